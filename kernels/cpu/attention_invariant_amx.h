// Batch-invariant attention on AMX tiles (attention_decode.cpp invariant_tiles): the two products of every
// query row, a decode row's as a prompt's, as tile products whose sums depend on the row alone.
//
// Why tiles can be batch-invariant: tdpbf16ps computes each element of its result alone, from one row of A
// and one column of B, in an order fixed by the tile's shape: with the 16 pairs (32 products) of a row,
// E = the float32 FMA chain over the even-index products (index 0, 2, 4, ... in order, from 0), O = the same
// chain over the odd-index ones, and c += E + O, with denormals flushed. The result of a query vector is then
// the same in a tile of 16 vectors (a prompt's) as in a tile of one (a decode row's), whatever its
// neighbours, as long as the tiles' inner dimension is laid out from the same origin: the head's dims for the
// scores, the part's positions (from its first, 32 a tile) for the output.
//
// Layouts: the queries as A (a vector a row of 64 bf16), K transposed as B (bf16dot::transpose_k_64: per 16
// positions, dim pair l one row, a position a column), so that a row's score of position j is
// (0 + (E + O) over dims 0-31) + (E + O) over dims 32-63; the weights (rounded to bf16) as A (a vector a row
// of 32 positions), V in pairs as B (bf16dot::pair_v_64: a pair of positions a row, 16 dims a tile), so that
// the output of a dim is the sum over the part's tiles of 32 positions, in order, of E + O over its even and
// odd positions. Where a row's tiles reach past its last position (a prompt row beside later ones), its
// weights there are zero: each such product is a zero that leaves E and O as they are (neither chain is ever
// -0, and the cache's V rows are finite), and a tile of them adds +0 to the sum: the bits of a decode row,
// whose tiles stop at its position. Two tiles of dims sum to the same bits in either order, and so do E and
// O; the order that matters is each chain's and the output's tiles of positions.

#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)

#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <limits>

#include "amx.h"
#include "vec.h"

