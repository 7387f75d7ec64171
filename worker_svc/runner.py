"""The worker's executor: applies step plans (proto/pagedserve/v1/worker.proto) to its per-slot state and
KV pool, runs one forward pass over the plan's flat batch, samples, and answers with a StepResult.

The state of a live request is split in two: the small Python record (`SlotState`) and rows of two
persistent arrays indexed by slot, its token ids and its block table (step_inputs.SlotArrays), from which
every step's model inputs are built and into which its sampled tokens go.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pagedserve.errors import InvalidRequestError
from pagedserve.v1 import common_pb2, worker_pb2
from pagedserve.validation import Limits, check_sampling
from pagedserve.worker_svc.cuda_graphs import DecodeGraphs, GraphCapture
from pagedserve.worker_svc.kv_cache import KVCache
from pagedserve.worker_svc.model import CausalLM
from pagedserve.worker_svc.sampler import Sampler, SamplingMetadata, SlotSamplingState, compute_logprobs
from pagedserve.worker_svc.spec_decode import (
    num_accepted,
    plan_drafts,
    position_states,
    propose_layer_drafts,
    verify_rows,
)
from pagedserve.worker_svc.step_inputs import SlotArrays, StepInputs, as_tensor

# A plan is input too: the worker checks each new request's sampling as the scheduler did, against the same
# limits but for `n`, which the scheduler bounds by its own --max-num-seqs (forks arrive one per slot).
_WORKER_LIMITS = Limits(max_n=(1 << 32) - 1)

# Slots are small integers picked by the scheduler; this bounds the per-slot arrays.
MAX_SLOTS = 1 << 16


class PlanError(InvalidRequestError):
    """A plan that breaks the step protocol; the runner's state is as it was before the plan."""


@dataclass(slots=True)
class SlotState:
    request_id: str  # for logs (forks share it)
    prompt_len: int  # leading tokens that are the prompt
    num_tokens: int  # tokens known: prompt + sampled; ids in SlotArrays.token_ids[slot, :num_tokens]
    num_computed_tokens: int  # leading tokens whose K/V are in the cache
    num_blocks: int  # block table length; ids in SlotArrays.block_tables[slot, :num_blocks]
    sampling: SlotSamplingState  # parameters and output history for penalties


@dataclass(slots=True)
class _Batch:
    slots: np.ndarray  # int64 [S]: scheduled slots, in plan order
    num_scheduled: np.ndarray  # int64 [S]: tokens computed per slot
    start: np.ndarray  # int64 [S]: num_computed_tokens before the step
    query_start_loc: np.ndarray  # int64 [S+1]: row offsets of each slot's tokens
    num_tokens: int  # T, rows of the batch


