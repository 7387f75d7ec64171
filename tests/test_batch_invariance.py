"""Batch invariance of the C++ CPU kernels (set_batch_invariant): a row's linear and attention output has
the same bits whatever the rest of its call computes (how many rows, prompt rows or decode rows, where a
prompt's chunks begin) and whatever the thread count; a prompt token gets the bits a decode step gives it.

Each test computes the rows under test once on their own (one row, one decode step at a time, one thread)
and compares every other way of computing them with those bits; each result is also checked against the
exact product or the float64 oracle, so that bits that agree by being wrong alike fail too.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from test_kernels_cpu import CPU, _assert_rounds_the_exact_product_once, needs_amx
from test_kernels_reference import Case, assert_matches_oracle, oracle

from pagedserve.kernels import cpu_ops

pytestmark = pytest.mark.skipif(CPU is None, reason="the C++ CPU kernels cannot be built here")


@pytest.fixture(autouse=True)
def invariant():
    """The kernels batch-invariant through the test, as the worker sets them; put back after."""
    before = CPU.batch_invariant
    CPU.batch_invariant = True
    yield
    CPU.batch_invariant = before


@pytest.fixture
def threads():
    """set(n) runs the kernels on n threads; torch's setting is put back after the test."""
    previous = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(previous)


# Row counts that reach every body of the linear without batch invariance: AVX-512 BF16's four streams (1-4
# rows) and two (5-8), AMX from 6 rows, chunks of up to 30 rows, oneDNN from 256 rows in float32 and 1024 in
# bf16 with AMX.
ROW_COUNTS = [1, 2, 3, 5, 6, 8, 9, 17, 31, 64, 300, 1030]
# SmolLM2-135M's projections: qkv, gate_up, down; and one whose K is no multiple of 32 (no AMX).
SHAPES = [(960, 576), (3072, 576), (576, 1536), (200, 80)]


