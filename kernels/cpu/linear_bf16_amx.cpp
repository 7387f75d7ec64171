// The bf16 linear on AMX (see linear.h): the packed weights are tiles already, a block's 16 consecutive K
// pairs being one W tile of 32 x 16 (16 lines of 64 bytes one after the other), so the tiles read the
// weights pack_linear_weight made. Each thread takes its run of blocks in panels that stay in L2, and passes
// the rows of x over each panel 32 at a time, two blocks at a time: two x tiles and two W tiles into four
// tiles of float32 sums, each over all of K in order (a row's sums whatever the rows beside it). From 16 rows
// K is walked in panels, the sums stored between them (see amx_walk).

#include <ATen/Parallel.h>
#include <omp.h>

#include <cstring>
#include <utility>
#include <vector>

#include "amx.h"
#include "common.h"
#include "linear.h"
#include "ops.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)

namespace pagedserve::cpu {
namespace {

// AMX needs K a multiple of 32 (a whole tile of x per step; every SmolLM2, Llama and Qwen hidden and
// intermediate size is one) and Linux's permission for the tile state, asked once per process; without
// either the linear takes the AVX-512 BF16 kernels. Many rows go to oneDNN (linear_onednn.cpp) before they
// reach it.

// Rows from which linear_to and linear_silu_to take the AMX kernel: below it the AVX-512 BF16 kernels stream
// the weights better.
constexpr int64_t kAmxMinRows = 6;
constexpr int64_t kAmxTileRows = 16;  // rows of an x tile and of a tile of sums

}  // namespace

// Batch-invariant, a weight AMX takes has its sums in the tiles' order for every row count: the few rows
// through linear_bf16dot's FMAs in that order (amx_tile_order), or on a CPU whose tiles round otherwise,
// through the tiles here too.
bool use_amx(int64_t m, int64_t pairs) {
  return (m >= kAmxMinRows || (batch_invariant() && !tiles_sum_in_chains())) && pairs % kAmxTilePairs == 0 &&
         amx_enabled();
}

bool amx_tile_order(int64_t pairs) {
  return batch_invariant() && pairs % kAmxTilePairs == 0 && amx_enabled() && tiles_sum_in_chains();
}

namespace {

// Tiles 0-3: sums, 4-5: x, 6-7: W; all 16 rows of 64 bytes.
constexpr TileConfig kLinearTiles{{16, 64}, {16, 64}, {16, 64}, {16, 64},
                                  {16, 64}, {16, 64}, {16, 64}, {16, 64}};

// The rows [r0, r0 + rows) of x as x tiles: each points into x itself (rows ldx elements apart), but the last
// when it has fewer than 16 rows, which is copied into pad (16 rows of 2 * pairs, zeros after the copied
// rows) so that the tile loads never read past x.
struct RowTiles {
  const c10::BFloat16* x;
  int64_t ldx, r0, rows;
  c10::BFloat16* pad;
  int64_t pairs;
  // Fewer than 16 rows in all, in tiles of that many rows (see amx_region): read from x itself.
  bool short_tiles = false;

