"""The engine (scheduler_svc/engine.py) in process, over real gRPC on loopback, with fake workers:
scheduler_fakes.FakeWorker (position-seeded samples, checked block tables) behind a WorkerService servicer.
Failover, per-sequence abort and re-registration, with no model and no subprocess."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from scheduler_fakes import EOS, VOCAB_SIZE, FakeWorker, expected_tokens

from pagedserve.scheduler_svc.engine import Engine
from pagedserve.scheduler_svc.request_stream import END, RequestStream
from pagedserve.scheduler_svc.server import EngineServicer
from pagedserve.scheduler_svc.service_config import SchedulerServiceConfig
from pagedserve.v1 import common_pb2, engine_pb2, worker_pb2, worker_pb2_grpc

pytestmark = pytest.mark.anyio

BLOCK_SIZE = 16
NUM_BLOCKS = 64
MAX_MODEL_LEN = 512
PROMPT = [2 + i % 50 for i in range(21)]
LENGTH = common_pb2.FINISH_REASON_LENGTH
ABORT = common_pb2.FINISH_REASON_ABORT


class FakeWorkerServicer(worker_pb2_grpc.WorkerServiceServicer):
    def __init__(self, step_seconds: float) -> None:
        self.step_seconds = step_seconds
        self.worker = FakeWorker(NUM_BLOCKS, BLOCK_SIZE)
        self.num_resets = 0
        self.plans: list[worker_pb2.StepPlan] = []

    def info(self) -> worker_pb2.ModelInfo:
        return worker_pb2.ModelInfo(
            model="fake",
            num_blocks=NUM_BLOCKS,
            block_size=BLOCK_SIZE,
            dtype="float32",
            device="cpu",
            max_model_len=MAX_MODEL_LEN,
            vocab_size=VOCAB_SIZE,
            eos_token_ids=[EOS],
        )

    async def Reset(self, request, context) -> worker_pb2.ResetResponse:
        self.worker = FakeWorker(NUM_BLOCKS, BLOCK_SIZE)
        self.num_resets += 1
        return worker_pb2.ResetResponse(info=self.info())

    async def GetModelInfo(self, request, context) -> worker_pb2.GetModelInfoResponse:
        return worker_pb2.GetModelInfoResponse(info=self.info())

    async def Steps(self, request_iterator, context):
        async for request in request_iterator:
            self.plans.append(request.plan)
            await asyncio.sleep(self.step_seconds)
            yield worker_pb2.StepsResponse(result=self.worker.execute(request.plan))


class Pool:
    """An engine and its fake workers."""

    def __init__(self) -> None:
        config = SchedulerServiceConfig(max_num_seqs=8, max_num_batched_tokens=64, worker_wait_timeout=10)
        self.engine = Engine(config, "fake", frozenset({EOS}), MAX_MODEL_LEN, VOCAB_SIZE)
        self.servers: dict[str, tuple[grpc.aio.Server, FakeWorkerServicer, str]] = {}

    async def start_worker(self, worker_id: str, step_seconds: float = 0.005) -> FakeWorkerServicer:
        server = grpc.aio.server()
        servicer = FakeWorkerServicer(step_seconds)
        worker_pb2_grpc.add_WorkerServiceServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        self.servers[worker_id] = (server, servicer, f"127.0.0.1:{port}")
        assert (await self.register(worker_id)).accepted
        return servicer

    async def register(self, worker_id: str) -> engine_pb2.RegisterWorkerResponse:
        address = self.servers[worker_id][2]
        return await self.engine.register_worker(
            engine_pb2.RegisterWorkerRequest(
                worker_id=worker_id,
                address=address,
                model="fake",
                num_blocks=NUM_BLOCKS,
                block_size=BLOCK_SIZE,
            )
        )

    async def kill_worker(self, worker_id: str) -> None:
        await self.servers[worker_id][0].stop(0)

    async def close(self) -> None:
        await self.engine.close()
        for server, _, _ in self.servers.values():
            await server.stop(0)


@pytest.fixture
async def pool():
    p = Pool()
    try:
        yield p
    finally:
        await p.close()


def _submit(pool: Pool, request_id: str, **sampling) -> RequestStream:
    msg = engine_pb2.GenerateTokensRequest(
        request_id=request_id, prompt_token_ids=PROMPT, sampling=common_pb2.SamplingParams(**sampling)
    )
    return pool.engine.submit(msg)


async def _read(stream: RequestStream, tokens: dict, reasons: dict, until=None) -> None:
    """Read the stream's messages into tokens / reasons (by index) until `until()` or its end."""
    while until is None or not until():
        item = await asyncio.wait_for(stream.queue.get(), timeout=10)
        if item is END:
            return
        assert not isinstance(item, Exception), item
        tokens.setdefault(item.index, []).extend(item.token_ids)
        if item.finish_reason:
            assert item.index not in reasons, "a sequence finished twice"
            reasons[item.index] = item.finish_reason


def _no_empty_plans(servicer: FakeWorkerServicer) -> bool:
    return all(p.slots or p.finished_slots or p.preempted_slots for p in servicer.plans)