def _exact(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ weight.double().T
    return y if bias is None else y + bias.double()


def _linear_rows(dtype: torch.dtype, n: int, k: int, bias: bool, seed: int):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    x = torch.randn(max(ROW_COUNTS), k, generator=gen).to(dtype)
    return x, weight, b


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_a_rows_linear_bits_are_the_same_whatever_the_rows_beside_it(dtype, n, k, threads):
    x, weight, bias = _linear_rows(dtype, n, k, bias=n == 200, seed=n + k)
    kernels = cpu_ops.load()
    packed = kernels.pack_linear_weight(weight)
    threads(1)
    alone = torch.cat([kernels.linear(x[i : i + 1], packed, n, bias) for i in range(8)])
    exact = _exact(x[:8], weight, bias)
    tolerance = 2**-7 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(alone.double(), exact, rtol=tolerance, atol=tolerance * k**0.5)
    for count, num_threads in itertools.product(ROW_COUNTS, [1, 2, 3]):
        threads(num_threads)
        # The rows under test first, then last (other rows before them in the same call).
        y = kernels.linear(x[:count], packed, n, bias)
        assert torch.equal(y[: min(count, 8)], alone[: min(count, 8)]), (count, num_threads)
        last = kernels.linear(torch.cat([x[8 : 8 + count - 1], x[:1]]), packed, n, bias)[-1]
        assert torch.equal(last, alone[0]), (count, num_threads)


def _bf16_with_edges(
    shape: tuple[int, ...], exponents: tuple[int, int], gen: torch.Generator
) -> torch.Tensor:
    """bf16 of random sign and mantissa and biased exponents in [exponents), one in 16 a zero and one in 16
    a denormal."""
    sign = torch.randint(0, 2, shape, generator=gen) << 15
    mantissa = torch.randint(0, 128, shape, generator=gen)
    exponent = torch.randint(*exponents, shape, generator=gen) << 7
    kind = torch.randint(0, 16, shape, generator=gen)
    bits = torch.where(
        kind == 0, sign, torch.where(kind == 1, sign | mantissa | 1, sign | exponent | mantissa)
    )
    return bits.to(torch.int16).view(torch.bfloat16)


@pytest.mark.parametrize("num_threads", [1, 2])
def test_few_rows_take_the_tiles_bits_with_zeros_denormals_and_tiny_products(num_threads, threads):
    """One to five rows of a weight AMX takes run on AVX-512 FMAs in the tiles' own order (see
    tiles_sum_in_chains): each row has the bits the tiles give it among 16 rows, zeros and denormals in x and
    W included, and a row and a block of W so small that their products and sums are denormals (which the
    tiles flush to zero)."""
    kernels = cpu_ops.load()
    if not kernels.has_amx():
        pytest.skip("no AMX here: every row count takes the same AVX-512 body")
    if not kernels.tiles_sum_in_chains():
        pytest.skip("this CPU's tiles round otherwise: AMX takes every row count")
    gen = torch.Generator().manual_seed(5)
    n, k = 16 * 65, 1536
    weight, x = _bf16_with_edges((n, k), (118, 134), gen), _bf16_with_edges((75, k), (118, 134), gen)
    weight[:16], x[2] = _bf16_with_edges((16, k), (54, 64), gen), _bf16_with_edges((k,), (54, 64), gen)
    packed = kernels.pack_linear_weight(weight)
    threads(num_threads)
    tiles = kernels.linear(x, packed, n, None)
    assert tiles[2, :16].count_nonzero() < 16  # flushed
    # The rows in calls of 1, 2, 3, 4 and 5 rows, over and over: a different rounding shows in a few of
    # these outputs only.
    bounds = [0, *itertools.accumulate([1, 2, 3, 4, 5] * 5)]
    few = torch.cat([kernels.linear(x[a:b], packed, n, None) for a, b in itertools.pairwise(bounds)])
    assert torch.equal(few, tiles), (few != tiles).nonzero()[:8].tolist()


@pytest.mark.parametrize("rows", [1, 3, 6, 9, 40, 300])
def test_the_mlps_fused_gate_up_and_silu_gives_a_row_its_bits_whatever_the_rows(rows, threads):
    x, weight, _ = _linear_rows(torch.bfloat16, 3072, 576, bias=False, seed=3)
    kernels = cpu_ops.load()
    packed = kernels.pack_linear_weight(weight)
    threads(1)
    alone = torch.cat([kernels.linear_silu(x[i : i + 1], packed, 1536, None) for i in range(rows)])
    reference = CPU.silu_mul(kernels.linear(x[:rows], packed, 3072, None))
    for num_threads in [1, 2]:
        threads(num_threads)
        assert torch.equal(kernels.linear_silu(x[:rows], packed, 1536, None), alone)
    assert torch.equal(reference, alone)


@needs_amx
@pytest.mark.parametrize(
    ("rows", "n", "k"),
    [(70, 80, 224), (97, 272, 416), (200, 100, 1056), (131, 3072, 576)],
)
@pytest.mark.parametrize("num_threads", [1, 2])
def test_the_many_row_amx_walks_k_panels_and_groups_give_each_row_its_few_row_bits(
    rows, n, k, num_threads, threads
):
    # From 16 rows the AMX linear walks K in panels (about 6 steps of 32, the sums stored between them) over
    # groups of x-tile pairs and W blocks: K of 7, 13 and 33 steps split into uneven panels, 80, 272 and 100
    # columns are 5, 17 and 7 blocks (odd runs a thread, the last of 100 partial), 70, 97, 200 and 131 rows
    # end in a partial group and a padded tile. Each row must have the bits of the walk below 16 rows (one
    # tile, all of K in one pass), and the exact product rounded once. No oneDNN: these rows stay on AMX.
    kernels = cpu_ops.load()
    before = kernels.set_onednn_min_rows(False, -1)
    try:
        gen = torch.Generator().manual_seed(rows + n + k)
        weight = torch.randn(n, k, generator=gen).bfloat16()
        bias = torch.randn(n, generator=gen).bfloat16() if n != 3072 else None
        x = torch.randn(rows, k + 32, generator=gen).bfloat16()[:, 16 : 16 + k]  # rows k + 32 apart
        packed = kernels.pack_linear_weight(weight)
        threads(num_threads)
        many = kernels.linear(x, packed, n, bias)
        few = torch.cat([kernels.linear(x[r : r + 5], packed, n, bias) for r in range(0, rows, 5)])
        assert torch.equal(many, few)
        _assert_rounds_the_exact_product_once(many, x, weight, bias)
        if n % 32 == 0 and bias is None:
            half = n // 2
            fused = kernels.linear_silu(x, packed, half, None)
            assert torch.equal(
                fused,
                torch.cat([kernels.linear_silu(x[r : r + 5], packed, half, None) for r in range(0, rows, 5)]),
            )
            assert torch.equal(fused, CPU.silu_mul(few))
    finally:
        kernels.set_onednn_min_rows(False, before)


# A sequence's context, long enough for several parts of the split decode attention (512 positions each).
CONTEXT = 1200


def _prompt_case(dtype: torch.dtype, head_dim: int, block_size: int):
    """One sequence of CONTEXT positions (K and V in the cache), and a query row for each position."""
    case = Case([CONTEXT], block_size, 3, head_dim, dtype, seed=head_dim + block_size, layout="head-major")
    query = torch.randn(CONTEXT, 9, head_dim, generator=case.gen).to(dtype)
    return case, query


def _decode_rows(case: Case, query: torch.Tensor, positions: list[int]) -> torch.Tensor:
    """Each position's query row as the decode step at that position computes it: one row, one sequence."""
    rows = []
    for p in positions:
        lens = torch.tensor([p + 1], dtype=torch.int32)
        rows.append(
            CPU.paged_decode_attention(
                query[p : p + 1], case.k_cache, case.v_cache, case.block_tables, lens, 0.125
            )
        )
    return torch.cat(rows)


def _chunks(case: Case, query: torch.Tensor, bounds: list[int], others: Case | None = None) -> torch.Tensor:
    """The prompt computed as the chunks [bounds[i], bounds[i + 1]), one call each; with others, each call
    also holds a decode row of others' first sequence (before the chunk) and a 37-row chunk of its second
    (after it), their blocks in the same pool."""
    k_cache, v_cache, table = case.k_cache, case.v_cache, case.block_tables
    if others is not None:
        k_cache, v_cache = (
            torch.cat([case.k_cache, others.k_cache]),
            torch.cat([case.v_cache, others.v_cache]),
        )
        width = max(table.shape[1], others.block_tables.shape[1])
        table = torch.nn.functional.pad(table, (0, width - table.shape[1]))
        other_tables = torch.nn.functional.pad(others.block_tables, (0, width - others.block_tables.shape[1]))
        other_tables = other_tables + case.k_cache.shape[0]
    out = []
    for start, end in itertools.pairwise(bounds):
        if others is None:
            q, tables, lens, starts = query[start:end], table, [end], [0, end - start]
        else:
            other_q = torch.randn(38, *query.shape[1:], generator=others.gen).to(query.dtype)
            q = torch.cat([other_q[:1], query[start:end], other_q[1:]])
            tables = torch.cat([other_tables[:1], table, other_tables[1:]])
            lens = [others.ctx_lens[0], end, others.ctx_lens[1]]
            starts = [0, 1, 1 + end - start, 1 + end - start + 37]
        as_int32 = lambda values: torch.tensor(values, dtype=torch.int32)  # noqa: E731
        result = CPU.paged_prefill_attention(
            q, k_cache, v_cache, tables, as_int32(starts), as_int32(lens), 0.125
        )
        out.append(result if others is None else result[1 : 1 + end - start])
    return torch.cat(out)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("head_dim", "block_size"), [(64, 16), (128, 32)])
