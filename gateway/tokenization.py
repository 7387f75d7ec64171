"""Text ↔ token ids: the tokenizer, the chat template, incremental detokenization and stop strings.

The scheduler and workers only see token ids; everything that touches text lives here.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

from pagedserve.errors import InvalidRequestError

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens kept as left context of the first output token: some tokenizers (SentencePiece) decode
# a token differently at the start of a text than after other text. vLLM uses the same number.
PROMPT_CONTEXT_TOKENS = 5


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte ↔ printable-character table that byte-level BPE vocabularies are written in."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


_BYTE_DECODER = {c: b for b, c in _bytes_to_unicode().items()}


class Tokenizer:
    """A Hugging Face tokenizer with the operations the gateway needs."""

    def __init__(self, hf_tokenizer: Any):
        self.hf = hf_tokenizer
        self.vocab_size: int = len(hf_tokenizer)
        self.special_ids: frozenset[int] = frozenset(hf_tokenizer.all_special_ids)
        self.bos_token_id: int | None = hf_tokenizer.bos_token_id
        self.has_chat_template = bool(getattr(hf_tokenizer, "chat_template", None))
        # Characters of the longest token in the vocabulary (byte-level pieces: one character a byte):
        # bounds how many tokens a text is at least, before it is tokenized.
        self.max_token_chars: int = max(map(len, hf_tokenizer.get_vocab()), default=1)
        self._token_text: dict[int, str] = {}
        self._token_bytes: dict[int, bytes] = {}

    @classmethod
    def from_model_dir(cls, model_dir: Path | str) -> Tokenizer:
        from pagedserve.model_files import load_tokenizer

        return cls(load_tokenizer(model_dir))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        try:
            return list(self.hf.encode(text, add_special_tokens=add_special_tokens))
        except TypeError as error:
            # NOTE: JSON may carry lone surrogates ("\ud800"), which are no Unicode text.
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                raise InvalidRequestError(
                    "the prompt is not valid Unicode (lone surrogate)", "prompt"
                ) from None
            raise error

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        # NOTE: no clean-up of tokenization spaces: it is not compositional, so incremental and full
        # decoding would disagree.
        return self.hf.decode(
            list(token_ids), skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def render_chat(
        self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None
    ) -> str:
        """The chat template applied to messages, and to the tools (OpenAI's tool objects) when given."""
        if not self.has_chat_template:
            raise InvalidRequestError("this model has no chat template; use /v1/completions", "messages")
        try:
            return self.hf.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        except Exception as error:  # the template is the model's Jinja code: its errors are the input's
            raise InvalidRequestError(f"could not render the chat template: {error}", "messages") from error

    def encode_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        # The rendered template already holds the special tokens (BOS and the role markers).
        return self.encode(self.render_chat(messages, add_generation_prompt), add_special_tokens=False)

    def token_text(self, token_id: int) -> str:
        """One token's text on its own, as logprobs show it."""
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.decode([token_id], skip_special_tokens=False)
        return text

    def token_bytes(self, token_id: int) -> bytes:
        """One token's exact bytes (a byte-level token can hold part of a UTF-8 character)."""
        raw = self._token_bytes.get(token_id)
        if raw is None:
            piece = self.hf.convert_ids_to_tokens(token_id)
            if token_id not in self.special_ids and piece and all(c in _BYTE_DECODER for c in piece):
                raw = bytes(_BYTE_DECODER[c] for c in piece)
            else:
                raw = self.token_text(token_id).encode()
            self._token_bytes[token_id] = raw
        return raw


class IncrementalDetokenizer:
    """Turns one sequence's token ids into text deltas as they arrive (vLLM's prefix/read offsets).

    `ids[prefix_offset:read_offset]` is the window whose text was already emitted; a new token's text is
    decode(ids[prefix_offset:]) minus that window's text. Text that ends in an incomplete UTF-8
    character (U+FFFD) is held until the character completes, so deltas never split a character, and
    the concatenated deltas plus `flush()` equal the full decode.
    """

    __slots__ = (
        "_ids",
        "_prefix_offset",
        "_prefix_text",
        "_prompt_text",
        "_read_offset",
        "skip_special_tokens",
        "tokenizer",
    )

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        context = [t for t in prompt_ids[-4 * PROMPT_CONTEXT_TOKENS :] if self._keep(t)]
        self._ids: list[int] = context[-PROMPT_CONTEXT_TOKENS:]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        # NOTE: a prompt can end inside a character that the first output token completes; that
        # character belongs to the output, so the read offset backs off over the incomplete tail.
        self._prompt_text: str | None = None  # set while the prompt's incomplete tail is in the window
        while self._read_offset > 0 and self._decode(0, self._read_offset).endswith(REPLACEMENT_CHAR):
            self._read_offset -= 1
        if self._read_offset < len(self._ids):
            self._prompt_text = self._decode(0)
        self._prefix_text = self._decode(0, self._read_offset)

    def _keep(self, token_id: int) -> bool:
        return not (self.skip_special_tokens and token_id in self.tokenizer.special_ids)

    def _decode(self, start: int, end: int | None = None) -> str:
        return self.tokenizer.decode(self._ids[start:end], self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """The new text this token completes (often "" inside a multi-byte character)."""
        if not self._keep(token_id):
            return ""
        self._ids.append(token_id)
        new_text = self._decode(self._prefix_offset)
        if len(new_text) <= len(self._prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""
        return self._advance(new_text)

    def flush(self) -> str:
        """Text still held back at the end of the sequence (e.g. an incomplete character)."""
        return self._advance(self._decode(self._prefix_offset))

    def _advance(self, new_text: str) -> str:
        delta = new_text[len(self._prefix_text) :]
        if self._prompt_text is not None:
            # The output did not complete the prompt's last character: that broken character is the
            # prompt's, not the output's.
            if new_text.startswith(self._prompt_text):
                delta = new_text[len(self._prompt_text) :]
            self._prompt_text = None
        # Slide the window: the tokens just read become the next token's left context.
        del self._ids[: self._read_offset]
        self._prefix_offset, self._read_offset = 0, len(self._ids)
        self._prefix_text = self._decode(0)
        return delta


class StopStringMatcher:
    """Finds stop strings in one sequence's text and holds back text that could start one.

    Text is released only once no stop string can begin in it, so streamed text never contains a stop
    string or a part of one. On a match the text is cut before the stop string (or after it, with
    include_stop_str_in_output) and the sequence is over.
    """

    __slots__ = ("_held", "_max_hold", "include_stop_str_in_output", "stop")

    def __init__(self, stop: Sequence[str] = (), include_stop_str_in_output: bool = False):
        self.stop = [s for s in stop if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        self._held = ""
        self._max_hold = max((len(s) for s in self.stop), default=1) - 1

    def add(self, text: str) -> tuple[str, str | None]:
        """(text that is safe to emit, the stop string that matched or None)."""
        if not self.stop:
            return text, None
        buffer = self._held + text
        # NOTE: the match that completes first wins (then the longest), as a stream can only know that
        # one; which is also what makes the result independent of how the text was split into deltas.
        match: tuple[int, int, str] | None = None
        for s in self.stop:
            i = buffer.find(s)
            if i >= 0 and (match is None or (i + len(s), i) < match[:2]):
                match = (i + len(s), i, s)
        if match is not None:
            _, i, s = match
            self._held = ""
            return buffer[: i + len(s)] if self.include_stop_str_in_output else buffer[:i], s
        hold = 0
        for k in range(min(len(buffer), self._max_hold), 0, -1):
            suffix = buffer[-k:]
            if any(s.startswith(suffix) for s in self.stop):
                hold = k
                break
        self._held = buffer[len(buffer) - hold :]
        return buffer[: len(buffer) - hold], None

    def flush(self) -> str:
        """Release the held-back text: the sequence ended without a stop string."""
        held, self._held = self._held, ""
        return held


class SequenceText:
    """The text of one generated sequence: incremental detokenization, then stop strings.

    One place for the rules the gateway and the offline LLM share: like vLLM, the text of the token
    that ended the sequence (EOS, a stop token id) is not shown unless include_stop_str_in_output;
    text that could begin a stop string is held back until it cannot, or until the sequence ends.
    """

    __slots__ = ("detok", "stop_token_ids", "stopper")

    def __init__(
        self, detok: IncrementalDetokenizer, stopper: StopStringMatcher, stop_token_ids: Collection[int]
    ):
        self.detok = detok
        self.stopper = stopper
        self.stop_token_ids = stop_token_ids  # tokens that end the sequence (EOS, stop token ids)

    def add(self, token_ids: Sequence[int], finish: str | None) -> tuple[str, int, str | None]:
        """Text released by new tokens: (text, how many of the tokens it used, matched stop string).

        finish: the engine's finish reason when the sequence ends with these tokens ("stop", "length",
        ...), else None; at the end, held-back text is released. Tokens after a matched stop string are
        not used: the sequence ends at the match.
        """
        hide_last = (
            finish == "stop"
            and bool(token_ids)
            and token_ids[-1] in self.stop_token_ids
            and not self.stopper.include_stop_str_in_output
        )
        pieces: list[str] = []
        used = 0
        for k, token_id in enumerate(token_ids):
            used = k + 1
            if hide_last and k == len(token_ids) - 1:
                break
            text, matched = self.stopper.add(self.detok.add(token_id))
            pieces.append(text)
            if matched is not None:
                return "".join(pieces), used, matched
        if finish is not None:
            text, matched = self.stopper.add(self.detok.flush())
            pieces.append(text)
            if matched is not None:
                return "".join(pieces), used, matched
            pieces.append(self.stopper.flush())
        return "".join(pieces), used, None
