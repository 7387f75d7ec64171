// What the kernels of every topic share: the KV cache's layouts, the dtypes they take, rows widened to
// float32 and their dot product, and the switches for AMX and for batch invariance.

#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>

#include <cstdint>

#include "vec.h"

namespace at {
class Tensor;
}

namespace pagedserve::cpu {

// A KV cache is [num_blocks, block_size, num_kv_heads, head_dim], in one of two layouts, each block's
// elements together: token-major (contiguous: a position's kv heads side by side) or head-major (a view of a
// contiguous [num_blocks, num_kv_heads, block_size, head_dim]: a kv head's rows of a block side by side,
// which the CPU pool uses, see worker_svc/kv_cache.py). The kernels read either through the strides.
bool is_cache_layout(const at::Tensor& cache);
// Both caches in one of those layouts, alike in shape, strides and dtype; else an error.
void check_cache(const at::Tensor& k_cache, const at::Tensor& v_cache);

// f(T{}) for the tensor dtype T the kernels compute with: float32, bf16 or fp16 (in float32 throughout).
template <typename F>
inline void with_dtype(c10::ScalarType type, const char* what, F&& f) {
  switch (type) {
    case c10::ScalarType::Float:
      return f(float{});
    case c10::ScalarType::BFloat16:
      return f(c10::BFloat16{});
    case c10::ScalarType::Half:
      return f(c10::Half{});
    default:
      TORCH_CHECK(false, what, ": the kernels take float32, bf16 or fp16, not ", type);
  }
}

// dst[0 .. n) = src[0 .. n) widened to float32 (exactly).
template <typename T>
inline void load_row(const T* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i < vec::whole(n); i += vec::kLanes) vec::store(dst + i, vec::load(src + i));
  if (i < n) vec::store_n(dst + i, vec::load_n(src + i, n - i), n - i);
}

// a . b over n floats, lane by lane, then across the lanes.
inline float dot(const float* a, const float* b, int64_t n) {
  vec::Vec acc = vec::zero();
  int64_t i = 0;
  for (; i < vec::whole(n); i += vec::kLanes) acc = vec::fma(vec::load(a + i), vec::load(b + i), acc);
  if (i < n) acc = vec::fma(vec::load_n(a + i, n - i), vec::load_n(b + i, n - i), acc);
  return vec::reduce_add(acc);
}

// Whether the kernels may take AMX tiles now: a build with AMX, Linux's permission for the tile state (asked
// once per process), and the switch (ops.h set_amx_enabled) on.
bool amx_enabled();

// Whether the kernels are batch-invariant now (ops.h set_batch_invariant): every row's result has the same
// bits whatever else its call computes (how many rows, prompt or decode rows, where a prompt's chunks
// begin) and however many threads compute it, so that a prompt token's K, V and logits are those a decode
// step would give it. A body chosen by the number of rows must then sum in the order of every other body
// of its op (see linear.h and attention.h for how each op keeps to one order).
bool batch_invariant();

}  // namespace pagedserve::cpu
