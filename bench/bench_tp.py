"""What tensor parallelism costs on this machine: the all-reduce per layer, the step inputs' broadcast, and
a step of TP=2 against TP=1.

1. The all-reduce alone: two ranks (this process and one it starts, gloo on loopback) sum a [T, hidden]
   tensor, T from decode batch sizes to prefill chunks; a layer makes two (after o and after down).
2. The step inputs from rank 0 to the others: the two tensor broadcasts parallel.StepBroadcast sends,
   against broadcast_object_list (a pickle) of the same tensors.
3. Steps: the worker's ModelRunner over a model shaped like SmolLM2-135M but with 8 query heads and 4 kv
   heads of 72 (the real one has 9 and 3, which 2 ranks cannot split), random weights, taking turns:
   TP=1 with the decoder stack (all layers in one C++ call), TP=1 running the model's layer loop (the
   path a TP rank takes, the stack having no place for the all-reduce), and TP=2; for TP=2 also the time
   rank 0 spends inside its all-reduces during the steps (the sum, and the wait for the other rank). TP=1
   runs with all the cores and with one rank's share of them (on a machine whose cores other work shares,
   OpenMP's threads wait on each other at every barrier, and fewer threads can be faster).

NOTE: one machine's cores are shared by the ranks: TP=2 on 2 cores runs each rank on one core where TP=1
runs 2 threads over both, so this measures TP's overhead, not a speedup, which needs a device (or
socket) per rank. On GPUs the all-reduce goes through NCCL, which one GPU cannot measure.

    .venv/bin/python bench/bench_tp.py [--tokens 1,8,32,128,512,2048] [--batch 1,8,32] [--prefill 512]

Prints tables and writes bench/results/bench_tp.{json,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from bench_worker import decode_plans

from pagedserve.launcher import free_port
from pagedserve.v1 import common_pb2, worker_pb2
from pagedserve.worker_svc.assembly import assemble
from pagedserve.worker_svc.model import AttentionMetadata
from pagedserve.worker_svc.parallel import StepBroadcast, join_group

RESULTS = Path(__file__).resolve().parent / "results"
HIDDEN = 576  # SmolLM2-135M's
LAYERS = 30


# ---- 1 and 2: the collectives alone, on two ranks --------------------------------------------------------


def _inputs(batch: int, tokens_each: int, max_blocks: int) -> tuple:
    t = batch * tokens_each
    attn = AttentionMetadata(
        slot_mapping=torch.arange(t, dtype=torch.int64),
        block_tables=torch.zeros(batch, max_blocks, dtype=torch.int32),
        query_start_loc=torch.arange(0, t + 1, tokens_each, dtype=torch.int32),
        context_lens=torch.full((batch,), 512, dtype=torch.int32),
        max_query_len=tokens_each,
    )
    return torch.zeros(t, dtype=torch.int64), torch.arange(t, dtype=torch.int64), attn, None


def collectives(rank: int, address: str, tokens: list[int], dtypes: list[str], repeats: int) -> dict:
    """Both ranks run this; rank 0's timings come back (median microseconds)."""
    group = join_group(rank, 2, address, torch.device("cpu"))
    out: dict = {"all_reduce": {}, "broadcast": {}}
    for name in dtypes:
        dtype = getattr(torch, name)
        for t in tokens:
            x = torch.randn(t, HIDDEN).to(dtype)
            times = []
            for i in range(repeats + 5):
                dist.barrier()
                start = time.perf_counter()
                group.all_reduce(x)
                if i >= 5:
                    times.append(time.perf_counter() - start)
            out["all_reduce"][f"{name}:{t}"] = statistics.median(times) * 1e6
    broadcast = StepBroadcast(group)
    for batch, each in [(1, 1), (32, 1), (256, 1), (1, 2048)]:
        ids, positions, attn, rows = _inputs(batch, each, 64)
        for how in ("tensors", "pickle"):
            times = []
            for i in range(repeats + 5):
                dist.barrier()
                start = time.perf_counter()
                if how == "tensors":
                    if rank == 0:
                        broadcast.send_forward(ids, positions, attn, rows)
                    else:
                        broadcast.receive()
                else:
                    box = [(ids, positions, attn, rows)] if rank == 0 else [None]
                    dist.broadcast_object_list(box, src=0)
                if i >= 5:
                    times.append(time.perf_counter() - start)
            out["broadcast"][f"{how}:{batch}x{each}"] = statistics.median(times) * 1e6
    dist.destroy_process_group()
    return out


