"""Hostile and malformed input against a live stack, over both OpenAI endpoints and gRPC Generate.

Three parts:
- HOSTILE, a table of named cases (what once crashed or hung the server, and every limit at and past
  its bound), each a test: the exact status (or gRPC code) and the parameter named.
- Property-based fuzzing (hypothesis) over the whole parameter space of /v1/completions,
  /v1/chat/completions and gRPC Generate: n up to its limit and beyond, seeds at both extremes, every
  sampling parameter at and past its bounds (NaN and infinities as raw JSON literals too), batches of
  prompts up to and past the limit, token ids negative and huge, long stop lists, deep nesting. Every
  request gets a 2xx or a 4xx in OpenAI's shape (a non-internal gRPC code with a message) within
  TIME_BOUND_S; requests go in concurrent batches, and after each batch a plain greedy request must be
  served with the text it had at the start.
- Deadlines: a gateway with a short --request-timeout and a gRPC caller's own deadline end requests
  with 504 / DEADLINE_EXCEEDED, and the engine lets go of them.

The stack's limits are small where the work grows with them (--max-prompts 8, --max-messages 16, a
2048-token context), so that requests at the limits stay quick; n keeps the gateway's default (16).
"""

from __future__ import annotations

import json
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import grpc
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from stack_testing import MODEL, Stack, assert_openai_error, running, sse_lines, wait_for

from pagedserve.v1 import common_pb2, text_generation_pb2, text_generation_pb2_grpc

pytestmark = pytest.mark.slow

KEY = "fuzz-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
GRPC_AUTH = [("authorization", f"Bearer {KEY}")]
VOCAB = 49152  # SmolLM2's vocabulary
MAX_MODEL_LEN = 2048
MAX_PROMPTS = 8
MAX_MESSAGES = 16
MAX_N = 16  # the gateway's default --max-n
MAX_BODY_BYTES = 1_000_000
TIME_BOUND_S = 60.0
GREEDY = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
HTTP_EXAMPLES = 20  # batches of 1 to 3 requests each
GRPC_EXAMPLES = 12
NAN, INF = math.nan, math.inf


@pytest.fixture(scope="module")
def stack(default_model_dir, tmp_path_factory):
    gateway_args = ["--api-key", KEY, "--max-prompts", str(MAX_PROMPTS), "--max-messages", str(MAX_MESSAGES)]
    gateway_args += ["--max-body-bytes", str(MAX_BODY_BYTES), "--request-timeout", str(TIME_BOUND_S)]
    stack = Stack(
        default_model_dir,
        tmp_path_factory.mktemp("fuzz-logs"),
        num_workers=1,
        num_blocks=512,
        scheduler_args=["--max-model-len", str(MAX_MODEL_LEN)],
        gateway_args=gateway_args,
    )
    with running(stack):
        yield stack


@pytest.fixture(scope="module")
def client(stack):
    with httpx.Client(base_url=stack.http_url, timeout=TIME_BOUND_S + 30, headers=AUTH) as client:
        yield client


@pytest.fixture(scope="module")
def stub(stack):
    with grpc.insecure_channel(stack.grpc_address) as channel:
        yield text_generation_pb2_grpc.TextGenerationServiceStub(channel)


@pytest.fixture(scope="module")
def greedy_text(client) -> str:
    """What the plain greedy request answers on the fresh stack: every later batch must leave it so."""
    response = client.post("/v1/completions", json=GREEDY)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def _served_greedy(client: httpx.Client, greedy_text: str) -> None:
    response = client.post("/v1/completions", json=GREEDY)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["choices"][0]["text"] == greedy_text and body["usage"]["completion_tokens"] == 4


# ---- sending, and what every answer must look like ----


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def _encode(body: Any) -> bytes:
    """The body as JSON text: NaN and infinities as the literals Python's parser takes (NaN, Infinity),
    and a field `"<nest:D>"` as an array nested D deep (too deep to build as Python objects)."""
    if isinstance(body, bytes):
        return body
    text = json.dumps(body, allow_nan=True)
    for depth in (63, 64, 65, 100_000):
        text = text.replace(f'"<nest:{depth}>"', _nested(depth))
    return text.encode()


def post(client: httpx.Client, path: str, body: Any, headers: dict | None = None) -> httpx.Response:
    started = time.monotonic()
    response = client.post(
        path, content=_encode(body), headers={"content-type": "application/json", **(headers or {})}
    )
    elapsed = time.monotonic() - started
    assert elapsed < TIME_BOUND_S, f"{elapsed:.1f} s for {path} {str(body)[:300]}"
    return response


