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

#include "ops.h"

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

template <typename T>
inline void load_row(const T* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

#if defined(__AVX2__)
// 8 bf16 or float values, widened to float32.
inline __m256 load8(const at::BFloat16* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
#endif

#if defined(__AVX2__)
// bf16 rows widened 8 at a time (a 16-bit shift), which GCC leaves to c10's scalar conversion (on AVX-512
// too: the tiled attention's K and V blocks without BF16, the linear's rows of x).
inline void load_row(const at::BFloat16* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, load8(src + i));
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}
#endif

inline float dot(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  float sum = 0.f;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
  sum = _mm512_reduce_add_ps(acc);
  // NOTE: no `omp simd reduction` on the tail: GCC then sums its sixteen lanes one by one after the
  // loop even when the loop does not run.
  for (; i < n; ++i) sum += a[i] * b[i];
#else
#pragma omp simd reduction(+ : sum)
  for (int64_t j = i; j < n; ++j) sum += a[j] * b[j];
#endif
  return sum;
}

// exp of n floats in place: 2^k * exp(r) with k = round(x / ln 2), |r| <= ln 2 / 2, and the Cephes
// polynomial for exp(r) (within 2 ulp of std::exp). Written so the compiler vectorises the loop: a scalar
// std::exp per score would cost more than the whole attention. Underflows to 0 below -87.3. The constants
// serve the scalar loop (exp_inplace) and the AVX-512 and AVX2 forms alike: x clamped to [kExpMin, kExpMax],
// r = x - k * kLn2Hi + k * kLn2Lo (ln 2 in two parts), exp(r) = 1 + r + r^2 * p(r), p's coefficients from
// the highest power down.
constexpr float kExpMin = -87.3f, kExpMax = 88.3f, kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = 2.12194440e-4f;
constexpr float kExpPoly[] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                              4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

#if defined(__AVX512F__)
// Always inlined: the tiled kernel's calls (4 a pair of positions) otherwise spill its live registers, all
// caller-saved; one layer of SmolLM2's attention in L2, alternating in one process: 15 queries after 685
// positions 0.98-0.99x as long, a prompt of 500 tokens 0.96-0.97x.
__attribute__((always_inline)) inline __m512 exp512(__m512 in) {
  const __m512 lo = _mm512_set1_ps(kExpMin), hi = _mm512_set1_ps(kExpMax);
  const __m512 v = _mm512_min_ps(_mm512_max_ps(in, lo), hi);
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(v, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(kLn2Hi), v);
  r = _mm512_fmadd_ps(k, _mm512_set1_ps(kLn2Lo), r);
  __m512 p = _mm512_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPoly[i]));
  p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.f));
  const __mmask16 underflow = _mm512_cmp_ps_mask(in, lo, _CMP_LT_OQ);
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~underflow), _mm512_scalef_ps(p, k));
}
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
  int64_t start = 0;
#if defined(__AVX512F__)
  for (; start + 16 <= n; start += 16) _mm512_storeu_ps(x + start, exp512(_mm512_loadu_ps(x + start)));
#elif defined(__AVX2__) && defined(__FMA__)
  for (; start + 8 <= n; start += 8) _mm256_storeu_ps(x + start, exp256(_mm256_loadu_ps(x + start)));
#endif
#pragma omp simd
  for (int64_t i = start; i < n; ++i) {
    const float v = std::min(std::max(x[i], kExpMin), kExpMax);
    const float k = std::floor(v * kLog2e + 0.5f);
    float r = v - k * kLn2Hi;
    r = r + k * kLn2Lo;
    float p = kExpPoly[0];
    for (int j = 1; j < 6; ++j) p = p * r + kExpPoly[j];
    p = p * r * r + r + 1.f;
    const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
    float scale;
    std::memcpy(&scale, &bits, sizeof(scale));
    x[i] = x[i] < kExpMin ? 0.f : p * scale;
  }
}

// Rounds a float to T and back: where the reference formulas hold a value in the model dtype.
template <typename T>
inline float round_to(float x) {
  return static_cast<float>(static_cast<T>(x));
}

// A KV cache is [num_blocks, block_size, num_kv_heads, head_dim], in one of two layouts, each block's
// elements together: token-major (contiguous: a position's kv heads side by side) or head-major (a view of a
// contiguous [num_blocks, num_kv_heads, block_size, head_dim]: a kv head's rows of a block side by side,
// which the CPU pool uses, see worker_svc/kv_cache.py). The kernels read either through the strides.
bool is_cache_layout(const at::Tensor& cache) {
  if (cache.dim() != 4) return false;
  const int64_t block_size = cache.size(1), heads = cache.size(2), head_dim = cache.size(3);
  const bool token_major = cache.stride(1) == heads * head_dim && cache.stride(2) == head_dim;
  const bool head_major = cache.stride(1) == head_dim && cache.stride(2) == block_size * head_dim;
  return cache.stride(3) == 1 && cache.stride(0) == block_size * heads * head_dim &&
         (token_major || head_major);
}

void check_cache(const at::Tensor& k_cache, const at::Tensor& v_cache) {
  TORCH_CHECK(k_cache.dim() == 4, "k_cache must be [num_blocks, block_size, num_kv_heads, head_dim]");
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes(), "v_cache ", v_cache.sizes(), " != k_cache ",
              k_cache.sizes());
  TORCH_CHECK(is_cache_layout(k_cache) && v_cache.strides() == k_cache.strides(),
              "the KV cache must be contiguous, or a view of a contiguous [num_blocks, num_kv_heads, "
              "block_size, head_dim] tensor (strides ",
              k_cache.strides(), " and ", v_cache.strides(), ")");
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type(), "k_cache and v_cache differ in dtype");
}

// ---- paged attention ------------------------------------------------------------------------------------

#if defined(__AVX512F__)
// Calls f(std::integral_constant<int, size / 16>) for the head sizes the AVX-512 loops are instantiated
// for (so their registers are a fixed array); false for any other size.
template <typename F>
inline bool with_head_chunks(int64_t size, F&& f) {
  switch (size) {
    case 64:
      return f(std::integral_constant<int, 4>{}), true;
    case 80:
      return f(std::integral_constant<int, 5>{}), true;
    case 96:
      return f(std::integral_constant<int, 6>{}), true;
    case 128:
      return f(std::integral_constant<int, 8>{}), true;
    case 256:
      return f(std::integral_constant<int, 16>{}), true;
    default:
      return false;
  }
}
#endif

// Where a prefetched line goes: into L1 for reading (prefetcht0, as __builtin_prefetch(p, 0, 3)), into L2
// only for reading (prefetcht1, as (p, 0, 2)), or into L1 for writing (prefetchw).
enum class Fetch { kRead, kReadL2, kWrite };

// One line on its way to the cache. On x86-64 an asm statement: GCC gives __builtin_prefetch no side
// effects, so a function that only prefetches (prefetch_tile_block, prefetch_tile) was found to be const and
// its calls deleted, and the tiled kernel ran with no prefetch at all. 15 queries after 685 cached
// positions, 30 layers' caches (one read from memory per layer, scattered blocks, 2-core Zen 5,
// alternating): 166-241 -> 96-127 us a layer. Into L1 rather than L2 (prefetcht2, before): the same,
// alternating in one process, 99.7 -> 96.0 and 158.6 -> 110.2 us; decode steps 0.97-0.98x as long (one
// sequence at 512 and 2048 positions, 16 at 400).
inline void prefetch_line(const char* p, Fetch kind) {
#if defined(__x86_64__)
  switch (kind) {
    case Fetch::kRead:
      asm volatile("prefetcht0 %0" : : "m"(*p));
      break;
    case Fetch::kReadL2:
      asm volatile("prefetcht1 %0" : : "m"(*p));
      break;
    case Fetch::kWrite:
      asm volatile("prefetchw %0" : : "m"(*p));
      break;
  }
#else
  switch (kind) {
    case Fetch::kRead:
      __builtin_prefetch(p, 0, 3);
      break;
    case Fetch::kReadL2:
      __builtin_prefetch(p, 0, 2);
      break;
    case Fetch::kWrite:
      __builtin_prefetch(p, 1, 1);
      break;
  }
#endif
}

inline void prefetch_lines(const void* ptr, int64_t bytes, Fetch kind) {
  const char* p = static_cast<const char*>(ptr);
  for (int64_t off = 0; off < bytes; off += 64) prefetch_line(p + off, kind);
}

// Brings the bytes [ptr, ptr + bytes) towards the cache ahead of use: the next block of a sequence lies
// anywhere in the pool, so the hardware prefetcher cannot guess it.
inline void prefetch(const void* ptr, int64_t bytes) { prefetch_lines(ptr, bytes, Fetch::kRead); }

// prefetch into L2 only, where a decode row's next block goes (see FetchShare).
inline void prefetch_l2(const void* ptr, int64_t bytes) { prefetch_lines(ptr, bytes, Fetch::kReadL2); }

// prefetch for lines about to be written (owned by this core when the stores come).
inline void prefetch_write(const void* ptr, int64_t bytes) { prefetch_lines(ptr, bytes, Fetch::kWrite); }

// Whether reads ahead go into L2 only (prefetcht1) rather than into L1 where both were measured: the tiled
// attention's next block (prefetch_tile_block) and the bf16 linear's decode streams (block_kernel_streams).
// Everywhere but on a Zen 5 (AMD family 26), which did better with L1 (see prefetch_line, and
// kFourStreamPrefetchBytes). On a 2-core Zen 4 (family 25) the L1's misses in flight are the limit, as for
// the decode attention's shares (see FetchShare), and the lines come from L2 in time: the tiled attention,
// 30 layers' caches from memory, alternating in one process, 15 queries after 700 cached positions (a
// cached request's last tokens) 212 -> 147, 193 -> 145 and, blocks scattered, 229 -> 181 us a layer
// (0.70-0.79x); 64 queries after 1936 0.78-0.91x; a 500-token prompt 0.98-1.01x. (Unmeasured for the
// tiled kernel on a Zen 3, family 25 too, whose AVX2 linear and decode attention prefetch into L2 already.)
inline bool reads_ahead_into_l2() {
#if defined(__x86_64__)
  static const bool into_l2 = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (__get_cpuid(0, &eax, &ebx, &ecx, &edx) == 0) return true;
    const bool amd = ebx == 0x68747541 && edx == 0x69746e65 && ecx == 0x444d4163;  // "AuthenticAMD"
    if (!amd || __get_cpuid(1, &eax, &ebx, &ecx, &edx) == 0) return true;
    const unsigned base = (eax >> 8) & 0xf, family = base == 0xf ? base + ((eax >> 20) & 0xff) : base;
    return family != 26;
  }();
  return into_l2;
#else
  return true;
#endif
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// ---- AMX ------------------------------------------------------------------------------------------------
//
// On CPUs with AMX (Intel from Sapphire Rapids), a core multiplies a 16 x 32 bf16 tile by a 32 x 16 tile in
// one instruction (tdpbf16ps: 16 x 16 float32 sums, each adding 32 products), about six times the products
// of vdpbf16ps in the same time. The linear layers (linear_amx) and the tiled attention take it.

// A tile configuration (palette 1): tile t has rows[t] rows of colsb[t] bytes.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  constexpr TileConfig(std::initializer_list<std::pair<int, int>> tiles) {
    int t = 0;
    for (const auto& [r, c] : tiles) rows[t] = static_cast<uint8_t>(r), colsb[t++] = static_cast<uint16_t>(c);
  }
};

// Linux hands a process the AMX tile state (8 KB more in each thread's saved state) only once asked
// (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA); before that a tile instruction faults.
bool amx_permitted() {
  static const bool permitted = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return permitted;
}

// Whether the kernels may take AMX (set_amx_enabled: for benchmarks and tests that compare the paths).
std::atomic<bool> amx_switch{true};

inline bool amx_enabled() { return amx_switch.load(std::memory_order_relaxed) && amx_permitted(); }
#endif  // __AMX_TILE__ && __AMX_BF16__

// The bytes [at, at + bytes) (the next block of the cache) prefetched a share at a time over `steps` steps
// of a kernel, so that the prefetches do not queue up behind each other in one burst: issued back to back
// before each visit of a block, a decode row's prefetches held half of `perf`'s samples of the attention's
// own code (beside its kernels). One layer of SmolLM2's attention, blocks scattered, caches in huge pages,
// alternating: 24 decode rows over 300 positions 692 -> 579 and 456 -> 367 us, 8 rows 183 -> 151 and 189 ->
// 163 us, one row over 2048 positions 143 -> 118 and 152 -> 124 us; the same bits. Prompt rows, whose
// shares are small (below kFetchBurstBytes), prefetch before each visit as before: shared out, they ran
// 3-6 % slower. The same on AVX-512 BF16 (30 layers, each read from memory, 2-core Zen 5, alternating in
// one process): 24 sequences of 300 positions 218 -> 203 and 279 -> 227 us a layer, 8 of 800 180 -> 166
// and 235 -> 197, one of 2048 83 -> 73; with the caches in L3, 24 of 300 0.96x as long. (Measured with a
// share of lines interleaved across the rows; this even split, alternating builds three times: 24 of 300
// scattered 179-214 against 191-202 us, 16 of 400 in order and one of 2048 even.) Where a sequence's next
// block is the one after it in the pool, the Zen 5 did better with the burst (16 sequences of 400
// positions: 132 and 125 us a layer against 143 and 138 shared out), but on a 2-core Zen 4 (family 25) the
// burst's prefetches stall, the miss queue full (`perf annotate`: a fifth of paged_attention_impl's own
// samples on the instruction after its prefetch loop), and shared out they run 0.79-0.97x as long (30
// layers, each from memory, blocks in order, alternating builds: 16 sequences of 400 positions 296-299 ->
// 258 us a layer, 4 of 1024 194-197 -> 153-167, one of 1024 45-57 -> 41-51, one of 2048 87-118 -> 85-91;
// scattered, 16 of 400 438-440 against 408-440, the same path as before): bench_worker's decode steps of 16
// sequences at 512 / 1024 / 2048 positions 27.8-31.4 / 39.6-40.4 / 55.8-66.9 -> 22.1-23.2 / 31.4-31.5
// / 48.0-50.8 ms. Every decode row now shares its prefetches out, wherever the next block lies.
// The shares go into L2 (prefetcht1) rather than L1: on the Zen 4 the L1's misses in flight are the limit,
// and the block is read from L2 fast enough. 30 layers from memory, alternating builds, us a layer: 16
// sequences of 400 positions 221-231 -> 197, scattered 387-427 -> 295-324, 4 of 1024 136-161 -> 130-131,
// one of 2048 70-76 -> 63-71, one of 512 and of 1024 even; bench_worker's decode steps of 16 sequences at
// 512 / 1024 / 2048 positions 23.3-24.4 / 31.3-32.6 / 45.0-51.5 -> 21.1-21.4 / 28.3-32.1 / 43.0-49.1 ms,
// one sequence's within the copy's noise. (On the Zen 5, with the L1 burst for blocks in order, decode
// steps ran 0.97-0.98x as long into L1: see prefetch_line; unmeasured there with these shares.)
struct FetchShare {
  const char* at;
  int64_t bytes, per_step;
  FetchShare(const char* at, int64_t bytes, int64_t steps)
      : at(at),
        bytes(bytes),
        per_step(bytes > 0 ? ((bytes + 63) / 64 + steps - 1) / std::max<int64_t>(1, steps) * 64 : 0) {}
  void step() {
    const int64_t now = std::min(per_step, bytes);
    prefetch_l2(at, now);
    at += now, bytes -= now;
  }
  void rest() {
    prefetch_l2(at, bytes);
    bytes = 0;
  }
};

// How many blocks ahead of the one computed the attention prefetches: the next but one. One block ahead
// was too near on a 2-core Zen 4 (family 25), where a block's share came in after its visit began: 30
// layers from memory, blocks in order, alternating in one process, us a layer: one sequence of 2048
// positions 69.7 -> 61.2, of 512 20.2 -> 18.5, 16 of 400 230 -> 211, 4 of 1024 115 -> 100, 64 of 192 377
// -> 353 (0.86-0.92x); scattered blocks 0.98-1.01x; three or four blocks ahead 0.88-0.97x, six 0.92-1.01x.
// Whole decode steps (bench_worker's plans, alternating step by step): one sequence at 2048 positions
// 0.95x as long, at 512 0.99x, 16 at 512 0.94x, 4 at 1024 0.96x.
constexpr int64_t kFetchAhead = 2;

// Up to this many bytes of the next block are prefetched before a visit (a prompt row's share); more (a
// decode row's) are shared out over the kernels' steps (see FetchShare).
constexpr int64_t kFetchBurstBytes = 1024;

// out[j] = dot(q, rows + j * stride) for j < n: the scores of one query against a block's K rows.
#if defined(__AVX512F__)
// Sums each of 16 vectors into one lane of the result (lane j = sum of v[j]): a transposing tree of
// shuffles and adds, about 3 instructions per vector instead of a full horizontal sum each.
inline __m512 sum_lanes16(const __m512* v) {
  __m512 t[8], u[4], w[2];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: (a0+a2, b0+b2, a1+a3, b1+b3)
    t[i] =
        _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: the lane sums of 4 vectors
    const __m512d a = _mm512_castps_pd(t[2 * i]), b = _mm512_castps_pd(t[2 * i + 1]);
    u[i] =
        _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  for (int i = 0; i < 2; ++i)  // 128-bit lanes (0+1, 2+3) of two such
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1)));
}
#endif

#if defined(__AVX512F__)
template <int kChunks>
inline void block_scores_avx512(const float* q, const float* rows, int64_t stride, int64_t n, float* out) {
  __m512 qv[kChunks];
  for (int c = 0; c < kChunks; ++c) qv[c] = _mm512_loadu_ps(q + 16 * c);
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const int64_t m = std::min<int64_t>(16, n - j0);
    __m512 partial[16];
    for (int j = 0; j < 16; ++j) {
      // Lanes past m repeat the last row and are never stored.
      const float* row = rows + (j0 + std::min<int64_t>(j, m - 1)) * stride;
      __m512 acc = _mm512_mul_ps(qv[0], _mm512_loadu_ps(row));
      for (int c = 1; c < kChunks; ++c) acc = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(row + 16 * c), acc);
      partial[j] = acc;
    }
    _mm512_mask_storeu_ps(out + j0, static_cast<__mmask16>((1u << m) - 1), sum_lanes16(partial));
  }
}
#endif

#if defined(__AVX512BF16__)
// block_scores of a bf16 query straight from bf16 K rows (no widening): each vdpbf16ps multiplies 32 head
// dims of the query and a row (every product exact in float32, summed in float32); out is scaled after.
template <int kVectors>
inline void block_scores_bf16_avx512(const at::BFloat16* q, const at::BFloat16* rows, int64_t stride,
                                     int64_t n, float scale, float* out, const char* fetch = nullptr,
                                     int64_t fetch_bytes = 0) {
  FetchShare ahead(fetch, fetch_bytes, 16);  // over the first 16 rows
  __m512bh qv[kVectors];
  for (int c = 0; c < kVectors; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(q + 32 * c);
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const int64_t m = std::min<int64_t>(16, n - j0);
    __m512 partial[16];
    for (int j = 0; j < 16; ++j) {
      // Lanes past m repeat the last row and are never stored.
      const at::BFloat16* row = rows + (j0 + std::min<int64_t>(j, m - 1)) * stride;
      ahead.step();
      __m512 acc = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[0], (__m512bh)_mm512_loadu_si512(row));
      for (int c = 1; c < kVectors; ++c)
        acc = _mm512_dpbf16_ps(acc, qv[c], (__m512bh)_mm512_loadu_si512(row + 32 * c));
      partial[j] = acc;
    }
    _mm512_mask_storeu_ps(out + j0, static_cast<__mmask16>((1u << m) - 1),
                          _mm512_mul_ps(sum_lanes16(partial), _mm512_set1_ps(scale)));
  }
  ahead.rest();
}

