"""OpenAI request parsing and validation, their SamplingParams, and both logprobs formats."""

from __future__ import annotations

import json

import pytest

from pagedserve.errors import InvalidRequestError
from pagedserve.gateway.generation import ChoiceDelta, GenerationCore, ModelInfo, Prompt
from pagedserve.gateway.openai_format import ChatFormatter, CompletionFormatter
from pagedserve.gateway.protocol import ChatCompletionRequest, CompletionRequest, parse_request
from pagedserve.v1 import common_pb2
from pagedserve.validation import check_sampling


def completion(**fields) -> CompletionRequest:
    return parse_request(CompletionRequest, json.dumps({"prompt": "hi", **fields}).encode())


def chat(**fields) -> ChatCompletionRequest:
    return parse_request(
        ChatCompletionRequest,
        json.dumps({"messages": [{"role": "user", "content": "hi"}], **fields}).encode(),
    )


def refused(make, **fields) -> InvalidRequestError:
    """The refusal of a request: by the API's own conversion, or by the check both APIs share."""
    with pytest.raises(InvalidRequestError) as info:
        req = make(**fields)
        check_sampling(req.sampling_params(), names=req.sampling_names())
    return info.value


def test_every_sampling_parameter_reaches_sampling_params():
    sp = completion(
        max_tokens=7, temperature=0.5, top_p=0.9, top_k=40, min_p=0.05, n=3, seed=42, stop=["\n", "END"],
        stop_token_ids=[5], presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.1,
        logit_bias={"17": 5.0}, logprobs=2, ignore_eos=True, min_tokens=2, skip_special_tokens=False,
        include_stop_str_in_output=True, user="u",
    ).sampling_params()  # fmt: skip
    assert sp.max_tokens == 7 and sp.n == 3 and sp.seed == 42 and sp.top_k == 40
    assert sp.temperature == pytest.approx(0.5) and sp.top_p == pytest.approx(0.9)
    assert sp.min_p == pytest.approx(0.05) and sp.repetition_penalty == pytest.approx(1.1)
    assert sp.presence_penalty == pytest.approx(0.5) and sp.frequency_penalty == pytest.approx(-0.5)
    assert list(sp.stop) == ["\n", "END"] and list(sp.stop_token_ids) == [5]
    assert dict(sp.logit_bias) == {17: 5.0} and sp.logprobs == 2
    assert (
        sp.ignore_eos and sp.min_tokens == 2 and not sp.skip_special_tokens and sp.include_stop_str_in_output
    )


def test_unset_parameters_stay_unset_so_the_engine_defaults_apply():
    sp = chat().sampling_params()
    for field in (
        "max_tokens",
        "temperature",
        "top_p",
        "seed",
        "repetition_penalty",
        "logprobs",
        "prompt_logprobs",
    ):
        assert not sp.HasField(field), field
    assert sp.n == 1 and sp.top_k == 0 and list(sp.stop) == []


def test_completions_default_to_sixteen_tokens_as_openai_does():
    assert completion().sampling_params().max_tokens == 16


def test_vllm_conventions_top_k_minus_one_and_a_single_stop_string():
    sp = completion(top_k=-1, stop="###").sampling_params()
    assert sp.top_k == 0 and list(sp.stop) == ["###"]


def test_negative_seed_is_kept_as_its_64_bit_pattern():
    assert completion(seed=-1).sampling_params().seed == 2**64 - 1


def test_unknown_fields_are_ignored():
    assert completion(frobnicate=True, response_format={"type": "text"}).sampling_params().n == 1


def test_echo_with_logprobs_asks_for_prompt_logprobs():
    assert completion(echo=True, logprobs=3).sampling_params().prompt_logprobs == 3
    assert not completion(echo=True).sampling_params().HasField("prompt_logprobs")


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2**31}, "top_k"),
        ({"priority": 2**31}, "priority"),
        ({"priority": -(2**31) - 1}, "priority"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 2**32}, "min_tokens"),
        ({"min_p": 1.5}, "min_p"),
        ({"n": 0}, "n"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"logprobs": 21}, "logprobs"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"3": 101}}, "logit_bias"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ],
)
def test_out_of_range_values_are_refused_naming_the_parameter(fields, param):
    error = refused(completion, **fields)
    assert error.param == param
    assert param in error.message


def test_chat_names_its_own_parameters_in_errors():
    assert refused(chat, logprobs=True, top_logprobs=30).param == "top_logprobs"
    assert refused(chat, top_logprobs=2).param == "top_logprobs"  # without logprobs: true
    assert refused(chat, max_completion_tokens=0).param == "max_completion_tokens"


def test_chat_max_completion_tokens_overrides_max_tokens_and_logprobs_map():
    sp = chat(max_tokens=5, max_completion_tokens=9, logprobs=True, top_logprobs=4).sampling_params()
    assert sp.max_tokens == 9 and sp.logprobs == 4
    assert chat(logprobs=True).sampling_params().logprobs == 0
    assert not chat().sampling_params().HasField("logprobs")


@pytest.mark.parametrize("prompt", ["text", ["a", "b"], [1, 2, 3], [[1, 2], [3]]])
def test_the_four_prompt_shapes_are_accepted(prompt):
    req = completion(prompt=prompt)
    assert len(req.prompts()) == (2 if isinstance(prompt, list) and not isinstance(prompt[0], int) else 1)


@pytest.mark.parametrize("prompt", [[], [1, "a"], {"x": 1}, 3, [[1], "a"], [True]])
def test_malformed_prompts_are_refused_with_param_prompt(prompt):
    with pytest.raises(InvalidRequestError) as info:
        completion(prompt=prompt)
    assert info.value.param == "prompt"


