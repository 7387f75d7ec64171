"""The OpenAI-compatible HTTP API (FastAPI): routes, SSE streaming, errors, auth, body limit, disconnects.

The response bodies and stream chunks are shaped in openai_format.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable
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
    PagedServeError,
    PayloadTooLargeError,
    UnavailableError,
    openai_error_body,
    retry_after_seconds,
)
from pagedserve.logging import get_logger
from pagedserve.tracing import extract_context
from pagedserve.v1 import common_pb2

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
from .tokenization import Tokenizer

log = get_logger(__name__)

HEALTH_TIMEOUT_S = 2.0


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
    core = GenerationCore(engine, tokenizer, model, max_n=config.max_n)
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
        if engine is None or state.draining:
            return Response(status_code=503)
        try:
            info = await engine.info(timeout=HEALTH_TIMEOUT_S)
        except PagedServeError:
            return Response(status_code=503)
        if info.max_model_len:
            model.max_model_len = info.max_model_len
        return Response(status_code=200 if info.num_healthy_workers > 0 else 503)

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

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        req = parse_request(TokenizeRequest, await request.body())
        state.core.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise InvalidRequestError("set exactly one of prompt and messages", "prompt")
        if req.messages is not None:
            messages = [{"role": m.role, "content": m.text()} for m in req.messages]
            ids = tokenizer.encode_chat(messages, req.add_generation_prompt)
        else:
            ids = tokenizer.encode(req.prompt or "", add_special_tokens=req.add_special_tokens)
        return {"count": len(ids), "max_model_len": model.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        req = parse_request(DetokenizeRequest, await request.body())
        state.core.check_model(req.model)
        state.core.check_token_ids(req.tokens or [0], "tokens")
        return {"prompt": tokenizer.decode(req.tokens)}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req: CompletionRequest = parse_request(CompletionRequest, await request.body())
        state.core.check_model(req.model)
        sp = req.sampling_params()
        prompts = [
            Prompt(tokenizer.encode(p), p) if isinstance(p, str) else Prompt(list(p)) for p in req.prompts()
        ]
        gen = _build(state, request, "cmpl", prompts, sp, req, param="prompt")
        out = CompletionFormatter(tokenizer, model.name, req, gen)
        if req.stream:
            return await _sse_response(request, state.core.generate(gen), out.chunks)
        return JSONResponse(await _until_disconnect(request, out.collect(state.core.generate(gen))))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req: ChatCompletionRequest = parse_request(ChatCompletionRequest, await request.body())
        state.core.check_model(req.model)
        sp = req.sampling_params()
        prompt_text = tokenizer.render_chat(req.template_messages(), req.add_generation_prompt)
        prompts = [Prompt(tokenizer.encode(prompt_text, add_special_tokens=False), prompt_text)]
        max_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        gen = _build(
            state, request, "chatcmpl", prompts, sp, req, param="messages", max_tokens_param=max_param
        )
        out = ChatFormatter(tokenizer, model.name, req, gen)
        if req.stream:
            return await _sse_response(request, state.core.generate(gen), out.chunks)
        return JSONResponse(await _until_disconnect(request, out.collect(state.core.generate(gen))))

    return app


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


def _build(
    state: GatewayState,
    request: Request,
    prefix: str,
    prompts: list[Prompt],
    sp: common_pb2.SamplingParams,
    req: Any,
    *,
    param: str,
    max_tokens_param: str = "max_tokens",
) -> GenerationRequest:
    request_id = new_request_id(prefix)
    structlog.contextvars.bind_contextvars(
        request_id=request_id, client_request_id=request.headers.get("x-request-id") or req.request_id
    )
    if req.user:
        structlog.contextvars.bind_contextvars(user=req.user)
    return state.core.build(
        prompts,
        sp,
        request_id=request_id,
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
) -> Response:
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
                yield _sse_event(chunk)
        except PagedServeError as error:
            yield _sse_event(openai_error_body(error))
        yield "data: [DONE]\n\n"

    # NOTE: Starlette cancels this body when the client disconnects; the cancellation runs the
    # generators' finally blocks, which cancel the engine call and abort the request.
    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


# ---- auth, body size, draining (plain ASGI: runs before FastAPI parses anything) ----

# Where the middleware leaves the caller's tenant salt in the ASGI scope ("" without API keys).
TENANT_SCOPE_KEY = "pagedserve.tenant"


class GuardMiddleware:
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
        api = scope["path"].startswith("/v1")
        if api:
            tenant = self.api_keys.tenant_from_header(headers.get(b"authorization"))
            if tenant is None:
                error = AuthenticationError("Incorrect API key provided.", code="invalid_api_key")
                await _send_error(send, error)
                return
            scope[TENANT_SCOPE_KEY] = tenant
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
