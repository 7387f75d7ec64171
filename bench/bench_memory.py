"""KV memory: how many sequences fit a fixed KV budget with paging against contiguous allocation.

The workload is compare_transformers.py's (prompts 30..500 tokens, outputs 16..160, seeded): only its
lengths matter here, so no model is loaded (the KV size per token comes from config.json). For each
budget:

- contiguous, full model length: each sequence reserves max_model_len tokens up front (what a
  server that does not know output lengths must do without paging);
- contiguous, workload's longest: each reserves the longest prompt+output of the workload (the
  best static allocation can do when it knows every length in advance);
- paged: each sequence holds ceil(len / block_size) blocks at its actual length (sequences taken
  in workload order until the pool is full; the waste is only the last block's unused slots);
- paged, scheduler: the real Scheduler run over the workload (requests cycled, fake token ids, no
  model): the most sequences it ever held running at once, and the preemptions that cost.

    .venv/bin/python bench/bench_memory.py [--budgets-mib 512,1024,4096] [--dtype auto] [--block-size 16]

Prints a table and writes bench/results/bench_memory.{json,png}.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from pagedserve.model_files import load_generation_info, resolve_model
from pagedserve.scheduler_svc.config import SchedulerConfig
from pagedserve.scheduler_svc.request import Request
from pagedserve.scheduler_svc.scheduler import Scheduler
from pagedserve.v1 import common_pb2, worker_pb2
from pagedserve.worker_svc.kv_cache import KVCacheSpec
from pagedserve.worker_svc.loader import parse_dtype
from pagedserve.worker_svc.model import ModelConfig

RESULTS = Path(__file__).resolve().parent / "results"


def workload_lengths(
    n: int, prompt: tuple[int, int], output: tuple[int, int], seed: int
) -> list[tuple[int, int]]:
    # The same draws as compare_transformers.build_workload (prompt lengths, then output lengths).
    rng = np.random.default_rng(seed)
    p = rng.integers(prompt[0], prompt[1] + 1, size=n)
    o = rng.integers(output[0], output[1] + 1, size=n)
    return [(int(a), int(b)) for a, b in zip(p, o, strict=True)]


def paged_fit(lengths: list[tuple[int, int]], num_blocks: int, block_size: int) -> tuple[int, float]:
    """Sequences (workload cycled) whose full-length block tables fit the pool; fraction of held slots unused."""
    used = held_tokens = count = 0
    while True:
        p, o = lengths[count % len(lengths)]
        need = -(-(p + o) // block_size)
        if used + need > num_blocks:
            break
        used += need
        held_tokens += p + o
        count += 1
    waste = 1 - held_tokens / (used * block_size) if used else 0.0
    return count, waste


def simulate(lengths: list[tuple[int, int]], num_blocks: int, block_size: int, max_model_len: int, num: int):
    """Run the scheduler with fake samples; (peak running sequences, preemptions, steps)."""
    sched = Scheduler(
        SchedulerConfig(
            num_blocks=num_blocks,
            block_size=block_size,
            max_num_seqs=4096,
            max_num_batched_tokens=8192,
            max_model_len=max_model_len,
            enable_prefix_caching=False,
        )
    )
    for i in range(num):
        p, o = lengths[i % len(lengths)]
        sp = common_pb2.SamplingParams(max_tokens=o, ignore_eos=True, temperature=0)
        sched.add_request(Request(f"r{i}", [(i + t) % 1000 + 3 for t in range(p)], p, sp))
    peak = 0
    while sched.has_unfinished_requests():
        out = sched.schedule()
        peak = max(peak, len(sched.running))
        result = worker_pb2.StepResult(step_id=out.step_id, sampled_token_ids=[7] * len(out.sampled))
        sched.update_from_output(out, result)
    stats = sched.stats()
    return peak, stats.num_preemptions, stats.num_steps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--budgets-mib", default="512,1024,4096")
    parser.add_argument("--num-requests", type=int, default=64, help="workload size (lengths are cycled)")
    parser.add_argument("--prompt-len", default="30,500")
    parser.add_argument("--output-len", default="16,160")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-simulation", action="store_true", help="skip the scheduler run")
    args = parser.parse_args(argv)

    model_dir = resolve_model(args.model)
    mc = ModelConfig.from_hf_config(json.loads((model_dir / "config.json").read_text()))
    max_model_len = min(load_generation_info(model_dir).max_model_len, mc.max_position)
    dtype = parse_dtype(args.dtype, "cpu")
    spec = KVCacheSpec(mc.num_layers, mc.num_kv_heads, mc.head_dim, args.block_size, dtype)
    token_bytes = spec.block_bytes // args.block_size
    lengths = workload_lengths(
        args.num_requests,
        tuple(int(x) for x in args.prompt_len.split(",")),
        tuple(int(x) for x in args.output_len.split(",")),
        args.seed,
    )
    longest = max(p + o for p, o in lengths)
    mean_len = sum(p + o for p, o in lengths) / len(lengths)
    print(
        f"{model_dir.name}, {dtype}: {token_bytes / 1024:.1f} KiB of KV per token; max_model_len {max_model_len}; "
        f"workload mean length {mean_len:.0f}, longest {longest} tokens"
    )

    rows = []
    for mib in (int(x) for x in args.budgets_mib.split(",")):
        budget = mib * 1024**2
        num_blocks = spec.num_blocks_for(budget)
        paged, waste = paged_fit(lengths, num_blocks, args.block_size)
        row = {
            "budget_mib": mib,
            "num_blocks": num_blocks,
            "contiguous_full_len": budget // (max_model_len * token_bytes),
            "contiguous_workload_max": budget // (longest * token_bytes),
            "paged": paged,
            "paged_slot_waste": waste,
        }
        if not args.no_simulation:
            num = max(2 * paged, len(lengths))
            row["sim_peak_running"], row["sim_preemptions"], row["sim_steps"] = simulate(
                lengths, num_blocks, args.block_size, min(max_model_len, num_blocks * args.block_size), num
            )
        rows.append(row)

    print()
    print(
        f"{'budget':>8} {'contig@' + str(max_model_len):>12} {'contig@' + str(longest):>12} "
        f"{'paged':>7} {'x full':>7} {'slot waste':>11} {'sched peak':>11} {'preempt':>8}"
    )
    for r in rows:
        ratio = f"{r['paged'] / r['contiguous_full_len']:.1f}x" if r["contiguous_full_len"] else "-"
        print(
            f"{r['budget_mib']:>5} MiB {r['contiguous_full_len']:>12} {r['contiguous_workload_max']:>12} "
            f"{r['paged']:>7} {ratio:>7} {r['paged_slot_waste']:>10.1%} "
            f"{r.get('sim_peak_running', '-'):>11} {r.get('sim_preemptions', '-'):>8}"
        )

    RESULTS.mkdir(parents=True, exist_ok=True)
    summary = {
        "model": model_dir.name,
        "dtype": str(dtype),
        "block_size": args.block_size,
        "kv_bytes_per_token": token_bytes,
        "max_model_len": max_model_len,
        "workload_mean_len": mean_len,
        "workload_longest": longest,
        "rows": rows,
    }
    (RESULTS / "bench_memory.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot(rows, max_model_len, longest, RESULTS / "bench_memory.png", f"{model_dir.name}, {dtype}")
    print(f"wrote {RESULTS / 'bench_memory.json'} and bench_memory.png")
    return 0


def plot(rows: list[dict], max_model_len: int, longest: int, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = [
        (f"contiguous @ {max_model_len}", "contiguous_full_len"),
        (f"contiguous @ {longest} (workload max)", "contiguous_workload_max"),
        ("paged (block 16, actual lengths)", "paged"),
    ]
    if "sim_peak_running" in rows[0]:
        series.append(("paged, scheduler peak running", "sim_peak_running"))
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    x = np.arange(len(rows))
    width = 0.8 / len(series)
    for k, (label, key) in enumerate(series):
        values = [r[key] for r in rows]
        bars = ax.bar(x + k * width, values, width, label=label)
        ax.bar_label(bars, fontsize=7)
    ax.set_xticks(x + width * (len(series) - 1) / 2, [f"{r['budget_mib']} MiB" for r in rows])
    ax.set_ylabel("concurrent sequences that fit")
    ax.set_title(f"KV cache: sequences per budget ({title})", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    torch.set_num_threads(1)
    raise SystemExit(main())
