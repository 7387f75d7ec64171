"""CPU implementation of the kernel ops: the C++ kernels of kernels/cpu/, built for this machine on first use.

The extension is compiled with torch.utils.cpp_extension (g++ and ninja, about a minute) with -march=native
(or PAGEDSERVE_CPU_MARCH's -march), once per machine and source version, into torch's extension cache
(TORCH_EXTENSIONS_DIR, by default ~/.cache/torch_extensions; `make install` builds it ahead of time). The
build is named after this CPU's feature flags, every file of kernels/cpu/ and the flags (`build_name`), so a
cache shared with another CPU or another checkout never loads code built for a different instruction set or
source.

What it replaces, and why: in stock PyTorch, attention gathers every sequence's K/V into dense tensors
and widens them to float32 before two small batched matmuls, and each decoder layer runs about ninety
small ops (RMSNorm alone is five). Here attention reads the paged cache in place (decode rows one by
one; prompt chunks as tiled products, on AVX-512 with the bf16 dot-product instruction), and RMSNorm
with its residual add, RoPE with the KV write, and SiLU with its product, are one pass each. On AVX-512
BF16 it also has a linear layer, at least as fast as oneDNN at every batch size (model.PackedLinear),
and on AVX2 with FMA one that widens the bf16 weights as it streams them; with either, DecoderStack runs
all decoder layers of a step in one call. Float32 models get a linear layer of their own (AVX2 with FMA),
faster than oneDNN's at every batch size on the CPUs measured, and their DecoderStack too. Where the tiled
path cannot run, long prompts in the model's Python layer loop take dense SDPA (reference.prefill_sequence),
which beats the per-row kernel on them; DecoderStack has no such fallback (see the note on decoder_stack).
"""

from __future__ import annotations

import functools
import hashlib
import os
import time
from pathlib import Path
from types import ModuleType

import torch

from pagedserve.kernels import reference
from pagedserve.kernels.reference import write_kv

__all__ = [
    "add_rms_norm_",
    "argmax",
    "argmax_append_",
    "copy_blocks",
    "decode_inputs",
    "decoder_stack",
    "linear_kernels",
    "load",
    "paged_decode_attention",
    "paged_prefill_attention",
    "rms_norm",
    "rotary_write_kv_",
    "silu_mul",
    "write_kv",
]

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
# builds), whose tasks fill up to 48 lanes (32 on AVX2); fewer go through the row kernel. -1: the build's own
# threshold, 16 on AVX-512 and 32 on AVX2 (kTileMinLanes in kernels/cpu/attention.h), where the tiled kernel
# starts to beat the row kernel (`bench/bench_kernels_cpu.py --prefill`, docs/performance.md).
TILE_MIN_LANES = -1
# Where the tiled kernel cannot run, a sequence of several queries with more query-key pairs than this
# goes through dense SDPA (reference.prefill_sequence) instead of the row kernel: very long prompts,
# whose K/V blocks the row kernel reads once per eight rows (numbers above).
SDPA_MIN_PAIRS = 1_000_000


def march() -> str:
    """The -march of the build: PAGEDSERVE_CPU_MARCH's, by default native."""
    return os.environ.get(MARCH_ENV, "").strip() or "native"


def compile_flags() -> list[str]:
    return [*CFLAGS, f"-march={march()}"]


