"""CPU micro-benchmarks of the C++ kernels: paged attention (one layer) and the linear layers.

Shapes of SmolLM2-135M: 9 query heads, 3 kv heads, head size 64; block size 16. Each sequence's blocks
are a random permutation of the pool, as after some hours of serving.

Default: the reference paged decode attention; one table of milliseconds per call (best and median of
the repeats: on a shared machine the best is the steadier number) for each batch size x context length,
and the K/V bandwidth of the best. --kernels: the C++ kernels' decode attention instead, over blocks
scattered through the pool and over blocks in pool order: the kernels prefetch each sequence's next block
through its block table, which is what keeps the scattered reads near the ordered ones.

--prefill: prompt chunks through the C++ kernels (kernels/cpu_ops.py), each of its three paths forced in
turn (the row kernel, the tiled kernel, dense SDPA): milliseconds per call (best of the repeats) for
chunks of q queries after a context, and the tiled kernel's GFLOP/s over the causal query-key pairs.

--linear: the linear layers of a SmolLM2-135M step (30 x qkv, o, gate_up and down, and the LM head, each
call with its own copy of the weights, in a step's order) at 1 to 2048 rows, through the kernels' linear
and through oneDNN as PyTorch runs it (F.linear: oneDNN for bf16, MKL's sgemm for float32; and oneDNN's
prepacked linear, model.PackedLinear's other choice, prepacked for the call's row count), in bf16 and in
float32. --march builds the kernels for other instruction sets too (PAGEDSERVE_CPU_MARCH, each in its own
process) and holds oneDNN and MKL to that instruction set there (ONEDNN_MAX_CPU_ISA,
MKL_ENABLE_INSTRUCTIONS): what the kernels' linear is up against on such a CPU. GFLOP/s of a step's
linears per build, dtype and system, then per shape; writes bench/results/bench_kernels_cpu_linear.{json,png}.

    .venv/bin/python bench/bench_kernels_cpu.py [--prefill | --linear [--march native,icelake-server,haswell]]
        [--dtype bfloat16] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from pagedserve.kernels import cpu_ops
from pagedserve.kernels.reference import ReferenceOps

RESULTS = Path(__file__).resolve().parent / "results"
# --linear's worker for -march=native-no-amx: the kernels keep off AMX.
NO_AMX = False

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
BATCHES = (1, 4, 16, 64)
CONTEXTS = (256, 512, 1024, 2048)


def time_decode(
    batch: int, ctx: int, dtype: torch.dtype, min_seconds: float, ops=None, scattered: bool = True
) -> tuple[float, float]:
    """(best, median) milliseconds per call; the cache is laid out head-major, as the worker's pool is."""
    blocks_per_seq = -(-ctx // BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq + 1
    k_cache = torch.randn(num_blocks, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM).to(dtype).transpose(1, 2)
    v_cache = torch.randn_like(k_cache)
    order = torch.randperm(num_blocks) if scattered else torch.arange(num_blocks)
    block_tables = order[: batch * blocks_per_seq].view(batch, -1).int()
    context_lens = torch.full((batch,), ctx, dtype=torch.int32)
    query = torch.randn(batch, NUM_HEADS, HEAD_DIM).to(dtype)
    args = (query, k_cache, v_cache, block_tables, context_lens, HEAD_DIM**-0.5)
    ops = ops or ReferenceOps()
    times = time_calls(lambda: ops.paged_decode_attention(*args), min_seconds)
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


# ---- linear layers ---------------------------------------------------------------------------------------

# SmolLM2-135M's linear layers as a step calls them: (name, N, K, calls a step). qkv holds 9 query heads and
# 3 kv heads of 64, gate_up the MLP's gate and up projections side by side, head the tied LM head.
LINEAR_SHAPES = (
    ("qkv", 960, 576, 30),
    ("o", 576, 576, 30),
    ("gate_up", 3072, 576, 30),
    ("down", 576, 1536, 30),
    ("head", 49152, 576, 1),
)
LINEAR_ROWS = (1, 2, 4, 8, 16, 32, 64, 256, 2048)
# The instruction sets oneDNN, MKL and ATen may use where the kernels are built for an older CPU than this
# one: the libraries' best on such a CPU, which is what the kernels' linear is up against there.
MARCH_LIBRARY_ISA = {
    "native": {},
    "icelake-server": {
        "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI",
        "MKL_ENABLE_INSTRUCTIONS": "AVX512",
        "ATEN_CPU_CAPABILITY": "avx512",
    },
    "haswell": {
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
        "ATEN_CPU_CAPABILITY": "avx2",
    },
    # This CPU's own build with neither the kernels nor oneDNN on AMX: AVX-512 BF16 alone, as on an AMD Zen 4.
    "native-no-amx": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"},
}


@dataclass
class LinearSystem:
    name: str
    prepare: Callable[[torch.Tensor, int], object]  # (weight [N, K], rows) -> what call takes
    call: Callable[[torch.Tensor, object, int], torch.Tensor]  # (x, prepared, N) -> y
    amx: bool = True  # the kernels' set_amx_enabled while it runs
    onednn: bool = True  # whether the kernels hand many rows to oneDNN (set_onednn_min_rows), as shipped
    by_rows: bool = False  # prepared for each row count


def linear_kernels(dtype: torch.dtype):
    """The extension, where its build has the linear layer for weights of `dtype`; else None."""
    linear = cpu_ops.CpuOps().linear
    return cpu_ops.load() if linear is not None and dtype in linear.dtypes else None


def onednn_min_rows(kernels, f32: bool) -> int:
    """Rows from which the kernels' linear of the dtype goes to oneDNN (-1: never, or a build without it)."""
    return kernels.onednn_min_rows(f32) if hasattr(kernels, "onednn_min_rows") else -1


@contextmanager
def kernels_set_to(system):
    """The kernels' AMX and oneDNN switches as the system wants them, put back after."""
    kernels = linear_kernels(torch.bfloat16) or linear_kernels(torch.float32)
    if kernels is None:
        yield
        return
    amx = kernels.set_amx_enabled(system.amx and not NO_AMX)
    settings = None
    if not system.onednn and hasattr(kernels, "set_onednn_min_rows"):
        settings = {f32: kernels.set_onednn_min_rows(f32, -1) for f32 in (False, True)}
    try:
        yield
    finally:
        kernels.set_amx_enabled(amx)
        for f32, rows in (settings or {}).items():
            kernels.set_onednn_min_rows(f32, rows)


def linear_systems(dtype: torch.dtype) -> list[LinearSystem]:
    """The kernels' linear (with and without AMX where the build has it), torch's F.linear (oneDNN for bf16,
    MKL's sgemm for float32) and oneDNN's prepacked linear (PackedLinear's choice where the kernels have no
    linear), prepacked for the call's row count."""
    systems = []
    kernels = linear_kernels(dtype)
    if kernels is not None:

        def ours(x, packed, n):
            return kernels.linear(x, packed, n, None)

        def pack(w, rows):
            return kernels.pack_linear_weight(w)

        systems.append(LinearSystem("kernels", pack, ours))
        if onednn_min_rows(kernels, dtype == torch.float32) >= 0:
            systems.append(LinearSystem("kernels' own", pack, ours, onednn=False))
        if dtype == torch.bfloat16 and kernels.has_amx() and not NO_AMX:
            systems.append(LinearSystem("kernels' own, no AMX", pack, ours, amx=False, onednn=False))
    systems.append(
        LinearSystem("F.linear", lambda w, rows: w, lambda x, w, n: torch.nn.functional.linear(x, w))
    )
    if torch.backends.mkldnn.is_available() and (
        dtype == torch.float32 or torch.ops.mkldnn._is_mkldnn_bf16_supported()
    ):
        systems.append(
            LinearSystem(
                "oneDNN prepacked",
                lambda w, rows: torch.ops.mkldnn._reorder_linear_weight(w, rows),
                lambda x, w, n: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""),
                by_rows=True,
            )
        )
    return systems


