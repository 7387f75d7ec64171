// The sampler's argmax: one vector pass over each row, bound by memory where torch.argmax's loop is not.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "ops.h"
#include "vec.h"

namespace pagedserve::cpu {
namespace {

// Index of the largest of x[0 .. n) (float32 or bf16): the first where several are equal, the first NaN if
// there is one (torch.argmax's answer). bf16 rows are compared as they widen, exactly, so a bf16 row's
// answer is that of the row widened to float32.
template <typename T>
int64_t argmax_row(const T* x, int64_t n) {
  using namespace vec;
  int64_t best = 0, i = 0;
  if (n >= kLanes) {
    // Per lane the largest value so far and its index; a later equal value leaves the earlier index.
    Vec top = load(x);
    IVec index = iota(), at = index;
    bool nan = any(is_nan(top));
    for (i = kLanes; !nan && i + kLanes <= n; i += kLanes) {
      const Vec v = load(x + i);
      at = iadd(at, iset1(kLanes));
      nan = any(is_nan(v));
      const Mask greater = gt(v, top);
      top = select(greater, v, top);
      index = iselect(greater, at, index);
    }
    if (!nan) {
      alignas(64) float values[kLanes];
      alignas(64) int32_t indices[kLanes];
      store(values, top);
      istore(indices, index);
      const float most = *std::max_element(values, values + kLanes);
      best = std::numeric_limits<int32_t>::max();
      for (int lane = 0; lane < kLanes; ++lane)
        if (values[lane] == most) best = std::min<int64_t>(best, indices[lane]);
    } else {
      i = 0;  // a NaN somewhere: the plain loop below finds the first one
    }
  }
  for (; i < n; ++i) {
    const float v = static_cast<float>(x[i]);
    if (std::isnan(v)) return i;
    if (v > static_cast<float>(x[best])) best = i;
  }
  return best;
}

}  // namespace

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

}  // namespace pagedserve::cpu
