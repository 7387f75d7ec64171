"""Why a sequence ended, in the one vocabulary every layer shares: the wire's FinishReason codes and the
names OpenAI and vLLM use ("stop", "length", "abort")."""

from __future__ import annotations

from collections.abc import Iterable

from pagedserve.v1 import common_pb2

# FinishReason code -> its name; FINISH_REASON_UNSPECIFIED (still running) has none.
NAMES: dict[int, str] = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
    # The gateway's, for a sequence that called tools; the engine never ends one so.
    common_pb2.FINISH_REASON_TOOL_CALLS: "tool_calls",
}
# Name -> FinishReason code.
CODES: dict[str, int] = {name: code for code, name in NAMES.items()}
# The request's reason when its sequences ended differently, for the counters: abort over length over stop.
_RANK = {
    common_pb2.FINISH_REASON_ABORT: 3,
    common_pb2.FINISH_REASON_LENGTH: 2,
    common_pb2.FINISH_REASON_STOP: 1,
}


def name_of(code: int) -> str | None:
    """The name of a FinishReason code, or None while the sequence runs."""
    return NAMES.get(code)


def code_of(name: str | None) -> int:
    """The FinishReason code of a name; FINISH_REASON_UNSPECIFIED for None (still running)."""
    return common_pb2.FINISH_REASON_UNSPECIFIED if name is None else CODES[name]


def request_reason(codes: Iterable[int]) -> str:
    """The finish reason of a request whose sequences ended with these codes."""
    return NAMES[max(codes, key=lambda code: _RANK.get(code, 0))]
