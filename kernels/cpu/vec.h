// The vector layer: the instruction set behind one set of types and operations, so that one kernel body
// serves AVX-512, AVX2 and plain C++. A Vec holds kLanes float32 values (16 in a zmm, 8 in a ymm, 1 in a
// float); loads widen bf16 and fp16 exactly, stores round to bf16 as c10 does (to nearest, ties to even),
// and loads and stores of the first n lanes cover a row's last values. Masks select lanes (comparisons,
// blends), IVec holds kLanes int32 values (indices, positions).
//
// What a single instruction set adds beyond this (AVX-512 BF16's dot product of bf16 pairs, AMX's tiles) is
// not here: the kernels built on it keep their own files. Modelled on vLLM's csrc/cpu/cpu_types_x86.hpp and
// ggml-cpu's simd-mappings.h, with free functions over the raw register types, so that the compiler sees
// the intrinsics themselves.

#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

// The branch this build takes: every server AVX-512 core has F, BW, DQ and VL; every AVX2 core but a few
// VIA ones has FMA and F16C with it.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
#define PAGEDSERVE_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PAGEDSERVE_AVX2 1
#endif

namespace pagedserve::cpu::vec {

using c10::BFloat16;
using c10::Half;

// exp(x) = 2^k * exp(r), k = round(x / ln 2), |r| <= ln 2 / 2, with the Cephes polynomial for exp(r)
// (within 2 ulp of std::exp); r = x - k ln 2 with ln 2 in two parts. x is clamped to [kExpMin, kExpMax]
// and exp is 0 below kExpMin.
constexpr float kExpMin = -87.3f, kExpMax = 88.3f, kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = 2.12194440e-4f;
constexpr float kExpPoly[] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                              4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

#if defined(PAGEDSERVE_AVX512)

constexpr int kLanes = 16;
constexpr int kRegisters = 32;  // vector registers: what a kernel's sums and operands share
using Vec = __m512;
using IVec = __m512i;
using Mask = __mmask16;

inline Vec zero() { return _mm512_setzero_ps(); }
inline Vec set1(float x) { return _mm512_set1_ps(x); }
inline Vec load(const float* p) { return _mm512_loadu_ps(p); }
inline Vec load(const BFloat16* p) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}
inline Vec load(const Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// The first n lanes (0 <= n <= kLanes).
inline Mask first(int64_t n) { return static_cast<Mask>((1u << n) - 1); }
inline Vec load_n(const float* p, int64_t n) { return _mm512_maskz_loadu_ps(first(n), p); }
inline Vec load_n(const BFloat16* p, int64_t n) {
  const __m256i v = _mm256_maskz_loadu_epi16(first(n), p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}
inline Vec load_n(const Half* p, int64_t n) { return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(first(n), p)); }

// 16 floats to bf16, rounded as c10 rounds: to nearest, ties to even (AVX-512 BF16's conversion; without
// it the same in integer steps, NaN to 0x7FC0).
inline __m256i to_bf16(Vec v) {
#if defined(__AVX512BF16__)
  return (__m256i)_mm512_cvtneps_pbh(v);
#else
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
#endif
}
// 16 floats to fp16, to nearest, ties to even (as c10 rounds every finite value).
inline __m256i to_half(Vec v) { return _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline void store(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline void store(BFloat16* p, Vec v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16(v)); }
inline void store(Half* p, Vec v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_half(v)); }
inline void store_n(float* p, Vec v, int64_t n) { _mm512_mask_storeu_ps(p, first(n), v); }
inline void store_n(BFloat16* p, Vec v, int64_t n) { _mm256_mask_storeu_epi16(p, first(n), to_bf16(v)); }
inline void store_n(Half* p, Vec v, int64_t n) { _mm256_mask_storeu_epi16(p, first(n), to_half(v)); }
// v rounded to bf16 (fp16) and widened back: a value the dtype holds.
inline Vec round_bf16(Vec v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16(v)), 16));
}
inline Vec round_half(Vec v) { return _mm512_cvtph_ps(to_half(v)); }

