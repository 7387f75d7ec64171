"""The OpenAI API's request schema (plus vLLM's extra sampling fields) and its mapping to SamplingParams.

Unknown fields are ignored, as vLLM and OpenAI do. Before pydantic looks at a body, parse_request bounds
its nesting and the size of every collection and identifier in it (pagedserve/validation.py, with the
gateway's Limits); types are then checked by pydantic; value ranges by the same validation.check_sampling
call the gRPC API makes (GenerationCore.check_sampling), so both APIs refuse the same requests with the
same messages. Responses are plain dicts built in openai_format.py (cheaper to serialize per token).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from pagedserve.errors import InvalidRequestError
from pagedserve.gateway.tool_calls import MAX_TOOLS, apply_tools
from pagedserve.structured_outputs import MAX_CHOICES, Constraint
from pagedserve.v1 import common_pb2
from pagedserve.validation import (
    DEFAULT_LIMITS,
    Limits,
    check_count,
    check_json_depth,
    check_prompt_len,
    check_text,
    reduce_seed,
)


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class StructuredOutputsField(_Request):
    """vLLM's `structured_outputs` object (one constraint)."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class _SamplingFields(_Request):
    """Fields both OpenAI endpoints share (vLLM's extensions included)."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM extensions: scheduling priority (lower first), prefix-cache partition, caller's request id.
    priority: int = 0
    cache_salt: str | None = None
    request_id: str | None = None
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs object and its older
    # guided_* fields; at most one constraint over all of them.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def structured_output(self) -> tuple[common_pb2.StructuredOutput | None, str]:
        """The request's constraint and the parameter the client gave it by (for errors)."""
        found: list[tuple[str, Constraint]] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            found.append(("response_format", Constraint(json_object=True)))
        elif rf is not None and rf.type == "json_schema":
            spec = rf.json_schema
            if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
                raise InvalidRequestError(
                    "response_format: json_schema needs an object with a name", "response_format"
                )
            schema = spec.get("schema")
            # NOTE: OpenAI makes the schema optional; without one any JSON object is taken.
            constraint = Constraint(json_object=True) if schema is None else Constraint(json=schema)
            found.append(("response_format", constraint))
        if (so := self.structured_outputs) is not None:
            constraint = Constraint(so.json_, so.regex, so.choice, so.grammar, so.json_object)
            if constraint.to_proto("structured_outputs") is not None:
                found.append(("structured_outputs", constraint))
        for param, constraint in (
            ("guided_json", Constraint(json=self.guided_json)),
            ("guided_regex", Constraint(regex=self.guided_regex)),
            ("guided_choice", Constraint(choice=self.guided_choice)),
            ("guided_grammar", Constraint(grammar=self.guided_grammar)),
        ):
            if constraint.to_proto(param) is not None:
                found.append((param, constraint))
        if not found:
            return None, "structured_output"
        if len(found) > 1:
            names = ", ".join(param for param, _ in found)
            raise InvalidRequestError(
                f"at most one structured output constraint may be given, got {names}", found[1][0]
            )
        param, constraint = found[0]
        return constraint.to_proto(param), param

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None) -> common_pb2.SamplingParams:
        for token_id in self.stop_token_ids or []:
            _checked_uint(token_id, "stop_token_ids")
        # Sent as int32 (the engine's priority, SamplingParams.top_k): out of range is the caller's error.
        _checked_int32(self.priority, "priority")
        if self.n < 1:
            raise InvalidRequestError(f"n must be at least 1, got {self.n}", "n")
        _checked_uint(self.n, "n")
        if self.top_k is not None and self.top_k < -1:
            raise InvalidRequestError(
                f"top_k must be -1 (disable), 0 (disable) or positive, got {self.top_k}", "top_k"
            )
        sp = common_pb2.SamplingParams(
            top_k=0 if self.top_k is None or self.top_k == -1 else _checked_int32(self.top_k, "top_k"),
            min_p=self.min_p or 0.0,
            stop=[self.stop] if isinstance(self.stop, str) else (self.stop or []),
            stop_token_ids=self.stop_token_ids or [],
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            n=self.n,
            ignore_eos=self.ignore_eos,
            min_tokens=_checked_uint(self.min_tokens, "min_tokens"),
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
        )
        if max_tokens is not None:
            sp.max_tokens = _checked_uint(max_tokens, "max_tokens")
        if self.temperature is not None:
            sp.temperature = self.temperature
        if self.top_p is not None:
            sp.top_p = self.top_p
        if self.seed is not None:
            sp.seed = reduce_seed(self.seed)
        if self.repetition_penalty is not None:
            sp.repetition_penalty = self.repetition_penalty
        if logprobs is not None:
            sp.logprobs = _checked_uint(logprobs, "logprobs")
        for key, bias in (self.logit_bias or {}).items():
            try:
                token_id = int(key)
            except ValueError:
                raise InvalidRequestError(f"logit_bias key {key!r} is not a token id", "logit_bias") from None
            sp.logit_bias[_checked_uint(token_id, "logit_bias")] = bias
        structured, _ = self.structured_output()
        if structured is not None:
            sp.structured_output.CopyFrom(structured)
        return sp

    def _names(self) -> dict[str, str]:
        """SamplingParams fields both APIs call by another name (for errors)."""
        return {"structured_output": self.structured_output()[1]}