def linear_copies(rows: int) -> dict[str, int]:
    # Past 64 rows the calls are bound by arithmetic: two copies will do, and keep a pass short.
    return {name: calls if rows <= 64 else min(calls, 2) for name, _, _, calls in LINEAR_SHAPES}


def time_linears(
    system: LinearSystem, weights: dict[str, list], dtype: torch.dtype, rows: int, min_seconds: float
) -> dict[str, float]:
    """Seconds a step's calls of each shape take (LINEAR_SHAPES' calls, each with its own copy of the
    weights, in a step's order, so that they come from wherever a step finds them): the fastest of the passes
    over all of them, after one that warms up."""
    copies = linear_copies(rows)
    gen = torch.Generator().manual_seed(rows)
    xs = {k: torch.randn(rows, k, generator=gen).to(dtype) for _, _, k, _ in LINEAR_SHAPES}
    order = [
        (name, n, k, i)
        for i in range(max(copies.values()))
        for name, n, k, _ in LINEAR_SHAPES
        if i < copies[name]
    ]
    with kernels_set_to(system):
        passes: list[dict[str, float]] = []
        start = time.perf_counter()
        while len(passes) < 4 or (time.perf_counter() - start < min_seconds and len(passes) < 50):
            spent = dict.fromkeys(copies, 0.0)
            for name, n, k, i in order:
                t = time.perf_counter()
                system.call(xs[k], weights[name][i], n)
                spent[name] += time.perf_counter() - t
            passes.append(spent)
    # The fastest pass: on a shared machine the one least disturbed by the other processes.
    return {
        name: min(p[name] for p in passes[1:]) * calls / copies[name] for name, _, _, calls in LINEAR_SHAPES
    }


