from scheduler_fakes import Driver, check_invariants, make_request

from pagedserve.scheduler_svc.block_pool import BlockPool
from pagedserve.scheduler_svc.config import SchedulerConfig
from pagedserve.scheduler_svc.kv_cache_manager import KVCacheManager
from pagedserve.scheduler_svc.prefix_cache import PrefixCache
from pagedserve.scheduler_svc.scheduler import Scheduler

BS = 4


def _chain(cache: PrefixCache, pool: BlockPool, keys: list[tuple[int, ...]], salt: str = ""):
    node = cache.root(salt)
    blocks = pool.allocate(len(keys))
    for key, b in zip(keys, blocks, strict=True):
        node = cache.insert(node, key, b)
    return blocks


def _cache(num_blocks: int = 8) -> tuple[PrefixCache, BlockPool]:
    return _cache_of(num_blocks, 2)


def _cache_of(num_blocks: int, block_size: int) -> tuple[PrefixCache, BlockPool]:
    cache = PrefixCache(num_blocks, block_size)
    return cache, BlockPool(num_blocks, cache)


def test_match_returns_longest_cached_path_up_to_max_blocks():
    cache, pool = _cache()
    blocks = _chain(cache, pool, [(1, 2), (3, 4), (5, 6)])
    assert [n.block_id for n in cache.match("", [1, 2, 3, 4, 9, 9], 3)] == blocks[:2]
    assert [n.block_id for n in cache.match("", [1, 2, 3, 4, 5, 6, 7], 2)] == blocks[:2]
    assert cache.match("", [2, 1], 1) == []


def test_eviction_takes_leaves_before_their_parents():
    cache, pool = _cache(num_blocks=3)
    parent, child, other = _chain(cache, pool, [(1, 2), (3, 4)]) + _chain(cache, pool, [(7, 7)])
    pool.free([parent])  # the parent is released first: least recently used, but interior
    pool.free([child])
    pool.free([other])
    assert cache.evict() == child
    assert cache.evict() == parent
    assert cache.evict() == other


def test_interior_node_becomes_evictable_once_its_children_are_gone():
    cache, pool = _cache(num_blocks=3)
    a, b = _chain(cache, pool, [(1, 2), (3, 4)])
    pool.free([a, b])
    assert cache.num_evictable == 2
    assert pool.allocate(2) == [2, b]  # the free block, then the leaf
    assert pool.allocate(1) == [a]


def test_different_salts_never_share():
    cache, pool = _cache()
    _chain(cache, pool, [(1, 2)], salt="tenant-a")
    assert cache.match("tenant-b", [1, 2, 3], 1) == []
    assert cache.match("", [1, 2, 3], 1) == []
    assert len(cache.match("tenant-a", [1, 2, 3], 1)) == 1


def test_second_insert_of_same_block_keeps_existing_node():
    cache, pool = _cache()
    (first,) = _chain(cache, pool, [(1, 2)])
    (second,) = pool.allocate(1)
    node = cache.insert(cache.root(""), (1, 2), second)
    assert node.block_id == first and not cache.is_cached(second)


def _scheduler(**kw) -> Scheduler:
    cfg = dict(num_blocks=32, block_size=BS, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)
    return Scheduler(SchedulerConfig(**(cfg | kw)))


def test_full_prompt_hit_still_computes_last_token():
    s = _scheduler()
    d = Driver(s, check=lambda: check_invariants(s))
    prompt = list(range(10, 22))  # 3 full blocks
    s.add_request(make_request("a", prompt, max_tokens=1))
    d.run()
    s.add_request(make_request("b", prompt, max_tokens=1))
    out = d.step()
    # 2 blocks hit whole; of the third, which holds the last prompt token (it must be computed to
    # sample), the 3 tokens before it: the block is copied and only the last token computed.
    assert out.num_scheduled_tokens == [1]
    (copy,) = out.cow_copies
    assert copy.src_block == s.kv.cache.match("", prompt, 3)[2].block_id != copy.dst_block
    assert s.stats().prefix_cache_hits == 11
    d.run()
    assert d.logs[("b", 0)].num_cached_tokens == 11
    assert d.logs[("b", 0)].tokens == d.logs[("a", 0)].tokens


