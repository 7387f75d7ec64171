"""The event loop every service runs on, and that the async tests run on too."""

from __future__ import annotations

import asyncio

import pytest

from pagedserve import service_main

uvloop = pytest.importorskip("uvloop", reason="uvloop is not installed (Windows)")


def test_services_run_on_uvloop():
    # A worker's compute thread must not hand the GIL to its loop when it wakes it at the end of a step
    # (see service_main.EVENT_LOOP_FACTORY): asyncio's loop takes it there, uvloop's cannot.
    loops = []

    async def serve():
        loops.append(asyncio.get_running_loop())

    service_main.run_event_loop(serve())
    assert len(loops) == 1 and isinstance(loops[0], uvloop.Loop)


@pytest.mark.anyio
async def test_async_tests_run_on_the_services_event_loop():
    assert isinstance(asyncio.get_running_loop(), uvloop.Loop)