def linear_path(system: LinearSystem, dtype: torch.dtype, rows: int) -> str:
    """The kernels' linear that serves `rows` rows in this build (SmolLM2's K are multiples of 32)."""
    if not system.name.startswith("kernels"):
        return ""
    kernels = cpu_ops.load()
    onednn = onednn_min_rows(kernels, dtype == torch.float32)
    if system.onednn and 0 <= onednn <= rows:
        return "oneDNN"
    if dtype == torch.float32:
        return "f32 fma"
    if system.amx and not NO_AMX and kernels.has_amx() and rows >= 6:
        return "amx"
    if cpu_ops.march() == "native" and "avx512_bf16" in Path("/proc/cpuinfo").read_text():
        return "avx512-bf16"
    return "avx512-widen" if cpu_ops.march() == "icelake-server" and rows >= 4 else "avx2-widen"


def run_linear(
    dtypes: list[torch.dtype], rows_list: list[int], min_seconds: float, rounds: int = 2
) -> list[dict]:
    """Every system's times for every dtype and row count in this process's build: the systems one after the
    other at each row count, `rounds` times over, each cell its fastest (the speed of a shared machine
    drifts: so the systems of a row count meet the same minutes)."""
    results = []
    march = "native-no-amx" if NO_AMX else cpu_ops.march()
    most = linear_copies(min(rows_list))
    for dtype in dtypes:
        gen = torch.Generator().manual_seed(0)
        plain = {
            name: [(torch.randn(n, k, generator=gen) * k**-0.5).to(dtype) for _ in range(most[name])]
            for name, n, k, _ in LINEAR_SHAPES
        }
        systems = linear_systems(dtype)
        fixed = {  # systems that pack alike share the copies
            s.prepare: {name: [s.prepare(w, 1) for w in ws] for name, ws in plain.items()}
            for s in systems
            if not s.by_rows
        }
        best: dict[tuple[str, int], dict[str, float]] = {}
        for _ in range(rounds):
            for rows in rows_list:
                for system in systems:
                    weights = fixed.get(system.prepare)
                    if weights is None:  # prepared for the row count, and let go after
                        weights = {name: [system.prepare(w, rows) for w in ws] for name, ws in plain.items()}
                    spent = time_linears(system, weights, dtype, rows, min_seconds)
                    cell = best.setdefault((system.name, rows), spent)
                    for name, seconds in spent.items():
                        cell[name] = min(cell[name], seconds)
                    print(
                        f"  {march:>15} {str(dtype).removeprefix('torch.'):>9} {system.name:>22} {rows:>5} rows: "
                        f"{sum(spent.values()) * 1e3:9.2f} ms",
                        file=sys.stderr,
                        flush=True,
                    )
        for system in systems:
            for rows in rows_list:
                results.append(
                    {
                        "march": march,
                        "dtype": str(dtype).removeprefix("torch."),
                        "system": system.name,
                        "path": linear_path(system, dtype, rows),
                        "rows": rows,
                        "seconds": best[(system.name, rows)],
                    }
                )
    return results


