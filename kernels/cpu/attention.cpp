// Paged attention's plan and entry point (see attention.h): which sequences take the row kernel, which the
// tiled kernel and in which tasks, and which are left to the caller.

#include "attention.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "common.h"
#include "ops.h"

namespace pagedserve::cpu {

// A split tile's parts are this many blocks or more.
constexpr int64_t kSplitMinBlocks = 4;

AttentionPlan plan_attention(int64_t num_tokens, int64_t num_heads, const at::Tensor& k_cache,
                             const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                             const at::Tensor& context_lens, int64_t max_pairs, int64_t min_tile_lanes) {
  TORCH_CHECK(num_heads % k_cache.size(2) == 0, "num_heads ", num_heads,
              " is not a multiple of num_kv_heads ", k_cache.size(2));
  TORCH_CHECK(
      block_tables.dim() == 2 && block_tables.scalar_type() == at::kInt && block_tables.stride(1) == 1,
      "block_tables must be int32 [num_seqs, max_blocks]");
  TORCH_CHECK(query_start_loc.scalar_type() == at::kInt && context_lens.scalar_type() == at::kInt,
              "query_start_loc and context_lens must be int32");
  const int64_t num_seqs = context_lens.numel();
  TORCH_CHECK(query_start_loc.numel() == num_seqs + 1 && block_tables.size(0) == num_seqs,
              "query_start_loc, context_lens and block_tables disagree on the number of sequences");
  const at::Tensor starts = query_start_loc.contiguous(), lens = context_lens.contiguous();
  const int32_t* start = starts.data_ptr<int32_t>();
  const int32_t* ctx = lens.data_ptr<int32_t>();
  TORCH_CHECK(start[0] == 0 && start[num_seqs] == num_tokens, "query_start_loc must run from 0 to ",
              num_tokens);
  const int64_t max_ctx = block_tables.size(1) * k_cache.size(1);
  const int64_t threads = std::max(1, at::get_num_threads());
  const int64_t group = num_heads / k_cache.size(2);
  // On AVX-512 the tiled kernel takes head sizes of whole registers. Batch-invariant, every row goes through
  // the row kernel, as a decode row does, or with AMX every row through the blocked rows' tiles, and none is
  // left to the caller (see attention.h).
  const bool invariant = batch_invariant();
  const bool can_tile =
      !invariant && kHasTiles && group <= kTileLanes && k_cache.size(3) % (vec::kLanes == 16 ? 16 : 1) == 0;
  if (invariant) max_pairs = -1;
  const bool blocked_fit = invariant && blocked_rows_fit(k_cache);
  const bool all_blocked = invariant && invariant_tiles_fit(k_cache);
  if (min_tile_lanes < 0) min_tile_lanes = kTileMinLanes;
  AttentionPlan plan;
  plan.chunks.reserve(num_tokens);
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t q_len = start[s + 1] - start[s];
    TORCH_CHECK(q_len >= 0 && q_len <= ctx[s], "sequence ", s, ": ", q_len, " queries but context length ",
                ctx[s]);
    TORCH_CHECK(ctx[s] <= max_ctx, "sequence ", s, ": context length ", ctx[s], " exceeds its block table (",
                max_ctx, " positions)");
    if (can_tile && q_len > 1 && q_len * group >= min_tile_lanes) {
      // Tasks of as many rows as fill kTileLanes, evened out: 40 rows of 3 heads in 48 lanes are 14 + 14 +
      // 12, not 16 + 16 + 8.
      const int64_t per_task = kTileLanes / group, num_row_tiles = (q_len + per_task - 1) / per_task;
      const int64_t rows = (q_len + num_row_tiles - 1) / num_row_tiles;
      for (int64_t i = 0; i < q_len; i += rows)
        for (int64_t h = 0; h < k_cache.size(2); ++h)
          plan.tiles.push_back({s, h, start[s] + i, ctx[s] - q_len + i, std::min(rows, q_len - i)});
      continue;
    }
    if (q_len > 0 && (all_blocked || (invariant && q_len >= kBlockedMinRows && blocked_fit))) {
      const int64_t num_row_blocks = (q_len + kBlockedRows - 1) / kBlockedRows;
      const int64_t rows = (q_len + num_row_blocks - 1) / num_row_blocks;
      for (int64_t i = 0; i < q_len; i += rows)
        plan.blocks.push_back({s, start[s] + i, ctx[s] - q_len + i, std::min(rows, q_len - i)});
      continue;
    }
    const int64_t pairs = q_len * ctx[s] - q_len * (q_len - 1) / 2;
    if (max_pairs >= 0 && q_len > 1 && pairs > max_pairs) {
      plan.skipped.push_back(s);
      continue;
    }
    if (q_len == 0) continue;
    // Chunks of at most kChunkRows rows, as many as a multiple of the threads when there are enough rows,
    // and as even as possible: 20 rows on 2 threads are 4 chunks of 5, not 8, 8 and 4.
    int64_t num_row_chunks = (q_len + kChunkRows - 1) / kChunkRows;
    if (q_len >= threads) num_row_chunks = (num_row_chunks + threads - 1) / threads * threads;
    const int64_t rows = (q_len + num_row_chunks - 1) / num_row_chunks;
    for (int64_t i = 0; i < q_len; i += rows)
      plan.chunks.push_back({s, start[s] + i, ctx[s] - q_len + i, std::min(rows, q_len - i)});
  }
  const int64_t block_size = k_cache.size(1);
  // Fewer tiles than two per thread (a prompt's last chunk after a long cached prefix: one per kv head)
  // leave threads idle; each such tile's blocks are split into parts of kSplitMinBlocks blocks or more, all
  // starting at or before the block of the tile's first row so that every lane sees a position in every part.
  const int64_t num_tiles = static_cast<int64_t>(plan.tiles.size());
  if (kSplitTiles && threads > 1 && num_tiles > 0 && num_tiles < 2 * threads) {
    const int64_t wanted = (2 * threads + num_tiles - 1) / num_tiles;
    std::vector<QueryTile> tasks;
    for (const QueryTile& t : plan.tiles) {
      const int64_t shared_blocks = t.pos0 / block_size + 1;  // those up to the first row's
      const int64_t parts = std::min(wanted, shared_blocks / kSplitMinBlocks);
      if (parts < 2) {
        tasks.push_back(t);
        continue;
      }
      plan.splits.push_back({t, plan.num_partials, parts});
      for (int64_t p = 0; p < parts; ++p) {
        QueryTile part = t;
        part.block_begin = p * shared_blocks / parts;
        if (p + 1 < parts) part.block_end = (p + 1) * shared_blocks / parts;
        part.partial = plan.num_partials++;
        tasks.push_back(part);
      }
    }
    plan.tiles = std::move(tasks);
  }
  // The longest first: tasks are handed out dynamically, and a late long one would run alone.
  const auto positions = [block_size](const QueryTile& t) {
    const int64_t end_block = std::min(t.block_end, (t.pos0 + t.rows - 1) / block_size + 1);
    return std::min(t.pos0 + t.rows, end_block * block_size) - t.block_begin * block_size;
  };
  std::stable_sort(plan.tiles.begin(), plan.tiles.end(),
                   [&](const QueryTile& a, const QueryTile& b) { return positions(a) > positions(b); });
  return plan;
}

