// KV-cache maintenance kernels: write new K/V into slots, copy whole blocks (copy-on-write).
//
// Both are pure data movement, so they are dtype-agnostic: they copy in units U (uint4 = 16 bytes when every
// address and size allows it, narrower otherwise; the loader picks the widest unit that divides the row size,
// the strides and the base addresses). One kernel per unit width instead of per (dtype, head size).
#include "common.cuh"

// One CTA per token (blockIdx.x); its threads stride over the token's [num_kv_heads, head_dim] row.
// Cache layout [num_blocks, block_size, num_kv_heads, head_dim] makes a slot's row contiguous, so
// slot * row_units addresses it. A negative slot marks padding: nothing is written.
template <typename U>
__device__ __forceinline__ void write_kv_impl(const U* __restrict__ key, const U* __restrict__ value, U* __restrict__ k_cache,
                    U* __restrict__ v_cache, const long long* __restrict__ slot_mapping,
                    long long row_units,          // units per token row (num_kv_heads * head_dim * elsize / sizeof(U))
                    long long key_stride_units,   // units between consecutive tokens of `key`
                    long long value_stride_units  // units between consecutive tokens of `value`
    ) {
  const long long t = blockIdx.x;
  const long long slot = slot_mapping[t];
  if (slot < 0) return;
  const U* k_src = key + t * key_stride_units;
  const U* v_src = value + t * value_stride_units;
  U* k_dst = k_cache + slot * row_units;
  U* v_dst = v_cache + slot * row_units;
  for (long long i = threadIdx.x; i < row_units; i += blockDim.x) {
    k_dst[i] = k_src[i];
    v_dst[i] = v_src[i];
  }
}

// Copies block src[i] -> dst[i] for every cache tensor. blockIdx.x = pair i, blockIdx.y = cache tensor
// (all K and V caches of all layers, whose base addresses come in `cache_ptrs`). The loader splits the pair
// list into launches in which no destination is read or written by another pair, so pairs of one launch
// can run in any order and the list still behaves as if copied in order.
template <typename U>
__device__ __forceinline__ void copy_blocks_impl(const long long* __restrict__ cache_ptrs, const long long* __restrict__ src,
                       const long long* __restrict__ dst,
                       long long block_units  // units per block (block_size * num_kv_heads * head_dim * elsize / sizeof(U))
    ) {
  U* cache = reinterpret_cast<U*>(cache_ptrs[blockIdx.y]);
  const U* from = cache + src[blockIdx.x] * block_units;
  U* to = cache + dst[blockIdx.x] * block_units;
  for (long long i = threadIdx.x; i < block_units; i += blockDim.x) to[i] = from[i];
}

// Entry points: the loader appends one line per instantiation it needs, e.g.
//   PS_WRITE_KV_KERNEL(write_kv_u16, uint4)
// extern "C" names (no C++ mangling) let CuPy fetch them by name and cache the binary on disk.
#define PS_WRITE_KV_KERNEL(NAME, U)                                                                            \
  extern "C" __global__ void __launch_bounds__(128)                                                            \
      NAME(const U* key, const U* value, U* k_cache, U* v_cache, const long long* slot_mapping,                \
           long long row_units, long long key_stride_units, long long value_stride_units) {                    \
    write_kv_impl<U>(key, value, k_cache, v_cache, slot_mapping, row_units, key_stride_units,                  \
                     value_stride_units);                                                                      \
  }

#define PS_COPY_BLOCKS_KERNEL(NAME, U)                                                                         \
  extern "C" __global__ void __launch_bounds__(256)                                                            \
      NAME(const long long* cache_ptrs, const long long* src, const long long* dst, long long block_units) {   \
    copy_blocks_impl<U>(cache_ptrs, src, dst, block_units);                                                    \
  }
