// The bf16 linear without a bf16 dot product (see linear.h): AVX2 with FMA, and AVX-512 without BF16. A
// shift and a mask widen a packed line to the float32 weights of k = 2p and k = 2p + 1, exactly, and float32
// FMAs multiply them by x widened to float32: a product of two bf16 values is exact in float32, so the
// result is again the exact product summed in float32 and rounded once.

#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstring>
#include <vector>

#include "block_runs.h"
#include "common.h"
#include "linear.h"

#if !defined(__AVX512BF16__) && defined(__AVX2__) && defined(__FMA__)

namespace pagedserve::cpu {
namespace {

// 8 bf16 or float values, widened to float32.
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

// exp512 on AVX2: the same reduction and polynomial; 2^k is built in the exponent bits (k is -126 .. 127
// after the clamp).
inline __m256 exp256(__m256 in) {
  const __m256 lo = _mm256_set1_ps(vec::kExpMin), hi = _mm256_set1_ps(vec::kExpMax);
  const __m256 v = _mm256_min_ps(_mm256_max_ps(in, lo), hi);
  const __m256 k = _mm256_round_ps(_mm256_mul_ps(v, _mm256_set1_ps(vec::kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(vec::kLn2Hi), v);
  r = _mm256_fmadd_ps(k, _mm256_set1_ps(vec::kLn2Lo), r);
  __m256 p = _mm256_set1_ps(vec::kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(vec::kExpPoly[i]));
  p = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.f));
  const __m256i scale =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
  const __m256 e = _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
  return _mm256_and_ps(e, _mm256_cmp_ps(in, lo, _CMP_NLT_UQ));  // 0 below vec::kExpMin
}

// 8 floats to bf16 as c10's conversion rounds them: to nearest, ties to even, NaN to 0x7FC0.
inline __m128i to_bf16_avx2(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0),
                         _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

// 8 floats rounded to bf16 and stored; rounded to bf16 and widened back (a value the dtype holds).
inline void store8_bf16(c10::BFloat16* p, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), to_bf16_avx2(v));
}
inline __m256 round_bf16_avx2(__m256 v) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(to_bf16_avx2(v)), 16));
}

// silu(g) = g / (1 + exp(-g)), 8 at a time.
inline __m256 silu256(__m256 g) {
  return _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), exp256(_mm256_sub_ps(_mm256_setzero_ps(), g))));
}

// The same packed layout without a bf16 dot product (CPUs with AVX2 and FMA but no AVX-512 BF16: AMD before
// Zen 4, Intel cores before Sapphire Rapids; on those with AVX-512, passes of 5 rows and more run in zmm, see
// halves_kernel_avx512). Each 32-bit lane of a line holds one column's pair (k = 2p
// in its low half, 2p + 1 in its high half), so a shift and a mask widen a half line to 8 float32 weights of
// k = 2p and 8 of k = 2p + 1, exactly. x is widened to float32 once per group of rows (kAvx2GroupRows, into
// each thread's buffer) and its values are broadcast from there. A product of two bf16 values is exact in
// float32: the sums are float32 FMAs, in k order, rounded once to bf16 at the end, as on AVX-512.
//
// Against float32 weights through PyTorch's linear, it streams half the bytes, and few rows are where
// PyTorch's is slowest. The SmolLM2 shapes on a 2-core AMD EPYC (Zen 3, 2 threads, weights from memory),
// GFLOP/s, these against PyTorch's float32: 1 row 21-23 against 6-8, 16 rows 112-148 against 38-65, 2000
// rows 121-163 against 115-159.
constexpr int kAvx2MaxRows = 4;     // 2 x 4 ymm sums + 4 widened weights + 2 broadcasts: 14 of 16 registers
constexpr int kAvx2HalvesRows = 6;  // the rows of a block_kernel_halves_avx2 pass
// x rows widened at a time: 48 x 1536 float32 is 288 KB, beside down's widened block (96 KB) in a 512 KB L2;
// 48 rows are 8 passes of 6 over that block. Up to K = kAvx2WideGroupMaxK twice as many (96 x 576 is 221 KB,
// the block 36 KB), so that each block is widened half as often: the prompt steps of the 24-request
// workload, forward seconds, five alternating pairs of runs, 10.35 -> 9.89 s on average.
constexpr int64_t kAvx2GroupRows = 48;
constexpr int64_t kAvx2WideGroupMaxK = 768;

// A packed line (K pair p of a block's 16 columns) widened, with the line at `fetch` prefetched: even[h]
// holds the k = 2p weights of columns 8h .. 8h + 7 in float32, odd[h] those of k = 2p + 1.
struct WideLine {
  __m256 even[2], odd[2];
};
inline WideLine widen_line(const c10::BFloat16* line, const char* fetch) {
  _mm_prefetch(fetch, _MM_HINT_T1);
  const __m256i high = _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(line));
  const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(line + kBlock));
  return {{_mm256_castsi256_ps(_mm256_slli_epi32(lo, 16)), _mm256_castsi256_ps(_mm256_slli_epi32(hi, 16))},
          {_mm256_castsi256_ps(_mm256_and_si256(lo, high)), _mm256_castsi256_ps(_mm256_and_si256(hi, high))}};
}

