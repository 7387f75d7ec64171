// The row kernel of paged attention: decode rows, and chunks of few queries. A task is a chunk of rows for a
// range of kv heads against a part of its sequence's context; its queries score every position they see,
// reading K and V in place block by block through the block table while a later block is prefetched, then
// the softmax and the weighted sum of V rows. Two passes, the scores kept between them.
//
// The products are one body over vec::Vec for every instruction set and dtype: a kv head's group of query
// vectors (kGroup at a time) against each K or V row loaded once for all of them, widened as it is loaded.
// Only AVX-512 BF16 reads bf16 rows its own way, with its dot product of bf16 pairs
// (attention_decode_bf16.h).
//
// Batch-invariant, long prompt chunks take the blocked rows (blocked_rows, at the end): the row kernel's
// sums for every row, from K and V laid out once per part for a block of rows; with AMX every row, decode
// rows too, takes the blocked rows' tiles instead (invariant_tiles_bf16_64), whose sums are not the row
// kernel's but are a row's own in a tile of one row as of many.

#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "attention.h"
#include "attention_decode_bf16.h"
#include "attention_invariant_amx.h"
#include "common.h"
#include "prefetch.h"
#include "vec.h"

namespace pagedserve::cpu {
namespace {

// The block this many blocks after the one computed is prefetched, a share a visit: one ahead comes in late
// where memory is slow to answer.
constexpr int64_t kFetchAhead = 2;

// Up to this many bytes of that block are prefetched at once before a visit (a prompt row's share); more (a
// decode row's) are shared out over the kernels' steps (see FetchShare).
constexpr int64_t kFetchBurstBytes = 1024;

// Most score floats a thread keeps between calls (256 KB).
constexpr size_t kKeptScores = 64 * 1024;

// With fewer chunks than threads (a lone sequence's decode row), a context of at least this many blocks a
// part is split into parts, one a thread, whose partial softmaxes are merged after, as flash-decoding does:
// splitting the kv heads instead leaves threads idle (3 heads on 2 threads run 2 against 1).
constexpr int64_t kMinPartBlocks = 8;

// Batch-invariant, parts of a fixed size instead: the part size in blocks (kInvariantPartTokens, whole
// blocks), each part's first block a multiple of it.
// Fewer parts than this many a thread, and each part's kv heads are tasks of their own.
constexpr int64_t kInvariantTasksPerThread = 4;

inline int64_t invariant_part_blocks(int64_t block_size) {
  return std::max<int64_t>(1, kInvariantPartTokens / block_size);
}

inline int64_t context_parts(int64_t used_blocks, int64_t num_chunks, int64_t threads, int64_t part_blocks) {
  if (part_blocks > 0) return (used_blocks + part_blocks - 1) / part_blocks;
  if (num_chunks >= threads) return 1;
  return std::max<int64_t>(1,
                           std::min(used_blocks / kMinPartBlocks, (threads + num_chunks - 1) / num_chunks));
}

// The rows of chunk `chunk`, for kv heads h0 .. h1, against the blocks [b0, b1) of its sequence. partial:
// where a part's results start in the partials buffer ([rows x query heads] weighted sums of head_dim
// floats, then as many maxima, then as many sums); -1 when the task covers the whole context and writes
// the output itself.
struct RowTask {
  int64_t chunk, h0, h1, b0, b1, partial;
};

// Query vectors of a kv head computed together (SmolLM2's group of three): each K and V row is loaded once
// for all of them.
constexpr int kGroup = 3;
// Vectors of head dims a values pass holds the sums of, for kGroup query vectors: their sums, kGroup
// weights and a row fill the registers (AVX-512: 3 x 8 + 4 of 32; AVX2: 3 x 4 + 4 of 16).
constexpr int kValueVectors = std::min(8, (vec::kRegisters - 1 - kGroup) / kGroup);

// out[g * out_stride + j] = q_g . row j for the G query vectors q_g (size floats apart, scaled) and the n
// rows (stride apart, of the cache's R, widened as they are loaded): four rows at a time, each row's
// products summed in the lanes and the four reduced together. With kFetch, the fetch_bytes at fetch are
// prefetched a share every four rows.
template <int G, typename R, bool kFetch>
void group_scores(const float* q, int64_t size, const R* rows, int64_t stride, int64_t n, float* out,
                  int64_t out_stride, const char* fetch, int64_t fetch_bytes) {
  using namespace vec;
  FetchShare ahead(fetch, kFetch ? fetch_bytes : 0, n / 4);
  const int64_t whole_size = whole(size), tail = size - whole_size;
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    if constexpr (kFetch) ahead.step();
    const R* r = rows + j * stride;
    Vec acc[G][4];
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) acc[g][0] = acc[g][1] = acc[g][2] = acc[g][3] = zero();
    const auto products = [&](int64_t d, int64_t lanes) __attribute__((always_inline)) {
      Vec qv[G];
#pragma GCC unroll 4
      for (int g = 0; g < G; ++g) {
        qv[g] = lanes == kLanes ? load(q + g * size + d) : load_n(q + g * size + d, lanes);
        keep_in_register(qv[g]);  // else 4G loads of q beside the rows' 4 instead of G
      }
#pragma GCC unroll 4
      for (int p = 0; p < 4; ++p) {
        const Vec k = lanes == kLanes ? load(r + p * stride + d) : load_n(r + p * stride + d, lanes);
#pragma GCC unroll 4
        for (int g = 0; g < G; ++g) acc[g][p] = fma(qv[g], k, acc[g][p]);
      }
    };
    for (int64_t d = 0; d < whole_size; d += kLanes) products(d, kLanes);
    if (tail > 0) products(whole_size, tail);
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g)
      store_sums4(out + g * out_stride + j, acc[g][0], acc[g][1], acc[g][2], acc[g][3]);
  }
  if constexpr (kFetch) ahead.rest();
  for (; j < n; ++j) {  // the last rows of a block, widened into a thread's buffer
    thread_local std::vector<float> wide;
    wide.resize(size);
    load_row(rows + j * stride, wide.data(), size);
    for (int g = 0; g < G; ++g) out[g * out_stride + j] = dot(q + g * size, wide.data(), size);
  }
}

