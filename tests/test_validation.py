"""The one validation every way in shares (pagedserve/validation.py)."""

from __future__ import annotations

import math

import pytest

from pagedserve.errors import InvalidRequestError
from pagedserve.scheduler_svc.request import Request
from pagedserve.v1 import common_pb2, engine_pb2
from pagedserve.validation import (
    SEED_MODULUS,
    Limits,
    check_count,
    check_json_depth,
    check_max_tokens,
    check_prompt,
    check_prompt_chars,
    check_prompt_len,
    check_sampling,
    check_text,
    check_token_ids,
    child_seed,
    reduce_seed,
)


@pytest.mark.parametrize("seed", [-1, -(1 << 70), 0, SEED_MODULUS - 1, SEED_MODULUS, 1 << 80])
def test_any_integer_seed_becomes_a_uint64(seed):
    reduced = reduce_seed(seed)
    assert 0 <= reduced < SEED_MODULUS
    assert reduced == seed % SEED_MODULUS


def test_a_fork_of_the_largest_seed_wraps_instead_of_overflowing():
    assert child_seed(SEED_MODULUS - 1, 1) == 0
    msg = engine_pb2.GenerateTokensRequest(
        request_id="r",
        prompt_token_ids=[1, 2, 3],
        sampling=common_pb2.SamplingParams(n=3, seed=SEED_MODULUS - 1),
    )
    parent = Request.from_generate_request(msg, frozenset(), 0.0)
    assert [parent.fork(i).sampling.seed for i in (1, 2)] == [0, 1]
    resumed = Request.resume(msg, 2, [7], frozenset(), 0.0)
    assert resumed.sampling.seed == 1 and resumed.sampling.n == 1


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": math.nan}, "top_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"top_k": -2}, "top_k"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": math.nan}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": math.inf}, "repetition_penalty"),
        ({"n": 17}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 4, "min_tokens": 5}, "min_tokens"),
        ({"logprobs": 21}, "logprobs"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"logit_bias": {3: 101.0}}, "logit_bias"),
        ({"logit_bias": {3: math.nan}}, "logit_bias"),
        ({"logit_bias": {100: 1.0}}, "logit_bias"),
        ({"logit_bias": {i: 1.0 for i in range(5)}}, "logit_bias"),
        ({"stop": [""]}, "stop"),
        ({"stop": ["x" * 9]}, "stop"),
        ({"stop": ["a", "b", "c"]}, "stop"),
        ({"stop_token_ids": [100]}, "stop_token_ids"),
        ({"stop_token_ids": [1, 2, 3, 4, 5]}, "stop_token_ids"),
    ],
)
def test_each_value_out_of_range_is_refused_naming_its_parameter(fields, param):
    limits = Limits(max_stop_strings=2, max_stop_chars=8, max_stop_token_ids=4, max_logit_bias=4)
    with pytest.raises(InvalidRequestError) as refused:
        check_sampling(common_pb2.SamplingParams(**fields), limits=limits, vocab_size=100)
    assert refused.value.param == param


def test_the_client_name_of_a_parameter_is_the_one_reported():
    with pytest.raises(InvalidRequestError) as refused:
        check_sampling(common_pb2.SamplingParams(logprobs=50), names={"logprobs": "top_logprobs"})
    assert refused.value.param == "top_logprobs"
    assert refused.value.message.startswith("top_logprobs ")


def test_values_at_their_bounds_are_accepted():
    check_sampling(
        common_pb2.SamplingParams(
            temperature=0.0, top_p=1.0, min_p=1.0, top_k=0, presence_penalty=-2.0, frequency_penalty=2.0,
            n=16, logprobs=20, prompt_logprobs=20, max_tokens=1, min_tokens=1, seed=SEED_MODULUS - 1,
            logit_bias={0: -100.0, 99: 100.0}, stop_token_ids=[0, 99],
        ),
        vocab_size=100,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("ids", "fragment"),
    [([], "empty"), (list(range(10)), "context length"), ([1, -1], "-1"), ([1, 100], "100")],
)
def test_prompts_are_refused_empty_too_long_or_out_of_the_vocabulary(ids, fragment):
    with pytest.raises(InvalidRequestError) as refused:
        check_prompt(ids, vocab_size=100, max_model_len=10)
    assert fragment in refused.value.message and refused.value.param == "prompt"


def test_prompt_plus_max_tokens_must_fit_the_context():
    check_max_tokens(6, common_pb2.SamplingParams(max_tokens=4), max_model_len=10)
    with pytest.raises(InvalidRequestError) as refused:
        check_max_tokens(6, common_pb2.SamplingParams(max_tokens=5), max_model_len=10)
    assert refused.value.param == "max_tokens"


