"""The gateway's one config object, from CLI flags, PAGEDSERVE_* environment variables and defaults
(pagedserve/flags.py: the flag wins over its variable, the variable over the default)."""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

from pagedserve.flags import EnvFlags
from pagedserve.gateway.reasoning import PARSERS as REASONING_PARSERS
from pagedserve.gateway.tool_calls import PARSERS
from pagedserve.grpc_utils import ClusterAuth, TLSConfig, add_cluster_token_argument
from pagedserve.validation import DEFAULT_LIMITS, Limits


@dataclass(slots=True, frozen=True)
class GatewayConfig:
    host: str = "0.0.0.0"  # interface the HTTP and gRPC servers listen on
    port: int = 8000  # HTTP port of the OpenAI API
    grpc_port: int = 50051  # port of the public TextGenerationService gRPC service; 0: no gRPC server
    scheduler: str = "localhost:50052"  # host:port of the scheduler's EngineService
    model: str = "default"  # model spec (folder, .gguf or "default") for the tokenizer and chat template
    served_model_name: str | None = None  # name clients pass as `model`; None: the model's own name
    api_key: str | None = None  # when set, every path but the probes needs "Authorization: Bearer <key>"
    api_keys: tuple[str, ...] = ()  # more accepted keys, one per tenant (each its own prefix-cache partition)
    max_body_bytes: int = 32 * 1024 * 1024  # larger request bodies are refused with 413
    max_n: int = DEFAULT_LIMITS.max_n  # most sequences (`n`) one request may ask for
    max_prompts: int = DEFAULT_LIMITS.max_prompts  # most prompts in one completions request
    max_messages: int = DEFAULT_LIMITS.max_messages  # most messages in one chat request
    request_timeout: float = 600.0  # seconds a request may take in the gateway, then 504; 0: no limit
    shutdown_timeout: float = 30.0  # seconds SIGTERM waits for running requests (new ones get 503)
    tls_cert: str | None = None  # PEM certificate presented to the scheduler (mutual TLS)
    tls_key: str | None = None  # its private key
    tls_ca: str | None = None  # PEM CA the scheduler's certificate must chain to; enables TLS
    cluster_token_file: str | None = None  # file holding the cluster token (see grpc_utils.ClusterAuth)
    log_level: str = "info"  # structlog level
    vllm_metric_aliases: bool = True  # also export every metric under vLLM's `vllm:` names
    tool_call_parser: str = "hermes"  # the format the model writes tool calls in (gateway/tool_calls.py)
    reasoning_parser: str | None = None  # the format of a thinking model's reasoning (gateway/reasoning.py)
    max_stored_responses: int = 1024  # Responses API objects kept for previous_response_id (LRU, per replica)

    @property
    def tls(self) -> TLSConfig:
        return TLSConfig(self.tls_cert, self.tls_key, self.tls_ca)

    @property
    def cluster_auth(self) -> ClusterAuth:
        return ClusterAuth.load(self.cluster_token_file)

    def limits(self) -> Limits:
        """What a client may send, with the flags operators tune."""
        return Limits(max_n=self.max_n, max_prompts=self.max_prompts, max_messages=self.max_messages)

    def all_api_keys(self) -> tuple[str, ...]:
        return tuple(k for k in (self.api_key, *self.api_keys) if k)

    @classmethod
    def from_args(cls, argv: list[str] | None = None, env: Mapping[str, str] | None = None) -> GatewayConfig:
        parser = build_parser(os.environ if env is None else env)
        args = parser.parse_args(argv)
        config = cls(**vars(args))
        if config.max_body_bytes <= 0:
            parser.error("--max-body-bytes must be positive")
        if config.max_stored_responses < 0:
            parser.error("--max-stored-responses must be 0 (store nothing) or positive")
        for flag in ("max_n", "max_prompts", "max_messages"):
            if getattr(config, flag) <= 0:
                parser.error(f"--{flag.replace('_', '-')} must be positive")
        if not 0 <= config.request_timeout < math.inf:
            parser.error("--request-timeout must be 0 (none) or positive")
        try:
            config.tls  # noqa: B018 -- checks the TLS flags go together and the files exist
            config.cluster_auth  # noqa: B018 -- checks the token file exists
        except ValueError as error:
            parser.error(str(error))
        return config


def build_parser(env: Mapping[str, str]) -> argparse.ArgumentParser:
    """The `pagedserve gateway` flags, each defaulting to its PAGEDSERVE_* variable."""
    d = GatewayConfig()
    parser = argparse.ArgumentParser(
        prog="pagedserve gateway", description="OpenAI-compatible HTTP API and public gRPC API."
    )
    flags = EnvFlags(parser, env)
    add = flags.add
    add("--host", str, "address the HTTP and gRPC servers listen on", d.host)
    add("--port", int, "HTTP port of the OpenAI API", d.port)
    add("--grpc-port", int, "port of the public TextGenerationService gRPC API; 0: none", d.grpc_port)
    add("--scheduler", str, "host:port of the scheduler's EngineService", d.scheduler)
    add("--model", str, "model folder, .gguf or 'default' (tokenizer and chat template)", d.model)
    add("--served-model-name", str, "name clients pass as `model` (default: the model's)")
    add("--api-key", str, "when set, every API path needs `Authorization: Bearer <key>`")
    add("--api-keys", _key_list, "comma-separated accepted keys, one per tenant", d.api_keys)
    add("--max-body-bytes", int, "larger request bodies get 413", d.max_body_bytes)
    add("--max-n", int, "largest n per request", d.max_n)
    add("--max-prompts", int, "most prompts in one completions request", d.max_prompts)
    add("--max-messages", int, "most messages in one chat request", d.max_messages)
    add("--request-timeout", float, "seconds a request may take, then 504; 0: none", d.request_timeout)
    add("--shutdown-timeout", float, "seconds SIGTERM waits for running requests", d.shutdown_timeout)
    add("--tls-cert", str, "PEM client certificate presented to the scheduler (mutual TLS)")
    add("--tls-key", str, "private key of --tls-cert")
    add("--tls-ca", str, "PEM CA of the scheduler's certificate; enables TLS")
    add_cluster_token_argument(add)
    add("--log-level", str, "debug, info, warning, error", d.log_level)
    flags.add_bool("--vllm-metric-aliases", "also export metrics under vLLM's `vllm:` names", True)
    add(
        "--tool-call-parser",
        str,
        "format of the model's tool calls: hermes or llama3_json",
        d.tool_call_parser,
        choices=PARSERS,
    )
    add(
        "--reasoning-parser",
        str,
        "format of a thinking model's reasoning, split out before tool calls: deepseek_r1 or qwen3",
        choices=REASONING_PARSERS,
    )
    add(
        "--max-stored-responses",
        int,
        "Responses API objects this gateway keeps for previous_response_id and GET (LRU); 0: none",
        d.max_stored_responses,
    )
    return parser


def _key_list(text: str) -> tuple[str, ...]:
    return tuple(k.strip() for k in text.split(",") if k.strip())
