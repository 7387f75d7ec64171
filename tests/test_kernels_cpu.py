"""The C++ CPU kernels (kernels/cpu/): attention against the float64 oracle, the fused small ops
against the PyTorch reference formulas they replace, bad input refused with an error (never a crash),
and a whole model in bf16 no less accurate through them than through the reference.

The extension is built on first use (g++ and ninja); the module is skipped where it cannot be built.
"""

from __future__ import annotations

import copy
import os
import platform
import shutil
import subprocess
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch
from test_kernels_reference import (
    COPY_CASES,
    DECODE_PARAMS,
    GARBAGE_BLOCK,
    LAYOUTS,
    PREFILL_PARAMS,
    Case,
    assert_matches_oracle,
    check_copy_blocks_in_order,
    check_decode_against_oracle,
    check_mixed_prefill_against_oracle,
    nan_cache,
    oracle,
)
from test_model import FAMILIES, VOCAB, PagedCache, _hf_logits, _save_tiny_hf_model

from pagedserve.kernels import CPU_KERNELS_ENV, cpu_ops
from pagedserve.kernels.cpu_ops import CpuOps
from pagedserve.kernels.ops import linear_for
from pagedserve.kernels.reference import ReferenceOps
from pagedserve.launcher import python_command
from pagedserve.worker_svc.loader import load_model


def _built() -> bool:
    try:
        cpu_ops.load()
    except Exception:
        return False
    return True


pytestmark = pytest.mark.skipif(not _built(), reason="the C++ CPU kernels cannot be built here")

CPU = CpuOps() if _built() else None
REFERENCE = ReferenceOps()


def _linear_kernels(dtype: torch.dtype = torch.bfloat16):
    """The extension, where its build has a linear layer for weights of dtype (see CpuOps.linear); else None."""
    return cpu_ops.load() if CPU is not None and linear_for(CPU, dtype) is not None else None


def _cpu_flags() -> set[str]:
    try:
        return set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return set()


needs_amx = pytest.mark.skipif(
    not (_built() and cpu_ops.load().has_amx()), reason="no AMX here (amx_bf16 and Linux's permission for it)"
)


@pytest.fixture
def amx_switch():
    """set(enabled) lets the bf16 linear take AMX or keeps it on AVX-512; put back after the test."""
    kernels = cpu_ops.load()
    before = kernels.set_amx_enabled(True)
    yield kernels.set_amx_enabled
    kernels.set_amx_enabled(before)


@pytest.mark.parametrize("source", sorted(p.name for p in cpu_ops.SOURCE_DIR.iterdir() if p.is_file()))
def test_the_build_is_named_after_every_source_file(tmp_path, monkeypatch, source):
    # Two checkouts sharing one extension cache must not load each other's build.
    name = cpu_ops.build_name()
    assert name.startswith("pagedserve_cpu_") and name == cpu_ops.build_name()
    copy = tmp_path / "cpu"
    shutil.copytree(cpu_ops.SOURCE_DIR, copy)
    monkeypatch.setattr(cpu_ops, "SOURCE_DIR", copy)
    copied = cpu_ops.build_name()
    assert copied != name  # the same files in another checkout: a build of its own
    assert cpu_ops.build_name() == copied
    (copy / source).write_text((copy / source).read_text() + "\n// changed\n")
    assert cpu_ops.build_name() not in (name, copied)


def test_the_build_is_named_after_its_instruction_set(monkeypatch):
    # A build for another -march (PAGEDSERVE_CPU_MARCH) is another extension, never this machine's own.
    monkeypatch.delenv(cpu_ops.MARCH_ENV, raising=False)
    native = cpu_ops.build_name()
    monkeypatch.setenv(cpu_ops.MARCH_ENV, "haswell")
    assert cpu_ops.march() == "haswell" and "-march=haswell" in cpu_ops.compile_flags()
    assert cpu_ops.build_name() != native


