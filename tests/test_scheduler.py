import pytest
from pagedserve.proto import common_pb2
from pagedserve.scheduler_svc.config import SchedulerConfig
from pagedserve.scheduler_svc.request import RequestStatus
from pagedserve.scheduler_svc.scheduler import Scheduler
from scheduler_fakes import EOS, Driver, check_invariants, expected_tokens, make_request

BS = 4
STOP, LENGTH, ABORT = (
    common_pb2.FINISH_REASON_STOP,
    common_pb2.FINISH_REASON_LENGTH,
    common_pb2.FINISH_REASON_ABORT,
)


def _setup(lag: int = 0, **kw) -> tuple[Scheduler, Driver]:
    cfg = dict(num_blocks=64, block_size=BS, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128)
    s = Scheduler(SchedulerConfig(**(cfg | kw)))
    return s, Driver(s, lag=lag, check=lambda: check_invariants(s))


def _prompt(n: int, start: int = 2) -> list[int]:
    return [start + i % 60 for i in range(n)]


# ---------------------------------------------------------------- batching


def test_chunked_prefill_respects_token_budget():
    s, d = _setup(max_num_batched_tokens=16)
    s.add_request(make_request("a", _prompt(40), max_tokens=2, eos=None))
    assert [d.step().num_scheduled_tokens for _ in range(4)] == [[16], [16], [8], [1]]
    d.run()


def test_running_decodes_go_before_a_waiting_prefill_which_gets_the_rest_of_the_budget():
    s, d = _setup(max_num_batched_tokens=16)
    s.add_request(make_request("a", _prompt(3), max_tokens=5, eos=None))
    d.step()
    s.add_request(make_request("b", _prompt(30, 7), max_tokens=2, eos=None))
    out = d.step()
    assert [r.request_id for r in out.scheduled] == ["a", "b"]
    assert out.num_scheduled_tokens == [1, 15] and out.total_num_scheduled_tokens == 16
    d.run()


def test_without_chunked_prefill_a_prompt_waits_for_a_step_with_room():
    s, d = _setup(max_num_batched_tokens=16, enable_chunked_prefill=False)
    s.add_request(make_request("a", _prompt(3), max_tokens=5, eos=None))
    d.step()
    s.add_request(make_request("b", _prompt(16, 7), max_tokens=2, eos=None))
    assert d.step().num_scheduled_tokens == [1]
    d.run()


def test_max_num_seqs_caps_the_batch():
    s, d = _setup(max_num_seqs=3)
    for i in range(5):
        s.add_request(make_request(f"r{i}", _prompt(5, i), max_tokens=3, eos=None))
    assert len(d.step().scheduled) == 3
    assert len(s.waiting) == 2
    d.run()


def test_fork_reserves_batch_places_for_all_its_sequences():
    s, d = _setup(max_num_seqs=3)
    s.add_request(make_request("a", _prompt(5), max_tokens=2, n=2, eos=None))
    s.add_request(make_request("b", _prompt(5, 9), max_tokens=2, n=2, eos=None))
    d.step()
    assert [r.request_id for r in s.running] == ["a"] and len(s.waiting) == 1
    d.run()


def test_priority_policy_admits_lower_value_first_then_arrival():
    s, d = _setup(policy="priority", max_num_seqs=1)
    for rid, prio in [("late-low", 5), ("high", -1), ("low", 5), ("mid", 0)]:
        s.add_request(make_request(rid, _prompt(3), priority=prio, max_tokens=1))
    order = [d.step().scheduled[0].request_id for _ in range(4)]
    assert order == ["high", "mid", "late-low", "low"]


def test_fcfs_ignores_priority():
    s, d = _setup(max_num_seqs=1)
    for rid, prio in [("first", 5), ("second", -1)]:
        s.add_request(make_request(rid, _prompt(3), priority=prio, max_tokens=1))
    assert [d.step().scheduled[0].request_id for _ in range(2)] == ["first", "second"]


# ---------------------------------------------------------------- preemption


