"""The worker's gRPC server on loopback, driven through real channels and the generated stubs."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from worker_testing import (
    EOS,
    PROMPT_A,
    PROMPT_B,
    TINY_VOCAB,
    decode_plan,
    first_plan,
    make_runner,
    plan,
    save_tiny_llama,
)

from pagedserve.grpc_utils import CHANNEL_OPTIONS, add_health_and_reflection, set_serving
from pagedserve.v1 import engine_pb2, engine_pb2_grpc, worker_pb2, worker_pb2_grpc
from pagedserve.worker_svc import compute_thread
from pagedserve.worker_svc import server as worker_server
from pagedserve.worker_svc.config import WorkerConfig, parse_bytes
from pagedserve.worker_svc.kv_cache import KVCacheSpec, resolve_num_blocks
from pagedserve.worker_svc.server import SERVICE_NAME, WorkerServer, load_worker

NUM_BLOCKS, BLOCK_SIZE = 32, 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def worker_config(model_dir, **overrides) -> WorkerConfig:
    fields = dict(
        model=str(model_dir),
        dtype="float32",
        device="cpu",
        block_size=BLOCK_SIZE,
        num_blocks=NUM_BLOCKS,
        host="127.0.0.1",
        port=0,
        worker_id="worker-test",
        log_level="warning",
    )
    return WorkerConfig(**(fields | overrides))


async def start_worker(model_dir, **overrides) -> WorkerServer:
    server = await WorkerServer.load(worker_config(model_dir, **overrides), max_register_backoff=0.5)
    await server.start()
    return server


async def steps(
    stub: worker_pb2_grpc.WorkerServiceStub, plans: list[worker_pb2.StepPlan]
) -> list[worker_pb2.StepResult]:
    """Sends every plan at once (the worker pipelines them) and collects the results."""
    return [response.result async for response in stub.Steps(iter(requests(plans)))]


def requests(plans: list[worker_pb2.StepPlan]) -> list[worker_pb2.StepsRequest]:
    return [worker_pb2.StepsRequest(plan=p) for p in plans]


async def serve_two_steps(server: WorkerServer) -> list[worker_pb2.StepResult]:
    """Starts the loaded server, runs a prefill and a decode step through it, and stops it."""
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}", options=CHANNEL_OPTIONS) as ch:
            return await steps(worker_pb2_grpc.WorkerServiceStub(ch), [first_plan(), decode_plan(2)])
    finally:
        await server.stop(grace=None)


def expected_tokens(model_dir, plans) -> list[list[int]]:
    runner = make_runner(model_dir, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    return [list(runner.execute(p).sampled_token_ids) for p in plans]


@pytest.mark.anyio
async def test_steps_stream_returns_one_result_per_plan_in_order(model_dir):
    plans = [first_plan(), decode_plan(2), decode_plan(3), plan(4, [(0, 1, [4]), (1, 1, [])])]

    async def scenario():
        server = await start_worker(model_dir)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}", options=CHANNEL_OPTIONS) as ch:
                stub = worker_pb2_grpc.WorkerServiceStub(ch)
                info = (await stub.GetModelInfo(worker_pb2.GetModelInfoRequest())).info
                return info, await steps(stub, plans)
        finally:
            await server.stop(grace=None)

    info, results = await scenario()
    assert [r.step_id for r in results] == [1, 2, 3, 4]
    assert [list(r.sampled_slots) for r in results] == [[0, 1]] * 4
    assert [list(r.sampled_token_ids) for r in results] == expected_tokens(model_dir, plans)
    assert results[0].timings.num_tokens == len(PROMPT_A) + len(PROMPT_B)
    assert all(r.timings.forward_seconds > 0 for r in results)
    assert (info.num_blocks, info.block_size, info.dtype, info.device) == (
        NUM_BLOCKS,
        BLOCK_SIZE,
        "float32",
        "cpu",
    )
    assert (info.vocab_size, info.num_layers, info.num_kv_heads, info.head_dim) == (TINY_VOCAB, 2, 2, 16)
    assert info.block_bytes == 2 * 2 * BLOCK_SIZE * 2 * 16 * 4
    assert list(info.eos_token_ids) == [EOS] and info.max_model_len == 256


@pytest.mark.anyio
async def test_the_model_loads_on_the_thread_that_runs_every_step(model_dir, monkeypatch):
    # One thread opens every OpenMP parallel region of the process: a second thread that did (the load)
    # would keep a second team of OpenMP threads, and libgomp would then all but stop spinning between
    # regions (see compute_thread.ComputeThread).
    threads: dict[str, set[int]] = {"load": set(), "steps": set()}

    def load(config):
        threads["load"].add(threading.get_ident())
        return load_worker(config)

    monkeypatch.setattr(worker_server, "load_worker", load)
    server = await WorkerServer.load(worker_config(model_dir), max_register_backoff=0.5)
    runner = server.loaded.runner
    execute = runner.execute

    def traced_execute(*args, **kwargs):
        threads["steps"].add(threading.get_ident())
        return execute(*args, **kwargs)

    runner.execute = traced_execute
    results = await serve_two_steps(server)
    assert [r.step_id for r in results] == [1, 2]
    assert len(threads["load"]) == 1 and threads["steps"] == threads["load"]
    assert threading.get_ident() not in threads["load"]  # not the event loop's


# How long a test waits for something that must happen; reached only when the behaviour is broken.
ORDER_DEADLINE_S = 60.0


def signal_when_queued(server: WorkerServer, step_id: int, queued: threading.Event) -> None:
    """Set `queued` once the server has handed plan `step_id` to its compute thread."""
    executor = server.servicer.executor
    post = executor.post

    def posting(fn, *args):
        post(fn, *args)
        if args and getattr(args[0], "step_id", None) == step_id:
            queued.set()

    executor.post = posting


@pytest.mark.anyio
async def test_the_next_step_starts_as_the_previous_one_ends_even_while_the_event_loop_is_busy(
    model_dir, monkeypatch
):
    # Plan 2 arrives while step 1 runs; then the event loop is held handling step 1's result until step 2
    # has started. The compute thread must not wait for the loop: step 2 starts while the loop is held.
    server = await WorkerServer.load(worker_config(model_dir), max_register_backoff=0.5)
    runner = server.loaded.runner
    execute, on_step = runner.execute, server.servicer.spans.on_step
    plan_two_queued, step_two_started = threading.Event(), threading.Event()
    started_while_loop_held: list[bool] = []

    def first_step_waits_for_plan_two(plan, *args, **kwargs):
        if plan.step_id == 1:
            plan_two_queued.wait(ORDER_DEADLINE_S)
        else:
            step_two_started.set()
        return execute(plan, *args, **kwargs)

    def busy_loop(plan, *args):
        if plan.step_id == 1:
            started_while_loop_held.append(step_two_started.wait(ORDER_DEADLINE_S))
        return on_step(plan, *args)

    signal_when_queued(server, 2, plan_two_queued)
    runner.execute = first_step_waits_for_plan_two
    monkeypatch.setattr(server.servicer.spans, "on_step", busy_loop)
    results = await serve_two_steps(server)
    assert [r.step_id for r in results] == [1, 2]
    assert results[1].timings.idle_seconds == 0.0  # the plan was there before the step before it ended
    assert started_while_loop_held == [True]


@pytest.mark.anyio
async def test_a_result_is_written_while_the_next_step_computes_not_after_it(model_dir):
    # Plan 2 is queued while step 1 runs, so step 1's result is handed over at step 2's forward pass (see
    # ResultHandOver): step 2's forward pass holds on until the scheduler has step 1's result.
    server = await WorkerServer.load(worker_config(model_dir), max_register_backoff=0.5)
    runner = server.loaded.runner
    execute, forward = runner.execute, runner.model.forward
    plan_two_queued, result_one_read = threading.Event(), threading.Event()
    read_during_forward: list[bool] = []

    def first_step_waits_for_plan_two(plan, *args, **kwargs):
        if plan.step_id == 1:
            plan_two_queued.wait(ORDER_DEADLINE_S)
        return execute(plan, *args, **kwargs)

    def forward_waits_for_result_one(*args, **kwargs):
        if runner.last_step_id == 1:
            read_during_forward.append(result_one_read.wait(ORDER_DEADLINE_S))
        return forward(*args, **kwargs)

    signal_when_queued(server, 2, plan_two_queued)
    runner.execute = first_step_waits_for_plan_two
    runner.model.forward = forward_waits_for_result_one
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}", options=CHANNEL_OPTIONS) as ch:
            steps = []
            stub = worker_pb2_grpc.WorkerServiceStub(ch)
            async for response in stub.Steps(iter(requests([first_plan(), decode_plan(2)]))):
                steps.append(response.result.step_id)
                result_one_read.set()
    finally:
        await server.stop(grace=None)
    assert steps == [1, 2]
    assert read_during_forward == [True]


@pytest.mark.anyio
async def test_the_result_hand_over_holds_a_result_only_while_a_next_step_is_queued():
    loop = asyncio.get_running_loop()
    hand_over = compute_thread.ResultHandOver(loop)
    first, second, third = loop.create_future(), loop.create_future(), loop.create_future()

    async def settle() -> None:
        for _ in range(3):
            await asyncio.sleep(0)

    # Nothing queued: a step's result goes at once.
    hand_over.queued()
    hand_over.started()
    hand_over.finished(first, "one")
    await settle()
    assert first.result() == "one"
    # A step queued behind: the result waits for that step's forward pass (flush) ...
    hand_over.queued()
    hand_over.started()
    hand_over.queued()
    hand_over.finished(second, "two")
    await settle()
    assert not second.done()
    hand_over.started()
    hand_over.flush()
    await settle()
    assert second.result() == "two"
    # ... or for its end, and always before that step's own result.
    hand_over.queued()
    hand_over.finished(third, "three")  # held: a step is queued
    fourth = loop.create_future()
    hand_over.started()
    hand_over.finished(fourth, "four")  # no forward pass in that step: the held result first
    order = []
    third.add_done_callback(lambda f: order.append(f.result()))
    fourth.add_done_callback(lambda f: order.append(f.result()))
    await settle()
    assert order == ["three", "four"]


def test_the_compute_thread_runs_calls_in_order_on_one_thread_and_ends_after_the_queued_ones():
    thread = compute_thread.ComputeThread()
    ran: list[tuple[str, int]] = []
    gate = threading.Event()
    thread.post(gate.wait)  # holds the thread while calls queue up behind it
    thread.post(lambda: ran.append(("posted", threading.get_ident())))
    square = thread.submit(lambda x: ran.append(("submitted", threading.get_ident())) or x * x, 7)

    def broken():
        raise ValueError("bad call")

    failed = thread.submit(broken)
    thread.post(broken)  # logged; the thread goes on
    last = thread.submit(lambda: ran.append(("last", threading.get_ident())))
    thread.shutdown(wait=False)
    with pytest.raises(RuntimeError, match="shut down"):
        thread.post(print)
    assert not square.done()
    gate.set()
    assert square.result(timeout=10) == 49
    with pytest.raises(ValueError, match="bad call"):
        failed.result(timeout=10)
    last.result(timeout=10)
    thread.shutdown(wait=True)
    assert [name for name, _ in ran] == ["posted", "submitted", "last"]
    idents = {ident for _, ident in ran}
    assert len(idents) == 1 and threading.get_ident() not in idents


async def until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


@pytest.mark.anyio
async def test_steps_still_queued_when_their_stream_ends_never_run(model_dir):
    server = await start_worker(model_dir)
    executor = server.servicer.executor
    post, gate, queued = executor.post, threading.Event(), []

    def tracked_post(fn, *args):
        queued.append(args[-1])  # the step's result future
        post(fn, *args)

    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}", options=CHANNEL_OPTIONS) as ch:
            stub = worker_pb2_grpc.WorkerServiceStub(ch)
            executor.post(gate.wait)  # holds the compute thread while the plans queue up behind it
            executor.post = tracked_post
            call = stub.Steps(iter(requests([first_plan(), decode_plan(2)])))
            await until(lambda: len(queued) == 2)
            call.cancel()
            await until(lambda: all(done.cancelled() for done in queued))  # the stream has ended
            gate.set()
            await asyncio.wrap_future(executor.submit(lambda: None))  # the queued steps had their turn
            # Neither ran: a new stream starts again at step 1.
            after = await steps(stub, [first_plan(), decode_plan(2)])
    finally:
        gate.set()
        executor.post = post
        await server.stop(grace=None)
    assert [r.step_id for r in after] == [1, 2]
    assert [list(r.sampled_token_ids) for r in after] == expected_tokens(
        model_dir, [first_plan(), decode_plan(2)]
    )


@pytest.mark.anyio
async def test_broken_plan_ends_the_stream_with_invalid_argument_and_a_new_stream_continues(model_dir):
    async def scenario():
        server = await start_worker(model_dir)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}", options=CHANNEL_OPTIONS) as ch:
                stub = worker_pb2_grpc.WorkerServiceStub(ch)
                received = []
                with pytest.raises(grpc.aio.AioRpcError) as error:
                    async for response in stub.Steps(
                        iter(requests([first_plan(), decode_plan(3), decode_plan(4)]))
                    ):
                        received.append(response.result)
                after = await steps(stub, [decode_plan(2), decode_plan(3)])
                return received, error.value, after
        finally:
            await server.stop(grace=None)

    received, error, after = await scenario()
    assert [r.step_id for r in received] == [1]  # the plan before the broken one was executed
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == "step 3: expected step id 2 (a gap or a repeat)"
    expected = expected_tokens(model_dir, [first_plan(), decode_plan(2), decode_plan(3)])
    assert [list(r.sampled_token_ids) for r in [*received, *after]] == expected


@pytest.mark.anyio
async def test_reset_forgets_requests_and_restarts_at_step_one(model_dir):
    async def scenario():
        server = await start_worker(model_dir)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}", options=CHANNEL_OPTIONS) as ch:
                stub = worker_pb2_grpc.WorkerServiceStub(ch)
                await steps(stub, [first_plan(), decode_plan(2)])
                info = (await stub.Reset(worker_pb2.ResetRequest())).info
                with pytest.raises(grpc.aio.AioRpcError) as error:
                    await steps(stub, [decode_plan(3)])
                again = await steps(stub, [first_plan()])
                return info, error.value, again, server.servicer.runner.slots
        finally:
            await server.stop(grace=None)

    info, error, again, slots = await scenario()
    assert info.num_blocks == NUM_BLOCKS
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "expected step id 1" in error.details()
    assert [r.step_id for r in again] == [1] and sorted(slots) == [0, 1]


@pytest.mark.anyio
async def test_health_reports_serving_and_reflection_lists_the_worker_service(model_dir):
    async def scenario():
        server = await start_worker(model_dir)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
                health_stub = health_pb2_grpc.HealthStub(ch)
                overall = await health_stub.Check(health_pb2.HealthCheckRequest(service=""))
                worker = await health_stub.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
                reflection = reflection_pb2_grpc.ServerReflectionStub(ch)
                request = reflection_pb2.ServerReflectionRequest(list_services="")
                responses = [r async for r in reflection.ServerReflectionInfo(iter([request]))]
                return overall.status, worker.status, responses
        finally:
            await server.stop(grace=None)

    overall, worker, responses = await scenario()
    assert overall == worker == health_pb2.HealthCheckResponse.SERVING
    names = {s.name for s in responses[0].list_services_response.service}
    assert {"pagedserve.v1.WorkerService", "grpc.health.v1.Health"} <= names


class RecordingEngineServicer(engine_pb2_grpc.EngineServiceServicer):
    """Stand-in for the scheduler that implements only RegisterWorker and records its requests:
    it tests the worker's client side of registration."""

    def __init__(self) -> None:
        self.requests: list[engine_pb2.RegisterWorkerRequest] = []
        self.arrived = asyncio.Event()
        self.drains: list[engine_pb2.DrainWorkerRequest] = []

    async def RegisterWorker(self, request, context):
        self.requests.append(request)
        self.arrived.set()
        return engine_pb2.RegisterWorkerResponse(accepted=True)

    async def DrainWorker(self, request, context):
        self.drains.append(request)
        return engine_pb2.DrainWorkerResponse(drained=True, num_requests_moved=3)


