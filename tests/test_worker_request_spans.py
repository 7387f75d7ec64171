"""The worker's span per request: opened when it enters, one event per step, ended when it leaves,
under the trace context the scheduler sent."""

from __future__ import annotations

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from scheduler_fakes import make_request

from pagedserve.scheduler_svc.config import SchedulerConfig
from pagedserve.scheduler_svc.plan import PlanBuilder
from pagedserve.scheduler_svc.scheduler import Scheduler
from pagedserve.v1 import worker_pb2
from pagedserve.worker_svc.request_spans import RequestSpans

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT = {"traceparent": f"00-{TRACE_ID}-b7ad6b7169203331-01"}


def _spans() -> tuple[RequestSpans, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return RequestSpans(provider.get_tracer("test")), exporter


def _plan(step_id: int, **fields) -> worker_pb2.StepPlan:
    return worker_pb2.StepPlan(step_id=step_id, **fields)


def test_a_request_span_lives_from_entering_to_finishing_under_the_schedulers_context():
    spans, exporter = _spans()
    entering = worker_pb2.NewRequest(
        slot=3, request_id="r1", token_ids=list(range(20)), prompt_len=20, trace_context=PARENT
    )
    spans.on_step(_plan(1, new_requests=[entering], slots=[3], num_scheduled_tokens=[16]), 0, 1)
    spans.on_step(_plan(2, slots=[3], num_scheduled_tokens=[4]), 1, 2)
    spans.on_step(_plan(3, slots=[3], num_scheduled_tokens=[1]), 2, 3)
    assert exporter.get_finished_spans() == ()
    spans.on_step(_plan(4, finished_slots=[3]), 3, 4)
    (span,) = exporter.get_finished_spans()
    assert span.name == "worker.request" and f"{span.context.trace_id:032x}" == TRACE_ID
    assert span.parent.span_id == int("b7ad6b7169203331", 16)
    assert [e.name for e in span.events] == ["prefill", "prefill", "decode"]
    assert span.attributes["request.id"] == "r1" and span.attributes["worker.left_because"] == "finished"


def test_requests_without_trace_context_get_no_span_and_preemption_ends_one():
    spans, exporter = _spans()
    plain = worker_pb2.NewRequest(slot=0, request_id="plain", token_ids=[1, 2], prompt_len=2)
    traced = worker_pb2.NewRequest(
        slot=1, request_id="traced", token_ids=[1, 2], prompt_len=2, trace_context=PARENT
    )
    spans.on_step(_plan(1, new_requests=[plain, traced], slots=[0, 1], num_scheduled_tokens=[2, 2]), 0, 1)
    spans.on_step(_plan(2, preempted_slots=[1], finished_slots=[0]), 1, 2)
    (span,) = exporter.get_finished_spans()
    assert span.attributes["request.id"] == "traced"
    assert span.attributes["worker.left_because"] == "preempted"


def test_the_plan_hands_the_requests_trace_context_to_the_worker():
    scheduler = Scheduler(SchedulerConfig(num_blocks=16, block_size=4, max_model_len=64))
    request = make_request("r1", list(range(6)), max_tokens=4)
    request.trace_context = dict(PARENT)
    scheduler.add_request(request)
    plan = PlanBuilder().build(scheduler.schedule()).plan
    assert dict(plan.new_requests[0].trace_context) == PARENT
