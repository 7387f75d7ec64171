"""Deterministic decoding (--deterministic, LLM(deterministic=True)): a request's tokens, and the bits of each
sampled token's log-probability, are the same alone, inside a batch of 32 other requests, with its prompt
chunked at several sizes and after a preemption and its recompute, in bf16 and float32, greedy and seeded
(the log-probabilities make a rounding that did not flip a token fail the test too). The default model through the offline LLM, which runs the
scheduler, the plans and the worker's runner exactly as served (the failover is tests/test_fault_tolerance.py).
"""

from __future__ import annotations

import functools

import pytest

from pagedserve import LLM, SamplingParams

# Each test loads the model and runs dozens of requests, float32 ones on two cores among them.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

DTYPES = ["bfloat16", "float32"]
MAX_TOKENS = 16
# A story long enough (839 tokens) that its attention is split into parts of 512 positions.
LONG = " ".join(
    f"Day {i}: the lighthouse keeper counted {i * 7 % 13} ships, wrote down the wind, and slept."
    for i in range(40)
)
# The requests under test: greedy and seeded, a short prompt and a long one, with their tokens' logprobs.
TARGET = {"max_tokens": MAX_TOKENS, "ignore_eos": True, "logprobs": 0}
TARGETS = [
    ("The capital of France is", SamplingParams(temperature=0.0, **TARGET)),
    (LONG, SamplingParams(temperature=0.0, **TARGET)),
    ("Once upon a time", SamplingParams(temperature=0.9, top_p=0.95, seed=7, **TARGET)),
    (LONG + " Then", SamplingParams(temperature=0.8, top_k=40, seed=3, **TARGET)),
]


def _others(count: int) -> list[tuple[str, SamplingParams]]:
    """count other requests: prompts of 6 to about 40 tokens, greedy and sampled, ending at different steps."""
    subjects = ["rivers", "bread", "prime numbers", "the moon", "chess", "a red fox", "Python lists", "rain"]
    others = []
    for i in range(count):
        prompt = f"Write about {subjects[i % len(subjects)]}." + " Tell me more, in detail." * (i % 5) * 2
        params = SamplingParams(
            temperature=0.0 if i % 3 == 0 else 1.0, seed=100 + i, max_tokens=4 + i % 13, ignore_eos=True
        )
        others.append((prompt, params))
    return others


def _tokens(llm: LLM, requests: list[tuple[str, SamplingParams]]) -> list[list]:
    """Each request's tokens, with each sampled token's logprob where it asked for them."""
    outputs = llm.generate([p for p, _ in requests], [s for _, s in requests], use_tqdm=False)
    return [
        list(
            zip(
                c.token_ids,
                [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs, strict=True)],
                strict=True,
            )
        )
        if c.logprobs is not None
        else list(c.token_ids)
        for c in (o.outputs[0] for o in outputs)
    ]


def _targets_within(llm: LLM, others: list[tuple[str, SamplingParams]]) -> list[list[int]]:
    """The targets' tokens when they run among others (half before them, half after)."""
    half = len(others) // 2
    tokens = _tokens(llm, others[:half] + TARGETS + others[half:])
    return tokens[half : half + len(TARGETS)]


@functools.cache
def _alone(dtype: str) -> tuple[list[list[int]], ...]:
    """Each target computed alone (its own generate call, nothing beside it), on a fresh engine."""
    llm = LLM(dtype=dtype, deterministic=True, enable_prefix_caching=False)
    return tuple(_tokens(llm, [target])[0] for target in TARGETS)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_request_has_its_tokens_alone_and_inside_a_batch_of_32(dtype):
    alone = list(_alone(dtype))
    llm = LLM(dtype=dtype, deterministic=True)
    assert _targets_within(llm, _others(32)) == alone
    # Again: now every prompt is in the prefix cache, and its K and V are the first run's.
    assert _targets_within(llm, _others(32)[::-1]) == alone


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("chunk", [16, 61, 256])
def test_a_request_has_its_tokens_whatever_the_size_of_its_prompts_chunks(dtype, chunk):
    # A step computes at most `chunk` tokens: the long prompts run in chunks of that size or less (what a
    # step's decodes leave of it), beside the others' decodes.
    llm = LLM(dtype=dtype, deterministic=True, max_num_seqs=8, max_num_batched_tokens=chunk)
    assert _targets_within(llm, _others(6)) == list(_alone(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_request_has_its_tokens_after_preemption_and_recompute(dtype):
    # 80 blocks of 16 tokens hold one long target (55 blocks with its output) and a few short requests: the
    # scheduler preempts the latest and recomputes their prompts and the tokens they had when they come back.
    llm = LLM(dtype=dtype, deterministic=True, num_blocks=80)
    assert _targets_within(llm, _others(12)) == list(_alone(dtype))
    assert llm.scheduler.stats().num_preemptions > 0


@pytest.mark.parametrize(
    ("dtype", "quantization", "on_where_measured"),
    [("bfloat16", None, True), ("float32", None, False), ("bfloat16", "gptq", False)],
)
def test_deterministic_is_the_default_where_its_cost_was_measured(dtype, quantization, on_where_measured):
    """Without --deterministic or --no-deterministic, batch invariance is on for the CPU kernels in bf16
    with AMX tiles that round as the few-row linear's FMAs (its cost measured within 3 %), on unquantized
    weights; off in float32, for quantized weights and on other backends."""
    import torch

    from pagedserve.kernels import get_ops
    from pagedserve.kernels.reference import ReferenceOps
    from pagedserve.worker_svc.assembly import default_deterministic

    ops = get_ops(torch.device("cpu"))
    cheap = getattr(ops, "tiles_sum_in_chains", False)
    torch_dtype = getattr(torch, dtype)
    assert default_deterministic(ops, torch_dtype, quantization) is (on_where_measured and cheap)
    assert not default_deterministic(ReferenceOps(), torch_dtype, quantization)
    if on_where_measured:
        assert LLM(dtype=dtype).runner.ops.batch_invariant is cheap
        assert LLM(dtype=dtype, deterministic=False).runner.ops.batch_invariant is False