def test_preempted_request_resumes_at_front_with_its_tokens():
    # 12 blocks: the three requests outgrow the pool as they decode.
    s, d = _setup(num_blocks=12, max_model_len=48, enable_prefix_caching=False)
    prompts = {f"r{i}": _prompt(9, 3 * i) for i in range(3)}
    for rid, p in prompts.items():
        s.add_request(make_request(rid, p, max_tokens=30, eos=None, seed=7))
    while not s.stats().num_preemptions:
        d.step()
    victim = s.waiting[0]
    assert victim.request_id == "r2"  # the latest arrival
    assert victim.num_output_tokens > 0 and victim.status is RequestStatus.WAITING
    s.add_request(make_request("newcomer", _prompt(3), max_tokens=1))
    assert s.waiting[0] is victim  # ahead of anything that arrived later
    d.run()
    for rid, p in prompts.items():
        assert d.logs[(rid, 0)].tokens == expected_tokens(p, 7, 30)


def test_resumed_request_enters_the_worker_with_prompt_and_outputs():
    s, d = _setup(num_blocks=12, max_model_len=48, enable_prefix_caching=False)
    for i in range(3):
        s.add_request(make_request(f"r{i}", _prompt(9, 3 * i), max_tokens=30, eos=None))
    while not s.stats().num_preemptions:
        d.step()
    victim = s.waiting[0]
    produced = list(victim.token_ids)
    while victim.status is not RequestStatus.RUNNING:
        d.step()
    (new,) = [n for n in d.plans[-1].new_requests if n.request_id == victim.request_id]
    assert list(new.token_ids) == produced and new.prompt_len == 9 and new.num_computed_tokens == 0
    d.run()


def test_priority_policy_preempts_the_lowest_priority():
    s, d = _setup(num_blocks=12, max_model_len=48, policy="priority", enable_prefix_caching=False)
    for rid, prio in [("low", 9), ("high", 0), ("mid", 5)]:
        s.add_request(make_request(rid, _prompt(9), priority=prio, max_tokens=30, eos=None))
    while not s.stats().num_preemptions:
        d.step()
    assert s.waiting[0].request_id == "low"
    d.run()


def test_preempted_request_with_pending_tokens_accepts_them_and_waits_for_them():
    s, d = _setup(lag=2, num_blocks=12, max_model_len=48, enable_prefix_caching=False)
    prompts = {f"r{i}": _prompt(9, 3 * i) for i in range(3)}
    for rid, p in prompts.items():
        s.add_request(make_request(rid, p, max_tokens=30, eos=None))
    while not s.stats().num_preemptions:
        d.schedule()
        while len(d.in_flight) > 2:
            d.update()
    victim = s.waiting[0]
    assert victim.num_pending_tokens > 0
    before = victim.num_output_tokens
    out = d.schedule()
    assert victim not in out.scheduled  # not re-admitted while samples are in flight
    d.drain()
    assert victim.num_pending_tokens == 0 and victim.num_output_tokens > before
    d.run()
    for rid, p in prompts.items():
        assert d.logs[(rid, 0)].tokens == expected_tokens(p, 0, 30)


def test_request_too_large_for_the_pool_is_refused():
    s, _ = _setup(num_blocks=4)
    with pytest.raises(ValueError):
        s.add_request(make_request("a", _prompt(10), max_tokens=10))


def test_prompt_as_long_as_the_model_is_refused():
    s, _ = _setup(max_model_len=16)
    with pytest.raises(ValueError):
        s.add_request(make_request("a", _prompt(16)))


# ---------------------------------------------------------------- abort


def test_abort_of_waiting_request_frees_every_block():
    s, d = _setup(max_num_seqs=3)
    s.add_request(make_request("a", _prompt(9), max_tokens=5, n=3))
    s.add_request(make_request("b", _prompt(9), max_tokens=5, n=3))
    d.step()
    outputs = d.abort("b")
    assert [(o.index, o.finish_reason) for o in outputs] == [(0, ABORT), (1, ABORT), (2, ABORT)]
    d.abort("a")
    d.drain()
    assert not s.has_unfinished_requests() and s.kv.pool.num_used_blocks == 0
    assert d.abort("a") == []


def test_abort_of_running_request_frees_every_block_and_its_slot():
    s, d = _setup()
    s.add_request(make_request("a", _prompt(9), max_tokens=50, n=2, eos=None))
    for _ in range(3):
        d.step()
    slots = {d.builder.slot_of(r) for r in s.running}
    assert len(d.abort("a")) == 2
    assert s.kv.pool.num_used_blocks == 0
    assert set(d.step().finished) and set(d.plans[-1].finished_slots) == slots


