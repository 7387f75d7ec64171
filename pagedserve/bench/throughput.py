"""`pagedserve bench throughput`: offline engine throughput through the `LLM` API (like `vllm bench throughput`).

    pagedserve bench throughput --dataset-name random --random-input-len 256 --random-output-len 64 \\
        --num-prompts 64 [--model default] [--dtype auto] [--max-num-seqs 256] [--output-json out.json]

All prompts are handed to one `LLM.generate` call (the server's scheduler and worker, in process);
ignore_eos with max_tokens makes every output length exact. Prints requests/s, output tokens/s and
total (prompt + output) tokens/s over the generate call's wall time.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from pagedserve.bench import datasets
from pagedserve.bench.datasets import ChatLengths


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pagedserve bench throughput",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="default")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--dataset-name", choices=("random", "chat"), default="random")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--random-input-len", type=int, default=256)
    p.add_argument("--random-output-len", type=int, default=64)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--chat-input-max", type=int, default=1024, help="clip chat prompts to this many tokens")
    p.add_argument("--chat-output-max", type=int, default=512, help="clip chat outputs to this many tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=1.0, help="0 for greedy")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--num-blocks", type=int, default=None)
    p.add_argument("--kv-cache-memory", type=int, default=None, help="bytes of KV pool")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--output-json", type=Path, default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from pagedserve.llm import LLM
    from pagedserve.sampling_params import SamplingParams

    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=not args.no_prefix_caching,
        kv_cache_memory=args.kv_cache_memory,
        num_blocks=args.num_blocks,
        seed=args.seed,
    )
    tokenizer = llm.get_tokenizer()
    if args.dataset_name == "random":
        requests = datasets.sample_random(
            tokenizer,
            args.num_prompts,
            args.random_input_len,
            args.random_output_len,
            args.random_range_ratio,
            seed=args.seed,
            as_token_ids=True,
        )
    else:
        lengths = ChatLengths(input_max=args.chat_input_max, output_max=args.chat_output_max)
        requests = datasets.sample_chat(
            tokenizer, args.num_prompts, lengths, seed=args.seed, as_token_ids=True
        )
    # NOTE: a request that cannot fit the context is shortened in its output, never dropped.
    limit = llm.max_model_len
    requests = [r for r in requests if r.prompt_len < limit]
    params = [
        SamplingParams(
            temperature=args.temperature, max_tokens=min(r.output_len, limit - r.prompt_len), ignore_eos=True
        )
        for r in requests
    ]
    start = time.perf_counter()
    outs = llm.generate([r.prompt for r in requests], params, use_tqdm=not args.no_progress)
    elapsed = time.perf_counter() - start
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
    output_tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    result = {
        "model": llm.model_name,
        "dtype": str(llm.dtype),
        "dataset": args.dataset_name,
        "num_requests": len(outs),
        "elapsed_s": elapsed,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "requests_per_s": len(outs) / elapsed,
        "output_tokens_per_s": output_tokens / elapsed,
        "total_tokens_per_s": (prompt_tokens + output_tokens) / elapsed,
    }
    print(
        f"Throughput: {result['requests_per_s']:.2f} requests/s, "
        f"{result['total_tokens_per_s']:.2f} total tokens/s, {result['output_tokens_per_s']:.2f} output tokens/s"
    )
    print(f"Total num prompt tokens:  {prompt_tokens}")
    print(f"Total num output tokens:  {output_tokens}")
    print(f"Elapsed: {elapsed:.2f} s for {len(outs)} requests")
    if args.output_json:
        args.output_json.parent.mkdir(parents=True, exist_ok=True)
        args.output_json.write_text(json.dumps(result, indent=2) + "\n")
    return 0
