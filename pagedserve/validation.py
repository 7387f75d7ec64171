"""The one validation of what a client controls: the limits, the sampling parameters' ranges, prompts.

Every way in calls it before any work proportional to the input: the gateway's HTTP and gRPC APIs (with
each API's parameter names), the scheduler's Engine service for whatever reaches it, the offline `LLM`,
and the worker for each request a plan brings (a plan is input too). A refusal is an
InvalidRequestError naming the parameter: HTTP 400 in OpenAI's shape, INVALID_ARGUMENT on gRPC.

The order matters as much as the checks: a count or a length is checked before any element is looked at
(check_count, check_token_ids), a JSON body's nesting before it is parsed (check_json_depth), a text's
length before it is tokenized (check_prompt_chars).
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pagedserve.errors import InvalidRequestError
from pagedserve.structured_outputs import check_shape
from pagedserve.v1 import common_pb2

# Seeds live in uint64: any integer a client sends is taken modulo 2^64, and forks add to it there.
SEED_MODULUS = 1 << 64


@dataclass(frozen=True, slots=True)
class Limits:
    # Sequences (`n`) one request may ask for.
    max_n: int = 16
    # Alternatives per position for logprobs and prompt_logprobs.
    max_logprobs: int = 20
    # Stop strings per request, and characters per stop string (each is matched on every new token).
    max_stop_strings: int = 16
    max_stop_chars: int = 256
    # Stop token ids and logit_bias entries per request.
    max_stop_token_ids: int = 256
    max_logit_bias: int = 1024
    # Prompts in one completions request (each becomes an engine request).
    max_prompts: int = 128
    # Messages in one chat request.
    max_messages: int = 2048
    # Nesting of a JSON request body (objects and arrays).
    max_json_depth: int = 64
    # Characters of a request's cache_salt, of a client's request id and of its `user` (all are stored
    # or logged with every line of the request).
    max_cache_salt_chars: int = 256
    max_request_id_chars: int = 256
    max_user_chars: int = 256


DEFAULT_LIMITS = Limits()


def reduce_seed(seed: int) -> int:
    """A client's seed as the uint64 the engine uses (negative ones included)."""
    return seed % SEED_MODULUS


def child_seed(seed: int, offset: int) -> int:
    """The seed of the sequence `offset` places after the one seeded with `seed` (n > 1 forks)."""
    return (seed + offset) % SEED_MODULUS


def check_sampling(
    sp: common_pb2.SamplingParams,
    *,
    limits: Limits = DEFAULT_LIMITS,
    vocab_size: int | None = None,
    names: Mapping[str, str] | None = None,
) -> None:
    """Refuse values outside the documented ranges, counts over the limits, and (given vocab_size) token
    ids outside the vocabulary. `names` maps a field to the parameter the client knows it by."""
    names = names or {}

    def fail(field: str, message: str) -> None:
        param = names.get(field, field)
        raise InvalidRequestError(f"{param} {message}", param)

    # Counts first: they bound every loop below.
    check_count(len(sp.stop), limits.max_stop_strings, names.get("stop", "stop"), "strings")
    check_count(
        len(sp.stop_token_ids),
        limits.max_stop_token_ids,
        names.get("stop_token_ids", "stop_token_ids"),
        "ids",
    )
    check_count(len(sp.logit_bias), limits.max_logit_bias, names.get("logit_bias", "logit_bias"), "entries")
    if not 0 <= sp.n <= limits.max_n:
        fail("n", f"must be between 1 and {limits.max_n}, got {sp.n}")

    if sp.HasField("max_tokens") and sp.max_tokens < 1:
        fail("max_tokens", f"must be at least 1, got {sp.max_tokens}")
    if sp.HasField("max_tokens") and sp.min_tokens > sp.max_tokens:
        fail("min_tokens", f"must not exceed max_tokens ({sp.max_tokens}), got {sp.min_tokens}")
    if sp.HasField("temperature") and not 0.0 <= sp.temperature < math.inf:
        fail("temperature", f"must be a finite number >= 0, got {sp.temperature:g}")
    if sp.HasField("top_p") and not 0.0 < sp.top_p <= 1.0:
        fail("top_p", f"must be in (0, 1], got {sp.top_p:g}")
    if sp.top_k < 0:
        fail("top_k", f"must be -1 (disable), 0 (disable) or positive, got {sp.top_k}")
    if not 0.0 <= sp.min_p <= 1.0:
        fail("min_p", f"must be in [0, 1], got {sp.min_p:g}")
    if not -2.0 <= sp.presence_penalty <= 2.0:
        fail("presence_penalty", f"must be in [-2, 2], got {sp.presence_penalty:g}")
    if not -2.0 <= sp.frequency_penalty <= 2.0:
        fail("frequency_penalty", f"must be in [-2, 2], got {sp.frequency_penalty:g}")
    if sp.HasField("repetition_penalty") and not 0.0 < sp.repetition_penalty < math.inf:
        fail("repetition_penalty", f"must be a finite number > 0, got {sp.repetition_penalty:g}")
    if sp.HasField("logprobs") and sp.logprobs > limits.max_logprobs:
        fail("logprobs", f"must be between 0 and {limits.max_logprobs}, got {sp.logprobs}")
    if sp.HasField("prompt_logprobs") and sp.prompt_logprobs > limits.max_logprobs:
        fail("prompt_logprobs", f"must be between 0 and {limits.max_logprobs}, got {sp.prompt_logprobs}")
    for token_id, bias in sp.logit_bias.items():
        if not -100.0 <= bias <= 100.0:
            fail("logit_bias", f"values must be in [-100, 100], got {bias:g} for token {token_id}")
    if sp.HasField("structured_output"):
        check_shape(sp.structured_output, names.get("structured_output", "structured_output"))
    if any(not s for s in sp.stop):
        fail("stop", "must not contain empty strings")
    if any(len(s) > limits.max_stop_chars for s in sp.stop):
        fail("stop", f"strings may be at most {limits.max_stop_chars} characters long")
    if vocab_size is not None:
        if sp.logit_bias and max(sp.logit_bias) >= vocab_size:
            fail(
                "logit_bias", f"token id {max(sp.logit_bias)} is out of the vocabulary (0..{vocab_size - 1})"
            )
        if sp.stop_token_ids and max(sp.stop_token_ids) >= vocab_size:
            fail(
                "stop_token_ids",
                f"token id {max(sp.stop_token_ids)} is out of the vocabulary (0..{vocab_size - 1})",
            )


