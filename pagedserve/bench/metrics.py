"""Serving metrics from per-request timings, with vLLM's `bench serve` definitions.

    TTFT  time to first token: sending the request -> the first chunk carrying a token
    TPOT  time per output token, excluding the first: (e2e latency - TTFT) / (output tokens - 1),
          one value per request with at least two output tokens
    ITL   inter-token latency: each gap between consecutive token-carrying chunks, spread over the
          tokens the later chunk brought (a gap g before a chunk of k tokens gives k values g/k), so
          every token after the first is one sample and a request's ITLs sum to e2e - TTFT
          (up to the stream's tail after the last token)
    E2EL  end-to-end latency: sending the request -> the end of the stream
Percentiles are numpy's default (linear interpolation between closest ranks).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from pagedserve.bench.client import RequestResult

DEFAULT_PERCENTILES = (99.0,)
LATENCIES = ("ttft", "tpot", "itl", "e2el")


@dataclass(slots=True)
class Distribution:
    mean: float  # ms
    median: float  # ms
    std: float  # ms
    percentiles: dict[str, float] = field(default_factory=dict)  # "p99" -> ms

    @classmethod
    def of(cls, seconds: list[float], percentiles: tuple[float, ...]) -> Distribution:
        if not seconds:
            return cls(0.0, 0.0, 0.0, {_pname(p): 0.0 for p in percentiles})
        ms = np.asarray(seconds, dtype=np.float64) * 1000.0
        return cls(
            mean=float(ms.mean()),
            median=float(np.median(ms)),
            std=float(ms.std()),
            percentiles={_pname(p): float(np.percentile(ms, p)) for p in percentiles},
        )


def _pname(p: float) -> str:
    return f"p{p:g}"


@dataclass(slots=True)
class BenchmarkMetrics:
    completed: int  # requests that streamed to the end
    failed: int  # requests that got an HTTP error, an error event or a broken connection
    duration: float  # s, first request sent -> last request finished
    total_input_tokens: int  # prompt tokens of the completed requests
    total_output_tokens: int  # output tokens of the completed requests
    request_throughput: float  # completed requests / s
    output_throughput: float  # output tokens / s
    total_token_throughput: float  # (input + output tokens) / s
    output_len_mismatches: int  # completed requests whose output length differs from max_tokens
    ttft: Distribution  # ms
    tpot: Distribution  # ms
    itl: Distribution  # ms
    e2el: Distribution  # ms

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def request_itls(result: RequestResult) -> list[float]:
    itls: list[float] = []
    for i in range(1, len(result.chunk_times)):
        gap = result.chunk_times[i] - result.chunk_times[i - 1]
        tokens = result.chunk_tokens[i]
        itls += [gap / tokens] * tokens
    return itls


def request_tpot(result: RequestResult) -> float | None:
    if result.output_tokens < 2:
        return None
    return (result.latency - result.ttft) / (result.output_tokens - 1)


def compute_metrics(
    results: list[RequestResult], duration: float, percentiles: tuple[float, ...] = DEFAULT_PERCENTILES
) -> BenchmarkMetrics:
    done = [r for r in results if r.success]
    input_tokens = sum(r.prompt_len for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    tpots = [t for r in done if (t := request_tpot(r)) is not None]
    per_second = 1.0 / duration if duration > 0 else 0.0
    return BenchmarkMetrics(
        completed=len(done),
        failed=len(results) - len(done),
        duration=duration,
        total_input_tokens=input_tokens,
        total_output_tokens=output_tokens,
        request_throughput=len(done) * per_second,
        output_throughput=output_tokens * per_second,
        total_token_throughput=(input_tokens + output_tokens) * per_second,
        output_len_mismatches=sum(r.output_tokens != r.output_len for r in done),
        ttft=Distribution.of([r.ttft for r in done], percentiles),
        tpot=Distribution.of(tpots, percentiles),
        itl=Distribution.of([itl for r in done for itl in request_itls(r)], percentiles),
        e2el=Distribution.of([r.latency for r in done], percentiles),
    )