def _checked_uint(value: int, param: str) -> int:
    if value < 0 or value >= 1 << 32:
        raise InvalidRequestError(f"{param} must be a non-negative integer, got {value}", param)
    return value


def _checked_int32(value: int, param: str) -> int:
    if not -(1 << 31) <= value < 1 << 31:
        raise InvalidRequestError(f"{param} must be a 32-bit integer, got {value}", param)
    return value


class CompletionRequest(_SamplingFields):
    prompt: Any
    # OpenAI's default for the legacy completions API (chat's default is the rest of the context).
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    # vLLM extension: log-probabilities of this many alternatives for each prompt token.
    prompt_logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt_shape(cls, value: Any) -> str | list[str] | list[int] | list[list[int]]:
        def is_ids(v: Any) -> bool:
            return isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)

        if isinstance(value, str):
            return value
        if isinstance(value, list) and value:
            if all(isinstance(v, str) for v in value) or is_ids(value):
                return value
            if all(is_ids(v) for v in value):
                return value
        if isinstance(value, list) and not value:
            raise ValueError("prompt must not be empty")
        raise ValueError(
            "prompt must be a string, a list of strings, a list of token ids or a list of token id lists"
        )

    def prompts(self) -> list[str | list[int]]:
        """The prompts one by one: each is text or token ids."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)

    def sampling_params(self) -> common_pb2.SamplingParams:
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidRequestError("best_of is not supported; use n", "best_of")
        if self.suffix:
            raise InvalidRequestError("suffix is not supported", "suffix")
        sp = self._sampling_params(self.max_tokens, self.logprobs)
        prompt_logprobs = self.prompt_logprobs
        if prompt_logprobs is None and self.echo and self.logprobs is not None:
            prompt_logprobs = self.logprobs  # echo with logprobs shows the prompt's logprobs too
        if prompt_logprobs is not None:
            sp.prompt_logprobs = _checked_uint(prompt_logprobs, "prompt_logprobs")
        return sp

    def sampling_names(self) -> dict[str, str]:
        """SamplingParams fields this API calls by another name (for errors)."""
        return self._names()


class ContentPart(_Request):
    type: str
    text: str | None = None


class ChatMessage(_Request):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    # An assistant's calls ({"id", "type": "function", "function": {"name", "arguments"}}), and the call a
    # tool message answers.
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    def template_message(self) -> dict[str, Any]:
        """The message as chat templates take it: text content, and a call's arguments as an object."""
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            message["tool_calls"] = [_template_call(call) for call in self.tool_calls]
        return message

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise InvalidRequestError(
                    f"content parts of type {part.type!r} are not supported", "messages"
                )
            parts.append(part.text)
        return "\n".join(parts)


