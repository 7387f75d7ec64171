"""One sequence as the scheduler tracks it: tokens, progress, block table, stop conditions."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedserve.v1 import common_pb2, engine_pb2
from pagedserve.validation import child_seed

from .prefix_cache import CacheNode

if TYPE_CHECKING:
    import llguidance

    from .ngram import NgramIndex
    from .structured_output import Grammar


class RequestStatus(enum.Enum):
    WAITING = enum.auto()  # not admitted yet, or preempted and waiting to come back
    RUNNING = enum.auto()  # admitted: holds blocks, scheduled step after step
    FINISHED = enum.auto()  # stopped, reached a length limit, or aborted; blocks released


@dataclass(slots=True, eq=False)
class Request:
    # Id given by the gateway; the n sequences of a request share it.
    request_id: str
    # Prompt tokens followed by the generated tokens received so far.
    token_ids: list[int]
    # Number of leading token_ids that are the prompt.
    prompt_len: int
    # Sampling parameters as the worker receives them (for a fork: seed + index).
    sampling: common_pb2.SamplingParams
    # Token ids that end the sequence unless ignore_eos (the model's end-of-sequence tokens).
    eos_token_ids: frozenset[int] = frozenset()
    # Prefix-cache partition; requests with different salts never share blocks.
    cache_salt: str = ""
    # Lower runs first under the priority policy.
    priority: int = 0
    # Wall-clock arrival, in seconds (for the engine's latency metrics).
    arrival_time: float = 0.0
    # Which of the request's n sequences this is, 0-based.
    index: int = 0
    # W3C trace context of the request's span (opaque to the core; the worker's span hangs under it).
    trace_context: dict[str, str] = field(default_factory=dict)
    # The compiled structured-output constraint; None: unconstrained.
    grammar: Grammar | None = None

    # --- set by the scheduler ---
    # Arrival order among all requests (forks share their parent's).
    arrival_seq: int = 0
    # Order of service: (priority or 0 under fcfs, arrival_seq, index); smaller first.
    sort_key: tuple[int, int, int] = (0, 0, 0)
    # Most tokens this sequence may generate: max_tokens capped by the model length, in tokens.
    max_output_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    # Leading tokens whose K/V are computed or scheduled to be by a plan already built.
    num_computed_tokens: int = 0
    # Tokens sampled by plans in flight whose ids have not come back yet (placeholders).
    num_pending_tokens: int = 0
    # Physical block of each block_size tokens; covers num_computed_tokens exactly.
    block_table: list[int] = field(default_factory=list)
    # Leading blocks the prefix cache has seen (inserted, found, or left private).
    num_cached_blocks: int = 0
    # Trie node of the last of those blocks, or the salt's root; None once caching stops.
    cache_node: CacheNode | None = None
    # Prompt tokens served by the prefix cache at first admission (for usage).
    num_cached_prompt_tokens: int = -1
    # Indices of the sequences still to fork off once the prompt but its last token is computed
    # (1..n-1 for a new request with n > 1; empty otherwise).
    pending_forks: list[int] = field(default_factory=list)
    # (sequences, tokens) it weighs in the waiting queue while it waits: its sequences (itself and its
    # forks to come), and as many times prompt_len + max_output_tokens (see Scheduler._weigh).
    queue_weight: tuple[int, int] = (0, 0)
    # Step of its latest admission if that admission hit the prefix cache, else 0.
    hit_step: int = 0
    # Step of the plan it entered the worker with since its latest admission (or fork); 0: not yet.
    entry_step: int = 0
    # Trie nodes of the blocks it cached itself since its latest admission (or fork), in order; kept once
    # it ends, for a failure reported after that (see Scheduler._drop_uncomputed).
    inserted: list[CacheNode] = field(default_factory=list)
    # Why the sequence ended; UNSPECIFIED while it runs.
    finish_reason: int = common_pb2.FINISH_REASON_UNSPECIFIED
    # The stop token id (from sampling.stop_token_ids) that ended it, when one did.
    stop_token_id: int | None = None
    # This sequence's grammar matcher (its state after every token received), when it has a grammar.
    matcher: llguidance.LLMatcher | None = None
    # Speculative decoding: the draft tokens of its step in flight (it is not scheduled again until their
    # result says how many were accepted); empty when none is.
    draft_token_ids: list[int] = field(default_factory=list)
    # Its n-gram index, made at its first lookup.
    ngram: NgramIndex | None = None
    # Step before which it gets no proposal (it backs off after drafts that were all rejected), and how
    # many of its drafts in a row were all rejected.
    spec_resume_step: int = 0
    spec_misses: int = 0
    # Block table length after its latest rollback (the worker drops the same entries), for the plan builder;
    # -1: none since its latest plan.
    rolled_back_table_len: int = -1

    # --- from sampling, as plain Python (read every step; proto field access is slow) ---
    # Tokens generated before EOS or a stop token id may end the sequence.
    min_tokens: int = field(init=False)
    # Keep generating past end-of-sequence tokens.
    ignore_eos: bool = field(init=False)
    # Token ids that end the sequence (besides EOS).
    stop_token_ids: frozenset[int] = field(init=False)
    # Whether the worker returns log-probabilities of the sampled tokens.
    wants_logprobs: bool = field(init=False)
    # Whether the worker scores every prompt token (so no prefix-cache hit may skip one).
    wants_prompt_logprobs: bool = field(init=False)

    def __post_init__(self) -> None:
        sp = self.sampling
        self.min_tokens = sp.min_tokens
        self.ignore_eos = sp.ignore_eos
        self.stop_token_ids = frozenset(sp.stop_token_ids)
        self.wants_logprobs = sp.HasField("logprobs")
        self.wants_prompt_logprobs = sp.HasField("prompt_logprobs")

    @classmethod
    def from_generate_request(
        cls, msg: engine_pb2.GenerateTokensRequest, eos_token_ids: frozenset[int], arrival_time: float
    ) -> Request:
        return cls(
            request_id=msg.request_id,
            token_ids=list(msg.prompt_token_ids),
            prompt_len=len(msg.prompt_token_ids),
            sampling=msg.sampling,
            eos_token_ids=frozenset(eos_token_ids),
            cache_salt=msg.cache_salt,
            priority=msg.priority,
            arrival_time=arrival_time,
        )

    @classmethod
    def resume(
        cls,
        msg: engine_pb2.GenerateTokensRequest,
        index: int,
        output_token_ids: list[int],
        eos_token_ids: frozenset[int],
        arrival_time: float,
    ) -> Request:
        """Sequence `index` of msg carrying on after output_token_ids (e.g. on another worker): the
        prompt stays the prompt and the outputs stay outputs, exactly like a preempted sequence, so
        seeded draws keep their positions and penalties and limits count those tokens as output."""
        return cls(
            request_id=msg.request_id,
            token_ids=[*msg.prompt_token_ids, *output_token_ids],
            prompt_len=len(msg.prompt_token_ids),
            sampling=_sequence_sampling(msg.sampling, index),
            eos_token_ids=frozenset(eos_token_ids),
            cache_salt=msg.cache_salt,
            priority=msg.priority,
            arrival_time=arrival_time,
            index=index,
        )

    @property
    def num_tokens(self) -> int:
        """Known tokens plus pending placeholders."""
        return len(self.token_ids) + self.num_pending_tokens

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens received so far."""
        return len(self.token_ids) - self.prompt_len

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def can_sample(self) -> bool:
        """Whether one more sample (counting pending ones) stays within max_output_tokens."""
        return len(self.token_ids) + self.num_pending_tokens - self.prompt_len < self.max_output_tokens

    def check_stop(self, token_id: int) -> int:
        """Finish reason after token_id was appended, UNSPECIFIED to go on."""
        num_out = len(self.token_ids) - self.prompt_len
        if num_out >= self.min_tokens:
            if not self.ignore_eos and token_id in self.eos_token_ids:
                return common_pb2.FINISH_REASON_STOP
            if token_id in self.stop_token_ids:
                self.stop_token_id = token_id
                return common_pb2.FINISH_REASON_STOP
        if num_out >= self.max_output_tokens:
            return common_pb2.FINISH_REASON_LENGTH
        return common_pb2.FINISH_REASON_UNSPECIFIED

    def fork(self, index: int) -> Request:
        """Sequence `index` of this request: same tokens and progress, its own seed; the caller
        shares the blocks (KVCacheManager.fork)."""
        assert self.num_output_tokens == 0 and self.num_pending_tokens == 0
        return Request(
            request_id=self.request_id,
            token_ids=list(self.token_ids),
            prompt_len=self.prompt_len,
            sampling=_sequence_sampling(self.sampling, index - self.index),
            eos_token_ids=self.eos_token_ids,
            cache_salt=self.cache_salt,
            priority=self.priority,
            arrival_time=self.arrival_time,
            index=index,
            trace_context=self.trace_context,
            grammar=self.grammar,
            matcher=None if self.matcher is None else self.matcher.deep_copy(),
            arrival_seq=self.arrival_seq,
            sort_key=(self.sort_key[0], self.sort_key[1], index),
            max_output_tokens=self.max_output_tokens,
            status=self.status,
            num_computed_tokens=self.num_computed_tokens,
            num_cached_blocks=self.num_cached_blocks,
            cache_node=self.cache_node,
            num_cached_prompt_tokens=self.num_cached_prompt_tokens,
            hit_step=self.hit_step,
        )


def _sequence_sampling(sampling: common_pb2.SamplingParams, offset: int) -> common_pb2.SamplingParams:
    """The sampling parameters of one sequence, `offset` sequences after the one `sampling` belongs
    to: a single sequence (n = 1) whose seed, when there is one, is offset by as much."""
    sequence = common_pb2.SamplingParams()
    sequence.CopyFrom(sampling)
    sequence.n = 1
    if sequence.HasField("seed"):
        sequence.seed = child_seed(sampling.seed, offset)
    return sequence
