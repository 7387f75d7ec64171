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

Self-speculative drafts (StepPlan.num_draft_layers = L): the worker proposes a draft slot's k drafts itself,
before the verification pass, with k passes of the model's first L layers, final norm and LM head, each
taking the argmax (propose_layer_drafts). Greedy drafts are point masses too, so the rule above stays exact
for every temperature. The draft's keys and values at the slot's new positions, layers 0..L-1, go to the
target's own KV pool at the slots the plan gave those positions: they are what the target's first L layers
compute there (same weights, same inputs; the verification pass writes them again), so the draft needs no
pool of its own and nothing to roll back beyond what verification rolls back.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from pagedserve.v1 import worker_pb2
from pagedserve.worker_svc.model import CausalLM
from pagedserve.worker_svc.sampler import SlotSamplingState
from pagedserve.worker_svc.step_inputs import SlotArrays, as_tensor


def plan_drafts(plan: worker_pb2.StepPlan) -> dict[int, list[int]]:
    """Slot -> its draft tokens (zeros, to be proposed, when the worker drafts: num_draft_layers); ValueError
    when draft_slots, num_draft_tokens and draft_token_ids disagree."""
    if not plan.draft_slots:
        return {}
    if len(plan.num_draft_tokens) != len(plan.draft_slots):
        raise ValueError("draft_slots and num_draft_tokens differ in length")
    if plan.num_draft_layers:
        if plan.draft_token_ids:
            raise ValueError(
                "draft_token_ids given although the worker proposes the drafts (num_draft_layers)"
            )
    elif sum(plan.num_draft_tokens) != len(plan.draft_token_ids):
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
        drafts[slot] = [0] * k if plan.num_draft_layers else list(plan.draft_token_ids[offset : offset + k])
        offset += k
    return drafts


def propose_layer_drafts(
    model: CausalLM,
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    arrays: SlotArrays,
    num_layers: int,
    slots: list[int],
    computed: list[int],
    known: list[int],
    num_drafts: list[int],
) -> list[list[int]]:
    """Each slot's greedy drafts from the model's first num_layers layers (a self-speculative draft), written
    into arrays.token_ids after its known tokens: slot i has computed[i] tokens in the cache and known[i]
    tokens, and gets num_drafts[i] drafts. The first pass computes every uncomputed known token, each later
    one the draft before; a slot leaves once it has its drafts (the last draft is not computed: verification
    does). The passes write layers 0..num_layers-1 of the KV pool at the positions they compute."""
    device = arrays.device
    for slot, n, k in zip(slots, known, num_drafts, strict=True):
        arrays.reserve(slot, n + k + 1, 0)
    drafts: list[list[int]] = [[] for _ in slots]
    live = list(range(len(slots)))
    counts: list[int] | None = [n - c for n, c in zip(known, computed, strict=True)]
    starts = list(computed)
    while live:
        run_slots = [slots[i] for i in live]
        inputs = arrays.inputs(run_slots, [starts[i] for i in live], counts)
        rows = None
        if counts is not None and max(counts) > 1:
            last = np.add.accumulate(np.asarray(counts, dtype=np.int64)) - 1
            rows = as_tensor(last, device)
        hidden = model.draft_forward(
            num_layers, inputs.input_ids, inputs.positions, inputs.attn, kv_caches, rows
        )
        tokens = model.compute_logits(hidden).argmax(dim=-1).tolist()
        still = []
        for i, token in zip(live, tokens, strict=True):
            position = known[i] + len(drafts[i])
            arrays.token_ids[slots[i], position] = token
            drafts[i].append(token)
            starts[i] = position  # the next pass computes this draft
            if len(drafts[i]) < num_drafts[i]:
                still.append(i)
        live = still
        counts = None  # one token each from now on
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
