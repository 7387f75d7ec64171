"""The engine: the registered workers, the live request streams, routing, and worker failure.

Each registered worker gets a `WorkerEngine` (worker_loop.py) that runs its step loop; each client
request is a `RequestStream` (request_stream.py). When a worker's stream breaks (or a step outlives its
deadline), its requests go back to the router with what their clients have already been sent and are
recomputed on a surviving worker; with no healthy worker left they wait (bounded) for one to register.
A request that was in a step in flight at more than `max_requeues` failures fails instead: it is the
likeliest cause. A worker that does not come back within `worker_retire_timeout` is forgotten; one
that drains (it is leaving) hands its requests over the same way, without blame.

Whatever reaches the engine is checked where it enters (submit, with pagedserve.validation), and one
request's failure inside a worker's core or on the worker fails that request alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable

import grpc

from pagedserve import finish_reasons
from pagedserve.errors import InvalidRequestError, OverloadedError, PagedServeError, UnavailableError
from pagedserve.grpc_utils import WORKER_CHANNEL_OPTIONS, open_channel
from pagedserve.logging import get_logger
from pagedserve.scheduler_svc.config import SchedulerConfig
from pagedserve.scheduler_svc.metrics import EngineMetrics, add_per_position
from pagedserve.scheduler_svc.request import Request
from pagedserve.scheduler_svc.request_stream import END, RequestStream
from pagedserve.scheduler_svc.router import choose_worker
from pagedserve.scheduler_svc.scheduler import RequestFailure, RequestOutput, SchedulerStats
from pagedserve.scheduler_svc.service_config import SchedulerServiceConfig
from pagedserve.scheduler_svc.structured_output import Grammar, GrammarCompiler
from pagedserve.scheduler_svc.worker_loop import PromptLogprobs, WorkerEngine, WorkerLoopSettings
from pagedserve.v1 import common_pb2, engine_pb2, worker_pb2, worker_pb2_grpc
from pagedserve.validation import check_max_tokens, check_prompt, check_sampling, check_text

log = get_logger("pagedserve.scheduler.engine")


class Engine:
    """The workers, the live request streams, routing, and the numbers behind GetStats. It is each
    WorkerEngine's listener (worker_loop.WorkerListener)."""

    def __init__(
        self,
        config: SchedulerServiceConfig,
        model: str,
        eos_token_ids: frozenset[int],
        max_model_len: int,
        vocab_size: int,
        on_health_change: Callable[[bool], None] | None = None,
        grammars: GrammarCompiler | None = None,
    ):
        self.config = config
        # Compiles structured-output constraints for the model's tokenizer; None: the model has no
        # tokenizer.json, and constrained requests are refused.
        self.grammars = grammars
        self.model = model
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.on_health_change = on_health_change
        self.workers: dict[str, WorkerEngine] = {}
        self.streams: dict[str, RequestStream] = {}
        # Requests waiting for a healthy worker, in arrival order.
        self.pending: deque[RequestStream] = deque()
        self.metrics = EngineMetrics()
        # Core counters of schedulers discarded after a worker failure (kept so totals never drop).
        self.retired = dict.fromkeys(_COUNTERS, 0)
        # Accepted draft tokens by draft position, of the retired workers' cores.
        self.retired_accepted_per_pos: list[int] = []
        self._reconnects: dict[str, asyncio.Task] = {}
        # Set by drain() (SIGTERM): new requests are refused, live ones run to their end.
        self.draining = False
        # Monotonic seconds when a step last completed, or when work became pending after none was.
        self._progress_at = time.monotonic()

    # --- workers ---
    def effective_max_model_len(self) -> int:
        """The context length every healthy worker can serve (the configured one with none up)."""
        return min((w.max_model_len for w in self.healthy_workers()), default=self.max_model_len)

    def healthy_workers(self) -> list[WorkerEngine]:
        """The workers that take work: their stream is up and they are not leaving."""
        return [w for w in self.workers.values() if w.healthy and not w.draining]

    async def register_worker(
        self, reg: engine_pb2.RegisterWorkerRequest
    ) -> engine_pb2.RegisterWorkerResponse:
        def refuse(message: str) -> engine_pb2.RegisterWorkerResponse:
            log.warning("worker_refused", worker_id=reg.worker_id, address=reg.address, reason=message)
            return engine_pb2.RegisterWorkerResponse(accepted=False, message=message)

        if not reg.worker_id or not reg.address:
            return refuse("worker_id and address are required")
        if reg.block_size != self.config.block_size:
            return refuse(
                f"block size {reg.block_size} differs from the scheduler's {self.config.block_size}"
            )
        if reg.model and reg.model != self.model:
            return refuse(f"model {reg.model!r} differs from the scheduler's {self.model!r}")
        existing = self.workers.get(reg.worker_id)
        if (
            existing is not None
            and existing.healthy
            and not existing.draining
            and existing.address == reg.address
        ):
            # NOTE: the same live process announcing itself again (it lost sight of us for a while);
            # its state matches ours, so there is nothing to reset.
            log.info("worker_reregistered", worker_id=reg.worker_id, address=reg.address)
            return engine_pb2.RegisterWorkerResponse(accepted=True)
        channel = open_channel(reg.address, self.config.tls, WORKER_CHANNEL_OPTIONS, self.config.cluster_auth)
        try:
            stub = worker_pb2_grpc.WorkerServiceStub(channel)
            info = (await stub.Reset(worker_pb2.ResetRequest(), timeout=30.0)).info
        except grpc.RpcError as error:
            await channel.close()
            return refuse(f"cannot reach the worker at {reg.address}: {error.code().name}")
        if info.block_size != self.config.block_size:
            await channel.close()
            return refuse(
                f"block size {info.block_size} differs from the scheduler's {self.config.block_size}"
            )
        spec = self.config.speculative
        if spec is not None and spec.num_draft_layers and spec.num_draft_layers >= info.num_layers:
            await channel.close()
            return refuse(
                f"speculative_config.num_draft_layers {spec.num_draft_layers} is not below the model's "
                f"{info.num_layers} layers"
            )
        # A worker with this id or at this address already known is gone: its requests move on.
        for old in [
            w for w in self.workers.values() if w.worker_id == reg.worker_id or w.address == reg.address
        ]:
            await self._retire(old)
        worker = WorkerEngine(self, reg, info, channel, self._loop_settings(reg.worker_id, info))
        self.workers[reg.worker_id] = worker
        worker.start()
        log.info(
            "worker_registered",
            worker_id=reg.worker_id,
            address=reg.address,
            num_blocks=info.num_blocks,
            device=info.device,
            dtype=info.dtype,
        )
        self._health_changed()
        self._place_pending()
        return engine_pb2.RegisterWorkerResponse(accepted=True)

    def _loop_settings(self, worker_id: str, info: worker_pb2.ModelInfo) -> WorkerLoopSettings:
        """A worker's loop and scheduler core, from this engine's config and what the worker reported."""
        cfg = self.config
        core = SchedulerConfig(
            num_blocks=info.num_blocks,
            block_size=info.block_size,
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=max(cfg.max_num_batched_tokens, cfg.max_num_seqs),
            # NOTE: a sequence must fit the pool alone, or it could never finish (the core refuses
            # it); a small pool therefore shortens this worker's context rather than failing requests.
            max_model_len=min(
                self.max_model_len,
                info.max_model_len or self.max_model_len,
                info.num_blocks * info.block_size,
            ),
            enable_prefix_caching=cfg.enable_prefix_caching,
            policy=cfg.scheduling_policy,
            max_cache_salts=cfg.max_cache_salts,
            speculative=cfg.speculative,
        )
        if core.max_model_len < self.max_model_len:
            log.warning(
                "worker_context_shortened",
                worker_id=worker_id,
                max_model_len=core.max_model_len,
                reason="its KV pool or its own limit holds fewer tokens than the model's context",
            )
        return WorkerLoopSettings(
            core=core,
            max_inflight_plans=cfg.max_inflight_plans,
            step_timeout=cfg.step_timeout,
            step_timeout_per_token=cfg.step_timeout_per_token,
            eos_token_ids=self.eos_token_ids,
        )

    async def _retire(self, worker: WorkerEngine) -> None:
        """Forget the worker: close it, drop it from the workers (and so from Stats), requeue its requests."""
        task = self._reconnects.pop(worker.worker_id, None)
        if task is not None and task is not asyncio.current_task():
            task.cancel()
        if self.workers.get(worker.worker_id) is worker:
            del self.workers[worker.worker_id]
        streams = worker.streams()
        self._retire_counters(worker)
        worker.reset_core()
        await worker.close()
        worker.drained.set()
        self._health_changed()
        self._requeue(streams)

    def on_worker_failed(self, worker: WorkerEngine, reason: str) -> None:
        """The worker's stream broke or a step outlived its deadline: requeue its requests elsewhere
        (blaming those that were in a step in flight) and try to get it back."""
        worker.healthy = False
        blamed = set() if worker.draining else worker.in_flight_request_ids()
        streams = worker.streams()
        self._retire_counters(worker)
        worker.reset_core()
        self._health_changed()
        self._requeue(streams, blamed, reason)
        if worker.draining:
            # NOTE: it was leaving anyway (its grace period may have run out): nothing to get back.
            self._reconnects[worker.worker_id] = asyncio.create_task(self._retire(worker))
        elif not worker.closed:
            self._reconnects[worker.worker_id] = asyncio.create_task(self._reconnect(worker))

    async def _reconnect(self, worker: WorkerEngine) -> None:
        """Reset the worker until it answers (a transient outage), then give it work again; retire it if
        it has not answered within worker_retire_timeout. A restarted worker process re-registers
        instead, which replaces this one."""
        loop = asyncio.get_running_loop()
        retire_at = loop.time() + self.config.worker_retire_timeout
        backoff = 0.5
        while not worker.closed:
            left = retire_at - loop.time()
            if left <= 0:
                log.warning(
                    "worker_retired",
                    worker_id=worker.worker_id,
                    address=worker.address,
                    reason=f"it has not come back within {self.config.worker_retire_timeout:g} s",
                )
                self._reconnects.pop(worker.worker_id, None)
                await self._retire(worker)
                return
            await asyncio.sleep(min(backoff, left))
            try:
                info = await worker.reset(timeout=max(min(5.0, left), 0.1))
            except grpc.RpcError:
                backoff = min(backoff * 2, 10.0)
                continue
            if worker.closed or self.workers.get(worker.worker_id) is not worker:
                return
            worker.resume(info)
            log.info("worker_reconnected", worker_id=worker.worker_id, address=worker.address)
            self._reconnects.pop(worker.worker_id, None)
            self._health_changed()
            self._place_pending()
            return

    def _requeue(
        self, streams: list[RequestStream], blamed: set[str] = frozenset(), reason: str = ""
    ) -> None:
        """Place the streams again (on a surviving worker, by recomputation). A stream that was in a step in
        flight at this failure (its id in blamed) counts it, and fails past max_requeues."""
        limit = self.config.max_requeues
        for stream in streams:
            stream.worker = None
            if stream.done:
                continue
            if stream.request_id in blamed:
                stream.num_failures += 1
                stream.last_failure = reason
                if stream.num_failures > limit:
                    log.warning(
                        "request_failed_on_workers",
                        request_id=stream.request_id,
                        failures=stream.num_failures,
                        last_failure=reason,
                    )
                    self._fail(
                        stream,
                        PagedServeError(
                            f"request {stream.request_id!r} failed: the worker computing it failed "
                            f"{stream.num_failures} times, more than the {limit} requeues allowed "
                            f"(--max-requeues); the last failure: {reason}"
                        ),
                    )
                    continue
            log.info(
                "request_requeued",
                request_id=stream.request_id,
                tokens_streamed=[len(s.token_ids) for s in stream.sequences],
                failures=stream.num_failures,
            )
            self.place(stream)

    def _retire_counters(self, worker: WorkerEngine) -> None:
        for key, value in _core_counters(worker).items():
            self.retired[key] += value
        add_per_position(self.retired_accepted_per_pos, worker.core_stats().spec_num_accepted_tokens_per_pos)

    def _health_changed(self) -> None:
        if self.on_health_change is not None:
            self.on_health_change(bool(self.healthy_workers()))

    async def drain_worker(self, worker_id: str, address: str = "") -> engine_pb2.DrainWorkerResponse:
        """The worker is leaving: route nothing more to it, let its steps in flight finish, move its requests
        to the other workers by recomputation (no blame), close its stream; returns when that is done."""
        worker = self.workers.get(worker_id)
        if worker is None or (address and worker.address != address):
            return engine_pb2.DrainWorkerResponse(drained=False)
        if not worker.draining:
            worker.draining = True
            log.info(
                "worker_draining", worker_id=worker_id, address=worker.address, requests=worker.num_streams
            )
            self._health_changed()
            if worker.healthy and worker.is_running:
                worker.wake()  # the loop ends once its steps in flight are back
            else:
                await self._retire(worker)  # failed and not back: its requests have moved already
        await worker.drained.wait()
        return engine_pb2.DrainWorkerResponse(drained=True, num_requests_moved=worker.num_moved)

    async def on_worker_drained(self, worker: WorkerEngine) -> None:
        """The draining worker's loop ended with nothing in flight: hand its requests over, forget it."""
        worker.num_moved = sum(1 for stream in worker.streams() if not stream.done)
        log.info("worker_drained", worker_id=worker.worker_id, requests_moved=worker.num_moved)
        await self._retire(worker)

    async def drain(self, timeout: float) -> bool:
        """Refuse new requests and wait up to timeout seconds for the live ones to finish; True if
        they all did."""
        self.draining = True
        deadline = time.monotonic() + timeout
        while self.streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return not self.streams

    async def close(self) -> None:
        if self.grammars is not None:
            self.grammars.close()
        for task in self._reconnects.values():
            task.cancel()
        for worker in list(self.workers.values()):
            await worker.close()
        for stream in list(self.streams.values()):
            self._fail(stream, UnavailableError("the scheduler is shutting down"))

    # --- requests ---
    async def compile(self, msg: engine_pb2.GenerateTokensRequest) -> Grammar | None:
        """The request's structured-output constraint compiled (off the loop, bounded in time), or None when it
        has none; InvalidRequestError when it does not compile."""
        if not msg.sampling.HasField("structured_output"):
            return None
        check_sampling(msg.sampling, limits=self.config.limits, vocab_size=self.vocab_size or None)
        if self.grammars is None:
            raise InvalidRequestError(
                "structured outputs are not available: the model has no tokenizer.json", "structured_output"
            )
        return await self.grammars.compile(msg.sampling.structured_output)

    def submit(
        self, msg: engine_pb2.GenerateTokensRequest, span=None, grammar: Grammar | None = None
    ) -> RequestStream:
        """Route a request (its constraint compiled by compile() first)."""
        if self.draining:
            raise UnavailableError("the scheduler is shutting down; retry on another replica or later")
        self._validate(msg)
        if msg.request_id in self.streams:
            raise InvalidRequestError(f"request id {msg.request_id!r} is already live", param="request_id")
        if msg.sampling.HasField("structured_output") and grammar is None:
            raise InvalidRequestError(
                "the structured output constraint was not compiled", "structured_output"
            )
        stream = RequestStream(msg, span, grammar)
        self._check_queue(stream)
        if not self.streams:
            self._progress_at = time.monotonic()  # work is pending from now on
        self.place(stream)
        self.streams[msg.request_id] = stream
        return stream

    def _validate(self, msg: engine_pb2.GenerateTokensRequest) -> None:
        """What every way in checks (pagedserve.validation), against this engine's vocabulary and the
        context length its workers serve."""
        limits = self.config.limits
        check_text(msg.request_id, max_chars=limits.max_request_id_chars, param="request_id")
        if not msg.request_id:
            raise InvalidRequestError("request_id is required", param="request_id")
        check_text(msg.cache_salt, max_chars=limits.max_cache_salt_chars, param="cache_salt")
        vocab_size = self.vocab_size or None
        max_model_len = self.effective_max_model_len()
        check_prompt(msg.prompt_token_ids, vocab_size=vocab_size, max_model_len=max_model_len)
        check_sampling(msg.sampling, limits=limits, vocab_size=vocab_size)
        check_max_tokens(len(msg.prompt_token_ids), msg.sampling, max_model_len=max_model_len)

    def _check_queue(self, stream: RequestStream) -> None:
        """Refuse (RESOURCE_EXHAUSTED) a request that would take the waiting queue past its bounds, in
        sequences or in tokens. NOTE: a request alone in the queue always gets in, so that one larger
        than a bound is not refused for good (the KV pool's own check is the place for that)."""
        seqs, tokens = stream.weight(self.effective_max_model_len())
        queued_seqs, queued_tokens = self.queued()
        cfg = self.config
        if queued_seqs and queued_seqs + seqs > cfg.max_queued_requests:
            raise OverloadedError(
                f"the waiting queue is full ({queued_seqs} sequences waiting, at most "
                f"{cfg.max_queued_requests}); retry later"
            )
        if queued_tokens and queued_tokens + tokens > cfg.max_queued_tokens:
            raise OverloadedError(
                f"the waiting queue is full ({queued_tokens} tokens of prompts and max_tokens waiting, at most "
                f"{cfg.max_queued_tokens}); retry later"
            )

    def place(self, stream: RequestStream) -> None:
        """Hand the stream to the best healthy worker whose KV pool can hold it, or park it until one
        registers. A stream no healthy worker's pool can ever hold is refused (a new one) or failed."""
        healthy = self.healthy_workers()
        fitting = [w for w in healthy if w.refusal(stream) is None]
        if healthy and not fitting:
            largest = max(healthy, key=lambda w: w.num_blocks)
            sp = stream.msg.sampling
            param = "max_tokens" if sp.HasField("max_tokens") else "prompt"
            if stream.n > 1 and stream.is_fresh():
                param = "n"
            error = InvalidRequestError(
                f"request {stream.request_id!r}: {largest.refusal(stream)}", param=param
            )
            if stream.request_id not in self.streams:
                raise error  # a new request: the client hears why
            self._fail(stream, error)
            return
        worker = choose_worker(fitting, stream.msg.prompt_token_ids, stream.msg.cache_salt)
        if worker is None:
            self.pending.append(stream)
            if stream.wait_timer is None:
                stream.wait_timer = asyncio.get_running_loop().call_later(
                    self.config.worker_wait_timeout, self._wait_expired, stream
                )
            return
        if stream.wait_timer is not None:
            stream.wait_timer.cancel()
            stream.wait_timer = None
        try:
            worker.add(stream)
        except InvalidRequestError as error:
            if stream.request_id not in self.streams:
                raise  # a new request: the client hears why
            self._fail(stream, error)
            return
        if stream.span is not None:
            stream.span.add_event("routed", {"worker.id": worker.worker_id})

    def _place_pending(self) -> None:
        pending, self.pending = self.pending, deque()
        for stream in pending:
            if not stream.done:
                self.place(stream)

    def _wait_expired(self, stream: RequestStream) -> None:
        stream.wait_timer = None
        if stream.done or stream.worker is not None:
            return
        with contextlib.suppress(ValueError):
            self.pending.remove(stream)
        self._fail(stream, UnavailableError("no worker is available to serve the request; retry later"))

    def abort(self, request_id: str, index: int | None = None) -> bool:
        """Stop sequence `index` of a live request (the others go on), or all of them when None; the
        aborted sequences' blocks go back to the pool at once. False if nothing was live."""
        stream = self.streams.get(request_id)
        if stream is None or stream.done:
            return False
        unfinished = [
            i
            for i, s in enumerate(stream.sequences)
            if s.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED
        ]
        if index is not None and index not in unfinished:
            return False
        whole = index is None or unfinished == [index]
        if stream.worker is not None:
            stream.worker.abort(stream, None if whole else index)
        elif whole:
            with contextlib.suppress(ValueError):
                self.pending.remove(stream)
        # NOTE: a partly aborted stream waiting for a worker needs nothing more: core_requests()
        # leaves its finished sequences out when it is placed.
        messages = []
        for i in unfinished if whole else [index]:
            stream.sequences[i].finish_reason = common_pb2.FINISH_REASON_ABORT
            messages.append(
                engine_pb2.GenerateTokensResponse(
                    request_id=request_id, index=i, finish_reason=common_pb2.FINISH_REASON_ABORT
                )
            )
        if whole:
            messages[-1].usage.CopyFrom(stream.usage())
        for message in messages:
            stream.queue.put_nowait(message)
        if whole:
            self._finish(stream, "abort", time.monotonic())
        return True

    def _fail(self, stream: RequestStream, error: PagedServeError) -> None:
        if stream.worker is not None:
            stream.worker.abort(stream)
        stream.queue.put_nowait(error)
        self._finish(stream, "abort", time.monotonic(), end=False)

    def _finish(self, stream: RequestStream, reason: str, now: float, end: bool = True) -> None:
        stream.done = True
        if stream.wait_timer is not None:
            stream.wait_timer.cancel()
            stream.wait_timer = None
        self.streams.pop(stream.request_id, None)
        if stream.worker is not None:
            stream.worker.forget(stream)
        self.metrics.record_finished(reason, stream.arrival, now)
        if end:
            stream.queue.put_nowait(END)
        if stream.span is not None:
            stream.span.set_attribute("finish_reason", reason)

    # --- what the workers' loops report (worker_loop.WorkerListener) ---
    def on_requests_failed(self, worker: WorkerEngine, failures: list[RequestFailure]) -> None:
        """Requests a worker's core failed alone (an exception in their part of a step, or the worker
        refused them): their clients hear why; the worker goes on. Those it gave back (retry: they may
        have read what a failed one never computed) are recomputed, as after a worker failure."""
        recompute = []
        for failure in failures:
            stream = worker.stream_of(failure.request_id)
            if failure.retry:
                log.info("request_recomputed", request_id=failure.request_id, reason=failure.message)
                if stream is not None and not stream.done:
                    worker.forget(stream)  # the core has let go of it already
                    recompute.append(stream)
                continue
            log.warning("request_failed", request_id=failure.request_id, error=failure.message)
            if stream is not None and not stream.done:
                self._fail(stream, PagedServeError(failure.message))
        self._requeue(recompute)

    def on_scheduled(self, worker: WorkerEngine, requests: list[Request]) -> None:
        """A plan went out: requests computed for the first time stop counting as queued."""
        now = time.monotonic()
        for request in requests:
            stream = worker.stream_of(request.request_id)
            if stream is not None and stream.first_scheduled is None:
                stream.first_scheduled = now
                self.metrics.queue_time.observe(now - stream.arrival)

    def on_results(
        self, worker: WorkerEngine, outputs: list[RequestOutput], prompt_logprobs: list[PromptLogprobs]
    ) -> None:
        """A step came back (progress): turn its per-sequence outputs into client messages."""
        now = self._progress_at = time.monotonic()
        if prompt_logprobs:
            self._collect_prompt_logprobs(worker, prompt_logprobs)
        for out in outputs:
            stream = worker.stream_of(out.request_id)
            if stream is None or stream.done:
                continue  # aborted while its plan was in flight
            # NOTE: one request's bookkeeping failing fails that request alone (a try costs nothing until it
            # catches).
            try:
                index = out.index
                seq = stream.sequences[index]
                if seq.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                    continue
                if stream.cached_prompt_tokens < 0:
                    stream.cached_prompt_tokens = out.num_cached_tokens
                token_ids = list(out.new_token_ids)
                message = engine_pb2.GenerateTokensResponse(
                    request_id=stream.request_id, index=index, token_ids=token_ids
                )
                if token_ids:
                    if all(s.first_token_time is None for s in stream.sequences):
                        self.metrics.prompt_tokens += len(stream.msg.prompt_token_ids)
                    self.metrics.record_tokens(
                        len(token_ids), now, seq.first_token_time, seq.last_token_time, stream.arrival
                    )
                    if seq.first_token_time is None:
                        seq.first_token_time = now
                    seq.last_token_time = now
                    seq.token_ids.extend(token_ids)
                if out.logprobs:
                    message.logprobs.extend(out.logprobs)
                if not stream.prompt_logprobs_sent and stream.msg.sampling.HasField("prompt_logprobs"):
                    message.prompt_logprobs.extend(stream.prompt_logprobs)
                    stream.prompt_logprobs_sent = True
                if out.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                    seq.finish_reason = out.finish_reason
                    message.finish_reason = out.finish_reason
                    if out.stop_token_id is not None:
                        message.stop_token_id = out.stop_token_id
                    if stream.num_unfinished == 0:
                        message.usage.CopyFrom(stream.usage())
                stream.queue.put_nowait(message)
                if stream.num_unfinished == 0:
                    reasons = [s.finish_reason for s in stream.sequences]
                    self._finish(stream, finish_reasons.request_reason(reasons), now)
            except Exception as error:
                log.exception("request_delivery_failed", request_id=out.request_id)
                self._fail(stream, PagedServeError(f"request {out.request_id!r} failed: {error!r}"))

    def _collect_prompt_logprobs(self, worker: WorkerEngine, entries: list[PromptLogprobs]) -> None:
        for entry in entries:
            stream = worker.stream_of(entry.request_id)
            if stream is None or stream.prompt_logprobs_sent:
                continue
            # NOTE: keep each prompt position once, in order (position 0 has none): the n sequences
            # all score the last prompt token, and a prompt recomputed after a preemption or on
            # another worker is scored again.
            start = entry.start_position
            have = 1 + len(stream.prompt_logprobs)  # the next position wanted
            if start <= have:
                stream.prompt_logprobs.extend(
                    entry.logprobs[have - start : len(stream.msg.prompt_token_ids) - start]
                )

    # --- stats ---
    def queued(self) -> tuple[int, int]:
        """(sequences, tokens) waiting over every worker and for a worker: what the queue bounds weigh."""
        seqs = tokens = 0
        for worker in self.workers.values():
            worker_seqs, worker_tokens = worker.queued()
            seqs += worker_seqs
            tokens += worker_tokens
        max_model_len = self.effective_max_model_len()
        for stream in self.pending:
            stream_seqs, stream_tokens = stream.weight(max_model_len)
            seqs += stream_seqs
            tokens += stream_tokens
        return seqs, tokens

    def seconds_without_progress(self) -> float:
        """Seconds since a step last completed while requests are live; 0 when none is."""
        return time.monotonic() - self._progress_at if self.streams else 0.0

    def stats(self) -> engine_pb2.EngineStats:
        stats = engine_pb2.EngineStats()
        counters = dict(self.retired)
        accepted_per_pos = list(self.retired_accepted_per_pos)
        total_blocks = used_blocks = 0
        for worker in self.workers.values():
            core = worker.core_stats()
            for key, value in _counters_of(core).items():
                counters[key] += value
            add_per_position(accepted_per_pos, core.spec_num_accepted_tokens_per_pos)
            stats.workers.append(
                engine_pb2.WorkerStats(
                    worker_id=worker.worker_id,
                    address=worker.address,
                    healthy=worker.healthy,
                    num_blocks=core.num_blocks,
                    num_blocks_in_use=core.num_blocks_in_use,
                    num_cached_free_blocks=core.num_cached_free_blocks,
                    num_running=core.num_running,
                    num_waiting=core.num_waiting,
                    num_steps=worker.timings.num_steps,
                    mean_step_seconds=worker.timings.mean_step_seconds,
                    mean_idle_seconds=worker.timings.mean_idle_seconds,
                    mean_forward_seconds=worker.timings.mean_forward_seconds,
                    mean_gap_seconds=worker.timings.mean_gap_seconds,
                    mean_prepare_seconds=worker.timings.mean_prepare_seconds,
                    mean_no_work_seconds=worker.timings.mean_no_work_seconds,
                )
            )
            if worker.healthy:
                total_blocks += core.num_blocks
                used_blocks += core.num_blocks_in_use
                stats.num_requests_running += core.num_running
                stats.num_requests_waiting += core.num_waiting
        stats.num_requests_waiting += len(self.pending)
        stats.num_blocks_in_use = used_blocks
        stats.kv_cache_usage = used_blocks / total_blocks if total_blocks else 0.0
        for key, value in counters.items():
            setattr(stats, key, value)
        stats.spec_decode_num_accepted_tokens_per_pos.extend(accepted_per_pos)
        self.metrics.fill(stats)
        return stats

    def info(self) -> engine_pb2.EngineInfo:
        idle_for = self.seconds_without_progress()
        return engine_pb2.EngineInfo(
            model=self.model,
            max_model_len=self.effective_max_model_len(),
            eos_token_ids=sorted(self.eos_token_ids),
            vocab_size=self.vocab_size,
            block_size=self.config.block_size,
            num_healthy_workers=len(self.healthy_workers()),
            max_queued_requests=self.config.max_queued_requests,
            stalled=idle_for > self.config.progress_deadline,
            seconds_without_progress=idle_for,
        )


# EngineStats' counters summed over the workers' cores (those of retired workers kept).
_COUNTERS = (
    "prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "spec_decode_num_drafts",
    "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens",
)  # fmt: skip


def _core_counters(worker: WorkerEngine) -> dict[str, int]:
    return _counters_of(worker.core_stats())


def _counters_of(stats: SchedulerStats) -> dict[str, int]:
    return {
        "prefix_cache_queries": stats.prefix_cache_queries,
        "prefix_cache_hits": stats.prefix_cache_hits,
        "num_preemptions": stats.num_preemptions,
        "spec_decode_num_drafts": stats.spec_num_drafts,
        "spec_decode_num_draft_tokens": stats.spec_num_draft_tokens,
        "spec_decode_num_accepted_tokens": stats.spec_num_accepted_tokens,
    }
