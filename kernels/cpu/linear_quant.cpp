// The weight-only quantized linear (see linear_quant.h). Each thread streams its run of W's blocks once (see
// BlockRuns), a block's codes turned into float32 or bf16 vectors in registers and multiplied by up to kRows
// rows of x at a time; a group's products are summed in float32, then scaled and offset into the row's sums.
// Many bf16 rows dequantize the codes to bf16 a W tile at a time and multiply them on AMX (linear_quant_amx).

#include "linear_quant.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <omp.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstring>
#include <utility>
#include <vector>

#include "amx.h"
#include "block_runs.h"
#include "common.h"
#include "linear.h"
#include "prefetch.h"
#include "vec.h"

namespace pagedserve::cpu {

namespace {

std::atomic<int64_t> dequant_min_rows{kQuantDequantRows};

int64_t scale_group_bytes(int32_t kind) { return kind == kScaleF32 ? 128 : (kind == kScaleF16 ? 64 : 32); }

}  // namespace

QuantHeader quant_header(const at::Tensor& packed, const char* what) {
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 1 && packed.is_contiguous() &&
                  packed.numel() >= kQuantHeaderBytes,
              what, "a quantized weight must be a contiguous uint8 tensor from pack_quant_weight");
  QuantHeader h;
  std::memcpy(&h, packed.const_data_ptr<uint8_t>(), sizeof h);
  TORCH_CHECK(h.magic == kQuantMagic, what, "not a packed quantized weight (no header)");
  TORCH_CHECK((h.bits == 4 || h.bits == 8) && h.scale_kind >= 0 && h.scale_kind <= 2 && h.group_size > 0 &&
                  h.group_size % (h.bits == 4 ? 8 : 4) == 0 && h.n > 0 && h.groups > 0 &&
                  h.k == h.groups * h.group_size,
              what, "malformed quantized weight header: bits ", h.bits, ", group size ", h.group_size, ", K ",
              h.k, ", N ", h.n);
  const int64_t scales = (h.groups * scale_group_bytes(h.scale_kind) + 63) / 64 * 64;
  const int64_t blocks = (h.n + kBlock - 1) / kBlock;
  TORCH_CHECK(h.scale_bytes == scales && h.block_bytes == scales + h.k * kBlock * h.bits / 8 &&
                  packed.numel() == kQuantHeaderBytes + blocks * h.block_bytes,
              what, "quantized weight of ", packed.numel(), " bytes does not match its header");
  return h;
}

bool is_quant_weight(const at::Tensor& packed) {
  if (packed.scalar_type() != at::kByte || packed.dim() != 1 || packed.numel() < kQuantHeaderBytes)
    return false;
  uint32_t magic;
  std::memcpy(&magic, packed.const_data_ptr<uint8_t>(), sizeof magic);
  return magic == kQuantMagic;
}

#if defined(PAGEDSERVE_AVX512)

namespace {

// Rows of x a pass over a block computes (their group sums and totals stay in registers).
constexpr int kRows = 8;
// Independent sums a row keeps within a group: with few rows, one chain of multiply-adds a row would wait on
// the latency of each (4 to 6 cycles) rather than on the weights.
template <int R>
constexpr int kChains = R == 1 ? 4 : (R == 2 ? 2 : 1);

// A block's group g: its 16 scales and offsets in float32.
template <int KIND>
inline void group_scales(const uint8_t* scales, int64_t g, __m512& scale, __m512& offset) {
  if constexpr (KIND == kScaleF32) {
    const float* p = reinterpret_cast<const float*>(scales + g * 128);
    scale = _mm512_loadu_ps(p);
    offset = _mm512_loadu_ps(p + kBlock);
  } else if constexpr (KIND == kScaleF16) {
    const uint8_t* p = scales + g * 64;
    scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    offset = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32)));
  } else {
    scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + g * 32)));
    offset = _mm512_setzero_ps();
  }
}

// N sums set to zero.
template <int N>
inline void zero(__m512* sums) {
#pragma GCC unroll 32
  for (int i = 0; i < N; ++i) sums[i] = _mm512_setzero_ps();
}

// The arguments of a pass: R rows of x against one block.
struct Pass {
  const uint8_t* block;  // the block (scales, then codes)
  const QuantHeader* h;  // the weight's header
  const void* x;         // the rows: bf16 (bf16 pairs path) or float32
  int64_t ldx;           // elements between rows of x
  const float* xsum;     // [R, groups]: each row's sum of x over each group
  const void* bias;      // the block's 16 bias values (of the output's dtype), or null
  void* y;               // the block's first column of the first row
  int64_t ldy;           // elements between rows of y
  int64_t cols;          // the block's columns that exist (<= 16)
};

