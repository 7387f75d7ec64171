"""The core both public APIs share: prompts as token ids in, per-choice text deltas out.

One engine request per prompt (its n sequences are forked by the engine), so a list of prompts runs
concurrently; choice indices are prompt_index * n + j, as in OpenAI and vLLM. Text is made here:
incremental detokenization, then stop strings. A sequence that hits a stop string is finished at once
and aborted at the engine on its own (its siblings go on); when every sequence of a request is
finished the request is aborted at the engine.

Both APIs build a request the same way, in this order, so that nothing proportional to the input runs
before the limits have been checked: check_sampling (counts, ranges, n), then the prompts' texts are
bounded by their length and tokenized (encode / render_chat, on threads), then build (each prompt's
token ids by length first, then by value; max_tokens against the context).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from opentelemetry import trace
from opentelemetry.context import Context

from pagedserve import finish_reasons
from pagedserve.errors import ModelNotFoundError, RequestTimeoutError, UnavailableError
from pagedserve.logging import get_logger
from pagedserve.structured_outputs import check_structured_output
from pagedserve.v1 import common_pb2, engine_pb2
from pagedserve.validation import (
    DEFAULT_LIMITS,
    Limits,
    check_count,
    check_max_tokens,
    check_prompt,
    check_prompt_chars,
    check_sampling,
    check_token_ids,
)

from .engine_client import EngineClient
from .tokenization import IncrementalDetokenizer, SequenceText, StopStringMatcher, Tokenizer

log = get_logger(__name__)
tracer = trace.get_tracer(__name__)

# How long to wait, after aborting a request whose sequences all hit stop strings, for the engine's
# last message (it carries the cached-prompt-token count). A step is far shorter.
DRAIN_TIMEOUT_S = 0.25
# Threads that tokenize and render chat templates. NOTE: both take time proportional to the input, so
# they run off the event loop (the Rust tokenizer releases the GIL while it works; Jinja is Python and
# shares the GIL by the interpreter's switch interval). Incremental detokenization stays on the loop:
# about 5 us a token on the 2-core Zen 4, less than the loop's own work per streamed token.
TOKENIZER_THREADS = 4

T = TypeVar("T")


def new_request_id(prefix: str, tenant_tag: str = "") -> str:
    """A new request's id, the gateway's own and unique: a uuid, then the tenant's tag (ApiKeys.tag) so
    that every service's logs show whose request it is. It is the id of the OpenAI response and the
    engine's id alike, so one id follows the request through every service.

    A client's own id (vLLM's `request_id`, `x-request-id`, gRPC's request_id) never reaches the engine:
    a tenant reusing an id, or two tenants choosing the same one, would otherwise share an engine
    request, and an abort sent late for an old request would end the new one. It is logged beside the
    request's id, and echoed where the API says so (gRPC's GenerateResponse.request_id).

    The prefix is OpenAI's (`chatcmpl-`, `cmpl-`); one that ends in "_" (the Responses API's `resp_`)
    carries its own separator.
    """
    uid = uuid.uuid4().hex
    head = f"{prefix}{uid}" if prefix.endswith("_") else f"{prefix}-{uid}"
    return f"{head}-{tenant_tag}" if tenant_tag else head


@dataclass(slots=True)
class ModelInfo:
    name: str  # the name clients pass as `model`
    max_model_len: int  # context length in tokens (the engine's value once it has been asked)
    eos_token_ids: tuple[int, ...]  # tokens that end a sequence unless ignore_eos
    created: int = field(default_factory=lambda: int(time.time()))  # Unix time the gateway started


@dataclass(slots=True)
class Prompt:
    token_ids: list[int]  # what the engine gets
    text: str | None = None  # the prompt as text (given or rendered), for echo; None: decode token_ids


@dataclass(slots=True)
class GenerationRequest:
    request_id: str  # the client-visible id (the response's id)
    engine_id: str  # the engine's id, the gateway's own (new_request_id); per prompt "<id>-<index>"
    prompts: list[Prompt]  # one engine request each
    sampling: list[common_pb2.SamplingParams]  # per prompt: validated, max_tokens filled in
    cache_salt: str = ""  # prefix-cache partition
    priority: int = 0  # lower runs first
    trace_context: Context | None = None  # parent of the request's span (from the caller's metadata)
    deadline: float | None = None  # event-loop time by which it must be done (then aborted); None: never

    @property
    def n(self) -> int:
        return self.sampling[0].n or 1


@dataclass(slots=True)
class ChoiceDelta:
    index: int  # choice index: prompt_index * n + sequence index
    prompt_index: int  # which prompt it continues
    text: str  # new text (stop strings applied)
    token_ids: list[int]  # new token ids (all of them, including a stop token)
    logprobs: list[common_pb2.TokenLogprob]  # parallel to token_ids when logprobs were requested
    finish_reason: str | None = None  # "stop" | "length" | "abort" on the choice's last delta
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    prompt_logprobs: list[common_pb2.TokenLogprob] | None = None  # on a choice's first delta, if asked


@dataclass(slots=True)
class UsageInfo:
    prompt_tokens: int = 0  # over all prompts
    completion_tokens: int = 0  # over all choices, up to their stop
    cached_tokens: int = 0  # prompt tokens served by the prefix cache (when the engine reported it)

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class _Choice:
    """One sequence's text state: detokenizer, stop strings, counts."""

    __slots__ = ("done", "engine_done", "index", "num_tokens", "sent_prompt_logprobs", "text")

    def __init__(self, index: int, text: SequenceText):
        self.index = index
        self.text = text
        self.num_tokens = 0
        self.done = False  # finished for the client
        self.engine_done = False  # finished at the engine
        self.sent_prompt_logprobs = False


