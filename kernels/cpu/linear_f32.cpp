// The float32 linear (see linear.h), for a model loaded in float32: a row's 16 sums of a block are fed per k
// by the line's weights and one broadcast of x; each thread streams its run of W once while x stays in L1 or
// L2, the sums in k order and the bias added last.

#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <memory>
#include <vector>

#include "block_runs.h"
#include "linear.h"

#if defined(__AVX2__) && defined(__FMA__)

namespace pagedserve::cpu {
namespace {

// Rows of x handled by one pass over its blocks of W: 12 ymm sums, two weights and a broadcast.
constexpr int kF32PassRows = 6;
// Rows of x taken through the blocks at a time, twice as many up to K = 768: as the bf16 linear's groups
// (kAvx2GroupRows), so that a group's rows stay in L2 while the blocks stream past them.
constexpr int64_t kF32GroupRows = 48;
constexpr int64_t kF32WideGroupMaxK = 768;
// A row's 16 sums of a block (columns 0-7 in lo, 8-15 in hi); the first cols of them to y.
inline void store_sums_f32(__m256 lo, __m256 hi, float* y, int64_t cols) {
  if (cols >= kBlock) {
    _mm256_storeu_ps(y, lo);
    _mm256_storeu_ps(y + 8, hi);
    return;
  }
  alignas(32) float row[kBlock];
  _mm256_store_ps(row, lo);
  _mm256_store_ps(row + 8, hi);
  std::memcpy(y, row, cols * sizeof(float));
}

// ROWS rows of x (ldx apart) against S blocks `step` blocks apart: S sequential streams of W (a core reads
// faster from several streams than from one; see rows_streams_avx2). With line i of a block it prefetches
// fetch + i * fetch_step, and as much past fetch for every stream after the first. bias: S * kBlock floats,
// the streams' blocks' in turn; cols[s]: stream s's columns.
template <int S, int ROWS>
void f32_pass(const float* w, int64_t step, int64_t k, const float* x, int64_t ldx, const float* bias,
              float* y, int64_t ldy, const int64_t* cols, const char* fetch, int64_t fetch_step) {
  const int64_t w_step = step * k * kBlock;
  __m256 acc[S][ROWS][2];
#pragma GCC unroll 4
  for (int s = 0; s < S; ++s)
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; ++r) acc[s][r][0] = acc[s][r][1] = _mm256_setzero_ps();
  for (int64_t i = 0; i < k; ++i)
#pragma GCC unroll 4
    for (int s = 0; s < S; ++s) {
      const float* line = w + s * w_step + i * kBlock;
      _mm_prefetch(fetch + s * w_step * sizeof(float) + i * fetch_step, _MM_HINT_T1);
      const __m256 w0 = _mm256_loadu_ps(line), w1 = _mm256_loadu_ps(line + 8);
#pragma GCC unroll 8
      for (int r = 0; r < ROWS; ++r) {
        const __m256 xr = _mm256_broadcast_ss(x + r * ldx + i);
        acc[s][r][0] = _mm256_fmadd_ps(w0, xr, acc[s][r][0]);
        acc[s][r][1] = _mm256_fmadd_ps(w1, xr, acc[s][r][1]);
      }
    }
#pragma GCC unroll 4
  for (int s = 0; s < S; ++s)
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; ++r)
      store_sums_f32(_mm256_add_ps(acc[s][r][0], _mm256_loadu_ps(bias + s * kBlock)),
                     _mm256_add_ps(acc[s][r][1], _mm256_loadu_ps(bias + s * kBlock + 8)),
                     y + s * step * kBlock + r * ldy, cols[s]);
}

using F32PassFn = void (*)(const float*, int64_t, int64_t, const float*, int64_t, const float*, float*,
                           int64_t, const int64_t*, const char*, int64_t);
constexpr std::array<F32PassFn, kF32PassRows> kF32Passes = {
    &f32_pass<1, 1>, &f32_pass<1, 2>, &f32_pass<1, 3>, &f32_pass<1, 4>, &f32_pass<1, 5>, &f32_pass<1, 6>};

// Each thread streams its own run of the blocks, then helps the others finish theirs (see BlockRuns); one or
// two rows go as steps over four or two parts of a run side by side, more in passes over each block (36-96
// KB for SmolLM2, in L2 for all the passes over it). The 30 layers' linears of SmolLM2 (2-core Zen 3,
// weights from memory, separate processes alternating, ms): runs against units of one block for 48 rows
// handed to whichever thread asks next, 128 rows 202 and 224 against 269 and 338, 256 rows 452 and 370
// against 557 and 457; past a group of rows (see kF32GroupRows) the groups in turn against all the rows in
// every pass over a block (x then streamed from L3 for each block), 256 rows 315 and 294 against 394 and
// 295, 512 rows 617 and 591 against 646 and 615, 2048 rows 2424 and 2369 against 2741 and 2434.
}  // namespace