def check_http(response: httpx.Response, body: Any) -> int:
    """A 2xx with a whole response or a whole stream, or a 4xx in OpenAI's shape; the status."""
    what = f"{str(body)[:500]} -> {response.status_code} {response.text[:500]}"
    assert response.status_code < 500, what
    if response.status_code >= 400:
        assert_openai_error(response)
    elif response.headers["content-type"].startswith("text/event-stream"):
        events = [line.removeprefix("data: ") for line in sse_lines(response.text) if line]
        assert events[-1] == "[DONE]", what
        assert not any("error" in json.loads(e) for e in events[:-1]), what
    else:
        assert response.json()["choices"], what
    return response.status_code


@dataclass
class GrpcOutcome:
    code: grpc.StatusCode
    details: str = ""
    messages: list = field(default_factory=list)


def grpc_generate(stub, request: text_generation_pb2.GenerateRequest, metadata=GRPC_AUTH) -> GrpcOutcome:
    started = time.monotonic()
    try:
        messages = list(stub.Generate(request, metadata=metadata, timeout=TIME_BOUND_S))
        outcome = GrpcOutcome(grpc.StatusCode.OK, messages=messages)
    except grpc.RpcError as error:
        outcome = GrpcOutcome(error.code(), error.details() or "")
    assert time.monotonic() - started < TIME_BOUND_S, request
    return outcome


# What a refusal of a gRPC request may be: the caller's fault, said in words.
CLIENT_CODES = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND}


def check_grpc(outcome: GrpcOutcome, request) -> None:
    what = f"{str(request)[:500]} -> {outcome.code} {outcome.details[:300]}"
    if outcome.code == grpc.StatusCode.OK:
        assert outcome.messages and outcome.messages[-1].HasField("usage"), what
    else:
        assert outcome.code in CLIENT_CODES and outcome.details, what


# ---- the table of hostile and malformed cases ----


@dataclass(frozen=True)
class Http:
    path: str
    body: Any  # a JSON-able value, or bytes sent as they are
    status: int
    param: str | None = None  # the parameter the error must name (None: not checked)
    headers: dict | None = None


@dataclass(frozen=True)
class Grpc:
    request: dict  # GenerateRequest fields
    code: grpc.StatusCode
    fragment: str = ""  # in the details
    method: str = "Generate"
    metadata: tuple = tuple(GRPC_AUTH)


def _chat(**fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields}


def _cmpl(**fields) -> dict:
    return {"model": MODEL, "prompt": "hi", "max_tokens": 2, **fields}


def _raw(template: str) -> bytes:
    """A body written as text: for NaN and Infinity literals and other things json.dumps will not make."""
    return template.encode()


