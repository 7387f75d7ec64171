"""Paged KV cache ops: CUDA kernels loaded through CuPy on a CUDA device, the PyTorch reference elsewhere.

`get_ops(device)` returns a module with write_kv, paged_decode_attention, paged_prefill_attention and
copy_blocks (signatures in kernels/reference.py). Importing this package imports neither torch nor CuPy;
that happens on the first get_ops call.

The CUDA module `pagedserve.kernels.cuda_ops` is used when torch sees a CUDA device, the module imports
and, if it defines `init(device)` (where it imports CuPy and compiles its kernels), that call succeeds; any failure (no CuPy, no nvrtc, a compile error) is logged once and
the reference is used instead.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["get_ops"]


def get_ops(device: torch.device) -> ModuleType:
    if device.type == "cuda":
        cuda_ops = _load_cuda_ops(device.index)
        if cuda_ops is not None:
            return cuda_ops
    from pagedserve.kernels import reference

    return reference


@functools.cache
def _load_cuda_ops(device_index: int | None) -> ModuleType | None:
    import torch

    from pagedserve.logging import get_logger

    try:
        if not torch.cuda.is_available():
            raise RuntimeError("torch sees no CUDA device")
        from pagedserve.kernels import cuda_ops

        init = getattr(cuda_ops, "init", None)
        if init is not None:
            init(torch.device("cuda", device_index))
    except Exception as exc:  # ImportError for a missing CuPy, CuPy/NVRTC errors when compiling
        get_logger(__name__).warning("cuda_kernels_unavailable", error=repr(exc), fallback="reference")
        return None
    return cuda_ops
