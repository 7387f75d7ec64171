"""The offline API, in the shape vLLM users know: `LLM(...).generate(prompts, SamplingParams(...))`.

It runs the same scheduler and worker code as the server, in one process and without gRPC, through
the engine core it shares with `AsyncLLMEngine` (pagedserve/engine_core.py): each call adds its
requests and steps the core until they have all finished, with continuous batching, chunked prefill,
prefix caching and preemption exactly as served.

    from pagedserve import LLM, SamplingParams

    llm = LLM()  # the default model (SmolLM2-135M-Instruct)
    outs = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))
    print(outs[0].outputs[0].text)
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from pagedserve.engine_core import EngineConfig, EngineCore, as_prompt_list
from pagedserve.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from pagedserve.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "Logprob", "RequestMetrics", "RequestOutput", "SamplingParams"]


class LLM:
    """An in-process engine over the server's own scheduler and worker code (see the module docstring)."""

    def __init__(self, model: str | None = None, **engine_args: Any):
        """engine_args: EngineConfig's fields (dtype, block_size, max_num_seqs, max_model_len,
        max_num_batched_tokens, enable_prefix_caching, kv_cache_memory, num_blocks, seed, device, threads,
        gpu_memory_utilization, enforce_eager, tensor_parallel_size, speculative_config, deterministic)."""
        self.core = core = EngineCore(EngineConfig(model, **engine_args))
        self.model_dir, self.model_name, self.tokenizer = core.model_dir, core.model_name, core.tokenizer
        self.model, self.kv_cache, self.runner = core.model, core.kv_cache, core.runner
        self.dtype, self.max_model_len = core.dtype, core.max_model_len
        self.scheduler_config, self.scheduler = core.scheduler_config, core.scheduler
        self._request_ids = itertools.count()

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
        inputs = [self.core.encode(p) for p in as_prompt_list(prompts)]
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

    def close(self) -> None:
        """Stop the other ranks of a tensor-parallel engine (they also stop when this process exits)."""
        self.core.close()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix, as vLLM's LLM.reset_prefix_cache: the next generate computes
        every prompt token again (a benchmark that runs one workload twice measures the same work).
        True; between generate calls no request holds a block."""
        return self.scheduler.reset_prefix_cache()

    # ------------------------------------------------------------------ the loop

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
        core = self.core
        for (_, token_ids), sp in zip(inputs, params, strict=True):
            core.check_prompt(token_ids, sp)
        request_ids = [str(next(self._request_ids)) for _ in inputs]
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(inputs), desc="Processed prompts", unit="req", dynamic_ncols=True)
        try:
            results = [
                core.add_request(request_id, text, token_ids, sp).result
                for request_id, (text, token_ids), sp in zip(request_ids, inputs, params, strict=True)
            ]
            while core.requests:
                finished = sum(t.result.finished for t in core.step())
                if bar is not None and finished:
                    bar.update(finished)
        finally:
            if bar is not None:
                bar.close()
            # NOTE: on an error (or KeyboardInterrupt) the requests of this call are aborted so the
            # next call starts from a clean scheduler.
            for request_id in request_ids:
                core.abort_request(request_id)
        return results
