"""The CUDA kernels' launches executed in PyTorch on the CPU, from the grid and the arguments CudaOps prepares.

Each function below follows its kernel in kernels/*.cu: which CTA computes what (from the grid and
blockIdx), which parameters it reads, and where it writes. So a launch prepared wrongly (a grid short of a
sequence's tiles, a stride in the wrong unit, tile offsets from a stale tensor, a split's range) gives wrong
results here too, and the CUDA glue is tested where no GPU is (tests/test_cuda_glue.py). The arithmetic
inside a CTA is the reference's (float32, exact softmax), not the kernels' order of sums: what is checked is
the launch, not the device code, which tests/test_kernels_cuda.py checks on a GPU.
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch

from pagedserve.kernels import cuda_ops
from pagedserve.kernels.cuda_ops import DevicePointers, Entry

_UNIT = re.compile(r"_u(\d+)$")
_SHAPE = re.compile(r"_d(\d+)_b(\d+)(?:_g(\d+))?$")


class EmulatedLauncher:
    """A cuda_ops.KernelLauncher that runs each launch in PyTorch on the tensors' own device (the CPU)."""

    def __init__(self, num_sms: int = 132) -> None:
        self.sms = num_sms
        self.launches: list[tuple[str, tuple[int, ...]]] = []  # (kernel name, grid) of every launch

    def prepare(self, device: torch.device) -> None:
        pass

    def num_sms(self, device: torch.device) -> int:
        return self.sms

    def launch(
        self,
        device: torch.device,
        entry: Entry,
        grid: tuple[int, ...],
        block: tuple[int, ...],
        args: tuple[Any, ...],
        shared_mem: int = 0,
    ) -> None:
        for a in args:
            if isinstance(a, torch.Tensor):
                assert a.device == device, f"{entry.name}: an argument on {a.device}, the launch on {device}"
        self.launches.append((entry.name, tuple(grid)))
        kind = entry.name.split("_")[0] + "_" + entry.name.split("_")[1]
        run = {
            "write_kv": _write_kv,
            "copy_blocks": _copy_blocks,
            "paged_decode": _decode,
            "merge_splits": _merge,
            "paged_prefill": _prefill,
        }[kind]
        run(entry, tuple(grid), args)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's storage as bytes, from its first element (as its data pointer addresses it)."""
    flat = torch.empty(0, dtype=torch.uint8, device=t.device)
    flat.set_(t.untyped_storage(), 0, (t.untyped_storage().nbytes(),))
    return flat[t.storage_offset() * t.element_size() :]


def _write_kv(entry: Entry, grid: tuple[int, ...], args: tuple[Any, ...]) -> None:
    # CTA t copies token t's K and V rows (row_units units of `unit` bytes) to cache slot slots[t], skipping
    # slots < 0; rows of key and value lie key_stride / value_stride units apart.
    key, value, k_cache, v_cache, slots, row_units, key_stride, value_stride = args
    unit = int(_UNIT.search(entry.name).group(1))
    row, k_step, v_step = int(row_units) * unit, int(key_stride) * unit, int(value_stride) * unit
    k_src, v_src, k_dst, v_dst = _bytes(key), _bytes(value), _bytes(k_cache), _bytes(v_cache)
    for t in range(grid[0]):
        slot = int(slots[t])
        if slot < 0:
            continue
        k_dst[slot * row : (slot + 1) * row] = k_src[t * k_step : t * k_step + row]
        v_dst[slot * row : (slot + 1) * row] = v_src[t * v_step : t * v_step + row]


def _copy_blocks(entry: Entry, grid: tuple[int, ...], args: tuple[Any, ...]) -> None:
    # CTA (i, c) copies block src[i] to dst[i] in cache c: the pairs of one launch are independent.
    pointers, src, dst, block_units = args
    assert isinstance(pointers, DevicePointers) and len(pointers.tensors) == grid[1]
    unit = int(_UNIT.search(entry.name).group(1))
    size = int(block_units) * unit
    assert len(set(dst.tolist())) == grid[0] and not set(src.tolist()) & set(dst.tolist()), "dependent pairs"
    for cache in pointers.tensors:
        data = _bytes(cache)
        for i in range(grid[0]):
            s, d = int(src[i]), int(dst[i])
            data[d * size : (d + 1) * size] = data[s * size : (s + 1) * size].clone()


