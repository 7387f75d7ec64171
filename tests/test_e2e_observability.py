"""Observability of the whole stack, on a small stack of its own: a KV pool of 12 blocks and at most
two running requests (so requests wait and get preempted), traces exported to stdout
(OTEL_TRACES_EXPORTER=console) and info-level JSON logs captured from every process.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import openai
import pytest
from stack_testing import MODEL, Stack, running, wait_for

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
SERVICES = {"pagedserve-gateway", "pagedserve-scheduler", "pagedserve-worker"}


@pytest.fixture(scope="module")
def stack(default_model_dir, tmp_path_factory):
    args = ["--dtype", "float32", "--num-blocks", "12", "--max-num-seqs", "2", "--log-level", "info"]
    env = {"OTEL_TRACES_EXPORTER": "console", "OTEL_BSP_SCHEDULE_DELAY": "100"}
    log_dir = tmp_path_factory.mktemp("observability-logs")
    with running(Stack(default_model_dir, log_dir, serve_args=args, env=env)) as s:
        s.client = openai.OpenAI(base_url=s.openai_base_url, api_key="unused", max_retries=0, timeout=600)
        yield s


def _spans(path: Path) -> list[dict]:
    """The spans the console exporter wrote: pretty-printed JSON objects, one after another."""
    text, decoder, spans, i = path.read_text(), json.JSONDecoder(), [], 0
    while (start := text.find("{", i)) >= 0:
        try:
            obj, i = decoder.raw_decode(text, start)
        except json.JSONDecodeError:
            i = start + 1
            continue
        if isinstance(obj, dict) and "context" in obj and "name" in obj:
            spans.append(obj)
    return spans


def _log_lines(path: Path) -> list[dict]:
    lines = []
    for line in path.read_text().splitlines():
        if line.startswith("{"):
            lines.append(json.loads(line))
    return lines


def test_one_request_has_spans_in_gateway_scheduler_and_worker_in_one_trace(stack: Stack):
    response = stack.client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=8, temperature=0
    )

    def request_spans() -> list[dict] | None:
        spans = _spans(stack.stdout_path)
        mine = [s for s in spans if response.id in json.dumps(s["attributes"])]
        if not {s["resource"]["attributes"]["service.name"] for s in mine} >= SERVICES:
            return None
        trace_ids = {s["context"]["trace_id"] for s in mine}
        assert len(trace_ids) == 1, trace_ids
        return [s for s in spans if s["context"]["trace_id"] in trace_ids]

    spans = wait_for(request_spans)
    by_name = {s["name"]: s for s in spans}
    gateway = by_name["pagedserve.gateway.generate"]
    scheduler = by_name["scheduler.generate"]
    worker = by_name["worker.request"]
    assert scheduler["parent_id"] == gateway["context"]["span_id"]
    assert worker["parent_id"] == scheduler["context"]["span_id"]
    assert worker["resource"]["attributes"]["service.name"] == "pagedserve-worker"
    assert worker["attributes"]["request.id"] == response.id
    assert worker["attributes"]["worker.left_because"] == "finished"
    events = [e["name"] for e in worker["events"]]
    assert events[0] == "prefill" and events.count("decode") == response.usage.completion_tokens - 1
    # The caller's own trace context (W3C traceparent header) becomes the parent.
    trace_id = "0af7651916cd43dd8448eb211c80319c"
    stack.client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        max_tokens=2,
        extra_headers={"traceparent": f"00-{trace_id}-b7ad6b7169203331-01"},
    )

    def caller_trace() -> set[str] | None:
        services = {
            s["resource"]["attributes"]["service.name"]
            for s in _spans(stack.stdout_path)
            if s["context"]["trace_id"] == f"0x{trace_id}"
        }
        return services if services >= SERVICES else None

    wait_for(caller_trace)


def test_log_lines_about_a_request_carry_its_id(stack: Stack):
    response = stack.client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        max_tokens=4,
        user="e2e-log-user",
        extra_headers={"x-request-id": "e2e-log-42"},
    )

    def lines_of_request() -> list[dict] | None:
        lines = [line for line in _log_lines(stack.stderr_path) if response.id in json.dumps(line)]
        services = {line["service"] for line in lines}
        return lines if {"gateway", "scheduler"} <= services else None

    lines = wait_for(lines_of_request)
    for line in lines:
        assert line.get("request_id") == response.id, line
        assert line["level"] and line["timestamp"] and line["event"]
    gateway = [line for line in lines if line["service"] == "gateway"]
    assert all(line["client_request_id"] == "e2e-log-42" for line in gateway)
    assert all(line["user"] == "e2e-log-user" for line in gateway)


def test_waiting_running_and_preemptions_show_in_metrics(stack: Stack):
    stack.wait_idle()
    before = stack.scrape()
    prompt = "Count from one to one hundred: one, two, three,"
    results: list = []

    def run() -> None:
        results.append(
            stack.client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=100, temperature=0, extra_body={"ignore_eos": True}
            )
        )

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    seen = {"running": 0.0, "waiting": 0.0, "usage": 0.0}
    while any(t.is_alive() for t in threads):
        now = stack.scrape()
        seen["running"] = max(seen["running"], now["vllm:num_requests_running"])
        seen["waiting"] = max(seen["waiting"], now["vllm:num_requests_waiting"])
        seen["usage"] = max(seen["usage"], now["vllm:kv_cache_usage_perc"])
        time.sleep(0.1)
    for t in threads:
        t.join()
    after = stack.scrape()
    assert seen["running"] == 2 and seen["waiting"] >= 1 and seen["usage"] > 0.5
    # 2 x (about 12 + 100 tokens) do not fit 12 blocks of 16: somebody was preempted and recomputed,
    # and nobody lost or repeated a token.
    assert after["vllm:num_preemptions_total"] > before["vllm:num_preemptions_total"]
    assert [r.usage.completion_tokens for r in results] == [100] * 4
    assert len({r.choices[0].text for r in results}) == 1
    assert after["vllm:num_requests_running"] == 0 and after["vllm:num_requests_waiting"] == 0
    assert after["vllm:kv_cache_usage_perc"] == 0


def test_bench_serve_prints_how_long_the_worker_waited_between_steps(
    stack: Stack, default_model_dir, tmp_path, capsys
):
    from pagedserve.bench import main as bench_main

    stack.wait_idle()
    before = stack.scrape()
    code = bench_main(
        ["serve", "--base-url", stack.http_url, "--tokenizer", str(default_model_dir),
         "--dataset-name", "random", "--random-input-len", "16", "--random-output-len", "8",
         "--num-prompts", "2", "--disable-tqdm", "--save-result", "--result-dir", str(tmp_path),
         "--result-filename", "run.json"]
    )  # fmt: skip
    assert code == 0
    out = capsys.readouterr().out
    assert "worker between forward passes: " in out and "of the step (forward pass " in out
    assert (
        "idle waiting for a plan, the next step's inputs " in out
        and "with nothing to schedule left out" in out
    )
    worker = json.loads((tmp_path / "run.json").read_text())["passes"][0]["worker"]
    assert worker is not None, "the stack's /metrics lacks a pagedserve:worker_* counter"
    # Two requests of 8 tokens take at least 8 steps; the counters behind it are /metrics' own.
    assert worker["steps"] >= 8 and worker["step_seconds"] > 0 and worker["idle_seconds"] >= 0
    # The forward passes are the step less sampling; the gaps hold the idle time and more.
    assert 0 < worker["forward_seconds"] < worker["step_seconds"]
    assert worker["gap_seconds"] >= worker["idle_seconds"] and worker["gap_seconds"] > 0
    assert worker["prepare_seconds"] > 0 and worker["no_work_seconds"] >= 0
    after = stack.scrape()
    steps = [k for k in after if k.startswith("pagedserve:worker_steps_total[worker_id=")]
    assert steps and sum(after[k] - before.get(k, 0.0) for k in steps) >= worker["steps"]


def test_a_wait_for_requests_is_not_counted_as_the_worker_waiting_for_the_scheduler(stack: Stack):
    def total(scrape: dict[str, float], name: str) -> float:
        return sum(v for k, v in scrape.items() if k.startswith(f"pagedserve:{name}_total[worker_id="))

    def ask() -> None:
        stack.client.completions.create(model=MODEL, prompt="Paris is", max_tokens=4, temperature=0)

    stack.wait_idle()
    ask()
    before = stack.scrape()
    time.sleep(3.0)  # nothing to schedule: the worker waits for the next request
    ask()
    after = stack.scrape()

    def grew(name: str) -> float:
        return total(after, name) - total(before, name)

    # The wait is counted as waiting for work, apart from the steady state's gaps: it is in no_work whole,
    # and the gaps of the second request's few steps hold none of it.
    assert grew("worker_no_work_seconds") >= 3.0
    assert grew("worker_gap_seconds") < grew("worker_no_work_seconds") / 2
    assert grew("worker_idle_seconds") < grew("worker_no_work_seconds") / 2
    assert total(after, "worker_prepare_seconds") > total(before, "worker_prepare_seconds")
