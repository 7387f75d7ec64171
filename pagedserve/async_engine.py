"""The asyncio API, in the shape vLLM users know: `AsyncLLMEngine.from_engine_args(AsyncEngineArgs(...))`,
then `async for output in engine.generate(prompt, sampling_params, request_id)`.

    from pagedserve import AsyncEngineArgs, AsyncLLMEngine, SamplingParams

    engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(max_num_seqs=128))
    async for output in engine.generate("The capital of France is", SamplingParams(max_tokens=8), "r1"):
        print(output.outputs[0].text)

One engine thread owns the engine core that `LLM` runs too (pagedserve/engine_core.py): it applies the
requests and aborts the event loop sends it, steps the core while it has work (so concurrent requests
share each step's batch), and hands every updated request's output to its iterator's asyncio queue
with one `loop.call_soon_threadsafe` per event loop per step. The forward pass never runs on the event
loop, and neither does tokenization. A consumer that stops iterating (breaks out, or its task is
cancelled) aborts its request, which frees its blocks. An error in the step loop ends every live
iterator with `EngineDeadError` and leaves the engine errored.
"""

from __future__ import annotations

import asyncio
import copy
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from pagedserve.engine_core import EngineConfig, EngineCore, Prompt, TrackedRequest
from pagedserve.outputs import CompletionOutput, RequestOutput
from pagedserve.sampling_params import RequestOutputKind, SamplingParams
from pagedserve.worker_svc.config import DEFAULT_DETERMINISTIC, DEFAULT_GPU_MEMORY_UTILIZATION, parse_bytes

__all__ = ["AsyncEngineArgs", "AsyncLLM", "AsyncLLMEngine", "EngineDeadError", "ModelConfig"]


class EngineDeadError(RuntimeError):
    """The engine stopped (an error in its step loop, or shutdown()): no request can run any more."""


@dataclass(slots=True)
class AsyncEngineArgs:
    # Model folder, .gguf file, or None / "default" for the default model.
    model: str | None = None
    # Must be None or the model: the tokenizer always comes from the model's folder.
    tokenizer: str | None = None
    # "auto", "float32", "bfloat16" or "float16" (weights and KV cache).
    dtype: str = "auto"
    # Quantized checkpoints: "auto" keeps the weights quantized, "none" dequantizes them.
    quantization: str = "auto"
    # torch device ("cpu", "cuda", "cuda:1"); "auto": cuda when available, else cpu.
    device: str = "auto"
    # Longest sequence in tokens, prompt plus output; None: the model's own.
    max_model_len: int | None = None
    # Most sequences computed in one step.
    max_num_seqs: int = 256
    # Most tokens computed in one step; None: the server's default.
    max_num_batched_tokens: int | None = None
    # Tokens per KV block.
    block_size: int = 16
    # Share the KV blocks of common prompt prefixes between requests.
    enable_prefix_caching: bool = True
    # KV pool budget: bytes or a size such as "2GiB"; None: the device's default budget.
    kv_cache_memory: int | str | None = None
    # Exact number of KV blocks (vLLM's name); wins over kv_cache_memory.
    num_gpu_blocks_override: int | None = None
    # Seed of the sampler's generator.
    seed: int = 0
    # torch intra-op threads for the CPU model; None: torch's default.
    threads: int | None = None
    # Processes (ranks) the model is sharded over: one GPU each on CUDA (NCCL), CPU processes (gloo) on the CPU.
    tensor_parallel_size: int = 1
    # Accepted for vLLM compatibility: requests are not logged one by one here either way.
    disable_log_requests: bool = False
    # On CUDA: run every step eagerly, without CUDA graphs.
    enforce_eager: bool = False
    # On CUDA: the share of the device the engine may hold; its KV pool takes what the weights and a step's
    # activations leave of it, unless kv_cache_memory or num_gpu_blocks_override sizes the pool.
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    # Speculative decoding, vLLM's dict ({"method": "ngram", "num_speculative_tokens": k, ...}); None: off.
    speculative_config: dict | str | None = None
    # Batch-invariant kernels (see EngineConfig.deterministic).
    deterministic: bool | None = DEFAULT_DETERMINISTIC

    def engine_config(self) -> EngineConfig:
        kv_cache_memory = self.kv_cache_memory
        return EngineConfig(
            model=self.model,
            dtype=self.dtype,
            quantization=self.quantization,
            block_size=self.block_size,
            max_num_seqs=self.max_num_seqs,
            max_model_len=self.max_model_len,
            max_num_batched_tokens=self.max_num_batched_tokens,
            enable_prefix_caching=self.enable_prefix_caching,
            kv_cache_memory=None if kv_cache_memory is None else parse_bytes(kv_cache_memory),
            num_blocks=self.num_gpu_blocks_override,
            seed=self.seed,
            device=self.device,
            threads=self.threads,
            gpu_memory_utilization=self.gpu_memory_utilization,
            enforce_eager=self.enforce_eager,
            tensor_parallel_size=self.tensor_parallel_size,
            speculative_config=self.speculative_config,
            deterministic=self.deterministic,
        )

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be at least 1, not {self.tensor_parallel_size}")
        if self.tokenizer is not None and self.tokenizer != self.model:
            raise ValueError("a separate tokenizer is not supported: the model's own is used")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], not {self.gpu_memory_utilization}")