// acc (a row's 16 sums) += the line times the row's pair at xr, k = 2p first.
inline void fma_line(__m256 (&acc)[2], const WideLine& l, const float* xr) {
  const __m256 x0 = _mm256_broadcast_ss(xr), x1 = _mm256_broadcast_ss(xr + 1);
  acc[0] = _mm256_fmadd_ps(l.even[0], x0, acc[0]);
  acc[1] = _mm256_fmadd_ps(l.even[1], x0, acc[1]);
  acc[0] = _mm256_fmadd_ps(l.odd[0], x1, acc[0]);
  acc[1] = _mm256_fmadd_ps(l.odd[1], x1, acc[1]);
}

// A row's 16 sums (columns 0-7 in lo, 8-15 in hi), rounded to bf16; the first cols of them to y.
inline void store_sums(__m256 lo, __m256 hi, c10::BFloat16* y, int64_t cols) {
  alignas(32) c10::BFloat16 row[kBlock];
  _mm_store_si128(reinterpret_cast<__m128i*>(row), to_bf16_avx2(lo));
  _mm_store_si128(reinterpret_cast<__m128i*>(row + 8), to_bf16_avx2(hi));
  std::memcpy(y, row, cols * sizeof(c10::BFloat16));
}

// U independent sets of sums over interleaved K pairs keep 8 FMA chains in flight at 1 and 2 rows.
template <int ROWS, int U>
void block_kernel_avx2(const c10::BFloat16* w, const float* x, int64_t ldx, int64_t pairs, const float* bias,
                       c10::BFloat16* y, int64_t ldy, int64_t cols, const char* fetch, int64_t fetch_step) {
  __m256 acc[U][ROWS][2];
#pragma GCC unroll 8
  for (int u = 0; u < U; ++u)
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; ++r) acc[u][r][0] = acc[u][r][1] = _mm256_setzero_ps();
  const auto step = [&](int u, int64_t pair) {
    const WideLine line = widen_line(w + pair * 2 * kBlock, fetch + pair * fetch_step);
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; ++r) fma_line(acc[u][r], line, x + r * ldx + 2 * pair);
  };
  int64_t p = 0;
  for (; p + U <= pairs; p += U)
#pragma GCC unroll 8
    for (int u = 0; u < U; ++u) step(u, p + u);
  for (; p < pairs; ++p) step(0, p);
#pragma GCC unroll 8
  for (int r = 0; r < ROWS; ++r) {
    __m256 sum[2];
    for (int h = 0; h < 2; ++h) {
      sum[h] = _mm256_add_ps(acc[0][r][h], _mm256_loadu_ps(bias + 8 * h));
      for (int u = 1; u < U; ++u) sum[h] = _mm256_add_ps(sum[h], acc[u][r][h]);
    }
    store_sums(sum[0], sum[1], y + r * ldy, cols);
  }
}

// From 32 rows on, each block is widened once into a float32 copy (in each thread's buffer) and passes of 5-6
// rows read it from there: per k, 12 FMAs for 2 loads and 6 broadcasts, none of the shifts and masks of
// widening. Alone, with the block in cache, the 6-row pass ran 90 GFLOP/s a core, the 4-row pass that
// widens as it goes 70, bare FMAs 99.5 (2-core Zen 3). Below 32 rows the widening pass, which the FMAs do
// not hide, costs more than it saves: at 6-16 rows single calls took up to 1.9x as long. The sums are the
// FMAs of the 3-, 4- and 6-row passes (U = 1), in the same k order.
constexpr int kAvx2WideMinRows = 32;
constexpr int kAvx2WideMaxRows = 6;  // 12 ymm sums + 2 weights + 1 broadcast: 15 of 16 registers

// The block's weights of k = 2p + i land at wide + 16 (2p + i): k's 16 columns side by side.
void widen_block(const c10::BFloat16* w, int64_t pairs, float* wide) {
  for (int64_t p = 0; p < pairs; ++p) {
    const WideLine line =
        widen_line(w + p * 2 * kBlock, reinterpret_cast<const char*>(w + p * 2 * kBlock) + kPrefetchBytes);
    for (int h = 0; h < 2; ++h) {
      _mm256_store_ps(wide + 32 * p + 8 * h, line.even[h]);
      _mm256_store_ps(wide + 32 * p + kBlock + 8 * h, line.odd[h]);
    }
  }
}