class ModelRunner:
    """Stateful executor of step plans; one instance per worker, used from one thread at a time."""

    def __init__(
        self,
        model: CausalLM,
        kv_cache: KVCache,
        max_model_len: int,
        sampler: Sampler | None = None,
    ):
        self.model = model
        self.kv_cache = kv_cache
        self.device = kv_cache.device
        self.block_size = kv_cache.block_size
        self.num_blocks = kv_cache.num_blocks
        self.max_model_len = max_model_len
        self.vocab_size = model.config.vocab_size
        self.ops = model.ops  # the kernel ops the model runs on
        self.sampler = sampler or Sampler(self.vocab_size, self.device)
        # 32-bit words of one token mask (StepPlan.token_masks).
        self._mask_words = (self.vocab_size + 31) // 32
        self._kv_layers = kv_cache.layers
        # Each live slot's token ids and block table.
        self.arrays = SlotArrays(max_model_len, self.block_size, self.device)
        self.slots: dict[int, SlotState] = {}
        # Slots whose NewRequest was refused (see _refusals), with why: left out of every plan that
        # schedules them until a plan frees them; the scheduler fails their requests meanwhile.
        self.refused: dict[int, str] = {}
        # Live slots whose tokens the sampler draws: any but argmax_only ones (see SlotSamplingState).
        self._sampler_slots: set[int] = set()
        self.last_step_id = 0
        self._idle_since: float | None = None
        # Captured plain decode steps (CUDA graphs), where the worker captured them.
        self.graphs: DecodeGraphs | None = None

    # ---- public API -------------------------------------------------------------------------------

    def capture_decode_graphs(self, sizes: Sequence[int], capture: GraphCapture) -> None:
        """Capture the plain decode step for batches of `sizes` sequences (see cuda_graphs); plain decode
        steps that fit one of them replay it from then on."""
        max_blocks = math.ceil(self.max_model_len / self.block_size)
        self.graphs = DecodeGraphs(self.model, self._kv_layers, sizes, max_blocks, capture)

    def reset(self) -> None:
        """Forget every request; the next plan must have step id 1."""
        self.slots.clear()
        self.refused.clear()
        self._sampler_slots.clear()
        self.last_step_id = 0
        self._idle_since = None

    @torch.inference_mode()
    def execute(
        self,
        plan: worker_pb2.StepPlan,
        received_at: float | None = None,
        before_forward: Callable[[], None] | None = None,
        result: worker_pb2.StepResult | None = None,
    ) -> worker_pb2.StepResult:
        """Validate, apply and run one plan. `received_at` (time.perf_counter()) is when the plan
        arrived, for the idle time; default: now. `before_forward`, if given, is called once the plan
        is valid and the model's inputs are built, right before the forward pass (not at all for a plan
        without tokens to compute, nor for a refused one). `result` is the empty StepResult to fill and
        return (the server passes the `result` of the StepsResponse it sends, so it is built in place);
        default: a new one."""
        t0 = time.perf_counter()
        received_at = t0 if received_at is None else received_at
        idle = 0.0 if self._idle_since is None else max(0.0, received_at - self._idle_since)
        gap = 0.0 if self._idle_since is None else t0 - self._idle_since
        result = worker_pb2.StepResult() if result is None else result
        decode = self._plain_decode(plan)
        if decode is not None:
            t1, t2 = self._execute_decode(plan, *decode, before_forward, result)
            batch_tokens = len(decode[0])
        else:
            t1, t2, batch_tokens = self._execute_plan(plan, before_forward, result)
        t3 = time.perf_counter()
        self.last_step_id = plan.step_id
        self._idle_since = t3
        result.timings.idle_seconds = idle
        result.timings.gap_seconds = gap
        result.timings.prepare_seconds = t1 - t0
        result.timings.forward_seconds = t2 - t1
        result.timings.sample_seconds = t3 - t2
        result.timings.num_tokens = batch_tokens
        return result

    def _execute_plan(
        self,
        plan: worker_pb2.StepPlan,
        before_forward: Callable[[], None] | None,
        result: worker_pb2.StepResult,
    ) -> tuple[float, float, int]:
        """Any plan, its outcome written into result: the start and end of its forward pass, and the tokens
        it computed."""
        refused = self._refusals(plan) if plan.new_requests or self.refused else None
        if refused:
            plan = _without_slots(plan, refused)
        self._validate(plan)
        self._apply(plan)
        result.step_id = plan.step_id
        if refused:
            self.refused.update(refused)
            result.refused_slots.extend(refused)
            result.refused_messages.extend(refused.values())
        batch = self._batch(plan)
        t1 = t2 = time.perf_counter()
        if batch is None:
            return t1, t2, 0
        drafts = self._write_drafts(plan, batch)
        inputs = self.arrays.inputs(batch.slots.tolist(), batch.start.tolist(), batch.num_scheduled.tolist())
        sample_idx, prompt_rows = self._logits_rows(batch, drafts)
        # The model returns the final states of these rows alone; sample rows alone come in order, and all of
        # them (a decode step) are every row. A slot with drafts samples at each of its drafts' rows too.
        sample_rows = batch.query_start_loc[1:][sample_idx] - 1
        if drafts:
            sample_rows = verify_rows(
                sample_rows, [len(drafts.get(s, ())) for s in batch.slots[sample_idx].tolist()]
            )
        output_rows = None
        if prompt_rows or len(sample_rows) != batch.num_tokens:
            rows = [sample_rows, *(r for _, r in prompt_rows)]
            output_rows = as_tensor(np.concatenate(rows).astype(np.int64, copy=False), self.device)
        logits, t1, t2 = self._forward(inputs, output_rows, before_forward)
        self._sample(batch, sample_idx, logits[: len(sample_rows)], result, self._token_masks(plan), drafts)
        if plan.num_draft_layers:  # the drafts the worker proposed, for the scheduler (worker.proto)
            for slot in result.sampled_slots:
                result.draft_token_ids.extend(drafts.get(slot, ()))
        self._prompt_logprobs(batch, prompt_rows, logits[len(sample_rows) :], result)
        return t1, t2, batch.num_tokens

    # ---- the steady state: a plain decode step --------------------------------------------------------

    def _plain_decode(self, plan: worker_pb2.StepPlan) -> tuple[list[int], list[SlotState]] | None:
        """The slots and states of a valid plain decode step: live slots, each scheduled once for the one
        token that completes it (so that it samples), blocks appended at most, nothing freed, added,
        replaced or copied. Else None: the general path takes the plan, and refuses it if it is broken (see
        _validate, which accepts every plan this does).

        NOTE: the steady state of decoding, taken with as little Python as it needs: this and the rest of
        the step's Python between two forward passes run cold, the caches full of the weights, where each
        protobuf field, numpy or torch call and object costs microseconds (docs/performance.md)."""
        if (
            plan.step_id != self.last_step_id + 1
            or plan.finished_slots
            or plan.preempted_slots
            or plan.new_requests
            or plan.replaced_slots
            or plan.replaced_block_indices
            or plan.replaced_block_ids
            or plan.copy_src_blocks
            or plan.copy_dst_blocks
            or plan.draft_slots
        ):
            return None
        slots = list(plan.slots)
        n = len(slots)
        if plan.mask_slots:
            # Every slot of a plain decode samples, so any of them may carry a mask (as _validate checks).
            masked = set(plan.mask_slots)
            if (
                len(masked) != len(plan.mask_slots)
                or not masked <= set(slots)
                or len(plan.token_masks) != len(masked) * self._mask_words * 4
            ):
                return None
        appended = plan.num_new_blocks
        if n == 0 or len(set(slots)) != n or len(appended) != n or len(plan.num_scheduled_tokens) != n:
            return None
        if set(plan.num_scheduled_tokens) != {1}:
            return None
        new_ids = plan.new_block_ids
        if sum(appended) != len(new_ids) or (new_ids and max(new_ids) >= self.num_blocks):
            return None
        get = self.slots.get
        states = [get(slot) for slot in slots]
        limit, block_size = self.max_model_len, self.block_size
        for state, more in zip(states, appended, strict=True):
            if state is None:
                return None
            end = state.num_computed_tokens + 1
            if end != state.num_tokens or end > limit or (state.num_blocks + more) * block_size < end:
                return None
        return slots, states

    def _execute_decode(
        self,
        plan: worker_pb2.StepPlan,
        slots: list[int],
        states: list[SlotState],
        before_forward: Callable[[], None] | None,
        result: worker_pb2.StepResult,
    ) -> tuple[float, float]:
        """A plain decode step (see _plain_decode), its outcome written into result: the same state, inputs
        and result as the general path's, which test_worker_runner checks. Returns the start and end of its
        forward pass."""
        if plan.new_block_ids:
            self._append_blocks(plan)
        start = [state.num_computed_tokens for state in states]
        inputs = self.arrays.inputs(slots, start, None)
        logits, t1, t2 = self._forward(inputs, None, before_forward, self.graphs)
        result.step_id = plan.step_id
        for state in states:
            state.num_computed_tokens += 1
        if self._sampler_slots or plan.mask_slots:
            self._sample_rows(slots, states, logits, result, self._token_masks(plan))
            return t1, t2
        # Every live slot is argmax_only: its token is its row's argmax, at start + 1 (its num_tokens).
        tokens = self.arrays.append(slots, [state.num_tokens for state in states], self.ops.argmax(logits))
        for state, token in zip(states, tokens, strict=True):
            state.num_tokens += 1
            state.sampling.append_output(token)
        result.sampled_slots.extend(slots)
        result.sampled_token_ids.extend(tokens)
        result.num_top_logprobs.extend([0] * len(slots))
        return t1, t2

    def _forward(
        self,
        inputs: StepInputs,
        output_rows: torch.Tensor | None,
        before_forward: Callable[[], None] | None,
        graphs: DecodeGraphs | None = None,
    ) -> tuple[torch.Tensor, float, float]:
        """The forward pass: the logits of its output rows (every row when None), and its start and end; a
        plain decode step's by replaying a captured graph where `graphs` holds its size."""
        if before_forward is not None:
            before_forward()
        t1 = time.perf_counter()
        logits = graphs.run(inputs) if graphs is not None else None
        if logits is None:
            hidden = self.model(inputs.input_ids, inputs.positions, inputs.attn, self._kv_layers, output_rows)
            logits = self.model.compute_logits(hidden)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return logits, t1, time.perf_counter()

    # ---- reading the state ------------------------------------------------------------------------

    def tokens(self, slot: int) -> list[int]:
        """Token ids known for a live slot (prompt + sampled)."""
        state = self.slots[slot]
        return self.arrays.token_ids[slot, : state.num_tokens].tolist()

    def block_table(self, slot: int) -> list[int]:
        state = self.slots[slot]
        return self.arrays.block_tables[slot, : state.num_blocks].tolist()

    # ---- validation: everything is checked before anything changes -------------------------------

    def _validate(self, plan: worker_pb2.StepPlan) -> None:
        step = plan.step_id

        def fail(message: str) -> None:
            raise PlanError(f"step {step}: {message}")

        if step != self.last_step_id + 1:
            fail(f"expected step id {self.last_step_id + 1} (a gap or a repeat)")

        def check_block_ids(ids: Iterable[int], what: str) -> None:
            ids = list(ids)
            if ids and max(ids) >= self.num_blocks:
                fail(f"{what} block id {max(ids)} is out of range (the pool has {self.num_blocks} blocks)")

        # 1. finished and preempted slots must be live, each freed once.
        freed: set[int] = set()
        for kind, slots in (("finished", plan.finished_slots), ("preempted", plan.preempted_slots)):
            for slot in slots:
                if slot not in self.slots and slot not in self.refused:
                    fail(f"{kind} slot {slot} is not live")
                if slot in freed:
                    fail(f"slot {slot} is freed twice")
                freed.add(slot)

        # 2. new requests take free slots (one freed in this plan is free).
        new: dict[int, worker_pb2.NewRequest] = {}
        for req in plan.new_requests:
            slot, n = req.slot, len(req.token_ids)
            where = f"new request {req.request_id!r} (slot {slot})"
            if slot >= MAX_SLOTS:
                fail(f"{where}: slot is out of range (max {MAX_SLOTS - 1})")
            if ((slot in self.slots or slot in self.refused) and slot not in freed) or slot in new:
                fail(f"{where}: slot {slot} is live")
            # NOTE: its own content (tokens, lengths, sampling) was checked by _refusals, which leaves a
            # refused one out of the plan.
            new[slot] = req

        def live(slot: int) -> bool:
            return (slot in self.slots and slot not in freed) or slot in new

        def table_len(slot: int) -> int:
            return 0 if slot in new else self.slots[slot].num_blocks

        # 3. block table replacements, then appends.
        if not len(plan.replaced_slots) == len(plan.replaced_block_indices) == len(plan.replaced_block_ids):
            fail("replaced_slots, replaced_block_indices and replaced_block_ids differ in length")
        check_block_ids(plan.replaced_block_ids, "replaced")
        for slot, index in zip(plan.replaced_slots, plan.replaced_block_indices, strict=True):
            if not live(slot):
                fail(f"replaced slot {slot} is not live")
            if index >= table_len(slot):
                fail(f"slot {slot}: replaced block index {index} is beyond its {table_len(slot)} blocks")

        # 4. copies.
        if len(plan.copy_src_blocks) != len(plan.copy_dst_blocks):
            fail("copy_src_blocks and copy_dst_blocks differ in length")
        check_block_ids(plan.copy_src_blocks, "copy source")
        check_block_ids(plan.copy_dst_blocks, "copy destination")

        # 5. the batch.
        if not len(plan.slots) == len(plan.num_scheduled_tokens) == len(plan.num_new_blocks):
            fail("slots, num_scheduled_tokens and num_new_blocks differ in length")
        if sum(plan.num_new_blocks) != len(plan.new_block_ids):
            fail(
                f"num_new_blocks sum to {sum(plan.num_new_blocks)} but {len(plan.new_block_ids)} new_block_ids"
            )
        check_block_ids(plan.new_block_ids, "new")
        try:
            drafts = plan_drafts(plan)
        except ValueError as error:
            fail(str(error))
        if plan.num_draft_layers:
            if not hasattr(self.model, "draft_forward"):
                fail("self-speculative drafts (num_draft_layers) are not supported under tensor parallelism")
            if plan.num_draft_layers >= self.model.config.num_layers:
                fail(
                    f"num_draft_layers {plan.num_draft_layers} is not below the model's "
                    f"{self.model.config.num_layers} layers"
                )
        elif drafts and max(plan.draft_token_ids) >= self.vocab_size:
            fail(f"draft token id {max(plan.draft_token_ids)} is outside the vocabulary ({self.vocab_size})")
        scheduled: set[int] = set()
        sampling: set[int] = set()
        for slot, n, appended in zip(plan.slots, plan.num_scheduled_tokens, plan.num_new_blocks, strict=True):
            if not live(slot):
                fail(f"slot {slot} is not live")
            if slot in scheduled:
                fail(f"slot {slot} is scheduled twice")
            scheduled.add(slot)
            if n == 0:
                fail(f"slot {slot}: num_scheduled_tokens is 0")
            if slot in new:
                computed, known = new[slot].num_computed_tokens, len(new[slot].token_ids)
            else:
                state = self.slots[slot]
                computed, known = state.num_computed_tokens, state.num_tokens
            known += len(drafts.get(slot, ()))  # the drafts follow its known tokens
            end = computed + n
            if end > known:
                fail(f"slot {slot}: {n} tokens scheduled after {computed} computed, but it has only {known}")
            if end == known:
                sampling.add(slot)
            if end > self.max_model_len:
                fail(f"slot {slot}: position {end - 1} is beyond max_model_len {self.max_model_len}")
            blocks = table_len(slot) + appended
            if blocks * self.block_size < end:
                fail(
                    f"slot {slot}: block table of {blocks} blocks holds {blocks * self.block_size} tokens, "
                    f"{end} needed"
                )
        for slot, req in new.items():
            if slot not in scheduled and req.num_computed_tokens > 0:
                fail(f"slot {slot}: {req.num_computed_tokens} computed tokens but no block table")

        for slot in drafts:
            if slot not in sampling:
                fail(f"slot {slot} has drafts but does not sample after them this step")
            sp = new[slot].sampling if slot in new else None
            if (sp is not None and sp.HasField("logprobs")) or (
                sp is None and self.slots[slot].sampling.logprobs is not None
            ):
                fail(f"slot {slot} has drafts and asks for logprobs")
        if drafts.keys() & set(plan.mask_slots):
            fail("a slot has both drafts and a token mask")

        # 6. token masks: one per constrained slot that samples this step.
        if len(set(plan.mask_slots)) != len(plan.mask_slots):
            fail("a slot has two token masks")
        for slot in plan.mask_slots:
            if slot not in sampling:
                fail(f"slot {slot} has a token mask but does not sample this step")
        mask_bytes = len(plan.mask_slots) * self._mask_words * 4
        if len(plan.token_masks) != mask_bytes:
            fail(f"token_masks holds {len(plan.token_masks)} bytes, {mask_bytes} expected for its mask_slots")

    def _refusal(self, req: worker_pb2.NewRequest) -> str | None:
        """What is wrong with a new request's own content (its tokens, lengths and sampling), or None."""
        n = len(req.token_ids)
        if n == 0:
            return "no token ids"
        if not 0 < req.prompt_len <= n:
            return f"prompt_len {req.prompt_len} is not in 1..{n} (its token count)"
        if req.num_computed_tokens > n:
            return f"num_computed_tokens {req.num_computed_tokens} exceeds its {n} tokens"
        if max(req.token_ids) >= self.vocab_size:
            return f"token id {max(req.token_ids)} is outside the vocabulary ({self.vocab_size})"
        try:
            check_sampling(req.sampling, limits=_WORKER_LIMITS, vocab_size=self.vocab_size)
        except InvalidRequestError as exc:
            return exc.message
        return None

    def _refusals(self, plan: worker_pb2.StepPlan) -> dict[int, str]:
        """The slots to leave out of this plan, with why: new requests whose content is refused (each fails
        alone, the rest of the plan runs) and slots refused before that the plan schedules again. No side
        effect. Nothing is left out of a plan whose new requests break the protocol (a slot out of range,
        live or taken twice): _validate refuses it whole."""
        freed = {*plan.finished_slots, *plan.preempted_slots}
        refused = {}
        if self.refused:
            touched = {*plan.slots, *plan.replaced_slots}
            refused = {s: message for s, message in self.refused.items() if s in touched and s not in freed}
        taken: set[int] = set()
        for req in plan.new_requests:
            slot = req.slot
            if (
                slot >= MAX_SLOTS
                or slot in taken
                or ((slot in self.slots or slot in self.refused) and slot not in freed)
            ):
                return {}  # the plan breaks the protocol: _validate refuses it whole
            taken.add(slot)
            if (problem := self._refusal(req)) is not None:
                refused[slot] = f"new request {req.request_id!r} (slot {slot}): {problem}"
        return refused

    # ---- applying a plan, in the order worker.proto gives ----------------------------------------

    def _apply(self, plan: worker_pb2.StepPlan) -> None:
        for slot in (*plan.finished_slots, *plan.preempted_slots):
            if self.refused.pop(slot, None) is None:
                del self.slots[slot]
                self._sampler_slots.discard(slot)
        for req in plan.new_requests:
            n = len(req.token_ids)
            self.arrays.reserve(req.slot, n + 1, 0)
            self.arrays.token_ids[req.slot, :n] = req.token_ids
            sampling = _sampling_state(req)
            self.slots[req.slot] = SlotState(
                request_id=req.request_id,
                prompt_len=req.prompt_len,
                num_tokens=n,
                num_computed_tokens=req.num_computed_tokens,
                num_blocks=0,
                sampling=sampling,
            )
            if not sampling.argmax_only:
                self._sampler_slots.add(req.slot)
        for slot, index, block in zip(
            plan.replaced_slots, plan.replaced_block_indices, plan.replaced_block_ids, strict=True
        ):
            self.arrays.block_tables[slot, index] = block
        self._append_blocks(plan)
        if plan.copy_src_blocks:
            src = torch.tensor(plan.copy_src_blocks, dtype=torch.int64, device=self.device)
            dst = torch.tensor(plan.copy_dst_blocks, dtype=torch.int64, device=self.device)
            self.ops.copy_blocks(self.kv_cache.k_caches, self.kv_cache.v_caches, src, dst)

    def _append_blocks(self, plan: worker_pb2.StepPlan) -> None:
        offset = 0
        for slot, appended in zip(plan.slots, plan.num_new_blocks, strict=True):
            if appended:
                state = self.slots[slot]
                self.arrays.reserve(slot, 0, state.num_blocks + appended)
                ids = plan.new_block_ids[offset : offset + appended]
                self.arrays.block_tables[slot, state.num_blocks : state.num_blocks + appended] = ids
                state.num_blocks += appended
                offset += appended

    # ---- the batch --------------------------------------------------------------------------------

    def _batch(self, plan: worker_pb2.StepPlan) -> _Batch | None:
        if not plan.slots:
            return None
        # NOTE: np.fromiter reads a repeated protobuf field faster than np.asarray; np.add.accumulate, not
        # np.cumsum, whose Python wrapper is one more cold call.
        n = len(plan.slots)
        slots = np.fromiter(plan.slots, np.int64, n)
        num_scheduled = np.fromiter(plan.num_scheduled_tokens, np.int64, n)
        start = np.fromiter((self.slots[s].num_computed_tokens for s in plan.slots), np.int64, n)
        query_start_loc = np.zeros(n + 1, dtype=np.int64)
        np.add.accumulate(num_scheduled, out=query_start_loc[1:])
        return _Batch(slots, num_scheduled, start, query_start_loc, int(query_start_loc[-1]))

    def _logits_rows(
        self, b: _Batch, drafts: dict[int, list[int]]
    ) -> tuple[np.ndarray, list[tuple[int, np.ndarray]]]:
        """Batch indices that sample (their known tokens and drafts are all computed after this step), and per
        batch index asking for prompt logprobs, the rows whose logits score a prompt token."""
        sample_idx = []
        prompt_rows = []
        for i, slot in enumerate(b.slots.tolist()):
            state = self.slots[slot]
            end = int(b.start[i] + b.num_scheduled[i])
            if end == state.num_tokens + (len(drafts[slot]) if slot in drafts else 0):
                sample_idx.append(i)
            if state.sampling.prompt_logprobs is not None:
                # Row of position q scores token q + 1; prompt tokens 1..prompt_len-1 have a score.
                last = min(end, state.prompt_len - 1)
                if last > b.start[i]:
                    first_row = b.query_start_loc[i]
                    prompt_rows.append((i, np.arange(first_row, first_row + last - b.start[i])))
        return np.asarray(sample_idx, dtype=np.int64), prompt_rows

    # ---- sampling and the result ------------------------------------------------------------------

    def _token_masks(self, plan: worker_pb2.StepPlan) -> tuple[list[int], np.ndarray] | None:
        """The plan's masked slots and their masks, int32 [len(mask_slots), words]; None when none."""
        if not plan.mask_slots:
            return None
        words = np.frombuffer(plan.token_masks, dtype="<i4").reshape(len(plan.mask_slots), self._mask_words)
        return list(plan.mask_slots), words

    def _sample(
        self,
        b: _Batch,
        sample_idx: np.ndarray,
        logits: torch.Tensor,
        result: worker_pb2.StepResult,
        masks: tuple[list[int], np.ndarray] | None = None,
        drafts: dict[int, list[int]] | None = None,
    ) -> None:
        # Every scheduled slot's tokens advance, whether it samples or not (a prefill chunk).
        for slot, n in zip(b.slots.tolist(), b.num_scheduled.tolist(), strict=True):
            self.slots[slot].num_computed_tokens += n
        if len(sample_idx) == 0:
            return
        slots = b.slots[sample_idx].tolist()
        if drafts:
            self._verify_drafts(slots, [self.slots[s] for s in slots], logits, result, masks, drafts)
        else:
            self._sample_rows(slots, [self.slots[s] for s in slots], logits, result, masks)

    def _sample_rows(
        self,
        slots: list[int],
        states: list[SlotState],
        logits: torch.Tensor,
        result: worker_pb2.StepResult,
        masks: tuple[list[int], np.ndarray] | None = None,
    ) -> None:
        """Sample a token for each of these slots from its row of logits (among the tokens its mask allows,
        when it has one), append it and write the result."""
        meta = SamplingMetadata.build([s.sampling for s in states], self.vocab_size, self.device)
        self._mask_rows(meta, slots, masks)
        out = self.sampler(logits, meta)
        token_ids = self.arrays.append(slots, [state.num_tokens for state in states], out.token_ids)
        for state, token in zip(states, token_ids, strict=True):
            state.num_tokens += 1
            state.sampling.append_output(token)
        result.sampled_slots.extend(slots)
        result.sampled_token_ids.extend(token_ids)
        # NOTE: left empty when no slot of the step asked for logprobs (the scheduler reads them only then).
        if meta.any_logprobs:
            result.sampled_logprobs.extend(out.logprobs.tolist())
            result.sampled_ranks.extend(out.ranks.tolist())
        if meta.max_num_logprobs:
            top_ids, top_logprobs = out.top_ids.tolist(), out.top_logprobs.tolist()
            for row, state in enumerate(states):
                k = state.sampling.logprobs or 0
                result.num_top_logprobs.append(k)
                result.top_token_ids.extend(top_ids[row][:k])
                result.top_logprobs.extend(top_logprobs[row][:k])
        else:
            result.num_top_logprobs.extend([0] * len(slots))

    def _mask_rows(
        self, meta: SamplingMetadata, row_slots: list[int], masks: tuple[list[int], np.ndarray] | None
    ) -> None:
        """Give meta the token masks of the masked slots, row_slots naming each row's slot."""
        if masks is None:
            return
        mask_slots, words = masks
        rows = None
        if mask_slots != row_slots:  # NOTE: every row, in order, is the common case and needs no scatter
            row_of = {slot: row for row, slot in enumerate(row_slots)}
            rows = torch.tensor([row_of[slot] for slot in mask_slots], dtype=torch.int64).to(self.device)
        meta.token_mask = (rows, torch.from_numpy(words.copy()).to(self.device))

    # ---- speculative decoding (worker.proto; spec_decode) --------------------------------------------

    def _write_drafts(self, plan: worker_pb2.StepPlan, batch: _Batch) -> dict[int, list[int]]:
        """The plan's drafts by slot, written after each slot's known tokens (where the inputs are read from);
        proposed here first when the plan asks the worker to (num_draft_layers, spec_decode)."""
        drafts = plan_drafts(plan)
        if drafts and plan.num_draft_layers:
            slots = list(drafts)
            index = {slot: i for i, slot in enumerate(batch.slots.tolist())}
            proposed = propose_layer_drafts(
                self.model,
                self._kv_layers,
                self.arrays,
                plan.num_draft_layers,
                slots,
                [int(batch.start[index[slot]]) for slot in slots],
                [self.slots[slot].num_tokens for slot in slots],
                [len(drafts[slot]) for slot in slots],
            )
            return dict(zip(slots, proposed, strict=True))
        for slot, tokens in drafts.items():
            n = self.slots[slot].num_tokens
            self.arrays.reserve(slot, n + len(tokens) + 1, 0)
            self.arrays.token_ids[slot, n : n + len(tokens)] = tokens
        return drafts

    def _verify_drafts(
        self,
        slots: list[int],
        states: list[SlotState],
        logits: torch.Tensor,
        result: worker_pb2.StepResult,
        masks: tuple[list[int], np.ndarray] | None,
        drafts: dict[int, list[int]],
    ) -> None:
        """Sample every verified position (logits rows in verify_rows' order), accept each slot's drafts up to the
        first its samples disagree with, append the accepted drafts and the sample after them, drop the rejected
        drafts' computed positions and the blocks past the computed tokens, and write the result."""
        row_states: list[SlotSamplingState] = []
        row_slots: list[int] = []
        for slot, state in zip(slots, states, strict=True):
            slot_drafts = drafts.get(slot, ())
            row_states.extend(
                position_states(state.sampling, slot_drafts) if slot_drafts else (state.sampling,)
            )
            row_slots.extend([slot] * (len(slot_drafts) + 1))
        meta = SamplingMetadata.build(row_states, self.vocab_size, self.device)
        self._mask_rows(meta, row_slots, masks)
        out = self.sampler(logits, meta)
        samples = out.token_ids.tolist()
        final_rows = []
        row = 0
        for slot, state in zip(slots, states, strict=True):
            slot_drafts = drafts.get(slot, ())
            k = len(slot_drafts)
            accepted = num_accepted(samples[row : row + k], slot_drafts) if k else 0
            gained = samples[row : row + accepted + 1]
            final_rows.append(row + accepted)
            row += k + 1
            n = state.num_tokens
            self.arrays.token_ids[slot, n : n + len(gained)] = gained
            state.num_tokens += len(gained)
            for token in gained:
                state.sampling.append_output(token)
            if k:
                state.num_computed_tokens -= k - accepted
                state.num_blocks = min(state.num_blocks, -(-state.num_computed_tokens // self.block_size))
            result.sampled_slots.append(slot)
            result.sampled_token_ids.append(gained[-1])
            result.num_accepted_tokens.append(accepted)
        result.num_top_logprobs.extend([0] * len(slots))
        if meta.any_logprobs:
            index = torch.tensor(final_rows, dtype=torch.int64, device=out.logprobs.device)
            result.sampled_logprobs.extend(out.logprobs[index].tolist())
            result.sampled_ranks.extend(out.ranks[index].tolist())
            if meta.max_num_logprobs:
                del result.num_top_logprobs[-len(slots) :]
                top_ids, top_logprobs = out.top_ids[index].tolist(), out.top_logprobs[index].tolist()
                for i, state in enumerate(states):
                    k = state.sampling.logprobs or 0
                    result.num_top_logprobs.append(k)
                    result.top_token_ids.extend(top_ids[i][:k])
                    result.top_logprobs.extend(top_logprobs[i][:k])

    def _prompt_logprobs(
        self,
        b: _Batch,
        prompt_rows: list[tuple[int, np.ndarray]],
        logits: torch.Tensor,
        result: worker_pb2.StepResult,
    ) -> None:
        offset = 0
        for i, rows in prompt_rows:
            slot = int(b.slots[i])
            state = self.slots[slot]
            first = int(b.start[i]) + 1  # the prompt position scored by the first row
            targets = torch.from_numpy(self.arrays.token_ids[slot, first : first + len(rows)].copy())
            k = state.sampling.prompt_logprobs or 0
            lp = compute_logprobs(logits[offset : offset + len(rows)], targets.to(self.device), k)
            offset += len(rows)
            entry = result.prompt_logprobs.add(slot=slot, start_position=first)
            for token, logprob, rank, top_ids, top_lps in zip(
                targets.tolist(),
                lp.logprobs.tolist(),
                lp.ranks.tolist(),
                lp.top_ids.tolist(),
                lp.top_logprobs.tolist(),
                strict=True,
            ):
                entry.logprobs.append(
                    common_pb2.TokenLogprob(
                        token_id=token,
                        logprob=logprob,
                        rank=rank,
                        top_token_ids=top_ids,
                        top_logprobs=top_lps,
                    )
                )


def _without_slots(plan: worker_pb2.StepPlan, left_out: Iterable[int]) -> worker_pb2.StepPlan:
    """The plan with these slots' new requests, batch entries (and their new blocks) and block table
    replacements left out; a plan whose parallel arrays disagree is returned as it is (_validate refuses it)."""
    n = len(plan.slots)
    if not (
        len(plan.num_scheduled_tokens) == len(plan.num_new_blocks) == n
        and sum(plan.num_new_blocks) == len(plan.new_block_ids)
        and len(plan.replaced_slots) == len(plan.replaced_block_indices) == len(plan.replaced_block_ids)
    ):
        return plan
    left_out = set(left_out)
    kept = worker_pb2.StepPlan(
        step_id=plan.step_id,
        finished_slots=plan.finished_slots,
        preempted_slots=plan.preempted_slots,
        new_requests=[req for req in plan.new_requests if req.slot not in left_out],
        copy_src_blocks=plan.copy_src_blocks,
        copy_dst_blocks=plan.copy_dst_blocks,
    )
    for slot, index, block in zip(
        plan.replaced_slots, plan.replaced_block_indices, plan.replaced_block_ids, strict=True
    ):
        if slot not in left_out:
            kept.replaced_slots.append(slot)
            kept.replaced_block_indices.append(index)
            kept.replaced_block_ids.append(block)
    offset = 0
    for slot, tokens, appended in zip(
        plan.slots, plan.num_scheduled_tokens, plan.num_new_blocks, strict=True
    ):
        if slot not in left_out:
            kept.slots.append(slot)
            kept.num_scheduled_tokens.append(tokens)
            kept.num_new_blocks.append(appended)
            kept.new_block_ids.extend(plan.new_block_ids[offset : offset + appended])
        offset += appended
    if plan.mask_slots and len(plan.token_masks) % len(plan.mask_slots) == 0:
        size = len(plan.token_masks) // len(plan.mask_slots)
        for row, slot in enumerate(plan.mask_slots):
            if slot not in left_out:
                kept.mask_slots.append(slot)
                kept.token_masks += plan.token_masks[row * size : (row + 1) * size]
    else:
        kept.mask_slots.extend(plan.mask_slots)  # broken: _validate refuses it
        kept.token_masks = plan.token_masks
    kept.num_draft_layers = plan.num_draft_layers
    if len(plan.num_draft_tokens) == len(plan.draft_slots) and (
        sum(plan.num_draft_tokens) == len(plan.draft_token_ids)
        or (plan.num_draft_layers and not plan.draft_token_ids)
    ):
        offset = 0
        for slot, k in zip(plan.draft_slots, plan.num_draft_tokens, strict=True):
            if slot not in left_out:
                kept.draft_slots.append(slot)
                kept.num_draft_tokens.append(k)
                kept.draft_token_ids.extend(plan.draft_token_ids[offset : offset + k])
            offset += k
    else:  # broken: _validate refuses it
        kept.draft_slots.extend(plan.draft_slots)
        kept.num_draft_tokens.extend(plan.num_draft_tokens)
        kept.draft_token_ids.extend(plan.draft_token_ids)
    return kept


def _sampling_state(req: worker_pb2.NewRequest) -> SlotSamplingState:
    return SlotSamplingState.from_proto(
        req.sampling, req.token_ids[: req.prompt_len], output_token_ids=req.token_ids[req.prompt_len :]
    )
