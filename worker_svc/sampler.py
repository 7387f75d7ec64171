"""Token sampling for a batch of requests: token masks, logit bias, penalties, temperature, min-p, top-k, top-p.

Order of operations (as vLLM v1): raw log-probabilities are taken from the model's logits first;
then structured outputs' token masks, logit bias, then penalties; greedy rows take the argmax there; the other rows are scaled by
their temperature, filtered by min-p, top-k and top-p, and sampled by the exponential race
(argmax of probs / q with q ~ Exp(1), equivalent to Gumbel-max).

Everything is vectorised over the batch; the only per-row Python work is the random draw of rows
that carry a seed. A seeded row's draw for output position k comes from a generator seeded by a mix
of (seed, k), so it depends neither on the rest of the batch nor on preemptions (recompute).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from pagedserve.kernels import get_ops
from pagedserve.kernels.reference import mask_tokens
from pagedserve.v1 import common_pb2

# Temperatures below this are greedy (as vLLM's _SAMPLING_EPS).
GREEDY_TEMPERATURE = 1e-5

_MASK64 = (1 << 64) - 1
_GOLDEN_GAMMA = 0x9E3779B97F4A7C15


def mix_seed(seed: int, position: int) -> int:
    """splitmix64 of seed ^ position * golden ratio: the generator seed of one seeded draw."""
    z = (seed ^ (position * _GOLDEN_GAMMA)) & _MASK64
    z = (z + _GOLDEN_GAMMA) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


@dataclass(slots=True)
class SlotSamplingState:
    """Sampling parameters and token history of one live request (one slot) on the worker."""

    temperature: float = 1.0  # 0 (below GREEDY_TEMPERATURE) = greedy
    top_p: float = 1.0  # in (0, 1]; 1 = off
    top_k: int = 0  # <= 0 = off
    min_p: float = 0.0  # in [0, 1]; 0 = off
    seed: int | None = None  # None = draws from the sampler's own generator
    presence_penalty: float = 0.0  # subtracted once from every token present in the output
    frequency_penalty: float = 0.0  # subtracted once per occurrence in the output
    repetition_penalty: float = 1.0  # > 0; divides positive / multiplies negative logits of seen tokens
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    logprobs: int | None = None  # alternatives to return per sampled token; None = no logprobs asked
    prompt_logprobs: int | None = None  # alternatives per prompt token; None = no prompt logprobs
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)  # generated so far, appended per step

    @classmethod
    def from_proto(
        cls,
        params: common_pb2.SamplingParams,
        prompt_token_ids: Sequence[int],
        seed_override: int | None = None,
        output_token_ids: Sequence[int] = (),
    ) -> SlotSamplingState:
        """Unset optional fields take the OpenAI defaults. `seed_override` replaces the request's
        seed (e.g. a distinct seed per fork of an n > 1 request); `output_token_ids` are the tokens
        already generated (a request coming back after preemption, or a fork)."""
        has = params.HasField
        seed = seed_override if seed_override is not None else (params.seed if has("seed") else None)
        return cls(
            temperature=params.temperature if has("temperature") else 1.0,
            top_p=params.top_p if has("top_p") else 1.0,
            top_k=max(params.top_k, 0),
            min_p=params.min_p,
            seed=seed,
            presence_penalty=params.presence_penalty,
            frequency_penalty=params.frequency_penalty,
            repetition_penalty=params.repetition_penalty if has("repetition_penalty") else 1.0,
            logit_bias={int(t): float(v) for t, v in params.logit_bias.items()},
            logprobs=params.logprobs if has("logprobs") else None,
            prompt_logprobs=params.prompt_logprobs if has("prompt_logprobs") else None,
            prompt_token_ids=list(prompt_token_ids),
            output_token_ids=list(output_token_ids),
        )

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def argmax_only(self) -> bool:
        """Greedy, with no penalty, no logit bias and no logprobs: its token is the argmax of its logits."""
        return self.greedy and not self.has_penalties and not self.logit_bias and self.logprobs is None

    def append_output(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)


@dataclass(slots=True)
class SamplingMetadata:
    """The batch's sampling parameters as tensors, built once per step. Tensors that no row needs are
    None, so an all-greedy batch without penalties or bias costs one argmax."""

    num_rows: int  # B, rows of the logits
    greedy: torch.Tensor | None  # bool [B], True = argmax; None when no row is greedy (all random)
    temperature: torch.Tensor | None  # float32 [B] (1 on greedy rows); None when all greedy
    top_p: torch.Tensor | None  # float32 [B] (1 = off); None when no random row filters by top-p
    top_k: torch.Tensor | None  # int64 [B] (vocab_size = off); None when no random row filters by top-k
    max_top_k: int  # largest top_k among the rows that filter by it (0 when none does)
    min_p: torch.Tensor | None  # float32 [B] (0 = off); None when no random row filters by min-p
    presence_penalty: torch.Tensor | None  # float32 [B]; None when no row has any penalty
    frequency_penalty: torch.Tensor | None  # float32 [B]; None when no row has any penalty
    repetition_penalty: torch.Tensor | None  # float32 [B]; None when no row has any penalty
    prompt_token_ids: torch.Tensor | None  # int64 [B, Lp] padded with vocab_size; None: no repetition
    output_token_ids: torch.Tensor | None  # int64 [B, Lo] padded with vocab_size; None = no penalties
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # (row, token) int64, value float32
    unseeded_rows: torch.Tensor | None  # int64 [R]: random rows drawing from the sampler's generator
    seeded_rows: list[int]  # random rows with a seed
    seeds: list[int]  # their seeds, parallel to seeded_rows
    output_positions: list[int]  # their output position k (tokens generated before this one)
    max_num_logprobs: int  # K: top alternatives returned per row (rows asking fewer use a prefix)
    any_logprobs: bool = True  # some row asked for logprobs (0 included); else none are computed
    # Structured outputs: (rows int64 [R], masks int32 [R, ceil(V / 32)]): row rows[i] may sample token t only
    # when bit t % 32 of masks[i, t // 32] is set; rows None: every row, in order. None: no row is constrained.
    token_mask: tuple[torch.Tensor | None, torch.Tensor] | None = None

    @property
    def all_greedy(self) -> bool:
        return self.temperature is None

    @property
    def all_random(self) -> bool:
        return self.temperature is not None and self.greedy is None

    @property
    def no_penalties(self) -> bool:
        return self.output_token_ids is None

    @property
    def _greedy_alone(self) -> bool:
        """Greedy rows with no penalty, no logit bias and no logprobs."""
        return self.all_greedy and self.no_penalties and self.logit_bias is None and not self.any_logprobs

    @property
    def argmax_only(self) -> bool:
        """Every row's token is the argmax of its logits (see SlotSamplingState.argmax_only)."""
        return self._greedy_alone and self.token_mask is None

    @property
    def masked_argmax_only(self) -> bool:
        """Every row's token is the argmax of its logits under its token mask, if it has one."""
        return self._greedy_alone and self.token_mask is not None

    @property
    def no_top_k(self) -> bool:
        return self.top_k is None

    @property
    def no_top_p(self) -> bool:
        return self.top_p is None

    @property
    def no_min_p(self) -> bool:
        return self.min_p is None

    @classmethod
    def build(
        cls, states: Sequence[SlotSamplingState], vocab_size: int, device: torch.device | str = "cpu"
    ) -> SamplingMetadata:
        assert states, "a sampling batch needs at least one row"
        if all(s.argmax_only for s in states):
            # NOTE: the common case, built without the general path's passes over the rows: it runs
            # after every forward pass, with the caches full of the weights.
            return cls.argmax_rows(len(states))
        device = torch.device(device)

        def floats(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32).to(device, non_blocking=True)

        def ints(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64).to(device, non_blocking=True)

        greedy = [s.greedy for s in states]
        any_greedy, all_greedy = any(greedy), all(greedy)

        temperature = top_p = top_k = min_p = unseeded_rows = None
        max_top_k = 0
        seeded_rows: list[int] = []
        if not all_greedy:
            temps, top_ps, top_ks, min_ps, unseeded = [], [], [], [], []
            for row, s in enumerate(states):
                # NOTE: greedy rows get neutral values, so a temperature-0 row asking for top-p or
                # top-k does not make the whole batch pay for the filter.
                rand = not s.greedy
                temps.append(s.temperature if rand else 1.0)
                top_ps.append(s.top_p if rand else 1.0)
                top_ks.append(s.top_k if rand and 0 < s.top_k < vocab_size else vocab_size)
                min_ps.append(s.min_p if rand else 0.0)
                if rand:
                    (unseeded if s.seed is None else seeded_rows).append(row)
            temperature = floats(temps)
            top_p = floats(top_ps) if min(top_ps) < 1.0 else None
            max_top_k = max((k for k in top_ks if k < vocab_size), default=0)
            top_k = ints(top_ks) if max_top_k else None
            min_p = floats(min_ps) if max(min_ps) > 0.0 else None
            unseeded_rows = ints(unseeded) if unseeded else None

        presence = frequency = repetition = prompt_ids = output_ids = None
        if any(s.has_penalties for s in states):
            presence = floats([s.presence_penalty for s in states])
            frequency = floats([s.frequency_penalty for s in states])
            repetition = floats([s.repetition_penalty for s in states])
            # Rows without penalties contribute no ids: their masks stay empty.
            output_ids = _pad([s.output_token_ids if s.has_penalties else [] for s in states], vocab_size)
            output_ids = output_ids.to(device, non_blocking=True)
            if any(s.repetition_penalty != 1.0 for s in states):
                prompt_lists = [s.prompt_token_ids if s.repetition_penalty != 1.0 else [] for s in states]
                prompt_ids = _pad(prompt_lists, vocab_size).to(device, non_blocking=True)

        logit_bias = None
        if any(s.logit_bias for s in states):
            rows = [i for i, s in enumerate(states) for _ in s.logit_bias]
            tokens = [t for s in states for t in s.logit_bias]
            values = [v for s in states for v in s.logit_bias.values()]
            assert all(0 <= t < vocab_size for t in tokens), "logit_bias token outside the vocabulary"
            logit_bias = (ints(rows), ints(tokens), floats(values))

        greedy_mask = torch.tensor(greedy).to(device) if any_greedy and not all_greedy else None
        return cls(
            num_rows=len(states),
            greedy=greedy_mask,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            max_top_k=max_top_k,
            min_p=min_p,
            presence_penalty=presence,
            frequency_penalty=frequency,
            repetition_penalty=repetition,
            prompt_token_ids=prompt_ids,
            output_token_ids=output_ids,
            logit_bias=logit_bias,
            unseeded_rows=unseeded_rows,
            seeded_rows=seeded_rows,
            seeds=[states[i].seed for i in seeded_rows],
            output_positions=[len(states[i].output_token_ids) for i in seeded_rows],
            max_num_logprobs=max((s.logprobs or 0 for s in states), default=0),
            any_logprobs=any(s.logprobs is not None for s in states),
        )

    @classmethod
    def argmax_rows(cls, num_rows: int) -> SamplingMetadata:
        """The metadata of num_rows argmax_only rows: no tensors, one argmax."""
        return cls(
            num_rows=num_rows,
            greedy=None,
            temperature=None,
            top_p=None,
            top_k=None,
            max_top_k=0,
            min_p=None,
            presence_penalty=None,
            frequency_penalty=None,
            repetition_penalty=None,
            prompt_token_ids=None,
            output_token_ids=None,
            logit_bias=None,
            unseeded_rows=None,
            seeded_rows=[],
            seeds=[],
            output_positions=[],
            max_num_logprobs=0,
            any_logprobs=False,
        )


