import pytest
from scheduler_fakes import EOS, Driver, SeqLog, check_invariants, expected_tokens, make_request

from pagedserve.scheduler_svc.config import SchedulerConfig
from pagedserve.scheduler_svc.kv_cache_manager import KVCacheManager
from pagedserve.scheduler_svc.request import Request, RequestStatus
from pagedserve.scheduler_svc.scheduler import Scheduler
from pagedserve.v1 import common_pb2

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


def test_one_token_prompt_forks_at_admission_with_no_empty_step():
    s, d = _setup()
    s.add_request(make_request("a", [5], max_tokens=3, n=3, seed=4, eos=None))
    out = d.step()
    assert out.step_id == 1 and out.num_scheduled_tokens == [1, 1, 1]
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
    # 8 tokens cached: nothing to compute before the fork, which happens in the same step.
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


# ---------------------------------------------------------------- has_work


def _is_empty(out) -> bool:
    return not (out.scheduled or out.finished or out.preempted)


def test_has_work_says_whether_schedule_returns_a_non_empty_step():
    s, d = _setup(num_blocks=12, max_num_seqs=2, max_model_len=48)
    assert not s.has_work()
    s.add_request(make_request("a", _prompt(9), max_tokens=3, eos=None))
    s.add_request(make_request("b", _prompt(9, 5), max_tokens=30, eos=None))
    s.add_request(make_request("c", _prompt(9, 7), max_tokens=3, eos=None))  # no batch place yet
    seen_idle = False
    while s.has_unfinished_requests() or d.in_flight or s.has_work():  # departures to report
        if s.has_work():
            assert not _is_empty(d.schedule())
        else:
            seen_idle = True
            assert d.in_flight, "no work and nothing in flight: it would never finish"
        if d.in_flight and (len(d.in_flight) >= 2 or not s.has_work()):
            d.update()
    assert not s.has_work() and seen_idle
    assert s.stats().num_steps == len(d.plans)


def test_empty_pipeline_round_does_not_burn_a_step_id():
    s, d = _setup(lag=1)
    s.add_request(make_request("a", _prompt(5), max_tokens=1, eos=None))
    d.schedule()  # samples the only token: nothing more until its result is in
    assert not s.has_work()
    d.update()
    assert s.has_work()  # the departure is reported in the next step
    assert d.schedule().step_id == 2 and not s.has_work()


# ---------------------------------------------------------------- carrying on with outputs


def test_request_with_output_tokens_continues_like_an_uninterrupted_seeded_run():
    prompt = _prompt(10)
    reference = expected_tokens(prompt, 7, 20)
    s, d = _setup()
    streamed = reference[:6]
    req = make_request("a", prompt, max_tokens=20, min_tokens=8, eos=None, seed=7, temperature=1.0)
    req.token_ids = prompt + streamed
    s.add_request(req)
    d.logs[("a", 0)] = SeqLog(tokens=list(streamed))  # what the client has seen
    d.run()
    (new,) = d.plans[0].new_requests
    assert list(new.token_ids) == prompt + streamed and new.prompt_len == 10
    log = d.logs[("a", 0)]
    assert log.tokens == reference  # nothing re-sent, nothing lost, same draws
    assert log.finish_reason == LENGTH and req.num_output_tokens == 20


def test_request_with_output_tokens_is_one_sequence_with_room_left():
    s, _ = _setup()
    req = make_request("a", _prompt(4), max_tokens=3, n=2)
    req.token_ids += [9]
    with pytest.raises(ValueError):
        s.add_request(req)
    req = make_request("a", _prompt(4), max_tokens=3)
    req.token_ids += [9, 9, 9]
    with pytest.raises(ValueError):
        s.add_request(req)


def test_failover_resumes_each_sequence_with_its_index_and_child_seed():
    # The engine's failover path (RequestStream.core_requests) on a fresh core: each unfinished
    # sequence carries on after what its client has seen and ends exactly as an uninterrupted run.
    from pagedserve.scheduler_svc.request_stream import RequestStream
    from pagedserve.v1 import engine_pb2

    prompt = _prompt(10)
    msg = engine_pb2.GenerateTokensRequest(
        request_id="a",
        prompt_token_ids=prompt,
        sampling=common_pb2.SamplingParams(n=3, seed=7, temperature=1.0, max_tokens=12, ignore_eos=True),
    )
    stream = RequestStream(msg)
    refs = [expected_tokens(prompt, 7 + i, 12) for i in range(3)]
    stream.sequences[0].token_ids = refs[0][:5]
    stream.sequences[1].token_ids = refs[1][:12]
    stream.sequences[1].finish_reason = LENGTH
    # Sequence 2 had streamed nothing yet.
    s, d = _setup()
    requests = stream.core_requests(frozenset({EOS}))
    assert [(r.index, r.sampling.seed, r.num_output_tokens) for r in requests] == [(0, 7, 5), (2, 9, 0)]
    for r in requests:
        s.add_request(r)
    d.logs[("a", 0)] = SeqLog(tokens=refs[0][:5])
    d.run()
    assert d.logs[("a", 0)].tokens == refs[0]
    assert d.logs[("a", 2)].tokens == refs[2]
    assert ("a", 1) not in d.logs


