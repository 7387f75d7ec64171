"""Self-speculative drafts (speculative_config method "draft_layers", StepPlan.num_draft_layers) in the worker,
on a tiny random 4-layer Llama: the drafts are transformers' greedy tokens of the model cut to its first L
layers, the output is the plain decoding's (and transformers'), a draft equal to the model is accepted whole,
seeded sampling with penalties is unchanged, and broken plans are refused whole."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig
from worker_testing import (
    TINY_VOCAB,
    hf_greedy,
    load_hf,
    make_runner,
    new_request,
    plan,
    random_llama,
    snapshot,
)

from pagedserve.speculative import parse_speculative_config
from pagedserve.worker_svc.runner import PlanError

BLOCK_SIZE = 4
LAYERS = 4
PROMPT = [5, 17, 42, 9, 77, 3]


def _save(path, identity_from: int | None = None):
    config = LlamaConfig(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )
    model = random_llama(config, seed=3)
    if identity_from is not None:
        # Layers from identity_from on add nothing to the residual stream: the first layers are the model.
        with torch.no_grad():
            for layer in model.model.layers[identity_from:]:
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return _save(tmp_path_factory.mktemp("llama4"))


def _hf_first_layers(model_dir, num_layers: int):
    """transformers' model of the checkpoint's first num_layers layers, final norm and LM head."""
    return AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, num_hidden_layers=num_layers
    ).eval()


def _decode(runner, steps: int, k: int, layers: int, sampling: dict | None = None):
    """Tokens of PROMPT (slot 0) over `steps` decode steps, each asking the worker for k drafts from its first
    `layers` layers (none when 0); returns (tokens, [(tokens before the step, drafts, accepted)] per step)."""
    next_block = [0]

    def blocks(end, have):
        need = max(-(-end // BLOCK_SIZE) - have, 0)
        ids = list(range(next_block[0], next_block[0] + need))
        next_block[0] += need
        return ids

    runner.execute(
        plan(
            1,
            [(0, len(PROMPT), blocks(len(PROMPT), 0))],
            new_requests=[new_request(0, PROMPT, **(sampling or {}))],
        )
    )
    record = []
    for step in range(2, steps + 2):
        state = runner.slots[0]
        before = runner.tokens(0)
        n = 1 + (k if layers else 0)
        p = plan(step, [(0, n, blocks(state.num_computed_tokens + n, state.num_blocks))])
        if layers:
            p.draft_slots.append(0)
            p.num_draft_tokens.append(k)
            p.num_draft_layers = layers
        result = runner.execute(p)
        if layers:
            assert list(result.sampled_slots) == [0] and len(result.draft_token_ids) == k
            record.append((before, list(result.draft_token_ids), result.num_accepted_tokens[0]))
        state = runner.slots[0]
        assert state.num_computed_tokens == state.num_tokens - 1
        assert state.num_blocks == -(-state.num_computed_tokens // BLOCK_SIZE)
    return runner.tokens(0)[len(PROMPT) :], record


@pytest.mark.parametrize("layers", [1, 2, 3])
def test_drafts_are_the_first_layers_greedy_tokens_and_the_output_is_unchanged(model_dir, layers):
    plain, _ = _decode(make_runner(model_dir, num_blocks=64, block_size=BLOCK_SIZE), 20, 0, 0)
    assert plain[:20] == hf_greedy(load_hf(model_dir), PROMPT, 20)
    runner = make_runner(model_dir, num_blocks=64, block_size=BLOCK_SIZE)
    tokens, record = _decode(runner, 10, 3, layers)
    assert tokens == plain[: len(tokens)]
    draft_model = _hf_first_layers(model_dir, layers)
    for before, drafts, accepted in record:
        assert drafts == hf_greedy(draft_model, before, 3)
        done = len(before) - len(PROMPT)
        expected = 0
        while expected < 3 and drafts[expected] == plain[done + expected]:
            expected += 1
        assert accepted == expected


def test_a_draft_equal_to_the_model_is_accepted_whole(tmp_path):
    model_dir = _save(tmp_path, identity_from=2)
    reference = hf_greedy(load_hf(model_dir), PROMPT, 1 + 6 * 4)
    runner = make_runner(model_dir, num_blocks=64, block_size=BLOCK_SIZE)
    tokens, record = _decode(runner, 6, 3, 2)
    assert [accepted for _, _, accepted in record] == [3] * 6
    assert tokens == reference


def test_seeded_sampling_with_penalties_is_unchanged(model_dir):
    sampling = dict(
        temperature=0.9, seed=7, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2
    )
    plain, _ = _decode(make_runner(model_dir, num_blocks=64, block_size=BLOCK_SIZE), 20, 0, 0, sampling)
    tokens, _ = _decode(make_runner(model_dir, num_blocks=64, block_size=BLOCK_SIZE), 8, 2, 2, sampling)
    assert tokens == plain[: len(tokens)]


def test_broken_draft_layer_plans_are_refused_whole(model_dir):
    runner = make_runner(model_dir, num_blocks=64, block_size=BLOCK_SIZE)
    runner.execute(plan(1, [(0, len(PROMPT), [0, 1])], new_requests=[new_request(0, PROMPT)]))
    before = snapshot(runner)
    cases = [
        (
            dict(draft_slots=[0], num_draft_tokens=[2], num_draft_layers=LAYERS),
            "not below the model's 4 layers",
        ),
        (
            dict(draft_slots=[0], num_draft_tokens=[2], draft_token_ids=[1, 2], num_draft_layers=1),
            "draft_token_ids",
        ),
    ]
    for fields, message in cases:
        with pytest.raises(PlanError, match=message):
            runner.execute(plan(2, [(0, 3, [])], **fields))
        assert snapshot(runner) == before
    runner.execute(plan(2, [(0, 1, [])]))  # the state is as it was: a plain decode goes on


def test_config_names_the_method_and_its_layers():
    spec = parse_speculative_config(
        '{"method": "draft_layers", "num_speculative_tokens": 3, "num_draft_layers": 8}'
    )
    assert (spec.method, spec.num_speculative_tokens, spec.num_draft_layers) == ("draft_layers", 3, 8)
    for config, message in [
        ({"method": "draft_layers", "num_speculative_tokens": 3}, "num_draft_layers is required"),
        (
            {"method": "draft_layers", "num_speculative_tokens": 3, "num_draft_layers": 0},
            "num_draft_layers must",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": 3, "num_draft_layers": 2},
            "applies to method draft_layers",
        ),
        (
            {
                "method": "draft_layers",
                "num_speculative_tokens": 3,
                "num_draft_layers": 2,
                "prompt_lookup_max": 3,
            },
            "prompt_lookup_max applies to method ngram",
        ),
        (
            {"model": "/models/small", "num_speculative_tokens": 3},
            "separate draft checkpoint is not supported",
        ),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_speculative_config(config)
