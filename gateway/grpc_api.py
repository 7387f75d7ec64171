"""The public gRPC service, pagedserve.v1.TextGenerationService: the HTTP API's capability on the same core.

Every RPC needs the API key when one is set (each touches the model: generation, its tokenizer, its
name). Requests go through the same checks, in the same order, as the HTTP API's (GenerationCore), and
are bounded in time by --request-timeout or the caller's own deadline, whichever comes first.

Tools work as on HTTP (tool_calls.py): rendered through the chat template, a required or named call forced
by a grammar, and the calls parsed from each sequence's text once it ends, on its last message.
"""

from __future__ import annotations

import json

import grpc
import structlog

from pagedserve import finish_reasons
from pagedserve.errors import (
    AuthenticationError,
    InvalidRequestError,
    PagedServeError,
    UnavailableError,
    abort_with,
)
from pagedserve.logging import get_logger
from pagedserve.tracing import extract_context
from pagedserve.v1 import common_pb2, text_generation_pb2, text_generation_pb2_grpc
from pagedserve.validation import check_count, check_prompt_len, check_text

from .auth import ApiKeys, combined_salt
from .generation import ChoiceDelta, GenerationCore, Prompt, UsageInfo, new_request_id
from .output_parser import ParsedOutput, parse_output
from .reasoning import for_request
from .tool_calls import MAX_TOOLS, apply_tools

log = get_logger(__name__)

SERVICE_NAME = text_generation_pb2.DESCRIPTOR.services_by_name["TextGenerationService"].full_name


