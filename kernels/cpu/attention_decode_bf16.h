// The row kernel's bf16 products on AVX-512 BF16 (attention_decode.cpp): the scores of a bf16 query straight
// from the bf16 K rows of the cache, and the weighted sum of V rows two positions per dot product, with
// vdpbf16ps (each product of two bf16 values exact in float32, summed in float32). The vector layer has no
// such product: these are this instruction set's own.

#pragma once

#if defined(__AVX512BF16__)

#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "prefetch.h"
#include "vec.h"

namespace pagedserve::cpu::bf16dot {

// Sums each of 16 vectors into one lane of the result (lane j = sum of v[j]): a transposing tree of
// shuffles and adds, about 3 instructions per vector instead of a full horizontal sum each.
inline __m512 sum_lanes16(const __m512* v) {
  __m512 t[8], u[4], w[2];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: (a0+a2, b0+b2, a1+a3, b1+b3)
    t[i] =
        _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: the lane sums of 4 vectors
    const __m512d a = _mm512_castps_pd(t[2 * i]), b = _mm512_castps_pd(t[2 * i + 1]);
    u[i] =
        _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  for (int i = 0; i < 2; ++i)  // 128-bit lanes (0+1, 2+3) of two such
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// block_scores of a bf16 query straight from bf16 K rows (no widening): each vdpbf16ps multiplies 32 head
// dims of the query and a row (every product exact in float32, summed in float32); out is scaled after.
template <int kVectors>
inline void block_scores_bf16_avx512(const c10::BFloat16* q, const c10::BFloat16* rows, int64_t stride,
                                     int64_t n, float scale, float* out, const char* fetch = nullptr,
                                     int64_t fetch_bytes = 0) {
  FetchShare ahead(fetch, fetch_bytes, 16);  // over the first 16 rows
  __m512bh qv[kVectors];
  for (int c = 0; c < kVectors; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(q + 32 * c);
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const int64_t m = std::min<int64_t>(16, n - j0);
    __m512 partial[16];
    for (int j = 0; j < 16; ++j) {
      // Lanes past m repeat the last row and are never stored.
      const c10::BFloat16* row = rows + (j0 + std::min<int64_t>(j, m - 1)) * stride;
      ahead.step();
      __m512 acc = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[0], (__m512bh)_mm512_loadu_si512(row));
      for (int c = 1; c < kVectors; ++c)
        acc = _mm512_dpbf16_ps(acc, qv[c], (__m512bh)_mm512_loadu_si512(row + 32 * c));
      partial[j] = acc;
    }
    _mm512_mask_storeu_ps(out + j0, static_cast<__mmask16>((1u << m) - 1),
                          _mm512_mul_ps(sum_lanes16(partial), _mm512_set1_ps(scale)));
  }
  ahead.rest();
}

// block_scores_bf16 for G query vectors of head size 64 at once (q_g at q + 64 g, its scores at out +
// g * out_stride): each K row is loaded once for all of them, and the sums of four rows are reduced as
// soon as they are done (sum_lanes16's first two levels), so the registers hold G x 4 sums, not G x 16.
// The same sums in the same order as block_scores_bf16_avx512<2>: the same bits.
template <int G>
inline void group_scores_bf16_64(const c10::BFloat16* q, const c10::BFloat16* rows, int64_t stride, int64_t n,
                                 float scale, float* out, int64_t out_stride, const char* fetch,
                                 int64_t fetch_bytes) {
  FetchShare ahead(fetch, fetch_bytes, 16);  // over the first 16 rows
  __m512bh q0[G], q1[G];
  for (int g = 0; g < G; ++g) {
    q0[g] = (__m512bh)_mm512_loadu_si512(q + 64 * g);
    q1[g] = (__m512bh)_mm512_loadu_si512(q + 64 * g + 32);
  }
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const int64_t m = std::min<int64_t>(16, n - j0);
    // Per vector, rows 4k .. 4k + 3 summed pairwise per 128-bit lane (quad), and two such quads' 128-bit
    // lanes summed (half): each level reduced as soon as its inputs are done, so that no more than G x 4
    // sums, G quads and G halves are live at once (with all G x 4 quads kept to the end, they spilled).
    __m512 quad[G][2], half[G][2];
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) {
      __m512 acc[G][4];
#pragma GCC unroll 4
      for (int r = 0; r < 4; ++r) {
        const int j = 4 * k + r;
        // Lanes past m repeat the last row and are never stored.
        const c10::BFloat16* row = rows + (j0 + std::min<int64_t>(j, m - 1)) * stride;
        ahead.step();
        const __m512bh x0 = (__m512bh)_mm512_loadu_si512(row), x1 = (__m512bh)_mm512_loadu_si512(row + 32);
        for (int g = 0; g < G; ++g)
          acc[g][r] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), q0[g], x0), q1[g], x1);
      }
      for (int g = 0; g < G; ++g) {
        const __m512 t0 =
            _mm512_add_ps(_mm512_unpacklo_ps(acc[g][0], acc[g][1]), _mm512_unpackhi_ps(acc[g][0], acc[g][1]));
        const __m512 t1 =
            _mm512_add_ps(_mm512_unpacklo_ps(acc[g][2], acc[g][3]), _mm512_unpackhi_ps(acc[g][2], acc[g][3]));
        const __m512d a = _mm512_castps_pd(t0), b = _mm512_castps_pd(t1);
        quad[g][k % 2] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                                       _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
        if (k % 2 == 1)
          half[g][k / 2] =
              _mm512_add_ps(_mm512_shuffle_f32x4(quad[g][0], quad[g][1], _MM_SHUFFLE(2, 0, 2, 0)),
                            _mm512_shuffle_f32x4(quad[g][0], quad[g][1], _MM_SHUFFLE(3, 1, 3, 1)));
      }
    }
    for (int g = 0; g < G; ++g) {
      const __m512 sums =
          _mm512_add_ps(_mm512_shuffle_f32x4(half[g][0], half[g][1], _MM_SHUFFLE(2, 0, 2, 0)),
                        _mm512_shuffle_f32x4(half[g][0], half[g][1], _MM_SHUFFLE(3, 1, 3, 1)));
      _mm512_mask_storeu_ps(out + g * out_stride + j0, static_cast<__mmask16>((1u << m) - 1),
                            _mm512_mul_ps(sums, _mm512_set1_ps(scale)));
    }
  }
  ahead.rest();
}

