"""Scheduler hot path and paging waste.

1. CPU time of one decode step on the scheduler side: schedule() + PlanBuilder.build() +
   SerializeToString(), median and p99, at 16..1024 running requests with long contexts
   (pipelined one step deep, as the engine runs it; update_from_output timed separately).
2. KV memory wasted by paging (allocated slots minus tokens in them) on chat-like traffic, next to
   the waste of reserving max_model_len contiguous slots per request.

Run: .venv/bin/python bench/bench_scheduler.py
"""

from __future__ import annotations

import random
import statistics
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from tqdm import tqdm

from pagedserve.scheduler_svc.config import SchedulerConfig
from pagedserve.scheduler_svc.plan import PlanBuilder
from pagedserve.scheduler_svc.request import Request
from pagedserve.scheduler_svc.scheduler import Scheduler, SchedulerOutput
from pagedserve.v1 import common_pb2, worker_pb2

RESULTS = Path(__file__).parent / "results"
BLOCK_SIZE = 16


def _request(rid: str, prompt: list[int], max_tokens: int) -> Request:
    sampling = common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    return Request(request_id=rid, token_ids=prompt, prompt_len=len(prompt), sampling=sampling)


def _result(out: SchedulerOutput, builder: PlanBuilder, rng: random.Random) -> worker_pb2.StepResult:
    result = worker_pb2.StepResult(step_id=out.step_id)
    result.sampled_slots.extend([builder.slot_of(r) for r in out.sampled])
    result.sampled_token_ids.extend([rng.randrange(2, 30000) for _ in out.sampled])
    return result


def bench_step_time(batch: int, steps: int, rng: random.Random) -> dict[str, float]:
    context = 1536
    cfg = SchedulerConfig(
        num_blocks=batch * (context + steps + 64) // BLOCK_SIZE + 64,
        block_size=BLOCK_SIZE,
        max_num_seqs=batch,
        max_num_batched_tokens=max(8192, batch),
        max_model_len=8192,
    )
    sched, builder = Scheduler(cfg), PlanBuilder()
    for i in range(batch):
        prompt = [rng.randrange(2, 30000) for _ in range(context - rng.randrange(0, 512))]
        sched.add_request(_request(f"r{i}", prompt, max_tokens=4096))
    in_flight: SchedulerOutput | None = None
    # Warm up until every request decodes.
    while len(sched.running) < batch or any(r.num_computed_tokens < r.prompt_len - 1 for r in sched.running):
        out = sched.schedule()
        builder.build(out)
        if in_flight is not None:
            sched.update_from_output(in_flight, _result(in_flight, builder, rng))
        in_flight = out
    times, update_times, sizes = [], [], []
    for _ in tqdm(range(steps), desc=f"decode steps, batch {batch}", leave=False):
        t0 = time.process_time_ns()
        out = sched.schedule()
        data = builder.build(out).SerializeToString()
        t1 = time.process_time_ns()
        result = _result(in_flight, builder, rng)
        t2 = time.process_time_ns()
        sched.update_from_output(in_flight, result)
        t3 = time.process_time_ns()
        assert len(out.scheduled) == batch
        in_flight = out
        times.append((t1 - t0) / 1e6)
        update_times.append((t3 - t2) / 1e6)
        sizes.append(len(data))
    times.sort()
    return {
        "median_ms": statistics.median(times),
        "p99_ms": times[int(0.99 * (len(times) - 1))],
        "update_median_ms": statistics.median(update_times),
        "plan_bytes": statistics.median(sizes),
    }


def chat_lengths(rng: random.Random) -> tuple[int, int]:
    plen = int(min(max(rng.lognormvariate(5.0, 1.0), 20), 1500))
    olen = int(min(max(rng.lognormvariate(4.5, 0.9), 10), 500))
    return plen, olen


def bench_waste(max_model_len: int, num_requests: int, rng: random.Random) -> dict[str, float]:
    cfg = SchedulerConfig(
        num_blocks=256 * max_model_len // BLOCK_SIZE,
        block_size=BLOCK_SIZE,
        max_num_seqs=256,
        max_num_batched_tokens=4096,
        max_model_len=max_model_len,
        enable_prefix_caching=False,  # shared blocks would make "used" ambiguous
    )
    sched, builder = Scheduler(cfg), PlanBuilder()
    traffic = [chat_lengths(rng) for _ in range(num_requests)]
    allocated = used = reserved = 0
    in_flight = None
    with tqdm(total=num_requests, desc=f"chat traffic, max_model_len {max_model_len}", leave=False) as bar:
        added = 0
        while added < num_requests or sched.has_unfinished_requests():
            while added < num_requests and len(sched.waiting) < 8:
                plen, olen = traffic[added]
                sched.add_request(_request(f"r{added}", [rng.randrange(2, 30000) for _ in range(plen)], olen))
                added += 1
            out = sched.schedule()
            builder.build(out)
            if in_flight is not None:
                done = sched.update_from_output(in_flight, _result(in_flight, builder, rng))
                bar.update(sum(o.finished for o in done))
            in_flight = out
            for req in sched.running:
                allocated += len(req.block_table) * BLOCK_SIZE
                used += req.num_computed_tokens
                reserved += max_model_len
    return {"paged": 1 - used / allocated, "contiguous": 1 - used / reserved}


def main() -> None:
    rng = random.Random(0)
    RESULTS.mkdir(parents=True, exist_ok=True)
    batches = [16, 64, 256, 1024]
    rows = {b: bench_step_time(b, steps=400 if b < 1024 else 200, rng=rng) for b in batches}
    print("\nScheduler CPU time per decode step (schedule + build plan + serialize), contexts ~1-1.5k tokens")
    print(f"{'running':>8} {'median ms':>10} {'p99 ms':>8} {'update ms':>10} {'plan bytes':>11}")
    for b, r in rows.items():
        print(
            f"{b:>8} {r['median_ms']:>10.3f} {r['p99_ms']:>8.3f} "
            f"{r['update_median_ms']:>10.3f} {r['plan_bytes']:>11.0f}"
        )

    print("\nKV memory wasted on chat traffic (prompts 20..1500, outputs 10..500 tokens, lognormal)")
    print(f"{'max_model_len':>14} {'paged (bs 16)':>14} {'contiguous':>11}")
    for max_len in (2048, 8192):
        w = bench_waste(max_len, num_requests=600, rng=random.Random(1))
        print(f"{max_len:>14} {w['paged']:>13.2%} {w['contiguous']:>11.2%}")

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(batches, [rows[b]["median_ms"] for b in batches], "o-", label="median")
    ax.plot(batches, [rows[b]["p99_ms"] for b in batches], "s--", label="p99")
    ax.axhline(1.0, color="grey", lw=0.8, ls=":", label="1 ms goal")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("running requests (decode)")
    ax.set_ylabel("CPU ms per step (schedule + plan)")
    ax.set_title("pagedserve scheduler hot path")
    ax.legend()
    fig.tight_layout()
    path = RESULTS / "scheduler_step_time.png"
    fig.savefig(path, dpi=120)
    print(f"\nplot: {path}")


if __name__ == "__main__":
    main()
