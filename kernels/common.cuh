// Shared device helpers for the pagedserve kernels.
//
// NOTE: deliberately header-free. The same source is compiled by NVRTC at run time (through CuPy) and by
// nvcc in CI; NVRTC does not ship the CUDA runtime headers everywhere (cuda_bf16.h in particular), so the
// 16-bit types are plain `unsigned short` bit patterns and converted with PTX `cvt` or bit shifts. The
// Python loader pastes this file in place of its #include line before handing the source to NVRTC.
#pragma once

#define PS_WARP 32
#define PS_NEG_INF (-__int_as_float(0x7f800000))

// ---- dtype tags ---------------------------------------------------------------------------------------
// A tag names the storage type and how one 16-byte vector (uint4) of it unpacks into floats. Kernels load
// K/V only as uint4 (the widest load an SM issues), so VEC = elements per 16 bytes.

struct bf16 {
  typedef unsigned short storage;
  static constexpr int VEC = 8;
  static __device__ __forceinline__ float to_float(storage x) { return __uint_as_float(((unsigned)x) << 16); }
  static __device__ __forceinline__ storage from_float(float f) {
    storage h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));  // round-to-nearest-even, NaN-preserving (sm_80+)
    return h;
  }
  static __device__ __forceinline__ void unpack(const uint4& v, float* f) {
    const unsigned w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      f[2 * i] = __uint_as_float(w[i] << 16);
      f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
  }
};

struct fp16 {
  typedef unsigned short storage;
  static constexpr int VEC = 8;
  static __device__ __forceinline__ float to_float(storage x) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x));
    return f;
  }
  static __device__ __forceinline__ storage from_float(float f) {
    storage h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
  }
  static __device__ __forceinline__ void unpack(const uint4& v, float* f) {
    const unsigned w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      f[2 * i] = to_float((storage)(w[i] & 0xffffu));
      f[2 * i + 1] = to_float((storage)(w[i] >> 16));
    }
  }
};

struct fp32 {
  typedef float storage;
  static constexpr int VEC = 4;
  static __device__ __forceinline__ float to_float(storage x) { return x; }
  static __device__ __forceinline__ storage from_float(float f) { return f; }
  static __device__ __forceinline__ void unpack(const uint4& v, float* f) {
    f[0] = __uint_as_float(v.x);
    f[1] = __uint_as_float(v.y);
    f[2] = __uint_as_float(v.z);
    f[3] = __uint_as_float(v.w);
  }
};

// ---- small utilities ----------------------------------------------------------------------------------

template <int N>
struct is_pow2 {
  static constexpr bool value = N > 0 && (N & (N - 1)) == 0;
};

// Smallest power of two >= n (compile time).
__host__ __device__ constexpr int ps_next_pow2(int n) { return n <= 1 ? 1 : 2 * ps_next_pow2((n + 1) / 2); }
__host__ __device__ constexpr int ps_min(int a, int b) { return a < b ? a : b; }
__host__ __device__ constexpr int ps_max(int a, int b) { return a > b ? a : b; }

// Read-only 16-byte load through the non-coherent (texture) path: K/V and queries are never written by the
// kernel that reads them.
__device__ __forceinline__ uint4 ps_ldg16(const void* p) { return __ldg(reinterpret_cast<const uint4*>(p)); }

__device__ __forceinline__ uint4 ps_zero4() { return make_uint4(0u, 0u, 0u, 0u); }
