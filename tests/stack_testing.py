"""A real stack of processes on loopback for the end-to-end test modules (one stack per module).

Two shapes, one `Stack`: `pagedserve serve` (serve_args set), the way users run it, or a scheduler, N
workers and optionally a gateway, each its own process, so a test can kill, restart or signal any one
of them. Either way every process logs into log_dir, the ports are free loopback ports, every process
shares a cluster token of the stack's own (the test's Engine calls carry it too), and
`running(stack)` starts it, waits until it serves and stops it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import grpc
import httpx
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.grpc_utils import CLUSTER_TOKEN_ENV, PLAINTEXT, ClusterAuth, TLSConfig, open_sync_channel
from pagedserve.launcher import cli_command, worker_threads
from pagedserve.v1 import engine_pb2, engine_pb2_grpc

LOOPBACK = "127.0.0.1"
MODEL = "SmolLM2-135M-Instruct"
STARTUP_TIMEOUT_S = 180  # the launcher gives up by itself after this (so the wait for its banner ends)


def wait_for(condition, timeout: float = 60.0, what: str = "timed out", interval: float = 0.1):
    """Polls `condition` every `interval` seconds until it returns something truthy, and returns that."""
    deadline = time.monotonic() + timeout
    while not (found := condition()):
        assert time.monotonic() < deadline, what
        time.sleep(interval)
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def _spawn(args: list[str], stdout: IO, stderr: IO | int, env: dict[str, str]) -> subprocess.Popen:
    # NOTE: its own session (process group), so stopping it also stops whatever it started.
    return subprocess.Popen(
        cli_command(*args),
        stdout=stdout,
        stderr=stderr,
        start_new_session=True,
        env={**os.environ, **env},
    )


def stop_process(process: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM its process group and wait up to grace_s seconds, then SIGKILL (at once with no grace)."""
    if process.poll() is not None:
        return
    if grace_s > 0:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=grace_s)
            return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