C, CHAT = "/v1/completions", "/v1/chat/completions"
CTX = [1] * MAX_MODEL_LEN  # one token too many: no room left to generate
HOSTILE = {
    # What once crashed or hung the stack.
    "20k token-id prompts": Http(C, _cmpl(prompt=[[1, 2]] * 20_000), 400, "prompt"),
    "nested 100k deep": Http(C, _cmpl(extra="<nest:100000>"), 400),
    "n=2 seed=-1 (used to hang)": Http(C, {"prompt": "hi", "n": 2, "seed": -1, "max_tokens": 3}, 200),
    # Nesting, body, JSON itself.
    # (The body's own object is one level: an array 64 deep in it makes 65.)
    "nested 65 deep": Http(C, _cmpl(extra="<nest:64>"), 400),
    "nested 64 deep is fine": Http(C, _cmpl(extra="<nest:63>"), 200),
    "body over the limit": Http(C, _cmpl(prompt="x" * MAX_BODY_BYTES), 413),
    "5000-digit integer": Http(C, _raw('{"prompt": "hi", "seed": ' + "9" * 5000 + "}"), 400),
    "not JSON": Http(C, b"{nope", 400),
    "invalid UTF-8": Http(C, b'{"prompt": "\xff\xfe"}', 400),
    "JSON array body": Http(C, b"[1, 2]", 400),
    "JSON null body": Http(C, b"null", 400),
    "empty body": Http(C, b"", 400),
    "lone surrogate": Http(C, _raw('{"prompt": "\\ud800", "max_tokens": 2}'), 400, "prompt"),
    # NaN and infinities, as JSON literals.
    "temperature NaN": Http(C, _raw('{"prompt": "hi", "temperature": NaN}'), 400, "temperature"),
    "top_p Infinity": Http(C, _raw('{"prompt": "hi", "top_p": Infinity}'), 400, "top_p"),
    "presence -Infinity": Http(C, _raw('{"prompt": "hi", "presence_penalty": -Infinity}'), 400),
    "min_p NaN": Http(CHAT, _raw('{"messages": [{"role": "user", "content": "x"}], "min_p": NaN}'), 400),
    "repetition 1e999": Http(C, _raw('{"prompt": "hi", "repetition_penalty": 1e999}'), 400),
    "logit_bias NaN": Http(C, _raw('{"prompt": "hi", "logit_bias": {"5": NaN}}'), 400, "logit_bias"),
    "frequency 1e308": Http(C, _cmpl(frequency_penalty=1e308), 400, "frequency_penalty"),
    "temperature 1e308": Http(C, _cmpl(temperature=1e308), 400, "temperature"),
    # n and seeds.
    "n at the limit": Http(C, _cmpl(n=MAX_N, max_tokens=1), 200),
    "n past the limit": Http(C, _cmpl(n=MAX_N + 1), 400, "n"),
    "n = 2^32": Http(C, _cmpl(n=2**32), 400, "n"),
    "n = 0": Http(C, _cmpl(n=0), 400, "n"),
    "n = -1": Http(CHAT, _chat(n=-1), 400, "n"),
    "seed 2^64 - 1": Http(C, _cmpl(n=2, seed=2**64 - 1), 200),
    "seed 2^64": Http(C, _cmpl(n=2, seed=2**64), 200),
    "seed -(2^70)": Http(CHAT, _chat(n=2, seed=-(2**70)), 200),
    # Counts and lengths.
    "prompts at the limit": Http(C, _cmpl(prompt=["hi"] * MAX_PROMPTS, max_tokens=1), 200),
    "prompts past the limit": Http(C, _cmpl(prompt=["hi"] * (MAX_PROMPTS + 1)), 400, "prompt"),
    "messages past the limit": Http(CHAT, _chat(messages=[{"role": "user", "content": "x"}] * 17), 400),
    "content parts past the limit": Http(
        CHAT, _chat(messages=[{"role": "user", "content": [{"type": "text", "text": "x"}] * 17}]), 400
    ),
    "17 stop strings": Http(C, _cmpl(stop=["s"] * 17), 400, "stop"),
    "100k stop strings": Http(C, _cmpl(stop=["s"] * 100_000), 400, "stop"),
    "257-char stop string": Http(C, _cmpl(stop=["s" * 257]), 400, "stop"),
    "empty stop string": Http(C, _cmpl(stop=[""]), 400, "stop"),
    "257 stop token ids": Http(C, _cmpl(stop_token_ids=list(range(257))), 400, "stop_token_ids"),
    "negative stop token id": Http(C, _cmpl(stop_token_ids=[-1]), 400, "stop_token_ids"),
    "stop token id past the vocab": Http(C, _cmpl(stop_token_ids=[VOCAB]), 400, "stop_token_ids"),
    "1025 logit_bias entries": Http(C, _cmpl(logit_bias={str(i): 1 for i in range(1025)}), 400, "logit_bias"),
    "logit_bias key not an id": Http(C, _cmpl(logit_bias={"x": 1}), 400, "logit_bias"),
    "logit_bias id past the vocab": Http(C, _cmpl(logit_bias={str(VOCAB): 1}), 400, "logit_bias"),
    "logit_bias value 101": Http(C, _cmpl(logit_bias={"5": 101}), 400, "logit_bias"),
    "257-char request_id": Http(C, _cmpl(request_id="r" * 257), 400, "request_id"),
    "257-char x-request-id": Http(C, _cmpl(), 400, "x-request-id", {"x-request-id": "r" * 257}),
    "257-char cache_salt": Http(C, _cmpl(cache_salt="s" * 257), 400, "cache_salt"),
    "257-char user": Http(C, _cmpl(user="u" * 257), 400, "user"),
    # Token ids.
    "negative token id": Http(C, _cmpl(prompt=[1, -1]), 400, "prompt"),
    "token id 2^40": Http(C, _cmpl(prompt=[1, 2**40]), 400, "prompt"),
    "token id = vocab": Http(C, _cmpl(prompt=[[1], [VOCAB]]), 400, "prompt"),
    "prompt filling the context": Http(C, _cmpl(prompt=CTX), 400, "prompt"),
    "300k token ids": Http(C, _cmpl(prompt=[1] * 300_000), 400, "prompt"),
    "empty token-id prompt": Http(C, _cmpl(prompt=[[]]), 400, "prompt"),
    "text too long to tokenize": Http(C, _cmpl(prompt="x" * 900_000), 400, "prompt"),
    "detokenize 100k ids": Http("/detokenize", {"tokens": [1] * 100_000}, 400, "tokens"),
    "detokenize negative id": Http("/detokenize", {"tokens": [-5]}, 400, "tokens"),
    # Ranges and types.
    "max_tokens 2^64": Http(C, _cmpl(max_tokens=2**64), 400, "max_tokens"),
    "max_tokens 0": Http(C, _cmpl(max_tokens=0), 400, "max_tokens"),
    "max_tokens past the context": Http(C, _cmpl(max_tokens=MAX_MODEL_LEN), 400, "max_tokens"),
    "min_tokens over max_tokens": Http(C, _cmpl(min_tokens=3), 400, "min_tokens"),
    "top_k 2^31": Http(C, _cmpl(top_k=2**31), 400, "top_k"),
    "top_k -2": Http(C, _cmpl(top_k=-2), 400, "top_k"),
    "top_k 2^31 - 1 is fine": Http(C, _cmpl(top_k=2**31 - 1), 200),
    "priority 2^31": Http(C, _cmpl(priority=2**31), 400, "priority"),
    "logprobs 21": Http(C, _cmpl(logprobs=21), 400, "logprobs"),
    "top_logprobs 21": Http(CHAT, _chat(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    "temperature as text": Http(C, _cmpl(temperature="hot"), 400, "temperature"),
    "role robot": Http(CHAT, _chat(messages=[{"role": "robot", "content": "x"}]), 400, "messages"),
    "image content part": Http(
        CHAT, _chat(messages=[{"role": "user", "content": [{"type": "image_url", "text": "x"}]}]), 400
    ),
    "unknown model": Http(C, _cmpl(model="nope"), 404, "model"),
    "best_of 2": Http(C, _cmpl(best_of=2), 400, "best_of"),
    # Keys.
    "no key on /tokenize": Http("/tokenize", {"prompt": "x"}, 401, headers={"Authorization": ""}),
    "wrong key on /v1": Http(C, _cmpl(), 401, headers={"Authorization": "Bearer nope"}),
    # gRPC.
    "gRPC n=2 seed 2^64-1": Grpc(
        {"prompt": "hi", "sampling": {"n": 2, "seed": 2**64 - 1, "max_tokens": 3}}, grpc.StatusCode.OK
    ),
    "gRPC n 2^32-1": Grpc(
        {"prompt": "hi", "sampling": {"n": 2**32 - 1}}, grpc.StatusCode.INVALID_ARGUMENT, "n"
    ),
    "gRPC n past the limit": Grpc(
        {"prompt": "hi", "sampling": {"n": MAX_N + 1}}, grpc.StatusCode.INVALID_ARGUMENT, "n"
    ),
    "gRPC temperature NaN": Grpc(
        {"prompt": "hi", "sampling": {"temperature": NAN}}, grpc.StatusCode.INVALID_ARGUMENT, "temperature"
    ),
    "gRPC top_p Infinity": Grpc(
        {"prompt": "hi", "sampling": {"top_p": INF}}, grpc.StatusCode.INVALID_ARGUMENT, "top_p"
    ),
    "gRPC token id 2^32-1": Grpc(
        {"prompt_token_ids": [1, 2**32 - 1]}, grpc.StatusCode.INVALID_ARGUMENT, "vocabulary"
    ),
    "gRPC prompt filling the context": Grpc(
        {"prompt_token_ids": CTX}, grpc.StatusCode.INVALID_ARGUMENT, "context length"
    ),
    "gRPC 100k stop strings": Grpc(
        {"prompt": "hi", "sampling": {"stop": ["s"] * 100_000}}, grpc.StatusCode.INVALID_ARGUMENT, "stop"
    ),
    "gRPC logit_bias id 2^32-1": Grpc(
        {"prompt": "hi", "sampling": {"logit_bias": {2**32 - 1: 1.0}}},
        grpc.StatusCode.INVALID_ARGUMENT,
        "logit_bias",
    ),
    "gRPC messages past the limit": Grpc(
        {"messages": [{"role": "user", "content": "x"}] * 17}, grpc.StatusCode.INVALID_ARGUMENT, "messages"
    ),
    "gRPC 257-char request_id": Grpc(
        {"prompt": "hi", "request_id": "r" * 257}, grpc.StatusCode.INVALID_ARGUMENT, "request_id"
    ),
    "gRPC 257-char cache_salt": Grpc(
        {"prompt": "hi", "cache_salt": "s" * 257}, grpc.StatusCode.INVALID_ARGUMENT, "cache_salt"
    ),
    "gRPC prompt and token ids": Grpc(
        {"prompt": "hi", "prompt_token_ids": [1]}, grpc.StatusCode.INVALID_ARGUMENT, "exactly one"
    ),
    "gRPC unknown model": Grpc({"prompt": "hi", "model": "nope"}, grpc.StatusCode.NOT_FOUND, "nope"),
    "gRPC no key": Grpc({"prompt": "hi"}, grpc.StatusCode.UNAUTHENTICATED, metadata=()),
    "gRPC Tokenize no key": Grpc(
        {"text": "hi"}, grpc.StatusCode.UNAUTHENTICATED, method="Tokenize", metadata=()
    ),
}


def _grpc_request(method: str, fields: dict):
    fields = dict(fields)
    if method == "Tokenize":
        return text_generation_pb2.TokenizeRequest(**fields)
    sampling = {"max_tokens": 2, **fields.pop("sampling", {})}
    messages = [text_generation_pb2.ChatMessage(**m) for m in fields.pop("messages", [])]
    return text_generation_pb2.GenerateRequest(
        sampling=common_pb2.SamplingParams(**sampling), messages=messages, **fields
    )


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_and_malformed_requests_get_their_4xx_or_are_served(client, stub, name):
    case = HOSTILE[name]
    if isinstance(case, Http):
        response = post(client, case.path, case.body, case.headers)
        assert response.status_code == case.status, response.text[:500]
        check_http(response, case.body)
        if case.param is not None:
            assert assert_openai_error(response)["param"] == case.param
        return
    request = _grpc_request(case.method, case.request)
    if case.method == "Tokenize":
        with pytest.raises(grpc.RpcError) as refused:
            stub.Tokenize(request, metadata=case.metadata, timeout=TIME_BOUND_S)
        assert refused.value.code() == case.code
        return
    outcome = grpc_generate(stub, request, list(case.metadata))
    assert outcome.code == case.code, outcome.details
    assert case.fragment in outcome.details
    if outcome.code == grpc.StatusCode.OK:
        check_grpc(outcome, request)


def test_after_the_hostile_cases_the_stack_serves_and_holds_nothing(stack, client, greedy_text):
    _served_greedy(client, greedy_text)
    stack.wait_idle(timeout=30)


# ---- property-based fuzzing of the whole parameter space ----
#
# A fuzzed body is a valid one, each field drawn over its whole range (its bounds included), with up to
# two fields then replaced by values past their bounds, of the wrong type or malformed; or, now and
# then, any JSON at all. So most batches mix requests that are served with requests that are refused.


def edges(*values: Any) -> st.SearchStrategy:
    return st.sampled_from(values)


_any_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=12),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3)
    ),
    max_leaves=8,
)
_text = st.text(max_size=24)
_prompt_text = st.text(min_size=1, max_size=24)  # (an empty one is refused: no token to start from)
_stop_text = st.text(min_size=1, max_size=12)
_token_id = edges(0, 1, VOCAB - 1) | st.integers(0, VOCAB - 1)
_ids = st.lists(_token_id, min_size=1, max_size=8)
_identifier = edges("", "dup", "i" * 256) | st.text(max_size=16)
_bias = st.dictionaries(
    st.integers(0, VOCAB - 1).map(str), edges(-100, 0, 100) | st.floats(-100, 100), max_size=4
)

