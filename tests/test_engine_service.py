"""The Engine service end to end: a real scheduler process and real worker processes on loopback,
driven through the generated Engine stubs (no gateway).

One scheduler and one worker are shared by the whole module; a second worker joins near the end and
the last test kills one of them mid-stream.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve.proto import common_pb2, engine_pb2, engine_pb2_grpc

pytestmark = pytest.mark.slow

PROMPT = "What is the capital of France?"
BIN = Path(sys.executable).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Stack:
    model_dir: Path
    address: str
    channel: grpc.Channel
    engine: engine_pb2_grpc.EngineStub
    prompt_ids: list[int]
    eos_ids: list[int]
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)

    def start_worker(self, worker_id: str) -> None:
        args = [str(BIN / "pagedserve"), "worker", "--model", str(self.model_dir), "--host", "127.0.0.1"]
        args += ["--port", "0", "--scheduler", self.address, "--worker-id", worker_id]
        args += ["--dtype", "float32", "--device", "cpu", "--num-blocks", "256", "--log-level", "warning"]
        self.processes[worker_id] = subprocess.Popen(args, start_new_session=True)

    def wait_for_workers(self, count: int, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, process in self.processes.items():
                assert process.poll() is None, f"{name} exited with {process.returncode}"
            with contextlib.suppress(grpc.RpcError):
                info = self.engine.GetEngineInfo(engine_pb2.EngineInfoRequest(), timeout=2)
                if info.num_healthy_workers >= count:
                    return
            time.sleep(0.3)
        raise TimeoutError(f"{count} worker(s) not registered after {timeout} s")

    def stats(self) -> engine_pb2.EngineStats:
        return self.engine.Stats(engine_pb2.StatsRequest(), timeout=5)

    def wait_blocks_released(self, timeout: float = 5.0) -> engine_pb2.EngineStats:
        deadline = time.monotonic() + timeout
        while True:
            stats = self.stats()
            if stats.num_blocks_in_use == 0 and stats.num_requests_running == 0:
                return stats
            assert time.monotonic() < deadline, f"blocks still in use: {stats.num_blocks_in_use}"
            time.sleep(0.05)


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()


@pytest.fixture(scope="module")
def stack():
    from pagedserve.model_files import load_generation_info, load_tokenizer, resolve_model

    model_dir = resolve_model(None)
    tokenizer = load_tokenizer(model_dir)
    encoded = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True)
    prompt_ids = list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)
    port = _free_port()
    address = f"127.0.0.1:{port}"
    scheduler = subprocess.Popen(
        [
            str(BIN / "pagedserve"),
            "scheduler",
            "--model",
            str(model_dir),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--worker-wait-timeout",
            "30",
            "--log-level",
            "warning",
        ],
        start_new_session=True,
    )
    channel = grpc.insecure_channel(address)
    s = Stack(
        model_dir,
        address,
        channel,
        engine_pb2_grpc.EngineStub(channel),
        prompt_ids,
        list(load_generation_info(model_dir).eos_token_ids),
        {"scheduler": scheduler},
    )
    try:
        s.start_worker("w0")
        s.wait_for_workers(1)
        yield s
    finally:
        channel.close()
        for process in reversed(list(s.processes.values())):
            _stop(process)


@pytest.fixture(scope="module")
def greedy_reference(stack):
    """transformers' own greedy generate in float32 on the same model (the oracle)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(stack.model_dir), dtype=torch.float32)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([stack.prompt_ids]), max_new_tokens=16, do_sample=False, eos_token_id=stack.eos_ids
        )
    return out[0, len(stack.prompt_ids) :].tolist()


def _request(stack: Stack, request_id: str, **sampling) -> engine_pb2.EngineGenerateRequest:
    sampling.setdefault("temperature", 0.0)
    return engine_pb2.EngineGenerateRequest(
        request_id=request_id,
        prompt_token_ids=stack.prompt_ids,
        sampling=common_pb2.SamplingParams(**sampling),
    )