// block_scores_bf16 for G query vectors of head size 64 at once (q_g at q + 64 g, its scores at out +
// g * out_stride): each K row is loaded once for all of them, and the sums of four rows are reduced as
// soon as they are done (sum_lanes16's first two levels), so the registers hold G x 4 sums, not G x 16.
// The same sums in the same order as block_scores_bf16_avx512<2>: the same bits.
template <int G>
inline void group_scores_bf16_64(const at::BFloat16* q, const at::BFloat16* rows, int64_t stride, int64_t n,
                                 float scale, float* out, int64_t out_stride, const char* fetch,
                                 int64_t fetch_bytes) {
  FetchShare ahead(fetch, fetch_bytes, 16);  // over the first 16 rows
  __m512bh q0[G], q1[G];
  for (int g = 0; g < G; ++g) {
    q0[g] = (__m512bh)_mm512_loadu_si512(q + 64 * g);
    q1[g] = (__m512bh)_mm512_loadu_si512(q + 64 * g + 32);
  }
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const int64_t m = std::min<int64_t>(16, n - j0);
    // Per vector, rows 4k .. 4k + 3 summed pairwise per 128-bit lane (quad), and two such quads' 128-bit
    // lanes summed (half): each level reduced as soon as its inputs are done, so that no more than G x 4
    // sums, G quads and G halves are live at once (with all G x 4 quads kept to the end, they spilled).
    __m512 quad[G][2], half[G][2];
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) {
      __m512 acc[G][4];
#pragma GCC unroll 4
      for (int r = 0; r < 4; ++r) {
        const int j = 4 * k + r;
        // Lanes past m repeat the last row and are never stored.
        const at::BFloat16* row = rows + (j0 + std::min<int64_t>(j, m - 1)) * stride;
        ahead.step();
        const __m512bh x0 = (__m512bh)_mm512_loadu_si512(row), x1 = (__m512bh)_mm512_loadu_si512(row + 32);
        for (int g = 0; g < G; ++g)
          acc[g][r] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), q0[g], x0), q1[g], x1);
      }
      for (int g = 0; g < G; ++g) {
        const __m512 t0 =
            _mm512_add_ps(_mm512_unpacklo_ps(acc[g][0], acc[g][1]), _mm512_unpackhi_ps(acc[g][0], acc[g][1]));
        const __m512 t1 =
            _mm512_add_ps(_mm512_unpacklo_ps(acc[g][2], acc[g][3]), _mm512_unpackhi_ps(acc[g][2], acc[g][3]));
        const __m512d a = _mm512_castps_pd(t0), b = _mm512_castps_pd(t1);
        quad[g][k % 2] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                                       _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
        if (k % 2 == 1)
          half[g][k / 2] =
              _mm512_add_ps(_mm512_shuffle_f32x4(quad[g][0], quad[g][1], _MM_SHUFFLE(2, 0, 2, 0)),
                            _mm512_shuffle_f32x4(quad[g][0], quad[g][1], _MM_SHUFFLE(3, 1, 3, 1)));
      }
    }
    for (int g = 0; g < G; ++g) {
      const __m512 sums =
          _mm512_add_ps(_mm512_shuffle_f32x4(half[g][0], half[g][1], _MM_SHUFFLE(2, 0, 2, 0)),
                        _mm512_shuffle_f32x4(half[g][0], half[g][1], _MM_SHUFFLE(3, 1, 3, 1)));
      _mm512_mask_storeu_ps(out + g * out_stride + j0, static_cast<__mmask16>((1u << m) - 1),
                            _mm512_mul_ps(sums, _mm512_set1_ps(scale)));
    }
  }
  ahead.rest();
}

// group_scores_bf16_64 for any number of vectors (q_g 64 apart): three at a time, then the one or two left;
// the first run brings the share of the next block (as group_scores on AVX2). 24 sequences of 300 positions
// with the caches in L3 (SmolLM2's group of 3), alternating in one process: the decode attention 0.84x as
// long as with one vector at a time; from memory 0.95-0.99x.
inline void group_scores_bf16_64(const at::BFloat16* q, int64_t vectors, const at::BFloat16* rows,
                                 int64_t stride, int64_t n, float scale, float* out, int64_t out_stride,
                                 const char* fetch, int64_t fetch_bytes) {
  for (int64_t g = 0; g < vectors; g += 3, fetch_bytes = 0) {
    const at::BFloat16* qg = q + 64 * g;
    float* og = out + g * out_stride;
    const int64_t run = std::min<int64_t>(3, vectors - g);
    if (run == 3)
      group_scores_bf16_64<3>(qg, rows, stride, n, scale, og, out_stride, fetch, fetch_bytes);
    else if (run == 2)
      group_scores_bf16_64<2>(qg, rows, stride, n, scale, og, out_stride, fetch, fetch_bytes);
    else
      group_scores_bf16_64<1>(qg, rows, stride, n, scale, og, out_stride, fetch, fetch_bytes);
  }
}

// Head sizes block_scores_bf16 takes.
inline bool has_bf16_scores(int64_t size) {
  return size == 32 || size == 64 || size == 96 || size == 128 || size == 256;
}

inline void block_scores_bf16(const at::BFloat16* q, const at::BFloat16* rows, int64_t stride, int64_t n,
                              int64_t size, float scale, float* out, const char* fetch = nullptr,
                              int64_t fetch_bytes = 0) {
  switch (size) {
    case 32:
      return block_scores_bf16_avx512<1>(q, rows, stride, n, scale, out, fetch, fetch_bytes);
    case 64:
      return block_scores_bf16_avx512<2>(q, rows, stride, n, scale, out, fetch, fetch_bytes);
    case 96:
      return block_scores_bf16_avx512<3>(q, rows, stride, n, scale, out, fetch, fetch_bytes);
    case 128:
      return block_scores_bf16_avx512<4>(q, rows, stride, n, scale, out, fetch, fetch_bytes);
    default:
      return block_scores_bf16_avx512<8>(q, rows, stride, n, scale, out, fetch, fetch_bytes);
  }
}
#endif

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512BF16__)
// Lane j < 4 of the result: the sum of the 8 lanes of v[j].
inline __m128 sum_lanes4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 sums = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(sums), _mm256_extractf128_ps(sums, 1));
}

// block_scores on AVX2 for a head size that is a multiple of 8, for the G query vectors of a kv head at
// once (q_g size floats apart; out[g * out_stride + j] = q_g . row j): four rows at a time, each row's
// products summed in 8 lanes and the four reduced together (the plain loop reduces every dot product on
// its own). Rows of R = float come from the tile, rows of R = bf16 straight from the cache, widened as
// they are loaded: each row is loaded once for all G vectors. 4G sums + G query chunks + a row: 16
// registers at G = 3.
template <int G, typename R, bool kFetch = false>
inline void group_scores_avx2(const float* q, int64_t size, const R* rows, int64_t stride, int64_t n,
                              float* out, int64_t out_stride, const char* fetch = nullptr,
                              int64_t fetch_bytes = 0) {
  FetchShare ahead(fetch, kFetch ? fetch_bytes : 0, n / 4);
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    if constexpr (kFetch) ahead.step();
    const R* r = rows + j * stride;
    __m256 acc[G][4];
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) acc[g][0] = acc[g][1] = acc[g][2] = acc[g][3] = _mm256_setzero_ps();
    for (int64_t d = 0; d < size; d += 8) {
      // The G query chunks held in registers for the 4 rows: left to itself GCC folds them into the
      // multiply-adds as memory operands, 4G loads beside the rows' 4 instead of G, more than the two
      // load ports keep up with. One layer of SmolLM2's attention, one row over 2048 positions,
      // alternating (four pairs): 78.0 -> 74.4 us with the caches in L1, 101.5 -> 97.0 us from memory.
      __m256 q0 = _mm256_loadu_ps(q + d), q1 = q0, q2 = q0;
      if constexpr (G > 1) q1 = _mm256_loadu_ps(q + size + d);
      if constexpr (G > 2) q2 = _mm256_loadu_ps(q + 2 * size + d);
      asm("" : "+x"(q0), "+x"(q1), "+x"(q2));
      const __m256 qv[3] = {q0, q1, q2};
#pragma GCC unroll 4
      for (int p = 0; p < 4; ++p) {
        const __m256 k = load8(r + p * stride + d);
#pragma GCC unroll 4
        for (int g = 0; g < G; ++g) acc[g][p] = _mm256_fmadd_ps(qv[g], k, acc[g][p]);
      }
    }
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g)
      _mm_storeu_ps(out + g * out_stride + j, sum_lanes4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]));
  }
  if constexpr (kFetch) ahead.rest();
  for (; j < n; ++j) {  // the last rows of a block, through dot (bf16 rows widened into a thread's buffer)
    const float* row = nullptr;
    if constexpr (std::is_same_v<R, float>) {
      row = rows + j * stride;
    } else {
      thread_local std::vector<float> wide;
      wide.resize(size);
      load_row(rows + j * stride, wide.data(), size);
      row = wide.data();
    }
    for (int g = 0; g < G; ++g) out[g * out_stride + j] = dot(q + g * size, row, size);
  }
}
#endif

inline void block_scores(const float* q, const float* rows, int64_t stride, int64_t n, int64_t size,
                         float* out) {
#if defined(__AVX512F__)
  if (with_head_chunks(
          size, [&](auto chunks) { block_scores_avx512<decltype(chunks)::value>(q, rows, stride, n, out); }))
    return;
#elif defined(__AVX2__) && defined(__FMA__)
  if (size % 8 == 0) return group_scores_avx2<1>(q, size, rows, stride, n, out, 0);
#endif
  for (int64_t j = 0; j < n; ++j) out[j] = dot(q, rows + j * stride, size);
}

// exp(s - max(s)) in place over n scores; returns their sum (softmax without the division), and the max in
// *max_out if given.
inline float exp_shifted_sum(float* s, int64_t n, float* max_out = nullptr) {
  float max = -std::numeric_limits<float>::infinity(), sum = 0.f;
  int64_t i = 0;
#if defined(__AVX512F__)
  // The last n % 16 scores too, masked, where they were scalar code: decode attention of 24 sequences of
  // 300 positions with the caches in L3, alternating in one process, 0.96x as long.
  __m512 vmax = _mm512_set1_ps(max);
  for (; i + 16 <= n; i += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(s + i));
  const __mmask16 tail = static_cast<__mmask16>((1u << (n - i)) - 1);
  vmax = _mm512_max_ps(vmax, _mm512_mask_loadu_ps(vmax, tail, s + i));
  i = n;
  max = _mm512_reduce_max_ps(vmax);
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 vmax = _mm256_set1_ps(max);
  for (; i + 8 <= n; i += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(s + i));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vmax);
  max = *std::max_element(lanes, lanes + 8);
#endif
  for (; i < n; ++i) max = std::max(max, s[i]);
  if (max_out != nullptr) *max_out = max;
  // exp(s - max), stored and summed in one pass (the same bits as subtracting, exp_inplace and summing,
  // three passes: one row over 2048 positions as above, 74.4 -> 70.6 us in L1, 97.0 -> 93.0 from memory).
  i = 0;
#if defined(__AVX512F__)
  __m512 vsum = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(s + i), _mm512_set1_ps(max)));
    _mm512_storeu_ps(s + i, e);
    vsum = _mm512_add_ps(vsum, e);
  }
  if (i < n) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m512 e = _mm512_maskz_mov_ps(
        tail, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + i), _mm512_set1_ps(max))));
    _mm512_mask_storeu_ps(s + i, tail, e);
    vsum = _mm512_add_ps(vsum, e);
    i = n;
  }
  sum = _mm512_reduce_add_ps(vsum);
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 vsum = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + i), _mm256_set1_ps(max)));
    _mm256_storeu_ps(s + i, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  const __m128 half = _mm_add_ps(_mm256_castps256_ps128(vsum), _mm256_extractf128_ps(vsum, 1));
  const __m128 pair = _mm_add_ps(half, _mm_movehl_ps(half, half));
  sum = _mm_cvtss_f32(_mm_add_ss(pair, _mm_movehdup_ps(pair)));
#endif
  for (int64_t p = i; p < n; ++p) s[p] -= max;
  exp_inplace(s + i, n - i);
  for (; i < n; ++i) sum += s[i];
  return sum;
}

// acc[0 .. size) += sum over j < n of w[j] * rows[j * stride + (0 .. size)]: one block's V rows, weighted.
#if defined(__AVX512F__)
template <int kChunks>
inline void accumulate_rows_avx512(float* acc, const float* w, const float* rows, int64_t stride, int64_t n) {
  // The accumulator stays in registers over the block's rows instead of a load and store per row, in
  // two copies (even and odd rows) so that twice as many multiply-adds are in flight.
  __m512 a[kChunks], b[kChunks];
  for (int c = 0; c < kChunks; ++c) a[c] = _mm512_loadu_ps(acc + 16 * c), b[c] = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 2 <= n; j += 2) {
    const __m512 w0 = _mm512_set1_ps(w[j]), w1 = _mm512_set1_ps(w[j + 1]);
    const float* r0 = rows + j * stride;
    const float* r1 = r0 + stride;
    for (int c = 0; c < kChunks; ++c) {
      a[c] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(r0 + 16 * c), a[c]);
      b[c] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(r1 + 16 * c), b[c]);
    }
  }
  if (j < n) {
    const __m512 w0 = _mm512_set1_ps(w[j]);
    for (int c = 0; c < kChunks; ++c)
      a[c] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(rows + j * stride + 16 * c), a[c]);
  }
  for (int c = 0; c < kChunks; ++c) _mm512_storeu_ps(acc + 16 * c, _mm512_add_ps(a[c], b[c]));
}
#endif

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512BF16__)
// accumulate_rows on AVX2 for a head size that is a multiple of 8, for the G query vectors of a kv head at
// once: acc_g[0 .. 8C) += sum over j < n of w[g * w_stride + j] * row j[0 .. 8C) (acc_g size floats apart),
// the sums held in registers over the block's rows (the plain loop loads and stores acc for every row).
// Rows of R = float come from the tile, rows of R = bf16 straight from the cache, each loaded once for all
// G vectors. GC sums + G weights + a row: 16 registers at G = 3, C = 4. C is a template argument: with a
// count known only at run time GCC kept the sums on the stack, a store and a compare per register and row.
template <int G, int C, typename R, bool kFetch = false>
inline void group_values_avx2(float* acc, int64_t size, const float* w, int64_t w_stride, const R* rows,
                              int64_t stride, int64_t n, const char* fetch = nullptr,
                              int64_t fetch_bytes = 0) {
  FetchShare ahead(fetch, kFetch ? fetch_bytes : 0, n);
  __m256 a[G][C];
#pragma GCC unroll 4
  for (int g = 0; g < G; ++g)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) a[g][c] = _mm256_loadu_ps(acc + g * size + 8 * c);
  for (int64_t j = 0; j < n; ++j) {
    if constexpr (kFetch) ahead.step();
    __m256 wj[G];
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) wj[g] = _mm256_set1_ps(w[g * w_stride + j]);
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      const __m256 v = load8(rows + j * stride + 8 * c);
#pragma GCC unroll 4
      for (int g = 0; g < G; ++g) a[g][c] = _mm256_fmadd_ps(wj[g], v, a[g][c]);
    }
  }
  if constexpr (kFetch) ahead.rest();
#pragma GCC unroll 4
  for (int g = 0; g < G; ++g)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) _mm256_storeu_ps(acc + g * size + 8 * c, a[g][c]);
}

inline void accumulate_rows_avx2(float* acc, const float* w, const float* rows, int64_t stride, int64_t n,
                                 int64_t size) {
  using Chunks =
      void (*)(float*, int64_t, const float*, int64_t, const float*, int64_t, int64_t, const char*, int64_t);
  static constexpr std::array<Chunks, 8> kChunks = {
      &group_values_avx2<1, 1, float>, &group_values_avx2<1, 2, float>, &group_values_avx2<1, 3, float>,
      &group_values_avx2<1, 4, float>, &group_values_avx2<1, 5, float>, &group_values_avx2<1, 6, float>,
      &group_values_avx2<1, 7, float>, &group_values_avx2<1, 8, float>};
  for (int64_t d0 = 0; d0 < size; d0 += 64)
    kChunks[std::min<int64_t>(8, (size - d0) / 8) - 1](acc + d0, 0, w, 0, rows + d0, stride, n, nullptr, 0);
}
#endif

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512BF16__)
// On AVX2 a kv head's K and V rows are read in place from a bf16 cache and widened as they are loaded, for
// its group of query vectors 3 at a time (group_scores_avx2 and group_values_avx2 with bf16 rows), where
// the tile path widens each block into float32 first and takes one vector at a time: the same sums in the
// same order, so the bits are the same. Widening a block into the tile was a loop of loads and stores
// that waited on memory with little else to do (a third of the attention's samples in `perf`). One layer
// of SmolLM2's attention (9 query heads, 3 kv heads of 64, blocks scattered over 4000), in place against
// the tile, alternating, two runs: 24 decode rows over 400 positions 0.32 and 0.39 against 0.46 and 0.72
// ms; one over 2048 0.07 and 0.08 against 0.10 and 0.12 ms; 4 prompts of 500 tokens 13.3 and 16.1 against
// 14.6 and 20.2 ms (each row of a prompt chunk widens the block again, and still gains). AVX-512 cores
// without BF16 (Ice Lake) take this path too, against their own one vector at a time over the widened tile
// (alternating, one layer as above, 2-core Ice Lake): 24 rows over 300 positions 0.41 against 0.82 ms (0.31
// against 0.56 with that tile widened 8 bf16 at a time, as load_row now does), one row over 2048 0.07
// against 0.13 ms. A float32 cache is read in place the same way (its rows copied into the tile before):
// 30 layers of SmolLM2's attention in float32 (blocks scattered, 2-core Zen 3, separate processes
// alternating, ms), one row over 512 positions 1.89-2.16 against 3.01-3.44, over 2048 7.2-7.9 against
// 9.0-10.6; 24 rows over 400 positions 32.3 and 38.3 against 44.0 and 41.6; 4 rows over 1000 14.9 and 18.6
// against 19.5 and 19.5.
constexpr int kGroupVectorsAvx2 = 3;

// The scores and the weighted V rows of `vectors` query vectors of one kv head, G at a time, with the
// `fetch_bytes` at fetch prefetched; rows of the cache's R (bf16 or float32).
template <typename R>
inline void group_scores(const float* q, int64_t vectors, int64_t size, const R* rows, int64_t stride,
                         int64_t n, float* out, int64_t out_stride, const char* fetch, int64_t fetch_bytes) {
  using Fn =
      void (*)(const float*, int64_t, const R*, int64_t, int64_t, float*, int64_t, const char*, int64_t);
  if (fetch_bytes <= kFetchBurstBytes) prefetch(fetch, fetch_bytes), fetch_bytes = 0;
  static constexpr std::array<std::array<Fn, kGroupVectorsAvx2>, 2> kFns = {{
      {&group_scores_avx2<1, R>, &group_scores_avx2<2, R>, &group_scores_avx2<3, R>},
      {&group_scores_avx2<1, R, true>, &group_scores_avx2<2, R, true>, &group_scores_avx2<3, R, true>},
  }};
  for (int64_t g = 0; g < vectors; g += kGroupVectorsAvx2) {
    const int64_t count = std::min<int64_t>(kGroupVectorsAvx2, vectors - g);
    kFns[fetch_bytes > 0][count - 1](q + g * size, size, rows, stride, n, out + g * out_stride, out_stride,
                                     fetch, fetch_bytes);
    fetch_bytes = 0;
  }
}

