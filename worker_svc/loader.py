"""Load a Hugging Face model folder (config.json + safetensors) into a `CausalLM`."""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from pagedserve.kernels import get_ops
from pagedserve.kernels.ops import Ops, linear_for
from pagedserve.kernels.quant import QuantizedWeight, dequantize
from pagedserve.worker_svc.model import CausalLM, ModelConfig, can_pack_linears, can_quantize_linears
from pagedserve.worker_svc.parallel import ParallelGroup, shard_config
from pagedserve.worker_svc.quantization import (
    SAFETENSORS_METHODS,
    detect_quantization,
    fuse_quantized_modules,
    gguf_source,
    quant_config,
    read_gguf_linears,
    read_quantized_module,
    resolve_quantization,
)

log = logging.getLogger(__name__)

# HF projection name -> (our fused parameter, index of its shard in the fused rows).
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
# Checkpoint entries that carry no weights we need (old checkpoints saved the RoPE frequencies).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: str, device: torch.device | str) -> torch.dtype:
    if name == "auto":
        # bfloat16 on CUDA, and on CPUs where it beats float32 (cpu_prefers_bf16): half the bytes that
        # decode streams (docs/performance.md, "Measurements behind the code"). The price is accuracy
        # (logits differ from float32's by up to 1.2, and greedy text from transformers' float32 text sooner).
        # Like vLLM's CPU backend, "auto" takes the speed; everything that compares with transformers (tests,
        # parity checks) passes --dtype float32 explicitly.
        device = torch.device(device)
        if device.type == "cuda" or (device.type == "cpu" and cpu_prefers_bf16()):
            return torch.bfloat16
        return torch.float32
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; expected one of: auto, {', '.join(_DTYPES)}")
    return _DTYPES[name]


@functools.cache
def cpu_prefers_bf16() -> bool:
    """Whether bfloat16 beats float32 on this CPU: it multiplies bf16 natively, or the C++ kernels have their
    linear layer (AVX2 with FMA: bf16 weights widened as they stream, half the bytes of float32). Elsewhere
    PyTorch emulates bf16 matmuls, about 100x slower than float32 on an AVX2 CPU."""
    return cpu_has_native_bf16() or linear_for(get_ops(torch.device("cpu")), torch.bfloat16) is not None


@functools.cache
def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (the avx512_bf16 or amx_bf16 flag, Linux only)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(f in flags.split() for f in ("avx512_bf16", "amx_bf16"))


def read_model_config(model_dir: Path | str) -> ModelConfig:
    """The architecture a HF folder's config.json describes (no weights read)."""
    config_path = Path(model_dir) / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"no config.json in {model_dir}")
    return ModelConfig.from_hf_config(json.loads(config_path.read_text()))


