"""The GPU goals measured side by side in one run (the last stage of `make gpu-check`).

On a Llama-3-8B-shaped model with random weights (written to disk once: the machine has no model hub),
with the default model's tokenizer and vocabulary so that text round-trips:

  offline_tok_s / hf_static_tok_s  the offline `LLM` against transformers' `generate` with static batching at
                                   its best batch size, on the same requests of the mixed workload's shape
                                   (prompts 30-500 tokens, outputs 16-160, EOS ignored), on the same GPU
  single_stream_ms_per_token       one request decoding alone, against single_stream_floor_ms: the weights'
                                   bytes over the measured device copy bandwidth
  decode_attention_bw_fraction     the paged decode attention at the goal shape (batch 64, 4096 positions,
                                   32 query / 8 kv heads of 128, bf16, blocks of 16) over the copy bandwidth
  quant_decode_bw_fraction         the int4 quantized linear (kernels/quant_gemm.cu) at one row on Llama-7B's
                                   shapes (4096x4096, 11008x4096, 4096x11008; groups of 128, fp16 scales and
                                   offsets, random codes): its bytes (codes, scales, x, out) per second over
                                   the copy bandwidth, all three timed together
  served_stack_ok (+ TTFT, TPOT)   `pagedserve serve` on the model, loaded by `pagedserve bench serve` at
                                   concurrency 1 and 64, with the worker's time between forward passes

It writes the keys into --json (docs/gpu-check.json), a markdown table into --markdown, and prints the table.
`--shape tiny --device cpu` runs the whole script on a small model on the CPU, to check it without a GPU.

    python bench/gpu_bench.py [--shape llama3-8b] [--device cuda] [--json docs/gpu-check.json]
        [--markdown bench/results/gpu_bench.md] [--junit bench/results/gpu_tests.xml] [--num-requests 256]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import xml.etree.ElementTree as ET
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_worker import measure_copy_bandwidth, weight_bytes  # noqa: E402
from compare_transformers import Work, run_hf_static, run_pagedserve, tokens_per_s  # noqa: E402

RESULTS = HERE / "results"
SHAPES = {
    # Llama-3-8B's layers, widths and heads; the default model's vocabulary (its tokenizer's).
    "llama3-8b": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "heads": (32, 8)},
    "tiny": {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "heads": (4, 2)},
}


def log(message: str) -> None:
    print(f"[gpu_bench {time.strftime('%H:%M:%S')}] {message}", flush=True)


def write_model(folder: Path, shape: str, device: str) -> Path:
    """A Llama of the shape with random weights (scaled so activations stay finite), in `folder` as HF
    safetensors, with the default model's tokenizer files."""
    from safetensors.torch import save_file

    from pagedserve.model_files import resolve_model

    default = resolve_model(None)
    vocab = json.loads((default / "config.json").read_text())["vocab_size"]
    s = SHAPES[shape]
    heads, kv_heads = s["heads"]
    hidden, inter, layers = s["hidden_size"], s["intermediate_size"], s["num_hidden_layers"]
    head_dim = hidden // heads
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "torch_dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    for name in (
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "generation_config.json",
    ):
        if (default / name).exists():
            shutil.copy(default / name, folder / name)
    gen = torch.Generator(device=device).manual_seed(0)

    def weight(*shape_: int, std: float) -> torch.Tensor:
        return (torch.randn(*shape_, generator=gen, device=device) * std).to(torch.bfloat16)

    tensors = {
        "model.embed_tokens.weight": weight(vocab, hidden, std=1.0),
        "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16, device=device),
        "lm_head.weight": weight(vocab, hidden, std=hidden**-0.5),
    }
    weight_map: dict[str, str] = {}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16, device=device),
            p + "post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16, device=device),
            p + "self_attn.q_proj.weight": weight(heads * head_dim, hidden, std=hidden**-0.5),
            p + "self_attn.k_proj.weight": weight(kv_heads * head_dim, hidden, std=hidden**-0.5),
            p + "self_attn.v_proj.weight": weight(kv_heads * head_dim, hidden, std=hidden**-0.5),
            p + "self_attn.o_proj.weight": weight(hidden, heads * head_dim, std=(heads * head_dim) ** -0.5),
            p + "mlp.gate_proj.weight": weight(inter, hidden, std=hidden**-0.5),
            p + "mlp.up_proj.weight": weight(inter, hidden, std=hidden**-0.5),
            p + "mlp.down_proj.weight": weight(hidden, inter, std=inter**-0.5),
        }
        if len(tensors) > 64 or i == layers - 1:  # shards of a few layers: host memory holds one at a time
            shard = f"model-{i:05d}.safetensors"
            save_file({k: v.cpu() for k, v in tensors.items()}, folder / shard)
            weight_map |= dict.fromkeys(tensors, shard)
            tensors = {}
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    return folder


