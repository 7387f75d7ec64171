"""CUDA implementation of the kernel ops (kernels/ops.py): CudaOps, whose paged cache ops are the kernels in
kernels/*.cu and whose small pointwise ops, argmax included, are the reference's PyTorch ops on the GPU
(the model's linear layers are PyTorch's, but for quantized weights kept quantized: CudaQuantLinear,
kernels/quant_gemm.cu).

The kernels in kernels/*.cu are compiled at run time with NVRTC through CuPy (RawModule, one module per
template instantiation, cached in memory and by CuPy on disk) and launched on torch's current stream with
torch's raw device pointers: no copy, no DLPack round trip, no extra synchronisation.

CudaOps prepares each launch (checks, metadata, grid, arguments) and hands it to a KernelLauncher:
CupyLauncher on a GPU. The tests run the same preparation on the CPU, under torch.inference_mode() as the
worker does, with a launcher that executes each launch in PyTorch from its grid and arguments
(tests/cuda_emulation.py), so the glue is checked where no GPU is.

CuPy is an optional extra and is imported only when a kernel is first needed, so importing this module on a
machine without CuPy or without a GPU works; calling an op there raises CudaOpsUnavailable naming the
package that would fix it.
"""

from __future__ import annotations

import functools
import importlib.metadata
import math
import os
import re
import weakref
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from pagedserve.kernels.ops import check_attention, check_copy_blocks, check_write_kv, int32
from pagedserve.kernels.quant import SCALE_F32, QuantizedWeight, scale_kind
from pagedserve.kernels.reference import ReferenceOps

__all__ = [
    "CudaOps",
    "CudaOpsUnavailable",
    "CupyLauncher",
    "DevicePointers",
    "KernelLauncher",
    "is_available",
    "unsupported_reason",
]

KERNEL_DIR = Path(__file__).resolve().parent
CU_FILES = ("cache_ops.cu", "decode_attention.cu", "prefill_attention.cu", "quant_gemm.cu")

# What the templates are instantiated for. The loader refuses anything else with a clear error.
DTYPE_TAGS: dict[torch.dtype, str] = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
HEAD_SIZES = (64, 80, 96, 128, 256)
BLOCK_SIZES = (8, 16, 32)
# Query heads handled by one decode CTA (template GMAX); larger GQA groups are split over several CTAs.
GROUP_TILES = (1, 2, 4, 8)
COPY_UNITS = {16: "uint4", 8: "uint2", 4: "unsigned int", 2: "unsigned short", 1: "unsigned char"}

# Mirrors of the kernels' compile-time constants.
DECODE_THREADS = 128
PREFILL_THREADS = 128
PREFILL_ROWS = 16
PREFILL_BK = 32
MIN_SPLIT_TOKENS = 512  # a split-K partition shorter than this costs more in merging than it gains
MAX_SPLITS = 64
# The quantized linear (quant_gemm.cu): m16 tiles of rows per CTA (template MT; more rows than the largest
# takes use several CTAs along grid z), the most rows it takes (decode batches up to the largest CUDA graph;
# more go to the dequantized weight and cuBLAS, whose traffic no longer outweighs the codes' rereads), and
# its constants.
QUANT_ROW_TILES = (1, 2, 4)
QUANT_MAX_ROWS = 256
QUANT_THREADS = 128
QUANT_CTA_COLUMNS = 64  # PS_QG_NCTA
QUANT_KSTAGE = 256  # PS_QG_KSTAGE
QUANT_GROUP_SLOTS = QUANT_KSTAGE // 16 + 1  # PS_QG_GSLOTS
QUANT_CHUNK = {4: 64, 8: 32}  # k of one lane's 16-byte load (qg_chunk)
QUANT_SCALE_TAGS = {torch.float32: "float", torch.float16: "unsigned short"}
# A prefill's dequantized weight is made this many bytes at a time (whole weights where they fit).
QUANT_DEQUANT_BYTES = 256 * 1024 * 1024

# NOTE: no --use_fast_math (its __expf costs accuracy against the float32 reference, and the kernels are
# memory-bound anyway). CuPy appends -ftz=true to every NVRTC compile, after these options, so subnormal
# float32 values flush to zero whatever is asked here: harmless for attention, whose subnormal terms are
# below float32's resolution of the sums they join (the tests compare against a float64 oracle).
NVRTC_OPTIONS = ("-std=c++17",)
# Shared memory a kernel may use without opting in (cudaFuncAttributeMaxDynamicSharedMemorySize).
DEFAULT_SHARED_MEMORY = 48 * 1024


class CudaOpsUnavailable(RuntimeError):
    """CUDA kernels cannot run here (no CuPy, a CuPy for the wrong CUDA, or no device)."""


# ---- CuPy, loaded lazily --------------------------------------------------------------------------------


def _wanted_cupy_package() -> str:
    major = (torch.version.cuda or "12").split(".")[0]
    return f"cupy-cuda{major}x"


def _installed_cupy_packages() -> list[str]:
    found = []
    for name in ("cupy-cuda12x", "cupy-cuda13x", "cupy-cuda11x", "cupy"):
        try:
            importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        found.append(name)
    return found


