"""Quantized checkpoints read into kernels.quant.QuantizedWeight: GGUF blocks, GPTQ, AWQ and compressed-tensors
tensors.

Each format reads into codes with a scale and an offset per group of K, computed exactly as the format's own
dequantization computes them (docs/quantization.md has each format's quirks), so that the kernels' quantized
linear and the dequantized float32 model use the same weights.

- GGUF (a converted folder whose pagedserve_model.json names its .gguf source): Q8_0, Q4_0, Q4_1, Q4_K and
  Q6_K tensors, read from the GGUF file itself by gguf's reader.
- GPTQ (config.json `quantization_config.quant_method` "gptq"): 4 and 8 bits, any group size, desc_act with
  g_idx, sym and asym, the v1 zero-point offset (stored zeros minus one) unless `checkpoint_format` is
  "gptq_v2".
- AWQ ("awq", version "gemm"): 4 bits, the GEMM packing order.
- compressed-tensors ("compressed-tensors", llm-compressor's W4A16 / W8A16): pack-quantized and
  naive-quantized, group, channel and tensor scales, symmetric or with zero points, per config group.
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pagedserve.kernels.quant import QuantizedWeight
from pagedserve.model_files import MARKER
from pagedserve.worker_svc.config import QUANTIZATION_CHOICES
from pagedserve.worker_svc.model import ModelConfig

log = logging.getLogger(__name__)


# Methods whose quantized tensors are in the checkpoint's safetensors (config.json quantization_config).
SAFETENSORS_METHODS = ("gptq", "awq", "compressed-tensors")


def detect_quantization(model_dir: Path | str) -> str | None:
    """The quantization a model folder carries: "gptq", "awq" or "compressed-tensors" from config.json's
    quantization_config,
    "gguf" for a folder converted from a GGUF file that is still there, else None (plain weights)."""
    model_dir = Path(model_dir)
    config = _read_json(model_dir / "config.json")
    qc = config.get("quantization_config")
    if qc is not None:
        if not isinstance(qc, dict) or "quant_method" not in qc:
            raise ValueError(f"{model_dir}/config.json: quantization_config has no quant_method")
        method = str(qc["quant_method"]).lower()
        if method not in SAFETENSORS_METHODS:
            raise ValueError(
                f"{model_dir}/config.json: unsupported quant_method {method!r} ({', '.join(SAFETENSORS_METHODS)})"
            )
        return method
    source = gguf_source(model_dir)
    return "gguf" if source is not None else None


def resolve_quantization(model_dir: Path | str, requested: str) -> str | None:
    """The quantization to load: the checkpoint's ("auto", a GGUF's only when named), none (dequantized
    weights: a GGUF's converted float32 copy; GPTQ and AWQ dequantized at load) or the one named, which must
    be the checkpoint's."""
    if requested not in QUANTIZATION_CHOICES:
        raise ValueError(
            f"unknown quantization {requested!r}; expected one of: {', '.join(QUANTIZATION_CHOICES)}"
        )
    detected = detect_quantization(model_dir)
    if requested == "auto":
        # NOTE: a GGUF serves dequantized unless asked: its quantized linear decodes one stream faster than the bf16
        # path but large batches slower (docs/quantization.md); GPTQ and AWQ stay quantized.
        return None if detected == "gguf" else detected
    if requested == "none":
        return None
    if requested != detected:
        raise ValueError(f"--quantization {requested}, but {model_dir} is {detected or 'not quantized'}")
    return detected


def gguf_source(model_dir: Path) -> Path | None:
    marker = _read_json(model_dir / MARKER)
    source = marker.get("source")
    if source and str(source).endswith(".gguf") and Path(source).is_file():
        return Path(source)
    return None


# --- GGUF -------------------------------------------------------------------------------------------------

# GGUF tensor -> (our fused module, shard); "{i}" is the layer.
_GGUF_LINEARS = {
    "attn_q": ("layers.{i}.self_attn.qkv_proj", 0),
    "attn_k": ("layers.{i}.self_attn.qkv_proj", 1),
    "attn_v": ("layers.{i}.self_attn.qkv_proj", 2),
    "attn_output": ("layers.{i}.self_attn.o_proj", 0),
    "ffn_gate": ("layers.{i}.mlp.gate_up_proj", 0),
    "ffn_up": ("layers.{i}.mlp.gate_up_proj", 1),
    "ffn_down": ("layers.{i}.mlp.down_proj", 0),
}


def gguf_block(raw: np.ndarray, kind: str, rows: int, cols: int) -> QuantizedWeight:
    """A GGUF tensor's blocks (uint8 [rows, bytes of a row]) as codes, scales and offsets: each weight
    scale * code + offset gives the same float32 bits as gguf.quants.dequantize."""
    blocks = np.ascontiguousarray(raw).reshape(-1, _BLOCK_BYTES[kind])

    def f16(a: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(a).view(np.float16).astype(np.float32)

    def nibbles(qs: np.ndarray, width: int) -> np.ndarray:  # low nibbles first, then high, per `width` bytes
        qs = qs.reshape(qs.shape[0], -1, 1, width) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
        return (qs & 0x0F).reshape(qs.shape[0], -1)

    offsets: np.ndarray | None
    if kind == "Q8_0":  # d f16, 32 int8: w = d q
        scales, codes, offsets, bits, group = f16(blocks[:, :2]), blocks[:, 2:].view(np.int8), None, 8, 32
    elif kind == "Q4_0":  # d f16, 16 bytes of nibbles: w = d (q - 8) = d q - 8 d (exact)
        d = f16(blocks[:, :2])
        scales, codes, offsets, bits, group = d, nibbles(blocks[:, 2:], 16), -8 * d, 4, 32
    elif kind == "Q4_1":  # d f16, m f16, 16 bytes of nibbles: w = d q + m
        scales, offsets = f16(blocks[:, :2]), f16(blocks[:, 2:4])
        codes, bits, group = nibbles(blocks[:, 4:], 16), 4, 32
    elif kind == "Q4_K":  # d, dmin f16, 12 bytes of 6-bit (sc, m) x 8, 128 bytes: w = (d sc) q - dmin m
        d, dmin = f16(blocks[:, :2]), f16(blocks[:, 2:4])
        sc, mn = _q4k_scale_min(blocks[:, 4:16])
        scales, offsets = d * sc.astype(np.float32), -(dmin * mn.astype(np.float32))
        codes, bits, group = nibbles(blocks[:, 16:], 32), 4, 32
    elif kind == "Q6_K":  # ql 128, qh 64, int8 scales 16, d f16: w = (d sc) (q - 32), 16-wide groups
        ql, qh = blocks[:, :128], blocks[:, 128:192]
        sc, d = blocks[:, 192:208].view(np.int8).astype(np.float32), f16(blocks[:, 208:210])
        low = nibbles(ql, 64).reshape(-1, 8, 32)
        high = (qh.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
        q = (low | (high.reshape(-1, 8, 32) << 4)).astype(np.int8) - np.int8(32)
        scales, codes, offsets, bits, group = d * sc, q.reshape(-1, 256), None, 8, 16
    else:
        raise ValueError(f"GGUF type {kind} is not kept quantized")
    codes = codes.reshape(rows, cols)
    codes_t = torch.from_numpy(
        np.ascontiguousarray(codes.view(np.int8) if bits == 8 else codes.astype(np.uint8))
    )
    return QuantizedWeight(
        codes=codes_t,
        scales=torch.from_numpy(np.ascontiguousarray(scales, dtype=np.float32).reshape(rows, cols // group)),
        offsets=None
        if offsets is None
        else torch.from_numpy(np.ascontiguousarray(offsets, dtype=np.float32).reshape(rows, cols // group)),
        bits=bits,
        group_size=group,
    )


_BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20, "Q4_K": 144, "Q6_K": 210}
GGUF_KEPT_TYPES = tuple(_BLOCK_BYTES)


def _q4k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    # 12 bytes: 8 six-bit scales and 8 six-bit mins (the layout of ggml's get_scale_min_k4)
    s = np.ascontiguousarray(scales).reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.reshape(-1, 8), mn.reshape(-1, 8)


def _llama_row_order(rows: int, heads: int) -> torch.Tensor:
    """GGUF stores a llama's q and k rows permuted for interleaved RoPE; the rows in HF's (rotate-half) order
    (transformers' reverse permutation, applied to row indices)."""
    dim = rows // heads // 2
    return torch.arange(rows).reshape(heads, dim, 2).transpose(1, 2).reshape(rows)


def read_gguf_linears(gguf_path: Path, config: ModelConfig) -> dict[str, QuantizedWeight]:
    """Our fused linear modules' quantized weights (qkv_proj, o_proj, gate_up_proj, down_proj, lm_head; a
    tied head from token_embd), for the tensors of a kept type; the others are left to the converted copy."""
    reader = _gguf_reader(gguf_path)
    arch = str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8")
    shards: dict[str, dict[int, QuantizedWeight]] = {}
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        parts = tensor.name.split(".")
        if parts[0] == "blk" and len(parts) == 4 and parts[2] in _GGUF_LINEARS:
            module, shard = _GGUF_LINEARS[parts[2]]
            module = module.format(i=int(parts[1]))
        elif tensor.name == "output.weight" or (
            tensor.name == "token_embd.weight" and config.tie_word_embeddings
        ):
            module, shard = "lm_head", 0
        else:
            continue
        if kind not in GGUF_KEPT_TYPES:
            if module == "lm_head" and tensor.name == "token_embd.weight":
                continue
            raise ValueError(
                f"{gguf_path.name}: {tensor.name} is {kind}; kept quantized: {', '.join(GGUF_KEPT_TYPES)}"
            )
        cols, rows = (int(s) for s in tensor.shape[:2])  # gguf lists the fastest dimension first
        raw = tensor.data
        if arch == "llama" and parts[-2:-1] and parts[-2] in ("attn_q", "attn_k"):
            # the rows' blocks are independent: permuting the raw rows permutes the weight's
            heads = config.num_heads if parts[-2] == "attn_q" else config.num_kv_heads
            raw = np.asarray(raw).reshape(rows, -1)[_llama_row_order(rows, heads).numpy()]
        try:
            q = gguf_block(raw, kind, rows, cols)
        except ValueError as error:
            raise ValueError(f"{gguf_path.name}: {tensor.name}: {error}") from error
        shards.setdefault(module, {})[shard] = q
    return {name: _fuse(name, parts) for name, parts in shards.items()}


def _gguf_reader(path: Path) -> Any:
    """gguf's reader over the file's bytes as a plain ndarray rather than its np.memmap: the reader slices
    the header once per metadata string (a tokenizer's whole vocabulary), and a memmap's slicing costs
    several times an ndarray's. The tensors' data are views of the same mapping."""
    import gguf

    class Reader(gguf.GGUFReader):
        @property
        def data(self) -> np.ndarray:
            return self._bytes

        @data.setter
        def data(self, mapped: np.ndarray) -> None:
            self._bytes = mapped.view(np.ndarray)

    return Reader(str(path))


def _fuse(name: str, parts: dict[int, QuantizedWeight]) -> QuantizedWeight:
    from pagedserve.kernels.quant import concat_rows

    ordered = [parts[i] for i in sorted(parts)]
    return ordered[0] if len(ordered) == 1 else concat_rows(ordered)


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


# --- GPTQ and AWQ ---------------------------------------------------------------------------------------

# HF projection -> (our fused module, shard), as the loader fuses them.
_HF_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
}
QUANT_SUFFIXES = ("qweight", "qzeros", "scales", "g_idx")
# AWQ's GEMM packing: nibble i of a packed int32 holds column 8 c + _AWQ_ORDER[i]
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


@dataclass(slots=True, frozen=True)
class QuantConfig:
    method: str  # "gptq" or "awq"
    bits: int  # 4 or 8 (AWQ: 4)
    group_size: int  # k of a group; -1: all of K
    v1_zeros: bool  # GPTQ's v1 format: stored zero points are one less than the real ones

    def holds(self, suffix: str, tensor: torch.Tensor) -> bool:
        """Whether a projection's tensor of this suffix is one of its quantized parts."""
        return suffix in QUANT_SUFFIXES

    @classmethod
    def from_config(cls, model_dir: Path) -> QuantConfig:
        qc = _read_json(Path(model_dir) / "config.json").get("quantization_config") or {}
        where = f"{model_dir}/config.json quantization_config"
        method = str(qc.get("quant_method", "")).lower()
        bits, group = qc.get("bits", qc.get("w_bit")), qc.get("group_size", qc.get("q_group_size"))
        if not isinstance(bits, int) or bits not in ((4, 8) if method == "gptq" else (4,)):
            raise ValueError(
                f"{where}: bits {bits!r} ({method} checkpoints are read with 4{' or 8' if method == 'gptq' else ''})"
            )
        if not isinstance(group, int) or not (group == -1 or group > 0):
            raise ValueError(f"{where}: group_size {group!r} (a positive size, or -1 for one group)")
        if method == "awq":
            version = str(qc.get("version", "gemm")).lower()
            if version != "gemm":
                raise ValueError(f"{where}: AWQ version {version!r}; the GEMM packing is read")
            if qc.get("zero_point", True) is not True:
                raise ValueError(f"{where}: AWQ without zero points is not read")
        fmt = str(qc.get("checkpoint_format", "gptq")).lower()
        if method == "gptq" and fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"{where}: checkpoint_format {fmt!r} (gptq or gptq_v2)")
        return cls(method, bits, group, method == "gptq" and fmt == "gptq")


def _unpack(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words of 32 / bits codes each, the first in the low bits, unpacked along `dim` (0 or 1)."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    words = packed.to(torch.int32)
    if dim == 0:  # [K / per, N] -> [K, N]
        codes = (words.unsqueeze(1) >> shifts.view(1, per, 1)) & (2**bits - 1)
        return codes.reshape(-1, words.shape[1])
    codes = (words.unsqueeze(2) >> shifts.view(1, 1, per)) & (2**bits - 1)  # [G, N / per] -> [G, N]
    return codes.reshape(words.shape[0], -1)


def _awq_unpack(packed: torch.Tensor) -> torch.Tensor:
    codes = _unpack(packed, 4, 1).view(packed.shape[0], -1, 8)  # nibble order
    out = torch.empty_like(codes)
    out[:, :, list(_AWQ_ORDER)] = codes
    return out.reshape(packed.shape[0], -1)


def read_quantized_module(
    name: str,
    parts: dict[str, torch.Tensor],
    qc: QuantConfig | CompressedTensorsConfig,
    out_features: int,
    in_features: int,
) -> tuple[QuantizedWeight, torch.Tensor | None]:
    """A GPTQ or AWQ module's tensors (qweight, qzeros, scales, g_idx; a compressed-tensors module's
    weight_packed, weight_scale, ...) as codes, scales and offsets
    (w = s (q - z) exactly), and the permutation of x's columns its codes' K order needs (GPTQ desc_act), or
    None. Raises a ValueError naming the tensor for a missing part or a shape that does not fit."""
    if isinstance(qc, CompressedTensorsConfig):
        return _read_compressed_tensors(name, parts, qc, out_features, in_features)
    n, k = out_features, in_features
    group = k if qc.group_size == -1 else qc.group_size
    groups, per = -(-k // group), 32 // qc.bits  # a last group may be shorter (K not a multiple)
    needed = ("qweight", "qzeros", "scales")
    for part in needed:
        if part not in parts:
            raise ValueError(f"{name}.{part} is missing from the checkpoint")
    if qc.method == "gptq":
        shapes = {
            "qweight": (k // per, n),
            "qzeros": (groups, n // per),
            "scales": (groups, n),
            "g_idx": (k,),
        }
    else:
        shapes = {"qweight": (k, n // per), "qzeros": (groups, n // per), "scales": (groups, n)}
    for part, shape in shapes.items():
        if part in parts and tuple(parts[part].shape) != shape:
            raise ValueError(
                f"{name}.{part}: shape {tuple(parts[part].shape)}, expected {shape} for a {qc.bits}-bit "
                f"{qc.method} [{n}, {k}] weight in groups of {group}"
            )
    scales = parts["scales"].to(torch.float32)
    if qc.method == "gptq":
        q = _unpack(parts["qweight"], qc.bits, 0)  # [K, N]
        zeros = _unpack(parts["qzeros"], qc.bits, 1)  # [G, N]
        if qc.v1_zeros:
            zeros = zeros + 1  # as AutoGPTQ's dequantization reads them (a stored 15 of 4 bits is 16)
        g_idx = parts.get("g_idx")
        g_idx = torch.arange(k) // group if g_idx is None else g_idx.to(torch.int64)
    else:
        q, zeros, g_idx = (
            _awq_unpack(parts["qweight"]),
            _awq_unpack(parts["qzeros"]),
            torch.arange(k) // group,
        )
    return _grouped_weight(f"{name}.g_idx", q, zeros, scales, g_idx, qc.bits, group)


def _grouped_weight(
    g_idx_name: str,
    q: torch.Tensor,
    zeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor,
    bits: int,
    group: int,
) -> tuple[QuantizedWeight, torch.Tensor | None]:
    """w = s (q - z) from unsigned codes q [K, N], zero points [G, N], float32 scales [G, N] and the group of
    each input column: the QuantizedWeight and the permutation of x's columns the codes' order needs (act
    order), or None."""
    k, groups = q.shape[0], scales.shape[0]
    name = g_idx_name.rpartition(".")[0]
    if g_idx.min() < 0 or g_idx.max() >= groups:
        raise ValueError(f"{g_idx_name}: groups outside 0..{groups - 1}")
    perm = None
    if not torch.equal(g_idx, torch.arange(k) // group):
        perm = torch.argsort(g_idx, stable=True)
        if not torch.equal(g_idx[perm], torch.arange(k) // group):
            raise ValueError(f"{g_idx_name}: groups of unequal sizes (each must hold {group} columns)")
        q = q[perm]
    codes = q.T.contiguous()
    zeros_f = zeros.T.to(torch.float32)  # [N, G]
    scales = scales.T.contiguous()
    if k % group:  # groups of gcd(group, K) columns, each its group's scale and zero: the same weights
        sub = math.gcd(group, k)
        scales = scales.repeat_interleave(group // sub, dim=1)[:, : k // sub].contiguous()
        zeros_f = zeros_f.repeat_interleave(group // sub, dim=1)[:, : k // sub]
        group = sub
    if bits == 8:  # int8 codes q - 128: s (q - z) = s (q - 128) - s (z - 128)
        codes, zeros_f = (codes - 128).to(torch.int8), zeros_f - 128
    else:
        codes = codes.to(torch.uint8)
    weight = QuantizedWeight(codes, scales, -(scales * zeros_f), bits, group)
    weight.check(name)
    return weight, perm


# --- compressed-tensors ---------------------------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class CompressedScheme:
    """One config group's weights: int codes of `bits`, per group of K ("group"), per output row
    ("channel") or one for the whole tensor ("tensor"), symmetric (no zero points) or not."""

    targets: tuple[str, ...]
    bits: int
    strategy: str
    group_size: int  # "group": k of a group; else 0
    symmetric: bool
    fmt: str  # "pack-quantized" or "naive-quantized"


_CT_FORMATS = ("pack-quantized", "naive-quantized")
_CT_STRATEGIES = ("group", "channel", "tensor")
CT_SUFFIXES = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx")


@dataclass(slots=True, frozen=True)
class CompressedTensorsConfig:
    """quantization_config of quant_method "compressed-tensors" (llm-compressor's checkpoints, vLLM's
    CompressedTensorsWNA16): weight-only int4 or int8 schemes in config_groups, each with its targets
    ("Linear", a module name, or "re:" and a regular expression), and the modules `ignore` leaves in float."""

    method = "compressed-tensors"
    schemes: tuple[CompressedScheme, ...]
    ignore: tuple[str, ...]

    def holds(self, suffix: str, tensor: torch.Tensor) -> bool:
        # naive-quantized stores its codes as an integer `weight`
        return suffix in CT_SUFFIXES or (suffix == "weight" and not tensor.is_floating_point())

    def scheme(self, module: str) -> CompressedScheme | None:
        """The scheme of an HF linear module (model.layers.0.mlp.down_proj), None where it is ignored."""
        if any(_ct_match(pattern, module) for pattern in self.ignore):
            return None
        for scheme in self.schemes:
            if any(t == "Linear" or _ct_match(t, module) for t in scheme.targets):
                return scheme
        return None

    @classmethod
    def from_config(cls, model_dir: Path) -> CompressedTensorsConfig:
        qc = _read_json(Path(model_dir) / "config.json").get("quantization_config") or {}
        where = f"{model_dir}/config.json quantization_config"
        top_format = qc.get("format")
        groups = qc.get("config_groups")
        if not isinstance(groups, dict) or not groups:
            raise ValueError(f"{where}: config_groups {groups!r} (a mapping of named schemes)")
        schemes = []
        for group_name, group in groups.items():
            at = f"{where}.config_groups.{group_name}"
            if not isinstance(group, dict) or not isinstance(group.get("weights"), dict):
                raise ValueError(f"{at}: no weights scheme")
            targets = group.get("targets")
            if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets) or not targets:
                raise ValueError(f"{at}.targets {targets!r} (a list of module names or classes)")
            if group.get("input_activations") is not None:
                raise ValueError(f"{at}.input_activations: activation quantization (W*A8) is not read")
            w = group["weights"]
            fmt = str(group.get("format") or top_format)
            if fmt not in _CT_FORMATS:
                raise ValueError(f"{at}: format {fmt!r} ({' or '.join(_CT_FORMATS)})")
            bits, kind = w.get("num_bits"), w.get("type", "int")
            if bits not in (4, 8) or kind != "int":
                raise ValueError(f"{at}.weights: num_bits {bits!r} type {kind!r} (int with 4 or 8 bits)")
            strategy = str(w.get("strategy"))
            if strategy not in _CT_STRATEGIES:
                raise ValueError(f"{at}.weights.strategy {strategy!r} ({', '.join(_CT_STRATEGIES)})")
            group_size = w.get("group_size") if strategy == "group" else 0
            if strategy == "group" and (not isinstance(group_size, int) or group_size <= 0):
                raise ValueError(
                    f"{at}.weights.group_size {group_size!r} (a positive size for strategy group)"
                )
            if w.get("dynamic", False):
                raise ValueError(f"{at}.weights.dynamic: weights quantized at run time are not read")
            symmetric = w.get("symmetric", True)
            if not isinstance(symmetric, bool):
                raise ValueError(f"{at}.weights.symmetric {symmetric!r} (true or false)")
            schemes.append(CompressedScheme(tuple(targets), bits, strategy, group_size, symmetric, fmt))
        ignore = qc.get("ignore") or []
        if not isinstance(ignore, list) or not all(isinstance(i, str) for i in ignore):
            raise ValueError(f"{where}.ignore {ignore!r} (a list of module names)")
        return cls(tuple(schemes), tuple(ignore))


def _ct_match(pattern: str, module: str) -> bool:
    """compressed-tensors' target matching: "re:" and a regular expression matched from the start of the
    module's name, else the name itself (or the end of a longer one, after a dot)."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None
    return module == pattern or module.endswith("." + pattern)


def _read_compressed_tensors(
    name: str, parts: dict[str, torch.Tensor], qc: CompressedTensorsConfig, n: int, k: int
) -> tuple[QuantizedWeight, torch.Tensor | None]:
    """compressed-tensors' pack-quantized (codes of `bits` packed into int32 along K, the first in the low
    bits, each stored plus 2^(bits - 1); asymmetric zero points packed the same way along N) or
    naive-quantized (int8 codes and zero points as they are) module: w = s (q - z), q and z signed."""
    scheme = qc.scheme(name if name == "lm_head" else f"model.{name}")  # the module's name in HF's model
    if scheme is None:
        raise ValueError(
            f"{name}: quantized tensors in the checkpoint, but quantization_config.config_groups has no "
            "scheme for it (not targeted, or in ignore)"
        )
    bits, half = scheme.bits, 2 ** (scheme.bits - 1)
    group = k if scheme.strategy in ("channel", "tensor") else scheme.group_size
    groups = -(-k // group)  # a last group may be shorter (K not a multiple)
    codes_part = "weight_packed" if scheme.fmt == "pack-quantized" else "weight"
    needed = [codes_part, "weight_scale"] + ([] if scheme.symmetric else ["weight_zero_point"])
    for part in needed:
        if part not in parts:
            raise ValueError(f"{name}.{part} is missing from the checkpoint")
    packed = scheme.fmt == "pack-quantized"
    per = 32 // bits
    shapes = {
        codes_part: (n, -(-k // per)) if packed else (n, k),
        "weight_scale": (1,) if scheme.strategy == "tensor" else (n, groups),
    }
    if not scheme.symmetric:
        zn = (-(-n // per) if packed else n, groups)
        shapes["weight_zero_point"] = (1,) if scheme.strategy == "tensor" else zn
    for part, shape in shapes.items():
        got = tuple(parts[part].shape)
        if got != shape and not (shape == (1,) and got in ((), (1, 1))):
            raise ValueError(
                f"{name}.{part}: shape {got}, expected {shape} for a {bits}-bit {scheme.fmt} [{n}, {k}] weight "
                f"({scheme.strategy}{f' of {group}' if scheme.strategy == 'group' else ''})"
            )
    if "weight_shape" in parts and [int(v) for v in parts["weight_shape"].flatten()] != [n, k]:
        raise ValueError(f"{name}.weight_shape: {parts['weight_shape'].tolist()}, expected [{n}, {k}]")
    if packed:
        if parts[codes_part].dtype != torch.int32:
            raise ValueError(f"{name}.weight_packed: {parts[codes_part].dtype}, expected int32")
        q = _unpack(parts[codes_part], bits, 1)[:, :k]  # [N, K], stored plus 2^(bits - 1)
    else:
        if parts[codes_part].dtype != torch.int8:
            raise ValueError(f"{name}.weight: {parts[codes_part].dtype}, expected int8 codes")
        q = parts[codes_part].to(torch.int32) + half
    scales = parts["weight_scale"].to(torch.float32).reshape(-1, groups if scheme.strategy != "tensor" else 1)
    scales = scales.expand(n, groups)
    if scheme.symmetric:
        zeros = torch.full((n, groups), half, dtype=torch.int32)
    elif packed and scheme.strategy != "tensor":  # a tensor's one zero point is stored as it is
        zeros = _unpack(parts["weight_zero_point"], bits, 0)[:n]  # [N, G], plus 2^(bits - 1)
    else:
        zeros = parts["weight_zero_point"].to(torch.int32) + half
    zeros = zeros.reshape(-1, groups).expand(n, groups)
    g_idx = parts.get("weight_g_idx")  # actorder "group": the group of each input column
    g_idx = torch.arange(k) // group if g_idx is None else g_idx.to(torch.int64)
    if g_idx.shape != (k,):
        raise ValueError(f"{name}.weight_g_idx: shape {tuple(g_idx.shape)}, expected ({k},)")
    return _grouped_weight(f"{name}.weight_g_idx", q.T, zeros.T, scales.T, g_idx, bits, group)


def quant_config(model_dir: Path) -> QuantConfig | CompressedTensorsConfig | None:
    """The quantization_config of a checkpoint whose quantized tensors are in its safetensors, else None."""
    method = detect_quantization(model_dir)
    if method == "compressed-tensors":
        return CompressedTensorsConfig.from_config(model_dir)
    return QuantConfig.from_config(model_dir) if method in SAFETENSORS_METHODS else None


def fuse_quantized_modules(
    modules: dict[str, tuple[QuantizedWeight, torch.Tensor | None]],
) -> tuple[dict[str, QuantizedWeight], dict[str, torch.Tensor], list[str]]:
    """HF modules (layers.0.self_attn.q_proj, ...) fused as the model fuses them: (weights, perms, and the
    fused modules whose shards' column orders differ, or with a shard not quantized (a compressed-tensors
    ignore), which are left to be loaded dequantized)."""
    fused: dict[str, dict[int, tuple[QuantizedWeight, torch.Tensor | None]]] = {}
    for hf_name, value in modules.items():
        parent, _, proj = hf_name.rpartition(".")
        target, shard = _HF_FUSED.get(proj, (proj, 0))  # lm_head: its own
        fused.setdefault(f"{parent}.{target}" if parent else target, {})[shard] = value
    weights, perms, unfused = {}, {}, []
    for name, shards in fused.items():
        ordered = [shards[i] for i in sorted(shards)]
        perm = ordered[0][1]
        fused_name = name.rpartition(".")[2]
        whole = len(ordered) == 1 + max((s for t, s in _HF_FUSED.values() if t == fused_name), default=0)
        if not whole or any(
            (p is None) != (perm is None) or (p is not None and not torch.equal(p, perm)) for _, p in ordered
        ):
            unfused.append(name)
            continue
        weights[name] = _fuse(name, {i: w for i, (w, _) in enumerate(ordered)})
        if perm is not None:
            perms[name] = perm
    return weights, perms, unfused
