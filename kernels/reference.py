"""The kernel ops in plain PyTorch (kernels/ops.py has the contract): the reference the C++ and CUDA
kernels are tested against, the production path where neither loads, and the base class of both, whose
ops they do not replace run as here.

Attention gathers each sequence's K/V blocks through its block table into a dense
[.., num_kv_heads, ctx, head_dim] tensor and runs dense attention over it; that copy is the price of
staying in stock PyTorch. Prefill keeps only the first ctx positions of the blocks it gathers; decode
gathers whole blocks for the batch's longest context, so it zeroes the V rows past each sequence's length
and masks their scores to -inf (0 * NaN in probs @ V would leak a recycled block's NaN).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedserve.kernels.ops import (
    DecoderStackFactory,
    LinearKernels,
    QuantLinearKernels,
    check_attention,
    check_copy_blocks,
    check_write_kv,
)

_REDUCED = (torch.float16, torch.bfloat16)

# Decode gathers K/V for this many bytes of sequences at a time: a chunk that fits in cache is consumed
# while still hot, and malloc does not map and fault temporaries of tens of MB afresh on every call
# (docs/performance.md, "Measurements behind the code").
DECODE_GATHER_BYTES = 4 << 20


class ReferenceOps:
    """kernels.ops.Ops in PyTorch, on any device."""

    name = "reference"
    linear: LinearKernels | None = None  # the model's linear layers are PyTorch's
    quant_linear: QuantLinearKernels | None = None  # quantized weights load dequantized
    decoder_stack: DecoderStackFactory | None = None
    # NOTE: PyTorch's matmuls and SDPA choose their blocking by the shape: setting it changes nothing here.
    batch_invariant: bool = False

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        check_write_kv(key, value, k_cache, v_cache, slot_mapping)
        if slot_mapping.numel() == 0:
            return
        slots = slot_mapping.to(device=k_cache.device, dtype=torch.int64)
        if int(slots.min()) < 0:  # padding tokens: skipped, their slots stay untouched
            keep = slots >= 0
            slots, key, value = slots[keep], key[keep], value[keep]
        # Indexed by (block, offset), so that any layout of the cache's strides takes the rows.
        blocks, offsets = slots // k_cache.shape[1], slots % k_cache.shape[1]
        k_cache[blocks, offsets] = key.to(k_cache.dtype)
        v_cache[blocks, offsets] = value.to(v_cache.dtype)

    def paged_decode_attention(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        check_attention(query, k_cache, v_cache, block_tables, context_lens)
        batch, _, head_dim = query.shape
        num_kv_heads = k_cache.shape[2]
        if batch == 0:
            return torch.empty_like(query)
        assert int(context_lens.min()) >= 1, "a decode query attends to at least its own position"
        max_ctx = int(context_lens.max())
        dtype = _compute_dtype(query)
        seq_bytes = 2 * max_ctx * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8
        chunk = max(1, DECODE_GATHER_BYTES // seq_bytes)
        if chunk >= batch:
            return _decode(query, k_cache, v_cache, block_tables, context_lens, scale, max_ctx, dtype)
        out = torch.empty_like(query)
        for i in range(0, batch, chunk):
            lens = context_lens[i : i + chunk]
            out[i : i + chunk] = _decode(
                query[i : i + chunk],
                k_cache,
                v_cache,
                block_tables[i : i + chunk],
                lens,
                scale,
                int(lens.max()),
                dtype,
            )
        return out

    def paged_prefill_attention(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        query_start_loc: torch.Tensor,
        context_lens: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        check_attention(query, k_cache, v_cache, block_tables, context_lens, query_start_loc)
        num_tokens = query.shape[0]
        num_seqs = context_lens.shape[0]
        starts = query_start_loc.tolist()
        ctx_lens = context_lens.tolist()
        assert starts[0] == 0 and starts[-1] == num_tokens, (starts, num_tokens)
        out = torch.empty_like(query)

        # Single-token sequences (the decodes of a mixed batch) go through the batched decode path in one
        # call; the loop below is per sequence and would cost one gather and SDPA call each.
        q_lens = [starts[s + 1] - starts[s] for s in range(num_seqs)]
        single = [s for s in range(num_seqs) if q_lens[s] == 1]
        if single:
            index = torch.tensor(single, device=query.device)
            rows = torch.tensor([starts[s] for s in single], device=query.device)
            out[rows] = self.paged_decode_attention(
                query[rows], k_cache, v_cache, block_tables[index], context_lens[index], scale
            )

        for s in range(num_seqs):
            if q_lens[s] > 1:
                rows = slice(starts[s], starts[s + 1])
                out[rows] = prefill_sequence(
                    query[rows], k_cache, v_cache, block_tables[s], ctx_lens[s], scale
                )
        return out

    def copy_blocks(
        self, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], src: torch.Tensor, dst: torch.Tensor
    ) -> None:
        check_copy_blocks(k_caches, v_caches, src, dst)
        if src.numel() == 0:
            return
        src_ids, dst_ids = src.tolist(), dst.tolist()
        independent = len(set(dst_ids)) == len(dst_ids) and not set(src_ids) & set(dst_ids)
        for cache in (*k_caches, *v_caches):
            if independent:  # the usual copy-on-write case: fresh blocks copied from shared ones
                index_src = src.to(device=cache.device, dtype=torch.int64)
                index_dst = dst.to(device=cache.device, dtype=torch.int64)
                cache.index_copy_(0, index_dst, cache.index_select(0, index_src))
            else:
                for a, b in zip(src_ids, dst_ids, strict=True):
                    if a != b:
                        cache[b] = cache[a]

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # HF's formula: torch's F.rms_norm is no faster on CPU (docs/performance.md).
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return weight * x32.to(x.dtype)

    def add_rms_norm_(
        self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        return self.rms_norm(x.add_(delta), weight, eps)

    def rotary_write_kv_(
        self,
        qk: torch.Tensor,
        value: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        rotate_(qk, cos, sin)
        self.write_kv(qk[:, qk.shape[1] - value.shape[1] :], value, k_cache, v_cache, slot_mapping)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        return x.argmax(dim=-1)

    def masked_argmax(self, x: torch.Tensor, masks: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        return mask_tokens(x, masks, rows).argmax(dim=-1)


# Byte value -> which of its 8 tokens a packed token mask leaves out (bit j clear: token 8k + j banned).
_BANNED_BITS = torch.tensor([[not (b >> j) & 1 for j in range(8)] for b in range(256)], dtype=torch.bool)
_banned_bits_on: dict[torch.device, torch.Tensor] = {}


def mask_tokens(logits: torch.Tensor, masks: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """A float32 copy of logits [R, V] with -inf on the tokens packed masks ban (see Ops.masked_argmax). Each
    byte of the masks picks its 8 tokens' flags from a table in one gather; torch ops on any device."""
    num_rows, vocab_size = logits.shape
    table = _banned_bits_on.get(masks.device)
    if table is None:
        table = _banned_bits_on[masks.device] = _BANNED_BITS.to(masks.device)
    # NOTE: little-endian words, so byte k holds tokens 8k .. 8k + 7, lowest bit first.
    index = masks.contiguous().view(torch.uint8).reshape(-1).long()
    banned = table.index_select(0, index).view(masks.shape[0], -1)[:, :vocab_size]
    if rows is not None:
        banned = banned.new_zeros((num_rows, vocab_size)).index_copy_(0, rows, banned)
    # NOTE: a copy, filled in place: the raw logits serve the logprobs.
    x = logits.float() if logits.dtype != torch.float32 else logits.clone()
    return x.masked_fill_(banned, float("-inf"))


