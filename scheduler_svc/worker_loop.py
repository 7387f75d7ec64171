"""One worker's loop: its scheduler core, its plan builder, and its one `WorkerService.Steps` stream.

The loop keeps up to `max_inflight_plans` plans in flight, so plan N+1 is built, encoded and on the wire
while the worker computes step N; when the core has nothing to schedule (`Scheduler.has_work()`) it
sends no plan and sleeps on an event that new requests and aborts set. Every decision that spans
workers (routing, failover, client messages) is the `Engine`'s: the loop calls back into it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from typing import TYPE_CHECKING

import grpc

from pagedserve.errors import InvalidRequestError
from pagedserve.logging import get_logger
from pagedserve.scheduler_svc.config import SchedulerConfig
from pagedserve.scheduler_svc.metrics import WorkerCounters
from pagedserve.scheduler_svc.plan import PlanBuilder
from pagedserve.scheduler_svc.request_stream import RequestStream
from pagedserve.scheduler_svc.scheduler import Scheduler
from pagedserve.tracing import get_tracer
from pagedserve.v1 import engine_pb2, worker_pb2, worker_pb2_grpc

if TYPE_CHECKING:
    from pagedserve.scheduler_svc.engine import Engine

log = get_logger("pagedserve.scheduler.worker_loop")
tracer = get_tracer("pagedserve.scheduler")


class WorkerLost(Exception):
    """The worker's Steps stream ended or broke."""


