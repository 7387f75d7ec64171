"""Chat-like traffic through a pool small enough to force sustained preemption."""

import random

import pytest
from scheduler_fakes import Driver, check_invariants, expected_tokens, make_request

from pagedserve.scheduler_svc.config import SchedulerConfig
from pagedserve.scheduler_svc.scheduler import Scheduler


def chat_traffic(num: int, seed: int) -> list[tuple[list[int], int]]:
    """(prompt, max_tokens) pairs: lognormal prompts in 20..1500 and outputs in 10..500 tokens."""
    rng = random.Random(seed)
    system = [rng.randrange(2, 64) for _ in range(48)]  # a shared system prompt: prefix hits
    traffic = []
    for _ in range(num):
        plen = int(min(max(rng.lognormvariate(5.0, 1.0), 20), 1500))
        olen = int(min(max(rng.lognormvariate(4.5, 0.9), 10), 500))
        body = [rng.randrange(2, 64) for _ in range(plen)]
        traffic.append(((system + body)[:plen] if rng.random() < 0.5 else body, olen))
    return traffic


@pytest.mark.parametrize("lag", [0, 2])
def test_chat_workload_finishes_every_request_without_starvation(lag):
    cfg = SchedulerConfig(
        num_blocks=160, block_size=16, max_num_seqs=12, max_num_batched_tokens=256, max_model_len=2048
    )
    s = Scheduler(cfg)
    d = Driver(s, lag=lag)
    traffic = chat_traffic(36, seed=lag)
    first_step: dict[str, int] = {}
    pending = list(enumerate(traffic))
    steps = 0
    while pending or s.has_unfinished_requests():
        # Two arrivals per step until the traffic is exhausted.
        for i, (prompt, olen) in pending[:2]:
            s.add_request(make_request(f"r{i:03d}", prompt, max_tokens=olen, ignore_eos=True, seed=i))
        pending = pending[2:]
        out = d.step()
        steps += 1
        for req in out.scheduled:
            first_step.setdefault(req.request_id, steps)
        if steps % 25 == 0:
            check_invariants(s)
        assert steps < 20_000, "no progress: starvation"
    d.drain()
    check_invariants(s)
    stats = s.stats()
    assert stats.num_preemptions > 10, "the pool was meant to force preemption"
    assert stats.num_blocks_in_use == 0 and stats.requests_finished["length"] == len(traffic)
    # FCFS: requests were first admitted in arrival order.
    order = sorted(first_step, key=first_step.get)
    assert order == sorted(order)
    for i, (prompt, olen) in enumerate(traffic):
        assert d.logs[(f"r{i:03d}", 0)].tokens == expected_tokens(prompt, i, olen)
    assert stats.prefix_cache_hits > 0
