"""Paged KV cache ops and the decoder's fused small ops: CUDA kernels loaded through CuPy on a CUDA
device, C++ kernels built for this machine on CPU, the PyTorch reference where neither loads.

`get_ops(device)` returns a module with write_kv, paged_decode_attention, paged_prefill_attention,
copy_blocks, rms_norm, add_rms_norm_, rotary_write_kv_ and silu_mul (signatures in kernels/reference.py).
Importing this package imports neither torch nor CuPy; that happens on the first get_ops call.

On CPU, `pagedserve.kernels.cpu_ops` is used unless PAGEDSERVE_CPU_KERNELS=off; a failed build (no
compiler) is logged once and the reference is used instead.

The CUDA module `pagedserve.kernels.cuda_ops` is used when torch sees a CUDA device, the module imports
and, if it defines `init(device)` (where it imports CuPy and compiles its kernels), that call succeeds; any failure (no CuPy, no nvrtc, a compile error) is logged once and
the reference is used instead.
"""

from __future__ import annotations

import functools
import os
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["get_ops"]

CPU_KERNELS_ENV = "PAGEDSERVE_CPU_KERNELS"  # "off": the PyTorch reference on CPU


def get_ops(device: torch.device) -> ModuleType:
    if device.type == "cuda":
        cuda_ops = _load_cuda_ops(device.index)
        if cuda_ops is not None:
            return cuda_ops
    if device.type == "cpu" and os.environ.get(CPU_KERNELS_ENV, "on").lower() not in ("off", "0", "false"):
        cpu_ops = _load_cpu_ops()
        if cpu_ops is not None:
            return cpu_ops
    from pagedserve.kernels import reference

    return reference


@functools.cache
def _load_cpu_ops() -> ModuleType | None:
    from pagedserve.logging import get_logger

    try:
        from pagedserve.kernels import cpu_ops

        cpu_ops.load()
    except Exception as exc:  # no C++ compiler or ninja, a build error
        get_logger(__name__).warning("cpu_kernels_unavailable", error=repr(exc), fallback="reference")
        return None
    return cpu_ops


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
