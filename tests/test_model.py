"""Our flat-batch paged model against transformers' own implementation, family by family."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
)

from pagedserve.kernels import get_ops
from pagedserve.kernels.ops import linear_for
from pagedserve.model_files import load_generation_info, load_tokenizer
from pagedserve.worker_svc import loader
from pagedserve.worker_svc.loader import load_model, parse_dtype
from pagedserve.worker_svc.model import (
    AttentionMetadata,
    CausalLM,
    ModelConfig,
    PackedLinear,
    can_pack_linears,
)

VOCAB = 256
TINY = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
)

FAMILIES = {
    "llama_llama3_rope_untied": lambda: LlamaConfig(
        **TINY,
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            # small, so that the test positions cover the scaled, blended and kept frequency bands
            "original_max_position_embeddings": 32,
        },
    ),
    "llama_linear_rope_tied": lambda: LlamaConfig(
        **TINY,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "linear", "rope_theta": 500.0, "factor": 2.0},
    ),
    "mistral_untied": lambda: MistralConfig(**TINY, tie_word_embeddings=False, rope_theta=1e6),
    "qwen2_qkv_bias_tied": lambda: Qwen2Config(**TINY, tie_word_embeddings=True),
    "qwen3_qk_norm_explicit_head_dim": lambda: Qwen3Config(**TINY, head_dim=32, tie_word_embeddings=False),
}


def _randomize(model: torch.nn.Module, seed: int) -> None:
    # HF's init (std 0.02, norms at 1, zero biases) would hide mistakes in norms, biases and scaling.
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.2 * noise if "norm" in name else 0.15 * noise)


def _save_tiny_hf_model(config, path: Path, seed: int = 0, **save_kwargs) -> torch.nn.Module:
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    _randomize(hf, seed)
    hf.save_pretrained(path, safe_serialization=True, **save_kwargs)
    return hf


class PagedCache:
    """A paged KV cache with scattered block tables, and the metadata for one step over it."""

    def __init__(self, model: CausalLM, num_seqs: int, block_size: int, seed: int = 0) -> None:
        cfg = model.config
        self.block_size = block_size
        self.max_blocks = cfg.max_position // block_size
        num_blocks = num_seqs * self.max_blocks + 1
        shape = model.kv_cache_shape(num_blocks, block_size)
        # NaN-filled: reading a slot that was never written shows up in the logits.
        self.kv_caches = [
            (
                torch.full(shape, float("nan"), dtype=model.dtype),
                torch.full(shape, float("nan"), dtype=model.dtype),
            )
            for _ in range(cfg.num_layers)
        ]
        perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))
        self.block_tables = perm[: num_seqs * self.max_blocks].view(num_seqs, self.max_blocks).to(torch.int32)

    def step(self, chunks: list[tuple[int, int, int]]) -> tuple[torch.Tensor, AttentionMetadata]:
        """chunks: (sequence, first position, end position) computed in this step, in row order."""
        positions = torch.cat([torch.arange(a, b) for _, a, b in chunks])
        seqs = torch.tensor([s for s, _, _ in chunks])
        q_lens = torch.tensor([b - a for _, a, b in chunks])
        rows_seq = torch.repeat_interleave(seqs, q_lens)
        blocks = self.block_tables[rows_seq, positions // self.block_size].long()
        attn = AttentionMetadata(
            slot_mapping=blocks * self.block_size + positions % self.block_size,
            block_tables=self.block_tables[seqs],
            query_start_loc=torch.cat([torch.zeros(1), q_lens.cumsum(0)]).to(torch.int32),
            context_lens=torch.tensor([b for _, _, b in chunks], dtype=torch.int32),
            max_query_len=int(q_lens.max()),
        )
        return positions, attn

    def run(
        self,
        model: CausalLM,
        tokens: list[torch.Tensor],
        chunks: list[tuple[int, int, int]],
        output_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        positions, attn = self.step(chunks)
        input_ids = torch.cat([tokens[s][a:b] for s, a, b in chunks])
        return model.compute_logits(model(input_ids, positions, attn, self.kv_caches, output_rows)).float()


def _hf_logits(hf: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return hf(ids[None]).logits[0].float()


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = _save_tiny_hf_model(FAMILIES[request.param](), path)
    return hf, load_model(path, torch.float32, "cpu")


@pytest.mark.parametrize("block_size", [4, 16])
def test_flat_batch_of_sequences_matches_hf_logits_at_every_position(tiny, block_size):
    hf, model = tiny
    lengths = [7, 1, 23, 16]
    gen = torch.Generator().manual_seed(block_size)
    tokens = [torch.randint(0, VOCAB, (n,), generator=gen) for n in lengths]
    cache = PagedCache(model, len(lengths), block_size, seed=block_size)
    logits = cache.run(model, tokens, [(s, 0, n) for s, n in enumerate(lengths)])
    assert logits.dtype == torch.float32 and logits.shape == (sum(lengths), VOCAB)
    expected = torch.cat([_hf_logits(hf, t) for t in tokens])
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


def test_chunked_prefill_then_decode_matches_one_pass(tiny):
    hf, model = tiny
    gen = torch.Generator().manual_seed(1)
    tokens = [torch.randint(0, VOCAB, (n,), generator=gen) for n in (21, 12)]
    expected = [_hf_logits(hf, t) for t in tokens]
    cache = PagedCache(model, 2, block_size=4, seed=1)
    # Prefill chunks over cached context, a mixed step (one sequence decodes while the other prefills),
    # then decode-only steps.
    steps = [
        [(0, 0, 9), (1, 0, 5)],
        [(0, 9, 17), (1, 5, 6)],
        [(1, 6, 11), (0, 17, 18)],
        [(0, 18, 19), (1, 11, 12)],
        [(0, 19, 20)],
        [(0, 20, 21)],
    ]
    got = {0: [], 1: []}
    for chunks in steps:
        logits = cache.run(model, tokens, chunks)
        q_lens = [end - start for _, start, end in chunks]
        for (s, _, _), rows in zip(chunks, logits.split(q_lens), strict=True):
            got[s].append(rows)
    for s in (0, 1):
        torch.testing.assert_close(torch.cat(got[s]), expected[s], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_output_rows_are_those_rows_of_the_whole_batch(tmp_path, dtype):
    # A step's caller reads a few rows (those it samples from or scores prompt tokens with): the last layer
    # computes them alone, as decode rows, and still writes every row's K and V. Their logits are those of
    # the whole batch's rows (within the two attention paths' rounding), in the order asked, and every
    # later step sees the same cache.
    _save_tiny_hf_model(FAMILIES["qwen3_qk_norm_explicit_head_dim"](), tmp_path)
    model = load_model(tmp_path, dtype, "cpu")
    gen = torch.Generator().manual_seed(3)
    tokens = [torch.randint(0, VOCAB, (n,), generator=gen) for n in (30, 18, 9)]
    steps = [[(0, 0, 12), (1, 0, 17), (2, 0, 4)], [(2, 4, 9), (0, 12, 30), (1, 17, 18)]]
    # rows of each step: the sequences' last rows out of order, prompt rows, one twice; then none
    picks = [[[28, 11, 0, 5, 5], []], [[22, 4, 0, 9], [1]]]
    tol = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 0.1, "rtol": 0.05}
    for step_picks in picks:
        whole, part = (PagedCache(model, 3, block_size=4, seed=4) for _ in range(2))
        for chunks, rows in zip(steps, step_picks, strict=True):
            expected = whole.run(model, tokens, chunks)
            got = part.run(model, tokens, chunks, torch.tensor(rows, dtype=torch.int64))
            assert got.shape == (len(rows), VOCAB)
            torch.testing.assert_close(got, expected[rows], **tol)
            for (k1, v1), (k2, v2) in zip(whole.kv_caches, part.kv_caches, strict=True):
                assert torch.equal(k1.nan_to_num(), k2.nan_to_num()) and torch.equal(
                    v1.nan_to_num(), v2.nan_to_num()
                )


def test_loader_reads_sharded_checkpoints(tmp_path):
    hf = _save_tiny_hf_model(FAMILIES["mistral_untied"](), tmp_path, seed=3, max_shard_size="50KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    model = load_model(tmp_path, torch.float32, "cpu")
    tokens = [torch.arange(10) * 7 % VOCAB]
    logits = PagedCache(model, 1, 16).run(model, tokens, [(0, 0, 10)])
    torch.testing.assert_close(logits, _hf_logits(hf, tokens[0]), atol=1e-4, rtol=1e-4)


def test_loader_casts_to_the_requested_dtype(tmp_path):
    _save_tiny_hf_model(FAMILIES["qwen2_qkv_bias_tied"](), tmp_path)
    model = load_model(tmp_path, torch.bfloat16, "cpu")
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.lm_head is None  # tied: the head is the embedding matrix


needs_packing = pytest.mark.skipif(
    not can_pack_linears(torch.bfloat16, torch.device("cpu")),
    reason="neither the kernels' linear nor native bf16 oneDNN on this CPU",
)
needs_onednn_bf16 = pytest.mark.skipif(
    not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()),
    reason="no native bf16 oneDNN on this CPU",
)


@needs_onednn_bf16
@pytest.mark.parametrize("rows", [1, 3, 16, 65])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_linear_bit_for_bit(rows, bias):
    linear = torch.nn.Linear(96, 200, bias=bias).bfloat16()
    x = torch.randn(rows, 96).bfloat16()
    assert torch.equal(PackedLinear(linear.weight, linear.bias)(x), linear(x))


def _packed_and_plain_logits(tmp_path, monkeypatch, family: str, dtype: torch.dtype) -> list[torch.Tensor]:
    """A prompt's and a decode step's logits, with the loader's packed linears and with nn.Linear."""
    _save_tiny_hf_model(FAMILIES[family](), tmp_path)
    packed = load_model(tmp_path, dtype, "cpu")
    assert not any(type(m) is torch.nn.Linear for m in packed.modules())
    assert (packed.lm_head is None) == (packed.tied_head is not None)
    monkeypatch.setattr(loader, "can_pack_linears", lambda *_: False)
    plain = load_model(tmp_path, dtype, "cpu")
    tokens = [torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(3))]
    logits = []
    for model in (packed, plain):
        cache = PagedCache(model, 1, block_size=4)
        prefill = cache.run(model, tokens, [(0, 0, 11)])
        logits.append(torch.cat([prefill, cache.run(model, tokens, [(0, 11, 12)])]))
    return logits