async def start_recording_engine(port: int) -> tuple[grpc.aio.Server, RecordingEngineServicer]:
    server = grpc.aio.server()
    servicer = RecordingEngineServicer()
    engine_pb2_grpc.add_EngineServiceServicer_to_server(servicer, server)
    health_servicer = add_health_and_reflection(server, ["pagedserve.v1.EngineService"])
    assert server.add_insecure_port(f"127.0.0.1:{port}") == port
    await server.start()
    await set_serving(health_servicer, ["pagedserve.v1.EngineService"], True)
    return server, servicer


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


RESTARTS = 5


@pytest.mark.anyio
async def test_worker_registers_when_the_scheduler_appears_and_again_after_each_restart(model_dir):
    port = free_port()

    async def scenario():
        # The worker starts first: it keeps retrying until the scheduler is up.
        worker = await start_worker(
            model_dir, scheduler=f"127.0.0.1:{port}", advertise_address="worker-a:7001"
        )
        recorded = []
        try:
            await asyncio.sleep(0.3)
            for restart in range(1 + RESTARTS):
                engine, servicer = await start_recording_engine(port)
                recorded.append(servicer)
                await asyncio.wait_for(servicer.arrived.wait(), timeout=15)
                if restart == RESTARTS:
                    break
                # The scheduler restarts at once (a new process on the same address, with no memory of
                # us): often before the worker has even read the answer to its registration.
                await engine.stop(grace=None)
            # The worker counts itself registered once the answer is back, just after the engine saw it.
            await asyncio.wait_for(worker.registrar.registered.wait(), timeout=5)
            await engine.stop(grace=None)
            return [s.requests for s in recorded]
        finally:
            await worker.stop(grace=None)

    requests = await scenario()
    assert [len(r) for r in requests] == [1] * (1 + RESTARTS)
    request = requests[0][0]
    assert (request.worker_id, request.address, request.model) == (
        "worker-test",
        "worker-a:7001",
        model_dir.name,
    )
    assert (request.num_blocks, request.block_size, request.dtype, request.device) == (
        NUM_BLOCKS,
        BLOCK_SIZE,
        "float32",
        "cpu",
    )
    assert request.max_model_len == 256
    assert all(r == [request] for r in requests)


