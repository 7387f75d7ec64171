// The float32 linear (see linear.h), for a model loaded in float32, one body over vec::Vec: a row's 16 sums
// of a block are fed per k by the line's weights and one broadcast of x; each thread streams its run of W
// once while x stays in L1 or L2, the sums in k order and the bias added last, so a row gets the same bits in
// any pass and on any instruction set.

#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <memory>
#include <vector>

#include "block_runs.h"
#include "linear.h"
#include "prefetch.h"
#include "vec.h"

#if defined(PAGEDSERVE_AVX512) || defined(PAGEDSERVE_AVX2)

namespace pagedserve::cpu {
namespace {

using vec::kLanes;
using vec::Vec;

// Vectors of a block's 16 columns (AVX-512: 1, AVX2: 2).
constexpr int kVectors = kBlock / kLanes;
// Rows of x one pass over a block computes: their sums, the line's weights and a broadcast in the registers
// (AVX2: 6 x 2 + 2 + 1 of 16).
constexpr int kPassRows = vec::kRegisters == 32 ? 12 : 6;
// Rows of x taken through the blocks at a time, twice as many up to K = 768, so that a group's rows stay in
// L2 while the blocks stream past them.
constexpr int64_t kGroupRows = 48;
constexpr int64_t kWideGroupMaxK = 768;

// ROWS rows of x (ldx apart) against S blocks `step` blocks apart: S sequential streams of W (a core reads
// faster from several streams than from one). With line i of a block it prefetches fetch + i * fetch_step,
// and as much past fetch for every stream after the first. bias: S * kBlock floats, the streams' blocks' in
// turn; cols[s]: stream s's columns. The sums run in k order, the bias added last.
template <int S, int ROWS>
void f32_pass(const float* w, int64_t step, int64_t k, const float* x, int64_t ldx, const float* bias,
              float* y, int64_t ldy, const int64_t* cols, const char* fetch, int64_t fetch_step) {
  using namespace vec;
  const int64_t w_step = step * k * kBlock;
  Vec acc[S][ROWS][kVectors];
#pragma GCC unroll 4
  for (int s = 0; s < S; ++s)
#pragma GCC unroll 16
    for (int r = 0; r < ROWS; ++r)
#pragma GCC unroll 2
      for (int v = 0; v < kVectors; ++v) acc[s][r][v] = zero();
  for (int64_t i = 0; i < k; ++i)
#pragma GCC unroll 4
    for (int s = 0; s < S; ++s) {
      const float* line = w + s * w_step + i * kBlock;
      prefetch_line(fetch + s * w_step * sizeof(float) + i * fetch_step, Fetch::kReadL2);
      Vec wv[kVectors];
#pragma GCC unroll 2
      for (int v = 0; v < kVectors; ++v) wv[v] = load(line + kLanes * v);
#pragma GCC unroll 16
      for (int r = 0; r < ROWS; ++r) {
        const Vec xr = set1(x[r * ldx + i]);
#pragma GCC unroll 2
        for (int v = 0; v < kVectors; ++v) acc[s][r][v] = fma(wv[v], xr, acc[s][r][v]);
      }
    }
#pragma GCC unroll 4
  for (int s = 0; s < S; ++s)
#pragma GCC unroll 16
    for (int r = 0; r < ROWS; ++r)
#pragma GCC unroll 2
      for (int v = 0; v < kVectors; ++v) {
        const Vec sums = add(acc[s][r][v], load(bias + s * kBlock + kLanes * v));
        float* out = y + s * step * kBlock + r * ldy + kLanes * v;
        const int64_t left = cols[s] - kLanes * v;  // the block's last columns may be fewer
        if (left >= kLanes)
          store(out, sums);
        else if (left > 0)
          store_n(out, sums, left);
      }
}

using PassFn = void (*)(const float*, int64_t, int64_t, const float*, int64_t, const float*, float*, int64_t,
                        const int64_t*, const char*, int64_t);
template <int... R>
constexpr std::array<PassFn, sizeof...(R)> passes(std::integer_sequence<int, R...>) {
  return {&f32_pass<1, R + 1>...};
}
constexpr auto kPasses = passes(std::make_integer_sequence<int, kPassRows>{});

}  // namespace

// Each thread streams its own run of the blocks, then helps the others finish theirs (see BlockRuns); one or
// two rows go as steps over four or two parts of a run side by side, more in passes over each block (in L2
// for all the passes over it), a group of rows at a time.
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
  // Block j for all the rows in balanced passes of up to kPassRows rows. One pass streams the block
  // kPrefetchBytes ahead; several fetch the next block of the run instead (the one before where dir is -1,
  // the run being taken back to front), each pass a 1/passes share of it, so that memory works while they
  // compute.
  const auto block_passes = [&](int64_t j, int64_t dir, int64_t g0, int64_t gm) {
    int64_t cols;
    float bias_f32[kBlock];
    block_of(j, &cols, bias_f32);
    const int64_t passes = (gm + kPassRows - 1) / kPassRows;
    const float* const at = w + j * k * kBlock;
    const char* const block = reinterpret_cast<const char*>(at);
    for (int64_t i = 0; i < passes; ++i) {
      const int64_t r0 = g0 + gm * i / passes, rows = g0 + gm * (i + 1) / passes - r0;
      const bool stream = passes == 1 && dir > 0;
      kPasses[rows - 1](
          at, 1, k, x + r0 * ldx, ldx, bias_f32, y + r0 * ldy + j * kBlock, ldy, &cols,
          stream ? block + kPrefetchBytes : block + dir * block_bytes + i * block_bytes / passes,
          stream ? 64 : (64 + passes - 1) / passes);
    }
  };
  // More rows than a group: the groups in turn (balanced), each as runs of its own, a thread going on to the
  // next group's run once none of this one's blocks is left to take.
  const int64_t group_rows = k <= kWideGroupMaxK ? 2 * kGroupRows : kGroupRows;
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