// The row totals of R rows: + bias, stored as TOut.
template <typename TOut, int R>
inline void store_rows(const Pass& a, __m512 (&tot)[R]) {
  const __m512 bias =
      a.bias == nullptr ? _mm512_setzero_ps() : vec::load_n(static_cast<const TOut*>(a.bias), a.cols);
  TOut* y = static_cast<TOut*>(a.y);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    const __m512 v = _mm512_add_ps(tot[r], bias);
    if (a.cols == kBlock)
      vec::store(y + r * a.ldy, v);
    else
      vec::store_n(y + r * a.ldy, v, a.cols);
  }
}

// The scaled and offset sums of group g into the totals: scale * acc + offset * sum(x).
template <int R, int A>
inline void add_group(__m512 (&tot)[R], const __m512 (&acc)[R][A], __m512 scale, __m512 offset,
                      const float* xsum, int64_t groups, int64_t g, bool offsets) {
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    __m512 sum = acc[r][0];
#pragma GCC unroll 4
    for (int c = 1; c < A; ++c) sum = _mm512_add_ps(sum, acc[r][c]);
    tot[r] = _mm512_fmadd_ps(scale, sum, tot[r]);
    if (offsets) tot[r] = _mm512_fmadd_ps(offset, _mm512_set1_ps(xsum[r * groups + g]), tot[r]);
  }
}

// The code lines of a pass: a 64-byte line holds kK k of the block's 16 columns; add() multiplies one (its
// first k is k0) by R rows of x into a group's sums, and fit() turns a group's scale and offset into those
// of the sums (kOffsets: whether the offsets' products are needed whatever the scales).

// int4 codes, float32 x: each k's 16 codes widened to float32, one FMA a row.
struct Int4F32 {
  using X = float;
  static constexpr int kK = 8;
  static constexpr bool kOffsets = false;
  template <int R, int A>
  static inline void add(const uint8_t* line, const float* x, int64_t ldx, int64_t k0, __m512 (&acc)[R][A]) {
    const __m512i lanes = _mm512_loadu_si512(line);
#pragma GCC unroll 8
    for (int kk = 0; kk < 8; ++kk) {
      const int shift = (kk & 1) ? 16 + 4 * (kk >> 1) : 4 * (kk >> 1);
      const __m512 wv =
          _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(lanes, shift), _mm512_set1_epi32(0xF)));
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r)
        acc[r][kk % A] = _mm512_fmadd_ps(wv, _mm512_set1_ps(x[r * ldx + k0 + kk]), acc[r][kk % A]);
    }
  }
  static void fit(__m512&, __m512&) {}
};

// int8 codes, float32 x.
struct Int8F32 {
  using X = float;
  static constexpr int kK = 4;
  static constexpr bool kOffsets = false;
  template <int R, int A>
  static inline void add(const uint8_t* line, const float* x, int64_t ldx, int64_t k0, __m512 (&acc)[R][A]) {
#pragma GCC unroll 4
    for (int kk = 0; kk < 4; ++kk) {
      const __m512 wv = _mm512_cvtepi32_ps(
          _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(line + kk * kBlock))));
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r)
        acc[r][kk % A] = _mm512_fmadd_ps(wv, _mm512_set1_ps(x[r * ldx + k0 + kk]), acc[r][kk % A]);
    }
  }
  static void fit(__m512&, __m512&) {}
};

#if defined(__AVX512BF16__)
// int4 codes, bf16 x: a code c becomes the bf16 1 + c/16 (exact: c in the mantissa's top 4 bits), so that
// vdpbf16ps multiplies a pair of k of 16 columns by a pair of x in one instruction; the group's sum is then
// sum(x) + sum(x c) / 16, and scale * sum(x c) + offset * sum(x) = 16 scale * acc + (offset - 16 scale) *
// sum(x).
// Pair p (k 2p and 2p + 1) of an int4 code line's 32-bit lanes, each code c as the bf16 1 + c/16: (placed &
// mask) | one puts the pair's two codes in the mantissas of 1.0.
inline __m512i int4_pair_bf16(__m512i lanes, int p) {
  const __m512i placed = p == 0 ? _mm512_slli_epi32(lanes, 3) : _mm512_srli_epi32(lanes, 4 * p - 3);
  return _mm512_ternarylogic_epi32(placed, _mm512_set1_epi32(0x00780078), _mm512_set1_epi32(0x3F803F80),
                                   0xEA);
}

struct Int4Bf16 {
  using X = c10::BFloat16;
  static constexpr int kK = 8;
  static constexpr bool kOffsets = true;
  template <int R, int A>
  static inline void add(const uint8_t* line, const c10::BFloat16* x, int64_t ldx, int64_t k0,
                         __m512 (&acc)[R][A]) {
    const __m512i lanes = _mm512_loadu_si512(line);
#pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) {
      const __m512bh wv = (__m512bh)int4_pair_bf16(lanes, p);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        int32_t pair;
        std::memcpy(&pair, x + r * ldx + k0 + 2 * p, sizeof pair);
        acc[r][p % A] = _mm512_dpbf16_ps(acc[r][p % A], wv, (__m512bh)_mm512_set1_epi32(pair));
      }
    }
  }
  static void fit(__m512& scale, __m512& offset) {
    scale = _mm512_mul_ps(scale, _mm512_set1_ps(16.f));
    offset = _mm512_sub_ps(offset, scale);
  }
};
#endif

