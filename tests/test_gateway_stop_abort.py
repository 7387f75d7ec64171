"""The gateway's generation core against a scripted engine: what it aborts when stop strings match."""

from __future__ import annotations

import pytest

from pagedserve.gateway.generation import GenerationCore, GenerationRequest, ModelInfo, Prompt, UsageInfo
from pagedserve.v1 import common_pb2, engine_pb2

pytestmark = pytest.mark.anyio


class ScriptedEngine:
    """Streams the given messages, records aborts (the real client sends them over gRPC)."""

    def __init__(self, messages: list[engine_pb2.GenerateTokensResponse]) -> None:
        self.messages = messages
        self.aborts: list[tuple[str, int | None]] = []

    async def generate(self, request, trace_context=None):
        for message in self.messages:
            yield message

    def abort_soon(self, request_id: str, index: int | None = None) -> None:
        self.aborts.append((request_id, index))

    async def abort(self, request_id: str, index: int | None = None) -> bool:
        self.aborts.append((request_id, index))
        return True


async def test_stop_string_in_one_of_n_sequences_aborts_only_that_sequence(tokenizer):
    stop_ids = tokenizer.encode(" STOP")  # what sequence 1 generates first
    go_ids = tokenizer.encode(" go on")
    messages = [
        engine_pb2.GenerateTokensResponse(request_id="r", index=1, token_ids=stop_ids),
        engine_pb2.GenerateTokensResponse(request_id="r", index=0, token_ids=go_ids),
        engine_pb2.GenerateTokensResponse(
            request_id="r", index=1, finish_reason=common_pb2.FINISH_REASON_ABORT
        ),
        engine_pb2.GenerateTokensResponse(
            request_id="r",
            index=0,
            token_ids=go_ids,
            finish_reason=common_pb2.FINISH_REASON_LENGTH,
            usage=common_pb2.Usage(prompt_tokens=3),
        ),
    ]
    engine = ScriptedEngine(messages)
    core = GenerationCore(engine, tokenizer, ModelInfo("m", 2048, (0,)))
    sampling = common_pb2.SamplingParams(n=2, max_tokens=16, stop=["STOP"])
    request = GenerationRequest("cmpl-r", "r", [Prompt([5, 6, 7])], [sampling])
    deltas = [d async for d in core.generate(request) if not isinstance(d, UsageInfo)]
    finish = {d.index: d.finish_reason for d in deltas if d.finish_reason}
    assert finish == {0: "length", 1: "stop"}
    assert engine.aborts == [("r", 1)]  # just the stopped sequence; the request ended on its own
