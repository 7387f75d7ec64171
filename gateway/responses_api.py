"""OpenAI's Responses API (`POST /v1/responses`): its request as a chat request, its output items and events.

A Responses request becomes the chat request it means (`to_chat`): `instructions` a system message, `input` the
messages (a string is one user message; `function_call` items an assistant's tool calls, `function_call_output`
items tool messages), the flat function tools the chat tools, `text.format` a `response_format`,
`max_output_tokens` the `max_completion_tokens`. From there it runs exactly as a chat completion does (chat
template, tools, structured outputs, sampling), and its text is parsed by the same reasoning and tool-call
parsers (gateway/output_parser.py). `ResponseFormatter` shapes the result as output items (a `reasoning` item,
a `message` with an `output_text` part, `function_call` items) and as the events OpenAI streams, each with
its `sequence_number`; a whole response is the last event's, so streamed and whole responses are the same.

`store` (the default) keeps the response and its conversation in a `ResponseStore` for `previous_response_id`
and `GET`/`DELETE /v1/responses/{id}`: bounded in count (--max-stored-responses) and in bytes, least recently
used out first, in this gateway's memory (each replica has its own; a client that chains responses must reach
the same replica, or send the whole conversation as input).
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError, field_validator

from pagedserve.errors import InvalidRequestError, NotFoundError, PagedServeError

from .generation import ChoiceDelta, GenerationRequest, UsageInfo
from .output_parser import StreamingOutputParser
from .protocol import ChatCompletionRequest, _Request, validation_error

# The stored responses' total size (their JSON), besides their count (--max-stored-responses).
MAX_STORED_BYTES = 256 * 1024 * 1024

# OpenAI's bounds of `metadata`: pairs, and characters of a key and of a value.
MAX_METADATA = (16, 64, 512)

# Request parameters of the chat request a Responses request becomes, by the names the client used.
_PARAM_NAMES = {
    "messages": "input",
    "response_format": "text",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
}


class ResponsesRequest(_Request):
    model: str | None = None
    input: str | list[Any]
    instructions: str | None = None
    # Flat function tools ({"type": "function", "name", "description", "parameters", "strict"}), and whether
    # the model must call: "none", "auto", "required" or {"type": "function", "name"}.
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    temperature: float | None = None
    top_p: float | None = None
    max_output_tokens: int | None = None
    # {"format": {"type": "text" | "json_object" | "json_schema", ...}}
    text: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    # Taken and echoed; reasoning models think as their template and the reasoning parser say.
    reasoning: dict[str, Any] | None = None
    truncation: str | None = None
    # vLLM's extra sampling and scheduling fields, as on chat completions.
    seed: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    stop: str | list[str] | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    priority: int = 0
    cache_salt: str | None = None
    request_id: str | None = None
    # vLLM's structured-output fields, as on chat completions (one constraint, text.format included).
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @field_validator("metadata")
    @classmethod
    def _bounded_metadata(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        pairs, key_chars, value_chars = MAX_METADATA
        if value is not None and (
            len(value) > pairs or any(len(k) > key_chars or len(v) > value_chars for k, v in value.items())
        ):
            raise ValueError(
                f"at most {pairs} pairs, keys of at most {key_chars} characters and values of at most "
                f"{value_chars}"
            )
        return value

    def text_format(self) -> dict[str, Any]:
        fmt = (self.text or {}).get("format") or {"type": "text"}
        if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
            raise InvalidRequestError(
                'text.format must be {"type": "text"}, {"type": "json_object"} or '
                '{"type": "json_schema", "name", "schema"}',
                "text",
            )
        if fmt["type"] == "json_schema":
            if not isinstance(fmt.get("name"), str) or not fmt["name"]:
                raise InvalidRequestError("text.format: json_schema needs a name", "text")
            if not isinstance(fmt.get("schema"), dict):
                raise InvalidRequestError("text.format: json_schema needs a schema object", "text")
        return fmt

    def to_chat(self, history: list[dict[str, Any]]) -> tuple[ChatCompletionRequest, list[dict[str, Any]]]:
        """The chat request this one means, after the stored conversation history (a previous response's),
        and the conversation it continues (history and input, without the instructions) for the store."""
        conversation = [*history, *input_messages(self.input)]
        messages = [{"role": "system", "content": self.instructions}] if self.instructions else []
        fmt = self.text_format()
        response_format: dict[str, Any] | None = None
        if fmt["type"] == "json_object":
            response_format = {"type": "json_object"}
        elif fmt["type"] == "json_schema":
            spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
            response_format = {"type": "json_schema", "json_schema": spec}
        fields = self.model_dump(
            include={
                "model", "temperature", "top_p", "user", "stream", "seed", "top_k", "min_p", "stop",
                "repetition_penalty", "presence_penalty", "frequency_penalty", "priority", "cache_salt",
                "request_id", "parallel_tool_calls", "structured_outputs", "guided_json", "guided_regex",
                "guided_choice", "guided_grammar",
            }
        )  # fmt: skip
        try:
            chat = ChatCompletionRequest.model_validate(
                {
                    **fields,
                    "messages": [*messages, *conversation],
                    "tools": chat_tools(self.tools) if self.tools is not None else None,
                    "tool_choice": chat_tool_choice(self.tool_choice),
                    "max_completion_tokens": self.max_output_tokens,
                    "response_format": response_format,
                }
            )
        except ValidationError as error:
            raise validation_error(error) from None
        return chat, conversation


def _text_of(content: Any, param: str) -> str | None:
    """A message's content (a string or a list of input_text / output_text parts) as text."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequestError(f"{param}: content must be a string or a list of parts", "input")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text", "refusal") or not isinstance(
            part.get("text", part.get("refusal")), str
        ):
            raise InvalidRequestError(
                f"{param}: content parts of type {kind!r} are not supported (only input_text and output_text)",
                "input",
            )
        texts.append(part.get("text", part.get("refusal")))
    return "\n".join(texts)