// kSilu: the sums are up's, and y gets silu(gate) * up for the gate rows at `gate` (kBlock apart), rounded
// as silu_mul rounds (the sums to bf16 first, as linear stores them).
template <int ROWS, bool kSilu = false>
void wide_kernel_avx2(const float* wide, const float* x, int64_t ldx, int64_t k, const float* bias,
                      c10::BFloat16* y, int64_t ldy, int64_t cols, const c10::BFloat16* gate = nullptr) {
  __m256 acc[ROWS][2];
#pragma GCC unroll 8
  for (int r = 0; r < ROWS; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t i = 0; i < k; ++i) {
    const __m256 w0 = _mm256_load_ps(wide + kBlock * i), w1 = _mm256_load_ps(wide + kBlock * i + 8);
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; ++r) {
      const __m256 xr = _mm256_broadcast_ss(x + r * ldx + i);
      acc[r][0] = _mm256_fmadd_ps(w0, xr, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(w1, xr, acc[r][1]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < ROWS; ++r) {
    const __m256 lo = _mm256_add_ps(acc[r][0], _mm256_loadu_ps(bias));
    const __m256 hi = _mm256_add_ps(acc[r][1], _mm256_loadu_ps(bias + 8));
    if constexpr (kSilu) {
      for (int h = 0; h < 2; ++h)
        store8_bf16(y + r * ldy + 8 * h,
                    _mm256_mul_ps(round_bf16_avx2(silu256(load8(gate + r * kBlock + 8 * h))),
                                  round_bf16_avx2(h == 0 ? lo : hi)));
    } else {
      store_sums(lo, hi, y + r * ldy, cols);
    }
  }
}

// 6 rows at once, widening as they go. A 3- or 4-row pass's sums each take two dependent FMAs a K pair (k =
// 2p, then 2p + 1): at 4 rows 16 FMAs a pair against 8 cycles of FMA latency, so the chains rather than the
// FMA pipes set its pace. Here the even half of a line is widened and multiplied into all the rows' sums,
// then the odd half (the line loaded again, from L1): 24 FMAs a pair against the same latency. 12 sums, 2
// widened weights, a broadcast and the mask: 16 registers. The FMAs of the 4-row pass, in the same order.
// The 30 layers' linears and the LM head of SmolLM2 (2-core Zen 3, weights from memory, alternating, four
// pairs, ms on average): 6 rows 16.28 -> 14.87, 12 rows 25.45 -> 23.31, 16 rows (6 + 6 + 4) 32.84 -> 31.20,
// 24 rows 47.88 -> 43.94; 5-13 rows otherwise within noise. At 5 rows GCC kept one of the sums on the stack
// (slower than 4 + 1), so the rows of a block go in passes of 6 and the rest in passes of up to 4; 7 rows as
// 6 + 1 ran about 5 % slower than 4 + 3, and go as 4 + 3.
template <int ROWS>
void block_kernel_halves_avx2(const c10::BFloat16* w, const float* x, int64_t ldx, int64_t pairs,
                              const float* bias, c10::BFloat16* y, int64_t ldy, int64_t cols,
                              const char* fetch, int64_t fetch_step) {
  __m256 acc[ROWS][2];
#pragma GCC unroll 8
  for (int r = 0; r < ROWS; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const __m256i high = _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  for (int64_t p = 0; p < pairs; ++p) {
    const __m256i* line = reinterpret_cast<const __m256i*>(w + p * 2 * kBlock);
    _mm_prefetch(fetch + p * fetch_step, _MM_HINT_T1);
    const __m256 even0 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256(line), 16));
    const __m256 even1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256(line + 1), 16));
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; ++r) {
      const __m256 xr = _mm256_broadcast_ss(x + r * ldx + 2 * p);
      acc[r][0] = _mm256_fmadd_ps(even0, xr, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(even1, xr, acc[r][1]);
    }
    const __m256 odd0 = _mm256_castsi256_ps(_mm256_and_si256(_mm256_loadu_si256(line), high));
    const __m256 odd1 = _mm256_castsi256_ps(_mm256_and_si256(_mm256_loadu_si256(line + 1), high));
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; ++r) {
      const __m256 xr = _mm256_broadcast_ss(x + r * ldx + 2 * p + 1);
      acc[r][0] = _mm256_fmadd_ps(odd0, xr, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(odd1, xr, acc[r][1]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < ROWS; ++r)
    store_sums(_mm256_add_ps(acc[r][0], _mm256_loadu_ps(bias)),
               _mm256_add_ps(acc[r][1], _mm256_loadu_ps(bias + 8)), y + r * ldy, cols);
}

using BlockFnAvx2 = void (*)(const c10::BFloat16*, const float*, int64_t, int64_t, const float*,
                             c10::BFloat16*, int64_t, int64_t, const char*, int64_t);
constexpr std::array<BlockFnAvx2, kAvx2MaxRows> kKernelsAvx2 = {
    &block_kernel_avx2<1, 4>, &block_kernel_avx2<2, 2>, &block_kernel_avx2<3, 1>, &block_kernel_avx2<4, 1>};

#if defined(__AVX512F__)
// AVX-512 without its BF16 dot product (Ice Lake, Cascade Lake and Skylake servers): a packed line is one
// zmm, and a shift and a mask widen it to a block's 16 weights of k = 2p and of k = 2p + 1, so a row's 16
// sums are one register and each FMA does 16 of them. On such a core (two 512-bit FMA units) bare FMAs ran
// 161-181 GFLOP/s in zmm against 104-110 in ymm, but the loads do not keep up with one per FMA (a row's
// broadcast): 12 rows against one block, in L1, ran 75-90 GFLOP/s, against two blocks (each broadcast
// feeding two FMAs) 142-150. So a pass covers several blocks, side by side in the packed weight: 8 rows
// against 3 blocks ran 1.06-1.14x as fast as 12 against 2 from 5 to 96 rows (SmolLM2's linears, alternating
// builds), as fast at 1024. Every lane runs the FMAs of the AVX2 passes in the same order (k = 2p, then
// 2p + 1, the bias added last), so a row's bits are those of a 3- to 6-row AVX2 pass.
constexpr int kAvx512Rows = 8;    // the rows of a pass: 24 sums, 3 widened halves, the mask, a broadcast
constexpr int kAvx512Blocks = 3;  // the blocks of a pass (all of SmolLM2's block counts are multiples of 3)
// Fewer rows go through the AVX2 passes (3 rows: 9 sums in zmm, two dependent FMAs a K pair each, wait on
// the FMAs' latency).
constexpr int kAvx512MinRows = 4;

// The rows of a pass, x [rows, 2 * pairs] bf16 (rows ldx apart), widened to float32 and interleaved by K pair
// into out [pairs, rows, 2]: the kernels then reach every broadcast from one pointer (with a pointer a row
// GCC kept them on the stack, reloaded every pair). A pair's two bf16 are one 32-bit word: its low half
// shifted up is k = 2p, its high half masked k = 2p + 1, one 64-bit store.
inline void interleave_pairs(const c10::BFloat16* x, int64_t ldx, int64_t rows, int64_t pairs, float* out) {
  uint64_t* const out_pairs = reinterpret_cast<uint64_t*>(out);
  for (int64_t r = 0; r < rows; ++r) {
    const c10::BFloat16* row = x + r * ldx;
    for (int64_t p = 0; p < pairs; ++p) {
      uint32_t v;
      std::memcpy(&v, row + 2 * p, sizeof(v));
      out_pairs[p * rows + r] = static_cast<uint64_t>(v & 0xFFFF0000u) << 32 | static_cast<uint32_t>(v << 16);
    }
  }
}

// A pass's sums (rows x nb blocks of kBlock floats) plus bias, rounded to bf16 into y, the first cols
// columns; with gate, silu(gate) * up of them (as wide_kernel_avx2), gate's rows nb * kBlock apart. Out of
// line, so that GCC compiles the kernels' loops alone: with a whole block's stores inlined (no memcpy call)
// it versioned the loop, spilled sums and ran 1.2-1.4x as long.
__attribute__((noinline)) void store_pass512(const float* sums, int64_t rows, int64_t nb, const float* bias,
                                             c10::BFloat16* y, int64_t ldy, int64_t cols,
                                             const c10::BFloat16* gate) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < nb; ++b) {
      const float* s = sums + (r * nb + b) * kBlock;
      c10::BFloat16* out = y + r * ldy + b * kBlock;
      const __m256 lo = _mm256_add_ps(_mm256_load_ps(s), _mm256_loadu_ps(bias + b * kBlock));
      const __m256 hi = _mm256_add_ps(_mm256_load_ps(s + 8), _mm256_loadu_ps(bias + b * kBlock + 8));
      if (gate != nullptr) {
        const c10::BFloat16* g = gate + r * nb * kBlock + b * kBlock;
        store8_bf16(out, _mm256_mul_ps(round_bf16_avx2(silu256(load8(g))), round_bf16_avx2(lo)));
        store8_bf16(out + 8, _mm256_mul_ps(round_bf16_avx2(silu256(load8(g + 8))), round_bf16_avx2(hi)));
      } else if (cols - b * kBlock >= kBlock) {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out), to_bf16_avx2(lo));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 8), to_bf16_avx2(hi));
      } else {
        store_sums(lo, hi, out, cols - b * kBlock);
      }
    }
}

