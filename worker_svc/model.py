"""Llama-family decoders (Llama 2/3, Mistral, Qwen2/2.5, Qwen3, SmolLM2) over a flat batch of tokens.

The batch has no padding: the tokens of all sequences are concatenated, `positions` gives each token's
position in its sequence, and `AttentionMetadata` says which rows belong to which sequence and where
their K/V live in the paged cache. Attention goes through the paged KV ops of `pagedserve.kernels`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from pagedserve.kernels import get_ops
from torch import nn

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
    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 and multiply in the model dtype, like the HF implementations.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """Neox-style (rotate-half) RoPE from a cos/sin cache indexed by position."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        inv_freq = _inv_freq(config)
        pos = torch.arange(config.max_position, dtype=torch.float32)
        freqs = pos[:, None] * inv_freq[None, :]  # [max_position, head_dim / 2]
        # NOTE: cast to the model dtype after computing in float32, as HF does for cos/sin.
        self.register_buffer("cos", freqs.cos().to(dtype=dtype, device=device), persistent=False)
        self.register_buffer("sin", freqs.sin().to(dtype=dtype, device=device), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, ...]:
        cos = self.cos[positions].unsqueeze(1)  # [T, 1, D/2], broadcast over heads
        sin = self.sin[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


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


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, ops: Any, dtype: torch.dtype, device: torch.device) -> None:
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
        self.q_norm = self.k_norm = None
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype, device)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype, device)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rope: RotaryEmbedding,
        attn: AttentionMetadata,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope(positions, q, k)
        k_cache, v_cache = kv_cache
        self.ops.write_kv(k, v, k_cache, v_cache, attn.slot_mapping)
        if attn.max_query_len == 1:
            assert t == attn.context_lens.shape[0], "a decode batch has exactly one row per sequence"
            out = self.ops.paged_decode_attention(
                q, k_cache, v_cache, attn.block_tables, attn.context_lens, self.scale
            )
        else:
            out = self.ops.paged_prefill_attention(
                q, k_cache, v_cache, attn.block_tables, attn.query_start_loc, attn.context_lens, self.scale
            )
        return self.o_proj(out.reshape(t, self.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        # gate and up in one matmul: the loader concatenates the HF gate_proj and up_proj rows.
        self.gate_up_proj = _linear(
            config.hidden_size, 2 * config.intermediate_size, config.mlp_bias, dtype, device
        )
        self.down_proj = _linear(config.intermediate_size, config.hidden_size, config.mlp_bias, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, ops: Any, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.self_attn = Attention(config, ops, dtype, device)
        self.mlp = MLP(config, dtype, device)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rope: RotaryEmbedding,
        attn: AttentionMetadata,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, rope, attn, kv_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class CausalLM(nn.Module):
    """Parameter names follow HF without the `model.` prefix, with qkv_proj and gate_up_proj fused."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        device = torch.device(device)
        self.config = config
        self.dtype = dtype
        self.device = device
        ops = get_ops(device)
        self.embed_tokens = torch.nn.utils.skip_init(
            nn.Embedding, config.vocab_size, config.hidden_size, dtype=dtype, device=device
        )
        self.rope = RotaryEmbedding(config, dtype, device)
        self.layers = nn.ModuleList(
            DecoderLayer(config, ops, dtype, device) for _ in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.lm_head = None
        if not config.tie_word_embeddings:
            self.lm_head = _linear(config.hidden_size, config.vocab_size, False, dtype, device)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        assert input_ids.shape == positions.shape and input_ids.dim() == 1
        assert len(kv_caches) == len(self.layers)
        x = self.embed_tokens(input_ids)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, positions, self.rope, attn, kv_cache)
        return self.norm(x)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        # NOTE: the matmul runs in the model dtype (casting the [vocab, hidden] weight every step would
        # cost more than the matmul); only the result is widened for the sampler.
        return F.linear(hidden, weight).float()

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int, int]:
        return (num_blocks, block_size, self.config.num_kv_heads, self.config.head_dim)
