"""Continuous batching over one worker pool: which requests compute how many tokens each step.

Token-centric, like vLLM v1: a request's num_computed_tokens catches up with its token count, so
prefill chunks, prefix hits, decodes and recomputation after preemption are the same thing. Running
requests go first, in service order, then waiting ones; when blocks run out the last running
request (lowest priority, latest arrival) is preempted by recomputation.

Pipelining: schedule() may run again before the previous step's update_from_output(). A request
that samples at a step gets a pending placeholder token, so the next step can compute it (the
worker feeds each decode its own last sample) before its id is known here. Not so a request under a
structured-output constraint: its next mask depends on the token in flight, so it is scheduled again
only once that token has come back and advanced its matcher (the rest of the batch keeps pipelining).

Speculative decoding (config.speculative): a decoding sequence whose tokens end in an n-gram seen earlier in
them gets draft tokens (what followed there) and computes 1 + k positions in one step; the worker accepts the
drafts its own sampling agrees with. Until that result comes back the sequence is not scheduled again, since
how many tokens it will have is unknown (a sequence with drafts is not pipelined; the rest of the batch is).
A sequence whose last token is still in flight proposes from the tokens before it, skipping the
continuation's first token (its guess of the token in flight): the worker verifies the drafts after the real
token, so a wrong guess costs only their rejection. The result rolls the rest back: the computed tokens stop
after the accepted drafts, block table entries past them are freed, and only accepted tokens reach the
prefix cache (it takes full blocks of known tokens only). Drafts that are all rejected make the sequence wait
2, 4, ... 64 steps before its next proposal.

No request can take the others down: an exception in one request's part of a step (its admission,
its fork, its bookkeeping when a result comes in) fails that request alone, its blocks freed, and the
step goes on; so does a request the worker refuses. The caller collects them with take_failures().
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from pagedserve import finish_reasons
from pagedserve.v1 import common_pb2, worker_pb2

from .config import SchedulerConfig
from .kv_cache_manager import CowCopy, KVCacheManager, PrefixHit
from .ngram import NgramIndex
from .request import Request, RequestStatus
from .structured_output import MaskFiller, matcher_error


@dataclass(slots=True)
class SchedulerOutput:
    # Step id of the plan built from this output: 1, 2, ... one per schedule() call.
    step_id: int
    # The batch, in plan order (each request at most once).
    scheduled: list[Request]
    # Tokens each scheduled request computes this step, parallel to scheduled (each > 0).
    num_scheduled_tokens: list[int]
    # Scheduled requests that sample a token at this step (all their tokens computed), in plan
    # order; StepResult.sampled_* are parallel to it.
    sampled: list[Request]
    # Copy-on-write operations, in order: shared block -> fresh block replacing a table entry.
    cow_copies: list[CowCopy]
    # Requests that finished or were aborted since the previous step: their slots are freed.
    finished: list[Request]
    # Requests preempted since the previous step (this one included): their slots are freed.
    preempted: list[Request]
    # Sum of num_scheduled_tokens, in tokens.
    total_num_scheduled_tokens: int
    # Sampled requests under a structured-output constraint, in plan order.
    masked: list[Request] = field(default_factory=list)
    # Their token masks: int32 [len(masked), ceil(vocab_size / 32)], llguidance's packed bits; None if none.
    token_masks: np.ndarray | None = None
    # Sampled requests that verify draft tokens, with their drafts, in plan order.
    drafts: list[tuple[Request, list[int]]] = field(default_factory=list)
    # > 0: the worker proposes those drafts with its model's first layers (placeholders in `drafts` until then).
    num_draft_layers: int = 0


@dataclass(slots=True)
class RequestOutput:
    # Id of the request.
    request_id: str
    # Which of its n sequences, 0-based.
    index: int
    # Token ids received for this sequence in this update (empty for an abort).
    new_token_ids: list[int]
    # Log-probabilities of new_token_ids when the request asked for them, else None.
    logprobs: list[common_pb2.TokenLogprob] | None
    # common_pb2.FinishReason; FINISH_REASON_UNSPECIFIED while the sequence goes on.
    finish_reason: int
    # The stop token id (from stop_token_ids) that ended the sequence, when one did.
    stop_token_id: int | None
    # Prompt length, in tokens.
    num_prompt_tokens: int
    # Tokens this sequence generated so far, in tokens.
    num_output_tokens: int
    # Prompt tokens served by the prefix cache at first admission, in tokens.
    num_cached_tokens: int

    @property
    def finished(self) -> bool:
        return self.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED


@dataclass(slots=True)
class RequestFailure:
    # Id of the request that failed (every one of its sequences has ended here).
    request_id: str
    # What went wrong, naming the request.
    message: str
    # Not failed but taken off this core: it may have read K/V that a failed request was to compute and
    # never did, so the caller recomputes it (as after a worker failure: from what its client has seen).
    retry: bool = False


@dataclass(slots=True)
class SchedulerStats:
    # Sequences admitted (holding blocks), and waiting for blocks or a batch place.
    num_running: int
    num_waiting: int
    # Blocks in the pool; held by requests (reference count > 0); cached and held by none.
    num_blocks: int
    num_blocks_in_use: int
    num_cached_free_blocks: int
    # num_blocks_in_use / num_blocks, 0 to 1.
    kv_cache_usage: float
    # Tokens looked up in the prefix cache at admission, and of those, found; ever.
    prefix_cache_queries: int
    prefix_cache_hits: int
    # Preemptions, ever.
    num_preemptions: int
    # Prompt tokens computed (recomputation included), and tokens generated; ever.
    prompt_tokens: int
    generation_tokens: int
    # Sequences finished, by finish reason name ("stop", "length", "abort"); ever.
    requests_finished: dict[str, int] = field(default_factory=dict)
    # schedule() calls, ever.
    num_steps: int = 0
    # Speculative decoding, ever: steps in which a sequence verified drafts, the draft tokens, those accepted,
    # and those accepted by position in their draft (vLLM's spec_decode_* counters).
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_num_accepted_tokens_per_pos: list[int] = field(default_factory=list)


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.kv = KVCacheManager(config)
        # Both kept sorted by Request.sort_key (service order).
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        # Live sequences of each request id.
        self._requests: dict[str, list[Request]] = {}
        self._step_id = 0
        self._num_arrivals = 0
        # Batch places promised to sequences not forked yet.
        self._num_reserved_seqs = 0
        # Parents whose prompt but its last token is scheduled: they fork at the next step.
        self._to_fork: list[Request] = []
        # Departures to report in the next SchedulerOutput.
        self._finished: list[Request] = []
        self._preempted: list[Request] = []
        self._prefix_queries = 0
        self._prefix_hits = 0
        self._num_preemptions = 0
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._finished_by_reason = {"stop": 0, "length": 0, "abort": 0}
        self._spec_drafts = 0
        self._spec_draft_tokens = 0
        self._spec_accepted = 0
        spec = config.speculative
        self._spec_accepted_per_pos = [0] * (spec.num_speculative_tokens if spec is not None else 0)
        # Requests failed since the last take_failures().
        self._failures: list[RequestFailure] = []
        # Computes the masks of constrained rows; made with the first of them.
        self._masks: MaskFiller | None = None
        # Sequences waiting (a parent counts its sequences not forked yet), and the tokens they may
        # hold at most (prompt plus max_output_tokens each): the weights of the waiting queue.
        self.num_waiting_seqs = 0
        self.num_waiting_tokens = 0

    # ------------------------------------------------------------------ requests in and out

    def add_request(self, req: Request) -> None:
        """Queue a request: a new one (its n sequences fork off after the prompt but its last
        token), or one sequence carrying on with output tokens already generated (token_ids = prompt
        + outputs; those outputs are not reported again), like a preempted one. A sequence may join
        live sequences of the same request id if its index is not taken."""
        cfg = self.config
        sp = req.sampling
        n = max(sp.n, 1)
        group = self._requests.get(req.request_id)
        if not 1 <= req.prompt_len <= len(req.token_ids):
            raise ValueError("a request needs at least one prompt token")
        if (req.index or req.num_output_tokens) and n > 1:
            raise ValueError("a sequence with an index or output tokens is one sequence: n must be 1")
        if group is not None and (n > 1 or req.index in _taken_indices(group)):
            raise ValueError(f"request {req.request_id!r} (sequence {req.index}) is already live")
        if req.prompt_len >= cfg.max_model_len:
            raise ValueError(f"prompt of {req.prompt_len} tokens leaves no room under {cfg.max_model_len}")
        if sp.HasField("max_tokens") and sp.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if n > cfg.max_num_seqs:
            raise ValueError(f"n={n} exceeds max_num_seqs={cfg.max_num_seqs}")
        room = cfg.max_model_len - req.prompt_len
        req.max_output_tokens = min(sp.max_tokens, room) if sp.HasField("max_tokens") else room
        if req.num_output_tokens >= req.max_output_tokens:
            raise ValueError(f"{req.num_output_tokens} output tokens leave nothing to generate")
        if (refusal := pool_refusal(cfg, req.prompt_len, req.max_output_tokens, n)) is not None:
            # NOTE: refused up front because alone in the pool it could never finish.
            raise ValueError(refusal)
        if req.grammar is not None and req.matcher is None:
            req.matcher = req.grammar.matcher(req.token_ids[req.prompt_len :])
        if group is None:
            self._num_arrivals += 1
            req.arrival_seq = self._num_arrivals
        else:
            req.arrival_seq = group[0].arrival_seq  # siblings keep one place in the service order
        req.sort_key = (req.priority if cfg.policy == "priority" else 0, req.arrival_seq, req.index)
        req.pending_forks = list(range(1, n))
        req.status = RequestStatus.WAITING
        self._enqueue(req)
        if group is None:
            self._requests[req.request_id] = [req]
        else:
            group.append(req)

    def abort_request(self, request_id: str, index: int | None = None) -> list[RequestOutput]:
        """Abort sequence `index` of the request, or every live one (sequences not forked yet
        included) when None; its blocks are released now. Unknown ids or indices give []."""
        group = self._requests.get(request_id, ())
        if index is None:
            return [out for req in list(group) for out in self._abort(req)]
        for req in group:
            if req.index == index:
                if req.pending_forks:
                    try:
                        self._hand_over_forks(req)
                    except Exception as error:
                        self._fail_request(req, "handing its sequences over", error)
                        return []
                return self._abort(req)
            if index in req.pending_forks:
                waiting = req.status is RequestStatus.WAITING
                if waiting:
                    self._unweigh(req)
                req.pending_forks.remove(index)
                if waiting:
                    self._weigh(req)
                if req.status is RequestStatus.RUNNING:
                    self._num_reserved_seqs -= 1
                self._finished_by_reason["abort"] += 1
                return [self._unforked_abort_output(req, index)]
        return []

    def _abort(self, req: Request) -> list[RequestOutput]:
        unforked = list(req.pending_forks)
        self._finish(req, common_pb2.FINISH_REASON_ABORT)
        return [self._output(req, [], None)] + [self._unforked_abort_output(req, i) for i in unforked]

    @staticmethod
    def _unforked_abort_output(parent: Request, index: int) -> RequestOutput:
        return RequestOutput(
            parent.request_id, index, [], None, common_pb2.FINISH_REASON_ABORT, None,
            parent.prompt_len, 0, max(parent.num_cached_prompt_tokens, 0),
        )  # fmt: skip

    def _hand_over_forks(self, parent: Request) -> None:
        """The parent is aborted before its siblings forked off: the first of them forks now, takes
        over the parent's progress (sharing its blocks) and forks the others in its turn."""
        heir_index, *rest = parent.pending_forks
        heir = parent.fork(heir_index)
        heir.pending_forks = rest
        parent.pending_forks = []
        self._requests[parent.request_id].append(heir)
        if parent.status is RequestStatus.RUNNING:
            self.kv.fork(parent, heir)
            self._num_reserved_seqs -= 1  # the heir takes a batch place of its own
            bisect.insort(self.running, heir, key=_sort_key)
            if rest and heir.num_computed_tokens == heir.prompt_len - 1:
                self._to_fork.append(heir)
        else:
            heir.status = RequestStatus.WAITING
            self._enqueue(heir)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; False (nothing changes) while a request holds cached blocks."""
        return self.kv.reset_prefix_cache()

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def has_work(self) -> bool:
        """Whether schedule() would return a non-empty step now (tokens to compute, sequences to
        fork, departures to report); no side effect. Call it before schedule() to avoid empty
        steps: a False stays False until a request arrives or is aborted or a result comes in."""
        if self._finished or self._preempted or any(map(_ready_to_fork, self._to_fork)):
            return True
        for req in self.running:
            if _num_tokens_to_compute(req) > 0:
                return True  # scheduled, or it preempts: either way the step is not empty
        # NOTE: with nothing running to compute, the first waiting request gets the whole budget
        # and every free block, exactly as schedule() would give them.
        return bool(self.waiting) and (
            self._admission(self.waiting[0], self.config.max_num_batched_tokens) is not None
        )

    # ------------------------------------------------------------------ one step

    def schedule(self) -> SchedulerOutput:
        out = self._schedule_once()
        if not out.scheduled and any(map(_ready_to_fork, self._to_fork)):
            # NOTE: parents admitted on a prefix hit covering their prompt but its last token had
            # nothing to compute before forking: fork them and schedule again in the same step rather
            # than send a step without tokens. The first pass built nothing the worker needs but
            # its departures, which the second pass reports (it admitted, so it preempted none).
            assert not out.preempted
            self._step_id -= 1
            first, out = out, self._schedule_once()
            out.finished[:0] = first.finished
            out.cow_copies[:0] = first.cow_copies  # copies of partly hit blocks for those parents
        return out

    def _schedule_once(self) -> SchedulerOutput:
        cfg = self.config
        kv = self.kv
        bs = cfg.block_size
        ref_counts = kv.pool.ref_counts
        self._step_id += 1
        if self._to_fork:
            self._fork_ready_parents()
        budget = cfg.max_num_batched_tokens
        scheduled: list[Request] = []
        counts: list[int] = []
        sampled: list[Request] = []
        cows: list[CowCopy] = []
        running = self.running
        preempted = False
        # Ids of the requests that failed in this step (their entries leave the step's lists).
        failed: set[str] = set()
        drafts: list[tuple[Request, list[int]]] = []
        spec = cfg.speculative
        propose = spec is not None and (
            spec.disable_by_batch_size is None or len(running) <= spec.disable_by_batch_size
        )

        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            i += 1
            if req.num_pending_tokens and (req.matcher is not None or req.draft_token_ids):
                continue  # constrained: its next mask waits for the token in flight; or drafts in flight
            # NOTE: a try costs nothing until it catches (Python 3.11).
            try:
                start = req.num_computed_tokens
                if req.pending_forks:
                    num_new = req.prompt_len - 1 - start
                else:
                    num_known = len(req.token_ids)
                    num_tokens = num_known + req.num_pending_tokens
                    if num_tokens - req.prompt_len >= req.max_output_tokens:
                        continue  # its last samples are in flight: the results will finish it
                    num_new = num_tokens - start
                    if (
                        propose
                        and num_new == 1
                        and req.matcher is None
                        and not req.wants_logprobs
                        and self._step_id >= req.spec_resume_step
                        and self._speculate(req, budget, num_tokens, cows, scheduled, counts, sampled, drafts)
                    ):
                        budget -= counts[-1]
                        continue
                    if (
                        num_new == 1
                        and start % bs
                        and start >= req.prompt_len
                        and ref_counts[req.block_table[-1]] == 1
                    ):
                        # Fast path, the common case: a decode whose token lands in its own partly filled
                        # last block (no block to allocate, nothing shared); _schedule_tokens inlined.
                        req.num_computed_tokens = num_tokens
                        req.num_pending_tokens += 1
                        scheduled.append(req)
                        counts.append(1)
                        sampled.append(req)
                        budget -= 1
                        if req.cache_node is not None and num_known // bs > req.num_cached_blocks:
                            kv.cache_full_blocks(req, self._step_id)
                        continue
                if num_new <= 0:
                    continue
                if num_new > budget:
                    if not cfg.enable_chunked_prefill and num_new <= cfg.max_num_batched_tokens:
                        continue
                    num_new = budget
                while not kv.allocate_slots(req, num_new, cows):
                    victim = running.pop()
                    self._preempt(victim)
                    preempted = True
                    if victim is req:
                        break
                else:
                    budget -= num_new
                    self._schedule_tokens(req, num_new, scheduled, counts, sampled, bs)
            except Exception as error:
                # The requests before it that survive keep their places: the loop goes on after them.
                before = running[: i - 1]
                failed |= self._fail_request(req, "being scheduled", error, self._step_id)
                i = sum(1 for r in before if r.status is RequestStatus.RUNNING)

        # NOTE: no admission in a step that preempted: the blocks just freed would be taken by a
        # newcomer instead of the request that lost them.
        waiting = self.waiting
        while waiting and budget > 0 and not preempted:
            req = waiting[0]
            try:
                admission = self._admission(req, budget)
                if admission is None:
                    break
                hit, num_new = admission
                waiting.pop(0)
                self._unweigh(req)
                kv.admit(req, hit, cows)
                ok = kv.allocate_slots(req, num_new, cows)
                assert ok
                if kv.cache is not None:
                    self._prefix_queries += len(req.token_ids)
                    self._prefix_hits += hit.num_tokens
                if req.num_cached_prompt_tokens < 0:
                    req.num_cached_prompt_tokens = min(hit.num_tokens, req.prompt_len)
                req.hit_step = self._step_id if hit.num_tokens else 0
                req.entry_step = 0
                self._num_reserved_seqs += len(req.pending_forks)
                req.status = RequestStatus.RUNNING
                bisect.insort(running, req, key=_sort_key)
                if num_new > 0:
                    budget -= num_new
                    self._schedule_tokens(req, num_new, scheduled, counts, sampled, bs)
                else:
                    self._to_fork.append(req)  # the cache held the whole prefix to share
            except Exception as error:
                failed |= self._fail_request(req, "being admitted", error, self._step_id)

        if failed:
            kept = [k for k, r in enumerate(scheduled) if r.request_id not in failed]
            scheduled = [scheduled[k] for k in kept]
            counts = [counts[k] for k in kept]
            sampled = [r for r in sampled if r.request_id not in failed]
            cows = [c for c in cows if c.request.request_id not in failed]
            drafts = [d for d in drafts if d[0].request_id not in failed]
            budget = cfg.max_num_batched_tokens - sum(counts)
        assert len(running) <= cfg.max_num_seqs
        masked = [r for r in sampled if r.matcher is not None]
        token_masks = self._token_masks(masked) if masked else None
        out = SchedulerOutput(
            step_id=self._step_id,
            scheduled=scheduled,
            num_scheduled_tokens=counts,
            sampled=sampled,
            cow_copies=cows,
            finished=self._finished,
            preempted=self._preempted,
            total_num_scheduled_tokens=cfg.max_num_batched_tokens - budget,
            masked=masked,
            token_masks=token_masks,
            drafts=drafts,
            num_draft_layers=spec.num_draft_layers if drafts and spec is not None else 0,
        )
        self._finished = []
        self._preempted = []
        return out

    def _token_masks(self, masked: list[Request]) -> np.ndarray:
        """The masks of the constrained rows that sample this step, from their matchers as the tokens
        received left them (none of them has a token in flight)."""
        if self._masks is None:
            grammar = masked[0].grammar
            assert grammar is not None
            self._masks = MaskFiller(grammar.vocab_size)
        return self._masks.fill([r.matcher for r in masked])

    def _admission(self, req: Request, budget: int) -> tuple[PrefixHit, int] | None:
        """(prefix-cache hits, tokens to compute now) if the waiting request can be admitted with
        this token budget and the free blocks; None if it must wait. No side effect."""
        cfg = self.config
        if req.num_pending_tokens:
            return None  # preempted with samples in flight: it comes back once they are in
        if len(self.running) + self._num_reserved_seqs + 1 + len(req.pending_forks) > cfg.max_num_seqs:
            return None
        kv = self.kv
        hit = kv.lookup(req, self._step_id)
        end = req.prompt_len - 1 if req.pending_forks else len(req.token_ids)
        num_new = end - hit.num_tokens
        if num_new > budget:
            if not cfg.enable_chunked_prefill and num_new <= cfg.max_num_batched_tokens:
                return None
            num_new = budget
        if kv.blocks_to_admit(hit, num_new) > kv.num_free_blocks:
            return None
        return hit, num_new

    def _schedule_tokens(
        self,
        req: Request,
        num_new: int,
        scheduled: list[Request],
        counts: list[int],
        sampled: list[Request],
        bs: int,
    ) -> None:
        start = req.num_computed_tokens
        req.num_computed_tokens = end = start + num_new
        if not req.entry_step:
            req.entry_step = self._step_id  # the plan that brings it to the worker
        scheduled.append(req)
        counts.append(num_new)
        if start < req.prompt_len:
            self._prompt_tokens += min(end, req.prompt_len) - start
        if end == len(req.token_ids) + req.num_pending_tokens:
            req.num_pending_tokens += 1
            sampled.append(req)
        elif req.pending_forks and end == req.prompt_len - 1:
            self._to_fork.append(req)
        if req.cache_node is not None and min(end, len(req.token_ids)) // bs > req.num_cached_blocks:
            self.kv.cache_full_blocks(req, self._step_id)

    def _speculate(
        self,
        req: Request,
        budget: int,
        num_tokens: int,
        cows: list[CowCopy],
        scheduled: list[Request],
        counts: list[int],
        sampled: list[Request],
        drafts: list[tuple[Request, list[int]]],
    ) -> bool:
        """Schedule the decoding request's next token with drafts after it (1 + k positions) if it has a
        proposal and the blocks for it; False, changing nothing, if not (it decodes as usual). N-gram drafts
        are looked up here; a self-speculative draft (num_draft_layers) always proposes k, in the worker."""
        spec = self.config.speculative
        assert spec is not None
        # NOTE: every token it may produce (the drafts and the one sampled after them) stays within its limit.
        k = min(
            spec.num_speculative_tokens, budget - 1, req.max_output_tokens - (num_tokens - req.prompt_len) - 1
        )
        if k < 1:
            return False
        if spec.num_draft_layers:
            # The worker proposes them (StepPlan.num_draft_layers); until its result they are placeholders.
            proposal = [0] * k
        else:
            if req.ngram is None:
                req.ngram = NgramIndex(spec.prompt_lookup_min, spec.prompt_lookup_max)
            proposal = req.ngram.propose(req.token_ids, k, skip=req.num_pending_tokens)
        if not proposal or not self.kv.allocate_slots(req, 1 + len(proposal), cows):
            return False  # NOTE: drafts never preempt anyone: without blocks for them it decodes alone
        start = req.num_computed_tokens
        req.num_computed_tokens = start + 1 + len(proposal)
        req.num_pending_tokens += 1
        req.draft_token_ids = proposal
        scheduled.append(req)
        counts.append(1 + len(proposal))
        sampled.append(req)
        drafts.append((req, proposal))
        if start < req.prompt_len:
            self._prompt_tokens += req.prompt_len - start
        bs = self.config.block_size
        if req.cache_node is not None and len(req.token_ids) // bs > req.num_cached_blocks:
            self.kv.cache_full_blocks(req, self._step_id)
        return True

    def _take_drafts(self, req: Request, drafts: list[int], accepted: int, token: int) -> RequestOutput:
        """Take a verification's result: the accepted drafts and the token sampled after them; roll the
        rejected drafts' positions and blocks back."""
        k = len(drafts)
        assert 0 <= accepted <= k, f"{accepted} of {k} drafts accepted"
        self._spec_drafts += 1
        self._spec_draft_tokens += k
        self._spec_accepted += accepted
        per_pos = self._spec_accepted_per_pos
        for j in range(accepted):
            per_pos[j] += 1
        if accepted:
            req.spec_misses = 0
        else:
            req.spec_misses += 1
            req.spec_resume_step = self._step_id + (1 << min(req.spec_misses, 6))
        if req.status is RequestStatus.RUNNING:  # a preempted one holds no blocks
            req.num_computed_tokens -= k - accepted
            self.kv.roll_back(req)
        tokens = req.token_ids
        new_tokens = []
        reason = common_pb2.FINISH_REASON_UNSPECIFIED
        for t in (*drafts[:accepted], token):
            tokens.append(t)
            new_tokens.append(t)
            reason = req.check_stop(t)
            if reason:
                break
        if reason:
            self._finish(req, reason)
        elif req.cache_node is not None and (
            min(req.num_computed_tokens, len(tokens)) // self.config.block_size > req.num_cached_blocks
        ):
            self.kv.cache_full_blocks(req, self._step_id)
        return RequestOutput(
            req.request_id, req.index, new_tokens, None, reason, req.stop_token_id,
            req.prompt_len, len(tokens) - req.prompt_len, req.num_cached_prompt_tokens,
        )  # fmt: skip

    def _fork_ready_parents(self) -> None:
        for parent in self._to_fork:
            if not _ready_to_fork(parent):
                continue  # aborted, or preempted (it is queued again when it gets back there)
            try:
                group = self._requests[parent.request_id]
                for index in parent.pending_forks:
                    child = parent.fork(index)
                    self.kv.fork(parent, child)
                    bisect.insort(self.running, child, key=_sort_key)
                    group.append(child)
                self._num_reserved_seqs -= len(parent.pending_forks)
                parent.pending_forks = []
            except Exception as error:
                self._fail_request(parent, "forking its sequences", error)
        self._to_fork.clear()

    def _preempt(self, req: Request) -> None:
        assert req.status is RequestStatus.RUNNING
        self.kv.free(req)
        req.status = RequestStatus.WAITING
        req.entry_step = 0
        self._num_reserved_seqs -= len(req.pending_forks)
        self._num_preemptions += 1
        self._preempted.append(req)
        self._enqueue(req)

    def _finish(self, req: Request, reason: int) -> None:
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
            self.kv.free(req)
            self._num_reserved_seqs -= len(req.pending_forks)
        elif req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
            self._unweigh(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        group = self._requests[req.request_id]
        group.remove(req)
        if not group:
            del self._requests[req.request_id]
        self._finished.append(req)
        self._finished_by_reason[finish_reasons.NAMES[reason]] += 1 + len(req.pending_forks)
        req.pending_forks = []

    def _fail_request(
        self,
        req: Request,
        stage: str | None,
        error: BaseException | str,
        uncomputed_from: int | None = None,
    ) -> set[str]:
        """Fail req's request alone: every sequence of it ends (aborted, blocks released, slots freed by
        the next plan), whatever state the exception left it in, and a RequestFailure is kept for the
        caller (stage None: error is the whole message). uncomputed_from: the step from which no plan
        will compute what its sequences cached (see _drop_uncomputed). Returns the ids of the requests
        ended here."""
        message = error if stage is None else f"{type(error).__name__}: {error}"
        where = "" if stage is None else f" while {stage}"
        self._failures.append(
            RequestFailure(req.request_id, f"request {req.request_id!r} failed{where}: {message}")
        )
        group = self._requests.pop(req.request_id, [])
        if req not in group:
            group.append(req)
        self._end(group)
        ended = {req.request_id}
        if uncomputed_from is not None:
            ended |= self._drop_uncomputed(dict.fromkeys(group, uncomputed_from), req.request_id)
        return ended

    def _drop_uncomputed(self, uncomputed_from: Mapping[Request, int], cause: str) -> set[str]:
        """These sequences (ended) cached blocks that no plan computes from the given step on (each one's
        step was lost: scrubbed from its plan, or left out by the worker). Every request of the salt that
        hit the cache since may have read them, and cached blocks computed over them: each is taken off
        this core (a RequestFailure with retry, to be recomputed); then every block of the salt cached
        since that no request holds any more is uncached (some were fine: the cache loses a little).
        Returns the ids of the requests taken off.

        NOTE: blocks enter the trie when the plan that computes them is built, so that requests in the
        same step and the next ones share them; this is the price of that when a plan's part is lost."""
        steps = [
            node.step
            for seq, step in uncomputed_from.items()
            for node in seq.inserted
            if node.alive and node.step >= step
        ]
        if not steps:
            return set()
        since = min(steps)
        salt = next(iter(uncomputed_from)).cache_salt
        victims = set()
        for request_id, seqs in list(self._requests.items()):
            if not any(s.cache_salt == salt and s.hit_step >= since for s in seqs):
                continue
            self._failures.append(
                RequestFailure(
                    request_id,
                    f"request {request_id!r} is recomputed: it may have read the K/V of blocks that request "
                    f"{cause!r} was to compute and did not",
                    retry=True,
                )
            )
            del self._requests[request_id]
            self._end(seqs)
            victims.add(request_id)
        self.kv.uncache_since(salt, since)
        return victims

    def _end(self, seqs: list[Request]) -> None:
        """Abort these sequences (a failure), from whatever state they are in; they leave _requests."""
        for seq in seqs:
            if seq.status is RequestStatus.FINISHED:
                continue
            if seq.status is RequestStatus.RUNNING:
                if seq in self.running:
                    self.running.remove(seq)
                self._num_reserved_seqs -= len(seq.pending_forks)
            elif seq in self.waiting:  # not when an admission failed between its pop and its RUNNING
                self.waiting.remove(seq)
                self._unweigh(seq)
            self.kv.free(seq)
            seq.status = RequestStatus.FINISHED
            seq.finish_reason = common_pb2.FINISH_REASON_ABORT
            self._finished.append(seq)
            self._finished_by_reason["abort"] += 1 + len(seq.pending_forks)
            seq.pending_forks = []

    def take_failures(self) -> list[RequestFailure]:
        """The requests failed since the last call (see the module docstring); their clients must hear why."""
        failures = self._failures
        if failures:  # NOTE: no new list per step while nothing fails
            self._failures = []
        return failures

    # ------------------------------------------------------------------ the waiting queue's weights

    def _enqueue(self, req: Request) -> None:
        bisect.insort(self.waiting, req, key=_sort_key)
        self._weigh(req)

    def _weigh(self, req: Request) -> None:
        seqs = 1 + len(req.pending_forks)
        req.queue_weight = (seqs, seqs * (req.prompt_len + req.max_output_tokens))
        self.num_waiting_seqs += seqs
        self.num_waiting_tokens += req.queue_weight[1]

    def _unweigh(self, req: Request) -> None:
        seqs, tokens = req.queue_weight
        self.num_waiting_seqs -= seqs
        self.num_waiting_tokens -= tokens

    # ------------------------------------------------------------------ results

    def update_from_output(
        self,
        out: SchedulerOutput,
        result: worker_pb2.StepResult,
        refused: Mapping[Request, str] | None = None,
    ) -> list[RequestOutput]:
        """Take the tokens sampled at out's step (updates arrive in step order). `refused`: the requests
        of the step the worker left out (StepResult.refused_slots), with its message: each fails alone."""
        assert result.step_id == out.step_id, f"result of step {result.step_id} for step {out.step_id}"
        token_ids = result.sampled_token_ids
        sampled = out.sampled
        if refused:
            by_request: dict[str, dict[Request, int]] = {}
            for req in refused:
                by_request.setdefault(req.request_id, {})[req] = req.entry_step
            for seqs in by_request.values():
                first = next(iter(seqs))
                if first.request_id in self._requests and any(
                    s.status is not RequestStatus.FINISHED for s in seqs
                ):
                    self._fail_request(first, None, f"its worker refused it: {refused[first]}")
                # NOTE: the worker left each out of every plan since the one it entered with, whether
                # it is still live or was aborted since.
                self._drop_uncomputed(seqs, first.request_id)
            sampled = [req for req in sampled if req not in refused]
        assert len(token_ids) == len(sampled), "sampled tokens do not match the plan"
        offsets = _top_offsets(result) if len(result.sampled_logprobs) else None
        accepted = result.num_accepted_tokens
        assert not out.drafts or len(accepted) == len(sampled), "accepted counts do not match the plan"
        # NOTE: the drafts of this step; a request's own draft_token_ids may be a later step's.
        drafts_of = dict(out.drafts) if out.drafts else None
        if drafts_of and out.num_draft_layers:
            drafts_of = _worker_drafts(sampled, drafts_of, result.draft_token_ids)
        block_size = self.config.block_size
        finished = RequestStatus.FINISHED
        outputs = []
        append = outputs.append
        for i, req in enumerate(sampled):
            req.num_pending_tokens -= 1
            assert req.num_pending_tokens >= 0
            drafts = drafts_of.get(req) if drafts_of is not None else None
            if drafts:
                req.draft_token_ids = []
            if req.status is finished:
                continue  # sampled in a step already in flight when it finished or was aborted
            try:
                token = token_ids[i]
                if drafts:
                    append(self._take_drafts(req, drafts, accepted[i], token))
                    continue
                tokens = req.token_ids
                tokens.append(token)
                num_known = len(tokens)
                logprobs = None
                if offsets is not None and req.wants_logprobs:
                    logprobs = [_token_logprob(result, i, offsets[i], token)]
                reason = req.check_stop(token)
                if req.matcher is not None and not reason:
                    reason = self._advance_matcher(req, token)
                if reason:
                    self._finish(req, reason)
                elif req.cache_node is not None and (
                    min(req.num_computed_tokens, num_known) // block_size > req.num_cached_blocks
                ):
                    self.kv.cache_full_blocks(req, self._step_id)
                # NOTE: positional and inline (the hot path); num_cached_prompt_tokens is set: it sampled.
                append(
                    RequestOutput(
                        req.request_id, req.index, [token], logprobs, reason, req.stop_token_id,
                        req.prompt_len, num_known - req.prompt_len, req.num_cached_prompt_tokens,
                    )
                )  # fmt: skip
            except Exception as error:
                self._fail_request(req, "taking its sampled token", error)
        self._generation_tokens += sum(len(o.new_token_ids) for o in outputs) if out.drafts else len(outputs)
        return outputs

    @staticmethod
    def _advance_matcher(req: Request, token: int) -> int:
        """Feed a constrained sequence's token to its matcher: STOP once the text is complete and nothing may
        follow, else UNSPECIFIED; ValueError (the request fails) if the grammar refuses it."""
        matcher = req.matcher
        assert matcher is not None
        if not matcher.consume_token(token):
            raise ValueError(f"the {req.grammar.description} refused token {token}: {matcher_error(matcher)}")
        return common_pb2.FINISH_REASON_STOP if matcher.is_stopped() else common_pb2.FINISH_REASON_UNSPECIFIED

    @staticmethod
    def _output(req: Request, token_ids: list[int], logprobs) -> RequestOutput:
        return RequestOutput(
            request_id=req.request_id,
            index=req.index,
            new_token_ids=token_ids,
            logprobs=logprobs,
            finish_reason=req.finish_reason,
            stop_token_id=req.stop_token_id,
            num_prompt_tokens=req.prompt_len,
            num_output_tokens=len(req.token_ids) - req.prompt_len,
            num_cached_tokens=max(req.num_cached_prompt_tokens, 0),
        )

    # ------------------------------------------------------------------ numbers

    def stats(self) -> SchedulerStats:
        pool = self.kv.pool
        cache = self.kv.cache
        in_use = pool.num_used_blocks
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_blocks=pool.num_blocks,
            num_blocks_in_use=in_use,
            num_cached_free_blocks=cache.num_evictable if cache else 0,
            kv_cache_usage=in_use / pool.num_blocks,
            prefix_cache_queries=self._prefix_queries,
            prefix_cache_hits=self._prefix_hits,
            num_preemptions=self._num_preemptions,
            prompt_tokens=self._prompt_tokens,
            generation_tokens=self._generation_tokens,
            requests_finished=dict(self._finished_by_reason),
            num_steps=self._step_id,
            spec_num_drafts=self._spec_drafts,
            spec_num_draft_tokens=self._spec_draft_tokens,
            spec_num_accepted_tokens=self._spec_accepted,
            spec_num_accepted_tokens_per_pos=list(self._spec_accepted_per_pos),
        )


