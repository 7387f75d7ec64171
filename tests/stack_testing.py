"""A real stack on loopback for the fault, load, fuzz and security tests: one scheduler, N workers and
a gateway, each its own process, so a test can kill, restart or signal any one of them."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx

from pagedserve.grpc_utils import PLAINTEXT, TLSConfig, open_sync_channel
from pagedserve.proto import engine_pb2, engine_pb2_grpc

LOOPBACK = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def _spawn(args: list[str], log_path: Path) -> subprocess.Popen:
    log = open(log_path, "ab")  # noqa: SIM115 -- lives as long as the process
    return subprocess.Popen(
        [sys.executable, "-m", "pagedserve.cli", *args],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={**os.environ, "PAGEDSERVE_LOG_JSON": "1"},
    )


@dataclass
class Stack:
    model_dir: Path
    log_dir: Path
    num_workers: int = 2
    num_blocks: int = 256
    scheduler_args: list[str] = field(default_factory=list)
    gateway_args: list[str] = field(default_factory=list)
    # TLS flags for every service (None: plaintext); client_tls is what the test itself dials with.
    tls_args: list[str] | None = None
    client_tls: TLSConfig = PLAINTEXT
    engine_port: int = field(default_factory=free_port)
    http_port: int = field(default_factory=free_port)
    grpc_port: int = field(default_factory=free_port)
    scheduler: subprocess.Popen | None = None
    workers: dict[str, subprocess.Popen] = field(default_factory=dict)
    gateway: subprocess.Popen | None = None

    @property
    def engine_address(self) -> str:
        return f"{LOOPBACK}:{self.engine_port}"

    @property
    def base_url(self) -> str:
        return f"http://{LOOPBACK}:{self.http_port}"

    # --- processes ---
    def start_scheduler(self, extra: list[str] | None = None) -> None:
        args = ["scheduler", "--model", str(self.model_dir), "--host", LOOPBACK]
        args += ["--port", str(self.engine_port), "--log-level", "info", *(self.tls_args or [])]
        args += [*self.scheduler_args, *(extra or [])]
        self.scheduler = _spawn(args, self.log_dir / "scheduler.log")

    def start_worker(self, worker_id: str) -> None:
        args = ["worker", "--model", str(self.model_dir), "--host", LOOPBACK, "--port", "0"]
        args += ["--scheduler", self.engine_address, "--worker-id", worker_id, "--dtype", "float32"]
        args += ["--device", "cpu", "--num-blocks", str(self.num_blocks), "--log-level", "info"]
        args += self.tls_args or []
        self.workers[worker_id] = _spawn(args, self.log_dir / f"{worker_id}.log")

    def start_gateway(self) -> None:
        args = ["gateway", "--host", LOOPBACK, "--port", str(self.http_port)]
        args += ["--grpc-port", str(self.grpc_port), "--scheduler", self.engine_address]
        args += ["--model", str(self.model_dir), "--log-level", "info"]
        if self.tls_args:
            args += [a for a in self.tls_args if a != "--tls-require-client-cert"]
        args += self.gateway_args
        self.gateway = _spawn(args, self.log_dir / "gateway.log")

    def start(self, timeout: float = 240.0) -> Stack:
        self.start_scheduler()
        for i in range(self.num_workers):
            self.start_worker(f"worker-{i}")
        self.start_gateway()
        self.wait_workers(self.num_workers, timeout)
        self.wait_http_ready(timeout)
        return self

    def processes(self) -> list[subprocess.Popen]:
        return [p for p in [self.gateway, *self.workers.values(), self.scheduler] if p is not None]

    def stop(self) -> None:
        for process in self.processes():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name} ---\n" + p.read_text(errors="replace")[-4000:]
            for p in sorted(self.log_dir.glob("*.log"))
        )

    # --- probes ---
    def engine_stats(self, timeout: float = 5.0) -> engine_pb2.EngineStats:
        with open_sync_channel(self.engine_address, self.client_tls) as channel:
            return engine_pb2_grpc.EngineStub(channel).Stats(engine_pb2.StatsRequest(), timeout=timeout)

    def healthy_workers(self) -> set[str]:
        try:
            stats = self.engine_stats(timeout=1.0)
        except grpc.RpcError:
            return set()
        return {w.worker_id for w in stats.workers if w.healthy}

    def wait_workers(self, count: int, timeout: float = 240.0, including: str | None = None) -> None:
        deadline = time.monotonic() + timeout
        while True:
            healthy = self.healthy_workers()
            if len(healthy) >= count and (including is None or including in healthy):
                return
            for process in self.processes():
                assert process.poll() is None, f"a process exited ({process.args[3]})\n{self.logs()}"
            assert time.monotonic() < deadline, f"workers not healthy: {healthy}\n{self.logs()}"
            time.sleep(0.2)

    def wait_http_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.base_url}/health", timeout=2.0).status_code == 200:
                    return
            assert self.gateway is not None and self.gateway.poll() is None, self.logs()
            assert time.monotonic() < deadline, f"gateway not ready\n{self.logs()}"
            time.sleep(0.2)

    def wait_idle(self, timeout: float = 5.0) -> engine_pb2.EngineStats:
        deadline = time.monotonic() + timeout
        while True:
            stats = self.engine_stats()
            if (
                stats.num_blocks_in_use == 0
                and stats.num_requests_running == 0
                and not stats.num_requests_waiting
            ):
                return stats
            assert time.monotonic() < deadline, f"not idle: {stats}"
            time.sleep(0.05)


def assert_openai_error(response: httpx.Response, status: int | None = None) -> dict:
    """The response is an error in OpenAI's shape; returns its "error" object."""
    if status is not None:
        assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert isinstance(error["message"], str) and error["message"], body
    assert isinstance(error["type"], str) and error["type"], body
    assert "param" in error and "code" in error, body
    return error


def stream_completion(
    client: httpx.Client, body: dict, headers: dict | None = None
) -> tuple[str, int, str | None]:
    """POST a streaming /v1/completions; returns (text, number of chunks with text, finish reason)."""
    import json

    text, chunks, finish = [], 0, None
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}, headers=headers) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            for choice in event["choices"]:
                if choice["text"]:
                    text.append(choice["text"])
                    chunks += 1
                finish = choice["finish_reason"] or finish
    return "".join(text), chunks, finish
