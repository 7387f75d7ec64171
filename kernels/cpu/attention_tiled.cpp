// The tiled kernel of paged attention for prompt chunks (see attention.h). The row kernel scores one query
// vector against a block's positions and sums across lanes, a shape made for decode. A prompt chunk has many
// query vectors per kv head (its rows x the group's query heads), which this kernel computes as small matrix
// products on tiles held transposed, so that the lanes of a register are query vectors: scores S^T = K Q^T
// and the output O^T += V^T P^T are plain multiply-adds with one operand broadcast from K or V (no sums
// across lanes), and the online softmax (running max and sum per query vector) is elementwise on the lanes.

#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "amx.h"
#include "attention.h"
#include "common.h"
#include "prefetch.h"
#include "vec.h"

namespace pagedserve::cpu {

// Positions scored together (8 x 2 or 3 registers of scores), and value columns accumulated together.
constexpr int64_t kTilePositions = 8, kTileColumns = 8;

// A task's query rows and output rows, fetched while the task before it computes (claimed a task ahead:
// the tasks go longest first, so their rows lie anywhere). Loaded cold, they and the copy-out took about
// a fifth of the AVX-512 kernel's samples.
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
// is computed: it lies anywhere in the pool. Always inlined, as prefetch_tile: each tiled kernel carries its
// own prefetches (a test reads them there).
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
// claiming its next one a task ahead and fetching that one's rows meanwhile (prefetch_tile). 30 layers of a
// real model's prompts on AVX-512: 16 of 100-140 tokens 73.5 -> 64.3 ms, 6 of 200-480 119.7 -> 113.5 (and
// 121.9 -> 114.0).
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

#if defined(PAGEDSERVE_AVX512)
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// The tiled kernel's products on AMX (bf16, head sizes a multiple of 32, blocks of 16 positions): the
// scores S^T = K Q^T with K's 16 rows of a block as one tile, straight from the cache, by the query pairs qp
// as the other; the output O^T += V^T P^T with the block's V transposed (vt) by the weight pairs pp. The
// layouts are the AVX-512 kernel's (s and ot lane-minor, qp and pp pairs by lanes), so the masking, the
// online softmax, the splits and the stores are shared. Sums in the same order as vdpbf16ps's (the same
// bits but for rare last-bit roundings, as in linear_amx). One layer of SmolLM2 in bf16 on a 2-core Intel
// Xeon with AMX (bench_kernels_cpu.py --prefill), ms against the AVX-512 BF16 kernel: a 500-token prompt
// 1.84 -> 0.73-0.81, 15 and 26 queries after 700 cached positions 0.30 -> 0.12, 4 chunks of 256 after 512
// 5.76 -> 2.27-2.52, a 2000-token prompt 28.8 -> 10.2-11.1 (157 -> 360-450 GFLOP/s). Of the rest, half is
// the second product's tiles (each of a block's 16 x 16 output tiles loaded, added to and stored) and the
// rescaling of the output where a max moved; the transposition of V about a sixth. The output tiles held
// in two tile registers in turn rather than one: no change.
constexpr int64_t kAmxKeys = 16;  // positions of a block
// Tiles 0-2: scores of 16 positions by 16 lanes, 3: K (16 positions x 32 dims), 4: query pairs (16 pairs x
// 16 lanes), 5: output (16 dims x 16 lanes), 6: V^T (16 dims x 16 positions), 7: weight pairs (8 pairs of
// positions x 16 lanes).
constexpr TileConfig kAttentionTiles{{16, 64}, {16, 64}, {16, 64}, {16, 64},
                                     {16, 64}, {16, 64}, {16, 32}, {8, 64}};

template <typename T>
inline bool use_amx_attention(const AttentionArgs<T>& a) {
  return a.block_size == kAmxKeys && a.head_dim % 32 == 0 && amx_enabled();
}

// s[j * kTileLanes + lane] = K row j . query vector lane, for the R x 16 lanes of qp and the 16 rows of K
// (row_stride elements apart; rows past a short block's end are read and never used).
template <int R>
inline void amx_scores(const at::BFloat16* k, int64_t row_stride, const int32_t* qp, int64_t head_dim,
                       float* s) {
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (R > 2) _tile_zero(2);
  for (int64_t d = 0; d < head_dim; d += 32) {
    _tile_loadd(3, k + d, row_stride * 2);
    const int32_t* q = qp + d / 2 * kTileLanes;
    _tile_loadd(4, q, kTileLanes * 4);
    _tile_dpbf16ps(0, 3, 4);
    _tile_loadd(4, q + 16, kTileLanes * 4);
    _tile_dpbf16ps(1, 3, 4);
    if constexpr (R > 2) {
      _tile_loadd(4, q + 32, kTileLanes * 4);
      _tile_dpbf16ps(2, 3, 4);
    }
  }
  _tile_stored(0, s, kTileLanes * 4);
  _tile_stored(1, s + 16, kTileLanes * 4);
  if constexpr (R > 2) _tile_stored(2, s + 32, kTileLanes * 4);
}

// ot[d * kTileLanes + lane] = alpha[lane] * ot[...] + sum over the block's n positions of the weights (pairs
// in pp, the AVX-512 kernel's) times V[j][d]: V's rows (row_stride apart) transposed into vt, then one
// product per 16 dims and 16 lanes. Past a short block's n positions vt is zero (the cache may hold
// anything there, NaN too), so that pp's pairs there, left from the block before, add nothing.
template <int R>
inline void amx_values(const at::BFloat16* v, int64_t row_stride, int64_t n, int64_t head_dim,
                       const __m512 (&alpha)[R], int32_t* pp, at::BFloat16* vt, float* ot) {
  // 32 dims at a time: 16 rows of 16 dim pairs transposed (transpose16x16), each pair split into its two
  // dims' rows of 16 positions.
  for (int64_t d0 = 0; d0 < head_dim; d0 += 32) {
    __m512i rows[16];
    for (int64_t j = 0; j < kAmxKeys; ++j)
      rows[j] = j < n ? _mm512_loadu_si512(v + j * row_stride + d0) : _mm512_setzero_si512();
    vec::transpose(rows);
    for (int p = 0; p < 16; ++p) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(vt + (d0 + 2 * p) * kAmxKeys),
                          _mm512_cvtepi32_epi16(rows[p]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(vt + (d0 + 2 * p + 1) * kAmxKeys),
                          _mm512_cvtepi32_epi16(_mm512_srli_epi32(rows[p], 16)));
    }
  }
  // The old output rescaled, unless no lane's max moved (alpha 1: the same bits).
  bool rescale = false;
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) rescale |= _mm512_cmpneq_ps_mask(alpha[r], _mm512_set1_ps(1.f)) != 0;
  if (rescale)
    for (int64_t d = 0; d < head_dim; ++d)
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        float* o = &ot[d * kTileLanes + 16 * r];
        _mm512_storeu_ps(o, _mm512_mul_ps(_mm512_loadu_ps(o), alpha[r]));
      }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    _tile_loadd(7, pp + 16 * r, kTileLanes * 4);
    for (int64_t d0 = 0; d0 < head_dim; d0 += 16) {
      float* o = ot + d0 * kTileLanes + 16 * r;
      _tile_loadd(5, o, kTileLanes * 4);
      _tile_loadd(6, vt + d0 * kAmxKeys, kAmxKeys * 2);
      _tile_dpbf16ps(5, 6, 7);
      _tile_stored(5, o, kTileLanes * 4);
    }
  }
}
#else
template <typename T>
inline bool use_amx_attention(const AttentionArgs<T>&) {
  return false;
}
#endif  // __AMX_TILE__ && __AMX_BF16__

