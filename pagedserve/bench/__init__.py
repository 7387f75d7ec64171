"""`pagedserve bench <benchmark>`: benchmarks as programs that print tables and write plots.

    pagedserve bench serve        load generator against any OpenAI-compatible endpoint (like `vllm bench serve`)
    pagedserve bench throughput   offline engine throughput through the LLM API (like `vllm bench throughput`)

Each benchmark is a module with `main(argv) -> int`, imported only when it runs.
"""

from __future__ import annotations

import importlib
import sys

# benchmark -> (module, one-line help)
BENCHMARKS: dict[str, tuple[str, str]] = {
    "serve": (
        "pagedserve.bench.serve",
        "load an OpenAI-compatible server and measure latency and throughput",
    ),
    "throughput": (
        "pagedserve.bench.throughput",
        "offline throughput of the engine through the LLM API (no server)",
    ),
}


def _usage() -> str:
    lines = ["usage: pagedserve bench <benchmark> [options]", "", "benchmarks:"]
    lines += [f"  {name:<12} {help_}" for name, (_, help_) in BENCHMARKS.items()]
    lines += ["", "Run `pagedserve bench <benchmark> --help` for its options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in {"-h", "--help", "help"}:
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in BENCHMARKS:
        print(f"pagedserve bench: unknown benchmark {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(BENCHMARKS[name][0])
    return int(module.main(rest) or 0)
