"""Configuration of the scheduler core: one instance per worker pool."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pagedserve.speculative import SpeculativeConfig


@dataclass(slots=True, frozen=True)
class SchedulerConfig:
    # Blocks in the worker's KV pool.
    num_blocks: int
    # Tokens per KV block.
    block_size: int = 16
    # Most sequences computed in one step (decodes and prefill chunks together).
    max_num_seqs: int = 256
    # Token budget of one step: tokens computed over the whole batch.
    max_num_batched_tokens: int = 2048
    # Longest sequence, prompt plus output, in tokens.
    max_model_len: int = 2048
    # Share cached blocks between requests through the prefix trie (whole blocks, then the start of one).
    enable_prefix_caching: bool = True
    # "fcfs": first come, first served; "priority": lower priority value first, then arrival.
    policy: Literal["fcfs", "priority"] = "fcfs"
    # Split a prompt longer than the step's remaining budget into chunks over several steps;
    # off, a prompt is computed in one step (and must fit max_num_batched_tokens).
    enable_chunked_prefill: bool = True
    # Most cache salts with cached blocks (prefix-trie roots); a new one past it evicts the least
    # recently used salt whose blocks no request holds, or runs without prefix caching if none can go.
    max_cache_salts: int = 1024
    # Speculative decoding: n-gram drafts verified by the worker in one pass; None: off.
    speculative: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        if self.num_blocks < 1 or self.block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1 or self.max_model_len < 2:
            raise ValueError("max_num_seqs, max_num_batched_tokens must be positive, max_model_len >= 2")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be at least max_num_seqs (one token each)")
        if self.max_cache_salts < 1:
            raise ValueError("max_cache_salts must be positive")
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"unknown policy {self.policy!r}")