// acc_g[0 .. C kLanes) += sum over j < n of w[g * w_stride + j] * row j[0 .. C kLanes) for the G query
// vectors (acc_g size floats apart), the sums held in registers over the block's rows; with kTail, C is 1
// and covers the head's last `tail` dims. The fetch_bytes at fetch are prefetched a share a row.
template <int G, int C, typename R, bool kFetch, bool kTail>
void group_values(float* acc, int64_t size, const float* w, int64_t w_stride, const R* rows, int64_t stride,
                  int64_t n, int64_t tail, const char* fetch, int64_t fetch_bytes) {
  using namespace vec;
  static_assert(!kTail || C == 1);
  FetchShare ahead(fetch, kFetch ? fetch_bytes : 0, n);
  Vec a[G][C];
#pragma GCC unroll 4
  for (int g = 0; g < G; ++g)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c)
      a[g][c] = kTail ? load_n(acc + g * size, tail) : load(acc + g * size + kLanes * c);
  for (int64_t j = 0; j < n; ++j) {
    if constexpr (kFetch) ahead.step();
    Vec wj[G];
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) wj[g] = set1(w[g * w_stride + j]);
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      const R* row = rows + j * stride + kLanes * c;
      const Vec v = kTail ? load_n(row, tail) : load(row);
#pragma GCC unroll 4
      for (int g = 0; g < G; ++g) a[g][c] = fma(wj[g], v, a[g][c]);
    }
  }
  if constexpr (kFetch) ahead.rest();
#pragma GCC unroll 4
  for (int g = 0; g < G; ++g)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      if constexpr (kTail)
        store_n(acc + g * size, a[g][c], tail);
      else
        store(acc + g * size + kLanes * c, a[g][c]);
    }
}

template <typename R>
using ScoresFn = void (*)(const float*, int64_t, const R*, int64_t, int64_t, float*, int64_t, const char*,
                          int64_t);
template <typename R>
using ValuesFn = void (*)(float*, int64_t, const float*, int64_t, const R*, int64_t, int64_t, int64_t,
                          const char*, int64_t);

// [fetch][G - 1]
template <typename R, int... G>
constexpr std::array<std::array<ScoresFn<R>, sizeof...(G)>, 2> scores_table(
    std::integer_sequence<int, G...>) {
  return {{{&group_scores<G + 1, R, false>...}, {&group_scores<G + 1, R, true>...}}};
}
// [fetch][G - 1][log2 C]: C = 1, 2, 4, 8 vectors of head dims, then the tail's.
template <typename R, int C, int... G>
constexpr std::array<std::array<ValuesFn<R>, sizeof...(G)>, 2> values_table(
    std::integer_sequence<int, G...>) {
  return {{{&group_values<G + 1, C, R, false, false>...}, {&group_values<G + 1, C, R, true, false>...}}};
}
template <typename R, int... G>
constexpr std::array<std::array<ValuesFn<R>, sizeof...(G)>, 2> tail_table(std::integer_sequence<int, G...>) {
  return {{{&group_values<G + 1, 1, R, false, true>...}, {&group_values<G + 1, 1, R, true, true>...}}};
}

// The scores of `vectors` query vectors of one kv head (q_g at q + g * size), kGroup at a time, with the
// `fetch_bytes` at fetch prefetched: at once where they are few, else a share every four rows of the first
// run.
template <typename R>
void head_scores(const float* q, int64_t vectors, int64_t size, const R* rows, int64_t stride, int64_t n,
                 float* out, int64_t out_stride, const char* fetch, int64_t fetch_bytes) {
  static constexpr auto kFns = scores_table<R>(std::make_integer_sequence<int, kGroup>{});
  if (fetch_bytes <= kFetchBurstBytes) prefetch(fetch, fetch_bytes), fetch_bytes = 0;
  for (int64_t g = 0; g < vectors; g += kGroup, fetch_bytes = 0) {
    const int64_t count = std::min<int64_t>(kGroup, vectors - g);
    kFns[fetch_bytes > 0][count - 1](q + g * size, size, rows, stride, n, out + g * out_stride, out_stride,
                                     fetch, fetch_bytes);
  }
}

// The weighted V rows of `vectors` query vectors of one kv head (acc_g at acc + g * size, their weights at
// w + g * w_stride), kGroup at a time and up to kValueVectors vectors of head dims a pass, the first run's
// passes each prefetching their share of the fetch_bytes at fetch.
template <typename R>
void head_values(float* acc, int64_t vectors, int64_t size, const float* w, int64_t w_stride, const R* rows,
                 int64_t stride, int64_t n, const char* fetch, int64_t fetch_bytes) {
  static constexpr auto kSeq = std::make_integer_sequence<int, kGroup>{};
  static constexpr std::array<std::array<std::array<ValuesFn<R>, kGroup>, 2>, 4> kFns = {
      values_table<R, 1>(kSeq), values_table<R, 2>(kSeq), values_table<R, 4>(kSeq), values_table<R, 8>(kSeq)};
  static constexpr auto kTail = tail_table<R>(kSeq);
  if (fetch_bytes <= kFetchBurstBytes) prefetch(fetch, fetch_bytes), fetch_bytes = 0;
  const int64_t whole_size = vec::whole(size);
  for (int64_t g = 0; g < vectors; g += kGroup) {
    const int64_t count = std::min<int64_t>(kGroup, vectors - g);
    for (int64_t d = 0; d < size;) {
      // The pass's share of the fetch: as many lines as its dims are of the dims left.
      const int64_t left = whole_size - d;
      int log2c = 0;
      while (log2c < 3 && (vec::kLanes << (log2c + 1)) <= left && (2 << log2c) <= kValueVectors) ++log2c;
      const int64_t dims = left > 0 ? vec::kLanes << log2c : size - d;
      const int64_t share =
          fetch_bytes > 0
              ? std::min(fetch_bytes, ((fetch_bytes + 63) / 64 * dims + size - d - 1) / (size - d) * 64)
              : 0;
      const auto fn = left > 0 ? kFns[log2c][share > 0][count - 1] : kTail[share > 0][count - 1];
      fn(acc + g * size + d, size, w + g * w_stride, w_stride, rows + d, stride, n, size - d, fetch, share);
      fetch += share, fetch_bytes -= share, d += dims;
    }
  }
}

