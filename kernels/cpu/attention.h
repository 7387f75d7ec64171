// Paged attention, read in place from the block tables: attention.cpp plans a call (which sequences go to
// which kernel, in which tasks), attention_decode.cpp's row kernel computes decode rows and short chunks,
// attention_tiled.cpp's tiled kernel computes prompt chunks, and, batch-invariant, attention_decode.cpp's
// blocked rows compute long prompt chunks with the row kernel's arithmetic. All read the geometry below.

#pragma once

#include <ATen/core/Tensor.h>

#include <atomic>
#include <cstdint>
#include <limits>
#include <vector>

#include "vec.h"

namespace pagedserve::cpu {

// Batch invariance (common.h batch_invariant): every query row, a prompt's too, gets one arithmetic that
// reduces each row over its positions alone, in the same order and passes whatever the rows beside it: with
// AMX (invariant_tiles_fit) every row's tile products (blocked_rows), else the row kernel's (long prompt
// chunks through blocked_rows, which computes the same); a context longer than kInvariantPartTokens is split
// into parts of that many positions (from position 0), each row's parts merged in order, whatever the batch
// and the thread count.
constexpr int64_t kInvariantPartTokens = 512;
// Batch-invariant, a sequence of this many query rows or more (a prompt chunk) takes blocked_rows in blocks
// of up to kBlockedRows rows, where blocked_rows_fit; every sequence does, where invariant_tiles_fit.
constexpr int64_t kBlockedMinRows = 16;
constexpr int64_t kBlockedRows = 32;

// Consecutive query rows of one sequence (positions pos0 .. pos0 + len - 1, query rows row0 ..), computed
// together by the row kernel so that every K and V block is read once for all of them.
struct RowChunk {
  int64_t seq, row0, pos0, len;
};
constexpr int64_t kChunkRows = 8;

// Query vectors of one tiled task: the lanes of a few vectors (AVX-512: three of 16, 16 rows of a group of
// three query heads; AVX2: four of 8).
constexpr int64_t kTileLanes = vec::kLanes == 16 ? 48 : 32;
// Where the caller leaves the choice to the build (min_tile_lanes < 0), a sequence of several queries takes
// the tiled kernel from this many query vectors per kv head (see TILE_MIN_LANES in cpu_ops.py).
constexpr int64_t kTileMinLanes = vec::kLanes == 16 ? 16 : 32;
// Whether this build has the tiled kernel (every build with vectors; plain C++ has the row kernel alone),
// and whether it splits a tile's blocks into parts.
constexpr bool kHasTiles = vec::kLanes > 1;
constexpr bool kSplitTiles = vec::kLanes == 16;

// Consecutive query rows of one sequence and all query heads of one kv head: rows * group <= kTileLanes
// query vectors, lane = (row - row0) * group + head in group.
struct QueryTile {
  int64_t seq, kv_head, row0, pos0, rows;
  // The blocks of the sequence it visits, [block_begin, block_end) (clipped to those its rows see), and
  // where it leaves its unnormalised result when it is one part of a split tile (see TileSplit); -1: it
  // writes its rows' output itself.
  int64_t block_begin = 0, block_end = std::numeric_limits<int64_t>::max(), partial = -1;
};

// A tile whose blocks went to several tasks, as flash-decoding splits a long context: parts tasks, each
// leaving its lanes' running max, sum and unnormalised output in partial slots first_partial ..
// first_partial + parts - 1, merged into the tile's output once all are done.
struct TileSplit {
  QueryTile tile;
  int64_t first_partial, parts;
};

// How paged_attention_ computes a batch: its sequences' row chunks (the row kernel) and query tiles (the
// tiled kernel), and the sequences it leaves to the caller. It depends on the batch's metadata and the
// cache's shape alone, so a decoder computes it once for all its layers (see DecoderStack).
struct AttentionPlan {
  std::vector<RowChunk> chunks;
  std::vector<RowChunk> blocks;   // batch-invariant: long prompts' row blocks (blocked_rows)
  std::vector<QueryTile> tiles;   // the longest first
  std::vector<TileSplit> splits;  // the tiles whose blocks went to several of tiles
  int64_t num_partials = 0;
  std::vector<int64_t> skipped;
};

// The geometry and data of one attention call, as both kernels read them.
template <typename T>
struct AttentionArgs {
  AttentionArgs(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                const at::Tensor& block_tables, double scale, at::Tensor& out)
      : head_dim(query.size(2)),
        num_blocks(k_cache.size(0)),
        block_size(k_cache.size(1)),
        num_kv_heads(k_cache.size(2)),
        group(query.size(1) / num_kv_heads),
        table_width(block_tables.size(1)),
        table_stride(block_tables.stride(0)),
        q_stride(query.stride(0)),
        out_stride(out.stride(0)),
        row_stride(k_cache.stride(1)),
        head_stride(k_cache.stride(2)),
        block_stride(k_cache.stride(0)),
        q_ptr(query.data_ptr<T>()),
        k_ptr(k_cache.data_ptr<T>()),
        v_ptr(v_cache.data_ptr<T>()),
        tables(block_tables.data_ptr<int32_t>()),
        out_ptr(out.data_ptr<T>()),
        fscale(static_cast<float>(scale)) {}
  const int64_t head_dim, num_blocks, block_size, num_kv_heads, group, table_width, table_stride, q_stride,
      out_stride;
  // Elements between a kv head's rows of consecutive positions, between a position's consecutive kv heads,
  // and between blocks (see check_cache: every block's elements lie together).
  const int64_t row_stride, head_stride, block_stride;
  const T* q_ptr;
  const T* k_ptr;
  const T* v_ptr;
  const int32_t* tables;
  T* out_ptr;
  const float fscale;

