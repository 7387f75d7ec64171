"""A chat choice's text as its parts: the reasoning first (gateway/reasoning.py), then, in what is left, the tool
calls (gateway/tool_calls.py), so that reasoning never reaches the content or a call. Whole or streamed, the
same text gives the same parts; the chat completions and the Responses API both shape theirs from these.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from . import reasoning, tool_calls
from .tool_calls import StreamingToolParser, ToolCall


@dataclass(slots=True)
class ParsedOutput:
    # The model's reasoning (None: none, or no reasoning parser).
    reasoning: str | None
    # The answer's text (None: nothing but reasoning and calls).
    content: str | None
    # The tool calls parsed from the answer.
    calls: list[ToolCall] = field(default_factory=list)


def parse_output(text: str, reasoning_parser: str | None, tool_parser: str | None) -> ParsedOutput:
    thought, content = None, text
    if reasoning_parser is not None:
        parts = reasoning.split(reasoning_parser, text)
        thought, content = parts.reasoning, parts.content
    calls: list[ToolCall] = []
    if tool_parser is not None and content is not None:
        content, calls = tool_calls.parse(tool_parser, content)
    return ParsedOutput(thought, content, calls)


class StreamingOutputParser:
    """One streamed choice: text deltas in, (reasoning, content) to send now out; the calls once it ends."""

    def __init__(self, reasoning_parser: str | None, tool_parser: str | None):
        self._reasoning = reasoning.StreamingReasoningParser(reasoning_parser) if reasoning_parser else None
        self._tools = StreamingToolParser(tool_parser) if tool_parser else None

    @property
    def thinking(self) -> bool:
        """Whether the text so far is reasoning with no answer after it yet."""
        return self._reasoning is not None and self._reasoning.thinking

    def add(self, delta: str) -> tuple[str, str]:
        thought, content = self._reasoning.add(delta) if self._reasoning else ("", delta)
        if self._tools is not None:
            content = self._tools.add(content)
        return thought, content

    def finish(self) -> tuple[str, str, list[ToolCall]]:
        """At the end of the choice: the reasoning and content still to send, and the calls."""
        thought, content = self._reasoning.finish() if self._reasoning else ("", "")
        calls: list[ToolCall] = []
        if self._tools is not None:
            content = self._tools.add(content)
            rest, calls = self._tools.finish()
            content += rest
        return thought, content, calls