// R rows of x against one block, its code lines read by Line: per group, the lines' products summed in
// float32, then scaled and offset into the rows' totals.
template <typename Line, typename TOut, int KIND, int R>
void pass(const Pass& a) {
  const QuantHeader& h = *a.h;
  const auto* x = static_cast<const typename Line::X*>(a.x);
  const uint8_t* codes = a.block + h.scale_bytes;
  __m512 tot[R];
  zero<R>(tot);
  for (int64_t g = 0; g < h.groups; ++g) {
    constexpr int A = kChains<R>;
    __m512 acc[R][A];
    zero<R * A>(acc[0]);
    for (int64_t k0 = g * h.group_size; k0 < (g + 1) * h.group_size; k0 += Line::kK) {
      const uint8_t* line = codes + k0 * (64 / Line::kK);
      prefetch_line(reinterpret_cast<const char*>(line) + kPrefetchBytes, Fetch::kReadL2);
      Line::template add<R, A>(line, x, a.ldx, k0, acc);
    }
    __m512 scale, offset;
    group_scales<KIND>(a.block, g, scale, offset);
    Line::fit(scale, offset);
    add_group<R, A>(tot, acc, scale, offset, a.xsum, h.groups, g,
                    Line::kOffsets || KIND != kScaleF16NoOffset);
  }
  store_rows<TOut, R>(a, tot);
}

using PassFn = void (*)(const Pass&);

template <typename Line, typename TOut, int KIND, int... R>
constexpr std::array<PassFn, sizeof...(R)> table(std::integer_sequence<int, R...>) {
  return {&pass<Line, TOut, KIND, R + 1>...};
}

// The passes of R = 1..kRows rows for a weight's bits and scales, with x of type TX and y of TOut.
template <typename TX, typename TOut, int KIND>
const PassFn* passes_of(int bits) {
  using Rows = std::make_integer_sequence<int, kRows>;
  static constexpr auto int4 = table<Int4F32, TOut, KIND>(Rows{});
  static constexpr auto int8 = table<Int8F32, TOut, KIND>(Rows{});
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<TX, c10::BFloat16>) {
    static constexpr auto int4_bf16 = table<Int4Bf16, TOut, KIND>(Rows{});
    if (bits == 4) return int4_bf16.data();
  }
#endif
  return bits == 4 ? int4.data() : int8.data();
}

#if defined(__AVX512BF16__)
// Block `block` of W as bf16 in pack_linear_weight's layout ([K / 2, 16, 2]: pairs of k), each weight
// scale * code + offset rounded once to bf16.
template <int BITS, int KIND>
void dequantize_block_bf16(const uint8_t* block, const QuantHeader& h, c10::BFloat16* out) {
  const __m512i low = _mm512_set1_epi32(0xFFFF);
  // The pair (even, odd) of 16 columns as one line of bf16 pairs.
  const auto store_pair = [&](int64_t pair, __m512 even, __m512 odd) {
    const __m512i e = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(even));
    const __m512i o = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(odd));
    _mm512_storeu_si512(out + pair * 2 * kBlock, _mm512_or_si512(e, _mm512_slli_epi32(o, 16)));
  };
  for (int64_t g = 0; g < h.groups; ++g) {
    __m512 scale, offset;
    group_scales<KIND>(block, g, scale, offset);
    const auto weight = [&](__m512i codes) {
      return _mm512_add_ps(_mm512_mul_ps(scale, _mm512_cvtepi32_ps(codes)), offset);
    };
    if constexpr (BITS == 4) {
      const uint8_t* codes = block + h.scale_bytes + g * h.group_size * 8;
      for (int64_t j = 0; j < h.group_size / 8; ++j) {
        const __m512i lanes = _mm512_loadu_si512(codes + j * 64);
#pragma GCC unroll 4
        for (int p = 0; p < 4; ++p) {
          const __m512i pair =
              _mm512_and_si512(_mm512_srli_epi32(lanes, 4 * p), _mm512_set1_epi32(0x000F000F));
          store_pair((g * h.group_size + 8 * j) / 2 + p, weight(_mm512_and_si512(pair, low)),
                     weight(_mm512_srli_epi32(pair, 16)));
        }
      }
    } else {
      const int8_t* codes = reinterpret_cast<const int8_t*>(block + h.scale_bytes);
      for (int64_t kk = g * h.group_size; kk < (g + 1) * h.group_size; kk += 2) {
        const auto line = [&](int64_t i) {
          return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + i * kBlock)));
        };
        store_pair(kk / 2, weight(line(kk)), weight(line(kk + 1)));
      }
    }
  }
}

