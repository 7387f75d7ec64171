"""The WorkerService servicer: the Steps stream over the compute thread, Reset and GetModelInfo."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator

import grpc

from pagedserve.logging import get_logger
from pagedserve.v1 import worker_pb2, worker_pb2_grpc
from pagedserve.worker_svc.compute_thread import ComputeThread, ResultHandOver
from pagedserve.worker_svc.request_spans import RequestSpans
from pagedserve.worker_svc.runner import ModelRunner, PlanError

SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["WorkerService"].full_name

log = get_logger("pagedserve.worker")

# Ends the queue of steps the stream has read.
_END = object()


class WorkerServicer(worker_pb2_grpc.WorkerServiceServicer):
    def __init__(self, runner: ModelRunner, info: worker_pb2.ModelInfo, executor: ComputeThread):
        self.runner = runner
        self.info = info
        # NOTE: the ComputeThread that loaded the runner: plans execute strictly in order, and the asyncio
        # loop stays free to receive the next plan (and answer health checks) while a forward pass runs.
        self.executor = executor
        # One span per request while it is here (only for requests that arrive with a trace context).
        self.spans = RequestSpans()

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    async def Steps(
        self, request_iterator: AsyncIterator[worker_pb2.StepsRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.StepsResponse]:
        loop = asyncio.get_running_loop()
        # The steps submitted to the compute thread, in step order, until their results are written.
        steps: asyncio.Queue = asyncio.Queue()
        hand_over = ResultHandOver(loop)
        closed = threading.Event()  # the stream has ended: steps not started never run

        def step(plan: worker_pb2.StepPlan, received_at: float, done: asyncio.Future) -> None:
            hand_over.started()
            if closed.is_set():
                return
            started_ns = time.time_ns()
            # The result is written in place into the message the stream sends.
            response = worker_pb2.StepsResponse()
            try:
                self.runner.execute(plan, received_at, before_forward=hand_over.flush, result=response.result)
            except Exception as error:
                hand_over.fail(done, error)
                return
            hand_over.finished(done, (response, started_ns, time.time_ns()))

        async def read() -> None:
            # NOTE: each plan goes to the compute thread the moment it arrives, so the thread starts it
            # as soon as the step before it ends, with no hop through this event loop in between: the
            # loop writes result N while step N+1 runs. A plan after a refused one is refused in turn
            # (its step id then follows no applied plan), so nothing runs past a broken plan.
            try:
                async for request in request_iterator:
                    plan = request.plan
                    # The step's result comes through `done` (see ResultHandOver).
                    done = loop.create_future()
                    hand_over.queued()
                    self.executor.post(step, plan, time.perf_counter(), done)
                    steps.put_nowait((plan, done))
            finally:
                steps.put_nowait((_END, None))

        reader = asyncio.create_task(read())
        try:
            while True:
                plan, done = await steps.get()
                if plan is _END:
                    return
                try:
                    response, started_ns, ended_ns = await done
                except PlanError as error:
                    log.warning("plan_refused", step_id=plan.step_id, error=error.message)
                    await context.abort(error.grpc_code, error.message)
                except Exception as error:
                    # NOTE: the state may be half-applied now; the scheduler resets us when it reconnects.
                    log.exception("step_failed", step_id=plan.step_id)
                    await context.abort(grpc.StatusCode.INTERNAL, f"step {plan.step_id}: {error!r}")
                self.spans.on_step(plan, started_ns, ended_ns)
                yield response
        finally:
            # Steps not started yet never run; one running finishes, its result unread.
            closed.set()
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reader
            while not steps.empty():
                _, done = steps.get_nowait()
                if done is not None:
                    done.cancel()

    async def Reset(self, request: worker_pb2.ResetRequest, context) -> worker_pb2.ResetResponse:
        await self._run(self.runner.reset)
        self.spans.end_all("reset")
        log.info("reset")
        return worker_pb2.ResetResponse(info=self.info)

    async def GetModelInfo(
        self, request: worker_pb2.GetModelInfoRequest, context
    ) -> worker_pb2.GetModelInfoResponse:
        return worker_pb2.GetModelInfoResponse(info=self.info)
