"""`pagedserve serve`: the whole stack (worker(s), scheduler, gateway) as local processes on loopback.

The model is resolved (a GGUF converted) once here, so every child loads the same folder. Children
inherit stdout/stderr, so their JSON log lines (each carrying its "service") come out of this one
terminal. Each child runs in its own process group, so stopping one also stops anything it started;
on Ctrl-C or SIGTERM the stack drains: the gateway and the scheduler get SIGTERM first (they refuse
new requests and let the running ones finish, up to --shutdown-timeout), the workers only once the
scheduler is gone, and anything still alive after the grace period gets SIGKILL.

Once the stack serves, a child that dies is started again with the same arguments after a backoff
that doubles with each restart in the last minute (a worker keeps its worker id and registers again;
meanwhile the scheduler moves its requests to the other workers); a child that dies more often than
--max-restarts-per-minute stops the stack, and the launcher exits non-zero. A death during start-up
stops it at once.

Only members of the cluster may call the scheduler and the workers: the children share a cluster
token (the one configured, else a random one made here), passed through their environment, never on
a command line. With --internal-tls the links between the processes are also mutual TLS under a
throwaway CA generated at start.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedserve.gateway.reasoning import PARSERS as REASONING_PARSERS
from pagedserve.gateway.tool_calls import PARSERS
from pagedserve.logging import configure_logging, get_logger
from pagedserve.speculative import parse_speculative_config
from pagedserve.worker_svc.config import (
    DEFAULT_DETERMINISTIC,
    DEFAULT_GPU_MEMORY_UTILIZATION,
    QUANTIZATION_CHOICES,
)

if TYPE_CHECKING:
    from pagedserve.grpc_utils import ClusterAuth

log = get_logger("pagedserve.launcher")

LOOPBACK = "127.0.0.1"
# The window --max-restarts-per-minute counts restarts in, and the longest wait before a restart.
RESTART_WINDOW_S = 60.0
MAX_RESTART_BACKOFF_S = 30.0


def python_command(*args: str) -> list[str]:
    """This interpreter's command line for a child process (`-m module ...` or `-c code ...`).

    NOTE: -P keeps the working directory off sys.path. `python -m` and `-c` put it first, and from
    the repository root its kernels/ folder would then be what `import kernels` finds: transformers
    imports the Hugging Face kernels package by that name once it is installed (transformers 5
    depends on it), and got our folder instead. Our own layers are imported only as
    pagedserve.<layer>, which the install maps to those folders from any directory."""
    return [sys.executable, "-P", *args]


def cli_command(*args: str) -> list[str]:
    """`pagedserve <args>` in a child process."""
    return python_command("-m", "pagedserve.cli", *args)


@dataclass(slots=True)
class LaunchConfig:
    # Model: a folder, a .gguf file, or None for the default model.
    model: str | None
    # Where the gateway listens (HTTP and public gRPC).
    host: str
    port: int
    grpc_port: int
    # Worker processes to start.
    workers: int
    # Ranks each worker shards the model over (processes of its own, one GPU each on CUDA).
    tensor_parallel_size: int
    # Passed through to the workers.
    dtype: str
    quantization: str
    device: str
    kv_cache_memory: str | None
    num_blocks: int | None
    gpu_memory_utilization: float
    threads: int | None
    deterministic: bool | None  # None: the worker's default (see worker_svc.config)
    # Passed through to the gateway (None: no authentication); api_keys: more keys, one per tenant.
    api_key: str | None
    api_keys: str | None
    # Passed through to the scheduler (and the workers, for max_model_len and block_size).
    max_model_len: int | None
    max_num_seqs: int | None
    max_num_batched_tokens: int | None
    block_size: int
    # The scheduler's Engine port on loopback; 0 picks a free one.
    scheduler_port: int
    # Start the gateway (off: scheduler and workers only, e.g. for Engine clients).
    gateway: bool
    # Seconds to wait for every process to report healthy.
    startup_timeout: float
    # Seconds between SIGTERM and SIGKILL when stopping (on top of shutdown_timeout).
    stop_timeout: float
    # Seconds the gateway and scheduler let running requests finish after SIGTERM.
    shutdown_timeout: float
    # Most waiting requests over all workers (the scheduler's bound); None: its default.
    max_queued_requests: int | None
    # Mutual TLS between the processes under a CA generated for this run.
    internal_tls: bool
    # File holding the cluster token the children share (None: PAGEDSERVE_CLUSTER_TOKEN, else a random one).
    cluster_token_file: str | None
    # Restarts of one child within a minute before the stack stops instead (0: never restart).
    max_restarts_per_minute: int
    # Seconds before a child's first restart; doubles with each restart of it in the last minute.
    restart_backoff: float
    log_level: str
    # The format the model writes tool calls in (the gateway's --tool-call-parser); None: the gateway's default.
    tool_call_parser: str | None = None
    # Speculative decoding, vLLM's JSON (the scheduler's --speculative-config); None: off.
    speculative_config: str | None = None
    # The format of a thinking model's reasoning (the gateway's --reasoning-parser); None: no reasoning parsed.
    reasoning_parser: str | None = None
    # Responses API objects the gateway keeps (its --max-stored-responses); None: the gateway's default.
    max_stored_responses: int | None = None


def build_parser() -> argparse.ArgumentParser:
    env = os.environ
    parser = argparse.ArgumentParser(
        prog="pagedserve serve",
        description="Start worker(s), scheduler and gateway as local processes and serve until Ctrl-C.",
    )
    parser.add_argument("--model", default=env.get("PAGEDSERVE_MODEL"), help="folder, .gguf, or default")
    parser.add_argument("--host", default=LOOPBACK, help="gateway address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="gateway HTTP port (OpenAI API)")
    parser.add_argument("--grpc-port", type=int, default=50051, help="gateway public gRPC port")
    parser.add_argument("--workers", type=int, default=1, help="worker processes")
    parser.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="ranks each worker shards the model over (one GPU each on CUDA; CPU processes with gloo)",
    )
    parser.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16")
    parser.add_argument(
        "--quantization",
        default="auto",
        choices=QUANTIZATION_CHOICES,
        help="quantized checkpoints: auto (GPTQ, AWQ and compressed-tensors kept quantized, a GGUF dequantized), gguf (a GGUF kept quantized), none (dequantized)",
    )
    parser.add_argument("--device", default="auto", help="worker torch device")
    parser.add_argument("--kv-cache-memory", default=None, help="KV pool budget per worker, e.g. 2GiB")
    parser.add_argument("--num-blocks", type=int, default=None, help="exact KV blocks per worker")
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=DEFAULT_GPU_MEMORY_UTILIZATION,
        help="on CUDA, the share of each GPU the workers on it may hold (split among workers sharing one)",
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads per worker (default: the cores shared out)"
    )
    parser.add_argument(
        "--deterministic",
        action=argparse.BooleanOptionalAction,
        default=DEFAULT_DETERMINISTIC,
        help="batch-invariant worker kernels: a request's tokens do not depend on the rest of the batch, on "
        "chunking or on a recompute after a worker failure (default: on where it costs at most 3 %%: CPU "
        "workers in bfloat16 with AMX, unquantized weights)",
    )
    parser.add_argument("--api-key", default=env.get("PAGEDSERVE_API_KEY"), help="required bearer token")
    parser.add_argument(
        "--api-keys", default=env.get("PAGEDSERVE_API_KEYS"), help="comma-separated keys, one per tenant"
    )
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument(
        "--speculative-config",
        default=env.get("PAGEDSERVE_SPECULATIVE_CONFIG"),
        help='speculative decoding as vLLM takes it, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'',
    )
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--scheduler-port", type=int, default=0, help="internal Engine port (0: free)")
    parser.add_argument(
        "--gateway", action=argparse.BooleanOptionalAction, default=True, help="start the gateway"
    )
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument("--stop-timeout", type=float, default=10.0, help="SIGKILL this long after the drain")
    parser.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds running requests may finish after SIGTERM",
    )
    parser.add_argument("--max-queued-requests", type=int, default=None, help="bound of the waiting queue")
    parser.add_argument(
        "--internal-tls",
        action="store_true",
        help="mutual TLS between gateway, scheduler and workers (throwaway CA generated at start)",
    )
    parser.add_argument(
        "--cluster-token-file",
        default=env.get("PAGEDSERVE_CLUSTER_TOKEN_FILE") or None,
        help="file holding the token the processes share (default: PAGEDSERVE_CLUSTER_TOKEN, else random)",
    )
    parser.add_argument(
        "--max-restarts-per-minute",
        type=int,
        default=5,
        help="restarts of one process within a minute before the whole stack stops (0: never restart)",
    )
    parser.add_argument(
        "--restart-backoff",
        type=float,
        default=1.0,
        help="seconds before a process that died starts again; doubles with each restart in the last minute",
    )
    parser.add_argument("--log-level", default=env.get("PAGEDSERVE_LOG_LEVEL", "info"))
    parser.add_argument(
        "--tool-call-parser", choices=PARSERS, default=None, help="format of the model's tool calls (gateway)"
    )
    parser.add_argument(
        "--reasoning-parser",
        choices=REASONING_PARSERS,
        default=None,
        help="format of a thinking model's reasoning: deepseek_r1 or qwen3 (gateway)",
    )
    parser.add_argument(
        "--max-stored-responses",
        type=int,
        default=None,
        help="Responses API objects the gateway keeps for previous_response_id (gateway)",
    )
    return parser


def free_port(host: str = LOOPBACK) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the child before exec: its own process group, and SIGTERM when the launcher dies (Linux)."""
    os.setpgid(0, 0)
    if sys.platform == "linux":
        import ctypes

        with contextlib.suppress(Exception):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@dataclass(slots=True)