@pytest.mark.anyio
async def test_draining_tells_the_scheduler_the_worker_is_leaving_and_stops_registering(model_dir):
    port = free_port()
    engine, servicer = await start_recording_engine(port)
    worker = await start_worker(model_dir, scheduler=f"127.0.0.1:{port}", advertise_address="worker-a:7001")
    try:
        await asyncio.wait_for(worker.registrar.registered.wait(), timeout=15)
        # DrainWorker answers once the scheduler has moved the worker's requests and closed its stream.
        assert await worker.drain(timeout=10)
        assert [(r.worker_id, r.address) for r in servicer.drains] == [("worker-test", "worker-a:7001")]
        assert worker._register_task.done()  # it does not announce itself again while it goes
    finally:
        await worker.stop(grace=None)
        await engine.stop(grace=None)
    # With no scheduler to tell, a drain is over at once.
    alone = await start_worker(model_dir)
    try:
        assert not await alone.drain(timeout=10)
    finally:
        await alone.stop(grace=None)


# ---- configuration ------------------------------------------------------------------------------


def test_config_flags_win_over_environment_which_wins_over_defaults():
    env = {"PAGEDSERVE_BLOCK_SIZE": "32", "PAGEDSERVE_KV_CACHE_MEMORY": "2GiB", "PAGEDSERVE_PORT": "7001"}
    config = WorkerConfig.from_args(["--port", "7002", "--scheduler", "sched:50050"], env=env)
    assert config.block_size == 32 and config.kv_cache_memory == 2 * 1024**3
    assert config.port == 7002 and config.scheduler == "sched:50050"
    assert config.num_blocks is None and config.device == "auto" and config.host == "0.0.0.0"
    assert config.advertised(7002).endswith(":7002")
    assert WorkerConfig.from_args(["--advertise-address", "w:1"], env={}).advertised(5) == "w:1"