void linear_f32(const float* x, int64_t ldx, int64_t m, const float* w, int64_t k, int64_t n,
                const float* bias, float* y, int64_t ldy) {
  const int64_t blocks = (n + kBlock - 1) / kBlock, block_bytes = k * kBlock * sizeof(float);
  const int threads = static_cast<int>(std::min<int64_t>(std::max(1, at::get_num_threads()), blocks));
  // Block j's columns into cols, and its bias (zero without one) into bias_f32.
  const auto block_of = [&](int64_t j, int64_t* cols, float* bias_f32) {
    *cols = std::min<int64_t>(kBlock, n - j * kBlock);
    std::fill(bias_f32, bias_f32 + kBlock, 0.f);
    if (bias != nullptr) std::memcpy(bias_f32, bias + j * kBlock, *cols * sizeof(float));
  };
  // Block j for all the rows in balanced passes of up to kF32PassRows rows. One pass streams the block
  // kPrefetchBytes ahead; several fetch the next block of the run instead (the one before where dir is -1,
  // the run being taken back to front), each pass a 1/passes share of it, so that memory works while they
  // compute, as linear_avx2's passes do. The 30 layers' linears and the LM head, against each pass
  // prefetching kPrefetchBytes ahead in its block (one run each): 16 rows 51.8 -> 39.0 ms, 32 rows 90.2 ->
  // 61.3, 48 rows 116.8 -> 83.5.
  const auto block_passes = [&](int64_t j, int64_t dir, int64_t g0, int64_t gm) {
    int64_t cols;
    float bias_f32[kBlock];
    block_of(j, &cols, bias_f32);
    const int64_t passes = (gm + kF32PassRows - 1) / kF32PassRows;
    const float* const at = w + j * k * kBlock;
    const char* const block = reinterpret_cast<const char*>(at);
    for (int64_t i = 0; i < passes; ++i) {
      const int64_t r0 = g0 + gm * i / passes, rows = g0 + gm * (i + 1) / passes - r0;
      const bool stream = passes == 1 && dir > 0;
      kF32Passes[rows - 1](
          at, 1, k, x + r0 * ldx, ldx, bias_f32, y + r0 * ldy + j * kBlock, ldy, &cols,
          stream ? block + kPrefetchBytes : block + dir * block_bytes + i * block_bytes / passes,
          stream ? 64 : (64 + passes - 1) / passes);
    }
  };
  // More rows than a group: the groups in turn (balanced), each as runs of its own, a thread going on to the
  // next group's run once none of this one's blocks is left to take.
  const int64_t group_rows = k <= kF32WideGroupMaxK ? 2 * kF32GroupRows : kF32GroupRows;
  if (m > group_rows) {
    const int64_t groups = (m + group_rows - 1) / group_rows;
    std::vector<std::unique_ptr<BlockRuns>> group_runs;
    for (int64_t g = 0; g < groups; ++g)
      group_runs.push_back(std::make_unique<BlockRuns>(blocks, threads, 1));
#pragma omp parallel num_threads(threads)
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t g0 = m * g / groups, gm = m * (g + 1) / groups - g0;
      BlockRuns& gr = *group_runs[g];
      gr.work(omp_get_thread_num(), [&](int r, int64_t u, int64_t dir) {
        int64_t first, parts;
        gr.parts_of(r, u, first, parts);
        block_passes(first, dir, g0, gm);
      });
    }
    return;
  }
  const int64_t streams = m == 1 ? 4 : (m == 2 ? 2 : 1);
  BlockRuns runs(blocks, threads, streams);
  const auto unit = [&](int r, int64_t u, int64_t dir) {
    int64_t first, parts;
    if (!runs.parts_of(r, u, first, parts)) return block_passes(first, dir, 0, m);
    int64_t cols[4];
    float bias_s[4 * kBlock];
    for (int64_t s = 0; s < streams; ++s) block_of(first + s * parts, cols + s, bias_s + s * kBlock);
    const float* const at = w + first * k * kBlock;
    const char* const fetch = reinterpret_cast<const char*>(at);
    if (m == 1)
      f32_pass<4, 1>(at, parts, k, x, ldx, bias_s, y + first * kBlock, ldy, cols,
                     fetch + kFourStreamPrefetchBytes, 64);
    else
      f32_pass<2, 2>(at, parts, k, x, ldx, bias_s, y + first * kBlock, ldy, cols, fetch + kPrefetchBytes, 64);
  };
#pragma omp parallel num_threads(threads)
  runs.work(omp_get_thread_num(), unit);
}

}  // namespace pagedserve::cpu

#endif
