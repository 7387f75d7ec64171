"""`bench serve` output: the printed table (vLLM's layout), the JSON result and PNG plots."""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pagedserve.bench.metrics import BenchmarkMetrics, Distribution, request_itls, request_tpot

if TYPE_CHECKING:
    from pagedserve.bench.serve import LoadConfig, PassResult

_WIDTH = 50
_SECTIONS = (  # (field, short name, title)
    ("ttft", "TTFT", "Time to First Token"),
    ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
    ("itl", "ITL", "Inter-token Latency"),
    ("e2el", "E2EL", "End-to-end Latency"),
)


def format_table(metrics: BenchmarkMetrics, load: LoadConfig, percentiles: tuple[float, ...]) -> str:
    m = metrics
    rate = "inf" if math.isinf(load.request_rate) else f"{load.request_rate:g}"
    rows: list[str] = [" Serving Benchmark Result ".center(_WIDTH, "=")]

    def row(name: str, value: Any) -> None:
        text = f"{value:.2f}" if isinstance(value, float) else str(value)
        rows.append(f"{name:<40}{text:>10}")

    row("Request rate (req/s):", rate)
    row("Max concurrency:", load.max_concurrency or "unlimited")
    row("Successful requests:", m.completed)
    row("Failed requests:", m.failed)
    row("Benchmark duration (s):", m.duration)
    row("Total input tokens:", m.total_input_tokens)
    row("Total generated tokens:", m.total_output_tokens)
    row("Request throughput (req/s):", m.request_throughput)
    row("Output token throughput (tok/s):", m.output_throughput)
    row("Total Token throughput (tok/s):", m.total_token_throughput)
    if m.output_len_mismatches:
        row("Output length != max_tokens (req):", m.output_len_mismatches)
    for field, short, title in _SECTIONS:
        dist: Distribution = getattr(m, field)
        rows.append(f" {title} ".center(_WIDTH, "-"))
        row(f"Mean {short} (ms):", dist.mean)
        row(f"Median {short} (ms):", dist.median)
        for p in percentiles:
            row(f"P{p:g} {short} (ms):", dist.percentiles[f"p{p:g}"])
    rows.append("=" * _WIDTH)
    return "\n".join(rows)


def result_dict(result: PassResult) -> dict[str, Any]:
    load = asdict(result.load)
    load["request_rate"] = "inf" if math.isinf(result.load.request_rate) else result.load.request_rate
    load.pop("show_progress")
    return {
        "load": load,
        "metrics": result.metrics.to_dict(),
        "worker": asdict(result.worker) if result.worker is not None else None,
        "requests": [
            {
                "prompt_len": r.prompt_len,
                "output_len": r.output_len,
                "output_tokens": r.output_tokens,
                "usage_reported": r.usage_reported,
                "success": r.success,
                "error": r.error,
                "start_s": r.start,
                "ttft_s": r.ttft,
                "tpot_s": request_tpot(r) if r.success else None,
                "e2el_s": r.latency,
                "itl_s": request_itls(r) if r.success else [],
            }
            for r in result.results
        ],
    }


def save_json(
    path: Path, meta: dict[str, Any], passes: list[PassResult], percentiles: tuple[float, ...]
) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {**meta, "percentiles": list(percentiles), "passes": [result_dict(p) for p in passes]}
    path.write_text(json.dumps(payload, indent=1, default=str, allow_nan=False) + "\n")


def save_plots(stem: Path, passes: list[PassResult]) -> list[Path]:
    """<stem>-latency.png for the last pass (every pass in a sweep), <stem>-sweep.png for a sweep."""
    import matplotlib

    matplotlib.use("Agg")
    written = []
    for p in passes:
        suffix = f"-c{p.load.max_concurrency}" if len(passes) > 1 else ""
        path = stem.with_name(f"{stem.name}{suffix}-latency.png")
        _plot_latencies(p, path)
        written.append(path)
    if len(passes) > 1:
        path = stem.with_name(f"{stem.name}-sweep.png")
        _plot_sweep(passes, path)
        written.append(path)
    return written


def _plot_latencies(result: PassResult, path: Path) -> None:
    import matplotlib.pyplot as plt

    done = [r for r in result.results if r.success]
    samples = {
        "ttft": [r.ttft for r in done],
        "tpot": [t for r in done if (t := request_tpot(r)) is not None],
        "itl": [x for r in done for x in request_itls(r)],
        "e2el": [r.latency for r in done],
    }
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    for ax, (field, short, title) in zip(axes.flat, _SECTIONS, strict=True):
        ms = [s * 1000.0 for s in samples[field]]
        dist: Distribution = getattr(result.metrics, field)
        if ms:
            ax.hist(ms, bins=min(50, max(5, len(ms) // 4)), color="tab:blue", alpha=0.8)
            ax.axvline(dist.median, color="tab:orange", label=f"median {dist.median:.1f} ms")
            for name, value in dist.percentiles.items():
                ax.axvline(value, color="tab:red", linestyle="--", label=f"{name} {value:.1f} ms")
            ax.legend(fontsize=8)
        ax.set_title(f"{short}: {title}", fontsize=10)
        ax.set_xlabel("ms")
        ax.set_ylabel("count")
    concurrency = result.load.max_concurrency or "unlimited"
    fig.suptitle(f"{result.metrics.completed} requests, max concurrency {concurrency}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _plot_sweep(passes: list[PassResult], path: Path) -> None:
    import matplotlib.pyplot as plt

    xs = [p.load.max_concurrency or len(p.results) for p in passes]
    metrics = [p.metrics for p in passes]
    fig, (ax_tp, ax_ttft, ax_tpot) = plt.subplots(1, 3, figsize=(15, 4.5))
    ax_tp.plot(xs, [m.output_throughput for m in metrics], "o-", label="output tok/s")
    ax_tp.plot(xs, [m.total_token_throughput for m in metrics], "s--", label="total tok/s")
    ax_tp.set_ylabel("tokens/s")
    ax_tp.set_title("Throughput")
    for ax, field, short in ((ax_ttft, "ttft", "TTFT"), (ax_tpot, "tpot", "TPOT")):
        dists: list[Distribution] = [getattr(m, field) for m in metrics]
        ax.plot(xs, [d.median for d in dists], "o-", label="median")
        for name in dists[0].percentiles:
            ax.plot(xs, [d.percentiles[name] for d in dists], "s--", label=name)
        ax.set_ylabel("ms")
        ax.set_title(short)
    for ax in (ax_tp, ax_ttft, ax_tpot):
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_xlabel("max concurrency")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
