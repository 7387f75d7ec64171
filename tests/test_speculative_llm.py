"""Speculative decoding end to end in the offline engine on the default model: float32 greedy output token for
token identical with and without n-gram drafts and self-speculative draft layers on 12 prompts, seeded sampling
identical too, and the KV pool whole afterwards."""

import pytest

from pagedserve import LLM, SamplingParams

pytestmark = pytest.mark.slow

# Drafts at every batch size (disable_by_batch_size lifted): the 12 prompts run together.
SPEC = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_max": 4,
    "prompt_lookup_min": 2,
    "disable_by_batch_size": None,
}
# The first 20 of the default model's 30 layers draft 3 tokens, in every step.
LAYERS_SPEC = {
    "method": "draft_layers",
    "num_speculative_tokens": 3,
    "num_draft_layers": 20,
    "disable_by_batch_size": None,  # all 12 sequences draft together
}
TEXT = "The river runs past the old mill, under the stone bridge, and into the quiet valley below."
PROMPTS = [
    f"Repeat this sentence exactly: {TEXT}\n",
    f"Copy the text below.\n\n{TEXT}\n\nCopy:",
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n",
    "List the numbers: 1, 2, 3, 4, 5, 6, 7, 8,",
    "The capital of France is",
    "Once upon a time",
    "Summarise: The meeting is on Monday. The meeting is in room 4. The meeting starts at noon.\nSummary:",
    "Translate to French: Good morning, my friend.",
    '{"name": "Ada", "age": 36, "city": "London"}\n{"name": "Alan", "age": 41, "city":',
    "Write a haiku about the sea.",
    "A B C D E F G A B C D E F G A B C",
    "Question: What is 2 + 2?\nAnswer:",
]


def _generate(spec, params):
    llm = LLM(dtype="float32", speculative_config=spec, seed=0)
    outputs = llm.generate(PROMPTS, params)
    scheduler = llm.scheduler
    assert scheduler.kv.pool.num_used_blocks == 0  # nothing leaked once idle
    return [o.outputs[0].token_ids for o in outputs], scheduler.stats()


@pytest.mark.parametrize("spec", [SPEC, LAYERS_SPEC], ids=["ngram", "draft_layers"])
def test_greedy_float32_output_is_identical_with_drafts(spec):
    params = SamplingParams(temperature=0, max_tokens=40)
    plain, _ = _generate(None, params)
    speculative, stats = _generate(spec, params)
    assert speculative == plain
    assert stats.spec_num_accepted_tokens > 0 and stats.spec_num_draft_tokens > stats.spec_num_accepted_tokens


@pytest.mark.parametrize("spec", [SPEC, LAYERS_SPEC], ids=["ngram", "draft_layers"])
def test_seeded_sampling_is_identical_with_drafts(spec):
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=1234, max_tokens=32)
    plain, _ = _generate(None, params)
    speculative, stats = _generate(spec, params)
    assert speculative == plain
    assert stats.spec_num_drafts > 0


def test_draft_layers_as_deep_as_the_model_fail_at_start():
    with pytest.raises(ValueError, match="num_draft_layers 30 is not below the model's 30 layers"):
        LLM(
            speculative_config={"method": "draft_layers", "num_speculative_tokens": 2, "num_draft_layers": 30}
        )


def test_bad_speculative_config_fails_before_the_model_loads():
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        LLM(speculative_config={"num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 3})


@pytest.mark.parametrize(
    "spec", [SPEC, {**LAYERS_SPEC, "num_draft_layers": 29}], ids=["ngram", "draft_layers"]
)
def test_served_stack_with_speculative_config_answers_as_the_offline_engine_without(
    default_model_dir, tmp_path, spec
):
    """`pagedserve serve --speculative-config` on real processes, through the openai SDK: greedy float32 text
    equal to the offline engine's without drafts, vLLM's counters on /metrics, no block held once idle."""
    import json

    import httpx
    import openai
    from stack_testing import MODEL, Stack, running, wait_for

    prompts = PROMPTS[:4]
    reference = LLM(dtype="float32").generate(
        prompts, SamplingParams(temperature=0, max_tokens=40), use_tqdm=False
    )
    args = ["--dtype", "float32", "--num-blocks", "256", "--log-level", "warning"]
    args += ["--speculative-config", json.dumps(spec)]
    with running(Stack(default_model_dir, tmp_path, serve_args=args)) as stack:
        client = openai.OpenAI(base_url=stack.openai_base_url, api_key="unused", max_retries=0, timeout=600)
        for prompt, expected in zip(prompts, reference, strict=True):
            reply = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=40)
            assert reply.choices[0].text == expected.outputs[0].text
            # Streamed, several tokens arrive per step where drafts are accepted: the same text.
            stream = client.completions.create(
                model=MODEL, prompt=prompt, temperature=0, max_tokens=40, stream=True
            )
            assert (
                "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
                == expected.outputs[0].text
            )
        metrics = httpx.get(f"{stack.http_url}/metrics", timeout=30).text
        accepted = [
            line
            for line in metrics.splitlines()
            if line.startswith("vllm:spec_decode_num_accepted_tokens_total")
        ]
        assert accepted and float(accepted[0].split()[-1]) > 0, metrics
        assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="' in metrics
        wait_for(lambda: stack.engine_stats().num_blocks_in_use == 0, 60, "blocks still held once idle")
