"""The engine (scheduler_svc/engine.py) in process, over real gRPC on loopback, with fake workers:
scheduler_fakes.FakeWorker (position-seeded samples, checked block tables) behind a Worker servicer.
Failover, per-sequence abort, re-registration, supervision (hung workers, workers that never come back,
draining) and requests that fail alone, with no model and no subprocess."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from scheduler_fakes import EOS, VOCAB_SIZE, FakeWorker, expected_tokens

from pagedserve.errors import InvalidRequestError, OverloadedError, PagedServeError
from pagedserve.grpc_utils import SERVER_OPTIONS
from pagedserve.scheduler_svc.engine import Engine
from pagedserve.scheduler_svc.request import Request
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
    """refuse: as FakeWorker's. crash_on: request ids whose arrival breaks the Steps stream (a crash; the
    worker answers Reset after, as one restarted in place). hung: once set, the next plan never gets an
    answer and Reset hangs too (a stuck compute thread keeps the connection)."""

    def __init__(self, step_seconds: float, refuse=None, crash_on: frozenset[str] = frozenset()) -> None:
        self.step_seconds = step_seconds
        self.refuse = refuse
        self.crash_on = crash_on
        self.worker = FakeWorker(NUM_BLOCKS, BLOCK_SIZE, refuse=refuse, strict=False)
        self.num_resets = 0
        self.num_crashes = 0
        self.plans: list[worker_pb2.StepPlan] = []
        self.hung = asyncio.Event()
        # Set when a Steps stream ends because the scheduler closed it (its last plan answered).
        self.stream_closed = asyncio.Event()

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
        if self.hung.is_set():
            await asyncio.Event().wait()
        self.worker = FakeWorker(NUM_BLOCKS, BLOCK_SIZE, refuse=self.refuse, strict=False)
        self.num_resets += 1
        return worker_pb2.ResetResponse(info=self.info())

    async def GetModelInfo(self, request, context) -> worker_pb2.GetModelInfoResponse:
        return worker_pb2.GetModelInfoResponse(info=self.info())

    async def Steps(self, request_iterator, context):
        async for request in request_iterator:
            plan = request.plan
            self.plans.append(plan)
            if self.hung.is_set():
                await asyncio.Event().wait()  # mid-step, for good
            if any(new.request_id in self.crash_on for new in plan.new_requests):
                self.num_crashes += 1
                await context.abort(grpc.StatusCode.INTERNAL, f"crashed in step {plan.step_id}")
            await asyncio.sleep(self.step_seconds)
            yield worker_pb2.StepsResponse(result=self.worker.execute(plan))
        self.stream_closed.set()


class Pool:
    """An engine and its fake workers."""

    def __init__(self, **config) -> None:
        defaults = dict(max_num_seqs=8, max_num_batched_tokens=64, worker_wait_timeout=10)
        self.engine = Engine(
            SchedulerServiceConfig(**(defaults | config)), "fake", frozenset({EOS}), MAX_MODEL_LEN, VOCAB_SIZE
        )
        self.servers: dict[str, tuple[grpc.aio.Server, FakeWorkerServicer, str]] = {}

    async def start_worker(self, worker_id: str, step_seconds: float = 0.005, **fakes) -> FakeWorkerServicer:
        # NOTE: the real worker's server options: the scheduler pings its workers every second.
        server = grpc.aio.server(options=SERVER_OPTIONS)
        servicer = FakeWorkerServicer(step_seconds, **fakes)
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
async def make_pool():
    """Pool(**scheduler flags), closed at the end of the test."""
    pools: list[Pool] = []

    def make(**config) -> Pool:
        pools.append(Pool(**config))
        return pools[-1]

    try:
        yield make
    finally:
        for p in pools:
            await p.close()


@pytest.fixture
async def pool(make_pool):
    return make_pool()


def _submit(pool: Pool, request_id: str, prompt: list[int] = PROMPT, **sampling) -> RequestStream:
    msg = engine_pb2.GenerateTokensRequest(
        request_id=request_id, prompt_token_ids=prompt, sampling=common_pb2.SamplingParams(**sampling)
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


# ---------------------------------------------------------------- no request can take a worker down


async def _outcome(
    stream: RequestStream, timeout: float = 60
) -> tuple[dict[int, list[int]], dict, Exception | None]:
    """Tokens by index, finish reasons by index, and the error the stream ended with (None: it finished)."""
    tokens: dict[int, list[int]] = {}
    reasons: dict[int, int] = {}
    while True:
        item = await asyncio.wait_for(stream.queue.get(), timeout=timeout)
        if item is END:
            return tokens, reasons, None
        if isinstance(item, Exception):
            return tokens, reasons, item
        tokens.setdefault(item.index, []).extend(item.token_ids)
        if item.finish_reason:
            assert item.index not in reasons, "a sequence finished twice"
            reasons[item.index] = item.finish_reason


def _prompt(i: int) -> list[int]:
    return [2 + (7 * i + k) % 50 for k in range(18 + i)]


async def _bystanders_finish_exactly(
    streams: dict[str, tuple[RequestStream, list[int]]], max_tokens: int
) -> None:
    for rid, (stream, prompt) in streams.items():
        tokens, reasons, error = await _outcome(stream)
        assert error is None, (rid, error)
        assert tokens[0] == expected_tokens(prompt, 0, max_tokens) and reasons == {0: LENGTH}, rid


async def test_an_exception_in_the_core_for_one_request_fails_it_alone_and_the_worker_goes_on(
    pool, monkeypatch
):
    # As the n = 2 request whose fork's seed overflowed once did: Scheduler.schedule raised, the loop took it
    # for a worker failure and requeued everything, the poison included, onto the next worker, forever.
    fork = Request.fork

    def poisoned_fork(self, index):
        if self.request_id == "poison":
            raise ValueError("Value out of range: 18446744073709551616")
        return fork(self, index)

    monkeypatch.setattr(Request, "fork", poisoned_fork)
    w0 = await pool.start_worker("w0")
    await pool.start_worker("w1")
    worker_loops = dict(pool.engine.workers)
    others = {
        f"r{i}": (_submit(pool, f"r{i}", _prompt(i), max_tokens=12, ignore_eos=True), _prompt(i))
        for i in range(4)
    }
    poison = _submit(pool, "poison", n=2, seed=2**64 - 1, temperature=1.0, max_tokens=12)
    _, _, error = await _outcome(poison)
    assert isinstance(error, PagedServeError) and error.grpc_code == grpc.StatusCode.INTERNAL
    assert "request 'poison' failed while forking its sequences: ValueError" in error.message
    await _bystanders_finish_exactly(others, 12)
    # No worker failed: the same loops, each reset once (at registration), nothing requeued.
    assert pool.engine.workers == worker_loops and all(w.healthy for w in worker_loops.values())
    assert w0.num_resets == 1 and all(s.num_failures == 0 for s, _ in others.values())
    assert pool.engine.stats().num_blocks_in_use == 0


async def test_a_request_its_worker_refuses_fails_alone_and_the_worker_goes_on(pool):
    # The sharer arrives with the refused request and shares its first block in the same step: the worker
    # never computes that block, so the sharer is recomputed, and its text is still exactly its own.
    refuse = lambda new: "top_p must be in (0, 1], got 0" if new.request_id == "refused" else None  # noqa: E731
    w0 = await pool.start_worker("w0", refuse=refuse)
    refused = _submit(pool, "refused", [*PROMPT, 3], max_tokens=10)
    others = {"sharer": (_submit(pool, "sharer", [*PROMPT, 4], max_tokens=10, ignore_eos=True), [*PROMPT, 4])}
    others |= {
        f"r{i}": (_submit(pool, f"r{i}", _prompt(i), max_tokens=10, ignore_eos=True), _prompt(i))
        for i in range(3)
    }
    _, _, error = await _outcome(refused)
    assert error.message.startswith("request 'refused' failed: its worker refused it: new request 'refused'")
    await _bystanders_finish_exactly(others, 10)
    first_plan = w0.plans[0]
    assert [n.request_id for n in first_plan.new_requests][:2] == ["refused", "sharer"]
    assert first_plan.num_scheduled_tokens[1] == len(PROMPT) + 1 - BLOCK_SIZE  # it did share the block
    assert pool.engine.workers["w0"].healthy and w0.num_resets == 1
    assert pool.engine.stats().num_blocks_in_use == 0


async def test_a_request_that_keeps_crashing_its_worker_fails_after_the_requeue_limit_and_bystanders_finish(
    make_pool,
):
    pool = make_pool(max_num_seqs=1, max_requeues=2)  # one sequence at a time: the others wait in the queue
    crash_on = frozenset({"poison"})
    workers = [await pool.start_worker(w, crash_on=crash_on) for w in ("w0", "w1")]
    bystanders = {
        f"r{i}": (_submit(pool, f"r{i}", _prompt(i), max_tokens=6, ignore_eos=True), _prompt(i))
        for i in range(2)
    }
    poison = _submit(pool, "poison", max_tokens=6)
    bystanders |= {
        f"r{i}": (_submit(pool, f"r{i}", _prompt(i), max_tokens=6, ignore_eos=True), _prompt(i))
        for i in range(2, 4)
    }
    _, _, error = await _outcome(poison)
    assert sum(w.num_crashes for w in workers) == 3  # its first run, then its 2 requeues
    assert error.message.startswith(
        "request 'poison' failed: the worker computing it failed 3 times, more than the 2 requeues allowed"
    )
    assert "the last failure: " in error.message and "crashed in step" in error.message
    await _bystanders_finish_exactly(bystanders, 6)
    # Queued while the poison ran, the bystanders were requeued with it and never blamed.
    assert all(stream.num_failures == 0 for stream, _ in bystanders.values())


# ---------------------------------------------------------------- supervision


async def _until(condition, timeout: float = 30.0, what: str = "timed out") -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, what
        await asyncio.sleep(0.01)


async def test_a_worker_that_stops_answering_mid_step_is_declared_failed_and_its_requests_finish_elsewhere(
    make_pool,
):
    # Its connection stays up (a stuck kernel or compute thread): only the step deadline can tell.
    pool = make_pool(step_timeout=0.5, step_timeout_per_token=0.01, worker_retire_timeout=60)
    w0 = await pool.start_worker("w0", step_seconds=0.01)
    streams = {
        f"r{i}": (
            _submit(pool, f"r{i}", _prompt(i), max_tokens=40, seed=i, temperature=1.0, ignore_eos=True),
            _prompt(i),
        )
        for i in range(3)
    }
    await _until(lambda: all(len(s.sequences[0].token_ids) >= 5 for s, _ in streams.values()))
    await pool.start_worker("w1")
    w0.hung.set()
    hung_at = time.monotonic()
    await _until(
        lambda: not pool.engine.workers["w0"].healthy, what="the hung worker was never declared failed"
    )
    detected = time.monotonic() - hung_at
    print(
        f"hung worker declared failed {detected:.2f} s after it stopped answering (step_timeout 0.5 s + 0.01 s/token)"
    )
    for rid, (stream, prompt) in streams.items():
        tokens, reasons, error = await _outcome(stream)
        assert error is None and reasons == {0: LENGTH}
        assert tokens[0] == expected_tokens(prompt, int(rid[1:]), 40)  # nothing lost, repeated or redrawn
        assert stream.num_failures == 1  # it was in the hung step
    assert pool.engine.stats().num_blocks_in_use == 0


async def test_a_failed_worker_that_never_comes_back_disappears_from_stats(make_pool):
    pool = make_pool(worker_retire_timeout=1.0)
    await pool.start_worker("w0")
    await pool.start_worker("w1")
    stream = _submit(pool, "a", max_tokens=20, ignore_eos=True)
    await pool.kill_worker("w0")
    await _until(lambda: "w0" not in pool.engine.workers, what="the dead worker was never retired")
    assert [w.worker_id for w in pool.engine.stats().workers] == ["w1"]
    tokens, _, error = await _outcome(stream)
    assert error is None and tokens[0] == expected_tokens(PROMPT, 0, 20)


async def test_a_worker_registering_under_a_new_id_at_the_same_address_replaces_the_old_one(pool):
    await pool.start_worker("w0")
    address = pool.servers["w0"][2]
    response = await pool.engine.register_worker(
        engine_pb2.RegisterWorkerRequest(
            worker_id="w0-restarted", address=address, model="fake", block_size=BLOCK_SIZE
        )
    )
    assert response.accepted
    assert [w.worker_id for w in pool.engine.stats().workers] == ["w0-restarted"]


@pytest.mark.parametrize("hung", [False, True], ids=["idle", "hung"])
async def test_engine_info_says_stalled_when_pending_work_stops_advancing(make_pool, hung):
    # A step deadline far away: only the progress deadline notices.
    pool = make_pool(progress_deadline=0.3, step_timeout=600)
    w0 = await pool.start_worker("w0")
    assert not pool.engine.info().stalled and pool.engine.info().seconds_without_progress == 0.0
    stream = _submit(pool, "a", max_tokens=200, ignore_eos=True)
    await _until(lambda: len(stream.sequences[0].token_ids) >= 3)
    if not hung:
        pool.engine.abort("a")
        await asyncio.sleep(0.5)
        assert not pool.engine.info().stalled and pool.engine.info().seconds_without_progress == 0.0
        return
    w0.hung.set()
    await _until(lambda: pool.engine.info().stalled, what="never stalled")
    assert pool.engine.info().seconds_without_progress > 0.3


# ---------------------------------------------------------------- draining


async def test_a_draining_worker_hands_every_request_over_with_no_token_lost_or_repeated(pool):
    w0 = await pool.start_worker("w0", step_seconds=0.01)
    streams = {
        f"r{i}": (
            _submit(
                pool, f"r{i}", _prompt(i), max_tokens=40, n=2, seed=10 * i, temperature=1.0, ignore_eos=True
            ),
            _prompt(i),
        )
        for i in range(3)
    }
    await _until(lambda: all(len(s.sequences[1].token_ids) >= 4 for s, _ in streams.values()))
    w1 = await pool.start_worker("w1")
    servicer = EngineServicer(pool.engine, sync_health=None)
    response = await servicer.DrainWorker(engine_pb2.DrainWorkerRequest(worker_id="w0"), None)
    # Answered once its steps in flight came back and its stream closed: the worker may go.
    assert response.drained and response.num_requests_moved == 3
    assert w0.stream_closed.is_set()
    assert [w.worker_id for w in pool.engine.stats().workers] == ["w1"]
    sent_before = len(w0.plans)
    for rid, (stream, prompt) in streams.items():
        tokens, reasons, error = await _outcome(stream)
        assert error is None and reasons == {0: LENGTH, 1: LENGTH}
        for index in (0, 1):
            assert tokens[index] == expected_tokens(prompt, 10 * int(rid[1:]) + index, 40), (rid, index)
        assert stream.num_failures == 0  # a drain is no failure
    assert len(w0.plans) == sent_before and w1.plans
    assert pool.engine.stats().num_blocks_in_use == 0


async def test_requests_of_a_draining_worker_wait_for_another_one_when_it_was_the_last(pool):
    await pool.start_worker("w0", step_seconds=0.01)
    stream = _submit(pool, "a", max_tokens=30, ignore_eos=True)
    await _until(lambda: len(stream.sequences[0].token_ids) >= 3)
    response = await pool.engine.drain_worker("w0")
    assert response.drained and not pool.engine.workers and pool.engine.pending
    await pool.start_worker("w1")
    tokens, _, error = await _outcome(stream)
    assert error is None and tokens[0] == expected_tokens(PROMPT, 0, 30)


# ---------------------------------------------------------------- what enters


async def test_what_enters_is_checked_where_it_enters_naming_the_parameter(pool):
    await pool.start_worker("w0")

    def refusal(**fields) -> InvalidRequestError:
        sampling = common_pb2.SamplingParams(**fields.pop("sampling", {}))
        msg = engine_pb2.GenerateTokensRequest(
            **({"request_id": "x", "prompt_token_ids": PROMPT} | fields), sampling=sampling
        )
        with pytest.raises(InvalidRequestError) as info:
            pool.engine.submit(msg)
        return info.value

    assert refusal(cache_salt="s" * (1 << 20)).param == "cache_salt"
    assert refusal(request_id="r" * 257).param == "request_id"
    assert refusal(request_id="").param == "request_id"
    assert refusal(prompt_token_ids=[]).param == "prompt"
    assert refusal(prompt_token_ids=[1, VOCAB_SIZE]).param == "prompt"
    assert refusal(sampling={"n": 9}).param == "n"  # more than max_num_seqs
    assert refusal(sampling={"logit_bias": {VOCAB_SIZE: 1.0}}).param == "logit_bias"
    assert refusal(sampling={"top_p": 0.0}).param == "top_p"
    assert refusal(sampling={"max_tokens": MAX_MODEL_LEN}).param == "max_tokens"
    # n sequences that could never fit the KV pool (64 blocks of 16 tokens), though one would.
    error = refusal(sampling={"n": 3, "max_tokens": 400})
    assert error.param == "n" and "need 81 KV blocks" in error.message and "has 64 blocks" in error.message
    assert not pool.engine.streams and pool.engine.queued() == (0, 0)


async def test_the_waiting_queue_is_bounded_in_sequences_and_in_tokens(make_pool):
    # No worker: everything waits (for up to worker_wait_timeout).
    pool = make_pool(max_queued_requests=4, max_queued_tokens=200)
    prompt_and_max = len(PROMPT) + 20
    _submit(pool, "a", n=3, max_tokens=20)  # 3 sequences, 3 x 41 tokens
    with pytest.raises(OverloadedError, match="3 sequences waiting, at most 4"):
        _submit(pool, "b", n=2, max_tokens=20)
    with pytest.raises(OverloadedError, match=f"{3 * prompt_and_max} tokens .* waiting, at most 200"):
        _submit(pool, "c", max_tokens=20 + 200)
    _submit(pool, "d", max_tokens=20)  # the 4th sequence, 164 tokens in all
    assert pool.engine.queued() == (4, 4 * prompt_and_max)
    with pytest.raises(OverloadedError):
        _submit(pool, "e", max_tokens=1)
    # A request alone in the queue always gets in, however large.
    alone = make_pool(max_queued_requests=1, max_queued_tokens=10)
    _submit(alone, "big", n=4, max_tokens=100)
