"""The kernel ops' contract, written once: every backend (reference.ReferenceOps in PyTorch,
cpu_ops.CpuOps in C++, cuda_ops.CudaOps through CuPy) implements `Ops`, and `get_ops(device)` returns one.

The paged KV cache, per layer: k_cache and v_cache [num_blocks, block_size, num_kv_heads, head_dim] in the
model dtype. A slot is block_id * block_size + offset_in_block; a negative slot is padding, never written.
The ops index a cache by that shape, so any strides do (the CPU pool's tensors are views of a head-major
allocation, see worker_svc/kv_cache.py; the CUDA kernels ask for contiguous ones).

A step's batch is flat: the tokens of all its S sequences concatenated, T rows in all, sequence s owning
rows query_start_loc[s]:query_start_loc[s + 1], which are its last tokens. Per sequence, block_tables
[S, max_blocks] int32 holds its physical block ids (entries past its last block are padding, never
dereferenced) and context_lens [S] int32 its tokens in the cache after the step, those rows included.
Positions at or beyond a sequence's context length never reach the output (garbage there, NaN in a
recycled block, must not leak through 0 * NaN). Queries have Hq heads of head_dim, Hq a multiple of
num_kv_heads (GQA: query head h reads kv head h // (Hq / num_kv_heads)).

Optional capabilities are attributes, None where a backend lacks them: `linear`, the backend's own linear
layer (model.PackedLinear packs weights for it), and `decoder_stack`, which runs all decoder layers of a
step in one call over those packed weights (model.CausalLM builds one; it computes what the model's Python
layer loop computes, bit for bit).

The argument checks every backend shares are the check_* helpers below.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from pagedserve.kernels.quant import QuantizedWeight


@runtime_checkable
class LinearKernels(Protocol):
    """A backend's own linear layer: y = x @ W^T + bias, W packed once into the backend's layout."""

    # Weight dtypes it packs and multiplies (bf16, float32); others stay with PyTorch's linear.
    dtypes: frozenset[torch.dtype]

    def pack_linear_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """An nn.Linear weight [N, K] in one of `dtypes` -> its packed copy (the layout is the backend's)."""
        ...

    def linear(
        self, x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """x [..., K] in the weight's dtype times the packed weight, plus bias [N] -> [..., N]."""
        ...


@runtime_checkable
class QuantLinearKernels(Protocol):
    """A backend's own weight-only quantized linear: y = x @ W^T + bias, W a kernels.quant.QuantizedWeight
    packed once into the backend's layout (the CPU kernels' is reached through `linear.linear_quant` and
    kernels.quant.pack_quant_weight instead: see worker_svc/model.py's QuantLinear)."""

    # Activation dtypes it multiplies; the packed weight serves all of them.
    dtypes: frozenset[torch.dtype]

    def pack_quant_weight(self, weight: QuantizedWeight, device: torch.device) -> Any:
        """The weight in the backend's layout on `device` (an object the backend's linear_quant reads)."""
        ...

    def linear_quant(self, x: torch.Tensor, packed: Any, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., K] in one of `dtypes` times the packed weight, plus bias [N] -> [..., N] in x's dtype,
        summed in float32."""
        ...


@runtime_checkable
class DecoderStack(Protocol):
    """A decoder's layers in one call: the model's layer loop (model.CausalLM.forward), same bits."""

    num_layers: int  # layers added so far

    def add_layer(
        self,
        qkv: torch.Tensor,
        qkv_bias: torch.Tensor | None,
        o: torch.Tensor,
        o_bias: torch.Tensor | None,
        gate_up: torch.Tensor,
        gate_up_bias: torch.Tensor | None,
        down: torch.Tensor,
        down_bias: torch.Tensor | None,
        input_norm: torch.Tensor,
        post_attention_norm: torch.Tensor,
        q_norm: torch.Tensor | None,
        k_norm: torch.Tensor | None,
    ) -> None:
        """One decoder layer: its packed linears (see LinearKernels), biases and norm weights, shared."""
        ...

    def forward_tokens(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        embedding: torch.Tensor,
        rope_table: torch.Tensor,
        k_caches: list[torch.Tensor],
        v_caches: list[torch.Tensor],
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        query_start_loc: torch.Tensor,
        context_lens: torch.Tensor,
        output_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """model.CausalLM.forward's result for these inputs, gathering the embedding and RoPE table rows
        of the tokens itself."""
        ...


@runtime_checkable
class DecoderStackFactory(Protocol):
    def __call__(
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
        """An empty stack for a model of these sizes; final_norm's dtype is the model's (bf16, float32)."""
        ...


@runtime_checkable
class Ops(Protocol):
    """The ops a worker's model and sampler call; shapes and layouts as in the module docstring."""

    name: str  # "reference", "cpu" or "cuda": which backend, for logs
    linear: LinearKernels | None  # the backend's own linear layer, or None: PyTorch's
    quant_linear: QuantLinearKernels | None  # the backend's own quantized linear (CUDA), or None
    decoder_stack: DecoderStackFactory | None  # all layers in one call (needs `linear`), or None
    # Batch invariance, set by the worker (--deterministic): every row's result has the same bits whatever
    # the rest of its step and the thread count (docs/kernels.md, "Batch invariance"). False: the kernels
    # choose by the batch. Only the CPU kernels guarantee it for a whole forward pass.
    batch_invariant: bool

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """key, value [T, num_kv_heads, head_dim] into the caches at slot_mapping int64 [T] (negative:
        skipped)."""
        ...

    def paged_decode_attention(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """One query row per sequence, query [S, Hq, head_dim], at its last position context_lens[s] - 1
        (at least 1), attending to its context_lens[s] cached positions: softmax(q K^T * scale) V, in
        query's dtype, reduced in float32."""
        ...

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
        """Causal attention of a flat batch, query [T, Hq, head_dim], query_start_loc int32 [S + 1]: a
        sequence's rows are its last positions and each sees the positions up to its own (cached context
        and the step's earlier rows). [T, Hq, head_dim] in query's dtype. The metadata tensors of a step are
        not modified in place between its calls (a backend may remember what it derived from them)."""
        ...

    def copy_blocks(
        self, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], src: torch.Tensor, dst: torch.Tensor
    ) -> None:
        """Block src[i] to block dst[i] (int64 [N]) in every layer, as if one copy after another: a block
        written by copy i and read by a later copy passes on its new content; the last copy into a block
        wins."""
        ...

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm over the last dimension: normalised in float32, multiplied by weight in x's dtype
        (as the HF implementations)."""
        ...

    def add_rms_norm_(
        self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """x += delta in place (the residual stream), then rms_norm(x)."""
        ...

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
        """Neox (rotate-half) RoPE in place on the query and key heads of qk [T, Hq + Hkv, head_dim], with
        cos and sin [T, 1, head_dim] rows of (cos, cos) and (-sin, sin) (x * cos + (x2, x1) * sin, HF's
        products and sums), then the rotated keys (qk's last Hkv heads) and value [T, Hkv, head_dim]
        written as write_kv does."""
        ...

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of gate_up [T, 2I] (gate first) -> [T, I], rounded where PyTorch rounds."""
        ...

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """Index of the largest value of each row of x [R, V], int64 [R]: the first where several are
        equal, a NaN counting as the largest (torch.argmax over the last dimension)."""
        ...

    def masked_argmax(self, x: torch.Tensor, masks: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        """argmax of x [R, V] with -inf on the tokens that structured outputs' packed masks ban: row rows[i]
        (rows None: row i) may take token t only where bit t % 32 of masks[i, t // 32] (int32 [M, ceil(V / 32)])
        is set; the other rows are argmax's. As argmax of x widened to float32 after that masked_fill."""
        ...


def quant_linear_for(ops: Ops, dtype: torch.dtype) -> QuantLinearKernels | None:
    """ops' own quantized linear for activations of dtype, or None."""
    kernels = ops.quant_linear
    return kernels if kernels is not None and dtype in kernels.dtypes else None


def linear_for(ops: Ops, dtype: torch.dtype) -> LinearKernels | None:
    """ops' own linear layer for weights of dtype, or None (PyTorch's linear then)."""
    linear = ops.linear
    return linear if linear is not None and dtype in linear.dtypes else None


# ---- the argument checks every backend makes --------------------------------------------------------------


def check_write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    num_kv_heads, head_dim = k_cache.shape[2:]
    assert key.shape == value.shape and key.shape[1:] == (num_kv_heads, head_dim), (key.shape, k_cache.shape)
    assert v_cache.shape == k_cache.shape
    assert slot_mapping.shape == (key.shape[0],), (slot_mapping.shape, key.shape)


def check_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor | None = None,
) -> None:
    """A query [rows, Hq, head_dim] against the caches, for S = context_lens' sequences; query_start_loc
    [S + 1] for a prefill batch, else one row per sequence."""
    num_heads, head_dim = query.shape[1:]
    num_kv_heads = k_cache.shape[2]
    num_seqs = context_lens.shape[0]
    assert k_cache.shape[3] == head_dim and v_cache.shape == k_cache.shape, (query.shape, k_cache.shape)
    assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
    assert context_lens.shape == (num_seqs,) and block_tables.shape[0] == num_seqs
    if query_start_loc is None:
        assert query.shape[0] == num_seqs, "a decode batch has exactly one row per sequence"
    else:
        assert query_start_loc.shape == (num_seqs + 1,), (query_start_loc.shape, num_seqs)


def check_copy_blocks(
    k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], src: torch.Tensor, dst: torch.Tensor
) -> None:
    assert len(k_caches) == len(v_caches) and src.shape == dst.shape and src.dim() == 1


def int32(t: torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
    """t as contiguous int32 (on device, default where it is), without a copy when it already is: a
    torch .to(), even one that changes nothing, costs a dispatch."""
    if t.dtype == torch.int32 and t.is_contiguous() and (device is None or t.device == device):
        return t
    return t.to(device=device, dtype=torch.int32).contiguous()
