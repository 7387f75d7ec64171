"""GPTQ, AWQ and compressed-tensors checkpoints of a Llama written the way AutoGPTQ, AutoAWQ and
llm-compressor (with compressed-tensors' own compressors) write them, for the tests.

Each linear weight is quantized by rounding to the nearest code (the formats, not the GPTQ or AWQ search
for the codes), then packed as the references pack: AutoGPTQ's QuantLinear.pack (qweight [K / (32 / bits),
N] packed along K, qzeros [groups, N / (32 / bits)] packed along N holding zero - 1 in the v1 format, scales
fp16 [groups, N], g_idx [K]), and AutoAWQ's WQLinear_GEMM.from_linear (qweight [K, N / 8] and qzeros [groups,
N / 8] packed along N in the order 0 2 4 6 1 3 5 7, scales fp16 [groups, N]). Beside each checkpoint the
same model's dequantized weights (s (q - z) in float32, from the codes before packing) go into a plain
float32 folder: the reference the loaded checkpoint is compared with.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def rtn(w: torch.Tensor, bits: int, group: int, sym: bool, g_idx: torch.Tensor):
    """Round-to-nearest codes of w [N, K] in the groups g_idx gives each column: (codes [N, K], scales fp16
    [G, N], zeros [G, N]) as AutoGPTQ's Quantizer computes them (zero points of at least 1, which the v1
    format can store)."""
    maxq = 2**bits - 1
    groups = int(g_idx.max()) + 1
    codes = torch.empty(w.shape, dtype=torch.int64)
    scales = torch.empty(groups, w.shape[0], dtype=torch.float16)
    zeros = torch.empty(groups, w.shape[0], dtype=torch.int64)
    for g in range(groups):
        cols = g_idx == g
        wg = w[:, cols].double()
        xmin, xmax = wg.min(1).values.clamp(max=0), wg.max(1).values.clamp(min=0)
        if sym:
            xmax = torch.maximum(xmin.abs(), xmax)
            xmin = torch.where(xmin < 0, -xmax, xmin)
        scale = ((xmax - xmin) / maxq).clamp(min=1e-5)
        zero = torch.full_like(scale, (maxq + 1) // 2) if sym else torch.round(-xmin / scale).clamp(1, maxq)
        s16 = scale.half()
        codes[:, cols] = torch.clamp(torch.round(wg / s16.double()[:, None] + zero[:, None]), 0, maxq).long()
        scales[g], zeros[g] = s16, zero.long()
    return codes, scales, zeros


def dequantized(codes, scales, zeros, g_idx) -> torch.Tensor:
    s = scales.float().T[:, g_idx]  # [N, K]
    z = zeros.T[:, g_idx].float()
    return s * (codes.float() - z)


def gptq_pack(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int, v1: bool):
    """AutoGPTQ's QuantLinear.pack: (qweight, qzeros) int32."""
    per = 32 // bits
    intweight = codes.T.contiguous().numpy().astype(np.uint32)  # [K, N]
    qweight = np.zeros((intweight.shape[0] // per, intweight.shape[1]), dtype=np.uint32)
    for row in range(qweight.shape[0]):
        for j in range(per):
            qweight[row] |= intweight[row * per + j] << (bits * j)
    z = (zeros - 1 if v1 else zeros).numpy().astype(np.uint32)
    qzeros = np.zeros((z.shape[0], z.shape[1] // per), dtype=np.uint32)
    for col in range(qzeros.shape[1]):
        for j in range(per):
            qzeros[:, col] |= z[:, col * per + j] << (bits * j)
    return torch.from_numpy(qweight.view(np.int32)), torch.from_numpy(qzeros.view(np.int32))


def awq_pack(values: torch.Tensor) -> torch.Tensor:
    """AutoAWQ's GEMM packing of [rows, N] 4-bit values: [rows, N / 8] int32, nibble i of word c holding
    column 8 c + AWQ_ORDER[i]."""
    v = values.numpy().astype(np.uint32)
    packed = np.zeros((v.shape[0], v.shape[1] // 8), dtype=np.uint32)
    for col in range(packed.shape[1]):
        for i in range(8):
            packed[:, col] |= v[:, col * 8 + AWQ_ORDER[i]] << (i * 4)
    return torch.from_numpy(packed.view(np.int32))


def write_quantized(
    state: dict[str, torch.Tensor],
    config: dict,
    out: Path,
    reference: Path,
    method: str,
    bits: int = 4,
    group: int = 128,
    sym: bool = True,
    desc_act: bool = False,
    v1: bool = True,
    seed: int = 0,
) -> None:
    """Writes `state` (an HF Llama's float32 weights) as a `method` checkpoint into `out`, and the weights
    it dequantizes to as a plain float32 folder into `reference`."""
    g = torch.Generator().manual_seed(seed)
    quantized, plain = {}, {}
    for name, w in state.items():
        parts = name.split(".")
        if len(parts) < 2 or parts[-2] not in PROJECTIONS or parts[-1] != "weight":
            quantized[name] = plain[name] = w
            continue
        module = name.removesuffix(".weight")
        k = w.shape[1]
        size = k if group == -1 else group
        g_idx = torch.arange(k) // size
        if desc_act:  # act order: column perm[i] is the i-th quantized, in group i // size
            perm = torch.randperm(k, generator=g)
            g_idx = torch.empty(k, dtype=torch.int64)
            g_idx[perm] = torch.arange(k) // size
        codes, scales, zeros = rtn(w, bits, size, sym, g_idx)
        plain[name] = dequantized(codes, scales, zeros, g_idx)
        if method == "gptq":
            qweight, qzeros = gptq_pack(codes, scales, zeros, bits, v1)
            quantized[f"{module}.g_idx"] = g_idx.to(torch.int32)
        else:
            qweight, qzeros = awq_pack(codes.T.contiguous()), awq_pack(zeros)
        quantized[f"{module}.qweight"], quantized[f"{module}.qzeros"] = qweight, qzeros
        quantized[f"{module}.scales"] = scales
    qc = {"quant_method": method, "bits": bits, "group_size": group}
    if method == "gptq":
        qc |= {"desc_act": desc_act, "sym": sym, "checkpoint_format": "gptq" if v1 else "gptq_v2"}
    else:
        qc |= {"zero_point": True, "version": "gemm"}
    for folder, tensors, conf in (
        (out, quantized, config | {"quantization_config": qc}),
        (reference, plain, config),
    ):
        folder.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
        (folder / "config.json").write_text(json.dumps(conf))


def write_compressed_tensors(
    state: dict[str, torch.Tensor],
    config: dict,
    out: Path,
    reference: Path,
    bits: int = 4,
    strategy: str = "group",
    group: int | None = 64,
    sym: bool = True,
    fmt: str = "pack-quantized",
    ignore: tuple[str, ...] = ("lm_head",),
) -> None:
    """Writes `state` as llm-compressor writes a W4A16 or W8A16 checkpoint: every Linear but those `ignore`
    names quantized by compressed-tensors' own round-to-nearest (calculate_qparams over each group's min and
    max, then its compressor: PackedQuantizationCompressor or NaiveQuantizationCompressor), the other tensors
    in bf16, and its QuantizationConfig as quantization_config. The reference folder holds the same weights
    in float32: the checkpoint's codes, unpacked by compressed-tensors' unpack_from_int32, as s (q - z)."""
    from compressed_tensors.compressors import NaiveQuantizationCompressor, PackedQuantizationCompressor
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams

    args = QuantizationArgs(
        num_bits=bits,
        type="int",
        symmetric=sym,
        strategy=strategy,
        group_size=group if strategy == "group" else None,
    )
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    compressor = PackedQuantizationCompressor if fmt == "pack-quantized" else NaiveQuantizationCompressor
    quantized, plain = {}, {}
    for name, w in state.items():
        w = w.to(torch.bfloat16)
        module = name.removesuffix(".weight")
        parts = module.split(".")
        linear = name.endswith(".weight") and (parts[-1] in PROJECTIONS or module == "lm_head")
        if not linear or any(_ignored(module, i) for i in ignore):
            quantized[name], plain[name] = w, w.float()
            continue
        n, k = w.shape
        size = group if strategy == "group" else k
        wg = w.view(1, 1, n * k) if strategy == "tensor" else w.view(n, k // size, size)
        scale, zero = calculate_qparams(wg.amin(-1).clamp(max=0), wg.amax(-1).clamp(min=0), args)
        if strategy == "tensor":  # one scale (and zero point) for the whole weight
            scale, zero = scale.reshape(1), zero.reshape(1)
        tensors = {"weight": w, "weight_scale": scale}
        if not sym:
            tensors["weight_zero_point"] = zero
        tensors = compressor.compress(tensors, scheme)
        for part, t in tensors.items():
            quantized[f"{module}.{part}"] = t
        if fmt == "pack-quantized":
            q = unpack_from_int32(tensors["weight_packed"], bits, torch.Size([n, k]))
            if not sym and strategy != "tensor":  # zero points packed along N
                zero = unpack_from_int32(tensors["weight_zero_point"], bits, scale.shape, packed_dim=0)
        else:
            q = tensors["weight"]
        groups = 1 if strategy == "tensor" else k // size
        z = _per_weight(zero, groups, size) if not sym else 0.0
        plain[name] = (_per_weight(scale, groups, size) * (q.float() - z)).expand(n, k).contiguous()
    qc = QuantizationConfig(
        config_groups={"group_0": scheme}, format=fmt, ignore=list(ignore), quantization_status="compressed"
    ).to_dict()
    for folder, tensors, conf in (
        (out, quantized, config | {"quantization_config": qc, "torch_dtype": "bfloat16"}),
        (reference, plain, config),
    ):
        folder.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
        (folder / "config.json").write_text(json.dumps(conf))


def _per_weight(t: torch.Tensor, groups: int, size: int) -> torch.Tensor:
    """[N or 1, groups] scales or zero points, each repeated over its group's `size` columns."""
    return t.float().reshape(-1, groups).repeat_interleave(size, 1)


def _ignored(module: str, pattern: str) -> bool:
    """compressed-tensors' matching of an ignore entry: "re:" and a regular expression, or the name."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None
    return module == pattern