// block_kernel_halves_avx2 in zmm: ROWS rows (x interleaved by pair) against NB blocks, each block's lines
// right after the one before's (w + pairs * 2 * kBlock); bias and y cover the NB blocks' columns. kSilu: the
// sums are up's, and y gets silu(gate) * up, gate's rows NB * kBlock apart (as wide_kernel_avx2). It serves
// every row count from kAvx512MinRows: a float32 copy of the blocks (the AVX2 build's path from 32 rows) is
// read from L2 here, two blocks of K = 576 being 72 KB, and ran 1.4x as long as widening them in every pass.
template <int ROWS, int NB, bool kSilu>
void halves_kernel_avx512(const c10::BFloat16* w, int64_t pairs, const float* x, const float* bias,
                          c10::BFloat16* y, int64_t ldy, int64_t cols, const c10::BFloat16* gate,
                          const char* fetch, int64_t fetch_step) {
  __m512 acc[ROWS][NB];
#pragma GCC unroll 16
  for (int r = 0; r < ROWS; ++r)
#pragma GCC unroll 4
    for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_setzero_ps();
  const __m512i high = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  for (int64_t p = 0; p < pairs; ++p) {
    __m512i line[NB];
#pragma GCC unroll 4
    for (int b = 0; b < NB; ++b) line[b] = _mm512_loadu_si512(w + (b * pairs + p) * 2 * kBlock);
    _mm_prefetch(fetch + p * fetch_step, _MM_HINT_T1);
    const float* xp = x + p * 2 * ROWS;
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {  // k = 2p, then 2p + 1
      __m512 half[NB];
#pragma GCC unroll 4
      for (int b = 0; b < NB; ++b)
        half[b] =
            _mm512_castsi512_ps(h == 0 ? _mm512_slli_epi32(line[b], 16) : _mm512_and_si512(line[b], high));
#pragma GCC unroll 16
      for (int r = 0; r < ROWS; ++r) {
        const __m512 xr = _mm512_set1_ps(xp[2 * r + h]);
#pragma GCC unroll 4
        for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_fmadd_ps(half[b], xr, acc[r][b]);
      }
    }
  }
  alignas(64) float sums[ROWS][NB][kBlock];
#pragma GCC unroll 16
  for (int r = 0; r < ROWS; ++r)
#pragma GCC unroll 4
    for (int b = 0; b < NB; ++b) _mm512_store_ps(sums[r][b], acc[r][b]);
  store_pass512(&sums[0][0][0], ROWS, NB, bias, y, ldy, cols, kSilu ? gate : nullptr);
}