def mixed_workload(n: int, vocab: int, seed: int = 0) -> list[Work]:
    """The mixed workload's shape with random token ids (the model's weights are random too)."""
    gen = torch.Generator().manual_seed(seed)
    prompt_lens = torch.randint(30, 501, (n,), generator=gen).tolist()
    output_lens = torch.randint(16, 161, (n,), generator=gen).tolist()
    return [
        Work(torch.randint(3, vocab, (p,), generator=gen).tolist(), o)
        for p, o in zip(prompt_lens, output_lens, strict=True)
    ]


def copy_bandwidth(device: torch.device) -> float:
    """Bytes read plus written per second by a large copy on the device (bench_kernels' on a GPU,
    bench_worker's on the CPU): the rate the goals' floors are set by."""
    if device.type == "cuda":
        from bench_kernels import copy_bandwidth as device_copy_bandwidth

        return device_copy_bandwidth() * 1e9
    return measure_copy_bandwidth()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def offline(model_dir: Path, device: str, work: list[Work], max_num_seqs: int) -> dict:
    from pagedserve import LLM, SamplingParams

    llm = LLM(model=str(model_dir), device=device, dtype="bfloat16", max_num_seqs=max_num_seqs)
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4))  # the first step's one-time work
    result = run_pagedserve(llm, work)
    # One request alone: its decode steps' time per token (the first token, the prompt's, left out).
    prompt, length = work[0].prompt_ids[:128], 256
    start = time.perf_counter()
    (out,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=length, ignore_eos=True))
    metrics = out.metrics
    decode_s = metrics.finished_time - metrics.first_token_time
    single = {
        "single_stream_ms_per_token": 1e3 * decode_s / (length - 1),
        "single_stream_seconds": time.perf_counter() - start,
        "weight_bytes": weight_bytes(llm.model),
    }
    del llm
    return {"offline_tok_s": tokens_per_s(result), "offline_seconds": result.elapsed_s, **single}


def hf_static(model_dir: Path, device: str, work: list[Work], batch_sizes: list[int]) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(device).eval()
    best = None
    runs = {}
    for batch in batch_sizes:
        result = run_hf_static(_OnDevice(model, device), work, batch, pad_id=0, sort=False)
        runs[batch] = tokens_per_s(result)
        log(f"transformers static batching B={batch}: {runs[batch]:.1f} output tokens/s")
        if best is None or runs[batch] > runs[best]:
            best = batch
    del model
    return {"hf_static_tok_s": runs[best], "hf_static_batch": best, "hf_static_by_batch": runs}


class _OnDevice:
    """The transformers model with generate's inputs moved to its device (run_hf_static builds them on
    the CPU)."""

    def __init__(self, model, device: str) -> None:
        self.model, self.device = model, device

    def generate(self, ids, attention_mask, generation_config):
        out = self.model.generate(
            ids.to(self.device),
            attention_mask=attention_mask.to(self.device),
            generation_config=generation_config,
        )
        sync(torch.device(self.device))
        return out


def decode_attention_fraction(device: torch.device, copy_bytes_per_s: float) -> float | None:
    """The paged decode attention's bytes per second at the goal shape (bench_kernels' TARGET: batch 64, 4096
    positions, 32 query / 8 kv heads of 128, bf16, blocks of 16) over the copy bandwidth, as bench_kernels
    measures it (L2 flushed before each call)."""
    if device.type != "cuda":
        return None
    from bench_kernels import TARGET, Timer, bench_one

    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20)
    row = bench_one(Timer(l2), copy_bytes_per_s / 1e9, l2, *TARGET, None)
    return row["pct"] / 100