# ---------------------------------------------------------------- per-sequence abort


def test_abort_of_one_sequence_frees_its_own_blocks_and_siblings_continue():
    s, d = _setup()
    prompt = _prompt(9)  # two full blocks shared by every sequence after the fork
    s.add_request(make_request("a", prompt, max_tokens=12, n=3, seed=2, eos=None))
    for _ in range(6):
        d.step()
    seqs = {r.index: r for r in s.running}
    shared = seqs[0].block_table[:2]
    own = [b for b in seqs[1].block_table if b not in shared]
    assert all(s.kv.pool.ref_counts[b] == 3 for b in shared) and own
    used = s.kv.pool.num_used_blocks
    (out,) = s.abort_request("a", 1)
    assert out.index == 1 and out.finish_reason == ABORT
    assert all(s.kv.pool.ref_counts[b] == 0 for b in own)
    assert all(s.kv.pool.ref_counts[b] == 2 for b in shared)
    assert s.kv.pool.num_used_blocks == used - len(own)
    assert s.abort_request("a", 1) == []
    slot = d.builder.slot_of(seqs[1])
    d.step()
    assert list(d.plans[-1].finished_slots) == [slot]
    d.run()
    for i in (0, 2):
        assert d.logs[("a", i)].tokens == expected_tokens(prompt, 2 + i, 12)


def test_abort_of_a_sequence_not_forked_yet_forks_the_others_only():
    s, d = _setup(max_num_batched_tokens=8, max_num_seqs=3)
    prompt = _prompt(20)
    s.add_request(make_request("a", prompt, max_tokens=4, n=3, seed=5, eos=None))
    d.step()  # a prefill chunk: no fork yet
    assert [o.index for o in s.abort_request("a", 2)] == [2]
    d.run()
    assert set(d.logs) == {("a", 0), ("a", 1)} and s.stats().requests_finished["abort"] == 1
    assert d.logs[("a", 1)].tokens == expected_tokens(prompt, 6, 4)


def test_abort_of_the_first_sequence_before_the_fork_hands_its_progress_to_a_sibling():
    s, d = _setup(max_num_batched_tokens=8, max_num_seqs=3)
    prompt = _prompt(20)
    s.add_request(make_request("a", prompt, max_tokens=4, n=3, seed=5, eos=None))
    d.step()
    computed = s.running[0].num_computed_tokens
    assert [o.index for o in s.abort_request("a", 0)] == [0]
    (heir,) = s.running
    assert heir.index == 1 and heir.num_computed_tokens == computed and heir.pending_forks == [2]
    d.run()
    for i in (1, 2):
        assert d.logs[("a", i)].tokens == expected_tokens(prompt, 5 + i, 4)
    assert s.stats().requests_finished == {"stop": 0, "length": 2, "abort": 1}


# ---------------------------------------------------------------- prompt logprobs


def test_prompt_logprobs_request_computes_its_whole_prompt_despite_a_prefix_hit():
    s, d = _setup()
    prompt = _prompt(13)
    s.add_request(make_request("warm", prompt, max_tokens=1))
    d.run()
    s.add_request(make_request("plain", prompt, max_tokens=1))
    s.add_request(make_request("scored", prompt, max_tokens=1, prompt_logprobs=0))
    d.run()
    new = {n.request_id: n for p in d.plans for n in p.new_requests}
    assert new["plain"].num_computed_tokens == 12
    assert new["scored"].num_computed_tokens == 0
    assert d.logs[("scored", 0)].num_cached_tokens == 0


# ---------------------------------------------------------------- one request's failure fails it alone


def _others_finish_right(d: Driver, prompts: dict[str, list[int]], seed: int = 0) -> None:
    for rid, prompt in prompts.items():
        log = d.logs[(rid, 0)]
        assert log.finish_reason == LENGTH and log.tokens == expected_tokens(prompt, seed, len(log.tokens))


