"""A deterministic stand-in for the worker, for scheduler tests only.

FakeWorker executes StepPlans the way worker_svc will: it keeps per-slot token lists and block
tables, refuses a broken plan whole (PlanError, state untouched), and simulates the KV pool: each
cache position holds a fingerprint of the token written there AND of every token before it (a rolling
hash), which is what real K/V depend on. Before computing, it checks that every position each
scheduled token attends to holds the fingerprint of the right prefix: a strong end-to-end check of
block tables, copy-on-write and prefix reuse. Samples are a hash of (seed, output position, context),
like the real sampler's seeded draws (position k of the output depends on (seed, k)): a request
recomputed after preemption samples the same tokens, and one whose outputs were wrongly turned into
prompt would not.

Driver runs a Scheduler + PlanBuilder + FakeWorker loop, optionally pipelined.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from pagedserve.scheduler_svc.plan import PlanBuilder
from pagedserve.scheduler_svc.request import Request, RequestStatus
from pagedserve.scheduler_svc.scheduler import RequestFailure, RequestOutput, Scheduler, SchedulerOutput
from pagedserve.v1 import common_pb2, engine_pb2, worker_pb2

VOCAB_SIZE = 64
EOS = 1


class PlanError(Exception):
    pass


def fingerprint(prev: int, token: int) -> int:
    return hash((prev, token))


def sample(seed: int, position: int, context_fingerprint: int, vocab_size: int = VOCAB_SIZE) -> int:
    """The token drawn at output position `position` (0-based) after that context."""
    return hash((seed, position, context_fingerprint, 0x5EED)) % vocab_size


def markov_sample(seed: int, tokens: list[int], vocab_size: int = VOCAB_SIZE) -> int:
    """The token a FakeWorker(markov=True) draws after these tokens: a function of the last one's residue
    mod 16 alone, so its text soon repeats itself and n-gram drafts are accepted."""
    return hash((seed, tokens[-1] % 16, 0x5EED)) % vocab_size


def expected_markov_tokens(prompt: list[int], seed: int, n: int) -> list[int]:
    """What FakeWorker(markov=True) samples for a prompt run alone, without drafts."""
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(markov_sample(seed, tokens))
    return tokens[len(prompt) :]


def expected_tokens(prompt: list[int], seed: int, n: int, vocab_size: int = VOCAB_SIZE) -> list[int]:
    """What the fake samples for a prompt run alone: the reference for any schedule."""
    fp = 0
    for t in prompt:
        fp = fingerprint(fp, t)
    out = []
    for k in range(n):
        t = sample(seed, k, fp, vocab_size)
        out.append(t)
        fp = fingerprint(fp, t)
    return out


@dataclass
class _Slot:
    tokens: list[int]
    prompt_len: int
    num_computed: int
    seed: int
    logprobs: int | None
    table: list[int] = field(default_factory=list)
    # fingerprints[p]: fingerprint of tokens[: p + 1]
    fingerprints: list[int] = field(default_factory=list)
    # It attended over K/V of the wrong prefix (a non-strict FakeWorker): what it writes and samples is garbage.
    corrupt: bool = False

    def extend_fingerprints(self) -> None:
        fps = self.fingerprints
        prev = fps[-1] if fps else 0
        for t in self.tokens[len(fps) :]:
            prev = fingerprint(prev, t)
            fps.append(prev)


class FakeWorker:
    """`refuse(new_request)`, when given, says why the worker refuses a new request (None: it takes it): as
    the real runner does, such a request fails alone, its slot left out of every plan until freed.
    strict: a slot that attends over the wrong K/V raises at once; else, as a real worker would, it
    goes on with garbage (it writes garbage K/V and samples garbage tokens), for the scheduler to catch.
    markov: samples follow markov_sample (after a check that the K/V read are right) instead of sample.
    Draft tokens (speculative decoding) are verified as worker.proto says: written and computed after the
    known tokens, accepted while each position's sample agrees, the rest rolled back. With num_draft_layers the
    fake proposes them itself (the markov sample, wrong at some positions) and reports them.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        vocab_size: int = VOCAB_SIZE,
        refuse: Callable[[worker_pb2.NewRequest], str | None] | None = None,
        strict: bool = True,
        markov: bool = False,
    ) -> None:
        self.markov = markov
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.refuse = refuse
        self.strict = strict
        self.kv: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.slots: dict[int, _Slot] = {}
        # Slots whose request was refused, with why, until a plan frees them.
        self.refused: dict[int, str] = {}
        self.last_step_id = 0
        self.num_copies = 0

    # ---------------------------------------------------------------- validation (no side effect)

    def validate(self, plan: worker_pb2.StepPlan) -> None:
        bs = self.block_size
        if plan.step_id != self.last_step_id + 1:
            raise PlanError(f"step {plan.step_id} after {self.last_step_id}")
        departed = list(plan.finished_slots) + list(plan.preempted_slots)
        known = set(self.slots) | set(self.refused)
        if len(set(departed)) != len(departed) or any(s not in known for s in departed):
            raise PlanError(f"departing slots {departed} not all live")
        if any(new.slot in known - set(departed) for new in plan.new_requests):
            raise PlanError("new request on a live slot")
        live = set(self.slots) - set(departed)
        table_len = {s: len(self.slots[s].table) for s in live}
        info = {s: (self.slots[s].num_computed, len(self.slots[s].tokens)) for s in live}
        for new in plan.new_requests:
            if new.slot in live:
                raise PlanError(f"new request on live slot {new.slot}")
            if not 0 < new.prompt_len <= len(new.token_ids) or new.num_computed_tokens >= len(new.token_ids):
                raise PlanError(f"bad new request on slot {new.slot}")
            live.add(new.slot)
            table_len[new.slot] = 0
            info[new.slot] = (new.num_computed_tokens, len(new.token_ids))
        blocks = [*plan.new_block_ids, *plan.replaced_block_ids, *plan.copy_src_blocks, *plan.copy_dst_blocks]
        if any(b >= self.num_blocks for b in blocks):
            raise PlanError("block id out of range")
        if len(plan.copy_src_blocks) != len(plan.copy_dst_blocks):
            raise PlanError("copy lists differ in length")
        for s, idx in zip(plan.replaced_slots, plan.replaced_block_indices, strict=True):
            if s not in live or idx >= table_len[s]:
                raise PlanError(f"replacement of entry {idx} of slot {s} out of range")
        n = len(plan.slots)
        if len(plan.num_scheduled_tokens) != n or len(plan.num_new_blocks) != n:
            raise PlanError("scheduled arrays differ in length")
        if sum(plan.num_new_blocks) != len(plan.new_block_ids) or len(set(plan.slots)) != n:
            raise PlanError("new blocks do not add up, or a slot is scheduled twice")
        if plan.num_draft_layers and plan.draft_token_ids:
            raise PlanError("draft token ids although the worker proposes the drafts")
        drafts = _plan_drafts(plan)
        if any(s not in plan.slots for s in drafts):
            raise PlanError("drafts for a slot not scheduled")
        for s, k, nb in zip(plan.slots, plan.num_scheduled_tokens, plan.num_new_blocks, strict=True):
            if s not in live or k == 0:
                raise PlanError(f"slot {s} scheduled but not live, or with no tokens")
            computed, known = info[s]
            if s in drafts:
                known += len(drafts[s])
                if computed + k != known:
                    raise PlanError(f"slot {s}: drafts but does not sample after them")
            if computed + k > known:
                raise PlanError(f"slot {s}: {k} tokens scheduled, {known - computed} available")
            if -(-(computed + k) // bs) > table_len[s] + nb:
                raise PlanError(f"slot {s}: block table too short")

    # ---------------------------------------------------------------- execution

    def _refusals(self, plan: worker_pb2.StepPlan) -> dict[int, str]:
        freed = {*plan.finished_slots, *plan.preempted_slots}
        refused = {s: m for s, m in self.refused.items() if s in plan.slots and s not in freed}
        for new in plan.new_requests:
            if self.refuse is not None and (problem := self.refuse(new)) is not None:
                refused[new.slot] = f"new request {new.request_id!r} (slot {new.slot}): {problem}"
        return refused

    def execute(self, plan: worker_pb2.StepPlan) -> worker_pb2.StepResult:
        refused = self._refusals(plan)
        if refused:
            plan = _without_slots(plan, set(refused))
        self.validate(plan)
        bs = self.block_size
        self.last_step_id = plan.step_id
        for s in (*plan.finished_slots, *plan.preempted_slots):
            if self.refused.pop(s, None) is None:
                del self.slots[s]
        self.refused.update(refused)
        for new in plan.new_requests:
            sp = new.sampling
            slot = self.slots[new.slot] = _Slot(
                tokens=list(new.token_ids),
                prompt_len=new.prompt_len,
                num_computed=new.num_computed_tokens,
                seed=sp.seed if sp.HasField("seed") else 0,
                logprobs=sp.logprobs if sp.HasField("logprobs") else None,
            )
            slot.extend_fingerprints()
        for s, idx, b in zip(
            plan.replaced_slots, plan.replaced_block_indices, plan.replaced_block_ids, strict=True
        ):
            self.slots[s].table[idx] = b
        pos = 0
        for s, nb in zip(plan.slots, plan.num_new_blocks, strict=True):
            self.slots[s].table.extend(plan.new_block_ids[pos : pos + nb])
            pos += nb
        for src, dst in zip(plan.copy_src_blocks, plan.copy_dst_blocks, strict=True):
            self.kv[dst] = list(self.kv[src])
            self.num_copies += 1
        drafts = _plan_drafts(plan)
        if plan.num_draft_layers:
            drafts = {s: self._propose(self.slots[s], len(tokens)) for s, tokens in drafts.items()}
        for s, tokens in drafts.items():
            self.slots[s].tokens.extend(tokens)
            self.slots[s].extend_fingerprints()
        # Write every scheduled token's K/V first (one forward pass), then check what each reads.
        for s, k in zip(plan.slots, plan.num_scheduled_tokens, strict=True):
            slot = self.slots[s]
            for p in range(slot.num_computed, slot.num_computed + k):
                self.kv[slot.table[p // bs]][p % bs] = ("garbage",) if slot.corrupt else slot.fingerprints[p]
        result = worker_pb2.StepResult(step_id=plan.step_id)
        result.refused_slots.extend(refused)
        result.refused_messages.extend(refused.values())
        for s, k in zip(plan.slots, plan.num_scheduled_tokens, strict=True):
            slot = self.slots[s]
            slot.num_computed += k
            self._check_attention(s, slot)
            if s in drafts:
                self._verify(s, slot, drafts[s], result)
                if plan.num_draft_layers:
                    result.draft_token_ids.extend(drafts[s])
            elif slot.num_computed == len(slot.tokens):
                position = len(slot.tokens) - slot.prompt_len
                context = slot.fingerprints[-1] if not slot.corrupt else ("garbage", slot.fingerprints[-1])
                if self.markov:
                    token = markov_sample(slot.seed, slot.tokens, self.vocab_size)
                else:
                    token = sample(slot.seed, position, context, self.vocab_size)
                slot.tokens.append(token)
                slot.extend_fingerprints()
                result.sampled_slots.append(s)
                result.sampled_token_ids.append(token)
                result.sampled_logprobs.append(-0.1 * (1 + token % 10))
                result.sampled_ranks.append(1 + token % 3)
                k_top = slot.logprobs or 0
                result.num_top_logprobs.append(k_top)
                result.top_token_ids.extend((token + j) % self.vocab_size for j in range(k_top))
                result.top_logprobs.extend(-0.1 * (j + 1) for j in range(k_top))
        if drafts:  # parallel to sampled_slots: the slots after the last with drafts
            result.num_accepted_tokens.extend(
                [0] * (len(result.sampled_slots) - len(result.num_accepted_tokens))
            )
        return result

    def _propose(self, slot: _Slot, k: int) -> list[int]:
        """k drafts after the slot's tokens: the markov samples, each wrong where a hash of the seed and its
        position says (about one in three)."""
        tokens = list(slot.tokens)
        for _ in range(k):
            token = markov_sample(slot.seed, tokens, self.vocab_size)
            if hash((slot.seed, len(tokens), 0xD4AF7)) % 3 == 0:
                token = (token + 1) % self.vocab_size
            tokens.append(token)
        return tokens[len(slot.tokens) :]

    def _verify(self, s: int, slot: _Slot, drafts: list[int], result: worker_pb2.StepResult) -> None:
        """Sample after the known tokens and after each draft; keep the drafts the samples agree with."""
        assert self.markov, "drafts are verified by the markov sampler"
        known = len(slot.tokens) - len(drafts)
        accepted = 0
        while (
            accepted < len(drafts)
            and markov_sample(slot.seed, slot.tokens[: known + accepted], self.vocab_size) == drafts[accepted]
        ):
            accepted += 1
        token = markov_sample(slot.seed, slot.tokens[: known + accepted], self.vocab_size)
        del slot.tokens[known + accepted :], slot.fingerprints[known + accepted :]
        slot.tokens.append(token)
        slot.extend_fingerprints()
        slot.num_computed = known + accepted
        del slot.table[-(-slot.num_computed // self.block_size) :]
        result.sampled_slots.append(s)
        result.sampled_token_ids.append(token)
        result.sampled_logprobs.append(-0.1)
        result.sampled_ranks.append(1)
        result.num_top_logprobs.append(0)
        while len(result.num_accepted_tokens) < len(result.sampled_slots) - 1:
            result.num_accepted_tokens.append(0)  # the slots before it sampled without drafts
        result.num_accepted_tokens.append(accepted)

    def _check_attention(self, s: int, slot: _Slot) -> None:
        """Every position 0..num_computed-1 reads the fingerprint of the right prefix."""
        bs = self.block_size
        fps = slot.fingerprints
        end = slot.num_computed
        for i in range(-(-end // bs)):
            lo, hi = i * bs, min((i + 1) * bs, end)
            got = self.kv[slot.table[i]][: hi - lo]
            if got != fps[lo:hi]:
                if self.strict:
                    raise AssertionError(f"slot {s} block {i} (physical {slot.table[i]}) holds the wrong K/V")
                slot.corrupt = True


def _plan_drafts(plan: worker_pb2.StepPlan) -> dict[int, list[int]]:
    drafts, offset = {}, 0
    for s, k in zip(plan.draft_slots, plan.num_draft_tokens, strict=True):
        drafts[s] = [0] * k if plan.num_draft_layers else list(plan.draft_token_ids[offset : offset + k])
        offset += k
    return drafts


def _without_slots(plan: worker_pb2.StepPlan, left_out: set[int]) -> worker_pb2.StepPlan:
    kept = worker_pb2.StepPlan()
    kept.CopyFrom(plan)
    del kept.new_requests[:], kept.slots[:], kept.num_scheduled_tokens[:], kept.num_new_blocks[:]
    del kept.new_block_ids[:], kept.replaced_slots[:], kept.replaced_block_indices[:]
    del kept.replaced_block_ids[:]
    kept.new_requests.extend(new for new in plan.new_requests if new.slot not in left_out)
    for s, idx, b in zip(
        plan.replaced_slots, plan.replaced_block_indices, plan.replaced_block_ids, strict=True
    ):
        if s not in left_out:
            kept.replaced_slots.append(s)
            kept.replaced_block_indices.append(idx)
            kept.replaced_block_ids.append(b)
    pos = 0
    for s, k, nb in zip(plan.slots, plan.num_scheduled_tokens, plan.num_new_blocks, strict=True):
        if s not in left_out:
            kept.slots.append(s)
            kept.num_scheduled_tokens.append(k)
            kept.num_new_blocks.append(nb)
            kept.new_block_ids.extend(plan.new_block_ids[pos : pos + nb])
        pos += nb
    return kept


@dataclass
class SeqLog:
    tokens: list[int] = field(default_factory=list)
    finish_reason: int = common_pb2.FINISH_REASON_UNSPECIFIED
    stop_token_id: int | None = None
    num_cached_tokens: int = 0


class Driver:
    """Scheduler -> PlanBuilder -> FakeWorker, with `lag` results held back (pipelining)."""

    def __init__(
        self,
        scheduler: Scheduler,
        lag: int = 0,
        check=None,
        refuse=None,
        strict: bool = True,
        markov: bool = False,
    ) -> None:
        cfg = scheduler.config
        self.scheduler = scheduler
        self.builder = PlanBuilder()
        self.worker = FakeWorker(cfg.num_blocks, cfg.block_size, refuse=refuse, strict=strict, markov=markov)
        # What each request added through add() was, to recompute it as the engine does (see _take_failures).
        self.originals: dict[str, engine_pb2.GenerateTokensRequest] = {}
        self.eos: dict[str, frozenset[int]] = {}
        self.lag = lag
        self.check = check  # called after every schedule and every update
        self.in_flight: deque[tuple[SchedulerOutput, worker_pb2.StepResult]] = deque()
        self.logs: dict[tuple[str, int], SeqLog] = {}
        self.outputs: list[SchedulerOutput] = []
        self.plans: list[worker_pb2.StepPlan] = []
        # Requests the core failed alone (Scheduler.take_failures), in order.
        self.failures: list[RequestFailure] = []

    def add(self, request: Request) -> None:
        """Add a new request, remembering it so that it can be recomputed."""
        self.originals[request.request_id] = engine_pb2.GenerateTokensRequest(
            request_id=request.request_id,
            prompt_token_ids=request.token_ids[: request.prompt_len],
            sampling=request.sampling,
            cache_salt=request.cache_salt,
            priority=request.priority,
        )
        self.eos[request.request_id] = request.eos_token_ids
        self.scheduler.add_request(request)

    def _take_failures(self) -> None:
        """Keep the failures; recompute each request the core gave back (retry) as the engine does: from
        what its client has seen (RequestStream.core_requests)."""
        for failure in self.scheduler.take_failures():
            self.failures.append(failure)
            if not failure.retry:
                continue
            msg, eos = self.originals[failure.request_id], self.eos[failure.request_id]
            logs = [self.logs.get((msg.request_id, i), SeqLog()) for i in range(max(1, msg.sampling.n))]
            if not any(log.tokens or log.finish_reason for log in logs):
                self.scheduler.add_request(Request.from_generate_request(msg, eos, 0.0))
                continue
            for index, log in enumerate(logs):
                if not log.finish_reason:
                    self.scheduler.add_request(Request.resume(msg, index, log.tokens, eos, 0.0))

    def schedule(self) -> SchedulerOutput:
        out = self.scheduler.schedule()
        plan = self.builder.build(out).plan
        self._take_failures()
        result = self.worker.execute(plan)
        sampled = self.builder.requests_at(out.step_id, list(result.sampled_slots))
        assert sampled == [r for r in out.sampled if self.builder.slot_of(r) not in result.refused_slots]
        self.outputs.append(out)
        self.plans.append(plan)
        self.in_flight.append((out, result))
        if self.check:
            self.check()
        return out

    def update(self) -> list[RequestOutput]:
        out, result = self.in_flight.popleft()
        refused = None
        if result.refused_slots:
            by_slot = self.builder.requests_by_slot(out.step_id)
            refused = {
                by_slot[s]: m for s, m in zip(result.refused_slots, result.refused_messages, strict=True)
            }
        outputs = self.scheduler.update_from_output(out, result, refused)
        self.record(outputs)
        self._take_failures()
        if self.check:
            self.check()
        return outputs

    def record(self, outputs: list[RequestOutput]) -> None:
        for o in outputs:
            log = self.logs.setdefault((o.request_id, o.index), SeqLog())
            assert not log.finish_reason, f"{o.request_id}/{o.index} got output after finishing"
            log.tokens.extend(o.new_token_ids)
            log.finish_reason = o.finish_reason
            log.stop_token_id = o.stop_token_id
            log.num_cached_tokens = o.num_cached_tokens
            assert o.num_output_tokens == len(log.tokens)

    def abort(self, request_id: str) -> list[RequestOutput]:
        outputs = self.scheduler.abort_request(request_id)
        self.record(outputs)
        return outputs

    def step(self) -> SchedulerOutput:
        out = self.schedule()
        while len(self.in_flight) > self.lag:
            self.update()
        return out

    def drain(self) -> None:
        while self.in_flight:
            self.update()

    def run(self, max_steps: int = 100_000) -> int:
        steps = 0
        while self.scheduler.has_unfinished_requests():
            self.step()
            steps += 1
            assert steps <= max_steps, "requests did not finish"
        self.drain()
        return steps


def make_request(
    request_id: str,
    prompt: list[int],
    *,
    eos: int | None = EOS,
    salt: str = "",
    priority: int = 0,
    **sampling,
) -> Request:
    """A request as the engine builds it; sampling takes SamplingParams fields (max_tokens=...)."""
    return Request(
        request_id=request_id,
        token_ids=list(prompt),
        prompt_len=len(prompt),
        sampling=common_pb2.SamplingParams(**sampling),
        eos_token_ids=frozenset() if eos is None else frozenset({eos}),
        cache_salt=salt,
        priority=priority,
    )


def check_invariants(scheduler: Scheduler) -> None:
    """Block accounting of a scheduler, exactly:
    - a block's reference count == the number of block table entries (of live requests) holding
      it; the prefix trie holds blocks without counting;
    - every block is exactly one of: free (uncached, ref 0), cached and unreferenced, in use;
    - a request's table has ceil(num_computed_tokens / block_size) entries, where
      num_computed_tokens counts the tokens of every plan built so far (in flight included);
    - the trie path of a request's cached blocks is its table's prefix;
    - with no live request, no block is in use."""
    kv = scheduler.kv
    pool, cache = kv.pool, kv.cache
    bs = scheduler.config.block_size
    holders = [0] * pool.num_blocks
    live = [r for group in scheduler._requests.values() for r in group]
    assert sorted(map(id, live)) == sorted(map(id, scheduler.running + scheduler.waiting))
    # The waiting queue's weights: sequences (forks to come included) and their prompt plus max_output_tokens.
    seqs = [1 + len(r.pending_forks) for r in scheduler.waiting]
    assert scheduler.num_waiting_seqs == sum(seqs)
    assert scheduler.num_waiting_tokens == sum(
        k * (r.prompt_len + r.max_output_tokens) for k, r in zip(seqs, scheduler.waiting, strict=True)
    )
    for req in live:
        if req.status is RequestStatus.WAITING:
            assert not req.block_table and req.num_computed_tokens == 0
        assert len(req.block_table) == -(-req.num_computed_tokens // bs), req
        # Drafts in flight (speculative decoding) are computed past the known and pending tokens.
        assert req.num_computed_tokens <= req.num_tokens + len(req.draft_token_ids)
        assert (
            req.num_output_tokens + req.num_pending_tokens + len(req.draft_token_ids) <= req.max_output_tokens
        )
        assert req.num_output_tokens + req.num_pending_tokens <= req.max_output_tokens
        for b in req.block_table:
            holders[b] += 1
        if req.cache_node is not None:
            chain = []
            node = req.cache_node
            while node.parent is not None:
                assert node.alive
                chain.append(node.block_id)
                node = node.parent
            assert chain[::-1] == req.block_table[: req.num_cached_blocks]
    assert holders == pool.ref_counts
    free = pool.free_block_ids()
    assert len(set(free)) == len(free)
    assert all(pool.ref_counts[b] == 0 for b in free), "a block is both free and referenced"
    cached_unref = 0
    if cache is not None:
        assert not any(cache.is_cached(b) for b in free)
        for node in cache.cached_nodes():
            assert node.alive and node.parent is not None and node.parent.children[node.key] is node
            assert node.referenced == (pool.ref_counts[node.block_id] > 0)
            if not node.referenced:
                cached_unref += 1
                # NOTE: whoever holds a node holds its ancestors, so nothing below is held.
                assert all(not c.referenced for c in node.children.values())
        assert cached_unref == cache.num_evictable
        # Per-salt state is bounded: a root lives while it has blocks, and there are at most the cap.
        roots = cache.roots()
        assert len(roots) <= scheduler.config.max_cache_salts
        assert all(
            r.alive and r.parent is None and r.children and cache.find_root(r.salt) is r for r in roots
        )
        for node in cache.cached_nodes():
            top = node
            while top.parent is not None:
                top = top.parent
            assert top.alive and cache.find_root(top.salt) is top, "a cached block under a dead root"
    in_use = sum(1 for c in pool.ref_counts if c > 0)
    assert len(free) + cached_unref + in_use == pool.num_blocks
    assert pool.num_used_blocks == in_use
    if not live:
        assert in_use == 0, "blocks leaked"
