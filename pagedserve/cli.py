"""The `pagedserve` command: one subcommand per process kind, each parsing its own flags.

    pagedserve serve      worker(s), scheduler and gateway as local processes (the whole stack)
    pagedserve worker     one worker: model weights, KV pool, forward pass, sampling
    pagedserve scheduler  the scheduler: block tables, prefix cache, batching
    pagedserve gateway    the OpenAI-compatible HTTP API and the public gRPC API
    pagedserve bench      benchmarks
    pagedserve prepare-model   convert the model into the cache (containers do it once, up front)
    pagedserve healthcheck     exit 0 when a gRPC or HTTP service is healthy
"""

from __future__ import annotations

import importlib
import sys

# subcommand -> (module, one-line help). Modules are imported only when their subcommand runs, so
# `pagedserve gateway` never imports torch.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("pagedserve.launcher", "start worker(s), scheduler and gateway as local processes"),
    "worker": ("pagedserve.worker_svc.server", "run one worker (model, KV pool, sampling)"),
    "scheduler": ("pagedserve.scheduler_svc.server", "run the scheduler (Engine service)"),
    "gateway": ("pagedserve.gateway.server", "run the gateway (OpenAI HTTP API and gRPC API)"),
    "bench": ("pagedserve.bench", "benchmarks: serve (load generator), throughput (offline)"),
    "prepare-model": ("pagedserve.prepare_model", "convert the model into the cache once and print its folder"),
    "healthcheck": ("pagedserve.healthcheck", "exit 0 when a gRPC or HTTP service is healthy (container checks)"),
}


def _usage() -> str:
    lines = ["usage: pagedserve <command> [options]", "", "commands:"]
    lines += [f"  {name:<14} {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
    lines += ["", "Run `pagedserve <command> --help` for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in {"-h", "--help", "help"}:
        print(_usage())
        return 0
    if argv[0] in {"-V", "--version"}:
        from pagedserve import __version__

        print(__version__)
        return 0
    command, rest = argv[0], argv[1:]
    if command not in SUBCOMMANDS:
        print(f"pagedserve: unknown command {command!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module_name = SUBCOMMANDS[command][0]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name != module_name:
            raise
        print(f"pagedserve {command}: not available in this version yet", file=sys.stderr)
        return 2
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
