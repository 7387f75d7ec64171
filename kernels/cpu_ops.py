"""CPU implementation of the kernel ops: the C++ kernels of kernels/cpu/, built for this machine on first use.

The extension is compiled with torch.utils.cpp_extension (g++ and ninja, about a minute) with -march=native
(or PAGEDSERVE_CPU_MARCH's -march), once per machine and source version, into torch's extension cache
(TORCH_EXTENSIONS_DIR, by default ~/.cache/torch_extensions; `make install` builds it ahead of time). The
build is named after this CPU's feature flags, every file of kernels/cpu/, the flags and the folder
(`build_name`), so a cache shared with another CPU or another checkout never loads code built for a
different instruction set or source.

What it replaces, and why: in stock PyTorch, attention gathers every sequence's K/V into dense tensors
and widens them to float32 before two small batched matmuls, and each decoder layer runs about ninety
small ops (RMSNorm alone is five). Here attention reads the paged cache in place (decode rows one by
one; prompt chunks as tiled products, on AVX-512 with the bf16 dot-product instruction), and RMSNorm
with its residual add, RoPE with the KV write, and SiLU with its product, are one pass each. On AVX-512
BF16 it also has a linear layer (model.PackedLinear; steps of many rows go to oneDNN's matmul where
oneDNN has the same instructions), and on AVX2 with FMA one that widens the bf16 weights as it streams them; with either, DecoderStack runs
all decoder layers of a step in one call. Float32 models get a linear layer of their own (AVX2 with FMA),
faster than oneDNN's at every batch size on the CPUs measured, and their DecoderStack too. Where the tiled
path cannot run, long prompts in the model's Python layer loop take dense SDPA (reference.prefill_sequence),
which beats the per-row kernel on them; DecoderStack has no such fallback (see CpuOps._decoder_stack).
"""

from __future__ import annotations

import functools
import hashlib
import os
import time
from pathlib import Path
from types import ModuleType

import torch

from pagedserve.kernels.ops import (
    DecoderStack,
    check_attention,
    check_copy_blocks,
    int32,
)
from pagedserve.kernels.reference import ReferenceOps, prefill_sequence

__all__ = ["CpuLinear", "CpuOps", "load"]

# The kernels' folder: a translation unit per topic (the bindings, torch/extension.h, one of them), their
# headers, and nothing else; the build compiles every .cpp in it and is named after every file in it.
SOURCE_DIR = Path(__file__).resolve().parent / "cpu"


def sources() -> list[Path]:
    return sorted(SOURCE_DIR.glob("*.cpp"))


# NOTE: no fused multiply-adds: x * c + y * s must round each product as PyTorch does (bitwise the same
# RoPE); the kernels are bound by memory traffic, not by the extra add.
CFLAGS = ["-O3", "-ffp-contract=off", "-fopenmp"]
# The instruction set the extension is built for: this machine's own, unless the variable names an older
# one this CPU also runs (haswell: AVX2; icelake-server: AVX-512 without BF16), so that one machine tests the
# kernels of each (`make test-isa`). The build's name includes it.
MARCH_ENV = "PAGEDSERVE_CPU_MARCH"
# A sequence of several queries with at least this many query vectors per kv head (queries x the
# group's query heads) takes the tiled kernel (AVX-512 builds with head sizes a multiple of 16, and AVX2
# builds), whose tasks fill up to 48 lanes (32 on AVX2); fewer go through the row kernel, which is faster
# for them. -1: the build's own threshold, 16 on AVX-512 and 32 on AVX2 (kTileMinLanes in kernels/cpu/attention.h;
# the measurements are in docs/performance.md, "Measurements behind the code").
TILE_MIN_LANES = -1
# Where the tiled kernel cannot run, a sequence of several queries with more query-key pairs than this
# goes through dense SDPA (reference.prefill_sequence) instead of the row kernel: very long prompts,
# whose K/V blocks the row kernel reads once per eight rows.
SDPA_MIN_PAIRS = 1_000_000


