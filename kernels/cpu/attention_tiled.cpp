// The tiled kernel of paged attention for prompt chunks (see attention.h). The row kernel scores one query
// vector against a block's positions and sums across lanes, a shape made for decode. A prompt chunk has many
// query vectors per kv head (its rows x the group's query heads), which this kernel computes as small matrix
// products on tiles held transposed, so that the lanes of a register are query vectors: scores S^T = K Q^T
// and the output O^T += V^T P^T are plain multiply-adds with one operand broadcast from K or V (no sums
// across lanes), and the online softmax (running max and sum per query vector) is elementwise on the lanes.
//
// One body for every instruction set: float32 products over vec::Vec (K and V widened once per task and
// block), passes of kPassRegs registers of lanes by kSteps positions or value columns, whose sums fill the
// registers. The same FMAs in the same order on AVX2 and AVX-512, so a lane gets the same bits. Only bf16 on
// AVX-512 BF16 takes its own products, of bf16 pairs or AMX tiles (attention_tiled_bf16.h).

#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "amx.h"
#include "attention.h"
#include "attention_amx.h"
#include "attention_tiled_bf16.h"
#include "common.h"
#include "prefetch.h"
#include "vec.h"

namespace pagedserve::cpu {

#if defined(PAGEDSERVE_AVX512) || defined(PAGEDSERVE_AVX2)

namespace {

using vec::IVec;
using vec::kLanes;
using vec::Vec;

// Registers of a task's lanes (AVX-512: 3 x 16, AVX2: 4 x 8).
constexpr int kLaneRegs = kTileLanes / kLanes;
// Registers of lanes one pass of the products computes, by up to kSteps positions (scores) or value columns
// (output): their sums, the lanes' operands and a broadcast fill the registers (AVX-512: 3 x 8 + 3 + 1 of
// 32; AVX2: 2 x 6 + 2 + 1 of 16).
constexpr int kPassRegs = vec::kRegisters == 32 ? 3 : 2;
constexpr int kSteps = vec::kRegisters == 32 ? 8 : 6;

// A task's query rows and output rows, fetched while the task before it computes (claimed a task ahead:
// the tasks go longest first, so their rows lie anywhere).
template <typename T>
__attribute__((always_inline)) inline void prefetch_tile(const AttentionArgs<T>& a, const QueryTile& t) {
  const int64_t offset = t.kv_head * a.group * a.head_dim, bytes = a.group * a.head_dim * sizeof(T);
  for (int64_t r = 0; r < t.rows; ++r) {
    prefetch(a.q_ptr + (t.row0 + r) * a.q_stride + offset, bytes);
    prefetch_write(a.out_ptr + (t.row0 + r) * a.out_stride + offset, bytes);
  }
}

// Each of the kTileLanes lanes' query vector, output and last visible position; lanes past the task's
// vectors repeat its last one (and are never stored). Returns the task's vectors.
template <typename T>
int64_t tile_lanes(const AttentionArgs<T>& a, const QueryTile& t, int32_t* limit, const T** lane_q,
                   T** lane_out) {
  const int64_t lanes = t.rows * a.group;
  for (int64_t lane = 0; lane < kTileLanes; ++lane) {
    const int64_t v = std::min(lane, lanes - 1), row = v / a.group;
    const int64_t offset = (t.kv_head * a.group + v % a.group) * a.head_dim;
    lane_q[lane] = a.q_ptr + (t.row0 + row) * a.q_stride + offset;
    lane_out[lane] = a.out_ptr + (t.row0 + row) * a.out_stride + offset;
    limit[lane] = static_cast<int32_t>(t.pos0 + row);
  }
  return lanes;
}

// Block `block`'s K and V rows of one kv head (row_stride apart), on their way while the block before it
// is computed: it lies anywhere in the pool.
template <typename T>
__attribute__((always_inline)) inline void prefetch_tile_block(const AttentionArgs<T>& a, int64_t block,
                                                               int64_t kv_head) {
  const int64_t at = block * a.block_stride + kv_head * a.head_stride;
  const Fetch kind = reads_ahead_into_l2() ? Fetch::kReadL2 : Fetch::kRead;
  for (int64_t j = 0; j < a.block_size; ++j) {
    prefetch_lines(a.k_ptr + at + j * a.row_stride, a.head_dim * sizeof(T), kind);
    prefetch_lines(a.v_ptr + at + j * a.row_stride, a.head_dim * sizeof(T), kind);
  }
}

// Calls visit(first position, positions, K rows, V rows) for each block of task t's sequence that its
// rows see (within its block range), in order, with the next one on its way (prefetch_tile_block). At a bad
// block table entry, reports it and returns false.
template <typename T, typename F>
bool for_tile_blocks(const AttentionArgs<T>& a, const QueryTile& t, BadBlock& bad, F&& visit) {
  const int64_t last = t.pos0 + t.rows - 1;
  const int64_t used_blocks = std::min(last / a.block_size + 1, t.block_end);
  const int32_t* table = a.tables + t.seq * a.table_stride;
  for (int64_t b = t.block_begin; b < used_blocks; ++b) {
    const int64_t block = table[b];
    if (!a.valid_block(block, b)) {
      bad.report(block);
      return false;
    }
    const int64_t first = b * a.block_size, n = std::min(a.block_size, last + 1 - first);
    if (b + 1 < used_blocks && a.valid_block(table[b + 1], b + 1))
      prefetch_tile_block(a, table[b + 1], t.kv_head);
    const int64_t at = block * a.block_stride + t.kv_head * a.head_stride;
    visit(first, n, a.k_ptr + at, a.v_ptr + at);
  }
  return true;
}

// The tiled kernels' parallel region: body(each_task) runs once on each thread (setting up its buffers), and
// each_task(run) calls run(task) for the tasks that thread takes: handed out dynamically, each thread
// claiming its next one a task ahead and fetching that one's rows meanwhile (prefetch_tile).
template <typename T, typename Body>
void for_tile_tasks(const AttentionArgs<T>& a, const std::vector<QueryTile>& tasks, Body&& body) {
  const int64_t num_tasks = static_cast<int64_t>(tasks.size());
  const int threads = std::max(1, at::get_num_threads());
  std::atomic<int64_t> next{0};
#pragma omp parallel num_threads(static_cast<int>(std::min<int64_t>(threads, num_tasks)))
  body([&](auto&& run) {
    const auto claim = [&] { return next.fetch_add(1, std::memory_order_relaxed); };
    for (int64_t task = claim(), ahead = claim(); task < num_tasks; task = ahead, ahead = claim()) {
      if (ahead < num_tasks) prefetch_tile(a, tasks[ahead]);
      run(tasks[task]);
    }
  });
}

// The scores of P positions (K rows at kb, head_dim floats apart) for the R registers of lanes at qt (scaled
// queries, qt[d * kTileLanes + lane]) into s[j * kTileLanes + lane]: where masked, positions past a lane's
// limit are -inf; next[r] takes the scores' max in.
template <int P, int R>
void float_scores(const float* qt, const float* kb, int64_t head_dim, const IVec* lim, int32_t pos,
                  bool masked, float* s, Vec* next) {
  using namespace vec;
  Vec acc[P][R];
#pragma GCC unroll 8
  for (int j = 0; j < P; ++j)
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) acc[j][r] = zero();
  for (int64_t d = 0; d < head_dim; ++d) {
    Vec q[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) q[r] = load(qt + d * kTileLanes + kLanes * r);
#pragma GCC unroll 8
    for (int j = 0; j < P; ++j) {
      const Vec k = set1(kb[j * head_dim + d]);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) acc[j][r] = fma(q[r], k, acc[j][r]);
    }
  }
  const Vec ninf = set1(-std::numeric_limits<float>::infinity());
#pragma GCC unroll 8
  for (int j = 0; j < P; ++j)
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      Vec v = acc[j][r];
      if (masked) v = select(igt(iset1(pos + j), lim[r]), ninf, v);
      store(s + j * kTileLanes + kLanes * r, v);
      next[r] = max(next[r], v);
    }
}