async def test_failover_continues_seeded_sampled_sequences_exactly_as_uninterrupted(pool):
    w0 = await pool.start_worker("w0")
    sampling = dict(n=2, seed=7, temperature=1.0, max_tokens=30, ignore_eos=True)
    stream = _submit(pool, "survivor", **sampling)
    tokens: dict[int, list[int]] = {}
    reasons: dict[int, int] = {}
    await _read(stream, tokens, reasons, until=lambda: min(len(tokens.get(i, ())) for i in (0, 1)) >= 8)
    w1 = await pool.start_worker("w1")
    await pool.kill_worker("w0")
    await _read(stream, tokens, reasons)
    for i in (0, 1):
        assert tokens[i] == expected_tokens(PROMPT, 7 + i, 30)  # nothing lost, repeated or redrawn
    assert reasons == {0: LENGTH, 1: LENGTH}
    # On w1 each sequence came back on its own: prompt + what its client had seen, prompt_len the prompt.
    resumed = [n for p in w1.plans for n in p.new_requests]
    assert sorted(n.sampling.seed for n in resumed) == [7, 8]
    assert all(n.prompt_len == len(PROMPT) and len(n.token_ids) > len(PROMPT) for n in resumed)
    assert _no_empty_plans(w0) and _no_empty_plans(w1)
    assert pool.engine.stats().num_blocks_in_use == 0


async def test_abort_with_an_index_stops_that_sequence_only_and_frees_its_blocks(pool):
    w0 = await pool.start_worker("w0", step_seconds=0.01)
    stream = _submit(pool, "a", n=3, seed=3, temperature=1.0, max_tokens=40, ignore_eos=True)
    tokens: dict[int, list[int]] = {}
    reasons: dict[int, int] = {}
    await _read(stream, tokens, reasons, until=lambda: len(tokens) == 3 and all(tokens.values()))
    core = pool.engine.workers["w0"].scheduler
    used = core.kv.pool.num_used_blocks
    servicer = EngineServicer(pool.engine, sync_health=None)
    response = await servicer.Abort(engine_pb2.AbortRequest(request_id="a", index=1), None)
    assert response.aborted
    assert sorted(r.index for r in core.running) == [0, 2]
    assert core.kv.pool.num_used_blocks < used  # its own blocks, at once; the shared prompt stays
    assert not (await servicer.Abort(engine_pb2.AbortRequest(request_id="a", index=1), None)).aborted
    await _read(stream, tokens, reasons)
    assert reasons == {0: LENGTH, 1: ABORT, 2: LENGTH}
    for i in (0, 2):
        assert tokens[i] == expected_tokens(PROMPT, 3 + i, 40)
    assert tokens[1] == expected_tokens(PROMPT, 4, 40)[: len(tokens[1])]
    assert _no_empty_plans(w0)
    assert pool.engine.stats().num_blocks_in_use == 0


async def test_abort_with_an_index_of_the_last_live_sequence_ends_the_request(pool):
    await pool.start_worker("w0", step_seconds=0.01)
    stream = _submit(pool, "a", n=2, max_tokens=40, ignore_eos=True)
    tokens: dict[int, list[int]] = {}
    reasons: dict[int, int] = {}
    await _read(stream, tokens, reasons, until=lambda: len(tokens) == 2)
    assert pool.engine.abort("a", 0) and pool.engine.abort("a", 1)
    await _read(stream, tokens, reasons)  # ends: the stream got its END
    assert reasons == {0: ABORT, 1: ABORT} and stream.done
    assert pool.engine.stats().num_blocks_in_use == 0


async def test_reregistration_of_a_healthy_worker_keeps_its_running_requests(pool):
    w0 = await pool.start_worker("w0", step_seconds=0.01)
    worker = pool.engine.workers["w0"]
    stream = _submit(pool, "a", seed=5, temperature=1.0, max_tokens=30, ignore_eos=True)
    tokens: dict[int, list[int]] = {}
    reasons: dict[int, int] = {}
    await _read(stream, tokens, reasons, until=lambda: len(tokens.get(0, ())) >= 5)
    for _ in range(2):
        assert (await pool.register("w0")).accepted
    assert pool.engine.workers["w0"] is worker and worker.healthy
    assert w0.num_resets == 1  # only the first registration's
    await _read(stream, tokens, reasons)
    assert tokens[0] == expected_tokens(PROMPT, 5, 30) and reasons == {0: LENGTH}


async def test_no_plan_without_work_while_idle(pool):
    w0 = await pool.start_worker("w0")
    stream = _submit(pool, "a", max_tokens=3, ignore_eos=True)
    await _read(stream, {}, {})
    # The departure (the finished slot) goes out with one more plan, then nothing.
    deadline = asyncio.get_running_loop().time() + 10
    while not (w0.plans and w0.plans[-1].finished_slots):
        assert asyncio.get_running_loop().time() < deadline, "the departure never went out"
        await asyncio.sleep(0.01)
    sent = len(w0.plans)
    await asyncio.sleep(0.2)
    assert len(w0.plans) == sent and _no_empty_plans(w0)
