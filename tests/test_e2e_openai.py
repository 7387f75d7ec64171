"""The whole stack as users start it (`pagedserve serve`), driven by the real openai SDK, by raw HTTP
(httpx, for the exact wire format) and by the public gRPC API. One stack is shared by the module;
the last test stops it with SIGTERM. Every test checks what a parameter does, not only that it is
accepted.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import threading
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from stack_testing import MODEL, Stack, running, wait_for

from pagedserve.v1 import common_pb2, text_generation_pb2, text_generation_pb2_grpc

pytestmark = pytest.mark.slow

API_KEY = "test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
# Greedy answers it in three tokens ("No." and EOS): a prompt where EOS comes early.
SHORT_ANSWER = [{"role": "user", "content": "Is the sky blue? Answer yes or no."}]
PROMPT = "The capital of France is"
MAX_BODY_BYTES = 200_000
MAX_MODEL_LEN = 4096  # 256 blocks of 16 tokens: the pool bounds the context
MAX_NUM_SEQS = 4  # a request with n=4 takes every slot, so that the next one waits
GRPC_AUTH = [("authorization", f"Bearer {API_KEY}")]


@pytest.fixture(scope="module")
def served(default_model_dir, tmp_path_factory):
    args = ["--api-key", API_KEY, "--dtype", "float32", "--num-blocks", "256", "--log-level", "warning"]
    args += ["--max-num-seqs", str(MAX_NUM_SEQS)]
    env = {"PAGEDSERVE_MAX_BODY_BYTES": str(MAX_BODY_BYTES)}
    log_dir = tmp_path_factory.mktemp("e2e-openai-logs")
    with running(Stack(default_model_dir, log_dir, serve_args=args, env=env)) as stack:
        stack.client = openai.OpenAI(
            base_url=stack.openai_base_url, api_key=API_KEY, max_retries=0, timeout=600
        )
        yield stack


def _chat(served: Stack, **kwargs):
    kwargs.setdefault("temperature", 0)
    kwargs.setdefault("max_tokens", 24)
    kwargs.setdefault("messages", QUESTION)
    return served.client.chat.completions.create(model=MODEL, **kwargs)


def _complete(served: Stack, **kwargs):
    kwargs.setdefault("temperature", 0)
    kwargs.setdefault("max_tokens", 8)
    kwargs.setdefault("prompt", PROMPT)
    return served.client.completions.create(model=MODEL, **kwargs)


def _tokenize(served: Stack, **body) -> list[int]:
    response = httpx.post(f"{served.http_url}/tokenize", json=body, headers=AUTH, timeout=10)
    assert response.status_code == 200, response.text
    data = response.json()
    assert data["count"] == len(data["tokens"]) and data["max_model_len"] == MAX_MODEL_LEN
    return data["tokens"]


def _token_id(served: Stack, text: str) -> int:
    ids = _tokenize(served, prompt=text, add_special_tokens=False)
    assert len(ids) == 1, ids
    return ids[0]


def _sse_events(served: Stack, path: str, body: dict) -> list[str]:
    """The raw `data:` payloads of a streamed response, in order."""
    events = []
    with httpx.stream(
        "POST", f"{served.openai_base_url}{path}", json=body, headers=AUTH, timeout=60
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line:
                assert line.startswith("data: "), line
                events.append(line.removeprefix("data: "))
    return events


# ---- the text endpoints and the service endpoints ----


def test_models_lists_the_served_model(served):
    models = served.client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].object == "model" and models[0].owned_by == "pagedserve"
    assert served.client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        served.client.models.retrieve("no-such-model")


def test_tokenize_and_detokenize_round_trip(served):
    ids = _tokenize(served, prompt=PROMPT)
    assert len(ids) == 5
    response = httpx.post(f"{served.http_url}/detokenize", json={"tokens": ids}, headers=AUTH, timeout=10)
    assert response.json() == {"prompt": PROMPT}
    chat_ids = _tokenize(served, messages=QUESTION)
    assert len(chat_ids) > len(_tokenize(served, prompt=QUESTION[0]["content"]))  # the template's turns
    bad = httpx.post(f"{served.http_url}/detokenize", json={"tokens": [10**9]}, headers=AUTH, timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_health_ready_version_and_metrics_answer(served):
    assert httpx.get(f"{served.http_url}/health", timeout=10).status_code == 200
    assert httpx.get(f"{served.http_url}/ready", timeout=10).json() == {"ready": True}
    assert httpx.get(f"{served.http_url}/version", timeout=10).json()["version"]
    metrics = httpx.get(f"{served.http_url}/metrics", timeout=10)
    assert metrics.status_code == 200 and "vllm:num_requests_running" in metrics.text


# ---- generation ----


def test_chat_answers_paris(served):
    response = _chat(served)
    assert "Paris" in response.choices[0].message.content
    assert response.choices[0].finish_reason == "stop"
    assert response.object == "chat.completion" and response.model == MODEL
    usage = response.usage
    assert usage.prompt_tokens == len(_tokenize(served, messages=QUESTION))
    assert usage.completion_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_completion_returns_text_and_usage(served):
    response = _complete(served, max_tokens=6)
    choice = response.choices[0]
    assert "Paris" in choice.text
    assert choice.finish_reason in ("length", "stop")
    assert response.usage.prompt_tokens == len(_tokenize(served, prompt=PROMPT))
    assert 0 < response.usage.completion_tokens <= 6


def test_every_prompt_form_gives_the_same_greedy_text(served):
    ids = _tokenize(served, prompt=PROMPT)
    text = _complete(served).choices[0].text
    assert _complete(served, prompt=ids).choices[0].text == text
    batch = _complete(served, prompt=[ids, ids[:3]]).choices
    assert [c.index for c in batch] == [0, 1] and batch[0].text == text
    assert batch[1].text == _complete(served, prompt=PROMPT.rsplit(" ", 2)[0]).choices[0].text


def test_list_prompts_give_choices_indexed_by_prompt_then_sample(served):
    prompts = [PROMPT, "Once upon a time"]
    response = _complete(served, prompt=prompts, n=2, max_tokens=5)
    choices = sorted(response.choices, key=lambda c: c.index)
    assert [c.index for c in choices] == [0, 1, 2, 3]
    for i, prompt in enumerate(prompts):
        alone = _complete(served, prompt=prompt, max_tokens=5).choices[0].text
        assert choices[2 * i].text == choices[2 * i + 1].text == alone
    assert response.usage.prompt_tokens == sum(len(_tokenize(served, prompt=p)) for p in prompts)


def test_n_gives_distinct_choices_and_usage_counts_them_all(served):
    response = _chat(served, n=3, temperature=1.0, seed=7, max_tokens=12, logprobs=True)
    assert sorted(c.index for c in response.choices) == [0, 1, 2]
    lengths = [len(c.logprobs.content) for c in response.choices]
    assert response.usage.completion_tokens == sum(lengths)
    assert len({c.message.content for c in response.choices}) > 1


def test_echo_prepends_the_prompt(served):
    plain = _complete(served).choices[0].text
    echoed = _complete(served, echo=True).choices[0].text
    assert echoed == PROMPT + plain


def test_max_tokens_and_ignore_eos_give_exactly_that_many_tokens(served):
    response = _chat(served, messages=SHORT_ANSWER, max_tokens=20, extra_body={"ignore_eos": True})
    assert response.usage.completion_tokens == 20 and response.choices[0].finish_reason == "length"
    response = _chat(served, messages=SHORT_ANSWER, max_completion_tokens=3, extra_body={"ignore_eos": True})
    assert response.usage.completion_tokens == 3 and response.choices[0].finish_reason == "length"
    completion = _complete(served, max_tokens=11, extra_body={"ignore_eos": True})
    assert completion.usage.completion_tokens == 11


def test_min_tokens_delays_the_end_of_sequence(served):
    early = _chat(served, messages=SHORT_ANSWER, max_tokens=30)
    assert early.usage.completion_tokens < 5 and early.choices[0].finish_reason == "stop"
    delayed = _chat(served, messages=SHORT_ANSWER, max_tokens=30, extra_body={"min_tokens": 10})
    assert delayed.usage.completion_tokens >= 10


def test_stop_string_ends_the_text_and_is_left_out(served):
    response = _chat(served, stop=["Paris"])
    content = response.choices[0].message.content
    assert "Paris" not in content and content.strip()
    assert response.choices[0].finish_reason == "stop"
    assert response.choices[0].model_extra["stop_reason"] == "Paris"


def test_stop_token_ids_end_at_that_token(served):
    whole = _chat(served).choices[0].message.content
    assert whole.startswith("The capital of France")
    france = _token_id(served, " France")
    response = _chat(served, extra_body={"stop_token_ids": [france]})
    choice = response.choices[0]
    assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] == france
    assert choice.message.content == "The capital of"  # the stop token's text is left out
    assert response.usage.completion_tokens == 4  # ...but it is counted


def test_logit_bias_forces_a_token(served):
    paris = _token_id(served, " Paris")
    response = _complete(served, max_tokens=6, logit_bias={str(paris): 100}, temperature=1.0)
    assert response.choices[0].text == " Paris" * 6


def test_top_k_one_top_p_tiny_and_min_p_one_equal_greedy(served):
    greedy = _chat(served, max_tokens=12).choices[0].message.content
    for extra in ({"top_k": 1}, {"min_p": 1.0}):
        sampled = _chat(served, max_tokens=12, temperature=1.5, seed=3, extra_body=extra)
        assert sampled.choices[0].message.content == greedy, extra
    sampled = _chat(served, max_tokens=12, temperature=1.5, seed=3, top_p=1e-6)
    assert sampled.choices[0].message.content == greedy


def test_seeds_reproduce_and_different_seeds_differ(served):
    kwargs = {"temperature": 1.5, "max_tokens": 16}
    first = _chat(served, seed=1234, **kwargs).choices[0].message.content
    assert _chat(served, seed=1234, **kwargs).choices[0].message.content == first
    others = {_chat(served, seed=seed, **kwargs).choices[0].message.content for seed in (1, 2)}
    assert others - {first}


def test_penalties_change_the_output(served):
    prompt = "one two one two one two one two"
    plain = _complete(served, prompt=prompt, max_tokens=16).choices[0].text
    for kwargs in (
        {"presence_penalty": 2.0},
        {"frequency_penalty": 2.0},
        {"extra_body": {"repetition_penalty": 1.8}},
    ):
        assert _complete(served, prompt=prompt, max_tokens=16, **kwargs).choices[0].text != plain, kwargs


def test_unknown_fields_and_user_are_accepted_and_change_nothing(served):
    plain = _chat(served, max_tokens=8).choices[0].message.content
    odd = _chat(served, max_tokens=8, user="e2e-user", extra_body={"no_such_field": {"x": 1}})
    assert odd.choices[0].message.content == plain


# ---- logprobs in both APIs' formats ----


def test_chat_logprobs_have_openais_shape(served):
    body = {
        "model": MODEL,
        "messages": QUESTION,
        "max_tokens": 5,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
    }
    data = httpx.post(
        f"{served.openai_base_url}/chat/completions", json=body, headers=AUTH, timeout=60
    ).json()
    content = data["choices"][0]["logprobs"]["content"]
    assert len(content) == data["usage"]["completion_tokens"]
    assert "".join(e["token"] for e in content) == data["choices"][0]["message"]["content"]
    for entry in content:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert entry["logprob"] <= 0 and bytes(entry["bytes"]) == entry["token"].encode()
        assert len(entry["top_logprobs"]) == 2
        for alt in entry["top_logprobs"]:
            assert set(alt) == {"token", "logprob", "bytes"}
        # Greedy: the chosen token is the most likely one.
        assert entry["top_logprobs"][0]["token"] == entry["token"]
        assert entry["top_logprobs"][0]["logprob"] >= entry["top_logprobs"][1]["logprob"]
    sdk = _chat(served, logprobs=True, top_logprobs=2, max_tokens=5).choices[0].logprobs.content
    assert [e.token for e in sdk] == [e["token"] for e in content]


def test_completion_logprobs_have_openais_shape(served):
    response = _complete(served, max_tokens=5, logprobs=2)
    choice = response.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:k]) for k in range(5)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert logprob <= 0 and token in top and top[token] == logprob
        assert max(top.values()) == logprob  # greedy picks the most likely
        assert 2 <= len(top) <= 3
    echoed = _complete(served, max_tokens=5, logprobs=2, echo=True).choices[0].logprobs
    num_prompt = len(_tokenize(served, prompt=PROMPT))
    assert len(echoed.tokens) == num_prompt + 5
    assert echoed.token_logprobs[0] is None and echoed.top_logprobs[0] is None  # nothing before it
    assert all(v <= 0 for v in echoed.token_logprobs[1:])
    assert echoed.tokens[num_prompt:] == lp.tokens


# ---- streaming ----


def test_streaming_equals_non_streaming_at_temperature_zero(served):
    whole = _chat(served)
    chunks = _chat(served, stream=True, stream_options={"include_usage": True})
    text, usage = [], None
    for chunk in chunks:
        if chunk.choices and chunk.choices[0].delta.content:
            text.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    assert "".join(text) == whole.choices[0].message.content
    _assert_same_counts(usage, whole.usage)

    complete = _complete(served, max_tokens=12)
    streamed = _complete(served, max_tokens=12, stream=True, stream_options={"include_usage": True})
    pieces, usage = [], None
    for chunk in streamed:
        pieces.extend(c.text for c in chunk.choices)
        usage = chunk.usage or usage
    assert "".join(pieces) == complete.choices[0].text
    _assert_same_counts(usage, complete.usage)
    # The first request's prompt and 12 tokens filled a block, which the prefix cache holds: the repeat
    # reuses every prompt token of it but the last (computed to sample), though the prompt is shorter
    # than a block.
    assert usage.prompt_tokens < 16 and usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1


def _assert_same_counts(repeat, first) -> None:
    # The number of cached prompt tokens may differ: the first request may have filled the cache.
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert [getattr(repeat, c) for c in counts] == [getattr(first, c) for c in counts]


def test_raw_sse_ends_with_done_and_usage_counts_the_streamed_tokens(served):
    body = {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": 10,
        "temperature": 0,
        "logprobs": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    events = _sse_events(served, "/completions", body)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == [] and usage_chunk["object"] == "text_completion"
    assert all(c["usage"] is None for c in chunks[:-1])
    streamed = sum(len(c["choices"][0]["logprobs"]["tokens"]) for c in chunks[:-1])
    assert usage_chunk["usage"]["completion_tokens"] == streamed == 10
    assert usage_chunk["usage"]["prompt_tokens"] == len(_tokenize(served, prompt=PROMPT))
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"

    chat = {"model": MODEL, "messages": QUESTION, "max_tokens": 8, "temperature": 0, "stream": True}
    events = _sse_events(served, "/chat/completions", chat)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" and "usage" not in c for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] is not None


# ---- errors, in OpenAI's shape ----


def _post_error(served: Stack, path: str, body: dict | str, headers=AUTH) -> tuple[int, dict]:
    kwargs = {"content": body} if isinstance(body, str) else {"json": body}
    response = httpx.post(f"{served.http_url}{path}", headers=headers, timeout=30, **kwargs)
    data = response.json()
    assert set(data) == {"error"} and set(data["error"]) == {"message", "type", "param", "code"}, data
    return response.status_code, data["error"]


def test_each_error_has_its_status_code_and_openais_shape(served):
    chat = {"model": MODEL, "messages": QUESTION}
    status, error = _post_error(served, "/v1/chat/completions", {**chat, "temperature": -1})
    assert status == 400 and error["type"] == "invalid_request_error" and error["param"] == "temperature"
    status, error = _post_error(served, "/v1/chat/completions", {**chat, "n": "many"})
    assert status == 400 and error["param"] == "n"
    status, error = _post_error(served, "/v1/chat/completions", "{not json")
    assert status == 400
    too_long = {"model": MODEL, "prompt": [1] * (MAX_MODEL_LEN + 1)}
    status, error = _post_error(served, "/v1/completions", too_long)
    assert status == 400 and "context length" in error["message"] and error["param"] == "prompt"
    status, error = _post_error(
        served, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 5000}
    )
    assert status == 400 and error["param"] == "max_tokens"
    status, error = _post_error(served, "/v1/chat/completions", {**chat, "model": "no-such-model"})
    assert status == 404 and "no-such-model" in error["message"]
    status, error = _post_error(served, "/v1/chat/completions", chat, headers={"Authorization": "Bearer no"})
    assert status == 401 and error["type"] == "authentication_error"
    assert httpx.get(f"{served.openai_base_url}/models", timeout=10).status_code == 401
    big = {"model": MODEL, "prompt": "x" * (MAX_BODY_BYTES + 10)}
    status, error = _post_error(served, "/v1/completions", big)
    assert status == 413
    # The SDK maps them onto its exception classes.
    with pytest.raises(openai.BadRequestError):
        _chat(served, temperature=-1)
    with pytest.raises(openai.NotFoundError):
        served.client.chat.completions.create(model="no-such-model", messages=QUESTION)
    wrong_key = openai.OpenAI(base_url=served.openai_base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong_key.chat.completions.create(model=MODEL, messages=QUESTION)


def test_the_api_key_guards_every_path_that_touches_the_model(served):
    for method, path, body in (
        ("GET", "/v1/models", None),
        ("POST", "/tokenize", {"prompt": "x"}),
        ("POST", "/detokenize", {"tokens": [1]}),
    ):
        refused = httpx.request(method, f"{served.http_url}{path}", json=body, timeout=10)
        assert refused.status_code == 401, path
        allowed = httpx.request(method, f"{served.http_url}{path}", json=body, headers=AUTH, timeout=10)
        assert allowed.status_code == 200, path
    for path in ("/health", "/ready", "/metrics", "/version"):
        assert httpx.get(f"{served.http_url}{path}", timeout=10).status_code == 200, path


# ---- metrics ----


def test_metrics_move_after_requests(served):
    served.wait_idle()
    before = served.scrape()
    long_prompt = " ".join(f"word{i}" for i in range(150))  # several full blocks
    for _ in range(2):
        _complete(served, prompt=long_prompt, max_tokens=4)
    after = served.scrape()

    def grew(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    prompt_len = len(_tokenize(served, prompt=long_prompt))
    assert grew("vllm:prefix_cache_queries_total") >= 2 * (prompt_len - 16)
    assert grew("vllm:prefix_cache_hits_total") >= (prompt_len - 1) // 16 * 16  # the second run's blocks
    assert grew("vllm:prompt_tokens_total") >= prompt_len
    assert grew("vllm:generation_tokens_total") >= 8
    for name in (
        "time_to_first_token_seconds",
        "time_per_output_token_seconds",
        "e2e_request_latency_seconds",
    ):
        assert grew(f"vllm:{name}_count") >= 2, name
        assert after[f"vllm:{name}_sum"] > 0
    assert grew("vllm:request_success_total[finished_reason=length]") == 2
    assert "vllm:num_preemptions_total" in after
    assert after["vllm:num_requests_running"] == 0 and after["vllm:kv_cache_usage_perc"] == 0

    # While a request runs: it is counted as running and holds part of the KV cache.
    stream = _chat(served, stream=True, max_tokens=300, extra_body={"ignore_eos": True})
    for i, _chunk in enumerate(stream):
        if i == 3:
            break
    during = served.scrape()
    stream.close()
    assert during["vllm:num_requests_running"] == 1 and during["vllm:num_requests_waiting"] == 0
    assert 0 < during["vllm:kv_cache_usage_perc"] <= 1
    served.wait_idle(timeout=10)


def _send_completion(served: Stack, body: dict) -> socket.socket:
    """POST /v1/completions on a raw socket, left unread, so the test chooses when the client goes away."""
    payload = json.dumps({"model": MODEL, "prompt": PROMPT, "ignore_eos": True, **body}).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {served.http_url[7:]}\r\nAuthorization: Bearer {API_KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
    )
    sock = socket.create_connection(served.http_url[7:].split(":"), timeout=10)
    sock.sendall(head.encode() + payload)
    return sock


def _load(served: Stack) -> tuple[int, int, int]:
    """What the engine holds now: KV blocks in use, sequences running, requests waiting."""
    stats = served.engine_stats()
    return stats.num_blocks_in_use, stats.num_requests_running, stats.num_requests_waiting


def _until_load(served: Stack, accept, what: str, timeout: float = 60.0) -> tuple[int, int, int]:
    """The engine's load once accept(blocks, running, waiting) holds (polled every 50 ms)."""

    def accepted() -> tuple[int, int, int] | None:
        load = _load(served)
        return load if accept(*load) else None

    return wait_for(accepted, timeout, what, 0.05)