def test_hit_reuses_blocks_of_a_finished_request_and_counts_tokens():
    s = _scheduler()
    d = Driver(s, check=lambda: check_invariants(s))
    s.add_request(make_request("a", list(range(20, 37)), max_tokens=3))
    d.run()
    s.add_request(make_request("b", [*range(20, 33), 99, 98], max_tokens=3))
    out = d.step()
    # 3 blocks whole, and token 32 from a's fourth block [32, 33, 34, 35].
    assert out.num_scheduled_tokens == [15 - 13]
    stats = s.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (17 + 15, 13)
    d.run()


def test_reset_forgets_every_cached_prefix_once_no_request_holds_one():
    s = _scheduler()
    d = Driver(s, check=lambda: check_invariants(s))
    prompt = list(range(20, 37))
    s.add_request(make_request("a", prompt, max_tokens=3))
    d.step()  # a holds its 4 full prompt blocks, cached
    cached = s.kv.cache.num_cached_blocks
    assert cached == 4 and not s.reset_prefix_cache()
    assert s.kv.cache.num_cached_blocks == cached  # refused: nothing changed
    d.run()
    assert s.reset_prefix_cache()
    check_invariants(s)
    assert s.kv.cache.num_cached_blocks == s.kv.cache.num_evictable == 0
    assert s.kv.pool.num_uncached_free_blocks == s.config.num_blocks
    s.add_request(make_request("b", prompt, max_tokens=3))
    out = d.step()
    assert out.num_scheduled_tokens == [len(prompt)] and s.stats().prefix_cache_hits == 0
    d.run()
    assert d.logs[("b", 0)].tokens == d.logs[("a", 0)].tokens


def test_generated_tokens_fill_blocks_that_later_requests_hit():
    s = _scheduler()
    d = Driver(s, check=lambda: check_invariants(s))
    s.add_request(make_request("a", [5, 6], max_tokens=12, eos=None))
    d.run()
    full = [5, 6, *d.logs[("a", 0)].tokens]  # 14 tokens: 3 full blocks, all cacheable
    s.add_request(make_request("b", full, max_tokens=1))
    d.step()
    assert s.stats().prefix_cache_hits == 12
    d.run()


def test_requests_with_different_salts_compute_their_own_blocks():
    s = _scheduler()
    d = Driver(s, check=lambda: check_invariants(s))
    prompt = list(range(30, 47))
    s.add_request(make_request("a", prompt, salt="x", max_tokens=1))
    d.run()
    s.add_request(make_request("b", prompt, salt="y", max_tokens=1))
    out = d.step()
    assert out.num_scheduled_tokens == [17] and s.stats().prefix_cache_hits == 0
    d.run()


def test_same_step_request_shares_blocks_scheduled_before_it():
    # NOTE: safe because every layer writes the whole batch's K/V before attending.
    s = _scheduler()
    d = Driver(s, check=lambda: check_invariants(s))
    prompt = list(range(40, 49))
    s.add_request(make_request("a", prompt, max_tokens=4, eos=None))
    s.add_request(make_request("b", prompt, max_tokens=4, eos=None))
    out = d.step()
    assert out.num_scheduled_tokens == [9, 1]
    a, b = s.running
    assert a.block_table[:2] == b.block_table[:2]
    d.run()


def test_concurrently_computed_same_block_keeps_the_first_node_and_the_second_stays_private():
    s = _scheduler()
    d = Driver(s, check=lambda: check_invariants(s))
    # Unseeded forks sample the same tokens, so both fill an identical block 1 at the same step.
    s.add_request(make_request("a", [40, 41, 42, 43, 44], max_tokens=6, n=2, eos=None))
    for _ in range(6):
        d.step()
    first, second = s.running
    assert first.block_table[0] == second.block_table[0]  # the shared prompt block
    assert first.block_table[1] != second.block_table[1]
    assert s.kv.cache.is_cached(first.block_table[1]) and not s.kv.cache.is_cached(second.block_table[1])
    assert second.cache_node is None  # it caches nothing further under a node it doesn't hold
    d.run()
    assert d.logs[("a", 0)].tokens == d.logs[("a", 1)].tokens


def test_disabled_prefix_caching_never_hits():
    s = _scheduler(enable_prefix_caching=False)
    d = Driver(s, check=lambda: check_invariants(s))
    for rid in "ab":
        s.add_request(make_request(rid, list(range(1, 18)), max_tokens=2))
        d.run()
    assert s.stats().prefix_cache_hits == 0 and s.kv.pool.num_used_blocks == 0


