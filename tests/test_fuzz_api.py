"""Fuzzing the HTTP API of a real stack: hypothesis-generated JSON bodies for /v1/completions and
/v1/chat/completions never give a 5xx, every error is in OpenAI's shape, and the server still serves
afterwards with no KV block left in use."""

from __future__ import annotations

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from stack_testing import Stack, assert_openai_error, running

pytestmark = pytest.mark.slow

EXAMPLES = 150

_any_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4)
    ),
    max_leaves=10,
)
_small_ints = st.integers(-5, 40) | st.integers(-(2**65), 2**65)
_numbers = st.floats(-5, 5, allow_nan=False) | st.integers(-3, 3) | st.sampled_from([1e308, -1e-308, 0.0])
_text = st.text(max_size=40)
_token_ids = st.lists(st.integers(-2, 60_000), max_size=8)

_sampling = {
    "model": st.sampled_from(["SmolLM2-135M-Instruct", "nope", ""]) | _any_json,
    "max_tokens": st.integers(-2, 4) | _any_json,
    "n": st.integers(-1, 20) | _any_json,
    "temperature": _numbers | _any_json,
    "top_p": _numbers,
    "top_k": _small_ints,
    "min_p": _numbers,
    "seed": _small_ints,
    "stop": _text | st.lists(_text, max_size=20) | _any_json,
    "stop_token_ids": _token_ids | _any_json,
    "presence_penalty": _numbers,
    "frequency_penalty": _numbers,
    "repetition_penalty": _numbers,
    "logit_bias": st.dictionaries(st.sampled_from(["0", "5", "-1", "x", "99999999"]), _numbers, max_size=3),
    "ignore_eos": st.booleans() | _any_json,
    "min_tokens": st.integers(-2, 6) | st.integers(-(2**65), 2**65),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | _any_json,
    "priority": _small_ints,
    "cache_salt": _text | _any_json,
    "user": _text,
}
_completion_only = {
    "prompt": _text
    | st.lists(_text, min_size=0, max_size=3)
    | _token_ids
    | st.lists(_token_ids, max_size=2)
    | _any_json,
    "logprobs": st.integers(-1, 25) | _any_json,
    "echo": st.booleans(),
    "prompt_logprobs": st.integers(-1, 25),
    "best_of": st.integers(0, 3),
    "suffix": _text,
}
_message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", "robot"]) | _any_json},
    optional={
        "content": _text
        | st.lists(
            st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]), "text": _text}), max_size=2
        )
        | _any_json
    },
)
_chat_only = {
    "messages": st.lists(_message, max_size=3) | _any_json,
    "logprobs": st.booleans() | _any_json,
    "top_logprobs": st.integers(-1, 25),
    "max_completion_tokens": st.integers(-1, 4),
}

completion_bodies = st.fixed_dictionaries(
    {"prompt": _completion_only.pop("prompt")}, optional={**_sampling, **_completion_only}
)
chat_bodies = st.fixed_dictionaries(
    {"messages": _chat_only.pop("messages")}, optional={**_sampling, **_chat_only}
)
requests = st.one_of(
    st.tuples(st.just("/v1/completions"), completion_bodies),
    st.tuples(st.just("/v1/chat/completions"), chat_bodies),
    st.tuples(st.sampled_from(["/v1/completions", "/v1/chat/completions"]), _any_json),
)


@pytest.fixture(scope="module")
def stack(default_model_dir, tmp_path_factory):
    stack = Stack(default_model_dir, tmp_path_factory.mktemp("fuzz-logs"), num_workers=1, num_blocks=512)
    with running(stack):
        yield stack


@pytest.fixture(scope="module")
def client(stack):
    with httpx.Client(base_url=stack.http_url, timeout=60) as client:
        yield client


def _bounded(body):
    """Keep generation short: the fuzz is about the API's edges, not about long outputs. A null limit is
    no limit (the context's end: thousands of tokens with ignore_eos, past the client's timeout), so it is
    bounded as a large one is."""
    if isinstance(body, dict):
        for key in ("max_tokens", "max_completion_tokens"):
            if key in body and (body[key] is None or (isinstance(body[key], int) and body[key] > 4)):
                body[key] = 4
        if "max_tokens" not in body and "max_completion_tokens" not in body:
            body["max_tokens"] = 2
        if isinstance(body.get("n"), int) and body["n"] > 4:
            body["n"] = body["n"] if body["n"] > 16 else 4  # > 16 is refused anyway
    return body


def test_fuzzed_bodies_never_give_5xx_and_errors_have_openai_shape(stack, client):
    seen: dict[int, int] = {}

    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(requests)
    def check(request):
        path, body = request
        response = client.post(path, json=_bounded(body))
        seen[response.status_code] = seen.get(response.status_code, 0) + 1
        assert response.status_code < 500, (body, response.text)
        if response.status_code >= 400:
            assert_openai_error(response)
        elif response.headers["content-type"].startswith("text/event-stream"):
            assert response.text.rstrip().endswith("data: [DONE]"), response.text
        else:
            assert response.json()["choices"] is not None

    check()
    print(f"status codes over {EXAMPLES} fuzzed requests: {seen}")
    assert seen.get(200, 0) > 0 and sum(v for k, v in seen.items() if k >= 400) > 0
    ok = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
    stack.wait_idle(timeout=5)


@pytest.mark.parametrize(
    "raw",
    [b"", b"{", b"[1, 2]", b'"text"', b"null", b'{"prompt": "\\ud800"}', b"\xff\xfe", b'{"prompt": 1e999}'],
)
def test_malformed_bodies_are_400_in_openai_shape(client, raw):
    response = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert response.status_code < 500, response.text
    assert_openai_error(response)
