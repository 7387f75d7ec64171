// The bf16 linear on AVX-512 BF16 (see linear.h): vdpbf16ps multiplies a packed line of W by a pair of x
// broadcast to all 16 lanes (a 32-bit broadcast folded into its memory operand), so one load of W feeds 16
// outputs of each row. Up to kMaxRows rows a pass over a block, their sums in the 32 zmm registers. The
// vector layer has no bf16 pair product: this family is AVX-512 BF16's own.

#include <ATen/Parallel.h>
#include <omp.h>

#include <array>
#include <utility>
#include <vector>

#include "block_runs.h"
#include "common.h"
#include "linear.h"
#include "prefetch.h"

#if defined(__AVX512BF16__)

namespace pagedserve::cpu {
namespace {

// Rows of x computed against one pass over a W block: their sums and the W line stay in the 32 zmm
// registers (the x pairs take none: see dot_pair). More rows are split into balanced chunks, each rereading
// the block from L1 or L2.
constexpr int kMaxRows = 30;
// The passes of 9 rows and more prefetch W further ahead: where the dot products are fast, they wait on
// memory more than on the products.
constexpr int64_t kBlockPrefetchBytes = 8192;

// acc + w . (the pair of x at p, broadcast to all 16 lanes): one vdpbf16ps, the pair its {1to16} memory
// operand, so the load unit broadcasts it. NOTE: written in asm because GCC does not fold the broadcast
// into vdpbf16ps: from _mm512_set1_epi32 it emits a vpbroadcastd of its own, which takes a vector pipe
// next to the dot products.
using AliasedPair = int32_t __attribute__((may_alias));
inline __m512 dot_pair(__m512 acc, __m512bh w, const c10::BFloat16* p) {
  asm("vdpbf16ps %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*reinterpret_cast<const AliasedPair*>(p)));
  return acc;
}

// One block of 16 output columns for ROWS rows of x. U independent sets of sums over interleaved K pairs
// hide the latency of vdpbf16ps when ROWS alone gives too few independent chains (fewer than 8 rows).
// NOTE: the `GCC unroll` pragmas keep every sum in a register: past 16 iterations GCC stops unrolling the
// row loops on its own, and acc[] then lives on the stack (twice as slow at 20 rows).
template <int ROWS, int U>
void block_kernel(const c10::BFloat16* w, const c10::BFloat16* x, int64_t ldx, int64_t pairs,
                  const __m512 bias, c10::BFloat16* y, int64_t ldy, __mmask16 cols) {
  __m512 acc[U][ROWS];
#pragma GCC unroll 32
  for (int u = 0; u < U; ++u)
#pragma GCC unroll 32
    for (int r = 0; r < ROWS; ++r) acc[u][r] = _mm512_setzero_ps();
  int64_t p = 0;
  for (; p + U <= pairs; p += U) {
    for (int u = 0; u < U; ++u) {
      _mm_prefetch(reinterpret_cast<const char*>(w + (p + u) * 2 * kBlock) + kBlockPrefetchBytes,
                   _MM_HINT_T1);
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + (p + u) * 2 * kBlock);
#pragma GCC unroll 32
      for (int r = 0; r < ROWS; ++r) acc[u][r] = dot_pair(acc[u][r], wv, x + r * ldx + 2 * (p + u));
    }
  }
  for (; p < pairs; ++p) {
    const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + p * 2 * kBlock);
#pragma GCC unroll 32
    for (int r = 0; r < ROWS; ++r) acc[0][r] = dot_pair(acc[0][r], wv, x + r * ldx + 2 * p);
  }
#pragma GCC unroll 32
  for (int r = 0; r < ROWS; ++r) {
    __m512 sum = _mm512_add_ps(acc[0][r], bias);
    for (int u = 1; u < U; ++u) sum = _mm512_add_ps(sum, acc[u][r]);
    // vcvtneps2bf16 rounds to nearest even, as PyTorch's float -> bf16 conversion does.
    _mm256_mask_storeu_epi16(y + r * ldy, cols, (__m256i)_mm512_cvtneps_pbh(sum));
  }
}

using BlockFn = void (*)(const c10::BFloat16*, const c10::BFloat16*, int64_t, int64_t, __m512, c10::BFloat16*,
                         int64_t, __mmask16);

// About eight independent chains of sums in flight: vdpbf16ps has a latency of several cycles and the
// loop issues about one per cycle. Batch-invariant, one chain a row whatever the rows (kOneChain): the
// order of 8 rows and more, and of the widening linear (see linear.h).
template <int ROWS, bool kOneChain>
constexpr int unroll() {
  return ROWS >= 8 || kOneChain ? 1 : (8 + ROWS - 1) / ROWS;
}

template <bool kOneChain, int... R>
constexpr auto make_table(std::integer_sequence<int, R...>) {
  return std::array<BlockFn, sizeof...(R)>{&block_kernel<R + 1, unroll<R + 1, kOneChain>()>...};
}
// Indexed by batch_invariant(), then by rows - 1.
constexpr std::array kKernelTables = {make_table<false>(std::make_integer_sequence<int, kMaxRows>{}),
                                      make_table<true>(std::make_integer_sequence<int, kMaxRows>{})};
constexpr const auto& kKernels = kKernelTables[0];

// block_kernel for S blocks at once, `step` blocks apart in W and in y: S streams from memory. A core reads
// faster from several sequential streams than from one, which counts where rows are few and the weights'
// stream sets the time. U sets of sums per block, as in block_kernel. kL2: W prefetched into L2, a single
// row too; else into L1, a single row not at all (see reads_ahead_into_l2).
template <int S, int ROWS, int U, bool kL2>
void block_kernel_streams(const c10::BFloat16* w, int64_t step, const c10::BFloat16* x, int64_t ldx,
                          int64_t pairs, const __m512* bias, c10::BFloat16* y, int64_t ldy,
                          const __mmask16* cols) {
  const int64_t w_step = step * pairs * 2 * kBlock;
  constexpr int64_t ahead = S >= 4 ? (ROWS == 1 && !kL2 ? 0 : kFourStreamPrefetchBytes) : kPrefetchBytes;
  constexpr Fetch kFetch = kL2 ? Fetch::kReadL2 : Fetch::kRead;
  __m512 acc[S][U][ROWS];
#pragma GCC unroll 32
  for (int s = 0; s < S; ++s)
#pragma GCC unroll 32
    for (int u = 0; u < U; ++u)
#pragma GCC unroll 32
      for (int r = 0; r < ROWS; ++r) acc[s][u][r] = _mm512_setzero_ps();
  int64_t p = 0;
  for (; p + U <= pairs; p += U) {
#pragma GCC unroll 32
    for (int u = 0; u < U; ++u) {
#pragma GCC unroll 32
      for (int s = 0; s < S; ++s) {
        const c10::BFloat16* line = w + s * w_step + (p + u) * 2 * kBlock;
        if constexpr (ahead > 0) prefetch_line(reinterpret_cast<const char*>(line) + ahead, kFetch);
        const __m512bh wv = (__m512bh)_mm512_loadu_si512(line);
#pragma GCC unroll 32
        for (int r = 0; r < ROWS; ++r) acc[s][u][r] = dot_pair(acc[s][u][r], wv, x + r * ldx + 2 * (p + u));
      }
    }
  }
  for (; p < pairs; ++p)
#pragma GCC unroll 32
    for (int s = 0; s < S; ++s) {
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + s * w_step + p * 2 * kBlock);
#pragma GCC unroll 32
      for (int r = 0; r < ROWS; ++r) acc[s][0][r] = dot_pair(acc[s][0][r], wv, x + r * ldx + 2 * p);
    }
#pragma GCC unroll 32
  for (int s = 0; s < S; ++s)
#pragma GCC unroll 32
    for (int r = 0; r < ROWS; ++r) {
      __m512 sum = _mm512_add_ps(acc[s][0][r], bias[s]);
      for (int u = 1; u < U; ++u) sum = _mm512_add_ps(sum, acc[s][u][r]);
      _mm256_mask_storeu_epi16(y + s * step * kBlock + r * ldy, cols[s], (__m256i)_mm512_cvtneps_pbh(sum));
    }
}