def test_partial_match_takes_the_child_with_the_longest_common_run():
    cache, pool = _cache_of(16, 4)
    root = cache.root("")
    (a,) = _chain(cache, pool, [(1, 2, 3, 4)])
    (b,) = _chain(cache, pool, [(1, 2, 7, 8)])
    _chain(cache, pool, [(5, 6, 7, 8)])
    assert cache.match_partial(root, [1, 2, 3, 9], 4, step=1) == (cache.node_of(a), 3)
    assert cache.match_partial(root, [1, 2, 7, 9], 4, step=1) == (cache.node_of(b), 3)
    assert cache.match_partial(root, [1, 2, 3, 4], 2, step=1) == (cache.node_of(a), 2)  # capped
    assert cache.match_partial(root, [9, 2, 3, 4], 4, step=1) == (None, 0)
    # A block whose tokens the plan being built computes cannot be copied by that same plan.
    (late,) = pool.allocate(1)
    cache.insert(root, (9, 9, 9, 9), late, step=5)
    assert cache.match_partial(root, [9, 9, 1], 3, step=5) == (None, 0)
    assert cache.match_partial(root, [9, 9, 1], 3, step=6) == (cache.node_of(late), 2)


def test_a_shared_prefix_ending_inside_a_block_is_reused_to_its_last_token():
    # A system prompt of 10 tokens (2 blocks and 2 tokens) then distinct questions: every request after
    # the first copies the third block and computes only its question.
    s = _scheduler()
    d = Driver(s, check=lambda: check_invariants(s))
    system = list(range(50, 60))
    for i, question in enumerate([[1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12]]):
        s.add_request(make_request(f"q{i}", system + question, max_tokens=3, eos=None))
        out = d.step()
        if i == 0:
            assert out.num_scheduled_tokens == [14] and not out.cow_copies
        else:
            assert out.num_scheduled_tokens == [len(question)] and len(out.cow_copies) == 1
        d.run()
        assert d.logs[(f"q{i}", 0)].num_cached_tokens == (0 if i == 0 else 10)
    assert s.stats().prefix_cache_hits == 20
    # The copies kept the cached block intact: a repeat of the first request still reads it right.
    s.add_request(make_request("again", [*system, 1, 2, 3, 4], max_tokens=3, eos=None))
    d.run()
    assert d.logs[("again", 0)].tokens == d.logs[("q0", 0)].tokens


def test_a_block_computed_in_the_same_step_is_not_copied_before_it_exists():
    # Two requests with one prefix ending inside a block arrive together: the first computes the block
    # in this step, whose copies run before its forward pass, so the second must not copy it.
    s = _scheduler()
    d = Driver(s, check=lambda: check_invariants(s))
    system = list(range(70, 80))
    s.add_request(make_request("a", [*system, 1, 2], max_tokens=2, eos=None))
    s.add_request(make_request("b", [*system, 3, 4], max_tokens=2, eos=None))
    out = d.step()
    assert out.num_scheduled_tokens == [12, 12 - 8] and not out.cow_copies
    d.run()
    s.add_request(make_request("c", [*system, 5, 6], max_tokens=2, eos=None))
    assert d.step().num_scheduled_tokens == [2]
    d.run()


def test_forks_after_a_hit_that_covers_all_but_the_last_prompt_token_keep_the_copy():
    # n = 2 on a prompt whose every token but the last is cached (the last of them in a partly hit
    # block): the parent has nothing to compute before forking, and the step that forks it must still
    # carry the copy of that block.
    s = _scheduler()
    d = Driver(s, check=lambda: check_invariants(s))
    prompt = list(range(90, 100))
    s.add_request(make_request("a", prompt, max_tokens=4, eos=None))  # fills its third block
    d.run()
    s.add_request(make_request("b", prompt, max_tokens=2, n=2, eos=None))
    out = d.step()
    assert (
        out.cow_copies[0].src_block == s.kv.cache.match("", prompt + d.logs[("a", 0)].tokens, 3)[2].block_id
    )
    d.run()
    assert d.logs[("b", 0)].num_cached_tokens == 9


# ---------------------------------------------------------------- per-salt state is bounded