@dataclass
class Stack:
    model_dir: Path
    log_dir: Path
    # Flags for `pagedserve serve`, which then runs the whole stack as one process group; None: each
    # service is its own process (the fields below shape them).
    serve_args: list[str] | None = None
    # Extra environment for every process.
    env: dict[str, str] = field(default_factory=dict)
    num_workers: int = 2
    num_blocks: int = 256
    with_gateway: bool = True
    scheduler_args: list[str] = field(default_factory=list)
    gateway_args: list[str] = field(default_factory=list)
    # TLS flags for every service (None: plaintext); client_tls is what the test itself dials with.
    tls_args: list[str] | None = None
    client_tls: TLSConfig = PLAINTEXT
    # The cluster token every process gets in PAGEDSERVE_CLUSTER_TOKEN (None: none, loopback peers only).
    cluster_token: str | None = field(default_factory=lambda: secrets.token_urlsafe(24))
    engine_port: int = field(default_factory=free_port)
    http_port: int = field(default_factory=free_port)
    grpc_port: int = field(default_factory=free_port)
    serve_process: subprocess.Popen | None = None
    scheduler: subprocess.Popen | None = None
    workers: dict[str, subprocess.Popen] = field(default_factory=dict)
    gateway: subprocess.Popen | None = None
    # Log files held open as long as their processes run.
    _log_files: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)

    @property
    def client_auth(self) -> ClusterAuth:
        """What the test's own Engine and Worker calls prove membership with."""
        return ClusterAuth(self.cluster_token)

    @property
    def process_env(self) -> dict[str, str]:
        token = {CLUSTER_TOKEN_ENV: self.cluster_token} if self.cluster_token is not None else {}
        return {**token, **self.env}

    @property
    def engine_address(self) -> str:
        return f"{LOOPBACK}:{self.engine_port}"

    @property
    def grpc_address(self) -> str:
        return f"{LOOPBACK}:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"http://{LOOPBACK}:{self.http_port}"

    @property
    def openai_base_url(self) -> str:
        return f"{self.http_url}/v1"

    @property
    def stdout_path(self) -> Path:
        """`pagedserve serve`'s stdout: its banner, and spans when they are exported to the console."""
        return self.log_dir / "stdout.log"

    @property
    def stderr_path(self) -> Path:
        """`pagedserve serve`'s stderr: every service's JSON log lines."""
        return self.log_dir / "stderr.log"

    # --- processes ---
    def start(self, timeout: float = 240.0) -> Stack:
        if self.serve_args is not None:
            self._start_serve()
            return self
        self.start_scheduler()
        for i in range(self.num_workers):
            self.start_worker(f"worker-{i}")
        if self.with_gateway:
            self.start_gateway()
        self.wait_workers(self.num_workers, timeout)
        if self.with_gateway:
            self.wait_http_ready(timeout)
        return self

    def _start_serve(self) -> None:
        args = ["serve", "--model", str(self.model_dir), "--port", str(self.http_port)]
        args += ["--grpc-port", str(self.grpc_port), "--scheduler-port", str(self.engine_port)]
        args += ["--startup-timeout", str(STARTUP_TIMEOUT_S), *(self.serve_args or [])]
        stdout = self._log_files.enter_context(self.stdout_path.open("w"))
        stderr = self._log_files.enter_context(self.stderr_path.open("w"))
        self.serve_process = _spawn(args, stdout, stderr, self.process_env)
        banner = self._wait_for_banner()
        assert any(self.openai_base_url in line for line in banner), banner

    def _wait_for_banner(self) -> list[str]:
        assert self.serve_process is not None
        deadline = time.monotonic() + STARTUP_TIMEOUT_S + 30
        while True:
            lines = self.stdout_path.read_text().splitlines()
            if any("Ctrl-C" in line for line in lines):
                return lines
            assert self.serve_process.poll() is None, (
                f"pagedserve serve exited with {self.serve_process.returncode}\n{self.logs()}"
            )
            assert time.monotonic() < deadline, f"pagedserve serve did not become ready\n{self.logs()}"
            time.sleep(0.25)

    def _spawn_service(self, args: list[str], name: str) -> subprocess.Popen:
        log = self._log_files.enter_context((self.log_dir / f"{name}.log").open("ab"))
        return _spawn(args, log, subprocess.STDOUT, self.process_env)

    def start_scheduler(self, extra: list[str] | None = None) -> None:
        args = ["scheduler", "--model", str(self.model_dir), "--host", LOOPBACK]
        args += ["--port", str(self.engine_port), "--log-level", "info", *(self.tls_args or [])]
        args += [*self.scheduler_args, *(extra or [])]
        self.scheduler = self._spawn_service(args, "scheduler")

    def start_worker(self, worker_id: str) -> None:
        args = ["worker", "--model", str(self.model_dir), "--host", LOOPBACK, "--port", "0"]
        args += ["--scheduler", self.engine_address, "--worker-id", worker_id, "--dtype", "float32"]
        args += ["--device", "cpu", "--num-blocks", str(self.num_blocks), "--log-level", "info"]
        if (threads := worker_threads(None, self.num_workers)) is not None:
            args += ["--threads", str(threads)]
        args += self.tls_args or []
        self.workers[worker_id] = self._spawn_service(args, worker_id)

    def start_gateway(self) -> None:
        args = ["gateway", "--host", LOOPBACK, "--port", str(self.http_port)]
        args += ["--grpc-port", str(self.grpc_port), "--scheduler", self.engine_address]
        args += ["--model", str(self.model_dir), "--log-level", "info"]
        if self.tls_args:
            args += [a for a in self.tls_args if a != "--tls-require-client-cert"]
        args += self.gateway_args
        self.gateway = self._spawn_service(args, "gateway")

    def processes(self) -> list[subprocess.Popen]:
        every = [self.serve_process, self.gateway, *self.workers.values(), self.scheduler]
        return [p for p in every if p is not None]

    def stop(self) -> None:
        # NOTE: the launcher gets to stop its children itself; separate services are killed at once
        # (nothing of theirs is checked after the module, and a drain would only cost suite time).
        grace_s = 30.0 if self.serve_process is not None else 0.0
        for process in self.processes():
            stop_process(process, grace_s)
        self._log_files.close()

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name} ---\n" + p.read_text(errors="replace")[-4000:]
            for p in sorted(self.log_dir.glob("*.log"))
        )

    def launcher_events(self, event: str | None = None) -> list[dict]:
        """`pagedserve serve`'s own JSON log lines (those of its "launcher" service), optionally one event's."""
        events = []
        for line in self.stderr_path.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                if isinstance(record, dict) and record.get("service") == "launcher":
                    events.append(record)
        return [e for e in events if event is None or e.get("event") == event]

    def child_pid(self, name: str) -> int | None:
        """The pid of `pagedserve serve`'s latest start of the child `name` (from its "started" lines)."""
        started = [e["pid"] for e in self.launcher_events("started") if e.get("process") == name]
        return started[-1] if started else None

    # --- probes ---
    def engine_channel(self) -> grpc.Channel:
        """A blocking channel to the Engine service whose calls prove membership as the stack's own do."""
        return open_sync_channel(self.engine_address, self.client_tls, auth=self.client_auth)

    def engine_stats(self, timeout: float = 30.0) -> engine_pb2.EngineStats:
        # wait_for_ready: a connection attempt that fails while the machine is loaded is tried again until
        # the deadline, rather than answered UNAVAILABLE at once.
        with self.engine_channel() as channel:
            return (
                engine_pb2_grpc.EngineServiceStub(channel)
                .GetStats(engine_pb2.GetStatsRequest(), timeout=timeout, wait_for_ready=True)
                .stats
            )

    def healthy_workers(self) -> set[str]:
        try:
            stats = self.engine_stats(timeout=10.0)
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
                if httpx.get(f"{self.http_url}/ready", timeout=2.0).status_code == 200:
                    return
            assert self.gateway is not None and self.gateway.poll() is None, self.logs()
            assert time.monotonic() < deadline, f"gateway not ready\n{self.logs()}"
            time.sleep(0.2)

    def wait_idle(self, timeout: float = 60.0) -> engine_pb2.EngineStats:
        """Stats once no request runs or waits and every block is free."""
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

    def scrape(self) -> dict[str, float]:
        """/metrics as {sample name with labels (model_name and the like left out): value}."""
        text = httpx.get(f"{self.http_url}/metrics", timeout=10).text
        samples = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = {k: v for k, v in sample.labels.items() if k != "model_name"}
                key = sample.name + "".join(f"[{k}={v}]" for k, v in sorted(labels.items()))
                samples[key] = sample.value
        return samples


