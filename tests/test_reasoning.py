"""Reasoning parsers in the gateway: a thinking model's `<think>` reasoning split from its answer, whole and
streamed alike (every way of cutting the text into deltas), and before the tool-call parser, so that reasoning
never reaches the content or a call. The openai SDK against a live stack is in test_responses_api.py."""

from __future__ import annotations

import json

import pytest

from pagedserve.gateway.output_parser import StreamingOutputParser, parse_output
from pagedserve.gateway.reasoning import Split, StreamingReasoningParser, for_request, split

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TEXTS = [
    "<think>\nThe user asks about Paris.\n</think>\n\nParis is the capital.",
    "<think>I think <tool_call> is what I write.</think>" + CALL,
    "Thinking without an opening tag</think> The answer.",
    "<think>Cut off while thinking",
    "Just an answer, no thinking.",
    "  <think> a </think>",
    "<think></think>Answer",
    "<thin",
    "",
    "answer with a </thinking> look-alike",
    "<think>one</think>two</think>three",
]


def _cuts(text: str, pieces: int):
    """Every way of cutting text into `pieces` parts (two or three), empty parts included."""
    n = len(text)
    if pieces == 2:
        for a in range(n + 1):
            yield [text[:a], text[a:]]
    else:
        for a in range(n + 1):
            for b in range(a, n + 1):
                yield [text[:a], text[a:b], text[b:]]


def _streamed(parser: str, deltas: list[str]) -> Split:
    stream = StreamingReasoningParser(parser)
    thought, content = "", ""
    for delta in deltas:
        t, c = stream.add(delta)
        thought, content = thought + t, content + c
    t, c = stream.finish()
    return Split(thought + t, content + c)


def test_deepseek_r1_reasoning_runs_until_the_closing_tag():
    assert split("deepseek_r1", TEXTS[0]) == Split("The user asks about Paris.", "Paris is the capital.")
    assert split("deepseek_r1", TEXTS[2]) == Split("Thinking without an opening tag", "The answer.")
    assert split("deepseek_r1", TEXTS[3]) == Split("Cut off while thinking", None)
    # Without a closing tag an output is all reasoning: the template opened the block in the prompt.
    assert split("deepseek_r1", TEXTS[4]) == Split("Just an answer, no thinking.", None)
    assert split("deepseek_r1", TEXTS[10]) == Split("one", "two</think>three")


def test_qwen3_has_reasoning_only_when_the_output_opens_with_think():
    assert split("qwen3", TEXTS[0]) == Split("The user asks about Paris.", "Paris is the capital.")
    assert split("qwen3", TEXTS[2]) == Split(None, TEXTS[2])
    assert split("qwen3", TEXTS[3]) == Split("Cut off while thinking", None)
    assert split("qwen3", TEXTS[4]) == Split(None, TEXTS[4])
    assert split("qwen3", TEXTS[6]) == Split("", "Answer")


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
@pytest.mark.parametrize("text", TEXTS)
def test_a_stream_cut_anywhere_splits_as_the_whole_text_does(parser, text):
    whole = split(parser, text)
    expected = (whole.reasoning or "", whole.content or "")
    cuts = list(_cuts(text, 3 if len(text) <= 40 else 2))
    cuts.append(list(text))  # one character at a time
    for deltas in cuts:
        got = _streamed(parser, deltas)
        assert (got.reasoning, got.content) == expected, deltas


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
def test_the_stream_sends_reasoning_before_the_answer_is_complete(parser):
    stream = StreamingReasoningParser(parser)
    assert stream.add("<thi") == ("", "")  # may be the opening tag
    assert stream.add("nk>Let me see") == ("Let me see", "")
    assert stream.add(" more \n</th") == (" more", "")  # whitespace and a partial closing tag wait
    assert stream.add("ink>\n\nParis") == ("", "Paris")
    assert stream.finish() == ("", "")


def test_reasoning_runs_before_the_tool_parser_and_never_reaches_a_call():
    parsed = parse_output(TEXTS[1], "qwen3", "hermes")
    assert parsed.reasoning == "I think <tool_call> is what I write."
    assert parsed.content is None
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [("get_weather", {"city": "Paris"})]
    # Without the reasoning parser the tag inside the reasoning spoils the calls: all of it is content.
    assert parse_output(TEXTS[1], None, "hermes").calls == []


@pytest.mark.parametrize("text", [TEXTS[0], TEXTS[1], "<think>x</think>Before. " + CALL])
def test_reasoning_and_calls_streamed_anywhere_match_the_whole_parse(text):
    whole = parse_output(text, "qwen3", "hermes")
    expected = (whole.reasoning or "", whole.content or "", [(c.name, c.arguments) for c in whole.calls])
    for deltas in [*_cuts(text, 2), list(text)]:
        stream = StreamingOutputParser("qwen3", "hermes")
        thought, content = "", ""
        for delta in deltas:
            t, c = stream.add(delta)
            thought, content = thought + t, content + c
        t, c, calls = stream.finish()
        assert (thought + t, content + c, [(k.name, k.arguments) for k in calls]) == expected, deltas


def test_a_constrained_output_has_reasoning_only_where_it_writes_think():
    answer = '{"city": "Paris"}'
    assert split(for_request("deepseek_r1", constrained=False), answer) == Split(answer, None)
    assert split(for_request("deepseek_r1", constrained=True), answer) == Split(None, answer)
    assert split(for_request("deepseek_r1", constrained=True), "<think>x</think>" + answer) == Split(
        "x", answer
    )
    assert for_request(None, constrained=True) is None