  int64_t count() const { return (rows + kAmxTileRows - 1) / kAmxTileRows; }
  int64_t rows_of(int64_t i) const { return std::min(kAmxTileRows, rows - i * kAmxTileRows); }
  bool padded(int64_t i) const { return !short_tiles && rows_of(i) < kAmxTileRows; }
  const c10::BFloat16* base(int64_t i) const { return padded(i) ? pad : x + (r0 + i * kAmxTileRows) * ldx; }
  int64_t stride_bytes(int64_t i) const { return (padded(i) ? 2 * pairs : ldx) * 2; }
  void fill_pad() const {
    if (count() == 0 || !padded(count() - 1)) return;
    const int64_t first = r0 + (count() - 1) * kAmxTileRows, n = rows_of(count() - 1), k = 2 * pairs;
    for (int64_t r = 0; r < n; ++r)
      std::memcpy(pad + r * k, x + (first + r) * ldx, k * sizeof(c10::BFloat16));
    std::memset(pad + n * k, 0, (kAmxTileRows - n) * k * sizeof(c10::BFloat16));
  }
};

// The sums of RT x tiles (a0, a1; their rows sa0, sa1 bytes apart) by BT W tiles (the blocks at w0, w1)
// over the K pairs [p0, p1), stored as float32 into c[(rt * BT + bt) * 256 + row * 16 + col]: from zero, or
// (resume) from the sums c holds, those of the pairs before p0. A tile of float32 stored and loaded back is
// the same tile, so the sums are bit for bit those of one pass over all of K in order.
template <int RT, int BT>
inline void amx_tiles(const c10::BFloat16* a0, int64_t sa0, const c10::BFloat16* a1, int64_t sa1,
                      const c10::BFloat16* w0, const c10::BFloat16* w1, int64_t p0, int64_t p1, bool resume,
                      float* c) {
  constexpr int64_t kTile = kAmxTileRows * kBlock;
  if (resume) {
    _tile_loadd(0, c, kBlock * 4);
    if constexpr (BT > 1) _tile_loadd(1, c + kTile, kBlock * 4);
    if constexpr (RT > 1) _tile_loadd(2, c + BT * kTile, kBlock * 4);
    if constexpr (RT > 1 && BT > 1) _tile_loadd(3, c + 3 * kTile, kBlock * 4);
  } else {
    _tile_zero(0);
    if constexpr (BT > 1) _tile_zero(1);
    if constexpr (RT > 1) _tile_zero(2);
    if constexpr (RT > 1 && BT > 1) _tile_zero(3);
  }
  for (int64_t p = p0; p < p1; p += kAmxTilePairs) {
    _tile_loadd(4, a0 + 2 * p, sa0);
    if constexpr (RT > 1) _tile_loadd(5, a1 + 2 * p, sa1);
    _tile_loadd(6, w0 + p * 2 * kBlock, 2 * kBlock * 2);
    if constexpr (BT > 1) _tile_loadd(7, w1 + p * 2 * kBlock, 2 * kBlock * 2);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (BT > 1) _tile_dpbf16ps(1, 4, 7);
    if constexpr (RT > 1) _tile_dpbf16ps(2, 5, 6);
    if constexpr (RT > 1 && BT > 1) _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, c, kBlock * 4);
  if constexpr (BT > 1) _tile_stored(1, c + kTile, kBlock * 4);
  if constexpr (RT > 1) _tile_stored(2, c + BT * kTile, kBlock * 4);
  if constexpr (RT > 1 && BT > 1) _tile_stored(3, c + 3 * kTile, kBlock * 4);
}

// The sums of x tiles i and i + 1 (if there is one, `two`) of `tiles` by the W blocks at w0 and w1 (none:
// w0 alone) over the K pairs [p0, p1) into c, as amx_tiles lays them out and resumes them.
inline void amx_step(const RowTiles& tiles, int64_t i, bool two, const c10::BFloat16* w0,
                     const c10::BFloat16* w1, int64_t p0, int64_t p1, bool resume, float* c) {
  const c10::BFloat16* a0 = tiles.base(i);
  const c10::BFloat16* a1 = two ? tiles.base(i + 1) : a0;
  const int64_t sa0 = tiles.stride_bytes(i), sa1 = two ? tiles.stride_bytes(i + 1) : sa0;
  if (two && w1 != nullptr)
    amx_tiles<2, 2>(a0, sa0, a1, sa1, w0, w1, p0, p1, resume, c);
  else if (two)
    amx_tiles<2, 1>(a0, sa0, a1, sa1, w0, w0, p0, p1, resume, c);
  else if (w1 != nullptr)
    amx_tiles<1, 2>(a0, sa0, a1, sa1, w0, w1, p0, p1, resume, c);
  else
    amx_tiles<1, 1>(a0, sa0, a1, sa1, w0, w0, p0, p1, resume, c);
}

// Rounds a tile of sums (16 x 16 float32 at c) plus the block's bias to bf16: `rows` rows of `cols` columns,
// into y (rows ldy apart).
inline void store_amx_tile(const float* c, __m512 bias, int64_t rows, __mmask16 cols, c10::BFloat16* y,
                           int64_t ldy) {
  for (int64_t r = 0; r < rows; ++r)
    _mm256_mask_storeu_epi16(
        y + r * ldy, cols, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(_mm512_loadu_ps(c + r * kBlock), bias)));
}

// Blocks of W a panel: as many (an even count) as fill about kPanelBytes, which stay in L2 while the x tiles
// pass over them.
constexpr int64_t kPanelBytes = 512 * 1024;
inline int64_t panel_blocks(int64_t pairs) {
  return std::max<int64_t>(2, kPanelBytes / (pairs * 2 * kBlock * 2) / 2 * 2);
}

// The walk's blocking from 16 rows: groups of kGroupPairs pairs of x tiles by kGroupSteps steps of W (a step:
// one or two W blocks), over K in panels of about kPanelSteps K steps; each group's sums stay in memory from
// one K panel to the next (amx_tiles' resume), and the group's x and W panels are read again from the caches
// closest to the tiles rather than streamed in from L2 and beyond once per pair of tiles.
constexpr int64_t kGroupPairs = 2;
constexpr int64_t kGroupSteps = 4;
constexpr int64_t kPanelSteps = 6;

// Walks `count` steps (w_of(s): step s's weights, the second null where it has one block) in panels of
// `panel` steps (panel_blocks) under the x tiles of `tiles`, and calls done(i, two, s, c) once c holds the
// complete sums of x tiles i (and i + 1, two) by step s's blocks. Every sum runs over all of K in order,
// whatever the blocking. Fewer than 16 rows (short tiles) take one tile, one step and all of K at a time.
template <typename WOf, typename Done>
void amx_walk(const RowTiles& tiles, int64_t pairs, int64_t count, int64_t panel, WOf&& w_of, Done&& done) {
  constexpr int64_t kStepSums = 4 * kAmxTileRows * kBlock;
  alignas(64) float sums[kGroupPairs * kGroupSteps * kStepSums];
  const int64_t k_steps = pairs / kAmxTilePairs, x_pairs = (tiles.count() + 1) / 2;
  const int64_t k_panels = tiles.short_tiles ? 1 : (k_steps + kPanelSteps - 1) / kPanelSteps;
  const int64_t group_pairs = tiles.short_tiles ? 1 : kGroupPairs,
                group_steps = tiles.short_tiles ? 1 : kGroupSteps;
  for (int64_t n0 = 0; n0 < count; n0 += panel) {
    const int64_t n1 = std::min(count, n0 + panel);
    for (int64_t i0 = 0; i0 < x_pairs; i0 += group_pairs) {
      const int64_t i1 = std::min(x_pairs, i0 + group_pairs);
      for (int64_t s0 = n0; s0 < n1; s0 += group_steps) {
        const int64_t s1 = std::min(n1, s0 + group_steps);
        for (int64_t k = 0; k < k_panels; ++k) {
          const int64_t p0 = k_steps * k / k_panels * kAmxTilePairs;
          const int64_t p1 = k_steps * (k + 1) / k_panels * kAmxTilePairs;
          for (int64_t ip = i0; ip < i1; ++ip) {
            const int64_t i = 2 * ip;
            const bool two = i + 1 < tiles.count();
            for (int64_t s = s0; s < s1; ++s) {
              const auto [w0, w1] = w_of(s);
              float* const c = sums + ((ip - i0) * group_steps + s - s0) * kStepSums;
              amx_step(tiles, i, two, w0, w1, p0, p1, k > 0, c);
              if (k == k_panels - 1) done(i, two, s, c);
            }
          }
        }
      }
    }
  }
}

// The tiles' parallel region over the m rows of x: each of `threads` threads loads the tile configuration,
// and runs body(t, nt, tiles) on x's tiles, the last padded into a pad of its own; the tile state is
// released at the end. Fewer than 16 rows (a decode step's) take x tiles and tiles of sums of m rows, read
// from x itself: tdpbf16ps computes each row's sums alone, so a row gets the same bits in a tile of any
// height, and the tiles' work shrinks with the rows.
template <typename F>
void amx_region(int threads, const c10::BFloat16* x, int64_t ldx, int64_t m, int64_t pairs, F&& body) {
  TileConfig config = kLinearTiles;
  const bool short_tiles = m < kAmxTileRows;
  if (short_tiles)
    for (int t = 0; t < 6; ++t) config.rows[t] = static_cast<uint8_t>(m);  // the sums' and x's tiles
#pragma omp parallel num_threads(threads)
  {
    _tile_loadconfig(&config);
    thread_local std::vector<c10::BFloat16> pad;
    pad.resize(std::max<size_t>(pad.size(), kAmxTileRows * 2 * pairs));
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    const RowTiles tiles{x, ldx, 0, m, pad.data(), pairs, short_tiles};
    tiles.fill_pad();
    body(t, nt, tiles);
    _tile_release();
  }
}

}  // namespace

