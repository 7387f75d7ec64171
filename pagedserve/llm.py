"""The offline API, in the shape vLLM users know: `LLM(...).generate(prompts, SamplingParams(...))`.

It runs the same scheduler and worker code as the server, in one process and without gRPC: one
`Scheduler` + `PlanBuilder` (scheduler_svc) and one `ModelRunner` (worker_svc) over the loaded model
and its KV pool, assembled as the worker server assembles them (worker_svc/assembly.py), driven by
the loop

    schedule() -> PlanBuilder.build() -> ModelRunner.execute(plan) -> update_from_output()

with continuous batching, chunked prefill, prefix caching and preemption exactly as served. Text is
the gateway's business there and here alike: prompts are tokenized (chat template for `chat`), token
ids are turned into text with the gateway's `IncrementalDetokenizer`, and stop strings are matched with
its `StopStringMatcher`; once every sequence of a request hit a stop string the request is aborted
at the scheduler, which frees its blocks.

    from pagedserve import LLM, SamplingParams

    llm = LLM()  # the default model (SmolLM2-135M-Instruct)
    outs = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))
    print(outs[0].outputs[0].text)
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from pagedserve import finish_reasons
from pagedserve.errors import InvalidRequestError
from pagedserve.gateway.tokenization import IncrementalDetokenizer, SequenceText, StopStringMatcher, Tokenizer
from pagedserve.sampling_params import SamplingParams
from pagedserve.scheduler_svc.config import SchedulerConfig
from pagedserve.scheduler_svc.plan import PlanBuilder
from pagedserve.scheduler_svc.request import Request
from pagedserve.scheduler_svc.scheduler import Scheduler
from pagedserve.scheduler_svc.structured_output import GrammarCompiler, load_tokenizer
from pagedserve.service_main import freeze_startup_objects
from pagedserve.v1 import common_pb2
from pagedserve.validation import check_max_tokens, check_prompt
from pagedserve.worker_svc.assembly import assemble

__all__ = ["LLM", "CompletionOutput", "Logprob", "RequestMetrics", "RequestOutput", "SamplingParams"]

# Step budget when the caller gives none (the server's default too).
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048


@dataclass(slots=True)
class Logprob:
    logprob: float  # natural-log probability under the model's raw distribution
    rank: int | None = None  # 1-based rank in the distribution (known for the sampled token)
    decoded_token: str | None = None  # the token's text on its own


@dataclass(slots=True)
class CompletionOutput:
    # Which of the request's n sequences, 0-based.
    index: int
    # Generated text, stop string cut off (unless include_stop_str_in_output).
    text: str
    # Generated token ids (the one that ended the sequence included).
    token_ids: list[int]
    # "stop" (EOS, stop token id or stop string), "length" (max_tokens or context), or "abort".
    finish_reason: str | None = None
    # The stop string or stop token id that ended it, when one did.
    stop_reason: str | int | None = None
    # Per token: token id -> Logprob for the sampled token and the top alternatives; None unless asked.
    logprobs: list[dict[int, Logprob]] | None = None
    # Sum of the sampled tokens' log-probabilities, when logprobs were asked.
    cumulative_logprob: float | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    # time.perf_counter() when the request entered the scheduler, in s.
    arrival_time: float
    # When its first token (of any sequence) came back; None if none did.
    first_token_time: float | None = None
    # When its last sequence finished.
    finished_time: float | None = None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    # The prompt text (None when given as token ids).
    prompt: str | None
    prompt_token_ids: list[int]
    # One per sequence, by index.
    outputs: list[CompletionOutput]
    finished: bool = False
    # Prompt tokens served by the prefix cache.
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None


@dataclass(slots=True)
class _Sequence:
    """Text state of one of a request's sequences."""

    text: SequenceText
    output: CompletionOutput
    pieces: list[str] = field(default_factory=list)
    done: bool = False  # finished by the scheduler, or by a stop string here


@dataclass(slots=True)
class _Tracked:
    """One request of a generate() call."""

    position: int  # index in the caller's list
    params: SamplingParams
    sequences: list[_Sequence]
    result: RequestOutput