def test_type_errors_and_missing_fields_name_the_parameter():
    with pytest.raises(InvalidRequestError) as info:
        completion(temperature="hot")
    assert info.value.param == "temperature"
    with pytest.raises(InvalidRequestError) as info:
        parse_request(ChatCompletionRequest, b"{}")
    assert info.value.param == "messages"
    with pytest.raises(InvalidRequestError) as info:
        chat(messages=[{"role": "wizard", "content": "x"}])
    assert info.value.param == "messages"
    with pytest.raises(InvalidRequestError):
        parse_request(CompletionRequest, b"{not json")


def test_content_parts_are_joined_and_non_text_parts_refused():
    req = chat(
        messages=[{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    )
    assert req.template_messages() == [{"role": "user", "content": "a\nb"}]
    req = chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    with pytest.raises(InvalidRequestError):
        req.template_messages()


# ---- context length and max_tokens (the core, no engine needed) ----


@pytest.fixture
def core(tokenizer) -> GenerationCore:
    return GenerationCore(None, tokenizer, ModelInfo("m", max_model_len=100, eos_token_ids=(2,)))


def test_max_tokens_defaults_to_what_the_context_has_left(core):
    gen = core.build([Prompt([5] * 30)], common_pb2.SamplingParams(), request_id="r", engine_id="r")
    assert gen.sampling[0].max_tokens == 70


def test_prompt_at_or_beyond_the_context_length_is_refused(core):
    with pytest.raises(InvalidRequestError, match="maximum context length is 100 tokens"):
        core.build([Prompt([5] * 100)], common_pb2.SamplingParams(), request_id="r", engine_id="r")


def test_prompt_plus_max_tokens_beyond_the_context_length_is_refused(core):
    with pytest.raises(InvalidRequestError, match=r"you requested 110 tokens") as info:
        core.build(
            [Prompt([5] * 30)], common_pb2.SamplingParams(max_tokens=80), request_id="r", engine_id="r"
        )
    assert info.value.param == "max_tokens"


def test_token_ids_outside_the_vocabulary_are_refused(core, tokenizer):
    with pytest.raises(InvalidRequestError, match="out of the vocabulary"):
        core.build(
            [Prompt([tokenizer.vocab_size])], common_pb2.SamplingParams(), request_id="r", engine_id="r"
        )


# ---- both logprobs formats ----


def _entry(token_id: int, logprob: float, alternatives: list[tuple[int, float]]) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(
        token_id=token_id,
        logprob=logprob,
        top_token_ids=[t for t, _ in alternatives],
        top_logprobs=[lp for _, lp in alternatives],
        rank=1,
    )


def test_completions_logprobs_format_has_tokens_offsets_and_top_dicts(tokenizer):
    ids = tokenizer.encode(" Paris is", add_special_tokens=False)
    req = completion(prompt=[1, 2, 3], logprobs=1)
    gen = GenerationCore(None, tokenizer, ModelInfo("m", 100, (2,))).build(
        [Prompt([1, 2, 3])], req.sampling_params(), request_id="cmpl-x", engine_id="e"
    )
    fmt = CompletionFormatter(tokenizer, "m", req, gen)
    entries = [_entry(t, -0.5, [(t, -0.5)]) for t in ids]
    lp = fmt.choice_part(ChoiceDelta(0, 0, " Paris is", ids, entries, "length"))[1]
    assert lp["tokens"] == [tokenizer.token_text(t) for t in ids]
    assert lp["token_logprobs"] == [-0.5] * len(ids)
    assert lp["top_logprobs"][0] == {tokenizer.token_text(ids[0]): -0.5}
    assert lp["text_offset"][0] == 0 and lp["text_offset"][1] == len(tokenizer.token_text(ids[0]))


def test_completions_echo_puts_the_prompt_and_its_logprobs_first(tokenizer):
    req = completion(prompt="Hello", echo=True, logprobs=0)
    prompt_ids = tokenizer.encode("Hello")
    gen = GenerationCore(None, tokenizer, ModelInfo("m", 100, (2,))).build(
        [Prompt(prompt_ids, "Hello")], req.sampling_params(), request_id="cmpl-x", engine_id="e"
    )
    fmt = CompletionFormatter(tokenizer, "m", req, gen)
    prompt_lps = [_entry(t, -1.0, []) for t in prompt_ids[1:]]
    delta = ChoiceDelta(0, 0, " world", [905], [_entry(905, -0.25, [])], "length", prompt_logprobs=prompt_lps)
    text, lp = fmt.choice_part(delta)
    assert text == "Hello world"
    assert lp["token_logprobs"] == [None] + [-1.0] * (len(prompt_ids) - 1) + [-0.25]
    assert len(lp["tokens"]) == len(prompt_ids) + 1


def test_chat_logprobs_format_has_content_with_bytes_and_top_logprobs(tokenizer):
    req = chat(logprobs=True, top_logprobs=1)
    ids = tokenizer.encode("😀", add_special_tokens=False)
    gen = GenerationCore(None, tokenizer, ModelInfo("m", 100, (2,))).build(
        [Prompt([1, 2])], req.sampling_params(), request_id="chatcmpl-x", engine_id="e"
    )
    fmt = ChatFormatter(tokenizer, "m", req, gen)
    entries = [_entry(t, -0.1, [(t, -0.1), (17, -3.0)]) for t in ids]
    content = fmt.choice_part(ChoiceDelta(0, 0, "😀", ids, entries))[1]["content"]
    assert [c["logprob"] for c in content] == pytest.approx([-0.1] * len(ids))
    assert b"".join(bytes(c["bytes"]) for c in content) == "😀".encode()
    assert all(
        len(c["top_logprobs"]) == 1 and set(c["top_logprobs"][0]) == {"token", "logprob", "bytes"}
        for c in content
    )
