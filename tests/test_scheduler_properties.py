"""Random interleavings of add, step (pipelined), fork, finish, abort (of a request or of one of its
sequences), preemption and eviction, with every block-accounting invariant checked after every
operation (see check_invariants), and has_work() checked against what schedule() returns."""

from collections import deque

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from scheduler_fakes import Driver, check_invariants, expected_tokens, make_request

from pagedserve.scheduler_svc.config import SchedulerConfig
from pagedserve.scheduler_svc.scheduler import Scheduler

BS = 4


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
    )
    def configure(self, num_blocks, budget, caching, policy, chunked):
        cfg = SchedulerConfig(
            num_blocks=num_blocks,
            block_size=BS,
            max_num_seqs=6,
            max_num_batched_tokens=budget,
            max_model_len=40,
            enable_prefix_caching=caching,
            policy=policy,
            enable_chunked_prefill=chunked,
        )
        self.s = Scheduler(cfg)
        self.d = Driver(self.s, lag=0)
        self.d.in_flight = deque()

    @precondition(lambda self: self.s is not None)
    @rule(
        # A few shared prefixes, so that requests hit each other's blocks.
        base=st.sampled_from([[5, 6, 7, 8, 9, 10, 11, 12], [5, 6, 7, 8, 20, 21], [30]]),
        tail=st.lists(st.integers(2, 40), max_size=10),
        max_tokens=st.integers(1, 12),
        n=st.sampled_from([1, 1, 2, 3]),
        seed=st.integers(0, 3),
        salt=st.sampled_from(["", "", "x"]),
        priority=st.integers(0, 2),
        eos=st.booleans(),
    )
    def add(self, base, tail, max_tokens, n, seed, salt, priority, eos):
        prompt = (base + tail)[:30]
        if n * -(-(len(prompt) + max_tokens) // BS) > self.s.config.num_blocks:
            return
        if not self.s.config.enable_chunked_prefill and len(prompt) > self.s.config.max_num_batched_tokens:
            return
        rid = f"r{self.next_id}"
        self.next_id += 1
        kw = dict(eos=1 if eos else None, salt=salt, priority=priority)
        self.s.add_request(make_request(rid, prompt, max_tokens=max_tokens, n=n, seed=seed, **kw))
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
        for (rid, index), log in self.d.logs.items():
            prompt, seed, _ = self.prompts[rid]
            if log.tokens:
                # Whatever preemptions and forks happened, each sequence is its reference run.
                assert log.tokens == expected_tokens(prompt, seed + index, len(log.tokens))

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
