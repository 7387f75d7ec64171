"""Load on a real stack (scheduler, two workers, gateway on loopback): 256 concurrent streams all
complete with every token, and an abort storm gives every KV block back."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from stack_testing import Stack, running

pytestmark = pytest.mark.slow

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def stack(default_model_dir, tmp_path_factory):
    stack = Stack(default_model_dir, tmp_path_factory.mktemp("load-logs"), num_workers=2, num_blocks=1024)
    with running(stack):
        yield stack


def _client(stack: Stack) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=400, max_keepalive_connections=400)
    return httpx.AsyncClient(base_url=stack.http_url, timeout=300, limits=limits)


async def _count_tokens(client: httpx.AsyncClient, i: int) -> tuple[int, str | None, int]:
    """(tokens streamed, finish reason, completion_tokens from usage) of one streaming request."""
    body = {
        "prompt": f"Request number {i} says",
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "temperature": 0.0 if i % 2 else 0.8,
        "seed": i,
        "logprobs": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    tokens, finish, usage = 0, None, -1
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                usage = event["usage"]["completion_tokens"]
            for choice in event["choices"]:
                tokens += len(choice["logprobs"]["tokens"])
                finish = choice["finish_reason"] or finish
    return tokens, finish, usage


def test_256_concurrent_streams_all_complete_with_every_token(stack):
    async def run():
        async with _client(stack) as client:
            return await asyncio.gather(*(_count_tokens(client, i) for i in range(256)))

    start = time.monotonic()
    results = asyncio.run(run())
    elapsed = time.monotonic() - start
    print(f"256 streams x {MAX_TOKENS} tokens in {elapsed:.1f} s ({256 * MAX_TOKENS / elapsed:.0f} tokens/s)")
    assert all(r == (MAX_TOKENS, "length", MAX_TOKENS) for r in results), [
        r for r in results if r[0] != MAX_TOKENS
    ]
    stats = stack.wait_idle(timeout=5)
    assert stats.num_blocks_in_use == 0


def test_abort_storm_gives_every_block_back(stack):
    async def drop_after_first_token(client: httpx.AsyncClient, i: int) -> bool:
        body = {"prompt": f"Story {i}:", "max_tokens": 200, "ignore_eos": True, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                    return True  # leaving the block closes the connection mid-stream
        return False

    async def run():
        async with _client(stack) as client:
            return await asyncio.gather(*(drop_after_first_token(client, i) for i in range(64)))

    assert all(asyncio.run(run()))
    dropped_at = time.monotonic()
    stats = stack.wait_idle(timeout=3)
    print(f"every block back {time.monotonic() - dropped_at:.2f} s after 64 streams were dropped")
    assert stats.num_blocks_in_use == 0 and stats.num_requests_running == 0
