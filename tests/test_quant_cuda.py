"""Quantized weights on CUDA (kernels/quant_gemm.cu through cuda_ops.CudaQuantLinear).

Without a GPU (CI): the CUDA pack's layout reads back to the QuantizedWeight it came from, each lane's words
hold exactly the mma.m16n8k16 B fragments the kernel forms from them (decoded here the way the kernel
decodes them: shifts, nibble and byte pairs), and the launches CudaQuantLinear prepares (grid, split-K,
arguments, the prefill's chunks) give the float64 oracle's product when executed in PyTorch.

With a GPU and CuPy: the GEMM against a float64 oracle of dequantize(q) @ x for int4 and int8, every scale
form, group sizes 16 .. K, 1 .. 256 rows (CTAs of 64 along grid z past 64) and prefill rows, edge sizes of N
and K, forced split counts; the dequantizing kernel bit for bit; a GPTQ checkpoint kept quantized by the
worker's runner on CUDA decoding the greedy tokens of the CPU runner on its dequantized weights; and the
bf16 model on the GEMM as close to the float32 model as the dequantized bf16 model.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from cuda_emulation import EmulatedLauncher
from test_quantization import _random_weight

from pagedserve.kernels import cuda_ops
from pagedserve.kernels.cuda_ops import (
    CudaOps,
    CudaQuantWeight,
    pack_quant_weight_cuda,
    unpack_quant_weight_cuda,
)
from pagedserve.kernels.ops import QuantLinearKernels
from pagedserve.kernels.quant import (
    SCALE_F16,
    SCALE_F16_NO_OFFSET,
    SCALE_F32,
    QuantizedWeight,
    dequantize,
)

KINDS = [SCALE_F32, SCALE_F16, SCALE_F16_NO_OFFSET]
PROMPTS = [
    [5, 17, 42, 9, 77, 3, 61, 90, 12, 33, 2, 8, 19, 4, 66, 70, 71, 13, 99, 100, 1, 2, 3],
    [7, 8, 9, 10],
]
_skip_without_cuda = pytest.mark.skipif(
    not cuda_ops.is_available(), reason="needs a CUDA device and a matching CuPy"
)


def needs_cuda(test: Any) -> Any:
    """A GPU test: marked `cuda` (make gpu-check runs them, failing on a skip), skipped cleanly elsewhere."""
    return pytest.mark.cuda(_skip_without_cuda(test))


def _oracle(
    x: torch.Tensor, q: QuantizedWeight, bias: torch.Tensor | None, w: torch.Tensor | None = None
) -> torch.Tensor:
    """dequantize(q) @ x + bias in float64, on x's device (w: dequantize(q) in float64 there, if at hand)."""
    w = dequantize(q).to(x.device, torch.float64) if w is None else w
    out = x.double() @ w.T
    return out if bias is None else out + bias.to(x.device, torch.float64)


# ---- the pack (no GPU) --------------------------------------------------------------------------------------

SHAPES = [(40, 96), (130, 576), (16, 256)]  # N, K: partial n16 and CTA tiles, k_pad > K


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_cuda_pack_reads_back_as_the_quantized_weight(bits, kind, shape):
    n, k = shape
    for group in sorted({g for g in (32, 64, 96, k) if k % g == 0}):
        q = _random_weight(n, k, bits, group, kind, seed=n + k + group)
        packed = pack_quant_weight_cuda(q)
        assert packed.codes.dtype == torch.int32 and packed.n_pad % 64 == 0 and packed.k_pad % 64 == 0
        assert packed.scales.dtype == (torch.float32 if kind == SCALE_F32 else torch.float16)
        assert (packed.offsets is None) == (kind == SCALE_F16_NO_OFFSET)
        back = unpack_quant_weight_cuda(packed)
        assert back.codes.dtype == q.codes.dtype and torch.equal(back.codes, q.codes)
        assert torch.equal(back.scales, q.scales) and back.group_size == group and back.bits == bits
        assert (back.offsets is None) == (q.offsets is None)
        if q.offsets is not None:
            assert torch.equal(back.offsets, q.offsets)
        assert torch.equal(dequantize(back), dequantize(q))