@pytest.mark.parametrize("queued", [False, True], ids=["running", "queued"])
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streaming"])
def test_a_client_that_goes_away_frees_its_request_running_or_queued(served, stream, queued):
    # NOTE: the engine's load, not a counter of aborts: only the load shows the request's blocks freed.
    # An abort that did not happen leaves it running thousands of tokens, or waiting behind the filler
    # for as long, far past the generous deadlines below.
    before = _until_load(served, lambda *load: load == (0, 0, 0), "not idle before the test")
    filler = None
    if queued:  # every slot taken by one request's forks: the next request waits
        filler = _send_completion(served, {"n": MAX_NUM_SEQS, "max_tokens": 900, "temperature": 1.0})
        _until_load(served, lambda blocks, running, waiting: running == MAX_NUM_SEQS, "filler not running")
    client = _send_completion(served, {"max_tokens": 3000, "stream": stream})
    if queued:
        during = _until_load(served, lambda b, r, waiting: waiting == 1, "request not waiting")
        assert during[1] == MAX_NUM_SEQS, during
    else:
        during = _until_load(served, lambda blocks, running, w: running == 1 and blocks > 0, "not running")
    client.close()
    if queued:
        after = _until_load(
            served, lambda b, r, waiting: waiting == 0, "the dropped request still waits", timeout=30
        )
        assert after[1] == MAX_NUM_SEQS, after  # the filler goes on
        filler.close()
    after = _until_load(served, lambda *load: load == before, "the dropped request still holds", timeout=30)
    print(f"engine load (blocks, running, waiting): before {before}, during {during}, after {after}")