// ot[c * kTileLanes + lane] for C value columns and the R registers of lanes: alpha * ot + the sum over j < n
// of the weights s[j * kTileLanes + lane] times V[j][c] (rows at vb, head_dim floats apart).
template <int C, int R>
void float_values(const float* s, const float* vb, int64_t head_dim, int64_t n, const Vec* alpha, float* ot) {
  using namespace vec;
  Vec acc[C][R];
#pragma GCC unroll 8
  for (int c = 0; c < C; ++c)
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) acc[c][r] = mul(load(ot + c * kTileLanes + kLanes * r), alpha[r]);
  for (int64_t j = 0; j < n; ++j) {
    Vec p[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) p[r] = load(s + j * kTileLanes + kLanes * r);
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      const Vec v = set1(vb[j * head_dim + c]);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) acc[c][r] = fma(p[r], v, acc[c][r]);
    }
  }
#pragma GCC unroll 8
  for (int c = 0; c < C; ++c)
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) store(ot + c * kTileLanes + kLanes * r, acc[c][r]);
}

using ScoresFn = void (*)(const float*, const float*, int64_t, const IVec*, int32_t, bool, float*, Vec*);
using ValuesFn = void (*)(const float*, const float*, int64_t, int64_t, const Vec*, float*);
template <int R, int... P>
constexpr std::array<ScoresFn, sizeof...(P)> scores_table(std::integer_sequence<int, P...>) {
  return {&float_scores<P + 1, R>...};
}
template <int R, int... C>
constexpr std::array<ValuesFn, sizeof...(C)> values_table(std::integer_sequence<int, C...>) {
  return {&float_values<C + 1, R>...};
}
template <int... R>
constexpr std::array<std::array<ScoresFn, kSteps>, kPassRegs> scores_tables(
    std::integer_sequence<int, R...>) {
  return {scores_table<R + 1>(std::make_integer_sequence<int, kSteps>{})...};
}
template <int... R>
constexpr std::array<std::array<ValuesFn, kSteps>, kPassRegs> values_tables(
    std::integer_sequence<int, R...>) {
  return {values_table<R + 1>(std::make_integer_sequence<int, kSteps>{})...};
}
// [registers of the pass - 1][positions or columns - 1]
constexpr auto kScores = scores_tables(std::make_integer_sequence<int, kPassRegs>{});
constexpr auto kValues = values_tables(std::make_integer_sequence<int, kPassRegs>{});