using DequantizeFn = void (*)(const uint8_t*, const QuantHeader&, c10::BFloat16*);
DequantizeFn dequantize_fn(const QuantHeader& h) {
  static constexpr DequantizeFn fns[2][3] = {
      {&dequantize_block_bf16<4, 0>, &dequantize_block_bf16<4, 1>, &dequantize_block_bf16<4, 2>},
      {&dequantize_block_bf16<8, 0>, &dequantize_block_bf16<8, 1>, &dequantize_block_bf16<8, 2>}};
  return fns[h.bits == 8][h.scale_kind];
}

// Blocks of W a thread dequantizes at a time for the kernels' bf16 linear: in L2 while its rows pass.
constexpr int64_t kDequantBlocks = 4;

// bf16 x of many rows: each thread dequantizes its run of W, kDequantBlocks blocks at a time, into bf16 in
// pack_linear_weight's layout, and runs the kernels' bf16 linear on them (AMX tiles where the CPU has them),
// single-threaded inside this region: the codes are turned into weights once for all the rows rather than
// once for every kRows of them.
void linear_dequant_bf16(const c10::BFloat16* x, int64_t ldx, int64_t m, const uint8_t* packed,
                         const c10::BFloat16* bias, c10::BFloat16* y, int64_t ldy) {
  QuantHeader h;
  std::memcpy(&h, packed, sizeof h);
  const uint8_t* w = packed + kQuantHeaderBytes;
  const DequantizeFn dequantize = dequantize_fn(h);
  const int64_t blocks = (h.n + kBlock - 1) / kBlock, chunks = (blocks + kDequantBlocks - 1) / kDequantBlocks;
  const int threads = static_cast<int>(std::min<int64_t>(std::max(1, at::get_num_threads()), chunks));
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t c = 0; c < chunks; ++c) {
    thread_local std::vector<c10::BFloat16> buffer;
    buffer.resize(std::max<size_t>(buffer.size(), kDequantBlocks * kBlock * h.k));
    const int64_t b0 = c * kDequantBlocks, nb = std::min(kDequantBlocks, blocks - b0);
    for (int64_t b = 0; b < nb; ++b)
      dequantize(w + (b0 + b) * h.block_bytes, h, buffer.data() + b * kBlock * h.k);
    const int64_t cols = std::min(nb * kBlock, h.n - b0 * kBlock);
    linear_to(x, ldx, m, buffer.data(), h.k / 2, cols, bias == nullptr ? nullptr : bias + b0 * kBlock,
              y + b0 * kBlock, ldy);
  }
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512VBMI__)
// Many bf16 rows on AMX with the codes dequantized a tile at a time. Each thread takes its run of W's blocks
// two at a time, and for each pair walks K a tile (32 k) at a time: the tile's 32 k of both blocks are
// dequantized to bf16 (scale * code + offset, see dequantize_tile) into a W tile in L1
// and multiplied right away by the first two x tiles (rows 0-31) into four tiles of float32 sums. The W
// tiles stay in the thread's buffer, the blocks' whole K, for the x tiles after the first two (prompts): the
// codes are turned into weights once a call, x is read in place (the last x tile padded once a call), and the
// tile configuration is loaded once a thread.

constexpr int64_t kTileRows = 16;  // rows of an x tile and of a tile of sums
constexpr int64_t kTileK = 32;     // k of a tile: 16 pairs, a W tile's 16 lines of 64 bytes

// Tiles 0-3: sums (x tile r and block b in tile 2 r + b), 4-5: x, 6-7: W; all 16 rows of 64 bytes.
constexpr TileConfig kQuantTiles{{16, 64}, {16, 64}, {16, 64}, {16, 64},
                                 {16, 64}, {16, 64}, {16, 64}, {16, 64}};

// A group's scales and offsets for the two halves of a W tile line (pack_linear_weight's pairs: columns 0-7,
// then 8-15, each column's value twice, for its pair of k), fitted to how the codes are read (see
// dequantize_tile): int4 codes c as 1 + c / 16 (w = 16 scale (1 + c / 16) + offset - 16 scale), int8 codes
// as c 2^24.
struct LineScales {
  __m512 scale[2], offset[2];
};

template <int BITS, int KIND>
inline LineScales line_scales(const uint8_t* block, int64_t g) {
  __m512 scale, offset;
  group_scales<KIND>(block, g, scale, offset);
  if constexpr (BITS == 4) {
    Int4Bf16::fit(scale, offset);
  } else {
    scale = _mm512_mul_ps(scale, _mm512_set1_ps(0x1p-24f));
  }
  const __m512i low = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i high = _mm512_add_epi32(low, _mm512_set1_epi32(8));
  return {{_mm512_permutexvar_ps(low, scale), _mm512_permutexvar_ps(high, scale)},
          {_mm512_permutexvar_ps(low, offset), _mm512_permutexvar_ps(high, offset)}};
}

