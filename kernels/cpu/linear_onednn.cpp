// Large products through oneDNN (at::linear): from a few hundred rows its matmul (MKL's for float32),
// blocked for the whole cache hierarchy, outruns the kernels' linear, which is made for streaming W past a
// few rows of x (docs/performance.md). The packed weight is unpacked to nn.Linear's [N, K] into a thread's
// buffer for the call: a copy of W, small beside the product at these row counts.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/linear.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#include "common.h"
#include "linear.h"
#include "ops.h"
#include "vec.h"

namespace pagedserve::cpu {
namespace {

// Rows from which the linear of each dtype goes to oneDNN, where oneDNN's matmul clearly beats the kernels'
// there (docs/performance.md): bf16 where the kernels have AMX's tiles (and so does oneDNN), float32 on every
// CPU. set_onednn_min_rows overrides them (-1: never, kOneDnnDefault: these again).
constexpr int64_t kBf16AmxRows = 1024, kF32Rows = 256;
std::atomic<int64_t> bf16_rows{kOneDnnDefault}, f32_rows{kOneDnnDefault};

// W [n, k] from its packed blocks of 16 columns, 32-bit words at a time (bf16: a pair of k; float32: one k):
// word i of block b's column c at ((b * words + i) * 16 + c). A block is a [words, 16] matrix of words, W's
// rows its columns: transposed kLanes x kLanes words at a time in registers (the words' bits moved, never
// computed with).
void unpack(const float* packed, int64_t n, int64_t words, float* out) {
  using namespace vec;
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  at::parallel_for(0, blocks, 8, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const float* block = packed + b * words * kBlock;
      const int64_t cols = std::min<int64_t>(kBlock, n - b * kBlock);
      float* rows = out + b * kBlock * words;
      int64_t i0 = 0;
      for (; i0 + kLanes <= words; i0 += kLanes)
        for (int64_t c0 = 0; c0 < cols; c0 += kLanes) {
          Vec r[kLanes];
          for (int i = 0; i < kLanes; ++i) r[i] = load(block + (i0 + i) * kBlock + c0);
          transpose(r);
          for (int64_t c = 0; c < std::min<int64_t>(kLanes, cols - c0); ++c)
            store(rows + (c0 + c) * words + i0, r[c]);
        }
      for (; i0 < words; ++i0)
        for (int64_t c = 0; c < cols; ++c) rows[c * words + i0] = block[i0 * kBlock + c];
    }
  });
}

// y [m, n] (rows ldy apart) = x [m, k] (rows ldx apart) @ W^T + bias through at::linear, W unpacked from its
// `words` words a block row.
template <typename T>
void onednn(const T* x, int64_t ldx, int64_t m, const T* w, int64_t k, int64_t words, int64_t n,
            const T* bias, T* y, int64_t ldy) {
  thread_local std::vector<float> plain;  // as long as the largest weight that came this way
  plain.resize(std::max<size_t>(plain.size(), n * words));
  unpack(reinterpret_cast<const float*>(w), n, words, plain.data());
  const at::TensorOptions options = at::TensorOptions().dtype(c10::CppTypeToScalarType<T>::value);
  const at::Tensor weight = at::from_blob(plain.data(), {n, k}, options);
  const at::Tensor input = at::from_blob(const_cast<T*>(x), {m, k}, {ldx, 1}, options);
  at::Tensor out = at::from_blob(y, {m, n}, {ldy, 1}, options);
  const c10::optional<at::Tensor> b =
      bias == nullptr ? c10::nullopt : c10::make_optional(at::from_blob(const_cast<T*>(bias), {n}, options));
  at::linear_out(out, input, weight, b);
}

}  // namespace

int64_t onednn_min_rows(bool f32) {
  const int64_t rows = (f32 ? f32_rows : bf16_rows).load(std::memory_order_relaxed);
  if (rows != kOneDnnDefault) return rows;
  return f32 ? kF32Rows : (amx_enabled() ? kBf16AmxRows : -1);
}

int64_t set_onednn_min_rows(bool f32, int64_t rows) { return (f32 ? f32_rows : bf16_rows).exchange(rows); }

bool use_onednn(int64_t m, bool f32) {
  // oneDNN blocks K as suits the rows: a row's sums would depend on how many came with it.
  if (batch_invariant()) return false;
  const int64_t rows = onednn_min_rows(f32);
  return rows >= 0 && m >= rows;
}

void linear_onednn(const c10::BFloat16* x, int64_t ldx, int64_t m, const c10::BFloat16* w, int64_t pairs,
                   int64_t n, const c10::BFloat16* bias, c10::BFloat16* y, int64_t ldy) {
  onednn(x, ldx, m, w, 2 * pairs, pairs, n, bias, y, ldy);
}

void linear_f32_onednn(const float* x, int64_t ldx, int64_t m, const float* w, int64_t k, int64_t n,
                       const float* bias, float* y, int64_t ldy) {
  onednn(x, ldx, m, w, k, k, n, bias, y, ldy);
}

}  // namespace pagedserve::cpu
