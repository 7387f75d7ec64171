"""Speculative decoding in the scheduler: its configuration, n-gram proposals, lookahead slots and their
rollback, against a fake worker that verifies drafts as worker.proto says (scheduler_fakes.FakeWorker with
markov=True: its samples depend on the last two tokens, so its text repeats and drafts get accepted)."""

import random

import pytest
from scheduler_fakes import Driver, check_invariants, expected_markov_tokens, make_request

from pagedserve.scheduler_svc.config import SchedulerConfig
from pagedserve.scheduler_svc.ngram import NgramIndex
from pagedserve.scheduler_svc.scheduler import Scheduler
from pagedserve.speculative import SpeculativeConfig, parse_speculative_config
from pagedserve.validation import child_seed

BS = 4
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


# ---------------------------------------------------------------- configuration


def test_vllm_shaped_config_parses_from_json_and_dict():
    text = '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'
    assert parse_speculative_config(text) == SpeculativeConfig("ngram", 5, 4, 2, 8)
    assert parse_speculative_config({"num_speculative_tokens": 2}) == SpeculativeConfig("ngram", 2, 5, 5)
    assert (
        parse_speculative_config({"num_speculative_tokens": 2, "prompt_lookup_max": 3}).prompt_lookup_min == 3
    )
    assert parse_speculative_config({"model": "[ngram]", "num_speculative_tokens": 2}).method == "ngram"
    assert parse_speculative_config(None) is None and parse_speculative_config("") is None
    assert parse_speculative_config({"num_speculative_tokens": 2}).disable_by_batch_size == 8
    assert (
        parse_speculative_config(
            {"num_speculative_tokens": 2, "disable_by_batch_size": None}
        ).disable_by_batch_size
        is None
    )


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"method": "eagle", "num_speculative_tokens": 2}, "method 'eagle' is not supported"),
        ({"method": "lookahead", "num_speculative_tokens": 2}, "method 'lookahead' is not supported"),
        (
            {"method": "ngram", "num_speculative_tokens": 0},
            "num_speculative_tokens must be an integer in 1..32",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": 33},
            "num_speculative_tokens must be an integer in 1..32",
        ),
        ({"method": "ngram", "num_speculative_tokens": "4"}, "num_speculative_tokens must be an integer"),
        ({"method": "ngram"}, "num_speculative_tokens is required"),
        (
            {"num_speculative_tokens": 2, "prompt_lookup_max": 2, "prompt_lookup_min": 3},
            "prompt_lookup_min (3) exceeds",
        ),
        (
            {"num_speculative_tokens": 2, "prompt_lookup_min": 0, "prompt_lookup_max": 2},
            "prompt_lookup_min must be",
        ),
        (
            {"num_speculative_tokens": 2, "draft_tensor_parallel_size": 1},
            "unknown field(s) draft_tensor_parallel",
        ),
        (
            {"model": "/models/draft", "num_speculative_tokens": 2},
            "a separate draft checkpoint is not supported",
        ),
        ("{not json", "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
    ],
)
def test_bad_config_fails_with_a_message_naming_the_field(config, message):
    with pytest.raises(ValueError, match="speculative_config") as error:
        parse_speculative_config(config)
    assert message in str(error.value)


# ---------------------------------------------------------------- proposals


def test_ngram_proposes_what_followed_the_latest_occurrence_of_the_longest_suffix():
    index = NgramIndex(min_n=1, max_n=3)
    tokens = [1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1, 2, 3]
    # [1, 2, 3] occurred at the start (followed by 4, 5); [2, 3] more recently (followed by 7, 8), but the
    # longest suffix wins.
    assert index.propose(tokens, 2) == [4, 5]
    assert index.propose([*tokens, 4], 3) == [5, 9, 2]
    # A token in flight: its guess (the continuation's first token) is skipped.
    assert NgramIndex(1, 3).propose(tokens, 2, skip=1) == [5, 9]


def test_ngram_proposes_nothing_below_prompt_lookup_min():
    assert NgramIndex(min_n=2, max_n=4).propose([1, 2, 3, 4, 5, 3], 3) == []
    assert NgramIndex(min_n=1, max_n=4).propose([1, 2, 3, 4, 5, 3], 3) == [4, 5, 3]


# ---------------------------------------------------------------- the scheduler


def _scheduler(num_blocks=64, caching=True, budget=64, **spec) -> Scheduler:
    speculative = None if spec.get("off") else SpeculativeConfig(**{**NGRAM, **spec})
    return Scheduler(
        SchedulerConfig(
            num_blocks=num_blocks,
            block_size=BS,
            max_num_seqs=8,
            max_num_batched_tokens=budget,
            max_model_len=96,
            enable_prefix_caching=caching,
            speculative=speculative,
        )
    )


