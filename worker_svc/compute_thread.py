"""The worker's compute thread, and the hand-over of each step's result from it to the event loop.

The model loads and runs in one dedicated thread (ComputeThread). The servicer's reader task hands each
plan of the Steps stream to that thread the moment it arrives, so with a pipelining scheduler the thread
goes from one step straight into the next, while the asyncio loop writes the previous result, which the
thread hands over (ResultHandOver) once the next step's forward pass has started.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future

from pagedserve.logging import get_logger

log = get_logger("pagedserve.worker")


class ComputeThread(Executor):
    """The one thread that runs a worker's torch work: loading the model and the KV pool, then every
    step, strictly in order. submit() runs a call and returns its future, as a ThreadPoolExecutor of one
    thread does; post() runs one without a future (a step, whose result goes through ResultHandOver).

    NOTE: libgomp gives each thread that opens a parallel region a team of OpenMP threads of its own,
    which lives as long as that thread. With more OpenMP threads in the process than cores, libgomp's
    waiting threads spin 100 times instead of 300,000 before they sleep in the kernel (GOMP_SPINCOUNT), so
    that each of the ~150 parallel regions of a decode step has to wake them: so the model loads on the
    thread that runs the steps (docs/performance.md, "Measurements behind the code").

    NOTE: a queue and a loop rather than a ThreadPoolExecutor, whose future, work item and idle semaphore
    per step (four locks and conditions in Python) cost the thread tens of microseconds from the end of one
    step to the start of the next, cold after the forward pass.
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


class ResultHandOver:
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
