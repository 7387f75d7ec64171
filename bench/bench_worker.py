"""Decode step time of the worker against this machine's hardware limits.

For each batch size and context length the worker's ModelRunner executes real step plans: B requests
enter with a context of C tokens already in the KV cache (their K/V are whatever the pool holds:
attention does the same work whatever the values are), then decode steps run and are timed. Next to
each measurement two ceilings:

- compute: the measured matrix-multiply rate (FLOP/s, same dtype) over the model's FLOPs per token;
- memory: streaming the weights once per step at the measured copy bandwidth, shared by the batch.

A shared machine's memory bandwidth drifts by a third from minute to minute, so the copy that sets a
cell's memory ceiling is measured in the cell's own seconds: a copy of 256 MB before every other step,
the median of those against the median of the steps in between (the bandwidth measured at the start is
printed too). A timed step follows a step, as in serving, not the copy: a copy leaves the last level
cache full of its written lines, which the step that follows must write back to memory as it reads (one
sequence at 512 and 2048 positions, 2-core Zen 5 EPYC: 1.02-1.09x as long after a copy as after a step).

The read bandwidth (a sum over a large tensor) is printed next to the copy's: the weights are only
read, and on some machines a copy, which counts its reads and its writes, measures more than a read.

    .venv/bin/python bench/bench_worker.py [--model default] [--dtype auto] [--batch 1,4,16,64,256]
        [--context 128,512,2048] [--steps 8] [--threads N]

Prints a table and writes bench/results/bench_worker.{json,png}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from pagedserve.model_files import resolve_model
from pagedserve.v1 import common_pb2, worker_pb2
from pagedserve.worker_svc.kv_cache import KVCache, KVCacheSpec
from pagedserve.worker_svc.loader import cpu_has_native_bf16, load_model, parse_dtype
from pagedserve.worker_svc.runner import ModelRunner

RESULTS = Path(__file__).resolve().parent / "results"
# Largest B x C the pool is sized for (the default model needs 46 KB of float32 KV per token).
MAX_POOL_TOKENS = 64 * 1024


def best_seconds(fn, repeats: int) -> float:
    """The fastest of `repeats` timed calls of fn, after one untimed call that warms it up."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def torch_matmul_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype in which PyTorch multiplies fastest for work in dtype on this CPU: float32 for bf16 where the
    CPU has no native bf16 (PyTorch emulates bf16 matmuls there, about 1 GFLOP/s on a Zen 3 core pair, and
    the kernels' AVX2 linear widens bf16 to float32 and multiplies in float32), else dtype itself."""
    return torch.float32 if dtype == torch.bfloat16 and not cpu_has_native_bf16() else dtype


def measure_matmul_flops(dtype: torch.dtype, n: int = 2048, repeats: int = 5) -> float:
    """FLOP/s of PyTorch's n x n matmul for work in dtype (in torch_matmul_dtype(dtype))."""
    dtype = torch_matmul_dtype(dtype)
    a = torch.randn(n, n, dtype=dtype)
    b = torch.randn(n, n, dtype=dtype)
    return 2 * n**3 / best_seconds(lambda: torch.mm(a, b), repeats)


class CopyProbe:
    """A memory copy of num_bytes, timed one at a time (read + write counted once each): at the start, and
    between a cell's steps."""

    def __init__(self, num_bytes: int = 256 * 1024 * 1024):
        self.src = torch.empty(num_bytes // 4, dtype=torch.float32).fill_(1.0)
        self.dst = torch.empty_like(self.src)
        self.dst.copy_(self.src)  # the pages touched before the first timed copy

    def sample(self) -> float:
        t = time.perf_counter()
        self.dst.copy_(self.src)
        return 2 * self.src.numel() * 4 / (time.perf_counter() - t)


def measure_copy_bandwidth(num_bytes: int = 512 * 1024 * 1024, repeats: int = 5) -> float:
    """Bytes per second moved by a large memory copy (read + write counted once each): the fastest of
    `repeats` copies."""
    probe = CopyProbe(num_bytes)
    return max(probe.sample() for _ in range(repeats))


def measure_read_bandwidth(num_bytes: int = 512 * 1024 * 1024, repeats: int = 5) -> float:
    """Bytes per second read by a sum over a large tensor: what a stream of weights can reach, where a
    copy's rate also counts the writes, which may run alongside the reads."""
    src = torch.empty(num_bytes // 4, dtype=torch.float32).fill_(1.0)
    return num_bytes / best_seconds(src.sum, repeats)


def flops_per_token(model, context: int) -> float:
    """Multiply-adds of one decode token: every weight matrix once, plus attention over the context."""
    cfg = model.config
    # Every weight matrix, packed or not (the C++ kernels' copies are [N / 16, K / 2, 16, 2]).
    matmul_params = sum(
        p.numel() for name, p in model.named_parameters() if p.dim() >= 2 and "embed_tokens" not in name
    )
    if cfg.tie_word_embeddings and model.tied_head is None:  # the embedding matrix, as the head
        matmul_params += cfg.vocab_size * cfg.hidden_size
    attention = 2 * cfg.num_layers * context * cfg.num_heads * cfg.head_dim
    return 2 * (matmul_params + attention)


def weight_bytes(model) -> int:
    """Bytes a decode step streams: every weight once (a tied head's packed copy counts, not the plain
    embedding matrix it copies)."""
    params = model.named_parameters()
    skip = "embed_tokens." if model.tied_head is not None else None
    return sum(p.numel() * p.element_size() for name, p in params if not (skip and name.startswith(skip)))


def kv_bytes(model, batch: int, context: int) -> int:
    """Bytes of K and V a decode step reads besides the weights (which the memory ceiling leaves out)."""
    cfg = model.config
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * model.dtype.itemsize
    return batch * context * per_token


def decode_plans(batch: int, context: int, block_size: int, vocab: int, steps: int):
    """Step 1 adds B requests whose first C-1 tokens are cached and computes token C-1 (a 1-token
    step, like a decode); the following steps are plain decodes, each growing the context by one."""
    blocks_per_seq = -(-(context + steps) // block_size)
    g = torch.Generator().manual_seed(0)
    plan = worker_pb2.StepPlan(step_id=1)
    for slot in range(batch):
        ids = torch.randint(0, vocab, (context,), generator=g).tolist()
        plan.new_requests.add(
            slot=slot,
            request_id=f"bench-{slot}",
            token_ids=ids,
            prompt_len=context,
            num_computed_tokens=context - 1,
            sampling=common_pb2.SamplingParams(temperature=0.0),
        )
        plan.slots.append(slot)
        plan.num_scheduled_tokens.append(1)
        plan.num_new_blocks.append(blocks_per_seq)
        plan.new_block_ids.extend(range(slot * blocks_per_seq, (slot + 1) * blocks_per_seq))
    yield plan
    for step in range(2, steps + 2):
        yield worker_pb2.StepPlan(
            step_id=step,
            slots=range(batch),
            num_scheduled_tokens=[1] * batch,
            num_new_blocks=[0] * batch,
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batch", default="1,4,16,64,256")
    parser.add_argument("--context", default="128,512,2048")
    parser.add_argument("--steps", type=int, default=8, help="timed decode steps per cell")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batch.split(",")]
    contexts = [int(c) for c in args.context.split(",")]

    device = torch.device("cpu")
    dtype = parse_dtype(args.dtype, device)
    model = load_model(resolve_model(args.model), dtype, device)
    cfg = model.config
    print(f"measuring this machine ({torch.get_num_threads()} threads, {dtype}) ...", flush=True)
    flops = measure_matmul_flops(dtype)
    bandwidth = measure_copy_bandwidth()
    read_bandwidth = measure_read_bandwidth()
    wbytes = weight_bytes(model)
    print(
        f"matmul {flops / 1e9:.0f} GFLOP/s, copy {bandwidth / 1e9:.1f} GB/s at the start, "
        f"read {read_bandwidth / 1e9:.1f} GB/s, weights {wbytes / 1e6:.0f} MB ({cfg.num_layers} layers)"
    )

    # Each timed step comes after an untimed one that follows the copy (see the module's docstring).
    num_plans = 2 * (args.steps + 1)
    cells = [(b, c) for c in contexts for b in batches if b * (c + num_plans) <= MAX_POOL_TOKENS]
    skipped = [(b, c) for c in contexts for b in batches if (b, c) not in cells]
    rows = []
    probe = CopyProbe()
    for batch, context in tqdm(cells, desc="decode cells", unit="cell"):
        blocks_per_seq = -(-(context + num_plans) // args.block_size)
        spec = KVCacheSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, args.block_size, dtype)
        runner = ModelRunner(model, KVCache(spec, batch * blocks_per_seq, device), context + num_plans + 1)
        times, copies, prepares, samples = [], [], [], []
        for k, plan in enumerate(decode_plans(batch, context, args.block_size, cfg.vocab_size, num_plans)):
            timed = k % 2 == 1
            if not timed:
                copies.append(probe.sample())
            t = time.perf_counter()
            result = runner.execute(plan)
            if timed:
                times.append(time.perf_counter() - t)
                prepares.append(result.timings.prepare_seconds)
                samples.append(result.timings.sample_seconds)
        step = statistics.median(times[1:])  # the first steps warm up allocators and caches
        cell_bandwidth = statistics.median(copies[1:])
        tokens_per_s = batch / step
        compute_ceiling = flops / flops_per_token(model, context)
        memory_ceiling = batch * cell_bandwidth / wbytes
        ceiling = min(compute_ceiling, memory_ceiling)
        rows.append(
            {
                "batch": batch,
                "context": context,
                "step_ms": step * 1e3,
                "prepare_us": statistics.median(prepares[1:]) * 1e6,
                "sample_us": statistics.median(samples[1:]) * 1e6,
                "copy_bandwidth": cell_bandwidth,
                "kv_bytes": kv_bytes(model, batch, context),
                "tokens_per_s": tokens_per_s,
                "ceiling_tokens_per_s": ceiling,
                "compute_ceiling": compute_ceiling,
                "memory_ceiling": memory_ceiling,
                "fraction_of_ceiling": tokens_per_s / ceiling,
            }
        )
        del runner

    print()
    print(
        f"{'batch':>6} {'context':>8} {'step ms':>9} {'prep us':>8} {'samp us':>8} {'tok/s':>9} {'copy GB/s':>10} "
        f"{'KV MB':>7} {'ceiling':>9} {'bound':>7} {'of ceiling':>11}"
    )
    for r in rows:
        bound = "compute" if r["compute_ceiling"] < r["memory_ceiling"] else "memory"
        print(
            f"{r['batch']:>6} {r['context']:>8} {r['step_ms']:>9.1f} {r['prepare_us']:>8.0f} {r['sample_us']:>8.0f} "
            f"{r['tokens_per_s']:>9.1f} "
            f"{r['copy_bandwidth'] / 1e9:>10.1f} {r['kv_bytes'] / 1e6:>7.0f} {r['ceiling_tokens_per_s']:>9.1f} {bound:>7} "
            f"{r['fraction_of_ceiling']:>10.0%}"
        )
    print(
        "prep us / samp us: the runner's Python before the forward pass (StepTimings.prepare_seconds) and after "
        "it (sample_seconds), medians; copy GB/s: the median of a copy before every other step of the cell, "
        "which sets its memory ceiling; KV MB: the K and V a step reads besides the weights (not in the ceiling)"
    )
    if skipped:
        print(f"skipped (KV pool over {MAX_POOL_TOKENS} tokens): {skipped}")

    RESULTS.mkdir(parents=True, exist_ok=True)
    summary = {
        "dtype": str(dtype),
        "threads": torch.get_num_threads(),
        "matmul_flops": flops,
        "copy_bandwidth": bandwidth,
        "read_bandwidth": read_bandwidth,
        "weight_bytes": wbytes,
        "rows": rows,
    }
    (RESULTS / "bench_worker.json").write_text(json.dumps(summary, indent=2))
    plot(rows, contexts, RESULTS / "bench_worker.png")
    print(f"wrote {RESULTS / 'bench_worker.json'} and bench_worker.png")
    return 0


def plot(rows: list[dict], contexts: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for context in contexts:
        cell = [r for r in rows if r["context"] == context]
        if not cell:
            continue
        (line,) = ax.plot(
            [r["batch"] for r in cell], [r["tokens_per_s"] for r in cell], "o-", label=f"ctx {context}"
        )
        ax.plot(
            [r["batch"] for r in cell],
            [r["ceiling_tokens_per_s"] for r in cell],
            "--",
            color=line.get_color(),
            alpha=0.6,
            label=f"ceiling ctx {context}",
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch size (sequences decoding)")
    ax.set_ylabel("output tokens / s")
    ax.set_title("Worker decode throughput vs hardware ceiling")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
