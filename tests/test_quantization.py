"""Quantized weights: the kernels' quantized linear against a float64 oracle, GGUF blocks against gguf's own
dequantization, and the default model served from its Q4_1 GGUF against the dequantized float32 model."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from pagedserve.kernels import cpu_ops, get_ops
from pagedserve.kernels.ops import linear_for
from pagedserve.kernels.quant import (
    SCALE_F16,
    SCALE_F16_NO_OFFSET,
    SCALE_F32,
    PackedRows,
    QuantizedWeight,
    concat_rows,
    dequantize,
    pack_quant_weight,
    scale_kind,
)
from pagedserve.worker_svc.quantization import detect_quantization, gguf_block, resolve_quantization

gguf = pytest.importorskip("gguf")


def _quant_kernels():
    ops = get_ops(torch.device("cpu"))
    kernels = linear_for(ops, torch.float32)
    if kernels is None or getattr(kernels, "linear_quant", None) is None:
        pytest.skip("this build of the CPU kernels has no quantized linear (AVX-512)")
    return kernels


def _random_weight(n: int, k: int, bits: int, group: int, kind: int, seed: int) -> QuantizedWeight:
    g = torch.Generator().manual_seed(seed)
    if bits == 4:
        codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    else:
        codes = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    scales = torch.rand(n, k // group, generator=g) * 0.02 + 1e-3
    offsets = -torch.rand(n, k // group, generator=g) * 0.1
    if kind != SCALE_F32:
        scales, offsets = scales.half().float(), offsets.half().float()
    else:
        scales = scales * (1 + 2**-20)  # not fp16 values
    q = QuantizedWeight(codes, scales, None if kind == SCALE_F16_NO_OFFSET else offsets, bits, group)
    assert scale_kind(q) == kind
    return q


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("kind", [SCALE_F32, SCALE_F16, SCALE_F16_NO_OFFSET])
@pytest.mark.parametrize("group", [16, 32, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_linear_matches_float64_oracle(bits, kind, group, dtype):
    kernels = _quant_kernels()
    if bits == 4 and group % 8:
        pytest.skip("int4 groups are multiples of 8")
    # many bf16 rows (from 6) take AMX tiles where the CPU has them: 19 rows are two x tiles, the second
    # padded; 40 rows three, the third multiplied by W tiles dequantized for the first two; N = 70 ends in
    # a block without a partner and columns short of 16
    for n, k, m, bias in (
        (40, 256, 1, True),
        (48, 384, 2, False),
        (33, 128, 5, True),
        (70, 256, 19, True),
        (50, 256, 40, False),
    ):
        _check_against_oracle(
            kernels, _random_weight(n, k, bits, group, kind, seed=n * k + m), m, dtype, bias
        )


def _check_against_oracle(kernels, q: QuantizedWeight, m: int, dtype: torch.dtype, bias: bool) -> None:
    n, k = q.shape
    w = dequantize(q).double()
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
    b = torch.randn(n).to(dtype) if bias else None
    y = kernels.linear_quant(x, pack_quant_weight(q), b)
    assert y.dtype == dtype and y.shape == (m, n)
    exact = x.double() @ w.T + (b.double() if bias else 0)
    bound = x.double().abs() @ w.abs().T
    # float32: the bound of float32 summation; bf16: one rounding of the output and, for many rows, of each
    # weight to bf16 (the dequantizing paths)
    tol = 1e-5 * bound if dtype == torch.float32 else 2**-8 * (exact.abs() + bound)
    assert ((y.double() - exact).abs() <= tol + 1e-6).all(), (q.bits, scale_kind(q), q.group_size, n, k, m)


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_linear_many_rows_without_amx_tiles(bits):
    """Many bf16 rows where AMX cannot take the weight (K not a multiple of 32, or AMX switched off): the
    blocks dequantized for the kernels' other bf16 linear."""
    kernels = _quant_kernels()
    extension = cpu_ops.load()
    for n, k, m, amx in ((40, 80, 19, True), (70, 256, 40, False)):
        before = extension.set_amx_enabled(amx)
        try:
            _check_against_oracle(
                kernels, _random_weight(n, k, bits, 16, SCALE_F16, seed=k + m), m, torch.bfloat16, True
            )
        finally:
            extension.set_amx_enabled(before)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("kind", [SCALE_F32, SCALE_F16, SCALE_F16_NO_OFFSET])