template <typename R>
inline void group_values(float* acc, int64_t vectors, int64_t size, const float* w, int64_t w_stride,
                         const R* rows, int64_t stride, int64_t n, const char* fetch, int64_t fetch_bytes) {
  using Fn =
      void (*)(float*, int64_t, const float*, int64_t, const R*, int64_t, int64_t, const char*, int64_t);
  if (fetch_bytes <= kFetchBurstBytes) prefetch(fetch, fetch_bytes), fetch_bytes = 0;
  static constexpr std::array<std::array<std::array<Fn, 4>, kGroupVectorsAvx2>, 2> kFns = {{
      {{
          {&group_values_avx2<1, 1, R>, &group_values_avx2<1, 2, R>, &group_values_avx2<1, 3, R>,
           &group_values_avx2<1, 4, R>},
          {&group_values_avx2<2, 1, R>, &group_values_avx2<2, 2, R>, &group_values_avx2<2, 3, R>,
           &group_values_avx2<2, 4, R>},
          {&group_values_avx2<3, 1, R>, &group_values_avx2<3, 2, R>, &group_values_avx2<3, 3, R>,
           &group_values_avx2<3, 4, R>},
      }},
      {{
          {&group_values_avx2<1, 1, R, true>, &group_values_avx2<1, 2, R, true>,
           &group_values_avx2<1, 3, R, true>, &group_values_avx2<1, 4, R, true>},
          {&group_values_avx2<2, 1, R, true>, &group_values_avx2<2, 2, R, true>,
           &group_values_avx2<2, 3, R, true>, &group_values_avx2<2, 4, R, true>},
          {&group_values_avx2<3, 1, R, true>, &group_values_avx2<3, 2, R, true>,
           &group_values_avx2<3, 3, R, true>, &group_values_avx2<3, 4, R, true>},
      }},
  }};
  for (int64_t g = 0; g < vectors; g += kGroupVectorsAvx2) {
    const int64_t count = std::min<int64_t>(kGroupVectorsAvx2, vectors - g);
    for (int64_t d = 0; d < size; d += 32) {  // the fetch shared out over the chunks of 32 values
      const int64_t share =
          fetch_bytes > 0
              ? std::min(fetch_bytes, ((fetch_bytes + 63) / 64 * 32 + size - d - 1) / (size - d) * 64)
              : 0;
      kFns[share > 0][count - 1][std::min<int64_t>(4, (size - d) / 8) - 1](
          acc + g * size + d, size, w + g * w_stride, w_stride, rows + d, stride, n, fetch, share);
      fetch += share, fetch_bytes -= share;
    }
  }
}
#endif

inline void accumulate_rows(float* acc, const float* w, const float* rows, int64_t stride, int64_t n,
                            int64_t size) {
#if defined(__AVX512F__)
  if (with_head_chunks(size, [&](auto chunks) {
        accumulate_rows_avx512<decltype(chunks)::value>(acc, w, rows, stride, n);
      }))
    return;
#elif defined(__AVX2__) && defined(__FMA__)
  if (size % 8 == 0) return accumulate_rows_avx2(acc, w, rows, stride, n, size);
#endif
  for (int64_t j = 0; j < n; ++j) {
    const float wj = w[j];
    const float* row = rows + j * stride;
#pragma omp simd
    for (int64_t d = 0; d < size; ++d) acc[d] += wj * row[d];
  }
}

#if defined(__AVX512BF16__)
// 16 bf16 values widened to float32 (exactly: a bf16 is a float32's upper half).
inline __m512 load16_bf16(const at::BFloat16* p) {
  return _mm512_cvtpbh_ps((__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// 16 floats rounded to bf16 (to nearest even, as c10's conversion) and widened back.
inline __m512 round_bf16(__m512 x) { return _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(x)); }
inline void store16_bf16(at::BFloat16* p, __m512 x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(x));
}
#endif

#if defined(__AVX512F__)
// Transposes 16 x 16 32-bit values in registers (lane j of r[i] becomes lane i of r[j]): 64 shuffles, where
// moving them one by one through memory costs 256 loads and stores.
inline void transpose16x16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {  // within 128-bit lanes: pairs of rows interleaved
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // within 128-bit lanes: 4 x 4 blocks transposed
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  // 128-bit lane k of r[4 * a + b] holds rows 4a .. 4a + 3 of column 4k + b: gather the four a of each.
  for (int b = 0; b < 4; ++b) {
    const __m512i y01 = _mm512_shuffle_i32x4(r[b], r[4 + b], 0x44),
                  z01 = _mm512_shuffle_i32x4(r[8 + b], r[12 + b], 0x44);
    const __m512i y23 = _mm512_shuffle_i32x4(r[b], r[4 + b], 0xEE),
                  z23 = _mm512_shuffle_i32x4(r[8 + b], r[12 + b], 0xEE);
    t[b] = _mm512_shuffle_i32x4(y01, z01, 0x88);
    t[4 + b] = _mm512_shuffle_i32x4(y01, z01, 0xDD);
    t[8 + b] = _mm512_shuffle_i32x4(y23, z23, 0x88);
    t[12 + b] = _mm512_shuffle_i32x4(y23, z23, 0xDD);
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}
#endif

#if defined(__AVX512BF16__)

// accumulate_rows for the `vectors` query vectors of one kv head at once (acc and w of vector r at
// acc + r * head size and w + r * w_stride), reading the bf16 V rows straight from the cache, two
// positions per step with the bf16 dot product: the rows of positions j and j + 1 are interleaved into
// pairs (V[j][d], V[j + 1][d]) for 16 dims d a register (one vpermt2w each), and vdpbf16ps adds
// w[j] * V[j][d] + w[j + 1] * V[j + 1][d] for a broadcast pair of weights, rounded to bf16 first (as the
// tiled kernel rounds P, and FlashAttention does). Half the instructions of widening each row to float32
// and a multiply-add per weight. The fetch_bytes at fetch are prefetched a share a step (see FetchShare).
template <int kChunks, int kVectors>
inline void accumulate_group_bf16_avx512(float* acc, const float* w, int64_t w_stride,
                                         const at::BFloat16* rows, int64_t stride, int64_t n,
                                         const char* fetch = nullptr, int64_t fetch_bytes = 0) {
  FetchShare ahead(fetch, fetch_bytes, (std::min<int64_t>(16, n) + 1) / 2);  // over the first pairs
  static_assert(kChunks % 2 == 0, "head sizes of whole 32-dim registers");
  // Word k of the pair register is, for even k, word k / 2 of the first row, for odd k that of the second
  // (index 32 + k / 2); the second register of a row's 32 dims starts 16 words further.
  alignas(64) static constexpr int16_t kLow[32] = {0,  32, 1,  33, 2,  34, 3,  35, 4,  36, 5,
                                                   37, 6,  38, 7,  39, 8,  40, 9,  41, 10, 42,
                                                   11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static constexpr int16_t kHigh[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21,
                                                    53, 22, 54, 23, 55, 24, 56, 25, 57, 26, 58,
                                                    27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i low = _mm512_load_si512(kLow), high = _mm512_load_si512(kHigh);
  // NOTE: the `GCC unroll` pragmas keep the sums in registers. Without them GCC unrolled the loops too, but
  // after it had given a[][] a place on the stack, and stored every sum there after every pair of rows
  // (`perf annotate`: the stores held a third of the kernel's samples). One sequence of 2048 positions,
  // caches in L2, 56.9 -> 46.4 us a layer; from memory 85.5 -> 81.7; decode steps, alternating step by
  // step, one sequence at 2048 positions and 4 at 1024 0.97x as long, 16 at 512 0.985x.
  __m512 a[kVectors][kChunks];
#pragma GCC unroll 8
  for (int r = 0; r < kVectors; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < kChunks; ++c) a[r][c] = _mm512_loadu_ps(acc + r * 16 * kChunks + 16 * c);
  alignas(64) int32_t pairs[kVectors][8];  // a run's weights in bf16, two to an int32
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const int64_t m = std::min<int64_t>(16, n - j0);
    const __mmask16 valid = static_cast<__mmask16>((1u << m) - 1);
    // An odd run ends with a pair whose second weight is zero (its row is read again, times zero).
#pragma GCC unroll 8
    for (int r = 0; r < kVectors; ++r)
      _mm256_store_si256(reinterpret_cast<__m256i*>(pairs[r]),
                         (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(valid, w + r * w_stride + j0)));
    for (int64_t j = 0; j < m; j += 2) {
      const at::BFloat16* r0 = rows + (j0 + j) * stride;
      const at::BFloat16* r1 = j + 1 < m ? r0 + stride : r0;
      ahead.step();
      __m512i v[kChunks];
#pragma GCC unroll 8
      for (int c = 0; c < kChunks / 2; ++c) {
        const __m512i x0 = _mm512_loadu_si512(r0 + 32 * c), x1 = _mm512_loadu_si512(r1 + 32 * c);
        v[2 * c] = _mm512_permutex2var_epi16(x0, low, x1);
        v[2 * c + 1] = _mm512_permutex2var_epi16(x0, high, x1);
      }
#pragma GCC unroll 8
      for (int r = 0; r < kVectors; ++r) {
        const __m512bh p = (__m512bh)_mm512_set1_epi32(pairs[r][j / 2]);
#pragma GCC unroll 8
        for (int c = 0; c < kChunks; ++c) a[r][c] = _mm512_dpbf16_ps(a[r][c], (__m512bh)v[c], p);
      }
    }
  }
  ahead.rest();
#pragma GCC unroll 8
  for (int r = 0; r < kVectors; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < kChunks; ++c) _mm512_storeu_ps(acc + r * 16 * kChunks + 16 * c, a[r][c]);
}

// Head sizes accumulate_group_bf16 takes.
inline bool has_bf16_values(int64_t size) { return size == 64 || size == 128; }

// Up to 16 accumulator registers at a time: vectors in runs of 4 (head size 64) or 2 (128).
inline void accumulate_group_bf16(float* acc, const float* w, int64_t w_stride, int64_t vectors,
                                  const at::BFloat16* rows, int64_t stride, int64_t n, int64_t size,
                                  const char* fetch = nullptr, int64_t fetch_bytes = 0) {
  for (int64_t r = 0; r < vectors;) {
    float* out = acc + r * size;
    const float* wr = w + r * w_stride;
    const int64_t left = vectors - r;
    const int64_t bytes = r == 0 ? fetch_bytes : 0;  // the first run of vectors brings the next block
    if (size == 64) {
      if (left >= 4) {
        accumulate_group_bf16_avx512<4, 4>(out, wr, w_stride, rows, stride, n, fetch, bytes), r += 4;
      } else if (left == 3) {
        accumulate_group_bf16_avx512<4, 3>(out, wr, w_stride, rows, stride, n, fetch, bytes), r += 3;
      } else if (left == 2) {
        accumulate_group_bf16_avx512<4, 2>(out, wr, w_stride, rows, stride, n, fetch, bytes), r += 2;
      } else {
        accumulate_group_bf16_avx512<4, 1>(out, wr, w_stride, rows, stride, n, fetch, bytes), r += 1;
      }
    } else if (left >= 2) {
      accumulate_group_bf16_avx512<8, 2>(out, wr, w_stride, rows, stride, n, fetch, bytes), r += 2;
    } else {
      accumulate_group_bf16_avx512<8, 1>(out, wr, w_stride, rows, stride, n, fetch, bytes), r += 1;
    }
  }
}
#endif

// out[0 .. n) = acc[0 .. n) * scale, rounded to T.
template <typename T>
inline void store_scaled(T* out, const float* acc, float scale, int64_t n) {
  int64_t d = 0;
#if defined(__AVX512BF16__)
  // 16 at a time: vcvtneps2bf16 rounds as c10's conversion does, which GCC leaves scalar.
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const __m512 s = _mm512_set1_ps(scale);
    for (; d + 16 <= n; d += 16) store16_bf16(out + d, _mm512_mul_ps(_mm512_loadu_ps(acc + d), s));
  }
#endif
  for (; d < n; ++d) out[d] = static_cast<T>(acc[d] * scale);
}

// Consecutive query rows of one sequence (positions pos0 .. pos0 + len - 1, query rows row0 ..), computed
// together so that every K and V block is read (and, but on AVX2, widened to float) once for all of them.
struct RowChunk {
  int64_t seq, row0, pos0, len;
};
constexpr int64_t kChunkRows = 8;
// Most score floats a thread keeps between calls (256 KB).
constexpr size_t kKeptScores = 64 * 1024;

// With fewer chunks than threads (a lone sequence's decode row), a long context is split into parts,
// enough to give every thread one, so that all of them read: splitting the kv heads instead (3 on 2
// threads) runs 2 against 1. A part yields a partial softmax (its max, its sum of exp(score - max) and its
// weighted sum of V rows), and the parts are merged after, as flash-decoding does. One sequence on 2
// threads, the attention of one layer with the caches cold, heads split against parts: 1024 positions
// 63.0 -> 53.6 us and 57.5 -> 48.2 us, 2048 positions 99.2 -> 80.4 us and 96.8 -> 87.1 us. From 16 blocks
// on (2-core Zen 3, 30 layers' caches, alternating builds, medians of 300 rounds): 256 positions 1.00x and
// 0.89x as long split, 300 0.95x, 384 0.90x, 512 0.85-0.88x, 768 0.65-0.74x; at 128 and 192 positions, split
// into parts of 8 blocks or fewer, 1.12-1.13x. With as many chunks as threads the tasks keep every thread
// busy already (13 sequences of 350 positions, whole decode steps: 1.03-1.06x as long split): those compute
// as before.
constexpr int64_t kMinPartBlocks = 8;

inline int64_t context_parts(int64_t used_blocks, int64_t num_chunks, int64_t threads) {
  if (num_chunks >= threads) return 1;
  return std::max<int64_t>(1,
                           std::min(used_blocks / kMinPartBlocks, (threads + num_chunks - 1) / num_chunks));
}

// The rows of chunk `chunk`, for kv heads h0 .. h1, against the blocks [b0, b1) of its sequence. partial:
// where a part's results start in the partials buffer ([rows x query heads] weighted sums of head_dim
// floats, then as many maxima, then as many sums); -1 when the task covers the whole context and writes
// the output itself.
struct RowTask {
  int64_t chunk, h0, h1, b0, b1, partial;
};

// One task is one chunk of rows, for a range of kv heads, against one part of its sequence's context (see
// RowTask): the query heads score every position of the part their row sees (up to its own position), reading
// K and V in place, block by block through the sequence's block table, while the next one is prefetched. A
// block's elements lie together in either layout (see check_cache); head-major, as the CPU pool is, a task
// streams through each block front to back, one kv head's rows after another, where token-major it reads the
// block in a strided pass per kv head (SmolLM2: 16 runs of 128 bytes, 384 apart). Decode steps, two runners
// over one model alternating step by step (2-core Zen 4), head-major over token-major: one sequence at 2048
// positions 0.965x as long, at 512 0.975x, 16 sequences at 512 0.968x, 4 at 1024 0.988x; the tiled kernel
// (30 layers from memory) even, with the same bits. Two passes: scores (kept: rows x heads x positions
// floats), then softmax and the weighted sum of V rows. Tasks are handed out dynamically: chunks see contexts
// of different lengths.

// The geometry and data of one attention call, as both attention kernels read them.
template <typename T>
struct AttentionArgs {
  AttentionArgs(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                const at::Tensor& block_tables, double scale, at::Tensor& out)
      : head_dim(query.size(2)),
        num_blocks(k_cache.size(0)),
        block_size(k_cache.size(1)),
        num_kv_heads(k_cache.size(2)),
        group(query.size(1) / num_kv_heads),
        table_width(block_tables.size(1)),
        table_stride(block_tables.stride(0)),
        q_stride(query.stride(0)),
        out_stride(out.stride(0)),
        row_stride(k_cache.stride(1)),
        head_stride(k_cache.stride(2)),
        block_stride(k_cache.stride(0)),
        q_ptr(query.data_ptr<T>()),
        k_ptr(k_cache.data_ptr<T>()),
        v_ptr(v_cache.data_ptr<T>()),
        tables(block_tables.data_ptr<int32_t>()),
        out_ptr(out.data_ptr<T>()),
        fscale(static_cast<float>(scale)) {}
  const int64_t head_dim, num_blocks, block_size, num_kv_heads, group, table_width, table_stride, q_stride,
      out_stride;
  // Elements between a kv head's rows of consecutive positions, between a position's consecutive kv heads,
  // and between blocks (see check_cache: every block's elements lie together).
  const int64_t row_stride, head_stride, block_stride;
  const T* q_ptr;
  const T* k_ptr;
  const T* v_ptr;
  const int32_t* tables;
  T* out_ptr;
  const float fscale;

  // Whether entry b of a block table, holding block, may be read: inside the cache and the table.
  bool valid_block(int64_t block, int64_t b) const {
    return block >= 0 && block < num_blocks && b < table_width;
  }
};

// The first bad block table entry the threads of a kernel met, reported once they are done.
struct BadBlock {
  std::atomic<bool> seen{false};
  std::atomic<int64_t> block{0};
  void report(int64_t id) {
    block.store(id);
    seen.store(true);
  }
  void check(int64_t num_blocks) const {
    TORCH_CHECK(!seen.load(), "block table entry ", block.load(), " is outside the cache (", num_blocks,
                " blocks) or past the table's width");
  }
};

template <typename T>
void paged_attention_impl(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                          const at::Tensor& block_tables, const std::vector<RowChunk>& chunks, double scale,
                          at::Tensor& out) {
  const AttentionArgs<T> a(query, k_cache, v_cache, block_tables, scale, out);
  const int64_t block_bytes = a.block_stride * static_cast<int64_t>(sizeof(T));
  const int threads = std::max(1, at::get_num_threads());
  const int64_t num_chunks = static_cast<int64_t>(chunks.size()), num_heads = a.num_kv_heads * a.group;
  const auto used_blocks = [&](const RowChunk& c) {
    return (c.pos0 + c.len + a.block_size - 1) / a.block_size;
  };
  // A task is a chunk and a range of kv heads: all of them, unless there are fewer chunks than threads; then
  // long contexts are split into parts (see context_parts) and the others split their kv heads.
  const int64_t splits = std::min<int64_t>(a.num_kv_heads, (threads + num_chunks - 1) / num_chunks);
  const int64_t heads_per_task = (a.num_kv_heads + splits - 1) / splits;
  // The parts, each chunk's side by side, and where each split chunk's first part is; empty but for a
  // long context among fewer chunks than threads.
  std::vector<RowTask> parts;
  std::vector<int64_t> merges;
  int64_t partial_floats = 0;
  const bool any_split = std::any_of(chunks.begin(), chunks.end(), [&](const RowChunk& c) {
    return context_parts(used_blocks(c), num_chunks, threads) > 1;
  });
  for (int64_t k = 0; k < num_chunks && any_split; ++k) {
    const RowChunk& c = chunks[k];
    const int64_t blocks = used_blocks(c), n = context_parts(blocks, num_chunks, threads);
    if (n > 1) merges.push_back(static_cast<int64_t>(parts.size()));
    for (int64_t p = 0; p < n; ++p) {
      parts.push_back(
          {k, 0, a.num_kv_heads, blocks * p / n, blocks * (p + 1) / n, n > 1 ? partial_floats : -1});
      if (n > 1) partial_floats += c.len * num_heads * (a.head_dim + 2);
    }
  }
  std::vector<float> partials(partial_floats);
  const int64_t num_tasks = parts.empty() ? num_chunks * splits : static_cast<int64_t>(parts.size());
  const auto task_at = [&](int64_t task) -> RowTask {
    if (!parts.empty()) return parts[task];
    const int64_t h0 = task % splits * heads_per_task;
    return {task / splits,
            h0,
            std::min(a.num_kv_heads, h0 + heads_per_task),
            0,
            used_blocks(chunks[task / splits]),
            -1};
  };
  BadBlock bad;
  // bf16 scores from the cache as it is, with the bf16 dot product (see block_scores_bf16), where the
  // head size allows: K is then never widened (V still is, once per block for the group's queries).
#if defined(__AVX512BF16__)
  const bool raw_scores = std::is_same_v<T, c10::BFloat16> && has_bf16_scores(a.head_dim);
  const bool raw_values = std::is_same_v<T, c10::BFloat16> && has_bf16_values(a.head_dim);
#else
  const bool raw_scores = false, raw_values = false;
#endif
  // Without AVX-512 BF16, bf16 and float32 K and V are read in place for the whole group (see group_scores),
  // the query in float.
  [[maybe_unused]] constexpr bool kInPlaceType = std::is_same_v<T, c10::BFloat16> || std::is_same_v<T, float>;
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512BF16__)
  const bool in_place = kInPlaceType && a.head_dim % 8 == 0;
#else
  const bool in_place = false;
#endif

#pragma omp parallel num_threads(static_cast<int>(std::min<int64_t>(threads, num_tasks)))
  {
    const int64_t max_q = kChunkRows * num_heads;  // query vectors of one task, at most
    // Each thread's buffers outlive the call: a decode step calls this once per layer, and allocating
    // and zeroing them every time cost about 2 us a call.
    thread_local std::vector<float> q, tile, acc, inv_sum, scores;
    q.resize(std::max<size_t>(q.size(), max_q * a.head_dim));
    tile.resize(std::max<size_t>(tile.size(), a.block_size * a.num_kv_heads * a.head_dim));
    acc.resize(std::max<size_t>(acc.size(), max_q * a.head_dim));
    inv_sum.resize(std::max<size_t>(inv_sum.size(), max_q));
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < num_tasks; ++task) {
      const RowTask tk = task_at(task);
      const RowChunk& c = chunks[tk.chunk];
      const int64_t nq = (tk.h1 - tk.h0) * a.group, width = (tk.h1 - tk.h0) * a.head_dim;
      const int32_t* table = a.tables + c.seq * a.table_stride;
      const int64_t span = c.pos0 + c.len;  // positions the last row sees
      // The part's positions, k0 .. k1; vector v = i * nq + r (row i's query head r) scores them from
      // v * part_len.
      const int64_t k0 = tk.b0 * a.block_size, k1 = std::min(span, tk.b1 * a.block_size), part_len = k1 - k0;
      for (int64_t i = 0; i < c.len && !raw_scores; ++i) {  // raw scores read the bf16 query itself
        const T* q_row = a.q_ptr + (c.row0 + i) * a.q_stride + tk.h0 * a.group * a.head_dim;
        for (int64_t e = 0; e < nq * a.head_dim; ++e)
          q[i * nq * a.head_dim + e] = static_cast<float>(q_row[e]) * a.fscale;
      }
      scores.resize(std::max<size_t>(scores.size(), c.len * nq * part_len));

      // Walks the part's blocks of one cache: widens each block's rows into tile when asked, then calls
      // visit(v, rows, raw, first, n) for every row that sees n > 0 of the block's positions and every kv
      // head: v is the first of the head's group of query vectors (the group is v .. v + group - 1), rows
      // the head's rows in the tile, raw the same rows in the cache (row_stride apart), first the block's
      // first position. The block kFetchAhead on (past the last ones, `then`'s first: the V walk follows
      // the K walk) is prefetched a slice a visit, which keeps the memory busy while the block is computed
      // (48 sequences of 300 positions, scattered blocks: 0.70 -> 0.59 ms a layer against one prefetch of
      // the whole block up front): before the visit, or by the bf16 kernels over their rows (see
      // FetchShare). The blocks between are prefetched whole as the K walk starts. False at a block id
      // outside the cache.
      const auto ahead_of = [&](const T* cache, const T* then, int64_t b) -> const char* {
        if (b >= tk.b1) {  // into `then`'s blocks
          if (then == nullptr) return nullptr;
          cache = then, b = tk.b0 + (b - tk.b1);
        }
        if (b >= tk.b1 || !a.valid_block(table[b], b)) return nullptr;
        return reinterpret_cast<const char*>(cache + table[b] * a.block_stride);
      };
      const auto walk = [&](const T* cache, const T* then, bool widen, auto&& visit) {
        for (int64_t b = tk.b0; b < tk.b1; ++b) {
          const int64_t block = table[b];
          if (!a.valid_block(block, b)) {
            bad.report(block);
            return false;
          }
          if (b == tk.b0 && then != nullptr)
            for (int64_t e = 1; e < kFetchAhead; ++e)
              if (const char* between = ahead_of(cache, then, b + e)) prefetch_l2(between, block_bytes);
          const char* ahead = ahead_of(cache, then, b + kFetchAhead);
          const int64_t first = b * a.block_size, end = std::min(a.block_size, span - first);
          const int64_t i0 = std::max<int64_t>(0, first - c.pos0);
          const int64_t visits = (c.len - i0) * (tk.h1 - tk.h0);
          const int64_t slice = (block_bytes / 64 + visits - 1) / visits * 64;
          int64_t fetched = 0;
          const T* raw = cache + block * a.block_stride + tk.h0 * a.head_stride;
          if (widen)
            for (int64_t j = 0; j < end; ++j)
              for (int64_t kh = 0; kh < tk.h1 - tk.h0; ++kh)
                load_row(raw + j * a.row_stride + kh * a.head_stride, &tile[j * width + kh * a.head_dim],
                         a.head_dim);
          for (int64_t i = i0; i < c.len; ++i) {
            const int64_t n = std::min(end, c.pos0 + i + 1 - first);  // positions of this block row i sees
            for (int64_t kh = 0; kh < tk.h1 - tk.h0; ++kh) {
              const int64_t fetch =
                  ahead != nullptr ? std::max<int64_t>(0, std::min(slice, block_bytes - fetched)) : 0;
              visit(i * nq + kh * a.group, &tile[kh * a.head_dim], raw + kh * a.head_stride, first - k0, n,
                    ahead == nullptr ? nullptr : ahead + fetched, fetch);
              fetched += fetch;
            }
          }
        }
        return true;
      };
      const bool valid = walk(
          a.k_ptr, a.v_ptr, !raw_scores && !in_place,
          [&](int64_t v0, const float* k_rows, const T* k_raw, int64_t first, int64_t n, const char* fetch,
              int64_t fetch_bytes) {
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512BF16__)
            if constexpr (kInPlaceType) {
              if (in_place) {
                return group_scores(&q[v0 * a.head_dim], a.group, a.head_dim, k_raw, a.row_stride, n,
                                    &scores[v0 * part_len + first], part_len, fetch, fetch_bytes);
              }
            }
#endif
            // The bf16 kernels share a decode row's share out over their rows (see FetchShare).
            if (!raw_scores || fetch_bytes <= kFetchBurstBytes) prefetch(fetch, fetch_bytes), fetch_bytes = 0;
#if defined(__AVX512BF16__)
            if constexpr (std::is_same_v<T, c10::BFloat16>) {
              if (raw_scores && a.head_dim == 64) {  // the group's vectors (one row's heads) side by side
                const T* q_raw =
                    a.q_ptr + (c.row0 + v0 / nq) * a.q_stride + (tk.h0 * a.group + v0 % nq) * a.head_dim;
                return group_scores_bf16_64(q_raw, a.group, k_raw, a.row_stride, n, a.fscale,
                                            &scores[v0 * part_len + first], part_len, fetch, fetch_bytes);
              }
            }
#endif
            for (int64_t v = v0; v < v0 + a.group; ++v) {
#if defined(__AVX512BF16__)
              if constexpr (std::is_same_v<T, c10::BFloat16>) {
                if (raw_scores) {
                  const T* q_raw =
                      a.q_ptr + (c.row0 + v / nq) * a.q_stride + (tk.h0 * a.group + v % nq) * a.head_dim;
                  block_scores_bf16(q_raw, k_raw, a.row_stride, n, a.head_dim, a.fscale,
                                    &scores[v * part_len + first], fetch, fetch_bytes);
                  fetch_bytes = 0;  // the first vector brings the share
                  continue;
                }
              }
#endif
              block_scores(&q[v * a.head_dim], k_rows, width, n, a.head_dim, &scores[v * part_len + first]);
            }
          });
      // A part's maxima and sums go to the partials buffer, after its weighted sums.
      float* const part_acc = tk.partial < 0 ? nullptr : partials.data() + tk.partial;
      float* const part_max = part_acc == nullptr ? nullptr : part_acc + c.len * nq * a.head_dim;
      float* const part_sum = part_max == nullptr ? nullptr : part_max + c.len * nq;
      if (!valid) {  // reported after the threads are done; the merge meanwhile reads an empty part
        if (part_sum != nullptr) std::fill(part_sum, part_sum + c.len * nq, 0.f);
        continue;
      }
      for (int64_t i = 0; i < c.len; ++i) {
        const int64_t visible = std::min(k1, c.pos0 + i + 1) - k0;  // none: the row ends before the part
        for (int64_t r = 0; r < nq; ++r) {
          const int64_t v = i * nq + r;
          if (part_acc == nullptr) {
            inv_sum[v] = 1.f / exp_shifted_sum(&scores[v * part_len], visible);
          } else if (visible > 0) {
            part_sum[v] = exp_shifted_sum(&scores[v * part_len], visible, &part_max[v]);
          } else {
            part_sum[v] = 0.f, part_max[v] = -std::numeric_limits<float>::infinity();
          }
        }
      }
      float* const sums = part_acc == nullptr ? acc.data() : part_acc;
      std::fill(sums, sums + c.len * nq * a.head_dim, 0.f);
      walk(a.v_ptr, nullptr, !raw_values && !in_place,
           [&](int64_t v0, const float* v_rows, const T* v_raw, int64_t first, int64_t n, const char* fetch,
               int64_t fetch_bytes) {
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512BF16__)
             if constexpr (kInPlaceType) {
               if (in_place) {
                 return group_values(&sums[v0 * a.head_dim], a.group, a.head_dim,
                                     &scores[v0 * part_len + first], part_len, v_raw, a.row_stride, n, fetch,
                                     fetch_bytes);
               }
             }
#endif
             if (!raw_values || fetch_bytes <= kFetchBurstBytes)
               prefetch(fetch, fetch_bytes), fetch_bytes = 0;  // else shared out over the kernel's steps
#if defined(__AVX512BF16__)
             if constexpr (std::is_same_v<T, c10::BFloat16>) {
               if (raw_values) {
                 accumulate_group_bf16(&sums[v0 * a.head_dim], &scores[v0 * part_len + first], part_len,
                                       a.group, v_raw, a.row_stride, n, a.head_dim, fetch, fetch_bytes);
                 return;
               }
             }
#endif
             for (int64_t v = v0; v < v0 + a.group; ++v)
               accumulate_rows(&sums[v * a.head_dim], &scores[v * part_len + first], v_rows, width, n,
                               a.head_dim);
           });
      if (part_acc == nullptr)
        for (int64_t i = 0; i < c.len; ++i)
          for (int64_t r = 0; r < nq; ++r)
            store_scaled(a.out_ptr + (c.row0 + i) * a.out_stride + (tk.h0 * a.group + r) * a.head_dim,
                         &acc[(i * nq + r) * a.head_dim], inv_sum[i * nq + r], a.head_dim);
    }
    // The split chunks: each query vector's parts rescaled to their common max, summed and normalised.
