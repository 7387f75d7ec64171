"""The offline API: `LLM.generate` / `LLM.chat` over the server's own scheduler and worker code."""

from __future__ import annotations

import gc
import subprocess

import pytest

from pagedserve.launcher import python_command
from pagedserve.sampling_params import SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):"]


def test_import_pagedserve_does_not_import_torch():
    code = "import sys, pagedserve; assert 'torch' not in sys.modules; print(pagedserve.__version__)"
    result = subprocess.run(python_command("-c", code), capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_sampling_params_convert_to_the_proto():
    sp = SamplingParams(temperature=0, top_k=-1, max_tokens=5, stop="x", seed=7, logprobs=2).to_proto()
    assert sp.temperature == 0 and sp.top_k == 0 and sp.max_tokens == 5 and list(sp.stop) == ["x"]
    assert sp.seed == 7 and sp.logprobs == 2
    assert not SamplingParams(max_tokens=None).to_proto().HasField("max_tokens")
    with pytest.raises(ValueError):
        SamplingParams(top_p=0)


@pytest.fixture(scope="module")
def llm():
    from pagedserve import LLM

    return LLM(dtype="float32", num_blocks=512)


def test_startup_objects_are_frozen_out_of_the_garbage_collector(llm):
    # What serving creates is collected as usual; the model and everything before it is never rescanned.
    tracked = {id(o) for o in gc.get_objects()}
    assert id(llm.model) not in tracked and id(llm.runner) not in tracked
    fresh = [[]]
    assert id(fresh) in {id(o) for o in gc.get_objects()}


@pytest.mark.slow
def test_greedy_output_equals_transformers_generate(llm):
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(llm.model_dir), dtype=torch.float32).eval()
    outs = llm.generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False
    )
    for out in outs:
        ids = torch.tensor([out.prompt_token_ids])
        with torch.no_grad():
            want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
        want = want[0, ids.shape[1] :].tolist()
        assert out.outputs[0].token_ids[: len(want)] == want


@pytest.mark.slow
def test_outputs_come_back_in_input_order(llm):
    prompts = ["One", "Two two", "Three three three", [1, 2, 3, 4]]
    params = [SamplingParams(temperature=0, max_tokens=k, ignore_eos=True) for k in (5, 1, 3, 2)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt for o in outs] == ["One", "Two two", "Three three three", None]
    assert outs[3].prompt_token_ids == [1, 2, 3, 4]
    assert [len(o.outputs[0].token_ids) for o in outs] == [5, 1, 3, 2]
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outs)


@pytest.mark.slow
def test_seeded_samples_are_reproducible_and_n_gives_distinct_sequences(llm):
    sp = SamplingParams(n=2, temperature=1.0, seed=11, max_tokens=8, ignore_eos=True)
    first = llm.generate("Once upon a time", sp, use_tqdm=False)[0]
    # Batched with another request, the seeded draws are the same.
    again = llm.generate(["Once upon a time", "Something else"], sp, use_tqdm=False)[0]
    assert [c.index for c in first.outputs] == [0, 1]
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in again.outputs]
    assert first.outputs[0].token_ids != first.outputs[1].token_ids


@pytest.mark.slow
def test_stop_string_is_excluded_and_ends_the_sequence(llm):
    base = llm.generate(
        "The capital of France is", SamplingParams(temperature=0, max_tokens=12), use_tqdm=False
    )
    text = base[0].outputs[0].text
    assert "." in text
    out = llm.generate(
        "The capital of France is", SamplingParams(temperature=0, max_tokens=12, stop=["."]), use_tqdm=False
    )[0].outputs[0]
    assert out.text == text.split(".")[0]
    assert out.finish_reason == "stop" and out.stop_reason == "."
    kept = llm.generate(
        "The capital of France is",
        SamplingParams(temperature=0, max_tokens=12, stop=["."], include_stop_str_in_output=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert kept.text == text.split(".")[0] + "."
    # The aborted request left nothing running at the scheduler.
    assert not llm.scheduler.has_unfinished_requests()


@pytest.mark.slow
def test_logprobs_are_returned_when_asked(llm):
    out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=3, logprobs=2), use_tqdm=False)[0]
    comp = out.outputs[0]
    assert len(comp.logprobs) == len(comp.token_ids)
    for token_id, entry in zip(comp.token_ids, comp.logprobs, strict=True):
        assert token_id in entry and entry[token_id].rank == 1  # greedy picks the top token


@pytest.mark.slow
def test_chat_answers_the_capital_of_france(llm):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    outs = llm.chat(messages, SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)
    assert "Paris" in outs[0].outputs[0].text
    assert outs[0].outputs[0].finish_reason == "stop"


@pytest.mark.slow
def test_reset_prefix_cache_makes_the_next_run_compute_every_prompt_token(llm):
    prompt = " ".join(["The quick brown fox jumps over the lazy dog."] * 6)  # several full blocks
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    first = llm.generate([prompt], sp, use_tqdm=False)[0]
    again = llm.generate([prompt], sp, use_tqdm=False)[0]
    assert again.num_cached_tokens >= 32
    assert llm.reset_prefix_cache()
    fresh = llm.generate([prompt], sp, use_tqdm=False)[0]
    assert fresh.num_cached_tokens == 0
    assert fresh.outputs[0].token_ids == again.outputs[0].token_ids == first.outputs[0].token_ids