def test_an_exception_while_forking_fails_that_request_alone_and_the_step_goes_on(monkeypatch):
    # The seed overflow of an n > 1 request raised here once and took the whole worker down with it.
    s, d = _setup()
    fork = Request.fork

    def poisoned_fork(self, index):
        if self.request_id == "poison":
            raise OverflowError("Value out of range: 18446744073709551616")
        return fork(self, index)

    monkeypatch.setattr(Request, "fork", poisoned_fork)
    prompts = {f"r{i}": _prompt(9, 3 * i) for i in range(3)}
    d.add(make_request("r0", prompts["r0"], max_tokens=6, eos=None))
    d.add(make_request("poison", _prompt(9, 30), max_tokens=6, n=2, eos=None))
    for rid in ("r1", "r2"):
        d.add(make_request(rid, prompts[rid], max_tokens=6, eos=None))
    d.run()
    (failure,) = d.failures
    assert failure.request_id == "poison" and not failure.retry
    assert "request 'poison' failed while forking its sequences: OverflowError" in failure.message
    _others_finish_right(d, prompts)
    assert s.kv.pool.num_used_blocks == 0 and not s.has_unfinished_requests()


def test_an_exception_while_taking_a_token_fails_that_request_alone(monkeypatch):
    s, d = _setup(lag=1)
    check_stop = Request.check_stop

    def poisoned_check_stop(self, token_id):
        if self.request_id == "poison" and self.num_output_tokens == 3:
            raise KeyError("bookkeeping")
        return check_stop(self, token_id)

    monkeypatch.setattr(Request, "check_stop", poisoned_check_stop)
    prompts = {f"r{i}": _prompt(7, 5 * i) for i in range(3)}
    for rid in ("r0", "poison", "r1", "r2"):
        d.add(make_request(rid, prompts.get(rid, _prompt(7, 40)), max_tokens=8, eos=None))
    d.run()
    (failure,) = d.failures
    assert failure.message.startswith("request 'poison' failed while taking its sampled token: KeyError")
    assert len(d.logs[("poison", 0)].tokens) == 2  # its third token never reached the client
    _others_finish_right(d, prompts)
    assert s.kv.pool.num_used_blocks == 0


def test_a_failure_while_scheduling_uncaches_what_it_was_to_compute(monkeypatch):
    # The poison caches its prompt's blocks (for the requests after it to share) and then fails: its part of
    # the step is never sent, so those blocks are never computed. They leave the cache at once: the request
    # after it in the same step computes its prompt itself (the strict fake worker would raise on a read of
    # blocks never computed).
    _, d = _setup()
    cache_full_blocks = KVCacheManager.cache_full_blocks

    def poisoned(self, req, step):
        cache_full_blocks(self, req, step)
        if req.request_id == "poison":
            raise RuntimeError("after caching")

    monkeypatch.setattr(KVCacheManager, "cache_full_blocks", poisoned)
    prompt = _prompt(12)
    d.add(make_request("poison", prompt, max_tokens=4, eos=None))
    d.add(make_request("sharer", prompt, max_tokens=4, eos=None))
    out = d.step()
    assert [(r.request_id, n) for r, n in zip(out.scheduled, out.num_scheduled_tokens, strict=True)] == [
        ("sharer", 12)
    ]
    assert [(f.request_id, f.retry) for f in d.failures] == [("poison", False)]
    assert (
        "request 'poison' failed while being admitted: RuntimeError: after caching" in d.failures[0].message
    )
    d.run()
    _others_finish_right(d, {"sharer": prompt})


def test_a_request_the_worker_refuses_fails_alone_and_one_that_shared_its_blocks_is_recomputed():
    # The worker leaves the refused request out of its step, so the blocks it cached are never computed;
    # a request that hit them in the same step read garbage there (a non-strict fake, as a real worker):
    # its tokens from that step are dropped and it is recomputed, with the reference tokens in the end.
    s = Scheduler(SchedulerConfig(num_blocks=64, block_size=BS, max_num_seqs=8, max_num_batched_tokens=64))
    d = Driver(s, lag=1, refuse=lambda new: "refused" if new.request_id == "poison" else None, strict=False)
    prompt = _prompt(12)
    d.add(make_request("poison", [*prompt, 50], max_tokens=4, eos=None))
    d.add(make_request("sharer", [*prompt, 51], max_tokens=4, eos=None))
    d.add(make_request("other", _prompt(6, 30), max_tokens=4, eos=None, salt="elsewhere"))
    out = d.step()
    assert out.num_scheduled_tokens == [13, 1, 6]  # the sharer hit the poison's 3 blocks
    d.run()
    assert [(f.request_id, f.retry) for f in d.failures] == [("poison", False), ("sharer", True)]
    assert d.failures[0].message == (
        "request 'poison' failed: its worker refused it: new request 'poison' (slot 0): refused"
    )
    _others_finish_right(d, {"sharer": [*prompt, 51], "other": _prompt(6, 30)})
    check_invariants(s)
    assert s.kv.pool.num_used_blocks == 0
