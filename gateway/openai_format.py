"""OpenAI response shapes: a request's choice deltas as one response object or as stream chunks.

Both endpoints gather the same things per choice (text, logprobs, finish and stop reason) and differ
only in how a choice and its logprobs look, so `_Formatter` does the gathering and each endpoint's
formatter says how its pieces are shaped. Responses are plain dicts: cheaper to serialize per token
than pydantic models.
"""

from __future__ import annotations

import math
import time
from collections.abc import AsyncIterator
from typing import Any

from .generation import ChoiceDelta, GenerationRequest, UsageInfo
from .output_parser import StreamingOutputParser, parse_output
from .protocol import ChatCompletionRequest, CompletionRequest
from .tokenization import Tokenizer


def usage_dict(usage: UsageInfo) -> dict:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


# What a log-probability of -inf (or NaN) is sent as: JSON has no infinity, and clients' parsers refuse
# Python's `-Infinity`; vLLM sends the same floor.
LOGPROB_FLOOR = -9999.0


def finite_logprob(logprob: float) -> float:
    """A log-probability as JSON can carry it: -inf and NaN become LOGPROB_FLOOR (+inf, never a
    probability's log, becomes 0)."""
    if math.isfinite(logprob):
        return logprob
    return 0.0 if logprob > 0 else LOGPROB_FLOOR


def merge_logprobs(into: dict | None, more: dict) -> dict:
    """Append one piece of logprobs to another (both formats are dicts of parallel lists)."""
    if into is None:
        return more
    for key in into:
        into[key].extend(more[key])
    return into


class _Formatter:
    """What both endpoints share: per-choice aggregation for a whole response, and the chunk loop."""

    object_name: str  # the response's "object"
    chunk_object_name: str  # each stream chunk's "object"

    def __init__(self, tokenizer: Tokenizer, model_name: str, req: Any, gen: GenerationRequest):
        self.tok = tokenizer
        self.req = req
        self.gen = gen
        self.id = gen.request_id
        self.created = int(time.time())
        self.model = model_name
        self.n = gen.n
        self.num_choices = len(gen.prompts) * self.n

    # --- what each endpoint shapes ---
    def choice_part(self, delta: ChoiceDelta) -> tuple[str, dict | None]:
        """The delta's text and logprobs in this endpoint's format (None: logprobs not asked for)."""
        raise NotImplementedError

    def _final_choice(self, index: int, text: str, logprobs: dict | None) -> dict:
        """A whole response's choice, without its finish and stop reasons."""
        raise NotImplementedError

    def _chunk_choice(self, delta: ChoiceDelta, text: str, logprobs: dict | None) -> dict:
        raise NotImplementedError

    def _opening_chunks(self, extra: dict) -> list[dict]:
        return []

    # --- shared ---
    async def collect(self, items: AsyncIterator[ChoiceDelta | UsageInfo]) -> dict:
        texts: list[list[str]] = [[] for _ in range(self.num_choices)]
        lps: list[dict | None] = [None] * self.num_choices
        finish: list[str | None] = [None] * self.num_choices
        stop_reason: list[Any] = [None] * self.num_choices
        usage = UsageInfo()
        async for item in items:
            if isinstance(item, UsageInfo):
                usage = item
                continue
            text, lp = self.choice_part(item)
            texts[item.index].append(text)
            if lp is not None:
                lps[item.index] = merge_logprobs(lps[item.index], lp)
            if item.finish_reason is not None:
                finish[item.index], stop_reason[item.index] = item.finish_reason, item.stop_reason
        # NOTE: a choice may override its finish reason (a chat choice that called tools: "tool_calls").
        choices = [
            {
                "finish_reason": finish[i],
                "stop_reason": stop_reason[i],
                **self._final_choice(i, "".join(texts[i]), lps[i]),
            }
            for i in range(self.num_choices)
        ]
        return {
            "id": self.id,
            "object": self.object_name,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": usage_dict(usage),
        }

    async def chunks(self, items: AsyncIterator[ChoiceDelta | UsageInfo]) -> AsyncIterator[dict]:
        include_usage = self.req.include_usage
        # NOTE: with include_usage every chunk carries "usage": null and a last one carries the totals.
        extra = {"usage": None} if include_usage else {}
        for chunk in self._opening_chunks(extra):
            yield chunk
        async for item in items:
            if isinstance(item, UsageInfo):
                if include_usage:
                    yield self._chunk([], usage=usage_dict(item))
                continue
            text, lp = self.choice_part(item)
            if not text and lp is None and item.finish_reason is None:
                continue
            yield self._chunk([self._chunk_choice(item, text, lp)], **extra)

    def _chunk(self, choices: list, **extra: Any) -> dict:
        return {
            "id": self.id,
            "object": self.chunk_object_name,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }


