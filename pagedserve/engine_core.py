"""The in-process engine that `LLM` and `AsyncLLMEngine` share: requests in, one step at a time, text out.

It runs the same scheduler and worker code as the server, in one process and without gRPC: one
`Scheduler` + `PlanBuilder` (scheduler_svc) and one `ModelRunner` (worker_svc) over the loaded model
and its KV pool, assembled as the worker server assembles them (worker_svc/assembly.py). One `step()` is

    schedule() -> PlanBuilder.build() -> ModelRunner.execute(plan) -> update_from_output()

with continuous batching, chunked prefill, prefix caching and preemption exactly as served. Text is
the gateway's business there and here alike: prompts are tokenized, token ids are turned into text
with the gateway's `IncrementalDetokenizer`, and stop strings are matched with its
`StopStringMatcher`; once every sequence of a request hit a stop string the request is aborted at the
scheduler, which frees its blocks.

The core is not thread-safe: one thread drives it (the caller's, for `LLM`; the engine thread, for
`AsyncLLMEngine`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from pagedserve import finish_reasons
from pagedserve.errors import InvalidRequestError
from pagedserve.gateway.tokenization import IncrementalDetokenizer, SequenceText, StopStringMatcher, Tokenizer
from pagedserve.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from pagedserve.sampling_params import SamplingParams
from pagedserve.scheduler_svc.config import SchedulerConfig
from pagedserve.scheduler_svc.plan import PlanBuilder
from pagedserve.scheduler_svc.request import Request
from pagedserve.scheduler_svc.scheduler import RequestOutput as TokenUpdate
from pagedserve.scheduler_svc.scheduler import Scheduler
from pagedserve.scheduler_svc.structured_output import Grammar, GrammarCompiler, load_tokenizer
from pagedserve.service_main import freeze_startup_objects
from pagedserve.speculative import SpeculativeConfig, parse_speculative_config
from pagedserve.v1 import common_pb2
from pagedserve.validation import check_max_tokens, check_prompt
from pagedserve.worker_svc.assembly import assemble
from pagedserve.worker_svc.config import DEFAULT_DETERMINISTIC, DEFAULT_GPU_MEMORY_UTILIZATION

# Step budget when the caller gives none (the server's default too).
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048

# What generate() takes as one prompt: text, token ids, or {"prompt": ...} / {"prompt_token_ids": ...}.
Prompt = str | Sequence[int] | dict


@dataclass(slots=True)
class SequenceState:
    """Text state of one of a request's sequences."""

    text: SequenceText
    # The output the caller sees; its text is set when the sequence ends (pieces hold it until then).
    output: CompletionOutput
    # Text released so far, one piece per update.
    pieces: list[str] = field(default_factory=list)
    # Finished by the scheduler, by a stop string here, or aborted.
    done: bool = False


@dataclass(slots=True)
class TrackedRequest:
    """A live request: its parameters, its sequences' text state, and the output it builds."""

    params: SamplingParams
    sequences: list[SequenceState]
    result: RequestOutput


@dataclass(slots=True)
class StepStats:
    # step() calls that ran a plan.
    num_steps: int = 0
    # Steps that computed more than one sequence together (continuous batching at work).
    num_batched_steps: int = 0