def test_the_package_ships_every_kernel_source():
    # `pip install .` must carry the folder the extension is built from.
    import tomllib

    pyproject = tomllib.loads((cpu_ops.SOURCE_DIR.parents[1] / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["package-data"]["pagedserve.kernels"]
    kernels = cpu_ops.SOURCE_DIR.parent
    for path in cpu_ops.SOURCE_DIR.iterdir():
        relative = path.relative_to(kernels)
        assert any(relative.match(pattern) for pattern in patterns), relative


# ---- attention ------------------------------------------------------------------------------------------


def _amd_cpu_family() -> int | None:
    """The CPU family of an AMD CPU (/proc/cpuinfo), None elsewhere."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    if "AuthenticAMD" not in info:
        return None
    return int(next(line for line in info.splitlines() if line.startswith("cpu family")).split(":")[1])


def test_reads_ahead_go_into_l2_but_on_a_zen_5():
    # The tiled attention's next block and the bf16 linear's decode streams are prefetched into L2 (on a Zen 4
    # the L1's misses in flight are the limit), into L1 on a Zen 5 (docs/performance.md).
    assert cpu_ops.load().prefetches_into_l2() == (_amd_cpu_family() != 26)


def _pool_orders(num_blocks: int) -> dict[str, list[int]]:
    gen = torch.Generator().manual_seed(num_blocks)
    return {
        "in order": list(range(num_blocks)),
        "reversed": list(range(num_blocks))[::-1],
        "scattered": torch.randperm(num_blocks, generator=gen).tolist(),
    }


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("order", ["in order", "reversed", "scattered"])
def test_attention_reads_its_blocks_wherever_they_lie_in_the_pool(dtype, order):
    # Each kernel prefetches a block or two ahead of the one it computes, through the block table: decode rows
    # (one sequence split into parts over the threads, and several sequences), a short chunk (the row kernel)
    # and prompt chunks (the tiled kernel, split or whole). Whatever the order of the blocks in the pool (the
    # next one right after, before, or anywhere), and with the first and last blocks of the pool in use, the
    # outputs are the oracle's.
    ctx_lens, q_lens = [700, 1, 300, 33, 260], [1, 1, 3, 17, 64]
    case = Case(ctx_lens, 16, 3, 64, dtype, seed=9, spare_blocks=0, layout="head-major")
    blocks = [b for table in case.tables for b in table]
    remap = dict(zip(sorted(blocks), _pool_orders(len(blocks))[order], strict=True))
    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
    for old, new in remap.items():
        k_cache[new], v_cache[new] = case.k_cache[old], case.v_cache[old]
    case.k_cache, case.v_cache = k_cache, v_cache
    case.tables = [[remap[b] for b in table] for table in case.tables]
    width = case.block_tables.shape[1]
    case.block_tables = torch.tensor(
        [t + [GARBAGE_BLOCK] * (width - len(t)) for t in case.tables], dtype=torch.int32
    )
    query = torch.randn(sum(q_lens), 9, 64, generator=case.gen).to(dtype)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    out = CPU.paged_prefill_attention(
        query, case.k_cache, case.v_cache, case.block_tables, starts, case.context_lens, 0.125
    )
    expected = oracle(query, case, q_lens, 0.125)
    assert_matches_oracle(out, expected, dtype)
    first = copy.copy(
        case
    )  # the first sequence alone: a decode row split into parts, a chunk whose tiles split
    first.tables, first.ctx_lens = case.tables[:1], case.ctx_lens[:1]
    lone = CPU.paged_decode_attention(
        query[:1], case.k_cache, case.v_cache, case.block_tables[:1], case.context_lens[:1], 0.125
    )
    assert_matches_oracle(lone, expected[:1], dtype)
    chunk = torch.randn(15, 9, 64, generator=case.gen).to(dtype)
    out = CPU.paged_prefill_attention(
        chunk,
        case.k_cache,
        case.v_cache,
        case.block_tables[:1],
        torch.tensor([0, 15], dtype=torch.int32),
        case.context_lens[:1],
        0.125,
    )
    assert_matches_oracle(out, oracle(chunk, first, [15], 0.125), dtype)


# The kernels read a cache in either layout through its strides (the worker's CPU pool is head-major).
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(("num_kv_heads", "group", "head_dim", "block_size", "dtype"), DECODE_PARAMS)
def test_decode_attention_matches_per_token_oracle(num_kv_heads, group, head_dim, block_size, dtype, layout):
    check_decode_against_oracle(CPU, num_kv_heads, group, head_dim, block_size, dtype, layout)


# Which path takes a sequence of several queries: the tiled kernel (from TILE_MIN_LANES query vectors per kv
# head, the build's own threshold as shipped; AVX-512 or AVX2), else SDPA (above SDPA_MIN_PAIRS query-key
# pairs), else the row kernel.
PATHS = [
    pytest.param(cpu_ops.TILE_MIN_LANES, cpu_ops.SDPA_MIN_PAIRS, id="as-shipped"),
    pytest.param(1, cpu_ops.SDPA_MIN_PAIRS, id="all-tiled"),
    pytest.param(10**9, cpu_ops.SDPA_MIN_PAIRS, id="rows"),
    pytest.param(10**9, 40, id="rows-and-sdpa"),
]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(("tile_min_lanes", "sdpa_min_pairs"), PATHS)
@pytest.mark.parametrize(("num_kv_heads", "group", "head_dim", "block_size", "dtype"), PREFILL_PARAMS)
def test_mixed_prefill_batch_matches_per_token_oracle(
    monkeypatch, tile_min_lanes, sdpa_min_pairs, num_kv_heads, group, head_dim, block_size, dtype, layout
):
    # The batch is split between the paths (with a threshold of 40 pairs the longer sequences go through
    # SDPA), and every row must land where it belongs.
    monkeypatch.setattr(cpu_ops, "TILE_MIN_LANES", tile_min_lanes)
    monkeypatch.setattr(cpu_ops, "SDPA_MIN_PAIRS", sdpa_min_pairs)
    check_mixed_prefill_against_oracle(CPU, num_kv_heads, group, head_dim, block_size, dtype, layout)


@pytest.mark.parametrize(
    ("head_dim", "dtype"), [(36, torch.bfloat16), (20, torch.float32), (64, torch.float16)]
)
def test_tiled_prefill_of_any_head_size_and_dtype_matches_oracle(monkeypatch, head_dim, dtype):
    # The tiled kernel moves whole registers of a row where it can (bf16 and float32 rows a multiple of 8
    # wide on AVX2) and one value at a time where it cannot; on AVX-512 head sizes that are not a multiple
    # of 16 take the row kernel.
    monkeypatch.setattr(cpu_ops, "TILE_MIN_LANES", 1)
    check_mixed_prefill_against_oracle(CPU, 2, 3, head_dim, 16, dtype)


@pytest.mark.parametrize("threads", [2, 5])
@pytest.mark.parametrize("ctx", [1, 15, 16, 17, 100, 260, 700, 1100, 2100])
def test_a_lone_decode_row_on_more_threads_than_rows_matches_oracle(ctx, threads):
    # Fewer rows than threads: the kv heads are split over the threads (some get none), and from 256
    # positions (16 blocks) the context is split into parts of at least 8 blocks whose partial softmaxes
    # are merged (2 at 260 positions, as many as the threads further on).
    case = Case([ctx], 16, 3, 64, torch.bfloat16, seed=ctx, layout="head-major")
    query = torch.randn(1, 9, 64, generator=case.gen).bfloat16()
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        out = CPU.paged_decode_attention(
            query, case.k_cache, case.v_cache, case.block_tables, case.context_lens, 0.125
        )
    finally:
        torch.set_num_threads(previous)
    assert_matches_oracle(out, oracle(query, case, [1], 0.125), torch.bfloat16)


@pytest.mark.parametrize("threads", [2, 5])
@pytest.mark.parametrize(("ctx", "q_len"), [(100, 15), (700, 15), (2100, 15), (700, 40), (260, 64)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_chunk_after_a_long_cached_prefix_matches_oracle_on_any_thread_count(ctx, q_len, threads, dtype):
    # A prompt's last chunk after its cached prefix makes few tiles (15 rows of 3 query heads: one per kv
    # head, three here), fewer than two per thread: on AVX-512 each tile's blocks are then split into parts
    # whose partial softmaxes are merged (not at 100 positions, too few blocks; at 5 threads 40 rows' nine
    # tiles too).
    case = Case([ctx], 16, 3, 64, dtype, seed=ctx + q_len, layout="head-major")
    query = torch.randn(q_len, 9, 64, generator=case.gen).to(dtype)
    start_loc = torch.tensor([0, q_len], dtype=torch.int32)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        out = CPU.paged_prefill_attention(
            query, case.k_cache, case.v_cache, case.block_tables, start_loc, case.context_lens, 0.125
        )
    finally:
        torch.set_num_threads(previous)
    assert_matches_oracle(out, oracle(query, case, [q_len], 0.125), dtype)


@needs_amx
@pytest.mark.parametrize(
    ("ctx_lens", "q_lens"),
    [([500], [500]), ([120, 37, 300], [120, 37, 16]), ([700], [15]), ([2100], [15]), ([33, 260], [17, 64])],
)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_amx_tiled_attention_gives_the_avx512_kernels_results(
    monkeypatch, amx_switch, ctx_lens, q_lens, layout
):
    # With AMX the tiled kernel's two products are tiles (K's 16 rows of a block by the query pairs, V
    # transposed by the weight pairs); the masking, the online softmax and the splits of a short chunk
    # after a long prefix (15 rows) stay AVX-512's. Blocks end short (37, 33, 17 positions) over a cache
    # of NaN past every sequence: transposed V must be zero there. The sums run in the same order, so the
    # outputs are AVX-512's but for rare last-bit roundings (0.3 % of them over 2100 positions).
    case = Case(ctx_lens, 16, 3, 64, torch.bfloat16, seed=sum(ctx_lens), layout=layout)
    query = torch.randn(sum(q_lens), 9, 64, generator=case.gen).bfloat16()
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    args = (query, case.k_cache, case.v_cache, case.block_tables, starts, case.context_lens, 0.125)
    monkeypatch.setattr(cpu_ops, "TILE_MIN_LANES", 1)  # every sequence of several rows tiled
    out = CPU.paged_prefill_attention(*args)
    amx_switch(False)
    avx512 = CPU.paged_prefill_attention(*args)
    assert_matches_oracle(out, oracle(query, case, q_lens, 0.125), torch.bfloat16)
    assert (out != avx512).float().mean() < 1e-2
    torch.testing.assert_close(out, avx512, rtol=2**-7, atol=1e-3)


@pytest.mark.parametrize("threads", [1, 3])
def test_any_thread_count_gives_the_same_rows(threads):
    # Heads are split over threads only when there are fewer row chunks than threads; the rows of a
    # sequence are chunked by the thread count: neither may change a result.
    case = Case([70, 3, 33], 16, 3, 64, torch.bfloat16, seed=5)
    q_lens = [21, 1, 2]
    query = torch.randn(sum(q_lens), 9, 64, generator=case.gen).bfloat16()
    starts = torch.tensor([0, 21, 22, 24], dtype=torch.int32)
    args = (query, case.k_cache, case.v_cache, case.block_tables, starts, case.context_lens, 0.125)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        out = CPU.paged_prefill_attention(*args)
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(out, CPU.paged_prefill_attention(*args))
    assert_matches_oracle(out, oracle(query, case, q_lens, 0.125), torch.bfloat16)


def test_float16_is_computed_in_float32_too():
    case = Case([40, 17], 8, 2, 64, torch.float16, seed=6)
    query = torch.randn(2, 4, 64, generator=case.gen).half()
    args = (case.block_tables, case.context_lens, 0.125)
    out = CPU.paged_decode_attention(query, case.k_cache, case.v_cache, *args)
    out32 = CPU.paged_decode_attention(query.float(), case.k_cache.float(), case.v_cache.float(), *args)
    assert out.dtype == torch.float16 and torch.equal(out, out32.half())


def test_a_query_that_is_a_strided_view_is_read_in_place():
    # The model hands the kernel q as a view into the fused qkv projection's output.
    case = Case([30, 5], 8, 2, 64, torch.float32, seed=1)
    qkv = torch.randn(2, (4 + 2 + 2) * 64, generator=case.gen)
    query = qkv[:, : 4 * 64].view(2, 4, 64)
    assert not query.is_contiguous()
    out = CPU.paged_decode_attention(
        query, case.k_cache, case.v_cache, case.block_tables, case.context_lens, 0.125
    )
    assert_matches_oracle(out, oracle(query, case, [1, 1], 0.125), torch.float32)


@pytest.mark.parametrize("seed", [2, 3])
def test_bf16_attention_rounds_the_weights_once_and_accumulates_in_float32(seed):
    # bf16 in and out: scores from exact products summed in float32, the softmax weights rounded to bf16
    # for the weighted sum of V (two positions per bf16 dot product), sums in float32. Measured error,
    # relative to each query head's largest exact output: 0.0035-0.0047, of which the final rounding to
    # bf16 alone is 0.0031-0.0035. Summing in bf16 instead would be off by about 0.05 over 700 positions.
    case = Case([700, 300, 17, 1], 16, 3, 64, torch.bfloat16, seed=seed)
    query = torch.randn(4, 9, 64, generator=case.gen).bfloat16()
    out = CPU.paged_decode_attention(
        query, case.k_cache, case.v_cache, case.block_tables, case.context_lens, 0.125
    )
    exact = oracle(query, case, [1, 1, 1, 1], 0.125)
    error = (out.double() - exact).abs() / exact.abs().amax(dim=-1, keepdim=True)
    assert out.dtype == torch.bfloat16 and error.max() < 2**-7


def test_block_id_outside_the_cache_is_an_error_not_a_crash():
    case = Case([40, 9], 8, 2, 64, torch.float32, seed=3)
    tables = case.block_tables.clone()
    tables[0, 2] = case.k_cache.shape[0] + 5
    query = torch.randn(2, 2, 64)
    with pytest.raises(RuntimeError, match="outside the cache"):
        CPU.paged_decode_attention(query, case.k_cache, case.v_cache, tables, case.context_lens, 0.1)
    tables[0, 2] = -1
    with pytest.raises(RuntimeError, match="outside the cache"):
        CPU.paged_decode_attention(query, case.k_cache, case.v_cache, tables, case.context_lens, 0.1)


def test_a_cache_in_any_other_layout_is_refused():
    # Position-major and head-major are the layouts the kernels read; a cache with its heads' dims strided
    # (a slice of a wider tensor) or its blocks apart would be read wrong, so it is refused, not read.
    query, tables, lens = torch.randn(1, 2, 64), torch.zeros(1, 1, dtype=torch.int32), torch.ones(1).int()
    sliced = torch.zeros(4, 8, 1, 128)[..., :64]
    apart = torch.zeros(8, 8, 1, 64)[::2]
    minor = torch.zeros(4, 1, 64, 8).permute(0, 3, 1, 2)  # head_dim not the innermost
    for cache in (sliced, apart, minor):
        with pytest.raises(RuntimeError, match="the KV cache must be contiguous, or a view of"):
            CPU.paged_decode_attention(query, cache, cache, tables, lens, 0.1)
        with pytest.raises(RuntimeError, match="the KV cache must be contiguous, or a view of"):
            CPU.rotary_write_kv_(
                torch.randn(1, 3, 64),
                torch.randn(1, 1, 64),
                torch.randn(1, 1, 64),
                torch.randn(1, 1, 64),
                cache,
                cache,
                torch.zeros(1, dtype=torch.int64),
            )


def test_context_past_the_block_table_or_short_of_the_queries_is_refused():
    case = Case([16], 8, 1, 64, torch.float32, seed=4)
    query = torch.randn(1, 1, 64)
    narrow = case.block_tables[:, :1]  # 8 positions, for a context of 16
    with pytest.raises(RuntimeError, match="exceeds its block table"):
        CPU.paged_decode_attention(query, case.k_cache, case.v_cache, narrow, case.context_lens, 0.1)
    with pytest.raises(RuntimeError, match="3 queries but context length 2"):
        CPU.paged_prefill_attention(
            torch.randn(3, 1, 64),
            case.k_cache,
            case.v_cache,
            case.block_tables,
            torch.tensor([0, 3], dtype=torch.int32),
            torch.tensor([2], dtype=torch.int32),
            0.1,
        )


# ---- the fused small ops --------------------------------------------------------------------------------

DTYPES = [torch.float32, torch.bfloat16]


def _close(dtype: torch.dtype) -> dict:
    # The norm's sum of squares is added up in another order: at most one rounding step apart in bf16.
    return {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 8e-3, "atol": 8e-3}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("size", [576, 40])  # bf16: whole registers, and the scalar path
def test_rms_norm_and_the_fused_residual_add_match_the_reference(dtype, size):
    gen = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(37, size, generator=gen)).to(dtype)
    delta = torch.randn(37, size, generator=gen).to(dtype)
    weight = (1 + 0.2 * torch.randn(size, generator=gen)).to(dtype)
    torch.testing.assert_close(
        CPU.rms_norm(x, weight, 1e-5), REFERENCE.rms_norm(x, weight, 1e-5), **_close(dtype)
    )
    x_ref = x.clone()
    expected = REFERENCE.add_rms_norm_(x_ref, delta, weight, 1e-5)
    got = CPU.add_rms_norm_(x, delta, weight, 1e-5)
    assert torch.equal(x, x_ref)  # the residual stream itself is updated exactly
    torch.testing.assert_close(got, expected, **_close(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 2 * 1536), (13, 2 * 1536), (3, 5, 2 * 40), (7, 2 * 9)])
def test_silu_mul_matches_the_reference(dtype, shape):
    # Rows of one token and of many, leading dimensions, and sizes that are no multiple of the vector width.
    gate_up = (3 * torch.randn(shape, generator=torch.Generator().manual_seed(shape[-1]))).to(dtype)
    got, want = CPU.silu_mul(gate_up), REFERENCE.silu_mul(gate_up)
    assert got.shape == want.shape and got.dtype == dtype
    if dtype == torch.bfloat16:
        # The exp may differ from PyTorch's in a last float bit, which the rounding to bf16 absorbs.
        assert (got != want).float().mean() < 1e-3
    torch.testing.assert_close(got, want, **_close(dtype))


def test_rms_norm_of_per_head_views_normalises_each_head():
    # qwen3's q/k norms see [T, heads, head_dim] slices of the qkv output: not one flat block of rows.
    qkv = torch.randn(5, 12, 32)
    heads = qkv[:, 2:9]
    weight = torch.randn(32)
    torch.testing.assert_close(CPU.rms_norm(heads, weight, 1e-6), REFERENCE.rms_norm(heads, weight, 1e-6))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 40])  # bf16: halves of whole registers, and the scalar path
def test_rotary_write_kv_is_bitwise_the_reference_and_skips_padding(dtype, head_dim, layout):
    gen = torch.Generator().manual_seed(1)
    num_heads, num_kv_heads, t = 6, 2, 9
    qkv = torch.randn(t, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(dtype)
    table = torch.randn(100, 2 * head_dim, generator=gen).to(dtype)
    positions = torch.randint(0, 100, (t,), generator=gen)
    cos, sin = table[positions].unsqueeze(1).chunk(2, dim=-1)
    slots = torch.randperm(40, generator=gen)[:t]
    slots[3] = -1  # padding
    results = []
    for ops in (CPU, REFERENCE):
        x = qkv.clone()
        qk = x[:, : (num_heads + num_kv_heads) * head_dim].view(t, num_heads + num_kv_heads, head_dim)
        v = x[:, (num_heads + num_kv_heads) * head_dim :].view(t, num_kv_heads, head_dim)
        k_cache = nan_cache((10, 4, num_kv_heads, head_dim), dtype, layout)
        v_cache = nan_cache((10, 4, num_kv_heads, head_dim), dtype, layout)
        ops.rotary_write_kv_(qk, v, cos, sin, k_cache, v_cache, slots)
        results.append((x, k_cache, v_cache))
    for got, want in zip(*results, strict=True):
        assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0))
    k_cache = results[0][1].reshape(-1, num_kv_heads, head_dim)
    assert k_cache.isnan().all(-1).all(-1).sum() == 40 - (t - 1)  # only the 8 real tokens were written


def test_rotary_write_kv_refuses_a_slot_outside_the_cache():
    qk, v = torch.randn(2, 3, 8), torch.randn(2, 1, 8)
    cos, sin = torch.randn(2, 1, 8), torch.randn(2, 1, 8)
    k_cache, v_cache = torch.zeros(2, 4, 1, 8), torch.zeros(2, 4, 1, 8)
    with pytest.raises(RuntimeError, match="slot 8 is outside the cache"):
        CPU.rotary_write_kv_(qk, v, cos, sin, k_cache, v_cache, torch.tensor([0, 8]))


# ---- block copies ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(("src", "dst"), COPY_CASES)
def test_copy_blocks_in_order_in_every_layer(src, dst, layout):
    check_copy_blocks_in_order(CPU, src, dst, layout)


def test_copy_blocks_refuses_a_block_outside_the_cache():
    k, v = [torch.zeros(4, 2, 1, 8)], [torch.zeros(4, 2, 1, 8)]
    with pytest.raises(RuntimeError, match="copy 1 -> 4 is outside the cache"):
        CPU.copy_blocks(k, v, torch.tensor([1]), torch.tensor([4]))


# ---- the sampler's argmax ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 5, 16, 17, 31, 49152])
def test_argmax_is_torchs_on_ties_infinities_and_nans(n, dtype):
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(10, n, generator=gen).to(dtype)
    # Row 1: the largest value twice (the first counts); row 2: all equal; row 3: all -inf (index 0);
    # row 4: a NaN after the largest value, row 5: one in the last place; row 6: +inf twice; row 7: the
    # largest value in the last place; rows 8-9 as drawn.
    x[1, n // 3] = x[1, -1] = 9.0
    x[2] = 0.5
    x[3] = float("-inf")
    x[4, n // 2] = float("nan")
    x[5, -1] = float("nan")
    x[6, n // 4] = x[6, -1] = float("inf")
    x[7, -1] = 100.0
    assert torch.equal(CPU.argmax(x), x.argmax(dim=-1))
    # A row view with a gap between rows, and rows of logits as the sampler sees them.
    wide = torch.randn(4, n + 7, generator=gen).to(dtype)[:, :n]
    assert torch.equal(CPU.argmax(wide), wide.argmax(dim=-1))
    # bf16: ties everywhere (8 bits of mantissa), and the answer is the widened row's.
    assert torch.equal(CPU.argmax(x), CPU.argmax(x.float()))


def test_argmax_of_anything_else_is_torchs():
    x = torch.randn(6, 40).half()
    assert torch.equal(CPU.argmax(x), x.argmax(dim=-1))
    t = torch.randn(40, 6).T
    assert torch.equal(CPU.argmax(t), t.argmax(dim=-1))


def _masked_argmax_oracle(x: torch.Tensor, masks: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """torch.argmax of x in float64 with -inf on each banned token, the bits unpacked by numpy."""
    n = x.shape[1]
    allowed = np.unpackbits(masks.numpy().view(np.uint8), axis=1, bitorder="little")[:, :n].astype(bool)
    rows = torch.arange(x.shape[0]) if rows is None else rows
    y = x.double().clone()
    for i, row in enumerate(rows.tolist()):
        y[row, ~torch.from_numpy(allowed[i])] = float("-inf")
    return y.argmax(dim=-1)


def _grammar_like_masks(num: int, n: int, gen: torch.Generator) -> torch.Tensor:
    """Packed masks int32 [num, ceil(n / 32)]: runs of allowed and banned tokens of random lengths (as grammars
    give), each mask's bits also flipped at random in a stretch (scattered bans inside runs)."""
    bits = torch.zeros(num, -(-n // 32) * 32, dtype=torch.bool)
    for i in range(num):
        t, on = 0, bool(i % 2)
        while t < n:
            run = int(torch.randint(1, 200, (1,), generator=gen))
            bits[i, t : t + run] = on
            t, on = t + run, not on
        lo = int(torch.randint(0, n, (1,), generator=gen))
        flips = torch.rand(min(300, n - lo), generator=gen) < 0.3
        bits[i, lo : lo + flips.numel()] ^= flips
    bits[:, n:] = bool(num % 2)  # bits past the vocabulary count for nothing
    packed = np.packbits(bits.numpy(), axis=1, bitorder="little")
    return torch.from_numpy(packed.view(np.int32).copy())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 5, 16, 17, 31, 32, 33, 100, 49152, 49155])
def test_masked_argmax_is_the_argmax_of_the_masked_row(n, dtype):
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(12, n, generator=gen).to(dtype)
    masks = _grammar_like_masks(12, n, gen)
    # Row 0: one token allowed, the last; row 1: none (index 0, as argmax of all -inf); row 2: all; row 3: a
    # banned token far above the rest; row 4: ties among allowed tokens, and a banned NaN; row 5: an allowed
    # NaN after a banned one; row 6: every allowed value -inf; row 7: +inf allowed twice.
    masks[0] = 0
    masks[0, (n - 1) // 32] = 1 << ((n - 1) % 32) if (n - 1) % 32 < 31 else -(2**31)
    masks[1] = 0
    masks[2] = -1
    masks[3] = -1
    masks[3, 0] = -2  # token 0 banned
    x[3, 0] = 1000.0
    x[4] = 0.25
    masks[4] = -1
    masks[4, 0] = -2
    x[4, 0] = float("nan")
    masks[5] = -1
    masks[5, 0] = -2
    x[5, 0] = x[5, n - 1] = float("nan")
    masks[6] = -1
    x[6] = float("-inf")
    masks[7] = -1
    x[7, n // 3] = x[7, n - 1] = float("inf")
    expected = _masked_argmax_oracle(x, masks, None)
    assert torch.equal(CPU.masked_argmax(x, masks, None), expected)
    assert torch.equal(ReferenceOps().masked_argmax(x, masks, None), expected)
    # Some rows constrained (in another order), the rest plain argmax; and a row view with a gap.
    rows = torch.tensor([9, 2, 5, 0])
    expected = _masked_argmax_oracle(x, masks[:4], rows)
    assert torch.equal(CPU.masked_argmax(x, masks[:4], rows), expected)
    assert torch.equal(ReferenceOps().masked_argmax(x, masks[:4], rows), expected)
    wide = torch.randn(3, n + 7, generator=gen).to(dtype)[:, :n]
    assert torch.equal(
        CPU.masked_argmax(wide, masks[8:11], None), _masked_argmax_oracle(wide, masks[8:11], None)
    )


def test_masked_argmax_of_anything_else_is_the_references():
    x = torch.randn(3, 40).half()
    masks = torch.tensor([[5, 1], [-1, 0], [0, 128]], dtype=torch.int32)
    assert torch.equal(CPU.masked_argmax(x, masks, None), _masked_argmax_oracle(x, masks, None))


# ---- the linear layer of few rows ----------------------------------------------------------------------

needs_linear = pytest.mark.skipif(
    _linear_kernels() is None,
    reason="no linear in this build (it needs AVX-512 BF16 or AVX2 with FMA)",
)


def _exact_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ weight.double().T
    return out if bias is None else out + bias.double()


def _assert_rounds_the_exact_product_once(out, x, weight, bias) -> torch.Tensor:
    """Within one bf16 step of the exact product (and float32 rounding where a sum cancels to near zero),
    and at least as close to it as PyTorch's own bf16 linear; returns the exact product."""
    exact = _exact_linear(x, weight, bias)
    torch.testing.assert_close(out.double(), exact, rtol=2**-8, atol=1e-4)
    theirs = torch.nn.functional.linear(x, weight, bias)
    assert (out.double() - exact).abs().max() <= 1.001 * (theirs.double() - exact).abs().max() + 1e-6
    return exact


@needs_linear
@pytest.mark.parametrize(
    ("rows", "n", "k"),
    [
        (1, 960, 576),
        (2, 200, 96),
        (3, 576, 1536),
        (4, 100, 46),
        (7, 576, 64),
        (8, 17, 63),
        (16, 3072, 576),
        (17, 15, 2),
        (26, 576, 576),
        (30, 31, 40),
        (40, 33, 97),
        (60, 40, 1000),
        (64, 200, 96),
        (97, 960, 96),
        (98, 200, 96),
        (128, 576, 64),
        (250, 100, 96),
    ],
)
@pytest.mark.parametrize("bias", [False, True])
def test_linear_rounds_the_exact_product_once(rows, n, k, bias):
    # Products summed in float32, one rounding to bf16: within one bf16 step of the exact result (and
    # float32 rounding where a sum cancels to near zero), and at least as close to it as PyTorch's own
    # bf16 linear. Odd N and K exercise the padding of the packed copy. Up to 4 rows a thread reads its
    # blocks as four runs side by side, then what is left as two runs, then one block (200 and 100
    # columns leave 2 and 3 on a thread of 2 threads); up to 8 rows as two runs; up to 30 rows in one
    # pass over each block of the weight, more in several; past 120 rows (four passes) a group of rows
    # through all blocks, then the next (250 rows: nine chunks of 27-28, in groups of 111, 111 and 28).
    # On AVX2: one row as four runs side by side and two rows as two, then one block at a time (960
    # columns: 30 blocks a thread, 7 in each of four runs and 2 left); below 32 rows passes of 6, then of
    # up to 4 (7 rows: 6 + 1, 16: 6 + 6 + 4, 26: four of 6 + 2, 30: five of 6); from 32 rows each block
    # widened to float32 once, then passes of 5-6 rows; a group of rows at a time, 96 up to
    # K = 768 and 48 past it, their blocks handed to the threads one at a time (64 rows of K = 96: one
    # group; 128 of K = 64: 96 over widened blocks, then 32; 250: 96, 96 and 58; 60 of K = 1000: 48, then 12
    # in passes of 4; 97 and 98 of K = 96: 96, then the last row as four runs, the last two as two). On
    # AVX-512 without BF16 the same groups and runs, but from 4 rows even passes of up to 8 rows over three
    # blocks at once, with no float32 copy (200 columns: 13 blocks, four threes and the last alone; 128 rows
    # of K = 64: 96 in twelve passes, then 32 in four).
    gen = torch.Generator().manual_seed(rows * n + k)
    weight = torch.randn(n, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16() if bias else None
    x = torch.randn(rows, k, generator=gen).bfloat16()
    kernels = _linear_kernels()
    out = kernels.linear(x, kernels.pack_linear_weight(weight), n, b)
    assert out.shape == (rows, n) and out.dtype == torch.bfloat16
    _assert_rounds_the_exact_product_once(out, x, weight, b)


@needs_linear
@pytest.mark.skipif(
    not _built() or "bf16" in cpu_ops.load().instruction_set(),
    reason="the AVX-512 BF16 linear sums a pair at a time",
)
@pytest.mark.parametrize(
    ("rows", "n", "k", "bias"), [(40, 200, 96, True), (100, 64, 1536, False), (100, 48, 96, True)]
)
def test_widening_linear_gives_a_row_the_same_bits_in_any_pass(rows, n, k, bias):
    # Without a bf16 dot product (AVX2, AVX-512 without BF16) every pass runs a row's float32 FMAs in k
    # order: one row as four streams of blocks, two as two, more in balanced passes of up to 6 rows (8 over
    # three blocks at once on AVX-512, fewer at the end where the count is not a multiple: n = 200 and 64),
    # and from 32 rows in groups of 96 up to K = 768, of 48 past it, and what is left (100 rows are 96 + 4
    # and 48 + 48 + 4), through a float32 copy of each block on AVX2. In any of them a row's result is the
    # same. So that any other order shows, x holds +2^40 and -2^40 against equal weights at k/3 and 2k/3: in
    # k order the sum up to 2k/3 vanishes (absorbed, then cancelled) and only the terms after it are left.
    gen = torch.Generator().manual_seed(rows + n + k)
    weight = torch.randn(n, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16() if bias else None
    x = torch.randn(rows, k, generator=gen).bfloat16()
    weight[:, 2 * k // 3] = weight[:, k // 3]
    x[:, k // 3], x[:, 2 * k // 3] = 2.0**40, -(2.0**40)
    kernels = _linear_kernels()
    packed = kernels.pack_linear_weight(weight)
    whole = kernels.linear(x, packed, n, b)
    parts = [(0, 3), (3, 4), (7, 4), (1, 6), (5, 10), (13, 24), (4, 32), (rows - 3, 3)]
    for start, size in [*parts, (0, 1), (9, 1), (2, 2), (4, 8), (6, 13)]:
        part = kernels.linear(x[start : start + size], packed, n, b)
        assert torch.equal(part, whole[start : start + size]), (start, size)


needs_linear_f32 = pytest.mark.skipif(
    _linear_kernels(torch.float32) is None,
    reason="no float32 linear in this build (it needs AVX2 with FMA)",
)


@needs_linear_f32
@pytest.mark.parametrize(
    ("rows", "n", "k"),
    [
        (1, 960, 576),
        (1, 17, 63),
        (2, 200, 96),
        (3, 576, 1536),
        (5, 100, 46),
        (6, 48, 7),
        (7, 576, 64),
        (13, 33, 97),
        (50, 40, 1000),
        (97, 960, 96),
        (130, 40, 1000),
    ],
)
@pytest.mark.parametrize("bias", [False, True])
def test_float32_linear_is_within_float32_summation_of_the_exact_product(rows, n, k, bias):
    # Sums in float32 FMAs, in k order, the bias added last: within the bound of k-term float32 summation,
    # k * 2^-24 times the sum of |x_i w_i| (plus the bias's rounding), of the float64 product. One row as
    # four runs side by side a thread (960 columns: 30 blocks a thread, 7 in each run and 2 left; 17
    # columns: two blocks, one a thread, alone), two rows as two runs (200 columns: 13 blocks, 6 and 7 a
    # thread, 3 each in two runs and 0 or 1 left), more rows in passes of up to 6 over each block (7: 3 +
    # 4, 13: 4 + 4 + 5), past 96 rows (48 where K is over 768) in groups, each through all the blocks (97
    # rows of K = 96: 48 + 49; 50 of K = 1000: 25 + 25; 130: 43 + 43 + 44); N and K not multiples of 16
    # exercise the padded blocks.
    gen = torch.Generator().manual_seed(rows * n + k)
    weight = torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    x = torch.randn(rows, k, generator=gen)
    kernels = _linear_kernels(torch.float32)
    out = kernels.linear(x, kernels.pack_linear_weight(weight), n, b)
    assert out.shape == (rows, n) and out.dtype == torch.float32
    exact = _exact_linear(x, weight, b)
    magnitude = x.double().abs() @ weight.double().abs().T
    bound = (k + 1) * 2.0**-24 * (magnitude if b is None else magnitude + b.double().abs())
    assert ((out.double() - exact).abs() <= bound).all()


@needs_linear_f32
@pytest.mark.parametrize(("n", "k"), [(200, 96), (960, 64), (33, 1000)])
def test_float32_linear_gives_a_row_the_same_bits_in_any_pass(n, k):
    # Every pass, of one row as four runs, of two as two, of 3 to 6 rows over a block, in one group of rows or
    # several, sums a row's products with FMAs in k order: a row's result does not depend on the rows beside
    # it. So that any other order shows, x holds +2^40 and -2^40 against equal weights at k/3 and 2k/3: in
    # k order the sum up to 2k/3 vanishes (absorbed, then cancelled) and only the terms after it are left.
    rows = 110  # past one group of rows (96 up to K = 768, else 48)
    gen = torch.Generator().manual_seed(n + k)
    weight = torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen)
    x = torch.randn(rows, k, generator=gen)
    weight[:, 2 * k // 3] = weight[:, k // 3]
    x[:, k // 3], x[:, 2 * k // 3] = 2.0**40, -(2.0**40)
    kernels = _linear_kernels(torch.float32)
    packed = kernels.pack_linear_weight(weight)
    whole = kernels.linear(x, packed, n, b)
    # Where 2^40 w is large enough to absorb every term (|w| > 0.01: a float32 step of 2^10 or more).
    tail = x[:, 2 * k // 3 + 1 :].double() @ weight[:, 2 * k // 3 + 1 :].double().T + b.double()
    big = weight[:, k // 3].abs() > 0.01
    torch.testing.assert_close(whole[:, big].double(), tail[:, big], rtol=1e-5, atol=1e-3)
    for start, size in [(0, 1), (5, 1), (1, 2), (7, 2), (2, 3), (3, 4), (9, 6), (0, 7), (4, 13), (3, 50)]:
        part = kernels.linear(x[start : start + size], packed, n, b)
        assert torch.equal(part, whole[start : start + size]), (start, size)


@needs_linear_f32
def test_float32_linear_reads_strided_and_batched_inputs():
    weight = torch.randn(48, 64)
    kernels = _linear_kernels(torch.float32)
    packed = kernels.pack_linear_weight(weight)
    assert packed.shape == (3, 64, 16) and packed.dtype == torch.float32
    wide = torch.randn(2, 3, 100)
    x = wide[..., 10:74]
    assert not x.is_contiguous()
    out = kernels.linear(x, packed, 48, None)
    assert out.shape == (2, 3, 48)
    torch.testing.assert_close(out.double(), _exact_linear(x, weight, None), rtol=1e-5, atol=1e-4)
    assert kernels.linear(x[:0], packed, 48, None).shape == (0, 3, 48)


@needs_linear_f32
def test_float32_linear_refuses_what_it_cannot_read():
    kernels = _linear_kernels(torch.float32)
    packed = kernels.pack_linear_weight(torch.randn(40, 64))
    with pytest.raises(RuntimeError, match="x must be float32"):
        kernels.linear(torch.randn(2, 64).bfloat16(), packed, 40, None)
    with pytest.raises(RuntimeError, match="x has K = 32"):
        kernels.linear(torch.randn(2, 32), packed, 40, None)
    with pytest.raises(RuntimeError, match="n = 60 does not match"):
        kernels.linear(torch.randn(2, 64), packed, 60, None)
    with pytest.raises(RuntimeError, match="bias must be float32"):
        kernels.linear(torch.randn(2, 64), packed, 40, torch.randn(40).bfloat16())
    with pytest.raises(RuntimeError, match="packed must be a weight from pack_linear_weight"):
        kernels.linear(torch.randn(2, 64), torch.randn(40, 64), 40, None)
    with pytest.raises(RuntimeError, match="packed must be a weight from pack_linear_weight"):
        kernels.linear_silu(torch.randn(2, 64), packed, 20, None)  # the fused MLP pass is bf16's
    with pytest.raises(RuntimeError, match="weight must be \\[N, K\\] bf16 or float32"):
        kernels.pack_linear_weight(torch.randn(40, 64).half())


_FEWER_THREADS_SCRIPT = """
import torch
from pagedserve.kernels import cpu_ops
torch.set_num_threads(2)
kernels = cpu_ops.load()
gen = torch.Generator().manual_seed(0)
for rows, n, k in [(1, 960, 576), (2, 200, 96), (3, 576, 64), (8, 17, 63), (24, 100, 96), (100, 48, 96)]:
    weight = torch.randn(n, k, generator=gen).bfloat16()
    x = torch.randn(rows, k, generator=gen).bfloat16()
    out = kernels.linear(x, kernels.pack_linear_weight(weight), n, None)
    exact = x.double() @ weight.double().T
    torch.testing.assert_close(out.double(), exact, rtol=2**-8, atol=1e-4)
for rows, n, k in [(1, 960, 576), (2, 200, 96), (7, 17, 63)]:
    weight, x = torch.randn(n, k, generator=gen), torch.randn(rows, k, generator=gen)
    out = kernels.linear(x, kernels.pack_linear_weight(weight), n, None)
    torch.testing.assert_close(out.double(), x.double() @ weight.double().T, rtol=1e-5, atol=1e-3)
print("ok")
"""


@needs_linear
def test_linear_computes_every_block_when_openmp_starts_fewer_threads_than_asked():
    # Two threads asked, one started (OMP_THREAD_LIMIT): the AVX2 linear's run of blocks of the thread
    # that never started is taken, unit by unit from its back end, by the one that did (in a decode
    # batch: one block, or a step of two or four streams for one or two rows, and the blocks they leave
    # over; the float32 linear's runs at any row count); a block nobody takes would leave its columns
    # unwritten.
    env = {**os.environ, "OMP_THREAD_LIMIT": "1"}
    done = subprocess.run(
        python_command("-c", _FEWER_THREADS_SCRIPT), env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


@needs_linear
def test_linear_reads_strided_and_batched_inputs():
    # The model hands it views (a slice of a fused projection) and any leading dimensions.
    weight = torch.randn(48, 64).bfloat16()
    kernels = _linear_kernels()
    packed = kernels.pack_linear_weight(weight)
    wide = torch.randn(2, 3, 100).bfloat16()
    x = wide[..., 10:74]
    assert not x.is_contiguous()
    out = kernels.linear(x, packed, 48, None)
    assert out.shape == (2, 3, 48)
    torch.testing.assert_close(out.double(), _exact_linear(x, weight, None), rtol=2**-8, atol=1e-4)
    assert kernels.linear(x[:0], packed, 48, None).shape == (0, 3, 48)


@needs_linear
@pytest.mark.parametrize("rows", [1, 6, 8, 9, 30, 31, 61, 200, 250, 300])
@pytest.mark.parametrize(("size", "k"), [(96, 64), (40, 30), (48, 33), (32, 800)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_silu_is_linear_then_silu_mul(rows, size, k, bias):
    # The MLP's gate_up and activation in one pass where it applies (size a multiple of 16, even K; on
    # AVX-512 more than 8 rows: one pass over each block or several, and past 120 rows in groups of rows;
    # on AVX2 the rows through the float32 copy, from 32 in groups of 96 or, past K = 768, 48, with a
    # short last group as the two calls: 200 rows; with AMX, from 6 rows where K is a multiple of 32, the
    # gate and up blocks as one step's two W tiles), else the two calls (and from 256 rows, where oneDNN
    # computes the linear, always: 300 rows): the same bits either way, from a strided view and with leading
    # dimensions too.
    gen = torch.Generator().manual_seed(rows * size + k)
    weight = torch.randn(2 * size, k, generator=gen).bfloat16()
    b = torch.randn(2 * size, generator=gen).bfloat16() if bias else None
    x = torch.randn(rows, k + 5, generator=gen).bfloat16()[:, 2 : 2 + k]
    kernels = _linear_kernels()
    packed = kernels.pack_linear_weight(weight)
    expected = kernels.silu_mul(kernels.linear(x, packed, 2 * size, b))
    assert torch.equal(kernels.linear_silu(x, packed, size, b), expected)
    batched = kernels.linear_silu(x.unsqueeze(0), packed, size, b)
    assert batched.shape == (1, rows, size) and torch.equal(batched[0], expected)


@pytest.mark.skipif(
    not {"amx_bf16", "amx_tile"} <= _cpu_flags() or cpu_ops.march() != "native",
    reason="this CPU has no AMX, or the kernels are built for another instruction set",
)
def test_a_cpu_with_amx_gets_the_amx_kernels(amx_switch, onednn_rows):
    # Without them (a build that lost the tile instructions, a refused permission, a dispatch that no longer
    # reaches them) the linear and the tiled attention fall back to AVX-512 BF16 without a word, several
    # times slower. (The linear's 256 rows stay with the kernels here, not oneDNN.)
    kernels = cpu_ops.load()
    assert kernels.has_amx()
    onednn_rows(False, -1)
    # That the tiles run shows in their rare last-bit roundings, which AVX-512 does not make: over these
    # inputs 107 of the gate_up projection's 786,432 outputs, 96 of its SiLU product's 393,216 and 220 of a
    # 500-token prompt's 288,000 attention outputs differ between the two paths.
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(3072, 576, generator=gen).bfloat16()
    x = torch.randn(256, 576, generator=gen).bfloat16()
    packed = kernels.pack_linear_weight(weight)
    case = Case([500], 16, 3, 64, torch.bfloat16, seed=1, layout="head-major")
    query = torch.randn(500, 9, 64, generator=case.gen).bfloat16()
    starts = torch.tensor([0, 500], dtype=torch.int32)
    args = (query, case.k_cache, case.v_cache, case.block_tables, starts, case.context_lens, 0.125)

    def outputs():
        return (
            kernels.linear(x, packed, 3072, None),
            kernels.linear_silu(x, packed, 1536, None),
            CPU.paged_prefill_attention(*args),
        )

    with_tiles = outputs()
    amx_switch(False)
    for name, tiles, avx512 in zip(
        ("linear", "linear_silu", "attention"), with_tiles, outputs(), strict=True
    ):
        assert (tiles != avx512).any(), name


@needs_amx
@pytest.mark.parametrize(
    ("rows", "n", "k"),
    [
        (6, 200, 64),
        (16, 3072, 576),
        (17, 960, 576),
        (31, 33, 96),
        (32, 576, 1536),
        (33, 48, 32),
        (300, 200, 96),
        (513, 100, 64),
    ],
)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_amx_linear_rounds_the_exact_product_once_as_avx512_does(
    amx_switch, onednn_rows, rows, n, k, bias, threads
):
    # From 6 rows and K a multiple of 32 the linear multiplies tiles: x tiles of 16 rows (the last padded:
    # 6, 17, 31, 33, 300 and 513 rows), W tiles straight from the packed blocks, two blocks and two x tiles
    # a step (odd block counts a thread and odd tile counts leave single ones: 200 columns are 13 blocks,
    # 33 and 100 columns 3 and 7), all rows at once (300 and 513 rows too). Within one bf16
    # step of the exact product, at least as close to it as PyTorch's linear, and AVX-512's bits but for
    # rare last-bit differences of the float32 sums (tdpbf16ps rounds inside a pair's products
    # differently in some cases: about 1 output in 5,000 apart). The rows that would go to oneDNN stay here.
    onednn_rows(False, -1)
    gen = torch.Generator().manual_seed(rows * n + k)
    weight = torch.randn(n, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16() if bias else None
    x = torch.randn(rows, k, generator=gen).bfloat16()
    kernels = _linear_kernels()
    packed = kernels.pack_linear_weight(weight)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = kernels.linear(x, packed, n, b)
        amx_switch(False)
        avx512 = kernels.linear(x, packed, n, b)
    finally:
        torch.set_num_threads(before)
    exact = _assert_rounds_the_exact_product_once(out, x, weight, b)
    differ = out != avx512
    assert differ.float().mean() < 1e-3
    # Where they differ, by the float32 sums' rounding: a bf16 step or two (2^-7 of the value), more only
    # where a sum cancels to near zero, within the bound of k-term float32 summation.
    magnitude = x.double().abs() @ weight.double().abs().T
    gap = (out.double() - avx512.double()).abs()
    assert (gap <= 2**-7 * exact.abs() + (k + 1) * 2.0**-24 * magnitude + 1e-30).all()


@pytest.fixture
def onednn_rows():
    """set(f32, rows): the rows from which the linear of the dtype goes to oneDNN (-1 never); put back after."""
    kernels = cpu_ops.load()
    before = {f32: kernels.set_onednn_min_rows(f32, -2) for f32 in (False, True)}
    yield kernels.set_onednn_min_rows
    for f32, rows in before.items():
        kernels.set_onednn_min_rows(f32, rows)


@needs_linear
@pytest.mark.parametrize(("rows", "n", "k"), [(1, 200, 96), (7, 33, 62), (40, 960, 576), (300, 100, 64)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_linear_through_onednn_is_torchs_linear_of_the_unpacked_weight(onednn_rows, rows, n, k, bias, dtype):
    # Many rows go to oneDNN (at::linear) over the packed weight unpacked to [N, K]: the result is F.linear's of
    # the weight itself, bit for bit, from a strided view too; and the MLP's linear_silu is then the linear
    # then silu_mul.
    kernels = _linear_kernels(dtype)
    if kernels is None:
        pytest.skip("no linear for the dtype in this build")
    gen = torch.Generator().manual_seed(rows + n + k)
    weight = torch.randn(n, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    x = torch.randn(rows, k + 3, generator=gen).to(dtype)[:, 1 : 1 + k]
    packed = kernels.pack_linear_weight(weight)
    onednn_rows(dtype == torch.float32, 1)
    assert torch.equal(kernels.linear(x, packed, n, b), torch.nn.functional.linear(x, weight, b))
    if dtype == torch.bfloat16 and n % 32 == 0:
        expected = kernels.silu_mul(kernels.linear(x, packed, n, b))
        assert torch.equal(kernels.linear_silu(x, packed, n // 2, b), expected)


@needs_linear
def test_linear_refuses_mismatched_shapes():
    kernels = _linear_kernels()
    packed = kernels.pack_linear_weight(torch.randn(40, 64).bfloat16())
    with pytest.raises(RuntimeError, match="x has K = 32"):
        kernels.linear(torch.randn(2, 32).bfloat16(), packed, 40, None)
    with pytest.raises(RuntimeError, match="n = 60 does not match"):
        kernels.linear(torch.randn(2, 64).bfloat16(), packed, 60, None)
    with pytest.raises(RuntimeError, match="bias must be bf16"):
        kernels.linear(torch.randn(2, 64).bfloat16(), packed, 40, torch.randn(39).bfloat16())
    with pytest.raises(RuntimeError, match="packed must be a weight from pack_linear_weight"):
        kernels.linear(torch.randn(2, 64).bfloat16(), torch.randn(40, 64).bfloat16(), 40, None)


# ---- a whole model ------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama_llama3_rope_untied", "qwen3_qk_norm_explicit_head_dim"])
def test_bf16_model_through_the_kernels_is_as_accurate_as_through_the_reference(
    tmp_path, monkeypatch, family
):
    hf = _save_tiny_hf_model(FAMILIES[family](), tmp_path)
    tokens = [torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(n)) for n in (70, 9)]
    expected = torch.cat([_hf_logits(hf, t) for t in tokens])
    errors = {}
    for kernels in ("on", "off"):
        monkeypatch.setenv(CPU_KERNELS_ENV, kernels)
        model = load_model(tmp_path, torch.bfloat16, "cpu")
        assert (model.layers[0].self_attn.ops.name == "cpu") == (kernels == "on")
        cache = PagedCache(model, 2, block_size=8)
        # A whole prompt (SDPA), a short one (the paged kernel), then one decode step for each.
        logits = cache.run(model, tokens, [(0, 0, 69), (1, 0, 8)])
        decode = cache.run(model, tokens, [(0, 69, 70), (1, 8, 9)])
        got = torch.cat([logits[:69], decode[:1], logits[69:], decode[1:]])
        errors[kernels] = (got - expected).abs().max().item()
    assert errors["on"] <= 1.25 * errors["off"] + 1e-3, errors


# ---- every instruction set's branch compiles ------------------------------------------------------------

# The build targets the CPU it runs on (-march=native), so a machine compiles only its own branch of the
# vector layer (vec.h) and of the kernels that one instruction set has alone. Each is compiled here whatever
# CPU runs the suite: plain C++ (no AVX2), AVX2 with FMA, AVX-512 without BF16, AVX-512 BF16 with AMX. Every
# kernel translation unit, but not the bindings: they have no branches, and their torch/extension.h would
# take most of the time.
MARCHES = ["x86-64-v2", "haswell", "icelake-server", "sapphirerapids"]
# The headers every unit's compile spends most of its time in.
PRECOMPILED_HEADERS = ["ATen/Parallel.h", "ATen/core/Tensor.h", "ATen/ops/empty.h", "ATen/ops/linear.h"]


@pytest.fixture(scope="module")
def compiled_marches(tmp_path_factory) -> dict[str, list[subprocess.CompletedProcess[str]]]:
    from concurrent.futures import ThreadPoolExecutor

    from torch.utils import cpp_extension

    includes = [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]
    flags = [f for f in cpu_ops.CFLAGS if f != "-O3"]
    out = tmp_path_factory.mktemp("march")
    units = [path for path in cpu_ops.sources() if path.name != "bindings.cpp"]

    # -O0 still inlines the intrinsics, so one outside its branch fails ("target specific option mismatch"),
    # in about half of -O3's time. Most of a unit's compile is ATen's headers: each instruction set's units
    # share them precompiled (a header compiled once, with the units' flags; GCC reads the .gch instead).
    def command(march: str) -> list[str]:
        base = ["g++", "-std=c++20", "-O0", f"-march={march}", *flags, "-DTORCH_EXTENSION_NAME=check"]
        return base + [f"-I{p}" for p in includes]

    def compile_headers(march: str) -> Path:
        header = out / march / "aten.h"
        header.parent.mkdir()
        header.write_text("".join(f"#include <{h}>\n" for h in PRECOMPILED_HEADERS))
        subprocess.run([*command(march), "-x", "c++-header", str(header), "-o", f"{header}.gch"], check=False)
        return header

    def compile_unit(march: str, header: Path, unit: Path) -> subprocess.CompletedProcess[str]:
        object_file = out / march / f"{unit.stem}.o"
        args = [*command(march), "-include", str(header), "-c", str(unit), "-o", str(object_file)]
        return subprocess.run(args, capture_output=True, text=True)

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        headers = dict(zip(MARCHES, pool.map(compile_headers, MARCHES), strict=True))
        jobs = [(march, unit) for march in MARCHES for unit in units]
        done = list(pool.map(lambda job: compile_unit(job[0], headers[job[0]], job[1]), jobs))
    return {march: [d for (m, _), d in zip(jobs, done, strict=True) if m == march] for march in MARCHES}


needs_gxx = pytest.mark.skipif(
    shutil.which("g++") is None or platform.machine() != "x86_64", reason="needs g++ on x86-64"
)


# The compiles take minutes on two cores, longer on a loaded machine: their own deadline, not the suite's.
@needs_gxx
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("march", MARCHES)
def test_every_kernel_unit_compiles_for_each_instruction_set(compiled_marches, march):
    for result in compiled_marches[march]:
        assert result.returncode == 0, (result.args[-3], result.stderr[-4000:])


@needs_gxx
@pytest.mark.timeout(1800)
@pytest.mark.skipif(shutil.which("nm") is None, reason="needs nm")
@pytest.mark.parametrize("march", MARCHES)
def test_every_kernel_function_a_unit_calls_is_defined_for_each_instruction_set(compiled_marches, march):
    # A dispatch that calls an instruction set's kernel must find it defined (or a stub) in every build,
    # else the extension fails to load there.
    objects = [result.args[-1] for result in compiled_marches[march] if result.returncode == 0]
    if len(objects) != len(compiled_marches[march]):
        pytest.skip("a unit did not compile (see the test above)")

    def symbols(*flags: str) -> set[str]:
        listing = subprocess.run(["nm", *flags, *objects], capture_output=True, text=True, check=True).stdout
        return {line.split()[-1] for line in listing.splitlines() if line.strip() and not line.endswith(":")}

    ours = {name for name in symbols("--undefined-only") if name.startswith("_ZN10pagedserve")}
    missing = ours - symbols("--defined-only")
    assert not missing, sorted(missing)
