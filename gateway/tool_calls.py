"""Tool calling: the model's tool calls parsed out of its text, and the grammar that forces one.

`--tool-call-parser` names the format the model writes its calls in (vLLM's names):
- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call, after any text;
- `llama3_json`: the whole output is `{"name": ..., "parameters": {...}}` (several joined by `;`), optionally
  after `<|python_tag|>`.

A streamed choice and a whole one give the same calls: both parse the same text with `parse`. While
streaming, text goes out as content until the start of a call could have begun; from there the text is held
back and parsed when the choice ends, and its calls go out as one delta each (index, id, name and the whole
arguments), which is what the openai SDK accumulates.

`tool_choice` "required" and a named function are enforced with a grammar in the parser's format
(`forcing_grammar`), each call's arguments by its function's JSON schema, so the calls always parse.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from pagedserve.errors import InvalidRequestError
from pagedserve.v1 import common_pb2

PARSERS = ("hermes", "llama3_json")
# Tools in one request (each is rendered into the prompt, and a forced call's grammar holds them all).
MAX_TOOLS = 128

_HERMES_START = "<tool_call>"
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True, slots=True)
class ToolCall:
    # The function's name.
    name: str
    # Its arguments as JSON text.
    arguments: str
    # The call's id ("call_" and random hex), as OpenAI's.
    id: str = ""

    def to_dict(self, index: int | None = None) -> dict:
        call = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return call if index is None else {"index": index, **call}


def _call(obj: object, arguments_key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(arguments_key, obj.get("arguments", obj.get("parameters", {})))
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False), f"call_{uuid.uuid4().hex[:24]}")


def parse(parser: str, text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole output: no calls and the text as it is when it holds none."""
    if parser == "hermes":
        if _HERMES_START not in text:
            return text, []
        calls = []
        for body in _HERMES_CALL.findall(text):
            try:
                call = _call(json.loads(body), "arguments")
            except ValueError:
                call = None
            if call is None:
                return text, []  # a malformed call: the text stays content, as vLLM's parser does
            calls.append(call)
        if not calls:
            return text, []
        content = text[: text.index(_HERMES_START)].rstrip()
        return content or None, calls
    if parser == "llama3_json":
        body = text.strip().removeprefix(_PYTHON_TAG).strip()
        if not body.startswith("{"):
            return text, []
        calls = []
        decoder = json.JSONDecoder()
        position = 0
        while position < len(body):
            try:
                obj, end = decoder.raw_decode(body, position)
            except ValueError:
                return text, []
            call = _call(obj, "parameters")
            if call is None:
                return text, []
            calls.append(call)
            position = end
            rest = body[position:].lstrip()
            if rest.startswith(";"):
                rest = rest[1:].lstrip()
            position = len(body) - len(rest)
        return None, calls
    raise ValueError(f"unknown tool call parser {parser!r}")


class StreamingToolParser:
    """One streamed choice: its text deltas in, the content to send now out; the calls once it ends."""

    def __init__(self, parser: str):
        self.parser = parser
        self._text = ""
        # Characters of _text already sent as content.
        self._sent = 0
        # Whether a call may have begun: from then on nothing more goes out as content until the end.
        self._holding = False

    def add(self, delta: str) -> str:
        """The content to send for this delta (possibly "")."""
        self._text += delta
        if self._holding:
            return ""
        pending = self._text[self._sent :]
        if self.parser == "llama3_json":
            stripped = self._text.lstrip()
            if not stripped:
                return ""
            if stripped.startswith("{") or _PYTHON_TAG.startswith(stripped[: len(_PYTHON_TAG)]):
                self._holding = True
                return ""
            self._sent = len(self._text)
            return pending
        start = pending.find(_HERMES_START)
        if start >= 0:
            self._holding = True
            out = pending[:start]
        else:
            # Keep back a tail that may be the start of "<tool_call>".
            keep = next(
                (
                    k
                    for k in range(min(len(pending), len(_HERMES_START) - 1), 0, -1)
                    if _HERMES_START.startswith(pending[-k:])
                ),
                0,
            )
            out = pending[: len(pending) - keep]
        # Trailing whitespace waits too: before a call it is not content (parse drops it).
        out = out.rstrip()
        self._sent += len(out)
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """At the end of the choice: the content still to send, and the calls (none: all of it is content)."""
        _, calls = parse(self.parser, self._text)
        if not calls:
            return self._text[self._sent :], []
        before = self._text.find(_HERMES_START) if self.parser == "hermes" else 0
        return self._text[self._sent : max(before, self._sent)].rstrip(), calls


