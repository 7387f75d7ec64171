import math
from collections import Counter

import pytest
import torch

from pagedserve.v1 import common_pb2
from pagedserve.worker_svc.sampler import (
    Sampler,
    SamplingMetadata,
    SlotSamplingState,
    apply_logit_bias,
    apply_penalties,
    compute_logprobs,
    mix_seed,
)

VOCAB = 64
# Crafted distribution over 10 tokens, most likely first.
PROBS = [0.35, 0.25, 0.15, 0.1, 0.05, 0.04, 0.03, 0.015, 0.01, 0.005]


def step_logits(key: int, step: int, vocab: int = VOCAB) -> torch.Tensor:
    """Logits of request `key` at `step`: the same whatever batch it runs in."""
    generator = torch.Generator().manual_seed(key * 100_003 + step)
    return torch.randn(vocab, generator=generator) * 2.0


def run(sampler: Sampler, logits: torch.Tensor, states: list[SlotSamplingState]):
    out = sampler(logits.to(sampler.device), SamplingMetadata.build(states, logits.shape[1], sampler.device))
    for state, token in zip(states, out.token_ids.tolist(), strict=True):
        state.append_output(token)
    return out


def generate(batch: list[tuple[int, SlotSamplingState]], steps: int, sampler: Sampler) -> list[list[int]]:
    """Runs `steps` decode steps of the batch of (key, state); returns each row's sampled tokens."""
    tokens: list[list[int]] = [[] for _ in batch]
    for _ in range(steps):
        states = [s for _, s in batch]
        logits = torch.stack([step_logits(key, len(s.output_token_ids)) for key, s in batch])
        out = run(sampler, logits, states)
        for row, token in enumerate(out.token_ids.tolist()):
            tokens[row].append(token)
    return tokens


def repeated_draws(logits: torch.Tensor, n: int, seeded: bool = False, **params) -> torch.Tensor:
    """n draws from one row of logits: n identical rows in one batch (seeded: seeds 0..n-1)."""
    states = [SlotSamplingState(seed=i if seeded else None, **params) for i in range(n)]
    meta = SamplingMetadata.build(states, logits.shape[0])
    return Sampler(logits.shape[0], seed=0)(logits.expand(n, -1).contiguous(), meta).token_ids


def chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    expected = probs.double() * tokens.numel()
    return float(((counts - expected) ** 2 / expected).sum())


# --- per-request state -------------------------------------------------------------------------


def test_from_proto_unset_fields_take_openai_defaults():
    state = SlotSamplingState.from_proto(common_pb2.SamplingParams(), [1, 2, 3])
    assert state.temperature == 1.0 and state.top_p == 1.0 and state.repetition_penalty == 1.0
    assert state.top_k == 0 and state.min_p == 0.0 and state.seed is None
    assert state.presence_penalty == 0.0 and state.frequency_penalty == 0.0
    assert state.logit_bias == {} and state.logprobs is None and state.prompt_logprobs is None
    assert state.prompt_token_ids == [1, 2, 3] and state.output_token_ids == []
    assert not state.greedy and not state.has_penalties


def test_from_proto_reads_set_fields_and_zero_values():
    params = common_pb2.SamplingParams(
        temperature=0.0,
        top_p=0.5,
        top_k=-1,
        min_p=0.1,
        seed=7,
        presence_penalty=0.5,
        frequency_penalty=-0.25,
        repetition_penalty=1.5,
        logit_bias={5: 3.0},
        logprobs=0,
        prompt_logprobs=2,
    )
    state = SlotSamplingState.from_proto(params, [4], output_token_ids=[9, 8])
    assert state.temperature == 0.0 and state.greedy
    assert state.top_p == 0.5 and state.top_k == 0 and state.min_p == pytest.approx(0.1)
    assert state.seed == 7 and state.repetition_penalty == 1.5 and state.has_penalties
    assert state.logit_bias == {5: 3.0} and state.logprobs == 0 and state.prompt_logprobs == 2
    assert state.output_token_ids == [9, 8]


def test_seed_override_replaces_the_request_seed():
    params = common_pb2.SamplingParams(seed=7)
    assert SlotSamplingState.from_proto(params, [1], seed_override=8).seed == 8
    assert SlotSamplingState.from_proto(common_pb2.SamplingParams(), [1], seed_override=3).seed == 3


# --- metadata ----------------------------------------------------------------------------------


