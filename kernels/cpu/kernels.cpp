// CPU kernels: paged attention straight from the block tables, the small per-layer ops of a decoder
// fused into one pass each (RMSNorm with its residual add, RoPE with the KV cache write, SiLU with its
// product), a bf16 linear layer (AVX-512 BF16, or AVX2 with FMA), the sampler's argmax, and DecoderStack,
// which runs all layers of a step in one call.
//
// Same contracts as kernels/reference.py (see there and proto/worker.proto). Every kernel reads bf16,
// fp16 or fp32 and computes in float32; the pointwise ones round to the tensor dtype exactly where the
// PyTorch formulas in reference.py round, so in bf16 they agree bit for bit with them except for the
// order of the sums inside RMSNorm and attention.
//
// Built once per machine by kernels/cpu_ops.py (torch.utils.cpp_extension, with -march=native), with the
// Python bindings of kernels/cpu_bindings.cpp.

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <omp.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <mutex>
#include <type_traits>
#include <utility>
#include <vector>

#include "amx.h"
#include "attention.h"
#include "common.h"
#include "ops.h"
#include "pointwise.h"
#include "prefetch.h"
#include "vec.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__x86_64__)
#include <cpuid.h>
#endif
#if defined(__AMX_TILE__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

// NOTE: where the build targets AVX-512 (-march=native on such a CPU), the inner loops of attention
// (dot products, exp, the softmax sums, the weighted sum of V rows) are written with its intrinsics. GCC
// vectorises the plain loops but ends every reduction with sixteen dependent scalar adds (the order it
// must keep) and leaves the exp polynomial scalar, which together cost more than everything else in
// attention. The plain loops are the portable definition.

namespace {

#if defined(__AVX2__)
// 8 bf16 or float values, widened to float32.
inline __m256 load8(const at::BFloat16* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
#endif

using pagedserve::cpu::AttentionPlan;
using pagedserve::cpu::check_cache;
using pagedserve::cpu::dot;
using pagedserve::cpu::Fetch;
using pagedserve::cpu::FetchShare;
using pagedserve::cpu::is_cache_layout;
using pagedserve::cpu::load_row;
using pagedserve::cpu::plan_attention;
using pagedserve::cpu::prefetch;
using pagedserve::cpu::prefetch_l2;
using pagedserve::cpu::prefetch_line;
using pagedserve::cpu::prefetch_lines;
using pagedserve::cpu::prefetch_write;
using pagedserve::cpu::reads_ahead_into_l2;
using pagedserve::cpu::rms_norm;
using pagedserve::cpu::rms_norm_rows;
using pagedserve::cpu::rotary_write_kv_rows;
using pagedserve::cpu::run_attention;
using pagedserve::cpu::silu_mul;
using pagedserve::cpu::silu_mul_rows;
using pagedserve::cpu::with_dtype;
using pagedserve::cpu::vec::kExpMax;
using pagedserve::cpu::vec::kExpMin;
using pagedserve::cpu::vec::kExpPoly;
using pagedserve::cpu::vec::kLn2Hi;
using pagedserve::cpu::vec::kLn2Lo;
using pagedserve::cpu::vec::kLog2e;

#if defined(__AVX512F__)
__attribute__((always_inline)) inline __m512 exp512(__m512 in) { return pagedserve::cpu::vec::exp(in); }
#endif

#if defined(__AVX2__) && defined(__FMA__)
// exp512 on AVX2: the same reduction and polynomial; 2^k is built in the exponent bits (k is -126 .. 127
// after the clamp).
inline __m256 exp256(__m256 in) {
  const __m256 lo = _mm256_set1_ps(kExpMin), hi = _mm256_set1_ps(kExpMax);
  const __m256 v = _mm256_min_ps(_mm256_max_ps(in, lo), hi);
  const __m256 k = _mm256_round_ps(_mm256_mul_ps(v, _mm256_set1_ps(kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(kLn2Hi), v);
  r = _mm256_fmadd_ps(k, _mm256_set1_ps(kLn2Lo), r);
  __m256 p = _mm256_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpPoly[i]));
  p = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.f));
  const __m256i scale =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
  const __m256 e = _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
  return _mm256_and_ps(e, _mm256_cmp_ps(in, lo, _CMP_NLT_UQ));  // 0 below kExpMin
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
inline void store8_bf16(at::BFloat16* p, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), to_bf16_avx2(v));
}
inline __m256 round_bf16_avx2(__m256 v) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(to_bf16_avx2(v)), 16));
}

// silu(g) = g / (1 + exp(-g)), 8 at a time.
inline __m256 silu256(__m256 g) {
  return _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), exp256(_mm256_sub_ps(_mm256_setzero_ps(), g))));
}

#endif

