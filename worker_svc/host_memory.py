"""Host memory for the worker's large, long-lived CPU tensors: the KV cache and the packed weights.

Every decode step reads both in full, the weights as long streams and the KV cache as 6 KB blocks that
lie anywhere in the pool. With 4 KB pages the TLB covers a few megabytes of that, so most blocks start
with a page walk that the prefetches cannot hide. Backed by transparent huge pages (2 MB) the same TLB
covers gigabytes, and decode steps are shorter (docs/performance.md, "Measurements behind the code").

Only these tensors get huge pages. Setting torch's THP_MEM_ALLOC_ENABLE=1 instead gives them to every
large allocation, the activations too, and made prompt steps slower: their buffers are freed and
allocated again every layer, and each new huge page is zeroed on first touch.

Linux with transparent huge pages in "always" or "madvise" mode; elsewhere plain torch.zeros.
"""

from __future__ import annotations

import math
import mmap
import sys
from pathlib import Path

import torch

__all__ = ["HUGE_PAGE", "Arena", "huge_pages_available", "in_huge_pages", "zeros"]

HUGE_PAGE = 2 << 20
_THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_pages_available() -> bool:
    """Whether this kernel gives transparent huge pages to a region that asks for them (madvise)."""
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        mode = _THP_MODE.read_text()
    except OSError:
        return False
    return "[always]" in mode or "[madvise]" in mode


def _mapped(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
    """A tensor in an anonymous mapping of its own, 2 MB aligned and advised MADV_HUGEPAGE, its pages not
    yet touched (they read as zeros); None where huge pages are unavailable or the tensor is under one.
    The tensor keeps the mapping alive, and the kernel unmaps it when the tensor is freed."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes < HUGE_PAGE or not huge_pages_available():
        return None
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)
    raw = torch.frombuffer(region, dtype=torch.uint8)  # holds a reference to the mapping
    start = -raw.data_ptr() % HUGE_PAGE
    return raw[start : start + nbytes].view(dtype).view(shape)


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """torch.zeros(shape, dtype=dtype) on the CPU, backed by transparent huge pages where available. The
    pages are touched here, so the memory is committed now, as torch.zeros would, and not in the middle
    of a step."""
    tensor = _mapped(shape, dtype)
    return torch.zeros(shape, dtype=dtype) if tensor is None else tensor.zero_()


def in_huge_pages(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor moved into huge pages (the copy touches every page); the tensor itself
    where huge pages are unavailable or it is under one."""
    assert tensor.is_contiguous() and tensor.device.type == "cpu"
    mapped = _mapped(tuple(tensor.shape), tensor.dtype)
    return tensor if mapped is None else mapped.copy_(tensor)


class Arena:
    """Copies of contiguous CPU tensors placed one after another in huge-page mappings of `chunk_bytes`
    each (a tensor larger than that gets a mapping of its own), each at a 4 KB boundary: the model's
    packed weights, most of them under a huge page alone (SmolLM2-135M's qkv, o and down: 106 of its
    269 MB), in huge pages all the same (decode steps 0.98-1.0x as long as with a mapping each, see
    docs/performance.md). Where huge pages are unavailable, copy returns the tensor itself.
    A mapping lives as long as any tensor placed in it."""

    ALIGN = 4096

    def __init__(self, chunk_bytes: int = 64 * HUGE_PAGE) -> None:
        assert chunk_bytes % HUGE_PAGE == 0
        self.chunk_bytes = chunk_bytes
        self._chunk: torch.Tensor | None = None  # uint8 [chunk_bytes], the mapping being filled
        self._used = 0

    def copy(self, tensor: torch.Tensor) -> torch.Tensor:
        assert tensor.is_contiguous() and tensor.device.type == "cpu"
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes > self.chunk_bytes:
            return in_huge_pages(tensor)
        if self._chunk is None or self._used + nbytes > self.chunk_bytes:
            self._chunk = _mapped((self.chunk_bytes,), torch.uint8)
            self._used = 0
            if self._chunk is None:
                return tensor
        placed = self._chunk[self._used : self._used + nbytes].view(tensor.dtype).view(tensor.shape)
        self._used += -(-nbytes // self.ALIGN) * self.ALIGN
        return placed.copy_(tensor)
