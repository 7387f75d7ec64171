"""The worker process: the WorkerService gRPC server over a loaded worker (assembly.py), with health,
reflection and registration with the scheduler; SIGTERM drains it.

    pagedserve worker --model default --scheduler scheduler:50050
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import Sequence

import torch

from pagedserve.errors import PagedServeError
from pagedserve.grpc_utils import add_health_and_reflection, internal_server, listen, set_serving
from pagedserve.logging import get_logger
from pagedserve.service_main import freeze_startup_objects, run_service, stop_on_signals
from pagedserve.v1 import engine_pb2, worker_pb2, worker_pb2_grpc
from pagedserve.worker_svc.assembly import LoadedWorker, load_worker
from pagedserve.worker_svc.compute_thread import ComputeThread
from pagedserve.worker_svc.config import WorkerConfig
from pagedserve.worker_svc.registrar import Registrar, drain
from pagedserve.worker_svc.servicer import SERVICE_NAME, WorkerServicer

__all__ = ["SERVICE_NAME", "WorkerServer", "load_worker", "main", "serve"]

log = get_logger("pagedserve.worker")


class WorkerServer:
    """The worker's gRPC server and its registration task. WorkerServer.load makes one: `loaded` must
    come from the `executor` thread that will run its steps (see ComputeThread)."""

    def __init__(
        self,
        config: WorkerConfig,
        loaded: LoadedWorker,
        executor: ComputeThread,
        max_register_backoff: float = 10.0,
    ):
        self.config = config
        self.loaded = loaded
        self.max_register_backoff = max_register_backoff
        self.servicer = WorkerServicer(loaded.runner, loaded.info, executor)
        self.server = internal_server(config.cluster_auth, config.tls)
        worker_pb2_grpc.add_WorkerServiceServicer_to_server(self.servicer, self.server)
        self.health = add_health_and_reflection(self.server, [SERVICE_NAME])
        self.port = 0
        self.registrar: Registrar | None = None
        self._register_task: asyncio.Task | None = None

    @classmethod
    async def load(cls, config: WorkerConfig, max_register_backoff: float = 10.0) -> WorkerServer:
        """A server over the model config names, loaded on the thread that will run its steps (see
        ComputeThread)."""
        executor = ComputeThread()
        try:
            loaded = await asyncio.get_running_loop().run_in_executor(executor, load_worker, config)
        except BaseException:
            executor.shutdown(wait=False)
            raise
        return cls(config, loaded, executor, max_register_backoff)

    @property
    def address(self) -> str:
        return self.config.advertised(self.port)

    async def start(self) -> None:
        self.port = listen(self.server, f"{self.config.host}:{self.config.port}", self.config.tls)
        if self.port == 0:
            raise RuntimeError(f"cannot listen on {self.config.host}:{self.config.port}")
        await self.server.start()
        await set_serving(self.health, [SERVICE_NAME], True)
        log.info("serving", address=self.address, port=self.port, **_info_fields(self.loaded.info))
        if self.config.scheduler:
            info = self.loaded.info
            request = engine_pb2.RegisterWorkerRequest(
                worker_id=self.config.worker_id,
                address=self.address,
                model=info.model,
                num_blocks=info.num_blocks,
                block_size=info.block_size,
                dtype=info.dtype,
                device=info.device,
                max_model_len=info.max_model_len,
            )
            self.registrar = Registrar(
                self.config.scheduler,
                request,
                max_backoff=self.max_register_backoff,
                tls=self.config.tls,
                auth=self.config.cluster_auth,
            )
            self._register_task = asyncio.create_task(self.registrar.run())

    async def drain(self, timeout: float) -> bool:
        """Stop registering, and drain through the scheduler (see registrar.drain). Whether it drained."""
        await self._stop_registering()
        if not self.config.scheduler:
            return False
        request = engine_pb2.DrainWorkerRequest(worker_id=self.config.worker_id, address=self.address)
        return await drain(
            self.config.scheduler, request, timeout, tls=self.config.tls, auth=self.config.cluster_auth
        )

    async def _stop_registering(self) -> None:
        if self._register_task is not None:
            self._register_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._register_task

    async def stop(self, grace: float | None = 1.0) -> None:
        await self._stop_registering()
        await set_serving(self.health, [SERVICE_NAME], False)
        await self.server.stop(grace)
        # The other ranks of a tensor-parallel group stop after the last step, from the thread that ran it.
        self.servicer.executor.post(self.loaded.close)
        self.servicer.executor.shutdown(wait=True)

    async def wait_for_termination(self) -> None:
        await self.server.wait_for_termination()


def _info_fields(info: worker_pb2.ModelInfo) -> dict:
    return {
        "model": info.model,
        "num_blocks": info.num_blocks,
        "block_size": info.block_size,
        "dtype": info.dtype,
        "device": info.device,
        "max_model_len": info.max_model_len,
    }


async def serve(config: WorkerConfig) -> None:
    if config.threads is not None:
        # NOTE: before any forward pass: torch's worker threads take the count when they first run.
        torch.set_num_threads(config.threads)
    server = await WorkerServer.load(config)
    freeze_startup_objects()
    await server.start()
    stop = stop_on_signals()
    await stop.wait()
    # NOTE: the scheduler moves this worker's requests to the others (recomputed, nothing lost) and
    # closes its stream before we go; a second signal stops at once.
    log.info("draining", timeout=config.drain_timeout)
    stop.clear()
    drained = asyncio.ensure_future(server.drain(config.drain_timeout))
    second_signal = asyncio.ensure_future(stop.wait())
    await asyncio.wait({drained, second_signal}, return_when=asyncio.FIRST_COMPLETED)
    drained.cancel()
    second_signal.cancel()
    log.info("stopping")
    await server.stop(grace=5.0)


def main(argv: Sequence[str] | None = None) -> int:
    config = WorkerConfig.from_args(argv)
    return run_service(
        "worker",
        config.log_level,
        config.log_json,
        lambda: serve(config),
        (FileNotFoundError, ValueError, PagedServeError),
    )


if __name__ == "__main__":
    sys.exit(main())