// Each of a task's lanes' output row: ot[d * kTileLanes + lane] scaled by inv[lane] (1 / its softmax sum).
template <typename T>
void store_tile(const float* ot, const float* inv, int64_t lanes, T* const* lane_out, int64_t head_dim) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    // 16 lanes x 16 dims at a time: scaled, transposed in registers, rounded (vcvtneps2bf16 rounds as c10's
    // conversion does) and stored as a row of each lane's output.
    for (int64_t g = 0; g < lanes; g += 16) {
      const __m512 scale = _mm512_load_ps(inv + g);
      for (int64_t d0 = 0; d0 < head_dim; d0 += 16) {
        __m512i r[16];
        for (int i = 0; i < 16; ++i)
          r[i] = _mm512_castps_si512(_mm512_mul_ps(_mm512_loadu_ps(&ot[(d0 + i) * kTileLanes + g]), scale));
        vec::transpose(r);
        for (int64_t j = 0; j < std::min<int64_t>(16, lanes - g); ++j)
          vec::store(lane_out[g + j] + d0, _mm512_castsi512_ps(r[j]));
      }
    }
    return;
  }
#endif
  for (int64_t lane = 0; lane < lanes; ++lane) {
    T* o = lane_out[lane];
    for (int64_t d = 0; d < head_dim; ++d) o[d] = static_cast<T>(ot[d * kTileLanes + lane] * inv[lane]);
  }
}