// out[0 .. n) = acc[0 .. n) * scale, rounded to T.
template <typename T>
void store_scaled(T* out, const float* acc, float scale, int64_t n) {
  using namespace vec;
  const Vec s = set1(scale);
  int64_t d = 0;
  for (; d < whole(n); d += kLanes) store(out + d, mul(load(acc + d), s));
  if (d < n) store_n(out + d, mul(load_n(acc + d, n - d), s), n - d);
}

// exp(s - max(s)) in place over n scores; returns their sum (softmax without the division), and the max in
// *max_out if given.
float exp_shifted_sum(float* s, int64_t n, float* max_out = nullptr) {
  using namespace vec;
  const int64_t whole_n = whole(n), tail = n - whole_n;
  Vec vmax = set1(-std::numeric_limits<float>::infinity());
  for (int64_t i = 0; i < whole_n; i += kLanes) vmax = max(vmax, load(s + i));
  float top = reduce_max(vmax);
  for (int64_t i = whole_n; i < n; ++i) top = std::max(top, s[i]);
  if (max_out != nullptr) *max_out = top;
  // exp(s - max), stored and summed in one pass.
  const Vec shift = set1(top);
  Vec sum = zero();
  for (int64_t i = 0; i < whole_n; i += kLanes) {
    const Vec e = exp(sub(load(s + i), shift));
    store(s + i, e);
    sum = add(sum, e);
  }
  if (tail > 0) {
    const Vec e = select(first_lanes(tail), exp(sub(load_n(s + whole_n, tail), shift)), zero());
    store_n(s + whole_n, e, tail);
    sum = add(sum, e);
  }
  return reduce_add(sum);
}

// One query vector's parts of its context merged, as flash-decoding merges them: part p's maximum score at
// max_p[p * stride], its sum of exponentials at sum_p[p * stride] (0: the row ends before the part) and its
// unnormalised output at acc[p * stride ..], rescaled to the common maximum, summed in part order and
// normalised into out (head_dim values, sum_v head_dim floats of scratch). One body (never inlined) for the
// row kernel and the blocked rows, so that both round alike.
template <typename T>
__attribute__((noinline)) void merge_parts(const float* acc, const float* max_p, const float* sum_p,
                                           int64_t stride, int64_t count, int64_t head_dim, float* sum_v,
                                           T* out) {
  float max = -std::numeric_limits<float>::infinity();
  for (int64_t p = 0; p < count; ++p) max = std::max(max, max_p[p * stride]);
  std::fill(sum_v, sum_v + head_dim, 0.f);
  float total = 0.f;
  for (int64_t p = 0; p < count; ++p) {
    const float sum = sum_p[p * stride];
    if (sum == 0.f) continue;  // the row ends before this part
    const float w = std::exp(max_p[p * stride] - max);
    total += sum * w;
    const float* part = acc + p * stride;
    for (int64_t d = 0; d < head_dim; ++d) sum_v[d] += part[d] * w;
  }
  store_scaled(out, sum_v, 1.f / total, head_dim);
}

}  // namespace

