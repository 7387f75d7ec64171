"""Paged decode attention benchmark (`make bench-kernels`): the CUDA kernel against the device's copy bandwidth,
PyTorch SDPA on K/V gathered from the same paged cache (timed with and without the gather), and
flex_attention where available (on the gathered dense K/V: a paged flex block mask over a pool this size is
not practical to build per step).

Prints one table per (query heads, kv heads, head size) and writes the tables (markdown) and a plot (PNG).
Block tables are random permutations over a pool several times the L2 size, and L2 is flushed before each
timed call, so the numbers are DRAM numbers. "Useful bytes" = the K/V of every context position + q + out.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

from pagedserve.kernels import cuda_ops

HEADS = [(32, 32), (32, 8), (64, 8), (28, 4)]
EXTRA_HEAD_SIZES = [(32, 8, 64), (32, 8, 256)]
BATCHES = [1, 8, 64, 256]
CONTEXTS = [256, 1024, 4096, 16384, 32768]
BLOCK_SIZE = 16
DTYPE = torch.bfloat16
MAX_KV_BYTES = 16 << 30  # skip shapes whose K+V alone exceed this
MAX_GATHER_BYTES = 8 << 30  # skip the SDPA comparison above this (it materialises K/V again)
TARGET = (64, 4096, 32, 8, 128)  # batch, context, q heads, kv heads, head size: goal >= 80 % of copy BW


class Timer:
    """Median of CUDA-event timings, with L2 flushed before each call."""

    def __init__(self, l2_bytes: int) -> None:
        self.scratch = torch.empty(max(2 * l2_bytes, 64 << 20), dtype=torch.uint8, device="cuda")

    def __call__(self, fn, iters: int = 15, budget_s: float = 1.0) -> float:
        fn()  # warm-up (and compile)
        torch.cuda.synchronize()
        times = []
        start_wall = time.perf_counter()
        for _ in range(iters):
            self.scratch.zero_()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e3)
            if time.perf_counter() - start_wall > budget_s and len(times) >= 3:
                break
        times.sort()
        return times[len(times) // 2]


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in GB/s (read + write bytes), best of several 2 GiB copies."""
    n = 2 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    best = math.inf
    for _ in range(8):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b) / 1e3)
    del src, dst
    return 2 * n / best / 1e9


def gather(cache: torch.Tensor, tables: torch.Tensor, ctx: int) -> torch.Tensor:
    """[B, Hkv, ctx, D] dense K or V of every sequence (all sequences have length ctx here)."""
    nb = math.ceil(ctx / BLOCK_SIZE)
    blocks = cache[tables[:, :nb].long()]  # [B, nb, bs, Hkv, D]
    b, _, _, hkv, d = blocks.shape
    return blocks.reshape(b, nb * BLOCK_SIZE, hkv, d)[:, :ctx].transpose(1, 2)


def make_flex():
    try:
        from torch.nn.attention.flex_attention import flex_attention
    except ImportError:
        return None
    try:
        return torch.compile(flex_attention, dynamic=False)
    except Exception:
        return None


def run(args) -> list[str]:
    props = torch.cuda.get_device_properties(0)
    l2 = getattr(props, "L2_cache_size", 50 << 20)
    timer = Timer(l2)
    copy_gbs = copy_bandwidth()
    lines = [
        f"# Paged decode attention, {props.name}, {props.multi_processor_count} SMs, L2 {l2 >> 20} MiB",
        f"device-to-device copy: {copy_gbs:.0f} GB/s (read + write); dtype bf16, block size {BLOCK_SIZE}",
        "",
    ]
    print("\n".join(lines), flush=True)
    flex = make_flex() if args.flex else None
    rows_for_plot = []
    target_result = None
    shapes = [(hq, hkv, 128) for hq, hkv in HEADS] + EXTRA_HEAD_SIZES
    for hq, hkv, d in shapes:
        header = (
            f"## q heads {hq}, kv heads {hkv}, head size {d}\n\n"
            "| batch | context | splits | µs | useful MB | GB/s | % copy | vs gather+SDPA | vs SDPA only | vs flex (dense) |\n"
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
        )
        print(header, flush=True)
        lines.append(header)
        for batch in args.batches:
            for ctx in args.contexts:
                kv_bytes = 2 * batch * ctx * hkv * d * 2
                if kv_bytes > MAX_KV_BYTES:
                    continue
                row = bench_one(timer, copy_gbs, l2, batch, ctx, hq, hkv, d, flex)
                print(row["line"], flush=True)
                lines.append(row["line"])
                rows_for_plot.append(row)
                if (batch, ctx, hq, hkv, d) == TARGET:
                    target_result = row
                torch.cuda.empty_cache()
        lines.append("")
    if target_result is not None:
        pct = target_result["pct"]
        verdict = "PASS" if pct >= 80 else "BELOW GOAL"
        msg = f"goal (batch 64, context 4096, 32/8 heads, head size 128): {pct:.0f} % of copy bandwidth: {verdict}"
        print(msg)
        lines.append(msg)
    if args.plot:
        plot(rows_for_plot, args.plot, copy_gbs)
    return lines