class CompletionFormatter(_Formatter):
    """/v1/completions: text_completion objects and chunks, with the completions logprobs format."""

    object_name = "text_completion"
    chunk_object_name = "text_completion"
    req: CompletionRequest

    def __init__(self, tokenizer: Tokenizer, model_name: str, req: CompletionRequest, gen: GenerationRequest):
        super().__init__(tokenizer, model_name, req, gen)
        self.offsets = [0] * self.num_choices  # text offset of each choice's next token
        self.started = [False] * self.num_choices

    def choice_part(self, delta: ChoiceDelta) -> tuple[str, dict | None]:
        """A delta's text and completions-format logprobs; a choice's first one starts with the echo."""
        i = delta.index
        prefix, lp = "", None
        if not self.started[i]:
            self.started[i] = True
            if self.req.echo:
                prefix, lp = self._echo(i, delta)
        if self.req.logprobs is not None:
            lp = merge_logprobs(lp, self._logprobs(i, delta.token_ids, delta.logprobs))
        return prefix + delta.text, lp

    def _final_choice(self, index: int, text: str, logprobs: dict | None) -> dict:
        return {
            "index": index,
            "text": text,
            "logprobs": logprobs if self.req.logprobs is not None else None,
        }

    def _chunk_choice(self, delta: ChoiceDelta, text: str, logprobs: dict | None) -> dict:
        return {
            "index": delta.index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": delta.finish_reason,
            "stop_reason": delta.stop_reason,
        }

    def _echo(self, index: int, delta: ChoiceDelta) -> tuple[str, dict | None]:
        """The prompt part a choice starts with when echo is set: its text and logprobs."""
        prompt = self.gen.prompts[index // self.n]
        text = prompt.text if prompt.text is not None else self.tok.decode(prompt.token_ids)
        lp = None
        if self.req.logprobs is not None:
            entries = list(delta.prompt_logprobs or [])
            lp = self._logprobs(index, prompt.token_ids, entries, first_is_none=True)
        return text, lp

    def _logprobs(self, index: int, token_ids: list[int], entries: list, first_is_none: bool = False) -> dict:
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        # Prompt logprobs start at the second token: the first has no context.
        shift = 1 if first_is_none and len(entries) == len(token_ids) - 1 else 0
        for k, token_id in enumerate(token_ids):
            text = self.tok.token_text(token_id)
            entry = entries[k - shift] if 0 <= k - shift < len(entries) else None
            out["tokens"].append(text)
            out["text_offset"].append(self.offsets[index])
            self.offsets[index] += len(text)
            if entry is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            out["token_logprobs"].append(finite_logprob(entry.logprob))
            top = {
                self.tok.token_text(t): finite_logprob(lp)
                for t, lp in zip(entry.top_token_ids, entry.top_logprobs, strict=False)
            }
            top.setdefault(text, finite_logprob(entry.logprob))
            out["top_logprobs"].append(top)
        return out


class ChatFormatter(_Formatter):
    """/v1/chat/completions: chat.completion objects and chunks, with the chat logprobs format."""

    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"
    req: ChatCompletionRequest

    def __init__(
        self,
        tokenizer: Tokenizer,
        model_name: str,
        req: ChatCompletionRequest,
        gen: GenerationRequest,
        tool_parser: str | None = None,
        reasoning_parser: str | None = None,
    ):
        super().__init__(tokenizer, model_name, req, gen)
        # The format tool calls are parsed from (gateway/tool_calls.py); None: no calls are parsed.
        self.tool_parser = tool_parser
        # The format reasoning is split from (gateway/reasoning.py), before any call; None: no reasoning.
        self.reasoning_parser = reasoning_parser
        self._streaming = (
            [StreamingOutputParser(reasoning_parser, tool_parser) for _ in range(self.num_choices)]
            if tool_parser or reasoning_parser
            else None
        )

    def choice_part(self, delta: ChoiceDelta) -> tuple[str, dict | None]:
        return delta.text, self._logprobs(delta)

    def _final_choice(self, index: int, text: str, logprobs: dict | None) -> dict:
        choice: dict[str, Any] = {
            "index": index,
            "message": {"role": "assistant", "content": text},
            "logprobs": (logprobs or {"content": []}) if self.req.logprobs else None,
        }
        if self._streaming is not None:
            parsed = parse_output(text, self.reasoning_parser, self.tool_parser)
            message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
            if self.reasoning_parser is not None:
                message["reasoning_content"] = parsed.reasoning
            if parsed.calls:
                message["tool_calls"] = [call.to_dict() for call in parsed.calls]
                choice["finish_reason"] = "tool_calls"
            choice["message"] = message
        return choice

    def _chunk_choice(self, delta: ChoiceDelta, text: str, logprobs: dict | None) -> dict:
        thought, calls = "", []
        if self._streaming is not None:
            parser = self._streaming[delta.index]
            thought, text = parser.add(text)
            if delta.finish_reason is not None:
                more_thought, rest, calls = parser.finish()
                thought, text = thought + more_thought, text + rest
        message: dict[str, Any] = {"content": text} if text else {}
        if thought:
            message["reasoning_content"] = thought
        if calls:
            message["tool_calls"] = [call.to_dict(index=k) for k, call in enumerate(calls)]
        choice: dict[str, Any] = {
            "index": delta.index,
            "delta": message,
            "logprobs": logprobs,
            "finish_reason": "tool_calls" if calls else delta.finish_reason,
        }
        if delta.finish_reason is not None:
            choice["stop_reason"] = delta.stop_reason
        return choice

    def _opening_chunks(self, extra: dict) -> list[dict]:
        # The first delta of every choice carries the role.
        return [
            self._chunk(
                [
                    {
                        "index": i,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ],
                **extra,
            )
            for i in range(self.num_choices)
        ]

    def _logprobs(self, delta: ChoiceDelta) -> dict | None:
        if not self.req.logprobs:
            return None
        content = []
        for token_id, entry in zip(delta.token_ids, delta.logprobs, strict=False):
            content.append(
                {
                    "token": self.tok.token_text(token_id),
                    "logprob": finite_logprob(entry.logprob),
                    "bytes": list(self.tok.token_bytes(token_id)),
                    "top_logprobs": [
                        {
                            "token": self.tok.token_text(t),
                            "logprob": finite_logprob(lp),
                            "bytes": list(self.tok.token_bytes(t)),
                        }
                        for t, lp in zip(entry.top_token_ids, entry.top_logprobs, strict=False)
                    ][: self.req.top_logprobs or 0],
                }
            )
        return {"content": content}
