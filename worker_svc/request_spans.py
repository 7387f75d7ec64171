"""The worker's OpenTelemetry span of each request: opened when the request enters (a NewRequest),
ended when it leaves (finished or preempted), with one event per step that computed its tokens.

The parent is the W3C trace context the scheduler sends in NewRequest.trace_context, so the span sits
in the same trace as the gateway's and the scheduler's. Requests without one (tracing off) cost
nothing here: no span, no per-step work.
"""

from __future__ import annotations

from dataclasses import dataclass

from opentelemetry.trace import Span, Tracer

from pagedserve.tracing import extract_context, get_tracer
from pagedserve.v1 import worker_pb2

tracer = get_tracer("pagedserve.worker")


@dataclass(slots=True)
class _Live:
    span: Span  # the request's span on this worker
    prefill_left: int  # tokens still to compute before its first sample (prompt or recomputation)
    num_decode_steps: int = 0  # steps that computed one sampled token


class RequestSpans:
    def __init__(self, tracer: Tracer = tracer) -> None:
        self.tracer = tracer
        self._live: dict[int, _Live] = {}  # slot -> its request's span

    def on_step(self, plan: worker_pb2.StepPlan, start_ns: int, end_ns: int) -> None:
        """Record a plan the runner executed (call it only for plans that were applied)."""
        if not self._live and not plan.new_requests:
            return
        for slot in plan.finished_slots:
            self._end(slot, "finished", start_ns)
        for slot in plan.preempted_slots:
            self._end(slot, "preempted", start_ns)
        for req in plan.new_requests:
            if not req.trace_context:
                continue
            span = self.tracer.start_span(
                "worker.request",
                context=extract_context(req.trace_context.items()),
                start_time=start_ns,
                attributes={
                    "request.id": req.request_id,
                    "worker.slot": req.slot,
                    "request.prompt_tokens": req.prompt_len,
                    "request.known_tokens": len(req.token_ids),
                    "request.cached_tokens": req.num_computed_tokens,
                },
            )
            self._live[req.slot] = _Live(span, len(req.token_ids) - req.num_computed_tokens)
        if not self._live:
            return
        for slot, num_tokens in zip(plan.slots, plan.num_scheduled_tokens, strict=True):
            live = self._live.get(slot)
            if live is None:
                continue
            if live.prefill_left > 0:
                live.prefill_left -= num_tokens
                name = "prefill"
            else:
                live.num_decode_steps += 1
                name = "decode"
            live.span.add_event(name, {"step.id": plan.step_id, "num_tokens": num_tokens}, end_ns)

    def end_all(self, reason: str, end_ns: int | None = None) -> None:
        """The worker forgets every request (Reset)."""
        for slot in list(self._live):
            self._end(slot, reason, end_ns)

    def _end(self, slot: int, reason: str, end_ns: int | None) -> None:
        live = self._live.pop(slot, None)
        if live is None:
            return
        live.span.set_attribute("worker.left_because", reason)
        live.span.set_attribute("worker.num_decode_steps", live.num_decode_steps)
        live.span.end(end_ns)
