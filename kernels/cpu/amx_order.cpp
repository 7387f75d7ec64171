// How this CPU's tdpbf16ps rounds, probed once a process: batch-invariant, a few rows of a weight that AMX
// takes for many rows are computed by AVX-512 FMAs in the tiles' own order (linear_bf16_avx512.cpp,
// tile_streams), which is only right where the tiles round as that order says.

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "amx.h"
#include "linear.h"
#include "ops.h"

namespace pagedserve::cpu {

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
namespace {

constexpr int kProbeTiles = 4;   // K tiles summed into each output
constexpr int kProbeRounds = 8;  // tiles of 16 x 16 outputs

// A pseudo-random bf16 (xorshift): a sign, an exponent of [60, 160) (so that products run from denormals to
// about 2^66 and sums of both signs cancel), 7 bits of mantissa; one in 16 a zero, one in 16 a denormal.
uint16_t probe_bf16(uint64_t& state) {
  state ^= state << 13, state ^= state >> 7, state ^= state << 17;
  const uint16_t sign = (state >> 8) & 1, mantissa = state & 0x7F;
  switch ((state >> 12) & 15) {
    case 0:
      return static_cast<uint16_t>(sign << 15);
    case 1:
      return static_cast<uint16_t>(sign << 15 | (mantissa | 1));
    default:
      return static_cast<uint16_t>(sign << 15 | (60 + (state >> 20) % 100) << 7 | mantissa);
  }
}

// Output (m, n) of tdpbf16ps's sums over the tiles a[t] (16 x 32) by b[t] (16 pairs x 16 x 2), in the
// tiles' order: per tile, the first and the second products of the pairs as two FMA chains from zero, their
// sum added to the output; under MXCSR's flush of denormals.
float chains(const uint16_t (*a)[16][32], const uint16_t (*b)[16][32], int m, int n) {
  __m128 sum = _mm_setzero_ps();
  for (int t = 0; t < kProbeTiles; ++t) {
    __m128 first = _mm_setzero_ps(), second = _mm_setzero_ps();
    for (int p = 0; p < 16; ++p) {
      first = _mm_fmadd_ss(_mm_set_ss(c10::detail::f32_from_bits(a[t][m][2 * p])),
                           _mm_set_ss(c10::detail::f32_from_bits(b[t][p][2 * n])), first);
      second = _mm_fmadd_ss(_mm_set_ss(c10::detail::f32_from_bits(a[t][m][2 * p + 1])),
                            _mm_set_ss(c10::detail::f32_from_bits(b[t][p][2 * n + 1])), second);
    }
    sum = _mm_add_ss(sum, _mm_add_ss(first, second));
  }
  return _mm_cvtss_f32(sum);
}

bool probe_chains() {
  alignas(64) uint16_t a[kProbeTiles][16][32], b[kProbeTiles][16][32];
  alignas(64) float tiles[16][16];
  constexpr TileConfig config{{16, 64}, {16, 64}, {16, 64}};
  uint64_t state = 0x9E3779B97F4A7C15u;
  bool same = true;
  const unsigned mxcsr = _mm_getcsr();
  for (int round = 0; round < kProbeRounds && same; ++round) {
    for (int t = 0; t < kProbeTiles; ++t)
      for (int i = 0; i < 16; ++i)
        for (int j = 0; j < 32; ++j) a[t][i][j] = probe_bf16(state), b[t][i][j] = probe_bf16(state);
    _tile_loadconfig(&config);
    _tile_zero(0);
    for (int t = 0; t < kProbeTiles; ++t) {
      _tile_loadd(1, a[t], 64);
      _tile_loadd(2, b[t], 64);
      _tile_dpbf16ps(0, 1, 2);
    }
    _tile_stored(0, tiles, 64);
    _tile_release();
    _mm_setcsr(mxcsr | kFlushDenormals);
    for (int m = 0; m < 16; ++m)
      for (int n = 0; n < 16; ++n) {
        const float want = chains(a, b, m, n);
        same = same && std::memcmp(&want, &tiles[m][n], sizeof want) == 0;
      }
    _mm_setcsr(mxcsr);
  }
  return same;
}

}  // namespace

bool tiles_sum_in_chains() {
  static const bool same = has_amx() && probe_chains();
  return same;
}
#else
bool tiles_sum_in_chains() { return false; }
#endif

}  // namespace pagedserve::cpu