// qt[d * kTileLanes + lane] = each lane's query vector, scaled: kLanes lanes by kLanes dims at a time,
// transposed in registers, where the head size is whole vectors.
template <typename T>
void load_queries(const T* const* lane_q, int64_t head_dim, float scale, float* qt) {
  using namespace vec;
  if (head_dim % kLanes == 0) {
    for (int64_t g = 0; g < kTileLanes; g += kLanes)
      for (int64_t d0 = 0; d0 < head_dim; d0 += kLanes) {
        Vec r[kLanes];
        for (int i = 0; i < kLanes; ++i) r[i] = load(lane_q[g + i] + d0);
        transpose(r);
        for (int i = 0; i < kLanes; ++i) store(&qt[(d0 + i) * kTileLanes + g], mul(r[i], set1(scale)));
      }
    return;
  }
  for (int64_t lane = 0; lane < kTileLanes; ++lane)
    for (int64_t d = 0; d < head_dim; ++d)
      qt[d * kTileLanes + lane] = static_cast<float>(lane_q[lane][d]) * scale;
}

// Each of a task's lanes' output row: ot[d * kTileLanes + lane] scaled by inv[lane] (1 / its softmax sum),
// rounded to T: kLanes lanes by kLanes dims at a time, transposed in registers, where the head size is whole
// vectors.
template <typename T>
void store_tile(const float* ot, const float* inv, int64_t lanes, T* const* lane_out, int64_t head_dim) {
  using namespace vec;
  if (head_dim % kLanes == 0) {
    for (int64_t g = 0; g < lanes; g += kLanes) {
      const Vec scale = load(inv + g);
      for (int64_t d0 = 0; d0 < head_dim; d0 += kLanes) {
        Vec r[kLanes];
        for (int i = 0; i < kLanes; ++i) r[i] = mul(load(&ot[(d0 + i) * kTileLanes + g]), scale);
        transpose(r);
        for (int64_t j = 0; j < std::min<int64_t>(kLanes, lanes - g); ++j) store(lane_out[g + j] + d0, r[j]);
      }
    }
    return;
  }
  for (int64_t lane = 0; lane < lanes; ++lane) {
    T* o = lane_out[lane];
    for (int64_t d = 0; d < head_dim; ++d) o[d] = static_cast<T>(ot[d * kTileLanes + lane] * inv[lane]);
  }
}

}  // namespace