@needs_packing
@pytest.mark.parametrize("family", ["qwen2_qkv_bias_tied", "mistral_untied"])
def test_bf16_loader_packs_linears_without_changing_the_logits(tmp_path, monkeypatch, family):
    packed, plain = _packed_and_plain_logits(tmp_path, monkeypatch, family, torch.bfloat16)
    assert torch.equal(packed, plain)


@pytest.mark.skipif(
    not can_pack_linears(torch.float32, torch.device("cpu")),
    reason="neither the kernels' float32 linear nor oneDNN on this CPU",
)
@pytest.mark.parametrize("family", ["qwen2_qkv_bias_tied", "mistral_untied"])
def test_float32_loader_packs_linears_and_keeps_the_logits(tmp_path, monkeypatch, family):
    # The kernels' float32 linear where the build has it (AVX2 with FMA), else oneDNN: either sums in
    # another order than MKL's sgemm, so the same logits to float32 rounding, not the same bits. With the
    # kernels' linear the layers run in a float32 DecoderStack.
    packed, plain = _packed_and_plain_logits(tmp_path, monkeypatch, family, torch.float32)
    torch.testing.assert_close(packed, plain, atol=1e-5, rtol=1e-5)
    if linear_for(get_ops(torch.device("cpu")), torch.float32) is not None:
        monkeypatch.undo()
        model = load_model(tmp_path, torch.float32, "cpu")
        linears = [m for m in model.modules() if isinstance(m, PackedLinear)]
        assert linears and all(m.kernels is not None and m.weight.dim() == 3 for m in linears)
        assert model.stack is not None and model.stack.num_layers == len(model.layers)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_decoder_stack_computes_the_python_loops_bits(tmp_path, family, dtype):
    """The C++ DecoderStack against the model's own layer loop, on prompt chunks, a mixed step and
    decode steps: the same kernels in the same order (in bf16 gate_up and SiLU as one pass where a step
    has more than 8 rows; in float32 always the two, as the loop runs them), so the same bits."""
    _save_tiny_hf_model(FAMILIES[family](), tmp_path)
    model = load_model(tmp_path, dtype, "cpu")
    if model.stack is None:
        pytest.skip("this CPU build has no linear for the dtype (see CpuOps.linear), so no DecoderStack")
    stack = model.stack
    gen = torch.Generator().manual_seed(5)
    tokens = [torch.randint(0, VOCAB, (n,), generator=gen) for n in (40, 30)]
    steps = [[(0, 0, 9), (1, 0, 20)], [(1, 20, 21), (0, 9, 30)], [(0, 30, 31), (1, 21, 22)], [(1, 22, 23)]]
    # the rows a caller reads: the last layer computes them alone (see CausalLM.forward)
    output_rows = [torch.tensor([28, 8, 3]), torch.tensor([21, 0]), None, None]
    runs = []
    for use_stack in (True, False):
        model.stack = stack if use_stack else None
        cache = PagedCache(model, 2, block_size=4, seed=2)
        runs.append([cache.run(model, tokens, *args) for args in zip(steps, output_rows, strict=True)])
        runs[-1].append(torch.cat([k for k, _ in cache.kv_caches] + [v for _, v in cache.kv_caches]))
    model.stack = stack
    for got, expected in zip(*runs, strict=True):
        assert torch.equal(got.nan_to_num(), expected.nan_to_num())