using PassFnAvx512 = void (*)(const c10::BFloat16*, int64_t, const float*, const float*, c10::BFloat16*,
                              int64_t, int64_t, const c10::BFloat16*, const char*, int64_t);
// The kernels of 1 .. kAvx512Rows rows: [silu][blocks - 1][rows - 1].
template <int... R>
constexpr auto avx512_table(std::integer_sequence<int, R...>) {
  using Rows = std::array<PassFnAvx512, sizeof...(R)>;
  static_assert(kAvx512Blocks == 3);
  return std::array<std::array<Rows, kAvx512Blocks>, 2>{{
      {Rows{&halves_kernel_avx512<R + 1, 1, false>...}, Rows{&halves_kernel_avx512<R + 1, 2, false>...},
       Rows{&halves_kernel_avx512<R + 1, 3, false>...}},
      {Rows{&halves_kernel_avx512<R + 1, 1, true>...}, Rows{&halves_kernel_avx512<R + 1, 2, true>...},
       Rows{&halves_kernel_avx512<R + 1, 3, true>...}},
  }};
}
constexpr auto kKernelsAvx512 = avx512_table(std::make_integer_sequence<int, kAvx512Rows>{});
#endif

// ROWS rows against S blocks at once, `step` blocks apart: S sequential streams of W a thread, each
// prefetched 1 KB ahead (a core reads faster from several streams than from one; see block_kernel_streams).
// On a 2-core Zen 3, single calls at one row, four streams against one, alternating: gate_up 22.5 -> 31-33
// GB/s of W, the LM head 25 -> 34, qkv 20 -> 22, down 20 -> 23.5; a single sequence's decode step at 128
// positions 16.4 and 15.9 -> 13.3 and 13.0 ms. Two rows as two streams: 22-25 -> 26-29 GB/s of W. The sums
// run in k order, one set per row and block.
template <int S, int ROWS>
void rows_streams_avx2(const c10::BFloat16* w, int64_t step, const float* x, int64_t ldx, int64_t pairs,
                       const float* bias, c10::BFloat16* y, int64_t ldy, const int64_t* cols) {
  const int64_t w_step = step * pairs * 2 * kBlock;
  __m256 acc[S][ROWS][2];
  for (int s = 0; s < S; ++s)
    for (int r = 0; r < ROWS; ++r) acc[s][r][0] = acc[s][r][1] = _mm256_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p)
#pragma GCC unroll 4
    for (int s = 0; s < S; ++s) {
      const c10::BFloat16* at_line = w + s * w_step + p * 2 * kBlock;
      const WideLine line =
          widen_line(at_line, reinterpret_cast<const char*>(at_line) + kFourStreamPrefetchBytes);
#pragma GCC unroll 4
      for (int r = 0; r < ROWS; ++r) fma_line(acc[s][r], line, x + r * ldx + 2 * p);
    }
  for (int s = 0; s < S; ++s)
    for (int r = 0; r < ROWS; ++r) {
      const float* b = bias + s * kBlock;
      store_sums(_mm256_add_ps(acc[s][r][0], _mm256_loadu_ps(b)),
                 _mm256_add_ps(acc[s][r][1], _mm256_loadu_ps(b + 8)), y + s * step * kBlock + r * ldy,
                 cols[s]);
    }
}

// Rows of x widened at a time for K = k (see kAvx2GroupRows).
inline int64_t avx2_group_rows(int64_t k) {
  return k <= kAvx2WideGroupMaxK ? 2 * kAvx2GroupRows : kAvx2GroupRows;
}

// How many of m rows go through the float32 copy: the groups of at least kAvx2WideMinRows rows, all but a
// short last one.
inline int64_t avx2_wide_rows(int64_t m, int64_t k) {
  const int64_t group_rows = avx2_group_rows(k), last = m - (m - 1) / group_rows * group_rows;
  return last >= kAvx2WideMinRows ? m : m - last;
}

