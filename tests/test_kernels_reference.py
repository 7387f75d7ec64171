"""The PyTorch paged KV ops against a float64 oracle that walks each block table one position at a time.

Every cache slot that no sequence owns holds NaN, so an op that reads an unused slot, an unreferenced
block or a padding entry of a block table fails the NaN check.
"""

from __future__ import annotations

import math
import sys
import types

import pytest
import torch

import pagedserve.kernels
from pagedserve.kernels import CPU_KERNELS_ENV, _load_cpu_ops, _load_cuda_ops, get_ops, reference
from pagedserve.kernels.reference import ReferenceOps

REFERENCE = ReferenceOps()

GARBAGE_BLOCK = 1_000_000  # pads block tables: far out of range, so reading it would raise or return junk


# The two layouts a cache [num_blocks, block_size, num_kv_heads, head_dim] comes in: contiguous, and the CPU
# pool's, a view of a contiguous [num_blocks, num_kv_heads, block_size, head_dim] (see worker_svc/kv_cache.py).
LAYOUTS = ["token-major", "head-major"]


def nan_cache(shape: tuple[int, int, int, int], dtype: torch.dtype, layout: str) -> torch.Tensor:
    """A cache of `shape` in `layout`, every element NaN."""
    num_blocks, block_size, num_kv_heads, head_dim = shape
    if layout == "head-major":
        heads_first = (num_blocks, num_kv_heads, block_size, head_dim)
        return torch.full(heads_first, float("nan"), dtype=dtype).transpose(1, 2)
    assert layout == "token-major", layout
    return torch.full(shape, float("nan"), dtype=dtype)


# (num_kv_heads, group): group = num_q_heads / num_kv_heads
GQA = [(1, 1), (2, 2), (1, 4), (4, 2), (2, 7), (1, 8), (4, 8)]


