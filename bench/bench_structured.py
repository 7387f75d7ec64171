"""What a structured-output constraint costs per decode step, against the step itself.

For each batch size B, B requests with a context of C tokens decode step after step on two of the worker's
ModelRunners taking turns, one unconstrained (the plain decode path), one with every row under a JSON schema: the
scheduler's part (llguidance fills each row's token mask, the masks are packed into the plan, and each
sampled token advances its row's matcher) and the worker's part (the plan's masks unpacked and applied
before sampling) are timed apart. A third runner takes the constrained plans with the sampler as it was
before its fused masked argmax (the masks unpacked onto a float32 copy of the logits, then the argmax), taking
turns with the fused one step by step; both must pick the same tokens. A row whose JSON is complete starts
over with a fresh matcher, so every step measures rows in the middle of a document.

    .venv/bin/python bench/bench_structured.py [--model default] [--batch 1,32] [--context 256] [--steps 24]

Prints a table and writes bench/results/bench_structured.{json,png}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from bench_worker import decode_plans

from pagedserve.kernels.reference import mask_tokens
from pagedserve.model_files import load_generation_info, resolve_model
from pagedserve.scheduler_svc.structured_output import GrammarCompiler, MaskFiller, load_tokenizer
from pagedserve.v1 import common_pb2
from pagedserve.worker_svc.kv_cache import KVCache, KVCacheSpec
from pagedserve.worker_svc.loader import load_model, parse_dtype
from pagedserve.worker_svc.runner import ModelRunner
from pagedserve.worker_svc.sampler import Sampler, SamplingMetadata, apply_token_mask

RESULTS = Path(__file__).resolve().parent / "results"

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "status": {"enum": ["active", "inactive", "pending"]},
    },
    "required": ["name", "age", "tags", "address", "status"],
    "additionalProperties": False,
}


def run_cell(model, spec_args, batch: int, context: int, steps: int, grammar, filler) -> dict:
    """Median seconds of a plain step and of a constrained one, and of the scheduler's mask fill and matcher
    advance. The two runners take turns step by step, so that both see the same load on a shared machine."""
    cfg = model.config
    blocks_per_seq = -(-(context + steps) // spec_args["block_size"])
    spec = KVCacheSpec(
        cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, spec_args["block_size"], spec_args["dtype"]
    )

    def new_runner() -> ModelRunner:
        cache = KVCache(spec, batch * blocks_per_seq, torch.device("cpu"))
        return ModelRunner(model, cache, context + steps + 2)

    plain, constrained, unfused = new_runner(), new_runner(), new_runner()
    # The sampler as it was before the fused kernel: the masks unpacked onto a float32 copy, then the argmax.
    argmax = unfused.sampler.argmax
    unfused.sampler.masked_argmax = lambda x, masks, rows: argmax(mask_tokens(x, masks, rows))
    matchers = [grammar.matcher() for _ in range(batch)]
    times: dict[str, list[float]] = {"plain": [], "constrained": [], "unfused": [], "mask": [], "advance": []}
    plans = zip(
        decode_plans(batch, context, spec_args["block_size"], cfg.vocab_size, steps),
        decode_plans(batch, context, spec_args["block_size"], cfg.vocab_size, steps),
        decode_plans(batch, context, spec_args["block_size"], cfg.vocab_size, steps),
        strict=True,
    )
    for step, (plain_plan, plan, unfused_plan) in enumerate(plans):
        t = time.perf_counter()
        plain.execute(plain_plan)
        times["plain"].append(time.perf_counter() - t)
        t = time.perf_counter()
        masks = filler.fill(matchers)
        plan.mask_slots.extend(range(batch))
        plan.token_masks = masks.tobytes()
        times["mask"].append(time.perf_counter() - t)
        unfused_plan.mask_slots.extend(range(batch))
        unfused_plan.token_masks = plan.token_masks
        # Both constrained runners see the same masks; which goes first alternates step by step.
        for name in ("constrained", "unfused") if step % 2 else ("unfused", "constrained"):
            runner, this_plan = (constrained, plan) if name == "constrained" else (unfused, unfused_plan)
            t = time.perf_counter()
            out = runner.execute(this_plan)
            times[name].append(time.perf_counter() - t)
            if name == "constrained":
                result = out
            else:
                unfused_tokens = list(out.sampled_token_ids)
        assert list(result.sampled_token_ids) == unfused_tokens, "the fused masked argmax disagrees"
        t = time.perf_counter()
        for i, token in enumerate(result.sampled_token_ids):
            assert matchers[i].consume_token(token), matchers[i].get_error()
            if matchers[i].is_stopped():
                matchers[i] = grammar.matcher()  # complete: a new document from here
        times["advance"].append(time.perf_counter() - t)
    # The first steps add the requests and warm up allocators and caches.
    cell = {name: statistics.median(values[2:]) for name, values in times.items()}
    # The last step's real masks.
    cell["apply"], cell["apply_unfused"] = time_apply(torch.from_numpy(masks.copy()), cfg.vocab_size)
    return cell


def time_apply(words: torch.Tensor, vocab: int, repeats: int = 50) -> tuple[float, float]:
    """Median seconds of the sampler's masked argmax alone, these masks on [B, vocab] bfloat16 logits: the
    fused kernel's, and the masks unpacked onto a float32 copy then the argmax (taking turns)."""
    logits = torch.randn(words.shape[0], vocab).bfloat16()
    sampler = Sampler(vocab)
    meta = SamplingMetadata.argmax_rows(words.shape[0])
    meta.token_mask = (None, words)
    fused, unfused = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        sampler.masked_argmax(logits, words, None)
        fused.append(time.perf_counter() - t)
        t = time.perf_counter()
        sampler.argmax(apply_token_mask(logits, meta))
        unfused.append(time.perf_counter() - t)
    return statistics.median(fused), statistics.median(unfused)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batch", default="1,32")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cpu")
    dtype = parse_dtype(args.dtype, device)
    model_dir = resolve_model(args.model)
    model = load_model(model_dir, dtype, device)
    vocab = model.config.vocab_size
    eos = load_generation_info(model_dir).eos_token_ids
    t = time.perf_counter()
    compiler = GrammarCompiler(load_tokenizer(model_dir, vocab, eos))
    tokenizer_s = time.perf_counter() - t
    so = common_pb2.StructuredOutput(json_schema=json.dumps(SCHEMA))
    t = time.perf_counter()
    grammar = compiler.compile_sync(so)
    compile_s = time.perf_counter() - t
    t = time.perf_counter()
    compiler.compile_sync(so)
    cached_s = time.perf_counter() - t
    filler = MaskFiller(vocab)
    spec_args = {"block_size": 16, "dtype": dtype}

    rows = []
    for batch in [int(b) for b in args.batch.split(",")]:
        cell = run_cell(model, spec_args, batch, args.context, args.steps, grammar, filler)
        apply_s = cell["apply"]
        worker_extra = cell["constrained"] - cell["plain"]
        unfused_extra = cell["unfused"] - cell["plain"]
        scheduler_s = cell["mask"] + cell["advance"]
        rows.append(
            {
                "batch": batch,
                "context": args.context,
                "decode_step_ms": cell["plain"] * 1e3,
                "constrained_step_ms": cell["constrained"] * 1e3,
                "mask_fill_ms": cell["mask"] * 1e3,
                "matcher_advance_ms": cell["advance"] * 1e3,
                "mask_apply_ms": apply_s * 1e3,
                "worker_extra_ms": worker_extra * 1e3,
                "overhead_of_step": (scheduler_s + max(worker_extra, 0.0)) / cell["plain"],
                "unfused_step_ms": cell["unfused"] * 1e3,
                "unfused_apply_ms": cell["apply_unfused"] * 1e3,
                "unfused_worker_extra_ms": unfused_extra * 1e3,
                "unfused_overhead_of_step": (scheduler_s + max(unfused_extra, 0.0)) / cell["plain"],
                "mask_and_apply_of_step": (cell["mask"] + apply_s) / cell["plain"],
            }
        )
    compiler.close()

    print(
        f"\n{args.model} ({dtype}, {torch.get_num_threads()} threads), context {args.context}; tokenizer load "
        f"{tokenizer_s:.2f} s, schema compile {compile_s * 1e3:.2f} ms ({cached_s * 1e6:.0f} us cached)\n"
    )
    print(
        f"{'batch':>5} {'sampler':>8} {'step ms':>8} {'constr ms':>9} {'fill ms':>8} {'advance ms':>10} "
        f"{'apply ms':>8} {'worker +ms':>10} {'fill+apply':>10} {'all':>7}"
    )
    for r in rows:
        for name, prefix in (("unfused", "unfused_"), ("fused", "")):
            step = r["unfused_step_ms"] if prefix else r["constrained_step_ms"]
            apply_ms = r[f"{prefix or 'mask_'}apply_ms"]
            print(
                f"{r['batch']:>5} {name:>8} {r['decode_step_ms']:>8.2f} {step:>9.2f} {r['mask_fill_ms']:>8.3f} "
                f"{r['matcher_advance_ms']:>10.3f} {apply_ms:>8.3f} {r[prefix + 'worker_extra_ms']:>10.3f} "
                f"{(r['mask_fill_ms'] + apply_ms) / r['decode_step_ms']:>10.1%} {r[prefix + 'overhead_of_step']:>7.1%}"
            )
    print(
        "step ms: a plain decode step (every row unconstrained); constr ms: the same step with every row under "
        "the schema; fill: the scheduler's masks; advance: feeding the sampled tokens to the matchers; apply: "
        "the sampler's masked argmax alone; sampler: fused (the masks applied in the argmax's pass over the logits) "
        "or unfused (the masks unpacked onto a float32 copy, then the argmax); worker +ms: constrained step less plain step; fill+apply: (fill + apply) / "
        "step; all: (fill + advance + worker +ms) / step"
    )
    RESULTS.mkdir(parents=True, exist_ok=True)
    summary = {
        "model": args.model,
        "dtype": str(dtype),
        "threads": torch.get_num_threads(),
        "tokenizer_load_s": tokenizer_s,
        "compile_s": compile_s,
        "cached_compile_s": cached_s,
        "rows": rows,
    }
    (RESULTS / "bench_structured.json").write_text(json.dumps(summary, indent=2))
    plot(rows, RESULTS / "bench_structured.png")
    print(f"wrote {RESULTS / 'bench_structured.json'} and bench_structured.png")
    return 0


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    labels = [f"batch {r['batch']}" for r in rows]
    x = range(len(rows))
    parts = [
        ("decode step", "decode_step_ms"),
        ("mask fill (scheduler)", "mask_fill_ms"),
        ("matcher advance (scheduler)", "matcher_advance_ms"),
        ("mask apply (sampler)", "mask_apply_ms"),
    ]
    width = 0.2
    for k, (label, key) in enumerate(parts):
        ax.bar([i + k * width for i in x], [r[key] for r in rows], width, label=label)
    ax.set_xticks([i + 1.5 * width for i in x], labels)
    ax.set_ylabel("ms per step")
    ax.set_yscale("log")
    ax.set_title("Structured outputs: cost per step against the decode step")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
