"""Weight-only quantized weights in one form: codes with a scale and an offset per group of K.

Every checkpoint format the worker keeps quantized (GGUF blocks, GPTQ, AWQ; see worker_svc/quantization.py)
reads into a `QuantizedWeight`: w[n, k] = scales[n, k // group_size] * codes[n, k] + offsets[n, k //
group_size], in float32, exactly as the format's own dequantization computes it. `dequantize` is that
formula (the oracle of the tests, and the fallback where the kernels have no quantized linear);
`pack_quant_weight` lays a weight out for the C++ kernels' quantized linear (kernels/cpu/linear_quant.h);
`PackedRows` reads rows back out of that layout (the embedding lookup of a quantized tied head).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import torch

BLOCK = 16  # output columns of a packed block (kernels/cpu/linear.h kBlock)
HEADER_BYTES = 64
# kernels/cpu/linear_quant.h QuantHeader: magic, bits, scale kind, group size, n, k, groups, scale bytes, block bytes
_HEADER_FORMAT = "<Iiiiqqqqq"
MAGIC = 0x51505351
SCALE_F32, SCALE_F16, SCALE_F16_NO_OFFSET = 0, 1, 2
_SCALE_GROUP_BYTES = {SCALE_F32: 128, SCALE_F16: 64, SCALE_F16_NO_OFFSET: 32}


@dataclass(slots=True)
class QuantizedWeight:
    codes: torch.Tensor  # [N, K]: uint8 0..15 (bits 4) or int8 -128..127 (bits 8)
    scales: torch.Tensor  # float32 [N, K / group_size]
    offsets: torch.Tensor | None  # float32 [N, K / group_size], or None: zero
    bits: int  # 4 or 8
    group_size: int  # k of a group; K is a multiple of it

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)  # type: ignore[return-value]

    def check(self, name: str) -> None:
        """Raises a ValueError naming the tensor if the parts do not fit together."""
        n, k = self.codes.shape
        groups = k // self.group_size if self.group_size > 0 else 0
        expected = torch.uint8 if self.bits == 4 else torch.int8
        problems = []
        if self.bits not in (4, 8):
            problems.append(f"bits {self.bits} (4 or 8)")
        if self.group_size <= 0 or k % self.group_size != 0:
            problems.append(f"group size {self.group_size} does not divide K = {k}")
        elif self.group_size % (8 if self.bits == 4 else 4) != 0:
            problems.append(f"group size {self.group_size} is not a multiple of {8 if self.bits == 4 else 4}")
        if self.codes.dtype != expected:
            problems.append(f"codes are {self.codes.dtype}, expected {expected}")
        for part, t in (("scales", self.scales), ("offsets", self.offsets)):
            if t is not None and (t.dtype != torch.float32 or tuple(t.shape) != (n, groups)):
                problems.append(f"{part} {t.dtype} {tuple(t.shape)}, expected float32 {(n, groups)}")
        if problems:
            raise ValueError(f"{name}: malformed quantized weight: {'; '.join(problems)}")


def dequantize(q: QuantizedWeight) -> torch.Tensor:
    """float32 [N, K]: scale * code + offset, each product and sum rounded once (as ggml and gguf do)."""
    scales = q.scales.repeat_interleave(q.group_size, dim=1)
    w = scales * q.codes.to(torch.float32)
    if q.offsets is not None:
        w = w + q.offsets.repeat_interleave(q.group_size, dim=1)
    return w


def concat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """The parts' rows one after the other (a fused q/k/v or gate/up weight), in a form all of them fit
    exactly: the most bits among them (int4 codes c as int8 c - 8, the offset raised by 8 scales) and the
    smallest group (a larger group's scales repeated)."""
    bits = max(p.bits for p in parts)
    group = min(p.group_size for p in parts)
    out = []
    for p in parts:
        if p.group_size % group != 0:
            raise ValueError(f"group sizes {[q.group_size for q in parts]} of a fused weight do not nest")
        codes, scales, offsets = p.codes, p.scales, p.offsets
        if p.bits != bits:  # 4 -> 8: w = s c + o = s (c - 8) + (o + 8 s), exact in float32 (s c < 2^24 s)
            codes = (codes.to(torch.int16) - 8).to(torch.int8)
            offsets = (offsets if offsets is not None else torch.zeros_like(scales)) + 8 * scales
        repeat = p.group_size // group
        scales = scales.repeat_interleave(repeat, dim=1)
        offsets = None if offsets is None else offsets.repeat_interleave(repeat, dim=1)
        out.append((codes, scales, offsets))
    any_offsets = any(o is not None for _, _, o in out)
    return QuantizedWeight(
        torch.cat([c for c, _, _ in out]),
        torch.cat([s for _, s, _ in out]),
        torch.cat([o if o is not None else torch.zeros_like(s) for _, s, o in out]) if any_offsets else None,
        bits,
        group,
    )


def _exact_f16(t: torch.Tensor) -> bool:
    return bool(torch.equal(t.to(torch.float16).to(torch.float32), t))


def scale_kind(q: QuantizedWeight) -> int:
    """The smallest scale form that holds q's scales and offsets exactly."""
    if _exact_f16(q.scales):
        if q.offsets is None or not q.offsets.any():
            return SCALE_F16_NO_OFFSET
        if _exact_f16(q.offsets):
            return SCALE_F16
    return SCALE_F32


_INT4_LOW, _INT4_HIGH = torch.tensor([0, 4, 1, 5]), torch.tensor([2, 6, 3, 7])


def pack_quant_weight(q: QuantizedWeight) -> torch.Tensor:
    """uint8 [64 + blocks * block_bytes]: the header, then blocks of 16 output columns, each its groups'
    scales (and offsets) padded to 64 bytes, then its codes (the layout of kernels/cpu/linear_quant.h)."""
    q.check("pack_quant_weight")
    n, k = q.shape
    groups = k // q.group_size
    if q.group_size % (8 if q.bits == 4 else 4) != 0:
        raise ValueError(f"group size {q.group_size} must be a multiple of {8 if q.bits == 4 else 4}")
    kind = scale_kind(q)
    blocks = -(-n // BLOCK)
    pad = blocks * BLOCK - n

    def padded(t: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.pad(t, (0, 0, 0, pad)) if pad else t

    # Scales: [blocks, groups, (scale | offset), 16] in float32 or fp16.
    scale_dtype = torch.float32 if kind == SCALE_F32 else torch.float16
    offsets = q.offsets if q.offsets is not None else torch.zeros_like(q.scales)
    parts = [q.scales] if kind == SCALE_F16_NO_OFFSET else [q.scales, offsets]
    scales = torch.stack([padded(p).view(blocks, BLOCK, groups) for p in parts], dim=2)  # [b, 16, parts, g]
    scales = scales.permute(0, 3, 2, 1).contiguous().to(scale_dtype)
    scales = scales.view(blocks, -1).view(torch.uint8)
    scale_bytes = -(-groups * _SCALE_GROUP_BYTES[kind] // 64) * 64
    scales = torch.nn.functional.pad(scales, (0, scale_bytes - scales.shape[1]))

    codes = padded(q.codes)
    if q.bits == 4:
        # [blocks, K / 8, 16, 8] -> one int32 lane per column and 8 k: k 2p at bit 4p, k 2p + 1 at bit 16 + 4p,
        # so its little-endian bytes hold k (0, 2), (4, 6), (1, 3), (5, 7), the first of each pair low
        c = codes.view(blocks, BLOCK, k // 8, 8).permute(0, 2, 1, 3)
        low, high = c[..., _INT4_LOW], c[..., _INT4_HIGH]
        code_bytes = (low | (high << 4)).reshape(blocks, -1)
    else:
        code_bytes = codes.view(blocks, BLOCK, k).permute(0, 2, 1).contiguous().view(torch.uint8)
        code_bytes = code_bytes.view(blocks, -1)
    body = torch.cat([scales, code_bytes], dim=1)
    header = struct.pack(
        _HEADER_FORMAT, MAGIC, q.bits, kind, q.group_size, n, k, groups, scale_bytes, body.shape[1]
    ).ljust(HEADER_BYTES, b"\0")
    return torch.cat([torch.frombuffer(bytearray(header), dtype=torch.uint8), body.reshape(-1)])


def packed_bytes(packed: torch.Tensor) -> int:
    return packed.numel() * packed.element_size()


class PackedRows:
    """Rows of a packed weight (output features) dequantized from their codes: float32 [len(rows), K], the same
    bits as `dequantize`'s rows. The lookup of an embedding whose codes are a quantized tied head's: one gather
    of each row's bytes (its scales and codes, strided through its block of 16 columns), then scale * code +
    offset."""

    def __init__(self, packed: torch.Tensor) -> None:
        magic, bits, kind, group, n, k, groups, scale_bytes, block_bytes = struct.unpack_from(
            _HEADER_FORMAT, packed[:HEADER_BYTES].numpy().tobytes()
        )
        if magic != MAGIC:
            raise ValueError("not a packed quantized weight")
        self.body, self.block_bytes = packed[HEADER_BYTES:], block_bytes
        self.bits, self.group, self.groups, self.k, self.rows = bits, group, groups, k, n
        self.parts = 1 if kind == SCALE_F16_NO_OFFSET else 2
        self.scale_dtype = torch.float32 if kind == SCALE_F32 else torch.float16
        width = 4 if kind == SCALE_F32 else 2
        self.scale_width = groups * self.parts * width
        # the byte offsets of column c's scales ([groups, parts, 16] of `width` bytes) and codes in its block
        column = torch.arange(BLOCK)[:, None]
        scales = (torch.arange(groups * self.parts) * BLOCK * width)[None] + column * width
        scales = (scales[:, :, None] + torch.arange(width)).view(BLOCK, -1)
        if bits == 4:  # 4 bytes per column and 8 k
            codes = (torch.arange(k // 8) * BLOCK * 4)[None] + column * 4
            codes = (codes[:, :, None] + torch.arange(4)).view(BLOCK, -1)
        else:  # [K, 16] int8
            codes = torch.arange(k)[None] * BLOCK + column
        self.offsets = torch.cat([scales, scale_bytes + codes], dim=1)

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        t = rows.numel()
        data = self.body[(rows // BLOCK * self.block_bytes)[:, None] + self.offsets[rows % BLOCK]]
        scales = (
            data[:, : self.scale_width].contiguous().view(self.scale_dtype).view(t, self.groups, self.parts)
        )
        codes = data[:, self.scale_width :]
        if self.bits == 4:
            # each column's 4 bytes per 8 k hold k (0, 2), (4, 6), (1, 3), (5, 7), the first low
            lanes = codes.view(t, self.k // 8, 4)
            c = torch.empty(t, self.k // 8, 8, dtype=torch.uint8)
            c[..., _INT4_LOW], c[..., _INT4_HIGH] = lanes & 0x0F, lanes >> 4
        else:
            c = codes.view(torch.int8)
        scales = scales.to(torch.float32)
        w = c.reshape(t, self.groups, self.group).to(torch.float32) * scales[:, :, :1]
        if self.parts == 2:
            w = w + scales[:, :, 1:]
        return w.view(t, self.k)