// The bf16 linear on AMX (see use_amx). Each thread takes a contiguous run of blocks, in panels (see
// panel_blocks), and walks each panel's blocks two at a time under the x tiles, two at a time (amx_walk).
// NOTE: bits. Both walk K in order, as block_kernel does where it keeps one chain a row (8 rows and more,
// unroll()), but tdpbf16ps sums a tile's first and second products of the pairs as two chains (see
// linear_bf16_avx512.cpp tile_streams), where vdpbf16ps adds a pair's two products in turn: about 1 output
// in 5,000 differs from AVX-512 BF16's, by a bf16 step (more only where a sum cancels to near zero).
void linear_amx(const c10::BFloat16* x, int64_t ldx, int64_t m, const c10::BFloat16* w, int64_t pairs,
                int64_t n, const c10::BFloat16* bias, c10::BFloat16* y, int64_t ldy) {
  const int64_t blocks = (n + kBlock - 1) / kBlock, block_elems = pairs * 2 * kBlock;
  const int threads = static_cast<int>(std::min<int64_t>(std::max(1, at::get_num_threads()), blocks));
  amx_region(threads, x, ldx, m, pairs, [&](int t, int nt, const RowTiles& tiles) {
    const int64_t b0 = blocks * t / nt, b1 = blocks * (t + 1) / nt;
    // A step: blocks j and j + 1 (j alone at the end of an odd run).
    amx_walk(
        tiles, pairs, (b1 - b0 + 1) / 2, panel_blocks(pairs) / 2,
        [&](int64_t s) {
          const int64_t j = b0 + 2 * s;
          const c10::BFloat16* wj = w + j * block_elems;
          return std::make_pair(wj, j + 1 < b1 ? wj + block_elems : nullptr);
        },
        [&](int64_t i, bool two, int64_t s, const float* c) {
          const int64_t j = b0 + 2 * s;
          const bool two_blocks = j + 1 < b1;
          for (int64_t rt = 0; rt < (two ? 2 : 1); ++rt)
            for (int64_t bt = 0; bt < (two_blocks ? 2 : 1); ++bt) {
              const int64_t b = j + bt, rows = tiles.rows_of(i + rt);
              const __mmask16 cols = block_cols(n, b);
              store_amx_tile(c + (rt * (two_blocks ? 2 : 1) + bt) * kAmxTileRows * kBlock,
                             bias_block(bias, b, cols), rows, cols,
                             y + (i + rt) * kAmxTileRows * ldy + b * kBlock, ldy);
            }
        });
  });
}

