"""Continuous batching over one worker pool: which requests compute how many tokens each step.

Token-centric, like vLLM v1: a request's num_computed_tokens catches up with its token count, so
prefill chunks, prefix hits, decodes and recomputation after preemption are the same thing. Running
requests go first, in service order, then waiting ones; when blocks run out the last running
request (lowest priority, latest arrival) is preempted by recomputation.

Pipelining: schedule() may run again before the previous step's update_from_output(). A request
that samples at a step gets a pending placeholder token, so the next step can compute it (the
worker feeds each decode its own last sample) before its id is known here.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from pagedserve.proto import common_pb2, worker_pb2

from .config import SchedulerConfig
from .kv_cache_manager import CowCopy, KVCacheManager
from .request import Request, RequestStatus

_FINISH_NAMES = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
}


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

    # ------------------------------------------------------------------ requests in and out

    def add_request(self, req: Request) -> None:
        cfg = self.config
        sp = req.sampling
        n = max(sp.n, 1)
        if req.request_id in self._requests:
            raise ValueError(f"request {req.request_id!r} is already live")
        if not 1 <= req.prompt_len == len(req.token_ids):
            raise ValueError("a request needs at least one prompt token, and no output yet")
        if req.prompt_len >= cfg.max_model_len:
            raise ValueError(f"prompt of {req.prompt_len} tokens leaves no room under {cfg.max_model_len}")
        if sp.HasField("max_tokens") and sp.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if n > cfg.max_num_seqs:
            raise ValueError(f"n={n} exceeds max_num_seqs={cfg.max_num_seqs}")
        room = cfg.max_model_len - req.prompt_len
        req.max_output_tokens = min(sp.max_tokens, room) if sp.HasField("max_tokens") else room
        longest = req.prompt_len + req.max_output_tokens
        if n * -(-longest // cfg.block_size) > cfg.num_blocks:
            # NOTE: refused up front because alone in the pool it could never finish.
            raise ValueError(f"{n} sequence(s) of up to {longest} tokens can never fit the KV pool")
        self._num_arrivals += 1
        req.arrival_seq = self._num_arrivals
        req.sort_key = (req.priority if cfg.policy == "priority" else 0, req.arrival_seq, req.index)
        req.num_forks_pending = n - 1
        req.status = RequestStatus.WAITING
        bisect.insort(self.waiting, req, key=_sort_key)
        self._requests[req.request_id] = [req]

    def abort_request(self, request_id: str) -> list[RequestOutput]:
        """Abort every live sequence of the request (sequences not forked yet included); unknown
        ids give an empty list."""
        outputs = []
        for req in list(self._requests.get(request_id, ())):
            unforked = req.num_forks_pending
            self._finish(req, common_pb2.FINISH_REASON_ABORT)
            outputs.append(self._output(req, [], None))
            for index in range(1, unforked + 1):
                outputs.append(
                    RequestOutput(
                        req.request_id, index, [], None, common_pb2.FINISH_REASON_ABORT, None,
                        req.prompt_len, 0, max(req.num_cached_prompt_tokens, 0),
                    )
                )  # fmt: skip
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    # ------------------------------------------------------------------ one step

    def schedule(self) -> SchedulerOutput:
        cfg = self.config
        kv = self.kv
        bs = cfg.block_size
        self._step_id += 1
        self._fork_ready_parents()
        budget = cfg.max_num_batched_tokens
        scheduled: list[Request] = []
        counts: list[int] = []
        sampled: list[Request] = []
        cows: list[CowCopy] = []
        running = self.running
        preempted = False

        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            i += 1
            if req.num_forks_pending:
                num_new = req.prompt_len - 1 - req.num_computed_tokens
            elif req.can_sample():
                num_new = len(req.token_ids) + req.num_pending_tokens - req.num_computed_tokens
            else:
                continue  # its last samples are in flight: the results will finish it
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

        # NOTE: no admission in a step that preempted: the blocks just freed would be taken by a
        # newcomer instead of the request that lost them.
        waiting = self.waiting
        while waiting and budget > 0 and not preempted:
            req = waiting[0]
            if req.num_pending_tokens:
                break  # preempted with samples in flight: it comes back once they are in
            if len(running) + self._num_reserved_seqs + 1 + req.num_forks_pending > cfg.max_num_seqs:
                break
            hits = kv.lookup(req)
            num_hit = len(hits) * bs
            end = req.prompt_len - 1 if req.num_forks_pending else len(req.token_ids)
            num_new = end - num_hit
            if num_new > budget:
                if not cfg.enable_chunked_prefill and num_new <= cfg.max_num_batched_tokens:
                    break
                num_new = budget
            if kv.blocks_to_admit(hits, num_new) > kv.num_free_blocks:
                break
            waiting.pop(0)
            kv.admit(req, hits)
            ok = kv.allocate_slots(req, num_new, cows)
            assert ok
            if kv.cache is not None:
                self._prefix_queries += len(req.token_ids)
                self._prefix_hits += num_hit
            if req.num_cached_prompt_tokens < 0:
                req.num_cached_prompt_tokens = min(num_hit, req.prompt_len)
            req.status = RequestStatus.RUNNING
            self._num_reserved_seqs += req.num_forks_pending
            bisect.insort(running, req, key=_sort_key)
            if num_new > 0:
                budget -= num_new
                self._schedule_tokens(req, num_new, scheduled, counts, sampled, bs)
            else:
                self._to_fork.append(req)  # the cache held the whole prefix to share

        assert len(running) <= cfg.max_num_seqs
        out = SchedulerOutput(
            step_id=self._step_id,
            scheduled=scheduled,
            num_scheduled_tokens=counts,
            sampled=sampled,
            cow_copies=cows,
            finished=self._finished,
            preempted=self._preempted,
            total_num_scheduled_tokens=cfg.max_num_batched_tokens - budget,
        )
        self._finished = []
        self._preempted = []
        return out

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
        scheduled.append(req)
        counts.append(num_new)
        if start < req.prompt_len:
            self._prompt_tokens += min(end, req.prompt_len) - start
        if end == len(req.token_ids) + req.num_pending_tokens:
            req.num_pending_tokens += 1
            sampled.append(req)
        elif req.num_forks_pending and end == req.prompt_len - 1:
            self._to_fork.append(req)
        if req.cache_node is not None and min(end, len(req.token_ids)) // bs > req.num_cached_blocks:
            self.kv.cache_full_blocks(req)

    def _fork_ready_parents(self) -> None:
        for parent in self._to_fork:
            if (
                parent.status is not RequestStatus.RUNNING
                or not parent.num_forks_pending
                or parent.num_computed_tokens != parent.prompt_len - 1
            ):
                continue  # aborted, or preempted (it is queued again when it gets back there)
            group = self._requests[parent.request_id]
            for index in range(1, parent.num_forks_pending + 1):
                child = parent.fork(index)
                self.kv.fork(parent, child)
                bisect.insort(self.running, child, key=_sort_key)
                group.append(child)
            self._num_reserved_seqs -= parent.num_forks_pending
            parent.num_forks_pending = 0
        self._to_fork.clear()

    def _preempt(self, req: Request) -> None:
        assert req.status is RequestStatus.RUNNING
        self.kv.free(req)
        req.status = RequestStatus.WAITING
        self._num_reserved_seqs -= req.num_forks_pending
        self._num_preemptions += 1
        self._preempted.append(req)
        bisect.insort(self.waiting, req, key=_sort_key)

    def _finish(self, req: Request, reason: int) -> None:
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
            self.kv.free(req)
            self._num_reserved_seqs -= req.num_forks_pending
        elif req.status is RequestStatus.WAITING:
            self.waiting.remove(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        group = self._requests[req.request_id]
        group.remove(req)
        if not group:
            del self._requests[req.request_id]
        self._finished.append(req)
        self._finished_by_reason[_FINISH_NAMES[reason]] += 1 + req.num_forks_pending
        req.num_forks_pending = 0

    # ------------------------------------------------------------------ results

    def update_from_output(self, out: SchedulerOutput, result: worker_pb2.StepResult) -> list[RequestOutput]:
        """Take the tokens sampled at out's step (updates arrive in step order)."""
        assert result.step_id == out.step_id, f"result of step {result.step_id} for step {out.step_id}"
        token_ids = result.sampled_token_ids
        assert len(token_ids) == len(out.sampled), "sampled tokens do not match the plan"
        offsets = _top_offsets(result) if len(result.sampled_logprobs) else None
        block_size = self.config.block_size
        outputs = []
        for i, req in enumerate(out.sampled):
            req.num_pending_tokens -= 1
            assert req.num_pending_tokens >= 0
            if req.status is RequestStatus.FINISHED:
                continue  # sampled in a step already in flight when it finished or was aborted
            token = token_ids[i]
            req.token_ids.append(token)
            self._generation_tokens += 1
            logprobs = None
            if offsets is not None and req.wants_logprobs:
                logprobs = [_token_logprob(result, i, offsets[i], token)]
            reason = req.check_stop(token)
            if reason:
                self._finish(req, reason)
            elif req.cache_node is not None and (
                min(req.num_computed_tokens, len(req.token_ids)) // block_size > req.num_cached_blocks
            ):
                self.kv.cache_full_blocks(req)
            outputs.append(self._output(req, [token], logprobs))
        return outputs

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
        )


def _sort_key(req: Request) -> tuple[int, int, int]:
    return req.sort_key


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