// group_scores_bf16_64 for any number of vectors (q_g 64 apart): three at a time (each K row loaded once for
// a group of three), then the one or two left; the first run brings the share of the next block.
inline void group_scores_bf16_64(const c10::BFloat16* q, int64_t vectors, const c10::BFloat16* rows,
                                 int64_t stride, int64_t n, float scale, float* out, int64_t out_stride,
                                 const char* fetch, int64_t fetch_bytes) {
  for (int64_t g = 0; g < vectors; g += 3, fetch_bytes = 0) {
    const c10::BFloat16* qg = q + 64 * g;
    float* og = out + g * out_stride;
    const int64_t run = std::min<int64_t>(3, vectors - g);
    if (run == 3)
      group_scores_bf16_64<3>(qg, rows, stride, n, scale, og, out_stride, fetch, fetch_bytes);
    else if (run == 2)
      group_scores_bf16_64<2>(qg, rows, stride, n, scale, og, out_stride, fetch, fetch_bytes);
    else
      group_scores_bf16_64<1>(qg, rows, stride, n, scale, og, out_stride, fetch, fetch_bytes);
  }
}

// Head sizes block_scores_bf16 takes.
inline bool has_bf16_scores(int64_t size) {
  return size == 32 || size == 64 || size == 96 || size == 128 || size == 256;
}

inline void block_scores_bf16(const c10::BFloat16* q, const c10::BFloat16* rows, int64_t stride, int64_t n,
                              int64_t size, float scale, float* out, const char* fetch = nullptr,
                              int64_t fetch_bytes = 0) {
  switch (size) {
    case 32:
      return block_scores_bf16_avx512<1>(q, rows, stride, n, scale, out, fetch, fetch_bytes);
    case 64:
      return block_scores_bf16_avx512<2>(q, rows, stride, n, scale, out, fetch, fetch_bytes);
    case 96:
      return block_scores_bf16_avx512<3>(q, rows, stride, n, scale, out, fetch, fetch_bytes);
    case 128:
      return block_scores_bf16_avx512<4>(q, rows, stride, n, scale, out, fetch, fetch_bytes);
    default:
      return block_scores_bf16_avx512<8>(q, rows, stride, n, scale, out, fetch, fetch_bytes);
  }
}