def _compute_dtype(query: torch.Tensor) -> torch.dtype:
    # bf16/fp16 are accumulated in float32: scores of a long context summed in bf16 lose digits.
    return torch.float32 if query.dtype in _REDUCED else query.dtype


def _decode(query, k_cache, v_cache, block_tables, context_lens, scale, max_ctx, dtype):
    batch, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1:3]
    assert block_tables.shape[1] * block_size >= max_ctx, (block_tables.shape, block_size, max_ctx)
    num_blocks_used = -(-max_ctx // block_size)
    lens = context_lens.to(torch.int64).unsqueeze(1)
    # Table entries past a sequence's last block are padding: they point at its first block instead.
    tables = block_tables[:, :num_blocks_used].to(torch.int64)
    used = torch.arange(num_blocks_used, device=tables.device) * block_size < lens
    tables = torch.where(used, tables, tables[:, :1])
    k = _gather_blocks(k_cache, tables, dtype)  # [B, Hkv, L, D], L = num_blocks_used * block_size
    v = _gather_blocks(v_cache, tables, dtype)
    # Positions at or past a sequence's context length are masked; they can only lie from the shortest
    # context's last full block on. Their V rows are zeroed as well: 0 * NaN (a recycled block) is NaN.
    first = int(context_lens.min()) // block_size * block_size
    invalid = torch.arange(first, k.shape[2], device=lens.device) >= lens  # [B, L - first]
    v[:, :, first:].masked_fill_(invalid[:, None, :, None], 0.0)
    # GQA: the G query heads of one kv head become G query rows against that head's K/V, so K/V are
    # never repeated per query head.
    group = num_heads // num_kv_heads
    q = query.view(batch, num_kv_heads, group, head_dim).to(dtype)
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)  # [B, Hkv, G, L]
    scores[..., first:].masked_fill_(invalid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, v)  # [B, Hkv, G, D]
    return out.view(batch, num_heads, head_dim).to(query.dtype)