using StreamsFn = void (*)(const c10::BFloat16*, int64_t, const c10::BFloat16*, int64_t, int64_t,
                           const __m512*, c10::BFloat16*, int64_t, const __mmask16*);
// Rows up to which a thread streams its blocks as four streams, and as two (block_kernel_streams); more
// rows are bound by the dot products rather than by memory.
constexpr int kFourStreamRows = 4;
constexpr int kTwoStreamRows = 8;
// About eight independent chains of sums per step, as unroll() for block_kernel (one, kOneChain).
template <int S, bool kL2, bool kOneChain, int... R>
constexpr auto make_streams_table(std::integer_sequence<int, R...>) {
  return std::array<StreamsFn, sizeof...(R)>{
      &block_kernel_streams < S, R + 1, kOneChain ? 1 : (8 + S * (R + 1) - 1) / (S * (R + 1)), kL2 > ...};
}
template <int S, int kRows, bool kOneChain>
constexpr auto make_streams_tables() {
  return std::array{make_streams_table<S, false, kOneChain>(std::make_integer_sequence<int, kRows>{}),
                    make_streams_table<S, true, kOneChain>(std::make_integer_sequence<int, kRows>{})};
}
// Indexed by batch_invariant(), by reads_ahead_into_l2(), then by rows - 1.
constexpr std::array kStreams4 = {make_streams_tables<4, kFourStreamRows, false>(),
                                  make_streams_tables<4, kFourStreamRows, true>()};
