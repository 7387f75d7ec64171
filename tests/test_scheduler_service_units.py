"""The scheduler service's pure parts: routing, histograms, and its one config object."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from pagedserve.scheduler_svc.metrics import Histogram, WorkerCounters
from pagedserve.scheduler_svc.router import choose_worker
from pagedserve.scheduler_svc.service_config import SchedulerServiceConfig
from pagedserve.v1 import worker_pb2


@dataclass
class FakeWorker:
    worker_id: str
    hit: int = 0
    running: int = 0
    free: int = 100

    def prefix_hit_tokens(self, token_ids, cache_salt):
        return self.hit

    def load(self):
        return self.running

    def free_blocks(self):
        return self.free


def test_no_healthy_worker_routes_nowhere():
    assert choose_worker([], [1, 2, 3]) is None


def test_longest_prefix_hit_wins_over_a_lighter_load():
    a, b = FakeWorker("a", hit=32, running=3), FakeWorker("b", hit=0, running=0)
    assert choose_worker([a, b], [1] * 40) is a


def test_an_overloaded_worker_loses_its_prefix_affinity():
    a, b = FakeWorker("a", hit=32, running=20), FakeWorker("b", hit=0, running=0)
    assert choose_worker([a, b], [1] * 40, max_imbalance=8) is b


def test_without_hits_the_least_loaded_then_the_emptiest_pool_wins():
    a, b, c = (
        FakeWorker("a", running=2),
        FakeWorker("b", running=1, free=10),
        FakeWorker("c", running=1, free=50),
    )
    assert choose_worker([a, b, c], [1, 2]) is c


def test_histogram_is_cumulative_with_le_buckets():
    h = Histogram((0.1, 1.0))
    for value in (0.05, 0.1, 0.5, 5.0):
        h.observe(value)
    proto = h.to_proto()
    assert list(proto.cumulative_counts) == [2, 3]
    assert proto.count == 4 and proto.sum == pytest.approx(5.65)


def test_worker_counters_average_step_forward_idle_and_gap_time():
    c = WorkerCounters()
    c.observe(
        worker_pb2.StepTimings(
            idle_seconds=0.5,
            gap_seconds=0.6,
            prepare_seconds=0.05,
            forward_seconds=0.2,
            sample_seconds=0.1,
            num_tokens=3,
        )
    )
    c.observe(
        worker_pb2.StepTimings(
            idle_seconds=0.0,
            gap_seconds=0.2,
            prepare_seconds=0.15,
            forward_seconds=0.4,
            sample_seconds=0.1,
            num_tokens=1,
        )
    )
    assert c.mean_step_seconds == pytest.approx(0.4)
    assert c.mean_forward_seconds == pytest.approx(0.3)
    assert c.mean_prepare_seconds == pytest.approx(0.1)
    assert c.mean_idle_seconds == pytest.approx(0.25)
    assert c.mean_gap_seconds == pytest.approx(0.4)
    assert c.mean_no_work_seconds == 0.0


def test_worker_counters_keep_a_wait_for_requests_out_of_the_steady_state():
    c = WorkerCounters()
    c.observe(worker_pb2.StepTimings(idle_seconds=0.01, gap_seconds=0.02, forward_seconds=0.1))
    # The first step planned after the scheduler had nothing to do: its gap is the wait for a request.
    c.observe(
        worker_pb2.StepTimings(idle_seconds=2.0, gap_seconds=2.5, forward_seconds=0.1), after_no_work=True
    )
    assert c.num_steps == 2 and c.mean_forward_seconds == pytest.approx(0.1)
    assert c.idle_seconds == pytest.approx(0.01) and c.gap_seconds == pytest.approx(0.02)
    assert c.no_work_seconds == pytest.approx(2.5)


def test_config_flags_win_over_environment_over_defaults():
    env = {
        "PAGEDSERVE_MAX_NUM_SEQS": "8",
        "PAGEDSERVE_BLOCK_SIZE": "32",
        "PAGEDSERVE_ENABLE_PREFIX_CACHING": "0",
    }
    config = SchedulerServiceConfig.from_args(["--block-size", "16", "--scheduling-policy", "priority"], env)
    assert config.max_num_seqs == 8
    assert config.block_size == 16
    assert config.enable_prefix_caching is False
    assert config.scheduling_policy == "priority"
    assert SchedulerServiceConfig.from_args([], {}).max_num_batched_tokens == 2048


def test_config_refuses_nonsense():
    with pytest.raises(ValueError):
        SchedulerServiceConfig(max_num_seqs=0)
    with pytest.raises(SystemExit):
        SchedulerServiceConfig.from_args(["--scheduling-policy", "random"], {})