def _sort_key(req: Request) -> tuple[int, int, int]:
    return req.sort_key


def pool_refusal(cfg: SchedulerConfig, prompt_len: int, max_output_tokens: int, n: int) -> str | None:
    """Why n sequences of prompt_len + max_output_tokens tokens can never run on a pool of cfg's, or None.

    NOTE: n times the longest sequence's blocks, as if the forks shared nothing: a sibling preempted
    and recomputed holds blocks of its own, and a request admitted with no way to finish would hold
    the head of the queue or preempt itself and compute its prompt again forever."""
    longest = prompt_len + max_output_tokens
    need = n * -(-longest // cfg.block_size)
    if need <= cfg.num_blocks:
        return None
    return (
        f"{n} sequence(s) of up to {longest} tokens ({prompt_len} in the prompt, up to {max_output_tokens} "
        f"generated) need {need} KV blocks of {cfg.block_size} tokens; the worker's KV pool has "
        f"{cfg.num_blocks} blocks ({cfg.num_blocks * cfg.block_size} tokens)"
    )


def _num_tokens_to_compute(req: Request) -> int:
    """Tokens a running request would compute now, budget and blocks permitting (as schedule())."""
    if req.pending_forks:
        return req.prompt_len - 1 - req.num_computed_tokens
    if not req.can_sample() or (req.num_pending_tokens and (req.matcher is not None or req.draft_token_ids)):
        return (
            0  # its last samples are in flight (a constrained request, or one with drafts, waits for its one)
        )
    return req.num_tokens - req.num_computed_tokens


def _ready_to_fork(parent: Request) -> bool:
    return (
        parent.status is RequestStatus.RUNNING
        and bool(parent.pending_forks)
        and parent.num_computed_tokens == parent.prompt_len - 1
    )


def _taken_indices(group: list[Request]) -> set[int]:
    """Sequence indices of a request that are live or still to fork."""
    return {i for req in group for i in (req.index, *req.pending_forks)}


def _top_offsets(result: worker_pb2.StepResult) -> list[int]:
    offsets = [0] * len(result.sampled_slots)
    total = 0
    for i, k in enumerate(result.num_top_logprobs):
        offsets[i] = total
        total += k
    return offsets


def _token_logprob(result: worker_pb2.StepResult, i: int, offset: int, token: int) -> common_pb2.TokenLogprob:
    k = result.num_top_logprobs[i] if len(result.num_top_logprobs) else 0
    return common_pb2.TokenLogprob(
        token_id=token,
        logprob=result.sampled_logprobs[i],
        rank=result.sampled_ranks[i] if len(result.sampled_ranks) else 0,
        top_token_ids=result.top_token_ids[offset : offset + k],
        top_logprobs=result.top_logprobs[offset : offset + k],
    )


def _worker_drafts(
    sampled: list[Request], planned: dict[Request, list[int]], proposed: Sequence[int]
) -> dict[Request, list[int]]:
    """The drafts the worker proposed for the planned requests (StepResult.draft_token_ids: in the order of
    the sampled requests, each its planned count)."""
    drafts = {}
    offset = 0
    for req in sampled:
        k = len(planned.get(req, ()))
        if k:
            drafts[req] = list(proposed[offset : offset + k])
            offset += k
    assert offset == len(proposed), "proposed drafts do not match the plan"
    return drafts