void check_attention(const at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache,
                     const at::Tensor& v_cache) {
  check_cache(k_cache, v_cache);
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1 && query.stride(1) == query.size(2),
              "query must be [num_tokens, num_heads, head_dim] with contiguous heads");
  TORCH_CHECK(query.scalar_type() == k_cache.scalar_type(), "query dtype ", query.scalar_type(),
              " != cache dtype ", k_cache.scalar_type());
  TORCH_CHECK(query.size(2) == k_cache.size(3), "query head_dim ", query.size(2), " != cache head_dim ",
              k_cache.size(3));
  TORCH_CHECK(out.sizes() == query.sizes() && out.is_contiguous() && out.scalar_type() == query.scalar_type(),
              "out must be a contiguous tensor shaped and typed like query");
}

void run_attention(const AttentionPlan& plan, at::Tensor& out, const at::Tensor& query,
                   const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_tables,
                   double scale) {
  with_dtype(query.scalar_type(), "paged_attention", [&](auto zero) {
    using T = decltype(zero);
    const AttentionArgs<T> a(query, k_cache, v_cache, block_tables, scale, out);
    if (!plan.chunks.empty()) row_attention(a, plan.chunks);
    if (!plan.blocks.empty()) blocked_rows(a, plan.blocks);
    if (!plan.tiles.empty()) tiled_attention(a, plan.tiles, plan.splits, plan.num_partials);
  });
}

// query [T, Hq, D] (rows may be strided); k_cache, v_cache [num_blocks, block_size, Hkv, D];
// block_tables int32 [S, max_blocks]; query_start_loc int32 [S + 1]; context_lens int32 [S].
// Sequence s owns query rows query_start_loc[s] .. query_start_loc[s + 1], its last tokens; a token at
// position p attends to positions 0 .. p. Decode is the case of one row per sequence. Writes the rows of
// out [T, Hq, D] of every sequence except those with several queries and more than max_pairs
// query-key pairs (none when max_pairs is negative); returns those, which are left to the caller. A
// sequence of several queries with at least min_tile_lanes query vectors per kv head takes the tiled
// kernel where the build has one (kTileMinLanes when negative), the others the row kernel.
std::vector<int64_t> paged_attention_(at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache,
                                      const at::Tensor& v_cache, const at::Tensor& block_tables,
                                      const at::Tensor& query_start_loc, const at::Tensor& context_lens,
                                      double scale, int64_t max_pairs, int64_t min_tile_lanes) {
  check_attention(out, query, k_cache, v_cache);
  AttentionPlan plan = plan_attention(query.size(0), query.size(1), k_cache, block_tables, query_start_loc,
                                      context_lens, max_pairs, min_tile_lanes);
  run_attention(plan, out, query, k_cache, v_cache, block_tables, scale);
  return std::move(plan.skipped);
}

}  // namespace pagedserve::cpu
