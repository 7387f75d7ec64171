// The bf16 linear without a bf16 dot product (see linear.h): AVX2 with FMA, and AVX-512 without BF16, one
// body over vec::Vec. A packed line holds one column's pair in each 32-bit word (k = 2p in its low half,
// 2p + 1 in its high half), so a shift and a mask widen it to the float32 weights of k = 2p and of 2p + 1,
// exactly, and float32 FMAs multiply them by x widened to float32: a product of two bf16 values is exact in
// float32, so the result is again the exact product summed in float32 and rounded once. Every pass runs a
// row's FMAs in k order (k = 2p, then 2p + 1, the bias added last), so a row gets the same bits in any pass.
//
// A pass is a few rows of x against a few blocks side by side (each broadcast of x feeding one FMA a block:
// the loads do not keep up with one broadcast per FMA), widening the lines as it goes. Where the registers
// are few (AVX2), groups of 32 rows and more instead widen each block once into a float32 copy that their
// passes read, which spares every pass the shifts and masks.

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
#include "pointwise.h"
#include "prefetch.h"
#include "vec.h"

#if !defined(__AVX512BF16__) && (defined(PAGEDSERVE_AVX512) || defined(PAGEDSERVE_AVX2))

namespace pagedserve::cpu {
namespace {

using c10::BFloat16;
using vec::IVec;
using vec::kLanes;
using vec::Vec;

// Vectors of a block's 16 columns (AVX-512: one, AVX2: two).
constexpr int kVectors = kBlock / kLanes;
// A pass: up to kPassRows rows against up to kPassBlocks blocks, their sums, a widened half line a block and
// a broadcast in the registers (AVX-512: 8 x 3 + 3 + 1 of 32; AVX2: 6 x 2 + 2 + 1 of 16).
constexpr int kPassRows = vec::kRegisters == 32 ? 8 : 6;
constexpr int kPassBlocks = vec::kRegisters == 32 ? 3 : 1;
// Rows of x widened at a time, twice as many up to K = kWideGroupMaxK, so that a group's rows stay in L2
// (beside a widened block, on AVX2) while the blocks stream past them.
constexpr int64_t kGroupRows = 48;
constexpr int64_t kWideGroupMaxK = 768;
// Groups of at least this many rows go through units handed to whichever thread asks next; on AVX2 their
// blocks are widened once into a float32 copy (kCopyBlocks), which the FMAs of fewer rows do not pay for.
constexpr int64_t kUnitMinRows = 32;
constexpr bool kCopyBlocks = vec::kRegisters == 16;
constexpr int kCopyRows = 6;  // the rows of a pass over a copy: 12 sums, 2 weights and a broadcast

inline int64_t group_rows_of(int64_t k) { return k <= kWideGroupMaxK ? 2 * kGroupRows : kGroupRows; }

// How many of m rows go through units: the groups of at least kUnitMinRows rows, all but a short last one.
inline int64_t unit_rows(int64_t m, int64_t k) {
  const int64_t group_rows = group_rows_of(k), last = m - (m - 1) / group_rows * group_rows;
  return last >= kUnitMinRows ? m : m - last;
}

// x [rows, 2 * pairs] bf16 (rows ldx apart), widened to float32 and interleaved by K pair into out [pairs,
// rows, 2]: a pass reaches every broadcast from one pointer. A pair's two bf16 are one 32-bit word: its low
// half shifted up is k = 2p, its high half masked k = 2p + 1, one 64-bit store.
void interleave_pairs(const BFloat16* x, int64_t ldx, int64_t rows, int64_t pairs, float* out) {
  uint64_t* const out_pairs = reinterpret_cast<uint64_t*>(out);
  for (int64_t r = 0; r < rows; ++r) {
    const BFloat16* row = x + r * ldx;
    for (int64_t p = 0; p < pairs; ++p) {
      uint32_t v;
      std::memcpy(&v, row + 2 * p, sizeof(v));
      out_pairs[p * rows + r] = static_cast<uint64_t>(v & 0xFFFF0000u) << 32 | static_cast<uint32_t>(v << 16);
    }
  }
}

// A pass's sums (rows x nb blocks of kBlock floats, a block's `step` blocks apart in y and in bias) plus the
// bias, rounded to bf16 into y, the first cols[b] columns of block b; with gate (a strip of the pass's rows,
// nb * kBlock apart), silu(gate) * up of them instead, up rounded to bf16 first as the linear stores it.
// NOTE: out of line, so that GCC compiles the passes' loops alone: with the stores inlined it versioned the
// loops and spilled sums.
__attribute__((noinline)) void store_pass(const float* sums, int64_t rows, int64_t nb, int64_t step,
                                          const float* bias, BFloat16* y, int64_t ldy, const int64_t* cols,
                                          const BFloat16* gate) {
  using namespace vec;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < nb; ++b)
      for (int v = 0; v < kVectors; ++v) {
        const int64_t at = b * step * kBlock + kLanes * v;
        const Vec s =
            add(load(sums + (r * nb + b) * kBlock + kLanes * v), load(bias + b * kBlock + kLanes * v));
        BFloat16* out = y + r * ldy + at;
        if (gate != nullptr) {
          store(out,
                silu_mul<BFloat16>(load(gate + r * nb * kBlock + b * kBlock + kLanes * v), round_bf16(s)));
          continue;
        }
        const int64_t left = cols[b] - kLanes * v;  // a last block may have fewer columns
        if (left >= kLanes)
          store(out, s);
        else if (left > 0)
          store_n(out, s, left);
      }
}

// ROWS rows (x interleaved by pair, see interleave_pairs) against NB blocks, `step` blocks apart in W (one
// after the other, step 1; kStreams: NB streams of W side by side, step their distance). The lines are
// widened as they come, k = 2p for all rows, then 2p + 1. With line p, fetch + p * fetch_step is prefetched,
// or with kStreams each stream's line fetch bytes ahead. kSilu: the sums are up's, and y gets
// silu(gate) * up (see store_pass).
template <int ROWS, int NB, bool kSilu, bool kStreams = false>
void pass(const BFloat16* w, int64_t step, int64_t pairs, const float* x, const float* bias, BFloat16* y,
          int64_t ldy, const int64_t* cols, const BFloat16* gate, const char* fetch, int64_t fetch_step) {
  using namespace vec;
  Vec acc[ROWS][NB][kVectors];
#pragma GCC unroll 16
  for (int r = 0; r < ROWS; ++r)
#pragma GCC unroll 4
    for (int b = 0; b < NB; ++b)
#pragma GCC unroll 2
      for (int v = 0; v < kVectors; ++v) acc[r][b][v] = zero();
  for (int64_t p = 0; p < pairs; ++p) {
    if constexpr (kStreams) {
#pragma GCC unroll 4
      for (int b = 0; b < NB; ++b)
        prefetch_line(reinterpret_cast<const char*>(w + (b * step * pairs + p) * 2 * kBlock) + fetch_step,
                      Fetch::kReadL2);
    } else {
      prefetch_line(fetch + p * fetch_step, Fetch::kReadL2);
    }
    const float* xp = x + p * 2 * ROWS;
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {  // k = 2p, then 2p + 1
      Vec half[NB][kVectors];
#pragma GCC unroll 4
      for (int b = 0; b < NB; ++b)
#pragma GCC unroll 2
        for (int v = 0; v < kVectors; ++v) {
          const IVec line =
              iload(reinterpret_cast<const int32_t*>(w + (b * step * pairs + p) * 2 * kBlock) + kLanes * v);
          half[b][v] = h == 0 ? even_bf16(line) : odd_bf16(line);
        }
#pragma GCC unroll 16
      for (int r = 0; r < ROWS; ++r) {
        const Vec xr = set1(xp[2 * r + h]);
#pragma GCC unroll 4
        for (int b = 0; b < NB; ++b)
#pragma GCC unroll 2
          for (int v = 0; v < kVectors; ++v) acc[r][b][v] = fma(half[b][v], xr, acc[r][b][v]);
      }
    }
  }
  alignas(64) float sums[ROWS][NB][kBlock];
#pragma GCC unroll 16
  for (int r = 0; r < ROWS; ++r)
#pragma GCC unroll 4
    for (int b = 0; b < NB; ++b)
#pragma GCC unroll 2
      for (int v = 0; v < kVectors; ++v) store(&sums[r][b][kLanes * v], acc[r][b][v]);
  store_pass(&sums[0][0][0], ROWS, NB, step, bias, y, ldy, cols, kSilu ? gate : nullptr);
}

using PassFn = void (*)(const BFloat16*, int64_t, int64_t, const float*, const float*, BFloat16*, int64_t,
                        const int64_t*, const BFloat16*, const char*, int64_t);
template <int NB, bool kSilu, int... R>
constexpr std::array<PassFn, sizeof...(R)> pass_table(std::integer_sequence<int, R...>) {
  return {&pass<R + 1, NB, kSilu>...};
}
using PassTable = std::array<std::array<PassFn, kPassRows>, kPassBlocks>;
template <bool kSilu, int... B>
constexpr PassTable pass_tables(std::integer_sequence<int, B...>) {
  return {pass_table<B + 1, kSilu>(std::make_integer_sequence<int, kPassRows>{})...};
}
// [silu][blocks - 1][rows - 1]
constexpr std::array<PassTable, 2> kPasses = {
    pass_tables<false>(std::make_integer_sequence<int, kPassBlocks>{}),
    pass_tables<true>(std::make_integer_sequence<int, kPassBlocks>{})};

// The float32 copy of a block (kCopyBlocks): the weights of k = 2p + i at wide + 16 (2p + i), k's 16
// columns side by side.
void widen_block(const BFloat16* w, int64_t pairs, float* wide) {
  using namespace vec;
  for (int64_t p = 0; p < pairs; ++p) {
    const BFloat16* line = w + p * 2 * kBlock;
    prefetch_line(reinterpret_cast<const char*>(line) + kPrefetchBytes, Fetch::kReadL2);
    for (int v = 0; v < kVectors; ++v) {
      const IVec bits = iload(reinterpret_cast<const int32_t*>(line) + kLanes * v);
      store(wide + 32 * p + kLanes * v, even_bf16(bits));
      store(wide + 32 * p + kBlock + kLanes * v, odd_bf16(bits));
    }
  }
}

// ROWS rows of x (float32, row-major, ldx apart) against a float32 copy of a block (widen_block): per k, the
// line's weights by one broadcast a row; the FMAs of `pass` in the same order.
template <int ROWS, bool kSilu>
void copy_pass(const float* wide, const float* x, int64_t ldx, int64_t k, const float* bias, BFloat16* y,
               int64_t ldy, const int64_t* cols, const BFloat16* gate) {
  using namespace vec;
  Vec acc[ROWS][kVectors];
#pragma GCC unroll 8
  for (int r = 0; r < ROWS; ++r)
#pragma GCC unroll 2
    for (int v = 0; v < kVectors; ++v) acc[r][v] = zero();
  for (int64_t i = 0; i < k; ++i) {
    Vec wv[kVectors];
#pragma GCC unroll 2
    for (int v = 0; v < kVectors; ++v) wv[v] = load(wide + kBlock * i + kLanes * v);
#pragma GCC unroll 8
    for (int r = 0; r < ROWS; ++r) {
      const Vec xr = set1(x[r * ldx + i]);
#pragma GCC unroll 2
      for (int v = 0; v < kVectors; ++v) acc[r][v] = fma(wv[v], xr, acc[r][v]);
    }
  }
  alignas(64) float sums[ROWS][kBlock];
#pragma GCC unroll 8
  for (int r = 0; r < ROWS; ++r)
#pragma GCC unroll 2
    for (int v = 0; v < kVectors; ++v) store(&sums[r][kLanes * v], acc[r][v]);
  store_pass(&sums[0][0], ROWS, 1, 1, bias, y, ldy, cols, kSilu ? gate : nullptr);
}

}  // namespace