template <typename T>
void row_attention(const AttentionArgs<T>& a, const std::vector<RowChunk>& chunks) {
  const int64_t block_bytes = a.block_stride * static_cast<int64_t>(sizeof(T));
  const int threads = std::max(1, at::get_num_threads());
  const int64_t num_chunks = static_cast<int64_t>(chunks.size()), num_heads = a.num_kv_heads * a.group;
  const auto used_blocks = [&](const RowChunk& c) {
    return (c.pos0 + c.len + a.block_size - 1) / a.block_size;
  };
  // A task is a chunk and a range of kv heads: all of them, unless there are fewer chunks than threads; then
  // long contexts are split into parts (see context_parts) and the others split their kv heads.
  const int64_t splits = std::min<int64_t>(a.num_kv_heads, (threads + num_chunks - 1) / num_chunks);
  const int64_t heads_per_task = (a.num_kv_heads + splits - 1) / splits;
  // The parts, each chunk's side by side, and where each split chunk's first part is; empty but for a
  // long context among fewer chunks than threads.
  std::vector<RowTask> parts;
  std::vector<int64_t> merges;
  int64_t partial_floats = 0;
  const int64_t part_blocks = batch_invariant() ? invariant_part_blocks(a.block_size) : 0;
  int64_t total_parts = 0;
  for (const RowChunk& c : chunks)
    total_parts += context_parts(used_blocks(c), num_chunks, threads, part_blocks);
  const bool any_split = total_parts > num_chunks;
  // Batch-invariant, the parts are fixed by the context alone, however few the chunks: where they are too
  // few tasks to keep every thread busy (a lone decode row), each part's kv heads become tasks of their own.
  // A kv head's sums are its own whichever task computes them, so this changes no bits.
  const int64_t part_heads =
      part_blocks > 0 && threads > 1 && total_parts < kInvariantTasksPerThread * threads ? 1 : a.num_kv_heads;
  for (int64_t k = 0; k < num_chunks && any_split; ++k) {
    const RowChunk& c = chunks[k];
    const int64_t blocks = used_blocks(c), n = context_parts(blocks, num_chunks, threads, part_blocks);
    // Part p's first block: a fixed multiple of part_blocks, or an even share of the context.
    const auto part_begin = [&](int64_t p) {
      return p == n ? blocks : part_blocks > 0 ? p * part_blocks : blocks * p / n;
    };
    for (int64_t h0 = 0; h0 < a.num_kv_heads; h0 += part_heads) {
      const int64_t h1 = std::min(a.num_kv_heads, h0 + part_heads);
      if (n > 1) merges.push_back(static_cast<int64_t>(parts.size()));
      for (int64_t p = 0; p < n; ++p) {
        parts.push_back({k, h0, h1, part_begin(p), part_begin(p + 1), n > 1 ? partial_floats : -1});
        if (n > 1) partial_floats += c.len * (h1 - h0) * a.group * (a.head_dim + 2);
      }
    }
  }
  std::vector<float> partials(partial_floats);
  const int64_t num_tasks = parts.empty() ? num_chunks * splits : static_cast<int64_t>(parts.size());
  const auto task_at = [&](int64_t task) -> RowTask {
    if (!parts.empty()) return parts[task];
    const int64_t h0 = task % splits * heads_per_task;
    return {task / splits,
            h0,
            std::min(a.num_kv_heads, h0 + heads_per_task),
            0,
            used_blocks(chunks[task / splits]),
            -1};
  };
  BadBlock bad;
  // On AVX-512 BF16, bf16 scores and values straight from the cache with its bf16 dot product where the head
  // size allows (the query read as bf16 too); everything else through the vector layer's kernels above.
#if defined(__AVX512BF16__)
  constexpr bool kBf16 = std::is_same_v<T, c10::BFloat16>;
  const bool raw_scores = kBf16 && bf16dot::has_bf16_scores(a.head_dim);
  const bool raw_values = kBf16 && bf16dot::has_bf16_values(a.head_dim);
#else
  const bool raw_scores = false;
#endif

#pragma omp parallel num_threads(static_cast<int>(std::min<int64_t>(threads, num_tasks)))
  {
    const int64_t max_q = kChunkRows * num_heads;  // query vectors of one task, at most
    // Each thread's buffers outlive the call: a decode step calls this once per layer.
    thread_local std::vector<float> q, acc, inv_sum, scores;
    q.resize(std::max<size_t>(q.size(), max_q * a.head_dim));
    acc.resize(std::max<size_t>(acc.size(), max_q * a.head_dim));
    inv_sum.resize(std::max<size_t>(inv_sum.size(), max_q));
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < num_tasks; ++task) {
      const RowTask tk = task_at(task);
      const RowChunk& c = chunks[tk.chunk];
      const int64_t nq = (tk.h1 - tk.h0) * a.group;
      const int32_t* table = a.tables + c.seq * a.table_stride;
      const int64_t span = c.pos0 + c.len;  // positions the last row sees
      // The part's positions, k0 .. k1; vector v = i * nq + r (row i's query head r) scores them from
      // v * part_len.
      const int64_t k0 = tk.b0 * a.block_size, k1 = std::min(span, tk.b1 * a.block_size), part_len = k1 - k0;
      for (int64_t i = 0; i < c.len && !raw_scores; ++i) {  // raw scores read the bf16 query itself
        const T* q_row = a.q_ptr + (c.row0 + i) * a.q_stride + tk.h0 * a.group * a.head_dim;
        for (int64_t e = 0; e < nq * a.head_dim; ++e)
          q[i * nq * a.head_dim + e] = static_cast<float>(q_row[e]) * a.fscale;
      }
      scores.resize(std::max<size_t>(scores.size(), c.len * nq * part_len));

      // Walks the part's blocks of one cache, calling visit(v, rows, first, n, fetch, fetch_bytes) for every
      // row that sees n > 0 of the block's positions and every kv head: v is the first of the head's group of
      // query vectors (the group is v .. v + group - 1), rows the head's rows in the cache (row_stride
      // apart), first the block's first position. The block kFetchAhead on (past the last ones, `then`'s
      // first: the V walk follows the K walk) is prefetched a slice a visit, which the visit prefetches (see
      // FetchShare); the blocks between are prefetched whole as the K walk starts. False at a block id
      // outside the cache.
      const auto ahead_of = [&](const T* cache, const T* then, int64_t b) -> const char* {
        if (b >= tk.b1) {  // into `then`'s blocks
          if (then == nullptr) return nullptr;
          cache = then, b = tk.b0 + (b - tk.b1);
        }
        if (b >= tk.b1 || !a.valid_block(table[b], b)) return nullptr;
        return reinterpret_cast<const char*>(cache + table[b] * a.block_stride);
      };
      const auto walk = [&](const T* cache, const T* then, auto&& visit) {
        for (int64_t b = tk.b0; b < tk.b1; ++b) {
          const int64_t block = table[b];
          if (!a.valid_block(block, b)) {
            bad.report(block);
            return false;
          }
          if (b == tk.b0 && then != nullptr)
            for (int64_t e = 1; e < kFetchAhead; ++e)
              if (const char* between = ahead_of(cache, then, b + e)) prefetch_l2(between, block_bytes);
          const char* ahead = ahead_of(cache, then, b + kFetchAhead);
          const int64_t first = b * a.block_size, end = std::min(a.block_size, span - first);
          const int64_t i0 = std::max<int64_t>(0, first - c.pos0);
          const int64_t visits = (c.len - i0) * (tk.h1 - tk.h0);
          const int64_t slice = (block_bytes / 64 + visits - 1) / visits * 64;
          int64_t fetched = 0;
          const T* raw = cache + block * a.block_stride + tk.h0 * a.head_stride;
          for (int64_t i = i0; i < c.len; ++i) {
            const int64_t n = std::min(end, c.pos0 + i + 1 - first);  // positions of this block row i sees
            for (int64_t kh = 0; kh < tk.h1 - tk.h0; ++kh) {
              const int64_t fetch =
                  ahead != nullptr ? std::max<int64_t>(0, std::min(slice, block_bytes - fetched)) : 0;
              visit(i * nq + kh * a.group, raw + kh * a.head_stride, first - k0, n,
                    ahead == nullptr ? nullptr : ahead + fetched, fetch);
              fetched += fetch;
            }
          }
        }
        return true;
      };
      const bool valid = walk(
          a.k_ptr, a.v_ptr,
          [&](int64_t v0, const T* k_rows, int64_t first, int64_t n, const char* fetch, int64_t fetch_bytes) {
#if defined(__AVX512BF16__)
            if constexpr (kBf16) {
              if (raw_scores) {
                if (fetch_bytes <= kFetchBurstBytes) prefetch(fetch, fetch_bytes), fetch_bytes = 0;
                const T* q_raw =
                    a.q_ptr + (c.row0 + v0 / nq) * a.q_stride + (tk.h0 * a.group + v0 % nq) * a.head_dim;
                return bf16dot::group_scores(q_raw, a.group, k_rows, a.row_stride, n, a.head_dim, a.fscale,
                                             &scores[v0 * part_len + first], part_len, fetch, fetch_bytes);
              }
            }
#endif
            head_scores(&q[v0 * a.head_dim], a.group, a.head_dim, k_rows, a.row_stride, n,
                        &scores[v0 * part_len + first], part_len, fetch, fetch_bytes);
          });
      // A part's maxima and sums go to the partials buffer, after its weighted sums.
      float* const part_acc = tk.partial < 0 ? nullptr : partials.data() + tk.partial;
      float* const part_max = part_acc == nullptr ? nullptr : part_acc + c.len * nq * a.head_dim;
      float* const part_sum = part_max == nullptr ? nullptr : part_max + c.len * nq;
      if (!valid) {  // reported after the threads are done; the merge meanwhile reads an empty part
        if (part_sum != nullptr) std::fill(part_sum, part_sum + c.len * nq, 0.f);
        continue;
      }
      for (int64_t i = 0; i < c.len; ++i) {
        const int64_t visible = std::min(k1, c.pos0 + i + 1) - k0;  // none: the row ends before the part
        for (int64_t r = 0; r < nq; ++r) {
          const int64_t v = i * nq + r;
          if (part_acc == nullptr) {
            inv_sum[v] = 1.f / exp_shifted_sum(&scores[v * part_len], visible);
          } else if (visible > 0) {
            part_sum[v] = exp_shifted_sum(&scores[v * part_len], visible, &part_max[v]);
          } else {
            part_sum[v] = 0.f, part_max[v] = -std::numeric_limits<float>::infinity();
          }
        }
      }
      float* const sums = part_acc == nullptr ? acc.data() : part_acc;
      std::fill(sums, sums + c.len * nq * a.head_dim, 0.f);
      walk(
          a.v_ptr, nullptr,
          [&](int64_t v0, const T* v_rows, int64_t first, int64_t n, const char* fetch, int64_t fetch_bytes) {
#if defined(__AVX512BF16__)
            if constexpr (kBf16) {
              if (raw_values) {
                if (fetch_bytes <= kFetchBurstBytes) prefetch(fetch, fetch_bytes), fetch_bytes = 0;
                return bf16dot::accumulate_group_bf16(&sums[v0 * a.head_dim], &scores[v0 * part_len + first],
                                                      part_len, a.group, v_rows, a.row_stride, n, a.head_dim,
                                                      fetch, fetch_bytes);
              }
            }
#endif
            head_values(&sums[v0 * a.head_dim], a.group, a.head_dim, &scores[v0 * part_len + first], part_len,
                        v_rows, a.row_stride, n, fetch, fetch_bytes);
          });
      if (part_acc == nullptr)
        for (int64_t i = 0; i < c.len; ++i)
          for (int64_t r = 0; r < nq; ++r)
            store_scaled(a.out_ptr + (c.row0 + i) * a.out_stride + (tk.h0 * a.group + r) * a.head_dim,
                         &acc[(i * nq + r) * a.head_dim], inv_sum[i * nq + r], a.head_dim);
    }
    // The split chunks: each query vector's parts rescaled to their common max, summed and normalised.
#pragma omp for schedule(static)
    for (int64_t m = 0; m < static_cast<int64_t>(merges.size()); ++m) {
      const int64_t first = merges[m];
      const RowTask& t0 = parts[first];
      const RowChunk& c = chunks[t0.chunk];
      int64_t count = 1;  // the parts of the chunk's kv heads h0 .. h1, side by side in the buffer too
      while (first + count < num_tasks && parts[first + count].chunk == t0.chunk &&
             parts[first + count].h0 == t0.h0)
        ++count;
      const int64_t nq = (t0.h1 - t0.h0) * a.group, vectors = c.len * nq;
      const int64_t part_floats = vectors * (a.head_dim + 2);
      const float* const part0 = partials.data() + parts[first].partial;
      for (int64_t v = 0; v < vectors; ++v)
        merge_parts(part0 + v * a.head_dim, part0 + vectors * a.head_dim + v,
                    part0 + vectors * (a.head_dim + 1) + v, part_floats, count, a.head_dim, acc.data(),
                    a.out_ptr + (c.row0 + v / nq) * a.out_stride + (t0.h0 * a.group + v % nq) * a.head_dim);
    }
    // The scores of a long prompt's rows (up to rows x heads x context floats) are not kept.
    if (scores.size() > kKeptScores) std::vector<float>().swap(scores);
  }
  bad.check(a.num_blocks);
}

