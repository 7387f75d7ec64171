// The linear layers' entry points (see linear.h): packing, the checks, and which family computes a call.

#include "linear.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <vector>

#include "ops.h"
#include "pointwise.h"

namespace pagedserve::cpu {

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

void check_linear_bias(const c10::optional<at::Tensor>& bias, int64_t n, const char* what, bool f32) {
  const at::ScalarType dtype = f32 ? at::kFloat : at::kBFloat16;
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == dtype && bias->dim() == 1 && bias->size(0) == n &&
                                    bias->is_contiguous()),
              what, "bias must be ", f32 ? "float32" : "bf16", " [", n, "], contiguous");
}

namespace {

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
  check_linear_bias(bias, n, "", true);
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

}  // namespace

void linear_to(const c10::BFloat16* x, int64_t ldx, int64_t m, const c10::BFloat16* w, int64_t pairs,
               int64_t n, const c10::BFloat16* bias, c10::BFloat16* y, int64_t ldy) {
  if (m == 0) return;
  if (use_onednn(m, false)) return linear_onednn(x, ldx, m, w, pairs, n, bias, y, ldy);
  if (use_amx(m, pairs)) return linear_amx(x, ldx, m, w, pairs, n, bias, y, ldy);
#if defined(__AVX512BF16__)
  linear_bf16dot(x, ldx, m, w, pairs, n, bias, y, ldy, amx_tile_order(pairs));
#elif defined(__AVX2__) && defined(__FMA__)
  linear_widen(x, ldx, m, w, pairs, n, bias, y, ldy, false);
#else
  TORCH_CHECK(false, "this build has no linear: it needs AVX-512 BF16 or AVX2 with FMA (see has_linear)");
#endif
}

void linear_f32_to(const float* x, int64_t ldx, int64_t m, const float* w, int64_t k, int64_t n,
                   const float* bias, float* y, int64_t ldy) {
  if (m == 0) return;
  if (use_onednn(m, true)) return linear_f32_onednn(x, ldx, m, w, k, n, bias, y, ldy);
#if defined(PAGEDSERVE_AVX512) || defined(PAGEDSERVE_AVX2)
  linear_f32(x, ldx, m, w, k, n, bias, y, ldy);
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
    linear_to(x2.const_data_ptr<c10::BFloat16>(), x2.stride(0), m, packed.const_data_ptr<c10::BFloat16>(),
              packed.size(1), n, bias.has_value() ? bias->const_data_ptr<c10::BFloat16>() : nullptr,
              y.mutable_data_ptr<c10::BFloat16>(), y.stride(0));
  return y.view(out_shape);
}

int64_t silu_fused_rows(int64_t m, int64_t k, int64_t size) {
  if (size % kBlock != 0 || k % 2 != 0 || use_onednn(m, false)) return 0;
  if (use_amx(m, k / 2)) return m;
#if defined(__AVX512BF16__)
  return bf16dot_silu_rows(m);
#elif defined(__AVX2__) && defined(__FMA__)
  return widen_silu_rows(m, k);
#else
  return 0;
#endif
}

void linear_silu_to(const c10::BFloat16* x, int64_t m, const c10::BFloat16* w, int64_t pairs, int64_t size,
                    const c10::BFloat16* bias, c10::BFloat16* out, int64_t ld_out, c10::BFloat16* scratch) {
  const int64_t k = 2 * pairs, fused = silu_fused_rows(m, k, size);
  if (fused > 0) {
    if (use_amx(fused, pairs)) return linear_silu_amx(x, k, fused, w, pairs, size, bias, out, ld_out);
#if defined(__AVX512BF16__)
    linear_silu_bf16dot(x, k, fused, w, pairs, size, bias, out, ld_out);
#elif defined(__AVX2__) && defined(__FMA__)
    linear_widen(x, k, fused, w, pairs, 2 * size, bias, out, ld_out, true);
#endif
  }
  if (fused == m) return;
  linear_to(x + fused * k, k, m - fused, w, pairs, 2 * size, bias, scratch, 2 * size);
  silu_mul_rows<c10::BFloat16>(scratch, 2 * size, out + fused * ld_out, m - fused, size);
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
  linear_silu_to(x2.const_data_ptr<c10::BFloat16>(), m, packed.const_data_ptr<c10::BFloat16>(),
                 packed.size(1), size, bias.has_value() ? bias->const_data_ptr<c10::BFloat16>() : nullptr,
                 out.mutable_data_ptr<c10::BFloat16>(), size, scratch.mutable_data_ptr<c10::BFloat16>());
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
#if defined(PAGEDSERVE_AVX512) || defined(PAGEDSERVE_AVX2)
  return true;
#else
  return false;
#endif
}

}  // namespace pagedserve::cpu