def check_count(count: int, limit: int, param: str, what: str) -> None:
    """A collection the client sends (prompts, messages, stop strings, ...) holds at most `limit` items."""
    if count > limit:
        raise InvalidRequestError(f"{param} may hold at most {limit} {what}, got {count}", param)


def check_prompt(
    token_ids: Sequence[int], *, vocab_size: int | None, max_model_len: int, param: str = "prompt"
) -> None:
    """A prompt of token ids: at least one, fewer than the context length (one token must be generated),
    each in the vocabulary. The length is checked before any id is looked at."""
    check_prompt_len(len(token_ids), max_model_len, param)
    check_token_ids(token_ids, vocab_size=vocab_size, max_len=max_model_len, param=param)


def check_prompt_len(num_tokens: int, max_model_len: int, param: str = "prompt") -> None:
    """A prompt of num_tokens tokens: at least one, and room left in the context for one more."""
    if num_tokens == 0:
        raise InvalidRequestError("the prompt is empty: it needs at least one token", param)
    if num_tokens >= max_model_len:
        raise InvalidRequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, your request has "
            f"{num_tokens} input tokens. Please reduce the length of the input.",
            param,
        )


def check_token_ids(token_ids: Sequence[int], *, vocab_size: int | None, max_len: int, param: str) -> None:
    """Token ids (a prompt, or ids to detokenize): at most max_len of them, each in the vocabulary. The
    length is checked before any id is looked at."""
    check_count(len(token_ids), max_len, param, "token ids")
    if not token_ids:
        return
    low, high = min(token_ids), max(token_ids)
    if low < 0 or (vocab_size is not None and high >= vocab_size):
        bad = low if low < 0 else high
        top = "" if vocab_size is None else f"0..{vocab_size - 1}"
        raise InvalidRequestError(f"token id {bad} is out of the vocabulary ({top})", param)


def check_prompt_chars(num_chars: int, *, max_model_len: int, max_token_chars: int, param: str) -> None:
    """A text prompt too long to fit the context whatever its tokens, refused before it is tokenized.

    A token covers at most max_token_chars characters (the tokenizer's longest piece), so a text of
    max_model_len * max_token_chars characters or more is at least max_model_len tokens. NOTE: twice that,
    since a normalizer may fold several characters into one (combining marks)."""
    limit = 2 * max_model_len * max(max_token_chars, 1)
    if num_chars >= limit:
        raise InvalidRequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, your request has "
            f"{num_chars} characters of input, more than that many tokens can hold. Please reduce the "
            "length of the input.",
            param,
        )


# What decides a JSON text's nesting: brackets outside strings. Escaped backslashes, then escaped quotes,
# then whole strings are dropped (left to right, as a parser pairs them), and the brackets left are
# counted; every pass is a C loop over the bytes, so a large body costs milliseconds, not seconds.
_STRING = re.compile(rb'"[^"]*"?')
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_STEP = [1 if b in b"[{" else -1 for b in range(256)]


def check_json_depth(body: bytes, max_depth: int) -> None:
    """Refuse a JSON text nested deeper than max_depth (objects and arrays) before it is parsed: the
    parser and everything after it recurse once per level. Nothing here recurses."""
    if body.count(b"[") + body.count(b"{") <= max_depth:
        return
    bare = _STRING.sub(b"", body.replace(b"\\\\", b"").replace(b'\\"', b""))
    brackets = bare.translate(None, _NOT_BRACKETS)
    if max(itertools.accumulate(map(_STEP.__getitem__, brackets)), default=0) > max_depth:
        raise InvalidRequestError(f"the request body is nested deeper than {max_depth} levels")


def check_max_tokens(
    prompt_len: int, sp: common_pb2.SamplingParams, *, max_model_len: int, param: str = "max_tokens"
) -> None:
    """Prompt plus max_tokens must fit the context length."""
    if sp.HasField("max_tokens") and prompt_len + sp.max_tokens > max_model_len:
        raise InvalidRequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_len + sp.max_tokens} tokens ({prompt_len} in the input, {sp.max_tokens} in the "
            "completion). Please reduce the length of the input or completion.",
            param,
        )


def check_text(value: str, *, max_chars: int, param: str) -> None:
    """A client-chosen identifier (cache_salt, request id, user): bounded, since it is stored and logged."""
    if len(value) > max_chars:
        raise InvalidRequestError(
            f"{param} may be at most {max_chars} characters long, got {len(value)}", param
        )