# Every field at any value in its range, its bounds included.
_VALID = {
    "model": st.just(MODEL),
    "max_tokens": edges(1, 2, 4),
    "n": edges(1, 2, MAX_N) | st.integers(1, 4),
    "temperature": edges(0.0, 1e-6, 2.0, 1e30) | st.floats(0, 2),
    "top_p": edges(1e-9, 1.0) | st.floats(1e-6, 1),
    "top_k": edges(-1, 0, 1, VOCAB, 2**31 - 1) | st.integers(1, 100),
    "min_p": edges(0.0, 1.0) | st.floats(0, 1),
    "seed": edges(-1, 0, 2**63, 2**64 - 1, 2**64, -(2**70)) | st.integers(-(2**70), 2**70),
    "stop": _stop_text | st.lists(_stop_text, max_size=3) | edges(["s"] * 16, ["s" * 256]),
    "stop_token_ids": st.lists(_token_id, max_size=3) | edges(list(range(256))),
    "presence_penalty": edges(-2.0, 2.0) | st.floats(-2, 2),
    "frequency_penalty": edges(-2.0, 2.0) | st.floats(-2, 2),
    "repetition_penalty": edges(1e-6, 1.0, 1e30) | st.floats(0.01, 2),
    "logit_bias": _bias | edges({str(i): 1.0 for i in range(1024)}),
    "ignore_eos": st.just(False),  # NOTE: true would only make the short outputs as long as max_tokens
    "min_tokens": edges(0, 1),
    "skip_special_tokens": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "priority": edges(-(2**31), 0, 2**31 - 1),
    "cache_salt": _identifier,
    "request_id": _identifier,
    "user": _identifier,
    "extra": edges(0, "<nest:63>") | _any_json,  # unknown fields are ignored
}
_VALID_COMPLETION = {
    "logprobs": edges(None, 0, 5, 20),
    "echo": st.booleans(),
    "prompt_logprobs": edges(0, 20),
    "best_of": st.just(None),
}
_VALID_CHAT = {
    "logprobs": st.booleans(),
    "max_completion_tokens": edges(1, 4),
    "add_generation_prompt": st.booleans(),
}
_prompts = edges(1, 2, MAX_PROMPTS).flatmap(
    lambda k: st.lists(_prompt_text, min_size=k, max_size=k) | st.lists(_ids, min_size=k, max_size=k)
)
_valid_prompt = _prompt_text | _ids | _prompts | edges([1] * 200)
_content = _text | st.lists(
    st.fixed_dictionaries({"type": st.just("text"), "text": _text}), min_size=1, max_size=3
)
_valid_message = st.fixed_dictionaries(
    {"role": edges("user", "system", "assistant", "developer"), "content": _content | st.none()}
)
_valid_messages = edges(1, 2, MAX_MESSAGES).flatmap(
    lambda k: st.lists(_valid_message, min_size=k, max_size=k)
)