def linear_flops(rows: int) -> dict[str, float]:
    return {name: 2.0 * rows * n * k * calls for name, n, k, calls in LINEAR_SHAPES}


def linear_tables(results: list[dict]) -> None:
    """GFLOP/s of a step's linears, one table per build and dtype (rows x systems), then of each shape."""
    for march in dict.fromkeys(r["march"] for r in results):
        for dtype in dict.fromkeys(r["dtype"] for r in results if r["march"] == march):
            cells = [r for r in results if r["march"] == march and r["dtype"] == dtype]
            systems = list(dict.fromkeys(r["system"] for r in cells))
            rows_list = sorted({r["rows"] for r in cells})
            at = {(r["system"], r["rows"]): r for r in cells}
            print(
                f"\nlinear layers, {dtype}, kernels built for -march={march}: GFLOP/s of a step's linears (ms)"
            )
            print(f"{'rows':>6} {'kernels path':>14} " + " ".join(f"{s:>22}" for s in systems))
            for rows in rows_list:
                flops = sum(linear_flops(rows).values())
                line = []
                for system in systems:
                    r = at.get((system, rows))
                    seconds = sum(r["seconds"].values()) if r else float("nan")
                    line.append(f"{flops / seconds / 1e9:10.1f} ({seconds * 1e3:8.2f})")
                path = at[("kernels", rows)]["path"] if ("kernels", rows) in at else ""
                print(f"{rows:>6} {path:>14} " + " ".join(f"{c:>22}" for c in line))
            print(f"{'':>6} {'GFLOP/s by shape':>14} " + " ".join(f"{s:>22}" for s in systems))
            for name, *_ in LINEAR_SHAPES:
                for rows in rows_list:
                    flops = linear_flops(rows)[name]
                    line = [
                        f"{flops / at[(s, rows)]['seconds'][name] / 1e9:22.1f}"
                        if (s, rows) in at
                        else f"{'':>22}"
                        for s in systems
                    ]
                    print(f"{rows:>6} {name:>14} " + " ".join(line))