class LLM:
    """An in-process engine over the server's own scheduler and worker code (see the module docstring)."""

    def __init__(
        self,
        model: str | None = None,
        dtype: str = "auto",
        block_size: int = 16,
        max_num_seqs: int = 256,
        max_model_len: int | None = None,
        max_num_batched_tokens: int | None = None,
        enable_prefix_caching: bool = True,
        kv_cache_memory: int | None = None,
        num_blocks: int | None = None,
        seed: int = 0,
        device: str = "cpu",
        threads: int | None = None,
    ):
        # threads: torch intra-op threads for the CPU model (None: torch's default, one per core).
        # NOTE: on a CPU shared with other busy processes, 1 can be much faster than 2: libgomp's
        # workers spin at every barrier, so one descheduled thread stalls each op (docs/performance.md).
        if threads is not None:
            torch.set_num_threads(threads)
        torch.manual_seed(seed)
        worker = assemble(
            model,
            dtype=dtype,
            device=device,
            block_size=block_size,
            num_blocks=num_blocks,
            kv_cache_memory=kv_cache_memory,
            max_model_len=max_model_len,
            seed=seed,
            # A sequence must fit the pool alone, so a small pool shortens the context (as the server's
            # engine does) instead of refusing every long request.
            context_within_pool=True,
        )
        self.model_dir = worker.model_dir
        self.model_name = worker.info.model
        self.tokenizer = Tokenizer.from_model_dir(self.model_dir)
        self.eos_token_ids = frozenset(worker.generation.eos_token_ids)
        self.model, self.kv_cache, self.runner = worker.model, worker.kv_cache, worker.runner
        self.dtype = self.model.dtype
        self.max_model_len = worker.info.max_model_len
        self.scheduler_config = SchedulerConfig(
            num_blocks=worker.info.num_blocks,
            block_size=block_size,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max(
                max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS, max_num_seqs
            ),
            max_model_len=self.max_model_len,
            enable_prefix_caching=enable_prefix_caching,
        )
        self.scheduler = Scheduler(self.scheduler_config)
        self.plan_builder = PlanBuilder()
        # Compiles structured-output constraints; made with the first constrained request.
        self._grammars: GrammarCompiler | None = None
        self._request_ids = itertools.count()
        freeze_startup_objects()

    # ------------------------------------------------------------------ public API

    def get_tokenizer(self) -> Any:
        """The Hugging Face tokenizer."""
        return self.tokenizer.hf

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]] | Sequence[dict],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text, token ids, or {"prompt": ...} / {"prompt_token_ids": ...}
        dicts); the outputs come back in input order."""
        inputs = [self._encode(p) for p in _as_prompt_list(prompts)]
        return self._run(inputs, sampling_params, use_tqdm)

    def chat(
        self,
        messages: Sequence[dict[str, str]] | Sequence[Sequence[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, rendered with the model's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        inputs = []
        for conversation in conversations:
            text = self.tokenizer.render_chat(list(conversation), add_generation_prompt)
            # The rendered template already holds the special tokens (BOS and role markers).
            inputs.append((text, self.tokenizer.encode(text, add_special_tokens=False)))
        return self._run(inputs, sampling_params, use_tqdm)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix, as vLLM's LLM.reset_prefix_cache: the next generate computes
        every prompt token again (a benchmark that runs one workload twice measures the same work).
        True; between generate calls no request holds a block."""
        return self.scheduler.reset_prefix_cache()

    # ------------------------------------------------------------------ the loop

    def _encode(self, prompt: str | Sequence[int] | dict) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        return None, [int(t) for t in prompt]

    def _run(
        self,
        inputs: list[tuple[str | None, list[int]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        use_tqdm: bool,
    ) -> list[RequestOutput]:
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (
            [sampling_params] * len(inputs)
            if isinstance(sampling_params, SamplingParams)
            else list(sampling_params)
        )
        if len(params) != len(inputs):
            raise ValueError(f"{len(params)} sampling params for {len(inputs)} prompts")
        tracked: dict[str, _Tracked] = {}
        try:
            for position, ((text, token_ids), sp) in enumerate(zip(inputs, params, strict=True)):
                self._check_prompt(token_ids, sp)
                request_id = str(next(self._request_ids))
                tracked[request_id] = self._add_request(request_id, position, text, token_ids, sp)
        except BaseException:
            for request_id in tracked:  # a refused request: the call's others leave the scheduler too
                self.scheduler.abort_request(request_id)
            raise
        results = [t.result for t in tracked.values()]
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(tracked), desc="Processed prompts", unit="req", dynamic_ncols=True)
        try:
            self._loop(tracked, bar)
        finally:
            if bar is not None:
                bar.close()
            # NOTE: on an error (or KeyboardInterrupt) the requests of this call are aborted so the
            # next call starts from a clean scheduler.
            for request_id in list(tracked):
                self.scheduler.abort_request(request_id)
        return results

    def _check_prompt(self, token_ids: list[int], sp: SamplingParams) -> None:
        """The server's checks (pagedserve.validation), raised as ValueError as vLLM's LLM does."""
        try:
            check_prompt(token_ids, vocab_size=self.model.config.vocab_size, max_model_len=self.max_model_len)
            check_max_tokens(len(token_ids), sp.to_proto(), max_model_len=self.max_model_len)
        except InvalidRequestError as error:
            raise ValueError(error.message) from None

    def _add_request(
        self, request_id: str, position: int, text: str | None, token_ids: list[int], sp: SamplingParams
    ) -> _Tracked:
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
            if self._grammars is None:
                vocab_size = self.model.config.vocab_size
                self._grammars = GrammarCompiler(
                    load_tokenizer(self.model_dir, vocab_size, self.eos_token_ids)
                )
            try:
                req.grammar = self._grammars.compile_sync(proto.structured_output, "structured_outputs")
            except InvalidRequestError as error:
                raise ValueError(error.message) from None
        arrival = time.perf_counter()
        self.scheduler.add_request(req)
        # EOS and stop token ids end a sequence; their text is hidden.
        stop_ids = frozenset(sp.stop_token_ids or ()) | (frozenset() if sp.ignore_eos else self.eos_token_ids)
        sequences = [
            _Sequence(
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
        return _Tracked(position, sp, sequences, result)

    def _loop(self, tracked: dict[str, _Tracked], bar: Any) -> None:
        scheduler, builder, runner = self.scheduler, self.plan_builder, self.runner
        live = set(tracked)
        idle_steps = 0
        while live:
            out = scheduler.schedule()
            plan = builder.build(out).plan
            if failures := scheduler.take_failures():
                raise RuntimeError(failures[0].message)
            result = runner.execute(plan)
            now = time.perf_counter()
            if not out.scheduled:
                idle_steps += 1
                # NOTE: add_request refuses what can never fit, so two empty steps in a row mean a bug.
                assert idle_steps < 2 or out.finished, "the scheduler scheduled nothing with requests live"
            else:
                idle_steps = 0
            # NOTE: every request was checked before it came in, so one the core fails alone, or the
            # runner refuses, means a bug: the call stops (its requests are aborted) and says which.
            if result.refused_slots:
                raise RuntimeError(f"the runner refused a request: {result.refused_messages[0]}")
            outputs = scheduler.update_from_output(out, result)
            if failures := scheduler.take_failures():
                raise RuntimeError(failures[0].message)
            for ro in outputs:
                t = tracked.get(ro.request_id)
                if t is None or ro.request_id not in live:
                    continue
                metrics = t.result.metrics
                if metrics.first_token_time is None and ro.new_token_ids:
                    metrics.first_token_time = now
                t.result.num_cached_tokens = ro.num_cached_tokens
                seq = t.sequences[ro.index]
                if not seq.done:
                    self._consume(t, seq, ro)
                if all(s.done for s in t.sequences):
                    live.discard(ro.request_id)
                    t.result.finished = True
                    metrics.finished_time = now
                    # Sequences that stopped on a stop string still run at the scheduler.
                    scheduler.abort_request(ro.request_id)
                    if bar is not None:
                        bar.update(1)

    def _consume(self, t: _Tracked, seq: _Sequence, ro: Any) -> None:
        """Append one update's tokens to a sequence's text (the gateway's rules: the text of the token that
        stopped the sequence, EOS or a stop token id, is hidden unless include_stop_str_in_output)."""
        out = seq.output
        finish = finish_reasons.name_of(ro.finish_reason)
        sp = t.params
        token_ids = ro.new_token_ids
        text, used, matched = seq.text.add(token_ids, finish)
        seq.pieces.append(text)
        out.token_ids.extend(token_ids[:used])
        if ro.logprobs is not None and out.logprobs is not None:
            for lp in ro.logprobs[:used]:
                self._add_logprobs(out, lp)
        if matched is not None:
            self._finish(seq, "stop", matched)
            return
        if finish is None:
            return
        stop_reason = ro.stop_token_id if ro.stop_token_id in (sp.stop_token_ids or ()) else None
        self._finish(seq, finish, stop_reason)

    def _add_logprobs(self, out: CompletionOutput, lp: common_pb2.TokenLogprob) -> None:
        text = self.tokenizer.token_text
        entry = {lp.token_id: Logprob(lp.logprob, lp.rank, text(lp.token_id))}
        for rank, (tid, value) in enumerate(zip(lp.top_token_ids, lp.top_logprobs, strict=True), 1):
            entry.setdefault(tid, Logprob(value, rank, text(tid)))
        out.logprobs.append(entry)
        out.cumulative_logprob = (out.cumulative_logprob or 0.0) + lp.logprob

    @staticmethod
    def _finish(seq: _Sequence, reason: str, stop_reason: str | int | None) -> None:
        seq.done = True
        seq.output.text = "".join(seq.pieces)
        seq.output.finish_reason = reason
        seq.output.stop_reason = stop_reason


def _as_prompt_list(prompts: Any) -> list[Any]:
    """One prompt (a string, a token id list, a dict) or a list of them, as a list."""
    if isinstance(prompts, str | dict):
        return [prompts]
    prompts = list(prompts)
    if prompts and isinstance(prompts[0], int):
        return [prompts]
    return prompts