def test_abort_with_steps_in_flight_ignores_their_results():
    s, d = _setup(lag=3)
    s.add_request(make_request("a", _prompt(5), max_tokens=50, eos=None))
    for _ in range(6):
        d.step()
    assert s.running[0].num_pending_tokens == 3
    d.abort("a")
    assert s.kv.pool.num_used_blocks == 0
    d.drain()
    assert d.logs[("a", 0)].finish_reason == ABORT
    assert len(d.logs[("a", 0)].tokens) == 6 - 3


# ---------------------------------------------------------------- finishing


def _run_one(prompt=None, lag=0, **sampling):
    s, d = _setup(lag=lag)
    s.add_request(make_request("a", prompt or _prompt(5), **sampling))
    d.run()
    return s, d.logs[("a", 0)]


def _eos_prompt() -> tuple[list[int], int]:
    """A prompt whose reference output contains EOS, and where."""
    for start in range(2, 200):
        prompt = _prompt(5, start)
        ref = expected_tokens(prompt, 0, 100)
        if EOS in ref[3:]:
            return prompt, ref.index(EOS, 3)
    raise AssertionError


def test_eos_finishes_with_stop():
    prompt, _ = _eos_prompt()
    _, log = _run_one(prompt, max_tokens=100)
    assert log.finish_reason == STOP and len(log.tokens) == expected_tokens(prompt, 0, 100).index(EOS) + 1
    assert log.stop_token_id is None


def test_min_tokens_keeps_eos_from_ending_early():
    prompt, at = _eos_prompt()
    ref = expected_tokens(prompt, 0, 100)
    _, log = _run_one(prompt, max_tokens=100, min_tokens=at + 2)  # EOS is output number at + 1
    assert log.tokens[: at + 1] == ref[: at + 1] and len(log.tokens) > at + 1


def test_ignore_eos_runs_to_max_tokens():
    prompt, _ = _eos_prompt()
    _, log = _run_one(prompt, max_tokens=100, ignore_eos=True)
    assert log.finish_reason == LENGTH and len(log.tokens) == 100


def test_stop_token_id_finishes_and_is_reported():
    ref = expected_tokens(_prompt(5), 0, 10)
    stop = ref[4]
    _, log = _run_one(max_tokens=10, stop_token_ids=[stop], eos=None)
    assert log.finish_reason == STOP and log.stop_token_id == stop
    assert log.tokens == ref[: ref.index(stop) + 1]


def test_max_tokens_finishes_with_length():
    _, log = _run_one(max_tokens=7, eos=None)
    assert log.finish_reason == LENGTH and len(log.tokens) == 7


def test_model_length_finishes_with_length():
    _, log = _run_one(_prompt(120), eos=None)
    assert log.finish_reason == LENGTH and len(log.tokens) == 128 - 120


@pytest.mark.parametrize("lag", [1, 2, 4])
def test_pipelined_scheduling_never_over_generates(lag):
    s, d = _setup(lag=lag)
    s.add_request(make_request("a", _prompt(5), max_tokens=6, eos=None))
    s.add_request(make_request("b", _prompt(122, 3), eos=None))  # up to max_model_len
    d.run()
    sampled = [r.request_id for out in d.outputs for r in out.sampled]
    assert sampled.count("a") == 6 and sampled.count("b") == 128 - 122
    assert len(d.logs[("a", 0)].tokens) == 6


def test_stop_while_later_step_in_flight_ignores_its_result_and_frees_blocks_at_once():
    prompt, _ = _eos_prompt()
    s, d = _setup(lag=2)
    s.add_request(make_request("a", prompt, max_tokens=100))
    s.add_request(make_request("b", _prompt(6), max_tokens=100, ignore_eos=True))
    while ("a", 0) not in d.logs or not d.logs[("a", 0)].finish_reason:
        d.step()
    a_blocks_free = all(s.kv.pool.ref_counts[b] == 0 for b in d.outputs[0].scheduled[0].block_table)
    assert a_blocks_free and len(d.in_flight) == 2  # finished with two steps still in flight
    d.run()
    assert d.logs[("a", 0)].tokens == expected_tokens(prompt, 0, 100)[: len(d.logs[("a", 0)].tokens)]
    assert d.logs[("a", 0)].tokens[-1] == EOS