def linear_plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = list(dict.fromkeys((r["march"], r["dtype"]) for r in results))
    fig, axes = plt.subplots(1, len(groups), figsize=(5 * len(groups), 4.5), squeeze=False)
    for ax, (march, dtype) in zip(axes[0], groups, strict=True):
        cells = [r for r in results if r["march"] == march and r["dtype"] == dtype]
        for system in dict.fromkeys(r["system"] for r in cells):
            points = sorted(
                (r["rows"], sum(linear_flops(r["rows"]).values()) / sum(r["seconds"].values()) / 1e9)
                for r in cells
                if r["system"] == system
            )
            ax.plot([p[0] for p in points], [p[1] for p in points], "o-", label=system)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("rows (M)")
        ax.set_ylabel("GFLOP/s, a step's linears")
        ax.set_title(f"{dtype}, -march={march}", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("SmolLM2-135M's linear layers: the kernels against oneDNN")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def linear_main(args) -> None:
    dtypes = (
        [torch.bfloat16, torch.float32]
        if args.linear_dtypes == "both"
        else [getattr(torch, args.linear_dtypes)]
    )
    rows_list = [int(r) for r in args.rows.split(",")]
    if args.worker:  # one build, in this process
        global NO_AMX
        NO_AMX = args.no_amx
        print(json.dumps(run_linear(dtypes, rows_list, args.min_seconds, args.rounds)))
        return
    results = []
    for march in args.march.split(","):
        env = {**os.environ, "PAGEDSERVE_CPU_MARCH": march, **MARCH_LIBRARY_ISA.get(march, {})}
        if march.startswith("native"):
            env.pop("PAGEDSERVE_CPU_MARCH")
        command = [
            sys.executable,
            __file__,
            "--linear",
            "--worker",
            "--rows",
            args.rows,
            "--linear-dtypes",
            args.linear_dtypes,
            "--min-seconds",
            str(args.min_seconds),
            "--rounds",
            str(args.rounds),
        ]
        if args.threads:
            command += ["--threads", str(args.threads)]
        if march == "native-no-amx":
            command.append("--no-amx")
        print(
            f"-march={march}: building and timing (PAGEDSERVE_CPU_MARCH, {MARCH_LIBRARY_ISA.get(march, {})})",
            flush=True,
        )
        done = subprocess.run(command, env=env, stdout=subprocess.PIPE, text=True, check=True)
        results += json.loads(done.stdout.strip().splitlines()[-1])
    linear_tables(results)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "bench_kernels_cpu_linear.json").write_text(json.dumps(results, indent=1))
    linear_plot(results, RESULTS / "bench_kernels_cpu_linear.png")
    print(f"wrote {RESULTS / 'bench_kernels_cpu_linear.json'} and bench_kernels_cpu_linear.png")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--min-seconds", type=float, default=0.3, help="time spent per cell")
    parser.add_argument("--prefill", action="store_true", help="prompt chunks through the C++ kernels' paths")
    parser.add_argument("--linear", action="store_true", help="the linear layers against oneDNN")
    parser.add_argument(
        "--kernels", action="store_true", help="decode: the C++ kernels, blocks scattered and in order"
    )
    parser.add_argument(
        "--march",
        default="native",
        help="--linear: the builds, comma-separated -march values (native-no-amx: native with neither the "
        "kernels nor oneDNN on AMX)",
    )
    parser.add_argument("--rows", default=",".join(map(str, LINEAR_ROWS)), help="--linear: row counts")
    parser.add_argument("--linear-dtypes", default="both", choices=["both", "bfloat16", "float32"])
    parser.add_argument(
        "--rounds", type=int, default=2, help="--linear: rounds over every cell, the fastest kept"
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--no-amx", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.linear:
        linear_main(args)
        return
    dtype = getattr(torch, args.dtype)
    if args.prefill:
        print(
            f"paged_prefill_attention (C++ CPU kernels), {args.dtype}, Hq={NUM_HEADS} Hkv={NUM_KV_HEADS} "
            f"D={HEAD_DIM} block={BLOCK_SIZE}, torch threads={torch.get_num_threads()}"
        )
        prefill_table(dtype, args.min_seconds)
        return
    ops = cpu_ops.CpuOps() if args.kernels else ReferenceOps()
    print(
        f"paged_decode_attention ({'C++ kernels' if args.kernels else 'reference'}), {args.dtype}, "
        f"Hq={NUM_HEADS} Hkv={NUM_KV_HEADS} D={HEAD_DIM} block={BLOCK_SIZE}, "
        f"torch threads={torch.get_num_threads()}"
    )
    print("ms per call: best / median   [K/V GB/s read at best]")
    for scattered in (True, False) if args.kernels else (True,):
        print(f"blocks {'scattered through the pool' if scattered else 'in pool order'}")
        print(f"{'batch':>6} " + " ".join(f"{f'ctx {c}':>28}" for c in CONTEXTS))
        for batch in BATCHES:
            cells = []
            for ctx in CONTEXTS:
                best, median = time_decode(batch, ctx, dtype, args.min_seconds, ops, scattered)
                kv_bytes = 2 * batch * ctx * NUM_KV_HEADS * HEAD_DIM * dtype.itemsize
                cells.append(f"{best:8.3f} / {median:8.3f} [{kv_bytes / best / 1e6:5.1f}]")
            print(f"{batch:>6} " + " ".join(f"{c:>28}" for c in cells), flush=True)


if __name__ == "__main__":
    main()
