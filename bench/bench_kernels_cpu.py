"""CPU micro-benchmarks of paged attention (one layer).

Shapes of SmolLM2-135M: 9 query heads, 3 kv heads, head size 64; block size 16. Each sequence's blocks
are a random permutation of the pool, as after some hours of serving.

Default: the reference paged decode attention; one table of milliseconds per call (best and median of
the repeats: on a shared machine the best is the steadier number) for each batch size x context length,
and the K/V bandwidth of the best.

--prefill: prompt chunks through the C++ kernels (kernels/cpu_ops.py), each of its three paths forced in
turn (the row kernel, the tiled kernel, dense SDPA): milliseconds per call (best of the repeats) for
chunks of q queries after a context, and the tiled kernel's GFLOP/s over the causal query-key pairs.

    .venv/bin/python bench/bench_kernels_cpu.py [--prefill] [--dtype bfloat16] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagedserve.kernels.reference import ReferenceOps

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
    times = time_calls(lambda: ReferenceOps().paged_decode_attention(*args), min_seconds)
    return min(times) * 1e3, statistics.median(times) * 1e3


def time_calls(call, min_seconds: float) -> list[float]:
    """Seconds of each of at least 5 calls, and of as many as fit in min_seconds, after a warm-up call."""
    call()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 5 or time.perf_counter() - start < min_seconds:
        t = time.perf_counter()
        call()
        times.append(time.perf_counter() - t)
    return times


# (queries, context length after them, sequences): short chunks, a chunk after a long cached prefix (a
# request after a shared system prompt), whole prompts, a batch of chunks.
PREFILL_SHAPES = (
    (2, 300, 1),
    (4, 300, 1),
    (8, 300, 1),
    (26, 698, 1),
    (32, 2032, 1),
    (128, 128, 1),
    (275, 275, 1),
    (500, 500, 1),
    (1000, 1000, 1),
    (2000, 2000, 1),
    (256, 512, 4),
)


def time_prefill(q_len: int, ctx: int, seqs: int, dtype: torch.dtype, min_seconds: float) -> dict[str, float]:
    """Best milliseconds per call of each path of CpuOps.paged_prefill_attention."""
    from pagedserve.kernels import cpu_ops

    ops = cpu_ops.CpuOps()
    blocks_per_seq = -(-ctx // BLOCK_SIZE)
    num_blocks = seqs * blocks_per_seq + 1
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM).to(dtype)
    v_cache = torch.randn_like(k_cache)
    block_tables = torch.randperm(num_blocks)[: seqs * blocks_per_seq].view(seqs, -1).int()
    query = torch.randn(seqs * q_len, NUM_HEADS, HEAD_DIM).to(dtype)
    starts = torch.arange(0, seqs * q_len + 1, q_len, dtype=torch.int32)
    lens = torch.full((seqs,), ctx, dtype=torch.int32)
    args = (query, k_cache, v_cache, block_tables, starts, lens, HEAD_DIM**-0.5)
    shipped = cpu_ops.TILE_MIN_LANES, cpu_ops.SDPA_MIN_PAIRS
    best = {}
    try:
        for path, tile_min_lanes, sdpa_min_pairs in (
            ("rows", 1 << 62, 1 << 62),
            ("tiled", 1, 1 << 62),
            ("sdpa", 1 << 62, 0),
        ):
            cpu_ops.TILE_MIN_LANES, cpu_ops.SDPA_MIN_PAIRS = tile_min_lanes, sdpa_min_pairs
            best[path] = min(time_calls(lambda: ops.paged_prefill_attention(*args), min_seconds)) * 1e3
    finally:
        cpu_ops.TILE_MIN_LANES, cpu_ops.SDPA_MIN_PAIRS = shipped
    return best


def prefill_table(dtype: torch.dtype, min_seconds: float) -> None:
    print(
        f"{'queries x context x seqs':>26} {'rows ms':>9} {'tiled ms':>9} {'SDPA ms':>9} {'tiled GFLOP/s':>14}"
    )
    for q_len, ctx, seqs in PREFILL_SHAPES:
        best = time_prefill(q_len, ctx, seqs, dtype, min_seconds)
        pairs = seqs * (q_len * ctx - q_len * (q_len - 1) // 2)
        gflops = pairs * NUM_HEADS * HEAD_DIM * 4 / best["tiled"] / 1e6
        shape = f"{q_len} x {ctx} x {seqs}"
        print(
            f"{shape:>26} {best['rows']:9.3f} {best['tiled']:9.3f} {best['sdpa']:9.3f} {gflops:14.1f}",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--min-seconds", type=float, default=0.3, help="time spent per cell")
    parser.add_argument("--prefill", action="store_true", help="prompt chunks through the C++ kernels' paths")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    if args.prefill:
        print(
            f"paged_prefill_attention (C++ CPU kernels), {args.dtype}, Hq={NUM_HEADS} Hkv={NUM_KV_HEADS} "
            f"D={HEAD_DIM} block={BLOCK_SIZE}, torch threads={torch.get_num_threads()}"
        )
        prefill_table(dtype, args.min_seconds)
        return
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