# What may replace a field: past its bounds, of the wrong type, malformed.
_HOSTILE = {
    "model": edges("nope", 5),
    "max_tokens": edges(-1, 0, MAX_MODEL_LEN, 2**32, 2**64, "4"),
    "n": edges(-1, 0, MAX_N + 1, 2**32, 2**64, -(2**63), 1.5),
    "temperature": edges(-1e-9, -1.0, NAN, INF, -INF, 1e308, "hot"),
    "top_p": edges(0.0, -0.0, 1.001, NAN, INF, 2),
    "top_k": edges(-2, -(2**31) - 1, 2**31, 2**63),
    "min_p": edges(-1e-3, 1.001, NAN, INF),
    "seed": edges("x", 1.5, NAN),
    "stop": edges(["s"] * 17, ["s" * 257], [""], ["s"] * 5000, 5),
    "stop_token_ids": edges([-1], [VOCAB], [2**32], list(range(257))),
    "presence_penalty": edges(-2.001, 2.001, NAN, INF, -INF),
    "frequency_penalty": edges(-2.001, 2.001, NAN, -INF),
    "repetition_penalty": edges(0, -1, NAN, INF),
    "logit_bias": edges(
        {"x": 1},
        {"-1": 1},
        {str(VOCAB): 1},
        {"5": 101},
        {"5": NAN},
        {str(2**64): 1},
        {str(i): 1 for i in range(1025)},
    ),
    "min_tokens": edges(-1, 5, 2**32),
    "priority": edges(-(2**31) - 1, 2**31),
    "cache_salt": edges("s" * 257, 5),
    "request_id": edges("r" * 257, ["r"]),
    "user": edges("u" * 257, {}),
    "extra": edges("<nest:64>", "<nest:100000>"),
    "stream": edges("yes", 2),
}
_HOSTILE_COMPLETION = {
    "prompt": edges(
        [], [[]], [-1], [VOCAB], [2**40], CTX, [[1]] * (MAX_PROMPTS + 1), ["a"] * (MAX_PROMPTS + 1)
    )
    | edges([1, "a"], {"x": 1}, [1] * 300_000)
    | _any_json,
    "logprobs": edges(-1, 21, 2**32),
    "prompt_logprobs": edges(-1, 21),
    "best_of": edges(0, 2),
    "suffix": st.just("x"),
}
_HOSTILE_CHAT = {
    "messages": edges(
        [],
        [{"role": "user", "content": "x"}] * (MAX_MESSAGES + 1),
        [{"role": "robot", "content": "x"}],
        [{"role": "user", "content": [{"type": "image_url", "text": "x"}]}],
        [{"role": "user", "content": [{"type": "text", "text": "x"}] * (MAX_MESSAGES + 1)}],
    )
    | _any_json,
    "top_logprobs": edges(-1, 21),
    "max_completion_tokens": edges(0, 2**32),
}


