"""Fixtures shared by the test modules."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The default model converted into the same cache `make serve` uses, so the ~20 s conversion
    happens once per machine, not once per test run."""
    from pagedserve.model_files import resolve_model

    return resolve_model(None)


@pytest.fixture(scope="session")
def anyio_backend():
    """The async tests run on the event loop the services run on (see service_main.EVENT_LOOP_FACTORY)."""
    from pagedserve.service_main import EVENT_LOOP_FACTORY

    return "asyncio", {"loop_factory": EVENT_LOOP_FACTORY}


@pytest.fixture(scope="session")
async def one_event_loop(anyio_backend):
    """Every async test of the session runs on one event loop, as each service runs on one.

    NOTE: grpc.aio delivers a completion to the loop its operation started on. An operation that a
    test cancelled (a stream read, a server's shutdown) may complete after that test has ended; if
    its loop were closed by then, grpc would raise "Event loop is closed" inside whichever test runs
    next. While this fixture holds anyio's runner, the loop stays open and such a late completion
    settles a future nobody awaits."""
    yield


@pytest.hookimpl(tryfirst=True)
def pytest_pycollect_makeitem(collector, name, obj):
    """Each async test (they are all anyio tests) holds the session's loop."""
    if collector.istestfunction(obj, name) and inspect.iscoroutinefunction(obj):
        pytest.mark.usefixtures("one_event_loop")(obj)


@pytest.fixture(scope="session")
def tokenizer():
    """The gateway's tokenizer of the default model (a module may define its own `tokenizer`)."""
    from pagedserve.gateway.tokenization import Tokenizer
    from pagedserve.model_files import resolve_model

    return Tokenizer.from_model_dir(resolve_model("default"))


@pytest.fixture(autouse=True, scope="module")
def _kernels_invariance_off_after_the_module():
    """An engine a module's fixture builds (LLM() is batch-invariant by default on CPUs with AMX) leaves the
    process-wide switch on for the module's tests; the next module starts with it off again, the kernels'
    own state, which tests of their dispatch (oneDNN from many rows) rely on."""
    yield
    from pagedserve import kernels

    if kernels._load_cpu_ops.cache_info().currsize > 0:
        ops = kernels._load_cpu_ops()
        if ops is not None:
            ops.batch_invariant = False


@pytest.fixture(autouse=True)
def _kernels_left_as_found():
    """The CPU kernels' batch invariance is a switch of the process (an engine built with deterministic=True
    sets it): each test leaves it as it found it, so a later test's kernels run their usual bodies."""
    from pagedserve import kernels

    loaded = kernels._load_cpu_ops.cache_info().currsize > 0
    ops = kernels._load_cpu_ops() if loaded else None
    before = ops.batch_invariant if ops is not None else False
    yield
    if kernels._load_cpu_ops.cache_info().currsize > 0:
        ops = kernels._load_cpu_ops()
        if ops is not None and ops.batch_invariant != before:
            ops.batch_invariant = before
