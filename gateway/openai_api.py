"""The OpenAI-compatible HTTP API (FastAPI): routes, SSE streaming, errors, auth, body limit, disconnects,
deadlines and the probes.

Every path but the probes (/health, /ready, /metrics, /version) needs the API key when one is set:
whatever touches the model (generation, tokenizing, listing it) does. A request is bounded in size
(--max-body-bytes, then the gateway's Limits, before any work proportional to it) and in time
(--request-timeout: 504, or an error event on a stream that has started); a client that goes away has
its engine request aborted, queued or running. The response bodies and stream chunks are shaped in
openai_format.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import structlog
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from pagedserve import __version__
from pagedserve.errors import (
    AuthenticationError,
    InvalidRequestError,
    NotFoundError,
    PagedServeError,
    PayloadTooLargeError,
    UnavailableError,
    openai_error_body,
    retry_after_seconds,
)
from pagedserve.logging import get_logger
from pagedserve.tracing import extract_context
from pagedserve.v1 import common_pb2
from pagedserve.validation import check_text

from . import metrics
from .auth import ApiKeys, combined_salt
from .config import GatewayConfig
from .engine_client import EngineClient
from .generation import (
    ChoiceDelta,
    GenerationCore,
    GenerationRequest,
    ModelInfo,
    Prompt,
    UsageInfo,
    new_request_id,
)
from .openai_format import ChatFormatter, CompletionFormatter
from .protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    parse_request,
)
from .reasoning import for_request
from .responses_api import (
    ResponseFormatter,
    ResponsesRequest,
    ResponseStore,
    responses_params,
    responses_sse,
    sampling_names,
)
from .tokenization import Tokenizer

log = get_logger(__name__)

# How long /ready waits for the scheduler's GetEngineInfo (its own RPC: never queued behind generation).
READY_TIMEOUT_S = 2.0
# Paths that answer without the API key: the probes and the version; none of them touches the model.
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics", "/version"})


class _ClientGone(Exception):
    """The HTTP client disconnected before the response was ready."""


@dataclass(slots=True)
class GatewayState:
    config: GatewayConfig
    tokenizer: Tokenizer
    model: ModelInfo
    core: GenerationCore
    engine: EngineClient | None
    # Set on SIGTERM: new API requests get 503 while the running ones finish.
    draining: bool = False
    # API requests being answered now (streams until their last byte).
    in_flight: int = 0


def create_app(
    config: GatewayConfig, tokenizer: Tokenizer, model: ModelInfo, engine: EngineClient | None
) -> FastAPI:
    """The HTTP app. Without an engine (engine=None) only the text endpoints work; the rest answer 503."""
    core = GenerationCore(engine, tokenizer, model, config.limits(), config.request_timeout)
    # Responses API objects kept for previous_response_id and GET (this replica's own).
    responses = ResponseStore(config.max_stored_responses)
    state = GatewayState(config, tokenizer, model, core, engine)
    app = FastAPI(title="pagedserve", version=__version__, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.gateway = state
    app.add_middleware(
        GuardMiddleware,
        api_keys=ApiKeys(config.all_api_keys()),
        max_body_bytes=config.max_body_bytes,
        state=state,
    )
    registry = None
    if engine is not None:
        registry = metrics.make_registry(
            metrics.EngineStatsCollector(engine.stats_sync, model.name, config.vllm_metric_aliases)
        )

    @app.exception_handler(PagedServeError)
    async def _project_error(_request: Request, error: PagedServeError) -> JSONResponse:
        return JSONResponse(
            openai_error_body(error), status_code=int(error.http_status), headers=_headers(error)
        )

    @app.exception_handler(_ClientGone)
    async def _client_gone(_request: Request, _error: _ClientGone) -> Response:
        return Response(status_code=499)  # nobody reads it; nginx's "client closed request"

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, error: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return JSONResponse(openai_error_body(PagedServeError(f"internal error: {error}")), status_code=500)

    @app.get("/health")
    async def health() -> Response:
        """Liveness: the gateway answers (503 only while it drains). What it serves through is /ready's."""
        return Response(status_code=503 if state.draining else 200)

    @app.get("/ready")
    async def ready() -> JSONResponse:
        """Readiness: the scheduler answers GetEngineInfo in time, a worker is healthy, and the engine is
        not stalled (pending work with no token advancing)."""
        reason = await _unready_reason(state)
        if reason is not None:
            return JSONResponse({"ready": False, "reason": reason}, status_code=503)
        return JSONResponse({"ready": True})

    @app.get("/metrics")
    async def metrics_route() -> Response:
        if registry is None:
            return Response(b"", media_type=CONTENT_TYPE_LATEST)
        # NOTE: the collector calls EngineService.GetStats synchronously; a thread keeps the event loop free.
        body = await asyncio.to_thread(metrics.render, registry)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/v1/models")
    async def list_models() -> dict:
        return {"object": "list", "data": [_model_card(model)]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> dict:
        state.core.check_model(model_id)
        return _model_card(model)

    async def parse(kind: type, request: Request, deadline: float | None) -> Any:
        body = await core.by_deadline(deadline, request.body())  # a slow upload counts too
        return parse_request(kind, body, core.limits, model.max_model_len)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        deadline = core.deadline()
        req = await parse(TokenizeRequest, request, deadline)
        core.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise InvalidRequestError("set exactly one of prompt and messages", "prompt")
        if req.messages is not None:
            messages = [{"role": m.role, "content": m.text()} for m in req.messages]
            ids = (await core.encode_chat(messages, deadline, req.add_generation_prompt)).token_ids
        else:
            ids = await core.encode(req.prompt or "", deadline, add_special_tokens=req.add_special_tokens)
        return {"count": len(ids), "max_model_len": model.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        deadline = core.deadline()
        req = await parse(DetokenizeRequest, request, deadline)
        core.check_model(req.model)
        core.check_token_ids(req.tokens, "tokens")
        return {"prompt": await core.decode(req.tokens, deadline)}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        deadline = core.deadline()
        req: CompletionRequest = await parse(CompletionRequest, request, deadline)
        core.check_model(req.model)
        sp = req.sampling_params()
        core.check_sampling(sp, req.sampling_names())
        request_id = _request_id(state, request, req, "cmpl")
        prompts = [
            Prompt(await core.encode(p, deadline), p) if isinstance(p, str) else Prompt(list(p))
            for p in req.prompts()
        ]
        gen = _build(state, request, request_id, prompts, sp, req, param="prompt", deadline=deadline)
        out = CompletionFormatter(tokenizer, model.name, req, gen)
        if req.stream:
            return await _sse_response(request, core.generate(gen), out.chunks)
        return JSONResponse(await _until_disconnect(request, out.collect(core.generate(gen))))

    async def chat_generation(
        request: Request,
        req: ChatCompletionRequest,
        deadline: float | None,
        names: dict[str, str],
        prefix: str,
    ) -> tuple[GenerationRequest, str | None, str | None]:
        """A chat request checked, rendered and tokenized, and the parsers of its tool calls and its
        reasoning (None: none)."""
        sp = req.sampling_params()
        tool_mode, tools = req.apply_tools(sp, config.tool_call_parser)
        core.check_sampling(sp, names)
        request_id = _request_id(state, request, req, prefix)
        prompt = await core.encode_chat(req.template_messages(), deadline, req.add_generation_prompt, tools)
        max_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        gen = _build(
            state,
            request,
            request_id,
            [prompt],
            sp,
            req,
            param="messages",
            max_tokens_param=names.get("max_tokens", max_param),
            deadline=deadline,
        )
        tool_parser = None if tool_mode == "none" else config.tool_call_parser
        return gen, tool_parser, for_request(config.reasoning_parser, sp.HasField("structured_output"))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        deadline = core.deadline()
        req: ChatCompletionRequest = await parse(ChatCompletionRequest, request, deadline)
        core.check_model(req.model)
        gen, tool_parser, reasoning_parser = await chat_generation(
            request, req, deadline, req.sampling_names(), "chatcmpl"
        )
        out = ChatFormatter(
            tokenizer, model.name, req, gen, tool_parser=tool_parser, reasoning_parser=reasoning_parser
        )
        if req.stream:
            return await _sse_response(request, core.generate(gen), out.chunks)
        return JSONResponse(await _until_disconnect(request, out.collect(core.generate(gen))))

    @app.post("/v1/responses")
    async def create_response(request: Request) -> Response:
        deadline = core.deadline()
        tenant = request.scope.get(TENANT_SCOPE_KEY, "")
        with responses_params():
            req: ResponsesRequest = await parse(ResponsesRequest, request, deadline)
            core.check_model(req.model)
            history: list[dict] = []
            if req.previous_response_id is not None:
                history = responses.get(req.previous_response_id, tenant, "previous_response_id").messages
            chat, conversation = req.to_chat(history)
            gen, tool_parser, reasoning_parser = await chat_generation(
                request, chat, deadline, sampling_names(chat), "resp_"
            )
        out = ResponseFormatter(
            model.name, req, gen, tool_parser=tool_parser, reasoning_parser=reasoning_parser
        )

        def keep() -> None:
            if req.store and out.status in ("completed", "incomplete"):
                responses.put(out.response(), [*conversation, out.assistant_message()], tenant)

        if req.stream:

            async def events(items: AsyncIterator[ChoiceDelta | UsageInfo]) -> AsyncIterator[dict]:
                async for event in out.events(items):
                    if event["type"] in ("response.completed", "response.incomplete"):
                        keep()
                    yield event

            return await _sse_response(
                request, core.generate(gen), events, encode=responses_sse, error=out.failed_event, done=None
            )
        body = await _until_disconnect(request, out.collect(core.generate(gen)))
        keep()
        return JSONResponse(body)

    @app.get("/v1/responses/{response_id}")
    async def get_response(request: Request, response_id: str) -> dict:
        return responses.get(response_id, request.scope.get(TENANT_SCOPE_KEY, "")).response

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(request: Request, response_id: str) -> dict:
        if not responses.delete(response_id, request.scope.get(TENANT_SCOPE_KEY, "")):
            raise NotFoundError(f"Response with id '{response_id}' not found.")
        return {"id": response_id, "object": "response", "deleted": True}

    return app


async def _unready_reason(state: GatewayState) -> str | None:
    """Why the gateway cannot serve generation now, or None when it can."""
    if state.engine is None:
        return "no scheduler is connected"
    if state.draining:
        return "shutting down"
    try:
        info = await state.engine.info(timeout=READY_TIMEOUT_S)
    except PagedServeError as error:
        return f"the scheduler did not answer: {error.message}"
    if info.max_model_len:
        state.model.max_model_len = info.max_model_len
    if info.num_healthy_workers == 0:
        return "no healthy worker"
    if info.stalled:
        return f"the engine is stalled: no token advanced for {info.seconds_without_progress:.1f} s"
    return None


def _model_card(model: ModelInfo) -> dict:
    return {
        "id": model.name,
        "object": "model",
        "created": model.created,
        "owned_by": "pagedserve",
        "root": model.name,
        "parent": None,
        "max_model_len": model.max_model_len,
        "permission": [],
    }


def _request_id(state: GatewayState, request: Request, req: Any, prefix: str) -> str:
    """A new request's id (the response's and the engine's, see new_request_id), bound to its log lines
    with the client's own id (the x-request-id header, else vLLM's request_id field) and user."""
    header = request.headers.get("x-request-id")
    client_id = header or req.request_id
    if client_id:
        limit = state.core.limits.max_request_id_chars
        check_text(client_id, max_chars=limit, param="x-request-id" if header else "request_id")
    request_id = new_request_id(prefix, request.scope.get(TENANT_TAG_SCOPE_KEY, ""))
    structlog.contextvars.bind_contextvars(request_id=request_id, client_request_id=client_id)
    if req.user:
        structlog.contextvars.bind_contextvars(user=req.user)
    return request_id


def _build(
    state: GatewayState,
    request: Request,
    request_id: str,
    prompts: list[Prompt],
    sp: common_pb2.SamplingParams,
    req: Any,
    *,
    param: str,
    max_tokens_param: str = "max_tokens",
    deadline: float | None,
) -> GenerationRequest:
    return state.core.build(
        prompts,
        sp,
        request_id=request_id,
        engine_id=request_id,
        deadline=deadline,
        param=param,
        max_tokens_param=max_tokens_param,
        cache_salt=combined_salt(request.scope.get(TENANT_SCOPE_KEY, ""), req.cache_salt),
        priority=req.priority,
        # A caller's W3C `traceparent` header makes the request's spans part of its trace.
        trace_context=extract_context(request.headers.items()),
    )


# ---- streaming and disconnects ----


def _sse_event(data: Any) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def _until_disconnect(request: Request, work: Awaitable) -> Any:
    """Await work unless the client disconnects first; then cancel it (which aborts at the engine)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    log.info("client disconnected, request aborted")
    raise _ClientGone


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _sse_response(
    request: Request,
    items: AsyncIterator[ChoiceDelta | UsageInfo],
    chunks,
    *,
    encode: Callable[[Any], str] = _sse_event,
    error: Callable[[PagedServeError], Any] = openai_error_body,
    done: str | None = "data: [DONE]\n\n",
) -> Response:
    """The chunks (or events) of items as server-sent events: each through encode, a failure as error's
    event, then done (chat and completions end with [DONE]; the Responses API with its last event)."""
    # The first item is awaited before the response starts, so an engine that refuses the request
    # (overloaded, no worker) answers with a proper HTTP status instead of an error event.
    try:
        first = await _until_disconnect(request, items.__anext__())
    except _ClientGone:
        return Response(status_code=499)

    async def body() -> AsyncIterator[str]:
        async def chained() -> AsyncIterator[ChoiceDelta | UsageInfo]:
            yield first
            async for item in items:
                yield item

        try:
            async for chunk in chunks(chained()):
                yield encode(chunk)
        except PagedServeError as failure:
            yield encode(error(failure))
        if done is not None:
            yield done

    # NOTE: Starlette cancels this body when the client disconnects; the cancellation runs the
    # generators' finally blocks, which cancel the engine call and abort the request.
    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


# ---- auth, body size, draining (plain ASGI: runs before FastAPI parses anything) ----

# Where the middleware leaves the caller's tenant salt and its tag in the ASGI scope ("" without API keys).
TENANT_SCOPE_KEY = "pagedserve.tenant"
TENANT_TAG_SCOPE_KEY = "pagedserve.tenant_tag"


class GuardMiddleware:
    """Every path but OPEN_PATHS needs an accepted key and is refused (503) while draining; every body is
    bounded by max_body_bytes (413), with or without a Content-Length."""

    def __init__(self, app, api_keys: ApiKeys, max_body_bytes: int, state: GatewayState | None = None):
        self.app = app
        self.api_keys = api_keys
        self.max_body_bytes = max_body_bytes
        self.state = state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        api = scope["path"] not in OPEN_PATHS
        if api:
            tenant = self.api_keys.tenant_from_header(headers.get(b"authorization"))
            if tenant is None:
                error = AuthenticationError("Incorrect API key provided.", code="invalid_api_key")
                await _send_error(send, error)
                return
            scope[TENANT_SCOPE_KEY] = tenant
            scope[TENANT_TAG_SCOPE_KEY] = self.api_keys.tag(tenant)
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            await _send_error(send, self._too_large())
            return
        state = self.state
        if state is None or not api:
            await self.app(scope, self._counting(receive), send)
            return
        if state.draining:
            await _send_error(
                send, UnavailableError("the server is shutting down; retry later", code="shutting_down")
            )
            return
        state.in_flight += 1
        try:
            await self.app(scope, self._counting(receive), send)
        finally:
            state.in_flight -= 1

    def _too_large(self) -> PayloadTooLargeError:
        return PayloadTooLargeError(
            f"the request body exceeds {self.max_body_bytes} bytes", code="payload_too_large"
        )

    def _counting(self, receive):
        received = 0

        async def counted():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:  # a chunked body without Content-Length
                    raise self._too_large()
            return message

        return counted


def _headers(error: PagedServeError) -> dict[str, str]:
    retry_after = retry_after_seconds(error)
    return {"Retry-After": str(retry_after)} if retry_after is not None else {}


async def _send_error(send, error: PagedServeError) -> None:
    body = json.dumps(openai_error_body(error)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if isinstance(error, AuthenticationError):
        headers.append((b"www-authenticate", b"Bearer"))
    headers += [(k.lower().encode(), v.encode()) for k, v in _headers(error).items()]
    await send({"type": "http.response.start", "status": int(error.http_status), "headers": headers})
    await send({"type": "http.response.body", "body": body})