def build_name() -> str:
    """The extension's name: a short hash of this CPU's model and feature flags (Linux; else torch's CPU
    capability), of the source and of the flags (the -march among them). Two checkouts or two CPUs sharing
    one extension cache never load each other's build."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        cpu = "\n".join([line for line in lines if line.startswith(("flags", "model name"))][:2])
    except OSError:
        cpu = ""
    files = [f"{path.name}\0{path.read_text()}" for path in sorted(SOURCE_DIR.iterdir()) if path.is_file()]
    key = "\0".join([cpu or torch.backends.cpu.get_cpu_capability(), *files, *compile_flags()])
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


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    batch = query.shape[0]
    assert block_tables.shape[0] == batch and context_lens.shape == (batch,)
    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    starts = torch.arange(batch + 1, dtype=torch.int32)
    tables, lens = _int32(block_tables), _int32(context_lens)
    load().paged_attention_(out, query, k_cache, v_cache, tables, starts, lens, scale, -1, TILE_MIN_LANES)
    return out


def paged_prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    tables, starts, lens = _int32(block_tables), _int32(query_start_loc), _int32(context_lens)
    # The kernel decides which sequences are SDPA's and leaves their rows to us.
    for s in load().paged_attention_(
        out, query, k_cache, v_cache, tables, starts, lens, scale, SDPA_MIN_PAIRS, TILE_MIN_LANES
    ):
        rows = slice(int(starts[s]), int(starts[s + 1]))
        out[rows] = reference.prefill_sequence(query[rows], k_cache, v_cache, tables[s], int(lens[s]), scale)
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return load().rms_norm(x, weight, eps)


def add_rms_norm_(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return load().add_rms_norm_(x, delta, weight, eps)


def copy_blocks(
    k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], src: torch.Tensor, dst: torch.Tensor
) -> None:
    assert len(k_caches) == len(v_caches) and src.shape == dst.shape and src.dim() == 1
    load().copy_blocks_([*k_caches, *v_caches], src.to(torch.int64), dst.to(torch.int64))


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    # One pass instead of PyTorch's two (silu, then the product), rounding where they round.
    return load().silu_mul(gate_up)


def rotary_write_kv_(
    qk: torch.Tensor,
    value: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    load().rotary_write_kv_(qk, value, cos, sin, k_cache, v_cache, slot_mapping)


def decode_inputs(
    token_ids: torch.Tensor,
    block_tables: torch.Tensor,
    slots: list[int],
    start: list[int],
    block_size: int,
) -> list[torch.Tensor]:
    """A decode step's inputs from a runner's per-slot arrays (token_ids int64 [rows, tokens],
    block_tables int32 [rows, blocks]): sequence i (slot slots[i]) computes its token at position
    start[i]. Returns [input_ids int64 [S], positions int64 [S], slot_mapping int64 [S], block_tables
    int32 [S, max_blocks], query_start_loc int32 [S + 1], context_lens int32 [S]] (see
    ModelRunner._model_inputs)."""
    return load().decode_inputs(token_ids, block_tables, slots, start, block_size)


def argmax_append_(
    logits: torch.Tensor, token_ids: torch.Tensor, slots: list[int], positions: list[int]
) -> list[int]:
    """The argmax of each row of logits [S, V] (float32 or bf16, as argmax), written into token_ids
    (int64 [rows, tokens]) at [slots[i], positions[i]], and returned: a greedy decode step's tokens."""
    return load().argmax_append_(logits, token_ids, slots, positions)


_ARGMAX_DTYPES = (torch.float32, torch.bfloat16)


def argmax(x: torch.Tensor) -> torch.Tensor:
    # torch.argmax's loop on CPU is far from memory's rate; this one pass of vector compares is bound by
    # memory. bf16 rows are compared as they widen (exactly), so the sampler need not widen argmax-only
    # logits.
    if x.dim() == 2 and x.dtype in _ARGMAX_DTYPES and x.stride(-1) == 1 and x.shape[1] > 0:
        return load().argmax_rows(x)
    return reference.argmax(x)


def linear_kernels(dtype: torch.dtype = torch.bfloat16) -> ModuleType | None:
    """The extension when this build has its linear layer for weights of `dtype` (bf16: AVX-512 BF16, or
    AVX2 with FMA; float32: AVX2 with FMA): `pack_linear_weight(weight)` once, then `linear(x, packed,
    out_features, bias)`; else None. The model's prepacked linear layers run through it
    (model.PackedLinear)."""
    module = load()
    if dtype == torch.bfloat16:
        return module if module.has_linear() else None
    if dtype == torch.float32:
        return module if module.has_linear_f32() else None
    return None


def decoder_stack(**shape: object) -> object:
    """A DecoderStack of the extension (needs linear_kernels(dtype) for the model's dtype, bf16 or
    float32, which final_norm's sets): a decoder's layers run in one call, over weights packed by its
    pack_linear_weight. `shape`: hidden, intermediate, num_heads, num_kv_heads, head_dim, eps, scale and
    final_norm; layers are added with add_layer (model.CausalLM builds it).

    NOTE: its attention never hands a sequence to SDPA. Every prompt chunk of at least TILE_MIN_LANES
    query vectors per kv head takes the tiled kernel, so this matters only on AVX-512 for head sizes
    that are not a multiple of 16, or for more than 32 query heads per kv head, whose long prompts then
    go through the row kernel: slower there, not wrong. The released models of every supported family
    use head sizes of 64 or 128. On AVX2 the tiled kernel runs every head size, and is faster than the row
    kernel and SDPA on long prompts (docs/performance.md)."""
    return load().DecoderStack(min_tile_lanes=TILE_MIN_LANES, **shape)


def _int32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.int32 and t.is_contiguous() else t.to(torch.int32).contiguous()


if __name__ == "__main__":
    # `python -m pagedserve.kernels.cpu_ops`: build (or find) the extension for this machine.
    from pagedserve.logging import configure_logging

    configure_logging("kernels", json=False)
    print(f"CPU kernels ready: {load().__file__}")