class Child:
    # Its name in logs ("scheduler", "worker-0", "gateway").
    name: str
    # Its `pagedserve` arguments, the same at every restart.
    args: list[str]
    # The running process; None while a restart is pending.
    process: subprocess.Popen | None = None
    # When (time.monotonic) it was restarted, within the last RESTART_WINDOW_S.
    restarts: deque[float] = field(default_factory=deque)
    # When (time.monotonic) its pending restart is due.
    restart_at: float | None = None


class TooManyRestarts(RuntimeError):
    pass


class Supervisor:
    """The child processes: started in order, restarted when they die (supervise()), stopped in reverse."""

    def __init__(
        self,
        stop_timeout: float,
        max_restarts_per_minute: int = 5,
        restart_backoff: float = 1.0,
        env: Mapping[str, str] | None = None,
        command: Callable[..., list[str]] = cli_command,
    ):
        self.stop_timeout = stop_timeout
        self.max_restarts_per_minute = max_restarts_per_minute
        self.restart_backoff = restart_backoff
        self.env = dict(os.environ if env is None else env)
        self.command = command
        self.children: dict[str, Child] = {}

    def start(self, name: str, args: Sequence[str]) -> None:
        child = Child(name, list(args))
        self.children[name] = child
        self._spawn(child)

    def _spawn(self, child: Child) -> None:
        command = self.command(*child.args)
        child.process = subprocess.Popen(command, env=self.env, preexec_fn=_die_with_parent)
        child.restart_at = None
        log.info("started", process=child.name, pid=child.process.pid, command=" ".join(command))

    def first_dead(self) -> tuple[str, int] | None:
        for child in self.children.values():
            code = None if child.process is None else child.process.poll()
            if code is not None:
                return child.name, code
        return None

    def supervise(self, now: float | None = None) -> None:
        """Notice children that died, schedule their restarts, start the ones due. Raises TooManyRestarts
        when a child dies with --max-restarts-per-minute restarts already in the last minute."""
        now = time.monotonic() if now is None else now
        for child in self.children.values():
            while child.restarts and now - child.restarts[0] > RESTART_WINDOW_S:
                child.restarts.popleft()
            if child.process is not None and (code := child.process.poll()) is not None:
                self._died(child, code, now)
            if child.process is None and child.restart_at is not None and now >= child.restart_at:
                child.restarts.append(now)
                self._spawn(child)
                log.warning("restarted", process=child.name, restarts_in_last_minute=len(child.restarts))

    def _died(self, child: Child, code: int, now: float) -> None:
        assert child.process is not None
        pid = child.process.pid
        # Whatever it started in its group goes with it.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
        child.process = None
        recent = len(child.restarts)
        if recent >= self.max_restarts_per_minute:
            log.error("exited", process=child.name, pid=pid, code=code, restarts_in_last_minute=recent)
            raise TooManyRestarts(
                f"{child.name} exited with code {code} after {recent} restart(s) in the last minute "
                f"(--max-restarts-per-minute {self.max_restarts_per_minute}); stopping the stack"
            )
        delay = min(self.restart_backoff * 2**recent, MAX_RESTART_BACKOFF_S)
        child.restart_at = now + delay
        log.warning("exited", process=child.name, pid=pid, code=code, restart_in_seconds=delay)

    def stop(self, first: Sequence[str] = (), drain_timeout: float = 0.0) -> None:
        """SIGTERM the children named in `first` and give them drain_timeout (+ stop_timeout) to exit,
        then the others; SIGKILL whatever outlives its grace period."""
        for child in self.children.values():
            child.restart_at = None
        running = [(c.name, c.process) for c in reversed(self.children.values()) if c.process is not None]
        early = [(n, p) for n, p in running if n in first]
        late = [(n, p) for n, p in running if n not in first]
        if early:
            self._terminate(early, drain_timeout + self.stop_timeout)
        self._terminate(late, self.stop_timeout)
        # Anything a child left in its group (its own children) goes too.
        for _name, process in running:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)

    def _terminate(self, children: list[tuple[str, subprocess.Popen]], timeout: float) -> None:
        live = [(name, p) for name, p in children if p.poll() is None]
        for _name, process in live:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for name, process in live:
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("killing", process=name, after_seconds=timeout)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()


