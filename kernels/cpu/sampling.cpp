// The sampler's argmax: one vector pass over each row, bound by memory where torch.argmax's loop is not; and
// the argmax of rows under structured outputs' packed token masks, read as they are, in the same pass.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

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

namespace {

// Index of the largest of x[0 .. n) among the tokens that bits allows (bit t % 32 of bits[t / 32] set), as
// torch.argmax of the row with -inf on the others: the first where several are equal, the first allowed NaN
// if there is one, 0 where every allowed value is -inf (or none is allowed). Words of 32 tokens all banned
// are skipped unread, chunks of kLanes all allowed are compared as vectors, the rest token by token.
template <typename T>
int64_t masked_argmax_row(const T* x, const int32_t* bits, int64_t n) {
  using namespace vec;
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  constexpr uint32_t kChunk = kLanes >= 32 ? 0xffffffffu : (1u << kLanes) - 1;
  Vec top = set1(kNegInf);
  IVec index = iset1(std::numeric_limits<int32_t>::max());
  float best_value = kNegInf;
  int64_t best = std::numeric_limits<int32_t>::max();
  bool nan = false;
  const int64_t full = n / 32;  // words whose 32 tokens are all in the row
  for (int64_t w = 0; w < full && !nan; ++w) {
    const uint32_t word = static_cast<uint32_t>(bits[w]);
    if (word == 0) continue;
    for (int off = 0; off < 32; off += kLanes) {
      const uint32_t chunk = (word >> off) & kChunk;
      if (chunk == 0) continue;
      const int64_t i = w * 32 + off;
      if (chunk == kChunk) {
        const Vec v = load(x + i);
        if (any(is_nan(v))) {
          nan = true;
          break;
        }
        const Mask greater = gt(v, top);
        top = select(greater, v, top);
        index = iselect(greater, iadd(iota(), iset1(static_cast<int32_t>(i))), index);
      } else {
        for (uint32_t c = chunk; c != 0; c &= c - 1) {
          const int64_t t = i + __builtin_ctz(c);
          const float v = static_cast<float>(x[t]);
          if (std::isnan(v)) {
            nan = true;
            break;
          }
          if (v > best_value) best_value = v, best = t;
        }
        if (nan) break;
      }
    }
  }
  for (int64_t t = full * 32; t < n && !nan; ++t) {
    if (!((static_cast<uint32_t>(bits[t / 32]) >> (t % 32)) & 1u)) continue;
    const float v = static_cast<float>(x[t]);
    if (std::isnan(v))
      nan = true;
    else if (v > best_value)
      best_value = v, best = t;
  }
  if (nan) {  // the first allowed NaN
    for (int64_t t = 0; t < n; ++t)
      if (((static_cast<uint32_t>(bits[t / 32]) >> (t % 32)) & 1u) && std::isnan(static_cast<float>(x[t])))
        return t;
  }
  alignas(64) float values[kLanes];
  alignas(64) int32_t indices[kLanes];
  store(values, top);
  istore(indices, index);
  for (int lane = 0; lane < kLanes; ++lane) {
    if (values[lane] > best_value || (values[lane] == best_value && indices[lane] < best))
      best_value = values[lane], best = indices[lane];
  }
  return best_value == kNegInf ? 0 : best;
}

}  // namespace

at::Tensor masked_argmax_rows(const at::Tensor& x, const at::Tensor& masks,
                              const c10::optional<at::Tensor>& rows) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
                  x.stride(1) == 1 && x.size(1) > 0,
              "x must be float32 or bf16 [rows, n > 0] with contiguous rows");
  TORCH_CHECK(x.size(1) <= std::numeric_limits<int32_t>::max(), "rows longer than 2^31 - 1");
  const int64_t n = x.size(1), stride = x.stride(0), num_rows = x.size(0);
  TORCH_CHECK(masks.dim() == 2 && masks.scalar_type() == at::kInt && masks.is_contiguous() &&
                  masks.size(1) == (n + 31) / 32,
              "masks must be contiguous int32 [R, ceil(n / 32)]");
  // Row r's mask: mask_of[r] (-1: none), from rows (int64 [R], distinct rows of x), or row r's own.
  std::vector<int64_t> mask_of(num_rows, -1);
  if (rows.has_value() && rows->defined()) {
    TORCH_CHECK(rows->dim() == 1 && rows->scalar_type() == at::kLong && rows->size(0) == masks.size(0),
                "rows must be int64 [R], one per mask");
    const at::Tensor r = rows->contiguous();
    const int64_t* p = r.data_ptr<int64_t>();
    for (int64_t i = 0; i < r.size(0); ++i) {
      TORCH_CHECK(p[i] >= 0 && p[i] < num_rows, "rows out of range");
      mask_of[p[i]] = i;
    }
  } else {
    TORCH_CHECK(masks.size(0) == num_rows, "masks must have one row per row of x when rows is None");
    for (int64_t r = 0; r < num_rows; ++r) mask_of[r] = r;
  }
  at::Tensor out = at::empty({num_rows}, x.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  const int32_t* words = masks.data_ptr<int32_t>();
  const int64_t num_words = masks.size(1);
  const auto each = [&](const auto* base) {
    at::parallel_for(0, num_rows, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        o[r] = mask_of[r] < 0 ? argmax_row(base + r * stride, n)
                              : masked_argmax_row(base + r * stride, words + mask_of[r] * num_words, n);
    });
  };
  if (x.scalar_type() == at::kFloat)
    each(x.data_ptr<float>());
  else
    each(x.data_ptr<at::BFloat16>());
  return out;
}

}  // namespace pagedserve::cpu
