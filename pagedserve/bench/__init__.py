"""`pagedserve bench <benchmark>`: benchmarks as programs that print tables and write plots.

    pagedserve bench serve        load generator against any OpenAI-compatible endpoint (like `vllm bench serve`)
    pagedserve bench throughput   offline engine throughput through the LLM API (like `vllm bench throughput`)

Each benchmark is a module with `main(argv) -> int`, imported only when it runs.
"""

from __future__ import annotations

import sys

from pagedserve.cli import dispatch

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


def main(argv: list[str] | None = None) -> int:
    return dispatch("pagedserve bench", BENCHMARKS, sys.argv[1:] if argv is None else argv)