# ---------------------------------------------------------------- forks


def test_fork_shares_every_block_and_copies_the_partial_block_once_per_writer():
    s, d = _setup()
    prompt = _prompt(7)  # the last prompt token lands in block 1, partly filled by the prefix
    s.add_request(make_request("a", prompt, max_tokens=5, n=3, seed=10, eos=None))
    d.step()  # computes the prompt but its last token
    d.step()  # forks, then each sequence writes its last prompt token
    copies = list(zip(d.plans[-1].copy_src_blocks, d.plans[-1].copy_dst_blocks, strict=True))
    assert len(copies) == 2 and len({src for src, _ in copies}) == 1  # the last writer keeps it
    tables = [r.block_table for r in s.running]
    assert len({t[0] for t in tables}) == 1 and len({t[1] for t in tables}) == 3
    d.run()
    assert sum(len(p.copy_src_blocks) for p in d.plans) == 2
    for i in range(3):
        assert d.logs[("a", i)].tokens == expected_tokens(prompt, 10 + i, 5)


def test_fork_needs_no_copy_when_the_last_prompt_token_starts_a_block():
    s, d = _setup()
    s.add_request(make_request("a", _prompt(9), max_tokens=3, n=2, seed=1, eos=None))
    d.run()
    assert all(not p.copy_src_blocks for p in d.plans)


def test_one_token_prompt_forks_with_no_blocks():
    s, d = _setup()
    s.add_request(make_request("a", [5], max_tokens=3, n=3, seed=4, eos=None))
    out = d.step()
    assert out.scheduled == [] and len(s.running) == 1
    out = d.step()
    assert out.num_scheduled_tokens == [1, 1, 1]
    assert [n.seed for n in (r.sampling for r in out.scheduled)] == [4, 5, 6]
    d.run()
    for i in range(3):
        assert d.logs[("a", i)].tokens == expected_tokens([5], 4 + i, 3)


def test_fork_of_fully_cached_prefix_happens_at_admission():
    s, d = _setup()
    prompt = _prompt(9)
    s.add_request(make_request("warm", prompt, max_tokens=1))
    d.run()
    s.add_request(make_request("a", prompt, max_tokens=2, n=2, seed=3, eos=None))
    assert d.step().scheduled == []  # 8 tokens cached: nothing to compute before the fork
    assert d.step().num_scheduled_tokens == [1, 1]
    d.run()
    assert d.logs[("a", 1)].num_cached_tokens == 8


# ---------------------------------------------------------------- outputs and numbers


def test_logprobs_are_converted_from_parallel_arrays():
    s, d = _setup()
    s.add_request(make_request("a", _prompt(5), max_tokens=2, logprobs=3, eos=None))
    s.add_request(make_request("b", _prompt(5, 9), max_tokens=2, eos=None))
    d.schedule()
    outputs = d.update()
    (a,) = [o for o in outputs if o.request_id == "a"]
    (b,) = [o for o in outputs if o.request_id == "b"]
    (lp,) = a.logprobs
    token = a.new_token_ids[0]
    assert lp.token_id == token and lp.rank == 1 + token % 3
    assert list(lp.top_token_ids) == [(token + j) % 64 for j in range(3)]
    assert b.logprobs is None


def test_stats_report_usage_preemptions_and_finish_reasons():
    s, d = _setup(num_blocks=12, max_model_len=48)
    for i in range(3):
        s.add_request(make_request(f"r{i}", _prompt(9, 3 * i), max_tokens=30, eos=None))
    d.step()
    stats = s.stats()
    assert stats.num_running == 3 and stats.kv_cache_usage == stats.num_blocks_in_use / 12 > 0
    d.abort("r0")
    d.run()
    stats = s.stats()
    assert stats.num_preemptions > 0 and stats.num_blocks_in_use == 0
    assert stats.requests_finished == {"stop": 0, "length": 2, "abort": 1}
    assert stats.generation_tokens >= 60 and stats.prompt_tokens >= 27