inline void exp_inplace(float* x, int64_t n) {
  namespace vec = pagedserve::cpu::vec;
  int64_t i = 0;
  for (; i < vec::whole(n); i += vec::kLanes) vec::store(x + i, vec::exp(vec::load(x + i)));
  if (i < n) vec::store_n(x + i, vec::exp(vec::load_n(x + i, n - i)), n - i);
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
using pagedserve::cpu::amx_enabled;
using pagedserve::cpu::TileConfig;
#endif

// ---- linear layers ----------------------------------------------------------------------------------------
//
// y = x @ W^T with x [M, K], W [N, K] (nn.Linear's layout), all bf16, products summed in float32
// (vdpbf16ps, AVX-512 BF16). It serves every batch size (see model.PackedLinear for the numbers against
// oneDNN). In decode M is 1 to a few dozen rows, so a linear layer is bound by streaming W from memory
// once, not by arithmetic; oneDNN's packed bf16 linear streams about 20 GB/s of
// the ~30 this 2-core machine reads at M = 1 and costs about 14 us per call before it reads anything
// (here about 3.5 us). W is read exactly once, as one sequential stream per thread, while every row of x
// stays in L1 and is broadcast from there.
//
// Layout (pack_linear_weight): W is packed once into blocks of 16 output columns. Inside a block, K is
// walked in pairs, and pair p of the block's 16 rows is one 64-byte line: [n0 k2p, n0 k2p+1, n1 k2p, ...].
// vdpbf16ps multiplies such a line by one pair of x broadcast to all 16 lanes (one 32-bit broadcast folded
// into the instruction's memory operand) and adds into 16 float32 sums, one per output column: one load
// of W feeds 16 outputs of each of the M rows. Blocks follow each other in memory, so a thread's share
// of the blocks is one contiguous stream. N is padded to a multiple of 16 and K to a multiple of 2.

constexpr int64_t kBlock = 16;  // output columns per block: one zmm of float32 sums
// Rows of x computed against one pass over a W block: their sums and the W line stay in the 32 zmm
// registers (the x pairs take none: see dot_pair). More rows are split into balanced chunks, each
// rereading the block from L1/L2. Against passes of at most 16 rows, whole decode steps of 17-28 rows
// took 0.92-0.98 of the time, 40-64 rows 0.98-1.0 (context 300, alternating builds); single calls with
// the weights in cache were even, and the LM head, streamed from memory, took 0.86-0.98 of the time.
constexpr int kMaxRows = 30;
// How far ahead of the line being read W is prefetched, into L2. Without it two threads stream about
// 26 GB/s at M = 1 (bench.py, gate_up); 4 KB ahead gives 29-31 GB/s, about what a bare read loop reaches
// on this machine. Nearer distances, or prefetching into L1, do less. The prefetches run up to 4 KB (8 KB
// in block_kernel, below) past the end of the packed weight, which is harmless (a prefetch never faults).
constexpr int64_t kPrefetchBytes = 4096;
// block_kernel (the passes of 9 rows and more on AVX-512 BF16) prefetches 8 KB ahead: on a 2-core Zen 5
// EPYC, whose dot products run at twice the rate of Zen 4's, its passes wait on memory more than on the
// dot products. Whole decode steps at 300 positions, alternating step by step: 12 rows 0.94-0.97 of the
// time, 16 rows 0.96-0.97, 32 rows 0.94-0.97 (2 KB: 1.03-1.07; 12 and 16 KB: 0.96-1.03); the linears of
// 8 layers at 256-2048 rows 0.95-0.97.
constexpr int64_t kBlockPrefetchBytes = 8192;
// Four streams a thread prefetch 1 KB ahead each. The 120 linear layers of a single-sequence step alone,
// against 4 KB ahead: faster in 75 of 80 rounds (30.8 against 29.3 GB/s on average; 39.9 against 35.4
// in the rounds where a plain read loop reached 40 GB/s or more); whole decode steps of 1 and 4
// sequences 0.92-0.997 of the time (2 KB: 0.97-1.0, 512 bytes: 0.985-1.06, none: 0.99-1.0). Two
// streams keep 4 KB: with 8 rows, 1 KB ahead or none made a step 1.15-1.23x as long.
// A single row prefetches nothing: the hardware's own prefetchers keep four streams fed, and its loads
// then issue sooner. A 2-core Zen 5 EPYC whose plain read (a sum) ran at 42-75 GB/s, single-sequence decode
// steps alternating step by step: at 512 and 2048 positions 0.93-0.97x as long where the copy ran at 60-66
// GB/s, 0.99-1.01x where it ran at 37-40; forward passes at 64 positions, sorted by the sum's rate just
// before each, 5.09 -> 4.73 ms where it read 55 GB/s or more (both with the threads sharing their runs,
// which alone changed nothing). With 4 rows, none made a step 1.03x as long. Into L1 (prefetcht0) rather
// than L2 on the Zen 5, alternating step by step at 400 positions: 2 sequences 0.98x as long, 4 0.97x, 8
// (two streams) even; block_kernel's prefetches the same at 16 sequences, and they stay in L2.
// That is the Zen 5's way (see reads_ahead_into_l2); elsewhere the streams prefetch into L2, a single row
// too.
constexpr int64_t kFourStreamPrefetchBytes = 1024;

// block_kernel_streams' kL2: W prefetched into L2 only (prefetcht1) rather than into L1 (prefetcht0), a
// single row as its four streams do (1 KB ahead) rather than not at all (see reads_ahead_into_l2). On a
// 2-core Zen 4 (family 25), whole decode steps, bench_worker's plans, alternating step by step in one
// process: 2 sequences at 1024 positions 0.93x as long, 3 / 4 / 6 / 8 at 512 0.95x / 0.94x / 0.93x / 0.88x,
// one at 512 and at 2048 positions 0.97x and 0.99x (in two more runs 0.94-0.96x), 16 at 512 (block_kernel,
// untouched) 0.995x; again, the two paths as built here: 2 / 4 / 8 at 512 positions 0.88x / 0.85x / 0.80x,
// one at 512 and 2048 0.98x and 1.0x, 16 1.0x. One row into L1 instead, 1 KB ahead, 1.02x. Into L2, nearer
// and further: one row 512 bytes ahead 0.96-0.97x, 2 KB 0.97-0.99x; 2-4 rows 512 bytes 0.89-0.93x, 2 KB
// 0.88-0.93x, against 0.89-0.93x at 1 KB; 6 and 8 rows 2 KB 0.91-0.92x, 8 KB 0.84-0.90x, against 0.83-0.90x
// at 4 KB.

// The blocks (or slots of blocks) of W shared out among `threads` threads as runs, thread t's run being slots
// slots * t / threads .. slots * (t + 1) / threads - 1: one sequential stream of W a thread. A run is taken
// in units: with `streams` > 1 first steps over its `streams` parts side by side (step u reading block u of
// each part, see rows_streams_avx2), then the blocks the parts leave over, one at a time. A thread takes its
// own run's units from the front, then the last units of the others' runs, back to front, so that a thread
// slowed down (the cores being shared) is helped rather than waited for: with equal runs alone, one of the
// two threads of a 2-core Zen 3 waited 10-25 % of a decode-shaped call. The 30 layers' bf16 linears and the
// LM head, weights from memory, alternating rounds: 8 rows 19.9 -> 17.2 ms, 24 rows 56.3 -> 53.4 ms, 1 row
// 9.96 -> 9.69 ms. Two threads sharing one run from its two ends, one of them reading it back to front from
// the start, ran 2-5 % slower at 5-12 rows in a quiet moment: a run read back to front streams worse.
class BlockRuns {
 public:
  BlockRuns(int64_t slots, int threads, int64_t streams)
      : slots_(slots), threads_(threads), streams_(streams), runs_(new Run[threads]) {
    for (int r = 0; r < threads; ++r) {
      int64_t first, units, steps;
      run_of(r, first, units, steps);
      runs_[r].left = static_cast<uint64_t>(units);
    }
  }

  // Unit u of run r: true for a step, with its first slot and the parts' size (the step reads slots first +
  // s * parts, s < streams); false for a slot taken alone, first.
  bool parts_of(int r, int64_t u, int64_t& first, int64_t& parts) const {
    int64_t units;
    run_of(r, first, units, parts);
    if (u < parts && streams_ > 1) {
      first += u;
      return true;
    }
    first += parts * (streams_ - 1) + u;
    return false;
  }

  // Thread t's share: f(r, u, dir) for each unit u of run r it takes, dir 1 for its own run (front to back),
  // -1 for the others' (back to front); all the runs where OpenMP gave fewer threads than asked.
  template <typename F>
  void work(int t, F&& f) {
    for (int64_t u; (u = claim(t, true)) >= 0;) f(t, u, 1);
    for (int o = 1; o < threads_; ++o)
      for (int64_t u; (u = claim((t + o) % threads_, false)) >= 0;) f((t + o) % threads_, u, -1);
  }

 private:
  struct alignas(64) Run {       // a cache line each: its thread takes it for itself with every unit
    std::atomic<uint64_t> left;  // the units not yet taken, [first, end) as first << 32 | end
  };

  // Run r's first slot, its units (steps and slots left over), and the steps.
  void run_of(int r, int64_t& first, int64_t& units, int64_t& steps) const {
    first = slots_ * r / threads_;
    const int64_t size = slots_ * (r + 1) / threads_ - first;
    steps = size / streams_;
    units = steps + size - steps * streams_;
  }

  // A unit of run r from the front or the back, or -1 when none is left.
  int64_t claim(int r, bool front) {
    uint64_t v = runs_[r].left.load(std::memory_order_relaxed);
    for (;;) {
      const uint64_t first = v >> 32, end = v & 0xFFFFFFFFu;
      if (first >= end) return -1;
      const uint64_t next = front ? (first + 1) << 32 | end : first << 32 | (end - 1);
      if (runs_[r].left.compare_exchange_weak(v, next, std::memory_order_relaxed))
        return static_cast<int64_t>(front ? first : end - 1);
    }
  }

  const int64_t slots_;
  const int threads_;
  const int64_t streams_;
  std::unique_ptr<Run[]> runs_;
};

#if defined(__AVX512BF16__)

// silu(gate) * up for 16 bf16 values, rounded as silu_mul_rows rounds.
inline void silu_mul16(at::BFloat16* out, const at::BFloat16* gate, const at::BFloat16* up) {
  namespace vec = pagedserve::cpu::vec;
  vec::store(out, pagedserve::cpu::silu_mul<at::BFloat16>(vec::load(gate), vec::load(up)));
}

// acc + w . (the pair of x at p, broadcast to all 16 lanes): one vdpbf16ps, the pair its {1to16} memory
// operand, so the load unit broadcasts it. NOTE: written in asm because GCC does not fold the broadcast
// into vdpbf16ps: from _mm512_set1_epi32 it emits a vpbroadcastd of its own, which on this 2-core Zen 4
// EPYC takes a vector pipe next to the dot products. Folded, in whole decode steps (context 300,
// alternating builds): 12 rows 0.926 of the time, 16 rows 0.883, 28 rows 0.903, 32-64 rows 0.97-0.99;
// single linears with the weights in cache: 9-31 rows 0.80-0.95, 48-1024 rows about 0.96. Folded, one
// block at a time (see kMaxRows) is also as fast as the kernel over pairs of blocks that served 32 rows
// and more before, whose one broadcast fed two products: whole decode steps of 32-96 rows took
// 0.95-0.99 of the time without it.
using AliasedPair = int32_t __attribute__((may_alias));
inline __m512 dot_pair(__m512 acc, __m512bh w, const at::BFloat16* p) {
  asm("vdpbf16ps %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*reinterpret_cast<const AliasedPair*>(p)));
  return acc;
}

// One block of 16 output columns for ROWS rows of x. U independent sets of sums over interleaved K pairs
// hide the latency of vdpbf16ps when ROWS alone gives too few independent chains (fewer than 8 rows).
// NOTE: the `GCC unroll` pragmas keep every sum in a register: past 16 iterations GCC stops unrolling the
// row loops on its own, and acc[] then lives on the stack (twice as slow at 20 rows).
template <int ROWS, int U>
void block_kernel(const at::BFloat16* w, const at::BFloat16* x, int64_t ldx, int64_t pairs, const __m512 bias,
                  at::BFloat16* y, int64_t ldy, __mmask16 cols) {
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

using BlockFn = void (*)(const at::BFloat16*, const at::BFloat16*, int64_t, int64_t, __m512, at::BFloat16*,
                         int64_t, __mmask16);

// About eight independent chains of sums in flight: vdpbf16ps has a latency of several cycles and the
// loop issues about one per cycle.
template <int ROWS>
constexpr int unroll() {
  return ROWS >= 8 ? 1 : (8 + ROWS - 1) / ROWS;
}

template <int... R>
constexpr auto make_table(std::integer_sequence<int, R...>) {
  return std::array<BlockFn, sizeof...(R)>{&block_kernel<R + 1, unroll<R + 1>()>...};
}
constexpr auto kKernels = make_table(std::make_integer_sequence<int, kMaxRows>{});

// block_kernel for S blocks at once, `step` blocks apart in W and in y: S streams from memory.
// A core reads faster from several sequential streams than from one (2 threads, plain read loop over
// 512 MB: one stream a thread 32.7 GB/s, two 34.3, four 36.2, eight 35.7, six rounds each), which counts
// where rows are few and the weights' stream sets the time. U sets of sums per block, as in block_kernel.
// kL2: W prefetched into L2, a single row too (see reads_ahead_into_l2).
template <int S, int ROWS, int U, bool kL2>
void block_kernel_streams(const at::BFloat16* w, int64_t step, const at::BFloat16* x, int64_t ldx,
                          int64_t pairs, const __m512* bias, at::BFloat16* y, int64_t ldy,
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
        const at::BFloat16* line = w + s * w_step + (p + u) * 2 * kBlock;
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

using StreamsFn = void (*)(const at::BFloat16*, int64_t, const at::BFloat16*, int64_t, int64_t, const __m512*,
                           at::BFloat16*, int64_t, const __mmask16*);
// Rows up to which a thread streams its blocks as four streams, and as two (block_kernel_streams); more
// rows are bound by the dot products rather than by memory. Whole decode steps, alternating in one process:
// two streams for 5-8 rows took 0.96-0.99 of the time of one (8 rows 0.956-0.968 in three runs), for 10
// and 12 rows 0.97-1.05.
constexpr int kFourStreamRows = 4;
constexpr int kTwoStreamRows = 8;
// About eight independent chains of sums per step, as unroll() for block_kernel.
template <int S, bool kL2, int... R>
constexpr auto make_streams_table(std::integer_sequence<int, R...>) {
  return std::array<StreamsFn, sizeof...(R)>{
      &block_kernel_streams<S, R + 1, (8 + S * (R + 1) - 1) / (S * (R + 1)), kL2>...};
}
// Indexed by reads_ahead_into_l2(), then by rows - 1.
constexpr std::array kStreams4 = {
    make_streams_table<4, false>(std::make_integer_sequence<int, kFourStreamRows>{}),
    make_streams_table<4, true>(std::make_integer_sequence<int, kFourStreamRows>{})};
constexpr std::array kStreams2 = {
    make_streams_table<2, false>(std::make_integer_sequence<int, kTwoStreamRows>{}),
    make_streams_table<2, true>(std::make_integer_sequence<int, kTwoStreamRows>{})};

// m rows are computed in chunks of at most kMaxRows rows, as even as possible, and the chunks in groups of
// kGroupChunks: a thread runs all its blocks over one group's rows, then the next group's. So a prompt's x
// is read from L2 (a group's rows of the SmolLM2 MLP's down: 120 x 3 KB) instead of from L3 once per block.
// Single calls with hot weights, 1930 rows, against all chunks per block: gate_up with SiLU 404 -> 416
// GFLOP/s, down 431 -> 441, qkv 425 -> 438; 128 and 512 rows 0.98-1.01 of the time. Whole prompt steps of
// 1930 and 2048 tokens took 0.960 and 0.959 of the time (groups of 2 and 8 chunks: 0.948, 0.955). Decode
// batches up to 120 rows are one group: the loops of before. A row's chunk, and so its bits, stay the same.
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

// The columns of block b that exist among n (the last block's may be fewer than 16).
inline __mmask16 block_cols(int64_t n, int64_t b) {
  return static_cast<__mmask16>((1u << std::min<int64_t>(kBlock, n - b * kBlock)) - 1);
}

// Block b's bias (its columns in cols) in float32, added before the one rounding (as oneDNN and F.linear
// do); zero without a bias.
inline __m512 bias_block(const at::BFloat16* bias, int64_t b, __mmask16 cols) {
  return bias == nullptr ? _mm512_setzero_ps()
                         : _mm512_castsi512_ps(_mm512_slli_epi32(
                               _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(cols, bias + b * kBlock)), 16));
}

void linear_avx512(const at::BFloat16* x, int64_t ldx, int64_t m, const at::BFloat16* w, int64_t pairs,
                   int64_t n, const at::BFloat16* bias, at::BFloat16* y, int64_t ldy) {
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  const int threads = static_cast<int>(std::min<int64_t>(std::max(1, at::get_num_threads()), blocks));
  // Up to kTwoStreamRows rows, the threads share the blocks out as runs (see BlockRuns), each run read as
  // four streams side by side (up to four rows; two up to eight), block i of each stream together; then
  // the blocks the streams leave over, one at a time. Against a fixed half a thread (four streams, then
  // two, then single blocks), the 30 layers' linears and the LM head from memory, one row, alternating in
  // one process (2-core Zen 4): gate_up, down and the head 0.95x as long, qkv and o even; four rows
  // 0.97-1.0x; whole single-sequence decode steps 0.98-0.99x. More rows: each thread its contiguous
  // run of blocks, a sequential stream of W (even where the blocks divide evenly, as every SmolLM2 shape's
  // on two threads).
  const int64_t streams = m <= kFourStreamRows ? 4 : 2;
  BlockRuns runs(blocks, threads, streams);
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    const auto cols_of = [&](int64_t b) { return block_cols(n, b); };
    const auto bias_of = [&](int64_t b) { return bias_block(bias, b, cols_of(b)); };
    if (m <= kTwoStreamRows) {
      const int l2 = reads_ahead_into_l2() ? 1 : 0;
      const StreamsFn step = streams == 4 ? kStreams4[l2][m - 1] : kStreams2[l2][m - 1];
      runs.work(t, [&](int r, int64_t u, int64_t) {
        int64_t first, part;
        if (!runs.parts_of(r, u, first, part)) {
          kKernels[m - 1](w + first * pairs * 2 * kBlock, x, ldx, pairs, bias_of(first), y + first * kBlock,
                          ldy, cols_of(first));
          return;
        }
        __m512 biases[4];
        __mmask16 cols[4];
        for (int s = 0; s < streams; ++s)
          biases[s] = bias_of(first + s * part), cols[s] = cols_of(first + s * part);
        step(w + first * pairs * 2 * kBlock, part, x, ldx, pairs, biases, y + first * kBlock, ldy, cols);
      });
    } else {
      const int64_t b0 = blocks * t / nt, b1 = blocks * (t + 1) / nt;
      for_row_groups(m, [&](int64_t c0, int64_t c1) {
        for (int64_t j = b0; j < b1; ++j) {
          const at::BFloat16* wb = w + j * pairs * 2 * kBlock;
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
// a parallel region of its own. The SmolLM2 MLP's gate_up (576 -> 2 x 1536), alternating with linear then
// silu_mul, hot weights: 9-64 rows 0.92-0.99 of the time, 2048 rows 0.89. Whole steps, alternating builds:
// prompt steps of 2048 tokens (8 x 256) and 2060 (7 prompts of 60-500) 0.978 and 0.960; decode at context
// 300-400, 12-64 sequences 0.95-0.99 (two runs at 51 sequences read 1.02, a third 0.982).
void linear_silu_avx512(const at::BFloat16* x, int64_t ldx, int64_t m, const at::BFloat16* w, int64_t pairs,
                        int64_t size, const at::BFloat16* bias, at::BFloat16* out, int64_t ld_out) {
  const int64_t half = size / kBlock, block_elems = pairs * 2 * kBlock;
  const int threads = static_cast<int>(std::min<int64_t>(std::max(1, at::get_num_threads()), half));
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    alignas(64) at::BFloat16 gate[kGroupChunks * kMaxRows * kBlock], up[kMaxRows * kBlock];
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
            silu_mul16(out + (r0 + r) * ld_out + j * kBlock, gate + (r0 - g0 + r) * kBlock, up + r * kBlock);
        });
      }
    });
  }
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// ---- linear layers on AMX ---------------------------------------------------------------------------------
//
// The packed weights are tiles already: a packed block's 16 consecutive K pairs (see the layout above) are
// one W tile of 32 x 16, 16 lines of 64 bytes one after the other. So the AMX kernel reads the weights
// pack_linear_weight made, with no second copy. Each thread takes its run of blocks two at a time, and for
// each pair the rows of x 32 at a time: two x tiles and two W tiles into four tiles of sums. The sums are
// float32, over K in order as block_kernel's (see linear_amx's note on the bits).
//
// AMX needs K a multiple of 32 (a whole tile of x per step; every SmolLM2, Llama and Qwen hidden and
// intermediate size is one) and Linux's permission for the tile state, asked once per process
// (amx_permitted); without either the linear takes the AVX-512 kernels above. The SmolLM2 shapes on a 2-core
// Intel Xeon with AMX, weights in cache, GFLOP/s against the AVX-512 BF16 kernels (and oneDNN's bf16
// linear): 16 rows 980-1370 against 160-190 (260-410), 256 rows 1890-2290 against 180-190 (1410-1940),
// 2048 rows 1380-2150 against 150-190 (1660-2770).

// Rows from which linear_to and linear_silu_to take the AMX kernel. Below it the AVX-512 kernels stream the
// weights better. Whole decode steps at 512 positions (bench_worker, AVX-512 -> AMX, two runs each): 2 and 4
// sequences 11.1-13.6 -> 12.8-15.4 ms, 5 even, 6 17.1-17.7 -> 16.2-16.5, 8 20.5-22.7 -> 17.6-19.2, 16
// 37.6-40.0 -> 23.4-25.3, 32 71.5-77.0 -> 36.7-39.1.
constexpr int64_t kAmxMinRows = 6;
constexpr int64_t kAmxTileRows = 16;   // rows of an x tile and of a tile of sums
constexpr int64_t kAmxTilePairs = 16;  // K pairs of a tile: 32 bf16, 64 bytes, a W tile's 16 lines
// Rows of x a thread runs over all its blocks before the next: 256 x 1536 bf16 is 768 KB, in its L2.
constexpr int64_t kAmxChunkRows = 256;

inline bool use_amx(int64_t m, int64_t pairs) {
  return m >= kAmxMinRows && pairs % kAmxTilePairs == 0 && amx_enabled();
}

// Tiles 0-3: sums, 4-5: x, 6-7: W; all 16 rows of 64 bytes.
constexpr TileConfig kLinearTiles{{16, 64}, {16, 64}, {16, 64}, {16, 64},
                                  {16, 64}, {16, 64}, {16, 64}, {16, 64}};

// The rows [r0, r0 + rows) of x as x tiles: each points into x itself (rows ldx elements apart), but the
// last when it has fewer than 16 rows, which is copied into pad (16 rows of 2 * pairs, zeros after the
// copied rows) so that the tile loads never read past x.
struct RowTiles {
  const at::BFloat16* x;
  int64_t ldx, r0, rows;
  at::BFloat16* pad;
  int64_t pairs;

  int64_t count() const { return (rows + kAmxTileRows - 1) / kAmxTileRows; }
  int64_t rows_of(int64_t i) const { return std::min(kAmxTileRows, rows - i * kAmxTileRows); }
  bool padded(int64_t i) const { return rows_of(i) < kAmxTileRows; }
  const at::BFloat16* base(int64_t i) const { return padded(i) ? pad : x + (r0 + i * kAmxTileRows) * ldx; }
  int64_t stride_bytes(int64_t i) const { return (padded(i) ? 2 * pairs : ldx) * 2; }
  void fill_pad() const {
    if (count() == 0 || !padded(count() - 1)) return;
    const int64_t first = r0 + (count() - 1) * kAmxTileRows, n = rows_of(count() - 1), k = 2 * pairs;
    for (int64_t r = 0; r < n; ++r) std::memcpy(pad + r * k, x + (first + r) * ldx, k * sizeof(at::BFloat16));
    std::memset(pad + n * k, 0, (kAmxTileRows - n) * k * sizeof(at::BFloat16));
  }
};

// The sums of RT x tiles (a0, a1; their rows sa0, sa1 bytes apart) by BT W tiles (the blocks at w0, w1)
// over all K, stored as float32 into c[(rt * BT + bt) * 256 + row * 16 + col].
template <int RT, int BT>
inline void amx_tiles(const at::BFloat16* a0, int64_t sa0, const at::BFloat16* a1, int64_t sa1,
                      const at::BFloat16* w0, const at::BFloat16* w1, int64_t pairs, float* c) {
  _tile_zero(0);
  if constexpr (BT > 1) _tile_zero(1);
  if constexpr (RT > 1) _tile_zero(2);
  if constexpr (RT > 1 && BT > 1) _tile_zero(3);
  for (int64_t p = 0; p < pairs; p += kAmxTilePairs) {
    _tile_loadd(4, a0 + 2 * p, sa0);
    if constexpr (RT > 1) _tile_loadd(5, a1 + 2 * p, sa1);
    _tile_loadd(6, w0 + p * 2 * kBlock, 2 * kBlock * 2);
    if constexpr (BT > 1) _tile_loadd(7, w1 + p * 2 * kBlock, 2 * kBlock * 2);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (BT > 1) _tile_dpbf16ps(1, 4, 7);
    if constexpr (RT > 1) _tile_dpbf16ps(2, 5, 6);
    if constexpr (RT > 1 && BT > 1) _tile_dpbf16ps(3, 5, 7);
  }
  constexpr int64_t kTile = kAmxTileRows * kBlock;
  _tile_stored(0, c, kBlock * 4);
  if constexpr (BT > 1) _tile_stored(1, c + kTile, kBlock * 4);
  if constexpr (RT > 1) _tile_stored(2, c + BT * kTile, kBlock * 4);
  if constexpr (RT > 1 && BT > 1) _tile_stored(3, c + 3 * kTile, kBlock * 4);
}

// The sums of x tiles i and i + 1 (if there is one, `two`) of `tiles` by the W blocks at w0 and w1 (none:
// w0 alone) into c, as amx_tiles lays them out.
inline void amx_step(const RowTiles& tiles, int64_t i, bool two, const at::BFloat16* w0,
                     const at::BFloat16* w1, int64_t pairs, float* c) {
  const at::BFloat16* a0 = tiles.base(i);
  const at::BFloat16* a1 = two ? tiles.base(i + 1) : a0;
  const int64_t sa0 = tiles.stride_bytes(i), sa1 = two ? tiles.stride_bytes(i + 1) : sa0;
  if (two && w1 != nullptr)
    amx_tiles<2, 2>(a0, sa0, a1, sa1, w0, w1, pairs, c);
  else if (two)
    amx_tiles<2, 1>(a0, sa0, a1, sa1, w0, w0, pairs, c);
  else if (w1 != nullptr)
    amx_tiles<1, 2>(a0, sa0, a1, sa1, w0, w1, pairs, c);
  else
    amx_tiles<1, 1>(a0, sa0, a1, sa1, w0, w0, pairs, c);
}

// Rounds a tile of sums (16 x 16 float32 at c) plus the block's bias to bf16: `rows` rows of `cols` columns,
// into y (rows ldy apart).
inline void store_amx_tile(const float* c, __m512 bias, int64_t rows, __mmask16 cols, at::BFloat16* y,
                           int64_t ldy) {
  for (int64_t r = 0; r < rows; ++r)
    _mm256_mask_storeu_epi16(
        y + r * ldy, cols, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(_mm512_loadu_ps(c + r * kBlock), bias)));
}

// The tiles' parallel region: each of `threads` threads loads the tile configuration, gets a pad for its
// last x tile, and runs body(t, nt, pad); the tile state is released at the end.
template <typename F>
void amx_region(int threads, int64_t pairs, F&& body) {
#pragma omp parallel num_threads(threads)
  {
    _tile_loadconfig(&kLinearTiles);
    thread_local std::vector<at::BFloat16> pad;
    pad.resize(std::max<size_t>(pad.size(), kAmxTileRows * 2 * pairs));
    body(omp_get_thread_num(), omp_get_num_threads(), pad.data());
    _tile_release();
  }
}

// linear_avx512 on AMX (see use_amx). Each thread takes a contiguous run of blocks, and for every chunk of
// kAmxChunkRows rows walks its blocks two at a time over the chunk's x tiles, two at a time.
// NOTE: bits. Both walk K in order, as block_kernel does where it keeps one chain a row (8 rows and more,
// unroll()), but tdpbf16ps rounds inside a pair's two products differently in rare cases: about 1 output
// in 5,000 differs from AVX-512's, by a bf16 step (more only where a sum cancels to near zero).
void linear_amx(const at::BFloat16* x, int64_t ldx, int64_t m, const at::BFloat16* w, int64_t pairs,
                int64_t n, const at::BFloat16* bias, at::BFloat16* y, int64_t ldy) {
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  const int threads = static_cast<int>(std::min<int64_t>(std::max(1, at::get_num_threads()), blocks));
  amx_region(threads, pairs, [&](int t, int nt, at::BFloat16* pad) {
    alignas(64) float c[4 * kAmxTileRows * kBlock];
    const int64_t b0 = blocks * t / nt, b1 = blocks * (t + 1) / nt;
    for (int64_t r0 = 0; r0 < m; r0 += kAmxChunkRows) {
      const RowTiles tiles{x, ldx, r0, std::min(kAmxChunkRows, m - r0), pad, pairs};
      tiles.fill_pad();
      for (int64_t j = b0; j < b1; j += 2) {
        const bool two_blocks = j + 1 < b1;
        for (int64_t i = 0; i < tiles.count(); i += 2) {
          const bool two = i + 1 < tiles.count();
          const at::BFloat16* wj = w + j * pairs * 2 * kBlock;
          amx_step(tiles, i, two, wj, two_blocks ? wj + pairs * 2 * kBlock : nullptr, pairs, c);
          for (int64_t rt = 0; rt < (two ? 2 : 1); ++rt)
            for (int64_t bt = 0; bt < (two_blocks ? 2 : 1); ++bt) {
              const int64_t b = j + bt, rows = tiles.rows_of(i + rt);
              const __mmask16 cols = block_cols(n, b);
              store_amx_tile(c + (rt * (two_blocks ? 2 : 1) + bt) * kAmxTileRows * kBlock,
                             bias_block(bias, b, cols), rows, cols,
                             y + (r0 + (i + rt) * kAmxTileRows) * ldy + b * kBlock, ldy);
            }
        }
      }
    }
  });
}

// linear_silu_avx512 on AMX: gate block j and up block size / 16 + j as one step's two W tiles, so that the
// sums of both lie side by side; each rounded to bf16 (as linear rounds) and multiplied by silu_mul16.
void linear_silu_amx(const at::BFloat16* x, int64_t ldx, int64_t m, const at::BFloat16* w, int64_t pairs,
                     int64_t size, const at::BFloat16* bias, at::BFloat16* out, int64_t ld_out) {
  const int64_t half = size / kBlock, block_elems = pairs * 2 * kBlock;
  const int threads = static_cast<int>(std::min<int64_t>(std::max(1, at::get_num_threads()), half));
  amx_region(threads, pairs, [&](int t, int nt, at::BFloat16* pad) {
    alignas(64) float c[4 * kAmxTileRows * kBlock];
    alignas(64) at::BFloat16 gate[kAmxTileRows * kBlock], up[kAmxTileRows * kBlock];
    const int64_t j0 = half * t / nt, j1 = half * (t + 1) / nt;
    for (int64_t r0 = 0; r0 < m; r0 += kAmxChunkRows) {
      const RowTiles tiles{x, ldx, r0, std::min(kAmxChunkRows, m - r0), pad, pairs};
      tiles.fill_pad();
      for (int64_t j = j0; j < j1; ++j) {
        const __m512 bias_gate = bias_block(bias, j, 0xFFFF), bias_up = bias_block(bias, half + j, 0xFFFF);
        for (int64_t i = 0; i < tiles.count(); i += 2) {
          const bool two = i + 1 < tiles.count();
          amx_step(tiles, i, two, w + j * block_elems, w + (half + j) * block_elems, pairs, c);
          for (int64_t rt = 0; rt < (two ? 2 : 1); ++rt) {
            const int64_t rows = tiles.rows_of(i + rt);
            const float* cg = c + 2 * rt * kAmxTileRows * kBlock;
            store_amx_tile(cg, bias_gate, rows, 0xFFFF, gate, kBlock);
            store_amx_tile(cg + kAmxTileRows * kBlock, bias_up, rows, 0xFFFF, up, kBlock);
            at::BFloat16* o = out + (r0 + (i + rt) * kAmxTileRows) * ld_out + j * kBlock;
            for (int64_t r = 0; r < rows; ++r) silu_mul16(o + r * ld_out, gate + r * kBlock, up + r * kBlock);
          }
        }
      }
    }
  });
}
#endif  // __AMX_TILE__ && __AMX_BF16__

#elif defined(__AVX2__) && defined(__FMA__)

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
inline WideLine widen_line(const at::BFloat16* line, const char* fetch) {
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
inline void store_sums(__m256 lo, __m256 hi, at::BFloat16* y, int64_t cols) {
  alignas(32) at::BFloat16 row[kBlock];
  _mm_store_si128(reinterpret_cast<__m128i*>(row), to_bf16_avx2(lo));
  _mm_store_si128(reinterpret_cast<__m128i*>(row + 8), to_bf16_avx2(hi));
  std::memcpy(y, row, cols * sizeof(at::BFloat16));
}

// U independent sets of sums over interleaved K pairs keep 8 FMA chains in flight at 1 and 2 rows.
template <int ROWS, int U>
void block_kernel_avx2(const at::BFloat16* w, const float* x, int64_t ldx, int64_t pairs, const float* bias,
                       at::BFloat16* y, int64_t ldy, int64_t cols, const char* fetch, int64_t fetch_step) {
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
void widen_block(const at::BFloat16* w, int64_t pairs, float* wide) {
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
                      at::BFloat16* y, int64_t ldy, int64_t cols, const at::BFloat16* gate = nullptr) {
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
void block_kernel_halves_avx2(const at::BFloat16* w, const float* x, int64_t ldx, int64_t pairs,
                              const float* bias, at::BFloat16* y, int64_t ldy, int64_t cols,
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

using BlockFnAvx2 = void (*)(const at::BFloat16*, const float*, int64_t, int64_t, const float*, at::BFloat16*,
                             int64_t, int64_t, const char*, int64_t);
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
inline void interleave_pairs(const at::BFloat16* x, int64_t ldx, int64_t rows, int64_t pairs, float* out) {
  uint64_t* const out_pairs = reinterpret_cast<uint64_t*>(out);
  for (int64_t r = 0; r < rows; ++r) {
    const at::BFloat16* row = x + r * ldx;
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
                                             at::BFloat16* y, int64_t ldy, int64_t cols,
                                             const at::BFloat16* gate) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < nb; ++b) {
      const float* s = sums + (r * nb + b) * kBlock;
      at::BFloat16* out = y + r * ldy + b * kBlock;
      const __m256 lo = _mm256_add_ps(_mm256_load_ps(s), _mm256_loadu_ps(bias + b * kBlock));
      const __m256 hi = _mm256_add_ps(_mm256_load_ps(s + 8), _mm256_loadu_ps(bias + b * kBlock + 8));
      if (gate != nullptr) {
        const at::BFloat16* g = gate + r * nb * kBlock + b * kBlock;
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
void halves_kernel_avx512(const at::BFloat16* w, int64_t pairs, const float* x, const float* bias,
                          at::BFloat16* y, int64_t ldy, int64_t cols, const at::BFloat16* gate,
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

using PassFnAvx512 = void (*)(const at::BFloat16*, int64_t, const float*, const float*, at::BFloat16*,
                              int64_t, int64_t, const at::BFloat16*, const char*, int64_t);
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
void rows_streams_avx2(const at::BFloat16* w, int64_t step, const float* x, int64_t ldx, int64_t pairs,
                       const float* bias, at::BFloat16* y, int64_t ldy, const int64_t* cols) {
  const int64_t w_step = step * pairs * 2 * kBlock;
  __m256 acc[S][ROWS][2];
  for (int s = 0; s < S; ++s)
    for (int r = 0; r < ROWS; ++r) acc[s][r][0] = acc[s][r][1] = _mm256_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p)
#pragma GCC unroll 4
    for (int s = 0; s < S; ++s) {
      const at::BFloat16* at_line = w + s * w_step + p * 2 * kBlock;
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

void linear_avx2(const at::BFloat16* x, int64_t ldx, int64_t m, const at::BFloat16* w, int64_t pairs,
                 int64_t n, const at::BFloat16* bias, at::BFloat16* y, int64_t ldy, bool silu = false) {
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
    thread_local std::vector<at::BFloat16> gate;
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
    thread_local std::vector<at::BFloat16> gate;
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

#endif  // __AVX512BF16__

// ---- float32 linear layers ------------------------------------------------------------------------------
//
// y = x @ W^T + bias with x, W and bias float32, for a model loaded in float32, on every CPU with AVX2 and
// FMA. Layout (pack_linear_weight of a float32 W): blocks of 16 output columns, [ceil(N/16), K, 16]; row k
// of block b is one 64-byte line, W[16b .. 16b + 15][k], and N is padded with zeros. A row's 16 sums of a
// block are two ymm, fed per k by the line's two loads and one broadcast of x: the walk of the bf16
// kernels over a block widened to float32 (wide_kernel_avx2), on the packed weight itself. As there, each
// thread streams its share of W once, sequentially, while x stays in L1 or L2; the sums run in k order and
// the bias is added last.
#if defined(__AVX2__) && defined(__FMA__)

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
void linear_f32_avx2(const float* x, int64_t ldx, int64_t m, const float* w, int64_t k, int64_t n,
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

#endif  // __AVX2__ && __FMA__

// W [N, K] bf16 -> [ceil(N/16), ceil(K/2), 16, 2] (see the layout above), padded with zeros; float32 weights
// -> [ceil(N/16), K, 16] for linear_f32.
at::Tensor pack_linear_weight(const at::Tensor& weight) {
  TORCH_CHECK(
      weight.dim() == 2 && (weight.scalar_type() == at::kBFloat16 || weight.scalar_type() == at::kFloat),
      "weight must be [N, K] bf16 or float32");
  const int64_t n = weight.size(0), k = weight.size(1);
  if (weight.scalar_type() == at::kFloat) {
    // [ceil(N/16), K, 16] (see linear_f32), padded with zeros.
    const int64_t blocks = (n + kBlock - 1) / kBlock;
    at::Tensor padded = at::zeros({blocks * kBlock, k}, weight.options());
    padded.narrow(0, 0, n).copy_(weight);
    return padded.view({blocks, kBlock, k}).permute({0, 2, 1}).contiguous();
  }
  const int64_t blocks = (n + kBlock - 1) / kBlock, pairs = (k + 1) / 2;
  at::Tensor padded = at::zeros({blocks * kBlock, pairs * 2}, weight.options());
  padded.narrow(0, 0, n).narrow(1, 0, k).copy_(weight);
  return padded.view({blocks, kBlock, pairs, 2}).permute({0, 2, 1, 3}).contiguous();
}

// The check of a linear layer's bias for N = n: contiguous [n] of the weight's dtype (bf16 by default);
// `what` starts the message.
void check_linear_bias(const c10::optional<at::Tensor>& bias, int64_t n, const char* what,
                       at::ScalarType dtype = at::kBFloat16) {
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == dtype && bias->dim() == 1 && bias->size(0) == n &&
                                    bias->is_contiguous()),
              what, "bias must be ", dtype == at::kFloat ? "float32" : "bf16", " [", n, "], contiguous");
}

// The checks of linear's arguments for a float32 packed weight.
void check_linear_f32(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                      const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(packed.is_contiguous() && packed.dim() == 3 && packed.size(2) == kBlock,
              "packed must be a weight from pack_linear_weight, [blocks, K, 16] float32");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() >= 1,
              "x must be float32 [..., K] for a float32 weight");
  TORCH_CHECK(x.size(-1) == packed.size(1), "x has K = ", x.size(-1), ", the packed weight ", packed.size(1));
  TORCH_CHECK(n > (packed.size(0) - 1) * kBlock && n <= packed.size(0) * kBlock, "n = ", n,
              " does not match the packed weight");
  check_linear_bias(bias, n, "", at::kFloat);
}

// The checks of linear's arguments (a bf16 packed weight).
void check_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                  const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() && packed.dim() == 4 &&
                  packed.size(2) == kBlock && packed.size(3) == 2,
              "packed must be a weight from pack_linear_weight, [blocks, K/2, 16, 2] bf16");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() >= 1, "x must be bf16 [..., K]");
  const int64_t pairs = packed.size(1), k = x.size(-1);
  TORCH_CHECK(k == 2 * pairs || k + 1 == 2 * pairs, "x has K = ", k, ", the packed weight ", 2 * pairs);
  TORCH_CHECK(n > (packed.size(0) - 1) * kBlock && n <= packed.size(0) * kBlock, "n = ", n,
              " does not match the packed weight");
  check_linear_bias(bias, n, "");
}

// y [m, n] (rows ldy apart) = x [m, 2 * pairs] (rows ldx apart) @ W^T + bias, for the W that
// pack_linear_weight packed: linear's kernel on buffers the caller owns (DecoderStack's).
void linear_to(const at::BFloat16* x, int64_t ldx, int64_t m, const at::BFloat16* w, int64_t pairs, int64_t n,
               const at::BFloat16* bias, at::BFloat16* y, int64_t ldy) {
  if (m == 0) return;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  if (use_amx(m, pairs)) return linear_amx(x, ldx, m, w, pairs, n, bias, y, ldy);
#endif
#if defined(__AVX512BF16__)
  linear_avx512(x, ldx, m, w, pairs, n, bias, y, ldy);
#elif defined(__AVX2__) && defined(__FMA__)
  linear_avx2(x, ldx, m, w, pairs, n, bias, y, ldy);
#else
  TORCH_CHECK(false, "this build has no linear: it needs AVX-512 BF16 or AVX2 with FMA (see has_linear)");
#endif
}

// y [m, n] (rows ldy apart) = x [m, k] (rows ldx apart) @ W^T + bias for a float32 W that
// pack_linear_weight packed: linear_to's float32 twin.
void linear_f32_to(const float* x, int64_t ldx, int64_t m, const float* w, int64_t k, int64_t n,
                   const float* bias, float* y, int64_t ldy) {
  if (m == 0) return;
#if defined(__AVX2__) && defined(__FMA__)
  linear_f32_avx2(x, ldx, m, w, k, n, bias, y, ldy);
#else
  TORCH_CHECK(false, "this build has no float32 linear: it needs AVX2 with FMA (see has_linear_f32)");
#endif
}

// y = x @ W^T + bias for the W that pack_linear_weight packed; n is W's N (the packed copy is padded).
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                  const c10::optional<at::Tensor>& bias) {
  const bool f32 = packed.scalar_type() == at::kFloat;
  f32 ? check_linear_f32(x, packed, n, bias) : check_linear(x, packed, n, bias);
  const int64_t k = x.size(-1);
  at::Tensor x2 = x.reshape({-1, k});
  // The bf16 kernel reads x in whole pairs: an odd K gets a zero column (the packed weight has one too).
  if (!f32 && k % 2 != 0) x2 = at::constant_pad_nd(x2, {0, 1});
  if (x2.stride(-1) != 1) x2 = x2.contiguous();
  const int64_t m = x2.size(0);
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = n;
  at::Tensor y = at::empty({m, n}, x.options());
  if (f32)
    linear_f32_to(x2.const_data_ptr<float>(), x2.stride(0), m, packed.const_data_ptr<float>(), k, n,
                  bias.has_value() ? bias->const_data_ptr<float>() : nullptr, y.mutable_data_ptr<float>(),
                  y.stride(0));
  else
    linear_to(x2.const_data_ptr<at::BFloat16>(), x2.stride(0), m, packed.const_data_ptr<at::BFloat16>(),
              packed.size(1), n, bias.has_value() ? bias->const_data_ptr<at::BFloat16>() : nullptr,
              y.mutable_data_ptr<at::BFloat16>(), y.stride(0));
  return y.view(out_shape);
}

// Of m rows of x [m, k], how many linear_silu_to computes in one pass (linear_silu_avx512, or on AVX2 the
// rows through the float32 copy): size a multiple of kBlock and K even, on AVX-512 more rows than
// linear_avx512 streams as runs side by side. The others go through linear then silu_mul. The same bits
// either way.
int64_t silu_fused_rows(int64_t m, int64_t k, int64_t size) {
  if (size % kBlock != 0 || k % 2 != 0) return 0;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  if (use_amx(m, k / 2)) return m;
#endif
#if defined(__AVX512BF16__)
  return m > kTwoStreamRows ? m : 0;
#elif defined(__AVX2__) && defined(__FMA__)
  return avx2_wide_rows(m, k);
#else
  return 0;
#endif
}

// out [m, size] (rows ld_out apart) = silu_mul(x @ W^T + bias) for a gate_up W of N = 2 * size (gate first)
// and x [m, 2 * pairs] contiguous. scratch: room for the [m - silu_fused_rows, 2 * size] products of the rows
// not fused.
void linear_silu_to(const at::BFloat16* x, int64_t m, const at::BFloat16* w, int64_t pairs, int64_t size,
                    const at::BFloat16* bias, at::BFloat16* out, int64_t ld_out, at::BFloat16* scratch) {
  const int64_t k = 2 * pairs, fused = silu_fused_rows(m, k, size);
  if (fused > 0) {
#if defined(__AVX512BF16__)
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if (use_amx(fused, pairs)) return linear_silu_amx(x, k, fused, w, pairs, size, bias, out, ld_out);
#endif
    linear_silu_avx512(x, k, fused, w, pairs, size, bias, out, ld_out);
#elif defined(__AVX2__) && defined(__FMA__)
    linear_avx2(x, k, fused, w, pairs, 2 * size, bias, out, ld_out, true);
#endif
  }
  if (fused == m) return;
  linear_to(x + fused * k, k, m - fused, w, pairs, 2 * size, bias, scratch, 2 * size);
  silu_mul_rows<at::BFloat16>(scratch, 2 * size, out + fused * ld_out, m - fused, size);
}

// silu_mul(linear(x, packed, 2 * size, bias)), in one pass where it can be (see silu_fused_rows).
at::Tensor linear_silu(const at::Tensor& x, const at::Tensor& packed, int64_t size,
                       const c10::optional<at::Tensor>& bias) {
  check_linear(x, packed, 2 * size, bias);
  const int64_t k = x.size(-1), m = x.numel() / std::max<int64_t>(1, k);
  const int64_t fused = silu_fused_rows(m, k, size);
  if (fused == 0) return silu_mul(linear(x, packed, 2 * size, bias));
  const at::Tensor x2 = x.reshape({m, k}).contiguous();
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = size;
  at::Tensor out = at::empty(out_shape, x.options());
  at::Tensor scratch = at::empty({m - fused, 2 * size}, x.options());
  linear_silu_to(x2.const_data_ptr<at::BFloat16>(), m, packed.const_data_ptr<at::BFloat16>(), packed.size(1),
                 size, bias.has_value() ? bias->const_data_ptr<at::BFloat16>() : nullptr,
                 out.mutable_data_ptr<at::BFloat16>(), size, scratch.mutable_data_ptr<at::BFloat16>());
  return out;
}

bool has_linear() {
#if defined(__AVX512BF16__) || (defined(__AVX2__) && defined(__FMA__))
  return true;
#else
  return false;
#endif
}

bool has_linear_f32() {
#if defined(__AVX2__) && defined(__FMA__)
  return true;
#else
  return false;
#endif
}

// ---- a decoder's layers in one call ---------------------------------------------------------------------
//
// The Python model calls about ten kernels per layer. Each call costs its module and wrapper code and
// the conversion of its arguments, some microseconds, which for a single sequence is about 2 ms of a
// 13 ms step on a 30-layer model: as much as attention and the pointwise ops together. DecoderStack
// holds every layer's weights and runs all layers of a forward pass from here, the same kernels in the
// same order as model.CausalLM.forward (but for linear_silu, which is its gate_up linear then silu_mul
// in one pass), so it computes the same bits. The model runs every step through it where the kernels
// have their linear for its dtype: bf16, or float32 (DecoderStackT<float>, whose MLP runs gate_up then
// silu_mul as the Python loop does). In float32 the Python around the kernels costs more still, 5-11 ms a
// step (SmolLM2, 2-core Zen 3, the loop against the stack, alternating steps in one process, medians of 20,
// two runs): 1 sequence at 512 positions 39.2 and 34.4 -> 30.9 and 29.2 ms, 8 sequences 60.2 and 57.9 ->
// 49.1 and 48.2 ms, 32 sequences 140.8 and 141.3 -> 130.2 and 125.0 ms; 1 sequence at 2048 positions 40.3 ->
// 31.0 ms.
//
// Inside, a layer makes no tensors: the kernels run on pointers into buffers the stack keeps (linear_to,
// linear_silu_to, rms_norm_impl), the tensors' checks and the attention's plan are made once per forward
// pass, and the views the attention and RoPE kernels take are made once too. Each torch op (an empty, a
// view, a reshape, a dispatch) costs microseconds there, as the weights streamed since the last one have
// pushed PyTorch's own data out of the caches, and the other thread waits meanwhile: the 30 layers' ops
// around the kernels took 0.88-1.14 ms of a single sequence's decode step, 0.20-0.28 ms since (2-core Zen
// 3, SmolLM2, timed inside the extension); whole steps, alternating builds, 0.94-0.96x as long at 128 to
// 2048 positions.

struct StackLayer {
  at::Tensor qkv, o, gate_up, down;  // packed by pack_linear_weight
  c10::optional<at::Tensor> qkv_bias, o_bias, gate_up_bias, down_bias;
  at::Tensor input_norm, post_attention_norm;
  c10::optional<at::Tensor> q_norm, k_norm;  // per-head RMSNorm of q and k (qwen3)
};

// The data of an optional tensor of T, or null.
template <typename T>
const T* data_or_null(const c10::optional<at::Tensor>& t) {
  return t.has_value() ? t->const_data_ptr<T>() : nullptr;
}

// What the interface's DecoderStack calls, whichever the dtype of the stack's model.
class StackBase {
 public:
  virtual ~StackBase() = default;
  virtual void add_layer(at::Tensor qkv, c10::optional<at::Tensor> qkv_bias, at::Tensor o,
                         c10::optional<at::Tensor> o_bias, at::Tensor gate_up,
                         c10::optional<at::Tensor> gate_up_bias, at::Tensor down,
                         c10::optional<at::Tensor> down_bias, at::Tensor input_norm,
                         at::Tensor post_attention_norm, c10::optional<at::Tensor> q_norm,
                         c10::optional<at::Tensor> k_norm) = 0;
  virtual at::Tensor forward_tokens(const at::Tensor& input_ids, const at::Tensor& positions,
                                    const at::Tensor& embedding, const at::Tensor& rope_table,
                                    const std::vector<at::Tensor>& k_caches,
                                    const std::vector<at::Tensor>& v_caches, const at::Tensor& slot_mapping,
                                    const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                                    const at::Tensor& context_lens,
                                    const c10::optional<at::Tensor>& output_rows) const = 0;
  virtual int64_t num_layers() const = 0;
};

// The stack of a bf16 model (T = at::BFloat16: the kernels' bf16 linear, with the MLP's gate_up and SiLU in
// one pass where linear_silu_to fuses them) or of a float32 one (T = float: linear_f32_avx2, then
// silu_mul, as the Python loop runs them).
template <typename T>
class DecoderStackT final : public StackBase {
  static constexpr at::ScalarType kType = c10::CppTypeToScalarType<T>::value;
  static constexpr const char* kTypeName = std::is_same_v<T, float> ? "float32" : "bf16";

 public:
  DecoderStackT(int64_t hidden, int64_t intermediate, int64_t num_heads, int64_t num_kv_heads,
                int64_t head_dim, double eps, double scale, int64_t min_tile_lanes, at::Tensor final_norm)
      : hidden_(hidden),
        intermediate_(intermediate),
        num_heads_(num_heads),
        num_kv_heads_(num_kv_heads),
        head_dim_(head_dim),
        q_size_(num_heads * head_dim),
        kv_size_(num_kv_heads * head_dim),
        eps_(eps),
        scale_(scale),
        min_tile_lanes_(min_tile_lanes),
        final_norm_(std::move(final_norm)) {
    TORCH_CHECK((std::is_same_v<T, float> ? has_linear_f32() : has_linear()),
                "DecoderStack needs the kernels' linear for its dtype (see has_linear and has_linear_f32)");
    TORCH_CHECK(num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads");
    // linear_to reads x in whole pairs; every released model's sizes are even.
    TORCH_CHECK(hidden % 2 == 0 && intermediate % 2 == 0 && head_dim % 2 == 0,
                "DecoderStack needs even hidden, intermediate and head sizes");
    check_norm(final_norm_, hidden_, "final_norm");
  }

  void add_layer(at::Tensor qkv, c10::optional<at::Tensor> qkv_bias, at::Tensor o,
                 c10::optional<at::Tensor> o_bias, at::Tensor gate_up, c10::optional<at::Tensor> gate_up_bias,
                 at::Tensor down, c10::optional<at::Tensor> down_bias, at::Tensor input_norm,
                 at::Tensor post_attention_norm, c10::optional<at::Tensor> q_norm,
                 c10::optional<at::Tensor> k_norm) override {
    check_packed(qkv, qkv_bias, q_size_ + 2 * kv_size_, hidden_, "qkv");
    check_packed(o, o_bias, hidden_, q_size_, "o");
    check_packed(gate_up, gate_up_bias, 2 * intermediate_, hidden_, "gate_up");
    check_packed(down, down_bias, hidden_, intermediate_, "down");
    check_norm(input_norm, hidden_, "input_norm");
    check_norm(post_attention_norm, hidden_, "post_attention_norm");
    TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "q_norm and k_norm come together");
    if (q_norm.has_value()) {
      check_norm(*q_norm, head_dim_, "q_norm");
      check_norm(*k_norm, head_dim_, "k_norm");
    }
    layers_.push_back({std::move(qkv), std::move(o), std::move(gate_up), std::move(down), std::move(qkv_bias),
                       std::move(o_bias), std::move(gate_up_bias), std::move(down_bias),
                       std::move(input_norm), std::move(post_attention_norm), std::move(q_norm),
                       std::move(k_norm)});
  }

  // forward over token ids: their embedding rows and the RoPE table rows of their positions (cos | sin, as
  // model.RotaryEmbedding.lookup splits them) are gathered here. From Python these are two torch calls
  // and their arguments, about 0.13 ms of a single sequence's decode step: cold, as the weights streamed
  // through the caches since the last step.
  at::Tensor forward_tokens(const at::Tensor& input_ids, const at::Tensor& positions,
                            const at::Tensor& embedding, const at::Tensor& rope_table,
                            const std::vector<at::Tensor>& k_caches, const std::vector<at::Tensor>& v_caches,
                            const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                            const at::Tensor& query_start_loc, const at::Tensor& context_lens,
                            const c10::optional<at::Tensor>& output_rows) const override {
    TORCH_CHECK(input_ids.dim() == 1 && input_ids.scalar_type() == at::kLong &&
                    positions.sizes() == input_ids.sizes() && positions.scalar_type() == at::kLong,
                "input_ids and positions must be int64 [num_tokens]");
    TORCH_CHECK(embedding.dim() == 2 && embedding.size(1) == hidden_ && embedding.scalar_type() == kType &&
                    embedding.is_contiguous(),
                "embedding must be contiguous ", kTypeName, " [vocab, ", hidden_, "]");
    TORCH_CHECK(rope_table.dim() == 2 && rope_table.size(1) == 2 * head_dim_ &&
                    rope_table.scalar_type() == kType && rope_table.is_contiguous(),
                "rope_table must be contiguous ", kTypeName, " [max_position, ", 2 * head_dim_, "]");
    const at::Tensor ids = input_ids.contiguous(), pos = positions.contiguous();
    const int64_t t = ids.numel(), vocab = embedding.size(0), max_position = rope_table.size(0);
    const int64_t* id = ids.const_data_ptr<int64_t>();
    const int64_t* at_pos = pos.const_data_ptr<int64_t>();
    for (int64_t i = 0; i < t; ++i) {
      TORCH_CHECK(id[i] >= 0 && id[i] < vocab, "token id ", id[i], " is outside the vocabulary (", vocab,
                  ")");
      TORCH_CHECK(at_pos[i] >= 0 && at_pos[i] < max_position, "position ", at_pos[i],
                  " is beyond the RoPE table (", max_position, " positions)");
    }
    at::Tensor x = at::empty({t, hidden_}, embedding.options());
    at::Tensor rope = at::empty({t, 1, 2 * head_dim_}, rope_table.options());
    const T* emb = embedding.const_data_ptr<T>();
    const T* table = rope_table.const_data_ptr<T>();
    T* x_rows = x.mutable_data_ptr<T>();
    T* rope_rows = rope.mutable_data_ptr<T>();
    at::parallel_for(0, t, 256, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        std::memcpy(x_rows + i * hidden_, emb + id[i] * hidden_, hidden_ * sizeof(T));
        std::memcpy(rope_rows + i * 2 * head_dim_, table + at_pos[i] * 2 * head_dim_,
                    2 * head_dim_ * sizeof(T));
      }
    });
    return forward(x, rope.narrow(2, 0, head_dim_), rope.narrow(2, head_dim_, head_dim_), k_caches, v_caches,
                   slot_mapping, block_tables, query_start_loc, context_lens, output_rows);
  }

  int64_t num_layers() const override { return static_cast<int64_t>(layers_.size()); }

 private:
  // x [T, hidden] is the embedded batch, the residual stream (updated in place); returns the final norm
  // of the last layer's output. cos and sin are rotary_write_kv_'s [T, 1, head_dim], the other arguments
  // those of rotary_write_kv_ and paged_attention_, with one K and one V cache per layer. output_rows (int64
  // indices of x's rows): the rows returned, in that order; the last layer computes attention, o and the MLP
  // for them alone (see OutputRows), and every row's K and V as always. None: all rows.
  at::Tensor forward(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                     const std::vector<at::Tensor>& k_caches, const std::vector<at::Tensor>& v_caches,
                     const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                     const at::Tensor& query_start_loc, const at::Tensor& context_lens,
                     const c10::optional<at::Tensor>& output_rows) const {
    const int64_t num_layers = static_cast<int64_t>(layers_.size());
    TORCH_CHECK(num_layers > 0, "the stack has no layers");
    TORCH_CHECK(static_cast<int64_t>(k_caches.size()) == num_layers &&
                    static_cast<int64_t>(v_caches.size()) == num_layers,
                "one K and one V cache per layer: ", num_layers, " layers, ", k_caches.size(), " and ",
                v_caches.size(), " caches");
    TORCH_CHECK(x.dim() == 2 && x.size(1) == hidden_ && x.is_contiguous() && x.scalar_type() == kType,
                "x must be contiguous ", kTypeName, " [num_tokens, ", hidden_, "]");
    for (int64_t i = 0; i < num_layers; ++i) {
      check_cache(k_caches[i], v_caches[i]);
      TORCH_CHECK(k_caches[i].scalar_type() == kType && k_caches[i].size(2) == num_kv_heads_ &&
                      k_caches[i].size(3) == head_dim_ && k_caches[i].sizes() == k_caches[0].sizes(),
                  "layer ", i, ": the caches must be ", kTypeName, " [num_blocks, block_size, ",
                  num_kv_heads_, ", ", head_dim_, "], as every layer's");
    }
    const int64_t t = x.size(0);
    TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == t, "slot_mapping must be [num_tokens]");
    const at::Tensor slots = slot_mapping.to(at::kLong).contiguous();
    const c10::optional<OutputRows> out_rows =
        output_rows.has_value()
            ? c10::make_optional(OutputRows(*output_rows, t, block_tables, query_start_loc, context_lens))
            : c10::nullopt;
    // The same for every layer: the attention's plan and the buffers' views.
    const AttentionPlan plan = plan_attention(t, num_heads_, k_caches[0], block_tables, query_start_loc,
                                              context_lens, -1, min_tile_lanes_);
    const Buffers b = buffers(t);
    at::Tensor out = out_rows.has_value() ? at::Tensor() : at::empty({t, hidden_}, x.options());
    T* const xp = x.mutable_data_ptr<T>();
    rms_norm_rows<T>(xp, hidden_, nullptr, 0, layers_[0].input_norm.const_data_ptr<T>(), b.h, hidden_, t,
                     hidden_, eps_);
    for (int64_t i = 0; i < num_layers; ++i) {
      const StackLayer& layer = layers_[i];
      at::Tensor k_cache = k_caches[i], v_cache = v_caches[i];
      linear(b.h, t, layer.qkv, hidden_, q_size_ + 2 * kv_size_, layer.qkv_bias, b.qkv);
      at::Tensor qk = b.qk;
      if (layer.q_norm.has_value())
        qk = at::cat({rms_norm(qk.narrow(1, 0, num_heads_), *layer.q_norm, eps_),
                      rms_norm(qk.narrow(1, num_heads_, num_kv_heads_), *layer.k_norm, eps_)},
                     1);
      rotary_write_kv_rows<T>(qk, b.v, cos, sin, k_cache, v_cache, slots);
      const at::Tensor q = layer.q_norm.has_value() ? qk.narrow(1, 0, num_heads_) : b.q;
      if (i + 1 == num_layers && out_rows.has_value()) {  // only the output rows go on (see OutputRows)
        at::Tensor xr = x.index_select(0, out_rows->rows);
        const int64_t r = xr.size(0);
        if (r == 0) return xr;
        const AttentionPlan rows_plan = plan_attention(r, num_heads_, k_cache, out_rows->tables,
                                                       out_rows->starts, out_rows->lens, -1, min_tile_lanes_);
        out = at::empty({r, hidden_}, x.options());
        attend_and_mlp(xr, q.index_select(0, out_rows->rows), layer, k_cache, v_cache, out_rows->tables,
                       rows_plan, b, b.attn.narrow(0, 0, r), final_norm_, out.mutable_data_ptr<T>());
        return out;
      }
      const bool last = i + 1 == num_layers;  // its output is the final norm's, the call's result
      attend_and_mlp(x, q, layer, k_cache, v_cache, block_tables, plan, b, b.attn,
                     last ? final_norm_ : layers_[i + 1].input_norm, last ? out.mutable_data_ptr<T>() : b.h);
    }
    return out;
  }

  // The rows a step's caller reads (the rows it samples from, or scores prompt tokens with): only their
  // final hidden states matter, and in the last layer a row's attention output, o and MLP feed nothing
  // but its own final state, so there they are computed for these rows alone, each as one query over its
  // sequence up to its own position (a decode row). The other rows' K and V are written as always.
  struct OutputRows {
    at::Tensor rows;                  // int64 [R], rows of the batch
    at::Tensor tables, starts, lens;  // paged_attention_'s metadata for them: one sequence each
    OutputRows(const at::Tensor& output_rows, int64_t num_tokens, const at::Tensor& block_tables,
               const at::Tensor& query_start_loc, const at::Tensor& context_lens) {
      TORCH_CHECK(output_rows.dim() == 1 && output_rows.scalar_type() == at::kLong,
                  "output_rows must be int64 [R]");
      rows = output_rows.contiguous();
      const at::Tensor starts_in = query_start_loc.contiguous(), ctx_in = context_lens.contiguous();
      const int64_t num_seqs = ctx_in.numel(), count = rows.numel();
      TORCH_CHECK(starts_in.scalar_type() == at::kInt && ctx_in.scalar_type() == at::kInt &&
                      starts_in.numel() == num_seqs + 1,
                  "query_start_loc must be int32 [S + 1] and context_lens int32 [S]");
      const int32_t* start = starts_in.const_data_ptr<int32_t>();
      const int32_t* ctx = ctx_in.const_data_ptr<int32_t>();
      TORCH_CHECK(start[0] == 0 && start[num_seqs] == num_tokens, "query_start_loc must run from 0 to ",
                  num_tokens);
      const int64_t* row = rows.const_data_ptr<int64_t>();
      at::Tensor seqs = at::empty({count}, rows.options());
      lens = at::empty({count}, ctx_in.options());
      int64_t* seq = seqs.mutable_data_ptr<int64_t>();
      int32_t* len = lens.mutable_data_ptr<int32_t>();
      for (int64_t i = 0; i < count; ++i) {
        TORCH_CHECK(row[i] >= 0 && row[i] < num_tokens, "output row ", row[i], " is outside the batch (",
                    num_tokens, " rows)");
        seq[i] = std::upper_bound(start, start + num_seqs + 1, row[i]) - start - 1;
        len[i] = ctx[seq[i]] - (start[seq[i] + 1] - static_cast<int32_t>(row[i])) + 1;  // its position + 1
      }
      tables = block_tables.index_select(0, seqs);
      starts = at::arange(count + 1, ctx_in.options());
    }
  };

  // A forward pass's intermediate rows, in workspace_: pointers to [T, width] buffers, and the views of them
  // that the RoPE and attention kernels take.
  struct Buffers {
    T *h, *qkv, *o, *act, *down, *scratch;
    at::Tensor qk, v, q;  // of qkv: [T, Hq + Hkv, D], [T, Hkv, D], [T, Hq, D]
    at::Tensor attn;      // [T, Hq, D], contiguous
  };

  // Buffers for t rows, in workspace_ (grown to fit, never shrunk: its pages are touched only as far as
  // the longest step has used them). NOTE: every forward pass uses the same workspace, so a stack serves
  // one at a time; pybind11 holds the GIL through the call.
  Buffers buffers(int64_t t) const {
    const int64_t qkv_width = q_size_ + 2 * kv_size_;
    // h, qkv, attn, o, act, down, scratch
    const int64_t widths[] = {hidden_,       qkv_width, q_size_,          hidden_,
                              intermediate_, hidden_,   2 * intermediate_};
    int64_t offsets[7], total = 0;
    for (int i = 0; i < 7; ++i) offsets[i] = total, total += t * widths[i];
    if (workspace_.numel() < total) workspace_ = at::empty({total}, final_norm_.options());
    T* const base = workspace_.mutable_data_ptr<T>();
    Buffers b;
    b.h = base + offsets[0];
    b.qkv = base + offsets[1];
    b.o = base + offsets[3];
    b.act = base + offsets[4];
    b.down = base + offsets[5];
    b.scratch = base + offsets[6];
    const at::Tensor qkv = workspace_.narrow(0, offsets[1], t * qkv_width).view({t, qkv_width});
    b.qk = qkv.narrow(1, 0, q_size_ + kv_size_).view({t, num_heads_ + num_kv_heads_, head_dim_});
    b.v = qkv.narrow(1, q_size_ + kv_size_, kv_size_).view({t, num_kv_heads_, head_dim_});
    b.q = b.qk.narrow(1, 0, num_heads_);
    b.attn = workspace_.narrow(0, offsets[2], t * q_size_).view({t, num_heads_, head_dim_});
    return b;
  }

  // A layer from its rotated queries q [R, num_heads, head_dim] on: attention over its caches with the given
  // metadata and plan into attn (a [R, num_heads, head_dim] buffer), o, the residual add into x (R rows,
  // updated in place) with the post-attention norm, the MLP, and the residual add with next_norm (the next
  // layer's input norm or the final one), written to h_out [R, hidden].
  void attend_and_mlp(at::Tensor& x, const at::Tensor& q, const StackLayer& layer, const at::Tensor& k_cache,
                      const at::Tensor& v_cache, const at::Tensor& block_tables, const AttentionPlan& plan,
                      const Buffers& b, at::Tensor attn, const at::Tensor& next_norm, T* h_out) const {
    const int64_t rows = q.size(0);
    T* const xp = x.mutable_data_ptr<T>();
    run_attention(plan, attn, q, k_cache, v_cache, block_tables, scale_);
    linear(attn.const_data_ptr<T>(), rows, layer.o, q_size_, hidden_, layer.o_bias, b.o);
    rms_norm_rows<T>(xp, hidden_, b.o, hidden_, layer.post_attention_norm.const_data_ptr<T>(), b.h, hidden_,
                     rows, hidden_, eps_);
    if constexpr (std::is_same_v<T, float>) {
      linear(b.h, rows, layer.gate_up, hidden_, 2 * intermediate_, layer.gate_up_bias, b.scratch);
      silu_mul_rows<float>(b.scratch, 2 * intermediate_, b.act, rows, intermediate_);
    } else {
      linear_silu_to(b.h, rows, layer.gate_up.const_data_ptr<T>(), hidden_ / 2, intermediate_,
                     data_or_null<T>(layer.gate_up_bias), b.act, intermediate_, b.scratch);
    }
    linear(b.act, rows, layer.down, intermediate_, hidden_, layer.down_bias, b.down);
    rms_norm_rows<T>(xp, hidden_, b.down, hidden_, next_norm.const_data_ptr<T>(), h_out, hidden_, rows,
                     hidden_, eps_);
  }

  // y [rows, n] = x [rows, k] @ W^T + bias for a W packed by pack_linear_weight (x and y contiguous).
  static void linear(const T* x, int64_t rows, const at::Tensor& packed, int64_t k, int64_t n,
                     const c10::optional<at::Tensor>& bias, T* y) {
    if constexpr (std::is_same_v<T, float>) {
      linear_f32_to(x, k, rows, packed.const_data_ptr<float>(), k, n, data_or_null<float>(bias), y, n);
    } else {
      linear_to(x, k, rows, packed.const_data_ptr<T>(), k / 2, n, data_or_null<T>(bias), y, n);
    }
  }

  static void check_packed(const at::Tensor& packed, const c10::optional<at::Tensor>& bias, int64_t n,
                           int64_t k, const char* name) {
    // bf16: [blocks, K / 2, 16, 2]; float32: [blocks, K, 16] (see pack_linear_weight)
    const bool shaped =
        std::is_same_v<T, float>
            ? packed.dim() == 3 && packed.size(1) == k && packed.size(2) == kBlock
            : packed.dim() == 4 && packed.size(1) == k / 2 && packed.size(2) == kBlock && packed.size(3) == 2;
    TORCH_CHECK(shaped && packed.size(0) == (n + kBlock - 1) / kBlock && packed.scalar_type() == kType &&
                    packed.is_contiguous(),
                name, ": expected a ", kTypeName, " weight [", n, ", ", k,
                "] packed by pack_linear_weight, got ", packed.sizes());
    check_linear_bias(bias, n, (std::string(name) + ": the ").c_str(), kType);
  }
  static void check_norm(const at::Tensor& weight, int64_t size, const char* name) {
    TORCH_CHECK(weight.dim() == 1 && weight.size(0) == size && weight.scalar_type() == kType &&
                    weight.is_contiguous(),
                name, " must be contiguous ", kTypeName, " [", size, "]");
  }

  const int64_t hidden_, intermediate_, num_heads_, num_kv_heads_, head_dim_, q_size_, kv_size_;
  const double eps_, scale_;
  const int64_t min_tile_lanes_;
  const at::Tensor final_norm_;
  std::vector<StackLayer> layers_;
  mutable at::Tensor workspace_;  // see buffers
};

}  // namespace

// ---- the interface (cpu_ops.h) ---------------------------------------------------------------------------
// The kernels above keep internal linkage (GCC inlines a local function called once, and drops the ones
// the build does not use); these forward to them.

namespace pagedserve::cpu {

at::Tensor pack_linear_weight(const at::Tensor& weight) { return ::pack_linear_weight(weight); }
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                  const c10::optional<at::Tensor>& bias) {
  return ::linear(x, packed, n, bias);
}
at::Tensor linear_silu(const at::Tensor& x, const at::Tensor& packed, int64_t size,
                       const c10::optional<at::Tensor>& bias) {
  return ::linear_silu(x, packed, size, bias);
}
bool has_linear() { return ::has_linear(); }
bool has_linear_f32() { return ::has_linear_f32(); }

// The stack of final_norm's dtype: bf16 or float32.
class DecoderStack::Impl {
 public:
  Impl(int64_t hidden, int64_t intermediate, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
       double eps, double scale, int64_t min_tile_lanes, at::Tensor final_norm) {
    const at::ScalarType dtype = final_norm.scalar_type();
    TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat,
                "DecoderStack runs bf16 or float32 models, not ", dtype);
    if (dtype == at::kFloat)
      stack = std::make_unique<DecoderStackT<float>>(hidden, intermediate, num_heads, num_kv_heads, head_dim,
                                                     eps, scale, min_tile_lanes, std::move(final_norm));
    else
      stack = std::make_unique<DecoderStackT<at::BFloat16>>(hidden, intermediate, num_heads, num_kv_heads,
                                                            head_dim, eps, scale, min_tile_lanes,
                                                            std::move(final_norm));
  }
  std::unique_ptr<StackBase> stack;
  // NOTE: the bindings release the GIL through a forward pass (so the worker's event loop writes results and
  // reads plans while it runs), and every pass uses the stack's one workspace: passes take turns.
  std::mutex forward_mutex;
};

