"""What generation returns, in the shape vLLM users know: `RequestOutput` holding one `CompletionOutput`
per sequence. `LLM.generate` returns them; `AsyncLLMEngine.generate` streams them."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CompletionOutput", "Logprob", "RequestMetrics", "RequestOutput"]


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