void linear_widen(const BFloat16* x, int64_t ldx, int64_t m, const BFloat16* w, int64_t pairs, int64_t n,
                  const BFloat16* bias, BFloat16* y, int64_t ldy, bool silu) {
  const int64_t blocks = (n + kBlock - 1) / kBlock, k = 2 * pairs, block_elems = pairs * 2 * kBlock;
  const int threads = static_cast<int>(std::min<int64_t>(std::max(1, at::get_num_threads()), blocks));
  const int64_t group_rows = group_rows_of(k), groups = (m + group_rows - 1) / group_rows;
  const int64_t unit_groups = (unit_rows(m, k) + group_rows - 1) / group_rows;
  TORCH_INTERNAL_ASSERT(!silu || (unit_groups == groups && n % (2 * kBlock) == 0));
  // The rows left (a decode batch, or a prompt's last rows): each thread takes a run of the blocks (see
  // BlockRuns), one or two rows in steps over four or two parts of the run side by side, more in slots of
  // kPassBlocks blocks a pass.
  const int64_t tail_rows = m - unit_groups * group_rows;
  const int64_t streams = tail_rows == 1 ? 4 : (tail_rows == 2 ? 2 : 1);
  const int64_t tail_width = streams > 1 ? 1 : kPassBlocks;
  BlockRuns runs((blocks + tail_width - 1) / tail_width, threads, streams);
  std::atomic<int64_t> next_unit{0};
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num();
    thread_local std::vector<float> xt;  // a group's x: interleaved by K pair pass by pass, or row-major
    xt.resize(std::max<size_t>(xt.size(), std::min(m, group_rows) * k));
    int64_t widened = -1;  // the group of rows whose x is in xt
    // The passes of a group of `rows` rows: balanced, of up to `most` rows each.
    const auto passes_of = [](int64_t rows, int64_t most) { return (rows + most - 1) / most; };
    // Group g's x into xt, as its passes read it; its first row and rows into g0 and rows.
    const auto load_group = [&](int64_t g, int64_t& g0, int64_t& rows, bool copy) {
      g0 = g * group_rows;
      rows = std::min(group_rows, m - g0);
      if (widened == g) return;
      widened = g;
      if (copy) {
        for (int64_t r = 0; r < rows; ++r) load_row(x + (g0 + r) * ldx, xt.data() + r * k, k);
        return;
      }
      const int64_t passes = passes_of(rows, kPassRows);
      for (int64_t i = 0; i < passes; ++i) {
        const int64_t r0 = rows * i / passes;
        interleave_pairs(x + (g0 + r0) * ldx, ldx, rows * (i + 1) / passes - r0, pairs, xt.data() + r0 * k);
      }
    };
    // Blocks j, j + step, ..., count of them: their columns, and their bias in float32 (zero without one).
    const auto blocks_of = [&](int64_t j, int64_t step, int64_t count, int64_t* cols, float* bias_f32) {
      for (int64_t b = 0; b < count; ++b) {
        const int64_t first = (j + b * step) * kBlock;
        cols[b] = std::min<int64_t>(kBlock, n - first);
        std::fill(bias_f32 + b * kBlock, bias_f32 + (b + 1) * kBlock, 0.f);
        for (int64_t c = 0; bias != nullptr && c < cols[b]; ++c) bias_f32[b * kBlock + c] = bias[first + c];
      }
    };
    // Blocks first .. first + nb - 1 for the rows g0 .. g0 + rows - 1 (x in xt) into out (rows ld_out apart)
    // in passes of up to kPassRows rows. Each pass fetches a 1/passes share of the next nb blocks (the ones
    // before where dir is -1, the run being taken back to front), so that memory works while they compute;
    // in a run, one pass streams its own blocks kPrefetchBytes ahead instead. silu_part: -1 without silu, 0
    // for gate's blocks (out is the thread's strip), 1 for up's (gate the strip).
    const auto block_passes = [&](int64_t first, int64_t nb, int64_t rows, int64_t dir, bool in_run,
                                  BFloat16* out, int64_t ld_out, int64_t silu_part, const BFloat16* gate) {
      int64_t cols[kPassBlocks];
      float bias_f32[kPassBlocks * kBlock];
      blocks_of(first, 1, nb, cols, bias_f32);
      const int64_t passes = passes_of(rows, kPassRows), block_bytes = block_elems * 2;
      const char* const block = reinterpret_cast<const char*>(w + first * block_elems);
      const bool stream = in_run && passes == 1 && dir > 0;
      for (int64_t i = 0; i < passes; ++i) {
        const int64_t r0 = rows * i / passes, chunk = rows * (i + 1) / passes - r0;
        const char* fetch =
            stream ? block + kPrefetchBytes : block + dir * nb * block_bytes + i * nb * block_bytes / passes;
        const int64_t fetch_step = stream ? 64 * nb : (64 * nb + passes - 1) / passes;
        kPasses[silu_part == 1][nb - 1][chunk - 1](
            w + first * block_elems, 1, pairs, xt.data() + r0 * k, bias_f32, out + r0 * ld_out, ld_out, cols,
            gate == nullptr ? nullptr : gate + r0 * nb * kBlock, fetch, fetch_step);
      }
    };

    // Groups of kUnitMinRows rows and more: a unit is a slot of blocks for one group of rows, handed to
    // whichever thread asks next, groups in order (the threads work through a group together, each widening
    // its x once). With silu a unit is a slot of gate's blocks and the same of up's: gate's sums go to the
    // thread's strip (rounded to bf16, as linear stores them), and up's are multiplied with them as they come
    // out.
    const int64_t unit_blocks = silu ? blocks / 2 : blocks;
    const int64_t width = kCopyBlocks ? 1 : kPassBlocks, units = (unit_blocks + width - 1) / width;
    thread_local std::vector<BFloat16> gate;
    if (silu) gate.resize(std::max<size_t>(gate.size(), group_rows * kPassBlocks * kBlock));
    thread_local std::vector<float> wide;
    if (kCopyBlocks && unit_groups > 0) wide.resize(std::max<size_t>(wide.size(), block_elems + kLanes));
    float* const wide_block = reinterpret_cast<float*>(  // aligned for whole-vector loads
        (reinterpret_cast<uintptr_t>(wide.data()) + 4 * kLanes - 1) & ~uintptr_t{4 * kLanes - 1});
    for (int64_t u = next_unit.fetch_add(1, std::memory_order_relaxed); u < unit_groups * units;
         u = next_unit.fetch_add(1, std::memory_order_relaxed)) {
      const int64_t j = u % units * width, nb = std::min<int64_t>(width, unit_blocks - j);
      int64_t g0, rows;
      load_group(u / units, g0, rows, kCopyBlocks);
      for (int part = 0; part < (silu ? 2 : 1); ++part) {  // with silu gate's blocks, then up's
        const int64_t first = part * unit_blocks + j;
        const bool to_gate = silu && part == 0;
        BFloat16* const out = to_gate ? gate.data() : y + g0 * ldy + j * kBlock;
        const int64_t ld_out = to_gate ? nb * kBlock : ldy;
        if constexpr (kCopyBlocks) {
          int64_t cols[1];
          float bias_f32[kBlock];
          blocks_of(first, 1, 1, cols, bias_f32);
          widen_block(w + first * block_elems, pairs, wide_block);
          const int64_t passes = passes_of(rows, kCopyRows);
          for (int64_t i = 0; i < passes; ++i) {
            const int64_t r0 = rows * i / passes, chunk = rows * (i + 1) / passes - r0;
            const bool up = silu && part == 1;
            using CopyFn = void (*)(const float*, const float*, int64_t, int64_t, const float*, BFloat16*,
                                    int64_t, const int64_t*, const BFloat16*);
            static constexpr CopyFn kCopy[2][2] = {
                {&copy_pass<kCopyRows - 1, false>, &copy_pass<kCopyRows, false>},
                {&copy_pass<kCopyRows - 1, true>, &copy_pass<kCopyRows, true>}};
            TORCH_INTERNAL_ASSERT(chunk == kCopyRows || chunk == kCopyRows - 1);
            kCopy[up][chunk == kCopyRows](wide_block, xt.data() + r0 * k, k, k, bias_f32, out + r0 * ld_out,
                                          ld_out, cols, gate.data() + r0 * kBlock);
          }
        } else {
          block_passes(first, nb, rows, 1, false, out, ld_out, silu ? part : -1, gate.data());
        }
      }
    }

    if (unit_groups < groups) {
      int64_t g0, rows;
      load_group(unit_groups, g0, rows, false);
      // Unit u of run r: a step (slot u of each part) or a slot, taken the way dir says.
      runs.work(t, [&](int r, int64_t u, int64_t dir) {
        int64_t first, part;
        if (!runs.parts_of(r, u, first, part)) {
          const int64_t j = first * tail_width;
          return block_passes(j, std::min(tail_width, blocks - j), rows, dir, true, y + g0 * ldy + j * kBlock,
                              ldy, -1, nullptr);
        }
        // One row as four streams, two as two: blocks first + s * part, as one pass over blocks `part` apart.
        const auto step = [&](auto streams_c) {
          constexpr int S = decltype(streams_c)::value;
          int64_t cols[S];
          float bias_s[S * kBlock];
          blocks_of(first, part, S, cols, bias_s);
          pass<S == 4 ? 1 : 2, S, false, true>(w + first * block_elems, part, pairs, xt.data(), bias_s,
                                               y + g0 * ldy + first * kBlock, ldy, cols, nullptr, nullptr,
                                               kFourStreamPrefetchBytes);
        };
        if (rows == 1) step(std::integral_constant<int, 4>{});
        if (rows == 2) step(std::integral_constant<int, 2>{});
      });
    }
  }
}

int64_t widen_silu_rows(int64_t m, int64_t k) { return unit_rows(m, k); }

}  // namespace pagedserve::cpu

#endif
