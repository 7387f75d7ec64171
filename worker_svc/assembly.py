"""A worker put together: the model resolved and loaded on its device in its dtype, the KV pool sized and
allocated, the runner over both, and the ModelInfo that describes them to the scheduler. The worker server
(load_worker) and the offline LLM (pagedserve/llm.py) both assemble through here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from pagedserve.kernels import get_ops
from pagedserve.kernels.ops import Ops
from pagedserve.logging import get_logger
from pagedserve.model_files import GenerationInfo, load_generation_info, model_name, resolve_model
from pagedserve.v1 import worker_pb2
from pagedserve.worker_svc.config import (
    DEFAULT_GPU_MEMORY_UTILIZATION,
    DEFAULT_MAX_CUDAGRAPH_CAPTURE_SIZE,
    WorkerConfig,
)
from pagedserve.worker_svc.cuda_graphs import CudaGraphCapture, capture_sizes
from pagedserve.worker_svc.kv_cache import KVCache, KVCacheSpec, resolve_num_blocks
from pagedserve.worker_svc.loader import load_model, parse_dtype, read_model_config
from pagedserve.worker_svc.model import CausalLM
from pagedserve.worker_svc.runner import ModelRunner
from pagedserve.worker_svc.sampler import Sampler

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
# The tokens of the largest step the KV budget leaves room for (the scheduler's default step budget).
STEP_TOKENS = 2048

log = get_logger("pagedserve.worker")


@dataclass(slots=True)
class LoadedWorker:
    model_dir: Path  # the resolved model folder (config, weights, tokenizer)
    generation: GenerationInfo  # the model's EOS ids and its own context length
    runner: ModelRunner  # the executor over the loaded model and its KV pool
    info: worker_pb2.ModelInfo  # what GetModelInfo and Reset answer, and registration tells the scheduler

    @property
    def model(self) -> CausalLM:
        return self.runner.model

    @property
    def kv_cache(self) -> KVCache:
        return self.runner.kv_cache


def resolve_device(name: str) -> torch.device:
    """ "auto": cuda where torch sees a device, else cpu; "cuda" alone: the current CUDA device."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def assemble(
    model: str | None = None,
    *,
    dtype: str = "auto",
    quantization: str = "auto",
    device: str = "auto",
    block_size: int = 16,
    num_blocks: int | None = None,
    kv_cache_memory: int | None = None,
    max_model_len: int | None = None,
    seed: int | None = None,
    context_within_pool: bool = False,
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
    enforce_eager: bool = False,
    max_cudagraph_capture_size: int = DEFAULT_MAX_CUDAGRAPH_CAPTURE_SIZE,
) -> LoadedWorker:
    """Load the model (a folder, a .gguf file, None for the default), size and allocate the KV pool (num_blocks,
    else from kv_cache_memory bytes, else the device's default budget), build the runner (its sampler's
    unseeded draws from `seed`; None: fresh entropy). max_model_len: the longest sequence, by default the
    model's own; context_within_pool also bounds it by the pool, so that a sequence always fits the pool
    alone (the offline engine; a server's scheduler refuses such requests itself). On CUDA without either
    size, the pool takes what gpu_memory_utilization of the device leaves after the weights and a step's
    activations. On CUDA kernels, plain decode steps of up to max_cudagraph_capture_size sequences are
    captured as CUDA graphs unless enforce_eager."""
    model_dir = resolve_model(model)
    torch_device = resolve_device(device)
    torch_dtype = parse_dtype(dtype, torch_device)
    mc = read_model_config(model_dir)
    check_kernel_shapes(get_ops(torch_device), mc.head_dim, block_size, torch_dtype)
    loaded = load_model(model_dir, torch_dtype, torch_device, quantization=quantization)
    generation = load_generation_info(model_dir)
    spec = KVCacheSpec(mc.num_layers, mc.num_kv_heads, mc.head_dim, block_size, torch_dtype)
    activations = mc.activation_bytes(STEP_TOKENS, torch.empty(0, dtype=torch_dtype).element_size())
    num_blocks = resolve_num_blocks(
        spec, torch_device, num_blocks, kv_cache_memory, gpu_memory_utilization, activations
    )
    max_model_len = min(max_model_len or generation.max_model_len, mc.max_position)
    if context_within_pool:
        max_model_len = min(max_model_len, num_blocks * block_size)
    kv_cache = KVCache(spec, num_blocks, torch_device)
    sampler = Sampler(mc.vocab_size, torch_device, seed=seed)
    runner = ModelRunner(loaded, kv_cache, max_model_len, sampler)
    if runner.ops.name == "cuda" and not enforce_eager:
        started = time.perf_counter()
        sizes = capture_sizes(max_cudagraph_capture_size)
        runner.capture_decode_graphs(sizes, CudaGraphCapture(torch_device))
        log.info("cuda_graphs_captured", sizes=sizes, seconds=round(time.perf_counter() - started, 2))
    info = worker_pb2.ModelInfo(
        model=model_name(model_dir),
        num_blocks=num_blocks,
        block_size=block_size,
        dtype=DTYPE_NAMES[torch_dtype],
        device=str(torch_device),
        max_model_len=max_model_len,
        vocab_size=mc.vocab_size,
        num_layers=mc.num_layers,
        num_kv_heads=mc.num_kv_heads,
        head_dim=mc.head_dim,
        block_bytes=spec.block_bytes,
        eos_token_ids=list(generation.eos_token_ids),
    )
    return LoadedWorker(model_dir, generation, runner, info)


def check_kernel_shapes(ops: Ops, head_dim: int, block_size: int, dtype: torch.dtype) -> None:
    """Refuse, before the weights load, a model whose shape the device's kernels cannot run (the CUDA
    kernels are built for some head sizes, block sizes and dtypes; the CPU's and the reference take any)."""
    if ops.name != "cuda":
        return
    from pagedserve.kernels.cuda_ops import unsupported_reason

    reason = unsupported_reason(head_dim, block_size, dtype)
    if reason is not None:
        raise ValueError(
            f"this model cannot run on {ops.name}: {reason} (head_dim {head_dim}, --block-size {block_size})"
        )


def load_worker(config: WorkerConfig) -> LoadedWorker:
    """The worker a `pagedserve worker` configuration names."""
    worker = assemble(
        config.model,
        dtype=config.dtype,
        quantization=config.quantization,
        device=config.device,
        block_size=config.block_size,
        num_blocks=config.num_blocks,
        kv_cache_memory=config.kv_cache_memory,
        max_model_len=config.max_model_len,
        gpu_memory_utilization=config.gpu_memory_utilization,
        enforce_eager=config.enforce_eager,
        max_cudagraph_capture_size=config.max_cudagraph_capture_size,
    )
    log.info(
        "kv_cache_allocated",
        num_blocks=worker.info.num_blocks,
        block_size=worker.info.block_size,
        kv_cache_bytes=worker.kv_cache.num_bytes,
        max_model_len=worker.info.max_model_len,
        threads=torch.get_num_threads(),
    )
    return worker