def _attend(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of q [R, D] over keys / values [N, D] in float32: the output [R, D] and the
    log-sum-exp of the scaled scores [R] (-inf and zeros where N is 0)."""
    if keys.shape[0] == 0:
        return torch.zeros_like(q, dtype=torch.float32), torch.full((q.shape[0],), -math.inf)
    scores = (q.float() * scale) @ keys.float().T
    lse = torch.logsumexp(scores, dim=-1)
    return torch.softmax(scores, dim=-1) @ values.float(), lse


def _positions(cache: torch.Tensor, table: torch.Tensor, begin: int, end: int, kv_head: int) -> torch.Tensor:
    """Rows of positions begin..end-1 of a sequence (block table `table`) for one kv head: [N, D]."""
    block_size = cache.shape[1]
    pos = torch.arange(begin, end)
    blocks = table[(pos // block_size).long()].long()
    return cache[blocks, pos % block_size, kv_head]


def _decode(entry: Entry, grid: tuple[int, ...], args: tuple[Any, ...]) -> None:
    # CTA (x, b, split): kv head x // n_sub, its query heads from (x % n_sub) * GMAX, sequence b, and the
    # blocks split * blocks_per_split .. of its context; one split writes out, several write partials.
    out, part_out, part_lse, q, k_cache, v_cache, tables, lens, scale, hq, hkv, max_blocks, per_split = args
    d, bs, gmax = (int(g) for g in _SHAPE.search(entry.name).groups())
    assert q.shape[-1] == d and k_cache.shape[1] == bs and tables.shape[1] == int(max_blocks)
    group = int(hq) // int(hkv)
    n_sub = math.ceil(group / gmax)
    num_splits = grid[2]
    for x in range(grid[0]):
        kvh, sub = divmod(x, n_sub)
        heads = range(kvh * group + sub * gmax, kvh * group + min(group, (sub + 1) * gmax))
        for b in range(grid[1]):
            ctx = int(lens[b])
            for split in range(num_splits):
                begin = split * int(per_split) * bs
                end = min(ctx, (split + 1) * int(per_split) * bs)
                keys = _positions(k_cache, tables[b], begin, max(begin, end), kvh)
                values = _positions(v_cache, tables[b], begin, max(begin, end), kvh)
                o, lse = _attend(q[b, list(heads)], keys, values, float(scale))
                if num_splits == 1:
                    out[b, list(heads)] = o.to(out.dtype)
                else:
                    part_out[b, list(heads), split] = o
                    part_lse[b, list(heads), split] = lse


def _merge(entry: Entry, grid: tuple[int, ...], args: tuple[Any, ...]) -> None:
    # CTA r merges the splits of row r of out viewed as [B * Hq, D].
    out, part_out, part_lse, num_splits, head_size = args
    rows = out.view(-1, int(head_size))
    parts = part_out.view(-1, int(num_splits), int(head_size))
    lse = part_lse.view(-1, int(num_splits))
    assert grid[0] == rows.shape[0] == parts.shape[0]
    for r in range(grid[0]):
        if torch.isinf(lse[r]).all():
            rows[r] = 0
            continue
        weights = torch.softmax(lse[r], dim=0)
        rows[r] = (weights[:, None] * parts[r]).sum(0).to(out.dtype)


def _prefill(entry: Entry, grid: tuple[int, ...], args: tuple[Any, ...]) -> None:
    # CTA (tile, kvh): the sequence s whose tiles (tile_offsets) hold `tile`, its rows local_tile * ROWS ..,
    # a row r being token r // G, query head kvh * G + r % G; tiles past the last sequence's exit.
    out, q, k_cache, v_cache, tables, starts, lens, offsets, num_seqs, scale, hq, hkv, max_blocks = args
    rows_per_tile = cuda_ops.PREFILL_ROWS
    group = int(hq) // int(hkv)
    num_seqs = int(num_seqs)
    assert offsets.shape == (num_seqs + 1,) and grid[1] == int(hkv) and tables.shape[1] == int(max_blocks)
    assert grid[0] >= int(offsets[num_seqs]), f"{grid[0]} tiles launched for {int(offsets[num_seqs])}"
    for tile in range(grid[0]):
        if tile >= int(offsets[num_seqs]):
            continue
        s = max(i for i in range(num_seqs) if int(offsets[i]) <= tile)
        q_begin, q_len, ctx = int(starts[s]), int(starts[s + 1]) - int(starts[s]), int(lens[s])
        row0 = (tile - int(offsets[s])) * rows_per_tile
        for kvh in range(grid[1]):
            for r in range(row0, min(row0 + rows_per_tile, q_len * group)):
                token, head = r // group, kvh * group + r % group
                end = ctx - q_len + token + 1  # causal: up to its own position
                keys = _positions(k_cache, tables[s], 0, end, kvh)
                values = _positions(v_cache, tables[s], 0, end, kvh)
                o, _ = _attend(q[q_begin + token, head][None], keys, values, float(scale))
                out[q_begin + token, head] = o[0].to(out.dtype)
