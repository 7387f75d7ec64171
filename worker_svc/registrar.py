"""The worker and the scheduler: registration (again whenever the scheduler comes back) and, on leaving,
the drain that hands the worker's requests to the other workers.
"""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve.grpc_utils import NO_CLUSTER_AUTH, PLAINTEXT, ClusterAuth, TLSConfig, open_channel
from pagedserve.logging import get_logger
from pagedserve.v1 import engine_pb2, engine_pb2_grpc

log = get_logger("pagedserve.worker")


class Registrar:
    """Announces the worker to the scheduler, retrying with backoff, and announces it again whenever
    the scheduler comes back (its health stream breaks or leaves SERVING: a restart or an outage)."""

    def __init__(
        self,
        scheduler: str,
        request: engine_pb2.RegisterWorkerRequest,
        initial_backoff: float = 0.5,
        max_backoff: float = 10.0,
        tls: TLSConfig = PLAINTEXT,
        auth: ClusterAuth = NO_CLUSTER_AUTH,
    ):
        self.scheduler = scheduler
        self.tls = tls
        self.auth = auth
        self.request = request
        self.initial_backoff = initial_backoff
        self.max_backoff = max_backoff
        self.registrations = 0  # successful registrations so far
        self.registered = asyncio.Event()  # set while the scheduler is known to hold us

    async def run(self) -> None:
        async with open_channel(self.scheduler, self.tls, auth=self.auth) as channel:
            engine = engine_pb2_grpc.EngineServiceStub(channel)
            health = health_pb2_grpc.HealthStub(channel)
            while True:
                await self._register(engine)
                # NOTE: read the state now, before any await: the scheduler may go away (and a new one
                # come up on the same address) before the watchers below start.
                registered_over = channel.get_state(try_to_connect=False)
                await _first_of(self._watch(health), _connection_lost(channel, registered_over))
                self.registered.clear()
                log.warning("scheduler_lost", scheduler=self.scheduler)

    async def _register(self, engine: engine_pb2_grpc.EngineServiceStub) -> None:
        backoff = self.initial_backoff
        while True:
            try:
                response = await engine.RegisterWorker(self.request, timeout=10.0)
            except grpc.RpcError as error:
                log.info("register_retry", scheduler=self.scheduler, code=error.code().name, backoff=backoff)
            else:
                if response.accepted:
                    self.registrations += 1
                    self.registered.set()
                    log.info("registered", scheduler=self.scheduler, address=self.request.address)
                    return
                # NOTE: a refusal (other model, other block size) may be fixed by redeploying the
                # scheduler, so keep trying, slowly.
                log.error("register_refused", scheduler=self.scheduler, message=response.message)
                backoff = self.max_backoff
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.max_backoff)

    async def _watch(self, health: health_pb2_grpc.HealthStub) -> None:
        """Returns when the scheduler must be told about us again."""
        serving = health_pb2.HealthCheckResponse.SERVING
        watch = health.Watch(health_pb2.HealthCheckRequest(service=""))
        try:
            async for response in watch:
                if response.status != serving:
                    return
        except grpc.RpcError as error:
            if error.code() != grpc.StatusCode.UNIMPLEMENTED:
                return
        finally:
            # NOTE: a stopping scheduler says NOT_SERVING, then waits for its open calls. Left open, this
            # one is cancelled by the scheduler's server when the wait ends, which grpc logs there as an
            # unhandled CancelledError.
            watch.cancel()
        # A scheduler without health Watch: poll its reachability instead.
        while True:
            await asyncio.sleep(self.max_backoff)
            try:
                await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5.0)
            except grpc.RpcError as error:
                if error.code() != grpc.StatusCode.UNIMPLEMENTED:
                    return


async def _connection_lost(channel: grpc.aio.Channel, registered_over: grpc.ChannelConnectivity) -> None:
    """Returns when the connection the registration went over is gone (the scheduler went away).

    registered_over is the channel's state read right after the registration's answer: READY while
    that connection stands. Anything else means it already dropped, and a later READY would be a new
    connection, perhaps to a new scheduler that has never heard of us.

    NOTE: the health Watch stream alone is not enough: a scheduler stopped without grace does not
    always end the stream promptly, while the closed connection always shows in the channel's state.
    """
    if registered_over == grpc.ChannelConnectivity.READY:
        await channel.wait_for_state_change(registered_over)


async def _first_of(*coroutines) -> None:
    """Run the coroutines until the first one returns, then cancel the others."""
    tasks = [asyncio.ensure_future(c) for c in coroutines]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def drain(
    scheduler: str,
    request: engine_pb2.DrainWorkerRequest,
    timeout: float,
    tls: TLSConfig = PLAINTEXT,
    auth: ClusterAuth = NO_CLUSTER_AUTH,
) -> bool:
    """Tell the scheduler this worker is leaving, and wait until it has moved the worker's requests to other
    workers and closed its Steps stream (DrainWorker answers then), or timeout seconds. Whether it did."""
    async with open_channel(scheduler, tls, auth=auth) as channel:
        try:
            response = await engine_pb2_grpc.EngineServiceStub(channel).DrainWorker(request, timeout=timeout)
        except grpc.RpcError as error:
            log.warning("drain_failed", scheduler=scheduler, code=error.code().name)
            return False
    log.info("drained", drained=response.drained, requests_moved=response.num_requests_moved)
    return response.drained