@needs_packing
def test_decoder_stack_refuses_token_ids_and_positions_outside_its_tables(tmp_path):
    # The stack gathers the embedding and RoPE rows itself: a bad index is an error, never a read elsewhere.
    _save_tiny_hf_model(FAMILIES["llama_linear_rope_tied"](), tmp_path)
    model = load_model(tmp_path, torch.bfloat16, "cpu")
    if model.stack is None:
        pytest.skip("this CPU build has no linear (AVX-512 BF16 or AVX2 with FMA), so no DecoderStack")
    cache = PagedCache(model, 1, block_size=4)
    tables = (model.embed_tokens.weight, model.rope.table)
    caches = ([k for k, _ in cache.kv_caches], [v for _, v in cache.kv_caches])
    attn = (
        torch.zeros(1, dtype=torch.int64),  # slot mapping
        torch.zeros(1, 1, dtype=torch.int32),  # block tables
        torch.tensor([0, 1], dtype=torch.int32),  # query start loc
        torch.ones(1, dtype=torch.int32),  # context lens
    )
    ok = torch.zeros(1, dtype=torch.int64)
    assert model.stack.forward_tokens(ok, ok, *tables, *caches, *attn).shape == (1, model.config.hidden_size)
    for ids, positions, message in (
        (torch.tensor([VOCAB]), ok, "outside the vocabulary"),
        (torch.tensor([-1]), ok, "outside the vocabulary"),
        (ok, torch.tensor([model.rope.table.shape[0]]), "beyond the RoPE table"),
    ):
        with pytest.raises(RuntimeError, match=message):
            model.stack.forward_tokens(ids, positions, *tables, *caches, *attn)
    # the rows to return (see CausalLM.forward) must be rows of the batch
    for rows in (torch.tensor([1]), torch.tensor([-1])):
        with pytest.raises(RuntimeError, match="outside the batch"):
            model.stack.forward_tokens(ok, ok, *tables, *caches, *attn, output_rows=rows)