inline Vec add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec sub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
inline Vec mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec div(Vec a, Vec b) { return _mm512_div_ps(a, b); }
inline Vec max(Vec a, Vec b) { return _mm512_max_ps(a, b); }
inline Vec min(Vec a, Vec b) { return _mm512_min_ps(a, b); }
// a * b + c, rounded once.
inline Vec fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float reduce_add(Vec v) { return _mm512_reduce_add_ps(v); }
inline float reduce_max(Vec v) { return _mm512_reduce_max_ps(v); }

inline Mask gt(Vec a, Vec b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }
inline Mask eq(Vec a, Vec b) { return _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ); }
inline Mask is_nan(Vec a) { return _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q); }
inline bool any(Mask m) { return m != 0; }
inline Mask first_lanes(int64_t n) { return first(n); }
// Where m: t, else f.
inline Vec select(Mask m, Vec t, Vec f) { return _mm512_mask_mov_ps(f, m, t); }

inline IVec iset1(int32_t x) { return _mm512_set1_epi32(x); }
inline IVec iota() { return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
inline IVec iload(const int32_t* p) { return _mm512_loadu_si512(p); }
inline void istore(int32_t* p, IVec v) { _mm512_storeu_si512(p, v); }
inline IVec iadd(IVec a, IVec b) { return _mm512_add_epi32(a, b); }
inline Mask igt(IVec a, IVec b) { return _mm512_cmpgt_epi32_mask(a, b); }
inline IVec iselect(Mask m, IVec t, IVec f) { return _mm512_mask_mov_epi32(f, m, t); }
// The bf16 value in the low (even) or high (odd) half of each 32-bit lane, as float32 (exactly).
inline Vec even_bf16(IVec pairs) { return _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16)); }
inline Vec odd_bf16(IVec pairs) {
  return _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u))));
}

// exp of each lane (see kExpPoly). Always inlined: its callers keep many registers live, all caller-saved.
__attribute__((always_inline)) inline Vec exp(Vec in) {
  const Vec lo = set1(kExpMin);
  const Vec v = min(max(in, lo), set1(kExpMax));
  const Vec k = _mm512_roundscale_ps(mul(v, set1(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  Vec r = _mm512_fnmadd_ps(k, set1(kLn2Hi), v);
  r = fma(k, set1(kLn2Lo), r);
  Vec p = set1(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = fma(p, r, set1(kExpPoly[i]));
  p = add(fma(mul(p, r), r, r), set1(1.f));
  return _mm512_maskz_mov_ps(static_cast<Mask>(~_mm512_cmp_ps_mask(in, lo, _CMP_LT_OQ)),
                             _mm512_scalef_ps(p, k));
}

// Holds v in a register where the compiler would fold its loads into the instructions that use it (more
// loads than the load ports keep up with, where a value serves several multiply-adds).
inline void keep_in_register(Vec& v) { asm("" : "+v"(v)); }

// Lane j < 4 of out: the sum of the lanes of v[j].
inline void store_sums4(float* out, Vec a, Vec b, Vec c, Vec d) {
  const auto half = [](Vec v) {
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
  };
  const __m256 sums = _mm256_hadd_ps(_mm256_hadd_ps(half(a), half(b)), _mm256_hadd_ps(half(c), half(d)));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(sums), _mm256_extractf128_ps(sums, 1)));
}

// Transposes kLanes x kLanes 32-bit values (lane j of r[i] becomes lane i of r[j]): 64 shuffles, where
// moving them one by one through memory costs 256 loads and stores.
inline void transpose(__m512i (&r)[16]) {
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
inline void transpose(Vec (&r)[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; ++i) t[i] = _mm512_castps_si512(r[i]);
  transpose(t);
  for (int i = 0; i < 16; ++i) r[i] = _mm512_castsi512_ps(t[i]);
}

#elif defined(PAGEDSERVE_AVX2)

constexpr int kLanes = 8;
constexpr int kRegisters = 16;
using Vec = __m256;
using IVec = __m256i;
using Mask = __m256;  // a lane all ones where set

inline Vec zero() { return _mm256_setzero_ps(); }
inline Vec set1(float x) { return _mm256_set1_ps(x); }
inline Vec load(const float* p) { return _mm256_loadu_ps(p); }
inline Vec load(const BFloat16* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}
inline Vec load(const Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// The first n lanes (0 <= n <= kLanes) through a zeroed copy: AVX2 has no masked load of 16-bit values.
template <typename T>
inline Vec load_n(const T* p, int64_t n) {
  alignas(32) T lanes[kLanes] = {};
  std::memcpy(lanes, p, n * sizeof(T));
  return load(lanes);
}

// 8 floats to bf16 as c10's conversion rounds them: to nearest, ties to even, NaN to 0x7FC0.
inline __m128i to_bf16(Vec v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0),
                         _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}
inline __m128i to_half(Vec v) { return _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline void store(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline void store(BFloat16* p, Vec v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), to_bf16(v)); }
inline void store(Half* p, Vec v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), to_half(v)); }
template <typename T>
inline void store_n(T* p, Vec v, int64_t n) {
  alignas(32) T lanes[kLanes];
  store(lanes, v);
  std::memcpy(p, lanes, n * sizeof(T));
}
inline Vec round_bf16(Vec v) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(to_bf16(v)), 16));
}
inline Vec round_half(Vec v) { return _mm256_cvtph_ps(to_half(v)); }