constexpr std::array kStreams2 = {make_streams_tables<2, kTwoStreamRows, false>(),
                                  make_streams_tables<2, kTwoStreamRows, true>()};

// The tiles' order: batch-invariant, the few rows of a weight that AMX takes for many rows (see
// amx_tile_order) must get the bits its tiles would give them, while streaming W as the kernels above do.
// tdpbf16ps sums a tile's 16 pairs into an output as two float32 chains, one over the pairs' first products
// (k = 2p) and one over their second (k = 2p + 1), each a fused multiply-add a product in k order from zero,
// then adds the two chains' sum to the output's sum; it treats denormal inputs and results as zeros.
// tile_streams does exactly that with FMAs on the float32 rows of x (widened by the caller): a line of W
// widened to its two halves (the first products' weights by a shift, the second's by a mask), times x's
// pair as two broadcasts, under MXCSR's flush of denormals; the bias is added and the sum rounded after it,
// as store_amx_tile does. amx_order.cpp probes the match on the CPU before this path is taken.
// Rows up to which the tiles' order streams W as four streams, two chains a row and stream in registers.
constexpr int kTileFourStreamRows = 3;

template <int S, int ROWS, bool kL2>
void tile_streams(const c10::BFloat16* w, int64_t step, const float* x, int64_t ldx, int64_t pairs,
                  const __m512* bias, c10::BFloat16* y, int64_t ldy, const __mmask16* cols) {
  const int64_t w_step = step * pairs * 2 * kBlock;
  constexpr int64_t ahead = S >= 4 ? kFourStreamPrefetchBytes : kPrefetchBytes;
  constexpr Fetch kFetch = kL2 ? Fetch::kReadL2 : Fetch::kRead;
  const __m512i high = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  __m512 sum[S][ROWS];
  const unsigned mxcsr = _mm_getcsr();
  _mm_setcsr(mxcsr | kFlushDenormals);
#pragma GCC unroll 32
  for (int s = 0; s < S; ++s)
#pragma GCC unroll 32
    for (int r = 0; r < ROWS; ++r) sum[s][r] = _mm512_setzero_ps();
  for (int64_t p0 = 0; p0 < pairs; p0 += kAmxTilePairs) {
    __m512 first[S][ROWS], second[S][ROWS];
#pragma GCC unroll 32
    for (int s = 0; s < S; ++s)
#pragma GCC unroll 32
      for (int r = 0; r < ROWS; ++r) first[s][r] = second[s][r] = _mm512_setzero_ps();
    for (int64_t p = p0; p < p0 + kAmxTilePairs; ++p) {
#pragma GCC unroll 32
      for (int s = 0; s < S; ++s) {
        const c10::BFloat16* line = w + s * w_step + p * 2 * kBlock;
        prefetch_line(reinterpret_cast<const char*>(line) + ahead, kFetch);
        const __m512i wv = _mm512_loadu_si512(line);
        const __m512 w0 = _mm512_castsi512_ps(_mm512_slli_epi32(wv, 16));
        const __m512 w1 = _mm512_castsi512_ps(_mm512_and_si512(wv, high));
#pragma GCC unroll 32
        for (int r = 0; r < ROWS; ++r) {
          first[s][r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx + 2 * p]), w0, first[s][r]);
          second[s][r] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * ldx + 2 * p + 1]), w1, second[s][r]);
        }
      }
    }
#pragma GCC unroll 32
    for (int s = 0; s < S; ++s)
#pragma GCC unroll 32
      for (int r = 0; r < ROWS; ++r)
        sum[s][r] = _mm512_add_ps(sum[s][r], _mm512_add_ps(first[s][r], second[s][r]));
  }
  _mm_setcsr(mxcsr);
#pragma GCC unroll 32
  for (int s = 0; s < S; ++s)
