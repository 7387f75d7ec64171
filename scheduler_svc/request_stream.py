"""A client request's stream: the queue its messages go through, and what its client has been sent.

What the client has been sent is what makes failover exact: when a worker's stream breaks, each
unfinished sequence goes back to the router with exactly those tokens as its output so far (with its
index and child seed) and is recomputed on a surviving worker, so the client sees no lost or repeated
token and seeded draws stay the same.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from opentelemetry import trace

from pagedserve.scheduler_svc.request import Request
from pagedserve.tracing import inject_metadata
from pagedserve.v1 import common_pb2, engine_pb2

if TYPE_CHECKING:
    from pagedserve.scheduler_svc.structured_output import Grammar
    from pagedserve.scheduler_svc.worker_loop import WorkerEngine

# Sentinel that ends a RequestStream's queue.
END = None


@dataclass(slots=True)
class SequenceProgress:
    # Tokens the client has been sent for this sequence, in order.
    token_ids: list[int] = field(default_factory=list)
    # FINISH_REASON_UNSPECIFIED while it runs.
    finish_reason: int = common_pb2.FINISH_REASON_UNSPECIFIED
    # Monotonic seconds of the first and of the latest token (None before the first).
    first_token_time: float | None = None
    last_token_time: float | None = None


class RequestStream:
    """One Generate call: the queue its messages go through, and what its client has seen."""

    def __init__(self, msg: engine_pb2.GenerateTokensRequest, span=None, grammar: Grammar | None = None):
        self.request_id = msg.request_id
        self.msg = msg
        # Its compiled structured-output constraint (each sequence gets a matcher of it); None: unconstrained.
        self.grammar = grammar
        self.n = max(1, msg.sampling.n)
        # Wall-clock arrival (the core's unit) and monotonic arrival (for latencies).
        self.arrival_time = time.time()
        self.arrival = time.monotonic()
        self.sequences = [SequenceProgress() for _ in range(self.n)]
        # GenerateTokensResponse messages, then END; or a PagedServeError.
        self.queue: asyncio.Queue = asyncio.Queue()
        # The worker computing it; None while it waits for one.
        self.worker: WorkerEngine | None = None
        # Prompt tokens served from the prefix cache at the first admission (-1: not known yet).
        self.cached_prompt_tokens = -1
        # Monotonic seconds it was first scheduled (None: still queued).
        self.first_scheduled: float | None = None
        self.done = False
        self.span = span
        # The span's W3C trace context, handed to the worker with each of its sequences (empty when
        # tracing is off).
        self.trace_context = (
            dict(inject_metadata(trace.set_span_in_context(span))) if span is not None else {}
        )
        # Cancels the wait for a worker when none is healthy.
        self.wait_timer: asyncio.TimerHandle | None = None
        # Prompt log-probabilities received and not sent yet; sent once on the first message.
        self.prompt_logprobs: list[common_pb2.TokenLogprob] = []
        self.prompt_logprobs_sent = False
        # Worker failures it was in a step in flight for (each requeued it), and what the last one was.
        self.num_failures = 0
        self.last_failure = ""

    @property
    def num_unfinished(self) -> int:
        return sum(1 for s in self.sequences if s.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED)

    def usage(self) -> common_pb2.Usage:
        return common_pb2.Usage(
            prompt_tokens=len(self.msg.prompt_token_ids),
            completion_tokens=sum(len(s.token_ids) for s in self.sequences),
            cached_prompt_tokens=max(0, self.cached_prompt_tokens),
        )

    def is_fresh(self) -> bool:
        """Whether its client has seen nothing yet (it goes to a worker as one request of n sequences)."""
        return all(not s.token_ids for s in self.sequences) and self.num_unfinished == self.n

    def weight(self, max_model_len: int) -> tuple[int, int]:
        """(sequences, tokens) it weighs in the waiting queue: its unfinished sequences, and as many times
        its prompt plus max_tokens (the room left under max_model_len when unset)."""
        prompt_len = len(self.msg.prompt_token_ids)
        sp = self.msg.sampling
        longest = prompt_len + sp.max_tokens if sp.HasField("max_tokens") else max_model_len
        seqs = self.num_unfinished
        return seqs, seqs * longest

    def core_requests(self, eos_token_ids: frozenset[int]) -> list[Request]:
        """What is left of this stream, for a worker's core: the whole request while its client has
        seen nothing, else each unfinished sequence on its own, carrying on after the tokens already
        streamed (its outputs stay outputs, its seed stays the child seed: after a worker failure it
        continues exactly as it would have, seeded draws and penalties included)."""
        if self.is_fresh():
            requests = [Request.from_generate_request(self.msg, eos_token_ids, self.arrival_time)]
        else:
            requests = [
                Request.resume(self.msg, index, seq.token_ids, eos_token_ids, self.arrival_time)
                for index, seq in enumerate(self.sequences)
                if seq.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED
            ]
        for request in requests:
            request.trace_context = self.trace_context
            request.grammar = self.grammar
        return requests
