"""End-to-end decode check for a GPU machine (part of `make gpu-check`): a random-weight Llama-shaped model
runs a mixed prefill + greedy decode on the GPU with the CUDA kernels, and the same token stream (teacher
forced) through (a) the same GPU model with the PyTorch reference ops and (b) the model on CPU with the
reference ops. Prints the logit differences and the greedy agreement, exits non-zero on a mismatch.

Written against the model interface (CausalLM with the kernel ops it is given, AttentionMetadata); kept
separate so a change of that interface is fixed here only.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from pagedserve.kernels import cuda_ops
from pagedserve.kernels.reference import ReferenceOps
from pagedserve.worker_svc import model as model_mod

# Llama-3-8B attention and MLP shapes, fewer layers (random weights, no download).
LLAMA_SHAPED = {
    "model_type": "llama",
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 4,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
}
BLOCK_SIZE = 16


def build(config, dtype, device, ops, state=None):
    model = model_mod.CausalLM(config, dtype, device, ops)  # the kernel ops picked explicitly
    if state is None:
        gen = torch.Generator(device="cpu").manual_seed(0)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_((torch.randn(p.shape, generator=gen) * 0.02).to(p.dtype))
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.fill_(1.0)
    else:
        model.load_state_dict(state)
    return model


class Sequences:
    """Block bookkeeping for a fixed batch: random physical blocks, growing contexts."""

    def __init__(self, prompt_lens, max_new, num_blocks, seed=1):
        gen = torch.Generator().manual_seed(seed)
        perm = torch.randperm(num_blocks, generator=gen).tolist()
        self.max_blocks = max((n + max_new + BLOCK_SIZE - 1) // BLOCK_SIZE for n in prompt_lens)
        self.tables = torch.zeros(len(prompt_lens), self.max_blocks, dtype=torch.int32)
        for s in range(len(prompt_lens)):
            self.tables[s] = torch.tensor(perm[s * self.max_blocks : (s + 1) * self.max_blocks])
        self.lens = [0] * len(prompt_lens)

    def step(self, new_counts, device):
        """AttentionMetadata and positions for appending new_counts[s] tokens to each sequence."""
        positions, slots, starts = [], [], [0]
        for s, n in enumerate(new_counts):
            for p in range(self.lens[s], self.lens[s] + n):
                positions.append(p)
                slots.append(int(self.tables[s, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE)
            self.lens[s] += n
            starts.append(starts[-1] + n)
        meta = model_mod.AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            block_tables=self.tables.to(device),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            context_lens=torch.tensor(self.lens, dtype=torch.int32, device=device),
            max_query_len=max(new_counts),
        )
        return torch.tensor(positions, dtype=torch.int64, device=device), meta


def run_stream(model, device, tokens_per_step, counts_per_step, num_blocks):
    """Feeds the given token ids step by step; returns each step's last-token logits [S, vocab] (float32 CPU)."""
    caches = [
        (
            torch.zeros(model.kv_cache_shape(num_blocks, BLOCK_SIZE), dtype=model.dtype, device=device),
            torch.zeros(model.kv_cache_shape(num_blocks, BLOCK_SIZE), dtype=model.dtype, device=device),
        )
        for _ in model.layers
    ]
    seqs = Sequences(counts_per_step[0], len(counts_per_step) - 1, num_blocks)
    outs = []
    for ids, counts in zip(tokens_per_step, counts_per_step, strict=True):
        positions, meta = seqs.step(counts, device)
        hidden = model(ids.to(device), positions, meta, caches)
        last = meta.query_start_loc[1:].long() - 1
        outs.append(model.compute_logits(hidden[last]).float().cpu())
    return outs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=24, help="decode steps after the prefill")
    parser.add_argument("--layers", type=int, default=LLAMA_SHAPED["num_hidden_layers"])
    parser.add_argument("--no-cpu", dest="cpu", action="store_false", help="skip the CPU comparison")
    args = parser.parse_args()
    if not cuda_ops.is_available():
        print("gpu_e2e: CUDA kernels unavailable, nothing to check", file=sys.stderr)
        return 1
    config = model_mod.ModelConfig.from_hf_config({**LLAMA_SHAPED, "num_hidden_layers": args.layers})
    dtype, dev = torch.bfloat16, torch.device("cuda")
    prompt_lens = [1, 15, 16, 17, 200, 513, 1000]
    num_blocks = 2 * len(prompt_lens) * ((max(prompt_lens) + args.steps) // BLOCK_SIZE + 2)

    t0 = time.perf_counter()
    gpu = build(config, dtype, dev, cuda_ops.CudaOps(dev))
    state = {k: v.detach().cpu() for k, v in gpu.state_dict().items()}
    # Token stream: random prompts, then greedy continuation chosen by the CUDA-kernel run.
    gen = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, config.vocab_size, (sum(prompt_lens),), generator=gen)
    tokens, counts = [prompt], [prompt_lens]
    logits_gpu = []
    # Run step by step so that greedy tokens can be chosen from the CUDA run.
    seqs = Sequences(prompt_lens, args.steps, num_blocks)
    caches_gpu = [
        tuple(
            torch.zeros(gpu.kv_cache_shape(num_blocks, BLOCK_SIZE), dtype=dtype, device=dev) for _ in range(2)
        )
        for _ in gpu.layers
    ]
    ids = prompt
    step_counts = prompt_lens
    for step in range(args.steps + 1):
        positions, meta = seqs.step(step_counts, dev)
        hidden = gpu(ids.to(dev), positions, meta, caches_gpu)
        logits = gpu.compute_logits(hidden[meta.query_start_loc[1:].long() - 1]).float().cpu()
        logits_gpu.append(logits)
        if step == args.steps:
            break
        ids = logits.argmax(-1)
        step_counts = [1] * len(prompt_lens)
        tokens.append(ids)
        counts.append(step_counts)
    torch.cuda.synchronize()
    print(
        f"cuda kernels: {args.steps} decode steps after a {sum(prompt_lens)}-token prefill in "
        f"{time.perf_counter() - t0:.1f}s"
    )

    ok = True
    ref_gpu = build(config, dtype, dev, ReferenceOps(), state)
    logits_ref = run_stream(ref_gpu, dev, tokens, counts, num_blocks)
    del ref_gpu
    ok &= report("GPU reference ops", logits_gpu, logits_ref, max_rel=0.02, min_agree=0.97)
    if args.cpu:
        cpu = build(config, dtype, torch.device("cpu"), ReferenceOps(), state)
        logits_cpu = run_stream(cpu, torch.device("cpu"), tokens, counts, num_blocks)
        ok &= report("CPU reference", logits_gpu, logits_cpu, max_rel=0.05, min_agree=0.9)
    print("gpu_e2e:", "OK" if ok else "MISMATCH")
    return 0 if ok else 1


def report(name, ours, theirs, max_rel, min_agree) -> bool:
    worst, agree, total = 0.0, 0, 0
    for a, b in zip(ours, theirs, strict=True):
        rel = ((a - b).abs().max() / b.abs().max().clamp_min(1e-6)).item()
        worst = max(worst, rel)
        agree += (a.argmax(-1) == b.argmax(-1)).sum().item()
        total += a.shape[0]
    ok = worst <= max_rel and agree / total >= min_agree
    print(
        f"| vs {name} | max rel logit diff {worst:.4f} | greedy agreement {agree}/{total} | "
        f"{'ok' if ok else 'FAIL'} |"
    )
    return ok


if __name__ == "__main__":
    sys.exit(main())