#pragma GCC unroll 32
    for (int r = 0; r < ROWS; ++r)
      _mm256_mask_storeu_epi16(y + s * step * kBlock + r * ldy, cols[s],
                               (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(sum[s][r], bias[s])));
}

using TileStreamsFn = void (*)(const c10::BFloat16*, int64_t, const float*, int64_t, int64_t, const __m512*,
                               c10::BFloat16*, int64_t, const __mmask16*);
template <int S, bool kL2, int... R>
constexpr auto make_tile_table(std::integer_sequence<int, R...>) {
  return std::array<TileStreamsFn, sizeof...(R)>{&tile_streams<S, R + 1, kL2>...};
}
template <int S, int kRows>
constexpr auto make_tile_tables() {
  return std::array{make_tile_table<S, false>(std::make_integer_sequence<int, kRows>{}),
                    make_tile_table<S, true>(std::make_integer_sequence<int, kRows>{})};
}
// Indexed by reads_ahead_into_l2(), then by rows - 1: four streams, two, and one (the blocks left over).
constexpr auto kTileStreams4 = make_tile_tables<4, kTileFourStreamRows>();
constexpr auto kTileStreams2 = make_tile_tables<2, kTwoStreamRows>();
constexpr auto kTileStreams1 = make_tile_tables<1, kTwoStreamRows>();

// m rows are computed in chunks of at most kMaxRows rows, as even as possible, and the chunks in groups of
// kGroupChunks: a thread runs all its blocks over one group's rows, then the next group's, so that a
// prompt's x is read from L2 (a group's rows of the SmolLM2 MLP's down: 120 x 3 KB) instead of from L3 once
// per block. A row's chunk, and so its bits, do not depend on the grouping.
constexpr int64_t kGroupChunks = 4;

// Calls f(c0, c1) for the groups of chunks c0 .. c1 - 1 of m rows.
template <typename F>
inline void for_row_groups(int64_t m, F&& f) {
  const int64_t chunks = (m + kMaxRows - 1) / kMaxRows;
  for (int64_t c0 = 0; c0 < chunks; c0 += kGroupChunks) f(c0, std::min(chunks, c0 + kGroupChunks));
}

// The first row of chunk c of m rows (c = the number of chunks: m).
inline int64_t row_chunk_begin(int64_t m, int64_t c) { return m * c / ((m + kMaxRows - 1) / kMaxRows); }

// Calls f(r0, rows) for chunks c0 .. c1 - 1 of m rows.
template <typename F>
inline void for_row_chunks(int64_t m, int64_t c0, int64_t c1, F&& f) {
  for (int64_t c = c0; c < c1; ++c) {
    const int64_t r0 = row_chunk_begin(m, c);
    f(r0, row_chunk_begin(m, c + 1) - r0);
  }
}

}  // namespace