# Llama-7B's linear shapes, [N, K]: q/k/v/o, gate and up, down.
QUANT_SHAPES = ((4096, 4096), (11008, 4096), (4096, 11008))


def kernel_us(fn, prefix: str, flush: torch.Tensor, iters: int = 20) -> float | None:
    """Device time per call of the kernels named prefix* that fn launches (CUPTI, through torch's profiler),
    flush zeroed before each call so that nothing is read from L2; None where the profiler saw none."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            flush.zero_()
            fn()
        torch.cuda.synchronize()
    total = 0.0
    for avg in prof.key_averages():
        if avg.key.startswith(prefix):
            total += getattr(avg, "device_time_total", None) or getattr(avg, "cuda_time_total", 0.0)
    return total / iters if total > 0 else None


def quant_decode_fraction(device: torch.device, copy_bytes_per_s: float) -> dict:
    """The int4 quantized linear at one bf16 row (decode) on QUANT_SHAPES: each shape's share of the copy
    bandwidth and the three together (total bytes over total time). The time is the kernels' own on the
    device (the GEMM and its split-K reduction; L2 flushed before each call); the call's time from the host
    (CUDA events, launches included) is reported beside it."""
    if device.type != "cuda":
        return {}
    from bench_kernels import Timer

    from pagedserve.kernels import cuda_ops
    from pagedserve.kernels.quant import QuantizedWeight

    ops = cuda_ops.CudaOps(device)
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20)
    timer = Timer(l2)
    gen = torch.Generator(device=device).manual_seed(0)
    result: dict = {"quant_decode_by_shape": {}}
    total_bytes = total_us = 0.0
    for n, k in QUANT_SHAPES:
        codes = torch.randint(0, 16, (n, k), generator=gen, device=device, dtype=torch.uint8)
        scales = (torch.rand(n, k // 128, generator=gen, device=device) * 0.02 + 1e-3).half().float()
        offsets = (-torch.rand(n, k // 128, generator=gen, device=device) * 0.1).half().float()
        packed = ops.quant_linear.pack_quant_weight(QuantizedWeight(codes, scales, offsets, 4, 128), device)
        del codes, scales, offsets
        x = torch.randn(1, k, device=device, dtype=torch.bfloat16)

        def call(x=x, packed=packed):
            return ops.quant_linear.linear_quant(x, packed, None)

        call_us = timer(call)  # warms up (compiles) too
        us = kernel_us(call, "quant_", timer.scratch) or call_us
        nbytes = packed.nbytes() + 2 * (k + n)
        fraction = nbytes / (us * 1e-6) / copy_bytes_per_s
        result["quant_decode_by_shape"][f"{n}x{k}"] = {
            "kernel_us": us,
            "call_us": call_us,
            "bytes": nbytes,
            "bw_fraction": fraction,
        }
        log(
            f"int4 linear M=1 {n}x{k}: kernels {us:.1f} us ({fraction:.2f} of the copy bandwidth), "
            f"call {call_us:.1f} us"
        )
        total_bytes += nbytes
        total_us += us
        del packed
    result["quant_decode_bw_fraction"] = total_bytes / (total_us * 1e-6) / copy_bytes_per_s
    return result


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def served(model_dir: Path, device: str, out_dir: Path, num_prompts: int) -> dict:
    """`pagedserve serve` on the model, loaded by `pagedserve bench serve` at concurrency 1 and 64."""
    port = free_port()
    exe = [sys.executable, "-P", "-m", "pagedserve.cli"]
    serve = subprocess.Popen(
        [
            *exe,
            "serve",
            "--model",
            str(model_dir),
            "--device",
            device,
            "--dtype",
            "bfloat16",
            "--port",
            str(port),
            "--grpc-port",
            str(free_port()),
            "--log-level",
            "warning",
        ],
    )
    results = {"served_stack_ok": False}
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                if urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=5).status == 200:
                    break
            if serve.poll() is not None:
                raise RuntimeError(f"pagedserve serve exited with {serve.returncode}")
            time.sleep(2)
        else:
            raise TimeoutError("pagedserve serve was not ready within 300 s")
        for concurrency in (1, 64):
            name = f"served_c{concurrency}.json"
            subprocess.run(
                [
                    *exe,
                    "bench",
                    "serve",
                    "--base-url",
                    f"http://127.0.0.1:{port}",
                    "--dataset-name",
                    "random",
                    "--tokenizer",
                    str(model_dir),
                    "--random-input-len",
                    "128",
                    "--random-output-len",
                    "128",
                    "--num-prompts",
                    str(num_prompts if concurrency > 1 else 8),
                    "--max-concurrency",
                    str(concurrency),
                    "--save-result",
                    "--no-plots",
                    "--result-dir",
                    str(out_dir),
                    "--result-filename",
                    name,
                    "--disable-tqdm",
                ],
                check=True,
                timeout=300,
            )
            run = json.loads((out_dir / name).read_text())["passes"][0]
            metrics, worker = run["metrics"], run["worker"] or {}
            results[f"served_c{concurrency}_ttft_ms_median"] = metrics["ttft"]["median"]
            results[f"served_c{concurrency}_tpot_ms_median"] = metrics["tpot"]["median"]
            results[f"served_c{concurrency}_between_passes_fraction"] = between_fraction(worker)
            results[f"served_c{concurrency}_failed"] = metrics.get("failed", 0)
        results["served_stack_ok"] = all(results[f"served_c{c}_failed"] == 0 for c in (1, 64))
    except Exception as exc:  # the table says what failed; the run goes on to write what it has
        results["served_error"] = repr(exc)
    finally:
        serve.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            serve.wait(60)
        if serve.poll() is None:
            serve.kill()
    return results


def between_fraction(worker: dict) -> float | None:
    """The share of a step the worker spends between forward passes (sampling, hand-over, the next inputs)."""
    if not worker.get("steps") or worker.get("forward_seconds") is None:
        return None
    forward = worker["forward_seconds"]
    between = (
        worker["step_seconds"]
        - forward
        + (worker.get("gap_seconds") or 0)
        + (worker.get("prepare_seconds") or 0)
    )
    return between / (forward + between)


def junit_counts(path: Path | None) -> dict:
    """Failed, skipped and passed tests of the GPU tests' JUnit XML, and whether the runner parity passed."""
    if path is None or not path.exists():
        return {"tests_failed": None}
    failed = skipped = total = 0
    parity = []
    for case in ET.parse(path).getroot().iter("testcase"):
        total += 1
        bad = case.find("failure") is not None or case.find("error") is not None
        failed += bad
        skipped += case.find("skipped") is not None
        if "test_cuda_runner" in case.get("classname", ""):
            parity.append(not bad and case.find("skipped") is None)
    return {
        "tests_total": total,
        "tests_failed": failed,
        "tests_skipped": skipped,
        "runner_parity_ok": bool(parity) and all(parity),
    }


