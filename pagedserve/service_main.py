"""What every service process (the scheduler, a worker, the gateway) does around its own `serve()`: one
event loop, one logging and tracing setup, stop signals, and the exit code of a failed start."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import signal
from collections.abc import Callable, Coroutine
from typing import Any

from pagedserve.logging import configure_logging, get_logger
from pagedserve.tracing import setup_tracing

log = get_logger("pagedserve.service")

try:
    import uvloop
except ImportError:  # Windows: uvloop is not installed there
    uvloop = None

# The event loop every service runs on (the tests' async code runs on it too): uvloop's where it is
# installed, asyncio's otherwise.
#
# NOTE: in a worker the choice sets how soon the next step starts. When the compute thread ends a step
# it wakes the loop (call_soon_threadsafe) and goes on into the next plan, already queued. asyncio
# wakes the loop with a socket send, which releases the GIL: the loop, now awake, can take the GIL
# there (a race it won in most steps on 2 cores) and write the step's result while the compute thread
# waits to get it back. uvloop wakes it from C
# (uv_async_send) with the GIL held, so the compute thread starts the next step first and the loop
# writes the result while the forward pass has the GIL released. `make serve`, then `pagedserve bench
# serve`, 2-core Zen 4, against the scheduler and worker on asyncio in three alternations: from the end
# of one step to the start of the next, concurrency 1 (128 + 128 tokens) 0.33-0.37 ms against 1.09-1.47
# (3.2-3.4 % of the step against 9.6-12.7 %), concurrency 16 (256 + 64) 1.1-1.6 % against 2.7-4.6 %;
# output tokens/s 79-85 against 75-78 and 244-256 against 248-261. Service by service, the gap follows
# the worker's loop alone; the scheduler's takes about a tenth of that process's CPU off each token.
EVENT_LOOP_FACTORY: Callable[[], asyncio.AbstractEventLoop] | None = uvloop.new_event_loop if uvloop else None


def run_event_loop(main: Coroutine[Any, Any, None]) -> None:
    """Run main to its end on a new loop of EVENT_LOOP_FACTORY's."""
    if uvloop is None:
        asyncio.run(main)
    else:
        uvloop.run(main)


def stop_on_signals() -> asyncio.Event:
    """An event that SIGINT and SIGTERM set, every time one comes (so a second signal can be awaited)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    return stop


def freeze_startup_objects() -> None:
    """Move every object alive after start-up (imported modules, the model's Python objects: about 360K
    in a worker) out of the cyclic garbage collector's sight, as vLLM's engine does. A full collection
    over them stops the process for about 165 ms (measured in the offline LLM after loading the default
    model); once frozen, collections scan only what serving creates."""
    gc.collect()
    gc.freeze()


def run_service(
    service: str,
    log_level: str,
    log_json: bool,
    serve: Callable[[], Coroutine[Any, Any, None]],
    failures: tuple[type[Exception], ...],
) -> int:
    """Run serve() to its end: 0, or 1 after logging `<service>_failed` when it raises one of failures
    (a missing model, a bad flag: errors the operator fixes, not bugs worth a traceback)."""
    configure_logging(service, log_level, json=log_json)
    setup_tracing(f"pagedserve-{service}")
    try:
        run_event_loop(serve())
    except failures as error:
        log.error(f"{service}_failed", error=str(error))
        return 1
    return 0
