"""The worker driven by the real scheduler's plans gives transformers' own greedy tokens.

Several requests batched, chunked prefill, a prefix hit that skips cached blocks, preemption and
recomputation, n = 2 forks with copy-on-write, pipelined plans: in float32 on the default model,
every request's greedy tokens equal `generate(do_sample=False)`, token for token.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Callable

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedserve.model_files import load_generation_info, load_tokenizer, resolve_model
from pagedserve.scheduler_svc.config import SchedulerConfig
from pagedserve.scheduler_svc.plan import PlanBuilder
from pagedserve.scheduler_svc.request import Request
from pagedserve.scheduler_svc.scheduler import Scheduler
from pagedserve.v1 import common_pb2, worker_pb2
from pagedserve.worker_svc.kv_cache import KVCache, KVCacheSpec
from pagedserve.worker_svc.loader import load_model
from pagedserve.worker_svc.runner import ModelRunner

pytestmark = pytest.mark.slow

BLOCK_SIZE = 16
POOL_BLOCKS = 96  # the worker's pool; each scenario's scheduler uses a prefix of it
SYSTEM = (
    "You are a careful assistant. Answer in one short sentence, without lists, without markdown, "
    "and without repeating the question. Prefer plain words over jargon."
)


@pytest.fixture(scope="module")
def model_dir():
    return resolve_model(None)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return load_tokenizer(model_dir)


@pytest.fixture(scope="module")
def eos(model_dir):
    return frozenset(load_generation_info(model_dir).eos_token_ids)


@pytest.fixture(scope="module")
def runner(model_dir):
    model = load_model(model_dir, torch.float32, "cpu")
    cfg = model.config
    spec = KVCacheSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, BLOCK_SIZE, torch.float32)
    return ModelRunner(model, KVCache(spec, POOL_BLOCKS, torch.device("cpu")), max_model_len=512)


@pytest.fixture(scope="module")
def hf_generate(model_dir):
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def generate(prompt: list[int], max_new_tokens: int) -> list[int]:
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                do_sample=False,
                max_new_tokens=max_new_tokens,
            )
        return out[0, len(prompt) :].tolist()

    return generate


def chat_prompt(tokenizer, question: str) -> list[int]:
    return tokenizer.encode(f"{SYSTEM}\nQuestion: {question}\nAnswer:")


def make_request(request_id: str, prompt: list[int], eos, max_tokens: int, n: int = 1) -> Request:
    sampling = common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, n=n)
    return Request(request_id, list(prompt), len(prompt), sampling, eos_token_ids=eos)


def drive(
    runner: ModelRunner,
    config: SchedulerConfig,
    requests: list[Request],
    pipelined: bool,
    late: tuple[Callable[[dict], bool], Request] | None = None,
) -> tuple[dict[tuple[str, int], list[int]], list[worker_pb2.StepPlan], Scheduler]:
    """Run every request to the end through Scheduler -> PlanBuilder -> ModelRunner. Pipelined:
    plan N+1 is scheduled and executed before result N is fed back. `late` = (condition on the
    tokens so far, request): the request arrives once the condition holds."""
    runner.reset()
    scheduler, builder = Scheduler(config), PlanBuilder()
    for req in requests:
        scheduler.add_request(req)
    tokens: dict[tuple[str, int], list[int]] = defaultdict(list)
    plans: list[worker_pb2.StepPlan] = []
    in_flight: deque = deque()

    def feed_oldest() -> None:
        out, result = in_flight.popleft()
        for o in scheduler.update_from_output(out, result):
            tokens[(o.request_id, o.index)].extend(o.new_token_ids)

    for _ in range(500):
        if late is not None and late[0](tokens):
            scheduler.add_request(late[1])
            late = None
        if not scheduler.has_unfinished_requests() and late is None:
            while in_flight:
                feed_oldest()
            if not scheduler.has_unfinished_requests():
                break
        out = scheduler.schedule()
        plan = builder.build(out).plan
        plans.append(plan)
        in_flight.append((out, runner.execute(plan)))
        while len(in_flight) > (1 if pipelined else 0):
            feed_oldest()
    else:
        raise AssertionError("requests did not finish in 500 steps")
    assert scheduler.stats().num_blocks_in_use == 0
    return dict(tokens), plans, scheduler


def test_batched_chunked_prefix_hit_and_forks_match_transformers_pipelined(
    runner, tokenizer, eos, hf_generate
):
    first = make_request("first", chat_prompt(tokenizer, "What is the capital of France?"), eos, 8)
    forked = make_request("forked", chat_prompt(tokenizer, "Why is the sky blue?"), eos, 6, n=2)
    # Arrives once "first" has sampled 4 tokens (its prompt's 45 tokens and 3 of them fill 3 blocks, all
    # cached): a prefix hit, whole blocks and then the part of the third block before "Spain" (copied
    # into a block of its own).
    second = make_request("second", chat_prompt(tokenizer, "What is the capital of Spain?"), eos, 6)
    # 24 tokens a step: every prompt (about 45 tokens) is computed in chunks over several steps.
    config = SchedulerConfig(
        num_blocks=64, block_size=BLOCK_SIZE, max_num_seqs=8, max_num_batched_tokens=24, max_model_len=512
    )
    tokens, plans, scheduler = drive(
        runner,
        config,
        [first, forked],
        pipelined=True,
        late=(lambda t: len(t.get(("first", 0), [])) >= 4, second),
    )

    # The scenario did what it says.
    assert max(p.num_scheduled_tokens[i] for p in plans for i in range(len(p.slots))) == 24
    assert any(len(p.slots) >= 2 for p in plans)
    hits = [r for p in plans for r in p.new_requests if r.request_id == "second" and r.num_computed_tokens]
    assert hits and hits[0].num_computed_tokens >= BLOCK_SIZE  # cached blocks skipped
    assert hits[0].num_computed_tokens % BLOCK_SIZE  # and part of one
    assert scheduler.stats().prefix_cache_hits >= BLOCK_SIZE
    assert any(p.copy_src_blocks for p in plans), "the forks' shared last block was never copied"
    assert sum(len(p.new_requests) for p in plans) == 4  # first, forked, its fork, second

    for req, max_tokens in ((first, 8), (second, 6)):
        assert tokens[(req.request_id, 0)] == hf_generate(req.token_ids[: req.prompt_len], max_tokens)
    expected = hf_generate(forked.token_ids[: forked.prompt_len], 6)
    assert tokens[("forked", 0)] == expected
    assert tokens[("forked", 1)] == expected


@pytest.mark.parametrize("pipelined", [False, True], ids=["sequential", "pipelined"])
def test_preempted_requests_recompute_and_match_transformers(runner, tokenizer, eos, hf_generate, pipelined):
    questions = ["Name a large animal.", "What color is grass?", "How many legs has a spider?"]
    requests = [
        make_request(f"r{i}", tokenizer.encode(f"Question: {q}\nAnswer:"), eos, 12)
        for i, q in enumerate(questions)
    ]
    # Three sequences of up to ~23 tokens (2 blocks each) in a pool of 5 blocks: once they cross
    # 16 tokens the decodes run out of blocks, and the latest request is preempted, then recomputed.
    config = SchedulerConfig(
        num_blocks=5,
        block_size=BLOCK_SIZE,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        max_model_len=512,
        enable_prefix_caching=False,
    )
    tokens, plans, scheduler = drive(runner, config, requests, pipelined=pipelined)
    assert scheduler.stats().num_preemptions >= 1
    assert any(p.preempted_slots for p in plans)
    comebacks = [r for p in plans for r in p.new_requests if len(r.token_ids) > r.prompt_len]
    assert comebacks, "no request came back with generated tokens to recompute"
    for req in requests:
        got = tokens[(req.request_id, 0)]
        assert got == hf_generate(req.token_ids[: req.prompt_len], 12)