namespace {

#if defined(__AVX512BF16__)
// blocked_rows for bf16 and head size 64 (see blocked_rows_fit). A task is a block of rows and a kv head;
// it walks its sequence's parts in order (kInvariantPartTokens positions, the row kernel's), lays each part's
// K out transposed and its V paired once for all its rows (bf16dot::transpose_k_64, pair_v_64), then gives
// each row that sees the part the row kernel's scores, softmax pass and weighted sum over the positions it
// sees, and finally merges each row's parts as the row kernel merges them (a row seeing one part: the same
// bits as the row kernel's unsplit result, the merge of one part rescaling by exp(0) = 1).
void blocked_rows_bf16_64(const AttentionArgs<c10::BFloat16>& a, const std::vector<RowChunk>& blocks) {
  using bf16 = c10::BFloat16;
  constexpr int64_t kSize = 64, kStride = kSize + 2;  // a part's floats: the output's sums, max, sum
  const int64_t part_tokens = invariant_part_blocks(a.block_size) * a.block_size;
  const int64_t num_blocks = static_cast<int64_t>(blocks.size()), num_tasks = num_blocks * a.num_kv_heads;
  const int threads = std::max(1, at::get_num_threads());
  BadBlock bad;
#pragma omp parallel num_threads(static_cast<int>(std::min<int64_t>(threads, num_tasks)))
  {
    thread_local std::vector<__m512i> kt, vp;
    thread_local std::vector<float> scores, partials, sum_v;
    const int64_t groups16 = (part_tokens + 15) / 16;
    kt.resize(groups16 * 32);
    vp.resize(groups16 * 8 * 4);
    scores.resize(a.group * groups16 * 16);
    sum_v.resize(kSize);
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < num_tasks; ++task) {
      // The last blocks first: their rows see the most positions.
      const RowChunk& c = blocks[num_blocks - 1 - task / a.num_kv_heads];
      const int64_t h = task % a.num_kv_heads;
      const int32_t* table = a.tables + c.seq * a.table_stride;
      const int64_t span = c.pos0 + c.len, used = (span + a.block_size - 1) / a.block_size;
      bool valid = true;
      for (int64_t b = 0; b < used && valid; ++b)
        if (!a.valid_block(table[b], b)) bad.report(table[b]), valid = false;
      if (!valid) continue;
      const auto row_of = [&](const bf16* cache, int64_t pos) {
        return cache + table[pos / a.block_size] * a.block_stride + pos % a.block_size * a.row_stride +
               h * a.head_stride;
      };
      const int64_t num_parts = (span + part_tokens - 1) / part_tokens;
      partials.resize(std::max<size_t>(partials.size(), c.len * a.group * num_parts * kStride));
      // Row i's query vector g, part p: partials[((i * group + g) * num_parts + p) * kStride ..].
      for (int64_t p = 0; p < num_parts; ++p) {
        const int64_t p0 = p * part_tokens, n = std::min(span, p0 + part_tokens) - p0;
        for (int64_t j0 = 0; j0 < n; j0 += 16) {
          const bf16* rows[16];
          for (int64_t j = 0; j < 16; ++j) rows[j] = j0 + j < n ? row_of(a.k_ptr, p0 + j0 + j) : nullptr;
          bf16dot::transpose_k_64(rows, &kt[j0 * 2]);
        }
        for (int64_t j = 0; j + 1 < n; j += 2)
          bf16dot::pair_v_64(row_of(a.v_ptr, p0 + j), row_of(a.v_ptr, p0 + j + 1), &vp[j * 2]);
        for (int64_t i = std::max<int64_t>(0, p0 - c.pos0); i < c.len; ++i) {
          const int64_t visible = std::min(n, c.pos0 + i + 1 - p0);
          const bf16* q = a.q_ptr + (c.row0 + i) * a.q_stride + h * a.group * kSize;
          const int64_t s_stride = groups16 * 16;
          for (int64_t g = 0; g < a.group;) {
            const int64_t run = std::min<int64_t>(3, a.group - g);
            float* out = &scores[g * s_stride];
            if (run == 3)
              bf16dot::transposed_scores_64<3>(q + g * kSize, kt.data(), visible, a.fscale, out, s_stride);
            else if (run == 2)
              bf16dot::transposed_scores_64<2>(q + g * kSize, kt.data(), visible, a.fscale, out, s_stride);
            else
              bf16dot::transposed_scores_64<1>(q + g * kSize, kt.data(), visible, a.fscale, out, s_stride);
            g += run;
          }
          float* const part = &partials[(i * a.group * num_parts + p) * kStride];
          const int64_t v_stride = num_parts * kStride;  // between a row's query vectors
          for (int64_t g = 0; g < a.group; ++g)
            part[g * v_stride + kSize + 1] =
                exp_shifted_sum(&scores[g * s_stride], visible, &part[g * v_stride + kSize]);
          const bf16* last = row_of(a.v_ptr, p0 + visible - 1);
          for (int64_t g = 0; g < a.group;) {
            const int64_t run = std::min<int64_t>(3, a.group - g);
            const float* w = &scores[g * s_stride];
            // acc of vector g + r at part + (g + r) * v_stride: one run's vectors apart by v_stride, so
            // computed into a contiguous scratch and copied.
            alignas(64) float acc[3 * kSize];
            if (run == 3)
              bf16dot::paired_values_64<3>(w, s_stride, visible, vp.data(), last, acc);
            else if (run == 2)
              bf16dot::paired_values_64<2>(w, s_stride, visible, vp.data(), last, acc);
            else
              bf16dot::paired_values_64<1>(w, s_stride, visible, vp.data(), last, acc);
            for (int64_t r = 0; r < run; ++r)
              std::copy(acc + r * kSize, acc + (r + 1) * kSize, part + (g + r) * v_stride);
            g += run;
          }
        }
      }
      for (int64_t i = 0; i < c.len; ++i) {
        const int64_t seen = (c.pos0 + i) / part_tokens + 1;  // the parts row i sees
        for (int64_t g = 0; g < a.group; ++g) {
          const float* base = &partials[((i * a.group + g) * num_parts) * kStride];
          merge_parts(base, base + kSize, base + kSize + 1, kStride, seen, kSize, sum_v.data(),
                      a.out_ptr + (c.row0 + i) * a.out_stride + (h * a.group + g) * kSize);
        }
      }
    }
  }
  bad.check(a.num_blocks);
}
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
// Batch-invariant with AMX, every row of bf16 and head size 64 (see invariant_tiles_fit): a task is a block
// of rows (a decode row alone, or up to kBlockedRows rows of a prompt), a kv head and one of the parts of
// kInvariantPartTokens positions its rows see. It lays the part's K out transposed and its V paired once for
// its rows, then, 16 query vectors at a time (a row's group of query heads, row after row), computes their
// scores on tiles, each vector's softmax over the positions it sees (the weights rounded to bf16, zero past
// them) and its output on tiles (invariant_amx: why each vector's sums are its own, whatever the tile's
// other vectors). Past its visible positions a vector's weights are zero and the V rows past the sequence
// zero, so the tiles a prompt row shares with later rows add exact zeros: its output is the one its decode
// step computes. Each row's parts are merged after, in order (merge_parts).
void invariant_tiles_bf16_64(const AttentionArgs<c10::BFloat16>& a, const std::vector<RowChunk>& blocks) {
  using bf16 = c10::BFloat16;
  namespace tiles = invariant_amx;
  constexpr int64_t kSize = 64, kStride = kSize + 2;  // a part's floats: the output's sums, max, sum
  const int64_t part_tokens = invariant_part_blocks(a.block_size) * a.block_size;
  // A part's room in positions: whole steps of the score tiles (four runs of 16).
  const int64_t room =
      (part_tokens + 4 * tiles::kScoreRun - 1) / (4 * tiles::kScoreRun) * 4 * tiles::kScoreRun;
  const int64_t num_blocks = static_cast<int64_t>(blocks.size()), group = a.group;
  // The tasks, the most work first (they are handed out dynamically), and where each block's partials start:
  // block b's row i, query head h * group + g, part p at first[b] + ((h * len + i) * group + g) * parts + p
  // (kStride floats each).
  // A task's kv heads h0 .. h1: all of them where the blocks' parts are tasks enough to keep the threads busy
  // (a block's K and V rows of every head are read together), else one.
  struct Task {
    int64_t block, h0, h1, part, work;
  };
  const int threads = std::max(1, at::get_num_threads());
  std::vector<int64_t> first(num_blocks + 1, 0);
  int64_t block_parts = 0;
  for (int64_t b = 0; b < num_blocks; ++b) {
    const int64_t parts = (blocks[b].pos0 + blocks[b].len + part_tokens - 1) / part_tokens;
    first[b + 1] = first[b] + a.num_kv_heads * blocks[b].len * group * parts * kStride;
    block_parts += parts;
  }
  // A long prompt's partials (every row's parts of every head) would take a lot of memory at once: its
  // blocks go in calls of at most kMaxPartials floats each (any one block alone), which changes no row's
  // sums.
  constexpr int64_t kMaxPartials = 4 << 20;
  if (num_blocks > 1 && first[num_blocks] > kMaxPartials) {
    for (int64_t b0 = 0, b1; b0 < num_blocks; b0 = b1) {
      for (b1 = b0 + 1; b1 < num_blocks && first[b1 + 1] - first[b0] <= kMaxPartials;) ++b1;
      invariant_tiles_bf16_64(a, std::vector<RowChunk>(blocks.begin() + b0, blocks.begin() + b1));
    }
    return;
  }
  const int64_t task_heads = block_parts >= kInvariantTasksPerThread * threads ? a.num_kv_heads : 1;
  std::vector<Task> tasks;
  for (int64_t b = 0; b < num_blocks; ++b) {
    const RowChunk& c = blocks[b];
    const int64_t span = c.pos0 + c.len;
    for (int64_t p = 0; p * part_tokens < span; ++p) {
      const int64_t p0 = p * part_tokens, n = std::min(span, p0 + part_tokens) - p0;
      const int64_t rows = c.pos0 + c.len - std::max(c.pos0, p0);
      for (int64_t h = 0; h < a.num_kv_heads; h += task_heads)
        tasks.push_back({b, h, std::min(a.num_kv_heads, h + task_heads), p, n * (rows + 8) * task_heads});
    }
  }
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& x, const Task& y) { return x.work > y.work; });
  // The partials outlive the call (not zeroed: every slot a merge reads is written first).
  static thread_local std::vector<float> partials;
  partials.resize(std::max<size_t>(partials.size(), first[num_blocks]));
  float* const partial0 = partials.data();
  const int64_t num_tasks = static_cast<int64_t>(tasks.size());
  alignas(64) static const bf16 kZeros[kSize] = {};
  BadBlock bad;