// The scores of `vectors` query vectors of one kv head (q_g at q + g * size, bf16 as the query is), scaled,
// into out + g * out_stride; the first brings the share of the next block.
inline void group_scores(const c10::BFloat16* q, int64_t vectors, const c10::BFloat16* rows, int64_t stride,
                         int64_t n, int64_t size, float scale, float* out, int64_t out_stride,
                         const char* fetch, int64_t fetch_bytes) {
  if (size == 64)
    return group_scores_bf16_64(q, vectors, rows, stride, n, scale, out, out_stride, fetch, fetch_bytes);
  for (int64_t g = 0; g < vectors; ++g, fetch_bytes = 0)
    block_scores_bf16(q + g * size, rows, stride, n, size, scale, out + g * out_stride, fetch, fetch_bytes);
}

// Word k of a pair register (two rows' 32 dims interleaved) is, for even k, word k / 2 of the first row, for
// odd k that of the second (index 32 + k / 2); the second register of a row's 32 dims starts 16 words
// further.
alignas(64) inline constexpr int16_t kPairLow[32] = {0,  32, 1,  33, 2,  34, 3,  35, 4,  36, 5,
                                                     37, 6,  38, 7,  39, 8,  40, 9,  41, 10, 42,
                                                     11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
alignas(64) inline constexpr int16_t kPairHigh[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21,
                                                      53, 22, 54, 23, 55, 24, 56, 25, 57, 26, 58,
                                                      27, 59, 28, 60, 29, 61, 30, 62, 31, 63};

// The first m (at most 16) weights of each of V vectors (w_v at w + v * w_stride) rounded to bf16, two
// positions to an int32 (pairs[v][j / 2]); past m, zeros.
template <int V>
inline void weight_pairs(const float* w, int64_t w_stride, int64_t m, int32_t (*pairs)[8]) {
  const __mmask16 valid = static_cast<__mmask16>((1u << m) - 1);
#pragma GCC unroll 8
  for (int v = 0; v < V; ++v)
    _mm256_store_si256(reinterpret_cast<__m256i*>(pairs[v]),
                       (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(valid, w + v * w_stride)));
}

// accumulate_rows for the `vectors` query vectors of one kv head at once (acc and w of vector r at
// acc + r * head size and w + r * w_stride), reading the bf16 V rows straight from the cache, two
// positions per step with the bf16 dot product: the rows of positions j and j + 1 are interleaved into
// pairs (V[j][d], V[j + 1][d]) for 16 dims d a register (one vpermt2w each), and vdpbf16ps adds
// w[j] * V[j][d] + w[j + 1] * V[j + 1][d] for a broadcast pair of weights, rounded to bf16 first (as the
// tiled kernel rounds P, and FlashAttention does). Half the instructions of widening each row to float32
// and a multiply-add per weight. The fetch_bytes at fetch are prefetched a share a step (see FetchShare).
template <int kChunks, int kVectors>
inline void accumulate_group_bf16_avx512(float* acc, const float* w, int64_t w_stride,
                                         const c10::BFloat16* rows, int64_t stride, int64_t n,
                                         const char* fetch = nullptr, int64_t fetch_bytes = 0) {
  FetchShare ahead(fetch, fetch_bytes, (std::min<int64_t>(16, n) + 1) / 2);  // over the first pairs
  static_assert(kChunks % 2 == 0, "head sizes of whole 32-dim registers");
  const __m512i low = _mm512_load_si512(kPairLow), high = _mm512_load_si512(kPairHigh);
  // NOTE: the `GCC unroll` pragmas keep the sums in registers: without them GCC gives a[][] a place on the
  // stack and stores every sum there after every pair of rows.
  __m512 a[kVectors][kChunks];
#pragma GCC unroll 8
  for (int r = 0; r < kVectors; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < kChunks; ++c) a[r][c] = _mm512_loadu_ps(acc + r * 16 * kChunks + 16 * c);
  alignas(64) int32_t pairs[kVectors][8];  // a run's weights in bf16, two to an int32
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const int64_t m = std::min<int64_t>(16, n - j0);
    // An odd run ends with a pair whose second weight is zero (its row is read again, times zero).
    weight_pairs<kVectors>(w + j0, w_stride, m, pairs);
    for (int64_t j = 0; j < m; j += 2) {
      const c10::BFloat16* r0 = rows + (j0 + j) * stride;
      const c10::BFloat16* r1 = j + 1 < m ? r0 + stride : r0;
      ahead.step();
      __m512i v[kChunks];
#pragma GCC unroll 8
      for (int c = 0; c < kChunks / 2; ++c) {
        const __m512i x0 = _mm512_loadu_si512(r0 + 32 * c), x1 = _mm512_loadu_si512(r1 + 32 * c);
        v[2 * c] = _mm512_permutex2var_epi16(x0, low, x1);
        v[2 * c + 1] = _mm512_permutex2var_epi16(x0, high, x1);
      }
#pragma GCC unroll 8
      for (int r = 0; r < kVectors; ++r) {
        const __m512bh p = (__m512bh)_mm512_set1_epi32(pairs[r][j / 2]);
#pragma GCC unroll 8
        for (int c = 0; c < kChunks; ++c) a[r][c] = _mm512_dpbf16_ps(a[r][c], (__m512bh)v[c], p);
      }
    }
  }
  ahead.rest();
#pragma GCC unroll 8
  for (int r = 0; r < kVectors; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < kChunks; ++c) _mm512_storeu_ps(acc + r * 16 * kChunks + 16 * c, a[r][c]);
}

