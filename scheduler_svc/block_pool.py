"""Physical KV blocks of one worker: reference counts and the order free blocks are handed out.

A block is in exactly one of three states:
  - free:   reference count 0, holds nothing worth keeping; in `_free`, least recently freed first;
  - cached: reference count 0, but the prefix cache keeps its content (the evictor owns it);
  - in use: reference count > 0 (held by that many block table entries).
Free blocks are handed out first; only when none is left does the evictor give up a cached block
(least recently used leaf first), so cached content is reused last.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Protocol


class Evictor(Protocol):
    """What the pool needs from the prefix cache (see prefix_cache.PrefixCache)."""

    # Cached blocks no block table holds: each can be evicted and handed out.
    num_evictable: int

    def is_cached(self, block_id: int) -> bool: ...

    def on_referenced(self, block_id: int) -> None: ...

    def on_unreferenced(self, block_id: int) -> None: ...

    def evict(self) -> int: ...


class BlockPool:
    def __init__(self, num_blocks: int, evictor: Evictor | None = None) -> None:
        self.num_blocks = num_blocks
        self.evictor = evictor
        # Number of block table entries holding each block.
        self.ref_counts = [0] * num_blocks
        # Free uncached blocks, least recently freed first (so fresh blocks come in id order).
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        """Blocks allocate() can hand out now: free ones plus evictable cached ones."""
        return len(self._free) + (self.evictor.num_evictable if self.evictor else 0)

    @property
    def num_uncached_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        """Blocks with a reference count above zero."""
        return self.num_blocks - self.num_free_blocks

    def allocate(self, n: int) -> list[int]:
        assert n <= self.num_free_blocks, f"asked for {n} blocks, {self.num_free_blocks} free"
        blocks = []
        for _ in range(n):
            block = self._free.popleft() if self._free else self.evictor.evict()
            assert self.ref_counts[block] == 0
            self.ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def incref(self, blocks: Iterable[int]) -> None:
        """Another table holds these blocks (a fork, or a prefix-cache hit)."""
        refs = self.ref_counts
        for block in blocks:
            if refs[block] == 0:
                # NOTE: only cached blocks are reachable while unreferenced (through the trie).
                assert self.evictor is not None and self.evictor.is_cached(block)
                self.evictor.on_referenced(block)
            refs[block] += 1

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference to each block, in the given order (callers pass tail blocks first,
        so that among equally old cached blocks the tails are evicted first)."""
        refs = self.ref_counts
        for block in blocks:
            assert refs[block] > 0, f"block {block} freed while unreferenced"
            refs[block] -= 1
            if refs[block] == 0:
                if self.evictor is not None and self.evictor.is_cached(block):
                    self.evictor.on_unreferenced(block)
                else:
                    self._free.append(block)

    def reclaim(self, blocks: Iterable[int]) -> None:
        """Cached blocks the prefix cache let go of (none referenced) become plain free blocks."""
        for block in blocks:
            assert self.ref_counts[block] == 0 and not self.evictor.is_cached(block)
            self._free.append(block)

    def evict_all(self) -> int:
        """Evict every evictable cached block into the free list; return how many."""
        n = 0
        while self.evictor is not None and self.evictor.num_evictable:
            self._free.append(self.evictor.evict())
            n += 1
        return n

    def free_block_ids(self) -> list[int]:
        """The uncached free blocks, in hand-out order (for tests and invariant checks)."""
        return list(self._free)
