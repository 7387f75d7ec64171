"""`pagedserve bench serve`: exact datasets, vLLM's metric definitions, and the load generator end to end
against a small OpenAI-format streaming server (FastAPI/uvicorn on a loopback port, defined here)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from pagedserve.bench import datasets
from pagedserve.bench import main as bench_main
from pagedserve.bench.client import RequestResult, RequestSpec
from pagedserve.bench.metrics import compute_metrics, request_itls, request_tpot
from pagedserve.bench.serve import LoadConfig, arrival_times, run_pass

TOKEN_TEXT = " hello"  # the fake server's every output token; one token of the test tokenizer

# ---- a small byte-level BPE tokenizer (decode/re-encode does not round-trip, like real ones) ----

_CORPUS = [
    "hello world, the quick brown fox jumps over the lazy dog.",
    "paged attention keeps the KV cache in fixed-size blocks; hello again!",
    "Prefix caching shares blocks between requests: 1234567890 ünïcødé ✓",
] * 50


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(_CORPUS, trainer)
    folder = tmp_path_factory.mktemp("tokenizer")
    PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>").save_pretrained(folder)
    (folder / "config.json").write_text('{"model_type": "llama"}')  # what resolve_model looks for
    return folder


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    from pagedserve.model_files import load_tokenizer

    tok = load_tokenizer(tokenizer_dir)
    assert len(tok.encode(TOKEN_TEXT * 5, add_special_tokens=False)) == 5
    return tok


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


# ---- datasets ----


def test_random_prompts_encode_to_exactly_their_token_lengths(tokenizer):
    requests = datasets.sample_random(tokenizer, 40, input_len=64, output_len=20, range_ratio=0.5, seed=3)
    lengths = [r.prompt_len for r in requests]
    assert all(32 <= n <= 96 for n in lengths) and len(set(lengths)) > 10
    assert all(10 <= r.output_len <= 30 for r in requests)
    for r in requests:
        assert len(_encode(tokenizer, r.prompt)) == r.prompt_len


def test_random_prompts_as_token_ids_are_the_texts_tokens(tokenizer):
    as_text = datasets.sample_random(tokenizer, 10, input_len=50, output_len=8, seed=5)
    as_ids = datasets.sample_random(tokenizer, 10, input_len=50, output_len=8, seed=5, as_token_ids=True)
    special = set(tokenizer.all_special_ids)
    for text, ids in zip(as_text, as_ids, strict=True):
        assert ids.prompt == _encode(tokenizer, text.prompt) and len(ids.prompt) == 50
        assert not special & set(ids.prompt)


def test_the_seed_alone_decides_the_requests(tokenizer):
    first = datasets.sample_chat(tokenizer, 8, seed=11)
    again = datasets.sample_chat(tokenizer, 8, seed=11)
    other = datasets.sample_chat(tokenizer, 8, seed=12)
    assert first == again
    assert first != other


def test_prefix_repetition_prompts_share_their_prefixes_token_for_token(tokenizer):
    requests = datasets.sample_prefix_repetition(
        tokenizer, 24, prefix_len=40, suffix_len=12, num_prefixes=3, output_len=7, seed=1
    )
    encoded = [_encode(tokenizer, r.prompt) for r in requests]
    assert all(
        len(ids) == r.prompt_len == 52 and r.output_len == 7 for ids, r in zip(encoded, requests, strict=True)
    )
    prefixes = [tuple(ids[:40]) for ids in encoded]
    assert len(set(prefixes)) == 3
    assert all(prefixes.count(p) == 8 for p in set(prefixes))
    assert len({tuple(ids[40:]) for ids in encoded}) == 24  # every suffix its own
    assert prefixes[:3] != sorted(prefixes[:3]) or prefixes[3:6] != prefixes[:3]  # shuffled, not round-robin


def test_chat_lengths_are_lognormal_around_their_medians_and_clipped(tokenizer):
    lengths = datasets.ChatLengths(
        input_median=40, input_sigma=0.8, input_max=150, output_median=20, output_sigma=0.5, output_max=60
    )
    requests = datasets.sample_chat(tokenizer, 200, lengths, seed=0)
    inputs = np.array([r.prompt_len for r in requests])
    outputs = np.array([r.output_len for r in requests])
    assert 32 <= np.median(inputs) <= 50 and 16 <= np.median(outputs) <= 25
    assert inputs.min() >= 8 and inputs.max() == 150 and outputs.max() <= 60
    assert all(len(_encode(tokenizer, r.prompt)) == r.prompt_len for r in requests[:50])


@pytest.mark.slow
def test_random_prompts_are_exact_for_the_default_models_tokenizer():
    from pagedserve.model_files import load_tokenizer, resolve_model

    tok = load_tokenizer(resolve_model(None))
    for r in datasets.sample_random(tok, 20, input_len=300, output_len=8, range_ratio=0.3, seed=0):
        assert len(_encode(tok, r.prompt)) == r.prompt_len


# ---- metrics on synthetic timings ----


def _result(ttft, chunk_times, chunk_tokens, latency, output_tokens=None, success=True):
    return RequestResult(
        prompt_len=10,
        output_len=sum(chunk_tokens),
        success=success,
        ttft=ttft,
        latency=latency,
        chunk_times=chunk_times,
        chunk_tokens=chunk_tokens,
        output_tokens=sum(chunk_tokens) if output_tokens is None else output_tokens,
    )


def test_itl_spreads_each_gap_over_the_tokens_of_the_chunk_it_brought():
    # chunks at 0.1 (1 token), 0.3 (1 token), 0.7 (2 tokens): gaps 0.2 and 0.4 -> 0.2, 0.2, 0.2
    r = _result(0.1, [0.1, 0.3, 0.7], [1, 1, 2], latency=0.75)
    assert request_itls(r) == pytest.approx([0.2, 0.2, 0.2])
    # TPOT excludes the first token: (0.75 - 0.1) / (4 - 1)
    assert request_tpot(r) == pytest.approx(0.65 / 3)
    assert request_tpot(_result(0.1, [0.1], [1], latency=0.1)) is None


def test_metrics_match_hand_computed_values():
    results = [
        _result(0.1, [0.1, 0.2, 0.3], [1, 1, 1], latency=0.3),  # itl 0.1 0.1, tpot 0.1
        _result(0.2, [0.2, 0.6], [1, 1], latency=0.6),  # itl 0.4, tpot 0.4
        _result(0.4, [0.4, 0.5, 0.6, 1.0], [1, 1, 1, 1], latency=1.0),  # itl .1 .1 .4, tpot 0.2
        _result(0.0, [], [], latency=0.05, success=False),
    ]
    m = compute_metrics(results, duration=2.0, percentiles=(50.0, 90.0, 99.0))
    assert (m.completed, m.failed) == (3, 1)
    assert (m.total_input_tokens, m.total_output_tokens) == (30, 9)
    assert m.request_throughput == pytest.approx(1.5)
    assert m.output_throughput == pytest.approx(4.5)
    assert m.total_token_throughput == pytest.approx(19.5)
    assert m.ttft.mean == pytest.approx(700 / 3)
    assert m.ttft.median == pytest.approx(200.0)
    # numpy's linear interpolation: p90 of [100, 200, 400] = 200 + 0.8 * (400 - 200)
    assert m.ttft.percentiles["p90"] == pytest.approx(360.0)
    assert m.ttft.percentiles["p99"] == pytest.approx(396.0)
    assert m.tpot.mean == pytest.approx(700 / 3) and m.tpot.median == pytest.approx(200.0)
    # ITL samples [100, 100, 400, 100, 100, 400]: every token after the first counts once
    assert m.itl.mean == pytest.approx(200.0) and m.itl.median == pytest.approx(100.0)
    assert m.itl.percentiles["p99"] == pytest.approx(400.0)
    assert m.e2el.mean == pytest.approx(1900 / 3) and m.e2el.percentiles["p50"] == pytest.approx(600.0)
    assert m.output_len_mismatches == 0


def test_poisson_arrivals_have_the_requested_mean_rate_and_inf_sends_all_at_once():
    times = arrival_times(4000, rate=20.0, burstiness=1.0, rng=np.random.default_rng(0))
    gaps = np.diff(times)
    assert times[0] == 0.0 and gaps.mean() == pytest.approx(0.05, rel=0.05)
    assert gaps.std() == pytest.approx(0.05, rel=0.1)  # exponential: std = mean
    bursty = np.diff(arrival_times(4000, rate=20.0, burstiness=0.25, rng=np.random.default_rng(0)))
    assert bursty.mean() == pytest.approx(0.05, rel=0.1) and bursty.std() > 1.5 * gaps.std()
    assert not arrival_times(5, math.inf, 1.0, np.random.default_rng(0)).any()


# ---- a fake OpenAI-compatible streaming server ----


@dataclass
class FakeServer:
    token_delay: float = 0.002  # s before each chunk
    tokens_per_chunk: int = 1
    usage: bool = True  # honour stream_options (include_usage, continuous_usage_stats)
    fail_http_every: int = 0  # every k-th request (1-based) answers HTTP 500
    fail_event_every: int = 0  # every k-th request sends an error event after two chunks
    bodies: list[dict] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/v1/models")
        async def list_models():
            return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

        @app.post("/v1/completions")
        async def completions(request: Request):
            return await self._generate(request, chat=False)

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request):
            return await self._generate(request, chat=True)

        return app

    async def _generate(self, request: Request, chat: bool):
        body = await request.json()
        self.bodies.append(body)
        index = len(self.bodies)
        if self.fail_http_every and index % self.fail_http_every == 0:
            return JSONResponse({"error": {"message": "overloaded", "type": "server_error"}}, status_code=500)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        fail = bool(self.fail_event_every and index % self.fail_event_every == 0)
        return StreamingResponse(self._stream(body, chat, fail), media_type="text/event-stream")

    async def _stream(self, body: dict, chat: bool, fail: bool):
        try:
            options = body.get("stream_options") or {}
            usage = self.usage and options.get("include_usage")
            continuous = self.usage and options.get("continuous_usage_stats")
            prompt_tokens = len(body["prompt"]) if isinstance(body.get("prompt"), list) else 1
            if chat:
                yield _sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
            total, sent = body["max_tokens"], 0
            while sent < total:
                await asyncio.sleep(self.token_delay)
                if fail and sent >= 2:
                    yield _sse({"error": {"message": "worker lost", "type": "server_error", "code": 500}})
                    break
                n = min(self.tokens_per_chunk, total - sent)
                sent += n
                text = TOKEN_TEXT * n
                choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
                chunk = {"choices": [choice]}
                if continuous:
                    chunk["usage"] = _usage(prompt_tokens, sent)
                yield _sse(chunk)
            if usage and not fail:
                yield _sse({"choices": [], "usage": _usage(prompt_tokens, sent)})
            yield "data: [DONE]\n\n"
        finally:
            self.in_flight -= 1


def _sse(data: dict) -> str:
    return f"data: {json.dumps(data)}\n\n"


def _usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


@contextlib.contextmanager
def serving(fake: FakeServer) -> Iterator[str]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(fake.app(), log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "fake server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def _requests(n: int, output_len: int = 6) -> list[datasets.SampleRequest]:
    return [
        datasets.SampleRequest(prompt=f"prompt {i}", prompt_len=5, output_len=output_len) for i in range(n)
    ]


def _run(url: str, requests, chat=False, tokenizer=None, **load) -> object:
    endpoint = "/v1/chat/completions" if chat else "/v1/completions"
    spec = RequestSpec(url=url + endpoint, model="fake-model", chat=chat)
    return asyncio.run(run_pass(spec, requests, LoadConfig(show_progress=False, **load), tokenizer))


# ---- the load generator end to end ----


def test_completions_counts_tokens_and_requests_exactly_from_continuous_usage():
    fake = FakeServer(tokens_per_chunk=2)
    with serving(fake) as url:
        result = _run(url, _requests(10, output_len=7))
    m = result.metrics
    assert (m.completed, m.failed) == (10, 0)
    assert (m.total_input_tokens, m.total_output_tokens) == (50, 70)
    assert m.output_len_mismatches == 0
    for r in result.results:
        assert r.usage_reported and r.chunk_tokens == [2, 2, 2, 1]
        assert len(request_itls(r)) == 5  # one per token after the first chunk (which brought two)
        assert 0 < r.ttft <= r.latency and r.text == TOKEN_TEXT * 7
    body = fake.bodies[0]
    assert body["stream"] is True and body["ignore_eos"] is True and body["max_tokens"] == 7
    assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert body["model"] == "fake-model"
    assert sorted(b["prompt"] for b in fake.bodies) == [f"prompt {i}" for i in range(10)]


def test_chat_without_usage_counts_tokens_with_the_tokenizer_and_skips_the_role_chunk(tokenizer):
    fake = FakeServer(usage=False)
    with serving(fake) as url:
        result = _run(url, _requests(6, output_len=5), chat=True, tokenizer=tokenizer)
    assert (result.metrics.completed, result.metrics.total_output_tokens) == (6, 30)
    assert all(not r.usage_reported and r.chunk_tokens == [1] * 5 for r in result.results)
    body = fake.bodies[0]
    assert body["messages"] == [{"role": "user", "content": body["messages"][0]["content"]}]
    assert sorted(b["messages"][0]["content"] for b in fake.bodies) == [f"prompt {i}" for i in range(6)]
    assert body["max_completion_tokens"] == 5


def test_failures_are_counted_with_their_error_text():
    fake = FakeServer(fail_http_every=4, fail_event_every=5)
    with serving(fake) as url:
        result = _run(url, _requests(12), max_concurrency=1)
    failed = [r for r in result.results if not r.success]
    assert (result.metrics.completed, result.metrics.failed) == (7, 5)  # 4, 8, 12 by HTTP; 5, 10 event
    errors = sorted(r.error for r in failed)
    assert errors[0].startswith("HTTP 500") and "overloaded" in errors[0]
    assert errors[-1] == "error event: worker lost" and len([e for e in errors if "HTTP" in e]) == 3
    assert result.metrics.total_output_tokens == 7 * 6  # failed requests' tokens don't count


def test_connection_errors_fail_the_request_not_the_run():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"  # bound but not listening: refused
        result = _run(url, _requests(3))
    assert result.metrics.failed == 3 and all("ConnectError" in r.error for r in result.results)


def test_max_concurrency_is_honoured_and_reached():
    fake = FakeServer(token_delay=0.005)
    with serving(fake) as url:
        result = _run(url, _requests(12, output_len=8), max_concurrency=3)
    assert result.metrics.completed == 12
    assert fake.max_in_flight == 3


def test_poisson_requests_go_out_in_order_never_before_their_arrival_time():
    rate, n = 40.0, 30
    with serving(FakeServer()) as url:
        result = _run(url, _requests(n, output_len=2), request_rate=rate, seed=7)
    schedule = arrival_times(n, rate, 1.0, np.random.default_rng(7))
    starts = np.array([r.start for r in result.results])
    # The schedule is the seeded Poisson process's; how late a loaded machine sends is the benchmark's
    # to report, not a test's to bound.
    assert np.all(np.diff(schedule) > 0) and 1.0 / rate / 4 < np.diff(schedule).mean() < 4.0 / rate
    assert np.all(starts >= schedule - 0.005)
    assert np.all(np.diff(starts) >= 0)
    assert result.metrics.duration >= schedule[-1]


def test_cli_sweep_prints_the_table_and_writes_json_and_plots(tokenizer_dir, tmp_path, capsys):
    fake = FakeServer()
    with serving(fake) as url:
        code = bench_main(
            ["serve", "--base-url", url, "--tokenizer", str(tokenizer_dir), "--dataset-name", "random",
             "--random-input-len", "20", "--random-output-len", "4", "--num-prompts", "8",
             "--sweep-concurrency", "1,4", "--percentiles", "50,99", "--disable-tqdm",
             "--save-result", "--result-dir", str(tmp_path), "--result-filename", "run.json"]
        )  # fmt: skip
    assert code == 0
    out = capsys.readouterr().out
    assert out.count("Serving Benchmark Result") == 2 and "P99 TTFT (ms):" in out
    assert "Successful requests:                             8" in out
    assert len(fake.bodies) == 1 + 2 * 8  # the initial test request, then two passes
    assert all(b["model"] == "fake-model" for b in fake.bodies)  # from GET /v1/models
    saved = json.loads((tmp_path / "run.json").read_text())
    assert [p["load"]["max_concurrency"] for p in saved["passes"]] == [1, 4]
    first = saved["passes"][0]
    assert first["metrics"]["completed"] == 8 and first["metrics"]["total_output_tokens"] == 32
    assert len(first["requests"]) == 8 and len(first["requests"][0]["itl_s"]) == 3
    assert set(first["metrics"]["ttft"]["percentiles"]) == {"p50", "p99"}
    assert "api_key" not in saved["args"] and saved["args"]["request_rate"] == "inf"
    for name in ("run-c1-latency.png", "run-c4-latency.png", "run-sweep.png"):
        assert (tmp_path / name).read_bytes().startswith(b"\x89PNG")


def test_bench_without_a_benchmark_prints_usage(capsys):
    assert bench_main([]) == 0
    assert "serve" in capsys.readouterr().out
    assert bench_main(["nope"]) == 2
