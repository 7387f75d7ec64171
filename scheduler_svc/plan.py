"""Turns each SchedulerOutput into the worker's StepPlan: deltas only, requests addressed by slot.

The plan is built in place inside the StepsRequest that carries it on the Steps stream, so sending it
copies nothing; code that wants the plan alone (the offline LLM, tests) reads the request's `plan`.

Call build() right after schedule(), before any update_from_output(): it reads the requests' token
ids and block tables as schedule() left them.
"""

from __future__ import annotations

import heapq

from pagedserve.v1 import worker_pb2

from .request import Request
from .scheduler import SchedulerOutput

# Steps requests_at() remembers: far more than the deepest pipeline.
_KEPT_STEPS = 64


class PlanBuilder:
    def __init__(self) -> None:
        self._last_step_id = 0
        # Slot of each request the worker knows.
        self._slot_of: dict[Request, int] = {}
        # Block table entries the worker has of each live slot.
        self._num_sent_blocks: dict[int, int] = {}
        # Free slots below _next_slot, smallest first; slots stay small integers.
        self._free_slots: list[int] = []
        self._next_slot = 0
        # Slots and requests of the steps not resolved yet: step id -> (slots, requests).
        self._steps: dict[int, tuple[list[int], list[Request]]] = {}

    @property
    def num_live_slots(self) -> int:
        return len(self._slot_of)

    def slot_of(self, req: Request) -> int | None:
        return self._slot_of.get(req)

    def build(self, out: SchedulerOutput) -> worker_pb2.StepsRequest:
        """The Steps stream's message for this output, its `plan` filled in place."""
        assert out.step_id == self._last_step_id + 1, f"step {out.step_id} after {self._last_step_id}"
        self._last_step_id = out.step_id
        request = worker_pb2.StepsRequest()
        plan = request.plan
        plan.step_id = out.step_id
        # 1. Departures first: their slots are free for this plan's newcomers.
        plan.finished_slots.extend(self._release(out.finished))
        plan.preempted_slots.extend(self._release(out.preempted))

        slot_of = self._slot_of
        sent = self._num_sent_blocks
        # 3a. Copy-on-write targets replace entries the worker already has; for a slot new to
        # the worker the fresh block simply arrives with its table below.
        if out.cow_copies:
            for cow in out.cow_copies:
                slot = slot_of.get(cow.request)
                if slot is not None and cow.block_index < sent[slot]:
                    plan.replaced_slots.append(slot)
                    plan.replaced_block_indices.append(cow.block_index)
                    plan.replaced_block_ids.append(cow.dst_block)
                plan.copy_src_blocks.append(cow.src_block)
                plan.copy_dst_blocks.append(cow.dst_block)

        slots: list[int] = []
        num_new_blocks: list[int] = []
        new_block_ids: list[int] = []
        for req, num_tokens in zip(out.scheduled, out.num_scheduled_tokens, strict=True):
            slot = slot_of.get(req)
            if slot is None:
                slot = self._new_slot(req)
                num_computed = req.num_computed_tokens - num_tokens
                # NOTE: requests enter with every token known (forks and comebacks wait for
                # their samples), so the worker gets the whole list once.
                assert num_computed + num_tokens <= len(req.token_ids) + len(req.draft_token_ids), (
                    "entering with unknown tokens"
                )
                plan.new_requests.add(
                    slot=slot,
                    request_id=req.request_id,
                    token_ids=req.token_ids,
                    prompt_len=req.prompt_len,
                    num_computed_tokens=num_computed,
                    sampling=req.sampling,
                    trace_context=req.trace_context,
                )
            table = req.block_table
            have = sent[slot]
            if req.rolled_back_table_len >= 0:
                # NOTE: the worker dropped the entries past it when it rejected drafts (worker.proto).
                have = sent[slot] = min(have, req.rolled_back_table_len)
                req.rolled_back_table_len = -1
            slots.append(slot)
            if len(table) > have:
                new_block_ids.extend(table[have:])
                num_new_blocks.append(len(table) - have)
                sent[slot] = len(table)
            else:
                num_new_blocks.append(0)
        plan.slots.extend(slots)
        plan.num_scheduled_tokens.extend(out.num_scheduled_tokens)
        plan.num_new_blocks.extend(num_new_blocks)
        plan.new_block_ids.extend(new_block_ids)
        if out.masked:
            assert out.token_masks is not None and len(out.token_masks) == len(out.masked)
            plan.mask_slots.extend([slot_of[req] for req in out.masked])
            plan.token_masks = out.token_masks.tobytes()
        for req, drafts in out.drafts:
            plan.draft_slots.append(slot_of[req])
            plan.num_draft_tokens.append(len(drafts))
            if not out.num_draft_layers:  # else placeholders: the worker proposes them
                plan.draft_token_ids.extend(drafts)
        plan.num_draft_layers = out.num_draft_layers
        self._steps[out.step_id] = (slots, out.scheduled)
        self._steps.pop(out.step_id - _KEPT_STEPS, None)
        return request

    def requests_at(self, step_id: int, slots: list[int]) -> list[Request]:
        """The requests the given slots addressed at that step (e.g. StepResult.sampled_slots, or
        the slots of its prompt_logprobs)."""
        by_slot = self.requests_by_slot(step_id)
        return [by_slot[s] for s in slots]

    def requests_by_slot(self, step_id: int) -> dict[int, Request]:
        """Slot -> request of the requests scheduled at that step."""
        step_slots, step_requests = self._steps[step_id]
        return dict(zip(step_slots, step_requests, strict=True))

    def _new_slot(self, req: Request) -> int:
        if self._free_slots:
            slot = heapq.heappop(self._free_slots)
        else:
            slot = self._next_slot
            self._next_slot += 1
        self._slot_of[req] = slot
        self._num_sent_blocks[slot] = 0
        return slot

    def _release(self, reqs: list[Request]) -> list[int]:
        slots = []
        for req in reqs:
            slot = self._slot_of.pop(req, None)
            if slot is not None:  # None: never reached the worker (or already released)
                del self._num_sent_blocks[slot]
                heapq.heappush(self._free_slots, slot)
                slots.append(slot)
        return slots