class _Stop(Exception):
    pass


def _engine_ready(address: str, workers: int, tls, auth) -> bool:
    """The scheduler is SERVING and all `workers` registered."""
    from pagedserve.grpc_utils import check_health, open_channel
    from pagedserve.v1 import engine_pb2, engine_pb2_grpc

    async def probe() -> bool:
        if not await check_health(address, timeout=1.0, tls=tls):
            return False
        async with open_channel(address, tls, auth=auth) as channel:
            response = await engine_pb2_grpc.EngineServiceStub(channel).GetEngineInfo(
                engine_pb2.GetEngineInfoRequest(), timeout=1.0
            )
            return response.info.num_healthy_workers >= workers

    try:
        return asyncio.run(probe())
    except Exception:
        return False


def _http_ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _wait_until(ready, supervisor: Supervisor, what: str, deadline: float) -> None:
    while not ready():
        dead = supervisor.first_dead()
        if dead is not None:
            raise RuntimeError(f"{dead[0]} exited with code {dead[1]} while waiting for {what}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not healthy after the startup timeout")
        time.sleep(0.25)


def worker_threads(threads: int | None, workers: int) -> int | None:
    """Torch threads for each of `workers` workers on this machine: `threads` when given; with several
    workers, the cores this process may run on shared out among them; else None (torch's default, one
    thread per core).

    NOTE: each worker's default is one OpenMP thread per core, so N workers on one machine would start N
    threads per core, and every barrier of a forward pass then waits for a thread the kernel has taken off
    its core (docs/performance.md has the measurement).
    """
    if threads is not None or workers == 1:
        return threads
    return max(1, len(os.sched_getaffinity(0)) // workers)


def gpu_placement(
    device: str, workers: int, utilization: float, device_count: Callable[[], int]
) -> list[tuple[str, float | None]]:
    """Each worker's --device and --gpu-memory-utilization. `cuda` (and `auto` with several workers, where
    CUDA devices are visible) places the workers round robin over the visible GPUs, and workers that share
    a GPU split its utilization evenly, so that each sizes its KV pool from its own share rather than from
    whatever the others left free. A named device (cuda:1, cpu) is every worker's, a named GPU's share split
    among them the same way; None: the flag's default."""
    if device not in ("cuda", "auto") or (device == "auto" and workers == 1):
        return [(device, utilization / workers if device.startswith("cuda") else None)] * workers
    count = device_count()
    if count == 0:
        return [(device, None)] * workers
    per_gpu = [len(range(g, workers, count)) for g in range(count)]
    return [(f"cuda:{i % count}", utilization / per_gpu[i % count]) for i in range(workers)]


def _cuda_device_count() -> int:
    import torch

    return torch.cuda.device_count()


def _tls_args(certs, server: bool) -> list[str]:
    if certs is None:
        return []
    args = ["--tls-cert", str(certs.cert), "--tls-key", str(certs.key), "--tls-ca", str(certs.ca)]
    return [*args, "--tls-require-client-cert"] if server else args


def _child_args(config: LaunchConfig, model_dir: str, engine_address: str, scheduler_port: int, certs=None):
    level = ["--log-level", config.log_level]
    scheduler = ["scheduler", "--model", model_dir, "--host", LOOPBACK, "--port", str(scheduler_port)]
    scheduler += ["--block-size", str(config.block_size), *level, *_tls_args(certs, server=True)]
    scheduler += ["--shutdown-timeout", str(config.shutdown_timeout)]
    for flag, value in [
        ("--max-model-len", config.max_model_len),
        ("--max-num-seqs", config.max_num_seqs),
        ("--max-num-batched-tokens", config.max_num_batched_tokens),
        ("--max-queued-requests", config.max_queued_requests),
        ("--speculative-config", config.speculative_config),
    ]:
        if value is not None:
            scheduler += [flag, str(value)]
    workers = []
    tp = config.tensor_parallel_size
    # A worker's ranks take the GPUs after its own (cuda:k..k+tp-1): placed as tp workers each, it gets the
    # first of its ranks' places.
    placement = gpu_placement(
        config.device, config.workers * tp, config.gpu_memory_utilization, _cuda_device_count
    )[::tp]
    for i, (device, utilization) in enumerate(placement):
        worker = ["worker", "--model", model_dir, "--host", LOOPBACK, "--port", "0"]
        worker += ["--scheduler", engine_address, "--worker-id", f"worker-{i}", "--dtype", config.dtype]
        worker += ["--quantization", config.quantization]
        worker += ["--device", device, "--block-size", str(config.block_size), *level]
        worker += _tls_args(certs, server=True)
        if config.deterministic is not None:
            worker += ["--deterministic" if config.deterministic else "--no-deterministic"]
        for flag, value in [
            ("--gpu-memory-utilization", utilization),
            ("--kv-cache-memory", config.kv_cache_memory),
            ("--num-blocks", config.num_blocks),
            ("--threads", worker_threads(config.threads, config.workers * tp)),
            ("--max-model-len", config.max_model_len),
            ("--tensor-parallel-size", tp if tp != 1 else None),
        ]:
            if value is not None:
                worker += [flag, str(value)]
        workers.append(worker)
    gateway = ["gateway", "--host", config.host, "--port", str(config.port)]
    gateway += ["--grpc-port", str(config.grpc_port), "--scheduler", engine_address, "--model", model_dir]
    if config.api_key:
        gateway += ["--api-key", config.api_key]
    if config.api_keys:
        gateway += ["--api-keys", config.api_keys]
    if config.tool_call_parser:
        gateway += ["--tool-call-parser", config.tool_call_parser]
    if config.reasoning_parser:
        gateway += ["--reasoning-parser", config.reasoning_parser]
    if config.max_stored_responses is not None:
        gateway += ["--max-stored-responses", str(config.max_stored_responses)]
    gateway += ["--shutdown-timeout", str(config.shutdown_timeout), *_tls_args(certs, server=False), *level]
    return scheduler, workers, gateway


def cluster_environment(
    auth: ClusterAuth, env: Mapping[str, str] | None = None
) -> tuple[dict[str, str], ClusterAuth]:
    """The children's environment carrying the cluster token (auth's, else a new random one), and the
    ClusterAuth the launcher itself calls with.

    NOTE: through the environment, not a flag: a process's command line is visible to every user of
    the machine (ps), its environment only to its owner."""
    from pagedserve.grpc_utils import CLUSTER_TOKEN_ENV, ClusterAuth

    if auth.token is None:
        auth = ClusterAuth(secrets.token_urlsafe(32))
    children = dict(os.environ if env is None else env)
    children.pop("PAGEDSERVE_CLUSTER_TOKEN_FILE", None)
    children[CLUSTER_TOKEN_ENV] = auth.token
    return children, auth


def serve(config: LaunchConfig) -> int:
    from pagedserve.grpc_utils import PLAINTEXT, ClusterAuth, TLSConfig
    from pagedserve.model_files import model_name, resolve_model

    try:
        child_env, auth = cluster_environment(ClusterAuth.load(config.cluster_token_file))
    except ValueError as error:
        log.error("startup failed", error=str(error))
        return 1
    model_dir = str(resolve_model(config.model))
    scheduler_port = config.scheduler_port or free_port()
    engine_address = f"{LOOPBACK}:{scheduler_port}"
    with_gateway = config.gateway

    certs, tls, tls_dir = None, PLAINTEXT, None
    if config.internal_tls:
        from pagedserve.internal_tls import generate

        tls_dir = tempfile.mkdtemp(prefix="pagedserve-tls-")
        certs = generate(tls_dir)
        tls = TLSConfig(str(certs.cert), str(certs.key), str(certs.ca))
    scheduler_args, worker_args, gateway_args = _child_args(
        config, model_dir, engine_address, scheduler_port, certs
    )

    def on_signal(signum, _frame):
        raise _Stop(signal.Signals(signum).name)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    supervisor = Supervisor(
        config.stop_timeout, config.max_restarts_per_minute, config.restart_backoff, env=child_env
    )
    try:
        supervisor.start("scheduler", scheduler_args)
        for i, args in enumerate(worker_args):
            supervisor.start(f"worker-{i}", args)
        if with_gateway:
            supervisor.start("gateway", gateway_args)
        deadline = time.monotonic() + config.startup_timeout
        _wait_until(
            lambda: _engine_ready(engine_address, config.workers, tls, auth),
            supervisor,
            "scheduler+workers",
            deadline,
        )
        http_host = LOOPBACK if config.host in ("0.0.0.0", "::", "") else config.host
        if with_gateway:
            _wait_until(
                lambda: _http_ready(f"http://{http_host}:{config.port}/ready"),
                supervisor,
                "gateway",
                deadline,
            )
        lines = [f"pagedserve is ready: {model_name(model_dir)} on {config.workers} worker(s)"]
        if with_gateway:
            lines.append(f"  OpenAI API:  http://{http_host}:{config.port}/v1")
            lines.append(f"  gRPC API:    {http_host}:{config.grpc_port}")
        membership = f"mutual TLS, certificates in {tls_dir}" if certs else "cluster token"
        lines.append(f"  Engine:      {engine_address} (internal; members only: {membership})")
        lines.append("Press Ctrl-C to stop.")
        print("\n".join(lines), flush=True)
        while True:
            supervisor.supervise()
            time.sleep(0.2)
    except _Stop as stop:
        log.info("stopping", signal=str(stop))
        return 0
    except TooManyRestarts as error:
        log.error("restart limit reached", error=str(error))
        return 1
    except (RuntimeError, TimeoutError) as error:
        log.error("startup failed", error=str(error))
        return 1
    finally:
        # A second Ctrl-C while stopping must not leave children behind.
        for s in previous:
            signal.signal(s, signal.SIG_IGN)
        # NOTE: the workers stop last: requests still running when the drain starts need them.
        supervisor.stop(first=("gateway", "scheduler"), drain_timeout=config.shutdown_timeout)
        for s, handler in previous.items():
            signal.signal(s, handler)
        if tls_dir is not None:
            shutil.rmtree(tls_dir, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging("launcher", args.log_level)
    if args.workers < 1 or args.tensor_parallel_size < 1:
        print("pagedserve serve: --workers and --tensor-parallel-size must be at least 1", file=sys.stderr)
        return 2
    if args.max_restarts_per_minute < 0 or args.restart_backoff < 0:
        print(
            "pagedserve serve: --max-restarts-per-minute and --restart-backoff must not be negative",
            file=sys.stderr,
        )
        return 2
    try:
        spec = parse_speculative_config(args.speculative_config)
    except ValueError as error:
        print(f"pagedserve serve: {error}", file=sys.stderr)
        return 2
    if spec is not None and spec.num_draft_layers and args.tensor_parallel_size > 1:
        print(
            "pagedserve serve: speculative_config method draft_layers is not supported with "
            "--tensor-parallel-size > 1",
            file=sys.stderr,
        )
        return 2
    return serve(LaunchConfig(**vars(args)))