TABLE = [
    ("offline throughput, output tokens/s", "offline_tok_s", "{:.0f}"),
    ("transformers static batching, best B", "hf_static_tok_s", "{:.0f}"),
    ("speedup (goal >= 10x)", "speedup_vs_hf_static", "{:.2f}x"),
    ("single stream, ms per token", "single_stream_ms_per_token", "{:.3f}"),
    ("single stream floor (weights / copy bandwidth), ms", "single_stream_floor_ms", "{:.3f}"),
    ("single stream against its floor (goal <= 1.2x)", "single_stream_vs_floor", "{:.2f}x"),
    ("decode attention, share of copy bandwidth (goal >= 0.8)", "decode_attention_bw_fraction", "{:.2f}"),
    ("int4 decode linear, share of copy bandwidth (goal >= 0.7)", "quant_decode_bw_fraction", "{:.2f}"),
    ("served stack healthy", "served_stack_ok", "{}"),
    (
        "served, concurrency 1: TTFT / TPOT median ms",
        ("served_c1_ttft_ms_median", "served_c1_tpot_ms_median"),
        "{:.1f} / {:.2f}",
    ),
    (
        "served, concurrency 64: TTFT / TPOT median ms",
        ("served_c64_ttft_ms_median", "served_c64_tpot_ms_median"),
        "{:.1f} / {:.2f}",
    ),
    (
        "between forward passes, concurrency 1 / 64 (goal < 0.05)",
        ("served_c1_between_passes_fraction", "served_c64_between_passes_fraction"),
        "{:.3f} / {:.3f}",
    ),
    ("GPU tests failed / skipped", ("tests_failed", "tests_skipped"), "{} / {}"),
    ("runner on CUDA equals the CPU runner", "runner_parity_ok", "{}"),
]