@needs_packing
def test_decoder_stack_refuses_weights_it_cannot_read():
    # The stack's layers read their weights, biases and norms through raw pointers: add_layer checks each
    # one's shape, dtype and layout once, and a layer that fails is not added.
    ops = get_ops(torch.device("cpu"))
    kernels = linear_for(ops, torch.bfloat16)
    if kernels is None:
        pytest.skip("this CPU build has no linear (AVX-512 BF16 or AVX2 with FMA), so no DecoderStack")
    hidden, intermediate, heads, kv_heads, head_dim = 32, 64, 4, 2, 8
    q, kv = heads * head_dim, kv_heads * head_dim
    bf16 = torch.bfloat16
    norm = torch.ones(hidden, dtype=bf16)
    shape = dict(
        hidden=hidden,
        intermediate=intermediate,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        eps=1e-6,
        scale=head_dim**-0.5,
    )

    def pack(n: int, k: int) -> torch.Tensor:
        return kernels.pack_linear_weight(torch.randn(n, k).to(bf16))

    layer = dict(
        qkv=pack(q + 2 * kv, hidden),
        qkv_bias=None,
        o=pack(hidden, q),
        o_bias=None,
        gate_up=pack(2 * intermediate, hidden),
        gate_up_bias=None,
        down=pack(hidden, intermediate),
        down_bias=None,
        input_norm=norm,
        post_attention_norm=norm,
        q_norm=None,
        k_norm=None,
    )
    stack = ops.decoder_stack(**shape, final_norm=norm)
    for change, message in (
        ({"qkv_bias": torch.zeros(q + 2 * kv - 1, dtype=bf16)}, "qkv: the bias must be"),
        ({"o_bias": torch.zeros(hidden)}, "o: the bias must be"),  # float32
        ({"down": pack(hidden, intermediate - 2)}, "down: expected a bf16 weight"),
        ({"o": kernels.pack_linear_weight(torch.randn(hidden, q))}, "o: expected a bf16 weight"),  # float32
        ({"post_attention_norm": torch.ones(2 * hidden, dtype=bf16)[::2]}, "post_attention_norm must be"),
        ({"q_norm": torch.ones(head_dim, dtype=bf16)}, "q_norm and k_norm come together"),
    ):
        with pytest.raises(RuntimeError, match=message):
            stack.add_layer(**{**layer, **change})
    assert stack.num_layers == 0
    stack.add_layer(**layer)
    assert stack.num_layers == 1
    # Its linears read the rows in whole pairs: odd sizes are refused when the stack is made.
    with pytest.raises(RuntimeError, match="even hidden, intermediate and head sizes"):
        ops.decoder_stack(**{**shape, "intermediate": 63}, final_norm=norm)
    # The final norm's dtype is the stack's: a float32 stack takes float32 weights alone.
    with pytest.raises(RuntimeError, match="runs bf16 or float32 models, not Half"):
        ops.decoder_stack(**shape, final_norm=norm.half())
    if linear_for(ops, torch.float32) is not None:
        stack32 = ops.decoder_stack(**shape, final_norm=norm.float())
        with pytest.raises(RuntimeError, match="qkv: expected a float32 weight"):
            stack32.add_layer(**layer)
        with pytest.raises(RuntimeError, match="input_norm must be contiguous float32"):
            stack32.add_layer(
                **{
                    **layer,
                    **{
                        n: kernels.pack_linear_weight(w)
                        for n, w in (
                            ("qkv", torch.randn(q + 2 * kv, hidden)),
                            ("o", torch.randn(hidden, q)),
                            ("gate_up", torch.randn(2 * intermediate, hidden)),
                            ("down", torch.randn(hidden, intermediate)),
                        )
                    },
                }
            )
        assert stack32.num_layers == 0