#pragma omp parallel num_threads(static_cast<int>(std::min<int64_t>(threads, num_tasks)))
  {
    _tile_loadconfig(&tiles::kTiles);
    // kt, vp: the part's K transposed and V paired; qa: 16 query vectors; s, w: their scores and weights;
    // out: their output.
    thread_local std::vector<__m512i> kt, vp;
    thread_local std::vector<bf16> qa, w;
    thread_local std::vector<float> s, out, sum_v;
    thread_local std::vector<const bf16*> k_rows, v_rows;
    k_rows.resize(part_tokens);
    v_rows.resize(part_tokens);
    kt.resize(room * 2);
    vp.resize(room * 2);
    qa.resize(16 * kSize);
    w.resize(16 * room);
    s.resize(16 * room);
    out.resize(16 * kSize);
    sum_v.resize(kSize);
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < num_tasks; ++task) {
      const Task& tk = tasks[task];
      const RowChunk& c = blocks[tk.block];
      const int64_t span = c.pos0 + c.len, parts = (span + part_tokens - 1) / part_tokens;
      const int32_t* table = a.tables + c.seq * a.table_stride;
      const int64_t p0 = tk.part * part_tokens, n = std::min(span, p0 + part_tokens) - p0;
      bool valid = true;
      for (int64_t b = p0 / a.block_size; b <= (p0 + n - 1) / a.block_size && valid; ++b)
        if (!a.valid_block(table[b], b)) bad.report(table[b]), valid = false;
      if (!valid) continue;
      for (int64_t h = tk.h0; h < tk.h1; ++h) {
        // The part's K and V rows (kv head h), block by block. They lie anywhere in the pool: where K is
        // transposed, K's rows are fetched kFetchRows positions ahead and V's meanwhile, for the pairing
        // after; a tile of one row's vectors reads them as the hardware fetches them (prefetches there cost
        // more than they saved).
        for (int64_t j = 0; j < n;) {
          const int64_t pos = p0 + j, at = table[pos / a.block_size] * a.block_stride + h * a.head_stride;
          for (int64_t r = pos % a.block_size; r < a.block_size && j < n; ++r, ++j) {
            k_rows[j] = a.k_ptr + at + r * a.row_stride;
            v_rows[j] = a.v_ptr + at + r * a.row_stride;
          }
        }
        // The query vectors of the rows that see the part, lane = (i - i0) * group + g; as few as one tile's
        // (a decode row's), their scores straight from K's rows where a block holds whole runs of 16
        // positions, else from K transposed.
        const int64_t i0 = std::max<int64_t>(0, p0 - c.pos0), lanes = (c.len - i0) * group;
        const bool from_rows = lanes <= 16 && a.block_size % tiles::kScoreRun == 0;
        constexpr int64_t kFetchRows = 32;
        for (int64_t j = 0; j < std::min(n, kFetchRows) && !from_rows; ++j) prefetch_l2(k_rows[j], kSize * 2);
        for (int64_t j0 = 0; j0 < n && !from_rows; j0 += 16) {
          const bf16* rows[16];
          for (int64_t j = 0; j < 16; ++j) rows[j] = j0 + j < n ? k_rows[j0 + j] : nullptr;
          for (int64_t j = j0 + kFetchRows; j < std::min(n, j0 + kFetchRows + 16); ++j)
            prefetch_l2(k_rows[j], kSize * 2);
          for (int64_t j = j0; j < std::min(n, j0 + 16); ++j) prefetch_l2(v_rows[j], kSize * 2);
          bf16dot::transpose_k_64(rows, &kt[j0 * 2]);
        }
        const int64_t n32 = (n + tiles::kValueRun - 1) / tiles::kValueRun * tiles::kValueRun;
        // V paired once K is scored (and V fetched meanwhile).
        const auto pair_values = [&] {
          for (int64_t j = 0; j < n32; j += 2)
            bf16dot::pair_v_64(j < n ? v_rows[j] : kZeros, j + 1 < n ? v_rows[j + 1] : kZeros, &vp[j * 2]);
        };
        if (!from_rows) pair_values();
        for (int64_t l0 = 0; l0 < lanes; l0 += 16) {
          const int64_t m = std::min<int64_t>(16, lanes - l0);
          for (int64_t l = 0; l < m; ++l) {
            const int64_t i = i0 + (l0 + l) / group, g = (l0 + l) % group;
            const bf16* q = a.q_ptr + (c.row0 + i) * a.q_stride + (h * group + g) * kSize;
            std::copy(q, q + kSize, &qa[l * kSize]);
          }
          if (from_rows) {
            tiles::query_pairs(qa.data(), kt.data());
            for (int64_t j0 = 0; j0 < n; j0 += 4 * tiles::kScoreRun) {
              const int64_t run = std::min(4 * tiles::kScoreRun, n - j0);
              tiles::scores_from_rows(kt.data(), &k_rows[j0], a.row_stride, run, m, &s[j0], room);
            }
            pair_values();
          } else {
            tiles::scores(qa.data(), kt.data(), n, s.data(), room);
          }
          float* slot[16];
          for (int64_t l = 0; l < m; ++l) {
            const int64_t i = i0 + (l0 + l) / group, g = (l0 + l) % group;
            slot[l] =
                partial0 + first[tk.block] + (((h * c.len + i) * group + g) * parts + tk.part) * kStride;
            const int64_t visible = std::min(n, c.pos0 + i + 1 - p0);
            slot[l][kSize + 1] =
                tiles::weights(&s[l * room], visible, a.fscale, &w[l * room], n32, &slot[l][kSize]);
          }
          tiles::values(w.data(), room, vp.data(), n32 / tiles::kValueRun, out.data());
          for (int64_t l = 0; l < m; ++l) std::copy(&out[l * kSize], &out[(l + 1) * kSize], slot[l]);
        }
      }
    }
    _tile_release();
    // Each row's parts merged (the bad block, if any, is reported after).
