"""The HTTP app in process: auth, errors and their shapes, limits, body limit, models, text, probes.

Most tests need no engine. Those about what the gateway does with the engine's calls (deadlines, the ids
it sends, aborts, readiness, overload) use a scripted one; the generated text itself is tested on the
running stack.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncIterator, Callable

import anyio
import httpx
import pytest
from stack_testing import sse_lines

from pagedserve import __version__
from pagedserve.errors import OverloadedError, PagedServeError, UnavailableError
from pagedserve.gateway.config import GatewayConfig
from pagedserve.gateway.generation import ModelInfo
from pagedserve.gateway.openai_api import create_app
from pagedserve.gateway.openai_format import LOGPROB_FLOOR
from pagedserve.gateway.tokenization import Tokenizer
from pagedserve.v1 import common_pb2, engine_pb2

MODEL = "SmolLM2-135M-Instruct"
REQUEST_BOUND_S = 10

pytestmark = pytest.mark.anyio


class BoundedTransport(httpx.ASGITransport):
    """The app in process, each request bounded in time: one that hangs fails its test instead."""

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        with anyio.fail_after(REQUEST_BOUND_S):
            return await super().handle_async_request(request)


def client(tokenizer: Tokenizer, engine=None, **config) -> httpx.AsyncClient:
    app = create_app(GatewayConfig(**config), tokenizer, ModelInfo(MODEL, 64, (2,)), engine=engine)
    c = httpx.AsyncClient(transport=BoundedTransport(app=app), base_url="http://gateway")
    c.gateway = app.state.gateway  # the app's state, for what a test sets by hand (draining)
    return c


Script = Callable[[engine_pb2.GenerateTokensRequest], AsyncIterator[engine_pb2.GenerateTokensResponse]]


async def one_token_then_silence(request: engine_pb2.GenerateTokensRequest):
    yield engine_pb2.GenerateTokensResponse(request_id=request.request_id, token_ids=[1000])
    await asyncio.sleep(3600)


async def two_tokens(request: engine_pb2.GenerateTokensRequest):
    yield engine_pb2.GenerateTokensResponse(request_id=request.request_id, token_ids=[1000])
    yield engine_pb2.GenerateTokensResponse(
        request_id=request.request_id,
        token_ids=[1001],
        finish_reason=common_pb2.FINISH_REASON_LENGTH,
        usage=common_pb2.Usage(prompt_tokens=len(request.prompt_token_ids), completion_tokens=2),
    )


def refusing(error: PagedServeError) -> Script:
    async def script(request):
        raise error
        yield  # an async generator that fails on its first read, as the engine's call does

    return script


class ScriptedEngine:
    """Stands in for the EngineClient: streams each request's script, answers GetEngineInfo with
    `info` (or raises `info_error`), and records the requests it was sent and those left early (which
    the real client cancels and aborts at the scheduler)."""

    def __init__(self, script: Script = two_tokens, info: engine_pb2.EngineInfo | None = None):
        self.script = script
        self.info_reply = info or engine_pb2.EngineInfo(num_healthy_workers=1, max_model_len=64)
        self.info_error: PagedServeError | None = None
        self.sent: list[engine_pb2.GenerateTokensRequest] = []
        self.left_early: list[str] = []

    async def generate(self, request, trace_context=None):
        self.sent.append(request)
        finished = False
        try:
            async for message in self.script(request):
                yield message
            finished = True
        finally:
            if not finished:
                self.left_early.append(request.request_id)

    def abort_soon(self, request_id: str, index: int | None = None) -> None:
        pass

    async def abort(self, request_id: str, index: int | None = None) -> bool:
        return True

    async def info(self, timeout: float = 5.0) -> engine_pb2.EngineInfo:
        if self.info_error is not None:
            raise self.info_error
        return self.info_reply

    def stats_sync(self, timeout: float = 5.0) -> engine_pb2.EngineStats:
        return engine_pb2.EngineStats()


def assert_openai_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if param is not None:
        assert error["param"] == param
    return error


async def test_models_lists_the_served_model(tokenizer):
    async with client(tokenizer) as c:
        body = (await c.get("/v1/models")).json()
        assert body["object"] == "list"
        assert [m["id"] for m in body["data"]] == [MODEL]
        assert body["data"][0]["object"] == "model" and body["data"][0]["max_model_len"] == 64
        assert (await c.get(f"/v1/models/{MODEL}")).json()["id"] == MODEL
        assert_openai_error(await c.get("/v1/models/other"), 404, "model")


async def test_version(tokenizer):
    async with client(tokenizer) as c:
        assert (await c.get("/version")).json() == {"version": __version__}


async def test_every_path_that_touches_the_model_needs_the_key_and_the_probes_do_not(tokenizer):
    key = {"Authorization": "Bearer sekret"}
    async with client(tokenizer, api_key="sekret") as c:
        error = assert_openai_error(await c.get("/v1/models"), 401)
        assert error["type"] == "authentication_error"
        assert_openai_error(await c.get("/v1/models", headers={"Authorization": "Bearer nope"}), 401)
        assert_openai_error(await c.get(f"/v1/models/{MODEL}"), 401)
        assert_openai_error(await c.post("/v1/completions", json={"prompt": "x"}), 401)
        assert_openai_error(await c.post("/tokenize", json={"prompt": "x"}), 401)
        assert_openai_error(await c.post("/detokenize", json={"tokens": [1]}), 401)
        assert (await c.get("/v1/models", headers=key)).status_code == 200
        assert (await c.post("/tokenize", json={"prompt": "x"}, headers=key)).status_code == 200
        assert (await c.post("/detokenize", json={"tokens": [1]}, headers=key)).status_code == 200
        # The probes and the version stay open (/ready is 503: no engine is connected here).
        assert (await c.get("/health")).status_code == 200
        assert (await c.get("/ready")).status_code == 503
        assert (await c.get("/metrics")).status_code == 200
        assert (await c.get("/version")).status_code == 200


async def test_unknown_model_is_404(tokenizer):
    async with client(tokenizer) as c:
        response = await c.post("/v1/completions", json={"model": "gpt-9", "prompt": "hi"})
        error = assert_openai_error(response, 404, "model")
        assert error["code"] == "model_not_found"
        response = await c.post(
            "/v1/chat/completions", json={"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}
        )
        assert_openai_error(response, 404, "model")


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "hi", "temperature": -1}, "temperature"),
        ("/v1/completions", {"prompt": "hi", "n": 0}, "n"),
        ("/v1/completions", {"prompt": []}, "prompt"),
        ("/v1/completions", {}, "prompt"),
        ("/v1/completions", {"prompt": [70000]}, "prompt"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_p": 2}, "top_p"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3},
            "top_logprobs",
        ),
    ],
)
async def test_invalid_parameters_are_400_naming_the_parameter(tokenizer, path, body, param):
    async with client(tokenizer) as c:
        error = assert_openai_error(await c.post(path, json=body), 400, param)
        assert error["type"] == "invalid_request_error"


async def test_prompt_longer_than_the_context_is_400(tokenizer):
    async with client(tokenizer) as c:
        response = await c.post("/v1/completions", json={"prompt": "word " * 100})
        error = assert_openai_error(response, 400, "prompt")
        assert "maximum context length is 64 tokens" in error["message"]
        response = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 64})
        assert_openai_error(response, 400, "max_tokens")
        messages = [{"role": "user", "content": "word " * 100}]
        assert_openai_error(
            await c.post("/v1/chat/completions", json={"messages": messages}), 400, "messages"
        )


async def test_invalid_json_is_400(tokenizer):
    async with client(tokenizer) as c:
        response = await c.post(
            "/v1/completions", content=b"{nope", headers={"content-type": "application/json"}
        )
        assert_openai_error(response, 400)


async def test_oversized_body_is_413_with_or_without_content_length(tokenizer):
    async with client(tokenizer, max_body_bytes=1000) as c:
        body = {"prompt": "x" * 2000}
        error = assert_openai_error(await c.post("/v1/completions", json=body), 413)
        assert error["type"] == "invalid_request_error"

        async def chunked():
            for _ in range(4):
                yield b" " * 400

        response = await c.post(
            "/v1/completions", content=chunked(), headers={"content-type": "application/json"}
        )
        assert_openai_error(response, 413)


async def test_generation_without_an_engine_is_503(tokenizer):
    async with client(tokenizer) as c:
        response = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4})
        assert_openai_error(response, 503)
        response = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4, "stream": True})
        assert_openai_error(response, 503)


async def test_tokenize_and_detokenize_round_trip(tokenizer):
    async with client(tokenizer) as c:
        body = (await c.post("/tokenize", json={"prompt": "Hello world 😀"})).json()
        assert body["tokens"] == tokenizer.encode("Hello world 😀") and body["count"] == len(body["tokens"])
        assert body["max_model_len"] == 64
        text = (await c.post("/detokenize", json={"tokens": body["tokens"]})).json()["prompt"]
        assert text == "Hello world 😀"
        messages = [{"role": "user", "content": "hi"}]
        chat_ids = (await c.post("/tokenize", json={"messages": messages})).json()["tokens"]
        assert tokenizer.decode(chat_ids, skip_special_tokens=False).endswith("<|im_start|>assistant\n")
        assert_openai_error(await c.post("/detokenize", json={"tokens": [10**6]}), 400, "tokens")


# ---- limits from the gateway's flags ----


@pytest.mark.parametrize(
    ("config", "path", "body", "param"),
    [
        ({"max_prompts": 2}, "/v1/completions", {"prompt": ["a", "b", "c"]}, "prompt"),
        ({"max_prompts": 2}, "/v1/completions", {"prompt": [[1], [2], [3]]}, "prompt"),
        ({"max_messages": 2}, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}] * 3}, "messages"),
        ({"max_messages": 2}, "/tokenize", {"messages": [{"role": "user", "content": "x"}] * 3}, "messages"),
        ({"max_n": 2}, "/v1/completions", {"prompt": "x", "n": 3}, "n"),
    ],
)  # fmt: skip
async def test_the_limits_operators_tune_are_the_ones_enforced(tokenizer, config, path, body, param):
    async with client(tokenizer, engine=ScriptedEngine(), **config) as c:
        assert_openai_error(await c.post(path, json=body), 400, param)


async def test_a_body_nested_past_the_limit_is_400_not_a_recursion_error(tokenizer):
    async with client(tokenizer) as c:
        for depth in (65, 100_000):
            body = '{"prompt": "x", "extra": ' + "[" * depth + "]" * depth + "}"
            response = await c.post(
                "/v1/completions", content=body, headers={"content-type": "application/json"}
            )
            assert "nested deeper than 64" in assert_openai_error(response, 400)["message"]
        shallow = '{"prompt": "x", "extra": ' + "[" * 60 + "]" * 60 + "}"
        response = await c.post(
            "/v1/completions", content=shallow, headers={"content-type": "application/json"}
        )
        assert_openai_error(response, 503)  # accepted; no engine to run it


# ---- what reaches the engine: ids, deadlines, aborts, refusals ----


async def test_request_ids_are_the_gateways_own_unique_per_request_and_tagged_by_tenant(tokenizer):
    engine = ScriptedEngine()
    async with client(tokenizer, engine=engine, api_keys=("key-a", "key-b")) as c:
        ids = []
        for key in ("key-a", "key-a", "key-b"):
            for how in (
                {"json": {"prompt": "x", "request_id": "same"}},
                {"json": {"prompt": "x"}, "headers": {"x-request-id": "same"}},
            ):
                headers = {"Authorization": f"Bearer {key}", **how.get("headers", {})}
                response = await c.post("/v1/completions", json=how["json"], headers=headers)
                assert response.status_code == 200, response.text
                ids.append(response.json()["id"])
    # One id per request, the response's and the engine's alike; the client's own never reaches the
    # engine. The tenant's tag is its key's place in the configuration, nothing derived from the key.
    assert ids == [r.request_id for r in engine.sent]
    assert len(set(ids)) == 6 and not any("same" in i for i in ids)
    assert [i.rsplit("-", 1)[1] for i in ids] == ["t0"] * 4 + ["t1"] * 2


async def test_a_late_abort_of_an_old_request_cannot_reach_a_newer_one_reusing_its_id(tokenizer):
    engine = ScriptedEngine(one_token_then_silence)
    async with client(tokenizer, engine=engine, request_timeout=0.3) as c:
        old = await c.post("/v1/completions", json={"prompt": "x", "request_id": "r1"})
        assert old.status_code == 504
        engine.script = two_tokens
        new = await c.post("/v1/completions", json={"prompt": "x", "request_id": "r1"})
        assert new.status_code == 200
    old_id, new_id = (r.request_id for r in engine.sent)
    assert engine.left_early == [old_id] and old_id != new_id and new.json()["id"] == new_id


async def test_a_request_past_its_deadline_is_504_and_left_at_the_engine(tokenizer):
    engine = ScriptedEngine(one_token_then_silence)
    async with client(tokenizer, engine=engine, request_timeout=0.3) as c:
        response = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 5})
        error = assert_openai_error(response, 504)
        assert error["type"] == "timeout"
        chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 5}
        assert_openai_error(await c.post("/v1/chat/completions", json=chat), 504)
    assert engine.left_early == [r.request_id for r in engine.sent] and len(engine.sent) == 2


async def test_a_stream_past_its_deadline_ends_with_an_error_event_then_done(tokenizer):
    engine = ScriptedEngine(one_token_then_silence)
    async with client(tokenizer, engine=engine, request_timeout=0.3) as c:
        response = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 5, "stream": True})
        assert response.status_code == 200
        events = [line.removeprefix("data: ") for line in sse_lines(response.text) if line]
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["type"] == "timeout"
        assert json.loads(events[0])["choices"][0]["text"]  # the token before the deadline came through
    assert engine.left_early == [engine.sent[0].request_id]


async def test_a_responses_stream_past_its_deadline_ends_with_response_failed(tokenizer):
    engine = ScriptedEngine(one_token_then_silence)
    async with client(tokenizer, engine=engine, request_timeout=0.3) as c:
        response = await c.post("/v1/responses", json={"input": "x", "max_output_tokens": 5, "stream": True})
        assert response.status_code == 200
        events = [
            json.loads(line.removeprefix("data: "))
            for line in response.text.splitlines()
            if line.startswith("data: ")
        ]
        kinds = [event["type"] for event in events]
        assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
        assert kinds[-1] == "response.failed" and "[DONE]" not in response.text
        names = [
            line.removeprefix("event: ") for line in response.text.splitlines() if line.startswith("event: ")
        ]
        assert names == kinds  # each event's SSE name is its type, as OpenAI sends them
        assert (
            events[-1]["response"]["status"] == "failed"
            and events[-1]["response"]["error"]["code"] == "timeout"
        )
        assert [event["sequence_number"] for event in events] == list(range(len(events)))
        # A failed response is not stored.
        assert (await c.get(f"/v1/responses/{events[0]['response']['id']}")).status_code == 404
    assert engine.left_early == [engine.sent[0].request_id]


async def test_a_stream_whose_first_token_misses_the_deadline_is_504(tokenizer):
    async def silence(request):
        await asyncio.sleep(3600)
        yield engine_pb2.GenerateTokensResponse()

    engine = ScriptedEngine(silence)
    async with client(tokenizer, engine=engine, request_timeout=0.3) as c:
        response = await c.post("/v1/completions", json={"prompt": "x", "stream": True})
        assert assert_openai_error(response, 504)["type"] == "timeout"


async def test_a_body_still_uploading_at_the_deadline_is_504(tokenizer):
    async def slow_body():
        yield b'{"prompt": '
        await asyncio.sleep(5)
        yield b'"x"}'

    async with client(tokenizer, engine=ScriptedEngine(), request_timeout=0.3) as c:
        headers = {"content-type": "application/json"}
        response = await c.post("/v1/completions", content=slow_body(), headers=headers)
        assert assert_openai_error(response, 504)["type"] == "timeout"


async def test_no_request_timeout_when_it_is_zero(tokenizer):
    async def slow(request):
        await asyncio.sleep(0.5)
        async for message in two_tokens(request):
            yield message

    async with client(tokenizer, engine=ScriptedEngine(slow), request_timeout=0) as c:
        assert (await c.post("/v1/completions", json={"prompt": "x"})).status_code == 200


@pytest.mark.parametrize(
    ("error", "status", "kind"),
    [
        (OverloadedError("the waiting queue is full"), 429, "server_overloaded"),
        (UnavailableError("no worker"), 503, "service_unavailable"),
    ],
)
async def test_a_full_queue_is_429_and_an_unavailable_engine_503_both_with_retry_after(
    tokenizer, error, status, kind
):
    async with client(tokenizer, engine=ScriptedEngine(refusing(error))) as c:
        for stream in (False, True):
            response = await c.post("/v1/completions", json={"prompt": "x", "stream": stream})
            assert assert_openai_error(response, status)["type"] == kind
            assert int(response.headers["retry-after"]) >= 1


# ---- liveness and readiness ----


async def test_health_is_liveness_and_ready_is_readiness(tokenizer):
    engine = ScriptedEngine()
    async with client(tokenizer, engine=engine) as c:
        assert (await c.get("/health")).status_code == 200
        assert (await c.get("/ready")).json() == {"ready": True}
        engine.info_reply = engine_pb2.EngineInfo(num_healthy_workers=0)
        assert (await c.get("/ready")).json() == {"ready": False, "reason": "no healthy worker"}
        engine.info_reply = engine_pb2.EngineInfo(
            num_healthy_workers=1, stalled=True, seconds_without_progress=31
        )
        response = await c.get("/ready")
        assert response.status_code == 503 and "stalled" in response.json()["reason"]
        engine.info_error = UnavailableError("connection refused")
        response = await c.get("/ready")
        assert response.status_code == 503 and "did not answer" in response.json()["reason"]
        # Liveness does not depend on the scheduler: the gateway itself answers.
        assert (await c.get("/health")).status_code == 200
        c.gateway.draining = True
        assert (await c.get("/health")).status_code == 503
        assert (await c.get("/ready")).status_code == 503


async def non_finite_logprobs(request: engine_pb2.GenerateTokensRequest):
    def entry(logprob: float) -> common_pb2.TokenLogprob:
        return common_pb2.TokenLogprob(
            logprob=logprob, top_token_ids=[1000, 7], top_logprobs=[logprob, math.nan]
        )

    yield engine_pb2.GenerateTokensResponse(
        request_id=request.request_id, token_ids=[1000], logprobs=[entry(-math.inf)]
    )
    yield engine_pb2.GenerateTokensResponse(
        request_id=request.request_id,
        token_ids=[1001],
        logprobs=[entry(math.nan)],
        finish_reason=common_pb2.FINISH_REASON_LENGTH,
        usage=common_pb2.Usage(prompt_tokens=len(request.prompt_token_ids), completion_tokens=2),
    )


def _strict_json(text: str):
    """JSON as strict parsers (JavaScript's, Go's) read it: no NaN, Infinity or -Infinity."""

    def refuse(constant: str):
        raise AssertionError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def _floats(body) -> list[float]:
    """Every float in a parsed body (in these responses, the logprobs)."""
    if isinstance(body, float):
        return [body]
    values = body.values() if isinstance(body, dict) else body if isinstance(body, list) else []
    return [x for v in values for x in _floats(v)]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "path, body",
    [
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 2},
        ),
        ("/v1/completions", {"prompt": "hi", "logprobs": 2}),
    ],
)
async def test_infinite_and_nan_logprobs_are_sent_as_json_clients_can_parse(tokenizer, path, body, stream):
    async with client(tokenizer, ScriptedEngine(non_finite_logprobs)) as c:
        response = await c.post(path, json={**body, "max_tokens": 2, "stream": stream})
    assert response.status_code == 200, response.text
    if stream:
        events = [line[len("data: ") :] for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        parsed = [_strict_json(event) for event in events[:-1]]
    else:
        parsed = _strict_json(response.text)
    values = _floats(parsed)
    assert values and all(math.isfinite(v) for v in values)
    assert LOGPROB_FLOOR in values