def _collect(responses) -> tuple[dict[int, list[int]], dict[int, int], common_pb2.Usage | None]:
    tokens: dict[int, list[int]] = {}
    reasons: dict[int, int] = {}
    usage = None
    for message in responses:
        tokens.setdefault(message.index, []).extend(message.token_ids)
        if message.finish_reason:
            reasons[message.index] = message.finish_reason
        if message.HasField("usage"):
            usage = message.usage
    return tokens, reasons, usage


def test_health_is_serving_once_a_worker_is_registered(stack):
    health = health_pb2_grpc.HealthStub(stack.channel)
    for service in ("", "pagedserve.v1.Engine"):
        response = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert response.status == health_pb2.HealthCheckResponse.SERVING


def test_engine_info_reports_the_model_and_its_special_tokens(stack):
    info = stack.engine.GetEngineInfo(engine_pb2.EngineInfoRequest(), timeout=5)
    assert info.model == "SmolLM2-135M-Instruct"
    assert set(info.eos_token_ids) == set(stack.eos_ids)
    assert info.max_model_len >= 2048
    assert info.vocab_size == 49152
    assert info.block_size == 16
    assert info.num_healthy_workers == 1
    assert info.max_queued_requests > 0


def test_greedy_stream_equals_transformers_generate(stack, greedy_reference):
    tokens, reasons, usage = _collect(
        stack.engine.Generate(_request(stack, "greedy", max_tokens=16), timeout=60)
    )
    assert tokens[0] == greedy_reference
    expected = (
        common_pb2.FINISH_REASON_STOP
        if greedy_reference[-1] in stack.eos_ids
        else common_pb2.FINISH_REASON_LENGTH
    )
    assert reasons == {0: expected}
    assert usage.prompt_tokens == len(stack.prompt_ids)
    assert usage.completion_tokens == len(greedy_reference)


def test_n2_streams_two_sequences_and_usage_covers_both(stack, greedy_reference):
    tokens, reasons, usage = _collect(
        stack.engine.Generate(_request(stack, "n2", max_tokens=16, n=2), timeout=60)
    )
    assert set(tokens) == {0, 1} and set(reasons) == {0, 1}
    assert tokens[0] == tokens[1] == greedy_reference
    assert usage.completion_tokens == 2 * len(greedy_reference)
    # The prompt's full blocks were cached by the previous test's identical prompt.
    assert usage.cached_prompt_tokens == (len(stack.prompt_ids) - 1) // 16 * 16


def test_abort_mid_stream_ends_the_stream_and_frees_blocks(stack):
    responses = stack.engine.Generate(
        _request(stack, "to-abort", max_tokens=500, ignore_eos=True), timeout=60
    )
    first = next(responses)
    assert first.token_ids
    assert stack.engine.Abort(engine_pb2.AbortRequest(request_id="to-abort"), timeout=5).aborted
    _tokens, reasons, usage = _collect(responses)
    assert reasons == {0: common_pb2.FINISH_REASON_ABORT}
    assert usage is not None
    stack.wait_blocks_released()
    assert not stack.engine.Abort(engine_pb2.AbortRequest(request_id="to-abort"), timeout=5).aborted


def test_client_cancelling_its_stream_frees_blocks(stack):
    responses = stack.engine.Generate(
        _request(stack, "to-cancel", max_tokens=500, ignore_eos=True), timeout=60
    )
    next(responses)
    next(responses)
    assert stack.stats().num_blocks_in_use > 0
    responses.cancel()
    stats = stack.wait_blocks_released()
    assert stats.requests_finished["abort"] >= 2