def test_loader_refuses_pickle_checkpoints(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(FAMILIES["mistral_untied"]().to_dict()))
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="pickle"):
        load_model(tmp_path, torch.float32, "cpu")


def test_loader_reports_missing_weights(tmp_path):
    from safetensors.torch import save_file

    _save_tiny_hf_model(FAMILIES["mistral_untied"](), tmp_path)
    from safetensors.torch import load_file

    state = load_file(tmp_path / "model.safetensors")
    del state["model.layers.1.self_attn.k_proj.weight"]
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"layers\.1\.self_attn\.qkv_proj\.weight\[1\]"):
        load_model(tmp_path, torch.float32, "cpu")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "gpt2"}, "unsupported model_type"),
        (
            {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}},
            "unsupported rope type",
        ),
        ({"hidden_act": "gelu"}, "unsupported hidden_act"),
    ],
)
def test_config_rejects_what_the_model_does_not_implement(change, message):
    hf = {**FAMILIES["mistral_untied"]().to_dict(), **change}
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_config(hf)


def test_config_reads_transformers_4_rope_fields():
    hf = {
        **TINY,
        "model_type": "llama",
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    }
    config = ModelConfig.from_hf_config(hf)
    assert (config.rope_theta, config.rope_type, config.rope_scaling["factor"]) == (500000.0, "llama3", 8.0)
    assert config.head_dim == 16 and not config.qkv_bias and not config.qk_norm