def test_threads_flag_defaults_to_torchs_choice_and_must_be_positive():
    assert WorkerConfig.from_args([], env={}).threads is None
    assert WorkerConfig.from_args([], env={"PAGEDSERVE_THREADS": "2"}).threads == 2
    assert WorkerConfig.from_args(["--threads", "1"], env={"PAGEDSERVE_THREADS": "2"}).threads == 1
    with pytest.raises(ValueError, match="threads must be positive"):
        WorkerConfig.from_args(["--threads", "0"], env={})


def test_launcher_shares_the_cores_out_among_several_workers_unless_threads_are_given(monkeypatch):
    from pagedserve.launcher import LaunchConfig, _child_args, build_parser

    def threads(*argv):
        config = LaunchConfig(**vars(build_parser().parse_args(argv)))
        workers = _child_args(config, "/m", "127.0.0.1:1", 1)[1]
        return [args[args.index("--threads") + 1] if "--threads" in args else None for args in workers]

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)))
    # One worker keeps torch's default (a thread per core); several share the cores, none with fewer than one.
    assert threads() == [None]
    assert threads("--workers", "2") == ["4", "4"]
    assert threads("--workers", "3") == ["2", "2", "2"]
    assert threads("--workers", "16") == ["1"] * 16
    assert threads("--workers", "2", "--threads", "3") == ["3", "3"]
    assert threads("--threads", "1") == ["1"]


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("2GiB", 2 * 1024**3),
        ("512MiB", 512 * 1024**2),
        ("1000", 1000),
        ("1.5GB", 1_500_000_000),
        ("64 kib", 65536),
    ],
)
def test_kv_cache_memory_accepts_units(text, size):
    assert parse_bytes(text) == size


