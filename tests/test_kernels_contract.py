"""Every kernel backend implements the one contract of kernels/ops.py: the same ops with the same
signatures, and the optional capabilities as attributes that are None or satisfy their own protocols.

The CUDA backend's signatures are checked from its class, without a GPU or CuPy.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from pagedserve.kernels import get_ops
from pagedserve.kernels.cpu_ops import CpuOps
from pagedserve.kernels.cuda_ops import CudaOps
from pagedserve.kernels.ops import (
    DecoderStack,
    DecoderStackFactory,
    LinearKernels,
    Ops,
    QuantLinearKernels,
    linear_for,
)
from pagedserve.kernels.reference import ReferenceOps

BACKENDS = [ReferenceOps, CpuOps, CudaOps]
# The contract's ops: its methods, and the capabilities and name as attributes.
OP_NAMES = sorted(
    name for name, member in vars(Ops).items() if inspect.isfunction(member) and not name.startswith("_")
)


def _parameters(function) -> list[tuple[str, object, object, str]]:
    """What a caller relies on: each parameter's name, kind, default and annotation (as written)."""
    return [
        (p.name, p.kind, p.default, str(p.annotation))
        for p in inspect.signature(function).parameters.values()
    ]


def _cpu_ops() -> CpuOps | None:
    try:
        return CpuOps()
    except Exception:  # no compiler here: the reference stands in (see test_kernels_reference)
        return None


def test_the_contract_names_every_op_the_worker_calls():
    assert OP_NAMES == [
        "add_rms_norm_",
        "argmax",
        "copy_blocks",
        "masked_argmax",
        "paged_decode_attention",
        "paged_prefill_attention",
        "rms_norm",
        "rotary_write_kv_",
        "silu_mul",
        "write_kv",
    ]


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.__name__)
@pytest.mark.parametrize("op", OP_NAMES)
def test_each_backend_takes_each_op_with_the_contracts_signature(backend, op):
    assert _parameters(getattr(backend, op)) == _parameters(getattr(Ops, op)), (backend.__name__, op)


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.__name__)
def test_each_backend_names_itself(backend):
    assert backend.name in ("reference", "cpu", "cuda")
    assert len({b.name for b in BACKENDS}) == len(BACKENDS)


def test_every_backend_available_here_satisfies_the_contract():
    backends = [ReferenceOps(), get_ops(torch.device("cpu"))]
    if (cpu := _cpu_ops()) is not None:
        backends.append(cpu)
    for ops in backends:
        assert isinstance(ops, Ops), ops
        assert ops.linear is None or isinstance(ops.linear, LinearKernels), ops
        assert ops.quant_linear is None or isinstance(ops.quant_linear, QuantLinearKernels), ops
        # A stack runs the backend's own linears, so it comes with them.
        assert ops.decoder_stack is None or (
            isinstance(ops.decoder_stack, DecoderStackFactory) and ops.linear is not None
        ), ops


def test_the_reference_has_no_capabilities():
    ops = ReferenceOps()
    assert ops.linear is None and ops.decoder_stack is None
    assert linear_for(ops, torch.bfloat16) is None and linear_for(ops, torch.float32) is None


def test_the_cpu_kernels_linear_and_stack_satisfy_their_protocols():
    ops = _cpu_ops()
    if ops is None or ops.linear is None:
        pytest.skip("no C++ linear layer in this build (it needs AVX-512 BF16 or AVX2 with FMA)")
    assert ops.linear.dtypes <= {torch.bfloat16, torch.float32}
    for dtype in (torch.bfloat16, torch.float32, torch.float16):
        assert (linear_for(ops, dtype) is ops.linear) == (dtype in ops.linear.dtypes)
    dtype = next(iter(ops.linear.dtypes))
    stack = ops.decoder_stack(
        hidden=32,
        intermediate=64,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        eps=1e-6,
        scale=8**-0.5,
        final_norm=torch.ones(32, dtype=dtype),
    )
    assert isinstance(stack, DecoderStack) and stack.num_layers == 0
