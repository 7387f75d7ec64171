"""CUDA graphs for plain decode steps: a small batch's forward pass is about thirty kernel launches a layer,
and without a graph the Python that issues them sets the step's pace, not the GPU.

At start the worker captures one graph per batch size of `capture_sizes` (a forward pass plus the logits
over static input buffers); a plain decode step of n sequences then copies its inputs into the buffers of
the smallest captured size >= n, pads the rows past n (their keys and values are written nowhere, and
their outputs are dropped), and replays that graph. Steps with prompt tokens, and batches larger than the
largest size, run eagerly.

Capturing is a `GraphCapture`'s business: torch.cuda.CUDAGraph on a GPU. The tests capture with one that
runs the same closure again at each replay (EagerCapture), which checks everything but the CUDA driver:
the buffers, the padding, the bucket choice, and that the replayed step computes what the eager one does.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from pagedserve.worker_svc.model import AttentionMetadata, CausalLM
from pagedserve.worker_svc.step_inputs import StepInputs


def capture_sizes(max_batch: int) -> list[int]:
    """The batch sizes to capture for batches of up to max_batch sequences: vLLM's, 1, 2 and 4, then every
    8 (a batch pads to at most 7 rows more, which cost little against the step)."""
    sizes = [s for s in (1, 2, 4) if s <= max_batch]
    sizes += list(range(8, max_batch + 1, 8))
    if sizes[-1] < max_batch:
        sizes.append(max_batch)
    return sizes


class GraphCapture(Protocol):
    def capture(self, step: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        """Record `step` (which reads only static buffers) and return what replays it, answering the
        tensor the recorded step returned, refilled."""
        ...


class CudaGraphCapture:
    """torch.cuda.CUDAGraph, every graph in one memory pool (a step's temporaries are reused across sizes,
    captured largest first so that the smaller ones fit in what the largest took)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()

    def capture(self, step: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        # A first run outside the graph, on a side stream, does the one-time work capture must not see:
        # kernel compilation and loading, allocator growth, library workspaces.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = step()

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay


class EagerCapture:
    """Replays by running the step again over the same buffers: the graphs' logic without the driver."""

    def capture(self, step: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        return step


class DecodeGraphs:
    """The captured decode steps of one model over one KV pool, and their static input buffers."""

    def __init__(
        self,
        model: CausalLM,
        kv_layers: list[tuple[torch.Tensor, torch.Tensor]],
        sizes: Sequence[int],
        max_blocks: int,
        capture: GraphCapture,
    ) -> None:
        self.sizes = sorted(set(sizes))
        largest = self.sizes[-1]
        device = model.device
        longs = {"dtype": torch.int64, "device": device}
        ints = {"dtype": torch.int32, "device": device}
        self.input_ids = torch.zeros(largest, **longs)
        self.positions = torch.zeros(largest, **longs)
        self.slot_mapping = torch.full((largest,), -1, **longs)
        # Every row's table as wide as the longest sequence's may be: the kernels read a row's first
        # ceil(context / block_size) entries alone, so what lies past them is never followed.
        self.block_tables = torch.zeros(largest, max_blocks, **ints)
        self.query_start_loc = torch.arange(largest + 1, **ints)
        self.context_lens = torch.ones(largest, **ints)
        self._replays: dict[int, Callable[[], torch.Tensor]] = {}
        for size in reversed(self.sizes):
            self._replays[size] = capture.capture(self._step(model, kv_layers, size))

    def _step(
        self, model: CausalLM, kv_layers: list[tuple[torch.Tensor, torch.Tensor]], size: int
    ) -> Callable[[], torch.Tensor]:
        attn = AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            block_tables=self.block_tables[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            context_lens=self.context_lens[:size],
            max_query_len=1,
        )
        ids, positions = self.input_ids[:size], self.positions[:size]

        def step() -> torch.Tensor:
            return model.compute_logits(model(ids, positions, attn, kv_layers))

        return step

    def size_for(self, batch: int) -> int | None:
        """The smallest captured size that holds `batch` rows, or None (the step runs eagerly)."""
        i = bisect.bisect_left(self.sizes, batch)
        return self.sizes[i] if i < len(self.sizes) else None

    def run(self, inputs: StepInputs) -> torch.Tensor | None:
        """The logits [n, vocab] of a plain decode step of n rows (one token per sequence) by replaying its
        size's graph; None where no captured size holds it, or its tables are wider than the buffers."""
        n = inputs.input_ids.shape[0]
        size = self.size_for(n)
        width = inputs.attn.block_tables.shape[1]
        if size is None or width > self.block_tables.shape[1]:
            return None
        self.input_ids[:n].copy_(inputs.input_ids, non_blocking=True)
        self.positions[:n].copy_(inputs.positions, non_blocking=True)
        self.slot_mapping[:n].copy_(inputs.attn.slot_mapping, non_blocking=True)
        self.block_tables[:n, :width].copy_(inputs.attn.block_tables, non_blocking=True)
        self.context_lens[:n].copy_(inputs.attn.context_lens, non_blocking=True)
        # Padding rows: written nowhere (slot -1), one position of context, their logits dropped.
        self.slot_mapping[n:size].fill_(-1)
        self.context_lens[n:size].fill_(1)
        return self._replays[size]()[:n]
