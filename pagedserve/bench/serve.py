"""`pagedserve bench serve`: load an OpenAI-compatible server (ours, vLLM, ...) and measure it.

    pagedserve bench serve --base-url http://localhost:8000 --dataset-name random \\
        --random-input-len 512 --random-output-len 128 --num-prompts 200 --request-rate 8 --save-result

Requests arrive as a Poisson process at --request-rate (gamma-distributed gaps with --burstiness), or all
at once (inf) limited by --max-concurrency. Every request streams, with ignore_eos and max_tokens set so
that output lengths are exact, and usage requested so that tokens are the server's own count.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from pagedserve.bench import datasets, report
from pagedserve.bench.client import BACKENDS, RequestResult, RequestSpec, first_model, send_request
from pagedserve.bench.datasets import ChatLengths, SampleRequest
from pagedserve.bench.metrics import DEFAULT_PERCENTILES, BenchmarkMetrics, compute_metrics


@dataclass(slots=True)
class LoadConfig:
    request_rate: float = math.inf  # requests/s on average; inf sends them all at once
    burstiness: float = 1.0  # gamma shape of the gaps between arrivals: 1 = Poisson, <1 burstier
    max_concurrency: int | None = None  # requests in flight at most (None: unlimited)
    seed: int = 0  # seeds the arrival times
    timeout: float | None = None  # s, per request (None: no limit)
    show_progress: bool = True  # a tqdm bar while the run goes


@dataclass(slots=True)
class WorkerTime:
    """Worker steps and their time, summed over workers (pagedserve's /metrics counters)."""

    steps: float = 0.0
    step_seconds: float = 0.0  # forward pass and sampling
    idle_seconds: float = 0.0  # waiting for the next plan after finishing one, at steady state
    forward_seconds: float | None = None  # the forward passes' share of step_seconds (None: not exposed)
    # From the end of one step to the start of the next at steady state: the idle seconds and the worker's
    # hand-over of results and plans between its threads (None: not exposed).
    gap_seconds: float | None = None
    prepare_seconds: float | None = None  # applying plans and building inputs (None: not exposed)
    # Waits with nothing to schedule (no requests), left out of idle_seconds and gap_seconds (None: not
    # exposed, and then in them).
    no_work_seconds: float | None = None

    def __sub__(self, other: WorkerTime) -> WorkerTime:
        def optional(mine: float | None, theirs: float | None) -> float | None:
            return None if mine is None or theirs is None else mine - theirs

        return WorkerTime(
            self.steps - other.steps,
            self.step_seconds - other.step_seconds,
            self.idle_seconds - other.idle_seconds,
            optional(self.forward_seconds, other.forward_seconds),
            optional(self.gap_seconds, other.gap_seconds),
            optional(self.prepare_seconds, other.prepare_seconds),
            optional(self.no_work_seconds, other.no_work_seconds),
        )

    def describe(self) -> str:
        """One line: how long the worker went from one forward pass to the next, and what took that time."""
        if self.steps <= 0:
            return "worker idle between steps: no steps"
        per_step = 1e3 / self.steps  # seconds in all -> ms a step
        step_ms, idle_ms = self.step_seconds * per_step, self.idle_seconds * per_step
        if self.forward_seconds is None or self.gap_seconds is None or self.prepare_seconds is None:
            # A server with the basic counters alone.
            return (
                f"worker idle between steps: {idle_ms:.2f} ms per step against {step_ms:.1f} ms steps "
                f"({idle_ms / step_ms:.1%} of the step time; {self.steps:.0f} steps)"
            )
        forward_ms = self.forward_seconds * per_step
        sample_ms, gap_ms = step_ms - forward_ms, self.gap_seconds * per_step
        prepare_ms = self.prepare_seconds * per_step
        between_ms = sample_ms + gap_ms + prepare_ms
        no_work = ""
        if self.no_work_seconds is not None:
            no_work = f"; {self.no_work_seconds:.2f} s with nothing to schedule left out"
        return (
            f"worker between forward passes: {between_ms:.2f} ms a step, {between_ms / (forward_ms + between_ms):.1%} "
            f"of the step (forward pass {forward_ms:.2f} ms; sampling {sample_ms:.2f}, hand-over {gap_ms:.2f} "
            f"of which {idle_ms:.2f} idle waiting for a plan, the next step's inputs {prepare_ms:.2f}; "
            f"{self.steps:.0f} steps{no_work})"
        )


@dataclass(slots=True)
class PassResult:
    load: LoadConfig  # how the requests were sent
    results: list[RequestResult]  # one per request, in dataset order
    duration: float  # s, first request sent -> last request finished
    metrics: BenchmarkMetrics
    worker: WorkerTime | None = None  # during the pass; None when the server exposes no such counters


def scrape_worker_time(base_url: str, api_key: str | None = None) -> WorkerTime | None:
    """The pagedserve:worker_* counters of the server's /metrics; None for a server without the steps,
    their seconds and the idle seconds (the forward passes' and the gaps' seconds are optional)."""
    from prometheus_client.parser import text_string_to_metric_families

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(f"{base_url}/metrics", headers=headers, timeout=10.0)
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    fields = {
        "pagedserve:worker_steps": "steps",
        "pagedserve:worker_step_seconds": "step_seconds",
        "pagedserve:worker_idle_seconds": "idle_seconds",
        "pagedserve:worker_forward_seconds": "forward_seconds",
        "pagedserve:worker_gap_seconds": "gap_seconds",
        "pagedserve:worker_prepare_seconds": "prepare_seconds",
        "pagedserve:worker_no_work_seconds": "no_work_seconds",
    }
    found, total = set(), WorkerTime()
    for family in text_string_to_metric_families(response.text):
        field = fields.get(family.name)
        if field is None:
            continue
        found.add(field)
        for sample in family.samples:
            if sample.name.endswith("_total"):
                setattr(total, field, (getattr(total, field) or 0.0) + sample.value)
    return total if found >= {"steps", "step_seconds", "idle_seconds"} else None


def arrival_times(n: int, rate: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """Send times in s since the start: gamma gaps of mean 1/rate (exponential when burstiness is 1)."""
    if math.isinf(rate):
        return np.zeros(n)
    assert rate > 0 and burstiness > 0
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    gaps[0] = 0.0  # NOTE: the first request goes at once, so the duration measures the load, not a wait
    return np.cumsum(gaps)


async def _arrivals(requests: list[SampleRequest], times: np.ndarray, start: float) -> AsyncIterator[int]:
    for i, at in enumerate(times):
        delay = start + float(at) - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        yield i


async def run_pass(
    spec: RequestSpec,
    requests: list[SampleRequest],
    load: LoadConfig,
    tokenizer: Any = None,
    percentiles: tuple[float, ...] = DEFAULT_PERCENTILES,
) -> PassResult:
    concurrency = load.max_concurrency or len(requests)
    # One connection pool sized to the concurrency: a request never waits for a connection it
    # would not have had to wait for at the semaphore.
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    timeout = httpx.Timeout(load.timeout, connect=min(load.timeout or 30.0, 30.0))
    semaphore = asyncio.Semaphore(concurrency)
    times = arrival_times(len(requests), load.request_rate, load.burstiness, np.random.default_rng(load.seed))
    bar = _progress(len(requests), load.show_progress)

    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:

        async def limited(request: SampleRequest) -> RequestResult:
            async with semaphore:
                result = await send_request(client, spec, request, run_start)
            bar.update()
            return result

        run_start = time.perf_counter()
        tasks = [
            asyncio.create_task(limited(requests[i])) async for i in _arrivals(requests, times, run_start)
        ]
        results = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - run_start
    bar.close()
    count_missing_tokens(results, tokenizer)
    return PassResult(load, results, duration, compute_metrics(results, duration, percentiles))


def count_missing_tokens(results: list[RequestResult], tokenizer: Any) -> None:
    # Servers that send no usage: count the generated text's tokens (exact unless the text re-tokenizes
    # differently from how it was generated, which is rare for ordinary text).
    for r in results:
        if r.success and not r.usage_reported:
            if tokenizer is not None:
                r.output_tokens = len(tokenizer.encode(r.text, add_special_tokens=False))
            else:
                r.output_tokens = sum(r.chunk_tokens)


def _progress(total: int, enabled: bool) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="requests", unit="req", disable=not enabled)


# ---- command line ----


def add_arguments(parser: argparse.ArgumentParser) -> None:
    server = parser.add_argument_group("server")
    server.add_argument("--backend", choices=sorted(BACKENDS), default="openai")
    server.add_argument("--endpoint", help="path, default by backend: " + ", ".join(BACKENDS.values()))
    server.add_argument("--base-url", help="e.g. http://localhost:8000 (overrides --host/--port)")
    server.add_argument("--host", default="127.0.0.1")
    server.add_argument("--port", type=int, default=8000)
    server.add_argument("--model", help="model name sent (default: the first of GET /v1/models)")
    server.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="default $OPENAI_API_KEY")
    server.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="don't send ignore_eos (for servers that refuse unknown fields)",
    )
    server.add_argument(
        "--no-continuous-usage",
        dest="continuous_usage",
        action="store_false",
        help="don't ask for usage on every chunk (vLLM's continuous_usage_stats)",
    )
    server.add_argument("--extra-body", type=json.loads, default={}, help="JSON merged into every request")
    server.add_argument("--timeout", type=float, default=None, help="s per request (default: none)")

    data = parser.add_argument_group("dataset")
    data.add_argument("--dataset-name", choices=datasets.DATASETS, default="random")
    data.add_argument("--tokenizer", help="model folder, .gguf or 'default' (default: --model if a folder)")
    data.add_argument("--num-prompts", type=int, default=1000)
    data.add_argument("--seed", type=int, default=0)
    data.add_argument("--prompt-as-token-ids", action="store_true", help="send prompts as token id lists")
    data.add_argument("--random-input-len", type=int, default=1024)
    data.add_argument("--random-output-len", type=int, default=128)
    data.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="lengths uniform in len*(1-r) .. len*(1+r), 0 <= r < 1",
    )
    data.add_argument("--prefix-len", type=int, default=256, help="tokens of each shared prefix")
    data.add_argument("--suffix-len", type=int, default=256, help="tokens after the prefix, per prompt")
    data.add_argument("--num-prefixes", type=int, default=10)
    data.add_argument("--output-len", type=int, default=128, help="prefix-repetition output tokens")
    defaults = ChatLengths()
    for name in ChatLengths.__dataclass_fields__:
        kind = float if name.endswith("sigma") else int
        data.add_argument(
            f"--chat-{name.replace('_', '-')}",
            type=kind,
            default=getattr(defaults, name),
            help="chat dataset: lognormal lengths (see ChatLengths)",
        )

    load = parser.add_argument_group("load")
    load.add_argument(
        "--request-rate", type=float, default=math.inf, help="req/s (Poisson); inf: all at once"
    )
    load.add_argument(
        "--burstiness", type=float, default=1.0, help="gamma shape of arrival gaps; 1 = Poisson"
    )
    load.add_argument("--max-concurrency", type=int, default=None)
    load.add_argument(
        "--sweep-concurrency", help="comma-separated concurrencies, one pass each, e.g. 1,4,16,64"
    )
    load.add_argument(
        "--skip-initial-test", action="store_true", help="don't send one checking request first"
    )
    load.add_argument("--disable-tqdm", action="store_true")

    out = parser.add_argument_group("results")
    out.add_argument("--percentiles", default="99", help="comma-separated, e.g. 50,90,99")
    out.add_argument("--save-result", action="store_true", help="write the JSON result and PNG plots")
    out.add_argument("--result-dir", default=".")
    out.add_argument(
        "--result-filename", help="default: <backend>-<rate>qps-<concurrency>-<model>-<time>.json"
    )
    out.add_argument("--no-plots", dest="plots", action="store_false")