template <typename T>
void tiled_attention(const AttentionArgs<T>& a, const std::vector<QueryTile>& tasks,
                     const std::vector<TileSplit>& splits, int64_t num_partials) {
  BadBlock bad;
  // bf16 scores straight from the cache with the bf16 dot product instruction (each product exact in
  // float32, summed in float32), two head dims per step; other dtypes widen K first.
#if defined(__AVX512BF16__)
  constexpr bool kPairs = std::is_same_v<T, c10::BFloat16>;
#else
  constexpr bool kPairs = false;
#endif
  // Each part of a split tile: its lanes' running max and sum, then its ot (see below).
  const int64_t partial_size = (2 + a.head_dim) * kTileLanes;
  std::vector<float> partials(num_partials * partial_size);
  const bool amx = kPairs && use_amx_attention(a);

  for_tile_tasks(a, tasks, [&](auto&& each_task) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if (amx) _tile_loadconfig(&kAttentionTiles);
#endif
    // bf16: qp[d / 2][lane] the query pairs, pp[j / 2][lane] the weight pairs, vp[j / 2][d] V's row pairs;
    // other dtypes: qt[d][lane] the scaled queries, kb, vb[j][d] one block's K and V rows, widened. Both:
    // s[j][lane] one block's scores (then weights), ot[d][lane] the unnormalised output.
    const int64_t max_pairs = (a.block_size + 1) / 2;
    std::vector<int32_t> qp(kPairs ? a.head_dim / 2 * kTileLanes : 0),
        pp(kPairs ? max_pairs * kTileLanes : 0), vp(kPairs ? max_pairs * a.head_dim : 0);
    // AMX: vt[d][j], a block's V transposed (see amx_values).
    std::vector<at::BFloat16> vt(amx ? a.head_dim * a.block_size : 0);
    std::vector<float> qt(kPairs ? 0 : a.head_dim * kTileLanes), kb(kPairs ? 0 : a.block_size * a.head_dim),
        vb(kPairs ? 0 : a.block_size * a.head_dim), s(a.block_size * kTileLanes), ot(a.head_dim * kTileLanes);
    // One task in R registers of lanes (R x 16 >= its query vectors).
    const auto task = [&](const QueryTile& t, auto registers) __attribute__((always_inline)) {
      constexpr int R = decltype(registers)::value;
      alignas(64) int32_t limit[kTileLanes];  // the last position each lane sees
      const T* lane_q[kTileLanes];            // each lane's query vector
      T* lane_out[kTileLanes];                // and its output
      const int64_t lanes = tile_lanes(a, t, limit, lane_q, lane_out);
      if constexpr (kPairs) {  // bf16 pairs (d, d + 1) as one 32-bit lane; the scale goes on the scores
        if (a.head_dim % 32 == 0) {
          // 16 lanes x 16 pairs at a time, transposed in registers.
          for (int64_t g = 0; g < 16 * R; g += 16)
            for (int64_t p0 = 0; p0 < a.head_dim / 2; p0 += 16) {
              __m512i r[16];
              for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(lane_q[g + i] + 2 * p0);
              vec::transpose(r);
              for (int j = 0; j < 16; ++j) _mm512_storeu_si512(&qp[(p0 + j) * kTileLanes + g], r[j]);
            }
        } else {
          for (int64_t lane = 0; lane < 16 * R; ++lane)
            for (int64_t d = 0; d < a.head_dim; d += 2)
              std::memcpy(&qp[d / 2 * kTileLanes + lane], lane_q[lane] + d, 4);
        }
      } else {
        for (int64_t lane = 0; lane < 16 * R; ++lane)
          for (int64_t d = 0; d < a.head_dim; ++d)
            qt[d * kTileLanes + lane] = static_cast<float>(lane_q[lane][d]) * a.fscale;
      }
      __m512i lim[R];
      __m512 max[R], sum[R];
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        lim[r] = _mm512_load_si512(limit + 16 * r);
        max[r] = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
        sum[r] = _mm512_setzero_ps();
      }
      std::fill(ot.begin(), ot.end(), 0.f);

      // One block of the task's sequence (see for_tile_blocks).
      const auto visit = [&](int64_t first, int64_t n, const T* k_block, const T* v_block) {
        if constexpr (!kPairs)
          for (int64_t j = 0; j < n; ++j) {
            load_row(k_block + j * a.row_stride, &kb[j * a.head_dim], a.head_dim);
            load_row(v_block + j * a.row_stride, &vb[j * a.head_dim], a.head_dim);
          }
        // Scores of kTilePositions positions for all lanes; positions a lane must not see become -inf (none
        // can be in a block that ends by the first lane's position), and the new running max.
        const bool masked = first + n - 1 > t.pos0;
        __m512 next[R];
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) next[r] = max[r];
        for (int64_t j0 = 0; j0 < n; j0 += kTilePositions) {
          __m512 acc[kTilePositions][R];
#pragma GCC unroll 8
          for (int64_t j = 0; j < kTilePositions; ++j)
#pragma GCC unroll 4
            for (int r = 0; r < R; ++r) acc[j][r] = _mm512_setzero_ps();
          const int64_t m = std::min(kTilePositions, n - j0);
          // Positions past m repeat the block's last row; their scores are never stored.
          if constexpr (kPairs) {
            if (amx) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
              // S^T = K Q^T for the whole block at once (see amx_scores), read here as the sums.
              if (j0 == 0) amx_scores<R>(k_block, a.row_stride, qp.data(), a.head_dim, s.data());
              for (int64_t j = 0; j < m; ++j)
#pragma GCC unroll 4
                for (int r = 0; r < R; ++r) acc[j][r] = _mm512_loadu_ps(&s[(j0 + j) * kTileLanes + 16 * r]);
#endif
            } else {
#if defined(__AVX512BF16__)
              const T* k_rows[kTilePositions];
              for (int64_t j = 0; j < kTilePositions; ++j)
                k_rows[j] = k_block + (j0 + std::min(j, m - 1)) * a.row_stride;
              for (int64_t d = 0; d < a.head_dim; d += 2) {
                __m512bh q[R];
#pragma GCC unroll 4
                for (int r = 0; r < R; ++r)
                  q[r] = (__m512bh)_mm512_loadu_si512(&qp[d / 2 * kTileLanes + 16 * r]);
#pragma GCC unroll 8
                for (int64_t j = 0; j < kTilePositions; ++j) {
                  int32_t pair;
                  std::memcpy(&pair, k_rows[j] + d, sizeof(pair));
                  const __m512bh k = (__m512bh)_mm512_set1_epi32(pair);
#pragma GCC unroll 4
                  for (int r = 0; r < R; ++r) acc[j][r] = _mm512_dpbf16_ps(acc[j][r], q[r], k);
                }
              }
#endif
            }
          } else {
            const float* k_rows = &kb[j0 * a.head_dim];
            for (int64_t d = 0; d < a.head_dim; ++d) {
              __m512 q[R];
#pragma GCC unroll 4
              for (int r = 0; r < R; ++r) q[r] = _mm512_loadu_ps(&qt[d * kTileLanes + 16 * r]);
#pragma GCC unroll 8
              for (int64_t j = 0; j < kTilePositions; ++j) {
                const __m512 k = _mm512_set1_ps(k_rows[std::min(j, m - 1) * a.head_dim + d]);
#pragma GCC unroll 4
                for (int r = 0; r < R; ++r) acc[j][r] = _mm512_fmadd_ps(q[r], k, acc[j][r]);
              }
            }
          }
          const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
          const __m512 score_scale = _mm512_set1_ps(kPairs ? a.fscale : 1.f);
          for (int64_t j = 0; j < m; ++j) {
            const __m512i pos = _mm512_set1_epi32(static_cast<int32_t>(first + j0 + j));
#pragma GCC unroll 4
            for (int r = 0; r < R; ++r) {
              __m512 sc = _mm512_mul_ps(acc[j][r], score_scale);
              if (masked) sc = _mm512_mask_mov_ps(sc, _mm512_cmpgt_epi32_mask(pos, lim[r]), ninf);
              _mm512_storeu_ps(&s[(j0 + j) * kTileLanes + 16 * r], sc);
              next[r] = _mm512_max_ps(next[r], sc);
            }
          }
        }
        // Online softmax over the block: the old output and sum rescaled by exp(old max - new max), the
        // scores turned into weights exp(s - new max).
        __m512 alpha[R];
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          alpha[r] = vec::exp(_mm512_sub_ps(max[r], next[r]));
          max[r] = next[r];
          sum[r] = _mm512_mul_ps(sum[r], alpha[r]);
        }
        if constexpr (!kPairs)  // bf16 takes its weights pair by pair below
          for (int64_t j = 0; j < n; ++j)