#pragma omp for schedule(static)
    for (int64_t k = 0; k < num_blocks * a.num_kv_heads; ++k) {
      const RowChunk& c = blocks[k / a.num_kv_heads];
      const int64_t h = k % a.num_kv_heads, parts = (c.pos0 + c.len + part_tokens - 1) / part_tokens;
      for (int64_t i = 0; i < c.len; ++i)
        for (int64_t g = 0; g < group; ++g) {
          const float* base =
              partial0 + first[k / a.num_kv_heads] + ((h * c.len + i) * group + g) * parts * kStride;
          merge_parts(base, base + kSize, base + kSize + 1, kStride, (c.pos0 + i) / part_tokens + 1, kSize,
                      sum_v.data(), a.out_ptr + (c.row0 + i) * a.out_stride + (h * group + g) * kSize);
        }
    }
  }
  bad.check(a.num_blocks);
}
#endif

}  // namespace

bool invariant_tiles_fit(const at::Tensor& k_cache) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
  return k_cache.scalar_type() == at::kBFloat16 && k_cache.size(3) == 64 && amx_enabled();
#else
  (void)k_cache;
  return false;
#endif
}

bool blocked_rows_fit(const at::Tensor& k_cache) {
#if defined(__AVX512BF16__)
  return k_cache.scalar_type() == at::kBFloat16 && k_cache.size(3) == 64 && k_cache.size(1) % 2 == 0;
#else
  (void)k_cache;
  return false;
#endif
}