def test_packed_rows_are_the_dequantized_rows_bit_for_bit(bits, kind):
    """The embedding lookup of a quantized tied head: rows gathered from the packed codes (any row of a
    block of 16, the last block short) equal dequantize's rows exactly."""
    q = _random_weight(37, 128, bits, 32 if bits == 4 else 16, kind, seed=bits + kind)
    rows = torch.tensor([0, 36, 5, 5, 17, 16, 15, 31, 32])
    assert torch.equal(PackedRows(pack_quant_weight(q))(rows), dequantize(q)[rows])
    assert PackedRows(pack_quant_weight(q))(rows[:0]).shape == (0, 128)


def test_quantized_linear_takes_any_batch_shape_and_checks_k():
    kernels = _quant_kernels()
    q = _random_weight(32, 64, 4, 32, SCALE_F16, seed=1)
    packed = pack_quant_weight(q)
    x = torch.randn(2, 3, 64)
    y = kernels.linear_quant(x, packed, None)
    torch.testing.assert_close(y, kernels.linear_quant(x.reshape(6, 64), packed, None).reshape(2, 3, 32))
    with pytest.raises(RuntimeError, match="K = 48"):
        kernels.linear_quant(torch.randn(1, 48), packed, None)
    with pytest.raises(RuntimeError, match="quantized weight"):
        kernels.linear_quant(x, packed[:-64], None)


# --- GGUF blocks ---------------------------------------------------------------------------------------

# Each type's block: (bytes, offsets of its fp16 fields)
_GGUF_TYPES = {
    "Q8_0": (34, [0]),
    "Q4_0": (18, [0]),
    "Q4_1": (20, [0, 2]),
    "Q4_K": (144, [0, 2]),
    "Q6_K": (210, [208]),
}


@pytest.mark.parametrize("kind", list(_GGUF_TYPES))
def test_gguf_blocks_dequantize_bit_for_bit_as_gguf(kind):
    size, f16_fields = _GGUF_TYPES[kind]
    qtype = getattr(gguf.GGMLQuantizationType, kind)
    block_elems = gguf.GGML_QUANT_SIZES[qtype][0]
    rows, cols = 6, 2 * 256
    rng = np.random.default_rng(len(kind) + size)
    raw = rng.integers(0, 256, size=(rows, cols // block_elems, size), dtype=np.uint8)
    for at in f16_fields:  # random bits, but finite fp16 scales of any sign and magnitude
        values = rng.standard_normal(raw.shape[:2]) * rng.choice([1e-4, 1e-2, 1.0], size=raw.shape[:2])
        raw[:, :, at : at + 2] = values.astype(np.float16).view(np.uint8).reshape(*raw.shape[:2], 2)
    raw = raw.reshape(rows, -1)
    expected = gguf.quants.dequantize(raw, qtype)
    assert expected.shape == (rows, cols)
    q = gguf_block(raw, kind, rows, cols)
    q.check(kind)
    got = dequantize(q).numpy()
    assert got.dtype == np.float32
    expected = expected.astype(np.float32)
    # the same bits, but for the sign of a zero (Q4_0: d * 8 - 8 * d is +0 where gguf's d * (8 - 8) is -0 for
    # a negative d)
    differ = got.view(np.uint32) != expected.view(np.uint32)
    assert not differ[(got != 0) | (expected != 0)].any()
    assert np.array_equal(got, expected)


def test_fused_weights_of_mixed_formats_keep_their_values():
    # a q/k/v of Q4_K rows (int4, groups of 32) and Q6_K rows (int8, groups of 16), as Q4_K_M files mix them
    parts = [
        _random_weight(16, 64, 4, 32, SCALE_F32, seed=1),
        _random_weight(16, 64, 8, 16, SCALE_F32, seed=2),
    ]
    fused = concat_rows(parts)
    assert (fused.bits, fused.group_size) == (8, 16)
    expected = torch.cat([dequantize(p) for p in parts])
    torch.testing.assert_close(dequantize(fused), expected, rtol=2**-23, atol=1e-7)


def test_malformed_quantized_weight_names_the_tensor():
    q = _random_weight(16, 64, 4, 32, SCALE_F16, seed=1)
    bad = QuantizedWeight(q.codes, q.scales[:, :1], q.offsets, 4, 32)
    with pytest.raises(ValueError, match=r"layers\.3\.mlp\.down_proj: malformed.*scales"):
        bad.check("layers.3.mlp.down_proj")
    with pytest.raises(ValueError, match="group size 24 does not divide"):
        QuantizedWeight(q.codes, q.scales, q.offsets, 4, 24).check("w")


def test_quantization_config_without_method_fails_at_load(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "llama", "quantization_config": {"bits": 4}})
    )
    with pytest.raises(ValueError, match="quant_method"):
        detect_quantization(tmp_path)
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "llama", "quantization_config": {"quant_method": "bitsandbytes"}})
    )
    with pytest.raises(ValueError, match="unsupported quant_method 'bitsandbytes'"):
        detect_quantization(tmp_path)