// silu: for a gate_up W (n / 2 a multiple of kBlock, gate first), y [m, n / 2] gets silu_mul of the
// product. Every row must go through the float32 copy (m == avx2_wide_rows(m, k)); see linear_silu.
#if defined(__AVX512F__)
constexpr int64_t kMaxWidth = kAvx512Blocks;  // the blocks of a unit of work, at most
#else
constexpr int64_t kMaxWidth = 1;
#endif

}  // namespace

void linear_widen(const c10::BFloat16* x, int64_t ldx, int64_t m, const c10::BFloat16* w, int64_t pairs,
                  int64_t n, const c10::BFloat16* bias, c10::BFloat16* y, int64_t ldy, bool silu) {
  const int64_t blocks = (n + kBlock - 1) / kBlock, k = 2 * pairs;
  const int threads = static_cast<int>(std::min<int64_t>(std::max(1, at::get_num_threads()), blocks));
  const int64_t group_rows = avx2_group_rows(k), groups = (m + group_rows - 1) / group_rows;
  const int64_t wide_groups = (avx2_wide_rows(m, k) + group_rows - 1) / group_rows;
  TORCH_INTERNAL_ASSERT(!silu || (wide_groups == groups && n % (2 * kBlock) == 0));
  std::atomic<int64_t> next_unit{0};
  // Below the float32 copy each thread takes a run of the blocks (see BlockRuns), one or two rows in steps
  // over four or two parts of the run side by side.
  const int64_t tail_rows = m - wide_groups * group_rows;
  const int64_t streams = tail_rows == 1 ? 4 : (tail_rows == 2 ? 2 : 1);
  // The runs are of slots of `width` blocks: on AVX-512 a pass of kAvx512MinRows rows or more covers
  // kAvx512Blocks.
#if defined(__AVX512F__)
  const int64_t width = tail_rows >= kAvx512MinRows ? kAvx512Blocks : 1;
#else
  const int64_t width = 1;
#endif
  BlockRuns runs((blocks + width - 1) / width, threads, streams);
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num();
    thread_local std::vector<float> xf;
    xf.resize(std::max<size_t>(xf.size(), std::min(m, group_rows) * k));
#if defined(__AVX512F__)
    thread_local std::vector<float> xt;  // x interleaved by K pair for the zmm passes
    xt.resize(xf.size());
#endif
    int64_t widened = -1;  // the group of rows whose x is in xf
    // x of group g into xf; the group's first row and rows into g0 and rows.
    const auto load_group = [&](int64_t g, int64_t& g0, int64_t& rows) {
      g0 = g * group_rows;
      rows = std::min(group_rows, m - g0);
      if (widened == g) return;
      widened = g;
#if defined(__AVX512F__)
      // From kAvx512MinRows the passes are zmm's, each pass's rows interleaved by K pair at xt + r0 * k.
      if (rows >= kAvx512MinRows) {
        const int64_t passes = (rows + kAvx512Rows - 1) / kAvx512Rows;
        for (int64_t i = 0; i < passes; ++i) {
          const int64_t r0 = rows * i / passes;
          interleave_pairs(x + (g0 + r0) * ldx, ldx, rows * (i + 1) / passes - r0, pairs, xt.data() + r0 * k);
        }
        return;
      }
#endif
      for (int64_t r = 0; r < rows; ++r) load_row(x + (g0 + r) * ldx, xf.data() + r * k, k);
    };
    // Blocks j .. j + count - 1: their columns, and their bias in float32 (zero without one) into bias_f32.
    const auto block_of = [&](int64_t j, int64_t& cols, float* bias_f32, int64_t count = 1) {
      cols = std::min<int64_t>(count * kBlock, n - j * kBlock);
      std::fill(bias_f32, bias_f32 + count * kBlock, 0.f);
      for (int64_t c = 0; bias != nullptr && c < cols; ++c)
        bias_f32[c] = static_cast<float>(bias[j * kBlock + c]);
    };
    // Slot j's blocks for the rows g0 .. g0 + rows - 1 (of xf) in passes of up to 6 rows (on AVX-512 8),
    // which widen them as they go; dir is -1 where the slots are taken back to front (the slot before is
    // fetched instead of the next).
    const auto block_passes = [&](int64_t j, int64_t g0, int64_t rows, int64_t dir = 1) {
      const int64_t first = j * width, nb = std::min(width, blocks - first);
      int64_t cols;
      float bias_f32[kMaxWidth * kBlock];
      block_of(first, cols, bias_f32, nb);
#if defined(__AVX512F__)
      // Even passes of up to kAvx512Rows rows.
      const int64_t passes = (rows + kAvx512Rows - 1) / kAvx512Rows;
#else
      // Passes of 6 rows, then the rest in even passes of up to 4; 6 + 1 rows at the end as 4 + 3.
      int64_t sixes = rows / kAvx2HalvesRows, rest = rows % kAvx2HalvesRows;
      if (rest == 1 && sixes > 0) --sixes, rest += kAvx2HalvesRows;
      const int64_t rest_passes = (rest + kAvx2MaxRows - 1) / kAvx2MaxRows, passes = sixes + rest_passes;
#endif
      const int64_t block_bytes = pairs * 2 * kBlock * 2;
      const char* const block = reinterpret_cast<const char*>(w + first * pairs * 2 * kBlock);
      for (int64_t i = 0; i < passes; ++i) {
        // One pass streams its blocks kPrefetchBytes ahead. Several (5 or 7-31 rows: a decode batch) fetch
        // the next slot instead, each pass a 1/passes share of it, so that memory works while they compute;
        // before, the first pass over a block waited on memory and the others on the FMAs. Single calls
        // at 8 rows, GFLOP/s, before -> after (2-core Zen 3, weights from memory, two runs): qkv 135 ->
        // 148 and 127 -> 137, gate_up 137 -> 158 and 112 -> 116, the LM head 126 -> 165 and 138 -> 161.
        // A decode step's 30 layers and head, alternating: 8 rows 21.5 -> 18.7 ms, 16 rows 39.3 -> 34.9.
        const char* fetch = passes == 1 && dir > 0
                                ? block + kPrefetchBytes
                                : block + dir * width * block_bytes + i * nb * block_bytes / passes;
        const int64_t step = passes == 1 && dir > 0 ? 64 * nb : (64 * nb + passes - 1) / passes;
#if defined(__AVX512F__)
        const int64_t r0 = rows * i / passes, chunk = rows * (i + 1) / passes - r0;
        if (chunk >= kAvx512MinRows) {
          kKernelsAvx512[0][nb - 1][chunk - 1](w + first * pairs * 2 * kBlock, pairs, xt.data() + r0 * k,
                                               bias_f32, y + (g0 + r0) * ldy + first * kBlock, ldy, cols,
                                               nullptr, fetch, step);
          continue;
        }
#else
        const int64_t r0 =
            i < sixes ? i * kAvx2HalvesRows : sixes * kAvx2HalvesRows + rest * (i - sixes) / rest_passes;
        const int64_t chunk =
            i < sixes ? kAvx2HalvesRows : sixes * kAvx2HalvesRows + rest * (i - sixes + 1) / rest_passes - r0;
#endif
        TORCH_INTERNAL_ASSERT(nb == 1);
        (chunk == kAvx2HalvesRows ? &block_kernel_halves_avx2<kAvx2HalvesRows> : kKernelsAvx2[chunk - 1])(
            w + first * pairs * 2 * kBlock, xf.data() + r0 * k, k, pairs, bias_f32,
            y + (g0 + r0) * ldy + first * kBlock, ldy, cols, fetch, step);
      }
    };
#if defined(__AVX512F__)
    // Groups of rows as below (the AVX2 build's comments), a unit being kAvx512Blocks blocks (the last one
    // fewer where their count is not a multiple), read by passes of up to kAvx512Rows rows that widen them as
    // they go: no float32 copy.
    const int64_t unit_blocks = silu ? blocks / 2 : blocks,
                  units = (unit_blocks + kAvx512Blocks - 1) / kAvx512Blocks;
    thread_local std::vector<c10::BFloat16> gate;
    if (silu) gate.resize(std::max<size_t>(gate.size(), group_rows * kAvx512Blocks * kBlock));
    for (int64_t u = next_unit.fetch_add(1, std::memory_order_relaxed); u < wide_groups * units;
         u = next_unit.fetch_add(1, std::memory_order_relaxed)) {
      const int64_t j = u % units * kAvx512Blocks, nb = std::min<int64_t>(kAvx512Blocks, unit_blocks - j);
      int64_t g0, rows;
      load_group(u / units, g0, rows);
      const int64_t passes = (rows + kAvx512Rows - 1) / kAvx512Rows;
      for (int part = 0; part < (silu ? 2 : 1); ++part) {  // with silu gate's blocks, then up's
        const int64_t first = part * unit_blocks + j;
        int64_t cols;
        float bias_f32[kMaxWidth * kBlock];
        block_of(first, cols, bias_f32, nb);
        const bool to_gate = silu && part == 0;
        // The blocks after these, a 1/passes share of them in each pass.
        const char* const next = reinterpret_cast<const char*>(w + (first + nb) * pairs * 2 * kBlock);
        const int64_t step = (64 * nb + passes - 1) / passes;
        for (int64_t i = 0; i < passes; ++i) {
          const int64_t r0 = rows * i / passes, chunk = rows * (i + 1) / passes - r0;
          kKernelsAvx512[silu && part == 1][nb - 1][chunk - 1](
              w + first * pairs * 2 * kBlock, pairs, xt.data() + r0 * k, bias_f32,
              to_gate ? gate.data() + r0 * nb * kBlock : y + (g0 + r0) * ldy + j * kBlock,
              to_gate ? nb * kBlock : ldy, cols, gate.data() + r0 * nb * kBlock,
              next + i * nb * pairs * 64 / passes, step);
        }
      }
    }
#else
    // Groups through the float32 copy: a unit is one block for one group of rows, handed to whichever thread
    // asks next, groups in order (the threads work through a group together, each widening its x once).
    // Given equal runs of blocks, the two threads of a 2-core Zen 3 did not finish together: one waited 5-20
    // % of a 2048-row call. A prompt step of 2048 tokens (30 layers), alternating: 3.93 -> 3.57 s and 3.84 ->
    // 3.56 s; the 24-request workload's prompt steps, forward seconds, three alternating pairs of runs:
    // 11.62 / 13.26 -> 11.31 / 11.19, 12.01 / 11.98 -> 10.48 / 10.89, 12.65 / 12.83 -> 11.73 / 10.65.
    thread_local std::vector<float> wide;
    if (wide_groups > 0) wide.resize(std::max<size_t>(wide.size(), pairs * 2 * kBlock + 8));
    float* const wide_block =  // 32-byte aligned, for whole-ymm loads
        reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(wide.data()) + 31) & ~uintptr_t{31});
    static_assert(kAvx2WideMinRows > 4 * kAvx2WideMaxRows);
    // With silu a unit is gate's block j and up's block blocks / 2 + j: gate's sums go to the thread's strip
    // (rounded to bf16, as linear stores them), and up's are multiplied with them as they come out. The
    // SmolLM2 MLP's gate_up, alternating with linear then silu_mul (2-core Zen 3, both orders run): 2048
    // rows 45.2 -> 43.4 ms, 501 rows 10.9 -> 10.6, 256 rows 5.6 -> 5.4; the same bits.
    const int64_t unit_blocks = silu ? blocks / 2 : blocks;
    thread_local std::vector<c10::BFloat16> gate;
    if (silu) gate.resize(std::max<size_t>(gate.size(), group_rows * kBlock));
    for (int64_t u = next_unit.fetch_add(1, std::memory_order_relaxed); u < wide_groups * unit_blocks;
         u = next_unit.fetch_add(1, std::memory_order_relaxed)) {
      const int64_t j = u % unit_blocks;
      int64_t g0, rows;
      load_group(u / unit_blocks, g0, rows);
      // Balanced passes over the widened block: past 24 rows, of 5 and 6 rows.
      const int64_t passes = (rows + kAvx2WideMaxRows - 1) / kAvx2WideMaxRows;
      int64_t cols;
      float bias_f32[kBlock];
      block_of(j, cols, bias_f32);
      widen_block(w + j * pairs * 2 * kBlock, pairs, wide_block);
      for (int64_t i = 0; i < passes; ++i) {
        const int64_t r0 = rows * i / passes, chunk = rows * (i + 1) / passes - r0;
        (chunk == 6 ? &wide_kernel_avx2<6> : &wide_kernel_avx2<5>)(wide_block, xf.data() + r0 * k, k, k,
                                                                   bias_f32,
                                                                   silu ? gate.data() + r0 * kBlock
                                                                        : y + (g0 + r0) * ldy + j * kBlock,
                                                                   silu ? kBlock : ldy, cols, nullptr);
      }
      if (!silu) continue;
      block_of(unit_blocks + j, cols, bias_f32);
      widen_block(w + (unit_blocks + j) * pairs * 2 * kBlock, pairs, wide_block);
      for (int64_t i = 0; i < passes; ++i) {
        const int64_t r0 = rows * i / passes, chunk = rows * (i + 1) / passes - r0;
        (chunk == 6 ? &wide_kernel_avx2<6, true>
                    : &wide_kernel_avx2<5, true>)(wide_block, xf.data() + r0 * k, k, k, bias_f32,
                                                  y + (g0 + r0) * ldy + j * kBlock, ldy, cols,
                                                  gate.data() + r0 * kBlock);
      }
    }
