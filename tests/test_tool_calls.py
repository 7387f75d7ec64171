"""Tool calling in the gateway: the parsers of the model's call formats, streamed and whole alike; the
tools' checks; the grammar that forces a call (compiled by llguidance against the default model's tokenizer).
The openai SDK against a live stack is in test_structured_outputs.py."""

from __future__ import annotations

import json

import llguidance
import pytest

from pagedserve.errors import InvalidRequestError
from pagedserve.gateway.tool_calls import StreamingToolParser, check_tools, forcing_grammar, parse

WEATHER = {
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
TIME = {"name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}}}
TOOLS = [{"type": "function", "function": WEATHER}, {"type": "function", "function": TIME}]

HERMES = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'
)
LLAMA = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}'


def _streamed(parser: str, text: str, piece: int) -> tuple[str, list]:
    stream = StreamingToolParser(parser)
    content = "".join(stream.add(text[k : k + piece]) for k in range(0, len(text), piece))
    rest, calls = stream.finish()
    return content + rest, calls


def test_hermes_calls_are_parsed_after_their_content():
    content, calls = parse("hermes", HERMES)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {"tz": "CET"}),
    ]
    assert all(c.id.startswith("call_") for c in calls) and calls[0].id != calls[1].id


def test_llama3_json_calls_are_parsed_from_the_whole_output():
    content, calls = parse("llama3_json", LLAMA)
    assert content is None and [c.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].arguments) == {"city": "Paris"}


@pytest.mark.parametrize("parser", ["hermes", "llama3_json"])
def test_text_without_calls_stays_content(parser):
    for text in ("Paris is sunny.", "<tool_call>{not json}</tool_call>", '{"no": "name"}'):
        assert parse(parser, text) == (text, [])
        assert _streamed(parser, text, 3) == (text, [])


@pytest.mark.parametrize("parser, text", [("hermes", HERMES), ("llama3_json", LLAMA)])
@pytest.mark.parametrize("piece", [1, 2, 7, 1000])
def test_a_streamed_output_gives_the_same_calls_as_a_whole_one(parser, text, piece):
    content, calls = parse(parser, text)
    streamed_content, streamed_calls = _streamed(parser, text, piece)
    assert streamed_content == (content or "")
    assert [(c.name, c.arguments) for c in streamed_calls] == [(c.name, c.arguments) for c in calls]


def test_hermes_streams_content_until_a_call_may_begin():
    stream = StreamingToolParser("hermes")
    assert stream.add("Hello <tool") == "Hello"  # the space waits: before a call it is not content
    assert stream.add("_call>") == ""
    assert stream.add("anything") == ""


def test_tools_and_tool_choice_are_checked_naming_the_parameter():
    assert check_tools(TOOLS, None) == ("auto", [WEATHER, TIME])
    assert check_tools([], None) == ("none", [])
    assert check_tools(TOOLS, "none")[0] == "none"
    assert check_tools(TOOLS, "required") == ("forced", [WEATHER, TIME])
    assert check_tools(TOOLS, {"type": "function", "function": {"name": "get_time"}}) == ("forced", [TIME])
    for tools, choice, param in (
        ([{"type": "function", "function": {"description": "no name"}}], None, "tools"),
        ([{"type": "function"}], None, "tools"),
        (TOOLS, {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
        ([], "required", "tool_choice"),
        (TOOLS, "sometimes", "tool_choice"),
    ):
        with pytest.raises(InvalidRequestError) as error:
            check_tools(tools, choice)
        assert error.value.param == param


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return llguidance.LLTokenizer(
        (default_model_dir / "tokenizer.json").read_text(), n_vocab=49152, eos_token=[2]
    )


@pytest.mark.parametrize(
    "parser, text", [("hermes", HERMES.split("\n", 1)[1]), ("llama3_json", LLAMA.split("<|python_tag|>")[1])]
)
def test_the_forcing_grammar_takes_exactly_calls_of_the_given_functions(tokenizer, parser, text):
    compact = text.replace(": ", ":").replace(", ", ",").replace("; ", ";")
    grammar = llguidance.LLMatcher.grammar_from_lark(forcing_grammar(parser, [WEATHER, TIME], parallel=True))
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    assert matcher.consume_tokens(tokenizer.tokenize_str(compact)) and matcher.is_accepting()
    single = llguidance.LLMatcher.grammar_from_lark(forcing_grammar(parser, [TIME], parallel=False))
    matcher = llguidance.LLMatcher(tokenizer, single, log_level=0)
    assert not matcher.consume_tokens(tokenizer.tokenize_str(compact))  # get_weather is not allowed