def load_model(
    model_dir: Path | str,
    dtype: torch.dtype,
    device: torch.device | str,
    ops: Ops | None = None,
    group: ParallelGroup | None = None,
    quantization: str = "auto",
) -> CausalLM:
    """The model of a HF folder on `device` in `dtype`, its layers calling `ops` (default: the device's);
    with a tensor-parallel group, this rank's shard of it (see parallel.py). quantization: "auto" keeps a
    GPTQ or AWQ checkpoint's linear weights quantized where the kernels have a quantized linear, "gguf" a
    GGUF's, "none" loads them dequantized (see worker_svc/quantization.py)."""
    start = time.perf_counter()
    model_dir = Path(model_dir)
    method = resolve_quantization(model_dir, quantization)
    if group is not None and (method is not None or detect_quantization(model_dir) in SAFETENSORS_METHODS):
        raise ValueError(
            f"{model_dir.name}: tensor parallelism does not shard quantized weights yet; a GGUF model shards "
            "dequantized (--quantization auto or none), a GPTQ, AWQ or compressed-tensors checkpoint serves on "
            "one rank"
        )
    full = read_model_config(model_dir)
    config = full if group is None else shard_config(full, group.size)
    model = CausalLM(config, dtype, device, ops)
    if group is not None:
        group.parallelize(model, full)
    # GPTQ, AWQ and compressed-tensors tensors are read whether kept quantized or not (then dequantized
    # into the weights).
    qc = quant_config(model_dir)
    quant_parts: dict[str, dict[str, torch.Tensor]] = {}  # HF module -> its qweight, qzeros, scales, ...
    if method is not None and not can_quantize_linears(model.ops, dtype, torch.device(device)):
        log.warning(
            "%s is %s-quantized but the kernels have no quantized linear for %s on %s: loading it dequantized",
            model_dir.name,
            method,
            dtype,
            device,
        )
        method = None
    if method is not None and model.ops.batch_invariant:
        # NOTE: the quantized linear's sums depend on the step's rows (its passes and its dequantized path
        # for many rows), so batch invariance (--deterministic) takes the dequantized weights.
        log.warning("%s: --deterministic loads its %s weights dequantized", model_dir.name, method)
        method = None
    params = dict(model.named_parameters())
    # Fused parameters are complete once all their shards are loaded, the others once loaded.
    missing = {(name, None) for name in params}
    for name in ("qkv_proj", "gate_up_proj"):
        for param_name in [p for p in params if f".{name}." in p]:
            missing.discard((param_name, None))
            missing.update((param_name, i) for i in range(3 if name == "qkv_proj" else 2))

    # A GGUF kept quantized: its linears (and a tied head's embedding, which the lookup reads from the head's
    # codes) are read from the file, so the converted copy's dequantized weights of them are never read.
    gguf_weights: dict[str, QuantizedWeight] = {}
    from_gguf: set[str] = set()
    if method == "gguf":
        source = gguf_source(model_dir)
        assert source is not None
        gguf_weights = read_gguf_linears(source, config)
        from_gguf = {f"{m}.weight" for m in gguf_weights}
        if "lm_head" in gguf_weights and config.tie_word_embeddings:
            from_gguf.add("embed_tokens.weight")
        missing = {(n, shard) for n, shard in missing if n not in from_gguf}

    def read_from_gguf(hf_name: str) -> bool:
        module, _, suffix = hf_name.removeprefix("model.").rpartition(".")
        return f"{_fused_module(module)[0]}.{suffix}" in from_gguf

    with torch.no_grad():
        for hf_name, tensor in _read_safetensors(model_dir, skip=read_from_gguf):
            if hf_name.endswith(_IGNORED_SUFFIXES):
                continue
            name = hf_name.removeprefix("model.")
            module, _, suffix = name.rpartition(".")
            if module == "lm_head" and config.tie_word_embeddings:
                continue  # some exporters write the tied head anyway
            if qc is not None and qc.holds(suffix, tensor) and module.rpartition(".")[2] in _HF_SHAPES:
                quant_parts.setdefault(module, {})[suffix] = tensor
                continue
            if group is not None:
                tensor = group.shard(full, name, tensor)
            shard = None
            parts = name.split(".")
            if len(parts) >= 2 and parts[-2] in _FUSED:
                fused, shard = _FUSED[parts[-2]]
                name = ".".join([*parts[:-2], fused, parts[-1]])
            if name not in params:
                raise ValueError(f"unexpected tensor {hf_name!r} in {model_dir} for {config.model_type}")
            target = params[name]
            if shard is not None:
                target = target.narrow(0, *_shard_rows(config, name, shard))
            if target.shape != tensor.shape:
                raise ValueError(
                    f"{hf_name}: checkpoint shape {tuple(tensor.shape)} != {tuple(target.shape)}"
                )
            target.copy_(tensor)
            missing.discard((name, shard))
        quantized, fused_of = {}, {}
        for module, parts in quant_parts.items():
            proj = module.rpartition(".")[2]
            quantized[module] = read_quantized_module(module, parts, qc, *_HF_SHAPES[proj](config))
            fused_of[module], shard = _fused_module(module)
            missing.discard((f"{fused_of[module]}.weight", shard))
        weights, perms, unfused = fuse_quantized_modules(quantized)
        for module, (weight, perm) in quantized.items():
            if method is None or fused_of[module] in unfused:
                _dequantize_into(params, config, module, weight, perm)
        if method is not None and unfused:
            log.warning(
                "%s: %s load dequantized (their shards' column orders differ, or not all are quantized)",
                model_dir.name,
                unfused,
            )
    if missing:
        names = sorted(f"{n}[{s}]" if s is not None else n for n, s in missing)
        raise ValueError(f"{model_dir}: weights missing from the checkpoint: {', '.join(names[:10])}")
    model.eval()
    if method == "gguf":
        model.quantize_linears(gguf_weights)
    elif method is not None:
        model.quantize_linears({n: w for n, w in weights.items() if n not in unfused}, perms)
    if can_pack_linears(dtype, torch.device(device)):
        model.pack_linears()
    log.info(
        "loaded %s (%s, %d layers) as %s%s on %s in %.2f s",
        model_dir.name,
        config.model_type,
        config.num_layers,
        dtype,
        f" with {method} weights kept quantized" if method else "",
        device,
        time.perf_counter() - start,
    )
    return model


