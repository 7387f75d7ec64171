"""Prefix caching: time to first token with a long shared system prompt, cache on against off.

Every prompt is the same ~600-word system prompt followed by a short distinct question. Requests go
through the offline `LLM` API one after another (each submitted when the previous one is done, so
the cache filled by one is there for the next); a request's TTFT is the time from its submission to
its first token in the engine loop. With the cache on, the first request computes the whole prompt
and every later one only the part after the last full shared block. The median over requests is
compared; the team's goal is a ratio >= 20x.

    .venv/bin/python bench/bench_prefix.py [--num-questions 8] [--words 600] [--dtype auto] [--threads N]

Prints a table and writes bench/results/bench_prefix.{json,png}.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"
_WORDS = [
    "the",
    "assistant",
    "answers",
    "questions",
    "about",
    "travel",
    "weather",
    "history",
    "science",
    "cooking",
    "music",
    "sports",
    "and",
    "language",
    "clearly",
    "politely",
    "briefly",
    "with",
    "facts",
    "examples",
    "and",
    "sources",
    "when",
    "a",
    "user",
    "asks",
    "it",
    "checks",
    "the",
    "question",
    "first",
    "then",
    "gives",
    "one",
    "short",
    "answer",
    "it",
    "never",
    "invents",
    "numbers",
    "names",
    "or",
    "dates",
    "and",
    "says",
    "so",
    "when",
    "unsure",
    "it",
    "keeps",
    "a",
    "friendly",
    "tone",
    "avoids",
    "jargon",
    "explains",
    "terms",
    "uses",
    "metric",
    "units",
    "prefers",
    "simple",
    "words",
    "and",
    "lists",
    "steps",
    "in",
    "order",
    "for",
    "recipes",
    "routes",
    "or",
    "instructions",
]


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def system_prompt(words: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    sentences, n = [], 0
    while n < words:
        k = int(min(rng.integers(8, 16), words - n))
        sentence = " ".join(rng.choice(_WORDS, size=k))
        sentences.append(sentence[0].upper() + sentence[1:] + ".")
        n += k
    return "You are a helpful assistant. " + " ".join(sentences)


def questions(n: int) -> list[str]:
    return [f"Question {i}: what is {3 * i + 7} plus {5 * i + 2}?\nAnswer:" for i in range(n)]


def measure(llm, prompts: list[str]) -> list[float]:
    from tqdm import tqdm

    from pagedserve.sampling_params import SamplingParams

    ttfts = []
    for prompt in tqdm(prompts, desc="requests", unit="req"):
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0]
        ttfts.append(out.metrics.first_token_time - out.metrics.arrival_time)
    return ttfts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-questions", type=int, default=8)
    parser.add_argument("--words", type=int, default=600, help="words in the shared system prompt")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    args = parser.parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)

    from pagedserve.llm import LLM

    system = system_prompt(args.words, args.seed)
    prompts = [f"{system}\n\n{q}" for q in questions(args.num_questions)]
    warmup = system_prompt(args.words, args.seed + 1) + "\n\nQuestion: warm up?\nAnswer:"
    results = {}
    prompt_tokens = None
    for caching in (False, True):
        llm = LLM(model=args.model, dtype=args.dtype, enable_prefix_caching=caching, seed=args.seed)
        prompt_tokens = [len(llm.tokenizer.encode(p)) for p in prompts]
        measure(llm, [warmup])  # first-call costs (allocator, kernels) out of the numbers
        ttfts = measure(llm, prompts)
        stats = llm.scheduler.stats()
        results["on" if caching else "off"] = {
            "ttft_s": ttfts,
            "median_ttft_s": statistics.median(ttfts),
            "prefix_cache_hit_rate": stats.prefix_cache_hits / stats.prefix_cache_queries
            if stats.prefix_cache_queries
            else 0.0,
        }
        del llm

    off, on = results["off"]["median_ttft_s"], results["on"]["median_ttft_s"]
    ratio = off / on
    print()
    print(
        f"shared system prompt: {args.words} words; prompts {min(prompt_tokens)}-{max(prompt_tokens)} tokens; "
        f"{args.num_questions} requests one after another; {torch_threads()} threads"
    )
    print(f"{'prefix cache':<13} {'median TTFT ms':>15} {'first ms':>9} {'hit rate':>9}")
    for key in ("off", "on"):
        r = results[key]
        print(
            f"{key:<13} {r['median_ttft_s'] * 1e3:>15.1f} {r['ttft_s'][0] * 1e3:>9.1f} {r['prefix_cache_hit_rate']:>8.0%}"
        )
    print(f"speed-up of the median TTFT: {ratio:.1f}x (goal >= 20x)")

    RESULTS.mkdir(parents=True, exist_ok=True)
    summary = {
        "words": args.words,
        "num_questions": args.num_questions,
        "prompt_tokens": prompt_tokens,
        "results": results,
        "median_ttft_ratio": ratio,
    }
    (RESULTS / "bench_prefix.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot(results, ratio, RESULTS / "bench_prefix.png")
    print(f"wrote {RESULTS / 'bench_prefix.json'} and bench_prefix.png")
    return 0


def plot(results: dict, ratio: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for key, color in (("off", "#999999"), ("on", "#2b7bba")):
        ttfts = [t * 1e3 for t in results[key]["ttft_s"]]
        ax.plot(range(len(ttfts)), ttfts, "o-", color=color, label=f"prefix cache {key}")
    ax.set_yscale("log")
    ax.set_xlabel("request (submitted one after another)")
    ax.set_ylabel("time to first token (ms)")
    ax.set_title(f"Shared system prompt: median TTFT {ratio:.1f}x faster with prefix caching", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
