"""Tensor parallelism: one worker as a group of N processes (ranks) over torch.distributed, gloo on the CPU
and NCCL on CUDA, each holding a 1/N shard of every layer (Megatron-style).

- q/k/v, gate and up are column-parallel: each rank computes its own query heads, kv heads and
  intermediate columns, with no communication. o and down are row-parallel: each rank's partial product
  is summed over the group (one all-reduce after each, two per layer), the bias added on rank 0 alone.
- The embedding and the LM head are vocab-parallel: each rank holds ceil(V / N) rows (the last padded
  with zeros); a token's embedding comes from the rank that holds its row (the others add zeros, one
  all-reduce), and the logits' shards are gathered on rank 0.
- KV heads are split across the ranks; with fewer kv heads than ranks, each is replicated on N / Hkv
  ranks (rank r keeps kv head r * Hkv // N, the one its query heads read). Each rank holds its share of
  the KV pool: every rank has the same blocks, each with its own kv heads in them.

The scheduler sees one worker: rank 0 runs the gRPC server and the ModelRunner. Each forward pass's
inputs (and each block copy) go from rank 0 to the others as one broadcast of a small header and one of
the packed inputs (`StepBroadcast`); the other ranks (`follow`) run the same forward on their shards, and
only rank 0 samples. A rank that dies takes its group down: rank 0 exits (the scheduler requeues its
requests; `pagedserve serve` restarts it), the others die with it.

All ranks run on one machine: rank 0 starts the others (`start_group`) and they meet on a loopback port.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pagedserve.logging import get_logger
from pagedserve.worker_svc.model import AttentionMetadata, CausalLM, ModelConfig

log = get_logger("pagedserve.worker")

# An idle rank waits for the next step in a collective: it must not time out between requests. A rank
# that dies is noticed through its process (rank 0 watches the others; they die with rank 0) and through
# its closed connections, not through this timeout.
COLLECTIVE_TIMEOUT = datetime.timedelta(days=365)
# Seconds the ranks have to meet at start (each loads the model after they met).
RENDEZVOUS_TIMEOUT_S = 300.0
# The exit code of rank 0 when another rank of its group died.
EXIT_RANK_DIED = 3


def check_tensor_parallel(config: ModelConfig, size: int) -> None:
    """Refuse, with what to change, a group size the model's shape cannot be split into."""
    if size < 1:
        raise ValueError(f"--tensor-parallel-size must be at least 1, not {size}")
    if size == 1:
        return
    problems = []
    if config.num_heads % size:
        problems.append(f"its {config.num_heads} query heads")
    kv = config.num_kv_heads
    if kv % size and size % kv:
        problems.append(f"its {kv} kv heads (nor is it a multiple of them, to replicate them)")
    if config.intermediate_size % size:
        problems.append(f"its intermediate size {config.intermediate_size}")
    if problems:
        sizes = [n for n in range(2, config.num_heads + 1) if _divides(config, n)]
        hint = f"sizes this model allows: {', '.join(map(str, sizes))}" if sizes else "this model allows none"
        raise ValueError(
            f"--tensor-parallel-size {size} does not divide {' nor '.join(problems)} "
            f"({config.model_type}: {config.num_heads} query heads, {kv} kv heads, intermediate size "
            f"{config.intermediate_size}); {hint}"
        )


def _divides(config: ModelConfig, n: int) -> bool:
    kv = config.num_kv_heads
    return config.num_heads % n == 0 and (kv % n == 0 or n % kv == 0) and config.intermediate_size % n == 0