namespace pagedserve::cpu::invariant_amx {

// Positions of a K tile, and of a weights tile.
constexpr int64_t kScoreRun = 16, kValueRun = 32;
// Tiles 0 and 3: B (K transposed or the query pairs, then V pairs); 1, 2: A (the queries' or K's dims 0-31
// and 32-63, then the weights in 1); 4-7: the sums (the scores of four runs of 16 positions, then the
// output's four runs of 16 dims). Each 16 rows of 64 bytes: a tile of fewer vectors computes its unused rows
// too.
constexpr TileConfig kTiles{{16, 64}, {16, 64}, {16, 64}, {16, 64}, {16, 64}, {16, 64}, {16, 64}, {16, 64}};

// s[v * s_stride + j] = query vector v . K row j for the 16 query vectors of qa (64 bf16 each, contiguous)
// and the positions j < n of kt (transpose_k_64's layout, 32 registers per 16 positions), unscaled; the
// columns up to n rounded up to 16 are written (past n: whatever kt holds there).
inline void scores(const c10::BFloat16* qa, const __m512i* kt, int64_t n, float* s, int64_t s_stride) {
  const int64_t bytes = s_stride * 4;
  _tile_loadd(1, qa, 128);
  _tile_loadd(2, qa + 32, 128);
  int64_t j0 = 0;
  // Four runs a step, each its own sum tile, so that the products of one run do not wait on the one before.
  for (; j0 + 4 * kScoreRun <= n; j0 += 4 * kScoreRun) {
    const __m512i* k = kt + j0 * 2;  // 32 registers per 16 positions
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
    _tile_loadd(0, k, 64);
    _tile_dpbf16ps(4, 1, 0);
    _tile_loadd(3, k + 16, 64);
    _tile_dpbf16ps(4, 2, 3);
    _tile_loadd(0, k + 32, 64);
    _tile_dpbf16ps(5, 1, 0);
    _tile_loadd(3, k + 48, 64);
    _tile_dpbf16ps(5, 2, 3);
    _tile_loadd(0, k + 64, 64);
    _tile_dpbf16ps(6, 1, 0);
    _tile_loadd(3, k + 80, 64);
    _tile_dpbf16ps(6, 2, 3);
    _tile_loadd(0, k + 96, 64);
    _tile_dpbf16ps(7, 1, 0);
    _tile_loadd(3, k + 112, 64);
    _tile_dpbf16ps(7, 2, 3);
    _tile_stored(4, s + j0, bytes);
    _tile_stored(5, s + j0 + 16, bytes);
    _tile_stored(6, s + j0 + 32, bytes);
    _tile_stored(7, s + j0 + 48, bytes);
  }
  for (; j0 < n; j0 += kScoreRun) {
    const __m512i* k = kt + j0 * 2;
    _tile_zero(4);
    _tile_loadd(0, k, 64);
    _tile_dpbf16ps(4, 1, 0);
    _tile_loadd(3, k + 16, 64);
    _tile_dpbf16ps(4, 2, 3);
    _tile_stored(4, s + j0, bytes);
  }
}

// `scores` for a tile of few query vectors (a decode row's group), its products the other way round: the
// same elements, so the same bits (each product of two bf16 values is exact, and the chains' order is
// that of the dim pairs either way), without transposing K. The K tiles are 16 positions of the cache as
// they lie (k_rows[j0] the first row of positions j0 .. j0 + 15, row_stride elements apart, all in one
// block), the queries the B tiles (qp: query_pairs), the result 16 positions by 16 vectors, transposed after
// into s[v * s_stride + j] for the m vectors v < m.
inline void scores_from_rows(const __m512i* qp, const c10::BFloat16* const* k_rows, int64_t row_stride,
                             int64_t n, int64_t m, float* s, int64_t s_stride) {
  const int64_t bytes = row_stride * 2;
  alignas(64) float st[4 * kScoreRun * 16];
  const auto transposed = [&](int64_t j0, int64_t runs) {
    for (int64_t r = 0; r < runs; ++r) {
      __m512 t[16];
      for (int j = 0; j < 16; ++j) t[j] = _mm512_load_ps(st + (r * 16 + j) * 16);
      vec::transpose(t);
      for (int64_t v = 0; v < m; ++v) _mm512_storeu_ps(s + v * s_stride + j0 + r * 16, t[v]);
    }
  };
  _tile_loadd(0, qp, 64);
  _tile_loadd(3, qp + 16, 64);
  int64_t j0 = 0;
  for (; j0 + 4 * kScoreRun <= n; j0 += 4 * kScoreRun) {
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
    _tile_loadd(1, k_rows[j0], bytes);
    _tile_dpbf16ps(4, 1, 0);
    _tile_loadd(2, k_rows[j0] + 32, bytes);
    _tile_dpbf16ps(4, 2, 3);
    _tile_loadd(1, k_rows[j0 + 16], bytes);
    _tile_dpbf16ps(5, 1, 0);
    _tile_loadd(2, k_rows[j0 + 16] + 32, bytes);
    _tile_dpbf16ps(5, 2, 3);
    _tile_loadd(1, k_rows[j0 + 32], bytes);
    _tile_dpbf16ps(6, 1, 0);
    _tile_loadd(2, k_rows[j0 + 32] + 32, bytes);
    _tile_dpbf16ps(6, 2, 3);
    _tile_loadd(1, k_rows[j0 + 48], bytes);
    _tile_dpbf16ps(7, 1, 0);
    _tile_loadd(2, k_rows[j0 + 48] + 32, bytes);
    _tile_dpbf16ps(7, 2, 3);
    _tile_stored(4, st, 64);
    _tile_stored(5, st + 256, 64);
    _tile_stored(6, st + 512, 64);
    _tile_stored(7, st + 768, 64);
    transposed(j0, 4);
  }
  for (; j0 < n; j0 += kScoreRun) {
    _tile_zero(4);
    _tile_loadd(1, k_rows[j0], bytes);
    _tile_dpbf16ps(4, 1, 0);
    _tile_loadd(2, k_rows[j0] + 32, bytes);
    _tile_dpbf16ps(4, 2, 3);
    _tile_stored(4, st, 64);
    transposed(j0, 1);
  }
}

// The B tiles of scores_from_rows: the 16 query vectors of qa (64 bf16 each, contiguous) transposed by
// 32-bit words, qp[l * 16 + v] = word l of vector v (dims 2l, 2l + 1), words 0-15 then 16-31.
inline void query_pairs(const c10::BFloat16* qa, __m512i* qp) {
  __m512i lo[16], hi[16];
  for (int v = 0; v < 16; ++v) {
    lo[v] = _mm512_loadu_si512(qa + v * 64);
    hi[v] = _mm512_loadu_si512(qa + v * 64 + 32);
  }
  vec::transpose(lo);
  vec::transpose(hi);
  for (int l = 0; l < 16; ++l) qp[l] = lo[l], qp[16 + l] = hi[l];
}

// out[v * 64 + d] = the sum over `runs` runs of 32 positions of the weights of query vector v (pa: 16 rows
// of bf16 weights, pa_stride elements apart, 32 a run) times V's dim d (vp: pair_v_64's layout, four
// registers per pair of positions), for the 16 vectors of the tile.
inline void values(const c10::BFloat16* pa, int64_t pa_stride, const __m512i* vp, int64_t runs, float* out) {
  _tile_zero(4);
  _tile_zero(5);
  _tile_zero(6);
  _tile_zero(7);
  for (int64_t t = 0; t < runs; ++t) {
    const __m512i* v = vp + t * 64;  // 16 pairs of four registers
    _tile_loadd(1, pa + t * kValueRun, pa_stride * 2);
    _tile_loadd(0, v, 256);
    _tile_dpbf16ps(4, 1, 0);
    _tile_loadd(3, v + 1, 256);
    _tile_dpbf16ps(5, 1, 3);
    _tile_loadd(0, v + 2, 256);
    _tile_dpbf16ps(6, 1, 0);
    _tile_loadd(3, v + 3, 256);
    _tile_dpbf16ps(7, 1, 3);
  }
  _tile_stored(4, out, 256);
  _tile_stored(5, out + 16, 256);
  _tile_stored(6, out + 32, 256);
  _tile_stored(7, out + 48, 256);
}

// One query vector's softmax over its n visible scores (unscaled, at s): the weights exp(s * scale - max)
// rounded to bf16 into w[0 .. w_len) (zeros from n), as the output's tiles take them; returns the sum of the
// unrounded weights, and the max into *max_out.
inline float weights(const float* s, int64_t n, float scale, c10::BFloat16* w, int64_t w_len,
                     float* max_out) {
  const __m512 vscale = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 top = ninf;
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 valid = static_cast<__mmask16>((1u << std::min<int64_t>(16, n - i)) - 1);
    top = _mm512_max_ps(top, _mm512_mask_mul_ps(ninf, valid, _mm512_maskz_loadu_ps(valid, s + i), vscale));
  }
  const float max = _mm512_reduce_max_ps(top);
  *max_out = max;
  const __m512 shift = _mm512_set1_ps(max);
  __m512 sum = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i < n; i += 16) {
    const __mmask16 valid = static_cast<__mmask16>((1u << std::min<int64_t>(16, n - i)) - 1);
    const __m512 e = _mm512_maskz_mov_ps(
        valid, vec::exp(_mm512_sub_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(valid, s + i), vscale), shift)));
    sum = _mm512_add_ps(sum, e);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(w + i), (__m256i)_mm512_cvtneps_pbh(e));
  }
  for (; i < w_len; i += 16) _mm256_storeu_si256(reinterpret_cast<__m256i*>(w + i), _mm256_setzero_si256());
  return _mm512_reduce_add_ps(sum);
}

}  // namespace pagedserve::cpu::invariant_amx

#endif