#pragma GCC unroll 4
            for (int r = 0; r < R; ++r) {
              const __m512 p = vec::exp(_mm512_sub_ps(_mm512_loadu_ps(&s[j * kTileLanes + 16 * r]), next[r]));
              _mm512_storeu_ps(&s[j * kTileLanes + 16 * r], p);
              sum[r] = _mm512_add_ps(sum[r], p);
            }
        // ot[d][lane] = alpha * ot[d][lane] + sum over j of s[j][lane] * V[j][d], kTileColumns d at a time.
        if constexpr (kPairs) {
#if defined(__AVX512BF16__)
          // Positions in pairs (j, j + 1): the weights, added to the sums in position order, then rounded
          // to bf16 side by side per lane (as FlashAttention feeds P to its second product); V's two rows
          // interleaved per column.
          const __m512i interleave =
              _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21,
                               5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
          for (int64_t jp = 0; jp < (n + 1) / 2; ++jp) {
            const int64_t j = 2 * jp;
            const bool second = j + 1 < n;  // an odd block's last pair has one position
#pragma GCC unroll 4
            for (int r = 0; r < R; ++r) {
              const __m512 lo =
                  vec::exp(_mm512_sub_ps(_mm512_loadu_ps(&s[j * kTileLanes + 16 * r]), next[r]));
              sum[r] = _mm512_add_ps(sum[r], lo);
              __m512 hi = _mm512_setzero_ps();
              if (second) {
                hi = vec::exp(_mm512_sub_ps(_mm512_loadu_ps(&s[(j + 1) * kTileLanes + 16 * r]), next[r]));
                sum[r] = _mm512_add_ps(sum[r], hi);
              }
              _mm512_storeu_si512(&pp[jp * kTileLanes + 16 * r],
                                  _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(hi, lo)));
            }
            if (amx) continue;  // V is transposed whole below
            const T* r0 = v_block + j * a.row_stride;
            for (int64_t d = 0; d < a.head_dim; d += 16) {
              const __m256i row0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r0 + d));
              const __m256i row1 =
                  second ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r0 + a.row_stride + d))
                         : _mm256_setzero_si256();
              _mm512_storeu_si512(&vp[jp * a.head_dim + d],
                                  _mm512_permutexvar_epi16(
                                      interleave, _mm512_inserti64x4(_mm512_castsi256_si512(row0), row1, 1)));
            }
          }
