"""Verifying draft tokens in the worker (worker.proto, speculative decoding), on a tiny random Llama: greedy
output identical to decoding without drafts and to transformers', rejected drafts rolled back (computed
tokens, block table, K/V), broken draft fields refused whole, and rejection sampling that keeps the target's
distribution (checked statistically against the plain sampler with fixed seeds)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from worker_testing import hf_greedy, load_hf, make_runner, new_request, plan, save_tiny_llama, snapshot

from pagedserve.worker_svc.runner import PlanError

BLOCK_SIZE = 4
PROMPT = [5, 17, 42, 9, 77, 3]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def hf_model(model_dir):
    return load_hf(model_dir)


def _blocks(start: int, end: int, have: int, next_block: list[int]) -> list[int]:
    """Fresh block ids for a slot whose table has `have` blocks and that computes up to `end` tokens."""
    need = -(-end // BLOCK_SIZE) - have
    ids = list(range(next_block[0], next_block[0] + max(need, 0)))
    next_block[0] += max(need, 0)
    return ids


def _decode_with_drafts(runner, prompt, steps, draft_for) -> tuple[list[int], list[int]]:
    """Greedy tokens of `prompt` (slot 0) over `steps` plans, each decode step carrying draft_for(tokens)'s
    drafts; returns (tokens, accepted count per step)."""
    next_block = [0]
    first = plan(
        1, [(0, len(prompt), _blocks(0, len(prompt), 0, next_block))], new_requests=[new_request(0, prompt)]
    )
    runner.execute(first)
    accepted = []
    for step in range(2, steps + 2):
        state = runner.slots[0]
        tokens = runner.tokens(0)
        drafts = draft_for(tokens)
        n = 1 + len(drafts)
        end = state.num_computed_tokens + n
        p = plan(step, [(0, n, _blocks(state.num_computed_tokens, end, state.num_blocks, next_block))])
        if drafts:
            p.draft_slots.append(0)
            p.num_draft_tokens.append(len(drafts))
            p.draft_token_ids.extend(drafts)
        result = runner.execute(p)
        accepted.append(result.num_accepted_tokens[0] if drafts else 0)
        state = runner.slots[0]
        # Rejected drafts leave nothing computed past the accepted ones, and no block past those.
        assert state.num_computed_tokens == state.num_tokens - 1
        assert state.num_blocks == -(-state.num_computed_tokens // BLOCK_SIZE)
    return runner.tokens(0)[len(prompt) :], accepted


def test_greedy_tokens_with_drafts_are_those_without_and_transformers(model_dir, hf_model):
    reference = hf_greedy(hf_model, PROMPT, 24)
    plain, _ = _decode_with_drafts(
        make_runner(model_dir, num_blocks=64, block_size=BLOCK_SIZE), PROMPT, 24, lambda t: []
    )
    assert plain[:24] == reference

    # Drafts that are right for 2 tokens then wrong, every step: accepted 2, the rest rolled back.
    def half_right(tokens):
        done = len(tokens) - len(PROMPT)
        good = reference[done : done + 2]
        return [*good, (reference[done + 2] + 1) % 128] if done + 3 <= len(reference) else []

    runner = make_runner(model_dir, num_blocks=64, block_size=BLOCK_SIZE)
    tokens, accepted = _decode_with_drafts(runner, PROMPT, 8, half_right)
    assert tokens == reference[: len(tokens)]
    assert accepted[:7] == [2] * 7 and len(tokens) >= 3 * 7

    # Wrong drafts only: every one rejected, the output unchanged.
    runner = make_runner(model_dir, num_blocks=64, block_size=BLOCK_SIZE)
    tokens, accepted = _decode_with_drafts(
        runner, PROMPT, 12, lambda t: [(reference[len(t) - len(PROMPT)] + 1) % 128, 3, 4]
    )
    assert tokens == reference[:13] and accepted == [0] * 12


def test_penalties_and_seeds_see_the_drafts_as_outputs(model_dir):
    """Seeded sampling with penalties: the tokens gained with drafts (right ones from a run without) are the
    tokens of that run, position for position."""
    sampling = dict(
        temperature=0.9, seed=7, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2
    )

    def run(draft_for):
        runner = make_runner(model_dir, num_blocks=64, block_size=BLOCK_SIZE)
        next_block = [0]
        runner.execute(
            plan(
                1,
                [(0, len(PROMPT), _blocks(0, len(PROMPT), 0, next_block))],
                new_requests=[new_request(0, PROMPT, **sampling)],
            )
        )
        step = 2
        while runner.slots[0].num_tokens < len(PROMPT) + 20:
            state = runner.slots[0]
            drafts = draft_for(runner.tokens(0))
            end = state.num_computed_tokens + 1 + len(drafts)
            p = plan(
                step,
                [(0, 1 + len(drafts), _blocks(state.num_computed_tokens, end, state.num_blocks, next_block))],
            )
            if drafts:
                p.draft_slots.append(0)
                p.num_draft_tokens.append(len(drafts))
                p.draft_token_ids.extend(drafts)
            runner.execute(p)
            step += 1
        return runner.tokens(0)[len(PROMPT) : len(PROMPT) + 20]

    plain = run(lambda t: [])
    with_drafts = run(lambda t: plain[len(t) - len(PROMPT) : len(t) - len(PROMPT) + 3])
    assert with_drafts == plain


def test_broken_draft_fields_are_refused_whole(model_dir):
    runner = make_runner(model_dir, num_blocks=64, block_size=BLOCK_SIZE)
    runner.execute(plan(1, [(0, len(PROMPT), [0, 1])], new_requests=[new_request(0, PROMPT)]))
    before = snapshot(runner)
    cases = [
        (dict(draft_slots=[0], num_draft_tokens=[2], draft_token_ids=[1]), "num_draft_tokens sum to 2"),
        (dict(draft_slots=[0], num_draft_tokens=[1, 1], draft_token_ids=[1, 2]), "differ in length"),
        (dict(draft_slots=[0], num_draft_tokens=[2], draft_token_ids=[1, 999]), "outside the vocabulary"),
        (dict(draft_slots=[0], num_draft_tokens=[1], draft_token_ids=[4]), "does not sample after them"),
    ]
    for fields, message in cases:
        n = 3 if "outside" in message or "sum" in message or "differ" in message else 1
        p = plan(2, [(0, n, [])], **fields)
        with pytest.raises(PlanError, match=message):
            runner.execute(p)
        assert snapshot(runner) == before
    runner.execute(plan(2, [(0, 1, [])]))  # the state is as it was: a plain decode goes on


def _first_tokens(model_dir, n: int, sampling: dict, draft: int | None) -> tuple[np.ndarray, int]:
    """The first token of n sequences of PROMPT sampled in one step (with `draft` after the prompt's last
    token when given), and how many sequences accepted the draft."""
    runner = make_runner(model_dir, num_blocks=2 * n * 3, block_size=BLOCK_SIZE, seed=1234)
    p = plan(1)
    blocks = 0
    k = 0 if draft is None else 1
    for slot in range(n):
        need = -(-(len(PROMPT) + k) // BLOCK_SIZE)
        p.new_requests.append(new_request(slot, PROMPT, **sampling))
        p.slots.append(slot)
        p.num_scheduled_tokens.append(len(PROMPT) + k)
        p.num_new_blocks.append(need)
        p.new_block_ids.extend(range(blocks, blocks + need))
        blocks += need
        if draft is not None:
            p.draft_slots.append(slot)
            p.num_draft_tokens.append(1)
            p.draft_token_ids.append(draft)
    result = runner.execute(p)
    firsts = np.array([runner.tokens(slot)[len(PROMPT)] for slot in range(n)])
    return firsts, sum(result.num_accepted_tokens)


def test_rejection_sampling_keeps_the_target_distribution(model_dir, hf_model):
    """A point-mass draft d is accepted with probability p(d) and the first token is distributed as p, as the
    plain sampler's (temperature and top-k applied); fixed seeds, bounds of several standard deviations."""
    sampling = dict(temperature=0.7, top_k=5)
    with torch.no_grad():
        logits = hf_model(torch.tensor([PROMPT])).logits[0, -1].double() / 0.7
    top = logits.topk(5)
    p = torch.zeros_like(logits)
    p[top.indices] = torch.softmax(top.values, dim=0)
    p = p.numpy()
    d = int(top.indices[1])  # the second most likely token as the draft
    n = 4000
    plain, _ = _first_tokens(model_dir, n, sampling, None)
    spec, accepted = _first_tokens(model_dir, n, sampling, d)

    def tv(samples):
        return 0.5 * np.abs(np.bincount(samples, minlength=len(p)) / len(samples) - p).sum()

    # Expected total variation of 4000 draws over 5 tokens is about 0.015.
    assert tv(plain) < 0.04 and tv(spec) < 0.04
    sd = np.sqrt(p[d] * (1 - p[d]) / n)
    assert abs(accepted / n - p[d]) < 5 * sd
    # Rejected: p without d, renormalised.
    rejected = spec[spec != d]
    q = p.copy()
    q[d] = 0
    q /= q.sum()
    assert 0.5 * np.abs(np.bincount(rejected, minlength=len(p)) / len(rejected) - q).sum() < 0.05