# --- the default model -------------------------------------------------------------------------------


@pytest.mark.slow
def test_default_model_kept_quantized_decodes_as_the_dequantized_float32_model(default_model_dir):
    from test_model import _greedy, default_model_prompts

    from pagedserve.model_files import load_tokenizer
    from pagedserve.worker_svc.loader import load_model
    from pagedserve.worker_svc.model import QuantEmbedding, QuantLinear

    _quant_kernels()
    assert detect_quantization(default_model_dir) == "gguf"
    quantized = load_model(default_model_dir, torch.float32, "cpu", quantization="gguf")
    dequantized = load_model(default_model_dir, torch.float32, "cpu", quantization="none")
    assert isinstance(quantized.layers[0].mlp.gate_up_proj, QuantLinear)
    assert isinstance(quantized.tied_head, QuantLinear)  # the tied head from the Q8_0 token embedding
    # whose codes the embedding lookup reads: the same rows as the dequantized model's, no float copy held
    assert isinstance(quantized.embed_tokens, QuantEmbedding)
    assert not any(name.startswith("embed_tokens.") for name, _ in quantized.named_parameters())
    ids = torch.arange(quantized.config.vocab_size)
    assert torch.equal(quantized.embed_tokens(ids), dequantized.embed_tokens.weight)
    assert quantized.stack is not None  # all layers in one call, through the quantized linear
    assert not any(isinstance(m, QuantLinear) for m in dequantized.modules())
    q_bytes = sum(m.weight.numel() for m in quantized.modules() if isinstance(m, QuantLinear))
    assert (
        q_bytes < 0.26 * sum(p.numel() * 4 for n, p in dequantized.named_parameters() if "proj" in n) + 40e6
    )

    tokenizer = load_tokenizer(default_model_dir)
    prompts = default_model_prompts(tokenizer)
    got = _greedy(quantized, prompts, 16)
    assert got == _greedy(dequantized, prompts, 16)
    assert tokenizer.decode(got[0]).startswith("The capital of France is Paris.")


# --- GPTQ and AWQ checkpoints --------------------------------------------------------------------------

SMALL = dict(
    vocab_size=256,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)


def _small_llama(tmp_path_factory) -> tuple[dict[str, torch.Tensor], dict]:
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**SMALL)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(0)
    state = {}
    for name, p in hf.state_dict().items():
        noise = torch.randn(p.shape, generator=gen)
        state[name] = 1.0 + 0.2 * noise if "norm" in name else 0.15 * noise
    return state, config.to_dict()


def _logits(model, tokens: list[torch.Tensor]) -> torch.Tensor:
    from test_model import PagedCache

    cache = PagedCache(model, len(tokens), 16)
    return cache.run(model, tokens, [(s, 0, len(t)) for s, t in enumerate(tokens)])


@pytest.fixture(scope="module")
def small_llama(tmp_path_factory):
    return _small_llama(tmp_path_factory)


def _check_against_reference(out, reference, expect_quantized=True):
    from pagedserve.worker_svc.loader import load_model
    from pagedserve.worker_svc.model import QuantLinear

    model = load_model(out, torch.float32, "cpu")
    ref = load_model(reference, torch.float32, "cpu")
    assert isinstance(model.layers[1].mlp.down_proj, QuantLinear) == expect_quantized
    gen = torch.Generator().manual_seed(3)
    tokens = [torch.randint(0, 256, (n,), generator=gen) for n in (9, 1, 17)]
    got, expected = _logits(model, tokens), _logits(ref, tokens)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    # and the checkpoint read dequantized (--quantization none) is the reference itself
    dense = load_model(out, torch.float32, "cpu", quantization="none")
    assert not any(isinstance(m, QuantLinear) for m in dense.modules())
    torch.testing.assert_close(_logits(dense, tokens), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 64, 96, 128, -1])  # 96: K = 256 ends in a shorter group
