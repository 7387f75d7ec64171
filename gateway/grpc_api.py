"""The public gRPC service, pagedserve.v1.TextGenerationService: the HTTP API's capability on the same core."""

from __future__ import annotations

import grpc
import structlog

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

from .auth import ApiKeys, combined_salt
from .generation import ChoiceDelta, GenerationCore, Prompt, UsageInfo, new_request_id
from .protocol import check_sampling_params

log = get_logger(__name__)

SERVICE_NAME = text_generation_pb2.DESCRIPTOR.services_by_name["TextGenerationService"].full_name
_FINISH = {
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "abort": common_pb2.FINISH_REASON_ABORT,
}


class TextGenerationServicer(text_generation_pb2_grpc.TextGenerationServiceServicer):
    def __init__(self, core: GenerationCore, api_keys: ApiKeys | None = None):
        self.core = core
        self.tokenizer = core.tokenizer
        self.api_keys = api_keys or ApiKeys(())
        # Set by the server on SIGTERM: new generations are refused (UNAVAILABLE) while it drains.
        self.draining = False

    # NOTE: only Generate needs a key, as on HTTP only the engine-backed /v1 paths do: Tokenize,
    # Detokenize and ListModels touch neither the engine nor the prefix cache.
    def _tenant(self, context: grpc.aio.ServicerContext) -> str:
        """The caller's tenant salt from its "authorization: Bearer <key>" metadata."""
        metadata = dict(context.invocation_metadata() or ())
        tenant = self.api_keys.tenant_from_header(metadata.get("authorization"))
        if tenant is None:
            raise AuthenticationError("Incorrect API key provided.", code="invalid_api_key")
        return tenant

    async def Generate(self, request: text_generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        request_id = request.request_id or new_request_id("gen")
        structlog.contextvars.bind_contextvars(request_id=request_id)
        try:
            tenant = self._tenant(context)
            if self.draining:
                raise UnavailableError("the server is shutting down; retry later")
            self.core.check_model(request.model)
            sp = common_pb2.SamplingParams()
            sp.CopyFrom(request.sampling)
            check_sampling_params(sp)
            prompt = self._prompt(request)
            gen = self.core.build(
                [prompt],
                sp,
                request_id=request_id,
                param="messages" if request.messages else "prompt",
                cache_salt=combined_salt(tenant, request.cache_salt),
                priority=request.priority,
                trace_context=extract_context(context.invocation_metadata()),
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
                if first:
                    pending.prompt_token_ids.extend(prompt.token_ids)
                    first = False
            if pending is not None:
                yield pending
        except PagedServeError as error:
            await abort_with(context, error)

    def _prompt(self, request: text_generation_pb2.GenerateRequest) -> Prompt:
        given = [bool(request.prompt), bool(request.messages), bool(request.prompt_token_ids)]
        if sum(given) != 1:
            raise InvalidRequestError("set exactly one of prompt, messages and prompt_token_ids", "prompt")
        if request.prompt:
            return Prompt(self.tokenizer.encode(request.prompt), request.prompt)
        if request.messages:
            text = self.tokenizer.render_chat(
                [{"role": m.role, "content": m.content} for m in request.messages]
            )
            return Prompt(self.tokenizer.encode(text, add_special_tokens=False), text)
        return Prompt(list(request.prompt_token_ids))

    @staticmethod
    def _response(request_id: str, item: ChoiceDelta) -> text_generation_pb2.GenerateResponse:
        response = text_generation_pb2.GenerateResponse(
            request_id=request_id,
            index=item.index,
            text=item.text,
            token_ids=item.token_ids,
            logprobs=item.logprobs,
            finish_reason=_FINISH.get(item.finish_reason or "", common_pb2.FINISH_REASON_UNSPECIFIED),
            stop_reason="" if item.stop_reason is None else str(item.stop_reason),
        )
        if item.prompt_logprobs:
            response.prompt_logprobs.extend(item.prompt_logprobs)
        return response

    async def Tokenize(self, request: text_generation_pb2.TokenizeRequest, context: grpc.aio.ServicerContext):
        try:
            self.core.check_model(request.model)
            if bool(request.text) and bool(request.messages):
                raise InvalidRequestError("set one of text and messages", "text")
            if request.messages:
                messages = [{"role": m.role, "content": m.content} for m in request.messages]
                ids = self.tokenizer.encode_chat(messages)
            else:
                add = request.add_special_tokens if request.HasField("add_special_tokens") else True
                ids = self.tokenizer.encode(request.text, add_special_tokens=add)
        except PagedServeError as error:
            await abort_with(context, error)
        return text_generation_pb2.TokenizeResponse(
            token_ids=ids, max_model_len=self.core.model.max_model_len
        )

    async def Detokenize(
        self, request: text_generation_pb2.DetokenizeRequest, context: grpc.aio.ServicerContext
    ):
        try:
            self.core.check_model(request.model)
            if request.token_ids:
                self.core.check_token_ids(list(request.token_ids), "token_ids")
        except PagedServeError as error:
            await abort_with(context, error)
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        return text_generation_pb2.DetokenizeResponse(text=self.tokenizer.decode(request.token_ids, skip))

    async def ListModels(
        self, request: text_generation_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ):
        model = self.core.model
        card = text_generation_pb2.ModelCard(
            id=model.name, max_model_len=model.max_model_len, owned_by="pagedserve", created=model.created
        )
        return text_generation_pb2.ListModelsResponse(models=[card])