#pragma omp for schedule(static)
    for (int64_t m = 0; m < static_cast<int64_t>(merges.size()); ++m) {
      const int64_t first = merges[m];
      const RowChunk& c = chunks[parts[first].chunk];
      int64_t count = 1;  // the chunk's parts, side by side in the buffer too
      while (first + count < num_tasks && parts[first + count].chunk == parts[first].chunk) ++count;
      const int64_t vectors = c.len * num_heads, part_floats = vectors * (a.head_dim + 2);
      const float* const part0 = partials.data() + parts[first].partial;
      float* const sum_v = acc.data();
      for (int64_t v = 0; v < vectors; ++v) {
        float max = -std::numeric_limits<float>::infinity();
        for (int64_t p = 0; p < count; ++p)
          max = std::max(max, part0[p * part_floats + vectors * a.head_dim + v]);
        std::fill(sum_v, sum_v + a.head_dim, 0.f);
        float total = 0.f;
        for (int64_t p = 0; p < count; ++p) {
          const float* part = part0 + p * part_floats;
          const float sum = part[vectors * (a.head_dim + 1) + v];
          if (sum == 0.f) continue;  // the row ends before this part
          const float w = std::exp(part[vectors * a.head_dim + v] - max);
          total += sum * w;
          for (int64_t d = 0; d < a.head_dim; ++d) sum_v[d] += part[v * a.head_dim + d] * w;
        }
        store_scaled(a.out_ptr + (c.row0 + v / num_heads) * a.out_stride + v % num_heads * a.head_dim, sum_v,
                     1.f / total, a.head_dim);
      }
    }
    // The scores of a long prompt's rows (up to rows x heads x context floats) are not kept.
    if (scores.size() > kKeptScores) std::vector<float>().swap(scores);
  }
  bad.check(a.num_blocks);
}

// ---- tiled attention for query blocks (prefill) ---------------------------------------------------------
//
// The row kernel above scores one query vector against 16 positions at a time and sums across lanes, a
// shape made for decode. A prompt chunk has many query vectors per kv head (its rows x the group's
// query heads), which this path computes as small matrix products on tiles held transposed, so that the
// lanes of a register are 16 query vectors: scores S^T = K Q^T and the output O^T += V^T P^T are plain
// multiply-adds with one operand broadcast from K or V (no sums across lanes), and the online softmax
// (running max and sum per query vector) is elementwise on those lanes.

// Query vectors of one tiled task. AVX-512: the lanes of three registers (a task of 32 or fewer computes
// two), 16 rows of SmolLM2's three query heads per kv head; each broadcast of K or V and each block's V
// interleave serves 1.5x the lanes of 32, and a prompt needs 2/3 of the tasks. 30 layers' caches from
// memory, bf16, 2-core Zen 5, alternating builds, us a layer (the same bits): 15 queries after 700
// positions 125 / 137 -> 99 / 88, a 500-token prompt 998 / 1080 -> 663 / 657, 64 queries after 1936
// 1075 / 1056 -> 615 / 604, a 120-token prompt 80 / 76 -> 57 / 59. AVX2: four registers of 8.
#if defined(__AVX512F__)
constexpr int64_t kTileLanes = 48;
#else
constexpr int64_t kTileLanes = 32;
#endif
// Where the caller leaves the choice to the build (min_tile_lanes < 0), a sequence of several queries takes
// the tiled kernel from this many query vectors per kv head (see TILE_MIN_LANES in cpu_ops.py). On AVX2
// (one layer of SmolLM2, bf16, 1 or 4 sequences after 300 or 2000 positions, tiled over the row kernel's
// time): 6 rows (18 vectors) 0.93-1.24, 8 rows 0.57-1.03, 11 rows 0.81-1.15, 16 rows 0.73-0.98, 32 rows
// 0.83-0.88.
#if defined(__AVX512F__)
constexpr int64_t kTileMinLanes = 16;
#else
constexpr int64_t kTileMinLanes = 32;
#endif
// A split tile's parts are this many blocks or more.
constexpr int64_t kSplitMinBlocks = 4;
// Positions scored together (8 x 2 or 3 registers of scores), and value columns accumulated together.
constexpr int64_t kTilePositions = 8, kTileColumns = 8;

// Consecutive query rows of one sequence and all query heads of one kv head: rows * group <= kTileLanes
// query vectors, lane = (row - row0) * group + head in group.
struct QueryTile {
  int64_t seq, kv_head, row0, pos0, rows;
  // The blocks of the sequence it visits, [block_begin, block_end) (clipped to those its rows see), and
  // where it leaves its unnormalised result when it is one part of a split tile (see TileSplit); -1: it
  // writes its rows' output itself.
  int64_t block_begin = 0, block_end = std::numeric_limits<int64_t>::max(), partial = -1;
};

// A tile whose blocks went to several tasks, as flash-decoding splits a long context: parts tasks, each
// leaving its lanes' running max, sum and unnormalised output in partial slots first_partial ..
// first_partial + parts - 1, merged into the tile's output once all are done. AVX-512 only.
struct TileSplit {
  QueryTile tile;
  int64_t first_partial, parts;
};

// A task's query rows and output rows, fetched while the task before it computes (claimed a task ahead:
// the tasks go longest first, so their rows lie anywhere). Loaded cold, they and the copy-out took about
// a fifth of the AVX-512 kernel's samples.
template <typename T>
__attribute__((always_inline)) inline void prefetch_tile(const AttentionArgs<T>& a, const QueryTile& t) {
  const int64_t offset = t.kv_head * a.group * a.head_dim, bytes = a.group * a.head_dim * sizeof(T);
  for (int64_t r = 0; r < t.rows; ++r) {
    prefetch(a.q_ptr + (t.row0 + r) * a.q_stride + offset, bytes);
    prefetch_write(a.out_ptr + (t.row0 + r) * a.out_stride + offset, bytes);
  }
}

// Each of the kTileLanes lanes' query vector, output and last visible position; lanes past the task's
// vectors repeat its last one (and are never stored). Returns the task's vectors.
template <typename T>
int64_t tile_lanes(const AttentionArgs<T>& a, const QueryTile& t, int32_t* limit, const T** lane_q,
                   T** lane_out) {
  const int64_t lanes = t.rows * a.group;
  for (int64_t lane = 0; lane < kTileLanes; ++lane) {
    const int64_t v = std::min(lane, lanes - 1), row = v / a.group;
    const int64_t offset = (t.kv_head * a.group + v % a.group) * a.head_dim;
    lane_q[lane] = a.q_ptr + (t.row0 + row) * a.q_stride + offset;
    lane_out[lane] = a.out_ptr + (t.row0 + row) * a.out_stride + offset;
    limit[lane] = static_cast<int32_t>(t.pos0 + row);
  }
  return lanes;
}

// Block `block`'s K and V rows of one kv head (row_stride apart), on their way while the block before it
// is computed: it lies anywhere in the pool. Always inlined, as prefetch_tile: each tiled kernel carries its
// own prefetches (a test reads them there).
template <typename T>
__attribute__((always_inline)) inline void prefetch_tile_block(const AttentionArgs<T>& a, int64_t block,
                                                               int64_t kv_head) {
  const int64_t at = block * a.block_stride + kv_head * a.head_stride;
  const Fetch kind = reads_ahead_into_l2() ? Fetch::kReadL2 : Fetch::kRead;
  for (int64_t j = 0; j < a.block_size; ++j) {
    prefetch_lines(a.k_ptr + at + j * a.row_stride, a.head_dim * sizeof(T), kind);
    prefetch_lines(a.v_ptr + at + j * a.row_stride, a.head_dim * sizeof(T), kind);
  }
}