@pytest.mark.parametrize("desc_act", [False, True])
@pytest.mark.parametrize("sym", [True, False])
def test_gptq_checkpoint_matches_its_dequantized_float32_model(
    small_llama, tmp_path, bits, group, desc_act, sym
):
    from quant_checkpoints import write_quantized

    _quant_kernels()
    state, config = small_llama
    write_quantized(state, config, tmp_path / "q", tmp_path / "ref", "gptq", bits, group, sym, desc_act)
    _check_against_reference(tmp_path / "q", tmp_path / "ref")


def test_gptq_v2_zero_points_are_read_as_stored(small_llama, tmp_path):
    from quant_checkpoints import write_quantized

    _quant_kernels()
    state, config = small_llama
    write_quantized(state, config, tmp_path / "q", tmp_path / "ref", "gptq", 4, 64, False, False, v1=False)
    _check_against_reference(tmp_path / "q", tmp_path / "ref")


@pytest.mark.parametrize("group", [32, 64, 128])
def test_awq_gemm_checkpoint_matches_its_dequantized_float32_model(small_llama, tmp_path, group):
    from quant_checkpoints import write_quantized

    _quant_kernels()
    state, config = small_llama
    write_quantized(state, config, tmp_path / "q", tmp_path / "ref", "awq", 4, group, sym=False)
    _check_against_reference(tmp_path / "q", tmp_path / "ref")


def test_malformed_gptq_checkpoints_fail_at_load_naming_the_tensor(small_llama, tmp_path):
    from quant_checkpoints import write_quantized
    from safetensors.torch import load_file, save_file

    from pagedserve.worker_svc.loader import load_model

    state, config = small_llama
    write_quantized(state, config, tmp_path / "q", tmp_path / "ref", "gptq", 4, 64)
    path = tmp_path / "q" / "model.safetensors"
    tensors = load_file(str(path))
    good = dict(tensors)
    tensors["model.layers.1.self_attn.k_proj.scales"] = tensors["model.layers.1.self_attn.k_proj.scales"][:1]
    save_file(tensors, str(path))
    with pytest.raises(ValueError, match=r"layers\.1\.self_attn\.k_proj\.scales: shape \(1, 64\)"):
        load_model(tmp_path / "q", torch.float32, "cpu")
    del good["model.layers.0.mlp.up_proj.qzeros"]
    save_file(good, str(path))
    with pytest.raises(ValueError, match=r"layers\.0\.mlp\.up_proj\.qzeros is missing"):
        load_model(tmp_path / "q", torch.float32, "cpu")
    conf = json.loads((tmp_path / "q" / "config.json").read_text())
    conf["quantization_config"]["bits"] = 3
    (tmp_path / "q" / "config.json").write_text(json.dumps(conf))
    with pytest.raises(ValueError, match="bits 3"):
        load_model(tmp_path / "q", torch.float32, "cpu")


# --- compressed-tensors checkpoints -------------------------------------------------------------------