def test_kv_cache_memory_refuses_nonsense():
    with pytest.raises(ValueError, match="not a size in bytes"):
        parse_bytes("lots")


def test_block_count_follows_from_the_memory_budget_unless_given():
    import torch

    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=16, block_size=4, dtype=torch.float32)
    assert spec.block_bytes == 2 * 2 * 4 * 2 * 16 * 4  # K and V, layers, tokens, heads, dims, bytes
    cpu = torch.device("cpu")
    assert resolve_num_blocks(spec, cpu, None, 10 * spec.block_bytes + 5) == 10
    assert resolve_num_blocks(spec, cpu, 7, 10 * spec.block_bytes) == 7
    with pytest.raises(ValueError, match="holds no block"):
        resolve_num_blocks(spec, cpu, None, 100)


def test_worker_command_shows_its_flags(capsys):
    from pagedserve.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["worker", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "--kv-cache-memory" in out and "PAGEDSERVE_SCHEDULER" in out


def test_wildcard_bind_advertises_the_address_the_scheduler_can_dial_back():
    from pagedserve.worker_svc.config import WorkerConfig

    config = WorkerConfig.from_args(["--host", "0.0.0.0", "--scheduler", "127.0.0.1:50052"], env={})
    assert config.advertised(41000) == "127.0.0.1:41000"
    explicit = WorkerConfig.from_args(["--advertise-address", "worker-7:9000"], env={})
    assert explicit.advertised(41000) == "worker-7:9000"