# ---- the public gRPC API ----


def _grpc_generate(served: Stack, **fields) -> list[text_generation_pb2.GenerateResponse]:
    fields.setdefault("sampling", common_pb2.SamplingParams(max_tokens=24, temperature=0))
    with grpc.insecure_channel(served.grpc_address) as channel:
        stub = text_generation_pb2_grpc.TextGenerationServiceStub(channel)
        request = text_generation_pb2.GenerateRequest(**fields)
        return list(stub.Generate(request, metadata=GRPC_AUTH, timeout=60))


def test_grpc_text_generation_streams_the_answer(served):
    messages = _grpc_generate(
        served, messages=[text_generation_pb2.ChatMessage(role="user", content=QUESTION[0]["content"])]
    )
    text = "".join(m.text for m in messages)
    assert "Paris" in text and text == _chat(served).choices[0].message.content
    assert messages[-1].finish_reason == common_pb2.FINISH_REASON_STOP
    assert list(messages[0].prompt_token_ids) == _tokenize(served, messages=QUESTION)
    assert messages[-1].usage.completion_tokens == sum(len(m.token_ids) for m in messages)


def test_grpc_prompt_text_and_token_ids_give_the_same_greedy_text(served):
    sampling = common_pb2.SamplingParams(max_tokens=8, temperature=0)
    by_text = _grpc_generate(served, prompt=PROMPT, sampling=sampling)
    by_ids = _grpc_generate(served, prompt_token_ids=_tokenize(served, prompt=PROMPT), sampling=sampling)
    text = "".join(m.text for m in by_text)
    assert text == "".join(m.text for m in by_ids) == _complete(served).choices[0].text
    assert by_ids[-1].usage.prompt_tokens == 5


