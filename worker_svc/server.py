"""The worker process: the WorkerService gRPC service over a ModelRunner, health, reflection, registration.

The model loads and runs in one dedicated thread (ComputeThread). A reader task hands each plan of the
Steps stream to that thread the moment it arrives (stamping its arrival for StepTimings.idle_seconds),
so with a pipelining scheduler the thread goes from one step straight into the next, while the asyncio
loop writes the previous result.

    pagedserve worker --model default --scheduler scheduler:50050
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Executor, Future

import grpc
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve.errors import PagedServeError
from pagedserve.grpc_utils import (
    NO_CLUSTER_AUTH,
    PLAINTEXT,
    ClusterAuth,
    TLSConfig,
    add_health_and_reflection,
    internal_server,
    listen,
    open_channel,
    set_serving,
)
from pagedserve.logging import get_logger
from pagedserve.service_main import freeze_startup_objects, run_service, stop_on_signals
from pagedserve.v1 import engine_pb2, engine_pb2_grpc, worker_pb2, worker_pb2_grpc
from pagedserve.worker_svc.assembly import LoadedWorker, load_worker
from pagedserve.worker_svc.config import WorkerConfig
from pagedserve.worker_svc.request_spans import RequestSpans
from pagedserve.worker_svc.runner import ModelRunner, PlanError

SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["WorkerService"].full_name

log = get_logger("pagedserve.worker")


class ComputeThread(Executor):
    """The one thread that runs a worker's torch work: loading the model and the KV pool, then every
    step, strictly in order. submit() runs a call and returns its future, as a ThreadPoolExecutor of one
    thread does; post() runs one without a future (a step, whose result goes through _ResultHandOver).

    NOTE: libgomp gives each thread that opens a parallel region a team of OpenMP threads of its own,
    which lives as long as that thread. With more OpenMP threads in the process than cores, libgomp's
    waiting threads spin 100 times instead of 300,000 before they sleep in the kernel (GOMP_SPINCOUNT),
    so that each of the ~150 parallel regions of a decode step has to wake them. Loaded on an asyncio
    thread and run on this one, a worker had two teams on 2 cores, and its forward pass took 20-23 ms
    where the offline LLM's (one thread) took 15.2-15.7 on the same model. `make serve`, then `pagedserve
    bench serve` at concurrency 1 (128 tokens in, 128 out), 2-core Zen 3, alternating old and new: median
    time per output token 27.8 and 25.5 ms -> 23.0 and 22.4 ms; at concurrency 16 (256 in, 64 out) 79.1
    and 80.7 -> 78.7 and 85.3 output tokens/s, within that machine's noise.

    NOTE: a queue and a loop rather than a ThreadPoolExecutor, whose future, work item and idle semaphore
    per step (four locks and conditions in Python) took the thread 32-44 us from the end of one step to
    the start of the next, cold after the forward pass (the median over 1000 steps of `pagedserve bench
    serve` at concurrency 1, 2-core Zen 4).
    """

    def __init__(self, name: str = "worker-forward"):
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False
        # A daemon: one blocked on an empty queue must not hold up the interpreter's exit.
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def post(self, fn: Callable[..., object], *args: object) -> None:
        """Run fn(*args) on the thread after the calls before it; what it returns or raises is dropped."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the compute thread is shut down")
            self._calls.put((fn, args))

    def submit(self, fn, /, *args, **kwargs) -> Future:
        future: Future = Future()
        self.post(_call_into, future, fn, args, kwargs)
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """No more calls; the queued ones still run (cancel_futures is not supported), then the thread ends."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._calls.put(None)
        if wait and threading.current_thread() is not self._thread:
            self._thread.join()

    def _run(self) -> None:
        while (call := self._calls.get()) is not None:
            fn, args = call
            try:
                fn(*args)
            except Exception:
                log.exception("compute_call_failed", call=getattr(fn, "__qualname__", repr(fn)))


def _call_into(future: Future, fn: Callable[..., object], args: tuple, kwargs: dict) -> None:
    if not future.set_running_or_notify_cancel():
        return
    try:
        value = fn(*args, **kwargs)
    except BaseException as error:
        future.set_exception(error)
    else:
        future.set_result(value)


_END = object()


class _ResultHandOver:
    """When the compute thread hands a step's result to the event loop.

    The loop's part of a step (writing the result, reading plans) is Python and holds the GIL; woken the
    moment a step ends, it would run while the compute thread applies the next plan, which then waits for
    it. So while a next plan is already queued, a step's result is handed over from that next step, right
    before its forward pass, where the kernels release the GIL: the loop writes it while the model runs.
    With no plan queued it goes at once. Results keep their order: one waits at most for the next step's
    inputs, and a step's own result never goes before the one held from the step before it.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._lock = threading.Lock()
        self._queued = 0  # plans submitted to the compute thread and not started
        self._held: tuple[asyncio.Future, object] | None = None  # a finished step's result, not handed over

    def queued(self) -> None:
        """On the loop: a plan is submitted."""
        with self._lock:
            self._queued += 1

    def started(self) -> None:
        """On the compute thread: a step starts."""
        with self._lock:
            self._queued -= 1

    def finished(self, done: asyncio.Future, value: object) -> None:
        """On the compute thread: the step of `done` ended with `value`; hand it over now or hold it."""
        self.flush()
        with self._lock:
            hold = self._queued > 0
        if hold:
            self._held = (done, value)
        else:
            self._post(_set_result, done, value)

    def fail(self, done: asyncio.Future, error: Exception) -> None:
        """On the compute thread: the step of `done` raised `error`; hand it over after the held result."""
        self.flush()
        self._post(_set_exception, done, error)

    def flush(self) -> None:
        """On the compute thread: hand over the held result, if any."""
        held, self._held = self._held, None
        if held is not None:
            self._post(_set_result, *held)

    def _post(self, callback, *args) -> None:
        # NOTE: a step may end after the server's loop has closed (a shutdown mid-step): nobody waits for it.
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(callback, *args)


def _set_result(future: asyncio.Future, value: object) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future, error: Exception) -> None:
    if not future.done():
        future.set_exception(error)


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
        hand_over = _ResultHandOver(loop)
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
                    # The step's result comes through `done` (see _ResultHandOver).
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
        """Tell the scheduler this worker is leaving, and wait until it has moved the worker's requests to
        other workers and closed its Steps stream (DrainWorker answers then), or timeout seconds. Whether
        it did."""
        await self._stop_registering()
        if not self.config.scheduler:
            return False
        request = engine_pb2.DrainWorkerRequest(worker_id=self.config.worker_id, address=self.address)
        async with open_channel(
            self.config.scheduler, self.config.tls, auth=self.config.cluster_auth
        ) as channel:
            try:
                response = await engine_pb2_grpc.EngineServiceStub(channel).DrainWorker(
                    request, timeout=timeout
                )
            except grpc.RpcError as error:
                log.warning("drain_failed", scheduler=self.config.scheduler, code=error.code().name)
                return False
        log.info("drained", drained=response.drained, requests_moved=response.num_requests_moved)
        return response.drained

    async def _stop_registering(self) -> None:
        if self._register_task is not None:
            self._register_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._register_task

    async def stop(self, grace: float | None = 1.0) -> None:
        await self._stop_registering()
        await set_serving(self.health, [SERVICE_NAME], False)
        await self.server.stop(grace)
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
