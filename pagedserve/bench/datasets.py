"""Synthetic request sets for `bench serve`, exact in tokens of the model's tokenizer.

Prompts are random token ids decoded to text. Decoding and re-encoding does not round-trip (merges
across token boundaries, partial UTF-8 bytes), so each prompt is re-encoded and adjusted until the text
encodes to exactly the wanted number of tokens (`_fit_text`).

    random             input/output lengths drawn uniformly from len*(1-r) .. len*(1+r)
    prefix-repetition  num_prefixes shared prefixes of prefix_len tokens, each prompt = prefix + own suffix
    chat               lognormal prompt and output lengths, like a chat service's traffic (ChatLengths)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

DATASETS = ("random", "prefix-repetition", "chat")
_FIT_TRIES = 20  # re-encode/adjust rounds before drawing fresh random tokens
_FRESH_DRAWS = 10  # fresh draws before giving up on an exact length


@dataclass(slots=True)
class SampleRequest:
    prompt: str | list[int]  # the prompt text, or its token ids (--prompt-as-token-ids)
    prompt_len: int  # tokens in the prompt, without special tokens (the tokenizer's count)
    output_len: int  # tokens to generate: sent as max_tokens with ignore_eos


@dataclass(slots=True, frozen=True)
class ChatLengths:
    """Lognormal lengths: median = exp(mu), sigma = the log's standard deviation, then clipped.

    The defaults give a chat-like mix: most prompts a few hundred tokens with a long tail of pasted
    documents (p90 about 1000), most answers 100-300 tokens (p90 about 500).
    """

    input_median: int = 256  # tokens; median of the prompt length
    input_sigma: float = 1.0  # log-space standard deviation of the prompt length
    input_min: int = 8  # prompts are clipped to input_min .. input_max tokens
    input_max: int = 4096
    output_median: int = 192  # tokens; median of the output length
    output_sigma: float = 0.8  # log-space standard deviation of the output length
    output_min: int = 8  # outputs are clipped to output_min .. output_max tokens
    output_max: int = 1024


class PromptMaker:
    """Random-token text of an exact token length, optionally after a fixed head text."""

    def __init__(self, tokenizer: Any, rng: np.random.Generator):
        self.tokenizer = tokenizer
        self.rng = rng
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        # NOTE: special tokens are left out: servers may strip or refuse them, and they re-encode
        # differently (or not at all) once decoded to text.
        self.vocab = np.array([i for i in range(len(tokenizer)) if i not in special], dtype=np.int64)
        self.misses = 0  # prompts whose length could not be made exact (kept at their real length)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def random_ids(self, n: int) -> list[int]:
        return self.rng.choice(self.vocab, size=n).tolist()

    def text(self, length: int, head: str = "", head_ids: list[int] | None = None) -> tuple[str, list[int]]:
        """head + random text that encodes to exactly `length` tokens, starting with head's tokens."""
        head_ids = self.encode(head) if head_ids is None else head_ids
        want = length - len(head_ids)
        assert want >= 0, f"length {length} shorter than the head's {len(head_ids)} tokens"
        best: tuple[str, list[int]] | None = None
        for _ in range(_FRESH_DRAWS):
            text, ids = _fit_text(self, head, head_ids, self.random_ids(want), length)
            if len(ids) == length and ids[: len(head_ids)] == head_ids:
                return text, ids
            if best is None or abs(len(ids) - length) < abs(len(best[1]) - length):
                best = (text, ids)
        assert best is not None
        self.misses += 1
        log.warning("prompt of %d tokens requested, got %d", length, len(best[1]))
        return best