@st.composite
def _bodies(draw, required: dict, valid: dict, hostile: dict) -> dict:
    body = draw(st.fixed_dictionaries(required, optional=valid))
    for _ in range(draw(edges(0, 0, 1, 2))):
        field = draw(st.sampled_from(sorted(hostile)))
        body[field] = draw(hostile[field])
    return body


_completion_request = st.tuples(
    st.just(C),
    _bodies({"prompt": _valid_prompt}, {**_VALID, **_VALID_COMPLETION}, {**_HOSTILE, **_HOSTILE_COMPLETION}),
)
_chat_request = st.tuples(
    st.just(CHAT),
    _bodies({"messages": _valid_messages}, {**_VALID, **_VALID_CHAT}, {**_HOSTILE, **_HOSTILE_CHAT}),
)
_http_request = st.one_of(
    _completion_request,
    _chat_request,
    _completion_request,
    _chat_request,
    st.tuples(edges(C, CHAT), _any_json),
)


def _bounded(body: Any) -> Any:
    """Keep generation short: the fuzz is about the API's edges, not long outputs. Without a limit
    (the rest of the context) a request gets 2 tokens; the limits past their bounds stay, to be refused."""
    if isinstance(body, dict) and "max_tokens" not in body and "max_completion_tokens" not in body:
        body["max_tokens"] = 2
    return body


FUZZ_SETTINGS = settings(deadline=None, suppress_health_check=list(HealthCheck), database=None)