def test_all_greedy_batch_without_penalties_builds_no_tensors():
    states = [SlotSamplingState(temperature=0.0, top_p=0.5, top_k=3, seed=1) for _ in range(4)]
    meta = SamplingMetadata.build(states, VOCAB)
    assert meta.all_greedy and not meta.all_random and meta.no_penalties
    assert meta.no_top_k and meta.no_top_p and meta.no_min_p
    assert meta.logit_bias is None and meta.seeded_rows == [] and meta.unseeded_rows is None


def test_greedy_rows_do_not_switch_on_filters_for_the_batch():
    states = [SlotSamplingState(temperature=0.0, top_p=0.5, top_k=3, min_p=0.2), SlotSamplingState()]
    meta = SamplingMetadata.build(states, VOCAB)
    assert not meta.all_greedy and not meta.all_random
    assert meta.no_top_k and meta.no_top_p and meta.no_min_p
    assert meta.unseeded_rows.tolist() == [1]


def test_metadata_pads_token_ids_with_vocab_size_and_records_seeded_positions():
    states = [
        SlotSamplingState(repetition_penalty=1.2, prompt_token_ids=[1, 2, 3], output_token_ids=[4]),
        SlotSamplingState(seed=5, frequency_penalty=0.5, prompt_token_ids=[7], output_token_ids=[8, 9, 8]),
        SlotSamplingState(top_k=VOCAB + 10, prompt_token_ids=[1] * 10, output_token_ids=[2] * 10),
    ]
    meta = SamplingMetadata.build(states, VOCAB)
    assert meta.all_random and not meta.no_penalties and meta.no_top_k
    # Rows without a repetition penalty send no prompt ids; rows without penalties send nothing.
    assert meta.prompt_token_ids.tolist() == [[1, 2, 3], [VOCAB] * 3, [VOCAB] * 3]
    assert meta.output_token_ids.tolist() == [[4, VOCAB, VOCAB], [8, 9, 8], [VOCAB] * 3]
    assert meta.seeded_rows == [1] and meta.seeds == [5] and meta.output_positions == [3]
    assert meta.unseeded_rows.tolist() == [0, 2]


def test_max_num_logprobs_is_the_largest_request():
    states = [SlotSamplingState(logprobs=3), SlotSamplingState(), SlotSamplingState(logprobs=0)]
    assert SamplingMetadata.build(states, VOCAB).max_num_logprobs == 3
    assert SamplingMetadata.build([SlotSamplingState()], VOCAB).max_num_logprobs == 0


# --- seeds -------------------------------------------------------------------------------------


def target() -> SlotSamplingState:
    return SlotSamplingState(seed=1234, temperature=1.3, top_p=0.95, prompt_token_ids=[1, 2])


def others(count: int) -> list[tuple[int, SlotSamplingState]]:
    kinds = [
        lambda i: SlotSamplingState(seed=i),
        lambda i: SlotSamplingState(temperature=0.7),
        lambda i: SlotSamplingState(temperature=0.0),
        lambda i: SlotSamplingState(top_k=5, repetition_penalty=1.3, prompt_token_ids=[3, 4]),
        lambda i: SlotSamplingState(min_p=0.1, frequency_penalty=0.4, logit_bias={0: 2.0}),
    ]
    return [(100 + i, kinds[i % len(kinds)](i)) for i in range(count)]


@pytest.mark.parametrize(("position", "batch_size"), [(0, 2), (2, 5), (7, 8)])
def test_seeded_request_gives_the_same_tokens_alone_or_batched_anywhere(position, batch_size):
    steps = 40
    alone = generate([(1, target())], steps, Sampler(VOCAB, seed=0))[0]
    batch = others(batch_size - 1)
    batch.insert(position, (1, target()))
    batched = generate(batch, steps, Sampler(VOCAB, seed=position + 99))[position]
    assert batched == alone
    assert len(set(alone)) > 5  # it really sampled


def test_seeded_request_continues_identically_after_recompute():
    steps, cut = 30, 12
    alone = generate([(1, target())], steps, Sampler(VOCAB))[0]
    # Preempted after `cut` tokens: comes back as a new request carrying its generated tokens.
    params = common_pb2.SamplingParams(seed=1234, temperature=1.3, top_p=0.95)
    resumed = SlotSamplingState.from_proto(params, [1, 2], output_token_ids=alone[:cut])
    rest = generate([*others(3), (1, resumed)], steps - cut, Sampler(VOCAB))[3]
    assert rest == alone[cut:]


