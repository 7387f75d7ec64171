"""The engine's counters and histograms, and their EngineStats shape (the numbers behind /metrics).

Bucket bounds follow vLLM's, so dashboards built for vLLM read ours unchanged. Everything here is
plain arithmetic on one event loop: no locks.
"""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass, field

from pagedserve.v1 import engine_pb2, worker_pb2

TTFT_BOUNDS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BOUNDS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_BOUNDS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip


def add_per_position(total: list[int], per_position: list[int]) -> None:
    """Add counts by position (speculative decoding's accepted tokens by draft position) into total, in place."""
    total.extend([0] * (len(per_position) - len(total)))
    for i, value in enumerate(per_position):
        total[i] += value


@dataclass(slots=True)
class Histogram:
    # Upper bounds of the buckets, increasing; +Inf is implied.
    bounds: tuple[float, ...]
    # Observations per bucket (not cumulative); one more than bounds (the +Inf bucket).
    bucket_counts: list[int] = field(default_factory=list)
    # Number and sum of the observations.
    count: int = 0
    total: float = 0.0

    def __post_init__(self) -> None:
        assert list(self.bounds) == sorted(self.bounds)
        if not self.bucket_counts:
            self.bucket_counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        # NOTE: bisect_left puts a value equal to a bound in that bound's bucket ("le" semantics).
        self.bucket_counts[bisect.bisect_left(self.bounds, value)] += 1
        self.count += 1
        self.total += value

    def to_proto(self) -> engine_pb2.Histogram:
        cumulative, running = [], 0
        for n in self.bucket_counts[:-1]:
            running += n
            cumulative.append(running)
        return engine_pb2.Histogram(
            bounds=self.bounds, cumulative_counts=cumulative, count=self.count, sum=self.total
        )


@dataclass(slots=True)
class WorkerCounters:
    # Steps whose results came back.
    num_steps: int = 0
    # Forward plus sampling seconds, summed over the steps.
    step_seconds: float = 0.0
    # The forward passes' share of step_seconds.
    forward_seconds: float = 0.0
    # Seconds applying plans and building inputs before the forward passes.
    prepare_seconds: float = 0.0
    # Seconds the worker waited for a plan, summed over the steps (at steady state: see no_work_seconds).
    idle_seconds: float = 0.0
    # Seconds from the end of one step to the start of the next (the idle seconds and the hand-over), at
    # steady state.
    gap_seconds: float = 0.0
    # The gaps before the steps planned after the scheduler ran out of work: the worker waited for requests,
    # not for the scheduler, so these are left out of idle_seconds and gap_seconds.
    no_work_seconds: float = 0.0
    # Tokens computed, summed over the steps.
    num_tokens: int = 0

    def observe(self, timings: worker_pb2.StepTimings, after_no_work: bool = False) -> None:
        """Count a step's timings; `after_no_work`: its plan was the first after the scheduler had nothing
        to schedule and no plan in flight."""
        self.num_steps += 1
        self.step_seconds += timings.forward_seconds + timings.sample_seconds
        self.forward_seconds += timings.forward_seconds
        self.prepare_seconds += timings.prepare_seconds
        if after_no_work:
            self.no_work_seconds += timings.gap_seconds
        else:
            self.idle_seconds += timings.idle_seconds
            self.gap_seconds += timings.gap_seconds
        self.num_tokens += timings.num_tokens

    def _per_step(self, seconds: float) -> float:
        return seconds / self.num_steps if self.num_steps else 0.0

    @property
    def mean_step_seconds(self) -> float:
        return self._per_step(self.step_seconds)

    @property
    def mean_forward_seconds(self) -> float:
        return self._per_step(self.forward_seconds)

    @property
    def mean_idle_seconds(self) -> float:
        return self._per_step(self.idle_seconds)

    @property
    def mean_gap_seconds(self) -> float:
        return self._per_step(self.gap_seconds)

    @property
    def mean_prepare_seconds(self) -> float:
        return self._per_step(self.prepare_seconds)

    @property
    def mean_no_work_seconds(self) -> float:
        return self._per_step(self.no_work_seconds)


@dataclass(slots=True)
class EngineMetrics:
    """Request-level numbers over all workers, ever since start."""

    # Prompt tokens computed (prefix-cache hits excluded) and tokens generated.
    prompt_tokens: int = 0
    generation_tokens: int = 0
    # Finished requests by finish reason name ("stop", "length", "abort").
    requests_finished: Counter = field(default_factory=Counter)
    time_to_first_token: Histogram = field(default_factory=lambda: Histogram(TTFT_BOUNDS))
    inter_token_latency: Histogram = field(default_factory=lambda: Histogram(ITL_BOUNDS))
    e2e_request_latency: Histogram = field(default_factory=lambda: Histogram(REQUEST_BOUNDS))
    queue_time: Histogram = field(default_factory=lambda: Histogram(REQUEST_BOUNDS))

    def record_tokens(
        self,
        num_new: int,
        now: float,
        first_token_time: float | None,
        last_token_time: float | None,
        arrival_time: float,
    ) -> None:
        """A sequence produced num_new tokens at `now`; first/last token times are before this batch."""
        if num_new <= 0:
            return
        self.generation_tokens += num_new
        if first_token_time is None:
            self.time_to_first_token.observe(now - arrival_time)
        elif last_token_time is not None:
            self.inter_token_latency.observe(now - last_token_time)

    def record_finished(self, reason: str, arrival_time: float, now: float) -> None:
        self.requests_finished[reason] += 1
        self.e2e_request_latency.observe(now - arrival_time)

    def fill(self, stats: engine_pb2.EngineStats) -> None:
        stats.prompt_tokens = self.prompt_tokens
        stats.generation_tokens = self.generation_tokens
        for reason, count in self.requests_finished.items():
            stats.requests_finished[reason] = count
        stats.time_to_first_token_seconds.CopyFrom(self.time_to_first_token.to_proto())
        stats.inter_token_latency_seconds.CopyFrom(self.inter_token_latency.to_proto())
        stats.e2e_request_latency_seconds.CopyFrom(self.e2e_request_latency.to_proto())
        stats.queue_time_seconds.CopyFrom(self.queue_time.to_proto())