template <typename T>
void blocked_rows(const AttentionArgs<T>& a, const std::vector<RowChunk>& blocks) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (a.head_dim == 64 && amx_enabled()) return invariant_tiles_bf16_64(a, blocks);
  }
#endif
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (a.head_dim == 64 && a.block_size % 2 == 0) return blocked_rows_bf16_64(a, blocks);
  }
#endif
  // Elsewhere the row kernel's chunks (the plan makes no blocks where blocked_rows_fit is false).
  std::vector<RowChunk> chunks;
  for (const RowChunk& b : blocks)
    for (int64_t i = 0; i < b.len; i += kChunkRows)
      chunks.push_back({b.seq, b.row0 + i, b.pos0 + i, std::min(kChunkRows, b.len - i)});
  row_attention(a, chunks);
}

template void blocked_rows<float>(const AttentionArgs<float>&, const std::vector<RowChunk>&);
template void blocked_rows<c10::BFloat16>(const AttentionArgs<c10::BFloat16>&, const std::vector<RowChunk>&);
template void blocked_rows<c10::Half>(const AttentionArgs<c10::Half>&, const std::vector<RowChunk>&);
template void row_attention<float>(const AttentionArgs<float>&, const std::vector<RowChunk>&);
template void row_attention<c10::BFloat16>(const AttentionArgs<c10::BFloat16>&, const std::vector<RowChunk>&);
template void row_attention<c10::Half>(const AttentionArgs<c10::Half>&, const std::vector<RowChunk>&);

}  // namespace pagedserve::cpu