def test_same_seed_at_different_output_positions_draws_differently():
    flat = torch.zeros(1000)
    tokens = []
    for position in range(20):
        state = SlotSamplingState(seed=42, output_token_ids=[0] * position)
        tokens.append(Sampler(1000)(flat[None], SamplingMetadata.build([state], 1000)).token_ids.item())
    assert len(set(tokens)) >= 15
    assert mix_seed(42, 0) != mix_seed(42, 1) and mix_seed(42, 1) != mix_seed(43, 1)


def test_different_seeds_at_the_same_position_draw_differently():
    flat = torch.zeros(20, 1000)
    states = [SlotSamplingState(seed=s) for s in range(20)]
    tokens = Sampler(1000)(flat, SamplingMetadata.build(states, 1000)).token_ids
    assert len(set(tokens.tolist())) >= 15


def test_equal_seeds_in_one_batch_draw_the_same_token():
    # Hence forks of an n > 1 request need distinct seeds (seed_override).
    flat = torch.zeros(2, 1000)
    states = [SlotSamplingState(seed=9), SlotSamplingState(seed=9)]
    tokens = Sampler(1000)(flat, SamplingMetadata.build(states, 1000)).token_ids
    assert tokens[0] == tokens[1]


def test_seeded_and_greedy_rows_leave_the_shared_generator_untouched():
    sampler = Sampler(VOCAB, seed=3)
    before = sampler.generator.get_state()
    states = [SlotSamplingState(seed=1), SlotSamplingState(temperature=0.0)]
    sampler(torch.randn(2, VOCAB), SamplingMetadata.build(states, VOCAB))
    assert torch.equal(sampler.generator.get_state(), before)


def test_unseeded_rows_follow_the_sampler_generator():
    logits = torch.zeros(4, 1000)
    states = [SlotSamplingState() for _ in range(4)]
    a = Sampler(1000, seed=5)(logits, SamplingMetadata.build(states, 1000)).token_ids
    b = Sampler(1000, seed=5)(logits, SamplingMetadata.build(states, 1000)).token_ids
    c = Sampler(1000, seed=6)(logits, SamplingMetadata.build(states, 1000)).token_ids
    assert torch.equal(a, b) and not torch.equal(a, c)


# --- filters -----------------------------------------------------------------------------------

CRAFTED = torch.tensor(PROBS).log()


@pytest.mark.parametrize("seeded", [False, True], ids=["unseeded", "seeded"])
@pytest.mark.parametrize(
    ("params", "allowed"),
    [
        ({"top_p": 0.7}, {0, 1, 2}),  # 0.35 + 0.25 < 0.7 <= 0.35 + 0.25 + 0.15
        ({"top_p": 0.01}, {0}),  # at least the top token
        ({"top_k": 4}, {0, 1, 2, 3}),
        ({"top_k": 1, "temperature": 5.0}, {0}),
        ({"min_p": 0.12}, {0, 1, 2, 3, 4}),  # threshold 0.042: 0.05 stays, 0.04 goes
        ({"top_k": 4, "top_p": 0.8}, {0, 1, 2}),  # top-p over the renormalised top 4
        ({"min_p": 0.12, "top_p": 0.9, "top_k": 9}, {0, 1, 2, 3}),  # top-p over the min-p survivors
    ],
)
def test_filters_never_emit_a_token_outside_the_allowed_set_and_cover_it(params, allowed, seeded):
    tokens = repeated_draws(CRAFTED, 2000, seeded=seeded, **params)
    assert set(tokens.tolist()) == allowed


def test_top_p_top_k_filters_apply_after_temperature():
    # Temperature 3 flattens the crafted distribution, so top_p 0.5 keeps more tokens than at 1.
    flat = torch.softmax(CRAFTED / 3.0, dim=0)
    needed = int((flat.cumsum(0) < 0.5).sum()) + 1
    tokens = repeated_draws(CRAFTED, 2000, temperature=3.0, top_p=0.5)
    assert set(tokens.tolist()) == set(range(needed)) and needed >= 3


@pytest.mark.parametrize("seeded", [False, True], ids=["unseeded", "seeded"])
@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
def test_unfiltered_sampling_follows_the_softmax_distribution(temperature, seeded):
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0, 2.0, 0.2, -2.0])
    n = 5000 if seeded else 20000
    tokens = repeated_draws(logits, n, seeded=seeded, temperature=temperature, top_p=1.0, top_k=0)
    # 7 degrees of freedom: P(chi2 > 24.3) = 0.001.
    assert chi_square(tokens, torch.softmax(logits / temperature, dim=0)) < 24.3