@dataclass(slots=True, frozen=True)
class ModelConfig:
    # The model's name, as the server reports it.
    model: str
    # Its folder (weights, tokenizer and chat template).
    model_dir: str
    # Weights' and KV cache's torch dtype, as text ("torch.float32").
    dtype: str
    # Longest sequence in tokens, prompt plus output.
    max_model_len: int


@dataclass(slots=True)
class _Stream:
    """Where one request's outputs go: its iterator's queue, on the event loop that reads it."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)


@dataclass(slots=True)
class _Start:
    """Command to the engine thread: tokenize, check and add a request, then stream it."""

    request_id: str
    prompt: Prompt
    params: SamplingParams
    stream: _Stream


@dataclass(slots=True)
class _Abort:
    """Command to the engine thread: abort a request."""

    request_id: str
    # Send the aborted request's last output (abort()); False when its consumer has left.
    notify: bool


@dataclass(slots=True)
class _Live:
    """The engine thread's record of a request it streams."""

    tracked: TrackedRequest
    stream: _Stream
    # Per sequence: pieces of text and tokens already sent (DELTA sends only what follows).
    sent_pieces: list[int]
    sent_tokens: list[int]


class AsyncLLMEngine:
    """An asyncio engine over the server's own scheduler and worker code (see the module docstring)."""

    def __init__(self, args: AsyncEngineArgs):
        self.core = EngineCore(args.engine_config())
        # Requests and aborts for the engine thread, applied in order before each step; None stops it.
        self._commands: queue.SimpleQueue[_Start | _Abort | None] = queue.SimpleQueue()
        # Request ids with a live iterator (event loop side), to refuse a duplicate.
        self._ids: set[str] = set()
        # Guards _ids, and the error check against the engine thread's failing the requests it holds.
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        # Engine thread only: the requests it streams, by id.
        self._live: dict[str, _Live] = {}
        self._thread = threading.Thread(target=self._run, name="pagedserve-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_engine_args(cls, engine_args: AsyncEngineArgs, **_: Any) -> AsyncLLMEngine:
        """vLLM's constructor (its other arguments, such as usage_context, change nothing here)."""
        return cls(engine_args)

    # ------------------------------------------------------------------ public API

    async def generate(
        self, prompt: Prompt, sampling_params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as it runs, the last with finished=True; what each holds follows
        sampling_params.output_kind. ValueError for a prompt or request the engine refuses."""
        if not isinstance(sampling_params, SamplingParams):
            raise TypeError(f"sampling_params must be SamplingParams, not {type(sampling_params).__name__}")
        stream = _Stream(asyncio.get_running_loop())
        with self._lock:
            if self._error is not None:
                raise EngineDeadError(f"the engine has stopped: {self._error}") from self._error
            if request_id in self._ids:
                raise ValueError(f"request id {request_id!r} is already running")
            self._ids.add(request_id)
            self._commands.put(_Start(request_id, prompt, sampling_params, stream))
        finished = False
        try:
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, EngineDeadError):
                    raise EngineDeadError(str(item)) from item.__cause__
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                # The consumer left (break, cancel, an error): nobody reads this request any more.
                self._commands.put(_Abort(request_id, notify=False))
            with self._lock:
                self._ids.discard(request_id)

    async def abort(self, request_id: str | list[str]) -> None:
        """Abort requests: each one's iterator ends with an output whose unfinished sequences say "abort"."""
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            self._commands.put(_Abort(rid, notify=True))

    async def get_tokenizer(self) -> Any:
        """The Hugging Face tokenizer."""
        return self.core.tokenizer.hf

    async def get_model_config(self) -> ModelConfig:
        core = self.core
        return ModelConfig(core.model_name, str(core.model_dir), str(core.dtype), core.max_model_len)

    async def check_health(self) -> None:
        """Raise EngineDeadError when the engine can no longer serve."""
        if self._error is not None:
            raise EngineDeadError(f"the engine has stopped: {self._error}") from self._error

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self._error is None

    @property
    def errored(self) -> bool:
        return self._error is not None

    @property
    def dead_error(self) -> BaseException | None:
        return self._error

    def shutdown(self) -> None:
        """Stop the engine thread; live iterators end with EngineDeadError."""
        self._commands.put(None)
        self._thread.join()
        self.core.close()

    # ------------------------------------------------------------------ the engine thread

    def _run(self) -> None:
        core = self.core
        try:
            while self._apply_commands(wait=not core.has_work()):
                self._publish(core.step())
            error: BaseException = EngineDeadError("the engine was shut down")
        except BaseException as exc:
            # Whatever it is, no iterator may hang on it.
            error = exc
        self._fail_all(error)

    def _apply_commands(self, wait: bool) -> bool:
        """Apply the commands queued so far, first waiting for one when wait; False once told to stop."""
        try:
            command = self._commands.get() if wait else self._commands.get_nowait()
            while command is not None:
                if isinstance(command, _Start):
                    self._start(command)
                else:
                    self._abort(command)
                command = self._commands.get_nowait()
            return False
        except queue.Empty:
            return True

    def _start(self, command: _Start) -> None:
        core = self.core
        stream = command.stream
        try:
            text, token_ids = core.encode(command.prompt)
            core.check_prompt(token_ids, command.params)
            tracked = core.add_request(command.request_id, text, token_ids, command.params)
        except Exception as error:
            _send(stream.loop, [(stream.queue, error)])
            if isinstance(error, ValueError | TypeError | KeyError):
                return  # a request the engine refuses fails alone: nothing of it reached the scheduler
            raise
        n = command.params.n
        self._live[command.request_id] = _Live(tracked, stream, [0] * n, [0] * n)

    def _abort(self, command: _Abort) -> None:
        tracked = self.core.abort_request(command.request_id)
        if command.request_id not in self._live:
            return
        if command.notify and tracked is not None:
            self._publish([tracked])  # its last output; a finished request leaves _live there
        else:
            del self._live[command.request_id]

    def _publish(self, updated: list[TrackedRequest]) -> None:
        """Each updated request's output to its queue: one hand-over per event loop."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]] = {}
        for tracked in updated:
            request_id = tracked.result.request_id
            live = self._live.get(request_id)
            if live is None:
                continue
            if tracked.result.finished:
                del self._live[request_id]
            output = _output(live)
            if output is not None:
                by_loop.setdefault(live.stream.loop, []).append((live.stream.queue, output))
        for loop, items in by_loop.items():
            if not _send(loop, items):
                # That event loop has closed under its consumers: nobody reads these requests.
                for _, output in items:
                    self._abort(_Abort(output.request_id, notify=False))

    def _fail_all(self, error: BaseException) -> None:
        """End every live iterator, and every request still queued, with EngineDeadError."""
        dead = EngineDeadError(f"the engine has stopped: {error}")
        dead.__cause__ = error
        with self._lock:
            self._error = error
            streams = [live.stream for live in self._live.values()]
            self._live.clear()
            # NOTE: under the lock, so that no generate() queues a request after this drain.
            while True:
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    break
                if isinstance(command, _Start):
                    streams.append(command.stream)
        for stream in streams:
            _send(stream.loop, [(stream.queue, dead)])


def _send(loop: asyncio.AbstractEventLoop, items: list[tuple[asyncio.Queue, Any]]) -> bool:
    """Put items into their queues on loop's thread; False when the loop has closed."""
    try:
        loop.call_soon_threadsafe(_put_all, items)
    except RuntimeError:
        return False
    return True


def _put_all(items: list[tuple[asyncio.Queue, Any]]) -> None:
    for q, item in items:
        q.put_nowait(item)


def _output(live: _Live) -> RequestOutput | None:
    """A snapshot of a request's output for its consumer (the engine thread goes on changing the
    original), holding what its output_kind asks for; None when there is nothing to send yet."""
    tracked = live.tracked
    result = tracked.result
    kind = tracked.params.output_kind
    if kind is RequestOutputKind.FINAL_ONLY and not result.finished:
        return None
    delta = kind is RequestOutputKind.DELTA
    outputs = []
    for i, seq in enumerate(tracked.sequences):
        out = seq.output
        first_piece = live.sent_pieces[i] if delta else 0
        first_token = live.sent_tokens[i] if delta else 0
        live.sent_pieces[i], live.sent_tokens[i] = len(seq.pieces), len(out.token_ids)
        outputs.append(
            CompletionOutput(
                index=out.index,
                text="".join(seq.pieces[first_piece:]),
                token_ids=out.token_ids[first_token:],
                finish_reason=out.finish_reason,
                stop_reason=out.stop_reason,
                logprobs=None if out.logprobs is None else out.logprobs[first_token:],
                cumulative_logprob=out.cumulative_logprob,
            )
        )
    return RequestOutput(
        request_id=result.request_id,
        prompt=result.prompt,
        prompt_token_ids=result.prompt_token_ids,
        outputs=outputs,
        finished=result.finished,
        num_cached_tokens=result.num_cached_tokens,
        metrics=copy.copy(result.metrics),
    )


# vLLM v1's name for the same engine.
AsyncLLM = AsyncLLMEngine
