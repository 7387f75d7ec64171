"""Block-granular radix trie of cached prefixes, one per worker.

Each node is one full block: its key is the block's token ids, its parent the block before it, and
one root per cache salt keeps tenants apart. Matching is token-granular at the end: past the last
block that matches whole, a cached block whose leading tokens continue the prompt serves those tokens
too (the request copies it and computes the rest of it), so a shared system prompt that ends inside a
block is still reused to its last token. The trie holds a block WITHOUT a reference count: the
pool's count is the number of block tables holding the block, and a cached block whose count drops
to zero stays in the trie (evictable) until the pool needs it back.

NOTE: a request only inserts a block under a node whose block it holds itself (see
KVCacheManager.cache_full_blocks), so whoever holds a node holds all of its ancestors. Hence an
unreferenced node has no referenced descendant, every unreferenced node is evictable by evicting
leaves first, and `num_evictable` is exact.

Per-salt state is bounded: a root exists only while it has a block under it (it goes away with its
last one), so there are never more roots than cached blocks, and KVCacheManager caps their number
(evicting the least recently used root whose blocks no request holds, with all its blocks). A request
that points at a root looks it up again before it inserts under it.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass(slots=True, eq=False)
class CacheNode:
    # Physical block holding the K/V of this node's tokens; -1 for a salt's root.
    block_id: int
    # The block's token ids (block_size of them); empty for a root.
    key: tuple[int, ...]
    # The node of the previous block; None for a root.
    parent: CacheNode | None
    # Nodes of the blocks that follow, by their token ids.
    children: dict[tuple[int, ...], CacheNode] = field(default_factory=dict)
    # Logical time of the last hit or release (larger is more recent).
    last_used: int = 0
    # Step id of the plan that computes the block's last token: a block enters the trie when that plan
    # is built, so its K/V exist only once that step has run.
    step: int = 0
    # Whether some block table holds the block (its pool reference count is above zero).
    referenced: bool = True
    # False once evicted.
    alive: bool = True
    # The cache salt, for a root; empty for the other nodes.
    salt: str = ""


# What a request's cache_node is while it holds no cached block: the root of its salt, looked up
# again when it inserts (see KVCacheManager.cache_full_blocks).
AT_ROOT = CacheNode(block_id=-1, key=(), parent=None, alive=False)


class PrefixCache:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        # Cached blocks no block table holds (all evictable, leaves first).
        self.num_evictable = 0
        # One root per salt with blocks under it, least recently used first.
        self._roots: OrderedDict[str, CacheNode] = OrderedDict()
        self._node_of_block: list[CacheNode | None] = [None] * num_blocks
        self._num_cached = 0
        self._clock = 0
        # (last_used, tie-breaker, node) of candidate leaves; stale entries are skipped on pop.
        self._heap: list[tuple[int, int, CacheNode]] = []
        self._pushes = 0

    @property
    def num_cached_blocks(self) -> int:
        return self._num_cached

    @property
    def num_roots(self) -> int:
        return len(self._roots)

    def find_root(self, salt: str) -> CacheNode | None:
        """The salt's root, if it has blocks under it; no side effect."""
        return self._roots.get(salt)

    def root(self, salt: str) -> CacheNode:
        """The salt's root, made if missing (insert a block under it at once), now the most recently used."""
        node = self._roots.get(salt)
        if node is None:
            node = self._roots[salt] = CacheNode(block_id=-1, key=(), parent=None, salt=salt)
        else:
            self._roots.move_to_end(salt)
        return node

    def touch_root(self, salt: str) -> None:
        """The salt's root (if any) is now the most recently used (a request hit its blocks)."""
        if salt in self._roots:
            self._roots.move_to_end(salt)

    def evictable_root(self) -> CacheNode | None:
        """The least recently used root whose blocks no request holds, or None. A root's blocks are all
        unreferenced when its children are (whoever holds a node holds its ancestors)."""
        for node in self._roots.values():
            if not any(child.referenced for child in node.children.values()):
                return node
        return None

    def drop_root(self, root: CacheNode) -> list[int]:
        """Forget a root and every block under it (none referenced); returns those blocks, now uncached."""
        assert root.parent is None and self._roots.get(root.salt) is root
        del self._roots[root.salt]
        root.alive = False
        blocks = self._drop_below(root)
        return blocks

    def drop_subtree(self, node: CacheNode) -> list[int]:
        """Forget a (non-root) node and every node under it, none referenced; returns their blocks, now
        uncached. Its parent may become an evictable leaf, or a root without blocks, which goes away."""
        parent = node.parent
        assert parent is not None and node.alive and parent.children.get(node.key) is node
        del parent.children[node.key]
        blocks = self._drop_below(node)
        assert not node.referenced, "a node a request holds is dropped"
        node.alive = False
        self._node_of_block[node.block_id] = None
        blocks.append(node.block_id)
        self._num_cached -= 1
        self.num_evictable -= 1
        if parent.parent is None:
            if not parent.children:
                del self._roots[parent.salt]
                parent.alive = False
        elif not parent.referenced and not parent.children:
            self._push(parent)
        return blocks

    def drop_since(self, salt: str, step: int) -> list[int]:
        """Forget every unreferenced node of the salt computed by a plan of step `step` or later, with
        everything under it (all unreferenced: holders of a node hold its ancestors); returns their blocks."""
        root = self._roots.get(salt)
        blocks: list[int] = []
        stack = list(root.children.values()) if root is not None else []
        while stack:
            node = stack.pop()
            if node.step >= step and not node.referenced:
                blocks += self.drop_subtree(node)
            else:
                stack.extend(node.children.values())
        return blocks

    def _drop_below(self, top: CacheNode) -> list[int]:
        blocks = []
        stack = list(top.children.values())
        top.children = {}
        while stack:
            node = stack.pop()
            assert not node.referenced, "a node a request holds is dropped"
            stack.extend(node.children.values())
            node.alive = False
            self._node_of_block[node.block_id] = None
            blocks.append(node.block_id)
        self._num_cached -= len(blocks)
        self.num_evictable -= len(blocks)
        return blocks

    def is_cached(self, block_id: int) -> bool:
        return self._node_of_block[block_id] is not None

    def node_of(self, block_id: int) -> CacheNode | None:
        return self._node_of_block[block_id]

    def match(self, salt: str, token_ids: list[int], max_blocks: int) -> list[CacheNode]:
        """Longest cached path for the leading full blocks of token_ids, at most max_blocks long."""
        bs = self.block_size
        node = self._roots.get(salt)
        path: list[CacheNode] = []
        while node is not None and len(path) < max_blocks:
            start = len(path) * bs
            node = node.children.get(tuple(token_ids[start : start + bs]))
            if node is not None:
                path.append(node)
        return path

    def match_partial(
        self, node: CacheNode, token_ids: list[int], max_tokens: int, step: int
    ) -> tuple[CacheNode | None, int]:
        """The child of node whose block begins with the longest run of token_ids (at most
        max_tokens, and fewer than a block), and that run's length; (None, 0) if none begins with
        token_ids[0]. Only blocks computed by a plan before `step`: the plan of step `step` copies
        the block before it computes anything. Cost: a comparison per child with a matching first
        token."""
        limit = min(max_tokens, len(token_ids), self.block_size - 1)
        if limit <= 0 or not node.children:
            return None, 0
        best, best_len = None, 0
        first = token_ids[0]
        for key, child in node.children.items():
            if key[0] != first or child.step >= step:
                continue
            n = 1
            while n < limit and key[n] == token_ids[n]:
                n += 1
            if n > best_len:
                best, best_len = child, n
                if n == limit:
                    break
        return best, best_len

    def insert(self, parent: CacheNode, key: tuple[int, ...], block_id: int, step: int = 0) -> CacheNode:
        """Cache a referenced full block, whose last token the plan of step `step` computes, under
        parent; if a node with this key exists already (another request computed the same block),
        keep it and return it."""
        assert parent.alive and len(key) == self.block_size
        node = parent.children.get(key)
        if node is not None:
            return node
        assert self._node_of_block[block_id] is None, f"block {block_id} cached twice"
        node = CacheNode(block_id=block_id, key=key, parent=parent, last_used=self._tick(), step=step)
        parent.children[key] = node
        self._node_of_block[block_id] = node
        self._num_cached += 1
        return node

    def on_referenced(self, block_id: int) -> None:
        node = self._node_of_block[block_id]
        assert node is not None and not node.referenced
        node.referenced = True
        node.last_used = self._tick()
        self.num_evictable -= 1

    def on_unreferenced(self, block_id: int) -> None:
        node = self._node_of_block[block_id]
        assert node is not None and node.referenced
        node.referenced = False
        node.last_used = self._tick()
        self.num_evictable += 1
        if not node.children:
            self._push(node)

    def evict(self) -> int:
        """Remove the least recently used unreferenced leaf; return its block."""
        while True:
            last_used, _, node = heapq.heappop(self._heap)
            if node.alive and not node.referenced and not node.children and node.last_used == last_used:
                break
        parent = node.parent
        assert parent is not None
        del parent.children[node.key]
        node.alive = False
        self._node_of_block[node.block_id] = None
        self._num_cached -= 1
        self.num_evictable -= 1
        if parent.parent is None:
            if not parent.children:
                del self._roots[parent.salt]  # a root goes away with its last block
                parent.alive = False
        elif not parent.referenced and not parent.children:
            self._push(parent)
        return node.block_id

    def cached_nodes(self) -> list[CacheNode]:
        """Every live node but the roots (for invariant checks)."""
        return [n for n in self._node_of_block if n is not None]

    def roots(self) -> list[CacheNode]:
        """Every root, least recently used first (for invariant checks)."""
        return list(self._roots.values())

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _push(self, node: CacheNode) -> None:
        self._pushes += 1
        heapq.heappush(self._heap, (node.last_used, self._pushes, node))
        if len(self._heap) > 4 * len(self._node_of_block) + 64:
            # Drop stale entries so the heap stays O(num_blocks).
            self._heap = [
                e
                for e in self._heap
                if e[2].alive and not e[2].referenced and not e[2].children and e[2].last_used == e[0]
            ]
            heapq.heapify(self._heap)
