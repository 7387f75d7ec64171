"""pagedserve: an LLM inference server with a paged KV cache, continuous batching and prefix caching.

`from pagedserve import LLM, SamplingParams` gives the offline API (pagedserve/llm.py), and
`AsyncLLMEngine` / `AsyncEngineArgs` the asyncio one (pagedserve/async_engine.py); each is imported on
first use, so `import pagedserve` stays light (no torch) for the gateway and the CLI.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# name -> module that defines it
_LAZY = {
    "LLM": "pagedserve.llm",
    "RequestOutput": "pagedserve.llm",
    "CompletionOutput": "pagedserve.llm",
    "SamplingParams": "pagedserve.sampling_params",
    "RequestOutputKind": "pagedserve.sampling_params",
    "StructuredOutputsParams": "pagedserve.sampling_params",
    "GuidedDecodingParams": "pagedserve.sampling_params",
    "AsyncLLMEngine": "pagedserve.async_engine",
    "AsyncLLM": "pagedserve.async_engine",
    "AsyncEngineArgs": "pagedserve.async_engine",
}
__all__ = [
    "LLM",
    "AsyncEngineArgs",
    "AsyncLLM",
    "AsyncLLMEngine",
    "CompletionOutput",
    "GuidedDecodingParams",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "StructuredOutputsParams",
    "__version__",
]

if TYPE_CHECKING:
    from pagedserve.async_engine import AsyncEngineArgs, AsyncLLM, AsyncLLMEngine
    from pagedserve.llm import LLM, CompletionOutput, RequestOutput
    from pagedserve.sampling_params import (
        GuidedDecodingParams,
        RequestOutputKind,
        SamplingParams,
        StructuredOutputsParams,
    )


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pagedserve' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