// Calls visit(first position, positions, K rows, V rows) for each block of task t's sequence that its
// rows see (within its block range), in order, with the next one on its way (prefetch_tile_block). At a bad
// block table entry, reports it and returns false.
template <typename T, typename F>
bool for_tile_blocks(const AttentionArgs<T>& a, const QueryTile& t, BadBlock& bad, F&& visit) {
  const int64_t last = t.pos0 + t.rows - 1;
  const int64_t used_blocks = std::min(last / a.block_size + 1, t.block_end);
  const int32_t* table = a.tables + t.seq * a.table_stride;
  for (int64_t b = t.block_begin; b < used_blocks; ++b) {
    const int64_t block = table[b];
    if (!a.valid_block(block, b)) {
      bad.report(block);
      return false;
    }
    const int64_t first = b * a.block_size, n = std::min(a.block_size, last + 1 - first);
    if (b + 1 < used_blocks && a.valid_block(table[b + 1], b + 1))
      prefetch_tile_block(a, table[b + 1], t.kv_head);
    const int64_t at = block * a.block_stride + t.kv_head * a.head_stride;
    visit(first, n, a.k_ptr + at, a.v_ptr + at);
  }
  return true;
}

// The tiled kernels' parallel region: body(each_task) runs once on each thread (setting up its buffers), and
// each_task(run) calls run(task) for the tasks that thread takes: handed out dynamically, each thread
// claiming its next one a task ahead and fetching that one's rows meanwhile (prefetch_tile). 30 layers of a
// real model's prompts on AVX-512: 16 of 100-140 tokens 73.5 -> 64.3 ms, 6 of 200-480 119.7 -> 113.5 (and
// 121.9 -> 114.0).
template <typename T, typename Body>
void for_tile_tasks(const AttentionArgs<T>& a, const std::vector<QueryTile>& tasks, Body&& body) {
  const int64_t num_tasks = static_cast<int64_t>(tasks.size());
  const int threads = std::max(1, at::get_num_threads());
  std::atomic<int64_t> next{0};
#pragma omp parallel num_threads(static_cast<int>(std::min<int64_t>(threads, num_tasks)))
  body([&](auto&& run) {
    const auto claim = [&] { return next.fetch_add(1, std::memory_order_relaxed); };
    for (int64_t task = claim(), ahead = claim(); task < num_tasks; task = ahead, ahead = claim()) {
      if (ahead < num_tasks) prefetch_tile(a, tasks[ahead]);
      run(tasks[task]);
    }
  });
}

#if defined(__AVX512F__)
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// The tiled kernel's products on AMX (bf16, head sizes a multiple of 32, blocks of 16 positions): the
// scores S^T = K Q^T with K's 16 rows of a block as one tile, straight from the cache, by the query pairs qp
// as the other; the output O^T += V^T P^T with the block's V transposed (vt) by the weight pairs pp. The
// layouts are the AVX-512 kernel's (s and ot lane-minor, qp and pp pairs by lanes), so the masking, the
// online softmax, the splits and the stores are shared. Sums in the same order as vdpbf16ps's (the same
// bits but for rare last-bit roundings, as in linear_amx). One layer of SmolLM2 in bf16 on a 2-core Intel
// Xeon with AMX (bench_kernels_cpu.py --prefill), ms against the AVX-512 BF16 kernel: a 500-token prompt
// 1.84 -> 0.73-0.81, 15 and 26 queries after 700 cached positions 0.30 -> 0.12, 4 chunks of 256 after 512
// 5.76 -> 2.27-2.52, a 2000-token prompt 28.8 -> 10.2-11.1 (157 -> 360-450 GFLOP/s). Of the rest, half is
// the second product's tiles (each of a block's 16 x 16 output tiles loaded, added to and stored) and the
// rescaling of the output where a max moved; the transposition of V about a sixth. The output tiles held
// in two tile registers in turn rather than one: no change.
constexpr int64_t kAmxKeys = 16;  // positions of a block
// Tiles 0-2: scores of 16 positions by 16 lanes, 3: K (16 positions x 32 dims), 4: query pairs (16 pairs x
// 16 lanes), 5: output (16 dims x 16 lanes), 6: V^T (16 dims x 16 positions), 7: weight pairs (8 pairs of
// positions x 16 lanes).
constexpr TileConfig kAttentionTiles{{16, 64}, {16, 64}, {16, 64}, {16, 64},
                                     {16, 64}, {16, 64}, {16, 32}, {8, 64}};

template <typename T>
inline bool use_amx_attention(const AttentionArgs<T>& a) {
  return a.block_size == kAmxKeys && a.head_dim % 32 == 0 && amx_enabled();
}

// s[j * kTileLanes + lane] = K row j . query vector lane, for the R x 16 lanes of qp and the 16 rows of K
// (row_stride elements apart; rows past a short block's end are read and never used).
template <int R>
inline void amx_scores(const at::BFloat16* k, int64_t row_stride, const int32_t* qp, int64_t head_dim,
                       float* s) {
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (R > 2) _tile_zero(2);
  for (int64_t d = 0; d < head_dim; d += 32) {
    _tile_loadd(3, k + d, row_stride * 2);
    const int32_t* q = qp + d / 2 * kTileLanes;
    _tile_loadd(4, q, kTileLanes * 4);
    _tile_dpbf16ps(0, 3, 4);
    _tile_loadd(4, q + 16, kTileLanes * 4);
    _tile_dpbf16ps(1, 3, 4);
    if constexpr (R > 2) {
      _tile_loadd(4, q + 32, kTileLanes * 4);
      _tile_dpbf16ps(2, 3, 4);
    }
  }
  _tile_stored(0, s, kTileLanes * 4);
  _tile_stored(1, s + 16, kTileLanes * 4);
  if constexpr (R > 2) _tile_stored(2, s + 32, kTileLanes * 4);
}

// ot[d * kTileLanes + lane] = alpha[lane] * ot[...] + sum over the block's n positions of the weights (pairs
// in pp, the AVX-512 kernel's) times V[j][d]: V's rows (row_stride apart) transposed into vt, then one
// product per 16 dims and 16 lanes. Past a short block's n positions vt is zero (the cache may hold
// anything there, NaN too), so that pp's pairs there, left from the block before, add nothing.
template <int R>
inline void amx_values(const at::BFloat16* v, int64_t row_stride, int64_t n, int64_t head_dim,
                       const __m512 (&alpha)[R], int32_t* pp, at::BFloat16* vt, float* ot) {
  // 32 dims at a time: 16 rows of 16 dim pairs transposed (transpose16x16), each pair split into its two
  // dims' rows of 16 positions.
  for (int64_t d0 = 0; d0 < head_dim; d0 += 32) {
    __m512i rows[16];
    for (int64_t j = 0; j < kAmxKeys; ++j)
      rows[j] = j < n ? _mm512_loadu_si512(v + j * row_stride + d0) : _mm512_setzero_si512();
    transpose16x16(rows);
    for (int p = 0; p < 16; ++p) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(vt + (d0 + 2 * p) * kAmxKeys),
                          _mm512_cvtepi32_epi16(rows[p]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(vt + (d0 + 2 * p + 1) * kAmxKeys),
                          _mm512_cvtepi32_epi16(_mm512_srli_epi32(rows[p], 16)));
    }
  }
  // The old output rescaled, unless no lane's max moved (alpha 1: the same bits).
  bool rescale = false;
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) rescale |= _mm512_cmpneq_ps_mask(alpha[r], _mm512_set1_ps(1.f)) != 0;
  if (rescale)
    for (int64_t d = 0; d < head_dim; ++d)
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        float* o = &ot[d * kTileLanes + 16 * r];
        _mm512_storeu_ps(o, _mm512_mul_ps(_mm512_loadu_ps(o), alpha[r]));
      }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    _tile_loadd(7, pp + 16 * r, kTileLanes * 4);
    for (int64_t d0 = 0; d0 < head_dim; d0 += 16) {
      float* o = ot + d0 * kTileLanes + 16 * r;
      _tile_loadd(5, o, kTileLanes * 4);
      _tile_loadd(6, vt + d0 * kAmxKeys, kAmxKeys * 2);
      _tile_dpbf16ps(5, 6, 7);
      _tile_stored(5, o, kTileLanes * 4);
    }
  }
}
#else
template <typename T>
inline bool use_amx_attention(const AttentionArgs<T>&) {
  return false;
}
#endif  // __AMX_TILE__ && __AMX_BF16__

// Each of a task's lanes' output row: ot[d * kTileLanes + lane] scaled by inv[lane] (1 / its softmax sum).
template <typename T>
void store_tile(const float* ot, const float* inv, int64_t lanes, T* const* lane_out, int64_t head_dim) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    // 16 lanes x 16 dims at a time: scaled, transposed in registers, rounded (vcvtneps2bf16 rounds as c10's
    // conversion does) and stored as a row of each lane's output.
    for (int64_t g = 0; g < lanes; g += 16) {
      const __m512 scale = _mm512_load_ps(inv + g);
      for (int64_t d0 = 0; d0 < head_dim; d0 += 16) {
        __m512i r[16];
        for (int i = 0; i < 16; ++i)
          r[i] = _mm512_castps_si512(_mm512_mul_ps(_mm512_loadu_ps(&ot[(d0 + i) * kTileLanes + g]), scale));
        transpose16x16(r);
        for (int64_t j = 0; j < std::min<int64_t>(16, lanes - g); ++j)
          store16_bf16(lane_out[g + j] + d0, _mm512_castsi512_ps(r[j]));
      }
    }
    return;
  }
#endif
  for (int64_t lane = 0; lane < lanes; ++lane) {
    T* o = lane_out[lane];
    for (int64_t d = 0; d < head_dim; ++d) o[d] = static_cast<T>(ot[d * kTileLanes + lane] * inv[lane]);
  }
}

template <typename T>
void tiled_attention_impl(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                          const at::Tensor& block_tables, const std::vector<QueryTile>& tasks,
                          const std::vector<TileSplit>& splits, int64_t num_partials, double scale,
                          at::Tensor& out) {
  const AttentionArgs<T> a(query, k_cache, v_cache, block_tables, scale, out);
  BadBlock bad;
  // bf16 scores straight from the cache with the bf16 dot product instruction (each product exact in
  // float32, summed in float32), two head dims per step; other dtypes widen K first.
#if defined(__AVX512BF16__)
  constexpr bool kPairs = std::is_same_v<T, c10::BFloat16>;
#else
  constexpr bool kPairs = false;
#endif
  // Each part of a split tile: its lanes' running max and sum, then its ot (see below).
  const int64_t partial_size = (2 + a.head_dim) * kTileLanes;
  std::vector<float> partials(num_partials * partial_size);
  const bool amx = kPairs && use_amx_attention(a);

  for_tile_tasks(a, tasks, [&](auto&& each_task) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if (amx) _tile_loadconfig(&kAttentionTiles);
#endif
    // bf16: qp[d / 2][lane] the query pairs, pp[j / 2][lane] the weight pairs, vp[j / 2][d] V's row pairs;
    // other dtypes: qt[d][lane] the scaled queries, kb, vb[j][d] one block's K and V rows, widened. Both:
    // s[j][lane] one block's scores (then weights), ot[d][lane] the unnormalised output.
    const int64_t max_pairs = (a.block_size + 1) / 2;
    std::vector<int32_t> qp(kPairs ? a.head_dim / 2 * kTileLanes : 0),
        pp(kPairs ? max_pairs * kTileLanes : 0), vp(kPairs ? max_pairs * a.head_dim : 0);
    // AMX: vt[d][j], a block's V transposed (see amx_values).
    std::vector<at::BFloat16> vt(amx ? a.head_dim * a.block_size : 0);
    std::vector<float> qt(kPairs ? 0 : a.head_dim * kTileLanes), kb(kPairs ? 0 : a.block_size * a.head_dim),
        vb(kPairs ? 0 : a.block_size * a.head_dim), s(a.block_size * kTileLanes), ot(a.head_dim * kTileLanes);
    // One task in R registers of lanes (R x 16 >= its query vectors).
    const auto task = [&](const QueryTile& t, auto registers) __attribute__((always_inline)) {
      constexpr int R = decltype(registers)::value;
      alignas(64) int32_t limit[kTileLanes];  // the last position each lane sees
      const T* lane_q[kTileLanes];            // each lane's query vector
      T* lane_out[kTileLanes];                // and its output
      const int64_t lanes = tile_lanes(a, t, limit, lane_q, lane_out);
      if constexpr (kPairs) {  // bf16 pairs (d, d + 1) as one 32-bit lane; the scale goes on the scores
        if (a.head_dim % 32 == 0) {
          // 16 lanes x 16 pairs at a time, transposed in registers.
          for (int64_t g = 0; g < 16 * R; g += 16)
            for (int64_t p0 = 0; p0 < a.head_dim / 2; p0 += 16) {
              __m512i r[16];
              for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(lane_q[g + i] + 2 * p0);
              transpose16x16(r);
              for (int j = 0; j < 16; ++j) _mm512_storeu_si512(&qp[(p0 + j) * kTileLanes + g], r[j]);
            }
        } else {
          for (int64_t lane = 0; lane < 16 * R; ++lane)
            for (int64_t d = 0; d < a.head_dim; d += 2)
              std::memcpy(&qp[d / 2 * kTileLanes + lane], lane_q[lane] + d, 4);
        }
      } else {
        for (int64_t lane = 0; lane < 16 * R; ++lane)
          for (int64_t d = 0; d < a.head_dim; ++d)
            qt[d * kTileLanes + lane] = static_cast<float>(lane_q[lane][d]) * a.fscale;
      }
      __m512i lim[R];
      __m512 max[R], sum[R];
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        lim[r] = _mm512_load_si512(limit + 16 * r);
        max[r] = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
        sum[r] = _mm512_setzero_ps();
      }
      std::fill(ot.begin(), ot.end(), 0.f);

      // One block of the task's sequence (see for_tile_blocks).
      const auto visit = [&](int64_t first, int64_t n, const T* k_block, const T* v_block) {
        if constexpr (!kPairs)
          for (int64_t j = 0; j < n; ++j) {
            load_row(k_block + j * a.row_stride, &kb[j * a.head_dim], a.head_dim);
            load_row(v_block + j * a.row_stride, &vb[j * a.head_dim], a.head_dim);
          }
        // Scores of kTilePositions positions for all lanes; positions a lane must not see become -inf (none
        // can be in a block that ends by the first lane's position), and the new running max.
        const bool masked = first + n - 1 > t.pos0;
        __m512 next[R];
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) next[r] = max[r];
        for (int64_t j0 = 0; j0 < n; j0 += kTilePositions) {
          __m512 acc[kTilePositions][R];
#pragma GCC unroll 8
          for (int64_t j = 0; j < kTilePositions; ++j)
#pragma GCC unroll 4
            for (int r = 0; r < R; ++r) acc[j][r] = _mm512_setzero_ps();
          const int64_t m = std::min(kTilePositions, n - j0);
          // Positions past m repeat the block's last row; their scores are never stored.
          if constexpr (kPairs) {
            if (amx) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
              // S^T = K Q^T for the whole block at once (see amx_scores), read here as the sums.
              if (j0 == 0) amx_scores<R>(k_block, a.row_stride, qp.data(), a.head_dim, s.data());
              for (int64_t j = 0; j < m; ++j)
#pragma GCC unroll 4
                for (int r = 0; r < R; ++r) acc[j][r] = _mm512_loadu_ps(&s[(j0 + j) * kTileLanes + 16 * r]);
#endif
            } else {
#if defined(__AVX512BF16__)
              const T* k_rows[kTilePositions];
              for (int64_t j = 0; j < kTilePositions; ++j)
                k_rows[j] = k_block + (j0 + std::min(j, m - 1)) * a.row_stride;
              for (int64_t d = 0; d < a.head_dim; d += 2) {
                __m512bh q[R];
#pragma GCC unroll 4
                for (int r = 0; r < R; ++r)
                  q[r] = (__m512bh)_mm512_loadu_si512(&qp[d / 2 * kTileLanes + 16 * r]);
#pragma GCC unroll 8
                for (int64_t j = 0; j < kTilePositions; ++j) {
                  int32_t pair;
                  std::memcpy(&pair, k_rows[j] + d, sizeof(pair));
                  const __m512bh k = (__m512bh)_mm512_set1_epi32(pair);
#pragma GCC unroll 4
                  for (int r = 0; r < R; ++r) acc[j][r] = _mm512_dpbf16_ps(acc[j][r], q[r], k);
                }
              }
#endif
            }
          } else {
            const float* k_rows = &kb[j0 * a.head_dim];
            for (int64_t d = 0; d < a.head_dim; ++d) {
              __m512 q[R];
#pragma GCC unroll 4
              for (int r = 0; r < R; ++r) q[r] = _mm512_loadu_ps(&qt[d * kTileLanes + 16 * r]);
#pragma GCC unroll 8
              for (int64_t j = 0; j < kTilePositions; ++j) {
                const __m512 k = _mm512_set1_ps(k_rows[std::min(j, m - 1) * a.head_dim + d]);
#pragma GCC unroll 4
                for (int r = 0; r < R; ++r) acc[j][r] = _mm512_fmadd_ps(q[r], k, acc[j][r]);
              }
            }
          }
          const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
          const __m512 score_scale = _mm512_set1_ps(kPairs ? a.fscale : 1.f);
          for (int64_t j = 0; j < m; ++j) {
            const __m512i pos = _mm512_set1_epi32(static_cast<int32_t>(first + j0 + j));
#pragma GCC unroll 4
            for (int r = 0; r < R; ++r) {
              __m512 sc = _mm512_mul_ps(acc[j][r], score_scale);
              if (masked) sc = _mm512_mask_mov_ps(sc, _mm512_cmpgt_epi32_mask(pos, lim[r]), ninf);
              _mm512_storeu_ps(&s[(j0 + j) * kTileLanes + 16 * r], sc);
              next[r] = _mm512_max_ps(next[r], sc);
            }
          }
        }
        // Online softmax over the block: the old output and sum rescaled by exp(old max - new max), the
        // scores turned into weights exp(s - new max).
        __m512 alpha[R];
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          alpha[r] = exp512(_mm512_sub_ps(max[r], next[r]));
          max[r] = next[r];
          sum[r] = _mm512_mul_ps(sum[r], alpha[r]);
        }
        if constexpr (!kPairs)  // bf16 takes its weights pair by pair below
          for (int64_t j = 0; j < n; ++j)
#pragma GCC unroll 4
            for (int r = 0; r < R; ++r) {
              const __m512 p = exp512(_mm512_sub_ps(_mm512_loadu_ps(&s[j * kTileLanes + 16 * r]), next[r]));
              _mm512_storeu_ps(&s[j * kTileLanes + 16 * r], p);
              sum[r] = _mm512_add_ps(sum[r], p);
            }
        // ot[d][lane] = alpha * ot[d][lane] + sum over j of s[j][lane] * V[j][d], kTileColumns d at a time.
        if constexpr (kPairs) {
#if defined(__AVX512BF16__)
          // Positions in pairs (j, j + 1): the weights, added to the sums in position order, then rounded
          // to bf16 side by side per lane (as FlashAttention feeds P to its second product); V's two rows
          // interleaved per column.
          const __m512i interleave =
              _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21,
                               5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
          for (int64_t jp = 0; jp < (n + 1) / 2; ++jp) {
            const int64_t j = 2 * jp;
            const bool second = j + 1 < n;  // an odd block's last pair has one position
#pragma GCC unroll 4
            for (int r = 0; r < R; ++r) {
              const __m512 lo = exp512(_mm512_sub_ps(_mm512_loadu_ps(&s[j * kTileLanes + 16 * r]), next[r]));
              sum[r] = _mm512_add_ps(sum[r], lo);
              __m512 hi = _mm512_setzero_ps();
              if (second) {
                hi = exp512(_mm512_sub_ps(_mm512_loadu_ps(&s[(j + 1) * kTileLanes + 16 * r]), next[r]));
                sum[r] = _mm512_add_ps(sum[r], hi);
              }
              _mm512_storeu_si512(&pp[jp * kTileLanes + 16 * r],
                                  _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(hi, lo)));
            }
            if (amx) continue;  // V is transposed whole below
            const T* r0 = v_block + j * a.row_stride;
            for (int64_t d = 0; d < a.head_dim; d += 16) {
              const __m256i row0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r0 + d));
              const __m256i row1 =
                  second ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r0 + a.row_stride + d))
                         : _mm256_setzero_si256();
              _mm512_storeu_si512(&vp[jp * a.head_dim + d],
                                  _mm512_permutexvar_epi16(
                                      interleave, _mm512_inserti64x4(_mm512_castsi256_si512(row0), row1, 1)));
            }
          }