def _pad(rows: list[list[int]], pad: int) -> torch.Tensor:
    width = max(len(r) for r in rows)
    return torch.tensor([r + [pad] * (width - len(r)) for r in rows], dtype=torch.int64)


@dataclass(slots=True)
class TokenLogprobs:
    """Log-probabilities of given tokens under the raw log_softmax of the logits, with the top-K."""

    logprobs: torch.Tensor  # float32 [N], of the given token
    ranks: torch.Tensor  # int64 [N], 1-based: 1 + number of tokens strictly more likely
    top_ids: torch.Tensor  # int64 [N, K], most likely first
    top_logprobs: torch.Tensor  # float32 [N, K]


def compute_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> TokenLogprobs:
    """Logprob, rank and top-`num_top` of token_ids[i] in row i of logits [N, V]. Serves sampled
    tokens and prompt logprobs alike (for prompts, row i is position i's logits and token_ids[i]
    the prompt token that follows it)."""
    assert logits.dim() == 2 and token_ids.shape == (logits.shape[0],)
    logits = logits.float()
    # NOTE: torch splits a row's reduction among threads when the rows are few, so a float32 logsumexp's
    # bits depend on how many rows the step holds; summed in float64, the float32 result is the same in any
    # batch (batch invariance, --deterministic) and closer to the exact value.
    lse = torch.logsumexp(logits.double(), dim=-1, keepdim=True)
    chosen = logits.gather(1, token_ids.view(-1, 1))
    ranks = (logits > chosen).sum(dim=-1) + 1
    if num_top > 0:
        top_values, top_ids = logits.topk(min(num_top, logits.shape[1]), dim=-1)
        top_logprobs = (top_values - lse).float()
    else:
        top_ids = logits.new_empty((logits.shape[0], 0), dtype=torch.int64)
        top_logprobs = logits.new_empty((logits.shape[0], 0))
    return TokenLogprobs((chosen - lse).float().squeeze(1), ranks, top_ids, top_logprobs)