def build_requests(args: argparse.Namespace, tokenizer: Any) -> list[SampleRequest]:
    common = dict(seed=args.seed, as_token_ids=args.prompt_as_token_ids)
    if args.dataset_name == "random":
        return datasets.sample_random(
            tokenizer,
            args.num_prompts,
            args.random_input_len,
            args.random_output_len,
            args.random_range_ratio,
            **common,
        )
    if args.dataset_name == "prefix-repetition":
        return datasets.sample_prefix_repetition(
            tokenizer,
            args.num_prompts,
            args.prefix_len,
            args.suffix_len,
            args.num_prefixes,
            args.output_len,
            **common,
        )
    lengths = ChatLengths(
        **{name: getattr(args, f"chat_{name}") for name in ChatLengths.__dataclass_fields__}
    )
    return datasets.sample_chat(tokenizer, args.num_prompts, lengths, **common)


def load_tokenizer(spec: str | None, model: str | None) -> tuple[Any, str]:
    from pagedserve.model_files import load_tokenizer as load
    from pagedserve.model_files import resolve_model

    if spec is None:
        spec = model if model and Path(model).expanduser().exists() else "default"
    path = resolve_model(spec)
    return load(path), str(path)


def run(args: argparse.Namespace) -> int:
    chat = args.backend == "openai-chat" or (args.endpoint or "").rstrip("/").endswith("chat/completions")
    if chat and args.prompt_as_token_ids:
        print("--prompt-as-token-ids needs /v1/completions (--backend openai)", file=sys.stderr)
        return 2
    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    args.backend = "openai-chat" if chat else "openai"  # NOTE: an explicit chat --endpoint decides it
    endpoint = args.endpoint or BACKENDS[args.backend]
    percentiles = tuple(float(p) for p in args.percentiles.split(",") if p.strip())
    sweep = [int(c) for c in args.sweep_concurrency.split(",")] if args.sweep_concurrency else None

    tokenizer, tokenizer_path = load_tokenizer(args.tokenizer, args.model)
    requests = build_requests(args, tokenizer)
    model = args.model or asyncio.run(_first_model(base_url, args.api_key))
    spec = RequestSpec(
        url=base_url + endpoint,
        model=model,
        chat=chat,
        api_key=args.api_key,
        ignore_eos=args.ignore_eos,
        continuous_usage=args.continuous_usage,
        extra_body=args.extra_body,
    )
    print(
        f"{len(requests)} {args.dataset_name} requests, tokenizer {tokenizer_path}, model {model}, {spec.url}"
    )

    if not args.skip_initial_test:
        check = asyncio.run(_initial_test(spec, requests[0]))
        if not check.success:
            print(f"the initial test request failed: {check.error}", file=sys.stderr)
            return 1
        print("initial test request succeeded, starting the benchmark")

    concurrencies = sweep or [args.max_concurrency]
    passes = []
    for concurrency in concurrencies:
        load = LoadConfig(
            request_rate=args.request_rate,
            burstiness=args.burstiness,
            max_concurrency=concurrency,
            seed=args.seed,
            timeout=args.timeout,
            show_progress=not args.disable_tqdm,
        )
        before = scrape_worker_time(base_url, args.api_key)
        result = asyncio.run(run_pass(spec, requests, load, tokenizer, percentiles))
        after = scrape_worker_time(base_url, args.api_key) if before is not None else None
        result.worker = after - before if after is not None else None
        print(report.format_table(result.metrics, load, percentiles))
        if result.worker is not None:
            print(result.worker.describe())
        passes.append(result)

    if args.save_result:
        meta = {
            "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
            "backend": args.backend,
            "url": spec.url,
            "model": model,
            "tokenizer": tokenizer_path,
            "dataset": args.dataset_name,
            "num_prompts": len(requests),
            "args": {k: _jsonable(v) for k, v in vars(args).items() if k != "api_key"},
        }
        name = args.result_filename or _default_filename(args, model, meta["date"], sweep)
        path = Path(args.result_dir).expanduser() / name
        report.save_json(path, meta, passes, percentiles)
        written = [path]
        if args.plots:
            written += report.save_plots(path.with_suffix(""), passes)
        print("wrote " + ", ".join(str(p) for p in written))
    return 0 if all(p.metrics.completed for p in passes) else 1


def _jsonable(value: Any) -> Any:
    return "inf" if isinstance(value, float) and math.isinf(value) else value


def _default_filename(args: argparse.Namespace, model: str, date: str, sweep: list[int] | None) -> str:
    rate = "inf" if math.isinf(args.request_rate) else f"{args.request_rate:g}"
    concurrency = f"sweep{'-'.join(map(str, sweep))}" if sweep else f"concurrency{args.max_concurrency}"
    return f"{args.backend}-{rate}qps-{concurrency}-{Path(model).name}-{date}.json"


async def _first_model(base_url: str, api_key: str | None) -> str:
    async with httpx.AsyncClient(timeout=30.0) as client:
        return await first_model(client, base_url, api_key)


async def _initial_test(spec: RequestSpec, request: SampleRequest) -> RequestResult:
    async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=30.0)) as client:
        return await send_request(client, spec, request)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="pagedserve bench serve",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))
