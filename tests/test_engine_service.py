"""The Engine service end to end: a real scheduler process and real worker processes on loopback,
driven through the generated Engine stubs (no gateway), with a cluster token: only callers that carry it
get in.

One scheduler and one worker are shared by the whole module; a second worker joins near the end and
the last test kills one of them mid-stream.
"""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from stack_testing import Stack, running

from pagedserve.grpc_utils import NO_CLUSTER_AUTH, ClusterAuth, open_sync_channel
from pagedserve.v1 import common_pb2, engine_pb2, engine_pb2_grpc, worker_pb2, worker_pb2_grpc

pytestmark = pytest.mark.slow

PROMPT = "What is the capital of France?"


@pytest.fixture(scope="module")
def stack(default_model_dir, tmp_path_factory):
    """A scheduler and one worker; no gateway."""
    stack = Stack(
        default_model_dir,
        tmp_path_factory.mktemp("engine-service-logs"),
        num_workers=1,
        with_gateway=False,
        scheduler_args=["--worker-wait-timeout", "30"],
    )
    with running(stack):
        yield stack


@pytest.fixture(scope="module")
def channel(stack):
    with stack.engine_channel() as channel:
        yield channel


@pytest.fixture(scope="module")
def engine(channel) -> engine_pb2_grpc.EngineServiceStub:
    return engine_pb2_grpc.EngineServiceStub(channel)


@pytest.fixture(scope="module")
def prompt_ids(default_model_dir) -> list[int]:
    from pagedserve.model_files import load_tokenizer

    tokenizer = load_tokenizer(default_model_dir)
    encoded = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True)
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


@pytest.fixture(scope="module")
def eos_ids(default_model_dir) -> list[int]:
    from pagedserve.model_files import load_generation_info

    return list(load_generation_info(default_model_dir).eos_token_ids)


