"""The KV pool: per layer one K and one V tensor [num_blocks, block_size, num_kv_heads, head_dim], all of
them views of one allocation (on the CPU of a head-major one: see KVCache).

Its size is either an explicit block count or follows from a memory budget in bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.worker_svc import host_memory
from pagedserve.worker_svc.config import DEFAULT_GPU_MEMORY_UTILIZATION

# Budget when the operator gives neither --num-blocks nor --kv-cache-memory.
DEFAULT_CPU_BUDGET = 1024**3


@dataclass(slots=True, frozen=True)
class KVCacheSpec:
    num_layers: int  # decoder layers, each with its own K and V tensor
    num_kv_heads: int  # key/value heads per layer
    head_dim: int  # elements per head
    block_size: int  # tokens per block
    dtype: torch.dtype  # element type of K and V

    @property
    def block_bytes(self) -> int:
        """Bytes one block takes over all layers, K and V."""
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * element

    def num_blocks_for(self, budget_bytes: int) -> int:
        return budget_bytes // self.block_bytes


def cuda_kv_budget(total: int, free: int, own: int, utilization: float, activations: int) -> int:
    """Bytes of KV pool a worker may allocate on a device of `total` bytes, `free` of them free now, of which
    it already holds `own` (its weights): its share (utilization x total) less what it holds and what its
    forward pass will need, and never more than is free beyond those activations (another process may hold
    the rest). Raises ValueError when that leaves nothing."""
    budget = min(int(total * utilization) - own - activations, free - activations)
    if budget <= 0:
        gib = 1024**3
        raise ValueError(
            f"--gpu-memory-utilization {utilization:g} of {total / gib:.1f} GiB leaves no room for the KV cache: "
            f"the weights take {own / gib:.2f} GiB, the forward pass about {activations / gib:.2f} GiB, and "
            f"{free / gib:.2f} GiB are free; raise it, give the worker a device of its own, or set "
            "--kv-cache-memory / --num-blocks"
        )
    return budget


def default_budget(
    device: torch.device,
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
    activations: int = 0,
) -> int:
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        own = torch.cuda.memory_reserved(device)
        return cuda_kv_budget(total, free, own, gpu_memory_utilization, activations)
    return DEFAULT_CPU_BUDGET


def resolve_num_blocks(
    spec: KVCacheSpec,
    device: torch.device,
    num_blocks: int | None,
    budget_bytes: int | None,
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
    activations: int = 0,
) -> int:
    """The pool's block count: explicit, else from the budget, else from the device's default budget (on
    CUDA: its share of the device's memory, `activations` bytes left for the forward pass)."""
    if num_blocks is None:
        budget = (
            budget_bytes
            if budget_bytes is not None
            else default_budget(device, gpu_memory_utilization, activations)
        )
        num_blocks = spec.num_blocks_for(budget)
        if num_blocks < 1:
            raise ValueError(
                f"a KV cache budget of {budget} bytes holds no block of {spec.block_bytes} bytes"
            )
    return num_blocks


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.zeros; on the CPU in huge pages, as decode reads scattered blocks of the pool every step
    (see host_memory)."""
    if device.type == "cpu":
        return host_memory.zeros(shape, dtype)
    return torch.zeros(shape, dtype=dtype, device=device)


class KVCache:
    """The pool's tensors, addressed by block id."""

    def __init__(
        self, spec: KVCacheSpec, num_blocks: int, device: torch.device, heads_first: bool | None = None
    ):
        """heads_first: the CPU kernels' head-major blocks (below); by default on the CPU only."""
        assert num_blocks > 0
        self.spec = spec
        self.num_blocks = num_blocks
        self.block_size = spec.block_size
        self.device = device
        shape = (num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
        # NOTE: zeros, not empty: padded block-table entries may point anywhere, and garbage there
        # (NaN/Inf from uninitialised memory) must never leak into a masked-out softmax term.
        # One allocation for all layers: on the CPU it lies in huge pages even where one layer's K or V is
        # smaller than a huge page (a pool sized for a few sequences), which a tensor of its own could not
        # (docs/performance.md, "Measurements behind the code").
        # On the CPU a block is head-major (a kv head's rows of the block side by side), and each tensor is a
        # view of that in the shape above: the decode attention then reads every block front to back, one
        # kv head at a time. On CUDA the kernels take the token-major tensor itself.
        if device.type == "cpu" if heads_first is None else heads_first:
            layout = (num_blocks, spec.num_kv_heads, spec.block_size, spec.head_dim)
            pool = _zeros((spec.num_layers, 2, *layout), spec.dtype, device).transpose(3, 4)
        else:
            pool = _zeros((spec.num_layers, 2, *shape), spec.dtype, device)
        self.k_caches = [pool[layer, 0] for layer in range(spec.num_layers)]
        self.v_caches = [pool[layer, 1] for layer in range(spec.num_layers)]

    @property
    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (k_cache, v_cache), the shape the model's forward takes."""
        return list(zip(self.k_caches, self.v_caches, strict=True))

    @property
    def num_bytes(self) -> int:
        return self.num_blocks * self.spec.block_bytes
