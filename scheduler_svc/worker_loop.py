"""One worker's loop: its scheduler core, its plan builder, and its one `WorkerService.Steps` stream.

The loop keeps up to `max_inflight_plans` plans in flight, so plan N+1 is built, encoded and on the wire
while the worker computes step N; when the core has nothing to schedule (`Scheduler.has_work()`) it
sends no plan and sleeps on an event that new requests and aborts set. Every decision that spans
workers (routing, failover, client messages) is the `Engine`'s: the loop tells it what happened through
the small `WorkerListener` interface, and the Engine asks a worker only through WorkerEngine's methods.

Supervision: the oldest step in flight has a deadline (`--step-timeout` plus `--step-timeout-per-token`
times its tokens, from when it became the oldest); a worker that keeps its connection but stops
answering (a stuck kernel or compute thread) is treated as dead when it passes. Draining (the worker
is leaving) stops new plans, waits for the ones in flight, then closes the stream.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import grpc

from pagedserve.errors import InvalidRequestError
from pagedserve.logging import get_logger
from pagedserve.scheduler_svc.config import SchedulerConfig
from pagedserve.scheduler_svc.metrics import WorkerCounters
from pagedserve.scheduler_svc.plan import PlanBuilder
from pagedserve.scheduler_svc.request import Request
from pagedserve.scheduler_svc.request_stream import RequestStream
from pagedserve.scheduler_svc.scheduler import (
    RequestFailure,
    RequestOutput,
    Scheduler,
    SchedulerOutput,
    SchedulerStats,
    pool_refusal,
)
from pagedserve.tracing import get_tracer
from pagedserve.v1 import common_pb2, engine_pb2, worker_pb2, worker_pb2_grpc

log = get_logger("pagedserve.scheduler.worker_loop")
tracer = get_tracer("pagedserve.scheduler")


class WorkerLost(Exception):
    """The worker's Steps stream ended or broke, or a step outlived its deadline."""


@dataclass(frozen=True, slots=True)
class WorkerLoopSettings:
    # The worker's scheduler core: its pool, batch and context limits.
    core: SchedulerConfig
    # Plans sent before the oldest one's result comes back (2: plan N+1 overlaps step N).
    max_inflight_plans: int
    # Seconds the oldest step in flight may take, plus this many per token it computes.
    step_timeout: float
    step_timeout_per_token: float
    # Tokens that end a sequence unless ignore_eos (the model's).
    eos_token_ids: frozenset[int]


@dataclass(frozen=True, slots=True)
class PromptLogprobs:
    # The request whose prompt positions these are.
    request_id: str
    # Prompt position of logprobs[0] (position 0 has none).
    start_position: int
    # One entry per position from start_position on.
    logprobs: Sequence[common_pb2.TokenLogprob]


class WorkerListener(Protocol):
    """What a worker's loop tells the Engine (every decision that spans workers is the Engine's)."""

    def on_scheduled(self, worker: WorkerEngine, requests: list[Request]) -> None:
        """A plan computing these requests went out."""

    def on_results(
        self, worker: WorkerEngine, outputs: list[RequestOutput], prompt_logprobs: list[PromptLogprobs]
    ) -> None:
        """A step's result came back: the sequences' new tokens, and the prompt positions it scored."""

    def on_requests_failed(self, worker: WorkerEngine, failures: list[RequestFailure]) -> None:
        """These requests failed alone (in the core, or refused by the worker); their blocks are free."""

    def on_worker_failed(self, worker: WorkerEngine, reason: str) -> None:
        """The stream broke or a step outlived its deadline; the loop has ended."""

    async def on_worker_drained(self, worker: WorkerEngine) -> None:
        """A draining worker's loop ended with nothing in flight."""


