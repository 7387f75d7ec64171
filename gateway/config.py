"""The gateway's one config object, from CLI flags, PAGEDSERVE_* environment variables and defaults.

Precedence: flag, then environment variable, then default.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class GatewayConfig:
    host: str = "0.0.0.0"  # interface the HTTP and gRPC servers listen on
    port: int = 8000  # HTTP port of the OpenAI API
    grpc_port: int = 50051  # port of the public TextGeneration gRPC service; 0: no gRPC server
    scheduler: str = "localhost:50052"  # host:port of the scheduler's Engine service
    model: str = "default"  # model spec (folder, .gguf or "default") for the tokenizer and chat template
    served_model_name: str | None = None  # name clients pass as `model`; None: the model's own name
    api_key: str | None = None  # when set, /v1 paths need "Authorization: Bearer <key>"
    max_body_bytes: int = 32 * 1024 * 1024  # larger request bodies are refused with 413
    log_level: str = "info"  # structlog level
    vllm_metric_aliases: bool = True  # also export every metric under vLLM's `vllm:` names

    @classmethod
    def from_args(cls, argv: list[str] | None = None, env: Mapping[str, str] | None = None) -> GatewayConfig:
        env = os.environ if env is None else env
        defaults = cls()

        def default(name: str, kind=str):
            value = env.get(f"PAGEDSERVE_{name.upper()}")
            if value is None or value == "":
                return getattr(defaults, name)
            if kind is bool:
                return value.strip().lower() in ("1", "true", "yes", "on")
            return kind(value)

        parser = argparse.ArgumentParser(
            prog="pagedserve gateway", description="OpenAI-compatible HTTP API and public gRPC API"
        )
        parser.add_argument("--host", default=default("host"))
        parser.add_argument("--port", type=int, default=default("port", int))
        parser.add_argument("--grpc-port", type=int, default=default("grpc_port", int))
        parser.add_argument("--scheduler", default=default("scheduler"), help="host:port of the Engine")
        parser.add_argument("--model", default=default("model"), help="model folder, .gguf or 'default'")
        parser.add_argument("--served-model-name", default=default("served_model_name"))
        parser.add_argument("--api-key", default=default("api_key"))
        parser.add_argument("--max-body-bytes", type=int, default=default("max_body_bytes", int))
        parser.add_argument("--log-level", default=default("log_level"))
        parser.add_argument(
            "--vllm-metric-aliases",
            action=argparse.BooleanOptionalAction,
            default=default("vllm_metric_aliases", bool),
        )
        args = parser.parse_args(argv)
        config = cls(**vars(args))
        if config.max_body_bytes <= 0:
            parser.error("--max-body-bytes must be positive")
        return config
