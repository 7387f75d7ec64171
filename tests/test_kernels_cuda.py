"""The CUDA kernels against the PyTorch reference, on fresh random inputs whose unused cache slots are NaN.

Runs only where a CUDA device and a matching CuPy are present (skipped cleanly elsewhere). Covers every dtype,
head size and block size, GQA groups 1, 2, 4, 7, 8 (and 16, split over two CTAs), context lengths 1, bs-1,
bs, bs+1, 511-513 and long ones, both decode paths (single pass and split-K) and blocks shared by sequences.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from pagedserve.kernels import cuda_ops
from pagedserve.kernels.cuda_ops import CudaOps
from pagedserve.kernels.reference import ReferenceOps

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not cuda_ops.is_available(), reason="needs a CUDA device and a matching CuPy"),
]

CUDA = CudaOps(torch.device("cuda")) if cuda_ops.is_available() else None
REFERENCE = ReferenceOps()
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
GROUPS = (1, 2, 4, 7, 8)
TOL = {torch.bfloat16: (2e-2, 2e-2), torch.float16: (3e-3, 3e-3), torch.float32: (2e-5, 2e-5)}
# Every (dtype, head size, block size); the GQA group cycles so that each value meets every other axis.
SHAPES = [
    (dtype, head, bs, GROUPS[i % len(GROUPS)])
    for i, (dtype, head, bs) in enumerate(
        itertools.product(DTYPES, cuda_ops.HEAD_SIZES, cuda_ops.BLOCK_SIZES)
    )
]
FULL_GQA = [(torch.bfloat16, 128, 16, g) for g in (*GROUPS, 16)]


def _ids(shape) -> str:
    dtype, head, bs, group = shape
    return f"{str(dtype).removeprefix('torch.')}-d{head}-bs{bs}-g{group}"


@pytest.fixture(scope="module", autouse=True)
def _precompile() -> None:
    # NVRTC compiles ~100 kernels for this module; do it on every core once instead of one by one.
    entries = set()
    for dtype, head, bs, group in [*SHAPES, *FULL_GQA]:
        entries.update(cuda_ops.entries_for(dtype, head, bs, group))
    entries.update(cuda_ops.write_kv_entry(u) for u in cuda_ops.COPY_UNITS)
    entries.update(cuda_ops.copy_blocks_entry(u) for u in cuda_ops.COPY_UNITS)
    cuda_ops.precompile(sorted(entries, key=lambda e: e.name))


class Paged:
    """A NaN-poisoned KV cache holding a batch of sequences at random block ids, written with the reference."""

    def __init__(self, lens, block_size, num_kv_heads, head_size, dtype, *, share_prefix=0, seed=0):
        self.gen = torch.Generator(device="cuda").manual_seed(seed)
        self.bs, self.hkv, self.d, self.dtype = block_size, num_kv_heads, head_size, dtype
        blocks_per_seq = [math.ceil(n / block_size) for n in lens]
        num_blocks = 2 * sum(blocks_per_seq) + 8  # free blocks around the used ones, all NaN
        shape = (num_blocks, block_size, num_kv_heads, head_size)
        self.k = torch.full(shape, float("nan"), device="cuda", dtype=dtype)
        self.v = torch.full(shape, float("nan"), device="cuda", dtype=dtype)
        perm = torch.randperm(num_blocks, device="cuda", generator=self.gen).tolist()
        max_blocks = max(blocks_per_seq) + 3  # padding entries past the used ones
        # Padding entries point at random (NaN-filled or foreign) blocks: the kernel must never follow them.
        self.tables = torch.randint(0, num_blocks, (len(lens), max_blocks), device="cuda", generator=self.gen)
        self.tables = self.tables.to(torch.int32)
        shared = perm[:share_prefix]
        pos = share_prefix
        for s, nb in enumerate(blocks_per_seq):
            own = shared[: min(nb, share_prefix)] + perm[pos : pos + max(0, nb - share_prefix)]
            pos += max(0, nb - share_prefix)
            self.tables[s, :nb] = torch.tensor(own, dtype=torch.int32)
        self.lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
        # Write each sequence's tokens (a shared block is written by every sequence using it: last wins,
        # which is exactly what the reference reads back too).
        for s, n in enumerate(lens):
            pos_ids = torch.arange(n, device="cuda")
            slots = self.tables[s, pos_ids // block_size].long() * block_size + pos_ids % block_size
            REFERENCE.write_kv(self.rand(n, num_kv_heads), self.rand(n, num_kv_heads), self.k, self.v, slots)

    def rand(self, *lead: int) -> torch.Tensor:
        return torch.randn(*lead, self.d, device="cuda", generator=self.gen).to(self.dtype)


def _close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert not actual.isnan().any(), "NaN reached the output"
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


def _decode_lengths(bs: int) -> list[int]:
    return [1, bs - 1, bs, bs + 1, 511, 512, 513, 1500]


# ---- write_kv / copy_blocks ----------------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES, ids=_ids)
def test_write_kv_matches_reference_and_skips_padding(shape) -> None:
    dtype, head, bs, _ = shape
    hkv, num_blocks, tokens = 3, 10, 25
    gen = torch.Generator(device="cuda").manual_seed(1)
    k0 = torch.randn(num_blocks, bs, hkv, head, device="cuda", generator=gen).to(dtype)
    v0 = torch.randn(num_blocks, bs, hkv, head, device="cuda", generator=gen).to(dtype)
    # A fused projection's slice: token stride larger than a row (no copy in the kernel path).
    fused = torch.randn(tokens, 3, hkv, head, device="cuda", generator=gen).to(dtype)
    key, value = fused[:, 0], fused[:, 2]
    slots = torch.randperm(num_blocks * bs, device="cuda", generator=gen)[:tokens]
    slots[::4] = -1  # padding
    k1, v1, k2, v2 = k0.clone(), v0.clone(), k0.clone(), v0.clone()
    CUDA.write_kv(key, value, k1, v1, slots)
    REFERENCE.write_kv(key, value, k2, v2, slots)
    torch.cuda.synchronize()
    assert torch.equal(k1, k2) and torch.equal(v1, v2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_copy_blocks_matches_reference_in_order(dtype) -> None:
    gen = torch.Generator(device="cuda").manual_seed(2)
    layers = [torch.randn(12, 16, 2, 80, device="cuda", generator=gen).to(dtype) for _ in range(6)]
    k1, v1 = [t.clone() for t in layers[:3]], [t.clone() for t in layers[3:]]
    k2, v2 = [t.clone() for t in layers[:3]], [t.clone() for t in layers[3:]]
    # Independent copies, then a chain (3 -> 4 -> 5) and a repeated destination (last wins).
    src = torch.tensor([0, 1, 3, 4, 7, 8], device="cuda")
    dst = torch.tensor([10, 11, 4, 5, 9, 9], device="cuda")
    CUDA.copy_blocks(k1, v1, src, dst)
    REFERENCE.copy_blocks(k2, v2, src, dst)
    torch.cuda.synchronize()
    for a, b in zip([*k1, *v1], [*k2, *v2], strict=True):
        assert torch.equal(a, b)


# ---- decode ----------------------------------------------------------------------------------------------


def _check_decode(shape, lens, *, splits=(None, 1, 3), share_prefix=0, seed=0) -> None:
    dtype, head, bs, group = shape
    hkv = 2
    cache = Paged(lens, bs, hkv, head, dtype, share_prefix=share_prefix, seed=seed)
    query = cache.rand(len(lens), hkv * group)
    scale = head**-0.5
    expected = REFERENCE.paged_decode_attention(query, cache.k, cache.v, cache.tables, cache.lens, scale)
    for num_splits in splits:
        out = CUDA.paged_decode_attention_splits(
            query, cache.k, cache.v, cache.tables, cache.lens, scale, num_splits
        )
        _close(out, expected, dtype)


@pytest.mark.parametrize("shape", SHAPES, ids=_ids)
def test_decode_matches_reference(shape) -> None:
    _check_decode(shape, _decode_lengths(shape[2]))


@pytest.mark.parametrize("shape", FULL_GQA, ids=_ids)
def test_decode_every_gqa_group_with_shared_blocks(shape) -> None:
    # Forked sequences: the first blocks (a partly filled one included) are shared.
    _check_decode(shape, [40, 40, 33, 100, 17], share_prefix=2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_long_context_uses_split_k(dtype) -> None:
    shape = (dtype, 128, 16, 4)
    assert cuda_ops.choose_num_splits(1 * 2, 32768 // 16, 16, 132) > 1
    _check_decode(shape, [32768, 9000], splits=(None, 1), seed=3)


def test_decode_public_signature_matches_reference() -> None:
    shape = (torch.bfloat16, 128, 16, 4)
    cache = Paged([5, 700], 16, 2, 128, torch.bfloat16)
    query = cache.rand(2, 8)
    out = CUDA.paged_decode_attention(query, cache.k, cache.v, cache.tables, cache.lens, 0.1)
    expected = REFERENCE.paged_decode_attention(query, cache.k, cache.v, cache.tables, cache.lens, 0.1)
    _close(out, expected, shape[0])


# ---- prefill ---------------------------------------------------------------------------------------------


def _check_prefill(shape, q_ctx, *, share_prefix=0, seed=0) -> None:
    dtype, head, bs, group = shape
    hkv = 2
    lens = [ctx for _, ctx in q_ctx]
    cache = Paged(lens, bs, hkv, head, dtype, share_prefix=share_prefix, seed=seed)
    q_lens = [q for q, _ in q_ctx]
    starts = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32, device="cuda")
    query = cache.rand(sum(q_lens), hkv * group)
    scale = head**-0.5
    args = (query, cache.k, cache.v, cache.tables, starts, cache.lens, scale)
    _close(CUDA.paged_prefill_attention(*args), REFERENCE.paged_prefill_attention(*args), dtype)


@pytest.mark.parametrize("shape", SHAPES, ids=_ids)
def test_prefill_matches_reference(shape) -> None:
    bs = shape[2]
    # (new tokens, context incl. them): fresh prompts, chunks over cached context, decodes in a mixed batch.
    q_ctx = [
        (1, 1),
        (bs - 1, bs - 1),
        (bs, bs),
        (bs + 1, bs + 1),
        (1, 513),
        (37, 511),
        (200, 512),
        (3, bs + 1),
    ]
    _check_prefill(shape, q_ctx)


@pytest.mark.parametrize("shape", FULL_GQA, ids=_ids)
def test_prefill_every_gqa_group_with_shared_blocks(shape) -> None:
    _check_prefill(shape, [(9, 40), (40, 40), (1, 33), (64, 100)], share_prefix=2)


def test_prefill_long_chunk() -> None:
    _check_prefill((torch.bfloat16, 128, 16, 4), [(1024, 5000), (300, 300)], seed=4)