class GenerationCore:
    def __init__(
        self,
        engine: EngineClient | None,
        tokenizer: Tokenizer,
        model: ModelInfo,
        limits: Limits = DEFAULT_LIMITS,
        request_timeout: float = 0.0,
    ):
        self.engine = engine
        self.tokenizer = tokenizer
        self.model = model
        self.limits = limits  # what a client may send (the gateway's flags: --max-n, --max-prompts, ...)
        self.request_timeout = request_timeout  # seconds a request may take (--request-timeout); 0: no limit
        self._threads = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="tokenizer")

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)

    # ---- building a request: every check happens here, before anything is sent ----

    def deadline(self, time_remaining: float | None = None) -> float | None:
        """The event-loop time by which a request arriving now must be done: --request-timeout, or the
        caller's own deadline (gRPC) when that is sooner. None: no limit."""
        limits = [t for t in (self.request_timeout or None, time_remaining) if t is not None]
        return asyncio.get_running_loop().time() + min(limits) if limits else None

    def check_model(self, name: str | None) -> None:
        if name and name != self.model.name:
            raise ModelNotFoundError(name)

    def check_sampling(self, sp: common_pb2.SamplingParams, names: dict[str, str] | None = None) -> None:
        """The sampling parameters' counts, ranges and n against the gateway's limits: the one check both
        APIs make, before any prompt is tokenized. A structured-output constraint must compile (bounded by
        llguidance's fuel limits; the scheduler compiles it again against the tokenizer)."""
        check_sampling(sp, limits=self.limits, vocab_size=self.tokenizer.vocab_size, names=names)
        if sp.HasField("structured_output"):
            param = (names or {}).get("structured_output", "structured_output")
            check_structured_output(sp.structured_output, param)

    def check_token_ids(self, token_ids: list[int], param: str) -> None:
        """Token ids to detokenize: as many as a context holds, each in the vocabulary."""
        check_token_ids(
            token_ids, vocab_size=self.tokenizer.vocab_size, max_len=self.model.max_model_len, param=param
        )

    async def encode(
        self, text: str, deadline: float | None, *, add_special_tokens: bool = True, param: str = "prompt"
    ) -> list[int]:
        """A text's token ids, tokenized off the event loop once its length could fit the context."""
        check_prompt_chars(
            len(text),
            max_model_len=self.model.max_model_len,
            max_token_chars=self.tokenizer.max_token_chars,
            param=param,
        )
        return await self._off_loop(deadline, self.tokenizer.encode, text, add_special_tokens)

    async def render_chat(
        self,
        messages: list[dict],
        deadline: float | None,
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
    ) -> str:
        """The chat template applied to messages (bounded in number) and tools, off the event loop."""
        check_count(len(messages), self.limits.max_messages, "messages", "messages")
        return await self._off_loop(
            deadline, self.tokenizer.render_chat, messages, add_generation_prompt, tools
        )

    async def encode_chat(
        self,
        messages: list[dict],
        deadline: float | None,
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
    ) -> Prompt:
        text = await self.render_chat(messages, deadline, add_generation_prompt, tools)
        # The rendered template already holds the special tokens (BOS and the role markers).
        ids = await self.encode(text, deadline, add_special_tokens=False, param="messages")
        return Prompt(ids, text)

    async def decode(
        self, token_ids: list[int], deadline: float | None, skip_special_tokens: bool = True
    ) -> str:
        """Token ids (checked by check_token_ids) as text, off the event loop."""
        return await self._off_loop(deadline, self.tokenizer.decode, token_ids, skip_special_tokens)

    async def _off_loop(self, deadline: float | None, fn: Callable[..., T], *args: Any) -> T:
        return await self.by_deadline(
            deadline, asyncio.get_running_loop().run_in_executor(self._threads, fn, *args)
        )

    async def by_deadline(self, deadline: float | None, work: Awaitable[T]) -> T:
        """The result of work, or RequestTimeoutError once the deadline passes (work is cancelled)."""
        try:
            async with asyncio.timeout_at(deadline):
                return await work
        except TimeoutError:
            raise self._timed_out() from None

    def _timed_out(self) -> RequestTimeoutError:
        return RequestTimeoutError("the request did not finish in time; it was aborted", code="timeout")

    def sampling_for_prompt(
        self, sp: common_pb2.SamplingParams, prompt_len: int, max_tokens_param: str = "max_tokens"
    ) -> common_pb2.SamplingParams:
        """A copy of sp for one prompt, max_tokens defaulting to what the context has left."""
        out = common_pb2.SamplingParams()
        out.CopyFrom(sp)
        limit = self.model.max_model_len
        if not out.HasField("max_tokens"):
            out.max_tokens = limit - prompt_len
        check_max_tokens(prompt_len, out, max_model_len=limit, param=max_tokens_param)
        return out

    def build(
        self,
        prompts: list[Prompt],
        sp: common_pb2.SamplingParams,
        *,
        request_id: str,
        engine_id: str,
        param: str = "prompt",
        max_tokens_param: str = "max_tokens",
        cache_salt: str = "",
        priority: int = 0,
        trace_context: Context | None = None,
        deadline: float | None = None,
    ) -> GenerationRequest:
        """The request to run, from sampling parameters that check_sampling passed and tokenized prompts."""
        check_count(len(prompts), self.limits.max_prompts, param, "prompts")
        for prompt in prompts:
            check_prompt(
                prompt.token_ids,
                vocab_size=self.tokenizer.vocab_size,
                max_model_len=self.model.max_model_len,
                param=param,
            )
        sampling = [self.sampling_for_prompt(sp, len(p.token_ids), max_tokens_param) for p in prompts]
        return GenerationRequest(
            request_id, engine_id, prompts, sampling, cache_salt, priority, trace_context, deadline
        )

    # ---- running it ----

    async def generate(self, req: GenerationRequest) -> AsyncIterator[ChoiceDelta | UsageInfo]:
        """Choice deltas as they come, then one UsageInfo (the last item)."""
        if self.engine is None:
            raise UnavailableError("no engine is connected")
        span = tracer.start_span(
            "pagedserve.gateway.generate",
            context=req.trace_context,
            attributes={"pagedserve.request_id": req.engine_id, "pagedserve.num_prompts": len(req.prompts)},
        )
        ctx = trace.set_span_in_context(span, req.trace_context)
        usage = UsageInfo()
        start = time.perf_counter()
        reasons: dict[str, int] = {}
        items = self._merged(req, ctx)
        try:
            while True:
                try:
                    # NOTE: the deadline covers each wait for the engine, never a yield: the time the
                    # consumer holds an item is not ours to cancel. On expiry the cancellation runs the
                    # finally blocks below us, which cancel the engine call and abort the request.
                    async with asyncio.timeout_at(req.deadline):
                        item = await anext(items)
                except StopAsyncIteration:
                    break
                except TimeoutError:
                    log.info("request timed out", seconds=round(time.perf_counter() - start, 4))
                    raise self._timed_out() from None
                if isinstance(item, UsageInfo):
                    usage.prompt_tokens += item.prompt_tokens
                    usage.completion_tokens += item.completion_tokens
                    usage.cached_tokens += item.cached_tokens
                    continue
                if item.finish_reason is not None:
                    reasons[item.finish_reason] = reasons.get(item.finish_reason, 0) + 1
                yield item
            span.set_attribute("pagedserve.completion_tokens", usage.completion_tokens)
            log.info(
                "request finished",
                prompt_tokens=usage.prompt_tokens,
                completion_tokens=usage.completion_tokens,
                cached_tokens=usage.cached_tokens,
                finish_reasons=reasons,
                seconds=round(time.perf_counter() - start, 4),
            )
            yield usage
        except BaseException as error:
            span.record_exception(error)
            if isinstance(error, asyncio.CancelledError | GeneratorExit):
                log.info("request cancelled", seconds=round(time.perf_counter() - start, 4))
            raise
        finally:
            await items.aclose()
            span.end()

    async def _merged(self, req: GenerationRequest, ctx: Context) -> AsyncIterator[ChoiceDelta | UsageInfo]:
        if len(req.prompts) == 1:
            async for item in self._run_prompt(req, 0, ctx):
                yield item
            return
        # Several prompts: one task each, merged through a queue.
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(i: int) -> None:
            try:
                async for item in self._run_prompt(req, i, ctx):
                    queue.put_nowait(item)
                queue.put_nowait(done)
            except Exception as error:
                queue.put_nowait(error)

        tasks = [asyncio.create_task(pump(i)) for i in range(len(req.prompts))]
        try:
            remaining = len(tasks)
            while remaining:
                item = await queue.get()
                if item is done:
                    remaining -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _run_prompt(
        self, req: GenerationRequest, prompt_index: int, ctx: Context
    ) -> AsyncIterator[ChoiceDelta | UsageInfo]:
        assert self.engine is not None
        prompt, sp = req.prompts[prompt_index], req.sampling[prompt_index]
        n = sp.n or 1
        engine_id = req.engine_id if len(req.prompts) == 1 else f"{req.engine_id}-{prompt_index}"
        engine_sp = common_pb2.SamplingParams()
        engine_sp.CopyFrom(sp)
        del engine_sp.stop[:]  # stop strings are the gateway's business
        request = engine_pb2.GenerateTokensRequest(
            request_id=engine_id,
            prompt_token_ids=prompt.token_ids,
            sampling=engine_sp,
            cache_salt=req.cache_salt,
            priority=req.priority,
        )
        stop_ids = frozenset(sp.stop_token_ids) | frozenset(self.model.eos_token_ids)
        skip_special = sp.skip_special_tokens if sp.HasField("skip_special_tokens") else True
        choices = [
            _Choice(
                prompt_index * n + j,
                SequenceText(
                    IncrementalDetokenizer(self.tokenizer, prompt.token_ids, skip_special),
                    StopStringMatcher(sp.stop, sp.include_stop_str_in_output),
                    stop_ids,
                ),
            )
            for j in range(n)
        ]
        prompt_logprobs: list[common_pb2.TokenLogprob] | None = None
        cached_tokens, usage_seen = 0, False
        stream = self.engine.generate(request, ctx)
        try:
            async for msg in stream:
                if msg.prompt_logprobs:
                    prompt_logprobs = list(msg.prompt_logprobs)
                if msg.HasField("usage"):
                    cached_tokens, usage_seen = msg.usage.cached_prompt_tokens, True
                if msg.index >= n:
                    raise UnavailableError(f"the engine sent sequence {msg.index} of a request with n={n}")
                choice = choices[msg.index]
                choice.engine_done = msg.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
                if not choice.done:
                    delta = self._consume(choice, msg, sp)
                    if not choice.sent_prompt_logprobs and prompt_logprobs is not None:
                        delta.prompt_logprobs = prompt_logprobs
                        choice.sent_prompt_logprobs = True
                    if delta.text or delta.token_ids or delta.finish_reason:
                        yield delta
                    if choice.done and not choice.engine_done and not all(c.done for c in choices):
                        # A stop string ended this sequence only: abort just it, so its blocks are
                        # freed now while its siblings go on.
                        self.engine.abort_soon(engine_id, msg.index)
                if all(c.done for c in choices):
                    break
            for choice in choices:  # the stream ended without finishing them: the engine gave up
                if not choice.done:
                    choice.done = True
                    yield ChoiceDelta(
                        choice.index, prompt_index, choice.text.stopper.flush(), [], [], "abort"
                    )
            if not all(c.engine_done for c in choices):
                # Every sequence hit a stop string: free the engine's blocks now, then give its last
                # message (with the cached-token count) a moment to arrive.
                await self.engine.abort(engine_id)
                cached_tokens = await _drain_usage(stream, cached_tokens)
            else:
                # Read the stream to its end (the engine closes it right after the last message) so that
                # closing it below does not count as a client abort.
                cached_tokens = await _drain_usage(stream, cached_tokens) if not usage_seen else cached_tokens
                await _drain_usage(stream, cached_tokens)
        finally:
            await stream.aclose()
        yield UsageInfo(len(prompt.token_ids), sum(c.num_tokens for c in choices), cached_tokens)

    def _consume(
        self, choice: _Choice, msg: engine_pb2.GenerateTokensResponse, sp: common_pb2.SamplingParams
    ) -> ChoiceDelta:
        finish = finish_reasons.name_of(msg.finish_reason)
        token_ids = list(msg.token_ids)
        # The token that stopped the sequence is counted and returned even when its text is hidden.
        text, used, matched = choice.text.add(token_ids, finish)
        choice.num_tokens += used
        stop_reason: str | int | None = None
        if matched is not None:
            finish, stop_reason = "stop", matched
        elif finish is not None and msg.HasField("stop_token_id") and msg.stop_token_id in sp.stop_token_ids:
            stop_reason = msg.stop_token_id
        if finish is not None:
            choice.done = True
        logprobs = list(msg.logprobs[:used]) if msg.logprobs else []
        return ChoiceDelta(
            choice.index,
            choice.index // (sp.n or 1),
            text,
            token_ids[:used],
            logprobs,
            finish,
            stop_reason,
        )


async def _drain_usage(stream: AsyncIterator[engine_pb2.GenerateTokensResponse], cached_tokens: int) -> int:
    async def drain() -> int:
        found = cached_tokens
        async for msg in stream:
            if msg.HasField("usage"):
                found = msg.usage.cached_prompt_tokens
        return found

    try:
        return await asyncio.wait_for(drain(), DRAIN_TIMEOUT_S)
    except Exception:  # TimeoutError included: the stream's usage never came in time
        return cached_tokens
