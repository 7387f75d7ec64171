"""Paged KV cache ops and the decoder's fused small ops, behind one contract (kernels/ops.py, `Ops`): CUDA
kernels loaded through CuPy on a CUDA device (cuda_ops.CudaOps), C++ kernels built for this machine on CPU
(cpu_ops.CpuOps), the PyTorch reference where neither loads (reference.ReferenceOps).

`get_ops(device)` returns the device's backend, one object per device. Importing this package imports
neither torch nor CuPy; that happens on the first get_ops call.

On CPU the C++ kernels are used unless PAGEDSERVE_CPU_KERNELS=off; a failed build (no compiler) is logged
once and the reference is used instead. On CUDA the kernels are used when torch sees the device and CudaOps
can compile and load a kernel there; any failure (no CuPy, no nvrtc, a compile error) is logged once and the
reference is used instead.
"""

from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from pagedserve.kernels.ops import Ops

__all__ = ["get_ops"]

CPU_KERNELS_ENV = "PAGEDSERVE_CPU_KERNELS"  # "off": the PyTorch reference on CPU


def get_ops(device: torch.device) -> Ops:
    if device.type == "cuda":
        cuda_ops = _load_cuda_ops(device.index)
        if cuda_ops is not None:
            return cuda_ops
    if device.type == "cpu" and os.environ.get(CPU_KERNELS_ENV, "on").lower() not in ("off", "0", "false"):
        cpu_ops = _load_cpu_ops()
        if cpu_ops is not None:
            return cpu_ops
    return _reference_ops()


@functools.cache
def _reference_ops() -> Ops:
    from pagedserve.kernels.reference import ReferenceOps

    return ReferenceOps()


@functools.cache
def _load_cpu_ops() -> Ops | None:
    from pagedserve.logging import get_logger

    try:
        from pagedserve.kernels.cpu_ops import CpuOps

        return CpuOps()
    except Exception as exc:  # no C++ compiler or ninja, a build error
        get_logger(__name__).warning("cpu_kernels_unavailable", error=repr(exc), fallback="reference")
        return None


@functools.cache
def _load_cuda_ops(device_index: int | None) -> Ops | None:
    import torch

    from pagedserve.logging import get_logger

    try:
        if not torch.cuda.is_available():
            raise RuntimeError("torch sees no CUDA device")
        from pagedserve.kernels.cuda_ops import CudaOps

        return CudaOps(torch.device("cuda", device_index))
    except Exception as exc:  # ImportError for a missing CuPy, CuPy/NVRTC errors when compiling
        get_logger(__name__).warning("cuda_kernels_unavailable", error=repr(exc), fallback="reference")
        return None
