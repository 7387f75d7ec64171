"""Async client of the scheduler's EngineService (grpc.aio): generate, abort, stats, info.

Leaving a `generate` stream early (the consumer stops, or its task is cancelled because the client
went away) cancels the call and sends an explicit Abort, so the request's blocks are freed within a
step even if the cancellation is lost on the way.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
from opentelemetry.context import Context

from pagedserve.errors import from_grpc_error
from pagedserve.grpc_utils import (
    NO_CLUSTER_AUTH,
    PLAINTEXT,
    ClusterAuth,
    TLSConfig,
    open_channel,
    open_sync_channel,
)
from pagedserve.logging import get_logger
from pagedserve.tracing import inject_metadata
from pagedserve.v1 import engine_pb2, engine_pb2_grpc

log = get_logger(__name__)

INFO_TIMEOUT_S = 5.0
ABORT_TIMEOUT_S = 5.0


class EngineClient:
    def __init__(self, address: str, tls: TLSConfig = PLAINTEXT, auth: ClusterAuth = NO_CLUSTER_AUTH):
        self.address = address
        self.tls = tls
        self.auth = auth
        # NOTE: the channel reconnects by itself (within ~2 s, see CHANNEL_OPTIONS) when the scheduler
        # restarts; calls made while it is down fail at once with UNAVAILABLE (a 503 to the client).
        self._channel = open_channel(address, tls, auth=auth)
        self._stub = engine_pb2_grpc.EngineServiceStub(self._channel)
        self._background: set[asyncio.Task] = set()  # aborts in flight, kept referenced until done
        self._sync_channel: grpc.Channel | None = None

    async def generate(
        self, request: engine_pb2.GenerateTokensRequest, trace_context: Context | None = None
    ) -> AsyncIterator[engine_pb2.GenerateTokensResponse]:
        call = self._stub.GenerateTokens(request, metadata=inject_metadata(trace_context))
        finished = False
        try:
            async for response in call:
                yield response
            finished = True
        except grpc.aio.AioRpcError as error:
            finished = True  # the engine ended the call itself: nothing to abort
            raise from_grpc_error(error) from None
        finally:
            if not finished:
                call.cancel()
                self.abort_soon(request.request_id)

    def abort_soon(self, request_id: str, index: int | None = None) -> None:
        """Abort in the background (safe to call while the caller is being cancelled)."""
        task = asyncio.get_running_loop().create_task(self.abort(request_id, index))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def abort(self, request_id: str, index: int | None = None) -> bool:
        """Abort sequence `index` of the request (the others go on), or all of it when None."""
        try:
            response = await self._stub.Abort(
                engine_pb2.AbortRequest(request_id=request_id, index=index), timeout=ABORT_TIMEOUT_S
            )
        except grpc.aio.AioRpcError as error:
            log.warning("abort failed", request_id=request_id, error=error.details())
            return False
        return response.aborted

    async def stats(self) -> engine_pb2.EngineStats:
        try:
            response = await self._stub.GetStats(engine_pb2.GetStatsRequest(), timeout=INFO_TIMEOUT_S)
        except grpc.aio.AioRpcError as error:
            raise from_grpc_error(error) from None
        return response.stats

    async def info(self, timeout: float = INFO_TIMEOUT_S) -> engine_pb2.EngineInfo:
        try:
            response = await self._stub.GetEngineInfo(engine_pb2.GetEngineInfoRequest(), timeout=timeout)
        except grpc.aio.AioRpcError as error:
            raise from_grpc_error(error) from None
        return response.info

    def stats_sync(self, timeout: float = INFO_TIMEOUT_S) -> engine_pb2.EngineStats:
        """Blocking GetStats, for prometheus_client's collectors (run in a thread, never on the loop)."""
        if self._sync_channel is None:
            self._sync_channel = open_sync_channel(self.address, self.tls, auth=self.auth)
        stub = engine_pb2_grpc.EngineServiceStub(self._sync_channel)
        try:
            response = stub.GetStats(engine_pb2.GetStatsRequest(), timeout=timeout)
        except grpc.RpcError as error:
            raise from_grpc_error(error) from None
        return response.stats

    async def close(self) -> None:
        if self._background:
            await asyncio.wait(self._background, timeout=ABORT_TIMEOUT_S)
        await self._channel.close()
        if self._sync_channel is not None:
            self._sync_channel.close()