def test_a_salts_root_goes_away_with_its_last_block():
    cache, pool = _cache(num_blocks=2)
    (block,) = _chain(cache, pool, [(1, 2)], salt="tenant")
    pool.free([block])
    assert cache.num_roots == 1
    assert pool.allocate(2) == [1, block]  # the free block, then the cached one, evicted
    assert cache.num_roots == 0 and cache.find_root("tenant") is None


def _run_salted(s: Scheduler, d: Driver, rid: str, salt: str, prompt: list[int]) -> None:
    s.add_request(make_request(rid, prompt, salt=salt, max_tokens=1, eos=None))
    d.run()


def test_a_new_salt_past_the_cap_evicts_the_least_recently_used_salt_no_request_holds():
    s = _scheduler(max_cache_salts=2)
    d = Driver(s, check=lambda: check_invariants(s))
    prompt = list(range(10, 19))  # two full blocks cached per request
    _run_salted(s, d, "a", "x", prompt)
    _run_salted(s, d, "b", "y", prompt)
    _run_salted(s, d, "c", "x", prompt)  # a hit: x is now the more recently used salt
    free = s.kv.pool.num_uncached_free_blocks
    _run_salted(s, d, "d", "z", prompt)
    assert sorted(r.salt for r in s.kv.cache.roots()) == ["x", "z"]
    # y's two blocks went back to the free pool with it (z's request took two others, one stays cached).
    assert s.kv.pool.num_uncached_free_blocks == free + 2 - 3 + 1


def test_a_new_salt_past_the_cap_runs_without_prefix_caching_while_every_salt_is_held():
    s = _scheduler(max_cache_salts=1)
    d = Driver(s, check=lambda: check_invariants(s))
    s.add_request(make_request("holder", list(range(10, 19)), salt="x", max_tokens=30, eos=None))
    d.step()
    s.add_request(make_request("newcomer", list(range(10, 19)), salt="y", max_tokens=2, eos=None))
    d.step()
    newcomer = next(r for r in s.running if r.request_id == "newcomer")
    assert newcomer.cache_node is None and [r.salt for r in s.kv.cache.roots()] == ["x"]
    d.run()
    assert d.logs[("newcomer", 0)].tokens == d.logs[("holder", 0)].tokens[:2]


def test_a_request_admitted_at_its_salts_root_inserts_under_a_live_one_after_the_root_went_away():
    # The salt's root the request was admitted under loses its last block before the request fills its first
    # one: that block goes under a root made again, never under the dead one.
    kv = KVCacheManager(SchedulerConfig(num_blocks=3, block_size=BS, max_num_seqs=2, max_model_len=12))
    first = make_request("first", [40, 41, 42, 43, 44], salt="x")
    kv.admit(first, kv.lookup(first, 1), [])
    assert kv.allocate_slots(first, 5, [])
    first.num_computed_tokens = 5
    kv.cache_full_blocks(first, 1)
    kv.free(first)
    old_root = kv.cache.find_root("x")
    late = make_request("late", list(range(1, 10)), salt="x")
    kv.admit(late, kv.lookup(late, 2), [])
    assert kv.allocate_slots(late, 3, [])
    late.num_computed_tokens = 3
    taken = kv.pool.allocate(kv.pool.num_free_blocks)  # the last one is x's cached block, evicted
    assert not old_root.alive and kv.cache.find_root("x") is None
    kv.pool.free(taken)
    assert kv.allocate_slots(late, 1, [])
    late.num_computed_tokens = 4
    kv.cache_full_blocks(late, 3)
    root = kv.cache.find_root("x")
    assert root is not None and root is not old_root and root.alive
    assert late.cache_node.parent is root and late.num_cached_blocks == 1


def test_salt_roots_stay_capped_under_10000_distinct_salts():
    s = _scheduler(num_blocks=64, max_num_seqs=16, max_cache_salts=8)
    d = Driver(s)
    prompt = list(range(10, 19))
    most = 0
    for i in range(10_000):
        s.add_request(make_request(f"r{i}", prompt, salt=f"tenant-{i}", max_tokens=1, eos=None))
        if i % 16 == 15:
            d.run()
            most = max(most, s.kv.cache.num_roots)
    d.run()
    check_invariants(s)
    assert s.kv.cache.num_roots <= 8 and most <= 8
    assert s.kv.cache.num_cached_blocks <= 8 * 2 and len(s.kv.cache._roots) == s.kv.cache.num_roots