@functools.cache
def _cupy() -> Any:
    wanted = _wanted_cupy_package()
    extra = "cuda" + wanted.removeprefix("cupy-cuda").removesuffix("x")
    hint = f"install {wanted} (pip install '{wanted}' or pip install 'pagedserve[{extra}]')"
    if not torch.cuda.is_available():
        raise CudaOpsUnavailable("pagedserve CUDA kernels need a CUDA device; torch sees none")
    try:
        import cupy
    except ImportError as e:
        raise CudaOpsUnavailable(
            f"pagedserve CUDA kernels need CuPy built for CUDA {torch.version.cuda}: {hint} ({e})"
        ) from e
    try:
        runtime_major = cupy.cuda.runtime.runtimeGetVersion() // 1000
    except Exception as e:  # a CuPy wheel whose CUDA libraries are missing fails here
        raise CudaOpsUnavailable(
            f"CuPy is installed ({', '.join(_installed_cupy_packages()) or 'unknown package'}) but cannot load "
            f"its CUDA runtime: {e}. torch uses CUDA {torch.version.cuda}: {hint}"
        ) from e
    torch_major = int((torch.version.cuda or "0").split(".")[0])
    if runtime_major != torch_major:
        raise CudaOpsUnavailable(
            f"CuPy is built for CUDA {runtime_major} ({', '.join(_installed_cupy_packages())}) but torch "
            f"uses CUDA {torch.version.cuda}: uninstall it and {hint}"
        )
    return cupy


def is_available() -> bool:
    """True when the CUDA kernels can run (a device, and a CuPy matching torch's CUDA)."""
    try:
        _cupy()
    except CudaOpsUnavailable:
        return False
    return True


# ---- sources and instantiations -------------------------------------------------------------------------

_INCLUDE = re.compile(r'^#include "([^"]+)"\s*$', re.MULTILINE)


@functools.cache
def kernel_source(file: str) -> str:
    """The source of kernels/<file> with its local #include lines inlined (NVRTC gets a single string, and
    CuPy's disk cache keys on that string, so an edited header must change it)."""
    text = (KERNEL_DIR / file).read_text()
    seen: set[str] = set()

    def inline(match: re.Match[str]) -> str:
        name = match.group(1)
        if name in seen:
            return ""
        seen.add(name)
        header = (KERNEL_DIR / name).read_text().replace("#pragma once\n", "")
        return _INCLUDE.sub(inline, header)

    return _INCLUDE.sub(inline, text)


def group_tile(group: int) -> int:
    """Query heads per decode CTA for a GQA group of `group` heads (GMAX template argument)."""
    return min(1 << max(0, group - 1).bit_length(), GROUP_TILES[-1])


@dataclass(frozen=True, slots=True)
class Entry:
    """One extern "C" kernel: the file defining its template and the macro line that instantiates it."""

    file: str  # kernels/<file>
    name: str  # extern "C" symbol
    line: str  # e.g. PS_DECODE_KERNEL(paged_decode_bf16_d128_b16_g4, bf16, 128, 16, 4)


def write_kv_entry(unit: int) -> Entry:
    name = f"write_kv_u{unit}"
    return Entry("cache_ops.cu", name, f"PS_WRITE_KV_KERNEL({name}, {COPY_UNITS[unit]})")


def copy_blocks_entry(unit: int) -> Entry:
    name = f"copy_blocks_u{unit}"
    return Entry("cache_ops.cu", name, f"PS_COPY_BLOCKS_KERNEL({name}, {COPY_UNITS[unit]})")


def decode_entry(tag: str, head_size: int, block_size: int, gmax: int) -> Entry:
    name = f"paged_decode_{tag}_d{head_size}_b{block_size}_g{gmax}"
    return Entry(
        "decode_attention.cu", name, f"PS_DECODE_KERNEL({name}, {tag}, {head_size}, {block_size}, {gmax})"
    )


def merge_entry(tag: str) -> Entry:
    name = f"merge_splits_{tag}"
    return Entry("decode_attention.cu", name, f"PS_MERGE_KERNEL({name}, {tag})")


def prefill_entry(tag: str, head_size: int, block_size: int) -> Entry:
    name = f"paged_prefill_{tag}_d{head_size}_b{block_size}"
    return Entry("prefill_attention.cu", name, f"PS_PREFILL_KERNEL({name}, {tag}, {head_size}, {block_size})")


def quant_gemm_entry(tag: str, bits: int, scale: torch.dtype, has_offset: bool, row_tiles: int) -> Entry:
    s = "s16" if scale == torch.float16 else "s32"
    name = f"quant_gemm_{tag}_i{bits}_{s}_o{int(has_offset)}_m{row_tiles}"
    return Entry(
        "quant_gemm.cu",
        name,
        f"PS_QUANT_GEMM_KERNEL({name}, {tag}, {bits}, {QUANT_SCALE_TAGS[scale]}, "
        f"{str(has_offset).lower()}, {row_tiles})",
    )


def quant_reduce_entry(tag: str) -> Entry:
    name = f"quant_reduce_{tag}"
    return Entry("quant_gemm.cu", name, f"PS_QUANT_REDUCE_KERNEL({name}, {tag})")


def quant_dequant_entry(tag: str, bits: int, scale: torch.dtype, has_offset: bool) -> Entry:
    s = "s16" if scale == torch.float16 else "s32"
    name = f"quant_dequant_{tag}_i{bits}_{s}_o{int(has_offset)}"
    return Entry(
        "quant_gemm.cu",
        name,
        f"PS_QUANT_DEQUANT_KERNEL({name}, {tag}, {bits}, {QUANT_SCALE_TAGS[scale]}, {str(has_offset).lower()})",
    )


