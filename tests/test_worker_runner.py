"""The worker's executor against the step protocol (proto/pagedserve/v1/worker.proto), on a tiny random Llama."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from worker_testing import (
    PROMPT_A,
    PROMPT_B,
    TINY_VOCAB,
    decode_plan,
    first_plan,
    hf_greedy,
    load_hf,
    make_runner,
    new_request,
    plan,
    save_tiny_llama,
    snapshot,
)

from pagedserve.v1 import worker_pb2
from pagedserve.worker_svc.kv_cache import KVCache, KVCacheSpec
from pagedserve.worker_svc.runner import PlanError
from pagedserve.worker_svc.step_inputs import SlotArrays

NUM_BLOCKS = 32
BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def hf_model(model_dir):
    return load_hf(model_dir)


@pytest.fixture
def runner(model_dir):
    return make_runner(model_dir, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)


# ---- execution ---------------------------------------------------------------------------------


def test_the_cpu_pool_lays_each_block_out_kv_head_by_kv_head():
    # Views [num_blocks, block_size, num_kv_heads, head_dim] of a head-major allocation: a kv head's rows of a
    # block side by side (the decode attention reads a block front to back), the blocks one after another.
    spec = KVCacheSpec(num_layers=2, num_kv_heads=3, head_dim=8, block_size=4, dtype=torch.float32)
    cache = KVCache(spec, 5, torch.device("cpu"))
    for k, v in cache.layers:
        assert k.shape == v.shape == (5, 4, 3, 8)
        assert k.stride() == v.stride() == (3 * 4 * 8, 8, 4 * 8, 1)
    assert cache.k_caches[1].data_ptr() - cache.k_caches[0].data_ptr() == 2 * 5 * 3 * 4 * 8 * 4


def test_first_plan_samples_each_prompt_once(runner):
    result = runner.execute(first_plan())
    assert result.step_id == 1
    assert list(result.sampled_slots) == [0, 1]
    assert len(result.sampled_token_ids) == 2 and all(0 <= t < TINY_VOCAB for t in result.sampled_token_ids)
    assert list(result.num_top_logprobs) == [0, 0]
    # No request asked for logprobs: the sampler skips them and the arrays stay empty.
    assert list(result.sampled_logprobs) == [] and list(result.sampled_ranks) == []
    assert result.timings.num_tokens == len(PROMPT_A) + len(PROMPT_B)
    assert runner.tokens(0) == [*PROMPT_A, result.sampled_token_ids[0]]
    assert runner.slots[0].num_computed_tokens == len(PROMPT_A)


def test_sampled_logprobs_and_ranks_come_back_when_one_slot_asks(runner):
    plan_ = first_plan()
    plan_.new_requests[1].sampling.logprobs = 0
    result = runner.execute(plan_)
    assert list(result.num_top_logprobs) == [0, 0]
    assert len(result.sampled_logprobs) == 2 and all(lp <= 0.0 for lp in result.sampled_logprobs)
    assert list(result.sampled_ranks) == [1, 1]  # greedy picks the most likely token


def test_greedy_tokens_match_transformers_across_chunked_prefill_and_decode(runner, hf_model):
    prompt_a = [5, 17, 42, 9, 77, 3, 61, 90, 12, 33, 2]  # 11 tokens, prefilled in chunks of 4, 4, 3
    steps = [
        plan(1, [(0, 4, [0])], new_requests=[new_request(0, prompt_a)]),
        plan(2, [(0, 4, [1]), (1, 5, [2, 3])], new_requests=[new_request(1, PROMPT_B)]),
        plan(3, [(0, 3, [4]), (1, 1, [])]),
    ]
    sampled: dict[int, list[int]] = {0: [], 1: []}
    for p in steps:
        result = runner.execute(p)
        for slot, token in zip(result.sampled_slots, result.sampled_token_ids, strict=True):
            sampled[slot].append(token)
    assert [len(v) for v in sampled.values()] == [1, 2]  # slot 0 only samples when its prompt is done
    next_block = 5
    for step in range(4, 16):
        scheduled = []
        for slot in (0, 1):
            position = runner.slots[slot].num_computed_tokens
            blocks = []
            if position % BLOCK_SIZE == 0:
                blocks, next_block = [next_block], next_block + 1
            scheduled.append((slot, 1, blocks))
        result = runner.execute(plan(step, scheduled))
        for slot, token in zip(result.sampled_slots, result.sampled_token_ids, strict=True):
            sampled[slot].append(token)
    assert sampled[0] == hf_greedy(hf_model, prompt_a, len(sampled[0]))
    assert sampled[1] == hf_greedy(hf_model, PROMPT_B, len(sampled[1]))


def test_pipelined_decode_uses_the_token_sampled_by_the_previous_plan(runner, hf_model):
    # The plans are built without looking at any result: the worker feeds each decode its own token.
    plans = [first_plan(), decode_plan(2), decode_plan(3), plan(4, [(0, 1, [4]), (1, 1, [])])]
    results = [runner.execute(p) for p in plans]
    tokens_a = [r.sampled_token_ids[0] for r in results]
    assert tokens_a == hf_greedy(hf_model, PROMPT_A, 4)


def test_fork_with_copy_on_write_continues_like_its_parent(runner):
    runner.execute(first_plan())
    parent_tokens = runner.tokens(0)  # 7 tokens, 6 computed: block 1 is partly filled
    # The fork shares block 0 and gets a copy of the partly filled block 1 (copy-on-write), then
    # computes the parent's last sampled token like the parent does.
    fork = new_request(2, parent_tokens, prompt_len=len(PROMPT_A), num_computed_tokens=len(PROMPT_A))
    step2 = plan(
        2,
        [(0, 1, []), (2, 1, [0, 5])],
        new_requests=[fork],
        copy_src_blocks=[1],
        copy_dst_blocks=[5],
    )
    step3 = plan(3, [(0, 1, []), (2, 1, [])])
    r2, r3 = runner.execute(step2), runner.execute(step3)
    assert list(r2.sampled_slots) == [0, 2] and r2.sampled_token_ids[0] == r2.sampled_token_ids[1]
    assert r3.sampled_token_ids[0] == r3.sampled_token_ids[1]
    assert runner.tokens(2) == runner.tokens(0)
    assert runner.block_table(2) == [0, 5]


def test_replaced_block_entry_points_the_slot_at_the_copy(runner, model_dir):
    runner.execute(first_plan())
    # The scheduler moves slot 0's block 1 to block 6 (copy first, then replace the entry).
    result = runner.execute(
        plan(
            2,
            [(0, 1, []), (1, 1, [])],
            copy_src_blocks=[1],
            copy_dst_blocks=[6],
            replaced_slots=[0],
            replaced_block_indices=[1],
            replaced_block_ids=[6],
        )
    )
    reference = make_runner(model_dir, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    reference.execute(first_plan())
    expected = reference.execute(decode_plan(2))
    assert runner.block_table(0) == [0, 6]
    assert list(result.sampled_token_ids) == list(expected.sampled_token_ids)


def test_preempted_request_recomputed_from_its_tokens_continues_identically(runner, hf_model):
    runner.execute(first_plan())
    runner.execute(decode_plan(2))
    tokens = runner.tokens(0)  # prompt + 2 sampled
    # Preempt slot 0, then bring it back (in another slot, other blocks) with everything it knew.
    runner.execute(plan(3, [(1, 1, [])], preempted_slots=[0]))
    back = new_request(7, tokens, prompt_len=len(PROMPT_A))
    result = runner.execute(plan(4, [(7, len(tokens), [8, 9])], new_requests=[back]))
    assert list(result.sampled_slots) == [7]
    assert runner.tokens(7) == [*PROMPT_A, *hf_greedy(hf_model, PROMPT_A, 3)]
    assert runner.slots[7].sampling.output_token_ids == runner.tokens(7)[len(PROMPT_A) :]


def test_slot_freed_in_a_plan_may_take_a_new_request_in_the_same_plan(runner):
    runner.execute(first_plan())
    result = runner.execute(
        plan(2, [(0, 1, []), (1, 3, [2])], finished_slots=[1], new_requests=[new_request(1, [4, 5, 6])])
    )
    assert list(result.sampled_slots) == [0, 1]
    assert runner.tokens(1)[:3] == [4, 5, 6] and runner.slots[1].request_id == "req-1"


def test_prompt_logprobs_over_chunks_match_transformers(runner, hf_model):
    prompt = [5, 17, 42, 9, 77, 3, 61, 90, 12]
    req = new_request(0, prompt, prompt_logprobs=2, logprobs=3)
    r1 = runner.execute(plan(1, [(0, 5, [0, 1])], new_requests=[req]))
    r2 = runner.execute(plan(2, [(0, 4, [2])]))
    entries = [*r1.prompt_logprobs, *r2.prompt_logprobs]
    assert [(e.slot, e.start_position, len(e.logprobs)) for e in entries] == [(0, 1, 5), (0, 6, 3)]
    with torch.no_grad():
        logp = hf_model(torch.tensor([prompt])).logits[0].log_softmax(-1)
    got = [lp for e in entries for lp in e.logprobs]
    for position, lp in enumerate(got, start=1):
        assert lp.token_id == prompt[position]
        assert lp.logprob == pytest.approx(logp[position - 1, prompt[position]].item(), abs=1e-4)
        assert list(lp.top_token_ids) == logp[position - 1].topk(2).indices.tolist()
        assert lp.rank == 1 + int((logp[position - 1] > logp[position - 1, prompt[position]]).sum())
    # The sampled token carries its 3 alternatives, most likely first.
    assert list(r2.num_top_logprobs) == [3]
    assert r2.top_token_ids[0] == r2.sampled_token_ids[0]
    assert r2.top_logprobs[0] == pytest.approx(r2.sampled_logprobs[0])
    assert r2.top_token_ids[:3] == logp[-1].topk(3).indices.tolist()


def test_plan_without_scheduled_slots_only_applies_deltas(runner):
    runner.execute(first_plan())
    result = runner.execute(plan(2, finished_slots=[0, 1]))
    assert result.step_id == 2 and not result.sampled_slots and result.timings.num_tokens == 0
    assert runner.slots == {}


def test_reset_forgets_everything_and_restarts_at_step_one(runner):
    runner.execute(first_plan())
    runner.reset()
    assert runner.slots == {} and runner.last_step_id == 0
    with pytest.raises(PlanError, match="step 2: expected step id 1"):
        runner.execute(decode_plan(2))
    runner.execute(first_plan())
    assert sorted(runner.slots) == [0, 1]


def test_idle_time_is_the_wait_for_the_plan_after_the_previous_step(runner):
    r1 = runner.execute(first_plan())
    assert r1.timings.idle_seconds == 0.0  # nothing before the first step
    time.sleep(0.05)
    r2 = runner.execute(decode_plan(2))
    assert r2.timings.idle_seconds >= 0.05
    # A plan that arrived while the previous step still ran waited for nothing.
    r3 = runner.execute(decode_plan(3), received_at=time.perf_counter() - 10.0)
    assert r3.timings.idle_seconds == 0.0
    assert r3.timings.forward_seconds > 0.0 and r3.timings.num_tokens == 2


def test_the_gap_is_the_end_of_the_previous_step_to_the_start_of_this_one(runner):
    assert runner.execute(first_plan()).timings.gap_seconds == 0.0  # nothing before the first step
    time.sleep(0.05)
    # Whether or not the plan arrived in time, the worker stood still from one step to the next.
    started = time.perf_counter()
    waited = runner.execute(decode_plan(2)).timings
    assert waited.gap_seconds >= waited.idle_seconds >= 0.05
    time.sleep(0.03)
    early = runner.execute(decode_plan(3), received_at=time.perf_counter() - 10.0).timings
    done = time.perf_counter()
    # At most the time around both calls less both steps' own (prepare, forward and sample): a gap taken
    # from the start of step 2, or from the end of step 1 (before the 50 ms sleep), is longer, however
    # slowly a loaded machine runs the test.
    steps = sum(t.prepare_seconds + t.forward_seconds + t.sample_seconds for t in (waited, early))
    assert early.idle_seconds == 0.0 and 0.03 <= early.gap_seconds <= done - started - steps + 1e-6


def test_a_steps_inputs_from_the_cpp_are_numpys(model_dir):
    runner = make_runner(model_dir, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    if not runner.arrays.native:
        pytest.skip("the C++ step inputs cannot be built here")
    numpy_arrays = SlotArrays(256, BLOCK_SIZE, runner.device, native=False)
    cpp_inputs = runner.arrays.inputs
    steps = []

    def both(slots, start, num_scheduled):  # the C++'s inputs, and numpy's from the same arrays
        got = cpp_inputs(slots, start, num_scheduled)
        numpy_arrays.token_ids, numpy_arrays.block_tables = (
            runner.arrays.token_ids,
            runner.arrays.block_tables,
        )
        steps.append((got, numpy_arrays.inputs(slots, start, num_scheduled)))
        return got

    runner.arrays.inputs = both
    # Slots out of order, one past the arrays' first rows (they grow, and the C++ must read the new ones);
    # contexts ending on a block's edge (slot 0 takes a new block), mid-block, and in a longer table.
    prompts = {11: list(range(3, 10)), 0: list(range(20, 24)), 5: list(range(40, 49))}
    tables = {11: [4, 5], 0: [0], 5: [6, 7, 8]}
    runner.execute(
        plan(
            1,
            [(slot, len(prompts[slot]), tables[slot]) for slot in prompts],
            new_requests=[new_request(slot, p) for slot, p in prompts.items()],
        )
    )
    runner.execute(plan(2, [(11, 1, []), (0, 1, [1]), (5, 1, [])]))
    runner.execute(plan(3, [(5, 1, []), (11, 1, [9])]))
    assert len(steps) == 3  # the prompt step, then two plain decode steps
    for got, want in steps:
        for a, b in [
            (got.input_ids, want.input_ids),
            (got.positions, want.positions),
            (got.attn.slot_mapping, want.attn.slot_mapping),
            (got.attn.block_tables, want.attn.block_tables),
            (got.attn.query_start_loc, want.attn.query_start_loc),
            (got.attn.context_lens, want.attn.context_lens),
        ]:
            assert a.dtype == b.dtype and torch.equal(a, b)
        assert got.attn.max_query_len == want.attn.max_query_len
    assert [got.attn.max_query_len for got, _ in steps] == [9, 1, 1]
    assert steps[1][0].attn.slot_mapping.tolist() == [5 * 4 + 3, 1 * 4 + 0, 8 * 4 + 1]


def _parity_plans():
    """Steps through the plain decode path and out of it: greedy decodes taking new blocks, a sampled
    request with logprobs joining (its seed makes both runners draw alike) and leaving again, a
    preemption, and 1-token steps that sample nothing (a prompt's chunk)."""
    sampled = new_request(2, [7, 8, 9], temperature=0.9, top_p=0.8, seed=11, logprobs=2)
    chunked = new_request(3, [30, 31, 32, 33, 34], num_computed_tokens=2)
    return [
        first_plan(),  # A (6 tokens, 7 after it) in blocks 0, 1 and B (5, then 6) in 2, 3: 8 tokens each
        decode_plan(2),
        plan(3, [(0, 1, []), (1, 1, [4])]),  # A fills its 8; B takes a block early
        plan(4, [(0, 1, [5]), (1, 1, [])]),
        plan(5, [(0, 1, []), (1, 1, []), (2, 3, [6])], new_requests=[sampled]),
        plan(6, [(2, 1, []), (0, 1, []), (1, 1, [])]),  # a plain decode with the sampler's rows
        plan(7, [(0, 1, []), (2, 1, [7]), (1, 1, [])]),
        plan(8, [(0, 1, [8]), (1, 1, [])], finished_slots=[2]),
        plan(9, [(1, 1, [9]), (0, 1, [])]),  # greedy again: the argmax kernel
        plan(10, [(0, 1, []), (3, 1, [10])], new_requests=[chunked]),  # token 3 of 5: no sample
        plan(11, [(3, 1, []), (0, 1, [])], preempted_slots=[1]),  # token 4 of 5: no sample either
        plan(12, [(3, 1, [11]), (0, 1, [12])]),  # slot 3's last prompt token: it samples
        plan(13, [(3, 1, []), (0, 1, [])]),
    ]


def test_the_plain_decode_path_gives_the_general_paths_state_and_results(model_dir):
    fast = make_runner(model_dir, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    general = make_runner(model_dir, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    general._plain_decode = lambda plan: None  # no plain decode path
    taken = []
    execute_decode = fast._execute_decode
    fast._execute_decode = lambda plan, *args: taken.append(plan.step_id) or execute_decode(plan, *args)
    for step in _parity_plans():
        got, want = fast.execute(step), general.execute(step)
        got.ClearField("timings")
        want.ClearField("timings")
        assert got == want, f"step {step.step_id}"
        assert snapshot(fast) == snapshot(general), f"step {step.step_id}"
        assert np.array_equal(fast.arrays.token_ids, general.arrays.token_ids)
    assert taken == [2, 3, 4, 6, 7, 9, 12, 13]
    assert list(got.sampled_slots) == [3, 0]


def test_the_plain_decode_path_grows_the_token_ids_for_the_sampled_token(model_dir):
    runner = make_runner(model_dir, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    runner.execute(first_plan())
    # A's 7 tokens fill a row of 7: its next sampled token needs a wider one.
    runner.arrays.token_ids = runner.arrays.token_ids[:, :7].copy()
    runner.execute(decode_plan(2))
    assert runner.arrays.token_ids.shape[1] > 8 and runner.slots[0].num_tokens == 8
    assert runner.tokens(0)[:7] == [*PROMPT_A, runner.slots[0].sampling.output_token_ids[0]]


# ---- validation: a broken plan is refused whole and changes nothing ----------------------------


BROKEN_PLANS = {
    "step id gap": (lambda: decode_plan(3), "step 3: expected step id 2"),
    "step id repeated": (lambda: decode_plan(1), "step 1: expected step id 2"),
    "finished slot not live": (lambda: plan(2, finished_slots=[5]), "step 2: finished slot 5 is not live"),
    "preempted slot not live": (lambda: plan(2, preempted_slots=[9]), "preempted slot 9 is not live"),
    "slot freed twice": (lambda: plan(2, finished_slots=[1], preempted_slots=[1]), "slot 1 is freed twice"),
    "new request reuses a live slot": (
        lambda: plan(2, [(0, 3, [4])], finished_slots=[1], new_requests=[new_request(0, [1, 2, 3])]),
        "step 2: new request 'req-0' (slot 0): slot 0 is live",
    ),
    "two new requests in one slot": (
        lambda: plan(2, new_requests=[new_request(4, [1, 2]), new_request(4, [3])]),
        "slot 4 is live",
    ),
    "scheduled slot not live": (lambda: plan(2, [(0, 1, []), (7, 1, [])]), "step 2: slot 7 is not live"),
    "scheduled slot freed in the same plan": (
        lambda: plan(2, [(0, 1, []), (1, 1, [])], finished_slots=[1]),
        "slot 1 is not live",
    ),
    "slot scheduled twice": (lambda: plan(2, [(0, 1, []), (0, 1, [])]), "slot 0 is scheduled twice"),
    "zero tokens": (lambda: plan(2, [(0, 0, [])]), "slot 0: num_scheduled_tokens is 0"),
    "more tokens than the request has": (
        lambda: plan(2, [(0, 2, [])]),
        "slot 0: 2 tokens scheduled after 6 computed, but it has only 7",
    ),
    "new block id out of range": (
        lambda: plan(2, [(0, 1, [NUM_BLOCKS]), (1, 1, [])]),
        f"new block id {NUM_BLOCKS} is out of range (the pool has {NUM_BLOCKS} blocks)",
    ),
    "copy block id out of range": (
        lambda: plan(2, [(0, 1, [])], copy_src_blocks=[1], copy_dst_blocks=[NUM_BLOCKS + 3]),
        f"copy destination block id {NUM_BLOCKS + 3} is out of range",
    ),
    "copy lists of different lengths": (
        lambda: plan(2, copy_src_blocks=[1, 2], copy_dst_blocks=[3]),
        "copy_src_blocks and copy_dst_blocks differ in length",
    ),
    "replaced block id out of range": (
        lambda: plan(2, replaced_slots=[0], replaced_block_indices=[0], replaced_block_ids=[99]),
        "replaced block id 99 is out of range",
    ),
    "replaced index beyond the table": (
        lambda: plan(2, replaced_slots=[0], replaced_block_indices=[2], replaced_block_ids=[9]),
        "slot 0: replaced block index 2 is beyond its 2 blocks",
    ),
    "block table too short": (
        lambda: plan(2, [(0, 1, []), (4, 9, [5, 6])], new_requests=[new_request(4, list(range(2, 11)))]),
        "slot 4: block table of 2 blocks holds 8 tokens, 9 needed",
    ),
    "block counts and ids disagree": (
        lambda: worker_pb2.StepPlan(
            step_id=2, slots=[0], num_scheduled_tokens=[1], num_new_blocks=[2], new_block_ids=[7]
        ),
        "num_new_blocks sum to 2 but 1 new_block_ids",
    ),
    "parallel arrays of different lengths": (
        lambda: worker_pb2.StepPlan(step_id=2, slots=[0, 1], num_scheduled_tokens=[1], num_new_blocks=[0, 0]),
        "slots, num_scheduled_tokens and num_new_blocks differ in length",
    ),
    "a refused new request in a plan broken otherwise": (
        lambda: plan(
            2,
            [(0, 1, []), (4, 2, [5])],
            new_requests=[new_request(4, [1, TINY_VOCAB])],
            copy_src_blocks=[1],
            copy_dst_blocks=[NUM_BLOCKS + 3],
        ),
        f"copy destination block id {NUM_BLOCKS + 3} is out of range",
    ),
    "a new request with bad content in a live slot": (
        lambda: plan(2, [(0, 1, [])], new_requests=[new_request(1, [1, TINY_VOCAB])]),
        "new request 'req-1' (slot 1): slot 1 is live",
    ),
    "position beyond max_model_len": (
        lambda: plan(
            2, [(4, 300, [4 + i % 28 for i in range(75)])], new_requests=[new_request(4, [3] * 300)]
        ),
        "position 299 is beyond max_model_len 256",
    ),
}


@pytest.mark.parametrize("case", list(BROKEN_PLANS), ids=list(BROKEN_PLANS))
def test_broken_plan_is_refused_naming_the_problem_and_changes_nothing(model_dir, case):
    broken, message = BROKEN_PLANS[case]
    runner = make_runner(model_dir, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    untouched = make_runner(model_dir, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    runner.execute(first_plan())
    untouched.execute(first_plan())
    before = snapshot(runner)

    with pytest.raises(PlanError) as error:
        runner.execute(broken())
    assert message in str(error.value)
    assert snapshot(runner) == before

    # The next valid plan gives what it gives on a runner that never saw the broken one.
    got, expected = runner.execute(decode_plan(2)), untouched.execute(decode_plan(2))
    assert list(got.sampled_slots) == list(expected.sampled_slots) == [0, 1]
    assert list(got.sampled_token_ids) == list(expected.sampled_token_ids)
    assert snapshot(runner) == snapshot(untouched)


# ---- a new request the worker refuses fails alone ---------------------------------------------


REFUSED_REQUESTS = {
    "computed beyond its tokens": (
        lambda: new_request(4, [1, 2], num_computed_tokens=3),
        "num_computed_tokens 3 exceeds its 2 tokens",
    ),
    "prompt longer than its tokens": (
        lambda: new_request(4, [1, 2], prompt_len=3),
        "prompt_len 3 is not in 1..2 (its token count)",
    ),
    "without tokens": (lambda: new_request(4, []), "no token ids"),
    "token outside the vocabulary": (
        lambda: new_request(4, [1, TINY_VOCAB]),
        f"token id {TINY_VOCAB} is outside the vocabulary",
    ),
    "bad sampling parameter": (lambda: new_request(4, [1, 2], top_p=0.0), "top_p must be in (0, 1]"),
    "logit bias outside the vocabulary": (
        lambda: new_request(4, [1, 2], logit_bias={TINY_VOCAB: 1.0}),
        f"logit_bias token id {TINY_VOCAB} is out of the vocabulary",
    ),
    "negative penalty": (
        lambda: new_request(4, [1, 2], repetition_penalty=0.0),
        "repetition_penalty must be a finite number > 0",
    ),
}


@pytest.mark.parametrize("case", list(REFUSED_REQUESTS), ids=list(REFUSED_REQUESTS))
def test_a_refused_new_request_is_left_out_alone_until_freed_and_the_rest_of_each_plan_runs(model_dir, case):
    make, problem = REFUSED_REQUESTS[case]
    runner = make_runner(model_dir, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    untouched = make_runner(model_dir, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    runner.execute(first_plan())
    untouched.execute(first_plan())

    def same_as_untouched(got: worker_pb2.StepResult, expected: worker_pb2.StepResult) -> None:
        assert list(got.sampled_slots) == list(expected.sampled_slots) == [0, 1]
        assert list(got.sampled_token_ids) == list(expected.sampled_token_ids)
        assert list(runner.refused) == [4]
        assert {**snapshot(runner), "refused": {}} == snapshot(untouched)

    # The bad request enters slot 4 beside two decodes, as a scheduler would send it (its first blocks too).
    got = runner.execute(plan(2, [(0, 1, []), (4, 1, [5]), (1, 1, [])], new_requests=[make()]))
    assert list(got.refused_slots) == [4]
    assert got.refused_messages[0].startswith(f"new request 'req-4' (slot 4): {problem}")
    same_as_untouched(got, untouched.execute(decode_plan(2)))
    # A plan sent before the scheduler heard of it schedules it again: left out and named again.
    got = runner.execute(plan(3, [(0, 1, []), (1, 1, []), (4, 1, [6])], replaced_slots=[4],
                              replaced_block_indices=[0], replaced_block_ids=[7]))  # fmt: skip
    assert list(got.refused_slots) == [4] and problem in got.refused_messages[0]
    same_as_untouched(got, untouched.execute(decode_plan(3)))
    # Once the scheduler frees the slot (it failed the request) the slot takes a new request.
    got = runner.execute(
        plan(
            4,
            [(0, 1, [10]), (4, len(PROMPT_B), [8, 9])],
            finished_slots=[4],
            new_requests=[new_request(4, PROMPT_B)],
        )
    )
    assert not got.refused_slots and list(got.sampled_slots) == [0, 4] and not runner.refused
    untouched.execute(
        plan(4, [(0, 1, [10]), (4, len(PROMPT_B), [8, 9])], new_requests=[new_request(4, PROMPT_B)])
    )
    assert snapshot(runner) == snapshot(untouched)


def test_broken_plan_with_valid_frees_keeps_the_freed_slots_live(runner):
    runner.execute(first_plan())
    broken = plan(2, [(1, 1, [])], finished_slots=[0], copy_src_blocks=[0], copy_dst_blocks=[NUM_BLOCKS])
    with pytest.raises(PlanError, match="copy destination block id"):
        runner.execute(broken)
    assert sorted(runner.slots) == [0, 1]
    runner.execute(decode_plan(2))


# ---- structured outputs: token masks in the plan -------------------------------------------------------


def _mask(allowed: set[int], vocab: int = TINY_VOCAB) -> bytes:
    bits = np.zeros(-(-vocab // 32) * 32, dtype=np.uint8)
    bits[list(allowed)] = 1
    return np.packbits(bits, bitorder="little").tobytes()


def test_a_masked_slot_samples_only_what_its_mask_allows(runner):
    first = first_plan()
    for req in first.new_requests:
        req.sampling.temperature = 1.0
    first.mask_slots.append(1)
    first.token_masks = _mask({7})
    result = runner.execute(first)
    assert result.sampled_token_ids[1] == 7
    for step in (2, 3):  # as far as the blocks of first_plan hold
        decode = decode_plan(step)
        decode.mask_slots.extend([0, 1])
        decode.token_masks = _mask({3, 5}) + _mask({step})
        tokens = list(runner.execute(decode).sampled_token_ids)
        assert tokens[0] in (3, 5) and tokens[1] == step


def test_a_broken_mask_refuses_the_plan(runner):
    runner.execute(first_plan())
    wrong_size = decode_plan(2)
    wrong_size.mask_slots.append(0)
    wrong_size.token_masks = _mask({1})[:-4]
    with pytest.raises(PlanError, match="token_masks holds"):
        runner.execute(wrong_size)
    not_sampling = plan(2, [(0, 1, [])])
    before = snapshot(runner)
    not_sampling.mask_slots.extend([0, 1])
    not_sampling.token_masks = _mask({1}) * 2
    with pytest.raises(PlanError, match="slot 1 has a token mask but does not sample"):
        runner.execute(not_sampling)
    assert snapshot(runner) == before