#endif
        }
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
        if constexpr (kPairs)
          if (amx) {
            amx_values<R>(v_block, a.row_stride, n, a.head_dim, alpha, pp.data(), vt.data(), ot.data());
            return;
          }
#endif
        for (int64_t d0 = 0; d0 < a.head_dim; d0 += kTileColumns) {
          __m512 acc[kTileColumns][R];
#pragma GCC unroll 8
          for (int64_t c = 0; c < kTileColumns; ++c)
#pragma GCC unroll 4
            for (int r = 0; r < R; ++r)
              acc[c][r] = _mm512_mul_ps(_mm512_loadu_ps(&ot[(d0 + c) * kTileLanes + 16 * r]), alpha[r]);
          if constexpr (kPairs) {
#if defined(__AVX512BF16__)
            for (int64_t jp = 0; jp < (n + 1) / 2; ++jp) {
              __m512bh p[R];
#pragma GCC unroll 4
              for (int r = 0; r < R; ++r) p[r] = (__m512bh)_mm512_loadu_si512(&pp[jp * kTileLanes + 16 * r]);
              const int32_t* v_pairs = &vp[jp * a.head_dim + d0];
#pragma GCC unroll 8
              for (int64_t c = 0; c < kTileColumns; ++c) {
                const __m512bh v = (__m512bh)_mm512_set1_epi32(v_pairs[c]);
#pragma GCC unroll 4
                for (int r = 0; r < R; ++r) acc[c][r] = _mm512_dpbf16_ps(acc[c][r], p[r], v);
              }
            }
#endif
          } else {
            for (int64_t j = 0; j < n; ++j) {
              __m512 p[R];
#pragma GCC unroll 4
              for (int r = 0; r < R; ++r) p[r] = _mm512_loadu_ps(&s[j * kTileLanes + 16 * r]);
              const float* v_row = &vb[j * a.head_dim + d0];
#pragma GCC unroll 8
              for (int64_t c = 0; c < kTileColumns; ++c) {
                const __m512 v = _mm512_set1_ps(v_row[c]);
#pragma GCC unroll 4
                for (int r = 0; r < R; ++r) acc[c][r] = _mm512_fmadd_ps(p[r], v, acc[c][r]);
              }
            }
          }
#pragma GCC unroll 8
          for (int64_t c = 0; c < kTileColumns; ++c)
#pragma GCC unroll 4
            for (int r = 0; r < R; ++r) _mm512_storeu_ps(&ot[(d0 + c) * kTileLanes + 16 * r], acc[c][r]);
        }
      };
      if (!for_tile_blocks(a, t, bad, visit)) return;
      if (t.partial >= 0) {
        float* slot = &partials[t.partial * partial_size];
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          _mm512_storeu_ps(slot + 16 * r, max[r]);
          _mm512_storeu_ps(slot + kTileLanes + 16 * r, sum[r]);
        }
        std::copy(ot.begin(), ot.end(), slot + 2 * kTileLanes);
        return;
      }
      alignas(64) float inv[kTileLanes];
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) _mm512_store_ps(inv + 16 * r, _mm512_div_ps(_mm512_set1_ps(1.f), sum[r]));
      store_tile(ot.data(), inv, lanes, lane_out, a.head_dim);
    };
    each_task([&](const QueryTile& t) {
      if (t.rows * a.group > 32)
        task(t, std::integral_constant<int, 3>{});
      else
        task(t, std::integral_constant<int, 2>{});
    });
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    if (amx) _tile_release();
#endif
  });
  bad.check(a.num_blocks);
  // Each split tile's parts merged, lane by lane: the output is sum_p w_p ot_p / sum_p w_p sum_p, with
  // w_p = exp(max_p - the parts' max).
  std::vector<float> ot(a.head_dim * kTileLanes);
  for (const TileSplit& split : splits) {
    alignas(64) int32_t limit[kTileLanes];
    const T* lane_q[kTileLanes];
    T* lane_out[kTileLanes];
    const int64_t lanes = tile_lanes(a, split.tile, limit, lane_q, lane_out);
    const float* first = &partials[split.first_partial * partial_size];
    alignas(64) float inv[kTileLanes];
    for (int64_t g = 0; g < lanes; g += 16) {
      __m512 max = _mm512_loadu_ps(first + g);
      for (int64_t p = 1; p < split.parts; ++p)
        max = _mm512_max_ps(max, _mm512_loadu_ps(first + p * partial_size + g));
      __m512 total = _mm512_setzero_ps();
      for (int64_t p = 0; p < split.parts; ++p) {
        const float* part = first + p * partial_size;
        const __m512 w = exp512(_mm512_sub_ps(_mm512_loadu_ps(part + g), max));
        total = _mm512_fmadd_ps(w, _mm512_loadu_ps(part + kTileLanes + g), total);
        for (int64_t d = 0; d < a.head_dim; ++d) {
          const __m512 o = _mm512_loadu_ps(part + (2 + d) * kTileLanes + g);
          float* dst = &ot[d * kTileLanes + g];
          _mm512_storeu_ps(dst, p == 0 ? _mm512_mul_ps(w, o) : _mm512_fmadd_ps(w, o, _mm512_loadu_ps(dst)));
        }
      }
      _mm512_store_ps(inv + g, _mm512_div_ps(_mm512_set1_ps(1.f), total));
    }
    store_tile(ot.data(), inv, lanes, lane_out, a.head_dim);
  }
}
#elif defined(__AVX2__) && defined(__FMA__)

// The tiled kernel on AVX2, in float32 throughout (no bf16 dot product): each block's K and V rows are
// widened into float32 rows once per task, and the scores and the weighted sums of V rows are small
// matrix products whose lanes are query vectors, 16 at a time (two ymm; 8 for a task's last few): up to
// kTileSteps positions (scores) or value columns (output) by 16 lanes are 12 sums, which with the two lane
// registers and one broadcast fill 15 of the 16 registers. One layer of SmolLM2 (9 query heads of 64 over
// 3 kv heads, bf16, 2 threads, a 2-core Zen 3), against the row kernel: a prompt of 2000 tokens 56.0 ->
// 44.4 ms, 1000 tokens 14.7 -> 12.7, 4 of 500 14.2 -> 11.6, 8 of 250 7.6 -> 6.6, a chunk of 512 after 2488
// cached 39.1 -> 30.1 ms.
constexpr int kTileSteps = 6;

// The scores of P positions (K rows at kb, head_dim floats apart) for the 8L lanes of qt (scaled queries,
// qt[d * kTileLanes + lane]) into s[j * kTileLanes + lane]: where masked, positions past a lane's limit
// are -inf; max[h] takes the scores in.
template <int P, int L>
void tile_scores_avx2(const float* qt, const float* kb, int64_t head_dim, const __m256i (&limit)[2],
                      int32_t pos, bool masked, float* s, __m256 (&max)[2]) {
  __m256 acc[P][L];
#pragma GCC unroll 8
  for (int j = 0; j < P; ++j)
    for (int h = 0; h < L; ++h) acc[j][h] = _mm256_setzero_ps();
  for (int64_t d = 0; d < head_dim; ++d) {
    __m256 q[L];
    for (int h = 0; h < L; ++h) q[h] = _mm256_loadu_ps(qt + d * kTileLanes + 8 * h);
#pragma GCC unroll 8
    for (int j = 0; j < P; ++j) {
      const __m256 k = _mm256_broadcast_ss(kb + j * head_dim + d);
      for (int h = 0; h < L; ++h) acc[j][h] = _mm256_fmadd_ps(q[h], k, acc[j][h]);
    }
  }
  const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
#pragma GCC unroll 8
  for (int j = 0; j < P; ++j)
    for (int h = 0; h < L; ++h) {
      __m256 v = acc[j][h];
      if (masked) {
        const __m256i past = _mm256_cmpgt_epi32(_mm256_set1_epi32(pos + j), limit[h]);
        v = _mm256_blendv_ps(v, ninf, _mm256_castsi256_ps(past));
      }
      _mm256_storeu_ps(s + j * kTileLanes + 8 * h, v);
      max[h] = _mm256_max_ps(max[h], v);
    }
}

// ot[c * kTileLanes + lane] for C value columns and the 8L lanes: alpha * ot + the sum over j < n of the
// weights s[j * kTileLanes + lane] times V[j][c] (rows at vb, head_dim floats apart).
template <int C, int L>
void tile_values_avx2(const float* s, const float* vb, int64_t head_dim, int64_t n, const __m256 (&alpha)[2],
                      float* ot) {
  __m256 acc[C][L];
#pragma GCC unroll 8
  for (int c = 0; c < C; ++c)
    for (int h = 0; h < L; ++h)
      acc[c][h] = _mm256_mul_ps(_mm256_loadu_ps(ot + c * kTileLanes + 8 * h), alpha[h]);
  for (int64_t j = 0; j < n; ++j) {
    __m256 p[L];
    for (int h = 0; h < L; ++h) p[h] = _mm256_loadu_ps(s + j * kTileLanes + 8 * h);
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      const __m256 v = _mm256_broadcast_ss(vb + j * head_dim + c);
      for (int h = 0; h < L; ++h) acc[c][h] = _mm256_fmadd_ps(p[h], v, acc[c][h]);
    }
  }
#pragma GCC unroll 8
  for (int c = 0; c < C; ++c)
    for (int h = 0; h < L; ++h) _mm256_storeu_ps(ot + c * kTileLanes + 8 * h, acc[c][h]);
}

using TileScoresFn = void (*)(const float*, const float*, int64_t, const __m256i (&)[2], int32_t, bool,
                              float*, __m256 (&)[2]);
using TileValuesFn = void (*)(const float*, const float*, int64_t, int64_t, const __m256 (&)[2], float*);
template <int L, int... P>
constexpr std::array<TileScoresFn, sizeof...(P)> tile_scores_table(std::integer_sequence<int, P...>) {
  return {&tile_scores_avx2<P + 1, L>...};
}
template <int L, int... C>
constexpr std::array<TileValuesFn, sizeof...(C)> tile_values_table(std::integer_sequence<int, C...>) {
  return {&tile_values_avx2<C + 1, L>...};
}
// [lane registers - 1][positions or columns - 1]
constexpr std::array<std::array<TileScoresFn, kTileSteps>, 2> kTileScores = {
    tile_scores_table<1>(std::make_integer_sequence<int, kTileSteps>{}),
    tile_scores_table<2>(std::make_integer_sequence<int, kTileSteps>{})};
constexpr std::array<std::array<TileValuesFn, kTileSteps>, 2> kTileValues = {
    tile_values_table<1>(std::make_integer_sequence<int, kTileSteps>{}),
    tile_values_table<2>(std::make_integer_sequence<int, kTileSteps>{})};

// Transposes 8 x 8 floats in registers (lane j of r[i] becomes lane i of r[j]).
inline void transpose8x8(__m256 r[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
    r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
  }
}

template <typename T>
void tiled_attention_impl(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                          const at::Tensor& block_tables, const std::vector<QueryTile>& tasks,
                          const std::vector<TileSplit>& splits, int64_t num_partials, double scale,
                          at::Tensor& out) {
  TORCH_CHECK(splits.empty() && num_partials == 0, "the AVX2 tiled kernel computes whole tiles");
  const AttentionArgs<T> a(query, k_cache, v_cache, block_tables, scale, out);
  BadBlock bad;
  // bf16 and float rows 8 at a time (load8, store8_bf16), transposed in registers, where a row is whole
  // registers; else one value at a time.
  constexpr bool kVectorRows = std::is_same_v<T, c10::BFloat16> || std::is_same_v<T, float>;
  const bool vector_rows = kVectorRows && a.head_dim % 8 == 0;
  for_tile_tasks(a, tasks, [&](auto&& each_task) {
    // qt[d][lane] the scaled queries, kb, vb[j][d] one block's K and V rows, widened, s[j][lane] one block's
    // scores (then weights), ot[d][lane] the unnormalised output.
    std::vector<float> qt(a.head_dim * kTileLanes), kb(a.block_size * a.head_dim),
        vb(a.block_size * a.head_dim), s(a.block_size * kTileLanes), ot(a.head_dim * kTileLanes);
    each_task([&](const QueryTile& t) {
      alignas(32) int32_t limit[kTileLanes];
      const T* lane_q[kTileLanes];
      T* lane_out[kTileLanes];
      const int64_t lanes = tile_lanes(a, t, limit, lane_q, lane_out), halves = (lanes + 15) / 16;
      if constexpr (kVectorRows) {
        if (vector_rows) {
          const __m256 fscale = _mm256_set1_ps(a.fscale);
          for (int64_t g = 0; g < kTileLanes; g += 8)
            for (int64_t d0 = 0; d0 < a.head_dim; d0 += 8) {
              __m256 r[8];
              for (int i = 0; i < 8; ++i) r[i] = load8(lane_q[g + i] + d0);
              transpose8x8(r);
              for (int i = 0; i < 8; ++i)
                _mm256_storeu_ps(&qt[(d0 + i) * kTileLanes + g], _mm256_mul_ps(r[i], fscale));
            }
        }
      }
      if (!vector_rows)
        for (int64_t lane = 0; lane < kTileLanes; ++lane)
          for (int64_t d = 0; d < a.head_dim; ++d)
            qt[d * kTileLanes + lane] = static_cast<float>(lane_q[lane][d]) * a.fscale;
      // Per half of the lanes (16 each): the last positions they see, the running max and sum.
      __m256i lim[2][2];
      __m256 max[2][2], sum[2][2];
      for (int h = 0; h < 2; ++h)
        for (int i = 0; i < 2; ++i) {
          lim[h][i] = _mm256_load_si256(reinterpret_cast<const __m256i*>(limit + 16 * h + 8 * i));
          max[h][i] = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
          sum[h][i] = _mm256_setzero_ps();
        }
      std::fill(ot.begin(), ot.end(), 0.f);

      // One block of the task's sequence (see for_tile_blocks).
      const auto visit = [&](int64_t first, int64_t n, const T* k_block, const T* v_block) {
        for (int64_t j = 0; j < n; ++j) {
          load_row(k_block + j * a.row_stride, &kb[j * a.head_dim], a.head_dim);
          load_row(v_block + j * a.row_stride, &vb[j * a.head_dim], a.head_dim);
        }
        // Positions a lane must not see become -inf (none can be in a block that ends by the first lane's
        // position).
        const bool masked = first + n - 1 > t.pos0;
        for (int64_t h = 0; h < halves; ++h) {
          const int regs = lanes - 16 * h > 8 ? 2 : 1;  // of 8 lanes: one where the task's vectors end early
          // The block's scores, its positions in balanced parts (16 is 6 + 5 + 5), and the new max.
          __m256 new_max[2] = {max[h][0], max[h][1]};
          const int64_t parts = (n + kTileSteps - 1) / kTileSteps;
          for (int64_t i = 0; i < parts; ++i) {
            const int64_t j0 = n * i / parts, j1 = n * (i + 1) / parts;
            kTileScores[regs - 1][j1 - j0 - 1](&qt[16 * h], &kb[j0 * a.head_dim], a.head_dim, lim[h],
                                               static_cast<int32_t>(first + j0), masked,
                                               &s[j0 * kTileLanes + 16 * h], new_max);
          }
          // Online softmax: the old output and sum rescaled by exp(old max - new max), the scores turned
          // into weights exp(s - new max).
          __m256 alpha[2];
          for (int i = 0; i < regs; ++i) {
            alpha[i] = exp256(_mm256_sub_ps(max[h][i], new_max[i]));
            max[h][i] = new_max[i];
            sum[h][i] = _mm256_mul_ps(sum[h][i], alpha[i]);
            for (int64_t j = 0; j < n; ++j) {
              float* at = &s[j * kTileLanes + 16 * h + 8 * i];
              const __m256 p = exp256(_mm256_sub_ps(_mm256_loadu_ps(at), new_max[i]));
              _mm256_storeu_ps(at, p);
              sum[h][i] = _mm256_add_ps(sum[h][i], p);
            }
          }
          for (int64_t d0 = 0; d0 < a.head_dim; d0 += kTileSteps)
            kTileValues[regs - 1][std::min<int64_t>(kTileSteps, a.head_dim - d0) - 1](
                &s[16 * h], &vb[d0], a.head_dim, n, alpha, &ot[d0 * kTileLanes + 16 * h]);
        }
      };
      if (!for_tile_blocks(a, t, bad, visit)) return;
      alignas(32) float inv[kTileLanes];
      for (int h = 0; h < 2; ++h)
        for (int i = 0; i < 2; ++i)
          _mm256_store_ps(inv + 16 * h + 8 * i, _mm256_div_ps(_mm256_set1_ps(1.f), sum[h][i]));
      const int64_t head_dim = a.head_dim;  // a local: the stores below could alias a's fields
      if constexpr (kVectorRows) {
        if (vector_rows)
          for (int64_t g = 0; g < lanes; g += 8) {
            const __m256 scale = _mm256_load_ps(inv + g);
            for (int64_t d0 = 0; d0 < head_dim; d0 += 8) {
              __m256 r[8];
              for (int i = 0; i < 8; ++i)
                r[i] = _mm256_mul_ps(_mm256_loadu_ps(&ot[(d0 + i) * kTileLanes + g]), scale);
              transpose8x8(r);
              for (int64_t j = 0; j < std::min<int64_t>(8, lanes - g); ++j) {
                if constexpr (std::is_same_v<T, c10::BFloat16>)
                  store8_bf16(lane_out[g + j] + d0, r[j]);  // rounded as c10 rounds
                else
                  _mm256_storeu_ps(lane_out[g + j] + d0, r[j]);
              }
            }
          }
      }
      if (!vector_rows)
        for (int64_t lane = 0; lane < lanes; ++lane) {
          T* o = lane_out[lane];
          for (int64_t d = 0; d < head_dim; ++d) o[d] = static_cast<T>(ot[d * kTileLanes + lane] * inv[lane]);
        }
    });
  });
  bad.check(a.num_blocks);
}
#endif

// How paged_attention_ computes a batch: its sequences' row chunks (the row kernel) and query tiles (the
// tiled kernel), and the sequences it leaves to the caller. It depends on the batch's metadata and the
// cache's shape alone, so a decoder computes it once for all its layers (see DecoderStack).
struct AttentionPlan {
  std::vector<RowChunk> chunks;
  std::vector<QueryTile> tiles;   // the longest first
  std::vector<TileSplit> splits;  // the tiles whose blocks went to several of tiles
  int64_t num_partials = 0;
  std::vector<int64_t> skipped;
};

