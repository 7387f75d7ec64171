"""Reasoning parsers: a thinking model's reasoning split from its answer, before any tool call is parsed.

`--reasoning-parser` names the model's format (vLLM's names); both write the reasoning between `<think>` and
`</think>`, then the answer:
- `deepseek_r1`: the output is reasoning until `</think>` (the chat template may already have opened the
  `<think>` block in the prompt, so an opening tag in the output is optional); an output that never closes
  it is all reasoning (cut off while thinking).
- `qwen3`: only an output that opens with `<think>` has reasoning (Qwen3 with thinking switched off answers
  at once); it lasts until `</think>`, or to the end when that never comes.

The answer after `</think>` loses its leading whitespace, and the reasoning its surrounding whitespace.
Streamed and whole outputs split the same way: `StreamingReasoningParser` sends at each delta what
`split(text, final=False)` already knows for sure (a tag or whitespace that may still grow is held back),
and `split(text, final=True)` of the same text is an extension of every provisional split of its prefixes.
"""

from __future__ import annotations

from dataclasses import dataclass

PARSERS = ("deepseek_r1", "qwen3")

THINK_START = "<think>"
THINK_END = "</think>"


@dataclass(frozen=True, slots=True)
class Split:
    # The reasoning text (None: the output had none).
    reasoning: str | None
    # The answer after it (None: nothing yet, or the output was all reasoning).
    content: str | None


def for_request(parser: str | None, constrained: bool) -> str | None:
    """The parser a request's output is split with. A constrained output (a structured output, a forced tool
    call) is the grammar's from its first token, so a block the template opened in the prompt was left before
    it began: only an explicit `<think>` in the output opens reasoning there (qwen3's rule), else deepseek_r1
    would take a whole JSON answer for reasoning."""
    return "qwen3" if parser is not None and constrained else parser


def _partial_tag(text: str, tag: str) -> int:
    """How many characters at the end of text may be the start of tag."""
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


def split(parser: str, text: str, final: bool = True) -> Split:
    """The reasoning and the answer of an output. With final=False the text may still grow: what could yet
    change (a partial tag, whitespace that may turn out to be trailing) is left out of both."""
    if parser not in PARSERS:
        raise ValueError(f"unknown reasoning parser {parser!r}")
    body = text.lstrip()
    if body.startswith(THINK_START):
        body = body[len(THINK_START) :]
    elif not final and THINK_START.startswith(body):
        return Split(None, None)  # the opening tag may still be coming
    elif parser == "qwen3":
        return Split(None, text)
    end = body.find(THINK_END)
    if end < 0:
        reasoning = body if final else body[: len(body) - _partial_tag(body, THINK_END)].rstrip()
        return Split(reasoning.strip() if final else reasoning.lstrip(), None)
    reasoning = body[:end].strip()
    content = body[end + len(THINK_END) :].lstrip()
    return Split(reasoning, content or None)


class StreamingReasoningParser:
    """One streamed choice: its text deltas in, (reasoning, content) to send now out."""

    def __init__(self, parser: str):
        self.parser = parser
        self._text = ""
        self._sent_reasoning = 0
        self._sent_content = 0
        # Whether the text so far is reasoning with no answer after it yet.
        self.thinking = False

    def add(self, delta: str) -> tuple[str, str]:
        self._text += delta
        now = split(self.parser, self._text, final=False)
        self.thinking = now.reasoning is not None and now.content is None
        return self._emit(now)

    def finish(self) -> tuple[str, str]:
        """At the end of the choice: the reasoning and content still to send."""
        return self._emit(split(self.parser, self._text, final=True))

    def _emit(self, now: Split) -> tuple[str, str]:
        reasoning, content = now.reasoning or "", now.content or ""
        assert len(reasoning) >= self._sent_reasoning and len(content) >= self._sent_content
        out = reasoning[self._sent_reasoning :], content[self._sent_content :]
        self._sent_reasoning, self._sent_content = len(reasoning), len(content)
        return out