@dataclass(slots=True)
class SamplerOutput:
    token_ids: torch.Tensor  # int64 [B], the sampled tokens
    # The rest is empty ([0], [0, 0]) when no row asked for logprobs (meta.any_logprobs is False).
    logprobs: torch.Tensor  # float32 [B], raw log_softmax (before bias, penalties, temperature) at token
    ranks: torch.Tensor  # int64 [B], 1-based rank of the token in the raw logits
    top_ids: torch.Tensor  # int64 [B, K], K = max requested logprobs; rows asking fewer use a prefix
    top_logprobs: torch.Tensor  # float32 [B, K]


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device | str = "cpu", seed: int | None = None):
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        ops = get_ops(self.device)
        self.argmax = ops.argmax  # torch.argmax over rows, the CPU kernels' faster
        self.masked_argmax = ops.masked_argmax
        # What a step without logprobs returns beside its tokens (see SamplerOutput), made once.
        empty = torch.empty(0, dtype=torch.float32, device=self.device)  # the logprobs' dtype
        self._no_logprobs = (empty, empty.long(), empty.long().view(0, 0), empty.view(0, 0))
        # Draws of rows without a seed.
        self.generator = torch.Generator(device=self.device)
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        assert logits.shape == (meta.num_rows, self.vocab_size)
        # NOTE: logits come in the model's dtype. An argmax-only batch takes its argmax from them as they are
        # (that of their float32 widening, which is exact), sparing a float32 copy of the logits every step;
        # the rest works in float32.
        if meta.masked_argmax_only:
            # NOTE: greedy rows under token masks and nothing else: the masks are applied in the argmax's own
            # pass over the logits, without the float32 copy the general path makes.
            rows, words = meta.token_mask
            return SamplerOutput(self.masked_argmax(logits, words, rows), *self._no_logprobs)
        # NOTE: every step below is out of place: the raw logits serve the logprobs at the end. A token mask
        # makes the float32 copy itself.
        x = apply_token_mask(logits, meta)
        if not meta.argmax_only and x.dtype != torch.float32:
            x = x.float()
        x = apply_logit_bias(x, meta)
        x = apply_penalties(x, meta)
        if meta.all_greedy:
            token_ids = self.argmax(x)
        else:
            token_ids = self._sample(x, meta)
            if meta.greedy is not None:
                token_ids = torch.where(meta.greedy, self.argmax(x), token_ids)
        if not meta.any_logprobs:
            # NOTE: the log_softmax, rank and top-K passes over [B, vocab] cost as much as the sampling
            # itself, for results nobody reads.
            return SamplerOutput(token_ids, *self._no_logprobs)
        lp = compute_logprobs(logits, token_ids, meta.max_num_logprobs)
        return SamplerOutput(token_ids, lp.logprobs, lp.ranks, lp.top_ids, lp.top_logprobs)

    def _sample(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        assert meta.temperature is not None
        x = logits / meta.temperature.unsqueeze(1)
        x = apply_min_p(x, meta)
        x = apply_top_k_top_p(x, meta)
        probs = torch.softmax(x, dim=-1)
        # Greedy rows keep q = 1 (their sample is replaced by the argmax anyway).
        q = torch.ones_like(probs)
        if meta.unseeded_rows is not None:
            draws = torch.empty(
                (meta.unseeded_rows.numel(), self.vocab_size), dtype=probs.dtype, device=probs.device
            )
            q[meta.unseeded_rows] = draws.exponential_(generator=self.generator)
        for row, seed, position in zip(meta.seeded_rows, meta.seeds, meta.output_positions, strict=True):
            generator = torch.Generator(device=probs.device).manual_seed(mix_seed(seed, position))
            q[row].exponential_(generator=generator)
        # NOTE: exponential_ may return 0; 0/0 on a filtered-out token would be NaN and win the argmax.
        q.clamp_(min=torch.finfo(q.dtype).tiny)
        return self.argmax(probs / q)


def apply_token_mask(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Structured outputs: a float32 copy of the logits with -inf on the tokens a constrained row's mask leaves
    out (before bias and penalties, which cannot bring a token back)."""
    if meta.token_mask is None:
        return logits
    rows, words = meta.token_mask
    return mask_tokens(logits, words, rows)


def apply_logit_bias(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    if meta.logit_bias is None:
        return logits
    rows, tokens, values = meta.logit_bias
    return logits.index_put((rows, tokens), values, accumulate=True)


def _token_counts(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, L] ids padded with vocab_size -> [B, V] counts (the pad lands in a dropped last column)."""
    counts = torch.zeros((token_ids.shape[0], vocab_size + 1), dtype=torch.int32, device=token_ids.device)
    counts.scatter_add_(1, token_ids, torch.ones_like(token_ids, dtype=torch.int32))
    return counts[:, :vocab_size]


def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Repetition over prompt and output tokens, then frequency and presence over output tokens."""
    if meta.no_penalties:
        return logits
    assert meta.output_token_ids is not None and meta.repetition_penalty is not None
    vocab_size = logits.shape[1]
    output_counts = _token_counts(meta.output_token_ids, vocab_size)
    output_mask = output_counts > 0
    if meta.prompt_token_ids is not None:
        seen = output_mask | (_token_counts(meta.prompt_token_ids, vocab_size) > 0)
        penalty = torch.where(seen, meta.repetition_penalty.unsqueeze(1), 1.0)
        logits = torch.where(logits > 0, logits / penalty, logits * penalty)
    logits = logits - meta.frequency_penalty.unsqueeze(1) * output_counts
    return logits - meta.presence_penalty.unsqueeze(1) * output_mask


def apply_min_p(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Drops tokens whose probability is below min_p times the most likely token's."""
    if meta.min_p is None:
        return logits
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * meta.min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """top-k keeps the k largest logits (and ties with the k-th); top-p then keeps the smallest set
    of the remaining tokens whose probability sums to at least p, always at least the top token."""
    if meta.top_p is None:
        if meta.top_k is None:
            return logits
        # No top-p: a partial top-k instead of a full sort; rows with top-k off keep everything.
        top_values = logits.topk(meta.max_top_k, dim=-1).values
        kth = top_values.gather(1, (meta.top_k.clamp(max=meta.max_top_k) - 1).unsqueeze(1))
        kth = kth.masked_fill((meta.top_k >= logits.shape[1]).unsqueeze(1), float("-inf"))
        return logits.masked_fill(logits < kth, float("-inf"))

    sorted_logits, order = logits.sort(dim=-1)  # ascending
    vocab_size = logits.shape[1]
    if meta.top_k is not None:
        kth = sorted_logits.gather(1, (vocab_size - meta.top_k).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    # Ascending cumulative mass: a token goes when the tokens up to it hold at most 1 - p, i.e. the
    # more likely ones already hold at least p.
    cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
    drop = cumulative <= 1.0 - meta.top_p.unsqueeze(1)
    drop[:, -1] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