def markdown(report: dict) -> str:
    lines = [
        f"# GPU check, {report['date']}, {report['device']} ({report['shape']})",
        "",
        "| measure | value |",
        "|---|---:|",
    ]
    for label, keys, fmt in TABLE:
        keys = keys if isinstance(keys, tuple) else (keys,)
        values = [report.get(k) for k in keys]
        lines.append(
            f"| {label} | {fmt.format(*values) if all(v is not None for v in values) else 'not measured'} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--hf-batch-sizes", default="32,64,128")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--served-prompts", type=int, default=128)
    parser.add_argument("--junit", type=Path, default=None, help="the GPU tests' JUnit XML")
    parser.add_argument("--json", type=Path, default=RESULTS / "gpu_check.json")
    parser.add_argument("--markdown", type=Path, default=RESULTS / "gpu_bench.md")
    parser.add_argument("--skip", default="", help="comma-separated: offline,hf,attention,quant,served")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    skip = set(filter(None, args.skip.split(",")))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({os.cpu_count()} cores)"
    report: dict = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": name,
        "shape": args.shape,
        **junit_counts(args.junit),
    }
    args.markdown.parent.mkdir(parents=True, exist_ok=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        # After every part, so that a run cut short by its time limit still leaves what it measured.
        args.markdown.write_text(markdown(report))
        args.json.write_text(json.dumps(report, indent=1, default=str) + "\n")

    with tempfile.TemporaryDirectory(prefix="gpu-bench-") as tmp:
        log(f"writing a {args.shape}-shaped model with random weights")
        model_dir = write_model(Path(tmp) / "model", args.shape, args.device)
        free(device)
        vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        work = mixed_workload(args.num_requests, vocab)
        copy = copy_bandwidth(device)
        report["copy_gb_s"] = copy / 1e9
        if "attention" not in skip:
            report["decode_attention_bw_fraction"] = decode_attention_fraction(device, copy)
            free(device)
            save()
        if "quant" not in skip:
            log("the int4 quantized linear at one row on Llama-7B's shapes")
            report |= quant_decode_fraction(device, copy)
            free(device)
            save()
        if "offline" not in skip:
            log("offline LLM on the mixed workload, then a single stream")
            report |= offline(model_dir, args.device, work, args.max_num_seqs)
            # The floor: the weights streamed once a token at the copy's rate (bench_worker's memory ceiling).
            report["single_stream_floor_ms"] = 1e3 * report["weight_bytes"] / copy
            report["single_stream_vs_floor"] = (
                report["single_stream_ms_per_token"] / report["single_stream_floor_ms"]
            )
            free(device)
            save()
        if "hf" not in skip:
            log("transformers static batching on the same requests")
            sizes = [int(b) for b in args.hf_batch_sizes.split(",")]
            report |= hf_static(model_dir, args.device, work, sizes)
            free(device)
        if report.get("offline_tok_s") and report.get("hf_static_tok_s"):
            report["speedup_vs_hf_static"] = report["offline_tok_s"] / report["hf_static_tok_s"]
        save()
        if "served" not in skip:
            log("the served stack under pagedserve bench serve")
            report |= served(model_dir, args.device, args.markdown.parent, args.served_prompts)
            save()
    print(markdown(report))
    log(f"wrote {args.json} and {args.markdown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
