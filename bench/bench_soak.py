"""Soak: mixed traffic for a long while against `pagedserve serve`, watching every process's memory and
the KV pool.

Clients keep a mix of requests in flight: completions and chat, streamed and not, n from 1 to 4, seeds,
prompts that share a system prompt and prompts that do not, many cache salts, and requests the client
abandons (a stream closed after a few chunks, a non-streamed request cancelled before its answer).
Every `--sample-seconds` the resident memory (VmRSS) of every process of the stack and the KV cache
usage are recorded. When the traffic stops the stack must come back to idle: no request running or
waiting and no KV block held. The report gives each process's memory at the end of the warm-up and at
the end, its least-squares slope in MB per hour after the warm-up, and the KV usage once idle.

    .venv/bin/python bench/bench_soak.py [--minutes 30] [--workers 2] [--concurrency 12] [--url URL]
    make bench-soak BENCH_ARGS="--minutes 30"

Prints a table and writes bench/results/bench_soak.{json,png}.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"
SYSTEM_PROMPT = (
    "You are a helpful assistant for a travel agency. You answer questions about destinations, weather, "
    "local food, museums and transport briefly and politely, and you say so when you do not know. "
)
TOPICS = ["Paris", "Kyoto", "Lima", "Oslo", "Cairo", "Hanoi", "Quito", "Perth", "Porto", "Riga"]


@dataclass(slots=True)
class Counts:
    completed: int = 0  # requests answered in full
    abandoned: int = 0  # requests the client gave up on (a stream closed early, a cancelled request)
    refused: int = 0  # 4xx/5xx answers (overload included)
    errors: int = 0  # transport errors and malformed answers
    by_status: dict[str, int] = field(default_factory=dict)


@dataclass(slots=True)
class Sample:
    seconds: float  # since the traffic started
    rss_mb: dict[str, float]  # resident memory of each process, by name
    kv_usage: float  # vllm:kv_cache_usage_perc, 0 to 1
    running: float  # vllm:num_requests_running
    waiting: float  # vllm:num_requests_waiting


# ---- the stack's processes ---------------------------------------------------------------------------


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            found += [int(c) for c in (task / "children").read_text().split()]
    return found


def process_tree(root: int) -> dict[str, int]:
    """Every process under root (root included), named by its `pagedserve <service>` command and worker id."""
    names: dict[str, int] = {}
    pending = [root]
    while pending:
        pid = pending.pop()
        pending += _children(pid)
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        args = [a.decode(errors="replace") for a in argv if a]
        name = "launcher" if pid == root else next((a for a in args if a in SERVICES), Path(args[0]).name)
        if "--worker-id" in args:
            name = args[args.index("--worker-id") + 1]
        names[name if name not in names else f"{name}-{pid}"] = pid
    return names


SERVICES = ("scheduler", "worker", "gateway", "serve")


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def scrape(client: httpx.Client) -> dict[str, float]:
    values = {}
    for line in client.get("/metrics", timeout=30).text.splitlines():
        if line.startswith(
            ("vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting")
        ):
            name, _, value = line.rpartition(" ")
            values[name.split("{")[0]] = float(value)
    return values


# ---- traffic -----------------------------------------------------------------------------------------


def make_body(rng: random.Random, model: str) -> tuple[str, dict, str]:
    """(path, body, how the client behaves: "full", "close-stream" or "cancel")."""
    topic = rng.choice(TOPICS)
    question = f"What should I see in {topic} in {rng.randint(1, 9)} days? Answer {rng.randint(1, 99)}."
    shared = rng.random() < 0.6
    body: dict = {
        "model": model,
        "max_tokens": rng.randint(4, 48),
        "n": rng.choice([1, 1, 1, 2, 3, 4]),
        "temperature": rng.choice([0.0, 0.7, 1.0]),
        "stream": rng.random() < 0.6,
    }
    if rng.random() < 0.5:
        body["seed"] = rng.randint(-(2**63), 2**64 - 1)
    if rng.random() < 0.3:
        body["cache_salt"] = f"tenant-{rng.randint(0, 5000)}"
    if rng.random() < 0.5:
        content = (SYSTEM_PROMPT if shared else "") + question
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": content}]
    else:
        path, body["prompt"] = "/v1/completions", (SYSTEM_PROMPT if shared else "") + question
    roll = rng.random()
    how = "close-stream" if body["stream"] and roll < 0.15 else "cancel" if roll < 0.08 else "full"
    return path, body, how


async def one_request(client: httpx.AsyncClient, rng: random.Random, model: str, counts: Counts) -> None:
    path, body, how = make_body(rng, model)

    def status(code: int) -> None:
        counts.by_status[str(code)] = counts.by_status.get(str(code), 0) + 1

    try:
        if how == "cancel":
            task = asyncio.ensure_future(client.post(path, json=body, timeout=600))
            await asyncio.sleep(rng.uniform(0.0, 0.5))
            if task.done():
                status(task.result().status_code)
                counts.completed += 1
                return
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
                await task
            counts.abandoned += 1
            return
        if not body["stream"]:
            response = await client.post(path, json=body, timeout=600)
            status(response.status_code)
            if response.status_code != 200:
                counts.refused += 1
            elif "choices" in response.json():
                counts.completed += 1
            else:
                counts.errors += 1
            return
        async with client.stream("POST", path, json=body, timeout=600) as response:
            status(response.status_code)
            if response.status_code != 200:
                await response.aread()
                counts.refused += 1
                return
            chunks, limit = 0, rng.randint(1, 4) if how == "close-stream" else None
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    counts.completed += 1
                    return
                chunks += 1
                if limit is not None and chunks >= limit:
                    counts.abandoned += 1
                    return  # leaving the block closes the connection: a client that went away
            counts.errors += 1
    except httpx.HTTPError:
        counts.errors += 1


async def traffic(
    base_url: str, model: str, concurrency: int, seconds: float, seed: int, counts: Counts
) -> None:
    deadline = time.monotonic() + seconds
    limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency)

    async def client_loop(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        async with httpx.AsyncClient(base_url=base_url, limits=limits) as client:
            while time.monotonic() < deadline:
                await one_request(client, rng, model, counts)

    await asyncio.gather(*(client_loop(i) for i in range(concurrency)))


# ---- the run -----------------------------------------------------------------------------------------


def start_stack(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    port = args.port
    command = [sys.executable, "-P", "-m", "pagedserve.cli", "serve", "--port", str(port), "--grpc-port", "0"]
    command += ["--workers", str(args.workers), "--log-level", "warning", *args.serve_args]
    log = (RESULTS / "bench_soak.serve.log").open("w")
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True)
    assert process.stdout is not None
    for line in process.stdout:
        print(line, end="", flush=True)
        if "Ctrl-C" in line:
            return process, f"http://127.0.0.1:{port}"
    raise SystemExit(f"pagedserve serve exited with {process.wait()}; see {log.name}")


def slope_mb_per_hour(samples: list[Sample], name: str, after: float) -> float:
    points = [(s.seconds, s.rss_mb[name]) for s in samples if s.seconds >= after and name in s.rss_mb]
    if len(points) < 3:
        return float("nan")
    t, y = np.array(points).T
    return float(np.polyfit(t / 3600.0, y, 1)[0])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0, help="how long the traffic runs")
    parser.add_argument("--warmup-minutes", type=float, default=3.0, help="left out of the slopes")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=12, help="clients, each one request at a time")
    parser.add_argument("--sample-seconds", type=float, default=10.0)
    parser.add_argument("--port", type=int, default=8011)
    parser.add_argument(
        "--url", default=None, help="an already running stack (its processes are not sampled)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("serve_args", nargs="*", help="more `pagedserve serve` flags, after --")
    args = parser.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)

    process = None
    if args.url is None:
        process, base_url = start_stack(args)
        pids = process_tree(process.pid)
    else:
        base_url, pids = args.url.rstrip("/"), {}
    http = httpx.Client(base_url=base_url)
    model = http.get("/v1/models", timeout=30).json()["data"][0]["id"]
    counts = Counts()
    samples: list[Sample] = []
    started = time.monotonic()

    def sample() -> Sample:
        metrics = scrape(http)
        s = Sample(
            seconds=time.monotonic() - started,
            rss_mb={name: mb for name, pid in pids.items() if (mb := rss_mb(pid)) is not None},
            kv_usage=metrics.get("vllm:kv_cache_usage_perc", float("nan")),
            running=metrics.get("vllm:num_requests_running", float("nan")),
            waiting=metrics.get("vllm:num_requests_waiting", float("nan")),
        )
        samples.append(s)
        return s

    async def run() -> None:
        load = asyncio.ensure_future(
            traffic(base_url, model, args.concurrency, args.minutes * 60, args.seed, counts)
        )
        while not load.done():
            s = await asyncio.to_thread(sample)
            total = sum(s.rss_mb.values())
            print(
                f"{s.seconds / 60:6.1f} min  rss {total:8.1f} MB  kv {s.kv_usage:5.1%}  running {s.running:4.0f}  "
                f"waiting {s.waiting:4.0f}  done {counts.completed}  abandoned {counts.abandoned}  "
                f"refused {counts.refused}  errors {counts.errors}",
                flush=True,
            )
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(load), args.sample_seconds)
        await load

    try:
        asyncio.run(run())
        # The traffic has stopped: the stack must return to idle, every block released.
        idle_deadline = time.monotonic() + 120
        while True:
            last = sample()
            if (last.running, last.waiting, last.kv_usage) == (0, 0, 0) or time.monotonic() > idle_deadline:
                break
            time.sleep(1.0)
    finally:
        if process is not None:
            os.killpg(process.pid, signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=60)

    warm = args.warmup_minutes * 60
    first = next((s for s in samples if s.seconds >= warm), samples[0])
    rows = []
    for name in sorted(pids):
        rows.append(
            {
                "process": name,
                "rss_mb_after_warmup": first.rss_mb.get(name, float("nan")),
                "rss_mb_end": last.rss_mb.get(name, float("nan")),
                "rss_mb_max": max(s.rss_mb.get(name, 0.0) for s in samples),
                "slope_mb_per_hour": slope_mb_per_hour(samples, name, warm),
            }
        )
    print(
        f"\nSoak: {args.minutes:g} min of mixed traffic, {args.workers} worker(s), {args.concurrency} clients"
    )
    print(f"{'process':<12}{'after warm-up MB':>18}{'end MB':>10}{'max MB':>10}{'MB/hour':>10}")
    for r in rows:
        print(
            f"{r['process']:<12}{r['rss_mb_after_warmup']:>18.1f}{r['rss_mb_end']:>10.1f}{r['rss_mb_max']:>10.1f}"
            f"{r['slope_mb_per_hour']:>10.1f}"
        )
    print(
        f"requests: {counts.completed} completed, {counts.abandoned} abandoned, {counts.refused} refused, "
        f"{counts.errors} errors; statuses {counts.by_status}"
    )
    print(f"once idle: running {last.running:g}, waiting {last.waiting:g}, KV usage {last.kv_usage:.1%}")
    out = {
        "args": {k: v for k, v in vars(args).items()},
        "counts": asdict(counts),
        "processes": rows,
        "idle": {"running": last.running, "waiting": last.waiting, "kv_usage": last.kv_usage},
        "samples": [asdict(s) for s in samples],
    }
    (RESULTS / "bench_soak.json").write_text(json.dumps(out, indent=1))
    plot(samples, sorted(pids), RESULTS / "bench_soak.png", warm)
    print(f"wrote {RESULTS / 'bench_soak.json'} and {RESULTS / 'bench_soak.png'}")
    return 0


def plot(samples: list[Sample], names: list[str], path: Path, warm: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    minutes = [s.seconds / 60 for s in samples]
    fig, (mem, kv) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    for name in names:
        mem.plot(minutes, [s.rss_mb.get(name, np.nan) for s in samples], label=name)
    mem.axvline(warm / 60, color="grey", linestyle=":", label="end of warm-up")
    mem.set_ylabel("resident memory (MB)")
    mem.set_title("Soak: memory of every process and the KV pool under mixed traffic")
    mem.legend(loc="upper left", fontsize="small")
    kv.plot(minutes, [100 * s.kv_usage for s in samples], label="KV cache usage (%)")
    kv.plot(minutes, [s.running for s in samples], label="requests running")
    kv.plot(minutes, [s.waiting for s in samples], label="requests waiting")
    kv.set_xlabel("minutes")
    kv.legend(loc="upper left", fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