@dataclass(slots=True, frozen=True)
class EngineConfig:
    # Model folder, .gguf file, or None / "default" for the default model.
    model: str | None = None
    # "auto", "float32", "bfloat16" or "float16" (weights and KV cache).
    dtype: str = "auto"
    # Quantized checkpoints (worker --quantization): "auto" keeps GPTQ, AWQ and compressed-tensors weights
    # quantized, "gguf" a GGUF's, "none" dequantizes them.
    quantization: str = "auto"
    # Tokens per KV block.
    block_size: int = 16
    # Most sequences computed in one step.
    max_num_seqs: int = 256
    # Longest sequence in tokens, prompt plus output; None: the model's own.
    max_model_len: int | None = None
    # Most tokens computed in one step; None: DEFAULT_MAX_NUM_BATCHED_TOKENS.
    max_num_batched_tokens: int | None = None
    # Share the KV blocks of common prompt prefixes between requests.
    enable_prefix_caching: bool = True
    # KV pool budget in bytes; None: the device's default budget.
    kv_cache_memory: int | None = None
    # Exact number of KV blocks; wins over kv_cache_memory.
    num_blocks: int | None = None
    # Seed of torch and of the sampler's generator.
    seed: int = 0
    # torch device ("cpu", "cuda", "cuda:1", "auto").
    device: str = "cpu"
    # torch intra-op threads for the CPU model; None: torch's default, one per core.
    # NOTE: on a CPU shared with other busy processes, 1 can be much faster than 2: libgomp's
    # workers spin at every barrier, so one descheduled thread stalls each op (docs/performance.md).
    threads: int | None = None
    # On CUDA: the share of the device the engine may hold (weights, activations, KV pool).
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    # On CUDA: run every step eagerly, without CUDA graphs.
    enforce_eager: bool = False
    # Processes (ranks) the model is sharded over (worker_svc/parallel.py); this one is rank 0.
    tensor_parallel_size: int = 1
    # Speculative decoding in vLLM's shape ({"method": "ngram", "num_speculative_tokens": k, ...}, as a dict,
    # JSON text or SpeculativeConfig); None: off. Checked here, before the model loads.
    speculative_config: SpeculativeConfig | dict | str | None = None
    # Batch-invariant kernels: a request's tokens do not depend on the rest of the batch (see kernels.ops.Ops).
    deterministic: bool | None = DEFAULT_DETERMINISTIC

    def __post_init__(self) -> None:
        object.__setattr__(self, "speculative_config", parse_speculative_config(self.speculative_config))
        spec = self.speculative_config
        if spec is not None and spec.num_draft_layers and self.tensor_parallel_size > 1:
            raise ValueError(
                "speculative_config method draft_layers is not supported with tensor_parallel_size > 1"
            )


