"""pagedserve: an LLM inference server with a paged KV cache, continuous batching and prefix caching."""

__version__ = "0.1.0"