def march() -> str:
    """The -march of the build: PAGEDSERVE_CPU_MARCH's, by default native."""
    return os.environ.get(MARCH_ENV, "").strip() or "native"


def compile_flags() -> list[str]:
    return [*CFLAGS, f"-march={march()}"]


def build_name() -> str:
    """The extension's name: a short hash of this CPU's model and feature flags (Linux; else torch's CPU
    capability), of every file of kernels/cpu/, of the flags (the -march among them) and of the folder. Two checkouts or two CPUs sharing
    one extension cache never load each other's build (nor rebuild it: the build's ninja file names the
    source paths, so two checkouts under one name would rebuild it each time the other loaded it)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        cpu = "\n".join([line for line in lines if line.startswith(("flags", "model name"))][:2])
    except OSError:
        cpu = ""
    files = [f"{path.name}\0{path.read_text()}" for path in sorted(SOURCE_DIR.iterdir()) if path.is_file()]
    key = "\0".join(
        [cpu or torch.backends.cpu.get_cpu_capability(), *files, *compile_flags(), str(SOURCE_DIR)]
    )
    return f"pagedserve_cpu_{hashlib.sha256(key.encode()).hexdigest()[:12]}"


@functools.cache
def load() -> ModuleType:
    """The compiled extension; builds it on the first call on this machine. Raises when it cannot be built
    (no C++ compiler, no ninja); pagedserve.kernels.get_ops then falls back to the reference."""
    from torch.utils import cpp_extension

    from pagedserve.logging import get_logger

    log = get_logger(__name__)
    name = build_name()
    started = time.monotonic()
    log.info(
        "cpu_kernels_loading",
        name=name,
        march=march(),
        note="compiled once per machine, about a minute the first time",
    )
    module = cpp_extension.load(
        name=name,
        sources=[str(path) for path in sources()],
        extra_cflags=compile_flags(),
        extra_ldflags=["-fopenmp"],
        verbose=False,
    )
    log.info("cpu_kernels_ready", name=name, seconds=round(time.monotonic() - started, 1))
    return module


class CpuLinear:
    """The extension's linear layer (kernels.ops.LinearKernels) for the weight dtypes its build has: its
    pack_linear_weight ([N / 16, K / 2, 16, 2] bf16, [N / 16, K, 16] float32, padded) and linear, bound as
    they are, with no Python frame between (the LM head calls linear every step)."""

    def __init__(self, extension: ModuleType, dtypes: frozenset[torch.dtype]) -> None:
        self.dtypes = dtypes
        self.pack_linear_weight = extension.pack_linear_weight
        self.linear = extension.linear
        # int4 and int8 weights (kernels/quant.py), float32 or bf16 x; None where the build lacks it
        self.linear_quant = extension.linear_quant if extension.has_linear_quant() else None


class CpuOps(ReferenceOps):
    """kernels.ops.Ops through the extension; write_kv is the reference's (the layers write K and V in
    rotary_write_kv_), and so is what the extension does not take (see argmax, paged_prefill_attention).
    Building it builds the extension (or raises, see load)."""

    name = "cpu"

    def __init__(self) -> None:
        self._extension = extension = load()
        # bf16: AVX-512 BF16, or AVX2 with FMA; float32: AVX2 with FMA
        dtypes = frozenset(
            dtype
            for dtype, has in (
                (torch.bfloat16, extension.has_linear()),
                (torch.float32, extension.has_linear_f32()),
            )
            if has
        )
        self.linear = CpuLinear(extension, dtypes) if dtypes else None
        self.decoder_stack = self._decoder_stack if dtypes else None

    @property
    def batch_invariant(self) -> bool:
        return self._extension.batch_invariant()

    @property
    def tiles_sum_in_chains(self) -> bool:
        """Whether this CPU's AMX tiles round as the few-row linear's FMAs in the tiles' order do (probed once
        a process; docs/kernels.md, "Batch invariance"): batch invariance then keeps the default's speed."""
        return self._extension.has_amx() and self._extension.tiles_sum_in_chains()

    @batch_invariant.setter
    def batch_invariant(self, on: bool) -> None:
        # Process-wide, as the kernels' other switches: every caller of the extension sees it.
        self._extension.set_batch_invariant(on)

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
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
        starts = torch.arange(query.shape[0] + 1, dtype=torch.int32)
        tables, lens = int32(block_tables), int32(context_lens)
        self._extension.paged_attention_(
            out, query, k_cache, v_cache, tables, starts, lens, scale, -1, TILE_MIN_LANES
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
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
        tables, starts, lens = int32(block_tables), int32(query_start_loc), int32(context_lens)
        # The kernel decides which sequences are SDPA's and leaves their rows to us.
        for s in self._extension.paged_attention_(
            out, query, k_cache, v_cache, tables, starts, lens, scale, SDPA_MIN_PAIRS, TILE_MIN_LANES
        ):
            rows = slice(int(starts[s]), int(starts[s + 1]))
            out[rows] = prefill_sequence(query[rows], k_cache, v_cache, tables[s], int(lens[s]), scale)
        return out

    def copy_blocks(
        self, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], src: torch.Tensor, dst: torch.Tensor
    ) -> None:
        check_copy_blocks(k_caches, v_caches, src, dst)
        self._extension.copy_blocks_([*k_caches, *v_caches], src.to(torch.int64), dst.to(torch.int64))

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self._extension.rms_norm(x, weight, eps)

    def add_rms_norm_(
        self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        return self._extension.add_rms_norm_(x, delta, weight, eps)

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
        self._extension.rotary_write_kv_(qk, value, cos, sin, k_cache, v_cache, slot_mapping)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        # One pass instead of PyTorch's two (silu, then the product), rounding where they round.
        return self._extension.silu_mul(gate_up)

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        # One pass bound by memory where torch.argmax is not (the sampling of a greedy decode step); bf16
        # rows are compared as they widen (exactly), so the sampler need not widen argmax-only logits. The
        # kernel checks its input (float32 or bf16 [R, V > 0], contiguous rows) itself, and anything else is
        # torch's: checks in Python here would cost microseconds in every greedy step.
        try:
            return self._extension.argmax_rows(x)
        except RuntimeError:
            return super().argmax(x)

    def masked_argmax(self, x: torch.Tensor, masks: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        # One pass over the logits reading the packed bits as they are: no unpacked mask, no float32 copy.
        # Checks as argmax's: the kernel's own, anything else (another dtype, strided rows) is the reference's.
        try:
            return self._extension.masked_argmax_rows(x, masks, rows)
        except RuntimeError:
            return super().masked_argmax(x, masks, rows)

    def _decoder_stack(
        self,
        *,
        hidden: int,
        intermediate: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        eps: float,
        scale: float,
        final_norm: torch.Tensor,
    ) -> DecoderStack:
        # Its attention never hands a sequence to SDPA: where the tiled kernel cannot run (on AVX-512,
        # head sizes not a multiple of 16, or more than 32 query heads per kv head) long prompts take the
        # row kernel, slower there but not wrong; every supported family's released models use head
        # sizes of 64 or 128.
        return self._extension.DecoderStack(
            hidden=hidden,
            intermediate=intermediate,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            eps=eps,
            scale=scale,
            min_tile_lanes=TILE_MIN_LANES,
            final_norm=final_norm,
        )


if __name__ == "__main__":
    # `python -m pagedserve.kernels.cpu_ops`: build (or find) the extension for this machine.
    from pagedserve.logging import configure_logging

    configure_logging("kernels", json=False)
    print(f"CPU kernels ready: {load().__file__}")