def _check_cached_tokens(scheduler: Scheduler) -> None:
    """Every cached block a request holds holds that request's own known tokens (only accepted tokens are
    cached), on top of the block accounting."""
    check_invariants(scheduler)
    for req in scheduler.running:
        node = req.cache_node
        i = req.num_cached_blocks
        while node is not None and node.parent is not None:
            i -= 1
            assert list(node.key) == req.token_ids[i * BS : (i + 1) * BS]
            node = node.parent


def _random_workload(seed: int, lag: int, **spec) -> tuple[Scheduler, Driver, dict]:
    """Seven requests (n up to 2, some sharing a prompt prefix) on a pool small enough to preempt, run to the
    end; returns the scheduler, the driver and what each parent sequence must produce."""
    rng = random.Random(seed)
    scheduler = _scheduler(num_blocks=rng.choice([28, 48]), budget=rng.choice([12, 64]), **spec)
    driver = Driver(scheduler, lag=lag, check=lambda: _check_cached_tokens(scheduler), markov=True)
    expected = {}
    shared = [rng.randrange(2, 60) for _ in range(6)]
    for i in range(7):
        prompt = (shared if i % 2 else []) + [rng.randrange(2, 60) for _ in range(rng.randrange(2, 10))]
        n = rng.choice([1, 1, 2])
        max_tokens = rng.randrange(8, 40)
        driver.add(
            make_request(f"r{i}", prompt, eos=None, n=n, seed=i, max_tokens=max_tokens, temperature=1.0)
        )
        for index in range(n):  # a fork's seed is the engine's child seed of its parent's
            expected[(f"r{i}", index)] = (prompt, i if index == 0 else child_seed(i, index), max_tokens)
    driver.run()
    return scheduler, driver, expected


# Drafts the worker proposes (the fake's own, right about two times in three), as with method draft_layers.
DRAFT_LAYERS = dict(method="draft_layers", num_draft_layers=1, prompt_lookup_max=5, prompt_lookup_min=5)


@pytest.mark.parametrize("spec", [{}, DRAFT_LAYERS], ids=["ngram", "draft_layers"])
@pytest.mark.parametrize("lag", [0, 1])
@pytest.mark.parametrize("seed", range(6))
def test_speculative_outputs_equal_plain_decoding_with_pools_whole_after(lag, seed, spec):
    """Random workloads (n > 1 forks, shared prefixes, a pool small enough to preempt, pipelined or not):
    every sequence gets the tokens it gets decoded alone, every invariant holds after every schedule and
    update, drafts were accepted, and once all is done no block is held."""
    scheduler, driver, expected = _random_workload(seed, lag, **spec)
    for (request_id, index), (prompt, seed_of_sequence, max_tokens) in expected.items():
        assert driver.logs[(request_id, index)].tokens == expected_markov_tokens(
            prompt, seed_of_sequence, max_tokens
        )
    stats = scheduler.stats()
    assert stats.spec_num_accepted_tokens > 0
    assert stats.spec_num_accepted_tokens <= stats.spec_num_draft_tokens
    with_drafts = [out for out in driver.outputs if out.drafts]
    assert all(out.num_draft_layers == spec.get("num_draft_layers", 0) for out in with_drafts)
    assert stats.spec_num_accepted_tokens == sum(stats.spec_num_accepted_tokens_per_pos)
    assert scheduler.kv.pool.num_used_blocks == 0
    assert scheduler.kv.num_free_blocks == scheduler.config.num_blocks
    if lag:
        # A sequence with drafts in flight is left out of the plan built before their result.
        for out, following in zip(driver.outputs, driver.outputs[1:], strict=False):
            assert not {id(r) for r, _ in out.drafts} & {id(r) for r in following.scheduled}


def test_the_random_workloads_preempt_and_hit_the_prefix_cache_with_drafts_in_flight():
    stats = [_random_workload(seed, lag=1)[0].stats() for seed in range(6)]
    assert sum(s.num_preemptions for s in stats) > 0
    assert sum(s.prefix_cache_hits for s in stats) > 0
    assert (
        sum(s.spec_num_draft_tokens - s.spec_num_accepted_tokens for s in stats) > 0
    )  # rejections rolled back