def entries(file: str) -> list[Entry]:
    """Every instantiation the loader may ask for from `file` (CI compiles them all with nvcc)."""
    tags = list(DTYPE_TAGS.values())
    if file == "cache_ops.cu":
        return [f(u) for f in (write_kv_entry, copy_blocks_entry) for u in COPY_UNITS]
    if file == "decode_attention.cu":
        decode = [
            decode_entry(t, d, b, g)
            for t in tags
            for d in HEAD_SIZES
            for b in BLOCK_SIZES
            for g in GROUP_TILES
        ]
        return decode + [merge_entry(t) for t in tags]
    if file == "prefill_attention.cu":
        return [prefill_entry(t, d, b) for t in tags for d in HEAD_SIZES for b in BLOCK_SIZES]
    if file == "quant_gemm.cu":
        forms = [(b, s, o) for b in QUANT_CHUNK for s in QUANT_SCALE_TAGS for o in (False, True)]
        gemm = [
            quant_gemm_entry(t, b, s, o, m)
            for t in ("bf16", "fp16")
            for b, s, o in forms
            for m in QUANT_ROW_TILES
        ]
        return (
            gemm
            + [quant_reduce_entry(t) for t in ("bf16", "fp16")]
            + [quant_dequant_entry(t, b, s, o) for t in tags for b, s, o in forms]
        )
    raise ValueError(f"unknown kernel file {file}")


def entries_for(dtype: torch.dtype, head_size: int, block_size: int, group: int) -> list[Entry]:
    """The kernels one model configuration uses (to precompile them)."""
    tag = _tag(dtype)
    return [
        write_kv_entry(16),
        copy_blocks_entry(16),
        decode_entry(tag, head_size, block_size, group_tile(group)),
        merge_entry(tag),
        prefill_entry(tag, head_size, block_size),
    ]


def entry_source(entry: Entry) -> str:
    """The exact source NVRTC compiles for one kernel (one module per kernel, so a process compiles only
    what it launches, and CuPy's disk cache, keyed on the source, holds each kernel separately)."""
    return f"{kernel_source(entry.file)}\n{entry.line}\n"


@functools.cache
def _kernel(entry: Entry, device_index: int) -> Any:
    """Compiled kernel for a device (NVRTC once per machine: CuPy caches the binary on disk)."""
    cupy = _cupy()
    with cupy.cuda.Device(device_index):
        module = cupy.RawModule(code=entry_source(entry), options=NVRTC_OPTIONS)
        return module.get_function(entry.name)


def _compile_in_subprocess(batch: list[Entry]) -> int:
    for entry in batch:
        _kernel(entry, 0)
    return len(batch)


def precompile(items: list[Entry], workers: int | None = None) -> None:
    """Compiles many kernels in parallel processes (one NVRTC compile is single-threaded) to fill CuPy's disk
    cache; the calling process then loads them without compiling."""
    items = sorted(set(items), key=lambda e: e.name)
    if not items:
        return
    workers = max(1, min(workers or os.cpu_count() or 1, len(items)))
    batches = [items[i::workers] for i in range(workers)]
    import multiprocessing

    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        list(pool.map(_compile_in_subprocess, batches))


# ---- launch helpers -------------------------------------------------------------------------------------


def unsupported_reason(head_size: int, block_size: int, dtype: torch.dtype) -> str | None:
    """Why the kernels cannot serve a model of this head size, KV block size and dtype, or None: the worker
    asks at load, so that a shape they lack fails there rather than at the first request."""
    if dtype not in DTYPE_TAGS:
        return f"CUDA kernels support {[str(d) for d in DTYPE_TAGS]}, not {dtype}"
    if head_size not in HEAD_SIZES:
        return f"CUDA kernels support head sizes {HEAD_SIZES}, not {head_size}"
    if block_size not in BLOCK_SIZES:
        return f"CUDA kernels support block sizes {BLOCK_SIZES}, not {block_size}"
    return None


def _tag(dtype: torch.dtype) -> str:
    if dtype not in DTYPE_TAGS:
        raise NotImplementedError(f"CUDA kernels support {[str(d) for d in DTYPE_TAGS]}, not {dtype}")
    return DTYPE_TAGS[dtype]


