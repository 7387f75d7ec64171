"""Starting and stopping `pagedserve serve` for the end-to-end test modules (one stack per module)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.proto import engine_pb2, engine_pb2_grpc

BIN = Path(sys.executable).parent
MODEL = "SmolLM2-135M-Instruct"
STARTUP_TIMEOUT_S = 180  # the launcher gives up by itself after this (so a read of its banner ends)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Stack:
    process: subprocess.Popen
    http_url: str  # gateway root, e.g. http://127.0.0.1:8000
    grpc_address: str  # the gateway's public gRPC API
    engine_address: str  # the scheduler's Engine service
    stdout_path: Path | None = None  # where the processes' stdout goes (None: a pipe)
    stderr_path: Path | None = None  # where their stderr (the JSON logs) goes (None: inherited)

    @property
    def base_url(self) -> str:
        return f"{self.http_url}/v1"

    def engine_stats(self) -> engine_pb2.EngineStats:
        with grpc.insecure_channel(self.engine_address) as channel:
            return engine_pb2_grpc.EngineStub(channel).Stats(engine_pb2.StatsRequest(), timeout=5)

    def wait_idle(self, timeout: float = 5.0) -> engine_pb2.EngineStats:
        deadline = time.monotonic() + timeout
        while True:
            stats = self.engine_stats()
            if stats.num_blocks_in_use == 0 and stats.num_requests_running == 0:
                return stats
            assert time.monotonic() < deadline, f"blocks still in use: {stats.num_blocks_in_use}"
            time.sleep(0.05)


def scrape(http_url: str) -> dict[str, float]:
    """/metrics as {sample name with labels (model_name and the like left out): value}."""
    import httpx

    text = httpx.get(f"{http_url}/metrics", timeout=10).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = {k: v for k, v in sample.labels.items() if k != "model_name"}
            key = sample.name + "".join(f"[{k}={v}]" for k, v in sorted(labels.items()))
            samples[key] = sample.value
    return samples


@contextlib.contextmanager
def running_stack(
    extra_args: list[str], env: dict[str, str] | None = None, log_dir: Path | None = None
) -> Iterator[Stack]:
    """`pagedserve serve` on free loopback ports until the block ends (SIGTERM to its process group).
    With log_dir, the processes' stdout and stderr are captured in files there."""
    port, grpc_port, engine_port = free_port(), free_port(), free_port()
    args = [str(BIN / "pagedserve"), "serve", "--port", str(port), "--grpc-port", str(grpc_port)]
    args += ["--scheduler-port", str(engine_port), "--startup-timeout", str(STARTUP_TIMEOUT_S), *extra_args]
    full_env = {**os.environ, **(env or {})}
    out_path = err_path = None
    with contextlib.ExitStack() as files:
        if log_dir is not None:
            out_path, err_path = log_dir / "stdout.log", log_dir / "stderr.log"
            stdout = files.enter_context(out_path.open("w"))
            stderr = files.enter_context(err_path.open("w"))
        else:
            stdout, stderr = subprocess.PIPE, None
        process = subprocess.Popen(
            args, stdout=stdout, stderr=stderr, text=True, env=full_env, start_new_session=True
        )
        try:
            banner = _wait_for_banner(process, out_path)
            http_url = f"http://127.0.0.1:{port}"
            assert any(f"{http_url}/v1" in line for line in banner), banner
            yield Stack(
                process,
                http_url,
                f"127.0.0.1:{grpc_port}",
                f"127.0.0.1:{engine_port}",
                out_path,
                err_path,
            )
        finally:
            stop(process)


def _wait_for_banner(process: subprocess.Popen, out_path: Path | None) -> list[str]:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S + 30
    if out_path is None:
        banner = []
        for line in process.stdout:
            banner.append(line)
            if "Ctrl-C" in line:
                break
            assert time.monotonic() < deadline, "pagedserve serve did not become ready"
        assert process.poll() is None, "".join(banner)
        return banner
    while True:
        lines = out_path.read_text().splitlines()
        if any("Ctrl-C" in line for line in lines):
            return lines
        assert process.poll() is None, f"pagedserve serve exited with {process.returncode}"
        assert time.monotonic() < deadline, "pagedserve serve did not become ready"
        time.sleep(0.25)


def stop(process: subprocess.Popen) -> None:
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