# ---- 3: steps on runners taking turns ---------------------------------------------------------------------


def save_model(path: Path) -> Path:
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=HIDDEN,
        intermediate_size=1536,
        num_hidden_layers=LAYERS,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=72,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    model.save_pretrained(path, safe_serialization=True)
    return path


def prefill_plans(tokens: int, block_size: int, vocab: int):
    g = torch.Generator().manual_seed(0)
    plan = worker_pb2.StepPlan(step_id=1, slots=[0], num_scheduled_tokens=[tokens])
    plan.new_requests.add(
        slot=0,
        request_id="bench-prefill",
        token_ids=torch.randint(0, vocab, (tokens,), generator=g).tolist(),
        prompt_len=tokens,
        num_computed_tokens=0,
        sampling=common_pb2.SamplingParams(temperature=0.0),
    )
    blocks = -(-(tokens + 1) // block_size)
    plan.num_new_blocks.append(blocks)
    plan.new_block_ids.extend(range(blocks))
    yield plan


class TimedAllReduce:
    """Rank 0's all-reduces during steps: their count and seconds."""

    def __init__(self, all_reduce) -> None:
        self.all_reduce, self.calls, self.seconds = all_reduce, 0, 0.0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        out = self.all_reduce(x)
        self.seconds += time.perf_counter() - start
        self.calls += 1
        return out


def steps(model_dir: Path, batches: list[int], prefill: int, context: int, repeats: int, dtype: str) -> dict:
    cores = len(os.sched_getaffinity(0))
    common = dict(dtype=dtype, device="cpu", block_size=16, num_blocks=640, max_model_len=8192)
    tp1 = assemble(str(model_dir), **common)
    loop = assemble(str(model_dir), **common)
    tp1_half = assemble(str(model_dir), **common)
    loop.model.stack = None  # the layer loop: what a TP rank runs
    tp2 = assemble(str(model_dir), **common, tensor_parallel_size=2, threads=max(1, cores // 2))
    timed = TimedAllReduce(tp2.model.model.layers[0].mlp.all_reduce)
    for layer in tp2.model.model.layers:
        layer.self_attn.all_reduce = layer.mlp.all_reduce = timed
    half = max(1, cores // 2)
    variants = {
        "tp1_stack": (tp1, cores),
        "tp1_stack_half_threads": (tp1_half, half),  # TP=1 with one rank's share of the cores
        "tp1_layer_loop_half_threads": (loop, half),
        "tp2": (tp2, half),
    }
    vocab = 49152
    cells = [(f"decode B={b}", lambda b=b: decode_plans(b, context, 16, vocab, 8)) for b in batches]
    cells.append((f"prefill {prefill} tokens", lambda: prefill_plans(prefill, 16, vocab)))
    out = {}
    for label, make in cells:
        times: dict[str, list[float]] = {name: [] for name in variants}
        reduce_share = []
        for _ in range(repeats):
            plans = {name: list(make()) for name in variants}
            for worker, _ in variants.values():
                worker.runner.reset()
            for i in range(len(plans["tp1_stack"])):
                for name, (worker, threads) in variants.items():
                    torch.set_num_threads(threads)
                    timed.calls, timed.seconds = 0, 0.0
                    start = time.perf_counter()
                    worker.runner.execute(plans[name][i])
                    elapsed = time.perf_counter() - start
                    if i > 0 or label.startswith("prefill"):  # decode: the steps after the one that adds them
                        times[name].append(elapsed)
                        if name == "tp2":
                            reduce_share.append((timed.seconds, timed.calls))
        row = {name: statistics.median(v) * 1e3 for name, v in times.items()}
        seconds = statistics.median(s for s, _ in reduce_share)
        calls = reduce_share[0][1]
        row["tp2_all_reduce_ms"] = seconds * 1e3
        row["tp2_all_reduce_per_layer_us"] = seconds / LAYERS * 1e6
        row["all_reduce_calls"] = calls
        out[label] = row
        print(
            f"{label:16} TP=1: stack {row['tp1_stack']:8.2f} ms, with {half} thread(s) "
            f"{row['tp1_stack_half_threads']:8.2f} ms, layer loop with {half} {row['tp1_layer_loop_half_threads']:8.2f} ms;  "
            f"TP=2 {row['tp2']:8.2f} ms (in all-reduces {row['tp2_all_reduce_ms']:.2f} ms, "
            f"{row['tp2_all_reduce_per_layer_us']:.0f} us a layer)",
            flush=True,
        )
    tp2.close()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", default="1,8,32,128,512,2048", help="rows of the all-reduced tensor")
    parser.add_argument("--batch", default="1,8,32", help="decode batch sizes of the step comparison")
    parser.add_argument("--prefill", type=int, default=512, help="prompt tokens of the prefill step")
    parser.add_argument("--context", type=int, default=256, help="decode context per sequence")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeats", type=int, default=50, help="timings per all-reduce size")
    parser.add_argument("--step-repeats", type=int, default=3, help="rounds of each step cell")
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--init", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    tokens = [int(t) for t in args.tokens.split(",")]
    dtypes = ["float32", "bfloat16"]
    torch.set_num_threads(1)
    if args.rank:
        collectives(args.rank, args.init, tokens, dtypes, args.repeats)
        return 0

    address = f"tcp://127.0.0.1:{free_port()}"
    other = subprocess.Popen(
        [sys.executable, __file__, *(argv or sys.argv[1:]), "--rank", "1", "--init", address]
    )
    result = {"collectives": collectives(0, address, tokens, dtypes, args.repeats)}
    other.wait()
    print(
        f"\nAll-reduce of [T, {HIDDEN}] over 2 ranks (gloo, loopback), median microseconds; a layer makes two"
    )
    print(f"{'T':>6} " + " ".join(f"{d:>10}" for d in dtypes))
    for t in tokens:
        print(
            f"{t:>6} " + " ".join(f"{result['collectives']['all_reduce'][f'{d}:{t}']:10.0f}" for d in dtypes)
        )
    print("\nStep inputs from rank 0 (median microseconds)")
    for key, us in result["collectives"]["broadcast"].items():
        print(f"  {key:18} {us:8.0f}")

    print(f"\nSteps ({args.dtype}, context {args.context}), median milliseconds, runners taking turns:")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = save_model(Path(tmp))
        batches = [int(b) for b in args.batch.split(",")]
        result["steps"] = steps(model_dir, batches, args.prefill, args.context, args.step_repeats, args.dtype)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "bench_tp.json").write_text(json.dumps(result, indent=2))
    plot(result, tokens, dtypes, RESULTS / "bench_tp.png")
    print(f"\nwrote {RESULTS / 'bench_tp.json'} and bench_tp.png")
    return 0


def plot(result: dict, tokens: list[int], dtypes: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for d in dtypes:
        left.plot(
            tokens, [result["collectives"]["all_reduce"][f"{d}:{t}"] for t in tokens], marker="o", label=d
        )
    left.set_xscale("log")
    left.set_yscale("log")
    left.set_xlabel("tokens T")
    left.set_ylabel(f"all-reduce of [T, {HIDDEN}], us")
    left.set_title("gloo all-reduce, 2 ranks")
    left.legend()
    labels = list(result["steps"])
    width = 0.2
    for i, name in enumerate(("tp1_stack", "tp1_stack_half_threads", "tp1_layer_loop_half_threads", "tp2")):
        right.bar(
            [x + i * width for x in range(len(labels))],
            [result["steps"][c][name] for c in labels],
            width,
            label=name,
        )
    right.set_xticks([x + 1.5 * width for x in range(len(labels))], labels, rotation=15)
    right.set_ylabel("step, ms")
    right.set_yscale("log")
    right.set_title("step time (2 cores shared by the ranks)")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
