"""CPU micro-benchmark of the reference paged decode attention (one layer).

Shapes of SmolLM2-135M: 9 query heads, 3 kv heads, head size 64; block size 16. Each sequence's blocks
are a random permutation of the pool, as after some hours of serving. Prints one table: milliseconds
per call (best and median of the repeats: on a shared machine the best is the steadier number) for each
batch size x context length, and the K/V bandwidth of the best.

    .venv/bin/python bench/bench_kernels_cpu.py [--dtype bfloat16] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagedserve.kernels import reference

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
BATCHES = (1, 4, 16, 64)
CONTEXTS = (256, 512, 1024, 2048)


def time_decode(batch: int, ctx: int, dtype: torch.dtype, min_seconds: float) -> tuple[float, float]:
    """(best, median) milliseconds per call."""
    blocks_per_seq = -(-ctx // BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq + 1
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM).to(dtype)
    v_cache = torch.randn_like(k_cache)
    block_tables = torch.randperm(num_blocks)[: batch * blocks_per_seq].view(batch, -1).int()
    context_lens = torch.full((batch,), ctx, dtype=torch.int32)
    query = torch.randn(batch, NUM_HEADS, HEAD_DIM).to(dtype)
    args = (query, k_cache, v_cache, block_tables, context_lens, HEAD_DIM**-0.5)
    reference.paged_decode_attention(*args)  # warm-up
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 5 or time.perf_counter() - start < min_seconds:
        t = time.perf_counter()
        reference.paged_decode_attention(*args)
        times.append(time.perf_counter() - t)
    return min(times) * 1e3, statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--min-seconds", type=float, default=0.3, help="time spent per cell")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    print(
        f"paged_decode_attention (reference), {args.dtype}, Hq={NUM_HEADS} Hkv={NUM_KV_HEADS} "
        f"D={HEAD_DIM} block={BLOCK_SIZE}, torch threads={torch.get_num_threads()}"
    )
    print("ms per call: best / median   [K/V GB/s read at best]")
    print(f"{'batch':>6} " + " ".join(f"{f'ctx {c}':>28}" for c in CONTEXTS))
    for batch in BATCHES:
        cells = []
        for ctx in CONTEXTS:
            best, median = time_decode(batch, ctx, dtype, args.min_seconds)
            kv_bytes = 2 * batch * ctx * NUM_KV_HEADS * HEAD_DIM * dtype.itemsize
            cells.append(f"{best:8.3f} / {median:8.3f} [{kv_bytes / best / 1e6:5.1f}]")
        print(f"{batch:>6} " + " ".join(f"{c:>28}" for c in cells), flush=True)


if __name__ == "__main__":
    main()