def test_forks_get_the_tokens_of_their_own_seeds():
    scheduler = _scheduler()
    driver = Driver(scheduler, lag=1, check=lambda: check_invariants(scheduler), markov=True)
    prompt = [5, 6, 7, 8, 9]
    driver.add(make_request("a", prompt, eos=None, n=3, seed=11, max_tokens=30, temperature=1.0))
    driver.run()
    # the forks' seeds are the engine's child seeds of 11; each sequence is what it would be alone
    for index in range(3):
        seed = 11 if index == 0 else child_seed(11, index)
        assert driver.logs[("a", index)].tokens == expected_markov_tokens(prompt, seed, 30)
    assert scheduler.stats().spec_num_drafts > 0


def test_rejected_drafts_blocks_return_to_the_pool_at_once():
    """A sequence whose drafts are all rejected holds exactly the blocks of its computed tokens afterwards,
    and its next proposal waits (it backs off)."""
    scheduler = _scheduler(num_speculative_tokens=8, prompt_lookup_min=1)
    driver = Driver(scheduler, markov=True)
    head = [3, 40, 41, 42]
    first, second = expected_markov_tokens(head, 1, 2)
    # After the prompt and its first sampled token `first`, the lookup finds `first` earlier, followed by
    # 8 tokens of which the first is not what the fake samples next.
    wrong = [t for t in range(2, 60) if t not in (first, second)][:8]
    prompt = [first, *wrong, *head]
    assert expected_markov_tokens(prompt, 1, 1) == [first]
    driver.add(make_request("a", prompt, eos=None, seed=1, max_tokens=20))
    driver.step()  # the prompt, sampling `first`
    driver.step()  # `first` computed with 8 drafts after it: all rejected
    out = driver.outputs[-1]
    assert out.drafts and out.drafts[0][1] == wrong and out.num_scheduled_tokens == [9]
    req = scheduler.running[0]
    assert scheduler.stats().spec_num_accepted_tokens == 0
    assert req.num_computed_tokens == len(prompt) + 1
    assert len(req.block_table) == -(-req.num_computed_tokens // BS)
    assert scheduler.kv.pool.num_used_blocks == len(req.block_table)
    assert req.token_ids[len(prompt) :] == [first, second]
    check_invariants(scheduler)
    driver.step()
    assert not driver.outputs[-1].drafts  # backing off


def test_no_proposals_past_disable_by_batch_size():
    scheduler = _scheduler(disable_by_batch_size=1)
    driver = Driver(scheduler, markov=True)
    for i in range(2):
        driver.add(make_request(f"r{i}", [4, 5, 4, 5, 4, 5], eos=None, seed=i, max_tokens=12))
    driver.run()
    assert scheduler.stats().spec_num_drafts == 0


def test_constrained_and_logprob_sequences_get_no_drafts():
    scheduler = _scheduler()
    driver = Driver(scheduler, markov=True)
    driver.add(make_request("lp", [4, 5, 4, 5, 4, 5], eos=None, seed=1, max_tokens=12, logprobs=2))
    driver.run()
    assert scheduler.stats().spec_num_drafts == 0


def test_drafts_stay_within_max_tokens():
    scheduler = _scheduler(num_speculative_tokens=8, prompt_lookup_min=1)
    driver = Driver(scheduler, markov=True)
    driver.add(make_request("a", [7, 7, 7, 7, 7, 7], eos=None, seed=3, max_tokens=3))
    driver.run()
    assert len(driver.logs[("a", 0)].tokens) == 3
    for out in driver.outputs:
        for _, drafts in out.drafts:
            assert len(drafts) <= 2


def test_metrics_carry_vllms_spec_decode_names():
    from prometheus_client import CollectorRegistry, generate_latest

    from pagedserve.gateway.metrics import EngineStatsCollector
    from pagedserve.v1 import engine_pb2

    stats = engine_pb2.EngineStats(
        spec_decode_num_drafts=4,
        spec_decode_num_draft_tokens=12,
        spec_decode_num_accepted_tokens=7,
        spec_decode_num_accepted_tokens_per_pos=[4, 2, 1],
    )
    registry = CollectorRegistry()
    registry.register(EngineStatsCollector(lambda: stats, "m"))
    text = generate_latest(registry).decode()
    assert 'vllm:spec_decode_num_drafts_total{model_name="m"} 4.0' in text
    assert 'vllm:spec_decode_num_draft_tokens_total{model_name="m"} 12.0' in text
    assert 'vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 7.0' in text
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="2"} 1.0' in text


def test_async_engine_args_carry_the_config_to_the_engine():
    from pagedserve import AsyncEngineArgs

    config = AsyncEngineArgs(
        speculative_config={"method": "ngram", "num_speculative_tokens": 3}
    ).engine_config()
    assert config.speculative_config == SpeculativeConfig("ngram", 3, 5, 5)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        AsyncEngineArgs(speculative_config={"method": "ngram"}).engine_config()