@pytest.mark.parametrize("bits", [4, 8])
def test_each_lane_holds_its_mma_b_fragments(bits):
    """Decoded as quant_gemm.cu decodes a lane's words, every register is the m16n8k16 B fragment of PTX's
    layout: lane (g, t) holds column g of the n8 tile, rows (k) 2t, 2t + 1 in b0 and 2t + 8, 2t + 9 in b1,
    the lower k in the register's low half."""
    n, k = 48, 128
    q = _random_weight(n, k, bits, 64, SCALE_F16, seed=0)
    packed = pack_quant_weight_cuda(q)
    codes = q.codes.to(torch.int64)
    chunk = cuda_ops.QUANT_CHUNK[bits]
    words = packed.codes.to(torch.int64) & 0xFFFFFFFF
    for block in range(n // 16):
        for c in range(k // chunk):
            for lane in range(32):
                g, t = lane // 4, lane % 4
                w = words[block, c, lane].tolist()
                for step in range(chunk // 16):
                    k0 = c * chunk + step * 16
                    for tile in range(2):
                        col = block * 16 + tile * 8 + g
                        regs = []
                        for half in range(2):  # b0, b1
                            if bits == 4:  # int4_pair(w >> (8 tile + 4 half)): nibbles at bits 0 and 16
                                word = w[step] >> (8 * tile + 4 * half)
                                lo, hi = word & 0xF, (word >> 16) & 0xF
                            else:  # int8_pair(word 2 step + tile, bytes 2 half and 2 half + 1) - 128
                                word = w[2 * step + tile]
                                lo = ((word >> (16 * half)) & 0xFF) - 128
                                hi = ((word >> (16 * half + 8)) & 0xFF) - 128
                            regs.append((lo, hi))
                        expected = [
                            (int(codes[col, k0 + 2 * t + 8 * h]), int(codes[col, k0 + 2 * t + 8 * h + 1]))
                            for h in range(2)
                        ]
                        assert regs == expected, (block, c, lane, step, tile)


def test_cuda_pack_pads_with_zero_codes_and_scales():
    q = _random_weight(40, 96, 4, 32, SCALE_F32, seed=0)
    packed = pack_quant_weight_cuda(q)
    assert packed.n_pad == 64 and packed.k_pad == 128
    assert not packed.scales[:, 40:].any()
    # the padded columns' blocks and the padded k of every block unpack to zero codes
    full = CudaQuantWeight(packed.codes, packed.scales, packed.offsets, 4, 32, packed.n_pad, packed.k_pad)
    codes = unpack_quant_weight_cuda_full(full)
    assert not codes[40:].any() and not codes[:, 96:].any()


def unpack_quant_weight_cuda_full(packed: CudaQuantWeight) -> torch.Tensor:
    """All codes of a packed weight, padding included (the scales' groups do not cover k_pad)."""
    bits, chunk = packed.bits, cuda_ops.QUANT_CHUNK[packed.bits]
    cn, ck, shift = cuda_ops._code_positions(bits)
    words = packed.codes.to(torch.int64) & 0xFFFFFFFF
    values = (words.unsqueeze(-1) >> shift) & (0xF if bits == 4 else 0xFF)
    blocks, chunks = words.shape[:2]
    codes = torch.zeros(blocks, 16, chunks, chunk, dtype=torch.int64)
    codes[:, cn, :, ck] = values.permute(2, 3, 4, 0, 1)
    return codes.view(blocks * 16, chunks * chunk)


# ---- the launches, executed in PyTorch (no GPU) ---------------------------------------------------------------


_QUANT_ENTRIES = frozenset(cuda_ops.entries("quant_gemm.cu"))


class QuantEmulatedLauncher(EmulatedLauncher):
    """EmulatedLauncher with quant_gemm.cu's kernels: each CTA's columns and k range as the kernel takes them
    (grid x: 64 columns, grid y: phases_per_split * KSTAGE of k), in float64 over the unpacked weight."""

    def launch(self, device, entry, grid, block, args, shared_mem=0) -> None:
        if not entry.name.startswith("quant_"):
            super().launch(device, entry, grid, block, args, shared_mem)
            return
        assert block[0] * math.prod(block[1:]) <= 1024 and shared_mem <= 227 * 1024
        assert entry in _QUANT_ENTRIES, f"{entry.name} is not among the instantiations CI compiles"
        self.launches.append((entry.name, tuple(grid)))
        kind = entry.name.split("_")[1]
        {"gemm": _emulate_gemm, "reduce": _emulate_reduce, "dequant": _emulate_dequant}[kind](
            entry, grid, args
        )


def _weight_from_args(entry_name: str, codes, scales, offsets, n, k, group) -> QuantizedWeight:
    bits = int(entry_name.split("_i")[1][0])
    has_offset = "_o1" in entry_name
    packed = CudaQuantWeight(codes, scales, offsets if has_offset else None, bits, group, n, k)
    return unpack_quant_weight_cuda(packed)


def _emulate_gemm(entry, grid, args) -> None:
    out, partial, x, codes, scales, offsets, bias, m, n, k, n_pad, k_pad, group, per_split = args
    m, n, k, n_pad, k_pad, group, per_split = (int(v) for v in (m, n, k, n_pad, k_pad, group, per_split))
    assert x.is_contiguous() and x.shape == (m, k) and codes.is_contiguous()
    rows_per_cta = 16 * int(entry.name.rsplit("_m", 1)[1])
    assert len(grid) == 3 and (grid[2] - 1) * rows_per_cta < m <= grid[2] * rows_per_cta, (grid, m)
    w = dequantize(_weight_from_args(entry.name, codes, scales, offsets, n, k, group)).double()
    w = torch.nn.functional.pad(w, (0, k_pad - k, 0, n_pad - n))
    xp = torch.nn.functional.pad(x.double(), (0, k_pad - k))
    splits = grid[1]
    assert grid[0] * cuda_ops.QUANT_CTA_COLUMNS == n_pad
    for y in range(splits):
        k0 = y * per_split * cuda_ops.QUANT_KSTAGE
        k1 = min(k_pad, k0 + per_split * cuda_ops.QUANT_KSTAGE)
        assert k0 < k1, "an empty split"
        part = xp[:, k0:k1] @ w[:, k0:k1].T  # [m, n_pad]
        if splits == 1:
            b = 0 if isinstance(bias, np.uint64) else bias.double()
            out.copy_((part[:, :n] + b).to(out.dtype))
        else:
            partial[y].copy_(part.float())


def _emulate_reduce(entry, grid, args) -> None:
    out, partial, bias, m, n, n_pad, splits = args
    m, n, n_pad, splits = int(m), int(n), int(n_pad), int(splits)
    assert grid[0] * 256 >= m * n and partial.shape == (splits, m, n_pad)
    total = partial.sum(0)[:, :n]
    if not isinstance(bias, np.uint64):
        total = total + bias.float()
    out.copy_(total.to(out.dtype))


def _emulate_dequant(entry, grid, args) -> None:
    out, codes, scales, offsets, k, n_pad, k_pad, group, n_begin, rows = args
    k, group, n_begin, rows = int(k), int(group), int(n_begin), int(rows)
    assert scales.shape[1] == int(n_pad) and out.shape == (rows, k)
    n = n_begin + rows
    q = _weight_from_args(entry.name, codes[: math.ceil(n / 16)], scales, offsets, n, k, group)
    words = math.ceil(rows / 16) * int(k_pad) // cuda_ops.QUANT_CHUNK[q.bits] * 128
    assert grid[0] * 256 >= words
    out.copy_(dequantize(q)[n_begin:n].to(out.dtype))


@pytest.fixture
def emulated() -> tuple[CudaOps, QuantEmulatedLauncher]:
    launcher = QuantEmulatedLauncher(num_sms=132)
    return CudaOps(torch.device("cpu"), launcher), launcher


def test_cuda_ops_have_a_quantized_linear_of_the_contract(emulated):
    ops, _ = emulated
    assert isinstance(ops.quant_linear, QuantLinearKernels)
    assert ops.quant_linear.dtypes == {torch.bfloat16, torch.float16, torch.float32}


@pytest.mark.parametrize("rows", [1, 7, 33, 64, 65, 150, 256, 257])
def test_emulated_quant_linear_matches_the_float64_oracle(emulated, rows):
    ops, launcher = emulated
    q = _random_weight(200, 2048, 4, 128, SCALE_F16, seed=rows)
    packed = ops.quant_linear.pack_quant_weight(q, torch.device("cpu"))
    x = torch.randn(rows, 2048, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    bias = torch.randn(200).to(torch.bfloat16)
    got = ops.quant_linear.linear_quant(x.view(1, rows, 2048), packed, bias)
    assert got.shape == (1, rows, 200) and got.dtype == torch.bfloat16
    expected = _oracle(x, q, bias.float())
    # the GEMM rounds only its output; the prefill path the weight too (to bf16, as a dequantized model)
    atol = expected.abs().max().item() * (2**-9 if rows <= cuda_ops.QUANT_MAX_ROWS else 2**-6)
    torch.testing.assert_close(got[0].double(), expected, rtol=2**-7, atol=atol)
    names = [name for name, _ in launcher.launches]
    if rows <= cuda_ops.QUANT_MAX_ROWS:
        (name, (_, splits, row_ctas)), *rest = launcher.launches
        assert name.startswith("quant_gemm_bf16_i4_s16_o1_m") and row_ctas == math.ceil(rows / 64)
        assert [n for n, _ in rest] == (["quant_reduce_bf16"] if splits > 1 else [])
        if rows <= 64:  # 4 CTAs of columns: a decode splits K (8 phases) so that every SM gets work
            assert splits > 1
    else:
        assert names == ["quant_dequant_bf16_i4_s16_o1"]


@pytest.mark.parametrize("splits", [1, 2, 5])
def test_emulated_split_k_covers_every_phase_once(emulated, splits):
    ops, launcher = emulated
    q = _random_weight(64, 576, 8, 32, SCALE_F32, seed=splits)
    packed = ops.quant_linear.pack_quant_weight(q, torch.device("cpu"))
    x = torch.randn(3, 576).to(torch.float16)
    got = ops.quant_linear.gemm(x, packed, None, splits)
    torch.testing.assert_close(got.double(), _oracle(x, q, None), rtol=2**-9, atol=1e-3)
    assert launcher.launches[0][1] == (1, min(splits, 3), 1)  # 576 = 3 phases of 256


def test_emulated_prefill_dequantizes_in_chunks_of_rows(emulated, monkeypatch):
    ops, launcher = emulated
    q = _random_weight(100, 256, 4, 64, SCALE_F32, seed=0)
    packed = ops.quant_linear.pack_quant_weight(q, torch.device("cpu"))
    monkeypatch.setattr(cuda_ops, "QUANT_DEQUANT_BYTES", 32 * 256 * 4)  # 32 rows of float32 at a time
    x = torch.randn(80, 256)
    bias = torch.randn(100)
    got = ops.quant_linear.linear_quant(x, packed, bias)
    torch.testing.assert_close(got.double(), _oracle(x, q, bias), rtol=1e-5, atol=1e-5)
    assert [name for name, _ in launcher.launches] == ["quant_dequant_fp32_i4_s32_o1"] * 4


def test_float32_activations_and_small_groups_take_the_dequantized_weight(emulated):
    ops, launcher = emulated
    for q, x in [
        (_random_weight(32, 128, 4, 32, SCALE_F32, seed=0), torch.randn(1, 128)),
        (_random_weight(32, 128, 4, 8, SCALE_F32, seed=0), torch.randn(1, 128).to(torch.bfloat16)),
    ]:
        packed = ops.quant_linear.pack_quant_weight(q, torch.device("cpu"))
        got = ops.quant_linear.linear_quant(x, packed, None)
        expected = _oracle(x, q, None)
        torch.testing.assert_close(
            got.double(), expected, rtol=2**-7, atol=expected.abs().max().item() * 2**-6
        )
    assert all(name.startswith("quant_dequant_") for name, _ in launcher.launches)


def test_the_worker_keeps_weights_quantized_on_cuda_only_with_the_cuda_kernels(emulated):
    from pagedserve.kernels.reference import ReferenceOps
    from pagedserve.worker_svc.model import can_quantize_linears, quant_kernels

    ops, _ = emulated
    cuda = torch.device("cuda")
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        assert can_quantize_linears(ops, dtype, cuda) and quant_kernels(ops, dtype, cuda) is ops.quant_linear
    # without CuPy or a device the worker has the reference: weights load dequantized, as before
    assert not can_quantize_linears(ReferenceOps(), torch.bfloat16, cuda)


def test_quant_linear_module_gathers_act_order_columns_and_adds_its_bias(emulated):
    from pagedserve.worker_svc.model import QuantLinear

    ops, _ = emulated
    q = _random_weight(48, 256, 4, 32, SCALE_F16, seed=5)
    perm = torch.randperm(256, generator=torch.Generator().manual_seed(0))
    bias = torch.randn(48).to(torch.bfloat16)
    layer = QuantLinear(q, bias, ops.quant_linear, perm, torch.device("cpu"))
    assert isinstance(layer.weight, CudaQuantWeight)
    x = torch.randn(2, 3, 256).to(torch.bfloat16)
    expected = _oracle(x.reshape(6, 256)[:, perm], q, bias.float()).view(2, 3, 48)
    got = layer(x)
    assert got.shape == (2, 3, 48)
    torch.testing.assert_close(got.double(), expected, rtol=2**-7, atol=expected.abs().max().item() * 2**-9)


def test_the_runner_on_the_cuda_ops_keeps_gptq_quantized_and_decodes_as_its_dequantized_model(tmp_path):
    """The worker's runner through the CUDA ops (launches executed in PyTorch) on a GPTQ checkpoint with act
    order: kept quantized, the greedy tokens of the CPU runner on the weights it dequantizes to."""
    from worker_testing import drive_greedy, make_runner

    from pagedserve.worker_svc.model import QuantLinear

    q, ref = _quantized_tiny_llama(tmp_path, 4, 64, desc_act=True)
    launcher = QuantEmulatedLauncher()
    runner = make_runner(q, num_blocks=32, block_size=16, ops=CudaOps(torch.device("cpu"), launcher))
    layer = runner.model.layers[0].mlp.down_proj  # (fused shards of different column orders load dequantized)
    assert (
        isinstance(layer, QuantLinear)
        and isinstance(layer.weight, CudaQuantWeight)
        and layer.perm is not None
    )
    cpu = make_runner(ref, num_blocks=32, block_size=16)
    assert drive_greedy(runner, PROMPTS, 16, steps=12) == drive_greedy(cpu, PROMPTS, 16, steps=12)
    # float32 activations: the weight dequantized by the kernel, then the matmul
    assert any(name == "quant_dequant_fp32_i4_s32_o1" for name, _ in launcher.launches)


def test_split_heuristic_fills_the_sms_without_outweighing_the_weight():
    # Llama-7B's q projection at one row: 64 column tiles, 16 phases of K
    assert cuda_ops.choose_quant_splits(64, 16, 1, 4096, 4096 * 4096 // 2, 132) == 9
    # 64 rows: partial sums bounded by the weight's bytes
    assert cuda_ops.choose_quant_splits(64, 16, 64, 4096, 4096 * 4096 // 2, 132) == 4
    # a wide layer needs no split
    assert cuda_ops.choose_quant_splits(600, 16, 1, 38400, 38400 * 4096 // 2, 132) == 1


# ---- on a GPU ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cuda() -> CudaOps:
    cuda_ops.precompile(cuda_ops.entries("quant_gemm.cu"))  # NVRTC in parallel processes, once
    return CudaOps(torch.device("cuda"))


# N, K: a partial CTA of columns and a partial n16 block, K past its last 64 (k_pad), several phases split
GPU_SHAPES = [(200, 576), (72, 192), (1000, 2752)]


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("group", [16, 32, 64, 128, -1])
def test_gemm_matches_float64_oracle(cuda, dtype, bits, kind, group):
    # Llama-7B's q projection in GPTQ's and AWQ's usual groups (once per dtype and width: it takes seconds)
    shapes = GPU_SHAPES + ([(4096, 4096)] if group == 128 and kind == SCALE_F16 else [])
    for n, k in shapes:
        g = k if group == -1 else group
        if k % g:
            continue
        q = _random_weight(n, k, bits, g, kind, seed=n + g)
        packed = cuda.quant_linear.pack_quant_weight(q, torch.device("cuda"))
        w = dequantize(q).to("cuda", torch.float64)
        gen = torch.Generator().manual_seed(k)
        bias = torch.randn(n, generator=gen).to(dtype).cuda()
        for rows in (1, 2, 15, 16, 17, 33, 64, 65, 130, 256, 300):
            x = torch.randn(rows, k, generator=gen).to(dtype).cuda()
            expected = _oracle(x, q, bias.float(), w)
            # the GEMM rounds only its output; the prefill path the weight too (to x's dtype)
            atol = expected.abs().max().item() * (2**-9 if rows <= cuda_ops.QUANT_MAX_ROWS else 2**-6)
            got = cuda.quant_linear.linear_quant(x, packed, bias)
            torch.testing.assert_close(got.double(), expected, rtol=2**-7, atol=atol)
            if rows <= cuda_ops.QUANT_MAX_ROWS:
                for splits in (1, 3):
                    got = cuda.quant_linear.gemm(x, packed, bias, splits)
                    torch.testing.assert_close(got.double(), expected, rtol=2**-7, atol=atol)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("kind", KINDS)
def test_dequantized_weight_has_the_bits_of_dequantize(cuda, dtype, bits, kind):
    q = _random_weight(200, 576, bits, 32, kind, seed=0)
    packed = cuda.quant_linear.pack_quant_weight(q, torch.device("cuda"))
    assert torch.equal(cuda.quant_linear.dequantize(packed, dtype).cpu(), dequantize(q).to(dtype))
    assert torch.equal(
        cuda.quant_linear.dequantize(packed, dtype, 32, 100).cpu(), dequantize(q)[32:132].to(dtype)
    )


def _quantized_tiny_llama(tmp_path, bits: int, group: int, desc_act: bool = False) -> tuple[Any, Any]:
    """A tiny Llama (head size 64, which the CUDA kernels take) as a GPTQ checkpoint, and the plain float32
    folder of the weights it dequantizes to."""
    import json

    from quant_checkpoints import write_quantized
    from safetensors.torch import load_file
    from worker_testing import save_tiny_llama

    plain = save_tiny_llama(tmp_path / "plain", head_dim=64)
    state = load_file(str(plain / "model.safetensors"))
    config = json.loads((plain / "config.json").read_text())
    write_quantized(
        state, config, tmp_path / "q", tmp_path / "ref", "gptq", bits, group, sym=False, desc_act=desc_act
    )
    for folder in ("q", "ref"):  # the tokenizer-free runner needs the generation config only
        (tmp_path / folder / "generation_config.json").write_text(
            (plain / "generation_config.json").read_text()
        )
    return tmp_path / "q", tmp_path / "ref"


@needs_cuda
@pytest.mark.parametrize(("bits", "group", "desc_act"), [(4, 64, False), (8, 32, True)])
def test_worker_keeps_gptq_quantized_on_cuda_and_decodes_as_the_dequantized_model(
    tmp_path, bits, group, desc_act
):
    """The worker's runner on CUDA (float32) with the checkpoint kept quantized: the greedy tokens of the
    CPU runner on the weights it dequantizes to."""
    from worker_testing import drive_greedy, make_runner

    from pagedserve.worker_svc.model import QuantLinear

    q, ref = _quantized_tiny_llama(tmp_path, bits, group, desc_act)
    cuda = make_runner(q, num_blocks=32, block_size=16, device="cuda")
    assert cuda.model.ops.name == "cuda", cuda.model.ops
    assert isinstance(cuda.model.layers[0].mlp.down_proj, QuantLinear)
    assert isinstance(cuda.model.layers[0].mlp.down_proj.weight, CudaQuantWeight)
    cpu = make_runner(ref, num_blocks=32, block_size=16)
    prompts = [
        [5, 17, 42, 9, 77, 3, 61, 90, 12, 33, 2, 8, 19, 4, 66, 70, 71, 13, 99, 100, 1, 2, 3],
        [7, 8, 9, 10],
    ]
    assert drive_greedy(cuda, prompts, 16, steps=24) == drive_greedy(cpu, prompts, 16, steps=24)


@needs_cuda
def test_bf16_model_on_the_quantized_gemm_is_as_close_to_float32_as_the_dequantized_bf16_model(tmp_path):
    """bf16 on CUDA, teacher-forced over a prefill and decode steps (both on quant_gemm.cu: at most 64 rows):
    the quantized model's logits are as close to the dequantized float32 model's as the dequantized bf16
    model's are (the GEMM keeps float32 scales where the bf16 model rounds its weights; a random model's
    bf16 activations dominate both)."""
    from test_model import PagedCache

    from pagedserve.worker_svc.loader import load_model
    from pagedserve.worker_svc.model import AttentionMetadata, QuantLinear

    q, _ = _quantized_tiny_llama(tmp_path, 4, 64)
    quantized = load_model(q, torch.bfloat16, "cuda")
    assert isinstance(quantized.layers[1].self_attn.qkv_proj, QuantLinear)
    models = [quantized] + [
        load_model(q, dtype, "cuda", quantization="none") for dtype in (torch.bfloat16, torch.float32)
    ]
    assert not any(isinstance(m, QuantLinear) for model in models[1:] for m in model.modules())
    gen = torch.Generator().manual_seed(1)
    tokens = [torch.randint(0, quantized.config.vocab_size, (n,), generator=gen) for n in (30, 9)]
    logits = []
    for model in models:
        cache = PagedCache(model, len(tokens), 16)
        cache.kv_caches = [(k.cuda(), v.cuda()) for k, v in cache.kv_caches]
        chunks = [(0, 0, 20), (1, 0, 5)]
        out = []
        while chunks:
            positions, attn = cache.step(chunks)
            attn = AttentionMetadata(**{f: _cuda(getattr(attn, f)) for f in attn.__dataclass_fields__})
            input_ids = torch.cat([tokens[s][a:b] for s, a, b in chunks]).cuda()
            hidden = model(input_ids, positions.cuda(), attn, cache.kv_caches)
            out.append(model.compute_logits(hidden).float().cpu())
            chunks = [(s, b, b + 1) for s, _, b in chunks if b < len(tokens[s])]
        logits.append(torch.cat(out))
    got, bf16, reference = logits
    error, bf16_error = (got - reference).abs(), (bf16 - reference).abs()
    scale = reference.abs().max().item()
    assert error.max() <= 1.5 * bf16_error.max() + 1e-3 * scale, (error.max(), bf16_error.max())
    assert error.mean() <= 1.5 * bf16_error.mean() + 1e-4 * scale, (error.mean(), bf16_error.mean())


def _cuda(value: Any) -> Any:
    return value.cuda() if isinstance(value, torch.Tensor) else value