class Case:
    """A cache holding len(ctx_lens) sequences whose blocks are a random permutation of a larger pool;
    every slot not holding a sequence's position is NaN. layout: one of LAYOUTS."""

    def __init__(
        self,
        ctx_lens: list[int],
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        seed: int = 0,
        shared_prefix_blocks: int = 0,
        spare_blocks: int = 7,
        layout: str = "token-major",
    ):
        gen = torch.Generator().manual_seed(seed)
        self.ctx_lens, self.block_size = ctx_lens, block_size
        need = [math.ceil(c / block_size) for c in ctx_lens]
        num_blocks = sum(need) + spare_blocks
        pool = torch.randperm(num_blocks, generator=gen).tolist()
        self.tables: list[list[int]] = []
        for s, n in enumerate(need):
            if s == 1 and shared_prefix_blocks:
                # Sequence 1 shares sequence 0's first blocks (a prefix-cache hit or a fork).
                assert min(ctx_lens[0], ctx_lens[1]) >= shared_prefix_blocks * block_size
                shared = self.tables[0][:shared_prefix_blocks]
                self.tables.append(shared + [pool.pop() for _ in range(n - len(shared))])
            else:
                self.tables.append([pool.pop() for _ in range(n)])
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k_cache = nan_cache(shape, dtype, layout)
        self.v_cache = nan_cache(shape, dtype, layout)
        for table, ctx in zip(self.tables, ctx_lens, strict=True):
            for p in range(ctx):
                block, offset = table[p // block_size], p % block_size
                self.k_cache[block, offset] = torch.randn(num_kv_heads, head_dim, generator=gen)
                self.v_cache[block, offset] = torch.randn(num_kv_heads, head_dim, generator=gen)
        width = max(need) + 2
        self.block_tables = torch.tensor(
            [t + [GARBAGE_BLOCK] * (width - len(t)) for t in self.tables], dtype=torch.int32
        )
        self.context_lens = torch.tensor(ctx_lens, dtype=torch.int32)
        self.gen = gen


def oracle(query, case: Case, q_lens: list[int], scale: float) -> torch.Tensor:
    """Per query token: walk the block table position by position, softmax attention in float64."""
    num_heads = query.shape[1]
    num_kv_heads = case.k_cache.shape[2]
    kv_head_of = [h // (num_heads // num_kv_heads) for h in range(num_heads)]
    out = torch.zeros(query.shape, dtype=torch.float64)
    row = 0
    for table, ctx, q_len in zip(case.tables, case.ctx_lens, q_lens, strict=True):
        for i in range(q_len):
            p = ctx - q_len + i
            keys, values = [], []
            for j in range(p + 1):
                block, offset = table[j // case.block_size], j % case.block_size
                keys.append(case.k_cache[block, offset].double())
                values.append(case.v_cache[block, offset].double())
            k = torch.stack(keys)[:, kv_head_of]  # [p + 1, Hq, D]
            v = torch.stack(values)[:, kv_head_of]
            q = query[row].double()
            probs = torch.softmax(torch.einsum("hd,phd->hp", q, k) * scale, dim=-1)
            out[row] = torch.einsum("hp,phd->hd", probs, v)
            row += 1
    return out


def assert_matches_oracle(out, expected, dtype):
    assert not out.isnan().any()
    assert out.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(out.double(), expected, rtol=2e-2, atol=2e-2)


def context_lens_for(block_size: int) -> list[int]:
    return [1, block_size - 1, block_size, block_size + 1, 3 * block_size + 5, 100]


DECODE_PARAMS = [
    pytest.param(kv, g, d, bs, torch.float32, id=f"hkv{kv}-g{g}-d{d}-bs{bs}-f32")
    for kv, g in GQA
    for d in (64, 128)
    for bs in (8, 16, 32)
] + [
    pytest.param(kv, g, d, bs, torch.bfloat16, id=f"hkv{kv}-g{g}-d{d}-bs{bs}-bf16")
    for kv, g in GQA
    for d, bs in ((64, 16), (128, 8), (40, 16))  # 40: a head that is no whole number of 32-value chunks
]


def check_decode_against_oracle(
    ops, num_kv_heads, group, head_dim, block_size, dtype, layout: str = "token-major"
) -> None:
    """ops.paged_decode_attention over sequences of context_lens_for(block_size), against the oracle."""
    case = Case(
        context_lens_for(block_size), block_size, num_kv_heads, head_dim, dtype, seed=group, layout=layout
    )
    query = torch.randn(len(case.ctx_lens), num_kv_heads * group, head_dim, generator=case.gen).to(dtype)
    scale = head_dim**-0.5
    out = ops.paged_decode_attention(
        query, case.k_cache, case.v_cache, case.block_tables, case.context_lens, scale
    )
    assert_matches_oracle(out, oracle(query, case, [1] * len(case.ctx_lens), scale), dtype)


@pytest.mark.parametrize(("num_kv_heads", "group", "head_dim", "block_size", "dtype"), DECODE_PARAMS)
def test_decode_attention_matches_per_token_oracle(num_kv_heads, group, head_dim, block_size, dtype):
    check_decode_against_oracle(REFERENCE, num_kv_heads, group, head_dim, block_size, dtype)


@pytest.mark.parametrize("gather_bytes", [1, 40_000])
def test_decode_attention_in_batch_chunks_matches_oracle(monkeypatch, gather_bytes):
    # Large batches are gathered a few sequences at a time (one at a time with a budget of 1 byte).
    monkeypatch.setattr(reference, "DECODE_GATHER_BYTES", gather_bytes)
    case = Case([100, 17, 1, 16, 15, 64, 33], 16, 2, 64, torch.float32, seed=4, shared_prefix_blocks=1)
    query = torch.randn(7, 6, 64, generator=case.gen)
    out = REFERENCE.paged_decode_attention(
        query, case.k_cache, case.v_cache, case.block_tables, case.context_lens, 0.125
    )
    assert_matches_oracle(out, oracle(query, case, [1] * 7, 0.125), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_reads_shared_prefix_blocks_for_both_sequences(dtype):
    case = Case([40, 37, 9], 8, 2, 64, dtype, seed=3, shared_prefix_blocks=4)
    assert case.tables[0][:4] == case.tables[1][:4]
    query = torch.randn(3, 4, 64, generator=case.gen).to(dtype)
    out = REFERENCE.paged_decode_attention(
        query, case.k_cache, case.v_cache, case.block_tables, case.context_lens, 0.125
    )
    assert_matches_oracle(out, oracle(query, case, [1, 1, 1], 0.125), dtype)


def test_bf16_attention_accumulates_in_float32():
    # bf16 in, bf16 out, but the arithmetic in between is float32: the result is exactly the float32
    # computation on the same (bf16-valued) inputs, rounded once.
    case = Case([700, 300], 16, 1, 64, torch.bfloat16, seed=2)
    query = torch.randn(2 + 5, 4, 64, generator=case.gen).bfloat16()
    k32, v32 = case.k_cache.float(), case.v_cache.float()
    decode = REFERENCE.paged_decode_attention(
        query[:2], case.k_cache, case.v_cache, case.block_tables, case.context_lens, 0.125
    )
    decode32 = REFERENCE.paged_decode_attention(
        query[:2].float(), k32, v32, case.block_tables, case.context_lens, 0.125
    )
    assert torch.equal(decode, decode32.bfloat16())
    prefill_args = (case.block_tables, torch.tensor([0, 1, 5], dtype=torch.int32), case.context_lens, 0.125)
    prefill = REFERENCE.paged_prefill_attention(query[2:], case.k_cache, case.v_cache, *prefill_args)
    prefill32 = REFERENCE.paged_prefill_attention(query[2:].float(), k32, v32, *prefill_args)
    assert torch.equal(prefill, prefill32.bfloat16())


PREFILL_PARAMS = [
    pytest.param(kv, g, d, bs, dtype, id=f"hkv{kv}-g{g}-d{d}-bs{bs}-{str(dtype)[6:]}")
    for kv, g in GQA
    for d, bs, dtype in ((64, 8, torch.float32), (128, 16, torch.float32), (64, 32, torch.bfloat16))
]


def check_mixed_prefill_against_oracle(
    ops, num_kv_heads, group, head_dim, block_size, dtype, layout: str = "token-major"
) -> None:
    """ops.paged_prefill_attention over a batch mixing decodes, whole prompts and chunks on cached
    context, against the oracle."""
    bs = block_size
    # (context length, query length): a decode of one token, a whole fresh prompt, a chunk on top of
    # cached context, a long decode, a chunk ending one short of a block, a fork of sequence 0.
    seqs = [(3 * bs + 5, 7), (3 * bs + 2, 1), (bs + 1, bs + 1), (1, 1), (100, 1), (bs, bs - 1), (2 * bs, 3)]
    ctx_lens, q_lens = [c for c, _ in seqs], [q for _, q in seqs]
    case = Case(
        ctx_lens, bs, num_kv_heads, head_dim, dtype, seed=7 + group, shared_prefix_blocks=3, layout=layout
    )
    num_heads = num_kv_heads * group
    query = torch.randn(sum(q_lens), num_heads, head_dim, generator=case.gen).to(dtype)
    query_start_loc = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    scale = head_dim**-0.5
    out = ops.paged_prefill_attention(
        query, case.k_cache, case.v_cache, case.block_tables, query_start_loc, case.context_lens, scale
    )
    assert_matches_oracle(out, oracle(query, case, q_lens, scale), dtype)


@pytest.mark.parametrize(("num_kv_heads", "group", "head_dim", "block_size", "dtype"), PREFILL_PARAMS)
def test_mixed_prefill_batch_matches_per_token_oracle(num_kv_heads, group, head_dim, block_size, dtype):
    check_mixed_prefill_against_oracle(REFERENCE, num_kv_heads, group, head_dim, block_size, dtype)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_reference_reads_either_cache_layout(layout):
    check_decode_against_oracle(REFERENCE, 2, 4, 64, 16, torch.bfloat16, layout)
    check_mixed_prefill_against_oracle(REFERENCE, 2, 4, 64, 16, torch.float32, layout)


def test_prefill_of_single_tokens_equals_decode():
    case = Case([1, 15, 16, 17, 100], 16, 2, 64, torch.float32, seed=11)
    query = torch.randn(5, 6, 64, generator=case.gen)
    start_loc = torch.arange(6, dtype=torch.int32)
    decode = REFERENCE.paged_decode_attention(
        query, case.k_cache, case.v_cache, case.block_tables, case.context_lens, 0.125
    )
    prefill = REFERENCE.paged_prefill_attention(
        query, case.k_cache, case.v_cache, case.block_tables, start_loc, case.context_lens, 0.125
    )
    torch.testing.assert_close(prefill, decode, rtol=0, atol=0)


def test_prefill_of_a_whole_prompt_is_causal():
    # The output of token i must not change when the tokens after it change.
    case = Case([20], 8, 1, 64, torch.float32, seed=5)
    query = torch.randn(20, 2, 64, generator=case.gen)
    args = (case.block_tables, torch.tensor([0, 20], dtype=torch.int32), case.context_lens, 0.125)
    before = REFERENCE.paged_prefill_attention(query, case.k_cache, case.v_cache, *args)
    table = case.tables[0]
    case.k_cache[table[1:]] = torch.randn_like(case.k_cache[table[1:]])  # positions 8.. change
    case.v_cache[table[1:]] = torch.randn_like(case.v_cache[table[1:]])
    after = REFERENCE.paged_prefill_attention(query, case.k_cache, case.v_cache, *args)
    torch.testing.assert_close(after[:8], before[:8], rtol=0, atol=0)
    assert not torch.allclose(after[8:], before[8:])


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_writes_each_token_to_its_slot_and_skips_padding(dtype, layout):
    num_blocks, bs, hkv, d = 6, 8, 2, 64
    gen = torch.Generator().manual_seed(0)
    k_cache = nan_cache((num_blocks, bs, hkv, d), dtype, layout)
    v_cache = nan_cache((num_blocks, bs, hkv, d), dtype, layout)
    slots = torch.randperm(num_blocks * bs, generator=gen)[:20]
    slots[[0, 5, 19]] = -1  # padding tokens
    key = torch.randn(20, hkv, d, generator=gen).to(dtype)
    value = torch.randn(20, hkv, d, generator=gen).to(dtype)
    REFERENCE.write_kv(key, value, k_cache, v_cache, slots)
    written = torch.zeros(num_blocks * bs, dtype=torch.bool)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(k_cache[slot // bs, slot % bs], key[t])
            assert torch.equal(v_cache[slot // bs, slot % bs], value[t])
            written[slot] = True
    assert written.sum() == 17
    assert k_cache.reshape(-1, hkv, d)[~written].isnan().all()
    assert v_cache.reshape(-1, hkv, d)[~written].isnan().all()


def test_write_kv_of_only_padding_changes_nothing():
    k_cache = torch.full((2, 4, 1, 8), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    REFERENCE.write_kv(torch.ones(3, 1, 8), torch.ones(3, 1, 8), k_cache, v_cache, torch.full((3,), -1))
    REFERENCE.write_kv(torch.ones(0, 1, 8), torch.ones(0, 1, 8), k_cache, v_cache, torch.zeros(0).long())
    assert k_cache.isnan().all() and v_cache.isnan().all()


def copy_in_order(caches: list[torch.Tensor], src: list[int], dst: list[int]) -> list[torch.Tensor]:
    caches = [c.clone() for c in caches]
    for c in caches:
        for a, b in zip(src, dst, strict=True):
            c[b] = c[a].clone()
    return caches


def random_caches(
    num_layers: int, num_blocks: int, seed: int, layout: str = "token-major"
) -> tuple[list, list]:
    gen = torch.Generator().manual_seed(seed)

    def cache() -> torch.Tensor:
        c = nan_cache((num_blocks, 4, 2, 8), torch.float32, layout)
        return c.copy_(torch.randn(c.shape, generator=gen))

    return [cache() for _ in range(num_layers)], [cache() for _ in range(num_layers)]


COPY_CASES = [
    pytest.param([3, 0, 5], [1, 7, 2], id="independent"),
    pytest.param([0, 1], [1, 2], id="chain-dst-used-as-src-later"),
    pytest.param([1, 0], [2, 1], id="read-before-overwrite"),
    pytest.param([2, 4], [5, 5], id="last-write-wins"),
    pytest.param([0, 1], [1, 0], id="swap-is-not-a-swap"),
    pytest.param([3, 3], [3, 6], id="copy-onto-itself"),
    pytest.param([], [], id="empty"),
]


def check_copy_blocks_in_order(ops, src: list[int], dst: list[int], layout: str = "token-major") -> None:
    """ops.copy_blocks over 3 layers against the copies done one by one."""
    k, v = random_caches(3, 8, seed=len(src), layout=layout)
    expected_k, expected_v = copy_in_order(k, src, dst), copy_in_order(v, src, dst)
    ops.copy_blocks(k, v, torch.tensor(src, dtype=torch.int64), torch.tensor(dst, dtype=torch.int64))
    for got, want in zip(k + v, expected_k + expected_v, strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize(("src", "dst"), COPY_CASES)
def test_copy_blocks_in_order_in_every_layer(src, dst):
    check_copy_blocks_in_order(REFERENCE, src, dst)


def test_copy_blocks_chain_passes_on_the_new_content():
    k, v = random_caches(1, 4, seed=1)
    block0 = k[0][0].clone()
    REFERENCE.copy_blocks(k, v, torch.tensor([0, 1, 2]), torch.tensor([1, 2, 3]))
    for b in range(4):
        assert torch.equal(k[0][b], block0)


@pytest.mark.parametrize("seed", range(10))
def test_copy_blocks_random_overlapping_sequences(seed):
    gen = torch.Generator().manual_seed(seed)
    src = torch.randint(0, 6, (5,), generator=gen)
    dst = torch.randint(0, 6, (5,), generator=gen)
    k, v = random_caches(2, 6, seed)
    expected = copy_in_order(k + v, src.tolist(), dst.tolist())
    REFERENCE.copy_blocks(k, v, src, dst)
    for got, want in zip(k + v, expected, strict=True):
        assert torch.equal(got, want)


@pytest.fixture
def fresh_cpu_ops():
    _load_cpu_ops.cache_clear()
    yield
    _load_cpu_ops.cache_clear()


def test_get_ops_on_cpu_is_the_built_kernels_unless_switched_off(monkeypatch, fresh_cpu_ops):
    from pagedserve.kernels.cpu_ops import CpuOps

    assert type(get_ops(torch.device("cpu"))) is CpuOps
    assert get_ops(torch.device("cpu")) is get_ops(torch.device("cpu"))
    monkeypatch.setenv(CPU_KERNELS_ENV, "off")
    assert type(get_ops(torch.device("cpu"))) is ReferenceOps
    # Every backend implements the whole contract: tests/test_kernels_contract.py.


def test_get_ops_on_cpu_falls_back_to_the_reference_when_the_build_fails(monkeypatch, fresh_cpu_ops):
    from pagedserve.kernels import cpu_ops

    def load():
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setattr(cpu_ops, "load", load)
    assert type(get_ops(torch.device("cpu"))) is ReferenceOps


@pytest.fixture
def fake_cuda(monkeypatch):
    """A CUDA device as torch would report it, and a stand-in cuda_ops module whose CudaOps is set by the
    test."""
    module = types.ModuleType("pagedserve.kernels.cuda_ops")
    monkeypatch.setitem(sys.modules, "pagedserve.kernels.cuda_ops", module)
    # `from pagedserve.kernels import cuda_ops` takes the package attribute once the real module
    # was imported (by another test), so replace that too.
    monkeypatch.setattr(pagedserve.kernels, "cuda_ops", module, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    _load_cuda_ops.cache_clear()
    yield module
    _load_cuda_ops.cache_clear()


def test_get_ops_on_cuda_uses_the_cuda_ops_when_they_initialise(fake_cuda):
    seen = []

    class FakeCudaOps:
        def __init__(self, device):
            seen.append(device)

    fake_cuda.CudaOps = FakeCudaOps
    assert type(get_ops(torch.device("cuda", 0))) is FakeCudaOps
    assert seen == [torch.device("cuda", 0)]


def test_get_ops_on_cuda_falls_back_to_the_reference_when_init_fails(fake_cuda):
    class FakeCudaOps:
        def __init__(self, device):
            raise ImportError("No module named 'cupy'")

    fake_cuda.CudaOps = FakeCudaOps
    assert type(get_ops(torch.device("cuda"))) is ReferenceOps


def test_get_ops_on_cuda_without_a_device_is_the_reference(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    _load_cuda_ops.cache_clear()
    try:
        assert type(get_ops(torch.device("cuda"))) is ReferenceOps
    finally:
        _load_cuda_ops.cache_clear()