def bench_one(timer, copy_gbs, l2, batch, ctx, hq, hkv, d, flex) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(batch * 100003 + ctx)
    blocks_per_seq = math.ceil(ctx / BLOCK_SIZE)
    block_bytes = BLOCK_SIZE * hkv * d * 2
    used = batch * blocks_per_seq
    pool = max(used + used // 4, 4 * l2 // block_bytes)
    k = torch.randn(pool, BLOCK_SIZE, hkv, d, device="cuda", dtype=DTYPE, generator=gen)
    v = torch.randn(pool, BLOCK_SIZE, hkv, d, device="cuda", dtype=DTYPE, generator=gen)
    perm = torch.randperm(pool, device="cuda", generator=gen)[:used].to(torch.int32)
    tables = perm.view(batch, blocks_per_seq).contiguous()
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, hq, d, device="cuda", dtype=DTYPE, generator=gen)
    scale = d**-0.5
    num_ctas = batch * hkv * math.ceil((hq // hkv) / cuda_ops.group_tile(hq // hkv))
    splits = cuda_ops.choose_num_splits(
        num_ctas, blocks_per_seq, BLOCK_SIZE, torch.cuda.get_device_properties(0).multi_processor_count
    )

    ops = cuda_ops.CudaOps(q.device)
    us = timer(lambda: ops.paged_decode_attention(q, k, v, tables, lens, scale))
    useful = 2 * batch * ctx * hkv * d * 2 + 2 * batch * hq * d * 2
    gbs = useful / us / 1e3
    pct = 100 * gbs / copy_gbs

    vs_gather = vs_sdpa = vs_flex = "n/a"
    if 2 * batch * ctx * hkv * d * 2 <= MAX_GATHER_BYTES:
        qd = q.unsqueeze(2)  # [B, Hq, 1, D]

        def gathered_sdpa():
            kd, vd = gather(k, tables, ctx), gather(v, tables, ctx)
            return torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, scale=scale, enable_gqa=True)

        us_gather = timer(gathered_sdpa)
        kd = gather(k, tables, ctx).contiguous()
        vd = gather(v, tables, ctx).contiguous()
        us_sdpa = timer(
            lambda: torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, scale=scale, enable_gqa=True)
        )
        vs_gather, vs_sdpa = f"{us_gather / us:.2f}x", f"{us_sdpa / us:.2f}x"
        # NOTE: flex_attention recompiles per shape, so it is timed at the goal's batch and context only.
        if flex is not None and (batch, ctx) == TARGET[:2]:
            try:
                us_flex = timer(lambda: flex(qd, kd, vd, scale=scale, enable_gqa=True))
                vs_flex = f"{us_flex / us:.2f}x"
            except Exception as e:  # flex lacks some shapes (q length 1 on older torch, head size 80...)
                vs_flex = f"n/a ({type(e).__name__})"
        del kd, vd
    line = (
        f"| {batch} | {ctx} | {splits} | {us:.1f} | {useful / 1e6:.1f} | {gbs:.0f} | {pct:.0f} | "
        f"{vs_gather} | {vs_sdpa} | {vs_flex} |"
    )

    return {"line": line, "batch": batch, "ctx": ctx, "hq": hq, "hkv": hkv, "d": d, "gbs": gbs, "pct": pct}


def plot(rows: list[dict], path: Path, copy_gbs: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = sorted({(r["hq"], r["hkv"], r["d"]) for r in rows})
    fig, axes = plt.subplots(1, len(shapes), figsize=(4 * len(shapes), 3.5), sharey=True, squeeze=False)
    for ax, (hq, hkv, d) in zip(axes[0], shapes, strict=True):
        for batch in sorted({r["batch"] for r in rows}):
            pts = [
                (r["ctx"], r["gbs"])
                for r in rows
                if (r["hq"], r["hkv"], r["d"], r["batch"]) == (hq, hkv, d, batch)
            ]
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=f"batch {batch}")
        ax.axhline(copy_gbs, color="gray", linestyle="--", label="d2d copy")
        ax.set_xscale("log", base=2)
        ax.set_title(f"{hq}/{hkv} heads, d={d}")
        ax.set_xlabel("context")
    axes[0][0].set_ylabel("GB/s")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--out", type=Path, default=Path("bench/results/bench_kernels.md"), help="tables (markdown)"
    )
    parser.add_argument("--plot", type=Path, default=Path("bench/results/bench_kernels.png"))
    parser.add_argument("--batches", type=int, nargs="+", default=BATCHES)
    parser.add_argument("--contexts", type=int, nargs="+", default=CONTEXTS)
    parser.add_argument("--no-flex", dest="flex", action="store_false", help="skip the flex_attention column")
    args = parser.parse_args()
    if not cuda_ops.is_available():
        try:
            cuda_ops._cupy()
        except cuda_ops.CudaOpsUnavailable as e:
            print(f"bench-kernels needs the CUDA kernels: {e}", file=sys.stderr)
        sys.exit(1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.plot.parent.mkdir(parents=True, exist_ok=True)
    lines = run(args)
    args.out.write_text("\n".join(lines) + "\n")
    print(f"tables written to {args.out}")


if __name__ == "__main__":
    main()
