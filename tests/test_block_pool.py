import pytest

from pagedserve.scheduler_svc.block_pool import BlockPool
from pagedserve.scheduler_svc.prefix_cache import PrefixCache


def _pool_with_cache(num_blocks: int = 6, block_size: int = 2) -> tuple[BlockPool, PrefixCache]:
    cache = PrefixCache(num_blocks, block_size)
    return BlockPool(num_blocks, cache), cache


def test_fresh_blocks_are_handed_out_in_id_order():
    pool = BlockPool(4)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.num_free_blocks == 1 and pool.num_used_blocks == 3


def test_freed_uncached_blocks_are_reused_least_recently_freed_first():
    pool = BlockPool(3)
    a, b, _ = pool.allocate(3)
    pool.free([b])
    pool.free([a])
    assert pool.allocate(2) == [b, a]


def test_uncached_free_blocks_go_before_cached_ones():
    pool, cache = _pool_with_cache()
    (cached,) = pool.allocate(1)
    cache.insert(cache.root(""), (1, 2), cached)
    pool.free([cached])
    assert cache.num_evictable == 1 and pool.num_free_blocks == 6
    assert cached not in pool.allocate(5)
    assert pool.allocate(1) == [cached]  # evicted only once nothing else is left
    assert not cache.is_cached(cached)


def test_cached_blocks_are_evicted_least_recently_used():
    pool, cache = _pool_with_cache(num_blocks=3)
    blocks = pool.allocate(3)
    root = cache.root("")
    for i, b in enumerate(blocks):
        cache.insert(root, (i, i), b)
    pool.free([blocks[1]])
    pool.free([blocks[0]])
    pool.free([blocks[2]])
    assert pool.allocate(3) == [blocks[1], blocks[0], blocks[2]]


def test_hit_on_cached_block_makes_it_unevictable():
    pool, cache = _pool_with_cache(num_blocks=2)
    a, b = pool.allocate(2)
    root = cache.root("")
    cache.insert(root, (0, 0), a)
    cache.insert(root, (1, 1), b)
    pool.free([a, b])
    pool.incref([a])
    assert pool.num_free_blocks == 1
    assert pool.allocate(1) == [b]


def test_free_of_unreferenced_block_is_a_bug():
    pool = BlockPool(2)
    with pytest.raises(AssertionError):
        pool.free([0])


def test_allocating_more_than_free_is_a_bug():
    pool = BlockPool(2)
    with pytest.raises(AssertionError):
        pool.allocate(3)