#endif
        }
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
        if constexpr (kPairs)
          if (amx) {
            amx_values<R>(v_block, a.row_stride, n, a.head_dim, alpha, pp.data(), vt.data(), ot.data());
            return;
          }
#endif
        for (int64_t d0 = 0; d0 < a.head_dim; d0 += kTileColumns) {
          __m512 acc[kTileColumns][R];
#pragma GCC unroll 8
          for (int64_t c = 0; c < kTileColumns; ++c)
#pragma GCC unroll 4
            for (int r = 0; r < R; ++r)
              acc[c][r] = _mm512_mul_ps(_mm512_loadu_ps(&ot[(d0 + c) * kTileLanes + 16 * r]), alpha[r]);
          if constexpr (kPairs) {
#if defined(__AVX512BF16__)
            for (int64_t jp = 0; jp < (n + 1) / 2; ++jp) {
              __m512bh p[R];
#pragma GCC unroll 4
              for (int r = 0; r < R; ++r) p[r] = (__m512bh)_mm512_loadu_si512(&pp[jp * kTileLanes + 16 * r]);
              const int32_t* v_pairs = &vp[jp * a.head_dim + d0];
#pragma GCC unroll 8
              for (int64_t c = 0; c < kTileColumns; ++c) {
                const __m512bh v = (__m512bh)_mm512_set1_epi32(v_pairs[c]);
#pragma GCC unroll 4
                for (int r = 0; r < R; ++r) acc[c][r] = _mm512_dpbf16_ps(acc[c][r], p[r], v);
              }
            }
#endif
          } else {
            for (int64_t j = 0; j < n; ++j) {
              __m512 p[R];
#pragma GCC unroll 4
              for (int r = 0; r < R; ++r) p[r] = _mm512_loadu_ps(&s[j * kTileLanes + 16 * r]);
              const float* v_row = &vb[j * a.head_dim + d0];
#pragma GCC unroll 8
              for (int64_t c = 0; c < kTileColumns; ++c) {
                const __m512 v = _mm512_set1_ps(v_row[c]);
#pragma GCC unroll 4
                for (int r = 0; r < R; ++r) acc[c][r] = _mm512_fmadd_ps(p[r], v, acc[c][r]);
              }
            }
          }
#pragma GCC unroll 8
          for (int64_t c = 0; c < kTileColumns; ++c)
#pragma GCC unroll 4
            for (int r = 0; r < R; ++r) _mm512_storeu_ps(&ot[(d0 + c) * kTileLanes + 16 * r], acc[c][r]);
        }
      };
      if (!for_tile_blocks(a, t, bad, visit)) return;
      if (t.partial >= 0) {
        float* slot = &partials[t.partial * partial_size];
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          _mm512_storeu_ps(slot + 16 * r, max[r]);
          _mm512_storeu_ps(slot + kTileLanes + 16 * r, sum[r]);
        }
        std::copy(ot.begin(), ot.end(), slot + 2 * kTileLanes);
        return;
      }
      alignas(64) float inv[kTileLanes];
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) _mm512_store_ps(inv + 16 * r, _mm512_div_ps(_mm512_set1_ps(1.f), sum[r]));
      store_tile(ot.data(), inv, lanes, lane_out, a.head_dim);
    };
    each_task([&](const QueryTile& t) {
      if (t.rows * a.group > 32)
        task(t, std::integral_constant<int, 3>{});
      else
        task(t, std::integral_constant<int, 2>{});
    });
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
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
    for (int64_t g = 0; g < lanes; g += 16) {
      __m512 max = _mm512_loadu_ps(first + g);
      for (int64_t p = 1; p < split.parts; ++p)
        max = _mm512_max_ps(max, _mm512_loadu_ps(first + p * partial_size + g));
      __m512 total = _mm512_setzero_ps();
      for (int64_t p = 0; p < split.parts; ++p) {
        const float* part = first + p * partial_size;
        const __m512 w = vec::exp(_mm512_sub_ps(_mm512_loadu_ps(part + g), max));
        total = _mm512_fmadd_ps(w, _mm512_loadu_ps(part + kTileLanes + g), total);
        for (int64_t d = 0; d < a.head_dim; ++d) {
          const __m512 o = _mm512_loadu_ps(part + (2 + d) * kTileLanes + g);
          float* dst = &ot[d * kTileLanes + g];
          _mm512_storeu_ps(dst, p == 0 ? _mm512_mul_ps(w, o) : _mm512_fmadd_ps(w, o, _mm512_loadu_ps(dst)));
        }
      }
      _mm512_store_ps(inv + g, _mm512_div_ps(_mm512_set1_ps(1.f), total));
    }
    store_tile(ot.data(), inv, lanes, lane_out, a.head_dim);
  }
}
#elif defined(PAGEDSERVE_AVX2)

