"""A worker put together: the model resolved and loaded on its device in its dtype, the KV pool sized and
allocated, the runner over both, and the ModelInfo that describes them to the scheduler. The worker server
(load_worker) and the offline LLM (pagedserve/llm.py) both assemble through here.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from pagedserve.kernels import get_ops
from pagedserve.kernels.cpu_ops import CpuOps
from pagedserve.kernels.ops import Ops
from pagedserve.logging import get_logger
from pagedserve.model_files import GenerationInfo, load_generation_info, model_name, resolve_model
from pagedserve.v1 import worker_pb2
from pagedserve.worker_svc.config import (
    DEFAULT_DETERMINISTIC,
    DEFAULT_GPU_MEMORY_UTILIZATION,
    DEFAULT_MAX_CUDAGRAPH_CAPTURE_SIZE,
    WorkerConfig,
)
from pagedserve.worker_svc.cuda_graphs import CudaGraphCapture, capture_sizes
from pagedserve.worker_svc.kv_cache import KVCache, KVCacheSpec, resolve_num_blocks
from pagedserve.worker_svc.loader import load_model, parse_dtype, read_model_config
from pagedserve.worker_svc.model import CausalLM, ModelConfig
from pagedserve.worker_svc.parallel import (
    LeaderModel,
    ParallelGroup,
    RankProcesses,
    check_tensor_parallel,
    default_threads,
    exit_on_rank_death,
    rank_device,
    shard_config,
    start_group,
    stop_group,
)
from pagedserve.worker_svc.quantization import resolve_quantization
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
    # With --tensor-parallel-size > 1: this process's place in the group (rank 0) and the other ranks.
    group: ParallelGroup | None = None
    ranks: RankProcesses | None = None

    @property
    def model(self) -> CausalLM:
        return self.runner.model

    def close(self) -> None:
        """On the thread that runs the steps: stop the other ranks, if any."""
        if self.group is not None and self.ranks is not None:
            stop_group(self.group, self.ranks)
            self.group = self.ranks = None

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


@dataclass(slots=True)
class Shard:
    """One rank's model and KV pool (the whole model's, without tensor parallelism)."""

    model_dir: Path  # the resolved model folder
    config: ModelConfig  # the full model's shape
    model: CausalLM  # this rank's layers (a shard of them in a tensor-parallel group)
    kv_cache: KVCache  # this rank's share of the pool: every block, its own kv heads
    spec: KVCacheSpec  # the pool's shape on this rank
    dtype: torch.dtype
    device: torch.device


def default_deterministic(ops: Ops, dtype: torch.dtype, quantization: str | None) -> bool:
    """Batch invariance unless asked otherwise: where its cost on the mixed workload was measured within 3 %
    (docs/performance.md, "Deterministic decoding"): the CPU kernels in bfloat16 with AMX tiles that round as
    the few-row linear's FMAs do (CpuOps.tiles_sum_in_chains), on unquantized weights (the quantized linear is
    not batch-invariant: --deterministic loads them dequantized). Elsewhere (float32, no AMX, CUDA, quantized)
    it is off: its cost there is larger or unmeasured, or, on CUDA, the linear layers are not invariant."""
    return (
        isinstance(ops, CpuOps)
        and dtype == torch.bfloat16
        and quantization is None
        and ops.tiles_sum_in_chains
    )


def load_shard(
    model: str | None,
    *,
    dtype: str,
    device: str,
    block_size: int,
    num_blocks: int | None,
    kv_cache_memory: int | None,
    gpu_memory_utilization: float,
    deterministic: bool | None = DEFAULT_DETERMINISTIC,
    quantization: str = "auto",
    group: ParallelGroup | None = None,
) -> Shard:
    """Load the model (a tensor-parallel rank: its shard) and allocate its KV pool: num_blocks, else from
    kv_cache_memory bytes (a group's budget, split evenly among its ranks), else the device's default budget
    (each rank's), the same block count on every rank of a group (the smallest)."""
    model_dir = resolve_model(model)
    torch_device = resolve_device(device) if group is None else group.device
    torch_dtype = parse_dtype(dtype, torch_device)
    mc = read_model_config(model_dir)
    ops = get_ops(torch_device)
    check_kernel_shapes(ops, mc.head_dim, block_size, torch_dtype)
    if deterministic is None:
        deterministic = default_deterministic(ops, torch_dtype, resolve_quantization(model_dir, quantization))
    ops.batch_invariant = deterministic
    if deterministic and ops.name != "cpu":
        log.warning(
            "deterministic_partly",
            kernels=ops.name,
            note="only the CPU kernels are batch-invariant through the whole forward pass; PyTorch's linear "
            "layers are not",
        )
    local = mc if group is None else shard_config(mc, group.size)
    loaded = load_model(model_dir, torch_dtype, torch_device, group=group, quantization=quantization)
    spec = KVCacheSpec(mc.num_layers, local.num_kv_heads, mc.head_dim, block_size, torch_dtype)
    activations = local.activation_bytes(STEP_TOKENS, torch.empty(0, dtype=torch_dtype).element_size())
    if group is not None and kv_cache_memory is not None:
        kv_cache_memory //= group.size
    num_blocks = resolve_num_blocks(
        spec, torch_device, num_blocks, kv_cache_memory, gpu_memory_utilization, activations
    )
    if group is not None:
        num_blocks = group.min(num_blocks)
    kv_cache = KVCache(spec, num_blocks, torch_device)
    return Shard(model_dir, mc, loaded, kv_cache, spec, torch_dtype, torch_device)


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
    tensor_parallel_size: int = 1,
    threads: int | None = None,
    on_rank_death: Callable[[int, int], None] | None = None,
    log_level: str = "info",
    deterministic: bool | None = DEFAULT_DETERMINISTIC,
) -> LoadedWorker:
    """Load the model (a folder, a .gguf file, None for the default), size and allocate the KV pool (num_blocks,
    else from kv_cache_memory bytes, else the device's default budget), build the runner (its sampler's
    unseeded draws from `seed`; None: fresh entropy). max_model_len: the longest sequence, by default the
    model's own; context_within_pool also bounds it by the pool, so that a sequence always fits the pool
    alone (the offline engine; a server's scheduler refuses such requests itself). On CUDA without either
    size, the pool takes what gpu_memory_utilization of the device leaves after the weights and a step's
    activations. On CUDA kernels, plain decode steps of up to max_cudagraph_capture_size sequences are
    captured as CUDA graphs unless enforce_eager. deterministic: the kernels batch-invariant
    (Ops.batch_invariant), on every rank. quantization: as load_model's.

    tensor_parallel_size > 1: this process becomes rank 0 of a group (see parallel.py); it starts the other
    ranks, each with `threads` torch threads (default: the cores shared out), and calls on_rank_death(rank,
    exit code) when one of them dies."""
    shard_args = {
        "dtype": dtype,
        "device": device,
        "block_size": block_size,
        "num_blocks": num_blocks,
        "kv_cache_memory": kv_cache_memory,
        "gpu_memory_utilization": gpu_memory_utilization,
        "deterministic": deterministic,
        "quantization": quantization,
    }
    group = ranks = None
    if tensor_parallel_size != 1:
        model_dir = resolve_model(model)
        check_tensor_parallel(read_model_config(model_dir), tensor_parallel_size)
        threads = threads or default_threads(tensor_parallel_size)
        torch.set_num_threads(threads)
        base = resolve_device(device)
        rank_device(base, tensor_parallel_size - 1)  # every rank has its GPU, before any starts
        follower_args = {**shard_args, "model": str(model_dir), "device": str(base), "threads": threads}
        group, ranks = start_group(
            tensor_parallel_size, base, {**follower_args, "log_level": log_level}, on_rank_death
        )
        model = str(model_dir)
    try:
        shard = load_shard(model, group=group, **shard_args)
    except BaseException:
        if ranks is not None:
            ranks.kill()
        raise
    mc, model_dir, kv_cache, torch_device = shard.config, shard.model_dir, shard.kv_cache, shard.device
    generation = load_generation_info(model_dir)
    num_blocks = kv_cache.num_blocks
    max_model_len = min(max_model_len or generation.max_model_len, mc.max_position)
    if context_within_pool:
        max_model_len = min(max_model_len, num_blocks * block_size)
    sampler = Sampler(mc.vocab_size, torch_device, seed=seed)
    runner_model = shard.model if group is None else LeaderModel(shard.model, group, mc)
    runner = ModelRunner(runner_model, kv_cache, max_model_len, sampler)
    # NOTE: a graph would capture the collectives too (NCCL allows it); tensor-parallel steps run eagerly.
    if runner.ops.name == "cuda" and not enforce_eager and group is None:
        started = time.perf_counter()
        sizes = capture_sizes(max_cudagraph_capture_size)
        runner.capture_decode_graphs(sizes, CudaGraphCapture(torch_device))
        log.info("cuda_graphs_captured", sizes=sizes, seconds=round(time.perf_counter() - started, 2))
    info = worker_pb2.ModelInfo(
        model=model_name(model_dir),
        num_blocks=num_blocks,
        block_size=block_size,
        dtype=DTYPE_NAMES[shard.dtype],
        device=str(torch_device),
        max_model_len=max_model_len,
        vocab_size=mc.vocab_size,
        num_layers=mc.num_layers,
        num_kv_heads=mc.num_kv_heads,
        head_dim=mc.head_dim,
        # the whole group's bytes per block
        block_bytes=shard.spec.block_bytes * (1 if group is None else group.size),
        eos_token_ids=list(generation.eos_token_ids),
    )
    return LoadedWorker(model_dir, generation, runner, info, group, ranks)


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
        tensor_parallel_size=config.tensor_parallel_size,
        threads=config.threads,
        on_rank_death=exit_on_rank_death,
        log_level=config.log_level,
        deterministic=config.deterministic,
    )
    log.info(
        "kv_cache_allocated",
        num_blocks=worker.info.num_blocks,
        block_size=worker.info.block_size,
        kv_cache_bytes=worker.kv_cache.num_bytes,
        max_model_len=worker.info.max_model_len,
        threads=torch.get_num_threads(),
        deterministic=worker.runner.ops.batch_invariant,
    )
    return worker