def test_invalid_requests_are_refused_with_invalid_argument(stack):
    cases = [
        engine_pb2.EngineGenerateRequest(
            request_id="empty", sampling=common_pb2.SamplingParams(max_tokens=4)
        ),
        engine_pb2.EngineGenerateRequest(request_id="oov", prompt_token_ids=[1, 10**6]),
        _request(stack, "too-long", max_tokens=10**6),
    ]
    for request in cases:
        with pytest.raises(grpc.RpcError) as info:
            list(stack.engine.Generate(request, timeout=10))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, request.request_id


def test_stats_count_tokens_finishes_latencies_and_worker_steps(stack):
    stats = stack.stats()
    assert stats.generation_tokens > 0 and stats.prompt_tokens > 0
    assert stats.requests_finished["stop"] + stats.requests_finished["length"] >= 2
    assert stats.prefix_cache_queries > 0 and stats.prefix_cache_hits > 0
    assert stats.time_to_first_token_seconds.count >= 4
    assert stats.inter_token_latency_seconds.count > 0
    assert stats.e2e_request_latency_seconds.count >= 4
    assert stats.queue_time_seconds.count >= 4
    assert len(stats.time_to_first_token_seconds.cumulative_counts) == len(
        stats.time_to_first_token_seconds.bounds
    )
    (worker,) = stats.workers
    assert worker.worker_id == "w0" and worker.healthy and worker.num_blocks == 256
    assert worker.num_steps > 0 and worker.mean_step_seconds > 0
    assert worker.num_cached_free_blocks > 0  # the prompt's blocks stay cached after the requests end


def test_a_second_worker_registers_and_takes_work(stack):
    stack.start_worker("w1")
    stack.wait_for_workers(2)
    # Two different prompts at once: the second goes to the idle worker.
    first = stack.engine.Generate(
        engine_pb2.EngineGenerateRequest(
            request_id="load-a",
            prompt_token_ids=[1, 2, 3, 4, 5],
            sampling=common_pb2.SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
        ),
        timeout=60,
    )
    next(first)
    second = stack.engine.Generate(
        engine_pb2.EngineGenerateRequest(
            request_id="load-b",
            prompt_token_ids=[6, 7, 8, 9],
            sampling=common_pb2.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
        ),
        timeout=60,
    )
    assert len(_collect(second)[0][0]) == 8
    assert len(_collect(first)[0][0]) == 23
    steps = {w.worker_id: w.num_steps for w in stack.stats().workers}
    assert steps["w0"] > 0 and steps["w1"] > 0


def test_killed_worker_requests_finish_on_the_other_worker_with_the_same_tokens(stack):
    # Seeded sampling with n=2: each sequence resumes on the survivor with its own index and child
    # seed, its streamed tokens as output (not prompt), so its later draws are exactly the same.
    sampling = dict(max_tokens=40, ignore_eos=True, n=2, temperature=1.0, seed=7)
    expected = _collect(stack.engine.Generate(_request(stack, "uninterrupted", **sampling), timeout=120))[0]
    assert len(expected[0]) == len(expected[1]) == 40 and expected[0] != expected[1]

    responses = stack.engine.Generate(_request(stack, "survivor", **sampling), timeout=120)
    received: dict[int, list[int]] = {0: [], 1: []}
    while min(len(t) for t in received.values()) < 8:
        message = next(responses)
        received[message.index].extend(message.token_ids)
    (busy,) = [w.worker_id for w in stack.stats().workers if w.num_running > 0]
    stack.processes[busy].kill()
    stack.processes[busy].wait()
    tokens, reasons, usage = _collect(responses)
    for i in (0, 1):
        assert received[i] + tokens.get(i, []) == expected[i]
    assert reasons == {0: common_pb2.FINISH_REASON_LENGTH, 1: common_pb2.FINISH_REASON_LENGTH}
    assert usage.completion_tokens == 80
    info = stack.engine.GetEngineInfo(engine_pb2.EngineInfoRequest(), timeout=5)
    assert info.num_healthy_workers == 1
    stats = stack.stats()
    assert {w.worker_id: w.healthy for w in stats.workers}[busy] is False
    stack.wait_blocks_released()