DecoderStack::DecoderStack(int64_t hidden, int64_t intermediate, int64_t num_heads, int64_t num_kv_heads,
                           int64_t head_dim, double eps, double scale, int64_t min_tile_lanes,
                           at::Tensor final_norm)
    : impl_(std::make_unique<Impl>(hidden, intermediate, num_heads, num_kv_heads, head_dim, eps, scale,
                                   min_tile_lanes, std::move(final_norm))) {}
DecoderStack::~DecoderStack() = default;

void DecoderStack::add_layer(at::Tensor qkv, c10::optional<at::Tensor> qkv_bias, at::Tensor o,
                             c10::optional<at::Tensor> o_bias, at::Tensor gate_up,
                             c10::optional<at::Tensor> gate_up_bias, at::Tensor down,
                             c10::optional<at::Tensor> down_bias, at::Tensor input_norm,
                             at::Tensor post_attention_norm, c10::optional<at::Tensor> q_norm,
                             c10::optional<at::Tensor> k_norm) {
  impl_->stack->add_layer(std::move(qkv), std::move(qkv_bias), std::move(o), std::move(o_bias),
                          std::move(gate_up), std::move(gate_up_bias), std::move(down), std::move(down_bias),
                          std::move(input_norm), std::move(post_attention_norm), std::move(q_norm),
                          std::move(k_norm));
}
at::Tensor DecoderStack::forward_tokens(const at::Tensor& input_ids, const at::Tensor& positions,
                                        const at::Tensor& embedding, const at::Tensor& rope_table,
                                        const std::vector<at::Tensor>& k_caches,
                                        const std::vector<at::Tensor>& v_caches,
                                        const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                                        const at::Tensor& query_start_loc, const at::Tensor& context_lens,
                                        const c10::optional<at::Tensor>& output_rows) const {
  const std::lock_guard<std::mutex> turn(impl_->forward_mutex);
  return impl_->stack->forward_tokens(input_ids, positions, embedding, rope_table, k_caches, v_caches,
                                      slot_mapping, block_tables, query_start_loc, context_lens, output_rows);
}
int64_t DecoderStack::num_layers() const { return impl_->stack->num_layers(); }

}  // namespace pagedserve::cpu