def test_identifiers_are_bounded():
    check_text("s" * 8, max_chars=8, param="cache_salt")
    with pytest.raises(InvalidRequestError) as refused:
        check_text("s" * 9, max_chars=8, param="cache_salt")
    assert refused.value.param == "cache_salt"


class _Unreadable(list):
    """Token ids whose values must not be read: only their length may be."""

    def __iter__(self):
        raise AssertionError("an id was read before the length was checked")

    def __getitem__(self, index):
        raise AssertionError("an id was read before the length was checked")


def test_a_prompt_too_long_is_refused_before_any_id_is_read():
    with pytest.raises(InvalidRequestError, match="context length"):
        check_prompt(_Unreadable([0] * 10), vocab_size=100, max_model_len=10)
    with pytest.raises(InvalidRequestError, match="at most 10 token ids"):
        check_token_ids(_Unreadable([0] * 11), vocab_size=100, max_len=10, param="tokens")
    with pytest.raises(InvalidRequestError, match="context length"):
        check_prompt_len(10, 10)
    check_prompt_len(9, 10)


def test_counts_are_bounded_naming_the_parameter():
    check_count(3, 3, "messages", "messages")
    with pytest.raises(InvalidRequestError) as refused:
        check_count(4, 3, "messages", "messages")
    assert refused.value.param == "messages" and "at most 3 messages, got 4" in refused.value.message


def test_a_text_too_long_for_any_tokenization_is_refused_before_tokenizing():
    check_prompt_chars(2 * 10 * 8 - 1, max_model_len=10, max_token_chars=8, param="prompt")
    with pytest.raises(InvalidRequestError) as refused:
        check_prompt_chars(2 * 10 * 8, max_model_len=10, max_token_chars=8, param="prompt")
    assert refused.value.param == "prompt" and "context length is 10" in refused.value.message


@pytest.mark.parametrize(
    ("body", "depth"),
    [
        (b'{"a": 1}', 1),
        (b'{"a": [[1], [2, [3]]]}', 4),
        (b'{"a": "[[[[[[[[[[{{{{{{", "b": []}', 2),  # brackets inside strings do not nest
        (b'{"a": "\\"[[[[[[[[[[", "b": [1]}', 2),  # nor after an escaped quote
        (b'{"a": "\\\\", "b": [[[1]]]}', 4),  # an escaped backslash does not escape the quote after it
        (b"[" * 30 + b"]" * 30, 30),
        (b'{"x": "unterminated [[[[[[[[[[[[[[', 1),
    ],
)
def test_json_depth_counts_brackets_outside_strings(body, depth):
    check_json_depth(body, depth)
    with pytest.raises(InvalidRequestError, match="nested deeper"):
        check_json_depth(body, depth - 1)


def test_json_nested_far_past_the_limit_is_refused_without_recursion():
    with pytest.raises(InvalidRequestError):
        check_json_depth(b"[" * 1_000_000 + b"]" * 1_000_000, 64)
    check_json_depth(b'{"prompt": [' + b"[1, 2]," * 200_000 + b"[3]]}", 3)


@pytest.mark.parametrize(
    ("fields", "fragment"),
    [
        ({"temperature": math.nan}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"logprobs": 21}, "logprobs"),
        ({"max_tokens": 4, "min_tokens": 5}, "min_tokens"),
        ({"stop": [""]}, "stop"),
        ({"n": 0}, "n"),
        ({"min_tokens": -1}, "min_tokens"),
    ],
)
def test_the_offline_sampling_params_refuse_what_the_server_refuses(fields, fragment):
    from pagedserve.sampling_params import SamplingParams

    with pytest.raises(ValueError, match=fragment):
        SamplingParams(**fields)


def test_an_offline_seed_of_any_integer_is_a_uint64():
    from pagedserve.sampling_params import SamplingParams

    assert SamplingParams(seed=-1).to_proto().seed == SEED_MODULUS - 1


def test_a_requests_finish_reason_is_abort_over_length_over_stop():
    from pagedserve import finish_reasons

    stop, length, abort = (finish_reasons.code_of(name) for name in ("stop", "length", "abort"))
    assert finish_reasons.request_reason([stop, stop]) == "stop"
    assert finish_reasons.request_reason([stop, length]) == "length"
    assert finish_reasons.request_reason([length, abort, stop]) == "abort"
    assert finish_reasons.name_of(common_pb2.FINISH_REASON_UNSPECIFIED) is None
    assert finish_reasons.code_of(None) == common_pb2.FINISH_REASON_UNSPECIFIED
