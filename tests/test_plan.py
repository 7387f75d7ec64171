from scheduler_fakes import Driver, check_invariants, make_request

from pagedserve.scheduler_svc.config import SchedulerConfig
from pagedserve.scheduler_svc.scheduler import Scheduler


def _setup(lag: int = 0, **kw) -> tuple[Scheduler, Driver]:
    cfg = dict(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    s = Scheduler(SchedulerConfig(**(cfg | kw)))
    return s, Driver(s, lag=lag, check=lambda: check_invariants(s))


def test_step_ids_increase_from_one():
    s, d = _setup()
    s.add_request(make_request("a", [3, 4, 5], max_tokens=3, eos=None))
    d.run()
    assert [p.step_id for p in d.plans] == list(range(1, len(d.plans) + 1))


def test_new_request_carries_prompt_computed_tokens_and_sampling():
    s, d = _setup()
    s.add_request(make_request("a", [3, 4, 5, 6, 7], max_tokens=3, temperature=0.5, seed=9))
    d.step()
    (new,) = d.plans[0].new_requests
    assert list(new.token_ids) == [3, 4, 5, 6, 7] and new.prompt_len == 5
    assert new.num_computed_tokens == 0 and new.sampling.seed == 9 and new.request_id == "a"
    assert list(d.plans[0].num_new_blocks) == [2] and list(d.plans[0].new_block_ids) == [0, 1]


def test_only_blocks_the_worker_lacks_are_sent():
    s, d = _setup()
    s.add_request(make_request("a", [3, 4, 5, 6, 7], max_tokens=8, eos=None))
    d.run()
    sent = [b for p in d.plans for b in p.new_block_ids]
    assert sent == [0, 1, 2]  # 5 prompt + 7 fed-back outputs computed: 12 tokens, 3 blocks, each once
    assert all(not p.new_requests for p in d.plans[1:])


def test_slot_freed_in_a_plan_is_reused_by_a_newcomer_of_the_same_plan():
    s, d = _setup(max_num_seqs=1)
    s.add_request(make_request("a", [3, 4], max_tokens=1))
    s.add_request(make_request("b", [5, 6], max_tokens=1))
    d.step()
    d.step()
    plan = d.plans[-1]
    assert list(plan.finished_slots) == [0] and plan.new_requests[0].slot == 0


def test_cow_emits_a_replacement_only_for_entries_the_worker_has():
    s, d = _setup()
    s.add_request(make_request("a", [3, 4, 5, 6, 7, 8], max_tokens=3, n=2, seed=1, eos=None))
    d.step()
    d.step()
    plan = d.plans[-1]
    assert len(plan.copy_src_blocks) == 1
    # The parent already had the shared block: its entry is replaced; the child is new to the
    # worker (entire table sent), or it was the last writer, which keeps the block.
    parent_slot = plan.slots[0]
    if plan.replaced_slots:
        assert list(plan.replaced_slots) == [parent_slot] and list(plan.replaced_block_indices) == [1]
        assert plan.replaced_block_ids[0] == plan.copy_dst_blocks[0]
    d.run()


def test_requests_at_maps_sampled_slots_back_to_requests():
    s, d = _setup()
    for rid in "abc":
        s.add_request(make_request(rid, [3, 4, 5], max_tokens=2, eos=None))
    out = d.schedule()
    _, result = d.in_flight[-1]
    assert d.builder.requests_at(out.step_id, list(result.sampled_slots)) == out.sampled
    d.drain()


def test_finished_request_never_sent_to_the_worker_is_not_in_finished_slots():
    s, d = _setup(max_num_seqs=1)
    s.add_request(make_request("a", [3, 4], max_tokens=2))
    s.add_request(make_request("b", [5, 6], max_tokens=2))
    d.step()
    d.abort("b")
    d.step()
    assert list(d.plans[-1].finished_slots) == []
    d.run()