def test_fuzzed_http_batches_get_2xx_or_openai_4xx_and_the_stack_keeps_serving(stack, client, greedy_text):
    seen: dict[int, int] = {}
    lock = threading.Lock()

    def one(request) -> None:
        path, body = request
        status = check_http(post(client, path, _bounded(body)), body)
        with lock:
            seen[status] = seen.get(status, 0) + 1

    @settings(FUZZ_SETTINGS, max_examples=HTTP_EXAMPLES)
    @given(st.lists(_http_request, min_size=1, max_size=3))
    def batch(requests):
        with ThreadPoolExecutor(len(requests)) as pool:
            list(pool.map(one, requests))
        _served_greedy(client, greedy_text)

    batch()
    print(f"HTTP status codes over {sum(seen.values())} fuzzed requests: {dict(sorted(seen.items()))}")
    assert seen.get(200, 0) > 0 and sum(v for k, v in seen.items() if k >= 400) > 0
    stack.wait_idle(timeout=30)


_F32_VALID = {
    "temperature": edges(0.0, 2.0, 1e30) | st.floats(0, 2),
    "top_p": edges(1e-9, 1.0) | st.floats(1e-6, 1),
    "min_p": edges(0.0, 1.0) | st.floats(0, 1),
    "presence_penalty": edges(-2.0, 2.0) | st.floats(-2, 2),
    "frequency_penalty": edges(-2.0, 2.0) | st.floats(-2, 2),
    "repetition_penalty": edges(1e-6, 1.0) | st.floats(0.01, 2),
}
_GRPC_VALID = {
    **_F32_VALID,
    "max_tokens": edges(1, 2, 4),
    "top_k": edges(0, 1, 40, VOCAB, 2**31 - 1),
    "seed": edges(0, 1, 2**63, 2**64 - 1) | st.integers(0, 2**64 - 1),
    "stop": st.lists(_stop_text, max_size=3),
    "stop_token_ids": st.lists(_token_id, max_size=3),
    "n": edges(0, 1, 2, MAX_N),
    "logprobs": edges(0, 2, 20),
    "min_tokens": edges(0, 1),
    "logit_bias": st.dictionaries(st.integers(0, VOCAB - 1), st.floats(-100, 100), max_size=3),
    "prompt_logprobs": edges(0, 20),
    "skip_special_tokens": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
}
_GRPC_HOSTILE = {
    "temperature": edges(-1.0, NAN, INF, -INF),
    "top_p": edges(0.0, 1.5, NAN, INF),
    "min_p": edges(-0.5, 1.5, NAN),
    "presence_penalty": edges(-3.0, 3.0, NAN, INF),
    "frequency_penalty": edges(-3.0, NAN, -INF),
    "repetition_penalty": edges(0.0, -1.0, NAN, INF),
    "max_tokens": edges(0, MAX_MODEL_LEN, 2**32 - 1),
    "top_k": edges(-(2**31), -2),
    "stop": edges(["s"] * 17, ["s" * 257], [""], ["s"] * 5000),
    "stop_token_ids": edges([VOCAB], [2**32 - 1], list(range(257))),
    "n": edges(MAX_N + 1, 2**32 - 1),
    "logprobs": edges(21, 2**32 - 1),
    "min_tokens": edges(5, 2**32 - 1),
    "logit_bias": edges({VOCAB: 1.0}, {2**32 - 1: 1.0}, {5: 101.0}, {5: NAN}, {i: 1.0 for i in range(1025)}),
    "prompt_logprobs": edges(21, 2**32 - 1),
}
_grpc_message = st.fixed_dictionaries(
    {"role": edges("user", "system", "assistant", "robot", ""), "content": _text}
)
_GRPC_PROMPTS = {
    "prompt": _prompt_text,
    "messages": edges(1, 2, MAX_MESSAGES).flatmap(lambda k: st.lists(_grpc_message, min_size=k, max_size=k)),
    "prompt_token_ids": _ids,
}
_GRPC_HOSTILE_PROMPTS = {
    "messages": edges(0, MAX_MESSAGES + 1).flatmap(lambda k: st.lists(_grpc_message, min_size=k, max_size=k)),
    "prompt_token_ids": edges([], [VOCAB], [2**32 - 1], CTX, [1] * 300_000),
    "prompt": st.just(""),
}
_GRPC_VALID_EXTRA = {
    "model": edges(MODEL, ""),
    "request_id": edges("", "dup", "i" * 256),
    "cache_salt": edges("", "s", "s" * 256),
    "priority": edges(-(2**31), -1, 0, 2**31 - 1),
}
_GRPC_HOSTILE_EXTRA = {
    "model": st.just("nope"),
    "request_id": st.just("r" * 257),
    "cache_salt": st.just("s" * 257),
}