def _gather_blocks(
    cache: torch.Tensor, tables: torch.Tensor, dtype: torch.dtype, length: int | None = None
) -> torch.Tensor:
    """cache blocks at tables [S, N] -> [S, num_kv_heads, length, head_dim] in dtype (the first `length`
    positions of the blocks, default all N * block_size), contiguous in that order (what the attention
    matmuls want).

    Whole blocks are gathered (block_size times fewer indices than slot rows, each a contiguous run), then
    the head-major transpose and the widening to dtype are one copy (docs/performance.md)."""
    num_seqs, n = tables.shape
    _, block_size, num_kv_heads, head_dim = cache.shape
    length = n * block_size if length is None else length
    blocks = cache.index_select(0, tables.flatten()).view(num_seqs, n * block_size, num_kv_heads, head_dim)
    out = torch.empty(num_seqs, num_kv_heads, length, head_dim, dtype=dtype, device=cache.device)
    return out.copy_(blocks[:, :length].transpose(1, 2))


def prefill_sequence(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    ctx: int,
    scale: float,
) -> torch.Tensor:
    """Attention of one sequence's last q_len tokens, query [q_len, Hq, D], over its ctx cached positions
    (block_table [max_blocks]) with dense SDPA: [q_len, Hq, D] in query's dtype."""
    q_len, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert q_len <= ctx, (q_len, ctx)
    dtype = _compute_dtype(query)
    group = num_heads // num_kv_heads
    tables = block_table[: -(-ctx // block_size)].to(torch.int64).unsqueeze(0)
    k = _gather_blocks(k_cache, tables, dtype, ctx)  # [1, Hkv, ctx, D]
    v = _gather_blocks(v_cache, tables, dtype, ctx)
    q = query.to(dtype)
    if q_len == ctx:
        # A whole prompt: plain causal attention, where SDPA skips the masked half (an explicit mask
        # makes it compute both).
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0), k, v, is_causal=True, scale=scale, enable_gqa=True
        )
        o = o[0].transpose(0, 1)
    else:
        # [q_len, Hq, D] -> [1, Hkv, G * q_len, D]: row (g, i) is query head kv * G + g at token i.
        q = (
            q.view(q_len, num_kv_heads, group, head_dim)
            .permute(1, 2, 0, 3)
            .reshape(1, num_kv_heads, -1, head_dim)
        )
        # The queries are the last q_len positions: token i sits at ctx - q_len + i, sees keys 0..that.
        q_pos = torch.arange(ctx - q_len, ctx, device=query.device)
        mask = torch.arange(ctx, device=query.device) <= q_pos.unsqueeze(1)  # [q_len, ctx]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.repeat(group, 1), scale=scale)
        o = o.view(num_kv_heads, group, q_len, head_dim).permute(2, 0, 1, 3)
    return o.reshape(q_len, num_heads, head_dim).to(query.dtype)


def rotate_(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Neox RoPE in place on heads [T, H, D]. cos and sin are [T, 1, D] rows of (cos, cos) and
    (-sin, sin): x * cos + (x2, x1) * sin computes (x1 cos - x2 sin, x2 cos + x1 sin) with the same
    products and sums, so bitwise like HF's form."""
    x1, x2 = qk.chunk(2, dim=-1)
    qk.copy_(torch.cat((x2, x1), dim=-1).mul_(sin).add_(qk * cos))
