"""The default model's Q4_1 GGUF kept quantized, against its bf16 (dequantized) path, llama.cpp and the floor.

Single-stream decode: tokens per second of the worker's ModelRunner executing real decode plans (one sequence
at a context of --context tokens) with the weights kept quantized (int4 codes of the Q4_1 layers, the tied
head's Q8_0 int8 codes; activations in --dtype) and loaded dequantized (`--quantization none`, the bf16 path);
llama.cpp (llama-cpp-python, the same GGUF file, the same threads) decoding one token at a time after the same
number of context tokens, where it is installed; and the floor: the GGUF file's quantized weight bytes read
once a token at the copy bandwidth measured beside each round (bench_worker's CopyProbe). Batch 32: the same
steps for 32 sequences, quantized against bf16. The variants run in turn, round after round (the machine is
shared), and each cell reports its fastest round; the floor takes the fastest copy (the machine at its
quietest), and every round's numbers go into the JSON.

Memory: how many sequences of --max-model-len tokens fit in --budget bytes of weights plus bf16 KV cache.

--layers ROWS: instead, each of the default model's linear shapes alone (random codes in its GGUF's formats:
Q4_1 layers, the Q8_0 head), microseconds a call of the quantized linear against the bf16 linear of the same
weights for ROWS rows of bf16 x, the two in turn round after round, each its fastest round's median call.

    .venv/bin/python bench/bench_quant.py [--rounds 5] [--steps 32] [--context 128] [--threads N]
    .venv/bin/python bench/bench_quant.py --layers 32 [--rounds 5] [--threads N]
    .venv/bin/python bench/bench_quant.py --threads 1 --cpu-time   (a shared machine: CPU time, one thread)

Prints a table and writes bench/results/bench_quant.{json,png}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_worker import CopyProbe, decode_plans

from pagedserve.model_files import default_gguf_path, resolve_model
from pagedserve.worker_svc.kv_cache import KVCache, KVCacheSpec
from pagedserve.worker_svc.loader import load_model, parse_dtype
from pagedserve.worker_svc.model import QuantLinear
from pagedserve.worker_svc.runner import ModelRunner

RESULTS = Path(__file__).resolve().parent / "results"
BLOCK_SIZE = 16
# The decode steps' clock: wall time, or with --cpu-time (one thread) the CPU time of the thread that runs
# them, which leaves out the time other processes took the core
CLOCK = time.perf_counter


def gguf_weight_bytes(path: Path) -> int:
    """Bytes of the GGUF's tensors a decode step reads: every tensor but the norms (a tied token embedding
    counts once, as the head)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    return sum(int(t.n_bytes) for t in reader.tensors if not t.name.endswith("norm.weight"))


def streamed_bytes(model) -> int:
    """Bytes of weights a decode step of our model reads: the linear layers' and the head's."""
    total = 0
    for name, p in model.named_parameters():
        if name.startswith("embed_tokens.") and model.tied_head is not None:
            continue  # the lookup reads a row a token; the tied head has its own copy
        if p.dim() >= 2 or p.dtype == torch.uint8:
            total += p.numel() * p.element_size()
    return total


def resident_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


class Decoder:
    """Decode steps of `batch` sequences at `context` tokens through a ModelRunner."""

    def __init__(self, model, batch: int, context: int, steps: int) -> None:
        cfg = model.config
        self.plans = list(decode_plans(batch, context, BLOCK_SIZE, cfg.vocab_size, steps))
        blocks = batch * -(-(context + steps + 1) // BLOCK_SIZE)
        spec = KVCacheSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, BLOCK_SIZE, model.dtype)
        self.model, self.spec, self.blocks, self.max_len = model, spec, blocks, context + steps + 2
        self.batch = batch

    def tokens_per_second(self) -> float:
        runner = ModelRunner(self.model, KVCache(self.spec, self.blocks, torch.device("cpu")), self.max_len)
        runner.execute(self.plans[0])  # the context's last token: a one-token step that starts the sequences
        times = []
        for plan in self.plans[1:]:
            t = CLOCK()
            runner.execute(plan)
            times.append(CLOCK() - t)
        return self.batch / statistics.median(times[2:])


# The default model's (SmolLM2-135M) linear layers, N, K and code bits, and how many of each a decode step runs
LAYER_SHAPES = {
    "qkv": (960, 576, 4, 30),
    "o": (576, 576, 4, 30),
    "gate_up": (3072, 576, 4, 30),
    "down": (576, 1536, 4, 30),
    "head": (49152, 576, 8, 1),
}