// One W tile line: the float32 codes of columns 0-7 (each k pair) and of 8-15, scaled and offset, as bf16.
inline void store_line(c10::BFloat16* out, __m512 low, __m512 high, const LineScales& s) {
  const __m512 a = _mm512_fmadd_ps(low, s.scale[0], s.offset[0]);
  const __m512 b = _mm512_fmadd_ps(high, s.scale[1], s.offset[1]);
  _mm512_storeu_si512(out, (__m512i)_mm512_cvtne2ps_pbh(b, a));
}

// The byte order that puts line pair q's codes of columns 8 h to 8 h + 7 (each k of the pair) in the top
// byte of 16 dwords: the int8 code c as the int32 c 2^24.
constexpr std::array<uint8_t, 64> int8_pair_order(int q, int h) {
  std::array<uint8_t, 64> order{};
  for (int i = 0; i < 16; ++i)
    order[4 * i + 3] = static_cast<uint8_t>((2 * q + i % 2) * kBlock + 8 * h + i / 2);
  return order;
}

// W tile kt (k from kTileK kt) of a block into out (16 lines of 64 bytes), each weight scale * code + offset
// in float32, then rounded to bf16: int8 codes in one fused multiply-add (one rounding, as
// dequantize_block_bf16), int4 codes as 16 scale (1 + c/16) + (offset - 16 scale), whose offset term is
// rounded once more first (within a float32 rounding of dequantize_block_bf16's, before the bf16 one).
template <int BITS, int KIND>
inline void dequantize_tile(const uint8_t* block, const QuantHeader& h, int64_t kt, c10::BFloat16* out) {
  const uint8_t* codes = block + h.scale_bytes;
  LineScales s;
  if constexpr (BITS == 4) {
    // A line of 8 k: its dwords (columns) reordered so that a pair's 16-bit codes unpack to columns 0-7
    // (low) and 8-15 (high), each code placed as the bf16 1 + c / 16 (see Int4Bf16), then widened.
    const __m512i order = _mm512_set_epi32(15, 14, 7, 6, 13, 12, 5, 4, 11, 10, 3, 2, 9, 8, 1, 0);
    const __m512i zero = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int64_t j = 0; j < kTileK / 8; ++j) {
      const int64_t k = kt * kTileK + 8 * j;
      if (j == 0 || k % h.group_size == 0) s = line_scales<BITS, KIND>(block, k / h.group_size);
      const __m512i lanes = _mm512_permutexvar_epi32(order, _mm512_loadu_si512(codes + k * 8));
#pragma GCC unroll 4
      for (int p = 0; p < 4; ++p) {
        const __m512i wv = int4_pair_bf16(lanes, p);
        store_line(out + (4 * j + p) * 2 * kBlock, _mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, wv)),
                   _mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, wv)), s);
      }
    }
  } else {
    // A line of 4 k (two pairs): each pair's codes of columns 0-7 and of 8-15 moved to the top bytes.
    static constexpr std::array<std::array<uint8_t, 64>, 4> orders{
        int8_pair_order(0, 0), int8_pair_order(0, 1), int8_pair_order(1, 0), int8_pair_order(1, 1)};
    constexpr __mmask64 top = 0x8888888888888888ull;
#pragma GCC unroll 8
    for (int64_t j = 0; j < kTileK / 4; ++j) {
      const int64_t k = kt * kTileK + 4 * j;
      if (j == 0 || k % h.group_size == 0) s = line_scales<BITS, KIND>(block, k / h.group_size);
      const __m512i line = _mm512_loadu_si512(codes + k * kBlock);
#pragma GCC unroll 2
      for (int q = 0; q < 2; ++q) {
        const auto half = [&](int hh) {
          const __m512i order = _mm512_loadu_si512(orders[2 * q + hh].data());
          return _mm512_cvtepi32_ps(_mm512_maskz_permutexvar_epi8(top, order, line));
        };
        store_line(out + (2 * j + q) * 2 * kBlock, half(0), half(1), s);
      }
    }
  }
}

// One tile step: RT x tiles (a0, a1; rows sa0, sa1 bytes apart) by BT W tiles (w0, w1) into the sums.
template <int RT, int BT>
inline void tile_step(const c10::BFloat16* a0, int64_t sa0, const c10::BFloat16* a1, int64_t sa1,
                      const c10::BFloat16* w0, const c10::BFloat16* w1) {
  _tile_loadd(4, a0, sa0);
  if constexpr (RT > 1) _tile_loadd(5, a1, sa1);
  _tile_loadd(6, w0, 2 * kBlock * 2);
  if constexpr (BT > 1) _tile_loadd(7, w1, 2 * kBlock * 2);
  _tile_dpbf16ps(0, 4, 6);
  if constexpr (BT > 1) _tile_dpbf16ps(1, 4, 7);
  if constexpr (RT > 1) _tile_dpbf16ps(2, 5, 6);
  if constexpr (RT > 1 && BT > 1) _tile_dpbf16ps(3, 5, 7);
}