def test_grpc_tokenize_detokenize_and_list_models(served):
    with grpc.insecure_channel(served.grpc_address) as channel:
        stub = text_generation_pb2_grpc.TextGenerationServiceStub(channel)
        auth = {"metadata": GRPC_AUTH, "timeout": 10}
        ids = stub.Tokenize(text_generation_pb2.TokenizeRequest(text=PROMPT), **auth)
        assert list(ids.token_ids) == _tokenize(served, prompt=PROMPT)
        assert ids.max_model_len == MAX_MODEL_LEN
        chat = stub.Tokenize(
            text_generation_pb2.TokenizeRequest(
                messages=[text_generation_pb2.ChatMessage(role="user", content=QUESTION[0]["content"])]
            ),
            **auth,
        )
        assert list(chat.token_ids) == _tokenize(served, messages=QUESTION)
        text = stub.Detokenize(text_generation_pb2.DetokenizeRequest(token_ids=ids.token_ids), **auth)
        assert text.text == PROMPT
        models = stub.ListModels(text_generation_pb2.ListModelsRequest(), **auth).models
        assert [m.id for m in models] == [MODEL] and models[0].max_model_len == MAX_MODEL_LEN
        # Each of them touches the model, so each needs the key.
        for call, request in (
            (stub.Tokenize, text_generation_pb2.TokenizeRequest(text=PROMPT)),
            (stub.Detokenize, text_generation_pb2.DetokenizeRequest(token_ids=[1])),
            (stub.ListModels, text_generation_pb2.ListModelsRequest()),
        ):
            with pytest.raises(grpc.RpcError) as refused:
                call(request, timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_grpc_request_ids_are_the_callers_to_echo_and_never_the_engines(served):
    """One caller reusing a request id: both requests run side by side, and the first one's abort (its
    client gone) leaves the second whole. The engine never saw "dup"."""
    long = common_pb2.SamplingParams(max_tokens=400, ignore_eos=True)
    short = common_pb2.SamplingParams(max_tokens=24, ignore_eos=True)
    with grpc.insecure_channel(served.grpc_address) as channel:
        stub = text_generation_pb2_grpc.TextGenerationServiceStub(channel)
        first = stub.Generate(
            text_generation_pb2.GenerateRequest(prompt=PROMPT, request_id="dup", sampling=long),
            metadata=GRPC_AUTH,
            timeout=60,
        )
        assert next(first).request_id == "dup"
        second = stub.Generate(
            text_generation_pb2.GenerateRequest(prompt=PROMPT, request_id="dup", sampling=short),
            metadata=GRPC_AUTH,
            timeout=60,
        )
        got = [next(second)]
        first.cancel()  # the first request's abort goes out while the second runs
        got += list(second)
    assert {m.request_id for m in got} == {"dup"}
    assert got[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert got[-1].usage.completion_tokens == 24 == sum(len(m.token_ids) for m in got)
    served.wait_idle(timeout=30)


def test_grpc_invalid_request_is_invalid_argument(served):
    with pytest.raises(grpc.RpcError) as caught:
        _grpc_generate(served, prompt=PROMPT, sampling=common_pb2.SamplingParams(temperature=-1))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "temperature" in caught.value.details()
    with pytest.raises(grpc.RpcError) as caught:
        _grpc_generate(served, prompt=PROMPT, prompt_token_ids=[1, 2])
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as caught:
        _grpc_generate(served, prompt=PROMPT, model="no-such-model")
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND


def test_grpc_reflection_lists_the_service_and_serves_its_contract(served):
    # What grpcurl does without -proto: list the services, then fetch the files that define one.
    with grpc.insecure_channel(served.grpc_address) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        assert "pagedserve.v1.TextGenerationService" in database.get_services()
        service = DescriptorPool(database).FindServiceByName("pagedserve.v1.TextGenerationService")
    assert service.file.name == "pagedserve/v1/text_generation.proto"
    assert [d.name for d in service.file.dependencies] == ["pagedserve/v1/common.proto"]
    generate = service.methods_by_name["Generate"]
    assert generate.output_type.full_name == "pagedserve.v1.GenerateResponse" and generate.server_streaming


# ---- the Node.js example client (examples/node) ----

NODE_EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "node"


def _node_generate(served: Stack, *args: str) -> subprocess.CompletedProcess:
    node = shutil.which("node")
    if node is None or not (NODE_EXAMPLE / "node_modules").is_dir():
        pytest.skip("needs node, and `npm ci` in examples/node (`make install` runs it where npm is)")
    command = [node, str(NODE_EXAMPLE / "generate.js"), "--address", served.grpc_address, *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def test_node_client_streams_the_same_greedy_text_as_a_python_client(served):
    result = _node_generate(served, "--api-key", API_KEY, "--max-tokens", "8", "--temperature", "0", PROMPT)
    assert result.returncode == 0, result.stderr
    text, _, finish = result.stdout.rpartition("\nfinish_reason: ")
    messages = _grpc_generate(
        served, prompt=PROMPT, sampling=common_pb2.SamplingParams(max_tokens=8, temperature=0)
    )
    assert text.strip() and text == "".join(m.text for m in messages)
    reason = common_pb2.FinishReason.Name(messages[-1].finish_reason).removeprefix("FINISH_REASON_").lower()
    assert finish == f"{reason}\n"


def test_node_client_chats_and_the_answer_ends_with_stop(served):
    result = _node_generate(
        served, "--api-key", API_KEY, "--chat", "--temperature", "0", QUESTION[0]["content"]
    )
    assert result.returncode == 0, result.stderr
    text, _, finish = result.stdout.rpartition("\nfinish_reason: ")
    assert text == _chat(served, max_tokens=64).choices[0].message.content
    assert "Paris" in text and finish == "stop\n"


def test_node_client_without_the_api_key_is_refused(served):
    result = _node_generate(served, "--api-key", "", PROMPT)
    assert result.returncode == 1
    assert "UNAUTHENTICATED" in result.stderr and "finish_reason" not in result.stdout


# ---- concurrency and shutdown ----


def test_concurrent_requests_each_get_their_own_greedy_answer(served):
    alone = _complete(served, max_tokens=8).choices[0].text
    results: list[str] = []

    def run() -> None:
        results.append(_complete(served, max_tokens=8).choices[0].text)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert results == [alone] * 4
    served.wait_idle()


def test_sigterm_stops_every_process(served):
    children = subprocess.run(
        ["pgrep", "-P", str(served.serve_process.pid)], capture_output=True, text=True, check=False
    ).stdout.split()
    assert len(children) == 3  # scheduler, worker, gateway
    logged_before = served.stderr_path.stat().st_size
    os.killpg(served.serve_process.pid, signal.SIGTERM)
    assert served.serve_process.wait(timeout=30) == 0
    for pid in map(int, children):
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    # A clean stop: no service logs an error on the way down (the worker's health watch on the
    # scheduler, left open, once made the scheduler's gRPC server log a CancelledError traceback).
    with served.stderr_path.open() as log:
        log.seek(logged_before)
        shutdown_log = log.read()
    assert "Traceback" not in shutdown_log, shutdown_log
    assert '"level": "error"' not in shutdown_log, shutdown_log