def test_filtered_sampling_follows_the_renormalised_distribution():
    tokens = repeated_draws(CRAFTED, 20000, top_k=4)
    assert int(tokens.max()) < 4
    kept = torch.tensor(PROBS[:4])
    assert chi_square(tokens, kept / kept.sum()) < 16.3  # 3 degrees of freedom, p = 0.001


# --- greedy ------------------------------------------------------------------------------------


def test_greedy_fast_path_equals_argmax_and_draws_nothing():
    logits = torch.randn(16, VOCAB)
    states = [SlotSamplingState(temperature=0.0) for _ in range(16)]
    sampler = Sampler(VOCAB, seed=1)
    before = sampler.generator.get_state()
    out = sampler(logits, SamplingMetadata.build(states, VOCAB))
    assert torch.equal(out.token_ids, logits.argmax(dim=-1))
    assert torch.equal(sampler.generator.get_state(), before)


def test_temperature_zero_is_argmax_even_with_filters_and_seed_set():
    logits = torch.randn(12, VOCAB)
    states = [
        SlotSamplingState(temperature=0.0, top_p=0.1, top_k=3, min_p=0.5, seed=i)
        if i % 2
        else SlotSamplingState()
        for i in range(12)
    ]
    out = Sampler(VOCAB)(logits, SamplingMetadata.build(states, VOCAB))
    odd = torch.arange(1, 12, 2)
    assert torch.equal(out.token_ids[odd], logits[odd].argmax(dim=-1))


# --- bias and penalties ------------------------------------------------------------------------


def reference_bias_and_penalties(logits: torch.Tensor, states: list[SlotSamplingState]) -> torch.Tensor:
    out = logits.clone()
    for row, s in enumerate(states):
        for token, value in s.logit_bias.items():
            out[row, token] += value
        for token in set(s.prompt_token_ids) | set(s.output_token_ids):
            value = out[row, token]
            out[row, token] = value / s.repetition_penalty if value > 0 else value * s.repetition_penalty
        for token, count in Counter(s.output_token_ids).items():
            out[row, token] -= count * s.frequency_penalty + s.presence_penalty
    return out


def random_states(count: int, generator: torch.Generator) -> list[SlotSamplingState]:
    def ids(n: int) -> list[int]:
        return torch.randint(0, VOCAB, (n,), generator=generator).tolist()

    def uniform(low: float, high: float) -> float:
        return low + (high - low) * torch.rand((), generator=generator).item()

    states = []
    for i in range(count):
        kind = i % 4  # 0: all penalties, 1: repetition only, 2: none, 3: presence/frequency + bias
        states.append(
            SlotSamplingState(
                temperature=0.0,
                presence_penalty=uniform(-2, 2) if kind in (0, 3) else 0.0,
                frequency_penalty=uniform(-2, 2) if kind in (0, 3) else 0.0,
                repetition_penalty=uniform(0.5, 2.0) if kind in (0, 1) else 1.0,
                logit_bias={t: uniform(-5, 5) for t in ids(3)} if kind == 3 else {},
                prompt_token_ids=ids(1 + i * 3),
                output_token_ids=ids(i * 2),
            )
        )
    return states


def test_penalties_and_bias_change_logits_exactly_as_specified():
    generator = torch.Generator().manual_seed(0)
    states = random_states(12, generator)
    states[0].logprobs = 0  # one row asking makes the sampler return logprobs for all
    logits = torch.randn(12, VOCAB, generator=generator) * 3
    meta = SamplingMetadata.build(states, VOCAB)
    got = apply_penalties(apply_logit_bias(logits, meta), meta)
    torch.testing.assert_close(got, reference_bias_and_penalties(logits, states), rtol=1e-5, atol=1e-5)
    # Greedy rows take the argmax after penalties, while the logprobs stay those of the raw logits.
    out = Sampler(VOCAB)(logits, meta)
    assert torch.equal(out.token_ids, got.argmax(dim=-1))
    torch.testing.assert_close(
        out.logprobs, torch.log_softmax(logits, -1).gather(1, out.token_ids[:, None])[:, 0]
    )


def test_penalties_leave_inputs_untouched_and_rows_without_penalties_unchanged():
    generator = torch.Generator().manual_seed(1)
    states = random_states(8, generator)
    logits = torch.randn(8, VOCAB, generator=generator)
    original = logits.clone()
    meta = SamplingMetadata.build(states, VOCAB)
    got = apply_penalties(logits, meta)
    assert torch.equal(logits, original)
    assert torch.equal(got[2::4], original[2::4])