@contextlib.contextmanager
def running(stack: Stack) -> Iterator[Stack]:
    """The stack started and serving until the block ends, then stopped (even if it never came up)."""
    try:
        yield stack.start()
    finally:
        stack.stop()


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


def stream_marking_progress(
    client: httpx.Client, body: dict, first_token: threading.Event, finished: threading.Event
) -> tuple[str, str | None]:
    """POST a streaming /v1/completions with one choice; returns (text, finish reason), setting first_token
    at its first text (or its end) and finished at its end. An error event fails it with the error."""
    text, finish = [], None
    try:
        with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
            assert response.status_code == 200, response.read()
            for line in response.iter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                assert "error" not in event, f"the stream ended in an error: {event['error']}"
                (choice,) = event["choices"]
                if choice["text"]:
                    text.append(choice["text"])
                    first_token.set()
                finish = choice["finish_reason"] or finish
    finally:
        first_token.set()
        finished.set()
    return "".join(text), finish


def stream_completion(
    client: httpx.Client, body: dict, headers: dict | None = None
) -> tuple[str, int, str | None]:
    """POST a streaming /v1/completions; returns (text, number of chunks with text, finish reason)."""
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


def sse_lines(text: str) -> list[str]:
    """The lines of an event stream, as SSE ends them: at \\r\\n, \\r or \\n only (str.splitlines also ends a
    line at \\x85, \\u2028 and others, which the JSON of a generated text may hold unescaped)."""
    return re.split(r"\r\n|\r|\n", text)