inline Vec add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec sub(Vec a, Vec b) { return _mm256_sub_ps(a, b); }
inline Vec mul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec div(Vec a, Vec b) { return _mm256_div_ps(a, b); }
inline Vec max(Vec a, Vec b) { return _mm256_max_ps(a, b); }
inline Vec min(Vec a, Vec b) { return _mm256_min_ps(a, b); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float reduce_add(Vec v) {
  const __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 pair = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(pair, _mm_movehdup_ps(pair)));
}
inline float reduce_max(Vec v) {
  alignas(32) float lanes[kLanes];
  _mm256_store_ps(lanes, v);
  return *std::max_element(lanes, lanes + kLanes);
}

inline Mask gt(Vec a, Vec b) { return _mm256_cmp_ps(a, b, _CMP_GT_OQ); }
inline Mask eq(Vec a, Vec b) { return _mm256_cmp_ps(a, b, _CMP_EQ_OQ); }
inline Mask is_nan(Vec a) { return _mm256_cmp_ps(a, a, _CMP_UNORD_Q); }
inline bool any(Mask m) { return _mm256_movemask_ps(m) != 0; }
inline Mask first_lanes(int64_t n) {
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(n)),
                                                _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
}
inline Vec select(Mask m, Vec t, Vec f) { return _mm256_blendv_ps(f, t, m); }

inline IVec iset1(int32_t x) { return _mm256_set1_epi32(x); }
inline IVec iota() { return _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7); }
inline IVec iload(const int32_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline void istore(int32_t* p, IVec v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); }
inline IVec iadd(IVec a, IVec b) { return _mm256_add_epi32(a, b); }
inline Mask igt(IVec a, IVec b) { return _mm256_castsi256_ps(_mm256_cmpgt_epi32(a, b)); }
inline IVec iselect(Mask m, IVec t, IVec f) { return _mm256_blendv_epi8(f, t, _mm256_castps_si256(m)); }
inline Vec even_bf16(IVec pairs) { return _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16)); }
inline Vec odd_bf16(IVec pairs) {
  return _mm256_castsi256_ps(_mm256_and_si256(pairs, _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u))));
}

