"""The worker's configuration: one dataclass, built from CLI flags and PAGEDSERVE_* variables in one place.

Every flag `--some-flag` has an environment variable `PAGEDSERVE_SOME_FLAG`; the flag wins over the
variable, the variable over the default (so a container sets variables, a developer types flags).
"""

from __future__ import annotations

import argparse
import os
import re
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pagedserve.flags import EnvFlags
from pagedserve.grpc_utils import ServiceTLSFields, add_tls_arguments

# On CUDA: the share of the device's memory a worker may hold in all (--gpu-memory-utilization, vLLM's name
# and default), of which the KV pool takes what the weights and the forward pass's activations leave.
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
# On CUDA: decode batches up to this many sequences replay captured CUDA graphs.
DEFAULT_MAX_CUDAGRAPH_CAPTURE_SIZE = 256
# Batch-invariant kernels (--deterministic; vLLM's VLLM_BATCH_INVARIANT): a request's tokens are the same
# whatever runs beside it, however its prompt is chunked and after a recompute. None: on where its cost was
# measured within 3 % (assembly.default_deterministic; docs/performance.md, "Deterministic decoding"), off
# elsewhere; --deterministic / --no-deterministic decide.
DEFAULT_DETERMINISTIC: bool | None = None

DTYPES = ("auto", "float32", "bfloat16", "float16")
# --quantization: the checkpoint's own (auto), dequantized (none), or a method the checkpoint must have.
QUANTIZATION_CHOICES = ("auto", "none", "gguf", "gptq", "awq", "compressed-tensors")

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "ki": 1024,
    "kib": 1024,
    "mi": 1024**2,
    "mib": 1024**2,
    "gi": 1024**3,
    "gib": 1024**3,
    "ti": 1024**4,
    "tib": 1024**4,
}