@pytest.fixture(scope="module")
def greedy_reference(default_model_dir, prompt_ids, eos_ids):
    """transformers' own greedy generate in float32 on the same model (the oracle)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(default_model_dir), dtype=torch.float32)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]), max_new_tokens=16, do_sample=False, eos_token_id=eos_ids
        )
    return out[0, len(prompt_ids) :].tolist()


def _request(prompt_ids: list[int], request_id: str, **sampling) -> engine_pb2.GenerateTokensRequest:
    sampling.setdefault("temperature", 0.0)
    return engine_pb2.GenerateTokensRequest(
        request_id=request_id,
        prompt_token_ids=prompt_ids,
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


def test_health_is_serving_once_a_worker_is_registered(channel):
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "pagedserve.v1.EngineService"):
        response = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert response.status == health_pb2.HealthCheckResponse.SERVING


def _refused(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


def _health(channel) -> int:
    check = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    return check.status


def _outsider_is_refused_everything_but_health(
    stack, auth: ClusterAuth, prompt_ids, worker_address: str
) -> None:
    with open_sync_channel(stack.engine_address, auth=auth) as channel:
        engine = engine_pb2_grpc.EngineServiceStub(channel)
        intruder = engine_pb2.RegisterWorkerRequest(
            worker_id="intruder", address="127.0.0.1:1", block_size=16
        )
        calls = {
            "RegisterWorker": lambda: engine.RegisterWorker(intruder, timeout=10),
            "GenerateTokens": lambda: list(
                engine.GenerateTokens(_request(prompt_ids, "intruder", max_tokens=4), timeout=10)
            ),
            "Abort": lambda: engine.Abort(engine_pb2.AbortRequest(request_id="anyone"), timeout=10),
            "GetStats": lambda: engine.GetStats(engine_pb2.GetStatsRequest(), timeout=10),
        }
        for name, call in calls.items():
            error = _refused(call)
            assert error.code() == grpc.StatusCode.UNAUTHENTICATED, name
            assert "cluster token" in error.details(), name
        assert _health(channel) == health_pb2.HealthCheckResponse.SERVING
    with open_sync_channel(worker_address, auth=auth) as channel:
        worker = worker_pb2_grpc.WorkerServiceStub(channel)
        steps = worker.Steps(iter([worker_pb2.StepsRequest(plan=worker_pb2.StepPlan(step_id=1))]), timeout=10)
        for call in (lambda: list(steps), lambda: worker.Reset(worker_pb2.ResetRequest(), timeout=10)):
            error = _refused(call)
            assert error.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "cluster token" in error.details()
        assert _health(channel) == health_pb2.HealthCheckResponse.SERVING


def test_engine_and_worker_refuse_callers_without_the_cluster_token_but_answer_health(stack, prompt_ids):
    worker_address = stack.engine_stats().workers[0].address
    _outsider_is_refused_everything_but_health(stack, NO_CLUSTER_AUTH, prompt_ids, worker_address)
    wrong = ClusterAuth("not-" + stack.cluster_token)
    _outsider_is_refused_everything_but_health(stack, wrong, prompt_ids, worker_address)
    # Nobody got in, and a member does.
    (worker,) = stack.engine_stats().workers
    assert worker.worker_id == "worker-0" and worker.healthy
    with open_sync_channel(worker_address, auth=stack.client_auth) as channel:
        info = (
            worker_pb2_grpc.WorkerServiceStub(channel)
            .GetModelInfo(worker_pb2.GetModelInfoRequest(), timeout=10)
            .info
        )
    assert info.model == "SmolLM2-135M-Instruct"


def test_engine_info_reports_the_model_and_its_special_tokens(engine, eos_ids):
    info = engine.GetEngineInfo(engine_pb2.GetEngineInfoRequest(), timeout=5).info
    assert info.model == "SmolLM2-135M-Instruct"
    assert set(info.eos_token_ids) == set(eos_ids)
    assert info.max_model_len >= 2048
    assert info.vocab_size == 49152
    assert info.block_size == 16
    assert info.num_healthy_workers == 1
    assert info.max_queued_requests > 0


def test_greedy_stream_equals_transformers_generate(engine, prompt_ids, eos_ids, greedy_reference):
    tokens, reasons, usage = _collect(
        engine.GenerateTokens(_request(prompt_ids, "greedy", max_tokens=16), timeout=60)
    )
    assert tokens[0] == greedy_reference
    expected = (
        common_pb2.FINISH_REASON_STOP if greedy_reference[-1] in eos_ids else common_pb2.FINISH_REASON_LENGTH
    )
    assert reasons == {0: expected}
    assert usage.prompt_tokens == len(prompt_ids)
    assert usage.completion_tokens == len(greedy_reference)


def test_n2_streams_two_sequences_and_usage_covers_both(engine, prompt_ids, greedy_reference):
    tokens, reasons, usage = _collect(
        engine.GenerateTokens(_request(prompt_ids, "n2", max_tokens=16, n=2), timeout=60)
    )
    assert set(tokens) == {0, 1} and set(reasons) == {0, 1}
    assert tokens[0] == tokens[1] == greedy_reference
    assert usage.completion_tokens == 2 * len(greedy_reference)
    # The prompt's full blocks were cached by the previous test's identical prompt.
    assert usage.cached_prompt_tokens == (len(prompt_ids) - 1) // 16 * 16


def test_abort_mid_stream_ends_the_stream_and_frees_blocks(stack, engine, prompt_ids):
    responses = engine.GenerateTokens(
        _request(prompt_ids, "to-abort", max_tokens=500, ignore_eos=True), timeout=60
    )
    first = next(responses)
    assert first.token_ids
    assert engine.Abort(engine_pb2.AbortRequest(request_id="to-abort"), timeout=5).aborted
    _tokens, reasons, usage = _collect(responses)
    assert reasons == {0: common_pb2.FINISH_REASON_ABORT}
    assert usage is not None
    stack.wait_idle()
    assert not engine.Abort(engine_pb2.AbortRequest(request_id="to-abort"), timeout=5).aborted


def test_client_cancelling_its_stream_frees_blocks(stack, engine, prompt_ids):
    responses = engine.GenerateTokens(
        _request(prompt_ids, "to-cancel", max_tokens=500, ignore_eos=True), timeout=60
    )
    next(responses)
    next(responses)
    assert stack.engine_stats().num_blocks_in_use > 0
    responses.cancel()
    stats = stack.wait_idle()
    assert stats.requests_finished["abort"] >= 2


def test_invalid_requests_are_refused_with_invalid_argument(engine, prompt_ids):
    cases = [
        engine_pb2.GenerateTokensRequest(
            request_id="empty", sampling=common_pb2.SamplingParams(max_tokens=4)
        ),
        engine_pb2.GenerateTokensRequest(request_id="oov", prompt_token_ids=[1, 10**6]),
        _request(prompt_ids, "too-long", max_tokens=10**6),
    ]
    for request in cases:
        with pytest.raises(grpc.RpcError) as info:
            list(engine.GenerateTokens(request, timeout=10))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, request.request_id


def test_stats_count_tokens_finishes_latencies_and_worker_steps(stack):
    stats = stack.engine_stats()
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
    assert worker.worker_id == "worker-0" and worker.healthy and worker.num_blocks == 256
    assert worker.num_steps > 0 and worker.mean_step_seconds > 0
    assert worker.num_cached_free_blocks > 0  # the prompt's blocks stay cached after the requests end


def test_a_second_worker_registers_and_takes_work(stack, engine):
    stack.start_worker("worker-1")
    stack.wait_workers(2)
    # Two different prompts at once: the second goes to the idle worker.
    first = engine.GenerateTokens(
        engine_pb2.GenerateTokensRequest(
            request_id="load-a",
            prompt_token_ids=[1, 2, 3, 4, 5],
            sampling=common_pb2.SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
        ),
        timeout=60,
    )
    next(first)
    second = engine.GenerateTokens(
        engine_pb2.GenerateTokensRequest(
            request_id="load-b",
            prompt_token_ids=[6, 7, 8, 9],
            sampling=common_pb2.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
        ),
        timeout=60,
    )
    assert len(_collect(second)[0][0]) == 8
    assert len(_collect(first)[0][0]) == 23
    steps = {w.worker_id: w.num_steps for w in stack.engine_stats().workers}
    assert steps["worker-0"] > 0 and steps["worker-1"] > 0


def test_killed_worker_requests_finish_on_the_other_worker_with_the_same_tokens(stack, engine, prompt_ids):
    # Seeded sampling with n=2: each sequence resumes on the survivor with its own index and child
    # seed, its streamed tokens as output (not prompt), so its later draws are exactly the same.
    sampling = dict(max_tokens=40, ignore_eos=True, n=2, temperature=1.0, seed=7)
    expected = _collect(
        engine.GenerateTokens(_request(prompt_ids, "uninterrupted", **sampling), timeout=120)
    )[0]
    assert len(expected[0]) == len(expected[1]) == 40 and expected[0] != expected[1]

    responses = engine.GenerateTokens(_request(prompt_ids, "survivor", **sampling), timeout=120)
    received: dict[int, list[int]] = {0: [], 1: []}
    while min(len(t) for t in received.values()) < 8:
        message = next(responses)
        received[message.index].extend(message.token_ids)
    (busy,) = [w.worker_id for w in stack.engine_stats().workers if w.num_running > 0]
    stack.workers[busy].kill()
    stack.workers[busy].wait()
    tokens, reasons, usage = _collect(responses)
    for i in (0, 1):
        assert received[i] + tokens.get(i, []) == expected[i]
    assert reasons == {0: common_pb2.FINISH_REASON_LENGTH, 1: common_pb2.FINISH_REASON_LENGTH}
    assert usage.completion_tokens == 80
    info = engine.GetEngineInfo(engine_pb2.GetEngineInfoRequest(), timeout=5).info
    assert info.num_healthy_workers == 1
    stats = stack.engine_stats()
    assert {w.worker_id: w.healthy for w in stats.workers}[busy] is False
    stack.wait_idle()