// The tiled kernel on AVX2, in float32 throughout (no bf16 dot product): each block's K and V rows are
// widened into float32 rows once per task, and the scores and the weighted sums of V rows are small
// matrix products whose lanes are query vectors, 16 at a time (two ymm; 8 for a task's last few): up to
// kTileSteps positions (scores) or value columns (output) by 16 lanes are 12 sums, which with the two lane
// registers and one broadcast fill 15 of the 16 registers. One layer of SmolLM2 (9 query heads of 64 over
// 3 kv heads, bf16, 2 threads, a 2-core Zen 3), against the row kernel: a prompt of 2000 tokens 56.0 ->
// 44.4 ms, 1000 tokens 14.7 -> 12.7, 4 of 500 14.2 -> 11.6, 8 of 250 7.6 -> 6.6, a chunk of 512 after 2488
// cached 39.1 -> 30.1 ms.
constexpr int kTileSteps = 6;

// The scores of P positions (K rows at kb, head_dim floats apart) for the 8L lanes of qt (scaled queries,
// qt[d * kTileLanes + lane]) into s[j * kTileLanes + lane]: where masked, positions past a lane's limit
// are -inf; max[h] takes the scores in.
template <int P, int L>
void tile_scores_avx2(const float* qt, const float* kb, int64_t head_dim, const __m256i (&limit)[2],
                      int32_t pos, bool masked, float* s, __m256 (&max)[2]) {
  __m256 acc[P][L];
#pragma GCC unroll 8
  for (int j = 0; j < P; ++j)
    for (int h = 0; h < L; ++h) acc[j][h] = _mm256_setzero_ps();
  for (int64_t d = 0; d < head_dim; ++d) {
    __m256 q[L];
    for (int h = 0; h < L; ++h) q[h] = _mm256_loadu_ps(qt + d * kTileLanes + 8 * h);
#pragma GCC unroll 8
    for (int j = 0; j < P; ++j) {
      const __m256 k = _mm256_broadcast_ss(kb + j * head_dim + d);
      for (int h = 0; h < L; ++h) acc[j][h] = _mm256_fmadd_ps(q[h], k, acc[j][h]);
    }
  }
  const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
#pragma GCC unroll 8
  for (int j = 0; j < P; ++j)
    for (int h = 0; h < L; ++h) {
      __m256 v = acc[j][h];
      if (masked) {
        const __m256i past = _mm256_cmpgt_epi32(_mm256_set1_epi32(pos + j), limit[h]);
        v = _mm256_blendv_ps(v, ninf, _mm256_castsi256_ps(past));
      }
      _mm256_storeu_ps(s + j * kTileLanes + 8 * h, v);
      max[h] = _mm256_max_ps(max[h], v);
    }
}

