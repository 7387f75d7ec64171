"""`pagedserve gateway`: uvicorn for the HTTP API and grpc.aio for the gRPC API, in one event loop."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time

import uvicorn

from pagedserve.errors import PagedServeError
from pagedserve.grpc_utils import add_health_and_reflection, public_server, set_serving
from pagedserve.logging import configure_logging, get_logger
from pagedserve.service_main import freeze_startup_objects, run_event_loop
from pagedserve.tracing import setup_tracing
from pagedserve.v1 import text_generation_pb2_grpc

from .auth import ApiKeys
from .config import GatewayConfig
from .engine_client import EngineClient
from .generation import ModelInfo
from .grpc_api import SERVICE_NAME, TextGenerationServicer
from .openai_api import create_app
from .tokenization import Tokenizer

log = get_logger(__name__)

ENGINE_INFO_RETRY_S = 2.0
GRPC_GRACE_S = 5.0


def load_model(config: GatewayConfig) -> tuple[Tokenizer, ModelInfo]:
    from pagedserve.model_files import load_generation_info, model_name, resolve_model

    model_dir = resolve_model(config.model)
    info = load_generation_info(model_dir)
    name = config.served_model_name or model_name(model_dir)
    return Tokenizer.from_model_dir(model_dir), ModelInfo(name, info.max_model_len, info.eos_token_ids)


async def follow_engine_info(engine: EngineClient, model: ModelInfo) -> None:
    """Take the context length and EOS ids from the engine once it answers (it may cap max_model_len)."""
    while True:
        try:
            info = await engine.info()
        except PagedServeError:
            await asyncio.sleep(ENGINE_INFO_RETRY_S)
            continue
        if info.max_model_len:
            model.max_model_len = info.max_model_len
        if info.eos_token_ids:
            model.eos_token_ids = tuple(info.eos_token_ids)
        log.info(
            "engine info",
            model=info.model,
            max_model_len=info.max_model_len,
            workers=info.num_healthy_workers,
        )
        return


class DrainingServer(uvicorn.Server):
    """uvicorn that drains on SIGTERM/SIGINT: API requests get 503 at once, the running ones finish
    (up to the shutdown timeout), then it stops. A second signal stops at once."""

    def __init__(self, config: uvicorn.Config, state, shutdown_timeout: float, on_drain=None):
        super().__init__(config)
        self.state = state
        self.on_drain = on_drain
        self.shutdown_timeout = shutdown_timeout
        self._drain_task: asyncio.Task | None = None
        self._loop = asyncio.get_event_loop()

    def handle_exit(self, sig, frame) -> None:
        # NOTE: not recorded in _captured_signals: uvicorn would raise it again on exit and the
        # default handler would kill us before the gRPC server and the engine channel are closed.
        if self.state.draining or self.should_exit:
            self.should_exit = True
            return
        self.state.draining = True
        if self.on_drain is not None:
            self.on_drain()
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        log.info("draining", in_flight=self.state.in_flight, timeout=self.shutdown_timeout)
        deadline = time.monotonic() + self.shutdown_timeout
        while self.state.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        log.info("stopping", unfinished=self.state.in_flight)
        self.should_exit = True


async def serve(config: GatewayConfig, tokenizer: Tokenizer, model: ModelInfo) -> None:
    engine = EngineClient(config.scheduler, config.tls, config.cluster_auth)
    app = create_app(config, tokenizer, model, engine)
    freeze_startup_objects()
    grpc_server = None
    servicer = TextGenerationServicer(
        app.state.gateway.core,
        ApiKeys(config.all_api_keys()),
        tool_call_parser=config.tool_call_parser,
        reasoning_parser=config.reasoning_parser,
    )
    if config.grpc_port:
        grpc_server = public_server(config.max_body_bytes)
        text_generation_pb2_grpc.add_TextGenerationServiceServicer_to_server(servicer, grpc_server)
        health = add_health_and_reflection(grpc_server, [SERVICE_NAME])
        grpc_server.add_insecure_port(f"{config.host}:{config.grpc_port}")
        await grpc_server.start()
        await set_serving(health, [SERVICE_NAME], True)
        log.info("gRPC API listening", host=config.host, port=config.grpc_port)
    info_task = asyncio.create_task(follow_engine_info(engine, model))
    http = DrainingServer(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            loop="none",  # the loop is already running (uvloop, from main)
            log_config=None,  # uvicorn logs through the project's structlog setup
            access_log=False,
            timeout_graceful_shutdown=GRPC_GRACE_S,
        ),
        app.state.gateway,
        config.shutdown_timeout,
        on_drain=lambda: setattr(servicer, "draining", True),
    )
    log.info(
        "HTTP API listening", host=config.host, port=config.port, model=model.name, scheduler=config.scheduler
    )
    try:
        await http.serve()
    finally:
        info_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await info_task
        if grpc_server is not None:
            await grpc_server.stop(max(GRPC_GRACE_S, config.shutdown_timeout))
        await engine.close()
        app.state.gateway.core.close()


def main(argv: list[str] | None = None) -> int:
    config = GatewayConfig.from_args(argv)
    configure_logging("gateway", config.log_level)
    setup_tracing("pagedserve-gateway")
    tokenizer, model = load_model(config)
    run_event_loop(serve(config, tokenizer, model))
    return 0


if __name__ == "__main__":
    sys.exit(main())