def parse_bytes(text: str | int) -> int:
    """ "2GiB" -> 2147483648, "512MiB", "1.5GB", "1000" (bytes)."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([a-zA-Z]*)\s*", text)
    if match is None or match.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size in bytes: {text!r} (examples: 2GiB, 512MiB, 1000000)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


@dataclass(slots=True)
class WorkerConfig(ServiceTLSFields):
    # TLS (inherited): on the WorkerService and on the channel to the scheduler.

    # Model to serve: a folder, a .gguf file, or None for the default model (see pagedserve.model_files).
    model: str | None = None
    # Weights' and KV cache's dtype; "auto": bfloat16 on CUDA and where the CPU runs it faster
    # (loader.cpu_prefers_bf16), else float32.
    dtype: str = "auto"
    # Weights of a quantized checkpoint (GGUF, GPTQ, AWQ, compressed-tensors): "auto" keeps them quantized (the
    # activations in dtype), "none" dequantizes them at load; or the checkpoint's own method named ("gguf",
    # "gptq", "awq", "compressed-tensors").
    quantization: str = "auto"
    # torch device ("cpu", "cuda", "cuda:1"); "auto": cuda when available, else cpu.
    device: str = "auto"
    # Tokens per KV block.
    block_size: int = 16
    # KV pool budget in bytes (None: `num_blocks`, or a device-dependent default; see kv_cache.py).
    kv_cache_memory: int | None = None
    # Exact number of KV blocks; wins over kv_cache_memory.
    num_blocks: int | None = None
    # On CUDA: the share of the device's memory this worker may hold (see kv_cache.cuda_kv_budget).
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    # On CUDA: no CUDA graphs (every step runs eagerly); else plain decode steps of up to
    # max_cudagraph_capture_size sequences replay graphs captured at start (see cuda_graphs).
    enforce_eager: bool = False
    max_cudagraph_capture_size: int = DEFAULT_MAX_CUDAGRAPH_CAPTURE_SIZE
    # Batch-invariant kernels: every row's K, V and logits independent of its step (see kernels.ops.Ops).
    deterministic: bool | None = DEFAULT_DETERMINISTIC
    # Longest sequence in tokens; None: the model's own context length.
    max_model_len: int | None = None
    # torch intra-op threads for the forward pass (each rank's); None: torch's default (one per core), the
    # cores shared out among the ranks of a tensor-parallel group.
    threads: int | None = None
    # Processes (ranks) the model is sharded over, one device each on CUDA (see worker_svc/parallel.py).
    tensor_parallel_size: int = 1
    # Where the gRPC server listens; port 0 picks a free port.
    host: str = "0.0.0.0"
    port: int = 0
    # host:port the scheduler uses to reach this worker; None: derived from host and the bound port.
    advertise_address: str | None = None
    # Scheduler (EngineService) address to register with; None: don't register.
    scheduler: str | None = None
    # Stable id of this worker; None: "<hostname>-<pid>".
    worker_id: str | None = None
    # Seconds SIGTERM waits for the scheduler to move this worker's requests elsewhere and close its stream.
    drain_timeout: float = 30.0
    # Logging level, and JSON (True) or console output.
    log_level: str = "info"
    log_json: bool = True

    def __post_init__(self) -> None:
        self.tls  # noqa: B018 -- checks the TLS flags go together and the files exist
        self.cluster_auth  # noqa: B018 -- checks the cluster token file exists
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, not {self.dtype!r}")
        if self.quantization not in QUANTIZATION_CHOICES:
            raise ValueError(
                f"quantization must be one of {', '.join(QUANTIZATION_CHOICES)}, not {self.quantization!r}"
            )
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, not {self.block_size}")
        if self.num_blocks is not None and self.num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, not {self.num_blocks}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be positive, not {self.kv_cache_memory}")
        if self.max_cudagraph_capture_size <= 0:
            raise ValueError(
                f"max_cudagraph_capture_size must be positive, not {self.max_cudagraph_capture_size}"
            )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], not {self.gpu_memory_utilization}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, not {self.max_model_len}")
        if self.threads is not None and self.threads <= 0:
            raise ValueError(f"threads must be positive, not {self.threads}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be at least 1, not {self.tensor_parallel_size}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in 0..65535, not {self.port}")
        if self.drain_timeout < 0:
            raise ValueError(f"drain_timeout must not be negative, not {self.drain_timeout}")
        if self.worker_id is None:
            self.worker_id = f"{socket.gethostname()}-{os.getpid()}"

    @classmethod
    def from_args(
        cls, argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None
    ) -> WorkerConfig:
        args = build_parser(os.environ if env is None else env).parse_args(argv)
        return cls(**vars(args))

    def advertised(self, bound_port: int) -> str:
        """host:port the scheduler should dial."""
        if self.advertise_address:
            return self.advertise_address
        host = self.host
        if host in ("0.0.0.0", "::", "[::]", ""):
            host = _address_towards(self.scheduler) or socket.gethostname()
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return f"{host}:{bound_port}"


def _address_towards(peer: str | None) -> str | None:
    """This machine's address on the interface that routes to peer (host:port), or None.

    NOTE: a wildcard bind has no single address; the one the scheduler can dial back is the one its
    packets would come from. Connecting a UDP socket sends nothing but makes the kernel pick the
    route, which works the same in containers (the container's IP, not its short-id hostname) and on
    Kubernetes.
    """
    if not peer:
        return None
    host, _, port = peer.rpartition(":")
    host = host.strip("[]")
    try:
        infos = socket.getaddrinfo(host, int(port or 0), type=socket.SOCK_DGRAM)
        family, _, _, _, sockaddr = infos[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(sockaddr)
            return probe.getsockname()[0]
    except (OSError, ValueError, IndexError):
        return None


def build_parser(env: Mapping[str, str]) -> argparse.ArgumentParser:
    """The `pagedserve worker` flags, each defaulting to its PAGEDSERVE_* variable."""
    parser = argparse.ArgumentParser(
        prog="pagedserve worker",
        description="Serve a model's forward pass and sampling over the step protocol (gRPC WorkerService).",
    )

    flags = EnvFlags(parser, env)
    add = flags.add

    add("--model", str, "model folder, .gguf file, or 'default'")
    add("--dtype", str, "weights and KV cache dtype", default="auto", choices=DTYPES)
    add(
        "--quantization",
        str,
        "quantized checkpoint weights: auto (GPTQ, AWQ and compressed-tensors kept quantized, a GGUF dequantized), gguf (a GGUF kept quantized), none (dequantized)",
        default="auto",
        choices=QUANTIZATION_CHOICES,
    )
    add("--device", str, "torch device: auto, cpu, cuda, cuda:N", default="auto")
    add("--block-size", int, "tokens per KV block", default=16)
    add("--kv-cache-memory", parse_bytes, "KV pool budget, e.g. 2GiB, 512MiB, or bytes")
    add("--num-blocks", int, "exact number of KV blocks (overrides --kv-cache-memory)")
    add(
        "--gpu-memory-utilization",
        float,
        "on CUDA, the share of the device's memory this worker may hold in all (weights, activations, KV "
        "pool); the pool takes the rest of it unless --kv-cache-memory or --num-blocks sizes it",
        default=DEFAULT_GPU_MEMORY_UTILIZATION,
    )
    flags.add_bool("--enforce-eager", "on CUDA, run every step eagerly: no CUDA graphs", False)
    add(
        "--max-cudagraph-capture-size",
        int,
        "on CUDA, the largest decode batch captured as a CUDA graph",
        default=DEFAULT_MAX_CUDAGRAPH_CAPTURE_SIZE,
    )
    add("--max-model-len", int, "longest sequence in tokens (default: the model's)")
    flags.add_bool(
        "--deterministic",
        "batch-invariant kernels: a request's tokens do not depend on what runs beside it, on how its prompt "
        "is chunked or on a recompute after preemption or a failover (CPU kernels; see docs/kernels.md); by "
        "default on where it costs at most 3 %%: the CPU kernels in bfloat16 with AMX, unquantized weights",
        DEFAULT_DETERMINISTIC,
    )
    # NOTE: two threads win when the cores are free; when other processes share them, OpenMP's threads wait
    # on each other and one thread is steadier (docs/performance.md: several workers on one machine, and
    # "Measurements behind the code").
    add(
        "--threads",
        int,
        "torch intra-op threads (default: torch's, one per core; on 2 free cores, 2 vs 1 thread: "
        "decode 1.1-1.2x, prefill 1.7x faster)",
    )
    add(
        "--tensor-parallel-size",
        int,
        "processes (ranks) the model is sharded over, Megatron-style: one GPU each on CUDA (NCCL), or CPU "
        "processes (gloo); the group is one worker to the scheduler",
        default=1,
    )
    add("--host", str, "address to listen on", default="0.0.0.0")
    add("--port", int, "port to listen on; 0 picks a free one", default=0)
    add(
        "--advertise-address",
        str,
        "host:port the scheduler dials (default: this host's address on the route to the scheduler)",
    )
    add("--scheduler", str, "scheduler address (host:port) to register with")
    add("--worker-id", str, "stable worker id (default: hostname-pid)")
    add(
        "--drain-timeout",
        float,
        "seconds SIGTERM waits for the scheduler to move this worker's requests",
        default=30.0,
    )

    add_tls_arguments(add, flags.add_bool)
    add("--log-level", str, "debug, info, warning, error", default="info")
    flags.add_bool("--log-json", "JSON log lines (--no-log-json: console)", True)
    return parser
