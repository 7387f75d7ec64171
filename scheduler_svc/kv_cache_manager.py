"""Block tables of one worker's requests over its block pool and prefix cache.

Invariant (checked by the property tests): len(req.block_table) == ceil(req.num_computed_tokens /
block_size), where num_computed_tokens counts tokens of plans already built, executed or not; and
the pool's reference count of a block equals the number of block table entries holding it (the
trie holds blocks without counting).
"""

from __future__ import annotations

from dataclasses import dataclass

from .block_pool import BlockPool
from .config import SchedulerConfig
from .prefix_cache import CacheNode, PrefixCache
from .request import Request


@dataclass(slots=True)
class CowCopy:
    # The request whose block table entry is replaced.
    request: Request
    # Index of the entry in its block table.
    block_index: int
    # The shared block whose K/V are copied.
    src_block: int
    # The fresh block that receives them and replaces the entry.
    dst_block: int


class KVCacheManager:
    def __init__(self, config: SchedulerConfig) -> None:
        self.block_size = config.block_size
        self.cache = (
            PrefixCache(config.num_blocks, config.block_size) if config.enable_prefix_caching else None
        )
        self.pool = BlockPool(config.num_blocks, self.cache)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def lookup(self, req: Request) -> list[CacheNode]:
        """Cached blocks for req's leading tokens; never covers its last token (which must be
        computed to sample). None for a request that scores its prompt (prompt logprobs): like
        vLLM, it computes every prompt position. No side effect."""
        if self.cache is None or req.wants_prompt_logprobs:
            return []
        return self.cache.match(req.cache_salt, req.token_ids, (len(req.token_ids) - 1) // self.block_size)

    def blocks_to_admit(self, hits: list[CacheNode], num_new_tokens: int) -> int:
        """Free blocks that admitting with these hits and tokens takes (hit blocks nobody holds
        count: they stop being evictable)."""
        bs = self.block_size
        new = -(-(len(hits) * bs + num_new_tokens) // bs) - len(hits)
        return new + sum(1 for node in hits if not node.referenced)

    def admit(self, req: Request, hits: list[CacheNode]) -> None:
        """Take the hit blocks into req's (empty) table; the caller then allocate_slots()."""
        assert not req.block_table and req.num_computed_tokens == 0
        req.block_table = [node.block_id for node in hits]
        self.pool.incref(req.block_table)
        req.num_computed_tokens = len(hits) * self.block_size
        req.num_cached_blocks = len(hits)
        if self.cache is not None:
            req.cache_node = hits[-1] if hits else self.cache.root(req.cache_salt)

    def allocate_slots(self, req: Request, num_new_tokens: int, cows: list[CowCopy]) -> bool:
        """Give req the blocks to compute its next num_new_tokens (a fresh copy of a shared
        partly filled block, new blocks); False, changing nothing, if the pool is short."""
        bs = self.block_size
        table = req.block_table
        start = req.num_computed_tokens
        num_new_blocks = -(-(start + num_new_tokens) // bs) - len(table)
        # The first token lands in a partly filled block when start % bs != 0; a fork shares it.
        shared = start % bs != 0 and self.pool.ref_counts[table[start // bs]] > 1
        if num_new_blocks <= 0 and not shared:
            return True
        if num_new_blocks + shared > self.pool.num_free_blocks:
            return False
        if shared:
            index = start // bs
            src = table[index]
            assert self.cache is None or not self.cache.is_cached(src), "a cached (full) block is written"
            (dst,) = self.pool.allocate(1)
            table[index] = dst
            self.pool.free((src,))
            cows.append(CowCopy(req, index, src, dst))
        if num_new_blocks > 0:
            table.extend(self.pool.allocate(num_new_blocks))
        return True

    def cache_full_blocks(self, req: Request) -> None:
        """Insert req's blocks that are full (all tokens computed and their ids known)."""
        node = req.cache_node
        if node is None:
            return
        bs = self.block_size
        token_ids = req.token_ids
        num_full = min(req.num_computed_tokens, len(token_ids)) // bs
        i = req.num_cached_blocks
        while i < num_full:
            block = req.block_table[i]
            node = self.cache.insert(node, tuple(token_ids[i * bs : (i + 1) * bs]), block)
            if node.block_id != block:
                # NOTE: another request cached these tokens first: keep its node, ours stays
                # private. Stop caching this request's later blocks, because inserting them under a
                # node we don't hold would break "holders of a node hold its ancestors".
                req.cache_node = None
                req.num_cached_blocks = i
                return
            i += 1
        req.cache_node = node
        req.num_cached_blocks = i

    def fork(self, parent: Request, child: Request) -> None:
        """child shares every block of parent, the partly filled last one included."""
        child.block_table = list(parent.block_table)
        self.pool.incref(child.block_table)

    def free(self, req: Request) -> None:
        """Release req's blocks (tail first, so tails are evicted before the blocks they extend)."""
        self.pool.free(reversed(req.block_table))
        req.block_table = []
        req.num_computed_tokens = 0
        req.num_cached_blocks = 0
        req.cache_node = None
