"""Speculative decoding's configuration, in vLLM's shape: `--speculative-config '{"method": "ngram",
"num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'` on `pagedserve serve` and
`pagedserve scheduler`, `LLM(speculative_config={...})` and `AsyncEngineArgs(speculative_config={...})`.

Two proposers. "ngram": the scheduler looks the drafts up in the sequence's own tokens (it holds them).
"draft_layers" (pagedserve's own; vLLM has no such method): a self-speculative draft, the first
num_draft_layers layers of the served model with its final norm and LM head, run by the worker before it
verifies; the scheduler plans the positions and tells the worker how many layers (StepPlan.num_draft_layers).
Either way only the scheduler's side is configured. A configuration that cannot work fails at start, naming
the field.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# The methods pagedserve proposes with: vLLM's n-gram lookup, and its own self-speculative draft.
METHODS = ("ngram", "draft_layers")
_VLLM_ONLY_METHODS = ("eagle", "eagle3", "medusa", "mlp_speculator", "draft_model", "deepseek_mtp", "suffix")
# Most draft tokens per step: a verification step computes 1 + k positions of a sequence.
MAX_SPECULATIVE_TOKENS = 32
# vLLM's default n-gram sizes when neither is given.
DEFAULT_PROMPT_LOOKUP = 5
# disable_by_batch_size when the configuration leaves it out (vLLM has no limit; null lifts it here too).
DEFAULT_DISABLE_BY_BATCH_SIZE = 8


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    # How drafts are proposed: "ngram" (prompt lookup in the sequence's own tokens) or "draft_layers" (the
    # model's first num_draft_layers layers, final norm and LM head, greedily, in the worker).
    method: str
    # Most draft tokens a sequence verifies in one step (k): the step computes 1 + k of its positions.
    num_speculative_tokens: int
    # Longest and shortest suffix of the sequence looked up earlier in its tokens, in tokens.
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP
    # No proposals in a step while more sequences than this run on the worker; None: no such limit.
    # NOTE: vLLM's field, whose default there is no limit. Here 8: a CPU step of 32 decodes is already
    # compute-bound, so 1 + k positions per sequence cost about what the accepted drafts save, and each
    # sequence with drafts leaves the pipeline for a step (docs/speculative-decoding.md, performance.md).
    disable_by_batch_size: int | None = DEFAULT_DISABLE_BY_BATCH_SIZE
    # "draft_layers": how many of the model's first layers draft (below its layer count, which the
    # scheduler checks when a worker registers); 0 for "ngram".
    num_draft_layers: int = 0

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            hint = (
                " (a vLLM method pagedserve does not implement)" if self.method in _VLLM_ONLY_METHODS else ""
            )
            raise ValueError(
                f"speculative_config.method {self.method!r} is not supported{hint}; supported: {', '.join(METHODS)}"
            )
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"speculative_config.num_speculative_tokens must be an integer in 1..{MAX_SPECULATIVE_TOKENS}, "
                f"not {k!r}"
            )
        for name in ("prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"speculative_config.{name} must be a positive integer, not {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) exceeds prompt_lookup_max "
                f"({self.prompt_lookup_max})"
            )
        layers = self.num_draft_layers
        if self.method == "draft_layers":
            if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
                raise ValueError(
                    f"speculative_config.num_draft_layers must be a positive integer for method draft_layers, "
                    f"not {layers!r}"
                )
        elif layers:
            raise ValueError(
                f"speculative_config.num_draft_layers applies to method draft_layers, not {self.method!r}"
            )
        limit = self.disable_by_batch_size
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            raise ValueError(
                f"speculative_config.disable_by_batch_size must be a positive integer, not {limit!r}"
            )


def parse_speculative_config(
    value: str | Mapping[str, Any] | SpeculativeConfig | None,
) -> SpeculativeConfig | None:
    """The configuration from a JSON text (the flag), a dict (LLM and AsyncEngineArgs) or a SpeculativeConfig;
    None or an empty text/dict: speculation off. ValueError, naming the field, for anything else."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        if not value.strip():
            return None
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise ValueError(f"speculative_config is not valid JSON: {error}") from None
    if not isinstance(value, Mapping):
        raise ValueError(f"speculative_config must be a JSON object, not {type(value).__name__}")
    if not value:
        return None
    fields = dict(value)
    if "model" in fields:
        model = fields.pop("model")
        if model in ("ngram", "[ngram]") and "method" not in fields:
            fields["method"] = "ngram"  # vLLM's older spelling
        elif model is not None:
            raise ValueError(
                f"speculative_config.model {model!r}: a separate draft checkpoint is not supported; "
                'use {"method": "draft_layers", "num_draft_layers": L} (the model\'s own first L layers) '
                'or {"method": "ngram"}'
            )
    fields.setdefault("method", "ngram")
    if "num_speculative_tokens" not in fields:
        raise ValueError("speculative_config.num_speculative_tokens is required")
    if fields["method"] == "draft_layers":
        if "num_draft_layers" not in fields:
            raise ValueError("speculative_config.num_draft_layers is required for method draft_layers")
        for name in ("prompt_lookup_max", "prompt_lookup_min"):
            if name in fields:
                raise ValueError(f"speculative_config.{name} applies to method ngram, not draft_layers")
    lookup_max, lookup_min = fields.get("prompt_lookup_max"), fields.get("prompt_lookup_min")
    # vLLM's defaults: one bound given stands for both; neither: 5.
    if lookup_max is None:
        lookup_max = DEFAULT_PROMPT_LOOKUP if lookup_min is None else lookup_min
    if lookup_min is None:
        lookup_min = lookup_max
    fields["prompt_lookup_max"], fields["prompt_lookup_min"] = lookup_max, lookup_min
    known = set(SpeculativeConfig.__slots__)
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(
            f"speculative_config has unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
        )
    return SpeculativeConfig(**fields)
