"""Helpers shared by the worker tests: a tiny random Llama on disk, a runner over it, plan builders."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from pagedserve.kernels.ops import Ops
from pagedserve.v1 import common_pb2, worker_pb2
from pagedserve.worker_svc.kv_cache import KVCache, KVCacheSpec
from pagedserve.worker_svc.loader import load_model
from pagedserve.worker_svc.runner import ModelRunner

TINY_VOCAB = 128
EOS = 1


def save_tiny_llama(path: Path, seed: int = 0, head_dim: int = 16) -> Path:
    """A 2-layer GQA Llama with random weights (large enough that greedy text is not one token
    repeated), saved as safetensors with a generation config. Its head size is 16 unless asked (the CUDA
    kernels take 64 and more)."""
    config = LlamaConfig(
        vocab_size=TINY_VOCAB,
        hidden_size=4 * head_dim,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        bos_token_id=0,
        eos_token_id=EOS,
        tie_word_embeddings=False,
    )
    random_llama(config, seed).save_pretrained(path, safe_serialization=True)
    return path


def random_llama(config: LlamaConfig, seed: int):
    """A float32 Llama of this config with random weights: norms near 1, the rest large enough that
    greedy text is not one token repeated."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.2 * noise)
    return model


def make_runner(
    model_dir: Path,
    num_blocks: int = 32,
    block_size: int = 4,
    max_model_len: int = 256,
    seed: int = 0,
    ops: Ops | None = None,
    device: str = "cpu",
) -> ModelRunner:
    """A float32 runner on `device`, through `ops` where given (else the device's own)."""
    from pagedserve.worker_svc.sampler import Sampler

    model = load_model(model_dir, torch.float32, device, ops=ops)
    cfg = model.config
    spec = KVCacheSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, block_size, torch.float32)
    # The CPU kernels take head-major blocks; CUDA's, whether run or emulated, token-major ones.
    kv_cache = KVCache(spec, num_blocks, torch.device(device), heads_first=model.ops.name == "cpu")
    return ModelRunner(model, kv_cache, max_model_len, sampler=Sampler(cfg.vocab_size, device, seed=seed))


def drive_greedy(
    runner: ModelRunner, prompts: list[list[int]], block_size: int, steps: int
) -> list[list[int]]:
    """Greedy tokens of each prompt (slot i: prompts[i]) over `steps` plans: the first prompt prefilled in
    two chunks, the second joining in the second plan beside that chunk (a mixed step), then one decode
    token each per plan, blocks appended as the sequences fill them."""
    first, second = prompts
    half = len(first) // 2
    blocks = iter(range(1 << 20))

    def fresh(tokens_before: int, tokens: int) -> list[int]:
        """The new blocks a sequence of tokens_before tokens needs for `tokens` more."""
        needed = math.ceil((tokens_before + tokens) / block_size) - math.ceil(tokens_before / block_size)
        return [next(blocks) for _ in range(needed)]

    plans = [
        plan(1, [(0, half, fresh(0, half))], new_requests=[new_request(0, first)]),
        plan(
            2,
            [(0, len(first) - half, fresh(half, len(first) - half)), (1, len(second), fresh(0, len(second)))],
            new_requests=[new_request(1, second)],
        ),
    ]
    sampled: list[list[int]] = [[], []]
    for step in range(1, steps + 1):
        if step > len(plans):
            plans.append(
                plan(step, [(slot, 1, fresh(runner.slots[slot].num_computed_tokens, 1)) for slot in (0, 1)])
            )
        result = runner.execute(plans[step - 1])
        for slot, token in zip(result.sampled_slots, result.sampled_token_ids, strict=True):
            sampled[slot].append(token)
    return sampled


def new_request(
    slot: int,
    token_ids: list[int],
    prompt_len: int | None = None,
    num_computed_tokens: int = 0,
    request_id: str | None = None,
    **sampling,
) -> worker_pb2.NewRequest:
    sampling.setdefault("temperature", 0.0)
    return worker_pb2.NewRequest(
        slot=slot,
        request_id=request_id or f"req-{slot}",
        token_ids=token_ids,
        prompt_len=len(token_ids) if prompt_len is None else prompt_len,
        num_computed_tokens=num_computed_tokens,
        sampling=common_pb2.SamplingParams(**sampling),
    )


def plan(
    step_id: int,
    scheduled: list[tuple[int, int, list[int]]] = (),
    **fields,
) -> worker_pb2.StepPlan:
    """scheduled: (slot, num_scheduled_tokens, new block ids) per batch entry, in order."""
    p = worker_pb2.StepPlan(step_id=step_id, **fields)
    for slot, n, blocks in scheduled:
        p.slots.append(slot)
        p.num_scheduled_tokens.append(n)
        p.num_new_blocks.append(len(blocks))
        p.new_block_ids.extend(blocks)
    return p


# Two prompts for block size 4: A (6 tokens) in blocks 0 and 1, B (5 tokens) in blocks 2 and 3.
PROMPT_A = [5, 17, 42, 9, 77, 3]
PROMPT_B = [11, 23, 64, 100, 8]


def first_plan() -> worker_pb2.StepPlan:
    """Step 1: A in slot 0 and B in slot 1 enter and are prefilled whole."""
    return plan(
        1,
        [(0, len(PROMPT_A), [0, 1]), (1, len(PROMPT_B), [2, 3])],
        new_requests=[new_request(0, PROMPT_A), new_request(1, PROMPT_B)],
    )


def decode_plan(step_id: int) -> worker_pb2.StepPlan:
    """One decode token for slots 0 and 1, no new blocks."""
    return plan(step_id, [(0, 1, []), (1, 1, [])])


def snapshot(runner: ModelRunner) -> dict:
    """Everything the runner knows about its requests, comparable with ==."""
    return {
        "last_step_id": runner.last_step_id,
        "refused": dict(runner.refused),
        "slots": {
            slot: (
                state.request_id,
                state.prompt_len,
                state.num_computed_tokens,
                runner.tokens(slot),
                runner.block_table(slot),
                list(state.sampling.output_token_ids),
            )
            for slot, state in sorted(runner.slots.items())
        },
    }


def hf_greedy(hf_model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation by transformers' own forward pass (full recompute each token, no EOS stop)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(max_new_tokens):
            next_id = hf_model(ids).logits[0, -1].argmax()
            ids = torch.cat([ids, next_id.view(1, 1)], dim=1)
    return ids[0, len(prompt) :].tolist()


def load_hf(model_dir: Path):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