def layer_times(rows: int, rounds: int) -> dict[str, dict[str, float]]:
    """Seconds a call of each layer shape takes, quantized and bf16 (see --layers)."""
    from pagedserve.kernels import get_ops
    from pagedserve.kernels.ops import linear_for
    from pagedserve.kernels.quant import QuantizedWeight, dequantize, pack_quant_weight

    kernels = linear_for(get_ops(torch.device("cpu")), torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    calls = {}
    for name, (n, k, bits, _) in LAYER_SHAPES.items():
        if bits == 4:  # Q4_1: fp16 scale and offset a group of 32
            codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
            offsets = (-torch.rand(n, k // 32, generator=g) * 0.1).half().float()
        else:  # Q8_0: an fp16 scale a group
            codes, offsets = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8), None
        scales = (torch.rand(n, k // 32, generator=g) * 0.02 + 1e-3).half().float()
        q = QuantizedWeight(codes, scales, offsets, bits, 32)
        packed, dense = pack_quant_weight(q), kernels.pack_linear_weight(dequantize(q).bfloat16())
        x = torch.randn(rows, k, generator=g).bfloat16()
        calls[name] = {
            "quantized": lambda x=x, packed=packed: kernels.linear_quant(x, packed, None),
            "bf16": lambda x=x, dense=dense, n=n: kernels.linear(x, dense, n, None),
        }
    best: dict[str, dict[str, float]] = {name: {} for name in calls}
    for _ in range(rounds):
        for name, variants in calls.items():
            reps = 5 if name == "head" else 40
            for variant, call in variants.items():
                call()
                times = []
                for _ in range(reps):
                    t = time.perf_counter()
                    call()
                    times.append(time.perf_counter() - t)
                median = statistics.median(times)
                best[name][variant] = min(best[name].get(variant, median), median)
    return best


def print_layers(rows: int, rounds: int) -> None:
    best = layer_times(rows, rounds)
    print(f"{rows} rows, {torch.get_num_threads()} threads, microseconds a call (fastest of {rounds} rounds)")
    print(f"{'layer':<8} {'N x K':>12} {'quantized':>10} {'bf16':>10} {'ratio':>6}")
    step = {"quantized": 0.0, "bf16": 0.0}
    for name, (n, k, _bits, count) in LAYER_SHAPES.items():
        q, b = best[name]["quantized"], best[name]["bf16"]
        print(f"{name:<8} {f'{n} x {k}':>12} {q * 1e6:>10.1f} {b * 1e6:>10.1f} {q / b:>6.2f}")
        step["quantized"] += count * q
        step["bf16"] += count * b
    q, b = step["quantized"], step["bf16"]
    print(f"{'a step':<8} {'':>12} {q * 1e6:>10.1f} {b * 1e6:>10.1f} {q / b:>6.2f}  (30 layers and the head)")


class LlamaCpp:
    """llama.cpp decoding one token at a time after `context` tokens, from the same GGUF file, in a process of
    its own (loaded beside torch and the kernels' OpenMP, llama.cpp crashes)."""

    def __init__(self, path: Path, threads: int, context: int, steps: int) -> None:
        self.args = [str(path), str(threads), str(context), str(steps)]

    def tokens_per_second(self) -> float:
        out = subprocess.run(
            [sys.executable, __file__, "--llama-cpp-child", *self.args],
            check=True,
            capture_output=True,
            text=True,
        )
        return float(out.stdout.split()[-1])


def llama_cpp_child(path: str, threads: int, context: int, steps: int) -> float:
    from llama_cpp import Llama

    llm = Llama(
        model_path=path,
        n_threads=threads,
        n_threads_batch=threads,
        n_ctx=context + steps + 16,
        n_batch=512,
        verbose=False,
    )
    g = torch.Generator().manual_seed(0)
    llm.eval(torch.randint(0, 1000, (context,), generator=g).tolist())
    times = []
    token = 1
    for _ in range(steps):
        t = time.perf_counter()
        llm.eval([token])
        times.append(time.perf_counter() - t)
        token = int(torch.randint(0, 1000, (1,), generator=g))
    return 1 / statistics.median(times[2:])


def llama_cpp_version() -> str | None:
    try:
        import llama_cpp
    except ImportError:
        return None
    return llama_cpp.__version__


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--llama-cpp-child"]:
        path, threads, context, steps = argv[1:5]
        print(llama_cpp_child(path, int(threads), int(context), int(steps)))
        return 0
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtype", default="auto", help="activations (and the bf16 path's weights)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=32, help="decode steps a cell times")
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--batch", type=int, default=32, help="the throughput cell's sequences")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--budget", default="1GiB", help="weights + KV cache, for the sequences that fit")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=None, metavar="ROWS", help="each layer shape alone")
    parser.add_argument(
        "--cpu-time",
        action="store_true",
        help="time the decode steps by the CPU time of one thread (needs --threads 1): for a shared machine",
    )
    args = parser.parse_args(argv)
    if args.cpu_time:
        if args.threads != 1:
            parser.error("--cpu-time times one thread: add --threads 1")
        global CLOCK
        CLOCK = time.thread_time
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.layers is not None:
        print_layers(args.layers, args.rounds)
        return 0
    threads = torch.get_num_threads()
    device = torch.device("cpu")
    dtype = parse_dtype(args.dtype, device)
    gguf_path = default_gguf_path()
    model_dir = resolve_model(None)
    quantized = load_model(model_dir, dtype, device, quantization="gguf")
    dense = load_model(model_dir, dtype, device, quantization="none")
    assert any(isinstance(m, QuantLinear) for m in quantized.modules()), (
        "the kernels have no quantized linear"
    )
    file_bytes = gguf_weight_bytes(gguf_path)

    variants: dict[str, object] = {
        "quantized, 1 seq": Decoder(quantized, 1, args.context, args.steps),
        f"{str(dtype).removeprefix('torch.')}, 1 seq": Decoder(dense, 1, args.context, args.steps),
        f"quantized, {args.batch} seqs": Decoder(quantized, args.batch, args.context, args.steps),
        f"{str(dtype).removeprefix('torch.')}, {args.batch} seqs": Decoder(
            dense, args.batch, args.context, args.steps
        ),
    }
    version = llama_cpp_version()
    if version is not None:
        llama = LlamaCpp(gguf_path, threads, args.context, args.steps)
        try:
            llama.tokens_per_second()
            variants["llama.cpp, 1 seq"] = llama
        except subprocess.CalledProcessError as error:
            print(
                f"llama-cpp-python {version} failed to decode (exit {error.returncode}): no llama.cpp column"
            )
    else:
        print("llama-cpp-python is not installed: no llama.cpp column (pip install llama-cpp-python)")

    probe = CopyProbe()
    samples: dict[str, list[float]] = {name: [] for name in variants}
    copies: list[float] = []
    print(
        f"{threads} threads, activations {dtype}, {args.rounds} rounds of {len(variants)} variants ...",
        flush=True,
    )
    for _ in range(args.rounds):
        for name, variant in variants.items():
            copies.append(probe.sample())
            samples[name].append(variant.tokens_per_second())  # type: ignore[attr-defined]
    bandwidth = max(copies)
    floor = bandwidth / file_bytes
    tps = {name: max(v) for name, v in samples.items()}

    per_token_kv = 2 * quantized.config.num_layers * quantized.config.kv_size * 2  # bf16 K and V
    budget = _parse_bytes(args.budget)
    seq_bytes = per_token_kv * args.max_model_len
    memory = {
        name: {
            "resident_bytes": resident_bytes(model),
            "streamed_bytes": streamed_bytes(model),
            "sequences": max(0, (budget - resident_bytes(model)) // seq_bytes),
        }
        for name, model in (("quantized", quantized), ("dense", dense))
    }

    print()
    print(f"{'variant':<22} {'tok/s':>9} {'x floor':>8}")
    for name, value in tps.items():
        print(f"{name:<22} {value:>9.1f} {(floor / value) if '1 seq' in name else float('nan'):>8.2f}")
    print(
        f"{'floor':<22} {floor:>9.1f}     1.00  ({file_bytes / 1e6:.1f} MB of GGUF weights at the copy's "
        f"{bandwidth / 1e9:.1f} GB/s, the fastest copy)"
    )
    print()
    print(f"{'weights':<22} {'resident MB':>12} {'streamed MB':>12} {'seqs in ' + args.budget:>14}")
    for name, m in memory.items():
        print(
            f"{name:<22} {m['resident_bytes'] / 1e6:>12.1f} {m['streamed_bytes'] / 1e6:>12.1f} {m['sequences']:>14}"
        )
    print(f"(sequences of {args.max_model_len} tokens, bf16 KV at {per_token_kv / 1e3:.1f} KB a token)")

    RESULTS.mkdir(parents=True, exist_ok=True)
    summary = {
        "threads": threads,
        "dtype": str(dtype),
        "context": args.context,
        "llama_cpp": version,
        "gguf": gguf_path.name,
        "gguf_weight_bytes": file_bytes,
        "copy_bandwidth": bandwidth,
        "copy_samples": copies,
        "floor_tokens_per_s": floor,
        "tokens_per_s": tps,
        "samples": samples,
        "memory": memory,
        "budget_bytes": budget,
        "max_model_len": args.max_model_len,
    }
    (RESULTS / "bench_quant.json").write_text(json.dumps(summary, indent=2))
    plot(tps, floor, RESULTS / "bench_quant.png")
    print(f"wrote {RESULTS / 'bench_quant.json'} and bench_quant.png")
    return 0


def _parse_bytes(text: str) -> int:
    from pagedserve.worker_svc.config import parse_bytes

    return parse_bytes(text)


def plot(tps: dict[str, float], floor: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(tps)
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.barh(
        names,
        [tps[n] for n in names],
        color=["C0" if "quantized" in n else "C1" if "llama" in n else "C2" for n in names],
    )
    ax.axvline(floor, color="k", linestyle="--", label=f"floor (1 seq): {floor:.0f} tok/s")
    ax.set_xlabel("tokens / s")
    ax.set_title("SmolLM2-135M Q4_1: decode throughput")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