def test_frequency_and_presence_count_output_tokens_only():
    state = SlotSamplingState(
        presence_penalty=0.5, frequency_penalty=1.0, prompt_token_ids=[3, 3, 4], output_token_ids=[4, 5, 5]
    )
    meta = SamplingMetadata.build([state], 8)
    got = apply_penalties(torch.zeros(1, 8), meta)[0]
    assert got.tolist() == [0, 0, 0, 0, -1.5, -2.5, 0, 0]


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    state = SlotSamplingState(repetition_penalty=2.0, prompt_token_ids=[0, 1], output_token_ids=[2])
    meta = SamplingMetadata.build([state], 4)
    got = apply_penalties(torch.tensor([[4.0, -4.0, 1.0, 4.0]]), meta)[0]
    assert got.tolist() == [2.0, -8.0, 0.5, 4.0]


def test_logit_bias_plus_100_forces_a_token_and_minus_100_bans_one():
    forced = repeated_draws(CRAFTED, 500, temperature=1.5, logit_bias={9: 100.0})
    assert set(forced.tolist()) == {9}
    banned = repeated_draws(CRAFTED, 2000, logit_bias={0: -100.0})
    assert 0 not in set(banned.tolist()) and len(set(banned.tolist())) > 5
    greedy = Sampler(10)(
        CRAFTED[None], SamplingMetadata.build([SlotSamplingState(temperature=0, logit_bias={0: -100})], 10)
    )
    assert greedy.token_ids.item() == 1


# --- logprobs ----------------------------------------------------------------------------------


def test_sampled_logprobs_ranks_and_top_k_match_raw_log_softmax():
    generator = torch.Generator().manual_seed(2)
    logits = torch.randn(6, VOCAB, generator=generator) * 2
    states = [
        SlotSamplingState(logprobs=5, temperature=0.5, repetition_penalty=1.5, prompt_token_ids=[1, 2]),
        SlotSamplingState(logprobs=0, seed=3, top_k=10),
        SlotSamplingState(),
        SlotSamplingState(logprobs=2, temperature=0.0, logit_bias={7: 50.0}),
        SlotSamplingState(logprobs=1, top_p=0.9, frequency_penalty=1.0, output_token_ids=[4, 4]),
        SlotSamplingState(temperature=3.0, min_p=0.05),
    ]
    out = Sampler(VOCAB)(logits, SamplingMetadata.build(states, VOCAB))
    expected = torch.log_softmax(logits, dim=-1)
    chosen = expected.gather(1, out.token_ids[:, None])[:, 0]
    torch.testing.assert_close(out.logprobs, chosen)
    assert torch.equal(out.ranks, (expected > chosen[:, None]).sum(-1) + 1)
    top_values, top_ids = expected.topk(5, dim=-1)
    assert out.top_ids.shape == (6, 5) and out.top_ids.dtype == torch.int64
    assert torch.equal(out.top_ids, top_ids)
    torch.testing.assert_close(out.top_logprobs, top_values)
    assert out.token_ids[3].item() == 7 and out.ranks[3].item() >= 1  # biased, but ranked on raw logits


def test_greedy_token_has_rank_one():
    logits = torch.randn(5, VOCAB)
    states = [SlotSamplingState(temperature=0.0, logprobs=0) for _ in range(5)]
    out = Sampler(VOCAB)(logits, SamplingMetadata.build(states, VOCAB))
    assert out.ranks.tolist() == [1] * 5 and out.top_ids.shape == (5, 0)


def test_no_logprobs_are_computed_when_no_row_asks():
    logits = torch.randn(3, VOCAB)
    states = [SlotSamplingState(temperature=0.0) for _ in range(3)]
    out = Sampler(VOCAB)(logits, SamplingMetadata.build(states, VOCAB))
    assert torch.equal(out.token_ids, logits.argmax(-1))
    assert out.logprobs.numel() == out.ranks.numel() == out.top_ids.numel() == 0


def test_prompt_logprobs_match_log_softmax():
    generator = torch.Generator().manual_seed(4)
    logits = torch.randn(9, VOCAB, generator=generator)
    next_ids = torch.randint(0, VOCAB, (9,), generator=generator)
    got = compute_logprobs(logits, next_ids, num_top=4)
    expected = torch.log_softmax(logits, dim=-1)
    chosen = expected[torch.arange(9), next_ids]
    torch.testing.assert_close(got.logprobs, chosen)
    assert torch.equal(got.ranks, (expected > chosen[:, None]).sum(-1) + 1)
    top_values, top_ids = expected.topk(4, dim=-1)
    assert torch.equal(got.top_ids, top_ids)
    torch.testing.assert_close(got.top_logprobs, top_values)
    assert math.isclose(
        got.top_logprobs[0].exp().sum().item(), top_values[0].exp().sum().item(), rel_tol=1e-5
    )