def test_parse_dtype():
    assert parse_dtype("auto", "cpu") == (torch.bfloat16 if loader.cpu_prefers_bf16() else torch.float32)
    assert parse_dtype("auto", "cuda") == torch.bfloat16
    assert parse_dtype("float16", "cpu") == torch.float16
    with pytest.raises(ValueError, match="unknown dtype"):
        parse_dtype("int8", "cpu")


def test_auto_dtype_on_cpu_takes_bf16_where_it_is_faster(monkeypatch):
    monkeypatch.setattr(loader, "cpu_prefers_bf16", lambda: True)
    assert parse_dtype("auto", "cpu") == torch.bfloat16
    monkeypatch.setattr(loader, "cpu_prefers_bf16", lambda: False)
    assert parse_dtype("auto", "cpu") == torch.float32
    assert parse_dtype("auto", "cuda") == torch.bfloat16


def test_cpu_prefers_bf16_with_native_bf16_or_the_kernels_linear(monkeypatch):
    from pagedserve.kernels import _load_cpu_ops
    from pagedserve.kernels.reference import ReferenceOps

    reference, cpu_ops = ReferenceOps(), _load_cpu_ops()

    def prefers(native: bool, ops) -> bool:
        monkeypatch.setattr(loader, "cpu_has_native_bf16", lambda: native)
        monkeypatch.setattr(loader, "get_ops", lambda device: ops)
        loader.cpu_prefers_bf16.cache_clear()
        return loader.cpu_prefers_bf16()

    try:
        assert prefers(True, reference)
        assert not prefers(False, reference)  # PyTorch's emulated bf16 matmuls: float32 is faster
        if cpu_ops is not None and linear_for(cpu_ops, torch.bfloat16) is not None:
            assert prefers(False, cpu_ops)
    finally:
        loader.cpu_prefers_bf16.cache_clear()


# --- the default model ------------------------------------------------------------------------------


def _greedy(model: CausalLM, prompts: list[list[int]], steps: int, block_size: int = 16) -> list[list[int]]:
    """Prefill all prompts in one flat batch, then decode them together through the paged cache."""
    cache = PagedCache(model, len(prompts), block_size)
    tokens = [torch.tensor(p) for p in prompts]
    lens = [len(p) for p in prompts]
    chunks = [(s, 0, n) for s, n in enumerate(lens)]
    for _ in range(steps):
        logits = cache.run(model, tokens, chunks)
        last = torch.tensor([b - a for _, a, b in chunks]).cumsum(0) - 1
        next_ids = logits[last].argmax(-1)
        tokens = [torch.cat([t, next_ids[s : s + 1]]) for s, t in enumerate(tokens)]
        chunks = [(s, len(t) - 1, len(t)) for s, t in enumerate(tokens)]
    return [t[n:].tolist() for t, n in zip(tokens, lens, strict=True)]


def default_model_prompts(tokenizer) -> list[list[int]]:
    """A chat question the default model answers "The capital of France is Paris.", and a plain text."""
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    return [
        tokenizer(chat, add_special_tokens=False)["input_ids"],
        tokenizer("The three primary colors are", add_special_tokens=False)["input_ids"],
    ]


@pytest.mark.slow
def test_default_model_greedy_decode_equals_transformers_generate(default_model_dir):
    tokenizer = load_tokenizer(default_model_dir)
    prompts = default_model_prompts(tokenizer)
    steps = 12
    ours = _greedy(load_model(default_model_dir, torch.float32, "cpu"), prompts, steps)

    hf = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32, local_files_only=True)
    eos_ids = load_generation_info(default_model_dir).eos_token_ids
    for prompt, got in zip(prompts, ours, strict=True):
        with torch.inference_mode():
            out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=steps)
        expected = out[0, len(prompt) :].tolist()
        # generate stops at EOS; our loop runs on, so compare up to there.
        assert got[: len(expected)] == expected
        assert len(expected) == steps or expected[-1] in eos_ids
    assert tokenizer.decode(ours[0]).startswith("The capital of France is Paris.")