class WorkerEngine:
    """One worker: its scheduler core, its Steps stream, and the loop that keeps it busy."""

    def __init__(
        self,
        engine: Engine,
        registration: engine_pb2.RegisterWorkerRequest,
        info: worker_pb2.ModelInfo,
        channel: grpc.aio.Channel,
    ):
        self.engine = engine
        self.worker_id = registration.worker_id
        self.address = registration.address
        self.info = info
        self.channel = channel
        self.stub = worker_pb2_grpc.WorkerServiceStub(channel)
        cfg = engine.config
        self.core_config = SchedulerConfig(
            num_blocks=info.num_blocks,
            block_size=info.block_size,
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=max(cfg.max_num_batched_tokens, cfg.max_num_seqs),
            # NOTE: a sequence must fit the pool alone, or it could never finish (the core refuses
            # it); a small pool therefore shortens this worker's context rather than failing requests.
            max_model_len=min(
                engine.max_model_len,
                info.max_model_len or engine.max_model_len,
                info.num_blocks * info.block_size,
            ),
            enable_prefix_caching=cfg.enable_prefix_caching,
            policy=cfg.scheduling_policy,
        )
        if self.core_config.max_model_len < engine.max_model_len:
            log.warning(
                "worker_context_shortened",
                worker_id=self.worker_id,
                max_model_len=self.core_config.max_model_len,
                reason="its KV pool or its own limit holds fewer tokens than the model's context",
            )
        self.scheduler = Scheduler(self.core_config)
        self.plan_builder = PlanBuilder()
        self.counters = WorkerCounters()
        # Request id -> client stream, for the streams this worker's core holds (its sequences are the
        # core's, under the same id and indices).
        self.routes: dict[str, RequestStream] = {}
        self.healthy = False
        # Set when there may be something new to schedule (a request, an abort).
        self.wakeup = asyncio.Event()
        self.task: asyncio.Task | None = None
        self.closed = False

    # --- what the router reads ---
    def prefix_hit_tokens(self, token_ids, cache_salt: str) -> int:
        cache = self.scheduler.kv.cache
        if cache is None:
            return 0
        bs = self.core_config.block_size
        return len(cache.match(cache_salt, list(token_ids), (len(token_ids) - 1) // bs)) * bs

    def load(self) -> int:
        return len(self.scheduler.running) + len(self.scheduler.waiting)

    def free_blocks(self) -> int:
        return self.scheduler.kv.num_free_blocks

    def streams(self) -> list[RequestStream]:
        return list(self.routes.values())

    # --- requests ---
    def add(self, stream: RequestStream) -> None:
        """Queue the stream's sequences here; raises InvalidRequestError if this worker can't take them."""
        assert self.healthy
        try:
            for request in stream.core_requests(self.engine.eos_token_ids):
                self.scheduler.add_request(request)
        except ValueError as error:
            self.scheduler.abort_request(stream.request_id)
            raise InvalidRequestError(str(error)) from error
        self.routes[stream.request_id] = stream
        stream.worker = self
        self.wakeup.set()

    def abort(self, stream: RequestStream, index: int | None = None) -> None:
        """Abort sequence `index` of the stream here (its blocks are free at once), or all of them."""
        self.scheduler.abort_request(stream.request_id, index)
        if index is None:
            self.routes.pop(stream.request_id, None)
            stream.worker = None
        self.wakeup.set()

    def forget(self, stream: RequestStream) -> None:
        """The stream is done: drop its route (the core has finished its sequences itself)."""
        self.routes.pop(stream.request_id, None)

    # --- the step loop ---
    def start(self) -> None:
        self.healthy = True
        self.task = asyncio.create_task(self._run(), name=f"worker-loop-{self.worker_id}")

    async def _run(self) -> None:
        try:
            await self._step_loop()
        except asyncio.CancelledError:
            raise
        except (grpc.RpcError, WorkerLost) as error:
            detail = error.details() if isinstance(error, grpc.aio.AioRpcError) else str(error)
            log.warning("worker_lost", worker_id=self.worker_id, address=self.address, error=detail)
            self.engine.on_worker_failed(self)
        except Exception:
            log.exception("worker_loop_failed", worker_id=self.worker_id)
            self.engine.on_worker_failed(self)

    async def _step_loop(self) -> None:
        call = self.stub.Steps()
        # (scheduler output, step span, whether it came after a wait for work) of each plan sent whose
        # result has not come back, in order.
        in_flight: deque = deque()
        # Whether the loop last waited with no plan in flight and nothing to schedule: the worker's gap before
        # the next plan is then a wait for requests, which its counters keep apart from the steady state.
        waited_for_work = False
        max_inflight = self.engine.config.max_inflight_plans
        scheduler, plan_builder = self.scheduler, self.plan_builder
        pending_read: asyncio.Future | None = None
        try:
            while True:
                self.wakeup.clear()
                # NOTE: fill the pipeline first, then wait for the oldest result: plan N+1 is on the
                # wire while the worker computes step N.
                while len(in_flight) < max_inflight and scheduler.has_work():
                    output = scheduler.schedule()
                    request = plan_builder.build(output)
                    plan = request.plan
                    span = tracer.start_span(
                        "worker.step",
                        attributes={
                            "worker.id": self.worker_id,
                            "step.id": plan.step_id,
                            "step.num_slots": len(plan.slots),
                            "step.num_scheduled_tokens": output.total_num_scheduled_tokens,
                        },
                    )
                    await call.write(request)
                    in_flight.append((output, span, waited_for_work))
                    waited_for_work = False
                    self.engine.on_scheduled(self, output)
                # NOTE: one read is always pending, even while idle, so a worker that dies between
                # requests is noticed at once (its stream ends) rather than at the next plan.
                if pending_read is None:
                    pending_read = asyncio.ensure_future(call.read())
                if not in_flight:
                    waited_for_work = True
                    wakeup = asyncio.ensure_future(self.wakeup.wait())
                    done, _ = await asyncio.wait({pending_read, wakeup}, return_when=asyncio.FIRST_COMPLETED)
                    if pending_read not in done:
                        continue
                    wakeup.cancel()
                    pending_read.result()  # raises the stream's error, if it broke
                    raise WorkerLost("the worker's Steps stream ended with no plan in flight")
                response = await pending_read
                pending_read = None
                if response is grpc.aio.EOF:
                    raise WorkerLost("the worker closed its Steps stream")
                result = response.result
                output, span, after_no_work = in_flight.popleft()
                span.end()
                self.counters.observe(result.timings, after_no_work)
                outputs = scheduler.update_from_output(output, result)
                self.engine.deliver(self, output, result, outputs)
        finally:
            for _, span, _ in in_flight:
                span.end()
            if pending_read is not None:
                pending_read.cancel()
            call.cancel()

    def reset_core(self) -> None:
        """Forget every request: a fresh block pool and trie (the worker is Reset before reuse)."""
        self.routes.clear()
        self.scheduler = Scheduler(self.core_config)
        self.plan_builder = PlanBuilder()

    async def close(self) -> None:
        self.closed = True
        self.healthy = False
        if self.task is not None and self.task is not asyncio.current_task():
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self.task
        await self.channel.close()