// The x tiles of a call: tile i is x's rows 16 i to 16 i + 15 in place, but the last where m is not a
// multiple of 16, which is `pad` (those rows, then zeros).
struct XTiles {
  const c10::BFloat16* x;
  int64_t ldx, m, k;
  const c10::BFloat16* pad;
  int64_t count() const { return (m + kTileRows - 1) / kTileRows; }
  int64_t rows(int64_t i) const { return std::min(kTileRows, m - i * kTileRows); }
  const c10::BFloat16* at(int64_t i, int64_t kt) const {
    return (rows(i) < kTileRows ? pad : x + i * kTileRows * ldx) + kt * kTileK;
  }
  int64_t stride(int64_t i) const { return (rows(i) < kTileRows ? k : ldx) * 2; }
};

// x tiles i (and i + 1 when RT is 2) by blocks j (and j + 1 when BT is 2) over all K, into y. With
// `dequantize`, each W tile is dequantized into buf (block b's at buf + b * 16 K) first; else it is there.
template <int BITS, int KIND, int RT, int BT>
void tile_rows(const XTiles& xt, int64_t i, const uint8_t* w, const QuantHeader& h, int64_t j,
               bool dequantize, c10::BFloat16* buf, float* sums, const c10::BFloat16* bias, c10::BFloat16* y,
               int64_t ldy) {
  _tile_zero(0);
  if constexpr (BT > 1) _tile_zero(1);
  if constexpr (RT > 1) _tile_zero(2);
  if constexpr (RT > 1 && BT > 1) _tile_zero(3);
  const int64_t a1 = RT > 1 ? i + 1 : i, tiles = h.k / kTileK;
  // W tile kt of both blocks into the buffer
  const auto dequantize_tiles = [&](int64_t kt) {
    dequantize_tile<BITS, KIND>(w + j * h.block_bytes, h, kt, buf + kt * kTileK * kBlock);
    if constexpr (BT > 1)
      dequantize_tile<BITS, KIND>(w + (j + 1) * h.block_bytes, h, kt, buf + (h.k + kt * kTileK) * kBlock);
  };
  // Dequantizing tile kt + 1 before multiplying tile kt keeps the tile loads off the stores just made.
  if (dequantize) dequantize_tiles(0);
  for (int64_t kt = 0; kt < tiles; ++kt) {
    if (dequantize && kt + 1 < tiles) dequantize_tiles(kt + 1);
    const c10::BFloat16* w0 = buf + kt * kTileK * kBlock;
    tile_step<RT, BT>(xt.at(i, kt), xt.stride(i), xt.at(a1, kt), xt.stride(a1), w0, w0 + h.k * kBlock);
  }
  constexpr int64_t kTile = kTileRows * kBlock;
  _tile_stored(0, sums, kBlock * 4);
  if constexpr (BT > 1) _tile_stored(1, sums + kTile, kBlock * 4);
  if constexpr (RT > 1) _tile_stored(2, sums + 2 * kTile, kBlock * 4);
  if constexpr (RT > 1 && BT > 1) _tile_stored(3, sums + 3 * kTile, kBlock * 4);
  for (int rt = 0; rt < RT; ++rt)
    for (int bt = 0; bt < BT; ++bt) {
      const __mmask16 cols = block_cols(h.n, j + bt);
      const __m512 b = bias_block(bias, j + bt, cols);
      const float* c = sums + (2 * rt + bt) * kTile;
      c10::BFloat16* out = y + (i + rt) * kTileRows * ldy + (j + bt) * kBlock;
      for (int64_t r = 0; r < xt.rows(i + rt); ++r)
        _mm256_mask_storeu_epi16(
            out + r * ldy, cols,
            (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(_mm512_loadu_ps(c + r * kBlock), b)));
    }
}