// The MLP's gate_up and SiLU on AMX: gate block j and up block size / 16 + j as one step's two W tiles, so
// that the sums of both lie side by side; each rounded to bf16 (as linear rounds) and multiplied by
// silu_mul_block.
void linear_silu_amx(const c10::BFloat16* x, int64_t ldx, int64_t m, const c10::BFloat16* w, int64_t pairs,
                     int64_t size, const c10::BFloat16* bias, c10::BFloat16* out, int64_t ld_out) {
  const int64_t half = size / kBlock, block_elems = pairs * 2 * kBlock;
  const int threads = static_cast<int>(std::min<int64_t>(std::max(1, at::get_num_threads()), half));
  amx_region(threads, x, ldx, m, pairs, [&](int t, int nt, const RowTiles& tiles) {
    alignas(64) c10::BFloat16 gate[kAmxTileRows * kBlock], up[kAmxTileRows * kBlock];
    const int64_t j0 = half * t / nt, j1 = half * (t + 1) / nt;
    // A step: gate block j with its up block, in panels of as many blocks as linear_amx's.
    amx_walk(
        tiles, pairs, j1 - j0, std::max<int64_t>(1, panel_blocks(pairs) / 2),
        [&](int64_t s) {
          return std::make_pair(w + (j0 + s) * block_elems, w + (half + j0 + s) * block_elems);
        },
        [&](int64_t i, bool two, int64_t s, const float* c) {
          const int64_t j = j0 + s;
          const __m512 bias_gate = bias_block(bias, j, 0xFFFF), bias_up = bias_block(bias, half + j, 0xFFFF);
          for (int64_t rt = 0; rt < (two ? 2 : 1); ++rt) {
            const int64_t rows = tiles.rows_of(i + rt);
            const float* cg = c + 2 * rt * kAmxTileRows * kBlock;
            store_amx_tile(cg, bias_gate, rows, 0xFFFF, gate, kBlock);
            store_amx_tile(cg + kAmxTileRows * kBlock, bias_up, rows, 0xFFFF, up, kBlock);
            c10::BFloat16* o = out + (i + rt) * kAmxTileRows * ld_out + j * kBlock;
            for (int64_t r = 0; r < rows; ++r)
              silu_mul_block(o + r * ld_out, gate + r * kBlock, up + r * kBlock);
          }
        });
  });
}

}  // namespace pagedserve::cpu

#else

namespace pagedserve::cpu {

bool use_amx(int64_t, int64_t) { return false; }
bool amx_tile_order(int64_t) { return false; }

void linear_amx(const c10::BFloat16*, int64_t, int64_t, const c10::BFloat16*, int64_t, int64_t,
                const c10::BFloat16*, c10::BFloat16*, int64_t) {
  TORCH_CHECK(false, "this build has no AMX (see use_amx)");
}

void linear_silu_amx(const c10::BFloat16*, int64_t, int64_t, const c10::BFloat16*, int64_t, int64_t,
                     const c10::BFloat16*, c10::BFloat16*, int64_t) {
  TORCH_CHECK(false, "this build has no AMX (see use_amx)");
}

}  // namespace pagedserve::cpu

#endif
