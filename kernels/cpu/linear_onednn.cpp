// Large products through oneDNN (at::linear): from a few hundred rows its matmul, blocked for the whole
// cache hierarchy (and on AMX tiles where the CPU has them), outruns the kernels' linear, which is made for
// streaming W past a few rows of x (docs/performance.md). The packed weight is unpacked to nn.Linear's
// [N, K] into a thread's buffer for the call: a copy of W, small beside the product at these row counts.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/linear.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#include "linear.h"
#include "ops.h"

namespace pagedserve::cpu {
namespace {

// Rows from which the linear of each dtype goes to oneDNN, -1 never (set_onednn_min_rows changes them): bf16
// where oneDNN's bf16 matmul is native (AVX-512 BF16, AMX); float32 never, the kernels' own keeping up with
// it (docs/performance.md).
#if defined(__AVX512BF16__)
constexpr int64_t kBf16Rows = 256;
#else
constexpr int64_t kBf16Rows = -1;
#endif
constexpr int64_t kF32Rows = -1;
std::atomic<int64_t> bf16_rows{kBf16Rows}, f32_rows{kF32Rows};

// W [n, k] from its packed blocks of 16 columns, T's pairs of k (bf16: a 32-bit word) or single k (float32)
// at a time: block b's word i of column c at ((b * words + i) * 16 + c).
template <typename Word>
void unpack(const Word* packed, int64_t n, int64_t words, Word* out) {
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  at::parallel_for(0, blocks, 8, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const Word* block = packed + b * words * kBlock;
      for (int64_t c = 0; c < std::min<int64_t>(kBlock, n - b * kBlock); ++c) {
        Word* row = out + (b * kBlock + c) * words;
        for (int64_t i = 0; i < words; ++i) row[i] = block[i * kBlock + c];
      }
    }
  });
}

// y [m, n] (rows ldy apart) = x [m, k] (rows ldx apart) @ W^T + bias through at::linear, W unpacked from its
// `words` words a block row.
template <typename T, typename Word>
void onednn(const T* x, int64_t ldx, int64_t m, const T* w, int64_t k, int64_t words, int64_t n,
            const T* bias, T* y, int64_t ldy) {
  thread_local std::vector<Word> plain;
  plain.resize(std::max<size_t>(plain.size(), n * words));
  unpack(reinterpret_cast<const Word*>(w), n, words, plain.data());
  const at::TensorOptions options = at::TensorOptions().dtype(c10::CppTypeToScalarType<T>::value);
  const at::Tensor weight = at::from_blob(plain.data(), {n, k}, options);
  const at::Tensor input = at::from_blob(const_cast<T*>(x), {m, k}, {ldx, 1}, options);
  at::Tensor out = at::from_blob(y, {m, n}, {ldy, 1}, options);
  const c10::optional<at::Tensor> b =
      bias == nullptr ? c10::nullopt : c10::make_optional(at::from_blob(const_cast<T*>(bias), {n}, options));
  at::linear_out(out, input, weight, b);
}

}  // namespace

int64_t onednn_rows(bool f32) { return (f32 ? f32_rows : bf16_rows).load(std::memory_order_relaxed); }

int64_t set_onednn_min_rows(bool f32, int64_t rows) { return (f32 ? f32_rows : bf16_rows).exchange(rows); }

bool use_onednn(int64_t m, bool f32) {
  const int64_t rows = onednn_rows(f32);
  return rows >= 0 && m >= rows;
}

void linear_onednn(const c10::BFloat16* x, int64_t ldx, int64_t m, const c10::BFloat16* w, int64_t pairs,
                   int64_t n, const c10::BFloat16* bias, c10::BFloat16* y, int64_t ldy) {
  onednn<c10::BFloat16, uint32_t>(x, ldx, m, w, 2 * pairs, pairs, n, bias, y, ldy);
}

void linear_f32_onednn(const float* x, int64_t ldx, int64_t m, const float* w, int64_t k, int64_t n,
                       const float* bias, float* y, int64_t ldy) {
  onednn<float, float>(x, ldx, m, w, k, k, n, bias, y, ldy);
}

}  // namespace pagedserve::cpu