# The [out, in] shape of each quantizable HF projection.
_HF_SHAPES = {
    "q_proj": lambda c: (c.q_size, c.hidden_size),
    "k_proj": lambda c: (c.kv_size, c.hidden_size),
    "v_proj": lambda c: (c.kv_size, c.hidden_size),
    "o_proj": lambda c: (c.hidden_size, c.q_size),
    "gate_proj": lambda c: (c.intermediate_size, c.hidden_size),
    "up_proj": lambda c: (c.intermediate_size, c.hidden_size),
    "down_proj": lambda c: (c.hidden_size, c.intermediate_size),
    "lm_head": lambda c: (c.vocab_size, c.hidden_size),  # an untied head quantized too
}


def _fused_module(module: str) -> tuple[str, int | None]:
    """The model's module an HF module's weight loads into (layers.0.self_attn.k_proj -> qkv_proj), and
    its shard there (None: the whole weight)."""
    parent, _, proj = module.rpartition(".")
    fused, shard = _FUSED.get(proj, (proj, None))
    return f"{parent}.{fused}" if parent else fused, shard


def _dequantize_into(
    params: dict[str, torch.nn.Parameter],
    config: ModelConfig,
    module: str,
    weight: QuantizedWeight,
    perm: torch.Tensor | None,
) -> None:
    """An HF module's quantized weight, dequantized in float32 (its columns back in order), into its
    (fused) parameter."""
    w = dequantize(weight)
    if perm is not None:
        w = torch.empty_like(w).index_copy_(1, perm, w)
    fused, shard = _fused_module(module)
    target = params[f"{fused}.weight"]
    if shard is not None:
        target = target.narrow(0, *_shard_rows(config, fused, shard))
    target.copy_(w)


def _shard_rows(config: ModelConfig, name: str, shard: int) -> tuple[int, int]:
    if "qkv_proj" in name:
        starts = (0, config.q_size, config.q_size + config.kv_size)
        sizes = (config.q_size, config.kv_size, config.kv_size)
        return starts[shard], sizes[shard]
    return shard * config.intermediate_size, config.intermediate_size


def _read_safetensors(
    model_dir: Path, skip: Callable[[str], bool] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        paths = [model_dir / f for f in files]
    else:
        paths = sorted(model_dir.glob("*.safetensors"))
    if not paths:
        pickled = [p.name for p in model_dir.glob("*.bin")] + [p.name for p in model_dir.glob("*.pt*")]
        hint = f" (found {', '.join(pickled)}: pickle checkpoints are not loaded)" if pickled else ""
        raise FileNotFoundError(f"no *.safetensors in {model_dir}{hint}")
    for path in paths:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                if skip is None or not skip(key):
                    yield key, f.get_tensor(key)