def shard_config(config: ModelConfig, size: int) -> ModelConfig:
    """The shape of one rank's layers: its query heads, kv heads and intermediate columns (the vocabulary
    stays whole: the model's config names the full vocabulary, its embedding module holds the shard)."""
    return replace(
        config,
        num_heads=config.num_heads // size,
        num_kv_heads=max(1, config.num_kv_heads // size),
        intermediate_size=config.intermediate_size // size,
    )


@dataclass(slots=True)
class ParallelGroup:
    """This process's place in its tensor-parallel group, and the group's collectives."""

    rank: int  # 0 runs the runner and samples; the others follow
    size: int  # ranks in the group
    device: torch.device  # this rank's device (cuda:base+rank on CUDA)
    vocab_size: int = 0  # the model's full vocabulary (set by parallelize)

    @property
    def backend(self) -> str:
        return "nccl" if self.device.type == "cuda" else "gloo"

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks, in place."""
        dist.all_reduce(x)
        return x

    def gather_logits(self, local: torch.Tensor) -> torch.Tensor | None:
        """Rank 0: the full logits [R, V] from every rank's shard [R, V / N]; the others: None."""
        if local.shape[0] == 0:  # every rank has the same rows: none of them sends anything
            return local.new_empty((0, self.vocab_size)) if self.rank == 0 else None
        local = local.contiguous()
        if self.rank != 0:
            dist.gather(local, None, dst=0)
            return None
        shards = [torch.empty_like(local) for _ in range(self.size)]
        dist.gather(local, shards, dst=0)
        logits = torch.cat(shards, dim=1)
        return logits if logits.shape[1] == self.vocab_size else logits[:, : self.vocab_size].contiguous()

    def min(self, value: int) -> int:
        """The smallest of the ranks' values (each rank's KV pool must have the same block count)."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    # ---- the weights --------------------------------------------------------------------------------

    def vocab_rows(self) -> tuple[int, int]:
        """The first vocabulary row this rank holds and the shard's row count (the same on every rank)."""
        per_rank = -(-self.vocab_size // self.size)
        return self.rank * per_rank, per_rank

    def kv_heads(self, config: ModelConfig) -> tuple[int, int]:
        """The first kv head this rank holds, and how many (one, replicated, when there are fewer than
        ranks)."""
        kv = config.num_kv_heads
        if kv >= self.size:
            return self.rank * (kv // self.size), kv // self.size
        return self.rank * kv // self.size, 1

    def shard(self, config: ModelConfig, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of the checkpoint tensor `name` (HF names without `model.`) of the full model
        `config`: rows for column-parallel weights and the vocabulary, columns for row-parallel ones; the
        row-parallel biases on rank 0 alone (zeros elsewhere: the all-reduce adds them once)."""
        parts = name.split(".")
        proj = parts[-2] if len(parts) >= 2 else ""
        is_bias = parts[-1] == "bias"
        d, r, n = config.head_dim, self.rank, self.size
        if name in ("embed_tokens.weight", "lm_head.weight"):
            start, rows = self.vocab_rows()
            out = tensor.new_zeros((rows, tensor.shape[1]))
            piece = tensor[start : start + rows]
            out[: piece.shape[0]] = piece
            return out
        if proj == "q_proj":
            heads = config.num_heads // n
            return tensor.narrow(0, r * heads * d, heads * d)
        if proj in ("k_proj", "v_proj"):
            first, heads = self.kv_heads(config)
            return tensor.narrow(0, first * d, heads * d)
        if proj in ("gate_proj", "up_proj"):
            cols = config.intermediate_size // n
            return tensor.narrow(0, r * cols, cols)
        if proj in ("o_proj", "down_proj"):
            if is_bias:
                return tensor if r == 0 else torch.zeros_like(tensor)
            width = config.q_size if proj == "o_proj" else config.intermediate_size
            cols = width // n
            return tensor.narrow(1, r * cols, cols)
        return tensor  # norms: every rank holds them whole

    def parallelize(self, model: CausalLM, full: ModelConfig) -> None:
        """Make a model built with shard_config's shape a shard of `full`: a vocab-parallel embedding and
        LM head, the row-parallel outputs summed, the logits gathered (before its weights load)."""
        self.vocab_size = full.vocab_size
        start, rows = self.vocab_rows()
        model.embed_tokens = VocabParallelEmbedding(
            start, rows, full.hidden_size, model.dtype, model.device, self
        )
        if model.lm_head is not None:
            model.lm_head = torch.nn.utils.skip_init(
                nn.Linear, full.hidden_size, rows, bias=False, dtype=model.dtype, device=model.device
            )
        for layer in model.layers:
            layer.self_attn.all_reduce = self.all_reduce
            layer.mlp.all_reduce = self.all_reduce
        model.gather_logits = self.gather_logits


class VocabParallelEmbedding(nn.Module):
    """Rows start..start+rows of the embedding (zero past the vocabulary); a token's row comes from the rank
    that holds it, the others add zeros."""

    def __init__(
        self,
        start: int,
        rows: int,
        hidden: int,
        dtype: torch.dtype,
        device: torch.device,
        group: ParallelGroup,
    ) -> None:
        super().__init__()
        self.start, self.rows, self.group = start, rows, group
        self.weight = nn.Parameter(torch.empty(rows, hidden, dtype=dtype, device=device), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.rows)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        x.masked_fill_(outside.unsqueeze(1), 0)
        return self.group.all_reduce(x)


class RankFailedError(RuntimeError):
    """A collective of rank 0's group failed: another rank died or failed, and the group cannot go on."""


# ---- the step inputs, from rank 0 to the others --------------------------------------------------------

_FORWARD, _COPY, _STOP = 1, 2, 3
_HEADER = 8  # int64 words: kind, then the sizes below


class StepBroadcast:
    """Rank 0 sends each forward pass's inputs (and each block copy) to the other ranks as two tensor
    broadcasts: a header of sizes, then every input packed into one int64 tensor.

    NOTE: the inputs are a few small integer tensors; a pickle of them (broadcast_object_list) costs two
    broadcasts as well plus the pickling on both sides (bench/bench_tp.py compares them)."""

    def __init__(self, group: ParallelGroup) -> None:
        self.group = group
        self.device = group.device

    def _send(self, header: list[int], parts: list[torch.Tensor]) -> None:
        head = torch.tensor(header + [0] * (_HEADER - len(header)), dtype=torch.int64, device=self.device)
        dist.broadcast(head, src=0)
        if parts:
            payload = torch.cat([p.reshape(-1).to(self.device, torch.int64) for p in parts])
            dist.broadcast(payload, src=0)

    def send_forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        output_rows: torch.Tensor | None,
    ) -> None:
        t, (s, b) = input_ids.shape[0], attn.block_tables.shape
        rows = -1 if output_rows is None else output_rows.shape[0]
        parts = [input_ids, positions, attn.slot_mapping, attn.block_tables, attn.query_start_loc]
        parts.append(attn.context_lens)
        if output_rows is not None:
            parts.append(output_rows)
        self._send([_FORWARD, t, s, b, rows, attn.max_query_len], parts)

    def send_copies(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self._send([_COPY, src.shape[0]], [src, dst])

    def send_stop(self) -> None:
        self._send([_STOP], [])

    def receive(self) -> tuple[int, tuple]:
        """The next message: (_FORWARD, (input_ids, positions, attn, output_rows)), (_COPY, (src, dst)) or
        (_STOP, ())."""
        head = torch.empty(_HEADER, dtype=torch.int64, device=self.device)
        dist.broadcast(head, src=0)
        kind, *sizes = head.tolist()
        if kind == _STOP:
            return kind, ()
        if kind == _COPY:
            n = sizes[0]
            payload = torch.empty(2 * n, dtype=torch.int64, device=self.device)
            dist.broadcast(payload, src=0)
            return kind, (payload[:n], payload[n:])
        assert kind == _FORWARD, kind
        t, s, b, rows, max_query_len = sizes[:5]
        lengths = [t, t, t, s * b, s + 1, s, max(rows, 0)]
        payload = torch.empty(sum(lengths), dtype=torch.int64, device=self.device)
        dist.broadcast(payload, src=0)
        ids, positions, slots, tables, starts, lens, out_rows = payload.split(lengths)
        i32 = torch.int32
        attn = AttentionMetadata(
            slot_mapping=slots,
            block_tables=tables.view(s, b).to(i32),
            query_start_loc=starts.to(i32),
            context_lens=lens.to(i32),
            max_query_len=max_query_len,
        )
        return kind, (ids, positions, attn, None if rows < 0 else out_rows)


class LeaderModel:
    """Rank 0's model, as the runner sees it: each forward pass's inputs go to the other ranks first, then
    it runs on this rank's shard; compute_logits returns the gathered full logits. Its ops send each block
    copy to the others too."""

    def __init__(self, model: CausalLM, group: ParallelGroup, config: ModelConfig) -> None:
        """config: the full model's (what the runner and the engine read: the vocabulary)."""
        assert group.rank == 0
        self.model = model
        self.config, self.dtype, self.device = config, model.dtype, model.device
        self.broadcast = StepBroadcast(group)
        self.ops = _LeaderOps(model.ops, self.broadcast)
        self.group = group

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        output_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        with self._group_failure():
            self.broadcast.send_forward(input_ids, positions, attn, output_rows)
            return self.model(input_ids, positions, attn, kv_caches, output_rows)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        with self._group_failure():
            return self.model.compute_logits(hidden)

    @contextlib.contextmanager
    def _group_failure(self):
        try:
            yield
        except RuntimeError as error:  # gloo and NCCL raise a RuntimeError (DistBackendError) for a lost peer
            raise RankFailedError(
                f"tensor-parallel group of {self.group.size}: a collective failed, another rank is gone "
                f"or failed ({error})"
            ) from error


class _LeaderOps:
    """The model's ops, but copy_blocks, which every rank applies to its own share of the pool."""

    def __init__(self, ops, broadcast: StepBroadcast) -> None:
        self._ops, self._broadcast = ops, broadcast

    def copy_blocks(self, k_caches, v_caches, src: torch.Tensor, dst: torch.Tensor) -> None:
        self._broadcast.send_copies(src, dst)
        self._ops.copy_blocks(k_caches, v_caches, src, dst)

    def __getattr__(self, name: str):
        return getattr(self._ops, name)


def follow(model: CausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], group: ParallelGroup) -> None:
    """A rank other than 0: run every forward pass and block copy rank 0 sends, until it says stop."""
    receiver = StepBroadcast(group)
    k_caches = [k for k, _ in kv_caches]
    v_caches = [v for _, v in kv_caches]
    with torch.inference_mode():
        while True:
            kind, args = receiver.receive()
            if kind == _STOP:
                return
            if kind == _COPY:
                model.ops.copy_blocks(k_caches, v_caches, *args)
                continue
            input_ids, positions, attn, output_rows = args
            hidden = model(input_ids, positions, attn, kv_caches, output_rows)
            model.compute_logits(hidden)  # this rank's shard goes to rank 0


# ---- the processes ---------------------------------------------------------------------------------------


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r's device: the r-th GPU from the one named (cuda:k -> cuda:k+r); the CPU for every rank."""
    if device.type != "cuda":
        return device
    index = (device.index or 0) + rank
    if index >= torch.cuda.device_count():
        raise ValueError(
            f"tensor parallel rank {rank} needs cuda:{index}, but {torch.cuda.device_count()} GPU(s) are visible"
        )
    return torch.device("cuda", index)


def default_threads(size: int) -> int:
    """Each rank's torch threads when none are given: the cores this process may use, shared out (N ranks
    with one thread per core each would start N threads per core, see launcher.worker_threads)."""
    return max(1, len(os.sched_getaffinity(0)) // size)


class RankProcesses:
    """The ranks rank 0 started, and the thread that watches them: a rank that dies while the group runs
    calls on_death (the worker server exits, failing its group; an in-process engine's next step fails)."""

    def __init__(
        self, processes: list[subprocess.Popen], on_death: Callable[[int, int], None] | None
    ) -> None:
        self.processes = processes
        self.closing = threading.Event()
        self._on_death = on_death
        for rank, process in enumerate(processes, start=1):
            threading.Thread(
                target=self._watch, args=(rank, process), name=f"tp-rank-{rank}", daemon=True
            ).start()
        atexit.register(self.kill)

    def _watch(self, rank: int, process: subprocess.Popen) -> None:
        code = process.wait()
        if self.closing.is_set():
            return
        log.error("tensor_parallel_rank_died", rank=rank, pid=process.pid, code=code)
        if self._on_death is not None:
            self._on_death(rank, code)

    def kill(self) -> None:
        self.closing.set()
        for process in self.processes:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
        for process in self.processes:
            with contextlib.suppress(Exception):
                process.wait(timeout=10)


def exit_on_rank_death(rank: int, code: int) -> None:
    """The worker server's reaction to a dead rank: the whole process goes, at once (its compute thread may
    be inside a collective that will never complete); the scheduler requeues its requests and the
    supervisor starts the group again."""
    sys.stderr.flush()
    os._exit(EXIT_RANK_DIED)


def _follower_preexec() -> None:
    # NOTE: in rank 0's process group, so that whoever stops the worker's group stops every rank; SIGKILL
    # when rank 0's thread that started it ends, which is as long as rank 0 lives or less.
    if sys.platform == "linux":
        import ctypes

        with contextlib.suppress(Exception):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def start_group(
    size: int,
    device: torch.device,
    shard_args: dict,
    on_death: Callable[[int, int], None] | None = None,
) -> tuple[ParallelGroup, RankProcesses]:
    """As rank 0: start ranks 1..size-1 (each loads its shard through `assembly.load_shard(**shard_args)`),
    and join them in the group on a free loopback port."""
    from pagedserve.launcher import free_port, python_command

    address = f"tcp://127.0.0.1:{free_port()}"
    processes = []
    for rank in range(1, size):
        command = python_command(
            "-m",
            "pagedserve.worker_svc.parallel",
            "--rank",
            str(rank),
            "--size",
            str(size),
            "--init",
            address,
            "--shard",
            json.dumps(shard_args),
        )
        processes.append(subprocess.Popen(command, preexec_fn=_follower_preexec))
    ranks = RankProcesses(processes, on_death)
    try:
        group = join_group(0, size, address, device)
    except BaseException:
        ranks.kill()
        raise
    log.info("tensor_parallel_group", size=size, backend=group.backend, pids=[p.pid for p in processes])
    return group, ranks


def join_group(rank: int, size: int, address: str, device: torch.device) -> ParallelGroup:
    group = ParallelGroup(rank, size, rank_device(device, rank))
    if group.device.type == "cuda":
        torch.cuda.set_device(group.device)
    kwargs = {"device_id": group.device} if group.device.type == "cuda" else {}
    store = dist.TCPStore(
        address.removeprefix("tcp://").rsplit(":", 1)[0],
        int(address.rsplit(":", 1)[1]),
        size,
        is_master=rank == 0,
        timeout=datetime.timedelta(seconds=RENDEZVOUS_TIMEOUT_S),
    )
    dist.init_process_group(
        group.backend, store=store, rank=rank, world_size=size, timeout=COLLECTIVE_TIMEOUT, **kwargs
    )
    return group


def stop_group(group: ParallelGroup, ranks: RankProcesses) -> None:
    """As rank 0, on the thread that runs the steps: the other ranks leave their loops and exit."""
    ranks.closing.set()
    with contextlib.suppress(Exception):
        StepBroadcast(group).send_stop()
    for process in ranks.processes:
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=30)
    ranks.kill()
    with contextlib.suppress(Exception):
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    """A rank other than 0 (started by start_group): join, load its shard, follow rank 0 until it stops."""
    import argparse

    from pagedserve.logging import configure_logging
    from pagedserve.worker_svc.assembly import load_shard

    parser = argparse.ArgumentParser(prog="pagedserve tensor-parallel rank")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--size", type=int, required=True)
    parser.add_argument("--init", required=True)
    parser.add_argument("--shard", required=True, help="load_shard's arguments as JSON")
    args = parser.parse_args(argv)
    shard_args = json.loads(args.shard)
    configure_logging(f"worker-rank{args.rank}", shard_args.pop("log_level", "info"))
    # NOTE: rank 0 drains on SIGTERM and Ctrl-C while this rank still computes its steps; this rank ends
    # when rank 0 says stop, or dies with it.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(shard_args.pop("threads"))
    group = join_group(args.rank, args.size, args.init, torch.device(shard_args["device"]))
    try:
        shard = load_shard(group=group, **shard_args)
        follow(shard.model, shard.kv_cache.layers, group)
    except Exception as error:  # rank 0 went away (its connections closed), or this rank failed
        log.error("tensor_parallel_rank_failed", rank=args.rank, error=repr(error))
        return 1
    with contextlib.suppress(Exception):
        dist.destroy_process_group()
    return 0


__all__ = [
    "LeaderModel",
    "ParallelGroup",
    "StepBroadcast",
    "check_tensor_parallel",
    "follow",
    "shard_config",
    "start_group",
    "stop_group",
]

if __name__ == "__main__":
    sys.exit(main())