@st.composite
def _grpc_requests(draw) -> text_generation_pb2.GenerateRequest:
    kind = draw(st.sampled_from(sorted(_GRPC_PROMPTS)))
    prompt = {kind: draw(_GRPC_PROMPTS[kind])}
    sampling = draw(st.fixed_dictionaries({}, optional=_GRPC_VALID))
    extra = draw(st.fixed_dictionaries({}, optional=_GRPC_VALID_EXTRA))
    for _ in range(draw(edges(0, 0, 1, 2))):
        where = draw(edges("sampling", "sampling", "prompt", "extra"))
        if where == "sampling":
            field = draw(st.sampled_from(sorted(_GRPC_HOSTILE)))
            sampling[field] = draw(_GRPC_HOSTILE[field])
        elif where == "prompt":
            field = draw(st.sampled_from(sorted(_GRPC_HOSTILE_PROMPTS)))
            prompt[field] = draw(_GRPC_HOSTILE_PROMPTS[field])  # may also make two prompt kinds
        else:
            field = draw(st.sampled_from(sorted(_GRPC_HOSTILE_EXTRA)))
            extra[field] = draw(_GRPC_HOSTILE_EXTRA[field])
    sampling.setdefault("max_tokens", 2)
    messages = [text_generation_pb2.ChatMessage(**m) for m in prompt.pop("messages", [])]
    return text_generation_pb2.GenerateRequest(
        messages=messages, sampling=common_pb2.SamplingParams(**sampling), **prompt, **extra
    )


def test_fuzzed_grpc_batches_get_ok_or_a_client_error_and_the_stack_keeps_serving(
    stack, client, stub, greedy_text
):
    seen: dict[str, int] = {}
    lock = threading.Lock()

    def one(request) -> None:
        outcome = grpc_generate(stub, request)
        check_grpc(outcome, request)
        with lock:
            seen[outcome.code.name] = seen.get(outcome.code.name, 0) + 1

    @settings(FUZZ_SETTINGS, max_examples=GRPC_EXAMPLES)
    @given(st.lists(_grpc_requests(), min_size=1, max_size=3))
    def batch(requests):
        with ThreadPoolExecutor(len(requests)) as pool:
            list(pool.map(one, requests))
        _served_greedy(client, greedy_text)

    batch()
    print(f"gRPC codes over {sum(seen.values())} fuzzed requests: {seen}")
    assert seen.get("OK", 0) > 0 and seen.get("INVALID_ARGUMENT", 0) > 0
    stack.wait_idle(timeout=30)


# ---- deadlines ----

LONG = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": True}


@pytest.fixture(scope="module")
def hasty_gateway(stack, tmp_path_factory):
    """A second gateway on the same scheduler whose requests may take 2 s."""
    hasty = Stack(
        stack.model_dir,
        tmp_path_factory.mktemp("hasty-gateway-logs"),
        engine_port=stack.engine_port,
        cluster_token=stack.cluster_token,
        gateway_args=["--api-key", KEY, "--request-timeout", "2"],
    )
    hasty.start_gateway()
    try:
        hasty.wait_http_ready(timeout=120)
        yield hasty
    finally:
        hasty.stop()


def test_past_the_request_timeout_the_client_gets_504_or_an_error_event_and_the_engine_lets_go(
    stack, hasty_gateway
):
    stack.wait_idle(timeout=30)
    with httpx.Client(base_url=hasty_gateway.http_url, timeout=30, headers=AUTH) as client:
        # 1500 tokens take far longer than the gateway's 2 s on any CPU: only the deadline ends the request.
        response = client.post("/v1/completions", json=LONG)
        assert assert_openai_error(response, 504)["type"] == "timeout"
        stack.wait_idle(timeout=30)
        response = client.post("/v1/completions", json={**LONG, "stream": True})
        if response.status_code == 200:  # tokens came before the deadline: the stream ends with its error
            events = [line.removeprefix("data: ") for line in sse_lines(response.text) if line]
            assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["type"] == "timeout"
        else:  # a loaded machine's first token came after it: nothing was streamed yet, so a plain 504
            assert assert_openai_error(response, 504)["type"] == "timeout"
        stack.wait_idle(timeout=30)
    with grpc.insecure_channel(hasty_gateway.grpc_address) as channel:
        stub = text_generation_pb2_grpc.TextGenerationServiceStub(channel)
        request = text_generation_pb2.GenerateRequest(
            prompt="Once upon a time", sampling=common_pb2.SamplingParams(max_tokens=1500, ignore_eos=True)
        )
        outcome = grpc_generate(stub, request)
        assert outcome.code == grpc.StatusCode.DEADLINE_EXCEEDED and outcome.details
    stack.wait_idle(timeout=30)


def test_the_grpc_callers_own_deadline_ends_the_request_at_the_engine(stack, stub):
    stack.wait_idle(timeout=30)
    request = text_generation_pb2.GenerateRequest(
        prompt="Once upon a time", sampling=common_pb2.SamplingParams(max_tokens=1500, ignore_eos=True)
    )
    with pytest.raises(grpc.RpcError) as late:
        list(stub.Generate(request, metadata=GRPC_AUTH, timeout=2))
    assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_for(lambda: stack.engine_stats().num_requests_running == 0, 30, "still running past its deadline")
    stack.wait_idle(timeout=30)
