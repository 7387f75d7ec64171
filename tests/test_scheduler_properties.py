"""Random interleavings of add, step (pipelined), fork, finish, abort (of a request or of one of its
sequences), preemption, eviction (of blocks, and of whole cache salts past their cap) and requests the
worker refuses, with every block-accounting invariant checked after every operation (see
check_invariants), and has_work() checked against what schedule() returns. Then workloads near the KV
pool's size: every request finishes within a bound of steps (no deadlock, no livelock)."""

from collections import deque

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from scheduler_fakes import VOCAB_SIZE, Driver, check_invariants, expected_tokens, make_request

from pagedserve.scheduler_svc.config import SchedulerConfig
from pagedserve.scheduler_svc.scheduler import Scheduler, pool_refusal
from pagedserve.v1 import common_pb2

BS = 4
# A token the fake worker refuses in a new request (as the real one refuses a token outside the
# vocabulary); the fake also samples it now and then, so a request may be refused when it comes back.
POISON = VOCAB_SIZE - 1


def _refuse_poison(new) -> str | None:
    return "a poisoned token" if POISON in new.token_ids else None


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.s: Scheduler | None = None
        self.next_id = 0
        self.prompts: dict[str, tuple[list[int], int, int]] = {}

    @precondition(lambda self: self.s is None)
    @rule(
        num_blocks=st.integers(10, 40),
        budget=st.sampled_from([8, 16, 64]),
        caching=st.booleans(),
        policy=st.sampled_from(["fcfs", "priority"]),
        chunked=st.booleans(),
        max_salts=st.sampled_from([1, 2, 1024]),
    )
    def configure(self, num_blocks, budget, caching, policy, chunked, max_salts):
        cfg = SchedulerConfig(
            num_blocks=num_blocks,
            block_size=BS,
            max_num_seqs=6,
            max_num_batched_tokens=budget,
            max_model_len=40,
            enable_prefix_caching=caching,
            policy=policy,
            enable_chunked_prefill=chunked,
            max_cache_salts=max_salts,
        )
        self.s = Scheduler(cfg)
        # NOTE: not strict: a refused request's step computes nothing of it, so a request sharing its blocks
        # reads garbage there (as on a real worker); the scheduler must recompute those, which the tokens
        # checked after every update show.
        self.d = Driver(self.s, lag=0, refuse=_refuse_poison, strict=False)
        self.d.in_flight = deque()

    @precondition(lambda self: self.s is not None)
    @rule(
        # A few shared prefixes, so that requests hit each other's blocks.
        base=st.sampled_from([[5, 6, 7, 8, 9, 10, 11, 12], [5, 6, 7, 8, 20, 21], [30]]),
        tail=st.lists(st.integers(2, 40), max_size=10),
        max_tokens=st.integers(1, 12),
        n=st.sampled_from([1, 1, 2, 3]),
        seed=st.integers(0, 3),
        salt=st.sampled_from(["", "", "x", "y", "z", "w", "v"]),
        priority=st.integers(0, 2),
        eos=st.booleans(),
        poison=st.sampled_from([False] * 3 + [True]),
    )
    def add(self, base, tail, max_tokens, n, seed, salt, priority, eos, poison):
        prompt = (base + tail)[:30] + ([POISON] if poison else [])
        if n * -(-(len(prompt) + max_tokens) // BS) > self.s.config.num_blocks:
            return
        if not self.s.config.enable_chunked_prefill and len(prompt) > self.s.config.max_num_batched_tokens:
            return
        rid = f"r{self.next_id}"
        self.next_id += 1
        kw = dict(eos=1 if eos else None, salt=salt, priority=priority)
        self.d.add(make_request(rid, prompt, max_tokens=max_tokens, n=n, seed=seed, **kw))
        self.prompts[rid] = (prompt, seed, max_tokens)

    @precondition(lambda self: self.s is not None and len(self.d.in_flight) < 3)
    @rule()
    def schedule(self):
        """Schedule (and execute) without taking the result: pipelining up to depth 3."""
        has_work = self.s.has_work()
        out = self.d.schedule()
        assert has_work == bool(out.scheduled or out.finished or out.preempted)

    @precondition(lambda self: self.s is not None and self.d.in_flight)
    @rule()
    def update(self):
        self.d.update()
        self._check_tokens()

    def _check_tokens(self) -> None:
        """Whatever preemptions, forks, failures and recomputations happened, each sequence is its
        reference run so far."""
        for (rid, index), log in self.d.logs.items():
            prompt, seed, _ = self.prompts[rid]
            assert log.tokens == expected_tokens(prompt, seed + index, len(log.tokens)), (rid, index)

    @precondition(lambda self: self.s is not None)
    @rule(pick=st.integers(0, 50), index=st.one_of(st.none(), st.integers(0, 2)))
    def abort(self, pick, index):
        """Abort a whole request, or one of its sequences (forked or not yet)."""
        live = sorted(self.s._requests)
        if live:
            self.d.record(self.s.abort_request(live[pick % len(live)], index))

    @precondition(lambda self: self.s is not None)
    @rule()
    def finish_everything(self):
        self.d.run(max_steps=2000)
        assert self.s.kv.pool.num_used_blocks == 0
        self._check_tokens()
        event(f"requests failed: {sum(not f.retry for f in self.d.failures) > 0}")
        event(
            f"requests recomputed for having read a failed one's blocks: {any(f.retry for f in self.d.failures)}"
        )
        event(f"cache salts evicted past the cap: {self.s.config.max_cache_salts < 1024}")
        failed = {f.request_id for f in self.d.failures if not f.retry}
        for (rid, index), log in self.d.logs.items():
            assert log.finish_reason or rid in failed, f"{rid}/{index} neither finished nor failed"
        # Refused requests failed alone, each naming itself.
        assert all(
            f.message.startswith(f"request {f.request_id!r} failed") for f in self.d.failures if not f.retry
        )
        assert all(POISON in self.prompts[rid][0] or rid in self._sampled_poison() for rid in failed)

    def _sampled_poison(self) -> set[str]:
        return {rid for (rid, _), log in self.d.logs.items() if POISON in log.tokens}

    @invariant()
    def blocks_are_accounted_for(self):
        if self.s is not None:
            check_invariants(self.s)


SchedulerMachine.TestCase.settings = settings(
    max_examples=120,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_scheduler_state_machine = SchedulerMachine.TestCase


# ---------------------------------------------------------------- requests near the KV pool's size


@st.composite
def _near_pool_workload(draw):
    num_blocks = draw(st.integers(6, 24))
    max_num_seqs = draw(st.sampled_from([2, 4, 8]))
    budget = draw(st.sampled_from([b for b in (4, 8, 16) if b >= max_num_seqs]))  # small: prompts are chunked
    cfg = SchedulerConfig(
        num_blocks=num_blocks,
        block_size=BS,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        # NOTE: longer than the pool holds, so that the pool, not the context length, refuses the largest.
        max_model_len=2 * num_blocks * BS,
        enable_prefix_caching=draw(st.booleans()),
        policy=draw(st.sampled_from(["fcfs", "priority"])),
        max_cache_salts=draw(st.sampled_from([1, 4])),
    )
    shared = draw(st.lists(st.integers(2, 60), min_size=4, max_size=12))  # prompts share it: prefix hits
    requests = []
    for _ in range(draw(st.integers(1, 8))):
        n = draw(st.sampled_from([n for n in (1, 1, 2, 3) if n <= max_num_seqs]))
        # Sequences near the pool's size: n of them take between half of it and all of it, or a bit more.
        longest = draw(st.integers(max(2, num_blocks * BS // (2 * n)), num_blocks * BS // n + BS))
        prompt_len = draw(st.integers(1, max(1, longest - 1)))
        prefix = shared[: draw(st.integers(0, len(shared)))]
        tail = draw(st.lists(st.integers(2, 60), min_size=prompt_len, max_size=prompt_len))
        prompt = (prefix + tail)[:prompt_len]
        requests.append(
            dict(
                arrival=draw(st.integers(0, 12)),
                prompt=prompt,
                max_tokens=max(1, longest - prompt_len),
                n=n,
                seed=draw(st.integers(0, 3)),
                salt=draw(st.sampled_from(["", "a", "b"])),
                priority=draw(st.integers(0, 2)),
            )
        )
    return cfg, requests, draw(st.sampled_from([0, 1, 2]))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_near_pool_workload())
def test_requests_near_the_pool_size_are_refused_or_finish_within_a_bound_of_steps(workload):
    cfg, requests, lag = workload
    s = Scheduler(cfg)
    d = Driver(s, lag=lag, check=lambda: check_invariants(s))
    admitted = []
    # The bound: every request computed alone, one after another, each preempted (and recomputed)
    # once per other request: a livelock or a deadlock runs past it.
    bound = 20 + sum(r["n"] * (len(r["prompt"]) + r["max_tokens"]) * (1 + len(requests)) for r in requests)
    steps = 0
    pending = sorted(enumerate(requests), key=lambda item: item[1]["arrival"])
    while pending or s.has_unfinished_requests():
        while pending and pending[0][1]["arrival"] <= steps:
            i, r = pending.pop(0)
            request = make_request(
                f"r{i}", r["prompt"], eos=None, salt=r["salt"], priority=r["priority"],
                max_tokens=r["max_tokens"], n=r["n"], seed=r["seed"],
            )  # fmt: skip
            max_output = min(r["max_tokens"], cfg.max_model_len - len(r["prompt"]))
            if len(r["prompt"]) >= cfg.max_model_len or pool_refusal(
                cfg, len(r["prompt"]), max_output, r["n"]
            ):
                # Could never finish: refused at once (the engine answers INVALID_ARGUMENT naming the pool).
                with pytest.raises(ValueError):
                    s.add_request(request)
                event("a request that could never fit is refused")
                continue
            s.add_request(request)
            admitted.append((i, r))
        d.step()
        steps += 1
        assert steps <= bound, f"requests still unfinished after {steps} steps: {s.stats()}"
    d.drain()
    event(f"preemptions: {min(s.stats().num_preemptions, 3)}{'+' if s.stats().num_preemptions > 3 else ''}")
    event(f"prefix hits: {s.stats().prefix_cache_hits > 0}")
    assert s.kv.pool.num_used_blocks == 0
    for i, r in admitted:
        for index in range(r["n"]):
            log = d.logs[(f"r{i}", index)]
            assert log.finish_reason == common_pb2.FINISH_REASON_LENGTH
            assert log.tokens == expected_tokens(r["prompt"], r["seed"] + index, len(log.tokens))
