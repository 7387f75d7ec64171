"""/metrics: the engine's numbers (EngineService.GetStats, fetched at scrape time) in the names vLLM users know.

Every metric is exported as `pagedserve:<name>` and, optionally, as vLLM's `vllm:<name>` alias, with a
`model_name` label as vLLM has it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from pagedserve.logging import get_logger
from pagedserve.v1 import engine_pb2

log = get_logger(__name__)

# pagedserve name -> vLLM's name, where vLLM's differs.
VLLM_NAMES = {"inter_token_latency_seconds": "time_per_output_token_seconds"}


class EngineStatsCollector(Collector):
    def __init__(
        self, fetch: Callable[[], engine_pb2.EngineStats], model_name: str, vllm_aliases: bool = True
    ):
        self.fetch = fetch  # blocking; prometheus_client calls collect() synchronously
        self.model_name = model_name
        self.prefixes = ["pagedserve"] + (["vllm"] if vllm_aliases else [])

    def collect(self) -> Iterator[Metric]:
        try:
            stats = self.fetch()
        except Exception as error:  # a scrape must still answer when the scheduler is down
            log.warning("engine stats unavailable", error=str(error))
            up = GaugeMetricFamily("pagedserve:engine_up", "Whether EngineService.GetStats answered", value=0)
            yield up
            return
        yield GaugeMetricFamily("pagedserve:engine_up", "Whether EngineService.GetStats answered", value=1)
        for prefix in self.prefixes:
            yield from self._families(prefix, stats)

    def _families(self, prefix: str, s: engine_pb2.EngineStats) -> Iterator[Metric]:
        labels, values = ["model_name"], [self.model_name]

        def name(base: str) -> str:
            return f"{prefix}:{VLLM_NAMES.get(base, base) if prefix == 'vllm' else base}"

        def gauge(base: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name(base), doc, labels=labels)
            g.add_metric(values, value)
            return g

        def counter(base: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name(base), doc, labels=labels)  # exposed as <name>_total
            c.add_metric(values, value)
            return c

        def histogram(base: str, doc: str, h: engine_pb2.Histogram) -> HistogramMetricFamily:
            buckets = [(_le(b), float(c)) for b, c in zip(h.bounds, h.cumulative_counts, strict=False)]
            buckets.append(("+Inf", float(h.count)))
            m = HistogramMetricFamily(name(base), doc, labels=labels)
            m.add_metric(values, buckets, h.sum)
            return m

        yield gauge("num_requests_running", "Requests being computed.", s.num_requests_running)
        yield gauge(
            "num_requests_waiting", "Requests waiting for blocks or a batch slot.", s.num_requests_waiting
        )
        yield gauge(
            "kv_cache_usage_perc", "Fraction of KV blocks held by requests (0 to 1).", s.kv_cache_usage
        )
        if prefix == "vllm":  # vLLM's older name of the same gauge
            yield gauge("gpu_cache_usage_perc", "Fraction of KV blocks held by requests.", s.kv_cache_usage)
        yield counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.prefix_cache_queries
        )
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_cache_hits)
        yield counter("num_preemptions", "Requests preempted.", s.num_preemptions)
        yield counter(
            "spec_decode_num_drafts", "Speculative decoding: drafts verified.", s.spec_decode_num_drafts
        )
        yield counter(
            "spec_decode_num_draft_tokens",
            "Speculative decoding: draft tokens verified.",
            s.spec_decode_num_draft_tokens,
        )
        yield counter(
            "spec_decode_num_accepted_tokens",
            "Speculative decoding: draft tokens accepted.",
            s.spec_decode_num_accepted_tokens,
        )
        per_pos = CounterMetricFamily(
            name("spec_decode_num_accepted_tokens_per_pos"),
            "Speculative decoding: draft tokens accepted, by position in the draft.",
            labels=[*labels, "position"],
        )
        for position, count in enumerate(s.spec_decode_num_accepted_tokens_per_pos):
            per_pos.add_metric([*values, str(position)], count)
        yield per_pos
        yield counter("prompt_tokens", "Prompt tokens computed.", s.prompt_tokens)
        yield counter("generation_tokens", "Tokens generated.", s.generation_tokens)
        success = CounterMetricFamily(
            name("request_success"),
            "Requests finished, by finish reason.",
            labels=[*labels, "finished_reason"],
        )
        for reason in sorted({"stop", "length", "abort", *s.requests_finished}):
            success.add_metric([*values, reason], s.requests_finished.get(reason, 0))
        yield success
        yield histogram(
            "time_to_first_token_seconds",
            "Seconds from arrival to first token.",
            s.time_to_first_token_seconds,
        )
        yield histogram(
            "inter_token_latency_seconds",
            "Seconds between consecutive tokens.",
            s.inter_token_latency_seconds,
        )
        yield histogram(
            "e2e_request_latency_seconds",
            "Seconds from arrival to last token.",
            s.e2e_request_latency_seconds,
        )
        yield histogram(
            "request_queue_time_seconds", "Seconds waiting before first scheduled.", s.queue_time_seconds
        )
        yield gauge("num_blocks_in_use", "KV blocks held by requests, over all workers.", s.num_blocks_in_use)
        if prefix == "pagedserve":
            healthy = GaugeMetricFamily(
                "pagedserve:worker_healthy", "Whether a worker's step stream is up.", labels=["worker_id"]
            )
            for w in s.workers:
                healthy.add_metric([w.worker_id], 1.0 if w.healthy else 0.0)
            yield healthy
            # Per worker, so a load generator can tell how much of the time a worker waited for plans.
            per_worker = {
                "worker_steps": ("Steps the worker executed.", lambda w: w.num_steps),
                "worker_step_seconds": (
                    "Seconds of forward pass and sampling.",
                    lambda w: w.mean_step_seconds * w.num_steps,
                ),
                "worker_idle_seconds": (
                    "Seconds the worker waited for its next plan after finishing one, at steady state.",
                    lambda w: w.mean_idle_seconds * w.num_steps,
                ),
                "worker_forward_seconds": (
                    "Seconds of forward pass (the model alone, of worker_step_seconds).",
                    lambda w: w.mean_forward_seconds * w.num_steps,
                ),
                "worker_gap_seconds": (
                    "Seconds from the end of one step to the start of the next (worker_idle_seconds and "
                    "the worker's hand-over of results and plans between its threads), at steady state.",
                    lambda w: w.mean_gap_seconds * w.num_steps,
                ),
                "worker_prepare_seconds": (
                    "Seconds applying plans and building the model's inputs, before the forward passes.",
                    lambda w: w.mean_prepare_seconds * w.num_steps,
                ),
                "worker_no_work_seconds": (
                    "Seconds the worker had nothing to do because the scheduler had nothing to schedule "
                    "(left out of worker_idle_seconds and worker_gap_seconds).",
                    lambda w: w.mean_no_work_seconds * w.num_steps,
                ),
            }
            for base, (doc, value) in per_worker.items():
                family = CounterMetricFamily(f"pagedserve:{base}", doc, labels=["worker_id"])
                for w in s.workers:
                    family.add_metric([w.worker_id], value(w))
                yield family


def _le(bound: float) -> str:
    return repr(float(bound))


def make_registry(collector: Collector) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