# ---- tool_choice "required" and named: a grammar in the parser's format ----


def _call_schema(function: dict, arguments_key: str) -> dict:
    parameters = function.get("parameters") or {"type": "object"}
    return {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, arguments_key: parameters},
        "required": ["name", arguments_key],
        "additionalProperties": False,
    }


def forcing_grammar(parser: str, functions: list[dict], parallel: bool) -> str:
    """A Lark grammar (llguidance's) whose every text is one call (or, with parallel, one or more) of one of
    these functions, in the parser's format."""
    key = "arguments" if parser == "hermes" else "parameters"
    # NOTE: compact JSON, as for response_format (see pagedserve/structured_outputs.py).
    schema = {
        "anyOf": [_call_schema(f, key) for f in functions],
        "x-guidance": {"whitespace_flexible": False},
    }
    body = "body: %json " + json.dumps(schema)
    if parser == "hermes":
        call = 'call: "<tool_call>\\n" body "\\n</tool_call>"'
        start = 'start: call ("\\n" call)*' if parallel else "start: call"
    else:
        call = "call: body"
        start = 'start: call (";" call)*' if parallel else "start: call"
    return "\n".join((start, call, body))


def check_tools(tools: list[dict], tool_choice: object) -> tuple[str, list[dict]]:
    """(mode, functions the calls may use) for a request's tools and tool_choice: mode "none", "auto" or
    "forced"; InvalidRequestError naming the parameter for a tool without a name, an unknown function or a
    tool_choice not understood."""
    functions = []
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or tool.get("type", "function") != "function":
            raise InvalidRequestError(
                'tools: each tool must be {"type": "function", "function": {...}}', "tools"
            )
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise InvalidRequestError("tools: every function needs a name", "tools")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise InvalidRequestError(
                f"tools: the parameters of {function['name']!r} must be a JSON schema object", "tools"
            )
        functions.append(function)
    if tool_choice is None:
        return ("auto" if functions else "none"), functions
    if tool_choice in ("none", "auto", "required"):
        if tool_choice != "none" and not functions:
            raise InvalidRequestError(f"tool_choice {tool_choice!r} needs tools", "tool_choice")
        return ("forced" if tool_choice == "required" else tool_choice), functions
    if isinstance(tool_choice, dict) and isinstance(tool_choice.get("function"), dict):
        name = tool_choice["function"].get("name")
        chosen = [f for f in functions if f["name"] == name]
        if not chosen:
            raise InvalidRequestError(
                f"tool_choice names {name!r}, which is not among the tools", "tool_choice"
            )
        return "forced", chosen
    raise InvalidRequestError(
        'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
        "tool_choice",
    )


def apply_tools(
    sp: common_pb2.SamplingParams, parser: str, tools: list[dict], tool_choice: object, parallel: bool
) -> tuple[str, list[dict] | None]:
    """(mode, tools for the chat template) of a request's tools and tool_choice (check_tools), for either API;
    a forced call ("required", or a named function) becomes sp's constraint, a grammar of the parser's format,
    so it cannot come with another one."""
    mode, functions = check_tools(tools, tool_choice)
    if mode == "forced":
        if sp.HasField("structured_output"):
            raise InvalidRequestError(
                "a required or named tool_choice cannot come with another structured output constraint",
                "tool_choice",
            )
        sp.structured_output.grammar = forcing_grammar(
            parser, functions, parallel and tool_choice == "required"
        )
    return mode, (tools if mode != "none" else None)