// The plan of paged_attention_ for num_tokens query rows of num_heads heads against caches shaped like
// k_cache, with every check of the metadata.
AttentionPlan plan_attention(int64_t num_tokens, int64_t num_heads, const at::Tensor& k_cache,
                             const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                             const at::Tensor& context_lens, int64_t max_pairs, int64_t min_tile_lanes) {
  TORCH_CHECK(num_heads % k_cache.size(2) == 0, "num_heads ", num_heads,
              " is not a multiple of num_kv_heads ", k_cache.size(2));
  TORCH_CHECK(
      block_tables.dim() == 2 && block_tables.scalar_type() == at::kInt && block_tables.stride(1) == 1,
      "block_tables must be int32 [num_seqs, max_blocks]");
  TORCH_CHECK(query_start_loc.scalar_type() == at::kInt && context_lens.scalar_type() == at::kInt,
              "query_start_loc and context_lens must be int32");
  const int64_t num_seqs = context_lens.numel();
  TORCH_CHECK(query_start_loc.numel() == num_seqs + 1 && block_tables.size(0) == num_seqs,
              "query_start_loc, context_lens and block_tables disagree on the number of sequences");
  const at::Tensor starts = query_start_loc.contiguous(), lens = context_lens.contiguous();
  const int32_t* start = starts.data_ptr<int32_t>();
  const int32_t* ctx = lens.data_ptr<int32_t>();
  TORCH_CHECK(start[0] == 0 && start[num_seqs] == num_tokens, "query_start_loc must run from 0 to ",
              num_tokens);
  const int64_t max_ctx = block_tables.size(1) * k_cache.size(1);
  const int64_t threads = std::max(1, at::get_num_threads());
  const int64_t group = num_heads / k_cache.size(2);
#if defined(__AVX512F__)
  const bool can_tile = k_cache.size(3) % 16 == 0 && group <= kTileLanes;  // the head size
#elif defined(__AVX2__) && defined(__FMA__)
  const bool can_tile = group <= kTileLanes;
#else
  const bool can_tile = false;
#endif
  if (min_tile_lanes < 0) min_tile_lanes = kTileMinLanes;
  AttentionPlan plan;
  plan.chunks.reserve(num_tokens);
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t q_len = start[s + 1] - start[s];
    TORCH_CHECK(q_len >= 0 && q_len <= ctx[s], "sequence ", s, ": ", q_len, " queries but context length ",
                ctx[s]);
    TORCH_CHECK(ctx[s] <= max_ctx, "sequence ", s, ": context length ", ctx[s], " exceeds its block table (",
                max_ctx, " positions)");
    if (can_tile && q_len > 1 && q_len * group >= min_tile_lanes) {
      // Tasks of as many rows as fill kTileLanes, evened out: 40 rows of 3 heads in 48 lanes are 14 + 14 +
      // 12, not 16 + 16 + 8.
      const int64_t per_task = kTileLanes / group, num_row_tiles = (q_len + per_task - 1) / per_task;
      const int64_t rows = (q_len + num_row_tiles - 1) / num_row_tiles;
      for (int64_t i = 0; i < q_len; i += rows)
        for (int64_t h = 0; h < k_cache.size(2); ++h)
          plan.tiles.push_back({s, h, start[s] + i, ctx[s] - q_len + i, std::min(rows, q_len - i)});
      continue;
    }
    const int64_t pairs = q_len * ctx[s] - q_len * (q_len - 1) / 2;
    if (max_pairs >= 0 && q_len > 1 && pairs > max_pairs) {
      plan.skipped.push_back(s);
      continue;
    }
    if (q_len == 0) continue;
    // Chunks of at most kChunkRows rows, as many as a multiple of the threads when there are enough rows,
    // and as even as possible: 20 rows on 2 threads are 4 chunks of 5, not 8, 8 and 4.
    int64_t num_row_chunks = (q_len + kChunkRows - 1) / kChunkRows;
    if (q_len >= threads) num_row_chunks = (num_row_chunks + threads - 1) / threads * threads;
    const int64_t rows = (q_len + num_row_chunks - 1) / num_row_chunks;
    for (int64_t i = 0; i < q_len; i += rows)
      plan.chunks.push_back({s, start[s] + i, ctx[s] - q_len + i, std::min(rows, q_len - i)});
  }
  const int64_t block_size = k_cache.size(1);
#if defined(__AVX512F__)
  // Fewer tiles than two per thread (a prompt's last chunk after a long cached prefix: one per kv head)
  // leave threads idle; each such tile's blocks are split into parts of kSplitMinBlocks blocks or more, all
  // starting at or before the block of the tile's first row so that every lane sees a position in every part.
  const int64_t num_tiles = static_cast<int64_t>(plan.tiles.size());
  if (threads > 1 && num_tiles > 0 && num_tiles < 2 * threads) {
    const int64_t wanted = (2 * threads + num_tiles - 1) / num_tiles;
    std::vector<QueryTile> tasks;
    for (const QueryTile& t : plan.tiles) {
      const int64_t shared_blocks = t.pos0 / block_size + 1;  // those up to the first row's
      const int64_t parts = std::min(wanted, shared_blocks / kSplitMinBlocks);
      if (parts < 2) {
        tasks.push_back(t);
        continue;
      }
      plan.splits.push_back({t, plan.num_partials, parts});
      for (int64_t p = 0; p < parts; ++p) {
        QueryTile part = t;
        part.block_begin = p * shared_blocks / parts;
        if (p + 1 < parts) part.block_end = (p + 1) * shared_blocks / parts;
        part.partial = plan.num_partials++;
        tasks.push_back(part);
      }
    }
    plan.tiles = std::move(tasks);
  }
#endif
  // The longest first: tasks are handed out dynamically, and a late long one would run alone.
  const auto positions = [block_size](const QueryTile& t) {
    const int64_t end_block = std::min(t.block_end, (t.pos0 + t.rows - 1) / block_size + 1);
    return std::min(t.pos0 + t.rows, end_block * block_size) - t.block_begin * block_size;
  };
  std::stable_sort(plan.tiles.begin(), plan.tiles.end(),
                   [&](const QueryTile& a, const QueryTile& b) { return positions(a) > positions(b); });
  return plan;
}

// The checks of paged_attention_'s tensors (its metadata is plan_attention's).
void check_attention(const at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache,
                     const at::Tensor& v_cache) {
  check_cache(k_cache, v_cache);
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1 && query.stride(1) == query.size(2),
              "query must be [num_tokens, num_heads, head_dim] with contiguous heads");
  TORCH_CHECK(query.scalar_type() == k_cache.scalar_type(), "query dtype ", query.scalar_type(),
              " != cache dtype ", k_cache.scalar_type());
  TORCH_CHECK(query.size(2) == k_cache.size(3), "query head_dim ", query.size(2), " != cache head_dim ",
              k_cache.size(3));
  TORCH_CHECK(out.sizes() == query.sizes() && out.is_contiguous() && out.scalar_type() == query.scalar_type(),
              "out must be a contiguous tensor shaped and typed like query");
}

// A plan's chunks and tiles computed into out (the tensors checked by check_attention).
void run_attention(const AttentionPlan& plan, at::Tensor& out, const at::Tensor& query,
                   const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_tables,
                   double scale) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_attention", [&] {
    if (!plan.chunks.empty())
      paged_attention_impl<scalar_t>(query, k_cache, v_cache, block_tables, plan.chunks, scale, out);
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
    if (!plan.tiles.empty())
      tiled_attention_impl<scalar_t>(query, k_cache, v_cache, block_tables, plan.tiles, plan.splits,
                                     plan.num_partials, scale, out);
#endif
  });
}

// query [T, Hq, D] (rows may be strided); k_cache, v_cache [num_blocks, block_size, Hkv, D];
// block_tables int32 [S, max_blocks]; query_start_loc int32 [S + 1]; context_lens int32 [S].
// Sequence s owns query rows query_start_loc[s] .. query_start_loc[s + 1], its last tokens; a token at
// position p attends to positions 0 .. p. Decode is the case of one row per sequence. Writes the rows of
// out [T, Hq, D] of every sequence except those with several queries and more than max_pairs
// query-key pairs (none when max_pairs is negative); returns those, which are left to the caller. A
// sequence of several queries with at least min_tile_lanes query vectors per kv head takes the tiled
// kernel where the build has one (kTileMinLanes when negative), the others the row kernel.
std::vector<int64_t> paged_attention_(at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache,
                                      const at::Tensor& v_cache, const at::Tensor& block_tables,
                                      const at::Tensor& query_start_loc, const at::Tensor& context_lens,
                                      double scale, int64_t max_pairs, int64_t min_tile_lanes) {
  check_attention(out, query, k_cache, v_cache);
  AttentionPlan plan = plan_attention(query.size(0), query.size(1), k_cache, block_tables, query_start_loc,
                                      context_lens, max_pairs, min_tile_lanes);
  run_attention(plan, out, query, k_cache, v_cache, block_tables, scale);
  return std::move(plan.skipped);
}

// ---- fused pointwise ops --------------------------------------------------------------------------------

// Rows of a pointwise op handed to one thread: about 64K values (tens of microseconds of work), so that
// a decode batch runs on the calling thread instead of paying a parallel region for a few microseconds.
inline int64_t pointwise_grain(int64_t values_per_row) {
  return std::max<int64_t>(1, 65536 / std::max<int64_t>(1, values_per_row));
}

#if defined(__AVX512BF16__)
// rms_norm_impl's row for bf16 and a size that is a multiple of 16, in registers: the same roundings, and
// the sum of squares in dot's order.
inline void rms_norm_row_bf16(at::BFloat16* x, const at::BFloat16* delta, const at::BFloat16* weight,
                              at::BFloat16* out, int64_t size, float eps) {
  __m512 squares = _mm512_setzero_ps();
  for (int64_t i = 0; i < size; i += 16) {
    __m512 v = load16_bf16(x + i);
    if (delta != nullptr) {
      v = round_bf16(_mm512_add_ps(v, load16_bf16(delta + i)));
      store16_bf16(x + i, v);
    }
    squares = _mm512_fmadd_ps(v, v, squares);
  }
  const __m512 inv =
      _mm512_set1_ps(1.f / std::sqrt(_mm512_reduce_add_ps(squares) / static_cast<float>(size) + eps));
  for (int64_t i = 0; i < size; i += 16)
    store16_bf16(out + i,
                 _mm512_mul_ps(load16_bf16(weight + i), round_bf16(_mm512_mul_ps(load16_bf16(x + i), inv))));
}
#endif

// out = weight * (x * rsqrt(mean(x^2) + eps)) per row, normalised in float32, rounded to the dtype
// before the weight is applied (as the HF models do). When delta is given, x += delta first, in place.
template <typename T>
void rms_norm_impl(T* x, int64_t x_stride, const T* delta, int64_t delta_stride, const T* weight, T* out,
                   int64_t out_stride, int64_t rows, int64_t size, double eps) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (size % 16 == 0) {
      at::parallel_for(0, rows, pointwise_grain(size), [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r)
          rms_norm_row_bf16(x + r * x_stride, delta == nullptr ? nullptr : delta + r * delta_stride, weight,
                            out + r * out_stride, size, static_cast<float>(eps));
      });
      return;
    }
  }
#endif
  at::parallel_for(0, rows, pointwise_grain(size), [&](int64_t begin, int64_t end) {
    std::vector<float> v(size), w(size);
    load_row(weight, w.data(), size);
    for (int64_t r = begin; r < end; ++r) {
      T* xr = x + r * x_stride;
      if (delta != nullptr) {
        const T* dr = delta + r * delta_stride;
        for (int64_t i = 0; i < size; ++i)
          xr[i] = static_cast<T>(static_cast<float>(xr[i]) + static_cast<float>(dr[i]));
      }
      load_row(xr, v.data(), size);
      const float inv =
          1.f / std::sqrt(dot(v.data(), v.data(), size) / static_cast<float>(size) + static_cast<float>(eps));
      T* o = out + r * out_stride;
      for (int64_t i = 0; i < size; ++i) o[i] = static_cast<T>(w[i] * round_to<T>(v[i] * inv));
    }
  });
}

at::Tensor rms_norm_any(const at::Tensor& x, const c10::optional<at::Tensor>& delta, const at::Tensor& weight,
                        double eps) {
  TORCH_CHECK(x.dim() >= 1 && x.stride(-1) == 1, "x must have a contiguous last dimension");
  const int64_t size = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == size && weight.is_contiguous(), "weight must be [", size,
              "]");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "weight and x differ in dtype");
  // In place, x must be viewable as rows (view fails clearly otherwise); else any layout will do.
  at::Tensor rows = delta.has_value() ? x.view({-1, size}) : x.reshape({-1, size});
  at::Tensor d;
  if (delta.has_value()) {
    d = delta->reshape({-1, size});
    TORCH_CHECK(d.sizes() == rows.sizes() && d.stride(1) == 1 && d.scalar_type() == x.scalar_type(),
                "delta must match x");
  }
  at::Tensor out = at::empty(x.sizes(), x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_norm_impl<scalar_t>(rows.data_ptr<scalar_t>(), rows.stride(0),
                            d.defined() ? d.data_ptr<scalar_t>() : nullptr, d.defined() ? d.stride(0) : 0,
                            weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), size, rows.size(0), size,
                            eps);
  });
  return out;
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return rms_norm_any(x, c10::nullopt, weight, eps);
}

at::Tensor add_rms_norm_(at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight, double eps) {
  return rms_norm_any(x, delta, weight, eps);
}

#if defined(__AVX512BF16__)
// silu(g) * u for 16 bf16 gate and up values, rounded as silu_mul_impl's scalar loop rounds.
inline void silu_mul16(at::BFloat16* out, const at::BFloat16* gate, const at::BFloat16* up) {
  const __m512 g = load16_bf16(gate);
  const __m512 silu =
      _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), exp512(_mm512_sub_ps(_mm512_setzero_ps(), g))));
  store16_bf16(out, _mm512_mul_ps(round_bf16(silu), load16_bf16(up)));
}
#endif

// silu(gate) * up of gate_up [T, 2I] (gate first) -> [T, I], rounded where reference.silu_mul rounds: the
// silu to the dtype, then the product. silu(g) = g / (1 + exp(-g)), with the exp above (PyTorch's differs
// in the last float bit or two, which the rounding to bf16 or fp16 almost always absorbs).
template <typename T>
void silu_mul_impl(const T* x, int64_t x_stride, T* out, int64_t rows, int64_t size) {
  // Rows in chunks of about 16K values: one decode row runs on the calling thread, a prompt on all.
  const int64_t grain = std::max<int64_t>(1, 16384 / size);
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = x + r * x_stride;
      const T* up = gate + size;
      T* o = out + r * size;
      int64_t i = 0;
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        for (; i + 16 <= size; i += 16) silu_mul16(o + i, gate + i, up + i);
      }
#elif defined(__AVX2__) && defined(__FMA__)
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        for (; i + 8 <= size; i += 8) {  // the silu rounded to bf16, then the product
          store8_bf16(o + i, _mm256_mul_ps(round_bf16_avx2(silu256(load8(gate + i))), load8(up + i)));
        }
      } else if constexpr (std::is_same_v<T, float>) {
        for (; i + 8 <= size; i += 8) _mm256_storeu_ps(o + i, _mm256_mul_ps(silu256(load8(gate + i)), load8(up + i)));
      }
#endif
      for (; i < size; ++i) {
        float e = -static_cast<float>(gate[i]);
        exp_inplace(&e, 1);
        const float silu = round_to<T>(static_cast<float>(gate[i]) / (1.f + e));
        o[i] = static_cast<T>(silu * static_cast<float>(up[i]));
      }
    }
  });
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() >= 1 && gate_up.size(-1) % 2 == 0 && gate_up.stride(-1) == 1,
              "gate_up must be [..., 2 * I] with a contiguous last dimension");
  const int64_t size = gate_up.size(-1) / 2;
  const at::Tensor rows = gate_up.reshape({-1, 2 * size});
  std::vector<int64_t> shape(gate_up.sizes().begin(), gate_up.sizes().end());
  shape.back() = size;
  at::Tensor out = at::empty(shape, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu_mul", [&] {
    silu_mul_impl<scalar_t>(rows.data_ptr<scalar_t>(), rows.stride(0), out.data_ptr<scalar_t>(), rows.size(0),
                            size);
  });
  return out;
}

// ---- the sampler's argmax -------------------------------------------------------------------------------

#if defined(__AVX512F__)
// 16 float32 or bf16 values as float32 (a bf16 widened exactly: it is a float32's upper half).
inline __m512 load16_wide(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16_wide(const at::BFloat16* p) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}
#endif

// Index of the largest of x[0 .. n) (float32 or bf16): the first where several are equal, the first NaN if
// there is one (torch.argmax's answer). bf16 rows are compared as they widen, exactly, so a bf16 row's
// answer is that of the row widened to float32.
template <typename T>
inline int64_t argmax_row(const T* x, int64_t n) {
  int64_t best = 0, i = 0;
#if defined(__AVX512F__)
  if (n >= 16) {
    // Per lane the largest value so far and its index; a later equal value leaves the earlier index.
    __m512 max = load16_wide(x);
    __m512i index = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), at = index;
    const __m512i step = _mm512_set1_epi32(16);
    bool nan = _mm512_cmp_ps_mask(max, max, _CMP_UNORD_Q) != 0;
    for (i = 16; !nan && i + 16 <= n; i += 16) {
      const __m512 v = load16_wide(x + i);
      at = _mm512_add_epi32(at, step);
      nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) != 0;
      const __mmask16 greater = _mm512_cmp_ps_mask(v, max, _CMP_GT_OQ);
      max = _mm512_mask_mov_ps(max, greater, v);
      index = _mm512_mask_mov_epi32(index, greater, at);
    }
    if (!nan) {
      const float top = _mm512_reduce_max_ps(max);
      best = _mm512_mask_reduce_min_epi32(_mm512_cmp_ps_mask(max, _mm512_set1_ps(top), _CMP_EQ_OQ), index);
    } else {
      i = 0;  // a NaN somewhere: the plain loop below finds the first one
    }
  }
#elif defined(__AVX2__)
  // The same on 8 lanes. Rows of a 49k vocabulary: 1 row 72 -> 7.9 us, 24 rows 791 -> 117 us against the
  // plain loop (0.8 ms of a 24-row decode step).
  if (n >= 8) {
    __m256 max = load8(x);
    __m256i index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), at = index;
    const __m256i step = _mm256_set1_epi32(8);
    bool nan = _mm256_movemask_ps(_mm256_cmp_ps(max, max, _CMP_UNORD_Q)) != 0;
    for (i = 8; !nan && i + 8 <= n; i += 8) {
      const __m256 v = load8(x + i);
      at = _mm256_add_epi32(at, step);
      nan = _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)) != 0;
      const __m256 greater = _mm256_cmp_ps(v, max, _CMP_GT_OQ);
      max = _mm256_blendv_ps(max, v, greater);
      index = _mm256_blendv_epi8(index, at, _mm256_castps_si256(greater));
    }
    if (!nan) {
      alignas(32) float values[8];
      alignas(32) int32_t indices[8];
      _mm256_store_ps(values, max);
      _mm256_store_si256(reinterpret_cast<__m256i*>(indices), index);
      const float top = *std::max_element(values, values + 8);
      best = std::numeric_limits<int32_t>::max();
      for (int lane = 0; lane < 8; ++lane)
        if (values[lane] == top) best = std::min<int64_t>(best, indices[lane]);
    } else {
      i = 0;  // a NaN somewhere: the plain loop below finds the first one
    }
  }
#endif
  for (; i < n; ++i) {
    const float v = static_cast<float>(x[i]);
    if (std::isnan(v)) return i;
    if (v > static_cast<float>(x[best])) best = i;
  }
  return best;
}

