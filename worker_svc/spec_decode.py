"""Verifying draft tokens (speculative decoding, worker.proto): the rows of a slot's positions, their sampling
states, and how many drafts the samples accept.

A slot with k drafts computes 1 + k positions in one forward pass, and its logits rows 0..k are sampled with
the plain sampler, row j as output position num_outputs + j with the drafts before it counted as outputs
(so penalties see them and a seeded draw uses position j's generator). Draft j is accepted while every row
before it sampled the draft that follows; the slot gains the accepted drafts and row a's sample.

Why this is exact: each row's sample is what decoding without drafts would draw at that position, given
the tokens before it, so the tokens the slot gains are the plain sampler's, token for token, under greedy
decoding and under seeded sampling alike. For a drafter that proposes one token with certainty (n-gram
lookup: a point mass), this is rejection sampling: draft d is accepted with probability p(d) under the
target's distribution p (after temperature, top-k, top-p, min-p, penalties and bias), and when it is not,
the token comes from p without d, renormalised.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from pagedserve.v1 import worker_pb2
from pagedserve.worker_svc.sampler import SlotSamplingState


def plan_drafts(plan: worker_pb2.StepPlan) -> dict[int, list[int]]:
    """Slot -> its draft tokens; ValueError when draft_slots, num_draft_tokens and draft_token_ids disagree."""
    if not plan.draft_slots:
        return {}
    if len(plan.num_draft_tokens) != len(plan.draft_slots):
        raise ValueError("draft_slots and num_draft_tokens differ in length")
    if sum(plan.num_draft_tokens) != len(plan.draft_token_ids):
        raise ValueError(
            f"num_draft_tokens sum to {sum(plan.num_draft_tokens)} but {len(plan.draft_token_ids)} draft_token_ids"
        )
    drafts: dict[int, list[int]] = {}
    offset = 0
    for slot, k in zip(plan.draft_slots, plan.num_draft_tokens, strict=True):
        if k == 0:
            raise ValueError(f"slot {slot} has 0 draft tokens")
        if slot in drafts:
            raise ValueError(f"slot {slot} has drafts twice")
        drafts[slot] = list(plan.draft_token_ids[offset : offset + k])
        offset += k
    return drafts


def verify_rows(last_rows: np.ndarray, num_drafts: list[int]) -> np.ndarray:
    """The batch rows whose logits are sampled: each sampling slot's last row, preceded by one row per draft."""
    return np.concatenate(
        [
            np.arange(row - k, row + 1, dtype=np.int64)
            for row, k in zip(last_rows.tolist(), num_drafts, strict=True)
        ]
    )


def position_states(state: SlotSamplingState, drafts: list[int]) -> list[SlotSamplingState]:
    """The sampling state of each of a slot's 1 + len(drafts) verified positions: position j counts drafts[:j]
    as outputs. States whose draws do not depend on the outputs (no penalty, no seed) are shared."""
    if not state.has_penalties and (state.greedy or state.seed is None):
        return [state] * (len(drafts) + 1)
    outputs = state.output_token_ids
    return [state] + [
        dataclasses.replace(state, output_token_ids=[*outputs, *drafts[:j]])
        for j in range(1, len(drafts) + 1)
    ]


def num_accepted(samples: list[int], drafts: list[int]) -> int:
    """Drafts accepted: those before the first whose position's sample differs from it."""
    for j, draft in enumerate(drafts):
        if samples[j] != draft:
            return j
    return len(drafts)
