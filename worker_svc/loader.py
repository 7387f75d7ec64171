"""Load a Hugging Face model folder (config.json + safetensors) into a `CausalLM`."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from pagedserve.worker_svc.model import CausalLM, ModelConfig
from safetensors import safe_open

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
        # bfloat16 on CUDA; float32 on CPU. Measured on the 2-core development CPU (AMD EPYC with
        # avx512_bf16, torch 2.13, 2 threads), default model SmolLM2-135M, forward + compute_logits
        # through the paged cache, min (median) of 7 runs:
        #   prefill, 2 sequences x 128 tokens:   float32 471 (575) ms   bfloat16 269 (307) ms
        #   decode, 8 sequences x 64 context:    float32  79  (93) ms   bfloat16  42  (49) ms
        # bfloat16 is ~1.8x faster here, but it does not stay accurate: logits differ from float32 by up
        # to 1.2, the argmax differs at 3% of the positions of the chat prompt, and greedy output leaves
        # transformers' own (float32) output within 10 tokens on one of two test prompts. It is also only
        # fast on CPUs with native bf16 (avx512_bf16 / AMX); elsewhere it is emulated and slower. So "auto"
        # keeps float32 on CPU; --dtype bfloat16 opts into the speed.
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; expected one of: auto, {', '.join(_DTYPES)}")
    return _DTYPES[name]


def load_model(model_dir: Path | str, dtype: torch.dtype, device: torch.device | str) -> CausalLM:
    start = time.perf_counter()
    model_dir = Path(model_dir)
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"no config.json in {model_dir}")
    config = ModelConfig.from_hf_config(json.loads(config_path.read_text()))
    model = CausalLM(config, dtype, device)
    params = dict(model.named_parameters())
    # Fused parameters are complete once all their shards are loaded, the others once loaded.
    missing = {(name, None) for name in params}
    for name in ("qkv_proj", "gate_up_proj"):
        for param_name in [p for p in params if f".{name}." in p]:
            missing.discard((param_name, None))
            missing.update((param_name, i) for i in range(3 if name == "qkv_proj" else 2))

    with torch.no_grad():
        for hf_name, tensor in _read_safetensors(model_dir):
            if hf_name.endswith(_IGNORED_SUFFIXES):
                continue
            name = hf_name.removeprefix("model.")
            if name == "lm_head.weight" and config.tie_word_embeddings:
                continue  # some exporters write the tied head anyway
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
    if missing:
        names = sorted(f"{n}[{s}]" if s is not None else n for n, s in missing)
        raise ValueError(f"{model_dir}: weights missing from the checkpoint: {', '.join(names[:10])}")
    model.eval()
    log.info(
        "loaded %s (%s, %d layers) as %s on %s in %.2f s",
        model_dir.name,
        config.model_type,
        config.num_layers,
        dtype,
        device,
        time.perf_counter() - start,
    )
    return model


def _shard_rows(config: ModelConfig, name: str, shard: int) -> tuple[int, int]:
    if "qkv_proj" in name:
        starts = (0, config.q_size, config.q_size + config.kv_size)
        sizes = (config.q_size, config.kv_size, config.kv_size)
        return starts[shard], sizes[shard]
    return shard * config.intermediate_size, config.intermediate_size


def _read_safetensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
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
                yield key, f.get_tensor(key)
