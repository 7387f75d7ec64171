"""The `pagedserve` command: one subcommand per process kind, each parsing its own flags.

Run `pagedserve --help` for the list; each subcommand's module is imported only when it runs, so
the gateway and the scheduler never load model code.
"""

from __future__ import annotations

import importlib
import sys

# subcommand -> (module with main(argv), one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("pagedserve.launcher", "start worker(s), scheduler and gateway as local processes"),
    "worker": ("pagedserve.worker_svc.server", "run one worker (model, KV pool, sampling)"),
    "scheduler": ("pagedserve.scheduler_svc.server", "run the scheduler (EngineService)"),
    "gateway": ("pagedserve.gateway.server", "run the gateway (OpenAI HTTP API and gRPC API)"),
    "bench": ("pagedserve.bench", "benchmarks: serve (load generator), throughput (offline)"),
    "prepare-model": (
        "pagedserve.prepare_model",
        "convert the model into the cache once and print its folder",
    ),
    "healthcheck": (
        "pagedserve.healthcheck",
        "exit 0 when a gRPC or HTTP service is healthy (container checks)",
    ),
    "cluster-token": (
        "pagedserve.cluster_token",
        "write a random cluster token into a file once (compose's cluster-init)",
    ),
}


def dispatch(prog: str, commands: dict[str, tuple[str, str]], argv: list[str]) -> int:
    """Run `prog <command> ...`: import the command's module and call its main(rest)."""
    usage = [f"usage: {prog} <command> [options]", "", "commands:"]
    usage += [f"  {name:<14} {help_}" for name, (_, help_) in commands.items()]
    usage += ["", f"Run `{prog} <command> --help` for a command's options."]
    if not argv or argv[0] in {"-h", "--help", "help"}:
        print("\n".join(usage))
        return 0
    command, rest = argv[0], argv[1:]
    if command not in commands:
        print(f"{prog}: unknown command {command!r}\n\n" + "\n".join(usage), file=sys.stderr)
        return 2
    module = importlib.import_module(commands[command][0])
    return int(module.main(rest) or 0)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in {"-V", "--version"}:
        from pagedserve import __version__

        print(__version__)
        return 0
    return dispatch("pagedserve", SUBCOMMANDS, argv)


if __name__ == "__main__":
    sys.exit(main())
