"""Structured outputs in the scheduler: compiling constraints against the model's tokenizer, and the token
masks of each step's constrained rows.

A constraint (common_pb2.StructuredOutput) compiles to an llguidance matcher over the model's vocabulary.
Compiling runs in a small thread pool (llguidance drops the GIL while it builds a grammar) under a time
limit: a compile past it fails its request alone, and the scheduler's loop never waits on one. The thread
of an abandoned compile runs on to its end, which llguidance's fuel limits (PARSER_LIMITS) bound. Compiled
grammars are cached by the hash of (kind, spec), least recently used out first; each sequence gets its
own matcher, a copy of the cached one (a copy shares the compiled grammar and costs microseconds).

Each step, the scheduler asks for the masks of the constrained rows that sample (fill_masks): one packed
bit per token of the vocabulary, in llguidance's layout, which is the plan's (worker.proto token_masks).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import llguidance
import numpy as np
from llguidance.numpy import fill_next_token_bitmask, fill_next_token_bitmask_par

from pagedserve.errors import InvalidRequestError
from pagedserve.structured_outputs import grammar_text, kind_of, one_line, parser_limits
from pagedserve.v1 import common_pb2


class Grammar:
    """One compiled constraint: the template its sequences' matchers are copied from."""

    __slots__ = ("_template", "description", "vocab_size")

    def __init__(self, template: llguidance.LLMatcher, description: str, vocab_size: int):
        self._template = template
        # For errors: "json schema", "regex", ...
        self.description = description
        # Tokens its masks cover (the model's logits' width).
        self.vocab_size = vocab_size

    def matcher(self, output_token_ids: Sequence[int] = ()) -> llguidance.LLMatcher:
        """A fresh matcher for one sequence, fed the tokens it has generated already (a sequence resumed on
        another worker); ValueError if the grammar refuses them."""
        matcher = self._template.deep_copy()
        if output_token_ids and not matcher.consume_tokens(list(output_token_ids)):
            raise ValueError(
                f"the {self.description} refuses the tokens already generated: {matcher_error(matcher)}"
            )
        return matcher


def matcher_error(matcher: llguidance.LLMatcher) -> str:
    return one_line(matcher.get_error())


def load_tokenizer(
    model_dir: Path | str, vocab_size: int, eos_token_ids: Sequence[int]
) -> llguidance.LLTokenizer:
    """llguidance's tokenizer for the model: its tokenizer.json (the Rust tokenizers library reads it; no
    transformers, no torch), over the model's vocab_size (the width of its logits; a mask covers it) and
    its end-of-sequence tokens."""
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{model_dir} has no tokenizer.json: structured outputs need one")
    return llguidance.LLTokenizer(path.read_text(), n_vocab=vocab_size, eos_token=sorted(eos_token_ids))


class GrammarCompiler:
    """Compiles constraints for one tokenizer: off the caller's thread, bounded in time, cached."""

    def __init__(
        self,
        tokenizer: llguidance.LLTokenizer,
        *,
        timeout: float = 10.0,
        max_workers: int = 2,
        cache_size: int = 256,
    ):
        self.tokenizer = tokenizer
        self.timeout = timeout
        self.cache_size = cache_size
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers, thread_name_prefix="grammar-compile")
        # (kind, sha256 of the spec) -> the compile's future (done or running), least recently used first.
        self._cache: OrderedDict[tuple[str, bytes], concurrent.futures.Future[Grammar]] = OrderedDict()
        self._lock = threading.Lock()
        # Compiles that ran past the timeout, ever.
        self.num_timeouts = 0

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def _future(self, so: common_pb2.StructuredOutput, param: str) -> concurrent.futures.Future[Grammar]:
        kind = kind_of(so)
        assert kind is not None, "no constraint to compile"
        key = (kind, hashlib.sha256(so.SerializeToString(deterministic=True)).digest())
        with self._lock:
            future = self._cache.get(key)
            if future is not None and not (future.done() and future.exception() is not None):
                self._cache.move_to_end(key)
                return future
            # NOTE: the grammar text is built here (cheap, and its errors are the client's) so that only
            # the compile itself goes to the pool.
            text = grammar_text(so, param)
            future = self._pool.submit(self._compile, text, kind.replace("_", " "), param)
            self._cache[key] = future
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            return future

    def _compile(self, text: str, what: str, param: str) -> Grammar:
        matcher = llguidance.LLMatcher(self.tokenizer, text, log_level=0, limits=parser_limits())
        if matcher.is_error():
            raise InvalidRequestError(f"{param}: {matcher_error(matcher)}", param)
        return Grammar(matcher, what, self.tokenizer.vocab_size)

    def _timed_out(self, param: str) -> InvalidRequestError:
        self.num_timeouts += 1
        return InvalidRequestError(
            f"{param}: compiling the constraint took longer than {self.timeout:g} s; simplify it", param
        )

    async def compile(self, so: common_pb2.StructuredOutput, param: str = "structured_output") -> Grammar:
        """The compiled constraint, awaited without blocking the loop; InvalidRequestError naming param if
        it does not compile or takes longer than the timeout (the compile is abandoned, not waited for)."""
        future = self._future(so, param)
        try:
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), self.timeout)
        except TimeoutError:
            raise self._timed_out(param) from None

    def compile_sync(self, so: common_pb2.StructuredOutput, param: str = "structured_output") -> Grammar:
        """compile() for a caller without an event loop (the offline LLM)."""
        try:
            return self._future(so, param).result(self.timeout)
        except concurrent.futures.TimeoutError:
            raise self._timed_out(param) from None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class MaskFiller:
    """Fills the token masks of a step's constrained rows: one row of ceil(vocab_size / 32) int32 words each."""

    def __init__(self, vocab_size: int, num_threads: int | None = None):
        self.num_words = (vocab_size + 31) // 32
        self._executor: llguidance.LLExecutor | None = None
        self._num_threads = num_threads

    def fill(self, matchers: Sequence[llguidance.LLMatcher]) -> np.ndarray:
        """int32 [len(matchers), num_words]: bit j of word i set when token 32 i + j is allowed next. A matcher
        in an error state allows only end-of-sequence tokens, and refuses them when they come back."""
        masks = np.empty((len(matchers), self.num_words), dtype=np.int32)
        if len(matchers) == 1:
            fill_next_token_bitmask(matchers[0], masks, 0)
            return masks
        if self._executor is None:
            self._executor = llguidance.LLExecutor(self._num_threads)
        # NOTE: the rows in parallel on llguidance's own threads, with the GIL dropped.
        fill_next_token_bitmask_par(self._executor, [(m, i) for i, m in enumerate(matchers)], masks)
        return masks