template <int BITS, int KIND>
void linear_quant_amx(const c10::BFloat16* x, int64_t ldx, int64_t m, const uint8_t* packed,
                      const c10::BFloat16* bias, c10::BFloat16* y, int64_t ldy) {
  QuantHeader h;
  std::memcpy(&h, packed, sizeof h);
  const uint8_t* w = packed + kQuantHeaderBytes;
  std::vector<c10::BFloat16> pad;
  if (m % kTileRows != 0) {
    const int64_t first = m / kTileRows * kTileRows;
    pad.assign(kTileRows * h.k, c10::BFloat16(0.f));
    for (int64_t r = first; r < m; ++r)
      std::memcpy(pad.data() + (r - first) * h.k, x + r * ldx, h.k * sizeof(c10::BFloat16));
  }
  const XTiles xt{x, ldx, m, h.k, pad.data()};
  const int64_t blocks = (h.n + kBlock - 1) / kBlock, pairs = (blocks + 1) / 2;
  const int threads = static_cast<int>(std::min<int64_t>(std::max(1, at::get_num_threads()), pairs));
#pragma omp parallel num_threads(threads)
  {
    _tile_loadconfig(&kQuantTiles);
    thread_local std::vector<c10::BFloat16> buf;
    buf.resize(std::max<size_t>(buf.size(), 2 * kBlock * h.k));
    alignas(64) float sums[4 * kTileRows * kBlock];
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    for (int64_t u = pairs * t / nt; u < pairs * (t + 1) / nt; ++u) {
      const int64_t j = 2 * u;
      const bool two_blocks = j + 1 < blocks;
      for (int64_t i = 0; i < xt.count(); i += 2) {
        const bool two_rows = i + 1 < xt.count();
        const auto run = [&](auto fn) { fn(xt, i, w, h, j, i == 0, buf.data(), sums, bias, y, ldy); };
        if (two_rows && two_blocks)
          run(tile_rows<BITS, KIND, 2, 2>);
        else if (two_rows)
          run(tile_rows<BITS, KIND, 2, 1>);
        else if (two_blocks)
          run(tile_rows<BITS, KIND, 1, 2>);
        else
          run(tile_rows<BITS, KIND, 1, 1>);
      }
    }
    _tile_release();
  }
}

using LinearQuantFn = void (*)(const c10::BFloat16*, int64_t, int64_t, const uint8_t*, const c10::BFloat16*,
                               c10::BFloat16*, int64_t);

// The AMX kernel for the weight, or null where it cannot take it (no AMX now, K not a multiple of 32).
LinearQuantFn amx_fn(const QuantHeader& h) {
  static constexpr LinearQuantFn fns[2][3] = {
      {&linear_quant_amx<4, 0>, &linear_quant_amx<4, 1>, &linear_quant_amx<4, 2>},
      {&linear_quant_amx<8, 0>, &linear_quant_amx<8, 1>, &linear_quant_amx<8, 2>}};
  return h.k % kTileK == 0 && amx_enabled() ? fns[h.bits == 8][h.scale_kind] : nullptr;
}
#else
using LinearQuantFn = void (*)(const c10::BFloat16*, int64_t, int64_t, const uint8_t*, const c10::BFloat16*,
                               c10::BFloat16*, int64_t);
LinearQuantFn amx_fn(const QuantHeader&) { return nullptr; }
#endif

bool use_dequant(int64_t m, const QuantHeader& h) {
  const int64_t rows = dequant_min_rows.load(std::memory_order_relaxed);
  return rows >= 0 && m >= rows && h.k % 2 == 0;
}

#endif

template <typename T>
void linear_quant_impl(const T* x, int64_t ldx, int64_t m, const uint8_t* packed, const T* bias, T* y,
                       int64_t ldy) {
  if (m == 0) return;
  QuantHeader h;
  std::memcpy(&h, packed, sizeof h);
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (use_dequant(m, h)) {
      if (const LinearQuantFn amx = amx_fn(h)) return amx(x, ldx, m, packed, bias, y, ldy);
      return linear_dequant_bf16(x, ldx, m, packed, bias, y, ldy);
    }
  }
#endif
  const uint8_t* w = packed + kQuantHeaderBytes;
  const int64_t k = h.k, groups = h.groups;
  // The bf16 pairs path reads x as it is; the float32 paths read float32 x (bf16 widened once here).
  bool pairs = false;
#if defined(__AVX512BF16__)
  pairs = std::is_same_v<T, c10::BFloat16> && h.bits == 4;