// Head sizes accumulate_group_bf16 takes.
inline bool has_bf16_values(int64_t size) { return size == 64 || size == 128; }

// Up to 16 accumulator registers at a time: vectors in runs of 4 (head size 64) or 2 (128).
inline void accumulate_group_bf16(float* acc, const float* w, int64_t w_stride, int64_t vectors,
                                  const c10::BFloat16* rows, int64_t stride, int64_t n, int64_t size,
                                  const char* fetch = nullptr, int64_t fetch_bytes = 0) {
  for (int64_t r = 0; r < vectors;) {
    float* out = acc + r * size;
    const float* wr = w + r * w_stride;
    const int64_t left = vectors - r;
    const int64_t bytes = r == 0 ? fetch_bytes : 0;  // the first run of vectors brings the next block
    if (size == 64) {
      if (left >= 4) {
        accumulate_group_bf16_avx512<4, 4>(out, wr, w_stride, rows, stride, n, fetch, bytes), r += 4;
      } else if (left == 3) {
        accumulate_group_bf16_avx512<4, 3>(out, wr, w_stride, rows, stride, n, fetch, bytes), r += 3;
      } else if (left == 2) {
        accumulate_group_bf16_avx512<4, 2>(out, wr, w_stride, rows, stride, n, fetch, bytes), r += 2;
      } else {
        accumulate_group_bf16_avx512<4, 1>(out, wr, w_stride, rows, stride, n, fetch, bytes), r += 1;
      }
    } else if (left >= 2) {
      accumulate_group_bf16_avx512<8, 2>(out, wr, w_stride, rows, stride, n, fetch, bytes), r += 2;
    } else {
      accumulate_group_bf16_avx512<8, 1>(out, wr, w_stride, rows, stride, n, fetch, bytes), r += 1;
    }
  }
}

// The blocked rows of a long prompt (attention_decode.cpp blocked_rows): a part of one kv head's K and V
// laid out once for all the block's rows, each row then computing exactly what the row kernel computes for
// it.

// 16 positions' K rows of head size 64 (rows[j], nullptr past the part: zeros) transposed into kt[0 .. 32):
// kt[l] holds, one position a lane, the pair of dims (2l, 2l + 1), the 32-bit word l of each row.
inline void transpose_k_64(const c10::BFloat16* const* rows, __m512i* kt) {
  __m512i lo[16], hi[16];
  for (int j = 0; j < 16; ++j) {
    lo[j] = rows[j] != nullptr ? _mm512_loadu_si512(rows[j]) : _mm512_setzero_si512();
    hi[j] = rows[j] != nullptr ? _mm512_loadu_si512(rows[j] + 32) : _mm512_setzero_si512();
  }
  vec::transpose(lo);
  vec::transpose(hi);
  for (int l = 0; l < 16; ++l) kt[l] = lo[l], kt[16 + l] = hi[l];
}

// The V rows of positions j and j + 1 (head size 64) interleaved into pairs as accumulate_group_bf16_avx512
// interleaves them: four registers of 16 dims.
inline void pair_v_64(const c10::BFloat16* r0, const c10::BFloat16* r1, __m512i* vp) {
  const __m512i low = _mm512_load_si512(kPairLow), high = _mm512_load_si512(kPairHigh);
  for (int c = 0; c < 2; ++c) {
    const __m512i x0 = _mm512_loadu_si512(r0 + 32 * c), x1 = _mm512_loadu_si512(r1 + 32 * c);
    vp[2 * c] = _mm512_permutex2var_epi16(x0, low, x1);
    vp[2 * c + 1] = _mm512_permutex2var_epi16(x0, high, x1);
  }
}

