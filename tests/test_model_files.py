"""Model files: the default GGUF converted once into a cache, folders used as is, torch-free helpers."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from pathlib import Path

import pytest
from safetensors import safe_open

from pagedserve import model_files
from pagedserve.launcher import python_command
from pagedserve.model_files import (
    default_gguf_path,
    load_generation_info,
    load_tokenizer,
    model_name,
    resolve_model,
)


@pytest.mark.slow
def test_default_model_converts_to_safetensors_config_and_tokenizer_with_chat_template(default_model_dir):
    config = json.loads((default_model_dir / "config.json").read_text())
    assert config["model_type"] == "llama" and config["tie_word_embeddings"] is True
    assert "quantization_config" not in config  # the folder must load as a plain float checkpoint
    with safe_open(str(default_model_dir / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        assert f.get_tensor("model.embed_tokens.weight").shape == (
            config["vocab_size"],
            config["hidden_size"],
        )
    assert "lm_head.weight" not in names  # tied
    assert len(names) == 2 + 9 * config["num_hidden_layers"]
    tokenizer = load_tokenizer(default_model_dir)
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert chat.endswith("<|im_start|>assistant\n")
    assert model_name(default_model_dir) == "SmolLM2-135M-Instruct"
    info = load_generation_info(default_model_dir)
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in info.eos_token_ids
    assert info.max_model_len == 8192


@pytest.mark.slow
def test_second_resolve_reuses_the_cache_without_converting(default_model_dir, monkeypatch):
    def fail(*args):
        raise AssertionError("converted again")

    monkeypatch.setattr(model_files, "_convert", fail)
    assert resolve_model("default", cache_dir=default_model_dir.parent) == default_model_dir
    assert resolve_model("smollm2", cache_dir=default_model_dir.parent) == default_model_dir
    assert resolve_model(str(default_gguf_path()), cache_dir=default_model_dir.parent) == default_model_dir


def _fake_gguf(tmp_path: Path) -> Path:
    gguf = tmp_path / "src" / "Tiny-Model-Q8_0.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF fake")
    return gguf


def test_concurrent_resolves_convert_once(tmp_path, monkeypatch):
    calls = []

    def slow_convert(gguf, out):
        calls.append(gguf)
        time.sleep(0.3)
        (out / "config.json").write_text("{}")
        (out / model_files.MARKER).write_text(json.dumps({"name": "Tiny-Model"}))

    monkeypatch.setattr(model_files, "_convert", slow_convert)
    gguf, results = _fake_gguf(tmp_path), []
    threads = [
        threading.Thread(target=lambda: results.append(resolve_model(str(gguf), tmp_path / "cache")))
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(set(results)) == 1 and len(results) == 3
    assert results[0].name.startswith("Tiny-Model-Q8_0-") and model_name(results[0]) == "Tiny-Model"
    assert [p.name for p in results[0].parent.iterdir() if not p.name.endswith(".lock")] == [results[0].name]


def test_failed_conversion_leaves_nothing_behind(tmp_path, monkeypatch):
    def broken_convert(gguf, out):
        (out / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    monkeypatch.setattr(model_files, "_convert", broken_convert)
    with pytest.raises(RuntimeError, match="disk full"):
        resolve_model(str(_fake_gguf(tmp_path)), tmp_path / "cache")
    assert [p.name for p in (tmp_path / "cache").iterdir() if not p.name.endswith(".lock")] == []


def test_folder_with_config_is_used_as_is(tmp_path):
    folder = tmp_path / "my-model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"max_position_embeddings": 4096, "eos_token_id": 7}))
    assert resolve_model(str(folder)) == folder
    assert model_name(folder) == "my-model"
    info = load_generation_info(folder)
    assert info.eos_token_ids == (7,) and info.max_model_len == 4096


@pytest.mark.parametrize("spec", ["/no/such/model", "no-such-model-name"])
def test_unknown_model_spec_gives_clear_error(spec):
    with pytest.raises(FileNotFoundError, match=r"not found.*never downloaded"):
        resolve_model(spec)


def test_folder_without_config_is_rejected(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        resolve_model(str(tmp_path))


@pytest.mark.parametrize(
    ("file", "name"),
    [
        ("SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct"),
        ("Meta-Llama-3.1-8B-Instruct-Q4_K_M.gguf", "Meta-Llama-3.1-8B-Instruct"),
        ("qwen2.5-0.5b-instruct-fp16.gguf", "qwen2.5-0.5b-instruct"),
        ("Mistral-7B-v0.3.gguf", "Mistral-7B-v0.3"),
    ],
)
def test_model_name_drops_the_quantization_suffix(file, name):
    assert model_name(Path(file)) == name


def test_importing_model_files_does_not_import_torch():
    code = (
        "import sys, pagedserve.model_files; "
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'imported torch'"
    )
    subprocess.run(python_command("-c", code), check=True)


@pytest.mark.slow
def test_tokenizer_and_generation_info_work_without_torch(default_model_dir):
    # The gateway's environment has no torch; make it unimportable here to prove these don't need it.
    code = f"""
import sys
sys.modules["torch"] = None
from pagedserve.model_files import load_generation_info, load_tokenizer, model_name, resolve_model
folder = resolve_model({str(default_model_dir)!r})
tokenizer = load_tokenizer(folder)
assert tokenizer.chat_template and tokenizer("Paris")["input_ids"]
assert load_generation_info(folder).eos_token_ids and model_name(folder) == "SmolLM2-135M-Instruct"
"""
    subprocess.run(python_command("-c", code), check=True)


def test_cache_key_follows_content_not_modification_time(tmp_path):
    from pagedserve.model_files import converted_dir

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + bytes(range(256)) * 10)
    before = converted_dir(gguf, tmp_path)
    os.utime(gguf, (1, 1))
    assert converted_dir(gguf, tmp_path) == before
    gguf.write_bytes(b"GGUF" + bytes(range(255, -1, -1)) * 10)
    assert converted_dir(gguf, tmp_path) != before
