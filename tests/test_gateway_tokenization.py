"""Incremental detokenization and stop strings, with the default model's tokenizer."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.gateway.tokenization import IncrementalDetokenizer, SequenceText, StopStringMatcher, Tokenizer

MULTIBYTE_TEXTS = [
    "héllo wörld, ça va? naïve café",
    "日本語のテキストと中文文本",
    "emoji: 😀🎉👍🏽 and a family 👨‍👩‍👧‍👦 and flags 🇫🇷🇯🇵",
    "mixed ascii ✓ math ∑∫√ and arrows → ← and ‘quotes’ “double”",
    "Ελληνικά, русский, العربية, עברית",
    "combining: e\u0301 a\u0308 and zero\u200bwidth",
]


def detokenize(tokenizer: Tokenizer, prompt: list[int], output: list[int], skip: bool = True) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip)
    return [detok.add(t) for t in output] + [detok.flush()]


def test_incremental_detokenization_equals_full_decode_for_random_token_sequences(tokenizer):
    rng = random.Random(1234)
    for _ in range(400):
        prompt = tokenizer.encode(rng.choice(MULTIBYTE_TEXTS))[: rng.randrange(0, 12)]
        while prompt and tokenizer.decode(prompt).endswith("\ufffd"):  # see the split-character tests
            prompt.pop()
        # Half the sequences draw from the whole vocabulary (bytes that form no valid UTF-8 included),
        # half from the low ids where the single-byte tokens and special tokens live.
        high = tokenizer.vocab_size if rng.random() < 0.5 else 600
        output = [rng.randrange(high) for _ in range(rng.randrange(1, 40))]
        for skip in (True, False):
            deltas = detokenize(tokenizer, prompt, output, skip)
            assert "".join(deltas) == tokenizer.decode(output, skip_special_tokens=skip)


@pytest.mark.parametrize("text", MULTIBYTE_TEXTS)
def test_incremental_detokenization_of_multibyte_text_never_splits_a_character(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    deltas = detokenize(tokenizer, tokenizer.encode("Say:"), ids)
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


def test_a_character_split_between_prompt_and_output_appears_in_the_output(tokenizer):
    ids = tokenizer.encode("a 😀 b", add_special_tokens=False)
    split = next(k for k in range(1, len(ids)) if tokenizer.decode(ids[:k]).endswith("\ufffd"))
    deltas = detokenize(tokenizer, ids[:split], ids[split:])
    assert "".join(deltas).endswith("😀 b")
    assert all("\ufffd" not in d for d in deltas)


def test_a_broken_character_at_the_end_of_the_prompt_is_not_shown_in_the_output(tokenizer):
    ids = tokenizer.encode("a 😀 b", add_special_tokens=False)
    split = next(k for k in range(1, len(ids)) if tokenizer.decode(ids[:k]).endswith("\ufffd"))
    output = tokenizer.encode(" next", add_special_tokens=False)
    assert "".join(detokenize(tokenizer, ids[:split], output)) == " next"


def test_special_tokens_are_skipped_unless_asked_for(tokenizer):
    ids = [*tokenizer.encode("Hi", add_special_tokens=False), 2]  # 2 = <|im_end|>
    assert "".join(detokenize(tokenizer, [], ids, skip=True)) == "Hi"
    assert "".join(detokenize(tokenizer, [], ids, skip=False)) == "Hi<|im_end|>"


def test_token_bytes_are_exact_for_tokens_inside_a_character(tokenizer):
    ids = tokenizer.encode("😀", add_special_tokens=False)
    assert len(ids) > 1
    assert b"".join(tokenizer.token_bytes(t) for t in ids) == "😀".encode()


def test_chat_template_ends_with_the_assistant_turn(tokenizer):
    text = tokenizer.render_chat([{"role": "user", "content": "What is the capital of France?"}])
    assert text.endswith("<|im_start|>assistant\n")
    assert "What is the capital of France?" in text


# ---- stop strings ----


def run_matcher(chunks: list[str], stop: list[str], include: bool = False) -> tuple[list[str], str | None]:
    matcher = StopStringMatcher(stop, include)
    emitted: list[str] = []
    for chunk in chunks:
        text, matched = matcher.add(chunk)
        emitted.append(text)
        if matched is not None:
            return emitted, matched
    emitted.append(matcher.flush())
    return emitted, None


def expected_cut(text: str, stop: list[str], include: bool) -> tuple[str, str | None]:
    # The match that completes first wins, then the longest one.
    hits = [(text.find(s) + len(s), text.find(s), s) for s in stop if s and s in text]
    if not hits:
        return text, None
    _, i, s = min(hits)
    return (text[: i + len(s)] if include else text[:i]), s


def test_stop_string_split_across_deltas_is_found_and_never_streamed():
    emitted, matched = run_matcher(["The capital is Pa", "r", "is. More"], ["Paris"])
    assert matched == "Paris"
    assert "".join(emitted) == "The capital is "
    assert emitted[0] == "The capital is "  # "Pa" held back from the first delta
    assert all(e == "" for e in emitted[1:])


def test_held_back_text_is_released_when_no_stop_string_follows():
    emitted, matched = run_matcher(["answer: Pa", "ri"], ["Paris"])
    assert matched is None
    assert emitted == ["answer: ", "", "Pari"]  # the last piece is the flush at finish


def test_include_stop_str_in_output_keeps_the_stop_string():
    emitted, matched = run_matcher(["one two ", "STOP three"], ["STOP"], include=True)
    assert matched == "STOP"
    assert "".join(emitted) == "one two STOP"


def test_the_stop_string_that_completes_first_wins():
    emitted, matched = run_matcher(["xx b a yy"], ["a", "b"])
    assert (matched, "".join(emitted)) == ("b", "xx ")
    emitted, matched = run_matcher(["xx", "abc"], ["xabc", "ab"])
    assert (matched, "".join(emitted)) == ("ab", "xx")


@settings(max_examples=400, deadline=None)
@given(
    text=st.text(alphabet="abc😀日 \n", max_size=40),
    stop=st.lists(st.text(alphabet="abc😀日 \n", min_size=1, max_size=4), min_size=1, max_size=3),
    cuts=st.lists(st.integers(0, 40), max_size=10),
    include=st.booleans(),
)
def test_stop_strings_never_leak_however_the_text_is_split(text, stop, cuts, include):
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    chunks = [text[a:b] for a, b in itertools.pairwise(bounds)]
    emitted, matched = run_matcher(chunks, stop, include)
    want, want_stop = expected_cut(text, stop, include)
    assert "".join(emitted) == want
    assert matched == want_stop
    if not include:
        # No streamed prefix ever holds (a part of) the stop string that eventually matched.
        assert all(len("".join(emitted[: k + 1])) <= len(want) for k in range(len(emitted)))


def test_stop_string_spanning_several_tokens_is_cut_from_detokenized_text(tokenizer):
    ids = tokenizer.encode("The capital of France is Paris. It is", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [])
    matcher = StopStringMatcher([" Paris."])
    streamed = []
    matched = None
    for token_id in ids:
        text, matched = matcher.add(detok.add(token_id))
        streamed.append(text)
        if matched:
            break
    assert matched == " Paris."
    assert "".join(streamed) == "The capital of France is"


def _sequence_text(tokenizer, stop=(), include=False, stop_ids=()):
    return SequenceText(
        IncrementalDetokenizer(tokenizer, tokenizer.encode("Q:", add_special_tokens=False)),
        StopStringMatcher(stop, include),
        frozenset(stop_ids),
    )


def test_sequence_text_hides_the_token_that_ended_the_sequence_but_counts_it(tokenizer):
    ids = tokenizer.encode(" Paris is nice", add_special_tokens=False)
    eos = ids[-1]  # stands in for an end-of-sequence token
    text, used, matched = _sequence_text(tokenizer, stop_ids={eos}).add(ids, "stop")
    assert (text, used, matched) == (tokenizer.decode(ids[:-1]), len(ids), None)
    shown, _, _ = _sequence_text(tokenizer, include=True, stop_ids={eos}).add(ids, "stop")
    assert shown == tokenizer.decode(ids)
    # A length finish on the same token shows it: only a stop token's text is hidden.
    assert _sequence_text(tokenizer, stop_ids={eos}).add(ids, "length")[0] == tokenizer.decode(ids)


def test_sequence_text_ends_at_a_stop_string_and_uses_no_later_token(tokenizer):
    ids = tokenizer.encode(" one two three four", add_special_tokens=False)
    seq = _sequence_text(tokenizer, stop=[" three"])
    text, used, matched = seq.add(ids, None)
    assert matched == " three" and text == " one two"
    assert used == len(tokenizer.encode(" one two three", add_special_tokens=False))


def test_sequence_text_holds_back_a_possible_stop_string_until_the_end(tokenizer):
    ids = tokenizer.encode(" one two", add_special_tokens=False)
    seq = _sequence_text(tokenizer, stop=[" two three"])
    held, used, matched = seq.add(ids, None)
    assert (held, used, matched) == (" one", len(ids), None)
    assert seq.add([], "length") == (" two", 0, None)
