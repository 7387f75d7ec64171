// The tiled attention's two products on AMX (attention_tiled.cpp, bf16): the scores S^T = K Q^T with K's 16
// rows of a block as one tile, straight from the cache, by the query pairs qp as the other; the output
// O^T += V^T P^T with the block's V transposed (vt) by the weight pairs pp. The layouts are those of the
// AVX-512 BF16 products (s and ot lane-minor, qp and pp pairs by lanes), so the masking, the online softmax,
// the splits and the stores are shared. The sums run in vdpbf16ps's order; tdpbf16ps rounds inside a pair's
// two products differently in rare cases, so the outputs are those but for rare last-bit differences.

#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)

#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <cstdint>

#include "amx.h"
#include "attention.h"
#include "common.h"
#include "vec.h"

namespace pagedserve::cpu {

constexpr int64_t kAmxKeys = 16;  // positions of a block
// Tiles 0-2: scores of 16 positions by 16 lanes, 3: K (16 positions x 32 dims), 4: query pairs (16 pairs x
// 16 lanes), 5: output (16 dims x 16 lanes), 6: V^T (16 dims x 16 positions), 7: weight pairs (8 pairs of
// positions x 16 lanes).
constexpr TileConfig kAttentionTiles{{16, 64}, {16, 64}, {16, 64}, {16, 64},
                                     {16, 64}, {16, 64}, {16, 32}, {8, 64}};

// Whether a call's tiled products can be tiles: blocks of 16 positions, head sizes a multiple of 32.
template <typename T>
inline bool use_amx_attention(const AttentionArgs<T>& a) {
  return a.block_size == kAmxKeys && a.head_dim % 32 == 0 && amx_enabled();
}

// s[j * kTileLanes + lane] = K row j . query vector lane, for the R x 16 lanes of qp and the 16 rows of K
// (row_stride elements apart; rows past a short block's end are read and never used).
template <int R>
inline void amx_scores(const c10::BFloat16* k, int64_t row_stride, const int32_t* qp, int64_t head_dim,
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
inline void amx_values(const c10::BFloat16* v, int64_t row_stride, int64_t n, int64_t head_dim,
                       const __m512 (&alpha)[R], int32_t* pp, c10::BFloat16* vt, float* ot) {
  // 32 dims at a time: 16 rows of 16 dim pairs transposed (vec::transpose), each pair split into its two
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

}  // namespace pagedserve::cpu

#endif
