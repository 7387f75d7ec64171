"""The runner's per-slot token ids and block tables, a step's model inputs built from them, and the sampled
tokens written back into them: one implementation for plain decode steps and any other step alike.

A live request's token ids and block table are rows of two numpy arrays indexed by slot, which grow by
doubling when a larger slot or a longer sequence shows up, so the common case costs no allocation. A step
takes a few gathers from them instead of per-token loops: in C++ (csrc/step_inputs.cpp, built on first use
through the kernels' build helper) where it builds, else in numpy, the same values either way. The C++ is
kept because numpy's dozen calls cost measurably more between two forward passes (docs/performance.md,
"The step's inputs").

    python -m pagedserve.worker_svc.step_inputs   # build the C++ now (`make install` does)
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import numpy as np
import torch

from pagedserve.worker_svc.model import AttentionMetadata

SOURCE = Path(__file__).resolve().parent / "csrc" / "step_inputs.cpp"
CFLAGS = ["-O3"]


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor  # int64 [T]: the token each row computes
    positions: torch.Tensor  # int64 [T]: each row's position in its sequence
    attn: AttentionMetadata  # where the rows' K and V go, and what each sequence attends to


class SlotArrays:
    """Token ids and block tables by slot (rows of numpy arrays the runner fills from its plans).
    native=False: numpy even where the C++ builds."""

    def __init__(
        self, max_model_len: int, block_size: int, device: torch.device, native: bool = True
    ) -> None:
        self.block_size = block_size
        self.device = device  # where the inputs go, and where sampled tokens come from
        self._native = native_step_inputs() if native else None
        # The C++ reads the tokens where they are: on the CPU.
        self._native_append = self._native.append_tokens_ if self._native and device.type == "cpu" else None
        # int64 [rows, tokens]: a slot's prompt and sampled tokens, token_ids[slot, :num_tokens]
        self.token_ids = np.zeros((8, min(max_model_len + 1, 1024)), dtype=np.int64)
        # int32 [rows, blocks]: a slot's physical block ids, block_tables[slot, :num_blocks]
        self.block_tables = np.zeros((8, min(-(-max_model_len // block_size), 64)), dtype=np.int32)

    # The C++ reads and writes the arrays through tensors that share their memory, made again with them.

    @property
    def token_ids(self) -> np.ndarray:
        return self._token_ids

    @token_ids.setter
    def token_ids(self, array: np.ndarray) -> None:
        self._token_ids, self._token_ids_shared = array, torch.from_numpy(array)

    @property
    def block_tables(self) -> np.ndarray:
        return self._block_tables

    @block_tables.setter
    def block_tables(self, array: np.ndarray) -> None:
        self._block_tables, self._block_tables_shared = array, torch.from_numpy(array)

    @property
    def native(self) -> bool:
        """Whether the C++ builds the inputs and writes the tokens."""
        return self._native is not None

    def reserve(self, slot: int, num_tokens: int, num_blocks: int) -> None:
        """Room for a row `slot` with num_tokens token ids and num_blocks block ids."""
        rows, cols = self.token_ids.shape
        if slot >= rows or num_tokens > cols:
            grown = np.zeros((_grow(rows, slot + 1), _grow(cols, num_tokens)), dtype=np.int64)
            grown[:rows, :cols] = self.token_ids
            self.token_ids = grown
        rows, cols = self.block_tables.shape
        if slot >= rows or num_blocks > cols:
            grown = np.zeros((_grow(rows, slot + 1), _grow(cols, num_blocks)), dtype=np.int32)
            grown[:rows, :cols] = self.block_tables
            self.block_tables = grown

    def inputs(
        self, slots: Sequence[int], start: Sequence[int], num_scheduled: Sequence[int] | None
    ) -> StepInputs:
        """The model's inputs for a step in which sequence i (slot slots[i]) computes num_scheduled[i]
        tokens from position start[i] on (None: one token each, a decode step), in that order."""
        device = self.device
        if self._native is not None:
            ids, positions, *meta = self._native.step_inputs(
                self._token_ids_shared,
                self._block_tables_shared,
                slots,
                start,
                num_scheduled or [],
                self.block_size,
            )
            if device.type != "cpu":
                ids, positions, *meta = (t.to(device, non_blocking=True) for t in (ids, positions, *meta))
            max_query_len = 1 if num_scheduled is None else max(num_scheduled)
            return StepInputs(ids, positions, AttentionMetadata(*meta, max_query_len=max_query_len))
        n = len(slots)
        slot_ids = np.array(slots, dtype=np.int64)
        starts = np.array(start, dtype=np.int64)
        if num_scheduled is None:  # each sequence's one token at its next position
            counts = None
            query_start_loc = np.arange(n + 1, dtype=np.int32)
            positions, slot_of_token = starts, slot_ids
            context_lens = np.add(starts, 1, dtype=np.int32)
            max_query_len = 1
        else:
            counts = np.array(num_scheduled, dtype=np.int64)
            # np.add.accumulate, not np.cumsum, whose Python wrapper is one more cold call
            query_start_loc = np.zeros(n + 1, dtype=np.int32)
            np.add.accumulate(counts, out=query_start_loc[1:], dtype=np.int32)
            seq_of_token = np.repeat(np.arange(n), counts)
            positions = starts[seq_of_token] + (np.arange(len(seq_of_token)) - query_start_loc[seq_of_token])
            slot_of_token = slot_ids[seq_of_token]
            context_lens = np.add(starts, counts, dtype=np.int32)
            max_query_len = int(counts.max())
        # Each array made in its tensor's dtype, in as few numpy calls as it takes.
        input_ids = self.token_ids[slot_of_token, positions]
        index, offset = np.divmod(positions, self.block_size)
        slot_mapping = np.multiply(self.block_tables[slot_of_token, index], self.block_size, dtype=np.int64)
        slot_mapping += offset
        max_blocks = -(-int(context_lens.max()) // self.block_size)
        block_tables = self.block_tables[slot_ids, :max_blocks]
        attn = AttentionMetadata(
            slot_mapping=as_tensor(slot_mapping, device),
            block_tables=as_tensor(block_tables, device),
            query_start_loc=as_tensor(query_start_loc, device),
            context_lens=as_tensor(context_lens, device),
            max_query_len=max_query_len,
        )
        return StepInputs(as_tensor(input_ids, device), as_tensor(positions, device), attn)

    def append(self, slots: Sequence[int], positions: Sequence[int], tokens: torch.Tensor) -> list[int]:
        """Each slot's sampled token (tokens int64 [S], on any device) written at its position, growing the
        rows where they end there; returns the tokens as a list."""
        last = max(positions, default=-1)
        if last >= self._token_ids.shape[1]:
            self.reserve(0, last + 1, 0)
        if self._native_append is not None:
            return self._native_append(self._token_ids_shared, slots, positions, tokens)
        sampled = tokens.tolist()
        token_ids = self._token_ids
        for slot, position, token in zip(slots, positions, sampled, strict=True):
            token_ids[slot, position] = token
        return sampled


@functools.cache
def native_step_inputs() -> ModuleType | None:
    """The C++ implementation, built on the first call on this machine; None where it cannot be built (no
    compiler), which is logged once: SlotArrays then takes numpy."""
    from pagedserve.kernels.build import load_extension
    from pagedserve.logging import get_logger

    try:
        return load_extension("pagedserve_step_inputs", [SOURCE], CFLAGS)
    except Exception as exc:  # no C++ compiler or ninja, a build error
        get_logger(__name__).warning("native_step_inputs_unavailable", error=repr(exc), fallback="numpy")
        return None


def as_tensor(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """An integer array, made in its tensor's dtype, as a tensor on `device` (on the CPU the array's own
    memory): a torch .to(), even one that changes nothing, costs a dispatch."""
    tensor = torch.from_numpy(array)
    return tensor if device.type == "cpu" else tensor.to(device, non_blocking=True)


def _grow(current: int, needed: int) -> int:
    while current < needed:
        current *= 2
    return current


if __name__ == "__main__":
    # `python -m pagedserve.worker_svc.step_inputs`: build (or find) the C++ for this machine.
    from pagedserve.logging import configure_logging

    configure_logging("worker", json=False)
    native = native_step_inputs()
    print(
        f"step inputs: {'C++ ' + native.__file__ if native is not None else 'numpy (the C++ did not build)'}"
    )