// ot[c * kTileLanes + lane] for C value columns and the 8L lanes: alpha * ot + the sum over j < n of the
// weights s[j * kTileLanes + lane] times V[j][c] (rows at vb, head_dim floats apart).
template <int C, int L>
void tile_values_avx2(const float* s, const float* vb, int64_t head_dim, int64_t n, const __m256 (&alpha)[2],
                      float* ot) {
  __m256 acc[C][L];
#pragma GCC unroll 8
  for (int c = 0; c < C; ++c)
    for (int h = 0; h < L; ++h)
      acc[c][h] = _mm256_mul_ps(_mm256_loadu_ps(ot + c * kTileLanes + 8 * h), alpha[h]);
  for (int64_t j = 0; j < n; ++j) {
    __m256 p[L];
    for (int h = 0; h < L; ++h) p[h] = _mm256_loadu_ps(s + j * kTileLanes + 8 * h);
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      const __m256 v = _mm256_broadcast_ss(vb + j * head_dim + c);
      for (int h = 0; h < L; ++h) acc[c][h] = _mm256_fmadd_ps(p[h], v, acc[c][h]);
    }
  }
#pragma GCC unroll 8
  for (int c = 0; c < C; ++c)
    for (int h = 0; h < L; ++h) _mm256_storeu_ps(ot + c * kTileLanes + 8 * h, acc[c][h]);
}

using TileScoresFn = void (*)(const float*, const float*, int64_t, const __m256i (&)[2], int32_t, bool,
                              float*, __m256 (&)[2]);
using TileValuesFn = void (*)(const float*, const float*, int64_t, int64_t, const __m256 (&)[2], float*);
template <int L, int... P>
constexpr std::array<TileScoresFn, sizeof...(P)> tile_scores_table(std::integer_sequence<int, P...>) {
  return {&tile_scores_avx2<P + 1, L>...};
}
template <int L, int... C>
constexpr std::array<TileValuesFn, sizeof...(C)> tile_values_table(std::integer_sequence<int, C...>) {
  return {&tile_values_avx2<C + 1, L>...};
}
// [lane registers - 1][positions or columns - 1]
constexpr std::array<std::array<TileScoresFn, kTileSteps>, 2> kTileScores = {
    tile_scores_table<1>(std::make_integer_sequence<int, kTileSteps>{}),
    tile_scores_table<2>(std::make_integer_sequence<int, kTileSteps>{})};
constexpr std::array<std::array<TileValuesFn, kTileSteps>, 2> kTileValues = {
    tile_values_table<1>(std::make_integer_sequence<int, kTileSteps>{}),
    tile_values_table<2>(std::make_integer_sequence<int, kTileSteps>{})};