class TextGenerationServicer(text_generation_pb2_grpc.TextGenerationServiceServicer):
    def __init__(
        self,
        core: GenerationCore,
        api_keys: ApiKeys | None = None,
        tool_call_parser: str = "hermes",
        reasoning_parser: str | None = None,
    ):
        self.core = core
        # The format the model writes its tool calls in (--tool-call-parser).
        self.tool_call_parser = tool_call_parser
        # The format of a thinking model's reasoning (--reasoning-parser); None: none is split out.
        self.reasoning_parser = reasoning_parser
        self.tokenizer = core.tokenizer
        self.api_keys = api_keys or ApiKeys(())
        # Set by the server on SIGTERM: new generations are refused (UNAVAILABLE) while it drains.
        self.draining = False

    def _tenant(self, context: grpc.aio.ServicerContext) -> str:
        """The caller's tenant salt from its "authorization: Bearer <key>" metadata."""
        metadata = dict(context.invocation_metadata() or ())
        tenant = self.api_keys.tenant_from_header(metadata.get("authorization"))
        if tenant is None:
            raise AuthenticationError("Incorrect API key provided.", code="invalid_api_key")
        return tenant

    async def Generate(self, request: text_generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        try:
            tenant = self._tenant(context)
            limits = self.core.limits
            if request.request_id:
                check_text(request.request_id, max_chars=limits.max_request_id_chars, param="request_id")
            # The caller's request_id is echoed in the responses; the engine gets an id of its own.
            engine_id = new_request_id("gen", self.api_keys.tag(tenant))
            request_id = request.request_id or engine_id
            structlog.contextvars.bind_contextvars(request_id=engine_id, client_request_id=request.request_id)
            if self.draining:
                raise UnavailableError("the server is shutting down; retry later")
            deadline = self.core.deadline(context.time_remaining())
            self.core.check_model(request.model)
            check_text(request.cache_salt, max_chars=limits.max_cache_salt_chars, param="cache_salt")
            sp = common_pb2.SamplingParams()
            sp.CopyFrom(request.sampling)
            tool_mode, tools = self._apply_tools(request, sp)
            self.core.check_sampling(sp)
            prompt = await self._prompt(request, deadline, tools)
            # Each sequence's text so far, where its reasoning and calls are parsed from when it ends.
            constrained = sp.HasField("structured_output")
            reasoning_parser = for_request(self.reasoning_parser, constrained) if request.messages else None
            tool_parser = self.tool_call_parser if tool_mode != "none" else None
            texts: dict[int, list[str]] | None = {} if tool_parser or reasoning_parser else None
            gen = self.core.build(
                [prompt],
                sp,
                request_id=request_id,
                engine_id=engine_id,
                param="messages" if request.messages else "prompt",
                cache_salt=combined_salt(tenant, request.cache_salt),
                priority=request.priority,
                trace_context=extract_context(context.invocation_metadata()),
                deadline=deadline,
            )
            # One message is held back so the very last one can carry the usage.
            pending: text_generation_pb2.GenerateResponse | None = None
            first = True
            async for item in self.core.generate(gen):
                if isinstance(item, UsageInfo):
                    last = pending or text_generation_pb2.GenerateResponse(request_id=request_id)
                    last.usage.CopyFrom(
                        common_pb2.Usage(
                            prompt_tokens=item.prompt_tokens,
                            completion_tokens=item.completion_tokens,
                            cached_prompt_tokens=item.cached_tokens,
                        )
                    )
                    pending = None
                    yield last
                    continue
                if pending is not None:
                    yield pending
                pending = self._response(request_id, item)
                if texts is not None:
                    texts.setdefault(item.index, []).append(item.text)
                    if item.finish_reason is not None:
                        parsed = parse_output("".join(texts.pop(item.index)), reasoning_parser, tool_parser)
                        self._add_parsed(pending, parsed)
                if first:
                    pending.prompt_token_ids.extend(prompt.token_ids)
                    first = False
            if pending is not None:
                yield pending
        except PagedServeError as error:
            await abort_with(context, error)

    async def _prompt(
        self, request: text_generation_pb2.GenerateRequest, deadline: float | None, tools: list[dict] | None
    ) -> Prompt:
        given = [bool(request.prompt), bool(request.messages), bool(request.prompt_token_ids)]
        if sum(given) != 1:
            raise InvalidRequestError("set exactly one of prompt, messages and prompt_token_ids", "prompt")
        if request.prompt:
            return Prompt(await self.core.encode(request.prompt, deadline), request.prompt)
        if request.messages:
            return await self.core.encode_chat(self._messages(request.messages), deadline, tools=tools)
        check_prompt_len(len(request.prompt_token_ids), self.core.model.max_model_len, "prompt_token_ids")
        return Prompt(list(request.prompt_token_ids))

    def _messages(self, messages) -> list[dict]:
        """The chat template's messages: text content, and an assistant's calls with their arguments as
        objects (as the HTTP API gives them)."""
        check_count(len(messages), self.core.limits.max_messages, "messages", "messages")
        out = []
        for m in messages:
            message: dict = {"role": m.role, "content": m.content}
            if m.tool_call_id:
                message["tool_call_id"] = m.tool_call_id
            if m.tool_calls:
                calls = [
                    (c, _json_object(c.arguments_json, "messages", f"the arguments of {c.name!r}"))
                    for c in m.tool_calls
                ]
                message["tool_calls"] = [
                    {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": args}}
                    for c, args in calls
                ]
            out.append(message)
        return out

    def _apply_tools(
        self, request: text_generation_pb2.GenerateRequest, sp: common_pb2.SamplingParams
    ) -> tuple[str, list[dict] | None]:
        """(mode, tools for the chat template) of the request's tools and tool_choice, as the HTTP API's."""
        if not request.tools and not request.tool_choice:
            return "none", None
        if not request.messages:
            raise InvalidRequestError("tools need messages (a chat request)", "tools")
        check_count(len(request.tools), MAX_TOOLS, "tools", "tools")
        tools = []
        for tool in request.tools:
            function: dict = {"name": tool.name, "description": tool.description}
            if tool.parameters_json:
                function["parameters"] = _json_object(
                    tool.parameters_json, "tools", f"the parameters of {tool.name!r}"
                )
            tools.append({"type": "function", "function": function})
        choice = request.tool_choice or None
        if choice not in (None, "none", "auto", "required"):
            choice = {"type": "function", "function": {"name": choice}}
        return apply_tools(sp, self.tool_call_parser, tools, choice, request.parallel_tool_calls)

    @staticmethod
    def _add_parsed(last: text_generation_pb2.GenerateResponse, parsed: ParsedOutput) -> None:
        """A sequence's reasoning and calls on its last message, which ends with TOOL_CALLS when it called."""
        last.reasoning = parsed.reasoning or ""
        calls = parsed.calls
        if calls:
            last.tool_calls.extend(
                text_generation_pb2.ToolCall(id=c.id, name=c.name, arguments_json=c.arguments) for c in calls
            )
            last.finish_reason = common_pb2.FINISH_REASON_TOOL_CALLS

    @staticmethod
    def _response(request_id: str, item: ChoiceDelta) -> text_generation_pb2.GenerateResponse:
        response = text_generation_pb2.GenerateResponse(
            request_id=request_id,
            index=item.index,
            text=item.text,
            token_ids=item.token_ids,
            logprobs=item.logprobs,
            finish_reason=finish_reasons.code_of(item.finish_reason),
            stop_reason="" if item.stop_reason is None else str(item.stop_reason),
        )
        if item.prompt_logprobs:
            response.prompt_logprobs.extend(item.prompt_logprobs)
        return response

    async def Tokenize(self, request: text_generation_pb2.TokenizeRequest, context: grpc.aio.ServicerContext):
        try:
            self._tenant(context)
            deadline = self.core.deadline(context.time_remaining())
            self.core.check_model(request.model)
            if bool(request.text) and bool(request.messages):
                raise InvalidRequestError("set one of text and messages", "text")
            if request.messages:
                ids = (await self.core.encode_chat(self._messages(request.messages), deadline)).token_ids
            else:
                add = request.add_special_tokens if request.HasField("add_special_tokens") else True
                ids = await self.core.encode(request.text, deadline, add_special_tokens=add, param="text")
        except PagedServeError as error:
            await abort_with(context, error)
        return text_generation_pb2.TokenizeResponse(
            token_ids=ids, max_model_len=self.core.model.max_model_len
        )

    async def Detokenize(
        self, request: text_generation_pb2.DetokenizeRequest, context: grpc.aio.ServicerContext
    ):
        try:
            self._tenant(context)
            deadline = self.core.deadline(context.time_remaining())
            self.core.check_model(request.model)
            self.core.check_token_ids(request.token_ids, "token_ids")
            skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
            text = await self.core.decode(list(request.token_ids), deadline, skip)
        except PagedServeError as error:
            await abort_with(context, error)
        return text_generation_pb2.DetokenizeResponse(text=text)

    async def ListModels(
        self, request: text_generation_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ):
        try:
            self._tenant(context)
        except PagedServeError as error:
            await abort_with(context, error)
        model = self.core.model
        card = text_generation_pb2.ModelCard(
            id=model.name, max_model_len=model.max_model_len, owned_by="pagedserve", created=model.created
        )
        return text_generation_pb2.ListModelsResponse(models=[card])


def _json_object(text: str, param: str, what: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise InvalidRequestError(f"{param}: {what} must be a JSON object", param)
    return value