// exp of each lane (see kExpPoly); 2^k is built in the exponent bits (k is -126 .. 127 after the clamp).
__attribute__((always_inline)) inline Vec exp(Vec in) {
  const Vec lo = set1(kExpMin);
  const Vec v = min(max(in, lo), set1(kExpMax));
  const Vec k = _mm256_round_ps(mul(v, set1(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  Vec r = _mm256_fnmadd_ps(k, set1(kLn2Hi), v);
  r = fma(k, set1(kLn2Lo), r);
  Vec p = set1(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = fma(p, r, set1(kExpPoly[i]));
  p = add(fma(mul(p, r), r, r), set1(1.f));
  const __m256i scale =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(mul(p, _mm256_castsi256_ps(scale)), _mm256_cmp_ps(in, lo, _CMP_NLT_UQ));
}

inline void keep_in_register(Vec& v) { asm("" : "+x"(v)); }

inline void store_sums4(float* out, Vec a, Vec b, Vec c, Vec d) {
  const __m256 sums = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(sums), _mm256_extractf128_ps(sums, 1)));
}

inline void transpose(Vec (&r)[8]) {
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

#else

// Plain C++: one lane, the loops left to the compiler.
constexpr int kLanes = 1;
constexpr int kRegisters = 16;
using Vec = float;
using IVec = int32_t;
using Mask = bool;

inline Vec zero() { return 0.f; }
inline Vec set1(float x) { return x; }
template <typename T>
inline Vec load(const T* p) {
  return static_cast<float>(*p);
}
template <typename T>
inline Vec load_n(const T* p, int64_t n) {
  return n > 0 ? static_cast<float>(*p) : 0.f;
}
template <typename T>
inline void store(T* p, Vec v) {
  *p = static_cast<T>(v);
}
template <typename T>
inline void store_n(T* p, Vec v, int64_t n) {
  if (n > 0) *p = static_cast<T>(v);
}
inline Vec round_bf16(Vec v) { return static_cast<float>(static_cast<BFloat16>(v)); }
inline Vec round_half(Vec v) { return static_cast<float>(static_cast<Half>(v)); }
inline Vec add(Vec a, Vec b) { return a + b; }
inline Vec sub(Vec a, Vec b) { return a - b; }
inline Vec mul(Vec a, Vec b) { return a * b; }
inline Vec div(Vec a, Vec b) { return a / b; }
inline Vec max(Vec a, Vec b) { return std::max(a, b); }
inline Vec min(Vec a, Vec b) { return std::min(a, b); }
// Two roundings: a fused multiply-add without the instruction is a library call.
inline Vec fma(Vec a, Vec b, Vec c) { return a * b + c; }
inline float reduce_add(Vec v) { return v; }
inline float reduce_max(Vec v) { return v; }
inline Mask gt(Vec a, Vec b) { return a > b; }
inline Mask eq(Vec a, Vec b) { return a == b; }
inline Mask is_nan(Vec a) { return std::isnan(a); }
inline bool any(Mask m) { return m; }
inline Mask first_lanes(int64_t n) { return n > 0; }
inline Vec select(Mask m, Vec t, Vec f) { return m ? t : f; }
inline IVec iset1(int32_t x) { return x; }
inline IVec iota() { return 0; }
inline IVec iload(const int32_t* p) { return *p; }
inline void istore(int32_t* p, IVec v) { *p = v; }
inline IVec iadd(IVec a, IVec b) { return a + b; }
inline Mask igt(IVec a, IVec b) { return a > b; }
inline IVec iselect(Mask m, IVec t, IVec f) { return m ? t : f; }
inline Vec even_bf16(IVec pairs) {
  const uint32_t bits = static_cast<uint32_t>(pairs) << 16;
  float x;
  std::memcpy(&x, &bits, sizeof(x));
  return x;
}
inline Vec odd_bf16(IVec pairs) {
  const uint32_t bits = static_cast<uint32_t>(pairs) & 0xFFFF0000u;
  float x;
  std::memcpy(&x, &bits, sizeof(x));
  return x;
}

inline Vec exp(Vec in) {
  const float v = std::min(std::max(in, kExpMin), kExpMax);
  const float k = std::floor(v * kLog2e + 0.5f);
  float r = v - k * kLn2Hi;
  r = r + k * kLn2Lo;
  float p = kExpPoly[0];
  for (int j = 1; j < 6; ++j) p = p * r + kExpPoly[j];
  p = p * r * r + r + 1.f;
  const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return in < kExpMin ? 0.f : p * scale;
}
inline void keep_in_register(Vec&) {}
inline void store_sums4(float* out, Vec a, Vec b, Vec c, Vec d) {
  out[0] = a, out[1] = b, out[2] = c, out[3] = d;
}
inline void transpose(Vec (&)[1]) {}

#endif

// The values of a row of n that fill whole vectors; the rest (n - whole(n) < kLanes) go through load_n and
// store_n.
constexpr int64_t whole(int64_t n) { return n - n % kLanes; }

// v rounded to T and widened back, where a kernel holds a value in the model's dtype.
template <typename T>
inline Vec round_to(Vec v) {
  if constexpr (std::is_same_v<T, BFloat16>) return round_bf16(v);
  if constexpr (std::is_same_v<T, Half>) return round_half(v);
  return v;
}

}  // namespace pagedserve::cpu::vec