#endif
  std::vector<float> widened;
  const float* xf = nullptr;
  int64_t ldxf = ldx;
  if constexpr (std::is_same_v<T, float>) {
    xf = x;
  } else if (!pairs) {
    widened.resize(m * k);
    for (int64_t r = 0; r < m; ++r)
      for (int64_t i = 0; i < k; ++i) widened[r * k + i] = static_cast<float>(x[r * ldx + i]);
    xf = widened.data();
    ldxf = k;
  }
  // Each row's sum of x over each group (the offsets' products), 16 k at a time.
  std::vector<float> xsum(m * groups);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      const T* p = x + r * ldx + g * h.group_size;
      vec::Vec sum = vec::zero();
      int64_t i = 0;
      for (; i + vec::kLanes <= h.group_size; i += vec::kLanes) sum = vec::add(sum, vec::load(p + i));
      if (i < h.group_size) sum = vec::add(sum, vec::load_n(p + i, h.group_size - i));
      xsum[r * groups + g] = vec::reduce_add(sum);
    }
  const PassFn* fns = h.scale_kind == kScaleF32   ? passes_of<T, T, kScaleF32>(h.bits)
                      : h.scale_kind == kScaleF16 ? passes_of<T, T, kScaleF16>(h.bits)
                                                  : passes_of<T, T, kScaleF16NoOffset>(h.bits);
  const int64_t blocks = (h.n + kBlock - 1) / kBlock;
  const int threads = static_cast<int>(std::min<int64_t>(std::max(1, at::get_num_threads()), blocks));
  // Block b for all rows, kRows at a time (balanced): the block stays in L1 or L2 for the passes after the
  // first.
  const auto block = [&](int64_t b) {
    const int64_t passes = (m + kRows - 1) / kRows;
    for (int64_t i = 0; i < passes; ++i) {
      const int64_t r0 = m * i / passes, rows = m * (i + 1) / passes - r0;
      Pass a;
      a.block = w + b * h.block_bytes;
      a.h = &h;
      a.x = pairs ? static_cast<const void*>(x + r0 * ldx) : static_cast<const void*>(xf + r0 * ldxf);
      a.ldx = pairs ? ldx : ldxf;
      a.xsum = xsum.data() + r0 * groups;
      a.bias = bias == nullptr ? nullptr : bias + b * kBlock;
      a.y = y + r0 * ldy + b * kBlock;
      a.ldy = ldy;
      a.cols = std::min<int64_t>(kBlock, h.n - b * kBlock);
      fns[rows - 1](a);
    }
  };
  BlockRuns runs(blocks, threads, 1);
#pragma omp parallel num_threads(threads)
  runs.work(omp_get_thread_num(), [&](int r, int64_t u, int64_t) {
    int64_t first, parts;
    runs.parts_of(r, u, first, parts);
    block(first);
  });
}

}  // namespace

void linear_quant_to(const float* x, int64_t ldx, int64_t m, const uint8_t* packed, const float* bias,
                     float* y, int64_t ldy) {
  linear_quant_impl(x, ldx, m, packed, bias, y, ldy);
}
void linear_quant_to(const c10::BFloat16* x, int64_t ldx, int64_t m, const uint8_t* packed,
                     const c10::BFloat16* bias, c10::BFloat16* y, int64_t ldy) {
  linear_quant_impl(x, ldx, m, packed, bias, y, ldy);
}

bool has_linear_quant() { return true; }

#else

void linear_quant_to(const float*, int64_t, int64_t, const uint8_t*, const float*, float*, int64_t) {
  TORCH_CHECK(false, "this build has no quantized linear: it needs AVX-512 (see has_linear_quant)");
}
void linear_quant_to(const c10::BFloat16*, int64_t, int64_t, const uint8_t*, const c10::BFloat16*,
                     c10::BFloat16*, int64_t) {
  TORCH_CHECK(false, "this build has no quantized linear: it needs AVX-512 (see has_linear_quant)");
}
bool has_linear_quant() { return false; }

#endif

int64_t set_quant_dequant_min_rows(int64_t rows) {
  return dequant_min_rows.exchange(rows == kQuantDequantDefault ? kQuantDequantRows : rows);
}
int64_t quant_dequant_min_rows() { return dequant_min_rows.load(); }

at::Tensor linear_quant(const at::Tensor& x, const at::Tensor& packed,
                        const c10::optional<at::Tensor>& bias) {
  const QuantHeader h = quant_header(packed, "");
  TORCH_CHECK((x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) && x.dim() >= 1,
              "x must be float32 or bf16 [..., K]");
  TORCH_CHECK(x.size(-1) == h.k, "x has K = ", x.size(-1), ", the quantized weight ", h.k);
  const bool f32 = x.scalar_type() == at::kFloat;
  check_linear_bias(bias, h.n, "", f32);
  at::Tensor x2 = x.reshape({-1, h.k});
  if (x2.stride(-1) != 1) x2 = x2.contiguous();
  const int64_t m = x2.size(0);
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = h.n;
  at::Tensor y = at::empty({m, h.n}, x.options());
  const uint8_t* w = packed.const_data_ptr<uint8_t>();
  if (f32)
    linear_quant_to(x2.const_data_ptr<float>(), x2.stride(0), m, w,
                    bias.has_value() ? bias->const_data_ptr<float>() : nullptr, y.mutable_data_ptr<float>(),
                    h.n);
  else
    linear_quant_to(x2.const_data_ptr<c10::BFloat16>(), x2.stride(0), m, w,
                    bias.has_value() ? bias->const_data_ptr<c10::BFloat16>() : nullptr,
                    y.mutable_data_ptr<c10::BFloat16>(), h.n);
  return y.view(out_shape);
}

}  // namespace pagedserve::cpu
