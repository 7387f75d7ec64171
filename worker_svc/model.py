"""Llama-family decoders (Llama 2/3, Mistral, Qwen2/2.5, Qwen3, SmolLM2) over a flat batch of tokens.

The batch has no padding: the tokens of all sequences are concatenated, `positions` gives each token's
position in its sequence, and `AttentionMetadata` says which rows belong to which sequence and where
their K/V live in the paged cache. Attention and the fused small ops go through the kernel ops
(`pagedserve.kernels`, the contract in kernels/ops.py).

These modules are the one description of the architecture. Where the ops have a DecoderStack (the C++ CPU
kernels with their linear layer), CausalLM builds one from these modules' own packed weights and norms, and
it runs the same layers with the same kernels in the same order in one call: the same bits, which
tests/test_model.py checks against the layer loop below for every family.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.kernels import get_ops
from pagedserve.kernels.ops import (
    DecoderStack,
    DecoderStackFactory,
    LinearKernels,
    Ops,
    QuantLinearKernels,
    linear_for,
    quant_linear_for,
)
from pagedserve.kernels.quant import PackedRows, QuantizedWeight, pack_quant_weight
from pagedserve.worker_svc import host_memory

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")


@dataclass(slots=True)
class ModelConfig:
    model_type: str  # HF model_type: "llama" (also SmolLM2), "mistral", "qwen2" or "qwen3"
    vocab_size: int  # rows of the embedding and of the LM head
    hidden_size: int  # width of the residual stream
    intermediate_size: int  # width of the SwiGLU MLP (each of gate and up)
    num_layers: int  # decoder layers
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads (GQA: num_heads is a multiple of it)
    head_dim: int  # features per head (explicit in qwen3 configs, else hidden_size // num_heads)
    rms_norm_eps: float  # epsilon of every RMSNorm
    rope_theta: float  # RoPE base
    rope_type: str  # "default", "llama3" or "linear"
    rope_scaling: dict[str, Any] | None  # parameters of a scaled rope_type (factor, ...), else None
    max_position: int  # positions the RoPE cache covers (max_position_embeddings)
    tie_word_embeddings: bool  # LM head shares the embedding matrix (no lm_head.weight in the checkpoint)
    qkv_bias: bool  # q/k/v projections have a bias (qwen2; llama with attention_bias)
    o_bias: bool  # output projection has a bias (llama with attention_bias)
    mlp_bias: bool  # gate/up/down projections have a bias (llama with mlp_bias)
    qk_norm: bool  # per-head RMSNorm of q and k before RoPE (qwen3)

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> ModelConfig:
        model_type = hf.get("model_type", "")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r}; only 'silu' (SwiGLU) is implemented")
        num_heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
        rope_theta, rope_type, rope_scaling = _rope_params(hf)
        max_position = hf.get("max_position_embeddings", 2048)
        # NOTE: sliding-window attention is not implemented. Within the window it equals full attention,
        # so a model that always uses it (mistral v0.1) is limited to window-long sequences.
        window = hf.get("sliding_window")
        uses_window = hf.get("use_sliding_window", model_type == "mistral")
        if window and uses_window:
            max_position = min(max_position, window)
        attention_bias = bool(hf.get("attention_bias", False))
        return cls(
            model_type=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_type=rope_type,
            rope_scaling=rope_scaling,
            max_position=max_position,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            # qwen2's q/k/v always carry a bias (its config has no switch for it); qwen3 follows attention_bias.
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=model_type in ("llama", "qwen3") and attention_bias,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            qk_norm=model_type == "qwen3",
        )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def activation_bytes(self, tokens: int, element_size: int) -> int:
        """An upper estimate of the memory a forward pass of `tokens` rows holds at its peak, beyond the
        weights and the KV pool: one layer's widest tensors alive together (the residual stream and its
        norm, the fused qkv projection, the attention's output, the MLP's gate and up and their product),
        twice over for the allocator's rounding and the next layer's first outputs, and float32 logits for
        as many rows."""
        widths = (
            2 * self.hidden_size + self.q_size + 2 * self.kv_size + self.q_size + 3 * self.intermediate_size
        )
        return 2 * tokens * widths * element_size + tokens * self.vocab_size * 4


def _rope_params(hf: dict[str, Any]) -> tuple[float, str, dict[str, Any] | None]:
    # transformers >= 5 writes `rope_parameters` (theta included); older configs `rope_theta` + `rope_scaling`.
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported")
    scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "rope_type", "type")}
    if rope_type == "llama3":
        scaling.setdefault("original_max_position_embeddings", hf.get("max_position_embeddings"))
    return theta, rope_type, (scaling if rope_type != "default" else None)


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # int64 [T]: cache slot (block_id * block_size + offset) of each token
    block_tables: torch.Tensor  # int32 [S, max_blocks]: physical block ids of each sequence, padded with 0
    query_start_loc: torch.Tensor  # int32 [S+1]: sequence s owns rows query_start_loc[s]:query_start_loc[s+1]
    context_lens: torch.Tensor  # int32 [S]: tokens of each sequence in the cache after this step
    max_query_len: int  # longest query of the batch; 1 = decode-only batch (one row per sequence)


class RMSNorm(nn.Module):
    """RMSNorm through the kernel ops: normalised in float32, multiplied in the model dtype (as HF)."""

    def __init__(self, size: int, eps: float, ops: Ops, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.eps = eps
        self.ops = ops
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)

    def add_(self, x: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """x += delta in place (the residual stream), then the norm of x: one pass on CPU."""
        return self.ops.add_rms_norm_(x, delta, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """Neox-style (rotate-half) RoPE from a cos/sin table indexed by position. `lookup` gathers the rows of
    a batch's positions once per forward; every layer's ops.rotary_write_kv_ rotates with them."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        inv_freq = _inv_freq(config)
        pos = torch.arange(config.max_position, dtype=torch.float32)
        freqs = pos[:, None] * inv_freq[None, :]  # [max_position, head_dim / 2]
        # NOTE: cast to the model dtype after computing in float32, as HF does for cos/sin.
        cos, sin = freqs.cos(), freqs.sin()
        # [max_position, 2 * head_dim] rows of (cos, cos) and (-sin, sin), for the one-pass form
        # x * (cos, cos) + (x2, x1) * (-sin, sin) (see kernels/reference.py rotary_write_kv_).
        table = torch.cat((cos, cos, -sin, sin), dim=-1).to(dtype=dtype, device=device)
        self.register_buffer("table", table, persistent=False)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) of each token, [T, 1, D] each, broadcast over heads."""
        cos, sin = self.table[positions].unsqueeze(1).chunk(2, dim=-1)
        return cos, sin


def _inv_freq(config: ModelConfig) -> torch.Tensor:
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling or {}
    if config.rope_type == "linear":
        return inv_freq / scaling["factor"]
    if config.rope_type == "llama3":
        # Llama 3.1: long wavelengths are divided by `factor`, short ones kept, the band between blended.
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


def _linear(in_f: int, out_f: int, bias: bool, dtype: torch.dtype, device: torch.device) -> nn.Linear:
    # The loader overwrites every weight, so skip the (slow, for big models) random initialisation.
    return torch.nn.utils.skip_init(nn.Linear, in_f, out_f, bias=bias, dtype=dtype, device=device)


class PackedLinear(nn.Module):
    """A linear layer whose weight is packed once: into the C++ CPU kernels' layout where they have a linear
    for its dtype (bf16: AVX-512 BF16, or AVX2 with FMA; float32: AVX2 with FMA), else into oneDNN's blocked
    layout for this CPU.

    NOTE: bf16 F.linear on CPU runs oneDNN but reorders (or reads strided) the plain [out, in] weight on
    every call; prepacked, the same results come faster. The kernels' linear (kernels/cpu/linear*.cpp)
    streams the weights faster still at few rows, and hands many rows (prompts) to oneDNN itself, over the
    weight unpacked for the call, where oneDNN's bf16 matmul is native: so one copy of each weight serves
    every batch size. float32 weights go to the kernels' float32 linear where the CPU has AVX2 with FMA,
    else to oneDNN prepacked: F.linear runs MKL's sgemm, which on an AMD CPU streams the weights at a
    fraction of the memory's rate. The measurements are in docs/performance.md
    (`bench/bench_kernels_cpu.py --linear`)."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        kernels: LinearKernels | None = None,
        arena: host_memory.Arena | None = None,
    ) -> None:
        super().__init__()
        weight = weight.detach()
        self.out_features, self.in_features = weight.shape
        self.kernels = kernels
        if kernels is not None:
            # [N / 16, K / 2, 16, 2], padded; in huge pages, as decode streams it every step (see host_memory):
            # in `arena`, beside the model's other weights, else in a mapping of its own
            packed = kernels.pack_linear_weight(weight)
            packed = host_memory.in_huge_pages(packed) if arena is None else arena.copy(packed)
        else:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)  # 1: decode's batch size
        self.weight = nn.Parameter(packed, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None:
            return self.kernels.linear(x, self.weight, self.out_features, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")


class QuantLinear(nn.Module):
    """A linear layer whose weight stays quantized (int4 or int8 codes, a scale and offset per group of K;
    kernels/quant.py), multiplied by the kernels' quantized linear with activations of the model dtype: the
    C++ kernels' linear_quant on a CPU (float32 or bf16), the backend's own QuantLinearKernels elsewhere
    (CUDA: bf16, fp16, float32). `perm` (GPTQ's act order): x's columns in the codes' K order, gathered each
    call."""

    def __init__(
        self,
        weight: QuantizedWeight,
        bias: torch.Tensor | None,
        kernels: Any,
        perm: torch.Tensor | None = None,
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.kernels = kernels
        if isinstance(kernels, QuantLinearKernels):
            # the backend's own layout, on its device (an object its linear_quant reads, not a tensor)
            assert device is not None
            self.weight = kernels.pack_quant_weight(weight, device)
            perm = None if perm is None else perm.to(device)
        else:
            # in huge pages: decode streams it every step, as PackedLinear's
            packed = host_memory.in_huge_pages(pack_quant_weight(weight))
            self.weight = nn.Parameter(packed, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.perm = perm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.perm is not None:
            x = x.index_select(-1, self.perm)
        return self.kernels.linear_quant(x, self.weight, self.bias)


class QuantEmbedding(nn.Module):
    """The token embedding of a model whose tied LM head is quantized: a step's rows gathered from the head's
    packed codes and dequantized, in the model dtype (the same values as the dequantized embedding), so no
    float copy of the embedding matrix is held."""

    def __init__(self, head: QuantLinear, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features
        self.dtype = dtype
        self.rows = PackedRows(head.weight.detach())  # the head's own tensor, not a parameter here

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = input_ids.reshape(-1)
        if ids.numel():
            lowest, highest = int(ids.min()), int(ids.max())
            if lowest < 0 or highest >= self.num_embeddings:
                bad = lowest if lowest < 0 else highest
                raise RuntimeError(f"token id {bad} is outside the vocabulary ({self.num_embeddings})")
        rows = self.rows(ids).to(self.dtype)
        return rows.view(*input_ids.shape, self.embedding_dim)


def can_quantize_linears(ops: Ops, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether QuantLinear applies: see quant_kernels."""
    return quant_kernels(ops, dtype, device) is not None


def quant_kernels(ops: Ops, dtype: torch.dtype, device: torch.device) -> Any:
    """The kernels QuantLinear multiplies with, or None: the backend's own quantized linear (ops.quant_linear:
    CUDA's, with CuPy and a device), else on a CPU the C++ kernels' (AVX-512), float32 or bf16 activations."""
    own = quant_linear_for(ops, dtype)
    if own is not None:
        return own
    kernels = linear_for(ops, dtype) if device.type == "cpu" else None
    return kernels if getattr(kernels, "linear_quant", None) is not None else None


def can_pack_linears(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether PackedLinear applies: on a CPU where the kernels have a linear for the dtype (bf16: AVX-512
    BF16, or AVX2 with FMA; float32: AVX2 with FMA), else where oneDNN runs it (bf16 natively)."""
    if device.type != "cpu" or dtype not in (torch.bfloat16, torch.float32):
        return False
    if linear_for(get_ops(device), dtype) is not None:
        return True
    if dtype == torch.float32:
        return torch.backends.mkldnn.is_available()
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, ops: Ops, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.ops = ops
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.scale = config.head_dim**-0.5
        h = config.hidden_size
        # q, k and v in one matmul: the loader concatenates the HF q_proj, k_proj, v_proj rows.
        self.qkv_proj = _linear(h, self.q_size + 2 * self.kv_size, config.qkv_bias, dtype, device)
        self.o_proj = _linear(self.q_size, h, config.o_bias, dtype, device)
        # Tensor parallelism (worker_svc/parallel.py): sums o_proj's partial outputs over the ranks; None: one rank.
        self.all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.q_norm = self.k_norm = None
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, ops, dtype, device)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, ops, dtype, device)

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        attn: AttentionMetadata,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The output for every row of x, or for `rows` alone (every row's keys and values are written
        either way; see CausalLM.forward)."""
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        qk = qkv[:, : self.q_size + self.kv_size].view(t, self.num_heads + self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=1)
        k_cache, v_cache = kv_cache
        # q and k heads rotated together, in place, and the keys and values written to the cache.
        self.ops.rotary_write_kv_(qk, v, *cos_sin, k_cache, v_cache, attn.slot_mapping)
        q = qk[:, : self.num_heads]
        if rows is not None:
            # Each row as one query over its sequence up to its own position: a decode batch.
            rows32 = rows.to(torch.int32)
            seqs = torch.searchsorted(attn.query_start_loc, rows32, right=True) - 1
            lens = attn.context_lens[seqs] - (attn.query_start_loc[seqs + 1] - rows32) + 1  # position + 1
            out = self.ops.paged_decode_attention(
                q[rows], k_cache, v_cache, attn.block_tables[seqs], lens, self.scale
            )
        elif attn.max_query_len == 1:
            assert t == attn.context_lens.shape[0], "a decode batch has exactly one row per sequence"
            out = self.ops.paged_decode_attention(
                q, k_cache, v_cache, attn.block_tables, attn.context_lens, self.scale
            )
        else:
            out = self.ops.paged_prefill_attention(
                q, k_cache, v_cache, attn.block_tables, attn.query_start_loc, attn.context_lens, self.scale
            )
        out = self.o_proj(out.reshape(out.shape[0], self.q_size))
        return out if self.all_reduce is None else self.all_reduce(out)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, ops: Ops, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.ops = ops
        # gate and up in one matmul: the loader concatenates the HF gate_proj and up_proj rows.
        self.gate_up_proj = _linear(
            config.hidden_size, 2 * config.intermediate_size, config.mlp_bias, dtype, device
        )
        self.down_proj = _linear(config.intermediate_size, config.hidden_size, config.mlp_bias, dtype, device)
        # Tensor parallelism (worker_svc/parallel.py): sums down_proj's partial outputs over the ranks.
        self.all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.down_proj(self.ops.silu_mul(self.gate_up_proj(x)))
        return out if self.all_reduce is None else self.all_reduce(out)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, ops: Ops, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.self_attn = Attention(config, ops, dtype, device)
        self.mlp = MLP(config, ops, dtype, device)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops, dtype, device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops, dtype, device)

    def forward(
        self,
        x: torch.Tensor,
        h: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        attn: AttentionMetadata,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        next_norm: RMSNorm,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x is the residual stream (updated in place: it is this forward's own tensor) and h its
        input_layernorm; returns next_norm of the updated stream, the next layer's input (or the final
        norm), of every row or of `rows` alone (see CausalLM.forward). Each residual add is fused with the
        norm that follows it."""
        out = self.self_attn(h, cos_sin, attn, kv_cache, rows)
        if rows is not None:
            x = x[rows]
        h = self.post_attention_layernorm.add_(x, out)
        return next_norm.add_(x, self.mlp(h))


class CausalLM(nn.Module):
    """Parameter names follow HF without the `model.` prefix, with qkv_proj and gate_up_proj fused."""

    def __init__(
        self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str, ops: Ops | None = None
    ) -> None:
        super().__init__()
        device = torch.device(device)
        self.config = config
        self.dtype = dtype
        self.device = device
        # The kernel ops every layer calls: the device's (get_ops), unless given.
        self.ops = ops = get_ops(device) if ops is None else ops
        self.embed_tokens = torch.nn.utils.skip_init(
            nn.Embedding, config.vocab_size, config.hidden_size, dtype=dtype, device=device
        )
        self.rope = RotaryEmbedding(config, dtype, device)
        self.layers = nn.ModuleList(
            DecoderLayer(config, ops, dtype, device) for _ in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops, dtype, device)
        self.lm_head = None
        if not config.tie_word_embeddings:
            self.lm_head = _linear(config.hidden_size, config.vocab_size, False, dtype, device)
        # A tied head's packed copy of the embedding matrix (see pack_linears); None: not packed.
        self.tied_head: PackedLinear | None = None
        # The layers in one call of the kernels, where they have a DecoderStack (see pack_linears).
        self.stack: DecoderStack | None = None
        # Stacks of the first layers alone, by layer count, built at a draft's first use (draft_forward).
        self._draft_stacks: dict[int, DecoderStack] = {}
        # Tensor parallelism (worker_svc/parallel.py): the full logits from this rank's vocabulary shard's
        # (on rank 0; None on the others); None: one rank.
        self.gather_logits: Callable[[torch.Tensor], torch.Tensor | None] | None = None

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        output_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The final hidden states (after the last norm) of every row of the batch, or of `output_rows`
        (int64 row indices, in that order) alone: the rows a step samples from or scores prompt tokens
        with. In the last layer a row's attention output, o and MLP feed nothing but its own final
        state, so there they are computed for those rows alone, each as one query over its sequence up
        to its position (every row's keys and values are written as always): for a prompt, 1/num_layers
        of its o and MLP FLOPs."""
        assert len(kv_caches) == len(self.layers)
        return self._run_layers(self.layers, self.stack, input_ids, positions, attn, kv_caches, output_rows)

    @torch.inference_mode()
    def draft_forward(
        self,
        num_layers: int,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        output_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """forward through the first num_layers layers alone, then the final norm: a self-speculative draft
        (worker_svc/spec_decode.py). Their keys and values go to kv_caches[:num_layers] as forward's would:
        the same weights over the same inputs."""
        assert 0 < num_layers < len(self.layers)
        stack = None
        if self.stack is not None:
            stack = self._draft_stacks.get(num_layers)
            if stack is None:
                stack = self._draft_stacks[num_layers] = self._build_stack(
                    self.ops.decoder_stack, self.layers[:num_layers]
                )
        layers = self.layers[:num_layers]
        return self._run_layers(
            layers, stack, input_ids, positions, attn, kv_caches[:num_layers], output_rows
        )

    def _run_layers(
        self,
        layers: Sequence[DecoderLayer],
        stack: DecoderStack | None,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        output_rows: torch.Tensor | None,
    ) -> torch.Tensor:
        """The embedding, these layers (in one call of `stack` where given) and the final norm."""
        assert input_ids.shape == positions.shape and input_ids.dim() == 1
        if stack is not None:
            # The stack gathers the embedding and RoPE rows itself (see DecoderStack.forward_tokens); a
            # quantized embedding's rows are dequantized here, the step's own table.
            table, ids = self.embed_tokens, input_ids
            if isinstance(table, QuantEmbedding):
                table, ids = table(input_ids), torch.arange(input_ids.numel())
            else:
                table = table.weight
            return stack.forward_tokens(
                ids,
                positions,
                table,
                self.rope.table,
                [k for k, _ in kv_caches],
                [v for _, v in kv_caches],
                attn.slot_mapping,
                attn.block_tables,
                attn.query_start_loc,
                attn.context_lens,
                output_rows,
            )
        x = self.embed_tokens(input_ids)
        cos_sin = self.rope.lookup(positions)  # once for all layers
        h = layers[0].input_layernorm(x)
        next_norms = [layer.input_layernorm for layer in layers[1:]] + [self.norm]
        last = len(layers) - 1
        for i, (layer, kv_cache, next_norm) in enumerate(zip(layers, kv_caches, next_norms, strict=True)):
            h = layer(x, h, cos_sin, attn, kv_cache, next_norm, output_rows if i == last else None)
        return h

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The logits of `hidden`'s rows, in the model dtype: the sampler widens them where it must (an
        argmax-only batch takes its argmax from them as they are).

        NOTE: the matmul runs in the model dtype (casting the [vocab, hidden] weight every step would cost
        more than the matmul)."""
        head = self.lm_head if self.lm_head is not None else self.tied_head
        logits = F.linear(hidden, self.embed_tokens.weight) if head is None else head(hidden)
        return logits if self.gather_logits is None else self.gather_logits(logits)

    def pack_linears(self) -> None:
        """Replace every nn.Linear (and a tied LM head) with a PackedLinear; see can_pack_linears.
        A tied head gets a packed copy of the embedding matrix, tied_head (the lookup needs the plain one)."""
        assert can_pack_linears(self.dtype, self.device), (self.dtype, self.device)
        kernels = linear_for(self.ops, self.dtype)
        arena = host_memory.Arena()
        for module in self.modules():
            for name, child in module.named_children():
                if type(child) is nn.Linear:
                    setattr(module, name, PackedLinear(child.weight, child.bias, kernels, arena))
        if self.lm_head is None and self.tied_head is None:
            self.tied_head = PackedLinear(self.embed_tokens.weight, None, kernels, arena)
        # NOTE: a tensor-parallel shard sums its layers' outputs over the ranks between the kernels, which
        # the stack's one call has no place for: it runs the layer loop (docs/tensor-parallel.md has the cost);
        # so does a model whose quantized linears gather their activations' columns (GPTQ's act order).
        parallel = self.layers[0].mlp.all_reduce is not None
        permuted = any(isinstance(m, QuantLinear) and m.perm is not None for m in self.modules())
        if kernels is not None and self.ops.decoder_stack is not None and not parallel and not permuted:
            self.stack = self._build_stack(self.ops.decoder_stack)

    def quantize_linears(
        self, weights: dict[str, QuantizedWeight], perms: dict[str, torch.Tensor] | None = None
    ) -> None:
        """Replace the linear modules named in `weights` (fused names: layers.0.self_attn.qkv_proj, ...;
        "lm_head" for the head, tied or not) with QuantLinear; see can_quantize_linears. pack_linears packs
        the others after. A model whose activations need a column gather (perms) runs the layer loop."""
        assert can_quantize_linears(self.ops, self.dtype, self.device), (self.dtype, self.device)
        kernels = quant_kernels(self.ops, self.dtype, self.device)
        perms = perms or {}
        for name, weight in weights.items():
            parent, _, attr = name.rpartition(".")
            module = self.get_submodule(parent) if parent else self
            old = getattr(module, attr)
            shape = (self.config.vocab_size, self.config.hidden_size) if old is None else old.weight.shape
            if tuple(weight.shape) != tuple(shape):
                raise ValueError(
                    f"{name}: quantized weight of shape {weight.shape}, the model expects {tuple(shape)}"
                )
            layer = QuantLinear(
                weight, None if old is None else old.bias, kernels, perms.get(name), self.device
            )
            if name == "lm_head" and old is None:
                self.tied_head = layer
                if not isinstance(kernels, QuantLinearKernels):
                    # the tied head's CPU codes are the embedding's: the lookup reads them, no float copy is
                    # kept (a backend's own layout keeps the dequantized embedding)
                    self.embed_tokens = QuantEmbedding(layer, self.dtype)
            else:
                setattr(module, attr, layer)

    def _build_stack(
        self, new_stack: DecoderStackFactory, layers: Iterable[DecoderLayer] | None = None
    ) -> DecoderStack:
        """The kernels' DecoderStack over this model's packed weights (shared, not copied). It runs the
        same kernels as forward's Python loop, in the same order (the MLP's gate_up linear and silu_mul
        as one pass, with the same roundings), so both compute the same bits; it saves the Python work
        around each of the ~10 kernel calls per layer."""
        c = self.config
        stack = new_stack(
            hidden=c.hidden_size,
            intermediate=c.intermediate_size,
            num_heads=c.num_heads,
            num_kv_heads=c.num_kv_heads,
            head_dim=c.head_dim,
            eps=c.rms_norm_eps,
            scale=c.head_dim**-0.5,
            final_norm=self.norm.weight,
        )
        for layer in self.layers if layers is None else layers:
            attn, mlp = layer.self_attn, layer.mlp
            stack.add_layer(
                qkv=attn.qkv_proj.weight,
                qkv_bias=attn.qkv_proj.bias,
                o=attn.o_proj.weight,
                o_bias=attn.o_proj.bias,
                gate_up=mlp.gate_up_proj.weight,
                gate_up_bias=mlp.gate_up_proj.bias,
                down=mlp.down_proj.weight,
                down_bias=mlp.down_proj.bias,
                input_norm=layer.input_layernorm.weight,
                post_attention_norm=layer.post_attention_layernorm.weight,
                q_norm=None if attn.q_norm is None else attn.q_norm.weight,
                k_norm=None if attn.k_norm is None else attn.k_norm.weight,
            )
        return stack

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int, int]:
        return (num_blocks, block_size, self.config.num_kv_heads, self.config.head_dim)