// The scaled scores of G bf16 query vectors of head size 64 (q_g at q + 64 g) against the first n positions
// of transposed K (transpose_k_64, 32 registers per 16 positions), into out + g * out_stride. Position j's
// score is group_scores_bf16_64's, one position a lane instead of one dim pair a lane: each lane's two
// vdpbf16ps in the same order, then its 16 sums added in sum_lanes16's tree, ((s0 + s1) + (s2 + s3)) with
// s_k = (a_4k + a_4k+2) + (a_4k+1 + a_4k+3): the same bits, with no shuffles.
template <int G>
inline void transposed_scores_64(const c10::BFloat16* q, const __m512i* kt, int64_t n, float scale,
                                 float* out, int64_t out_stride) {
  const int32_t* qp = reinterpret_cast<const int32_t*>(q);
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const __m512i* k = kt + j0 * 2;  // 32 registers per 16 positions
    __m512 s[G][4];
#pragma GCC unroll 4
    for (int k4 = 0; k4 < 4; ++k4) {
      __m512 acc[G][4];
#pragma GCC unroll 4
      for (int r = 0; r < 4; ++r) {
        const int l = 4 * k4 + r;
        const __m512bh k0 = (__m512bh)k[l], k1 = (__m512bh)k[16 + l];
#pragma GCC unroll 4
        for (int g = 0; g < G; ++g)
          acc[g][r] = _mm512_dpbf16_ps(
              _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)_mm512_set1_epi32(qp[32 * g + l]), k0),
              (__m512bh)_mm512_set1_epi32(qp[32 * g + 16 + l]), k1);
      }
#pragma GCC unroll 4
      for (int g = 0; g < G; ++g)
        s[g][k4] = _mm512_add_ps(_mm512_add_ps(acc[g][0], acc[g][2]), _mm512_add_ps(acc[g][1], acc[g][3]));
    }
    const __mmask16 valid = static_cast<__mmask16>((1u << std::min<int64_t>(16, n - j0)) - 1);
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) {
      const __m512 sums = _mm512_add_ps(_mm512_add_ps(s[g][0], s[g][1]), _mm512_add_ps(s[g][2], s[g][3]));
      _mm512_mask_storeu_ps(out + g * out_stride + j0, valid, _mm512_mul_ps(sums, vscale));
    }
  }
}

// acc_g[0 .. 64) = the sum over the first n positions of w_g[j] * V[j] for G query vectors (w_g at w +
// g * w_stride, acc_g at acc + 64 g), from the paired V rows (pair_v_64, four registers per pair of
// positions); an odd n ends with the pair of the last row with itself, at last (its weight paired with
// zero). accumulate_group_bf16_avx512's sums in its order (the weights rounded to bf16, a pair a step, the
// pairs in position order): the same bits.
template <int G>
inline void paired_values_64(const float* w, int64_t w_stride, int64_t n, const __m512i* vp,
                             const c10::BFloat16* last, float* acc) {
  __m512 a[G][4];
#pragma GCC unroll 4
  for (int g = 0; g < G; ++g)
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) a[g][c] = _mm512_setzero_ps();
  alignas(64) int32_t pairs[G][8];
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const int64_t m = std::min<int64_t>(16, n - j0);
    weight_pairs<G>(w + j0, w_stride, m, pairs);
    for (int64_t j = 0; j < m; j += 2) {
      __m512i odd[4];
      const __m512i* v = vp + (j0 + j) * 2;  // four registers per pair
      if (j + 1 >= m) pair_v_64(last, last, odd), v = odd;
#pragma GCC unroll 4
      for (int g = 0; g < G; ++g) {
        const __m512bh p = (__m512bh)_mm512_set1_epi32(pairs[g][j / 2]);
#pragma GCC unroll 4
        for (int c = 0; c < 4; ++c) a[g][c] = _mm512_dpbf16_ps(a[g][c], (__m512bh)v[c], p);
      }
    }
  }
#pragma GCC unroll 4
  for (int g = 0; g < G; ++g)
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(acc + 64 * g + 16 * c, a[g][c]);
}

}  // namespace pagedserve::cpu::bf16dot

#endif  // __AVX512BF16__