def test_a_prompt_rows_attention_has_the_bits_of_the_decode_step_at_its_position(
    dtype, head_dim, block_size, threads
):
    case, query = _prompt_case(dtype, head_dim, block_size)
    threads(1)
    positions = list(range(CONTEXT))
    decode = _decode_rows(case, query, positions)
    assert_matches_oracle(decode[-40:], oracle(query[-40:], case, [40], 0.125), dtype)
    # The whole prompt at once (the tiled kernel's size without batch invariance), chunked at several
    # sizes, with other sequences in the same call, and on other thread counts.
    chunkings = [[0, CONTEXT], [0, 7, 300, 513, 1024, CONTEXT], [*range(0, CONTEXT, 256), CONTEXT]]
    for bounds, num_threads in itertools.product(chunkings, [1, 2, 3]):
        threads(num_threads)
        assert torch.equal(_chunks(case, query, bounds), decode), (bounds, num_threads)
    others = Case([700, 1100], block_size, 3, head_dim, dtype, seed=9, layout="head-major")
    threads(2)
    assert torch.equal(_chunks(case, query, [0, 100, 600, CONTEXT], others), decode)


@pytest.mark.parametrize("block_size", [8, 5])
def test_a_prompts_blocked_rows_pair_positions_as_the_decode_step_does_in_any_block_size(block_size, threads):
    # Blocks of 8 positions (the blocked rows pair positions across two blocks of the cache at once) and of
    # 5 (odd: the row kernel pairs positions inside each block, and the blocked rows leave such a cache to it).
    context = 600
    case = Case([context], block_size, 3, 64, torch.bfloat16, seed=block_size, layout="head-major")
    query = torch.randn(context, 9, 64, generator=case.gen).bfloat16()
    threads(1)
    decode = _decode_rows(case, query, list(range(context)))
    assert_matches_oracle(decode[-20:], oracle(query[-20:], case, [20], 0.125), torch.bfloat16)
    for bounds, num_threads in itertools.product([[0, context], [0, 5, 41, 530, context]], [1, 2]):
        threads(num_threads)
        assert torch.equal(_chunks(case, query, bounds), decode), (bounds, num_threads)