def input_messages(items: str | list[Any]) -> list[dict[str, Any]]:
    """`input` as chat messages: a string is one user message; consecutive function_call items are one
    assistant message's tool calls (joined to the assistant message just before them); a function_call_output
    is a tool message; reasoning items are left out (the template is given the answers only)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for k, item in enumerate(items):
        where = f"input[{k}]"
        if isinstance(item, str):
            messages.append({"role": "user", "content": item})
            continue
        if not isinstance(item, dict):
            raise InvalidRequestError(f"{where}: each input item must be an object", "input")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise InvalidRequestError(
                    f"{where}: role must be user, assistant, system or developer, got {role!r}", "input"
                )
            messages.append({"role": role, "content": _text_of(item.get("content"), where)})
        elif kind == "function_call":
            name, call_id, arguments = item.get("name"), item.get("call_id"), item.get("arguments", "{}")
            if not isinstance(name, str) or not name or not isinstance(call_id, str) or not call_id:
                raise InvalidRequestError(f"{where}: a function_call needs a name and a call_id", "input")
            if not isinstance(arguments, str):
                raise InvalidRequestError(f"{where}: a function_call's arguments must be JSON text", "input")
            try:
                json.loads(arguments or "{}")
            except ValueError:
                raise InvalidRequestError(
                    f"{where}: a function_call's arguments are not JSON", "input"
                ) from None
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str) or not call_id:
                raise InvalidRequestError(f"{where}: a function_call_output needs a call_id", "input")
            text = output if isinstance(output, str) else _text_of(output, where)
            messages.append({"role": "tool", "tool_call_id": call_id, "content": text or ""})
        elif kind == "reasoning":
            continue
        else:
            raise InvalidRequestError(
                f"{where}: input items of type {kind!r} are not supported "
                "(message, function_call, function_call_output, reasoning)",
                "input",
            )
    return messages


def chat_tools(tools: list[Any]) -> list[dict[str, Any]]:
    """The Responses API's flat function tools as chat tools; any other kind of tool is refused."""
    out = []
    for k, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise InvalidRequestError(
                f"tools[{k}]: tools of type {kind!r} are not supported (only function tools)", "tools"
            )
        function = {key: tool[key] for key in ("name", "description", "parameters") if key in tool}
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise InvalidRequestError(
                'tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...}',
                "tool_choice",
            )
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


@contextmanager
def responses_params() -> Iterator[None]:
    """Errors raised while building the chat request name the Responses API's parameters."""
    try:
        yield
    except PagedServeError as error:
        if error.param in _PARAM_NAMES:
            error.param = _PARAM_NAMES[error.param]
        raise


def sampling_names(chat: ChatCompletionRequest) -> dict[str, str]:
    return {key: _PARAM_NAMES.get(name, name) for key, name in chat.sampling_names().items()}


# ---- the store ----


@dataclass(slots=True)
class StoredResponse:
    # The response object as GET returns it.
    response: dict[str, Any]
    # Its conversation as chat messages: the input (and any earlier responses'), then its answer.
    messages: list[dict[str, Any]]
    # The API key's tenant that created it ("" without API keys): no other tenant sees it.
    tenant: str
    # Its size in bytes (JSON), counted against MAX_STORED_BYTES.
    size: int