@pytest.mark.parametrize(
    "bits, strategy, group, sym, fmt, ignore",
    [
        (4, "group", 32, True, "pack-quantized", ("lm_head",)),
        # a k_proj left in float: its q/k/v loads dequantized, the rest quantized
        (4, "group", 64, False, "pack-quantized", ("lm_head", r"re:.*layers\.0\.self_attn\.k_proj$")),
        (4, "channel", None, True, "pack-quantized", ("lm_head",)),
        (8, "tensor", None, False, "pack-quantized", ("lm_head",)),
        (8, "group", 128, False, "pack-quantized", ()),  # the LM head quantized too
        (8, "group", 64, False, "naive-quantized", ("lm_head",)),
    ],
)
def test_compressed_tensors_checkpoint_matches_its_dequantized_float32_model(
    small_llama, tmp_path, bits, strategy, group, sym, fmt, ignore
):
    """llm-compressor's W4A16 / W8A16 checkpoints, written by compressed-tensors' own compressors: the same
    logits as the float32 model of the weights its unpacking gives, and the same greedy tokens."""
    pytest.importorskip("compressed_tensors")
    from quant_checkpoints import write_compressed_tensors
    from test_model import _greedy

    from pagedserve.worker_svc.loader import load_model
    from pagedserve.worker_svc.model import QuantLinear

    _quant_kernels()
    state, config = small_llama
    write_compressed_tensors(
        state, config, tmp_path / "q", tmp_path / "ref", bits, strategy, group, sym, fmt, ignore
    )
    assert detect_quantization(tmp_path / "q") == "compressed-tensors"
    assert resolve_quantization(tmp_path / "q", "auto") == "compressed-tensors"  # kept quantized by default
    model = load_model(tmp_path / "q", torch.float32, "cpu", quantization="compressed-tensors")
    ref = load_model(tmp_path / "ref", torch.float32, "cpu")
    assert isinstance(model.layers[1].mlp.down_proj, QuantLinear)
    assert isinstance(model.layers[0].self_attn.qkv_proj, QuantLinear) == ("k_proj" not in str(ignore))
    assert isinstance(model.lm_head, QuantLinear) == ("lm_head" not in ignore)
    tokens = [torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)) for n in (9, 1, 17)]
    torch.testing.assert_close(_logits(model, tokens), _logits(ref, tokens), atol=1e-4, rtol=1e-4)
    if bits == 4 and not sym:  # greedy decoding through the paged cache too (in one case: it takes seconds)
        prompts = [[1, 5, 9, 33, 70], [200, 3]]
        assert _greedy(model, prompts, 4) == _greedy(ref, prompts, 4)
    if fmt == "naive-quantized":  # and read dequantized (--quantization none): the reference itself
        dense = load_model(tmp_path / "q", torch.float32, "cpu", quantization="none")
        assert not any(isinstance(m, QuantLinear) for m in dense.modules())
        torch.testing.assert_close(_logits(dense, tokens), _logits(ref, tokens), atol=1e-5, rtol=1e-5)


def test_malformed_compressed_tensors_checkpoints_fail_at_load_naming_the_field(small_llama, tmp_path):
    pytest.importorskip("compressed_tensors")
    from quant_checkpoints import write_compressed_tensors
    from safetensors.torch import load_file, save_file

    from pagedserve.worker_svc.loader import load_model

    state, config = small_llama
    write_compressed_tensors(state, config, tmp_path / "q", tmp_path / "ref", 4, "group", 64, sym=False)
    path, conf_path = tmp_path / "q" / "model.safetensors", tmp_path / "q" / "config.json"
    tensors, conf = load_file(str(path)), json.loads(conf_path.read_text())

    def fails(match, edit_tensors=None, edit_config=None):
        t, c = dict(tensors), json.loads(json.dumps(conf))
        if edit_tensors:
            edit_tensors(t)
        if edit_config:
            edit_config(c["quantization_config"])
        save_file(t, str(path))
        conf_path.write_text(json.dumps(c))
        with pytest.raises(ValueError, match=match):
            load_model(tmp_path / "q", torch.float32, "cpu")

    weights = lambda qc: qc["config_groups"]["group_0"]["weights"]  # noqa: E731
    fails(
        r"config_groups\.group_0\.weights: num_bits 3", edit_config=lambda qc: weights(qc).update(num_bits=3)
    )
    fails(r"weights\.strategy 'block'", edit_config=lambda qc: weights(qc).update(strategy="block"))
    fails(r"group_size None", edit_config=lambda qc: weights(qc).update(group_size=None))
    fails(r"format 'marlin-24'", edit_config=lambda qc: qc.update(format="marlin-24"))
    fails(r"config_groups None", edit_config=lambda qc: qc.update(config_groups=None))
    fails(
        r"input_activations: activation quantization",
        edit_config=lambda qc: qc["config_groups"]["group_0"].update(input_activations={"num_bits": 8}),
    )
    k_proj = "model.layers.1.self_attn.k_proj"
    fails(
        r"layers\.1\.self_attn\.k_proj\.weight_scale: shape \(64, 4\), expected \(64, 2\)",
        edit_tensors=lambda t: t.update({f"{k_proj}.weight_scale": t[f"{k_proj}.weight_scale"].repeat(1, 2)}),
    )
    fails(
        r"layers\.1\.self_attn\.k_proj\.weight_zero_point is missing",
        edit_tensors=lambda t: t.pop(f"{k_proj}.weight_zero_point"),
    )
    fails(
        r"layers\.1\.self_attn\.k_proj\.weight_packed: shape \(64, 8\), expected \(64, 16\)",
        edit_tensors=lambda t: t.update(
            {f"{k_proj}.weight_packed": t[f"{k_proj}.weight_packed"][:, :8].contiguous()}
        ),
    )
    fails(  # quantized tensors for a module the config ignores
        r"layers\.1\.self_attn\.k_proj: quantized tensors in the checkpoint, but .*config_groups has no scheme",
        edit_config=lambda qc: qc.update(ignore=["lm_head", k_proj]),
    )


