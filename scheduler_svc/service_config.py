"""The scheduler service's configuration: one dataclass, built from CLI flags and PAGEDSERVE_* variables.

Every flag `--some-flag` has an environment variable `PAGEDSERVE_SOME_FLAG`; the flag wins over the
variable, the variable over the default. The per-worker scheduler core gets its own `SchedulerConfig`
from this one plus what each worker reports when it registers (its number of blocks).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pagedserve.flags import EnvFlags
from pagedserve.grpc_utils import ServiceTLSFields, add_tls_arguments

POLICIES = ("fcfs", "priority")


@dataclass(slots=True)
class SchedulerServiceConfig(ServiceTLSFields):
    # TLS (inherited): on the EngineService and on the channels to workers.

    # Model: a folder, a .gguf file, or None / "default" for the default model. Only its tokenizer's
    # special tokens and generation config are read here, never the weights.
    model: str | None = None
    # Where the EngineService gRPC service listens; port 0 picks a free one.
    host: str = "0.0.0.0"
    port: int = 50052
    # Longest sequence in tokens (prompt plus output); None: the model's own.
    max_model_len: int | None = None
    # Most sequences in one step's batch, per worker.
    max_num_seqs: int = 256
    # Most tokens computed in one step, per worker (long prefills are chunked to fit).
    max_num_batched_tokens: int = 2048
    # Tokens per KV block; workers registering with another block size are refused.
    block_size: int = 16
    # Reuse the KV blocks of shared prompt prefixes.
    enable_prefix_caching: bool = True
    # "fcfs" or "priority" (lower priority value runs first, ties first come, first served).
    scheduling_policy: str = "fcfs"
    # Most requests waiting over all workers before new ones are refused (RESOURCE_EXHAUSTED).
    max_queued_requests: int = 4096
    # Plans sent to a worker before its first result comes back (2: plan N+1 overlaps step N).
    max_inflight_plans: int = 2
    # Seconds a request waits for a worker to (re)register when no worker is healthy, then fails.
    worker_wait_timeout: float = 60.0
    # Seconds SIGTERM waits for running requests to finish (new ones are refused meanwhile).
    shutdown_timeout: float = 30.0
    # Logging level, and JSON (True) or console output.
    log_level: str = "info"
    log_json: bool = True

    def __post_init__(self) -> None:
        if self.scheduling_policy not in POLICIES:
            raise ValueError(f"scheduling_policy must be one of {POLICIES}, not {self.scheduling_policy!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "max_queued_requests"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, not {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, not {self.max_model_len}")
        if not 1 <= self.max_inflight_plans <= 8:
            raise ValueError(f"max_inflight_plans must be in 1..8, not {self.max_inflight_plans}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in 0..65535, not {self.port}")
        if self.shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must not be negative, not {self.shutdown_timeout}")
        self.tls  # noqa: B018 -- checks the TLS flags go together and the files exist

    @classmethod
    def from_args(
        cls, argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None
    ) -> SchedulerServiceConfig:
        args = build_parser(os.environ if env is None else env).parse_args(argv)
        return cls(**vars(args))


def build_parser(env: Mapping[str, str]) -> argparse.ArgumentParser:
    """The `pagedserve scheduler` flags, each defaulting to its PAGEDSERVE_* variable."""
    parser = argparse.ArgumentParser(
        prog="pagedserve scheduler",
        description="Serve the EngineService gRPC service: block tables, prefix cache, continuous batching.",
    )

    flags = EnvFlags(parser, env)
    add, add_bool = flags.add, flags.add_bool

    add("--model", str, "model folder, .gguf file, or 'default' (tokenizer and generation config only)")
    add("--host", str, "address to listen on", default="0.0.0.0")
    add("--port", int, "port to listen on; 0 picks a free one", default=50052)
    add("--max-model-len", int, "longest sequence in tokens (default: the model's)")
    add("--max-num-seqs", int, "most sequences per step, per worker", default=256)
    add("--max-num-batched-tokens", int, "most tokens per step, per worker", default=2048)
    add("--block-size", int, "tokens per KV block (workers must match)", default=16)
    add_bool("--enable-prefix-caching", "reuse KV blocks of shared prompt prefixes", True)
    add("--scheduling-policy", str, "fcfs or priority", default="fcfs", choices=POLICIES)
    add("--max-queued-requests", int, "most waiting requests before new ones are refused", default=4096)
    add("--max-inflight-plans", int, "plans in flight per worker (2: pipelined)", default=2)
    add("--worker-wait-timeout", float, "seconds a request waits for a worker when none is up", default=60.0)
    add("--shutdown-timeout", float, "seconds SIGTERM waits for running requests", default=30.0)
    add_tls_arguments(add, add_bool)
    add("--log-level", str, "debug, info, warning, error", default="info")
    add_bool("--log-json", "JSON log lines (--no-log-json: console)", True)
    return parser
