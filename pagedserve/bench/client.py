"""One streamed request to an OpenAI-compatible server, timed chunk by chunk (httpx + SSE parsing)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from pagedserve.bench.datasets import SampleRequest

BACKENDS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}


@dataclass(slots=True)
class RequestSpec:
    """What every request of a run shares."""

    url: str  # full endpoint URL, e.g. http://localhost:8000/v1/completions
    model: str  # the "model" field sent
    chat: bool  # chat completions (messages) rather than completions (prompt)
    api_key: str | None = None  # sent as a bearer token
    ignore_eos: bool = True  # vLLM extension: generate exactly max_tokens (other servers may ignore it)
    continuous_usage: bool = True  # vLLM extension: usage on every chunk, gives exact tokens per chunk
    extra_body: dict[str, Any] = field(default_factory=dict)  # merged into every request body


@dataclass(slots=True)
class RequestResult:
    prompt_len: int  # prompt tokens (the dataset's count)
    output_len: int  # tokens asked for (max_tokens)
    start: float = 0.0  # s, when the request was sent, since the start of the run
    success: bool = False
    error: str = ""  # why it failed: HTTP status and body, an error event, or the exception
    ttft: float = 0.0  # s, from sending to the first chunk carrying a token
    latency: float = 0.0  # s, from sending to the end of the stream (end-to-end latency)
    chunk_times: list[float] = field(default_factory=list)  # s since sending, per token-carrying chunk
    chunk_tokens: list[int] = field(default_factory=list)  # tokens in each of those chunks
    output_tokens: int = 0  # tokens generated: the server's usage, else counted by the tokenizer
    usage_reported: bool = False  # output_tokens came from the server's usage
    text: str = ""  # the generated text


def request_body(spec: RequestSpec, request: SampleRequest) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": spec.model,
        "max_tokens": request.output_len,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if spec.continuous_usage:
        body["stream_options"]["continuous_usage_stats"] = True
    if spec.ignore_eos:
        body["ignore_eos"] = True
    if spec.chat:
        assert isinstance(request.prompt, str), "chat requests need text prompts"
        body["messages"] = [{"role": "user", "content": request.prompt}]
        body["max_completion_tokens"] = request.output_len
    else:
        body["prompt"] = request.prompt
    body.update(spec.extra_body)
    return body


def headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def send_request(
    client: httpx.AsyncClient, spec: RequestSpec, request: SampleRequest, run_start: float = 0.0
) -> RequestResult:
    """Never raises (except on cancellation): a failure is recorded in the result.

    run_start: perf_counter() at the start of the run; `start` is recorded relative to it.
    """
    result = RequestResult(prompt_len=request.prompt_len, output_len=request.output_len)
    body = request_body(spec, request)
    sent = time.perf_counter()
    result.start = sent - run_start
    try:
        async with client.stream("POST", spec.url, json=body, headers=headers(spec.api_key)) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {text[:2000]}"
                return result
            await _read_stream(response, spec.chat, result, sent)
    except Exception as error:  # NOTE: any server misbehaviour is a failed request, never a crashed run
        result.error = f"{type(error).__name__}: {error}"
        return result
    result.latency = time.perf_counter() - sent
    if not result.error and not result.chunk_times:
        result.error = "the stream ended without any token"
    result.success = not result.error
    return result


async def _read_stream(response: httpx.Response, chat: bool, result: RequestResult, sent: float) -> None:
    texts: list[str] = []
    reported = 0  # completion tokens the server's (continuous) usage has accounted for so far
    done = False
    async for line in response.aiter_lines():
        now = time.perf_counter() - sent
        # NOTE: SSE lines other than "data:" (comments, event:, id:, blank separators) carry nothing here.
        # After [DONE] the body is still read to its end, so the connection goes back to the pool.
        if done or not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            done = True
            continue
        event = json.loads(data)
        if "error" in event:  # an error event mid-stream (OpenAI error body)
            error = event["error"]
            result.error = f"error event: {error.get('message', error) if isinstance(error, dict) else error}"
            return
        usage = event.get("usage")
        new_tokens = None
        if usage and usage.get("completion_tokens") is not None:
            result.output_tokens = int(usage["completion_tokens"])
            result.usage_reported = True
            new_tokens = result.output_tokens - reported
            reported = result.output_tokens
        text = _chunk_text(event, chat)
        texts.append(text)
        # A chunk carries tokens when usage says so; without continuous usage, when it carries text
        # (counted as one token, the usual one-token-per-chunk streaming). The usage-only chunk with
        # empty choices at the end and chat's role-only first chunk carry none.
        if new_tokens is None:
            new_tokens = 1 if text else 0
        if new_tokens > 0 and event.get("choices"):
            result.chunk_times.append(now)
            result.chunk_tokens.append(new_tokens)
            if len(result.chunk_times) == 1:
                result.ttft = now
    result.text = "".join(texts)


def _chunk_text(event: dict[str, Any], chat: bool) -> str:
    choices = event.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if chat:
        return (choice.get("delta") or {}).get("content") or ""
    return choice.get("text") or ""


async def first_model(client: httpx.AsyncClient, base_url: str, api_key: str | None) -> str:
    response = await client.get(f"{base_url}/v1/models", headers=headers(api_key))
    response.raise_for_status()
    models = response.json().get("data") or []
    if not models:
        raise RuntimeError(f"{base_url}/v1/models lists no model; pass --model")
    return str(models[0]["id"])