template <typename T>
void tiled_attention(const AttentionArgs<T>& a, const std::vector<QueryTile>& tasks,
                     const std::vector<TileSplit>& splits, int64_t num_partials) {
  TORCH_CHECK(splits.empty() && num_partials == 0, "the AVX2 tiled kernel computes whole tiles");
  BadBlock bad;
  // bf16 and float rows 8 at a time (load8, store8_bf16), transposed in registers, where a row is whole
  // registers; else one value at a time.
  constexpr bool kVectorRows = std::is_same_v<T, c10::BFloat16> || std::is_same_v<T, float>;
  const bool vector_rows = kVectorRows && a.head_dim % 8 == 0;
  for_tile_tasks(a, tasks, [&](auto&& each_task) {
    // qt[d][lane] the scaled queries, kb, vb[j][d] one block's K and V rows, widened, s[j][lane] one block's
    // scores (then weights), ot[d][lane] the unnormalised output.
    std::vector<float> qt(a.head_dim * kTileLanes), kb(a.block_size * a.head_dim),
        vb(a.block_size * a.head_dim), s(a.block_size * kTileLanes), ot(a.head_dim * kTileLanes);
    each_task([&](const QueryTile& t) {
      alignas(32) int32_t limit[kTileLanes];
      const T* lane_q[kTileLanes];
      T* lane_out[kTileLanes];
      const int64_t lanes = tile_lanes(a, t, limit, lane_q, lane_out), halves = (lanes + 15) / 16;
      if constexpr (kVectorRows) {
        if (vector_rows) {
          const __m256 fscale = _mm256_set1_ps(a.fscale);
          for (int64_t g = 0; g < kTileLanes; g += 8)
            for (int64_t d0 = 0; d0 < a.head_dim; d0 += 8) {
              __m256 r[8];
              for (int i = 0; i < 8; ++i) r[i] = vec::load(lane_q[g + i] + d0);
              vec::transpose(r);
              for (int i = 0; i < 8; ++i)
                _mm256_storeu_ps(&qt[(d0 + i) * kTileLanes + g], _mm256_mul_ps(r[i], fscale));
            }
        }
      }
      if (!vector_rows)
        for (int64_t lane = 0; lane < kTileLanes; ++lane)
          for (int64_t d = 0; d < a.head_dim; ++d)
            qt[d * kTileLanes + lane] = static_cast<float>(lane_q[lane][d]) * a.fscale;
      // Per half of the lanes (16 each): the last positions they see, the running max and sum.
      __m256i lim[2][2];
      __m256 max[2][2], sum[2][2];
      for (int h = 0; h < 2; ++h)
        for (int i = 0; i < 2; ++i) {
          lim[h][i] = _mm256_load_si256(reinterpret_cast<const __m256i*>(limit + 16 * h + 8 * i));
          max[h][i] = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
          sum[h][i] = _mm256_setzero_ps();
        }
      std::fill(ot.begin(), ot.end(), 0.f);

      // One block of the task's sequence (see for_tile_blocks).
      const auto visit = [&](int64_t first, int64_t n, const T* k_block, const T* v_block) {
        for (int64_t j = 0; j < n; ++j) {
          load_row(k_block + j * a.row_stride, &kb[j * a.head_dim], a.head_dim);
          load_row(v_block + j * a.row_stride, &vb[j * a.head_dim], a.head_dim);
        }
        // Positions a lane must not see become -inf (none can be in a block that ends by the first lane's
        // position).
        const bool masked = first + n - 1 > t.pos0;
        for (int64_t h = 0; h < halves; ++h) {
          const int regs = lanes - 16 * h > 8 ? 2 : 1;  // of 8 lanes: one where the task's vectors end early
          // The block's scores, its positions in balanced parts (16 is 6 + 5 + 5), and the new max.
          __m256 new_max[2] = {max[h][0], max[h][1]};
          const int64_t parts = (n + kTileSteps - 1) / kTileSteps;
          for (int64_t i = 0; i < parts; ++i) {
            const int64_t j0 = n * i / parts, j1 = n * (i + 1) / parts;
            kTileScores[regs - 1][j1 - j0 - 1](&qt[16 * h], &kb[j0 * a.head_dim], a.head_dim, lim[h],
                                               static_cast<int32_t>(first + j0), masked,
                                               &s[j0 * kTileLanes + 16 * h], new_max);
          }
          // Online softmax: the old output and sum rescaled by exp(old max - new max), the scores turned
          // into weights exp(s - new max).
          __m256 alpha[2];
          for (int i = 0; i < regs; ++i) {
            alpha[i] = vec::exp(_mm256_sub_ps(max[h][i], new_max[i]));
            max[h][i] = new_max[i];
            sum[h][i] = _mm256_mul_ps(sum[h][i], alpha[i]);
            for (int64_t j = 0; j < n; ++j) {
              float* at = &s[j * kTileLanes + 16 * h + 8 * i];
              const __m256 p = vec::exp(_mm256_sub_ps(_mm256_loadu_ps(at), new_max[i]));
              _mm256_storeu_ps(at, p);
              sum[h][i] = _mm256_add_ps(sum[h][i], p);
            }
          }
          for (int64_t d0 = 0; d0 < a.head_dim; d0 += kTileSteps)
            kTileValues[regs - 1][std::min<int64_t>(kTileSteps, a.head_dim - d0) - 1](
                &s[16 * h], &vb[d0], a.head_dim, n, alpha, &ot[d0 * kTileLanes + 16 * h]);
        }
      };
      if (!for_tile_blocks(a, t, bad, visit)) return;
      alignas(32) float inv[kTileLanes];
      for (int h = 0; h < 2; ++h)
        for (int i = 0; i < 2; ++i)
          _mm256_store_ps(inv + 16 * h + 8 * i, _mm256_div_ps(_mm256_set1_ps(1.f), sum[h][i]));
      const int64_t head_dim = a.head_dim;  // a local: the stores below could alias a's fields
      if constexpr (kVectorRows) {
        if (vector_rows)
          for (int64_t g = 0; g < lanes; g += 8) {
            const __m256 scale = _mm256_load_ps(inv + g);
            for (int64_t d0 = 0; d0 < head_dim; d0 += 8) {
              __m256 r[8];
              for (int i = 0; i < 8; ++i)
                r[i] = _mm256_mul_ps(_mm256_loadu_ps(&ot[(d0 + i) * kTileLanes + g]), scale);
              vec::transpose(r);
              for (int64_t j = 0; j < std::min<int64_t>(8, lanes - g); ++j) {
                if constexpr (std::is_same_v<T, c10::BFloat16>)
                  vec::store(lane_out[g + j] + d0, r[j]);  // rounded as c10 rounds
                else
                  _mm256_storeu_ps(lane_out[g + j] + d0, r[j]);
              }
            }
          }
      }
      if (!vector_rows)
        for (int64_t lane = 0; lane < lanes; ++lane) {
          T* o = lane_out[lane];
          for (int64_t d = 0; d < head_dim; ++d) o[d] = static_cast<T>(ot[d * kTileLanes + lane] * inv[lane]);
        }
    });
  });
  bad.check(a.num_blocks);
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