def _template_call(call: dict[str, Any]) -> dict[str, Any]:
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise InvalidRequestError("messages: a tool call needs a function with a name", "messages")
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments else {}
        except ValueError:
            raise InvalidRequestError(
                "messages: a tool call's arguments are not valid JSON", "messages"
            ) from None
    out = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    # Functions the model may call ({"type": "function", "function": {"name", "description", "parameters"}}),
    # and whether it must: "none", "auto", "required" or {"type": "function", "function": {"name"}}.
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    # vLLM extension: end the rendered prompt with the assistant's turn marker.
    add_generation_prompt: bool = True

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.template_message() for m in self.messages]

    def apply_tools(self, sp: common_pb2.SamplingParams, parser: str) -> tuple[str, list[dict] | None]:
        """(mode, tools for the chat template) of the request's tools and tool_choice (tool_calls.apply_tools)."""
        return apply_tools(sp, parser, self.tools or [], self.tool_choice, self.parallel_tool_calls)

    def sampling_params(self) -> common_pb2.SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs set to true", "top_logprobs")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self._sampling_params(max_tokens, (self.top_logprobs or 0) if self.logprobs else None)

    def sampling_names(self) -> dict[str, str]:
        names = {"logprobs": "top_logprobs", **self._names()}
        if self.tools and self.tool_choice not in (None, "none", "auto"):
            names["structured_output"] = "tool_choice"
        if self.max_completion_tokens is not None:
            names["max_tokens"] = "max_completion_tokens"
        return names


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


def parse_request(
    model: type[_Request], body: bytes, limits: Limits = DEFAULT_LIMITS, max_model_len: int | None = None
) -> Any:
    """Parse a JSON body into a request model; errors become InvalidRequestError naming the parameter.

    The body's nesting is bounded before it is parsed, and its collections and identifiers (check_sizes)
    before pydantic walks them; max_model_len, when given, bounds each list of token ids by its length."""
    check_json_depth(body, limits.max_json_depth)
    try:
        data = json.loads(body) if body else None
    except RecursionError:  # NOTE: check_json_depth stops these; kept for an encoding it does not read
        raise InvalidRequestError("the request body is nested too deeply") from None
    except ValueError as error:  # bad JSON, bad UTF-8, an integer of more digits than Python converts
        raise InvalidRequestError(f"the request body is not valid JSON: {error}") from None
    if not isinstance(data, dict):
        raise InvalidRequestError("the request body must be a JSON object")
    check_sizes(data, limits, max_model_len)
    try:
        return model.model_validate(data)
    except ValidationError as error:
        raise validation_error(error) from None


def check_sizes(data: dict[str, Any], limits: Limits, max_model_len: int | None = None) -> None:
    """Bound every collection and identifier of a parsed body by its length alone, before any element is
    looked at. Fields of the wrong type are left to pydantic, which reports them."""
    prompt = data.get("prompt")
    if isinstance(prompt, list):
        batch = bool(prompt) and isinstance(prompt[0], list | str)  # else one prompt of token ids
        check_count(len(prompt) if batch else 1, limits.max_prompts, "prompt", "prompts")
        if max_model_len is not None:
            for ids in prompt if batch else [prompt]:
                if isinstance(ids, list):
                    check_prompt_len(len(ids), max_model_len, "prompt")
    tokens = data.get("tokens")  # /detokenize
    if isinstance(tokens, list) and max_model_len is not None:
        check_count(len(tokens), max_model_len, "tokens", "token ids")
    messages = data.get("messages")
    if isinstance(messages, list):
        check_count(len(messages), limits.max_messages, "messages", "messages")
        parts = sum(
            len(m["content"]) for m in messages if isinstance(m, dict) and isinstance(m.get("content"), list)
        )
        check_count(parts, limits.max_messages, "messages", "content parts")
    items = data.get("input")  # the Responses API's input items
    if isinstance(items, list):
        check_count(len(items), limits.max_messages, "input", "input items")
    for field, limit, what in (
        ("guided_choice", MAX_CHOICES, "choices"),
        ("tools", MAX_TOOLS, "tools"),
        ("stop", limits.max_stop_strings, "strings"),
        ("stop_token_ids", limits.max_stop_token_ids, "ids"),
        ("logit_bias", limits.max_logit_bias, "entries"),
    ):
        if isinstance(value := data.get(field), list | dict):
            check_count(len(value), limit, field, what)
    for field, limit in (
        ("request_id", limits.max_request_id_chars),
        ("cache_salt", limits.max_cache_salt_chars),
        ("user", limits.max_user_chars),
    ):
        if isinstance(value := data.get(field), str):
            check_text(value, max_chars=limit, param=field)


def validation_error(error: ValidationError) -> InvalidRequestError:
    first = error.errors(include_url=False)[0]
    loc = [str(p) for p in first["loc"] if not str(p).startswith(("function-", "list[", "str", "int"))]
    param = loc[0] if loc else None
    where = ".".join(loc)
    message = first["msg"].removeprefix("Value error, ")
    if first["type"] == "missing":
        message = "field required"
    return InvalidRequestError(f"{where}: {message}" if where else message, param)
