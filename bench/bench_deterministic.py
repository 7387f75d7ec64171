"""The cost of batch-invariant kernels (--deterministic): the same work with the kernels' switch off and on,
taking turns in one process, so that both variants meet the same moments of a shared machine.

Three measures:
  - the kernels whose choice the switch changes, one call at a time at the default model's shapes (bf16):
    the linear for one row (a decode step) and for many (a prompt: each projection at each of --rows,
    oneDNN's with the switch off, the AMX tiles' on), a prompt's attention and decode attention, the
    median of repeated calls;
  - bench-compare's mixed workload (compare_transformers.build_workload: prompts of 30..500 tokens and
    outputs of 16..160, all there at t=0) through one offline LLM, its prefix cache reset before each
    run; output tokens/s;
  - bench_worker's decode step (compare bench_worker.decode_plans): B sequences of C cached positions,
    the median step time.
Each round runs the variants in turn, the order alternating between rounds (off-on, on-off, ...); a
variant's figure is its median over the rounds, and the cost is on's time over off's.

    .venv/bin/python bench/bench_deterministic.py [--num-requests 24] [--rounds 5] [--dtype auto]
        [--batch 1,16] [--context 512,2048] [--steps 16] [--threads N] [--kernels-only] [--rows 1500]

Prints a table and writes bench/results/bench_deterministic.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from pagedserve.model_files import load_tokenizer, resolve_model

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the kernel tests' paged cache
from bench_worker import decode_plans
from compare_transformers import build_workload, run_pagedserve, tokens_per_s

RESULTS = Path(__file__).resolve().parent / "results"
VARIANTS = (False, True)  # batch_invariant off, on


def _orders(rounds: int) -> list[tuple[bool, ...]]:
    return [VARIANTS if r % 2 == 0 else VARIANTS[::-1] for r in range(rounds)]


def _row(measure: str, runs: dict[bool, list[float]], scale: float = 1.0, rate: bool = False) -> dict:
    """A table row: each variant's median (times scale) and the cost, on's time over off's (for a rate,
    off's rate over on's)."""
    off, on = statistics.median(runs[False]) * scale, statistics.median(runs[True]) * scale
    cost = off / on - 1 if rate else on / off - 1
    return {
        "measure": measure,
        "off": off,
        "on": on,
        "cost": cost,
        "runs_off": runs[False],
        "runs_on": runs[True],
    }


def kernel_rounds(ops, rounds: int, many_rows: list[int]) -> list[dict]:
    """Median seconds of each kernel call of the default model's shapes under each variant; the many-row
    linears at each count of many_rows."""
    from test_kernels_reference import Case

    ext = ops._extension
    gen = torch.Generator().manual_seed(0)
    shapes = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
    packed = {
        k: (n, ext.pack_linear_weight(torch.randn(n, k_, generator=gen).bfloat16()))
        for k, (n, k_) in shapes.items()
    }
    head = ext.pack_linear_weight(torch.randn(49152, 576, generator=gen).bfloat16())
    row = {k: torch.randn(1, k_, generator=gen).bfloat16() for k, (_, k_) in shapes.items()}
    prompt_rows = {k_: torch.randn(max(many_rows), k_, generator=gen).bfloat16() for k_ in (576, 1536)}

    def layer_linears() -> None:
        for name, (n, w) in packed.items():
            ext.linear(row[name], w, n, None)

    prompt = Case([500], 16, 3, 64, torch.bfloat16, seed=1, layout="head-major")
    prompt_q = torch.randn(500, 9, 64, generator=gen).bfloat16()
    starts = torch.tensor([0, 500], dtype=torch.int32)
    decode = Case([2048] * 16, 16, 3, 64, torch.bfloat16, seed=2, layout="head-major")
    decode_q = torch.randn(16, 9, 64, generator=gen).bfloat16()
    calls = {
        "one row: a layer's qkv, o, gate_up, down": (layer_linears, 20),
        "one row: the LM head (49152 x 576)": (lambda: ext.linear(row["qkv"], head, 49152, None), 10),
        **{
            f"{m} rows: {name}": (
                lambda m=m, name=name, n=n, k_=k_: ext.linear(prompt_rows[k_][:m], packed[name][1], n, None),
                5,
            )
            for m in many_rows
            for name, (n, k_) in shapes.items()
        },
        **{
            f"{m} rows: gate_up and SiLU (the MLP's call)": (
                lambda m=m: ext.linear_silu(prompt_rows[576][:m], packed["gate_up"][1], 1536, None),
                5,
            )
            for m in many_rows
        },
        "a 500-token prompt's attention, one layer": (
            lambda: ops.paged_prefill_attention(
                prompt_q,
                prompt.k_cache,
                prompt.v_cache,
                prompt.block_tables,
                starts,
                prompt.context_lens,
                0.125,
            ),
            5,
        ),
        "16 decode rows of 2048 positions, one layer": (
            lambda: ops.paged_decode_attention(
                decode_q, decode.k_cache, decode.v_cache, decode.block_tables, decode.context_lens, 0.125
            ),
            10,
        ),
        "one decode row of 2048 positions, one layer": (
            lambda: ops.paged_decode_attention(
                decode_q[:1],
                decode.k_cache,
                decode.v_cache,
                decode.block_tables[:1],
                decode.context_lens[:1],
                0.125,
            ),
            20,
        ),
    }
    out = []
    for name, (call, repeats) in calls.items():
        times: dict[bool, list[float]] = {v: [] for v in VARIANTS}
        for order in _orders(rounds):
            for invariant in order:
                ops.batch_invariant = invariant
                call()  # warm
                samples = []
                for _ in range(repeats):
                    started = time.perf_counter()
                    call()
                    samples.append(time.perf_counter() - started)
                times[invariant].append(statistics.median(samples))
        out.append(_row(f"{name} (ms)", times, 1e3))
        print(f"{name}: {out[-1]['off']:.3f} ms off, {out[-1]['on']:.3f} ms on", flush=True)
    return out


def workload_rounds(llm, work, rounds: int) -> dict[bool, list[float]]:
    """Output tokens/s of each variant, one run per round."""
    rates: dict[bool, list[float]] = {v: [] for v in VARIANTS}
    for order in _orders(rounds):
        for invariant in order:
            llm.runner.ops.batch_invariant = invariant
            llm.reset_prefix_cache()  # the same prompts again: computed again
            rates[invariant].append(tokens_per_s(run_pagedserve(llm, work)))
    return rates


def decode_rounds(llm, batch: int, context: int, steps: int, rounds: int) -> dict[bool, list[float]]:
    """Median decode step seconds of each variant, one cell per round, on a runner over the LLM's model."""
    from pagedserve.worker_svc.kv_cache import KVCache, KVCacheSpec
    from pagedserve.worker_svc.runner import ModelRunner

    cfg, dtype, block_size = llm.model.config, llm.kv_cache.spec.dtype, llm.kv_cache.spec.block_size
    spec = KVCacheSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, block_size, dtype)
    blocks = batch * -(-(context + steps + 1) // block_size)
    times: dict[bool, list[float]] = {v: [] for v in VARIANTS}
    for order in _orders(rounds):
        for invariant in order:
            llm.runner.ops.batch_invariant = invariant
            runner = ModelRunner(llm.model, KVCache(spec, blocks, torch.device("cpu")), context + steps + 2)
            step_times = []
            for plan in decode_plans(batch, context, block_size, cfg.vocab_size, steps):
                started = time.perf_counter()
                runner.execute(plan)
                step_times.append(time.perf_counter() - started)
            times[invariant].append(statistics.median(step_times[2:]))  # after the first steps' warm-up
            del runner
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-requests", type=int, default=24)
    parser.add_argument("--prompt-len", default="30,500", help="min,max prompt tokens")
    parser.add_argument("--output-len", default="16,160", help="min,max output tokens")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch", default="1,16", help="decode batch sizes")
    parser.add_argument("--context", default="512,2048", help="decode context lengths")
    parser.add_argument("--steps", type=int, default=16, help="decode steps per cell")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--kernels-only", action="store_true", help="the kernel calls alone")
    parser.add_argument("--rows", default="1500", help="row counts of the many-row linears")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from pagedserve.llm import LLM

    model_dir = resolve_model(args.model)
    prompt_range = tuple(int(x) for x in args.prompt_len.split(","))
    output_range = tuple(int(x) for x in args.output_len.split(","))
    work = build_workload(load_tokenizer(model_dir), args.num_requests, prompt_range, output_range, args.seed)
    llm = LLM(model=args.model, dtype=args.dtype)
    if llm.runner.ops.name != "cpu":
        parser.error(
            f"the batch-invariant switch is the CPU kernels'; this engine runs {llm.runner.ops.name}"
        )
    rows = kernel_rounds(llm.runner.ops, args.rounds, [int(m) for m in args.rows.split(",")])
    if not args.kernels_only:
        rates = workload_rounds(llm, work, args.rounds)
        rows.append(_row(f"bench-compare workload, {len(work)} requests (output tok/s)", rates, rate=True))
    for context in [] if args.kernels_only else (int(c) for c in args.context.split(",")):
        for batch in (int(b) for b in args.batch.split(",")):
            times = decode_rounds(llm, batch, context, args.steps, args.rounds)
            rows.append(_row(f"decode step, batch {batch}, context {context} (ms)", times, 1e3))
    print(
        f"\n{torch.get_num_threads()} threads, {llm.dtype}, medians of {args.rounds} rounds, the variants taking turns"
    )
    print(f"{'measure':<52} {'off':>9} {'on':>9} {'cost':>8}")
    for r in rows:
        print(f"{r['measure']:<52} {r['off']:>9.1f} {r['on']:>9.1f} {r['cost']:>+8.1%}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "bench_deterministic.json"
    summary = {
        "dtype": str(llm.dtype),
        "threads": torch.get_num_threads(),
        "rounds": args.rounds,
        "rows": rows,
    }
    out.write_text(json.dumps(summary, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
