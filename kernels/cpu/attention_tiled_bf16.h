// The tiled attention's products on AVX-512 BF16 for bf16 caches (attention_tiled.cpp): the queries held as
// pairs of head dims (qp), K's pairs broadcast from the cache, the scores by vdpbf16ps; the softmax weights
// rounded to bf16 side by side in pairs of positions (pp, as FlashAttention feeds P to its second product)
// and V's rows of those positions interleaved (vp), the output by vdpbf16ps again. With AMX both products
// are tiles (attention_amx.h). The vector layer has no bf16 pair product: these are this instruction set's
// own, beside the float32 products every build shares.

#pragma once

#if defined(__AVX512BF16__)

#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

#include "attention.h"
#include "attention_amx.h"
#include "vec.h"

namespace pagedserve::cpu::tiled_bf16 {

// Positions scored together (8 x R registers of sums), and value columns accumulated together.
constexpr int64_t kPositions = 8, kColumns = 8;

// qp[d / 2 * kTileLanes + lane]: the pair of head dims (d, d + 1) of each of the R x 16 lanes' queries.
template <int R>
inline void load_query_pairs(const c10::BFloat16* const* lane_q, int64_t head_dim, int32_t* qp) {
  if (head_dim % 32 == 0) {  // 16 lanes x 16 pairs at a time, transposed in registers
    for (int64_t g = 0; g < 16 * R; g += 16)
      for (int64_t p0 = 0; p0 < head_dim / 2; p0 += 16) {
        __m512i r[16];
        for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(lane_q[g + i] + 2 * p0);
        vec::transpose(r);
        for (int j = 0; j < 16; ++j) _mm512_storeu_si512(&qp[(p0 + j) * kTileLanes + g], r[j]);
      }
    return;
  }
  for (int64_t lane = 0; lane < 16 * R; ++lane)
    for (int64_t d = 0; d < head_dim; d += 2)
      std::memcpy(&qp[d / 2 * kTileLanes + lane], lane_q[lane] + d, 4);
}

// One block of a task of R x 16 lanes (positions first .. first + n - 1, K and V rows row_stride apart): the
// scores (scaled, -inf past a lane's limit where masked), the online softmax's max and sum per lane
// (max[r] and sum[r]), the weight pairs and the output ot[d * kTileLanes + lane] rescaled and added to.
template <int R>
__attribute__((always_inline)) inline void block(int64_t first, int64_t n, const c10::BFloat16* k_block,
                                                 const c10::BFloat16* v_block, int64_t row_stride,
                                                 int64_t head_dim, float fscale, bool masked, bool amx,
                                                 const __m512i (&lim)[R], __m512 (&max)[R], __m512 (&sum)[R],
                                                 const int32_t* qp, int32_t* pp, int32_t* vp,
                                                 c10::BFloat16* vt, float* s, float* ot) {
  __m512 next[R];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) next[r] = max[r];
  for (int64_t j0 = 0; j0 < n; j0 += kPositions) {
    __m512 acc[kPositions][R];
#pragma GCC unroll 8
    for (int64_t j = 0; j < kPositions; ++j)
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) acc[j][r] = _mm512_setzero_ps();
    const int64_t m = std::min(kPositions, n - j0);
    // Positions past m repeat the block's last row; their scores are never stored.
    if (amx) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
      // S^T = K Q^T for the whole block at once (see amx_scores), read here as the sums.
      if (j0 == 0) amx_scores<R>(k_block, row_stride, qp, head_dim, s);
      for (int64_t j = 0; j < m; ++j)
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) acc[j][r] = _mm512_loadu_ps(&s[(j0 + j) * kTileLanes + 16 * r]);
#endif
    } else {
      const c10::BFloat16* k_rows[kPositions];
      for (int64_t j = 0; j < kPositions; ++j) k_rows[j] = k_block + (j0 + std::min(j, m - 1)) * row_stride;
      for (int64_t d = 0; d < head_dim; d += 2) {
        __m512bh q[R];
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) q[r] = (__m512bh)_mm512_loadu_si512(&qp[d / 2 * kTileLanes + 16 * r]);
#pragma GCC unroll 8
        for (int64_t j = 0; j < kPositions; ++j) {
          int32_t pair;
          std::memcpy(&pair, k_rows[j] + d, sizeof(pair));
          const __m512bh k = (__m512bh)_mm512_set1_epi32(pair);
#pragma GCC unroll 4
          for (int r = 0; r < R; ++r) acc[j][r] = _mm512_dpbf16_ps(acc[j][r], q[r], k);
        }
      }
    }
    const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    const __m512 scale = _mm512_set1_ps(fscale);
    for (int64_t j = 0; j < m; ++j) {
      const __m512i pos = _mm512_set1_epi32(static_cast<int32_t>(first + j0 + j));
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        __m512 sc = _mm512_mul_ps(acc[j][r], scale);
        if (masked) sc = _mm512_mask_mov_ps(sc, _mm512_cmpgt_epi32_mask(pos, lim[r]), ninf);
        _mm512_storeu_ps(&s[(j0 + j) * kTileLanes + 16 * r], sc);
        next[r] = _mm512_max_ps(next[r], sc);
      }
    }
  }
  // Online softmax over the block: the old output and sum rescaled by exp(old max - new max).
  __m512 alpha[R];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    alpha[r] = vec::exp(_mm512_sub_ps(max[r], next[r]));
    max[r] = next[r];
    sum[r] = _mm512_mul_ps(sum[r], alpha[r]);
  }
  // Positions in pairs (j, j + 1): the weights exp(s - new max), added to the sums in position order, then
  // rounded to bf16 side by side per lane; V's two rows interleaved per column.
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                              23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  for (int64_t jp = 0; jp < (n + 1) / 2; ++jp) {
    const int64_t j = 2 * jp;
    const bool second = j + 1 < n;  // an odd block's last pair has one position
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m512 lo = vec::exp(_mm512_sub_ps(_mm512_loadu_ps(&s[j * kTileLanes + 16 * r]), next[r]));
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
    const c10::BFloat16* r0 = v_block + j * row_stride;
    for (int64_t d = 0; d < head_dim; d += 16) {
      const __m256i row0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r0 + d));
      const __m256i row1 = second ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r0 + row_stride + d))
                                  : _mm256_setzero_si256();
      _mm512_storeu_si512(
          &vp[jp * head_dim + d],
          _mm512_permutexvar_epi16(interleave, _mm512_inserti64x4(_mm512_castsi256_si512(row0), row1, 1)));
    }
  }
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  if (amx) return amx_values<R>(v_block, row_stride, n, head_dim, alpha, pp, vt, ot);
#endif
  // ot[d][lane] = alpha * ot[d][lane] + sum over the pairs of their weights times V's, kColumns d at a time.
  for (int64_t d0 = 0; d0 < head_dim; d0 += kColumns) {
    __m512 acc[kColumns][R];
#pragma GCC unroll 8
    for (int64_t c = 0; c < kColumns; ++c)
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r)
        acc[c][r] = _mm512_mul_ps(_mm512_loadu_ps(&ot[(d0 + c) * kTileLanes + 16 * r]), alpha[r]);
    for (int64_t jp = 0; jp < (n + 1) / 2; ++jp) {
      __m512bh p[R];
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) p[r] = (__m512bh)_mm512_loadu_si512(&pp[jp * kTileLanes + 16 * r]);
      const int32_t* v_pairs = &vp[jp * head_dim + d0];
#pragma GCC unroll 8
      for (int64_t c = 0; c < kColumns; ++c) {
        const __m512bh v = (__m512bh)_mm512_set1_epi32(v_pairs[c]);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) acc[c][r] = _mm512_dpbf16_ps(acc[c][r], p[r], v);
      }
    }
#pragma GCC unroll 8
    for (int64_t c = 0; c < kColumns; ++c)
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) _mm512_storeu_ps(&ot[(d0 + c) * kTileLanes + 16 * r], acc[c][r]);
  }
}

}  // namespace pagedserve::cpu::tiled_bf16

#endif  // __AVX512BF16__