# --- CUDA (skipped without a device) -----------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.cuda
@needs_cuda
def test_seeded_request_gives_the_same_tokens_alone_or_batched_on_cuda():
    alone = generate([(1, target())], 20, Sampler(VOCAB, "cuda", seed=0))[0]
    batch = others(6)
    batch.insert(3, (1, target()))
    assert generate(batch, 20, Sampler(VOCAB, "cuda", seed=1))[3] == alone


@pytest.mark.cuda
@needs_cuda
def test_filters_and_logprobs_on_cuda_match_the_cpu_definition():
    states = [
        SlotSamplingState(top_k=4, top_p=0.8, seed=i if i % 2 else None, logprobs=3) for i in range(2000)
    ]
    logits = CRAFTED.expand(2000, -1).contiguous()
    out = Sampler(10, "cuda", seed=0)(logits.cuda(), SamplingMetadata.build(states, 10, "cuda"))
    assert set(out.token_ids.tolist()) == {0, 1, 2}
    expected = torch.log_softmax(logits, dim=-1)
    torch.testing.assert_close(out.logprobs.cpu(), expected.gather(1, out.token_ids.cpu()[:, None])[:, 0])
    torch.testing.assert_close(out.top_logprobs.cpu(), expected.topk(3, dim=-1).values)


# A greedy row's extra parameters, and whether the row is then argmax_only.
ROW_KINDS = [
    ({}, True),
    ({"logprobs": 0}, False),
    ({"logit_bias": {3: 100.0}}, False),
    ({"repetition_penalty": 1.2}, False),
    ({"frequency_penalty": 0.5}, False),
    ({"temperature": 0.7}, False),
]


@pytest.mark.parametrize(("extra", "argmax_only"), ROW_KINDS)
def test_a_batch_of_argmax_rows_takes_the_argmax_and_nothing_else(extra, argmax_only):
    # Such a batch skips the metadata's passes over its rows; any row that needs more takes them all.
    states = [SlotSamplingState(temperature=0.0), SlotSamplingState(**{"temperature": 0.0, **extra})]
    assert [s.argmax_only for s in states] == [True, argmax_only]
    meta = SamplingMetadata.build(states, VOCAB)
    assert (meta.all_greedy and meta.no_penalties and meta.logit_bias is None and not meta.any_logprobs) == (
        argmax_only
    )
    logits = torch.stack([step_logits(1, 0), step_logits(2, 0)])
    out = Sampler(VOCAB, seed=0)(logits, meta)
    assert out.token_ids[0] == logits[0].argmax()
    if argmax_only:
        assert torch.equal(out.token_ids, logits.argmax(dim=-1)) and out.logprobs.numel() == 0
    if "logit_bias" in extra:
        assert out.token_ids[1] == 3
    if "logprobs" in extra:
        assert out.logprobs.shape == (2,) and out.ranks.tolist()[0] == 1


@pytest.mark.parametrize(("extra", "argmax_only"), ROW_KINDS)
def test_bf16_logits_sample_as_their_float32_widening(extra, argmax_only):
    # The model's logits come in its dtype: an argmax-only batch takes its argmax from them as they are,
    # anything else widens them first; either way the result is that of the widened logits, bit for bit.
    states = [SlotSamplingState(temperature=0.0), SlotSamplingState(**{"temperature": 0.0, **extra})]
    logits = torch.stack([step_logits(1, 0), step_logits(2, 0)]).bfloat16()
    logits[0, 5] = logits[0, 9] = logits[0].max() + 1  # a tie, as bf16 makes them: the first wins
    got = Sampler(VOCAB, seed=0)(logits, SamplingMetadata.build(states, VOCAB))
    want = Sampler(VOCAB, seed=0)(logits.float(), SamplingMetadata.build(states, VOCAB))
    assert got.token_ids[0] == 5
    for a, b in zip(
        (got.token_ids, got.logprobs, got.ranks, got.top_ids, got.top_logprobs),
        (want.token_ids, want.logprobs, want.ranks, want.top_ids, want.top_logprobs),
        strict=True,
    ):
        assert a.dtype == b.dtype and torch.equal(a, b)