template <typename T>
void tiled_attention(const AttentionArgs<T>& a, const std::vector<QueryTile>& tasks,
                     const std::vector<TileSplit>& splits, int64_t num_partials) {
  using namespace vec;
  BadBlock bad;
  // bf16 on AVX-512 BF16: the products of bf16 pairs (or AMX tiles) straight from the cache; everything else
  // widens K and V to float32 once per task and block.
#if defined(__AVX512BF16__)
  constexpr bool kPairs = std::is_same_v<T, c10::BFloat16>;
#else
  constexpr bool kPairs = false;
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
  const bool amx = kPairs && use_amx_attention(a);
#else
  const bool amx = false;
#endif
  // Each part of a split tile: its lanes' running max and sum, then its ot (see below).
  const int64_t partial_size = (2 + a.head_dim) * kTileLanes;
  std::vector<float> partials(num_partials * partial_size);

  for_tile_tasks(a, tasks, [&](auto&& each_task) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
    if (amx) _tile_loadconfig(&kAttentionTiles);
#endif
    // Pairs: qp[d / 2][lane] the query pairs, pp[j / 2][lane] the weight pairs, vp[j / 2][d] V's row pairs,
    // vt[d][j] with AMX a block's V transposed. float32: qt[d][lane] the scaled queries, kb, vb[j][d] one
    // block's K and V rows. Both: s[j][lane] one block's scores (then weights), ot[d][lane] the unnormalised
    // output.
    const int64_t max_pairs = (a.block_size + 1) / 2;
    std::vector<int32_t> qp(kPairs ? a.head_dim / 2 * kTileLanes : 0),
        pp(kPairs ? max_pairs * kTileLanes : 0), vp(kPairs ? max_pairs * a.head_dim : 0);
    std::vector<c10::BFloat16> vt(amx ? a.head_dim * a.block_size : 0);
    std::vector<float> qt(kPairs ? 0 : a.head_dim * kTileLanes), kb(kPairs ? 0 : a.block_size * a.head_dim),
        vb(kPairs ? 0 : a.block_size * a.head_dim), s(a.block_size * kTileLanes), ot(a.head_dim * kTileLanes);
    each_task([&](const QueryTile& t) {
      alignas(64) int32_t limit[kTileLanes];  // the last position each lane sees
      const T* lane_q[kTileLanes];            // each lane's query vector
      T* lane_out[kTileLanes];                // and its output
      const int64_t lanes = tile_lanes(a, t, limit, lane_q, lane_out);
      // Per register of lanes: the last positions they see, the running max and sum.
      IVec lim[kLaneRegs];
      Vec max[kLaneRegs], sum[kLaneRegs];
      for (int r = 0; r < kLaneRegs; ++r) {
        lim[r] = iload(limit + kLanes * r);
        max[r] = set1(-std::numeric_limits<float>::infinity());
        sum[r] = zero();
      }
      std::fill(ot.begin(), ot.end(), 0.f);
      bool valid = true;
      if constexpr (kPairs) {
#if defined(__AVX512BF16__)
        // One pass of two or three registers of lanes.
        const auto pairs = [&](auto registers) {
          constexpr int R = decltype(registers)::value;
          tiled_bf16::load_query_pairs<R>(lane_q, a.head_dim, qp.data());
          __m512i lim_r[R];
          __m512 max_r[R], sum_r[R];
          for (int r = 0; r < R; ++r) lim_r[r] = lim[r], max_r[r] = max[r], sum_r[r] = sum[r];
          valid =
              for_tile_blocks(a, t, bad, [&](int64_t first, int64_t n, const T* k_block, const T* v_block) {
                tiled_bf16::block<R>(first, n, k_block, v_block, a.row_stride, a.head_dim, a.fscale,
                                     first + n - 1 > t.pos0, amx, lim_r, max_r, sum_r, qp.data(), pp.data(),
                                     vp.data(), vt.data(), s.data(), ot.data());
              });
          for (int r = 0; r < R; ++r) max[r] = max_r[r], sum[r] = sum_r[r];
        };
        if (lanes > 32)
          pairs(std::integral_constant<int, 3>{});
        else
          pairs(std::integral_constant<int, 2>{});
#endif
      } else {
        load_queries(lane_q, a.head_dim, a.fscale, qt.data());
        const int regs = static_cast<int>((lanes + kLanes - 1) / kLanes);
        valid = for_tile_blocks(a, t, bad, [&](int64_t first, int64_t n, const T* k_block, const T* v_block) {
          for (int64_t j = 0; j < n; ++j) {
            load_row(k_block + j * a.row_stride, &kb[j * a.head_dim], a.head_dim);
            load_row(v_block + j * a.row_stride, &vb[j * a.head_dim], a.head_dim);
          }
          // Positions a lane must not see become -inf (none can be in a block that ends by the first lane's
          // position).
          const bool masked = first + n - 1 > t.pos0;
          for (int g = 0; g < regs; g += kPassRegs) {
            const int pass = std::min(kPassRegs, regs - g);
            // The block's scores, its positions in balanced parts (16 is 6 + 5 + 5 on AVX2), and the new max.
            Vec next[kPassRegs];
            for (int r = 0; r < pass; ++r) next[r] = max[g + r];
            const int64_t parts = (n + kSteps - 1) / kSteps;
            for (int64_t i = 0; i < parts; ++i) {
              const int64_t j0 = n * i / parts, j1 = n * (i + 1) / parts;
              kScores[pass - 1][j1 - j0 - 1](&qt[kLanes * g], &kb[j0 * a.head_dim], a.head_dim, &lim[g],
                                             static_cast<int32_t>(first + j0), masked,
                                             &s[j0 * kTileLanes + kLanes * g], next);
            }
            // Online softmax: the old output and sum rescaled by exp(old max - new max), the scores turned
            // into weights exp(s - new max), added to the sum in position order.
            Vec alpha[kPassRegs];
            for (int r = 0; r < pass; ++r) {
              alpha[r] = exp(sub(max[g + r], next[r]));
              max[g + r] = next[r];
              sum[g + r] = mul(sum[g + r], alpha[r]);
              for (int64_t j = 0; j < n; ++j) {
                float* at = &s[j * kTileLanes + kLanes * (g + r)];
                const Vec p = exp(sub(load(at), next[r]));
                store(at, p);
                sum[g + r] = add(sum[g + r], p);
              }
            }
            for (int64_t d0 = 0; d0 < a.head_dim; d0 += kSteps)
              kValues[pass - 1][std::min<int64_t>(kSteps, a.head_dim - d0) - 1](
                  &s[kLanes * g], &vb[d0], a.head_dim, n, alpha, &ot[d0 * kTileLanes + kLanes * g]);
          }
        });
      }
      if (!valid) return;
      if (t.partial >= 0) {
        float* slot = &partials[t.partial * partial_size];
        for (int r = 0; r < kLaneRegs; ++r) {
          store(slot + kLanes * r, max[r]);
          store(slot + kTileLanes + kLanes * r, sum[r]);
        }
        std::copy(ot.begin(), ot.end(), slot + 2 * kTileLanes);
        return;
      }
      alignas(64) float inv[kTileLanes];
      for (int r = 0; r < kLaneRegs; ++r) store(inv + kLanes * r, div(set1(1.f), sum[r]));
      store_tile(ot.data(), inv, lanes, lane_out, a.head_dim);
    });
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
    if (amx) _tile_release();
#endif
  });
  bad.check(a.num_blocks);
  // Each split tile's parts merged, lane by lane: the output is sum_p w_p ot_p / sum_p w_p sum_p, with
  // w_p = exp(max_p - the parts' max).
  std::vector<float> ot(a.head_dim * kTileLanes);
  for (const TileSplit& split : splits) {
    alignas(64) int32_t limit[kTileLanes];
    const T* lane_q[kTileLanes];
    T* lane_out[kTileLanes];
    const int64_t lanes = tile_lanes(a, split.tile, limit, lane_q, lane_out);
    const float* first = &partials[split.first_partial * partial_size];
    alignas(64) float inv[kTileLanes];
    for (int64_t g = 0; g < lanes; g += kLanes) {
      Vec top = load(first + g);
      for (int64_t p = 1; p < split.parts; ++p) top = max(top, load(first + p * partial_size + g));
      Vec total = zero();
      for (int64_t p = 0; p < split.parts; ++p) {
        const float* part = first + p * partial_size;
        const Vec w = exp(sub(load(part + g), top));
        total = fma(w, load(part + kTileLanes + g), total);
        for (int64_t d = 0; d < a.head_dim; ++d) {
          const Vec o = load(part + (2 + d) * kTileLanes + g);
          float* dst = &ot[d * kTileLanes + g];
          store(dst, p == 0 ? mul(w, o) : fma(w, o, load(dst)));
        }
      }
      store(inv + g, div(set1(1.f), total));
    }
    store_tile(ot.data(), inv, lanes, lane_out, a.head_dim);
  }
}

#else

template <typename T>
void tiled_attention(const AttentionArgs<T>&, const std::vector<QueryTile>&, const std::vector<TileSplit>&,
                     int64_t) {
  TORCH_CHECK(false, "this build has no tiled attention (see kHasTiles)");
}

#endif

template void tiled_attention<float>(const AttentionArgs<float>&, const std::vector<QueryTile>&,
                                     const std::vector<TileSplit>&, int64_t);
template void tiled_attention<c10::BFloat16>(const AttentionArgs<c10::BFloat16>&,
                                             const std::vector<QueryTile>&, const std::vector<TileSplit>&,
                                             int64_t);
template void tiled_attention<c10::Half>(const AttentionArgs<c10::Half>&, const std::vector<QueryTile>&,
                                         const std::vector<TileSplit>&, int64_t);

}  // namespace pagedserve::cpu
