"""The scheduler process: the EngineService gRPC service over the engine, health, reflection.

    pagedserve scheduler --model default --port 50052

It reads the model's generation config and tokenizer files (end-of-sequence ids, context length,
vocabulary size) but never its weights: no torch in this process. Health is SERVING only while at
least one worker is registered and its step stream is up.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import grpc
import structlog
from opentelemetry.trace import Status, StatusCode

from pagedserve.errors import PagedServeError, abort_with
from pagedserve.grpc_utils import add_health_and_reflection, internal_server, listen, set_serving
from pagedserve.logging import get_logger
from pagedserve.model_files import load_generation_info, model_name, resolve_model
from pagedserve.scheduler_svc.engine import Engine
from pagedserve.scheduler_svc.request_stream import END, RequestStream
from pagedserve.scheduler_svc.service_config import SchedulerServiceConfig
from pagedserve.scheduler_svc.structured_output import GrammarCompiler, load_tokenizer
from pagedserve.service_main import freeze_startup_objects, run_service, stop_on_signals
from pagedserve.tracing import extract_context, get_tracer
from pagedserve.v1 import engine_pb2, engine_pb2_grpc

SERVICE_NAME = engine_pb2.DESCRIPTOR.services_by_name["EngineService"].full_name

log = get_logger("pagedserve.scheduler")
tracer = get_tracer("pagedserve.scheduler")


class EngineServicer(engine_pb2_grpc.EngineServiceServicer):
    def __init__(self, engine: Engine, sync_health):
        self.engine = engine
        self.sync_health = sync_health

    async def GenerateTokens(
        self, request: engine_pb2.GenerateTokensRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[engine_pb2.GenerateTokensResponse]:
        structlog.contextvars.bind_contextvars(request_id=request.request_id)
        span = tracer.start_span(
            "scheduler.generate",
            context=extract_context(context.invocation_metadata()),
            attributes={
                "request.id": request.request_id,
                "request.prompt_tokens": len(request.prompt_token_ids),
                "request.n": max(1, request.sampling.n),
            },
        )
        stream: RequestStream | None = None
        try:
            try:
                grammar = await self.engine.compile(request)
                stream = self.engine.submit(request, span, grammar)
            except PagedServeError as error:
                span.set_status(Status(StatusCode.ERROR, error.message))
                log.info("request_refused", error=error.message)
                await abort_with(context, error)
            log.info("request_received", prompt_tokens=len(request.prompt_token_ids), n=stream.n)
            while True:
                item = await stream.queue.get()
                if item is END:
                    break
                if isinstance(item, PagedServeError):
                    span.set_status(Status(StatusCode.ERROR, item.message))
                    log.warning("request_failed", error=item.message)
                    await abort_with(context, item)
                yield item
            usage = stream.usage()
            log.info(
                "request_finished",
                prompt_tokens=usage.prompt_tokens,
                completion_tokens=usage.completion_tokens,
                cached_prompt_tokens=usage.cached_prompt_tokens,
            )
        finally:
            if stream is not None and not stream.done:
                # NOTE: the client closed the stream (or the server is stopping): free its blocks now.
                self.engine.abort(request.request_id)
                log.info("request_cancelled")
            span.end()
            structlog.contextvars.unbind_contextvars("request_id")

    async def Abort(self, request: engine_pb2.AbortRequest, context) -> engine_pb2.AbortResponse:
        index = request.index if request.HasField("index") else None
        aborted = self.engine.abort(request.request_id, index)
        log.info("request_aborted", request_id=request.request_id, index=index, was_live=aborted)
        return engine_pb2.AbortResponse(aborted=aborted)

    async def GetStats(self, request: engine_pb2.GetStatsRequest, context) -> engine_pb2.GetStatsResponse:
        return engine_pb2.GetStatsResponse(stats=self.engine.stats())

    async def GetEngineInfo(
        self, request: engine_pb2.GetEngineInfoRequest, context
    ) -> engine_pb2.GetEngineInfoResponse:
        return engine_pb2.GetEngineInfoResponse(info=self.engine.info())

    async def DrainWorker(
        self, request: engine_pb2.DrainWorkerRequest, context
    ) -> engine_pb2.DrainWorkerResponse:
        response = await self.engine.drain_worker(request.worker_id, request.address)
        log.info("worker_drain_answered", worker_id=request.worker_id, drained=response.drained)
        return response

    async def RegisterWorker(
        self, request: engine_pb2.RegisterWorkerRequest, context
    ) -> engine_pb2.RegisterWorkerResponse:
        response = await self.engine.register_worker(request)
        # NOTE: SERVING before the answer: the worker watches our health right after and
        # registers again if it sees anything else.
        await self.sync_health()
        return response


def load_engine_facts(
    config: SchedulerServiceConfig,
) -> tuple[str, frozenset[int], int, int, GrammarCompiler | None]:
    """(model name, eos ids, max_model_len, vocab size, structured-output compiler) from the model's JSON
    files alone (tokenizer.json for the compiler: None without one)."""
    model_dir = resolve_model(config.model)
    generation = load_generation_info(model_dir)
    hf_config = json.loads((Path(model_dir) / "config.json").read_text())
    max_model_len = min(config.max_model_len or generation.max_model_len, generation.max_model_len)
    vocab_size = int(hf_config.get("vocab_size", 0))
    grammars = None
    if (Path(model_dir) / "tokenizer.json").is_file() and vocab_size:
        grammars = GrammarCompiler(
            load_tokenizer(model_dir, vocab_size, generation.eos_token_ids),
            timeout=config.structured_output_compile_timeout,
            max_workers=config.structured_output_compile_threads,
            cache_size=config.structured_output_cache_size,
        )
    else:
        log.warning("structured_outputs_unavailable", reason="the model has no tokenizer.json")
    return model_name(model_dir), frozenset(generation.eos_token_ids), max_model_len, vocab_size, grammars


class SchedulerServer:
    def __init__(self, config: SchedulerServiceConfig, engine: Engine):
        self.config = config
        self.engine = engine
        self.server = internal_server(config.cluster_auth, config.tls)
        self.servicer = EngineServicer(engine, self.sync_health)
        engine_pb2_grpc.add_EngineServiceServicer_to_server(self.servicer, self.server)
        self.health = add_health_and_reflection(self.server, [SERVICE_NAME])
        engine.on_health_change = lambda _serving: asyncio.get_running_loop().create_task(self.sync_health())
        self.port = 0
        self._serving: bool | None = None

    async def sync_health(self) -> None:
        serving = bool(self.engine.healthy_workers())
        if serving != self._serving:
            self._serving = serving
            await set_serving(self.health, [SERVICE_NAME], serving)
            log.info("health", serving=serving, healthy_workers=len(self.engine.healthy_workers()))

    async def start(self) -> None:
        self.port = listen(self.server, f"{self.config.host}:{self.config.port}", self.config.tls)
        if self.port == 0:
            raise RuntimeError(f"cannot listen on {self.config.host}:{self.config.port}")
        await self.server.start()
        await self.sync_health()
        log.info(
            "serving",
            port=self.port,
            model=self.engine.model,
            max_model_len=self.engine.max_model_len,
            tls=self.config.tls.enabled,
        )

    async def stop(self, grace: float = 2.0) -> None:
        await set_serving(self.health, [SERVICE_NAME], False)
        await self.engine.close()
        await self.server.stop(grace)


async def serve(config: SchedulerServiceConfig) -> None:
    model, eos, max_model_len, vocab_size, grammars = await asyncio.to_thread(load_engine_facts, config)
    engine = Engine(config, model, eos, max_model_len, vocab_size, grammars=grammars)
    freeze_startup_objects()
    server = SchedulerServer(config, engine)
    await server.start()
    stop = stop_on_signals()
    await stop.wait()
    # NOTE: graceful: refuse new requests at once, let the running ones finish (a second signal
    # stops at once), then close the streams that are still live.
    log.info("draining", live_requests=len(engine.streams), timeout=config.shutdown_timeout)
    stop.clear()
    drained = asyncio.ensure_future(engine.drain(config.shutdown_timeout))
    second_signal = asyncio.ensure_future(stop.wait())
    await asyncio.wait({drained, second_signal}, return_when=asyncio.FIRST_COMPLETED)
    log.info("stopping", drained=drained.done() and drained.result(), live_requests=len(engine.streams))
    drained.cancel()
    second_signal.cancel()
    await server.stop()


def main(argv: Sequence[str] | None = None) -> int:
    config = SchedulerServiceConfig.from_args(argv)
    return run_service(
        "scheduler",
        config.log_level,
        config.log_json,
        lambda: serve(config),
        (FileNotFoundError, ValueError, RuntimeError),
    )


if __name__ == "__main__":
    sys.exit(main())
