"""pagedserve next to Hugging Face transformers on one offline workload, same model and dtype.

The workload: --num-requests prompts of uniformly drawn lengths (--prompt-len 30..500 tokens, random
tokens re-encoded to an exact length) with uniformly drawn output lengths (--output-len 16..160),
seeded; greedy, EOS ignored, so every system computes exactly the same tokens. All requests are
there at t=0 (offline); a request's latency is the time from that start to its last token.

Systems:
  (a) transformers `generate`, static batching: requests in arrival order (--hf-sort: sorted by prompt
      length first, which favours padding), cut into batches of B, left-padded; each batch runs to
      the longest wanted output in it (max_new_tokens = max of the batch) and only each request's
      wanted tokens count as useful output. Every B of --hf-batch-sizes is run (by default 4, 8, 16 and
      so on below the number of requests, then all of them in one batch); the best is the baseline.
  (b) transformers continuous batching: the ContinuousBatchingManager behind `model.generate_batch`
      (transformers 5.x), used through its context manager so that each request gets its own
      max_new_tokens (generate_batch takes one for all); "unavailable: reason" when it fails.
  (c) pagedserve through the offline `LLM` API: the server's own scheduler and worker code in process.
They run in the order (a), (c), (b): see the note in main on what (b) leaves behind. With --rounds R,
(a) at its best batch size and (c) run R times in all, alternating before (b) (pagedserve's prefix cache
reset before each run); each system's row is its fastest run, and every round's ratio is printed: the
speed of a shared machine drifts over the minutes of a run, and one pair of runs may fall on either side.

Next to the table: the workload's FLOPs (every non-embedding weight matrix once per computed token,
the LM head once per output token, attention 4*layers*heads*head_dim*context per token) and the
fraction of this machine's matmul FLOP/s achieved (bench_worker's measure_matmul_flops, before and after
the runs: the higher of the two).

    .venv/bin/python bench/compare_transformers.py [--num-requests 64] [--hf-batch-sizes 4,8,16,32,64]
        [--skip-hf-cb] [--rounds 1] [--dtype auto] [--hf-dtype float32] [--threads N] [--model default]

Prints a table and writes bench/results/compare_transformers.{json,png}.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from pagedserve.bench.datasets import PromptMaker
from pagedserve.model_files import load_tokenizer, model_name, resolve_model
from pagedserve.worker_svc.loader import parse_dtype

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_worker import measure_matmul_flops, torch_matmul_dtype

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass(slots=True)
class Work:
    prompt_ids: list[int]  # exact prompt tokens
    output_len: int  # tokens to generate


@dataclass(slots=True)
class SystemResult:
    name: str
    elapsed_s: float | None = None  # wall time of the whole workload
    latencies_s: list[float] = field(default_factory=list)  # per request: start -> its last token
    output_tokens: int = 0  # useful output tokens (what the requests asked for)
    computed_output_tokens: int = (
        0  # output tokens actually generated (padding to the batch's longest included)
    )
    unavailable: str | None = None  # why the system could not run
    detail: dict = field(default_factory=dict)


def build_workload(
    tokenizer, n: int, prompt_range: tuple[int, int], output_range: tuple[int, int], seed: int
):
    rng = np.random.default_rng(seed)
    maker = PromptMaker(tokenizer, rng)
    prompt_lens = rng.integers(prompt_range[0], prompt_range[1] + 1, size=n)
    output_lens = rng.integers(output_range[0], output_range[1] + 1, size=n)
    work = []
    for p, o in tqdm(list(zip(prompt_lens, output_lens, strict=True)), desc="building prompts", unit="req"):
        _, ids = maker.text(int(p))
        work.append(Work(ids, int(o)))
    return work


def workload_flops(cfg: dict, matmul_params: int, lm_head_params: int, work: list[Work]) -> float:
    heads, layers = cfg["num_attention_heads"], cfg["num_hidden_layers"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    total = 0.0
    for w in work:
        computed = len(w.prompt_ids) + w.output_len - 1  # the last sampled token is never fed back
        # context of the token at position t is t + 1: sum over t of (t + 1)
        attention_ctx = computed * (computed + 1) / 2
        total += 2 * matmul_params * computed + 2 * lm_head_params * w.output_len
        total += 4 * layers * heads * head_dim * attention_ctx
    return total


# ---------------------------------------------------------------------------------------- (a) static


def default_batch_sizes(num_requests: int) -> list[int]:
    """Powers of two from 4 below the number of requests, then all of them in one batch."""
    sizes, b = [], 4
    while b < num_requests:
        sizes.append(b)
        b *= 2
    return [*sizes, num_requests]


def run_hf_static(model, work: list[Work], batch_size: int, pad_id: int, sort: bool) -> SystemResult:
    from transformers import GenerationConfig

    order = (
        sorted(range(len(work)), key=lambda i: len(work[i].prompt_ids)) if sort else list(range(len(work)))
    )
    res = SystemResult(f"transformers static B={batch_size}")
    latencies = [0.0] * len(work)
    start = time.perf_counter()
    bar = tqdm(total=len(work), desc=f"hf static B={batch_size}", unit="req")
    for b in range(0, len(order), batch_size):
        batch = [work[i] for i in order[b : b + batch_size]]
        width = max(len(w.prompt_ids) for w in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, w in enumerate(batch):
            ids[row, width - len(w.prompt_ids) :] = torch.tensor(w.prompt_ids)
            mask[row, width - len(w.prompt_ids) :] = 1
        new = max(w.output_len for w in batch)
        # eos_token_id=None: generation runs to max_new_tokens (the workload ignores EOS).
        config = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=pad_id)
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, generation_config=config)
        assert out.shape[1] == width + new, "generate stopped early"
        done = time.perf_counter() - start
        for i in order[b : b + batch_size]:
            latencies[i] = done
        res.output_tokens += sum(w.output_len for w in batch)
        res.computed_output_tokens += new * len(batch)
        bar.update(len(batch))
    bar.close()
    res.elapsed_s = time.perf_counter() - start
    res.latencies_s = latencies
    return res


# ---------------------------------------------------------------------------------------- (b) CB


def run_hf_continuous(model, work: list[Work], timeout_s: float) -> SystemResult:
    from transformers import GenerationConfig

    res = SystemResult("transformers continuous batching")
    try:
        config = GenerationConfig(
            do_sample=False, max_new_tokens=max(w.output_len for w in work), eos_token_id=-1
        )
        latencies = [0.0] * len(work)
        bar = tqdm(total=len(work), desc="hf continuous batching", unit="req")
        with model.continuous_batching_context_manager(
            generation_config=config, block=True, timeout=5
        ) as manager:
            start = time.perf_counter()
            for i, w in enumerate(work):
                manager.add_request(
                    w.prompt_ids, request_id=f"r{i}", max_new_tokens=w.output_len, eos_token_id=-1
                )
            got = 0
            last_progress = time.perf_counter()
            while got < len(work):
                out = manager.get_result(timeout=1)
                if out is None:
                    if not manager.is_running():
                        raise RuntimeError("its generation thread stopped")
                    if time.perf_counter() - last_progress > timeout_s:
                        raise TimeoutError(f"no request finished in {timeout_s:.0f} s")
                    continue
                if not out.is_finished():
                    continue
                if out.error:
                    raise RuntimeError(out.error)
                i = int(out.request_id[1:])
                latencies[i] = time.perf_counter() - start
                res.output_tokens += len(out.generated_tokens)
                got += 1
                last_progress = time.perf_counter()
                bar.update(1)
            res.elapsed_s = time.perf_counter() - start
        bar.close()
        res.latencies_s = latencies
        res.computed_output_tokens = res.output_tokens
    except Exception as error:  # any failure of the experimental API is a result, not a crash
        res.unavailable = f"{type(error).__name__}: {error}"[:200]
        res.elapsed_s = None
    return res


# ---------------------------------------------------------------------------------------- (c) ours


def run_pagedserve(llm, work: list[Work]) -> SystemResult:
    from pagedserve.sampling_params import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=w.output_len, ignore_eos=True) for w in work]
    res = SystemResult("pagedserve LLM (offline)")
    before = llm.scheduler.stats()
    start = time.perf_counter()
    outs = llm.generate([w.prompt_ids for w in work], params, use_tqdm=True)
    res.elapsed_s = time.perf_counter() - start
    res.latencies_s = [o.metrics.finished_time - o.metrics.arrival_time for o in outs]
    res.output_tokens = res.computed_output_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert res.output_tokens == sum(w.output_len for w in work)
    stats = llm.scheduler.stats()
    res.detail = {
        "num_preemptions": stats.num_preemptions - before.num_preemptions,
        "num_steps": stats.num_steps - before.num_steps,
    }
    return res


# ---------------------------------------------------------------------------------------- report


def tokens_per_s(r: SystemResult) -> float:
    return r.output_tokens / r.elapsed_s


def summarize(r: SystemResult, n: int, flops: float, machine_flops: float, baseline: float | None) -> dict:
    row = {"system": r.name, "unavailable": r.unavailable, **r.detail}
    if r.unavailable or not r.elapsed_s:
        return row
    tps = r.output_tokens / r.elapsed_s
    row.update(
        elapsed_s=r.elapsed_s,
        output_tokens=r.output_tokens,
        computed_output_tokens=r.computed_output_tokens,
        output_tokens_per_s=tps,
        requests_per_s=n / r.elapsed_s,
        mean_latency_s=statistics.fmean(r.latencies_s),
        median_latency_s=statistics.median(r.latencies_s),
        achieved_flops=flops / r.elapsed_s,
        fraction_of_matmul_peak=flops / r.elapsed_s / machine_flops,
        ratio_to_static=(tps / baseline) if baseline else None,
    )
    return row


def print_table(rows: list[dict]) -> None:
    head = f"{'system':<36} {'out tok/s':>10} {'req/s':>7} {'mean lat s':>11} {'med lat s':>10} {'of peak':>8} {'vs (a)':>7}"
    print(head)
    print("-" * len(head))
    for r in rows:
        if r.get("unavailable"):
            print(f"{r['system']:<36} unavailable: {r['unavailable']}")
            continue
        ratio = f"{r['ratio_to_static']:.2f}x" if r.get("ratio_to_static") else "-"
        print(
            f"{r['system']:<36} {r['output_tokens_per_s']:>10.1f} {r['requests_per_s']:>7.2f} "
            f"{r['mean_latency_s']:>11.1f} {r['median_latency_s']:>10.1f} {r['fraction_of_matmul_peak']:>7.1%} {ratio:>7}"
        )


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    names = [r["system"].replace(" (offline)", "").replace("transformers ", "hf ") for r in rows]
    values = [r.get("output_tokens_per_s") or 0.0 for r in rows]
    bars = ax.barh(names, values, color=["#999999" if "hf" in n else "#2b7bba" for n in names])
    for bar, r in zip(bars, rows, strict=True):
        label = "unavailable" if r.get("unavailable") else f"{r['output_tokens_per_s']:.0f}"
        if r.get("ratio_to_static"):
            label += f"  ({r['ratio_to_static']:.2f}x)"
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, " " + label, va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("useful output tokens / s (higher is better)")
    ax.set_title(title, fontsize=9)
    ax.margins(x=0.25)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument(
        "--hf-dtype",
        default=None,
        help="transformers' dtype (default: the same as --dtype, but float32 where this CPU has no native "
        "bf16); float32 is the issue's baseline",
    )
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-len", default="30,500", help="min,max prompt tokens")
    parser.add_argument("--output-len", default="16,160", help="min,max output tokens")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--hf-batch-sizes",
        default=None,
        help="comma-separated; default: 4, 8, 16, ... below --num-requests, and --num-requests itself",
    )
    parser.add_argument(
        "--hf-sort", action="store_true", help="sort requests by prompt length before batching"
    )
    parser.add_argument("--skip-hf-static", action="store_true")
    parser.add_argument("--skip-hf-cb", action="store_true")
    parser.add_argument(
        "--hf-cb-timeout", type=float, default=300.0, help="s without progress before giving up"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="runs of (a) at its best batch size and of (c), alternating after the sweep: each system's "
        "fastest is its row, and every round's ratio is printed (a shared machine's speed drifts)",
    )
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=RESULTS / "compare_transformers")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    prompt_range = tuple(int(x) for x in args.prompt_len.split(","))
    output_range = tuple(int(x) for x in args.output_len.split(","))

    from transformers import AutoModelForCausalLM

    from pagedserve.llm import LLM

    model_dir = resolve_model(args.model)
    dtype = parse_dtype(args.dtype, "cpu")
    # By default transformers runs in pagedserve's dtype, or in float32 where PyTorch emulates bf16 on this
    # CPU (about 100x slower than float32): the ratio is against transformers at its best.
    hf_dtype = parse_dtype(args.hf_dtype, "cpu") if args.hf_dtype else torch_matmul_dtype(dtype)
    tokenizer = load_tokenizer(model_dir)
    work = build_workload(tokenizer, args.num_requests, prompt_range, output_range, args.seed)
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=hf_dtype).eval()
    cfg = hf.config.to_dict()
    matmul_params = sum(
        p.numel() for n, p in hf.named_parameters() if p.dim() == 2 and "embed_tokens" not in n
    )
    lm_head_params = cfg["vocab_size"] * cfg["hidden_size"]
    if not cfg.get("tie_word_embeddings"):
        matmul_params -= lm_head_params  # counted per output token below
    flops = workload_flops(cfg, matmul_params, lm_head_params, work)
    print(
        f"measuring this machine's matmul rate ({torch.get_num_threads()} threads, {dtype}) ...", flush=True
    )
    machine_flops = measure_matmul_flops(dtype)
    if hf_dtype != dtype:
        print(f"transformers runs in {hf_dtype}, pagedserve in {dtype}; 'of peak' is against {dtype}'s rate")
    if torch_matmul_dtype(dtype) != dtype:
        print("no native bf16 on this CPU: the matmul rate is float32's, the arithmetic of the AVX2 linear")
    n_prompt = sum(len(w.prompt_ids) for w in work)
    n_out = sum(w.output_len for w in work)
    print(
        f"workload: {len(work)} requests, {n_prompt} prompt + {n_out} output tokens, "
        f"{flops / 1e12:.2f} TFLOP; machine matmul {machine_flops / 1e9:.0f} GFLOP/s"
    )

    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    results: list[SystemResult] = []
    static_runs: list[SystemResult] = []  # the sweep over batch sizes
    static_rounds: list[SystemResult] = []  # the best batch size's runs: the sweep's, then one a round
    best_batch = None
    if not args.skip_hf_static:
        if args.hf_batch_sizes:
            batch_sizes = [int(x) for x in args.hf_batch_sizes.split(",")]
        else:
            batch_sizes = default_batch_sizes(len(work))
        for b in batch_sizes:
            static_runs.append(run_hf_static(hf, work, b, pad_id, args.hf_sort))
        best_index = max(range(len(batch_sizes)), key=lambda i: tokens_per_s(static_runs[i]))
        best_batch = batch_sizes[best_index]
        static_rounds.append(static_runs[best_index])
    # NOTE: pagedserve runs before transformers' continuous batching, whose run leaves this machine slow
    # for a while after it (about 3.6 million page faults in a 24-request run; nothing of the process is
    # busy afterwards). 24 requests in one process, pagedserve's output tokens/s: 277-284 before it and
    # 275-276 just after the static runs; just after it 172, then 266 and 268, and 285 after a 20 s pause.
    llm = LLM(model=args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs)
    our_rounds = [run_pagedserve(llm, work)]
    for r in range(2, args.rounds + 1):
        print(f"round {r} of {args.rounds}", flush=True)
        if best_batch is not None:
            static_rounds.append(run_hf_static(hf, work, best_batch, pad_id, args.hf_sort))
        llm.reset_prefix_cache()  # the same prompts again: computed again, not served from the cache
        our_rounds.append(run_pagedserve(llm, work))
    del llm
    if static_rounds:
        best = max(static_rounds, key=tokens_per_s)
        best = replace(best, name=f"(a) transformers static, best B={best_batch}")
        results.append(best)
    ours = max(our_rounds, key=tokens_per_s)
    ours = replace(ours, name="(c) " + ours.name)
    if not args.skip_hf_cb:
        results.append(run_hf_continuous(hf, work, args.hf_cb_timeout))
        results[-1].name = "(b) " + results[-1].name
    del hf
    results.append(ours)
    # NOTE: the rate of a shared machine drifts over a run of minutes. Measured again at the end, the
    # higher of the two is the peak, so that a slow moment at the start cannot inflate "of peak".
    measured_flops = [machine_flops, measure_matmul_flops(dtype)]
    machine_flops = max(measured_flops)

    baseline = max(map(tokens_per_s, static_rounds)) if static_rounds else None
    rounds = [
        {
            "static_output_tokens_per_s": tokens_per_s(a) if a else None,
            "pagedserve_output_tokens_per_s": tokens_per_s(c),
            "ratio": tokens_per_s(c) / tokens_per_s(a) if a else None,
        }
        for a, c in itertools.zip_longest(static_rounds, our_rounds)
    ]
    rows = [summarize(r, len(work), flops, machine_flops, baseline) for r in results]
    static_rows = [summarize(r, len(work), flops, machine_flops, baseline) for r in static_runs]
    print()
    print_table(rows)
    if static_rows:
        print(
            "\n(a) by batch size (arrival order"
            + (", sorted by prompt length" if args.hf_sort else "")
            + "):"
        )
        print_table(static_rows)
    if args.rounds > 1:
        print(f"\nrounds, output tokens/s, (a) at B={best_batch} then (c) (the first: the sweep's run of B):")
        for i, r in enumerate(rounds, 1):
            static = f"{r['static_output_tokens_per_s']:.1f}" if r["ratio"] else "-"
            ratio = f" ({r['ratio']:.2f}x)" if r["ratio"] else ""
            print(f"  {i}: {static} / {r['pagedserve_output_tokens_per_s']:.1f}{ratio}")
        print("each system's row above is its fastest round")
    print(
        f"\nworkload {flops / 1e12:.2f} TFLOP; 'of peak' = achieved FLOP/s / measured matmul "
        f"{machine_flops / 1e9:.0f} GFLOP/s (the higher of {measured_flops[0] / 1e9:.0f} before the runs "
        f"and {measured_flops[1] / 1e9:.0f} after); latency = start -> request's last token (all arrive at t=0)"
    )

    args.out.parent.mkdir(parents=True, exist_ok=True)
    summary = {
        "model": model_name(model_dir),
        "dtype": str(dtype),
        "hf_dtype": str(hf_dtype),
        "threads": torch.get_num_threads(),
        "workload": {
            "num_requests": len(work),
            "prompt_len_range": prompt_range,
            "output_len_range": output_range,
            "seed": args.seed,
            "prompt_tokens": n_prompt,
            "output_tokens": n_out,
            "flops": flops,
            "hf_sorted": args.hf_sort,
        },
        "machine_matmul_flops": machine_flops,
        "machine_matmul_flops_before_after": measured_flops,
        "systems": rows,
        "hf_static_by_batch_size": static_rows,
        "rounds": rounds,
    }
    json_path = args.out.with_suffix(".json")
    json_path.write_text(json.dumps(summary, indent=2) + "\n")
    title = (
        f"{model_name(model_dir)}: pagedserve {str(dtype).removeprefix('torch.')}, transformers "
        f"{str(hf_dtype).removeprefix('torch.')}, {torch.get_num_threads()} CPU thread(s)\n{len(work)} requests, "
        f"prompts {prompt_range[0]}-{prompt_range[1]} tokens, outputs {output_range[0]}-{output_range[1]} tokens"
    )
    # The other batch sizes beside the rows (the best one is row (a)).
    plot(
        rows + [r for r in static_rows if r["system"] != f"transformers static B={best_batch}"],
        args.out.with_suffix(".png"),
        title,
    )
    print(f"wrote {json_path} and {args.out.with_suffix('.png').name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
