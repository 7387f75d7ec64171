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
from .prefix_cache import AT_ROOT, CacheNode, PrefixCache
from .request import Request


@dataclass(slots=True)
class PrefixHit:
    """What the prefix cache holds of a request's leading tokens."""

    # Cached full blocks of the leading tokens, in order (taken into the request's table).
    nodes: list[CacheNode]
    # Tokens of the hit: the blocks' and then partial_tokens more.
    num_tokens: int = 0
    # A cached block whose first partial_tokens tokens continue the prompt after those blocks: the
    # request copies it into a fresh block and computes from there on; None if there is none.
    partial: CacheNode | None = None
    partial_tokens: int = 0


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
        self.max_cache_salts = config.max_cache_salts

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def lookup(self, req: Request, step: int) -> PrefixHit:
        """What the cache holds of req's leading tokens for the plan of step `step`: whole blocks,
        then part of one computed before that step; never req's last token (which must be computed
        to sample). Nothing for a request that scores its prompt (prompt logprobs): like vLLM, it
        computes every prompt position. No side effect."""
        if self.cache is None or req.wants_prompt_logprobs:
            return PrefixHit([])
        bs = self.block_size
        tokens = req.token_ids
        nodes = self.cache.match(req.cache_salt, tokens, (len(tokens) - 1) // bs)
        start = len(nodes) * bs
        parent = nodes[-1] if nodes else self.cache.find_root(req.cache_salt)
        if parent is None:
            return PrefixHit([])
        partial, n = self.cache.match_partial(
            parent, tokens[start : start + bs], len(tokens) - 1 - start, step
        )
        return PrefixHit(nodes, start + n, partial, n)

    def blocks_to_admit(self, hit: PrefixHit, num_new_tokens: int) -> int:
        """Free blocks that admitting with this hit and tokens takes (hit blocks nobody holds
        count: they stop being evictable; so does a partly hit one while it is copied)."""
        bs = self.block_size
        new = -(-(hit.num_tokens + num_new_tokens) // bs) - len(hit.nodes)
        held = hit.partial is not None and not hit.partial.referenced
        return new + held + sum(1 for node in hit.nodes if not node.referenced)

    def admit(self, req: Request, hit: PrefixHit, cows: list[CowCopy]) -> None:
        """Take the hit blocks into req's (empty) table, and a copy of the partly hit block (the copy
        is the plan's, before anything is computed); the caller then allocate_slots()."""
        assert not req.block_table and req.num_computed_tokens == 0
        req.block_table = [node.block_id for node in hit.nodes]
        self.pool.incref(req.block_table)
        req.num_computed_tokens = hit.num_tokens
        req.num_cached_blocks = len(hit.nodes)
        req.inserted = []
        if self.cache is not None:
            req.cache_node = hit.nodes[-1] if hit.nodes else AT_ROOT
            if hit.nodes or hit.partial is not None:
                self.cache.touch_root(req.cache_salt)
        if hit.partial is not None:
            src = hit.partial.block_id
            # Held while the fresh block is taken, so that taking it cannot evict the block to copy.
            self.pool.incref((src,))
            (dst,) = self.pool.allocate(1)
            self.pool.free((src,))
            req.block_table.append(dst)
            cows.append(CowCopy(req, len(req.block_table) - 1, src, dst))

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

    def cache_full_blocks(self, req: Request, step: int) -> None:
        """Insert req's blocks that are full (all tokens computed, by plans up to step `step`, and
        their ids known)."""
        node = req.cache_node
        if node is None:
            return
        bs = self.block_size
        token_ids = req.token_ids
        num_full = min(req.num_computed_tokens, len(token_ids)) // bs
        i = req.num_cached_blocks
        if node.parent is None and i < num_full:
            # NOTE: a root is looked up again: it goes away with its last block (or is evicted)
            # while requests that hold none of its blocks still point at it.
            node = self._root(req.cache_salt)
            if node is None:
                req.cache_node = None  # too many salts hold blocks: this request caches nothing
                return
        while i < num_full:
            block = req.block_table[i]
            node = self.cache.insert(node, tuple(token_ids[i * bs : (i + 1) * bs]), block, step)
            if node.block_id != block:
                # NOTE: another request cached these tokens first: keep its node, ours stays
                # private. Stop caching this request's later blocks, because inserting them under a
                # node we don't hold would break "holders of a node hold its ancestors".
                req.cache_node = None
                req.num_cached_blocks = i
                return
            req.inserted.append(node)
            i += 1
        req.cache_node = node
        req.num_cached_blocks = i

    def _root(self, salt: str) -> CacheNode | None:
        """The salt's root to insert under; a new one evicts the least recently used root whose blocks
        no request holds (its blocks become free) when max_cache_salts roots exist. None if none can go."""
        cache = self.cache
        if cache.find_root(salt) is None and cache.num_roots >= self.max_cache_salts:
            victim = cache.evictable_root()
            if victim is None:
                return None
            self.pool.reclaim(cache.drop_root(victim))
        return cache.root(salt)

    def uncache_since(self, salt: str, step: int) -> None:
        """Forget the salt's cached blocks that plans of step `step` or later compute and that no block
        table holds, with everything under them: their K/V may never have been computed. They become free."""
        if self.cache is not None:
            self.pool.reclaim(self.cache.drop_since(salt, step))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix, its blocks becoming plain free blocks (as vLLM's
        reset_prefix_cache, for benchmarks that run one workload again, or after new weights): only
        when no block table holds a cached block. False, and nothing changes, while one does."""
        if self.cache is None:
            return True
        if self.cache.num_evictable != self.cache.num_cached_blocks:
            return False
        self.pool.evict_all()
        return True

    def fork(self, parent: Request, child: Request) -> None:
        """child shares every block of parent, the partly filled last one included."""
        child.block_table = list(parent.block_table)
        self.pool.incref(child.block_table)

    def roll_back(self, req: Request) -> None:
        """Free the blocks of req's table past those that hold its computed tokens (rejected drafts' blocks:
        never cached, as only full blocks of known tokens are), noting the new length for the plan builder."""
        keep = -(-req.num_computed_tokens // self.block_size)
        table = req.block_table
        if len(table) > keep:
            self.pool.free(reversed(table[keep:]))
            del table[keep:]
            req.rolled_back_table_len = keep

    def free(self, req: Request) -> None:
        """Release req's blocks (tail first, so tails are evicted before the blocks they extend)."""
        self.pool.free(reversed(req.block_table))
        req.block_table = []
        req.rolled_back_table_len = -1
        req.num_computed_tokens = 0
        req.num_cached_blocks = 0
        req.cache_node = None
