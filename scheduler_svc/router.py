"""Which worker takes a new request: prefix-cache affinity first, load second.

Each worker has its own block pool and prefix trie, so a prompt is cheapest on the worker whose trie
already holds the longest prefix of it (for its cache salt). Affinity alone would pile every request
sharing a system prompt onto one worker, so a worker whose load exceeds the least loaded one's by
more than `max_imbalance` requests loses its affinity bonus (the rule SGLang's cache-aware router uses).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class RouteTarget(Protocol):
    @property
    def worker_id(self) -> str: ...

    def prefix_hit_tokens(self, token_ids: Sequence[int], cache_salt: str) -> int:
        """Leading prompt tokens whose KV blocks this worker's prefix trie holds."""
        ...

    def load(self) -> int:
        """Requests running plus waiting on this worker."""
        ...

    def free_blocks(self) -> int:
        """KV blocks it could hand out now (free plus cached-but-unused)."""
        ...


def choose_worker(
    targets: Sequence[RouteTarget],
    token_ids: Sequence[int],
    cache_salt: str = "",
    max_imbalance: int = 8,
) -> RouteTarget | None:
    """The worker for a prompt among the healthy `targets`; None when there is none."""
    if not targets:
        return None
    loads = {t.worker_id: t.load() for t in targets}
    least = min(loads.values())

    def key(target: RouteTarget) -> tuple[int, int, int, str]:
        load = loads[target.worker_id]
        hit = target.prefix_hit_tokens(token_ids, cache_salt) if load - least <= max_imbalance else 0
        # Longest prefix hit, then least loaded, then most free blocks; the id keeps it deterministic.
        return (-hit, load, -target.free_blocks(), target.worker_id)

    return min(targets, key=key)
