// The decoder's small ops, each one pass over its rows (pointwise.cpp): RMSNorm with the residual add before
// it, RoPE with the KV cache write, SiLU with its product. The DecoderStack and the linear's fused MLP pass
// call them on rows they own; every one rounds to the dtype where kernels/reference.py rounds.

#pragma once

#include <cstdint>

#include "vec.h"

namespace at {
class Tensor;
}

namespace pagedserve::cpu {

// Rows of a pointwise op handed to one thread: about 64K values (tens of microseconds of work), so that a
// decode batch runs on the calling thread instead of paying a parallel region for a few microseconds.
inline int64_t pointwise_grain(int64_t values_per_row) {
  return std::max<int64_t>(1, 65536 / std::max<int64_t>(1, values_per_row));
}

// out = weight * (x * rsqrt(mean(x^2) + eps)) per row of `size`, normalised in float32 and rounded to T
// before the weight is applied (as the HF models do). With delta, x += delta first, in place.
template <typename T>
void rms_norm_rows(T* x, int64_t x_stride, const T* delta, int64_t delta_stride, const T* weight, T* out,
                   int64_t out_stride, int64_t rows, int64_t size, double eps);

// out [rows, size] (rows contiguous) = silu(gate) * up of x [rows, 2 * size] (rows x_stride apart, gate
// first).
template <typename T>
void silu_mul_rows(const T* x, int64_t x_stride, T* out, int64_t rows, int64_t size);

// Neox RoPE on the query and key heads of qk [T, Hq + Hkv, D] in place, then the rotated keys and the values
// v [T, Hkv, D] into the cache at slots (int64; negative: padding). cos and sin are [T, 1, D] rows of
// (cos, cos) and (-sin, sin). The tensors are checked by the caller (rotary_write_kv_).
template <typename T>
void rotary_write_kv_rows(at::Tensor& qk, const at::Tensor& v, const at::Tensor& cos, const at::Tensor& sin,
                          at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slots);

// silu(g) = g / (1 + exp(-g)), with vec::exp (PyTorch's exp differs in the last float bit or two, which the
// rounding to bf16 or fp16 almost always absorbs).
inline vec::Vec silu(vec::Vec g) {
  return vec::div(g, vec::add(vec::set1(1.f), vec::exp(vec::sub(vec::zero(), g))));
}

// silu(gate) * up of values the dtype T holds: the silu rounded to T, then the product (rounded by its
// store).
template <typename T>
inline vec::Vec silu_mul(vec::Vec gate, vec::Vec up) {
  return vec::mul(vec::round_to<T>(silu(gate)), up);
}

}  // namespace pagedserve::cpu