class ResponseStore:
    """The last responses, least recently used out first, bounded in count and in bytes."""

    def __init__(self, max_responses: int, max_bytes: int = MAX_STORED_BYTES):
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self.num_bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response: dict[str, Any], messages: list[dict[str, Any]], tenant: str) -> None:
        size = len(json.dumps(response)) + len(json.dumps(messages))
        if self.max_responses == 0 or size > self.max_bytes:
            return
        self.delete(response["id"], tenant)
        self._entries[response["id"]] = StoredResponse(response, messages, tenant, size)
        self.num_bytes += size
        while len(self._entries) > self.max_responses or self.num_bytes > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.num_bytes -= evicted.size

    def get(self, response_id: str, tenant: str, param: str | None = None) -> StoredResponse:
        entry = self._entries.get(response_id)
        if entry is None or entry.tenant != tenant:
            what = "Previous response" if param == "previous_response_id" else "Response"
            raise NotFoundError(f"{what} with id '{response_id}' not found.", param=param)
        self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str, tenant: str) -> bool:
        entry = self._entries.get(response_id)
        if entry is None or entry.tenant != tenant:
            return False
        del self._entries[response_id]
        self.num_bytes -= entry.size
        return True


# ---- the output ----


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseFormatter:
    """One request's choice deltas as Responses API events (`events`), or as the Response object they end
    with (`collect`)."""

    def __init__(
        self,
        model_name: str,
        req: ResponsesRequest,
        gen: GenerationRequest,
        *,
        tool_parser: str | None,
        reasoning_parser: str | None,
    ):
        self.req = req
        self.model = model_name
        self.id = gen.request_id
        self.created = int(time.time())
        self._parser = StreamingOutputParser(reasoning_parser, tool_parser)
        self._sequence = 0
        self.output: list[dict[str, Any]] = []
        # The item being streamed now (a reasoning or a message item) and its text so far.
        self._open: dict[str, Any] | None = None
        self._open_text = ""
        self.status = "in_progress"
        self.incomplete_details: dict[str, Any] | None = None
        self.error: dict[str, Any] | None = None
        self.usage: dict[str, Any] | None = None
        # Output tokens that came while the model was reasoning.
        self.reasoning_tokens = 0
        # The answer's text and calls, as the conversation's assistant message for the store.
        self.content = ""
        self.calls: list[dict[str, Any]] = []

    def response(self) -> dict[str, Any]:
        req = self.req
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": self.status,
            "background": False,
            "error": self.error,
            "incomplete_details": self.incomplete_details,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "metadata": req.metadata or {},
            "model": self.model,
            "output": self.output,
            "parallel_tool_calls": req.parallel_tool_calls,
            "previous_response_id": req.previous_response_id,
            "reasoning": req.reasoning or {"effort": None, "summary": None},
            "store": req.store,
            "temperature": req.temperature,
            "text": {"format": req.text_format()},
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
            "tools": req.tools or [],
            "top_p": req.top_p,
            "truncation": req.truncation or "disabled",
            "usage": self.usage,
            "user": req.user,
        }

    def assistant_message(self) -> dict[str, Any]:
        """The response's answer as the chat message a later turn's history holds (reasoning left out)."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content or None}
        if self.calls:
            message["tool_calls"] = [
                {
                    "id": c["call_id"],
                    "type": "function",
                    "function": {"name": c["name"], "arguments": c["arguments"]},
                }
                for c in self.calls
            ]
        return message

    async def collect(self, items: AsyncIterator[ChoiceDelta | UsageInfo]) -> dict[str, Any]:
        async for _ in self.events(items):
            pass
        return self.response()

    def failed_event(self, error: PagedServeError) -> dict[str, Any]:
        """The last event of a stream that failed: response.failed with the error."""
        self.status = "failed"
        self.error = {"code": error.code or "server_error", "message": error.message}
        return self._event("response.failed", response=self.response())

    async def events(self, items: AsyncIterator[ChoiceDelta | UsageInfo]) -> AsyncIterator[dict[str, Any]]:
        yield self._event("response.created", response=self.response())
        yield self._event("response.in_progress", response=self.response())
        finish: str | None = None
        async for item in items:
            if isinstance(item, UsageInfo):
                self.usage = _usage(item, self.reasoning_tokens)
                continue
            thought, content = self._parser.add(item.text)
            if self._parser.thinking:
                self.reasoning_tokens += len(item.token_ids)
            for event in self._texts(thought, content):
                yield event
            if item.finish_reason is not None:
                finish = item.finish_reason
                thought, content, calls = self._parser.finish()
                for event in self._texts(thought, content):
                    yield event
                for event in self._close(finish, bool(calls)):
                    yield event
                for call in calls:
                    for event in self._function_call(call.id, call.name, call.arguments):
                        yield event
        if finish == "length":
            self.status, self.incomplete_details = "incomplete", {"reason": "max_output_tokens"}
            yield self._event("response.incomplete", response=self.response())
        elif finish in (None, "abort"):
            self.status = "failed"
            self.error = {
                "code": "server_error",
                "message": "the engine ended the request before it finished",
            }
            yield self._event("response.failed", response=self.response())
        else:
            self.status = "completed"
            yield self._event("response.completed", response=self.response())

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event

    def _texts(self, thought: str, content: str) -> Iterator[dict[str, Any]]:
        if thought:
            yield from self._text("reasoning", thought)
        if content:
            self.content += content
            yield from self._text("message", content)

    def _text(self, kind: str, delta: str) -> Iterator[dict[str, Any]]:
        """A text delta of a reasoning or message item, opening it first (closing the other kind)."""
        if self._open is not None and self._open["type"] != kind:
            yield from self._close_open("completed")
        if self._open is None:
            yield from self._open_item(kind)
        self._open_text += delta
        where = self._where()
        if kind == "reasoning":
            yield self._event("response.reasoning_text.delta", **where, content_index=0, delta=delta)
        else:
            yield self._event(
                "response.output_text.delta", **where, content_index=0, delta=delta, logprobs=[]
            )

    def _where(self) -> dict[str, Any]:
        assert self._open is not None
        return {"item_id": self._open["id"], "output_index": len(self.output)}

    def _open_item(self, kind: str) -> Iterator[dict[str, Any]]:
        if kind == "reasoning":
            item = {
                "id": _item_id("rs"),
                "type": "reasoning",
                "summary": [],
                "content": [],
                "status": "in_progress",
            }
            part = {"type": "reasoning_text", "text": ""}
        else:
            item = {
                "id": _item_id("msg"),
                "type": "message",
                "status": "in_progress",
                "role": "assistant",
                "content": [],
            }
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self._open, self._open_text = item, ""
        yield self._event("response.output_item.added", output_index=len(self.output), item=dict(item))
        yield self._event("response.content_part.added", **self._where(), content_index=0, part=part)

    def _close_open(self, status: str) -> Iterator[dict[str, Any]]:
        item, text, where = self._open, self._open_text, self._where()
        assert item is not None
        if item["type"] == "reasoning":
            part = {"type": "reasoning_text", "text": text}
            yield self._event("response.reasoning_text.done", **where, content_index=0, text=text)
        else:
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            yield self._event("response.output_text.done", **where, content_index=0, text=text, logprobs=[])
        yield self._event("response.content_part.done", **where, content_index=0, part=part)
        item = {**item, "content": [part], "status": status}
        self.output.append(item)
        self._open = None
        yield self._event("response.output_item.done", output_index=where["output_index"], item=item)

    def _close(self, finish: str, called: bool) -> Iterator[dict[str, Any]]:
        """The end of the text: the open item closed; a message (empty if need be) unless the model called."""
        status = "incomplete" if finish == "length" else "completed"
        has_message = any(item["type"] == "message" for item in self.output)
        if self._open is not None:
            has_message = has_message or self._open["type"] == "message"
            yield from self._close_open(status)
        if not has_message and not called:
            yield from self._open_item("message")
            yield from self._close_open(status)

    def _function_call(self, call_id: str, name: str, arguments: str) -> Iterator[dict[str, Any]]:
        item = {"id": _item_id("fc"), "type": "function_call", "status": "in_progress", "call_id": call_id,
                "name": name, "arguments": ""}  # fmt: skip
        index = len(self.output)
        where = {"item_id": item["id"], "output_index": index}
        yield self._event("response.output_item.added", output_index=index, item=dict(item))
        yield self._event("response.function_call_arguments.delta", **where, delta=arguments)
        yield self._event("response.function_call_arguments.done", **where, name=name, arguments=arguments)
        item = {**item, "arguments": arguments, "status": "completed"}
        self.output.append(item)
        self.calls.append(item)
        yield self._event("response.output_item.done", output_index=index, item=item)


def _usage(usage: UsageInfo, reasoning_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": usage.total_tokens,
    }


def responses_sse(event: dict[str, Any]) -> str:
    """One event as OpenAI sends it: its type as the SSE event name, the event as data."""
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False, separators=(',', ':'))}\n\n"