class WorkerEngine:
    """One worker: its scheduler core, its Steps stream, and the loop that keeps it busy."""

    def __init__(
        self,
        listener: WorkerListener,
        registration: engine_pb2.RegisterWorkerRequest,
        info: worker_pb2.ModelInfo,
        channel: grpc.aio.Channel,
        settings: WorkerLoopSettings,
    ):
        self.listener = listener
        self.worker_id = registration.worker_id
        self.address = registration.address
        self.info = info
        self.channel = channel
        self.stub = worker_pb2_grpc.WorkerServiceStub(channel)
        self.settings = settings
        self.core_config = settings.core
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
        # (scheduler output, step span, whether it came after a wait for work) of each plan sent whose
        # result has not come back, in order.
        self.in_flight: deque = deque()
        # Set by the Engine when the worker is leaving: no new plans; the loop ends once none is in flight.
        self.draining = False
        # Set once a drain is over (its requests moved on, its stream closed), or the worker is gone.
        self.drained = asyncio.Event()
        # Requests moved off the worker by its drain.
        self.num_moved = 0

    # --- what the engine and the router read ---
    @property
    def max_model_len(self) -> int:
        """Longest sequence this worker serves, in tokens."""
        return self.core_config.max_model_len

    @property
    def num_blocks(self) -> int:
        return self.core_config.num_blocks

    @property
    def timings(self) -> WorkerCounters:
        """The worker's step timings (StepResult.timings), accumulated."""
        return self.counters

    @property
    def is_running(self) -> bool:
        """Whether its step loop runs."""
        return self.task is not None and not self.task.done()

    def core_stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    def queued(self) -> tuple[int, int]:
        """(sequences, tokens) waiting in this worker's core: what the queue bounds weigh."""
        return self.scheduler.num_waiting_seqs, self.scheduler.num_waiting_tokens

    def stream_of(self, request_id: str) -> RequestStream | None:
        return self.routes.get(request_id)

    @property
    def num_streams(self) -> int:
        return len(self.routes)

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

    def in_flight_request_ids(self) -> set[str]:
        """Requests with a sequence in a step sent and not answered (those a failure now is blamed on)."""
        return {req.request_id for output, _, _ in self.in_flight for req in output.scheduled}

    def refusal(self, stream: RequestStream) -> str | None:
        """Why this worker's KV pool could never hold what is left of the stream, or None."""
        cfg = self.core_config
        prompt_len = len(stream.msg.prompt_token_ids)
        room = cfg.max_model_len - prompt_len
        sp = stream.msg.sampling
        max_output = min(sp.max_tokens, room) if sp.HasField("max_tokens") else room
        # NOTE: a stream with tokens streamed comes back sequence by sequence (RequestStream.core_requests).
        n = stream.n if stream.is_fresh() else 1
        return pool_refusal(cfg, prompt_len, max_output, n)

    # --- requests ---
    def add(self, stream: RequestStream) -> None:
        """Queue the stream's sequences here; raises InvalidRequestError if this worker can't take them."""
        assert self.healthy
        try:
            for request in stream.core_requests(self.settings.eos_token_ids):
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

    def wake(self) -> None:
        """There may be something new to schedule, or the worker is leaving."""
        self.wakeup.set()

    async def reset(self, timeout: float) -> worker_pb2.ModelInfo:
        """Reset the worker process (it forgets every request); raises grpc.RpcError if it does not answer."""
        return (await self.stub.Reset(worker_pb2.ResetRequest(), timeout=timeout)).info

    def resume(self, info: worker_pb2.ModelInfo) -> None:
        """The worker answered a Reset: a fresh core, and its loop again."""
        self.info = info
        self.reset_core()
        self.start()

    # --- the step loop ---
    def start(self) -> None:
        self.healthy = True
        self.task = asyncio.create_task(self._run(), name=f"worker-loop-{self.worker_id}")

    async def _run(self) -> None:
        try:
            await self._step_loop()
        except asyncio.CancelledError:
            raise
        except (grpc.RpcError, WorkerLost, asyncio.InvalidStateError) as error:
            # NOTE: InvalidStateError: a write to a call the worker's end has already finished.
            detail = error.details() if isinstance(error, grpc.aio.AioRpcError) else str(error)
            log.warning("worker_lost", worker_id=self.worker_id, address=self.address, error=detail)
            self.listener.on_worker_failed(self, detail or type(error).__name__)
        except Exception as error:
            log.exception("worker_loop_failed", worker_id=self.worker_id)
            self.listener.on_worker_failed(self, f"the scheduler's loop for it failed: {error!r}")
        else:
            await self.listener.on_worker_drained(self)

    def step_timeout(self, output: SchedulerOutput) -> float:
        """Seconds the worker may take to answer this step once it is the oldest in flight."""
        cfg = self.settings
        return cfg.step_timeout + cfg.step_timeout_per_token * output.total_num_scheduled_tokens

    async def _step_loop(self) -> None:
        call = self.stub.Steps()
        in_flight = self.in_flight
        in_flight.clear()
        # Whether the loop last waited with no plan in flight and nothing to schedule: the worker's gap before
        # the next plan is then a wait for requests, which its counters keep apart from the steady state.
        waited_for_work = False
        max_inflight = self.settings.max_inflight_plans
        scheduler, plan_builder, listener = self.scheduler, self.plan_builder, self.listener
        loop = asyncio.get_running_loop()
        # When the oldest step in flight must have answered (loop time).
        deadline = 0.0
        pending_read: asyncio.Future | None = None
        try:
            while True:
                self.wakeup.clear()
                # NOTE: fill the pipeline first, then wait for the oldest result: plan N+1 is on the
                # wire while the worker computes step N.
                while len(in_flight) < max_inflight and not self.draining and scheduler.has_work():
                    output = scheduler.schedule()
                    request = plan_builder.build(output)
                    plan = request.plan
                    if failures := scheduler.take_failures():
                        listener.on_requests_failed(self, failures)
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
                    if not in_flight:
                        deadline = loop.time() + self.step_timeout(output)
                    in_flight.append((output, span, waited_for_work))
                    waited_for_work = False
                    listener.on_scheduled(self, output.scheduled)
                # NOTE: one read is always pending, even while idle, so a worker that dies between
                # requests is noticed at once (its stream ends) rather than at the next plan.
                if pending_read is None:
                    pending_read = asyncio.ensure_future(call.read())
                if not in_flight:
                    if self.draining:
                        # Every step sent has come back: close the stream, let the worker end its side.
                        await call.done_writing()
                        await asyncio.wait((pending_read,), timeout=5.0)
                        return
                    waited_for_work = True
                    wakeup = asyncio.ensure_future(self.wakeup.wait())
                    done, _ = await asyncio.wait({pending_read, wakeup}, return_when=asyncio.FIRST_COMPLETED)
                    if pending_read not in done:
                        continue
                    wakeup.cancel()
                    pending_read.result()  # raises the stream's error, if it broke
                    raise WorkerLost("the worker's Steps stream ended with no plan in flight")
                if not pending_read.done():
                    await asyncio.wait((pending_read,), timeout=max(deadline - loop.time(), 0.0))
                    if not pending_read.done():
                        output = in_flight[0][0]
                        raise WorkerLost(
                            f"step {output.step_id} ({output.total_num_scheduled_tokens} tokens) got no result "
                            f"within its deadline of {self.step_timeout(output):.1f} s: the worker is hung"
                        )
                response = pending_read.result()
                pending_read = None
                if response is grpc.aio.EOF:
                    raise WorkerLost("the worker closed its Steps stream")
                result = response.result
                output, span, after_no_work = in_flight.popleft()
                span.end()
                if in_flight:
                    deadline = loop.time() + self.step_timeout(in_flight[0][0])
                self.counters.observe(result.timings, after_no_work)
                refused = None
                if result.refused_slots:
                    by_slot = plan_builder.requests_by_slot(result.step_id)
                    refused = {
                        by_slot[slot]: message
                        for slot, message in zip(result.refused_slots, result.refused_messages, strict=True)
                        if slot in by_slot
                    }
                outputs = scheduler.update_from_output(output, result, refused)
                if failures := scheduler.take_failures():
                    listener.on_requests_failed(self, failures)
                listener.on_results(self, outputs, self._prompt_logprobs(result))
        finally:
            for _, span, _ in in_flight:
                span.end()
            if pending_read is not None:
                pending_read.cancel()
            call.cancel()

    def _prompt_logprobs(self, result: worker_pb2.StepResult) -> list[PromptLogprobs]:
        """The result's scored prompt positions, by request (the result names slots)."""
        if not result.prompt_logprobs:
            return []
        slots = [entry.slot for entry in result.prompt_logprobs]
        requests = self.plan_builder.requests_at(result.step_id, slots)
        return [
            PromptLogprobs(request.request_id, entry.start_position, entry.logprobs)
            for entry, request in zip(result.prompt_logprobs, requests, strict=True)
        ]

    def reset_core(self) -> None:
        """Forget every request: a fresh block pool and trie (the worker is Reset before reuse)."""
        self.routes.clear()
        self.in_flight.clear()
        self.scheduler = Scheduler(self.core_config)
        self.plan_builder = PlanBuilder()

    async def close(self) -> None:
        self.closed = True
        self.healthy = False
        self.drained.set()
        if self.task is not None and self.task is not asyncio.current_task():
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self.task
        await self.channel.close()