class EngineCore:
    """Tokenizer, scheduler, plan builder and model runner in one process (see the module docstring)."""

    def __init__(self, config: EngineConfig):
        if config.threads is not None:
            torch.set_num_threads(config.threads)
        torch.manual_seed(config.seed)
        worker = assemble(
            config.model,
            dtype=config.dtype,
            quantization=config.quantization,
            device=config.device,
            block_size=config.block_size,
            num_blocks=config.num_blocks,
            kv_cache_memory=config.kv_cache_memory,
            max_model_len=config.max_model_len,
            seed=config.seed,
            # A sequence must fit the pool alone, so a small pool shortens the context (as the server's
            # engine does) instead of refusing every long request.
            context_within_pool=True,
            gpu_memory_utilization=config.gpu_memory_utilization,
            enforce_eager=config.enforce_eager,
            max_cudagraph_capture_size=config.max_num_seqs,
            tensor_parallel_size=config.tensor_parallel_size,
            threads=config.threads,
            deterministic=config.deterministic,
        )
        self.worker = worker
        self.model_dir = worker.model_dir
        self.model_name = worker.info.model
        self.tokenizer = Tokenizer.from_model_dir(self.model_dir)
        self.eos_token_ids = frozenset(worker.generation.eos_token_ids)
        self.model, self.kv_cache, self.runner = worker.model, worker.kv_cache, worker.runner
        self.dtype = self.model.dtype
        self.max_model_len = worker.info.max_model_len
        spec = config.speculative_config
        if spec is not None and spec.num_draft_layers >= worker.info.num_layers:
            worker.close()
            raise ValueError(
                f"speculative_config.num_draft_layers {spec.num_draft_layers} is not below the model's "
                f"{worker.info.num_layers} layers"
            )
        self.scheduler_config = SchedulerConfig(
            num_blocks=worker.info.num_blocks,
            block_size=config.block_size,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=max(
                config.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS, config.max_num_seqs
            ),
            max_model_len=self.max_model_len,
            enable_prefix_caching=config.enable_prefix_caching,
            speculative=config.speculative_config,
        )
        self.scheduler = Scheduler(self.scheduler_config)
        self.plan_builder = PlanBuilder()
        # Live requests by id; a request leaves when it finishes or is aborted.
        self.requests: dict[str, TrackedRequest] = {}
        # Compiles structured-output constraints; made with the first constrained request.
        self._grammars: GrammarCompiler | None = None
        self.stats = StepStats()
        freeze_startup_objects()

    def close(self) -> None:
        """Stop the other ranks of a tensor-parallel group (they also go when this process exits); call it
        from the thread that steps the core, once it no longer does."""
        self.worker.close()

    # ------------------------------------------------------------------ requests in and out

    def encode(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        """(prompt text or None, token ids) of one prompt."""
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" not in prompt:
                raise ValueError('a prompt dict needs "prompt" or "prompt_token_ids"')
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        return None, [int(t) for t in prompt]

    def check_prompt(self, token_ids: list[int], sp: SamplingParams) -> None:
        """The server's checks (pagedserve.validation), raised as ValueError as vLLM's LLM does."""
        try:
            check_prompt(token_ids, vocab_size=self.model.config.vocab_size, max_model_len=self.max_model_len)
            check_max_tokens(len(token_ids), sp.to_proto(), max_model_len=self.max_model_len)
        except InvalidRequestError as error:
            raise ValueError(error.message) from None

    def add_request(
        self, request_id: str, text: str | None, token_ids: list[int], sp: SamplingParams
    ) -> TrackedRequest:
        """Queue a checked request (check_prompt) at the scheduler; ValueError if it refuses it."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already live")
        proto = sp.to_proto()
        del proto.stop[:]  # stop strings are matched here, on the text
        req = Request(
            request_id=request_id,
            token_ids=list(token_ids),
            prompt_len=len(token_ids),
            sampling=proto,
            eos_token_ids=self.eos_token_ids,
            arrival_time=time.time(),
        )
        if proto.HasField("structured_output"):
            req.grammar = self._compile(proto.structured_output)
        arrival = time.perf_counter()
        self.scheduler.add_request(req)
        # EOS and stop token ids end a sequence; their text is hidden.
        stop_ids = frozenset(sp.stop_token_ids or ()) | (frozenset() if sp.ignore_eos else self.eos_token_ids)
        sequences = [
            SequenceState(
                SequenceText(
                    IncrementalDetokenizer(self.tokenizer, token_ids, sp.skip_special_tokens),
                    StopStringMatcher(sp.stop or (), sp.include_stop_str_in_output),
                    stop_ids,
                ),
                CompletionOutput(
                    index=i, text="", token_ids=[], logprobs=[] if sp.logprobs is not None else None
                ),
            )
            for i in range(sp.n)
        ]
        result = RequestOutput(
            request_id=request_id,
            prompt=text,
            prompt_token_ids=list(token_ids),
            outputs=[s.output for s in sequences],
            metrics=RequestMetrics(arrival_time=arrival),
        )
        tracked = TrackedRequest(sp, sequences, result)
        self.requests[request_id] = tracked
        return tracked

    def _compile(self, so: common_pb2.StructuredOutput) -> Grammar:
        """A structured-output constraint compiled as the scheduler service compiles it; ValueError if not."""
        if self._grammars is None:
            vocab_size = self.model.config.vocab_size
            self._grammars = GrammarCompiler(load_tokenizer(self.model_dir, vocab_size, self.eos_token_ids))
        try:
            return self._grammars.compile_sync(so, "structured_outputs")
        except InvalidRequestError as error:
            raise ValueError(error.message) from None

    def abort_request(self, request_id: str) -> TrackedRequest | None:
        """Abort a live request: its blocks are released now, and its unfinished sequences end with
        "abort". The request, or None when it is not live (finished already, or unknown)."""
        tracked = self.requests.pop(request_id, None)
        self.scheduler.abort_request(request_id)
        if tracked is None:
            return None
        for seq in tracked.sequences:
            if not seq.done:
                _finish(seq, "abort", None)
        self._close(tracked, time.perf_counter())
        return tracked

    # ------------------------------------------------------------------ one step

    def has_work(self) -> bool:
        """Whether step() has anything to compute or to report to the runner."""
        return self.scheduler.has_work()

    def step(self) -> list[TrackedRequest]:
        """Run one step; the requests it updated, in the order their tokens came (finished ones have
        left `requests` and carry result.finished)."""
        scheduler = self.scheduler
        if not scheduler.has_work():
            # NOTE: add_request refuses what can never fit, so live requests with nothing to schedule
            # mean a bug.
            assert not self.requests, "the scheduler has nothing to schedule with requests live"
            return []
        out = scheduler.schedule()
        plan = self.plan_builder.build(out).plan
        if failures := scheduler.take_failures():
            raise RuntimeError(failures[0].message)
        result = self.runner.execute(plan)
        now = time.perf_counter()
        self.stats.num_steps += 1
        self.stats.num_batched_steps += len(out.scheduled) > 1
        # NOTE: every request was checked before it came in, so one the core fails alone, or the
        # runner refuses, means a bug: the caller stops (and aborts its requests) and says which.
        if result.refused_slots:
            raise RuntimeError(f"the runner refused a request: {result.refused_messages[0]}")
        updates = scheduler.update_from_output(out, result)
        if failures := scheduler.take_failures():
            raise RuntimeError(failures[0].message)
        updated: dict[str, TrackedRequest] = {}
        for update in updates:
            tracked = self.requests.get(update.request_id)
            if tracked is None:
                continue  # aborted, or stopped on a stop string, while this step ran
            metrics = tracked.result.metrics
            if metrics.first_token_time is None and update.new_token_ids:
                metrics.first_token_time = now
            tracked.result.num_cached_tokens = update.num_cached_tokens
            seq = tracked.sequences[update.index]
            if not seq.done:
                self._consume(tracked, seq, update)
            updated[update.request_id] = tracked
            if all(s.done for s in tracked.sequences):
                del self.requests[update.request_id]
                # Sequences that stopped on a stop string still run at the scheduler.
                scheduler.abort_request(update.request_id)
                self._close(tracked, now)
        return list(updated.values())

    @staticmethod
    def _close(tracked: TrackedRequest, now: float) -> None:
        tracked.result.finished = True
        tracked.result.metrics.finished_time = now

    def _consume(self, tracked: TrackedRequest, seq: SequenceState, update: TokenUpdate) -> None:
        """Append one update's tokens to a sequence's text (the gateway's rules: the text of the token that
        stopped the sequence, EOS or a stop token id, is hidden unless include_stop_str_in_output)."""
        out = seq.output
        finish = finish_reasons.name_of(update.finish_reason)
        token_ids = update.new_token_ids
        text, used, matched = seq.text.add(token_ids, finish)
        seq.pieces.append(text)
        out.token_ids.extend(token_ids[:used])
        if update.logprobs is not None and out.logprobs is not None:
            for lp in update.logprobs[:used]:
                self._add_logprobs(out, lp)
        if matched is not None:
            _finish(seq, "stop", matched)
            return
        if finish is None:
            return
        stop_ids = tracked.params.stop_token_ids or ()
        _finish(seq, finish, update.stop_token_id if update.stop_token_id in stop_ids else None)

    def _add_logprobs(self, out: CompletionOutput, lp: common_pb2.TokenLogprob) -> None:
        text = self.tokenizer.token_text
        entry = {lp.token_id: Logprob(lp.logprob, lp.rank, text(lp.token_id))}
        for rank, (tid, value) in enumerate(zip(lp.top_token_ids, lp.top_logprobs, strict=True), 1):
            entry.setdefault(tid, Logprob(value, rank, text(tid)))
        out.logprobs.append(entry)
        out.cumulative_logprob = (out.cumulative_logprob or 0.0) + lp.logprob


def _finish(seq: SequenceState, reason: str, stop_reason: str | int | None) -> None:
    seq.done = True
    seq.output.text = "".join(seq.pieces)
    seq.output.finish_reason = reason
    seq.output.stop_reason = stop_reason


def as_prompt_list(prompts: Any) -> list[Any]:
    """One prompt (a string, a token id list, a dict) or a list of them, as a list."""
    if isinstance(prompts, str | dict):
        return [prompts]
    prompts = list(prompts)
    if prompts and isinstance(prompts[0], int):
        return [prompts]
    return prompts