#endif
    if (wide_groups < groups) {
      // Fewer rows than the float32 copy pays for (a decode batch, or a prompt's last rows): each thread
      // takes a contiguous run of blocks (one sequential stream of W), as linear_avx512, then helps the
      // others finish theirs (see BlockRuns).
      int64_t g0, rows;
      load_group(wide_groups, g0, rows);
      // Unit u of run r: a step (block u of each part) or a block, taken the way dir says.
      runs.work(t, [&](int r, int64_t u, int64_t dir) {
        int64_t first, part;
        if (!runs.parts_of(r, u, first, part)) return block_passes(first, g0, rows, dir);
        const auto step = [&](auto streams_c, auto rows_c) {
          constexpr int S = decltype(streams_c)::value;
          int64_t cols[S];
          float bias_s[S * kBlock];
          for (int s = 0; s < S; ++s) block_of(first + s * part, cols[s], bias_s + s * kBlock);
          rows_streams_avx2<S, decltype(rows_c)::value>(w + first * pairs * 2 * kBlock, part, xf.data(), k,
                                                        pairs, bias_s, y + g0 * ldy + first * kBlock, ldy,
                                                        cols);
        };
        if (rows == 1) step(std::integral_constant<int, 4>{}, std::integral_constant<int, 1>{});
        if (rows == 2) step(std::integral_constant<int, 2>{}, std::integral_constant<int, 2>{});
      });
    }
  }
}

int64_t widen_silu_rows(int64_t m, int64_t k) { return avx2_wide_rows(m, k); }

}  // namespace pagedserve::cpu

#endif
