"""The whole stack as users start it (`pagedserve serve`), driven by the real openai SDK and by the
public gRPC API. One stack is shared by the module; the last test stops it with SIGTERM.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from pagedserve.proto import (
    common_pb2,
    engine_pb2,
    engine_pb2_grpc,
    text_generation_pb2,
    text_generation_pb2_grpc,
)

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent
API_KEY = "test-key"
MODEL = "SmolLM2-135M-Instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
MAX_BODY_BYTES = 200_000


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Served:
    process: subprocess.Popen
    base_url: str
    grpc_address: str
    engine_address: str
    client: openai.OpenAI

    def engine_stats(self) -> engine_pb2.EngineStats:
        with grpc.insecure_channel(self.engine_address) as channel:
            return engine_pb2_grpc.EngineStub(channel).Stats(engine_pb2.StatsRequest(), timeout=5)

    def wait_idle(self, timeout: float = 5.0) -> engine_pb2.EngineStats:
        deadline = time.monotonic() + timeout
        while True:
            stats = self.engine_stats()
            if stats.num_blocks_in_use == 0 and stats.num_requests_running == 0:
                return stats
            assert time.monotonic() < deadline, f"blocks still in use: {stats.num_blocks_in_use}"
            time.sleep(0.05)


@pytest.fixture(scope="module")
def served():
    port, grpc_port, engine_port = _free_port(), _free_port(), _free_port()
    args = [str(BIN / "pagedserve"), "serve", "--port", str(port), "--grpc-port", str(grpc_port)]
    args += ["--scheduler-port", str(engine_port), "--api-key", API_KEY, "--dtype", "float32"]
    args += ["--num-blocks", "256", "--log-level", "warning"]
    env = {**os.environ, "PAGEDSERVE_MAX_BODY_BYTES": str(MAX_BODY_BYTES)}
    process = subprocess.Popen(args, stdout=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        banner = []
        for line in process.stdout:
            banner.append(line)
            if "Ctrl-C" in line:
                break
            assert time.monotonic() < deadline, "pagedserve serve did not become ready"
        assert process.poll() is None, "".join(banner)
        base_url = f"http://127.0.0.1:{port}/v1"
        assert any(base_url in line for line in banner), banner
        client = openai.OpenAI(base_url=base_url, api_key=API_KEY, max_retries=0, timeout=60)
        yield Served(process, base_url, f"127.0.0.1:{grpc_port}", f"127.0.0.1:{engine_port}", client)
    finally:
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def _chat(served: Served, **kwargs):
    kwargs.setdefault("temperature", 0)
    kwargs.setdefault("max_tokens", 24)
    return served.client.chat.completions.create(model=MODEL, messages=QUESTION, **kwargs)


def test_chat_answers_paris(served):
    response = _chat(served)
    assert "Paris" in response.choices[0].message.content
    assert response.choices[0].finish_reason == "stop"
    usage = response.usage
    assert usage.prompt_tokens > 0 and usage.completion_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_completion_returns_text_and_usage(served):
    response = served.client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0
    )
    choice = response.choices[0]
    assert choice.text.strip()
    assert choice.finish_reason in ("length", "stop")
    assert response.usage.completion_tokens <= 6


def test_streaming_equals_non_streaming_at_temperature_zero(served):
    whole = _chat(served).choices[0].message.content
    chunks = _chat(served, stream=True, stream_options={"include_usage": True})
    text, usage = [], None
    for chunk in chunks:
        if chunk.choices and chunk.choices[0].delta.content:
            text.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    assert "".join(text) == whole
    assert usage is not None and usage.completion_tokens > 0


def test_same_seed_same_sample(served):
    kwargs = {"temperature": 1.0, "seed": 1234, "max_tokens": 12}
    first = _chat(served, **kwargs).choices[0].message.content
    assert _chat(served, **kwargs).choices[0].message.content == first


def test_stop_string_ends_the_text_and_is_left_out(served):
    response = _chat(served, stop=["Paris"])
    content = response.choices[0].message.content
    assert "Paris" not in content and content.strip()
    assert response.choices[0].finish_reason == "stop"


def test_logprobs_come_with_their_alternatives(served):
    response = _chat(served, logprobs=True, top_logprobs=2, max_tokens=5)
    entries = response.choices[0].logprobs.content
    assert len(entries) == response.usage.completion_tokens
    for entry in entries:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob


def test_each_error_has_its_status_code(served):
    with pytest.raises(openai.BadRequestError):
        _chat(served, temperature=-1)
    with pytest.raises(openai.NotFoundError):
        served.client.chat.completions.create(model="no-such-model", messages=QUESTION)
    wrong_key = openai.OpenAI(base_url=served.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong_key.chat.completions.create(model=MODEL, messages=QUESTION)
    response = httpx.post(
        f"{served.base_url}/completions",
        headers={"Authorization": f"Bearer {API_KEY}"},
        json={"model": MODEL, "prompt": "x" * (MAX_BODY_BYTES + 10)},
        timeout=30,
    )
    assert response.status_code == 413


def test_dropped_stream_frees_its_blocks(served):
    stream = _chat(served, stream=True, max_tokens=400, extra_body={"ignore_eos": True})
    for i, _chunk in enumerate(stream):
        if i == 3:
            break
    assert served.engine_stats().num_blocks_in_use > 0
    stream.close()
    stats = served.wait_idle(timeout=10)
    assert stats.requests_finished["abort"] >= 1


def test_grpc_text_generation_streams_the_answer(served):
    with grpc.insecure_channel(served.grpc_address) as channel:
        stub = text_generation_pb2_grpc.TextGenerationStub(channel)
        request = text_generation_pb2.GenerateRequest(
            messages=[text_generation_pb2.ChatMessage(role="user", content=QUESTION[0]["content"])],
            sampling=common_pb2.SamplingParams(max_tokens=24, temperature=0),
        )
        messages = list(stub.Generate(request, metadata=[("authorization", f"Bearer {API_KEY}")], timeout=60))
    text = "".join(m.text for m in messages)
    assert "Paris" in text
    assert messages[-1].finish_reason == common_pb2.FINISH_REASON_STOP


def test_sigterm_stops_every_process(served):
    children = subprocess.run(
        ["pgrep", "-P", str(served.process.pid)], capture_output=True, text=True, check=False
    ).stdout.split()
    assert len(children) == 3  # scheduler, worker, gateway
    os.killpg(served.process.pid, signal.SIGTERM)
    assert served.process.wait(timeout=30) == 0
    for pid in map(int, children):
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