@pytest.mark.slow
@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_default_model_shape_gptq_and_awq_decode_as_their_dequantized_models(
    default_model_dir, tmp_path, method
):
    """The default model's own weights quantized into each format (GPTQ: 4 bits, groups of 128, act order;
    AWQ: 4 bits, groups of 64): identical greedy tokens to the dequantized float32 model."""
    from quant_checkpoints import write_quantized
    from safetensors.torch import load_file
    from test_model import _greedy, default_model_prompts

    from pagedserve.model_files import load_tokenizer
    from pagedserve.worker_svc.loader import load_model

    _quant_kernels()
    state = {
        f"model.{k}" if not k.startswith("model.") else k: v
        for k, v in load_file(str(default_model_dir / "model.safetensors")).items()
    }
    config = json.loads((default_model_dir / "config.json").read_text())
    write_quantized(
        state,
        config,
        tmp_path / "q",
        tmp_path / "ref",
        method,
        4,
        128 if method == "gptq" else 64,  # GPTQ: K = 576 ends in a shorter group; AWQ needs whole groups
        sym=method == "gptq",
        desc_act=method == "gptq",
    )
    prompts = default_model_prompts(load_tokenizer(default_model_dir))
    got = _greedy(load_model(tmp_path / "q", torch.float32, "cpu", quantization=method), prompts, 16)
    assert got == _greedy(load_model(tmp_path / "ref", torch.float32, "cpu"), prompts, 16)


def test_auto_keeps_gptq_quantized_and_a_gguf_dequantized(small_llama, tmp_path, default_model_dir):
    from quant_checkpoints import write_quantized

    state, config = small_llama
    write_quantized(state, config, tmp_path / "q", tmp_path / "ref", "gptq", 4, 64)
    assert resolve_quantization(tmp_path / "q", "auto") == "gptq"
    assert resolve_quantization(tmp_path / "q", "none") is None
    assert resolve_quantization(default_model_dir, "auto") is None
    assert resolve_quantization(default_model_dir, "gguf") == "gguf"
    with pytest.raises(ValueError, match=r"--quantization gptq, but .* is gguf"):
        resolve_quantization(default_model_dir, "gptq")


def test_batch_invariant_kernels_load_a_quantized_checkpoint_dequantized(small_llama, tmp_path):
    """The quantized linear's sums depend on the step's rows: with the kernels batch-invariant
    (--deterministic) a GPTQ checkpoint loads as with --quantization none, bit for bit."""
    from quant_checkpoints import write_quantized

    from pagedserve.kernels import get_ops
    from pagedserve.worker_svc.loader import load_model
    from pagedserve.worker_svc.model import QuantLinear

    _quant_kernels()
    state, config = small_llama
    write_quantized(state, config, tmp_path / "q", tmp_path / "ref", "gptq", 4, 64)
    ops = get_ops(torch.device("cpu"))
    before = ops.batch_invariant
    ops.batch_invariant = True
    try:
        model = load_model(tmp_path / "q", torch.float32, "cpu")
        dense = load_model(tmp_path / "q", torch.float32, "cpu", quantization="none")
        assert not any(isinstance(m, QuantLinear) for m in model.modules())
        tokens = [torch.arange(7), torch.arange(3, 20)]
        assert torch.equal(_logits(model, tokens), _logits(dense, tokens))
    finally:
        ops.batch_invariant = before
    assert any(isinstance(m, QuantLinear) for m in load_model(tmp_path / "q", torch.float32, "cpu").modules())


def test_tensor_parallelism_refuses_quantized_checkpoints_by_name(small_llama, tmp_path):
    from quant_checkpoints import write_quantized

    from pagedserve.worker_svc.loader import load_model

    class OneOfTwoRanks:  # the loader refuses before it reads the group
        size = 2

    state, config = small_llama
    write_quantized(state, config, tmp_path / "q", tmp_path / "ref", "gptq", 4, 64)
    with pytest.raises(ValueError, match="q: tensor parallelism does not shard quantized weights"):
        load_model(tmp_path / "q", torch.float32, "cpu", group=OneOfTwoRanks(), quantization="none")