// argmax_row of every row of x [R, V] float32 or bf16 -> int64 [R].
at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
                  x.stride(1) == 1 && x.size(1) > 0,
              "x must be float32 or bf16 [rows, n > 0] with contiguous rows");
  TORCH_CHECK(x.size(1) <= std::numeric_limits<int32_t>::max(), "rows longer than 2^31 - 1");
  at::Tensor out = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  const int64_t n = x.size(1), stride = x.stride(0);
  const auto rows = [&](const auto* base) {
    at::parallel_for(0, x.size(0), 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) o[r] = argmax_row(base + r * stride, n);
    });
  };
  if (x.scalar_type() == at::kFloat)
    rows(x.data_ptr<float>());
  else
    rows(x.data_ptr<at::BFloat16>());
  return out;
}

// The inputs of a decode step (one token per sequence) from the runner's per-slot arrays: sequence i (slot
// slots[i]) computes its token at position start[i]. Returns its input ids (token_ids[slot, start]), the
// positions (start itself), its slot mapping (the cache slot of that position through the slot's block
// table), the block tables of the sequences up to the longest one's blocks, the query starts (0 .. S) and
// the context lengths (start + 1), as the runner's general path computes them with numpy
// (worker_svc/runner.py), in one call instead of eight numpy calls and six tensors, which run cold after
// every forward pass. slots and start come as Python lists: converting them costs less than a tensor each.
std::vector<at::Tensor> decode_inputs(const at::Tensor& token_ids, const at::Tensor& block_tables,
                                      const std::vector<int64_t>& slots, const std::vector<int64_t>& start,
                                      int64_t block_size) {
  TORCH_CHECK(token_ids.dim() == 2 && token_ids.scalar_type() == at::kLong && token_ids.stride(1) == 1,
              "token_ids must be int64 [rows, tokens] with contiguous rows");
  TORCH_CHECK(
      block_tables.dim() == 2 && block_tables.scalar_type() == at::kInt && block_tables.stride(1) == 1,
      "block_tables must be int32 [rows, blocks] with contiguous rows");
  TORCH_CHECK(start.size() == slots.size(), "slots and start differ in length");
  TORCH_CHECK(block_size > 0, "block_size must be positive");
  const int64_t n = static_cast<int64_t>(slots.size());
  const int64_t* slot = slots.data();
  const int64_t* pos = start.data();
  int64_t max_blocks = 0;
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(slot[i] >= 0 && slot[i] < token_ids.size(0) && slot[i] < block_tables.size(0), "slot ",
                slot[i], " is outside the arrays");
    TORCH_CHECK(pos[i] >= 0 && pos[i] < token_ids.size(1) && pos[i] / block_size < block_tables.size(1),
                "position ", pos[i], " of slot ", slot[i], " is outside the arrays");
    max_blocks = std::max(max_blocks, pos[i] / block_size + 1);
  }
  const at::TensorOptions longs = token_ids.options(), ints = block_tables.options();
  at::Tensor ids = at::empty({n}, longs), positions = at::empty({n}, longs),
             slot_mapping = at::empty({n}, longs);
  at::Tensor tables = at::empty({n, max_blocks}, ints), qsl = at::empty({n + 1}, ints),
             lens = at::empty({n}, ints);
  const int64_t* tok = token_ids.data_ptr<int64_t>();
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  int64_t* id = ids.data_ptr<int64_t>();
  int64_t* p = positions.data_ptr<int64_t>();
  int64_t* sm = slot_mapping.data_ptr<int64_t>();
  int32_t* tb = tables.data_ptr<int32_t>();
  int32_t* q = qsl.data_ptr<int32_t>();
  int32_t* len = lens.data_ptr<int32_t>();
  q[0] = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t* row = tok + slot[i] * token_ids.stride(0);
    const int32_t* table = bt + slot[i] * block_tables.stride(0);
    id[i] = row[pos[i]];
    p[i] = pos[i];
    sm[i] = static_cast<int64_t>(table[pos[i] / block_size]) * block_size + pos[i] % block_size;
    std::memcpy(tb + i * max_blocks, table, max_blocks * sizeof(int32_t));
    q[i + 1] = static_cast<int32_t>(i + 1);
    len[i] = static_cast<int32_t>(pos[i] + 1);
  }
  return {ids, positions, slot_mapping, tables, qsl, lens};
}

// The argmax of each row of logits [S, V] (as argmax_rows), written into the runner's token ids at
// token_ids[slots[i], positions[i]] and returned as a list: a greedy decode step's sampling, in one call
// instead of the sampler's, a tensor's tolist() and a numpy store per sequence, which run cold after every
// forward pass. Every row is checked before any is written.
std::vector<int64_t> argmax_append_(const at::Tensor& logits, at::Tensor& token_ids,
                                    const std::vector<int64_t>& slots,
                                    const std::vector<int64_t>& positions) {
  TORCH_CHECK(token_ids.dim() == 2 && token_ids.scalar_type() == at::kLong && token_ids.stride(1) == 1,
              "token_ids must be int64 [rows, tokens] with contiguous rows");
  const int64_t n = static_cast<int64_t>(slots.size());
  TORCH_CHECK(positions.size() == slots.size(), "slots and positions differ in length");
  TORCH_CHECK(logits.dim() == 2 && logits.size(0) == n, "logits must have a row per slot");
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(slots[i] >= 0 && slots[i] < token_ids.size(0) && positions[i] >= 0 &&
                    positions[i] < token_ids.size(1),
                "position ", positions[i], " of slot ", slots[i], " is outside the token ids");
  const at::Tensor best = argmax_rows(logits);
  const int64_t* b = best.data_ptr<int64_t>();
  int64_t* tok = token_ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) tok[slots[i] * token_ids.stride(0) + positions[i]] = b[i];
  return std::vector<int64_t>(b, b + n);
}

// For every cache, block src[i] copied to block dst[i], one copy after another (a block written by copy i
// and read by a later one passes on its new content). One call for all layers: PyTorch's index_select and
// index_copy_ cost two ops per cache, 60 for a 30-layer model, about 0.6 ms for a single copy-on-write.
void copy_blocks_(const std::vector<at::Tensor>& caches, const at::Tensor& src, const at::Tensor& dst) {
  TORCH_CHECK(src.dim() == 1 && dst.sizes() == src.sizes() && src.scalar_type() == at::kLong &&
                  dst.scalar_type() == at::kLong,
              "src and dst must be int64 [N]");
  const at::Tensor s = src.contiguous(), d = dst.contiguous();
  const int64_t* from = s.data_ptr<int64_t>();
  const int64_t* to = d.data_ptr<int64_t>();
  if (caches.empty() || s.numel() == 0) return;
  // Each block a run of memory: a contiguous cache, or one of check_cache's layouts.
  for (const at::Tensor& cache : caches)
    TORCH_CHECK((cache.is_contiguous() || is_cache_layout(cache)) && cache.dim() >= 1 &&
                    cache.sizes() == caches[0].sizes() && cache.strides() == caches[0].strides() &&
                    cache.scalar_type() == caches[0].scalar_type(),
                "the caches must be alike, each contiguous or a KV cache (see check_cache)");
  const int64_t num_blocks = caches[0].size(0);  // the same in every cache, as just checked
  for (int64_t i = 0; i < s.numel(); ++i)
    TORCH_CHECK(from[i] >= 0 && from[i] < num_blocks && to[i] >= 0 && to[i] < num_blocks, "copy ", from[i],
                " -> ", to[i], " is outside the cache (", num_blocks, " blocks)");
  const int64_t block_bytes = caches[0].stride(0) * caches[0].element_size();
  at::parallel_for(0, static_cast<int64_t>(caches.size()), 8, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      char* base = static_cast<char*>(caches[c].data_ptr());
      for (int64_t i = 0; i < s.numel(); ++i)
        if (from[i] != to[i])
          std::memcpy(base + to[i] * block_bytes, base + from[i] * block_bytes, block_bytes);
    }
  });
}

// Neox RoPE on the query and key heads of qk [T, Hq + Hkv, D] in place, then the rotated keys and the
// values v [T, Hkv, D] written into the cache at slot_mapping (negative slots skipped). cos and sin are
// [T, 1, D] rows of (cos, cos) and (-sin, sin); a head x becomes x * cos + (x2, x1) * sin, each product
// and the sum rounded to the dtype as in the reference.
template <typename T>
void rotary_write_kv_impl(at::Tensor& qk, const at::Tensor& v, const at::Tensor& cos, const at::Tensor& sin,
                          at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slots) {
  const int64_t num_tokens = qk.size(0), heads = qk.size(1), head_dim = qk.size(2), half = head_dim / 2;
  const int64_t num_kv_heads = v.size(1), num_heads = heads - num_kv_heads;
  const int64_t block_size = k_cache.size(1), num_slots = k_cache.size(0) * block_size;
  // Where slot dst's kv head h lies in the cache (either layout, see check_cache).
  const int64_t block_stride = k_cache.stride(0), row_stride = k_cache.stride(1),
                head_stride = k_cache.stride(2);
  const auto at_slot = [&](int64_t dst) {
    return dst / block_size * block_stride + dst % block_size * row_stride;
  };
  T* qk_ptr = qk.data_ptr<T>();
  const T* v_ptr = v.data_ptr<T>();
  const T* cos_ptr = cos.data_ptr<T>();
  const T* sin_ptr = sin.data_ptr<T>();
  T* kc = k_cache.data_ptr<T>();
  T* vc = v_cache.data_ptr<T>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  std::atomic<int64_t> bad_slot{-1};
  // bf16 heads whose halves are whole registers go 16 dims at a time, 8 on AVX2 (the same roundings); c10's
  // scalar bf16 conversions cost 4.7-5.8x as long on AVX2 (2048 rows of SmolLM2's 12 heads: 3.1-3.7 ms
  // against 0.65).
#if defined(__AVX512BF16__)
  const bool vectors = std::is_same_v<T, c10::BFloat16> && half % 16 == 0;
#elif defined(__AVX2__) && defined(__FMA__)
  const bool vectors = std::is_same_v<T, c10::BFloat16> && half % 8 == 0;
#else
  const bool vectors = false;
#endif
  at::parallel_for(0, num_tokens, pointwise_grain(heads * head_dim), [&](int64_t begin, int64_t end) {
    std::vector<float> c(head_dim), s(head_dim), x(head_dim);
    // The rows' cache slots, owned before the rotations: each lies in a block last written a step ago,
    // long out of the caches, and a store that waits for its line stalls the next ones. 51 rows into
    // random slots of a 1.9 GB cache took 43-45 us instead of 67-75 (1024 rows: 293 instead of 442).
    for (int64_t t = begin; t < end; ++t) {
      const int64_t dst = slot[t];
      if (dst >= 0 && dst < num_slots)
        for (int64_t h = 0; h < num_kv_heads; ++h) {
          prefetch_write(kc + at_slot(dst) + h * head_stride, head_dim * static_cast<int64_t>(sizeof(T)));
          prefetch_write(vc + at_slot(dst) + h * head_stride, head_dim * static_cast<int64_t>(sizeof(T)));
        }
    }
    for (int64_t t = begin; t < end; ++t) {
      load_row(cos_ptr + t * cos.stride(0), c.data(), head_dim);
      load_row(sin_ptr + t * sin.stride(0), s.data(), head_dim);
      for (int64_t h = 0; h < heads; ++h) {
        T* xh = qk_ptr + t * qk.stride(0) + h * head_dim;
#if defined(__AVX512BF16__)
        if constexpr (std::is_same_v<T, c10::BFloat16>) {
          if (vectors) {
            for (int64_t d = 0; d < half; d += 16) {
              const __m512 x1 = load16_bf16(xh + d), x2 = load16_bf16(xh + half + d);
              // first half: x1 * cos + x2 * (-sin); second half: x2 * cos + x1 * sin
              const __m512 lo = _mm512_add_ps(round_bf16(_mm512_mul_ps(x2, _mm512_loadu_ps(&s[d]))),
                                              round_bf16(_mm512_mul_ps(x1, _mm512_loadu_ps(&c[d]))));
              const __m512 hi = _mm512_add_ps(round_bf16(_mm512_mul_ps(x1, _mm512_loadu_ps(&s[half + d]))),
                                              round_bf16(_mm512_mul_ps(x2, _mm512_loadu_ps(&c[half + d]))));
              store16_bf16(xh + d, lo);
              store16_bf16(xh + half + d, hi);
            }
            continue;
          }
        }
#elif defined(__AVX2__) && defined(__FMA__)
        if constexpr (std::is_same_v<T, c10::BFloat16>) {
          if (vectors) {
            for (int64_t d = 0; d < half; d += 8) {
              const __m256 x1 = load8(xh + d), x2 = load8(xh + half + d);
              const __m256 lo = _mm256_add_ps(round_bf16_avx2(_mm256_mul_ps(x2, _mm256_loadu_ps(&s[d]))),
                                              round_bf16_avx2(_mm256_mul_ps(x1, _mm256_loadu_ps(&c[d]))));
              const __m256 hi = _mm256_add_ps(round_bf16_avx2(_mm256_mul_ps(x1, _mm256_loadu_ps(&s[half + d]))),
                                              round_bf16_avx2(_mm256_mul_ps(x2, _mm256_loadu_ps(&c[half + d]))));
              store8_bf16(xh + d, lo);
              store8_bf16(xh + half + d, hi);
            }
            continue;
          }
        }
#endif
        load_row(xh, x.data(), head_dim);
        for (int64_t d = 0; d < head_dim; ++d) {
          const float swapped = x[d < half ? d + half : d - half];
          xh[d] = static_cast<T>(round_to<T>(swapped * s[d]) + round_to<T>(x[d] * c[d]));
        }
      }
      const int64_t dst = slot[t];
      if (dst < 0) continue;  // padding
      if (dst >= num_slots) {
        bad_slot.store(dst);
        continue;
      }
      const T* k_row = qk_ptr + t * qk.stride(0) + num_heads * head_dim;
      const T* v_row = v_ptr + t * v.stride(0);
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        std::copy(k_row + h * head_dim, k_row + (h + 1) * head_dim, kc + at_slot(dst) + h * head_stride);
        std::copy(v_row + h * head_dim, v_row + (h + 1) * head_dim, vc + at_slot(dst) + h * head_stride);
      }
    }
  });
  TORCH_CHECK(bad_slot.load() < 0, "slot ", bad_slot.load(), " is outside the cache (", num_slots, " slots)");
}

void rotary_write_kv_(at::Tensor& qk, const at::Tensor& v, const at::Tensor& cos, const at::Tensor& sin,
                      at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slot_mapping) {
  check_cache(k_cache, v_cache);
  TORCH_CHECK(qk.dim() == 3 && qk.stride(2) == 1 && qk.stride(1) == qk.size(2),
              "qk must be [num_tokens, heads, head_dim] with contiguous heads");
  TORCH_CHECK(v.dim() == 3 && v.stride(2) == 1 && v.stride(1) == v.size(2),
              "v must be [num_tokens, kv_heads, head_dim] with contiguous heads");
  TORCH_CHECK(v.size(0) == qk.size(0) && v.size(1) == k_cache.size(2) && v.size(2) == k_cache.size(3) &&
                  qk.size(2) == k_cache.size(3) && qk.size(1) > v.size(1),
              "qk ", qk.sizes(), ", v ", v.sizes(), " and the cache ", k_cache.sizes(), " disagree");
  TORCH_CHECK(qk.size(2) % 2 == 0, "head_dim must be even for RoPE");
  for (const at::Tensor& t : {v, cos, sin, k_cache})
    TORCH_CHECK(t.scalar_type() == qk.scalar_type(), "every tensor must have qk's dtype ", qk.scalar_type());
  TORCH_CHECK(cos.size(0) == qk.size(0) && cos.size(-1) == qk.size(2) && cos.stride(-1) == 1 &&
                  sin.sizes() == cos.sizes() && sin.stride(-1) == 1,
              "cos and sin must be [num_tokens, 1, head_dim]");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == qk.size(0),
              "slot_mapping must be [num_tokens]");
  const at::Tensor slots = slot_mapping.to(at::kLong).contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qk.scalar_type(), "rotary_write_kv", [&] {
    rotary_write_kv_impl<scalar_t>(qk, v, cos, sin, k_cache, v_cache, slots);
  });
}

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
  silu_mul_impl<at::BFloat16>(scratch, 2 * size, out + fused * ld_out, m - fused, size);
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

bool has_amx() {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  return amx_permitted();
#else
  return false;
#endif
}

bool set_amx_enabled(bool enabled) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  return amx_switch.exchange(enabled);
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
    rms_norm_impl<T>(xp, hidden_, nullptr, 0, layers_[0].input_norm.const_data_ptr<T>(), b.h, hidden_, t,
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
      rotary_write_kv_impl<T>(qk, b.v, cos, sin, k_cache, v_cache, slots);
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
    rms_norm_impl<T>(xp, hidden_, b.o, hidden_, layer.post_attention_norm.const_data_ptr<T>(), b.h, hidden_,
                     rows, hidden_, eps_);
    if constexpr (std::is_same_v<T, float>) {
      linear(b.h, rows, layer.gate_up, hidden_, 2 * intermediate_, layer.gate_up_bias, b.scratch);
      silu_mul_impl<float>(b.scratch, 2 * intermediate_, b.act, rows, intermediate_);
    } else {
      linear_silu_to(b.h, rows, layer.gate_up.const_data_ptr<T>(), hidden_ / 2, intermediate_,
                     data_or_null<T>(layer.gate_up_bias), b.act, intermediate_, b.scratch);
    }
    linear(b.act, rows, layer.down, intermediate_, hidden_, layer.down_bias, b.down);
    rms_norm_impl<T>(xp, hidden_, b.down, hidden_, next_norm.const_data_ptr<T>(), h_out, hidden_, rows,
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

std::vector<int64_t> paged_attention_(at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache,
                                      const at::Tensor& v_cache, const at::Tensor& block_tables,
                                      const at::Tensor& query_start_loc, const at::Tensor& context_lens,
                                      double scale, int64_t max_pairs, int64_t min_tile_lanes) {
  return ::paged_attention_(out, query, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale,
                            max_pairs, min_tile_lanes);
}
at::Tensor argmax_rows(const at::Tensor& x) { return ::argmax_rows(x); }
std::vector<at::Tensor> decode_inputs(const at::Tensor& token_ids, const at::Tensor& block_tables,
                                      const std::vector<int64_t>& slots, const std::vector<int64_t>& start,
                                      int64_t block_size) {
  return ::decode_inputs(token_ids, block_tables, slots, start, block_size);
}
std::vector<int64_t> argmax_append_(const at::Tensor& logits, at::Tensor& token_ids,
                                    const std::vector<int64_t>& slots,
                                    const std::vector<int64_t>& positions) {
  return ::argmax_append_(logits, token_ids, slots, positions);
}
void copy_blocks_(const std::vector<at::Tensor>& caches, const at::Tensor& src, const at::Tensor& dst) {
  ::copy_blocks_(caches, src, dst);
}
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return ::rms_norm(x, weight, eps);
}
at::Tensor silu_mul(const at::Tensor& gate_up) { return ::silu_mul(gate_up); }
at::Tensor add_rms_norm_(at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight, double eps) {
  return ::add_rms_norm_(x, delta, weight, eps);
}
void rotary_write_kv_(at::Tensor& qk, const at::Tensor& v, const at::Tensor& cos, const at::Tensor& sin,
                      at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slot_mapping) {
  ::rotary_write_kv_(qk, v, cos, sin, k_cache, v_cache, slot_mapping);
}
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
bool prefetches_into_l2() { return reads_ahead_into_l2(); }
bool has_amx() { return ::has_amx(); }
bool set_amx_enabled(bool enabled) { return ::set_amx_enabled(enabled); }

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
