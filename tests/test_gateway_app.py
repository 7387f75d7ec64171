"""The HTTP app's behaviour that needs no engine: auth, errors and their shapes, body limit, models, text.

Endpoints that generate need the running stack; their tests come with it (no fake engine here).
"""

from __future__ import annotations

import httpx
import pytest

from pagedserve import __version__
from pagedserve.gateway.config import GatewayConfig
from pagedserve.gateway.generation import ModelInfo
from pagedserve.gateway.openai_api import create_app
from pagedserve.gateway.tokenization import Tokenizer

MODEL = "SmolLM2-135M-Instruct"

pytestmark = pytest.mark.anyio


def client(tokenizer: Tokenizer, **config) -> httpx.AsyncClient:
    app = create_app(GatewayConfig(**config), tokenizer, ModelInfo(MODEL, 64, (2,)), engine=None)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway")


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


async def test_wrong_or_missing_api_key_is_401_on_v1_paths_only(tokenizer):
    async with client(tokenizer, api_key="sekret") as c:
        error = assert_openai_error(await c.get("/v1/models"), 401)
        assert error["type"] == "authentication_error"
        assert_openai_error(await c.get("/v1/models", headers={"Authorization": "Bearer nope"}), 401)
        assert_openai_error(await c.post("/v1/completions", json={"prompt": "x"}), 401)
        assert (await c.get("/v1/models", headers={"Authorization": "Bearer sekret"})).status_code == 200
        # /health and /metrics stay open (/health is 503: no engine is connected here).
        assert (await c.get("/health")).status_code == 503
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
