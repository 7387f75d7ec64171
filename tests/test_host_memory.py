"""host_memory.zeros: torch.zeros in huge pages for the KV cache and the packed weights."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from pagedserve.worker_svc import host_memory
from pagedserve.worker_svc.kv_cache import KVCache, KVCacheSpec

needs_huge_pages = pytest.mark.skipif(
    not host_memory.huge_pages_available(), reason="no transparent huge pages on this kernel"
)


def _mapping_of(address: int) -> dict[str, int] | None:
    """The /proc/self/smaps counters (kB) of the mapping that holds address; None when none does."""
    found = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:  # a mapping's first line: start-end perms ...
            start, end = (int(part, 16) for part in head.split("-"))
            found = {} if start <= address < end else None
        elif found is not None and line.split()[-1] == "kB":
            found[line.split(":")[0]] = int(line.split()[1])
        elif found is not None and found:
            break
    return found


@pytest.mark.parametrize("shape", [(3, 5), (64, 16, 3, 64), (300, 16, 3, 64)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_zeros_is_torch_zeros(shape, dtype):
    got = host_memory.zeros(shape, dtype)
    assert got.shape == shape and got.dtype == dtype and got.is_contiguous() and got.device.type == "cpu"
    assert torch.equal(got, torch.zeros(shape, dtype=dtype))
    got.fill_(3)  # writable, all of it
    assert torch.equal(got, torch.full(shape, 3, dtype=dtype))


@needs_huge_pages
def test_a_large_tensor_lies_in_huge_pages():
    tensor = host_memory.zeros((1024, 16, 3, 64), torch.bfloat16)  # 6 MB
    assert tensor.data_ptr() % host_memory.HUGE_PAGE == 0
    counters = _mapping_of(tensor.data_ptr())
    assert counters is not None and counters["AnonHugePages"] >= 2048, counters
    # What the KV cache allocates on the CPU.
    cache = KVCache(KVCacheSpec(2, 3, 64, 16, torch.bfloat16), 1024, torch.device("cpu"))
    for layer in cache.k_caches + cache.v_caches:
        assert _mapping_of(layer.data_ptr())["AnonHugePages"] >= 2048


@needs_huge_pages
def test_a_small_kv_pool_lies_in_huge_pages_too():
    # 64 blocks: 384 KB a layer's K or V, under a huge page; the layers share one allocation that is not.
    cache = KVCache(KVCacheSpec(30, 3, 64, 16, torch.bfloat16), 64, torch.device("cpu"))
    for layer in cache.k_caches + cache.v_caches:
        # [num_blocks, block_size, num_kv_heads, head_dim], each block head-major (see KVCache).
        assert layer.shape == (64, 16, 3, 64) and layer.transpose(1, 2).is_contiguous()
        assert _mapping_of(layer.data_ptr())["AnonHugePages"] >= 2048
    # Each layer's tensors are its own: writing one leaves every other as it was.
    cache.k_caches[3].fill_(1)
    assert all(
        layer.count_nonzero() == 0 for layer in cache.k_caches[:3] + cache.k_caches[4:] + cache.v_caches
    )


@needs_huge_pages
def test_the_mapping_lives_as_long_as_a_view_of_the_tensor():
    tensor = host_memory.zeros((1024, 16, 3, 64), torch.bfloat16)
    view = tensor[10:20]
    address = view.data_ptr()
    del tensor
    gc.collect()
    view.fill_(1)
    assert view.sum().item() == view.numel() and _mapping_of(address) is not None
    del view
    gc.collect()
    assert _mapping_of(address) is None  # unmapped with its last tensor


@needs_huge_pages
def test_the_kernels_packed_weights_lie_in_huge_pages():
    from pagedserve.kernels import get_ops
    from pagedserve.kernels.ops import linear_for
    from pagedserve.worker_svc.model import PackedLinear

    kernels = linear_for(get_ops(torch.device("cpu")), torch.bfloat16)
    if kernels is None:
        pytest.skip("this CPU build has no linear (it needs AVX-512 BF16 or AVX2 with FMA)")
    weight = torch.randn(1536, 1152).to(torch.bfloat16)  # 3.4 MB packed
    linear = PackedLinear(weight, None, kernels)
    assert _mapping_of(linear.weight.data_ptr())["AnonHugePages"] >= 2048
    x = torch.randn(5, 1152).to(torch.bfloat16)
    torch.testing.assert_close(linear(x).float(), x.float() @ weight.float().T, rtol=2e-2, atol=2e-2)


@needs_huge_pages
def test_in_huge_pages_moves_a_large_tensor_and_leaves_a_small_one():
    large = torch.randn(1024, 16, 3, 64).to(torch.bfloat16)  # 6 MB
    moved = host_memory.in_huge_pages(large)
    assert torch.equal(moved, large) and moved.data_ptr() != large.data_ptr()
    assert _mapping_of(moved.data_ptr())["AnonHugePages"] >= 2048
    small = torch.randn(3, 5)
    assert host_memory.in_huge_pages(small) is small


@needs_huge_pages
def test_an_arena_places_copies_side_by_side_in_huge_pages():
    arena = host_memory.Arena(chunk_bytes=2 * host_memory.HUGE_PAGE)  # 4 MB mappings
    gen = torch.Generator().manual_seed(0)
    sources = [
        torch.randn(rows, 576, generator=gen).to(dtype)
        for rows, dtype in [
            (576, torch.bfloat16),
            (1000, torch.float32),
            (3, torch.bfloat16),
            (1536, torch.bfloat16),
        ]
    ]
    placed = [arena.copy(t) for t in sources]
    for source, copy in zip(sources, placed, strict=True):
        assert copy.shape == source.shape and copy.dtype == source.dtype and torch.equal(copy, source)
        assert copy.data_ptr() % host_memory.Arena.ALIGN == 0 and copy.data_ptr() != source.data_ptr()
        assert _mapping_of(copy.data_ptr())["AnonHugePages"] >= 2048
    # 648 KB, 2.3 MB and 3 KB share the first mapping, one after another; 1.8 MB more would not fit.
    spans = [(c.data_ptr(), c.data_ptr() + c.numel() * c.element_size()) for c in placed]
    assert spans[0][1] <= spans[1][0] and spans[1][1] <= spans[2][0]
    assert spans[2][1] - spans[0][0] < 2 * host_memory.HUGE_PAGE
    assert not spans[0][0] <= spans[3][0] < spans[0][0] + 2 * host_memory.HUGE_PAGE
    placed[0].fill_(0)  # the copies are the arena's own
    assert torch.equal(placed[1], sources[1]) and torch.equal(placed[2], sources[2])
    # Larger than a mapping: one of its own.
    large = torch.randn(2 << 20, generator=gen)  # 8 MB
    assert torch.equal(arena.copy(large), large)


@needs_huge_pages
def test_a_packed_models_weights_all_lie_in_huge_pages():
    from pagedserve.worker_svc.model import CausalLM, ModelConfig, PackedLinear, can_pack_linears

    if not can_pack_linears(torch.bfloat16, torch.device("cpu")):
        pytest.skip("no packed linears on this CPU")
    # SmolLM2-135M's widths, two layers: its qkv, o and down weights are each under a huge page.
    config = ModelConfig.from_hf_config(
        dict(
            model_type="llama",
            vocab_size=4096,
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=2,
            num_attention_heads=9,
            num_key_value_heads=3,
            tie_word_embeddings=True,
        )
    )
    model = CausalLM(config, torch.bfloat16, "cpu")
    for parameter in model.parameters():
        parameter.data.normal_()
    model.pack_linears()
    linears = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert len(linears) == 2 * 4 + 1 and model.tied_head in linears
    for linear in linears:
        if linear.kernels is not None:  # oneDNN's layout where the kernels have no linear
            assert _mapping_of(linear.weight.data_ptr())["AnonHugePages"] >= 2048, linear
