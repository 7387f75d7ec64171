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
from pagedserve.speculative import SpeculativeConfig, parse_speculative_config
from pagedserve.validation import Limits

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
    # Most sequences waiting over all workers (a request counts its n) before new ones are refused
    # (RESOURCE_EXHAUSTED).
    max_queued_requests: int = 4096
    # Most tokens waiting over all workers, each waiting sequence counting its prompt plus max_tokens,
    # before new requests are refused (RESOURCE_EXHAUSTED): 4096 sequences of 1024 tokens.
    max_queued_tokens: int = 4096 * 1024
    # Plans sent to a worker before its first result comes back (2: plan N+1 overlaps step N).
    max_inflight_plans: int = 2
    # Seconds a request waits for a worker to (re)register when no worker is healthy, then fails.
    worker_wait_timeout: float = 60.0
    # Worker failures (stream broken, or a step past its deadline) a request may be requeued after, counting
    # those where it was in a step in flight; at the next it fails, naming the last failure.
    max_requeues: int = 2
    # A step whose result has not come back step_timeout + step_timeout_per_token x its tokens seconds
    # after it started means a hung worker, treated as a dead one. NOTE: an 8B model costs about 16
    # GFLOP a token, so 0.5 s a token allows 32 GFLOP/s, below what two AVX2 cores sustain: a
    # 2048-token prefill of an 8B model on CPU gets 60 + 1024 s.
    step_timeout: float = 60.0
    step_timeout_per_token: float = 0.5
    # Seconds a failed worker has to come back (answer Reset) before it is retired: closed and forgotten.
    worker_retire_timeout: float = 300.0
    # Seconds of pending work with no step completed after which EngineInfo.stalled is set.
    progress_deadline: float = 300.0
    # Most cache salts holding cached blocks, per worker (their prefix-trie roots; see SchedulerConfig).
    max_cache_salts: int = 1024
    # Seconds SIGTERM waits for running requests to finish (new ones are refused meanwhile).
    shutdown_timeout: float = 30.0
    # Seconds a structured-output constraint may take to compile; past it that request fails (400) and the
    # compile is abandoned. Compiled constraints kept, least recently used out first; compiles at once.
    structured_output_compile_timeout: float = 10.0
    structured_output_cache_size: int = 256
    structured_output_compile_threads: int = 2
    # Speculative decoding, vLLM's JSON ({"method": "ngram", "num_speculative_tokens": k, ...}); None: off.
    speculative_config: str | None = None
    # Logging level, and JSON (True) or console output.
    log_level: str = "info"
    log_json: bool = True

    def __post_init__(self) -> None:
        if self.scheduling_policy not in POLICIES:
            raise ValueError(f"scheduling_policy must be one of {POLICIES}, not {self.scheduling_policy!r}")
        positive = (
            "max_num_seqs", "max_num_batched_tokens", "block_size", "max_queued_requests", "max_queued_tokens",
            "max_cache_salts", "step_timeout", "worker_retire_timeout", "progress_deadline",
            "structured_output_compile_timeout", "structured_output_cache_size",
            "structured_output_compile_threads",
        )  # fmt: skip
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, not {getattr(self, name)}")
        for name in ("max_requeues", "step_timeout_per_token"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative, not {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, not {self.max_model_len}")
        if not 1 <= self.max_inflight_plans <= 8:
            raise ValueError(f"max_inflight_plans must be in 1..8, not {self.max_inflight_plans}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in 0..65535, not {self.port}")
        if self.shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must not be negative, not {self.shutdown_timeout}")
        self.tls  # noqa: B018 -- checks the TLS flags go together and the files exist
        self.speculative  # noqa: B018 -- a bad configuration fails at start, naming the field

    @property
    def speculative(self) -> SpeculativeConfig | None:
        return parse_speculative_config(self.speculative_config)

    @property
    def limits(self) -> Limits:
        """What a request reaching the Engine may ask for (pagedserve.validation): n up to the batch size."""
        return Limits(max_n=self.max_num_seqs)

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
    add(
        "--max-queued-requests",
        int,
        "most waiting sequences (n each) before new ones are refused",
        default=4096,
    )
    add(
        "--max-queued-tokens",
        int,
        "most waiting tokens (n x (prompt + max_tokens)) before new requests are refused",
        default=4096 * 1024,
    )
    add("--max-inflight-plans", int, "plans in flight per worker (2: pipelined)", default=2)
    add("--worker-wait-timeout", float, "seconds a request waits for a worker when none is up", default=60.0)
    add("--max-requeues", int, "worker failures a request is requeued after, then it fails", default=2)
    add(
        "--step-timeout",
        float,
        "seconds a step may take before its worker counts as hung (plus per token)",
        default=60.0,
    )
    add("--step-timeout-per-token", float, "seconds more a step may take per token it computes", default=0.5)
    add(
        "--worker-retire-timeout",
        float,
        "seconds a failed worker has to come back before it is forgotten",
        default=300.0,
    )
    add(
        "--progress-deadline",
        float,
        "seconds of pending work with no step done before EngineInfo.stalled",
        default=300.0,
    )
    add("--max-cache-salts", int, "most cache salts with cached blocks, per worker", default=1024)
    add("--shutdown-timeout", float, "seconds SIGTERM waits for running requests", default=30.0)
    add(
        "--structured-output-compile-timeout",
        float,
        "seconds a structured-output constraint may take to compile before its request fails",
        default=10.0,
    )
    add("--structured-output-cache-size", int, "compiled structured-output constraints kept", default=256)
    add("--structured-output-compile-threads", int, "constraints compiled at once", default=2)
    add(
        "--speculative-config",
        str,
        'speculative decoding as vLLM takes it, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'',
    )
    add_tls_arguments(add, add_bool)
    add("--log-level", str, "debug, info, warning, error", default="info")
    add_bool("--log-json", "JSON log lines (--no-log-json: console)", True)
    return parser