def _fit_text(
    maker: PromptMaker, head: str, head_ids: list[int], tail: list[int], length: int
) -> tuple[str, list[int]]:
    # Decode, re-encode, then cut or extend the tail to the wanted length and try again; this
    # converges in a round or two for BPE tokenizers (vLLM's gen_prompt_decode_to_target_len does the same).
    text, ids = head, head_ids
    for _ in range(_FIT_TRIES):
        text = head + maker.decode(tail)
        ids = maker.encode(text)
        if len(ids) == length and ids[: len(head_ids)] == head_ids:
            break
        tail = ids[len(head_ids) :] if ids[: len(head_ids)] == head_ids else tail[1:] + maker.random_ids(1)
        want = length - len(head_ids)
        tail = tail[:want] + maker.random_ids(max(0, want - len(tail)))
    return text, ids


def _as_request(text: str, ids: list[int], output_len: int, as_token_ids: bool) -> SampleRequest:
    return SampleRequest(
        prompt=list(ids) if as_token_ids else text, prompt_len=len(ids), output_len=output_len
    )


def sample_random(
    tokenizer: Any,
    num_requests: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    seed: int = 0,
    as_token_ids: bool = False,
) -> list[SampleRequest]:
    assert 0.0 <= range_ratio < 1.0, "range ratio must be in [0, 1)"
    rng = np.random.default_rng(seed)
    maker = PromptMaker(tokenizer, rng)
    inputs = _uniform_lengths(rng, input_len, range_ratio, num_requests)
    outputs = _uniform_lengths(rng, output_len, range_ratio, num_requests, low=1)
    requests = []
    for n_in, n_out in zip(inputs, outputs, strict=True):
        text, ids = maker.text(int(n_in))
        requests.append(_as_request(text, ids, int(n_out), as_token_ids))
    return requests


def _uniform_lengths(rng: np.random.Generator, length: int, ratio: float, n: int, low: int = 0) -> np.ndarray:
    lo, hi = max(low, int(length * (1 - ratio))), max(low, int(length * (1 + ratio)))
    return rng.integers(lo, hi + 1, size=n)


def sample_prefix_repetition(
    tokenizer: Any,
    num_requests: int,
    prefix_len: int,
    suffix_len: int,
    num_prefixes: int,
    output_len: int,
    seed: int = 0,
    as_token_ids: bool = False,
) -> list[SampleRequest]:
    """num_requests prompts spread evenly over num_prefixes prefixes, shuffled so prefixes interleave.

    Every prompt encodes to prefix_len + suffix_len tokens whose first prefix_len are its prefix's
    tokens, so a prefix cache can serve them.
    """
    assert num_prefixes >= 1
    rng = np.random.default_rng(seed)
    maker = PromptMaker(tokenizer, rng)
    prefixes = [maker.text(prefix_len) for _ in range(num_prefixes)]
    requests = []
    for i in range(num_requests):
        prefix_text, prefix_ids = prefixes[i % num_prefixes]
        text, ids = maker.text(prefix_len + suffix_len, head=prefix_text, head_ids=prefix_ids)
        requests.append(_as_request(text, ids, output_len, as_token_ids))
    order = rng.permutation(num_requests)
    return [requests[i] for i in order]


def sample_chat(
    tokenizer: Any,
    num_requests: int,
    lengths: ChatLengths | None = None,
    seed: int = 0,
    as_token_ids: bool = False,
) -> list[SampleRequest]:
    lengths = lengths or ChatLengths()
    rng = np.random.default_rng(seed)
    maker = PromptMaker(tokenizer, rng)
    inputs = _lognormal(rng, lengths.input_median, lengths.input_sigma, num_requests)
    outputs = _lognormal(rng, lengths.output_median, lengths.output_sigma, num_requests)
    inputs = np.clip(inputs, lengths.input_min, lengths.input_max)
    outputs = np.clip(outputs, lengths.output_min, lengths.output_max)
    requests = []
    for n_in, n_out in zip(inputs, outputs, strict=True):
        text, ids = maker.text(int(n_in))
        requests.append(_as_request(text, ids, int(n_out), as_token_ids))
    return requests


def _lognormal(rng: np.random.Generator, median: int, sigma: float, n: int) -> np.ndarray:
    return np.rint(rng.lognormal(mean=np.log(median), sigma=sigma, size=n)).astype(np.int64)