  // Whether entry b of a block table, holding block, may be read: inside the cache and the table.
  bool valid_block(int64_t block, int64_t b) const {
    return block >= 0 && block < num_blocks && b < table_width;
  }
};

// The first bad block table entry the threads of a kernel met, reported once they are done.
struct BadBlock {
  std::atomic<bool> seen{false};
  std::atomic<int64_t> block{0};
  void report(int64_t id) {
    block.store(id);
    seen.store(true);
  }
  void check(int64_t num_blocks) const {
    TORCH_CHECK(!seen.load(), "block table entry ", block.load(), " is outside the cache (", num_blocks,
                " blocks) or past the table's width");
  }
};

// The row kernel (attention_decode.cpp) over a plan's chunks, and the tiled kernel (attention_tiled.cpp)
// over its tiles, for T = float, bf16 and fp16.
template <typename T>
void row_attention(const AttentionArgs<T>& a, const std::vector<RowChunk>& chunks);
// Batch-invariant, the row kernel's result for every row of long prompts' row blocks (consecutive rows of
// one sequence), the bits the row kernel gives each of them, at a fraction of its cost: each part of the
// context is laid out once for a block's rows (attention_decode.cpp). Where !blocked_rows_fit(k_cache) (not
// bf16 of head size 64 on AVX-512 BF16, or an odd block size) it hands them to the row kernel.
template <typename T>
void blocked_rows(const AttentionArgs<T>& a, const std::vector<RowChunk>& blocks);
bool blocked_rows_fit(const at::Tensor& k_cache);
// Batch-invariant with AMX tiles (bf16 of head size 64, AMX enabled): every row, a decode row too, takes
// blocked_rows, which computes them all on tiles in an arithmetic of its own (attention_invariant_amx.h)
// instead of the row kernel's, at about the tiled kernel's speed for a prompt.
bool invariant_tiles_fit(const at::Tensor& k_cache);
template <typename T>
void tiled_attention(const AttentionArgs<T>& a, const std::vector<QueryTile>& tasks,
                     const std::vector<TileSplit>& splits, int64_t num_partials);

// The plan of paged_attention_ for num_tokens query rows of num_heads heads against caches shaped like
// k_cache, with every check of the metadata.
AttentionPlan plan_attention(int64_t num_tokens, int64_t num_heads, const at::Tensor& k_cache,
                             const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                             const at::Tensor& context_lens, int64_t max_pairs, int64_t min_tile_lanes);
// The checks of paged_attention_'s tensors (its metadata is plan_attention's).
void check_attention(const at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache,
                     const at::Tensor& v_cache);
// A plan's chunks and tiles computed into out (the tensors checked by check_attention).
void run_attention(const AttentionPlan& plan, at::Tensor& out, const at::Tensor& query,
                   const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_tables,
                   double scale);

}  // namespace pagedserve::cpu
