"""`SamplingParams` of the offline API, with vLLM's names and defaults; converts to the wire proto."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from pagedserve.errors import InvalidRequestError
from pagedserve.structured_outputs import Constraint, check_structured_output
from pagedserve.v1 import common_pb2
from pagedserve.validation import Limits, check_sampling, reduce_seed

_OFFLINE_LIMITS = Limits(max_n=(1 << 32) - 1)

# vLLM's names for a structured-output constraint: StructuredOutputsParams(json=..., regex=..., choice=...,
# grammar=..., json_object=...), and the older GuidedDecodingParams.
StructuredOutputsParams = Constraint
GuidedDecodingParams = Constraint


class RequestOutputKind(Enum):
    """What each output AsyncLLMEngine.generate yields holds (vLLM's names; LLM returns final outputs)."""

    CUMULATIVE = 0  # everything generated so far
    DELTA = 1  # only what is new since the previous output
    FINAL_ONLY = 2  # one output, when the request has finished


@dataclass(slots=True)
class SamplingParams:
    # Sequences generated from the prompt.
    n: int = 1
    # Softmax temperature; 0 is greedy.
    temperature: float = 1.0
    # Nucleus sampling mass, in (0, 1].
    top_p: float = 1.0
    # Keep the k most likely tokens; 0 or -1: no limit.
    top_k: int = 0
    # Drop tokens below min_p times the most likely token's probability, in [0, 1].
    min_p: float = 0.0
    # Seed of this request's draws (sequence i of n uses seed + i); None: the LLM's generator.
    seed: int | None = None
    # Most tokens generated per sequence; None: up to the context length.
    max_tokens: int | None = 16
    # Tokens generated before EOS or a stop token id may end a sequence.
    min_tokens: int = 0
    # Strings that end a sequence; the text is cut before them.
    stop: str | list[str] | None = None
    # Token ids that end a sequence, besides the model's EOS tokens.
    stop_token_ids: list[int] | None = None
    # Keep generating past EOS tokens.
    ignore_eos: bool = False
    # OpenAI-style penalties on tokens already generated, in [-2, 2].
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # > 1 discourages tokens seen in prompt or output.
    repetition_penalty: float = 1.0
    # Log-probabilities of each sampled token and of this many alternatives (0..20); None: none.
    logprobs: int | None = None
    # Drop special tokens from the text.
    skip_special_tokens: bool = True
    # Keep the matched stop string at the end of the text.
    include_stop_str_in_output: bool = False
    # Constrain the output to a JSON schema, regex, choice or grammar (one of them).
    structured_outputs: StructuredOutputsParams | None = None
    # vLLM's older name for structured_outputs.
    guided_decoding: GuidedDecodingParams | None = None
    # What each streamed output holds (AsyncLLMEngine.generate); LLM.generate returns final outputs.
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k == -1:
            self.top_k = 0
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, not {self.output_kind!r}")
        if self.n < 1:
            raise ValueError(f"n must be at least 1, not {self.n}")
        for name in ("max_tokens", "min_tokens", "logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < 1 << 32:
                raise ValueError(f"{name} must be a non-negative integer, not {value}")
        # NOTE: the ranges are the server's (pagedserve.validation); n is bounded by the LLM's max_num_seqs.
        if self.structured_outputs is not None and self.guided_decoding is not None:
            raise ValueError("give structured_outputs or guided_decoding, not both")
        try:
            sp = self.to_proto()
            check_sampling(sp, limits=_OFFLINE_LIMITS, names={"structured_output": "structured_outputs"})
            if sp.HasField("structured_output"):
                check_structured_output(sp.structured_output, "structured_outputs")
        except InvalidRequestError as error:
            raise ValueError(error.message) from None

    def to_proto(self) -> common_pb2.SamplingParams:
        """The proto the scheduler and worker take (stop strings included; the offline loop applies them)."""
        sp = common_pb2.SamplingParams(
            n=self.n,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            stop=self.stop or [],
            stop_token_ids=self.stop_token_ids or [],
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
        )
        if self.seed is not None:
            sp.seed = reduce_seed(self.seed)
        if self.max_tokens is not None:
            sp.max_tokens = self.max_tokens
        if self.logprobs is not None:
            sp.logprobs = self.logprobs
        constraint = self.structured_outputs or self.guided_decoding
        if constraint is not None and (so := constraint.to_proto("structured_outputs")) is not None:
            sp.structured_output.CopyFrom(so)
        return sp
