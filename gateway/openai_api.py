"""The OpenAI-compatible HTTP API (FastAPI): routes, SSE streaming, errors, auth, body limit, disconnects."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
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
from pagedserve.proto import common_pb2
from pagedserve.tracing import extract_context

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
        # NOTE: the collector calls Engine.Stats synchronously; a thread keeps the event loop free.
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
        out = _CompletionFormatter(state, req, gen)
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
        out = _ChatFormatter(state, req, gen)
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


# ---- response shapes ----


def _usage_dict(usage: UsageInfo) -> dict:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


class _CompletionFormatter:
    """/v1/completions: text_completion objects and chunks, with the completions logprobs format."""

    def __init__(self, state: GatewayState, req: CompletionRequest, gen: GenerationRequest):
        self.tok = state.tokenizer
        self.req = req
        self.gen = gen
        self.id = gen.request_id
        self.created = int(time.time())
        self.model = state.model.name
        self.n = gen.n
        self.num_choices = len(gen.prompts) * self.n
        self.offsets = [0] * self.num_choices  # text offset of each choice's next token
        self.started = [False] * self.num_choices

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
            out["token_logprobs"].append(entry.logprob)
            top = {
                self.tok.token_text(t): lp
                for t, lp in zip(entry.top_token_ids, entry.top_logprobs, strict=False)
            }
            top.setdefault(text, entry.logprob)
            out["top_logprobs"].append(top)
        return out

    def _choice_part(self, delta: ChoiceDelta) -> tuple[str, dict | None]:
        """A delta's text and completions-format logprobs; a choice's first one starts with the echo."""
        i = delta.index
        prefix, lp = "", None
        if not self.started[i]:
            self.started[i] = True
            if self.req.echo:
                prefix, lp = self._echo(i, delta)
        if self.req.logprobs is not None:
            out = self._logprobs(i, delta.token_ids, delta.logprobs)
            if lp is None:
                lp = out
            else:
                for key in lp:
                    lp[key].extend(out[key])
        return prefix + delta.text, lp

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
            text, lp = self._choice_part(item)
            texts[item.index].append(text)
            if lp is not None:
                if lps[item.index] is None:
                    lps[item.index] = lp
                else:
                    for key in lp:
                        lps[item.index][key].extend(lp[key])
            if item.finish_reason is not None:
                finish[item.index], stop_reason[item.index] = item.finish_reason, item.stop_reason
        choices = [
            {
                "index": i,
                "text": "".join(texts[i]),
                "logprobs": lps[i] if self.req.logprobs is not None else None,
                "finish_reason": finish[i],
                "stop_reason": stop_reason[i],
            }
            for i in range(self.num_choices)
        ]
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": _usage_dict(usage),
        }

    async def chunks(self, items: AsyncIterator[ChoiceDelta | UsageInfo]) -> AsyncIterator[dict]:
        include_usage = self.req.include_usage
        async for item in items:
            if isinstance(item, UsageInfo):
                if include_usage:
                    yield self._chunk([], usage=_usage_dict(item))
                continue
            text, lp = self._choice_part(item)
            if not text and lp is None and item.finish_reason is None:
                continue
            choice = {
                "index": item.index,
                "text": text,
                "logprobs": lp,
                "finish_reason": item.finish_reason,
                "stop_reason": item.stop_reason,
            }
            yield self._chunk([choice], usage=None) if include_usage else self._chunk([choice])

    def _chunk(self, choices: list, **extra: Any) -> dict:
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }


class _ChatFormatter:
    """/v1/chat/completions: chat.completion objects and chunks, with the chat logprobs format."""

    def __init__(self, state: GatewayState, req: ChatCompletionRequest, gen: GenerationRequest):
        self.tok = state.tokenizer
        self.req = req
        self.id = gen.request_id
        self.created = int(time.time())
        self.model = state.model.name
        self.num_choices = len(gen.prompts) * gen.n

    def _logprobs(self, delta: ChoiceDelta) -> dict | None:
        if not self.req.logprobs:
            return None
        content = []
        for token_id, entry in zip(delta.token_ids, delta.logprobs, strict=False):
            content.append(
                {
                    "token": self.tok.token_text(token_id),
                    "logprob": entry.logprob,
                    "bytes": list(self.tok.token_bytes(token_id)),
                    "top_logprobs": [
                        {
                            "token": self.tok.token_text(t),
                            "logprob": lp,
                            "bytes": list(self.tok.token_bytes(t)),
                        }
                        for t, lp in zip(entry.top_token_ids, entry.top_logprobs, strict=False)
                    ][: self.req.top_logprobs or 0],
                }
            )
        return {"content": content}

    async def collect(self, items: AsyncIterator[ChoiceDelta | UsageInfo]) -> dict:
        texts: list[list[str]] = [[] for _ in range(self.num_choices)]
        lps: list[list] = [[] for _ in range(self.num_choices)]
        finish: list[str | None] = [None] * self.num_choices
        stop_reason: list[Any] = [None] * self.num_choices
        usage = UsageInfo()
        async for item in items:
            if isinstance(item, UsageInfo):
                usage = item
                continue
            texts[item.index].append(item.text)
            lp = self._logprobs(item)
            if lp is not None:
                lps[item.index].extend(lp["content"])
            if item.finish_reason is not None:
                finish[item.index], stop_reason[item.index] = item.finish_reason, item.stop_reason
        choices = [
            {
                "index": i,
                "message": {"role": "assistant", "content": "".join(texts[i])},
                "logprobs": {"content": lps[i]} if self.req.logprobs else None,
                "finish_reason": finish[i],
                "stop_reason": stop_reason[i],
            }
            for i in range(self.num_choices)
        ]
        return {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": _usage_dict(usage),
        }

    async def chunks(self, items: AsyncIterator[ChoiceDelta | UsageInfo]) -> AsyncIterator[dict]:
        include_usage = self.req.include_usage
        extra = {"usage": None} if include_usage else {}
        for i in range(self.num_choices):  # the first delta of every choice carries the role
            yield self._chunk(
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
        async for item in items:
            if isinstance(item, UsageInfo):
                if include_usage:
                    yield self._chunk([], usage=_usage_dict(item))
                continue
            lp = self._logprobs(item)
            if not item.text and lp is None and item.finish_reason is None:
                continue
            choice: dict[str, Any] = {
                "index": item.index,
                "delta": {"content": item.text} if item.text else {},
                "logprobs": lp,
                "finish_reason": item.finish_reason,
            }
            if item.finish_reason is not None:
                choice["stop_reason"] = item.stop_reason
            yield self._chunk([choice], **extra)

    def _chunk(self, choices: list, **extra: Any) -> dict:
        return {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }


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