void linear_bf16dot(const c10::BFloat16* x, int64_t ldx, int64_t m, const c10::BFloat16* w, int64_t pairs,
                    int64_t n, const c10::BFloat16* bias, c10::BFloat16* y, int64_t ldy, bool tile_order) {
  TORCH_CHECK(!tile_order || (m <= kTwoStreamRows && pairs % kAmxTilePairs == 0),
              "the tiles' order takes up to ", kTwoStreamRows, " rows and K in whole tiles");
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  const int threads = static_cast<int>(std::min<int64_t>(std::max(1, at::get_num_threads()), blocks));
  // Up to kTwoStreamRows rows, the threads share the blocks out as runs (see BlockRuns), each run read as
  // four streams side by side (up to four rows, three in the tiles' order; two up to eight), block i of each
  // stream together; then the blocks the streams leave over, one at a time. More rows: each thread its
  // contiguous run of blocks, a sequential stream of W.
  const int64_t streams = m <= (tile_order ? kTileFourStreamRows : kFourStreamRows) ? 4 : 2;
  BlockRuns runs(blocks, threads, streams);
  // The tiles' order reads x in float32, widened once here for all the threads.
  thread_local std::vector<float> wide;
  if (tile_order) {
    wide.resize(std::max<size_t>(wide.size(), m * 2 * pairs));
    for (int64_t r = 0; r < m; ++r) load_row(x + r * ldx, wide.data() + r * 2 * pairs, 2 * pairs);
  }
  const float* const x32 = wide.data();
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    const auto cols_of = [&](int64_t b) { return block_cols(n, b); };
    const auto bias_of = [&](int64_t b) { return bias_block(bias, b, cols_of(b)); };
    if (m <= kTwoStreamRows) {
      const int l2 = reads_ahead_into_l2() ? 1 : 0, one_chain = batch_invariant() ? 1 : 0;
      runs.work(t, [&](int r, int64_t u, int64_t) {
        int64_t first, part;
        const bool together = runs.parts_of(r, u, first, part);
        __m512 biases[4];
        __mmask16 cols[4];
        for (int s = 0; s < (together ? streams : 1); ++s)
          biases[s] = bias_of(first + s * part), cols[s] = cols_of(first + s * part);
        const c10::BFloat16* wf = w + first * pairs * 2 * kBlock;
        c10::BFloat16* yf = y + first * kBlock;
        if (tile_order) {
          const TileStreamsFn step = !together      ? kTileStreams1[l2][m - 1]
                                     : streams == 4 ? kTileStreams4[l2][m - 1]
                                                    : kTileStreams2[l2][m - 1];
          step(wf, part, x32, 2 * pairs, pairs, biases, yf, ldy, cols);
        } else if (!together) {
          kKernelTables[one_chain][m - 1](wf, x, ldx, pairs, biases[0], yf, ldy, cols[0]);
        } else {
          const StreamsFn step =
              streams == 4 ? kStreams4[one_chain][l2][m - 1] : kStreams2[one_chain][l2][m - 1];
          step(wf, part, x, ldx, pairs, biases, yf, ldy, cols);
        }
      });
    } else {
      const int64_t b0 = blocks * t / nt, b1 = blocks * (t + 1) / nt;
      for_row_groups(m, [&](int64_t c0, int64_t c1) {
        for (int64_t j = b0; j < b1; ++j) {
          const c10::BFloat16* wb = w + j * pairs * 2 * kBlock;
          const __m512 bias_f32 = bias_of(j);
          for_row_chunks(m, c0, c1, [&](int64_t r0, int64_t rows) {
            kKernels[rows - 1](wb, x + r0 * ldx, ldx, pairs, bias_f32, y + r0 * ldy + j * kBlock, ldy,
                               cols_of(j));
          });
        }
      });
    }
  }
}

// silu_mul(x @ W^T + bias) for a gate_up W of N = 2 * size (gate first) and size a multiple of kBlock: gate
// block j for a group's rows (see kGroupChunks) into a thread's strip, then up block size / kBlock + j, whose
// rows are multiplied with the strip's as they come out; only the product is written, out [m, size]. The same
// roundings as linear then silu_mul, without writing and reading back the [m, 2 * size] product, and without
// a parallel region of its own.
void linear_silu_bf16dot(const c10::BFloat16* x, int64_t ldx, int64_t m, const c10::BFloat16* w,
                         int64_t pairs, int64_t size, const c10::BFloat16* bias, c10::BFloat16* out,
                         int64_t ld_out) {
  const int64_t half = size / kBlock, block_elems = pairs * 2 * kBlock;
  const int threads = static_cast<int>(std::min<int64_t>(std::max(1, at::get_num_threads()), half));
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    alignas(64) c10::BFloat16 gate[kGroupChunks * kMaxRows * kBlock], up[kMaxRows * kBlock];
    for_row_groups(m, [&](int64_t c0, int64_t c1) {
      const int64_t g0 = row_chunk_begin(m, c0);  // the group's first row, gate's row 0
      for (int64_t j = half * t / nt; j < half * (t + 1) / nt; ++j) {
        const __m512 bias_gate = bias_block(bias, j, 0xFFFF), bias_up = bias_block(bias, half + j, 0xFFFF);
        for_row_chunks(m, c0, c1, [&](int64_t r0, int64_t rows) {
          kKernels[rows - 1](w + j * block_elems, x + r0 * ldx, ldx, pairs, bias_gate,
                             gate + (r0 - g0) * kBlock, kBlock, 0xFFFF);
        });
        for_row_chunks(m, c0, c1, [&](int64_t r0, int64_t rows) {
          kKernels[rows - 1](w + (half + j) * block_elems, x + r0 * ldx, ldx, pairs, bias_up, up, kBlock,
                             0xFFFF);
          for (int64_t r = 0; r < rows; ++r)
            silu_mul_block(out + (r0 + r) * ld_out + j * kBlock, gate + (r0 - g0 + r) * kBlock,
                           up + r * kBlock);
        });
      }
    });
  }
}

int64_t bf16dot_silu_rows(int64_t m) { return m > kTwoStreamRows ? m : 0; }

}  // namespace pagedserve::cpu

#endif  // __AVX512BF16__