def _check_cache(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[str, int, int]:
    """What the attention kernels need of a query's paged K/V cache (its shapes checked by
    ops.check_attention): the dtype tag, block size and KV head count, after checking they are ones the
    kernels were built for."""
    head_size = query.shape[2]
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    reason = unsupported_reason(head_size, block_size, k_cache.dtype)
    if reason is not None:
        raise NotImplementedError(reason)
    return DTYPE_TAGS[k_cache.dtype], block_size, num_kv_heads


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """Contiguous and 16-byte aligned (the kernels load 16-byte vectors)."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def _int64(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t.to(device=device, dtype=torch.int64).contiguous()


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


class _StreamHandle:
    """A raw cudaStream_t under the CUDA stream protocol (`__cuda_stream__`: version 0, the handle)."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.ptr)


def _external_stream(cupy: Any, ptr: int, index: int) -> Any:
    """torch's stream as a CuPy stream: through the stream protocol where CuPy has it (14 and newer, which
    deprecate ExternalStream), else as an ExternalStream."""
    if hasattr(cupy.cuda.Stream, "from_external"):
        return cupy.cuda.Stream.from_external(_StreamHandle(ptr))
    return cupy.cuda.ExternalStream(ptr, index)


@dataclass(frozen=True, slots=True)
class DevicePointers:
    """A kernel argument that is a device array of the tensors' data pointers (copy_blocks' caches)."""

    tensors: tuple[torch.Tensor, ...]


class KernelLauncher(Protocol):
    """Runs one kernel launch that CudaOps prepared. `args` are the kernel's parameters in order: tensors
    (passed as their data pointers), DevicePointers, and numpy scalars of the parameter's C type."""

    def prepare(self, device: torch.device) -> None:
        """Fails unless kernels can be launched on `device` (CudaOps' constructor calls it)."""
        ...

    def num_sms(self, device: torch.device) -> int:
        """Streaming multiprocessors of the device (the decode attention's split-K heuristic reads it)."""
        ...

    def launch(
        self,
        device: torch.device,
        entry: Entry,
        grid: tuple[int, ...],
        block: tuple[int, ...],
        args: tuple[Any, ...],
        shared_mem: int = 0,
    ) -> None: ...


class CupyLauncher:
    """Launches through CuPy on torch's current stream of the tensors' device."""

    def prepare(self, device: torch.device) -> None:
        _kernel(write_kv_entry(16), _device_index(device))

    def num_sms(self, device: torch.device) -> int:
        return _num_sms(_device_index(device))

    def launch(
        self,
        device: torch.device,
        entry: Entry,
        grid: tuple[int, ...],
        block: tuple[int, ...],
        args: tuple[Any, ...],
        shared_mem: int = 0,
    ) -> None:
        cupy = _cupy()
        index = _device_index(device)
        kernel = _kernel(entry, index)
        stream = torch.cuda.current_stream(index).cuda_stream
        # Pointer tables stay referenced until the launch is queued; the caching allocator orders their reuse
        # after it on this stream.
        tables = [_pointer_table(a, device) for a in args if isinstance(a, DevicePointers)]
        raw = _raw_args(args, iter(tables))
        with cupy.cuda.Device(index), _external_stream(cupy, stream, index):
            # The attribute is the function's on the device whose context is current: the worker's, here.
            # Set once per kernel and device, before any capture (the worker warms each graph's step up
            # eagerly first), so a captured launch makes no driver call but the launch itself.
            if shared_mem > DEFAULT_SHARED_MEMORY and _opted_in.get((entry, index), 0) < shared_mem:
                if kernel.max_dynamic_shared_size_bytes < shared_mem:
                    kernel.max_dynamic_shared_size_bytes = shared_mem
                _opted_in[(entry, index)] = shared_mem
            kernel(grid, block, raw, shared_mem=shared_mem)


# (kernel, device) -> the dynamic shared memory it has been allowed (above DEFAULT_SHARED_MEMORY).
_opted_in: dict[tuple[Entry, int], int] = {}


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _pointer_table(pointers: DevicePointers, device: torch.device) -> torch.Tensor:
    return torch.tensor([t.data_ptr() for t in pointers.tensors], dtype=torch.int64).to(device)


def _raw_args(args: tuple[Any, ...], tables: Any) -> tuple[Any, ...]:
    """Tensors as their data pointers, DevicePointers as their tables' (in order), scalars as they are."""
    raw = []
    for a in args:
        if isinstance(a, torch.Tensor):
            raw.append(np.uint64(a.data_ptr()))
        elif isinstance(a, DevicePointers):
            raw.append(np.uint64(next(tables).data_ptr()))
        else:
            raw.append(a)
    return tuple(raw)


def _copy_unit(*byte_quantities: int) -> int:
    for unit in COPY_UNITS:
        if all(q % unit == 0 for q in byte_quantities):
            return unit
    return 1


def _independent_waves(pairs: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """Splits copy pairs into consecutive groups in which no pair reads or writes another's destination, so
    each group may run in parallel and the whole behaves like copying in list order."""
    waves: list[list[tuple[int, int]]] = []
    reads: set[int] = set()
    writes: set[int] = set()
    for src, dst in pairs:
        if not waves or dst in reads or dst in writes or src in writes:
            waves.append([])
            reads, writes = set(), set()
        waves[-1].append((src, dst))
        reads.add(src)
        writes.add(dst)
    return waves


def choose_num_splits(num_ctas: int, max_blocks: int, block_size: int, num_sms: int) -> int:
    """Split-K heuristic for decode: split the context over several CTAs only when the (sequence, kv head)
    CTAs alone cannot keep every SM busy for several waves and the context is long enough that each split
    still streams >= MIN_SPLIT_TOKENS tokens (the merge then costs well under 1 % of the traffic)."""
    max_tokens = max_blocks * block_size
    target = 4 * num_sms  # ~2 resident CTAs per SM at this register budget, times a couple of waves
    if num_ctas >= target or max_tokens < 2 * MIN_SPLIT_TOKENS:
        return 1
    return max(1, min(math.ceil(target / num_ctas), max_tokens // MIN_SPLIT_TOKENS, MAX_SPLITS))


# The per-sequence tile offsets of a prefill batch depend only on query_start_loc and the GQA group. The
# worker passes the same metadata tensor to every layer of a step, so they are computed once per step (on the
# device, no host sync) and remembered for the tensor object that produced them (ops.py: attention metadata
# is not modified in place between the calls of a step).
_tile_cache: dict[tuple[int, int], tuple[weakref.ref, int | None, torch.Tensor]] = {}


def _version(t: torch.Tensor) -> int | None:
    """The tensor's version counter, or None for an inference tensor (made under torch.inference_mode(), as
    the worker makes its step's metadata), which keeps none: reading it raises."""
    return None if t.is_inference() else t._version


def _tile_offsets(query_start_loc: torch.Tensor, starts: torch.Tensor, group: int) -> torch.Tensor:
    """First tile of each sequence (prefix sum of ceil(q_len * G / ROWS)), int32 [S + 1] on the device.
    Cached for the caller's query_start_loc object (and version, where it keeps one)."""
    key = (id(query_start_loc), group)
    version = _version(query_start_loc)
    hit = _tile_cache.get(key)
    if hit is not None and hit[0]() is query_start_loc and hit[1] == version:
        return hit[2]
    q_lens = (starts[1:] - starts[:-1]).to(torch.int64)
    tiles = (q_lens * group + PREFILL_ROWS - 1) // PREFILL_ROWS
    offsets = torch.zeros(q_lens.numel() + 1, dtype=torch.int32, device=starts.device)
    offsets[1:] = torch.cumsum(tiles, 0).to(torch.int32)
    _tile_cache.clear()  # one live batch at a time
    _tile_cache[key] = (weakref.ref(query_start_loc), version, offsets)
    return offsets


def prefill_smem_bytes(head_size: int) -> int:
    return (PREFILL_ROWS * head_size + 2 * PREFILL_BK * (head_size + 1)) * 4


# ---- the quantized linear's weight layout ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CudaQuantWeight:
    """A QuantizedWeight laid out for quant_gemm.cu (pack_quant_weight_cuda; unpack_quant_weight_cuda reads it
    back). Codes: for each n16 block and each chunk of QUANT_CHUNK[bits] k, 32 lanes x 4 words, lane (g, t)
    holding the mma.m16n8k16 B fragments it multiplies: column g of both n8 tiles at k 2t, 2t + 1, 2t + 8,
    2t + 9 of each k16 step. int4, word j = k16 step j: nibble e at bits 4e is column 8 ((e >> 1) & 1) + g,
    k 2t + (e >> 2) + 8 (e & 1). int8 (stored as q + 128), word j = k16 step j >> 1 of n8 tile j & 1: byte e
    is k 2t + (e & 1) + 8 (e >> 1). Padding (columns to n_pad, k to k_pad) holds zeros."""

    codes: torch.Tensor  # int32 [n_pad / 16, k_pad / chunk, 32, 4]
    scales: torch.Tensor  # [groups, n_pad] float32, or fp16 where every scale (and offset) is fp16 exactly
    offsets: torch.Tensor | None  # [groups, n_pad] as scales, or None: all zero
    bits: int  # 4 or 8
    group_size: int  # k of a group
    n: int  # output features
    k: int  # input features

    @property
    def n_pad(self) -> int:
        return self.scales.shape[1]

    @property
    def k_pad(self) -> int:
        return self.codes.shape[1] * QUANT_CHUNK[self.bits]

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def nbytes(self) -> int:
        parts = [self.codes, self.scales] + ([] if self.offsets is None else [self.offsets])
        return sum(t.numel() * t.element_size() for t in parts)


def _code_positions(
    bits: int, device: torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For every code of one (n16 block, chunk) in the packed order [32 lanes, 4 words, codes of a word]: its
    column within the block, its k within the chunk, and its bit offset in the word."""
    lane = torch.arange(32, device=device).view(32, 1, 1)
    j = torch.arange(4, device=device).view(1, 4, 1)
    g, t = lane >> 2, lane & 3
    if bits == 4:
        e = torch.arange(8, device=device).view(1, 1, 8)
        n = 8 * ((e >> 1) & 1) + g
        k = 16 * j + 2 * t + (e >> 2) + 8 * (e & 1)
        shift = 4 * e
    else:
        e = torch.arange(4, device=device).view(1, 1, 4)
        n = 8 * (j & 1) + g
        k = 16 * (j >> 1) + 2 * t + (e & 1) + 8 * (e >> 1)
        shift = 8 * e
    shape = (32, 4, 8 if bits == 4 else 4)
    return n.expand(shape), k.expand(shape), shift.expand(shape)


def quant_kernel_reason(weight: QuantizedWeight | CudaQuantWeight) -> str | None:
    """Why quant_gemm.cu cannot take this weight (it then runs dequantized through cuBLAS), or None."""
    if weight.group_size % 16 != 0:
        return f"group size {weight.group_size} is not a multiple of 16"
    return None


def pack_quant_weight_cuda(q: QuantizedWeight, device: torch.device | None = None) -> CudaQuantWeight:
    """q laid out for quant_gemm.cu (see CudaQuantWeight), on `device` (default q's), where it is packed: a
    GPU packs a large model's weights in a fraction of the CPU's time."""
    q.check("pack_quant_weight_cuda")
    if device is not None:
        q = QuantizedWeight(
            q.codes.to(device),
            q.scales.to(device),
            None if q.offsets is None else q.offsets.to(device),
            q.bits,
            q.group_size,
        )
    n, k = q.shape
    chunk = QUANT_CHUNK[q.bits]
    n_pad = -(-n // QUANT_CTA_COLUMNS) * QUANT_CTA_COLUMNS
    k_pad = -(-k // 64) * 64
    codes = q.codes.to(torch.int64) if q.bits == 4 else q.codes.to(torch.int64) + 128
    codes = torch.nn.functional.pad(codes, (0, k_pad - k, 0, n_pad - n))
    cn, ck, shift = _code_positions(q.bits, codes.device)
    blocks = codes.view(n_pad // 16, 16, k_pad // chunk, chunk)  # [block, column, chunk, k]
    gathered = blocks[:, cn, :, ck]  # [lane, word, code, block, chunk]
    words = (gathered << shift.reshape(32, 4, -1, 1, 1)).sum(dim=2)  # [lane, word, block, chunk]
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    codes_packed = words.permute(2, 3, 0, 1).contiguous()
    kind = scale_kind(q)
    scale_dtype = torch.float32 if kind == SCALE_F32 else torch.float16

    def columns(t: torch.Tensor) -> torch.Tensor:  # [N, groups] -> [groups, n_pad]
        return torch.nn.functional.pad(t.T, (0, n_pad - n)).to(scale_dtype).contiguous()

    has_offset = q.offsets is not None and bool(q.offsets.any())
    return CudaQuantWeight(
        codes=codes_packed,
        scales=columns(q.scales),
        offsets=columns(q.offsets) if has_offset else None,
        bits=q.bits,
        group_size=q.group_size,
        n=n,
        k=k,
    )


def unpack_quant_weight_cuda(packed: CudaQuantWeight) -> QuantizedWeight:
    """The QuantizedWeight a CudaQuantWeight holds, read back from its layout in PyTorch (the inverse of
    pack_quant_weight_cuda; the tests' check of the layout, and the CUDA emulation's weight)."""
    bits, chunk = packed.bits, QUANT_CHUNK[packed.bits]
    cn, ck, shift = _code_positions(bits, packed.device)
    words = packed.codes.to(torch.int64) & 0xFFFFFFFF  # [block, chunk, lane, word]
    mask = 0xF if bits == 4 else 0xFF
    values = (words.unsqueeze(-1) >> shift) & mask  # [block, chunk, lane, word, code]
    blocks, chunks = words.shape[:2]
    codes = torch.zeros(blocks, 16, chunks, chunk, dtype=torch.int64, device=words.device)
    codes[:, cn, :, ck] = values.permute(2, 3, 4, 0, 1)
    codes = codes.view(blocks * 16, chunks * chunk)[: packed.n, : packed.k]
    codes = codes.to(torch.uint8) if bits == 4 else (codes - 128).to(torch.int8)

    def rows(t: torch.Tensor) -> torch.Tensor:
        return t[:, : packed.n].T.to(torch.float32).contiguous()

    return QuantizedWeight(
        codes=codes.contiguous(),
        scales=rows(packed.scales),
        offsets=None if packed.offsets is None else rows(packed.offsets),
        bits=bits,
        group_size=packed.group_size,
    )


def quant_smem_bytes(row_tiles: int, scale_dtype: torch.dtype) -> int:
    """Dynamic shared memory of a quant_gemm CTA (qg_smem::BYTES)."""
    x_bytes = 16 * row_tiles * (QUANT_KSTAGE + 8) * 2
    s_bytes = QUANT_GROUP_SLOTS * QUANT_CTA_COLUMNS * torch.finfo(scale_dtype).bits // 8
    return 2 * (x_bytes + 2 * s_bytes)


def choose_quant_splits(
    n_ctas: int, phases: int, rows: int, n_pad: int, weight_bytes: int, num_sms: int
) -> int:
    """Split-K count of the quantized GEMM: enough CTAs for about four per SM (a single row's decode of a
    4096-wide layer has only 64 column tiles), no more than the phases of K, and float32 partial sums
    (written and read back) of no more bytes than the weight itself."""
    want = max(1, math.ceil(4 * num_sms / n_ctas))
    by_traffic = max(1, weight_bytes // (rows * n_pad * 8))
    return max(1, min(want, phases, by_traffic))


class CudaQuantLinear:
    """The quantized linear (kernels.ops.QuantLinearKernels) on CUDA: up to QUANT_MAX_ROWS rows of bf16 or fp16
    x through quant_gemm.cu's tensor-core GEMM (64 rows a CTA); more rows (prefill), float32 x, or a group
    size the GEMM does not take, through the weight dequantized to x's dtype by quant_gemm.cu and PyTorch's
    matmul (cuBLAS), QUANT_DEQUANT_BYTES of it at a time."""

    dtypes = frozenset((torch.bfloat16, torch.float16, torch.float32))

    def __init__(self, launcher: KernelLauncher) -> None:
        self.launcher = launcher

    def pack_quant_weight(self, weight: QuantizedWeight, device: torch.device) -> CudaQuantWeight:
        return pack_quant_weight_cuda(weight, device)

    def linear_quant(
        self, x: torch.Tensor, packed: CudaQuantWeight, bias: torch.Tensor | None
    ) -> torch.Tensor:
        assert x.shape[-1] == packed.k, (x.shape, packed.k)
        assert x.dtype in self.dtypes, x.dtype
        lead = x.shape[:-1]
        x2 = x.reshape(-1, packed.k)
        rows = x2.shape[0]
        if rows == 0:
            return x.new_empty(*lead, packed.n)
        if rows <= QUANT_MAX_ROWS and x.dtype != torch.float32 and quant_kernel_reason(packed) is None:
            out = self.gemm(x2, packed, bias, None)
        else:
            out = self.dequantized_matmul(x2, packed, bias)
        return out.view(*lead, packed.n)

    def gemm(
        self, x: torch.Tensor, packed: CudaQuantWeight, bias: torch.Tensor | None, num_splits: int | None
    ) -> torch.Tensor:
        """x [M <= QUANT_MAX_ROWS, K] (bf16 or fp16) times the packed weight on tensor cores, plus bias; an
        explicit split-K count (None: choose_quant_splits) for the tests and the benchmark."""
        rows = x.shape[0]
        assert 0 < rows <= QUANT_MAX_ROWS and x.dtype in (torch.bfloat16, torch.float16), (x.shape, x.dtype)
        device = packed.device
        tag = DTYPE_TAGS[x.dtype]
        x = _aligned(x)
        row_tiles = next((m for m in QUANT_ROW_TILES if rows <= 16 * m), QUANT_ROW_TILES[-1])
        row_ctas = math.ceil(rows / (16 * row_tiles))
        n_ctas = packed.n_pad // QUANT_CTA_COLUMNS
        phases = math.ceil(packed.k_pad / QUANT_KSTAGE)
        if num_splits is None:
            num_splits = choose_quant_splits(
                n_ctas * row_ctas, phases, rows, packed.n_pad, packed.nbytes(), self.launcher.num_sms(device)
            )
        per_split = math.ceil(phases / max(1, min(num_splits, phases)))
        num_splits = math.ceil(phases / per_split)  # every split non-empty
        out = torch.empty(rows, packed.n, device=device, dtype=x.dtype)
        partial = (
            torch.empty(num_splits, rows, packed.n_pad, device=device, dtype=torch.float32)
            if num_splits > 1
            else out
        )
        bias_arg = np.uint64(0) if bias is None else bias.to(x.dtype).contiguous()
        has_offset = packed.offsets is not None
        args = (
            out,
            partial,
            x,
            packed.codes,
            packed.scales,
            packed.offsets if has_offset else packed.scales,
            bias_arg,
            np.int32(rows),
            np.int32(packed.n),
            np.int32(packed.k),
            np.int32(packed.n_pad),
            np.int32(packed.k_pad),
            np.int32(packed.group_size),
            np.int32(per_split),
        )
        entry = quant_gemm_entry(tag, packed.bits, packed.scales.dtype, has_offset, row_tiles)
        smem = quant_smem_bytes(row_tiles, packed.scales.dtype)
        grid = (n_ctas, num_splits, row_ctas)
        self.launcher.launch(device, entry, grid, (QUANT_THREADS,), args, shared_mem=smem)
        if num_splits > 1:
            reduce_args = (
                out,
                partial,
                bias_arg,
                np.int32(rows),
                np.int32(packed.n),
                np.int32(packed.n_pad),
                np.int32(num_splits),
            )
            grid = (math.ceil(rows * packed.n / 256),)
            self.launcher.launch(device, quant_reduce_entry(tag), grid, (256,), reduce_args)
        return out

    def dequantize(
        self, packed: CudaQuantWeight, dtype: torch.dtype, n_begin: int = 0, rows: int | None = None
    ) -> torch.Tensor:
        """Rows [n_begin, n_begin + rows) of the weight, scale * code + offset rounded once to dtype: [rows, K]
        (the bits of kernels.quant.dequantize(q).to(dtype)). n_begin is a multiple of 16."""
        rows = packed.n - n_begin if rows is None else rows
        assert n_begin % 16 == 0 and rows > 0 and n_begin + rows <= packed.n, (n_begin, rows, packed.n)
        device = packed.device
        out = torch.empty(rows, packed.k, device=device, dtype=dtype)
        has_offset = packed.offsets is not None
        words = math.ceil(rows / 16) * (packed.k_pad // QUANT_CHUNK[packed.bits]) * 32 * 4
        args = (
            out,
            packed.codes,
            packed.scales,
            packed.offsets if has_offset else packed.scales,
            np.int32(packed.k),
            np.int32(packed.n_pad),
            np.int32(packed.k_pad),
            np.int32(packed.group_size),
            np.int32(n_begin),
            np.int32(rows),
        )
        entry = quant_dequant_entry(_tag(dtype), packed.bits, packed.scales.dtype, has_offset)
        self.launcher.launch(device, entry, (math.ceil(words / 256),), (256,), args)
        return out

    def dequantized_matmul(
        self, x: torch.Tensor, packed: CudaQuantWeight, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """x [M, K] times the weight dequantized to x's dtype, QUANT_DEQUANT_BYTES of rows at a time."""
        step = max(16, QUANT_DEQUANT_BYTES // (packed.k * x.element_size()) // 16 * 16)
        if step >= packed.n:
            return torch.nn.functional.linear(x, self.dequantize(packed, x.dtype), bias)
        out = torch.empty(x.shape[0], packed.n, device=x.device, dtype=x.dtype)
        for begin in range(0, packed.n, step):
            end = min(packed.n, begin + step)
            w = self.dequantize(packed, x.dtype, begin, end - begin)
            out[:, begin:end] = x @ w.T
        if bias is not None:
            out += bias.to(out.dtype)
        return out


# ---- the ops ---------------------------------------------------------------------------------------------


class CudaOps(ReferenceOps):
    """kernels.ops.Ops on CUDA: write_kv, copy_blocks and both attentions are the kernels here, launched on
    torch's current stream; the rest is the reference's PyTorch on the GPU (rotary_write_kv_ rotates with
    PyTorch ops, then writes with the write_kv kernel)."""

    name = "cuda"

    def __init__(self, device: torch.device, launcher: KernelLauncher | None = None) -> None:
        """Fails (CudaOpsUnavailable, or NVRTC's error) unless the launcher can run kernels on `device`
        (CuPy's: it loads and compiles one); kernels.get_ops then takes the reference."""
        self.launcher = launcher or CupyLauncher()
        self.launcher.prepare(device)
        self.quant_linear = CudaQuantLinear(self.launcher)

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        check_write_kv(key, value, k_cache, v_cache, slot_mapping)
        assert k_cache.is_contiguous() and v_cache.is_contiguous()
        num_tokens, num_kv_heads, head_size = key.shape
        if num_tokens == 0:
            return
        device = k_cache.device
        # The kernel copies whole token rows, so a row must be contiguous; a token stride may be anything (a
        # slice of a fused qkv projection is passed without a copy).
        key = key.to(k_cache.dtype)
        value = value.to(v_cache.dtype)
        if key.stride(2) != 1 or key.stride(1) != head_size:
            key = key.contiguous()
        if value.stride(2) != 1 or value.stride(1) != head_size:
            value = value.contiguous()
        slots = _int64(slot_mapping, device)
        elsize = k_cache.element_size()
        row_bytes = num_kv_heads * head_size * elsize
        unit = _copy_unit(
            row_bytes,
            key.stride(0) * elsize,
            value.stride(0) * elsize,
            key.data_ptr(),
            value.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
        )
        args = (
            key,
            value,
            k_cache,
            v_cache,
            slots,
            np.int64(row_bytes // unit),
            np.int64(key.stride(0) * elsize // unit),
            np.int64(value.stride(0) * elsize // unit),
        )
        self.launcher.launch(device, write_kv_entry(unit), (num_tokens,), (128,), args)

    def copy_blocks(
        self, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], src: torch.Tensor, dst: torch.Tensor
    ) -> None:
        check_copy_blocks(k_caches, v_caches, src, dst)
        if src.numel() == 0 or not k_caches:
            return
        caches = [*k_caches, *v_caches]
        first = caches[0]
        device = first.device
        assert all(c.shape == first.shape and c.dtype == first.dtype and c.is_contiguous() for c in caches)
        block_bytes = first[0].numel() * first.element_size()
        unit = _copy_unit(block_bytes, *(c.data_ptr() for c in caches))
        pointers = DevicePointers(tuple(caches))
        # The pair list is small (copy-on-write of a few blocks); reading it on the host costs one sync at
        # most.
        pairs = list(zip(src.tolist(), dst.tolist(), strict=True))
        for wave in _independent_waves(pairs):
            wave_src = torch.tensor([s for s, _ in wave], dtype=torch.int64).to(device)
            wave_dst = torch.tensor([d for _, d in wave], dtype=torch.int64).to(device)
            args = (pointers, wave_src, wave_dst, np.int64(block_bytes // unit))
            self.launcher.launch(device, copy_blocks_entry(unit), (len(wave), len(caches)), (256,), args)

    def paged_decode_attention(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        return self.paged_decode_attention_splits(
            query, k_cache, v_cache, block_tables, context_lens, scale, None
        )

    def paged_decode_attention_splits(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        scale: float,
        num_splits: int | None,
    ) -> torch.Tensor:
        """paged_decode_attention with an explicit split-K count (None: the heuristic). Tests and the
        benchmark force both paths through this."""
        check_attention(query, k_cache, v_cache, block_tables, context_lens)
        batch, num_q_heads, head_size = query.shape
        tag, block_size, num_kv_heads = _check_cache(query, k_cache, v_cache)
        device = k_cache.device
        if batch == 0:
            return torch.empty_like(query)
        out_dtype = query.dtype
        query = _aligned(query.to(k_cache.dtype))
        tables = int32(block_tables, device)
        lens = int32(context_lens, device)
        max_blocks = tables.shape[1]

        group = num_q_heads // num_kv_heads
        gmax = group_tile(group)
        n_sub = math.ceil(group / gmax)
        num_ctas = batch * num_kv_heads * n_sub
        if num_splits is None and self.batch_invariant:
            # Splits of a fixed size from position 0, whatever the batch (the heuristic's count follows the
            # batch and the block tables' width); always merged, so that a short context's bits are the
            # same whether the batch beside it is split or not (an empty split weighs nothing).
            blocks_per_split = max(1, MIN_SPLIT_TOKENS // block_size)
            num_splits = max(2, math.ceil(max_blocks / blocks_per_split))
        else:
            if num_splits is None:
                num_splits = choose_num_splits(
                    num_ctas, max_blocks, block_size, self.launcher.num_sms(device)
                )
            num_splits = max(1, min(num_splits, max_blocks))
            blocks_per_split = math.ceil(max_blocks / num_splits)
            num_splits = math.ceil(max_blocks / blocks_per_split)

        out = torch.empty_like(query)
        if num_splits > 1:
            part_out = torch.empty(
                batch, num_q_heads, num_splits, head_size, device=device, dtype=torch.float32
            )
            part_lse = torch.empty(batch, num_q_heads, num_splits, device=device, dtype=torch.float32)
        else:
            part_out = part_lse = out  # unused by the kernel
        args = (
            out,
            part_out,
            part_lse,
            query,
            k_cache,
            v_cache,
            tables,
            lens,
            np.float32(scale),
            np.int32(num_q_heads),
            np.int32(num_kv_heads),
            np.int32(max_blocks),
            np.int32(blocks_per_split),
        )
        grid = (num_kv_heads * n_sub, batch, num_splits)
        entry = decode_entry(tag, head_size, block_size, gmax)
        self.launcher.launch(device, entry, grid, (DECODE_THREADS,), args)
        if num_splits > 1:
            merge_args = (out, part_out, part_lse, np.int32(num_splits), np.int32(head_size))
            self.launcher.launch(device, merge_entry(tag), (batch * num_q_heads,), (128,), merge_args)
        return out.to(out_dtype)

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
        num_tokens, num_q_heads, head_size = query.shape
        tag, block_size, num_kv_heads = _check_cache(query, k_cache, v_cache)
        device = k_cache.device
        out_dtype = query.dtype
        query = _aligned(query.to(k_cache.dtype))
        out = torch.empty_like(query)
        num_seqs = context_lens.shape[0]
        if num_tokens == 0 or num_seqs == 0:
            return out
        tables = int32(block_tables, device)
        starts = int32(query_start_loc, device)
        lens = int32(context_lens, device)
        group = num_q_heads // num_kv_heads
        offsets = _tile_offsets(query_start_loc, starts, group)
        # Upper bound on the tiles (sum of ceil(q_len * G / ROWS)); CTAs past the last real tile exit at
        # once.
        grid = (math.ceil(num_tokens * group / PREFILL_ROWS) + num_seqs, num_kv_heads)
        args = (
            out,
            query,
            k_cache,
            v_cache,
            tables,
            starts,
            lens,
            offsets,
            np.int32(num_seqs),
            np.float32(scale),
            np.int32(num_q_heads),
            np.int32(num_kv_heads),
            np.int32(tables.shape[1]),
        )
        entry = prefill_entry(tag, head_size, block_size)
        smem = prefill_smem_bytes(head_size)
        self.launcher.launch(device, entry, grid, (PREFILL_THREADS,), args, shared_mem=smem)
        return out.to(out_dtype)