@pytest.mark.parametrize(("num_kv_heads", "group"), [(1, 8), (2, 5), (4, 1)])
def test_a_prompt_rows_attention_has_the_decode_bits_in_any_group_size(num_kv_heads, group, threads):
    # With AMX a prompt's query vectors share tiles of 16 (a row's group split across two where 16 is no
    # multiple of it, its scores from K transposed), while a decode row's group or a short chunk's rows fill
    # one tile alone (their scores from K's rows as the cache holds them): the same bits either way.
    context = 560
    case = Case([context], 16, num_kv_heads, 64, torch.bfloat16, seed=group, layout="head-major")
    query = torch.randn(context, num_kv_heads * group, 64, generator=case.gen).bfloat16()
    positions = [0, 1, 15, 16, 17, 100, 511, 512, 513, *range(context - 20, context)]
    threads(1)
    decode = _decode_rows(case, query, positions)
    assert_matches_oracle(decode[-20:], oracle(query[-20:], case, [20], 0.125), torch.bfloat16)
    for bounds, num_threads in itertools.product([[0, context], [0, 1, 3, 17, 514, 516, context]], [1, 2]):
        threads(num_threads)
        assert torch.equal(_chunks(case, query, bounds)[positions], decode), (bounds, num_threads)


def test_a_long_prompts_rows_have_the_decode_bits_when_their_parts_are_merged_in_several_calls(threads):
    # 2600 rows of 16 query heads hold more parts than the AMX tiles keep at once: their blocks of rows are
    # computed in several calls of bounded memory, each row's sums unchanged.
    context = 2600
    case = Case([context], 16, 2, 64, torch.bfloat16, seed=26, layout="head-major")
    query = torch.randn(context, 16, 64, generator=case.gen).bfloat16()
    positions = [0, 700, 1535, 1536, 2047, *range(context - 8, context)]
    threads(2)
    decode = _decode_rows(case, query, positions)
    assert_matches_oracle(decode[-8:], oracle(query[-8:], case, [8], 0.125), torch.bfloat16)
    assert torch.equal(_chunks(case, query, [0, context])[positions], decode)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_decode_rows_attention_is_the_same_in_any_batch_and_on_any_thread_count(dtype, threads):
    # Without batch invariance a lone long decode row's context is split by the thread count, a batch's
    # is not: here each row has the bits it has alone on one thread, in batches of 1 to 33 (a sequence may
    # come more than once, as forks do) and on 1 to 3 threads.
    lens = [1, 15, 16, 17, 511, 512, 513, 900, 1500, 2047, 2048, 2049]
    case = Case(lens, 16, 3, 64, dtype, seed=2, layout="head-major")
    query = torch.randn(len(lens), 9, 64, generator=case.gen).to(dtype)

    def decode(rows: list[int]) -> torch.Tensor:
        return CPU.paged_decode_attention(
            query[rows], case.k_cache, case.v_cache, case.block_tables[rows], case.context_lens[rows], 0.125
        )

    threads(1)
    alone = torch.cat([decode([i]) for i in range(len(lens))])
    assert_matches_oracle(alone, oracle(query, case, [1] * len(lens), 0.125), dtype)
    for num_threads, batch in itertools.product([1, 2, 3], [2, 5, 33]):
        threads(num_threads)
        for i in range(len(lens)):
            rows = [(i + 5 * j) % len(lens) for j in range(batch)]
            rows = rows[1:] + rows[:1]  # the row under test last
            assert torch.equal(decode(rows)[-1], alone[i]), (num_threads, batch, i)
