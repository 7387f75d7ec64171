// The decoder's small ops fused into one pass each (see pointwise.h), and copy_blocks_. Each is one body over
// vec::Vec rows with the last values of a row in a part-filled vector, so every instruction set runs the
// same roundings in the same order: RoPE and the residual add give the reference formulas' bits, RMSNorm's
// sum of squares is summed lane by lane, then across.

#include "pointwise.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <vector>

#include "common.h"
#include "ops.h"
#include "prefetch.h"

namespace pagedserve::cpu {

template <typename T>
void rms_norm_rows(T* x, int64_t x_stride, const T* delta, int64_t delta_stride, const T* weight, T* out,
                   int64_t out_stride, int64_t rows, int64_t size, double eps) {
  using namespace vec;
  const int64_t whole_size = whole(size), tail = size - whole_size;
  at::parallel_for(0, rows, pointwise_grain(size), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* xr = x + r * x_stride;
      const T* dr = delta == nullptr ? nullptr : delta + r * delta_stride;
      const auto add_delta = [&](int64_t i, Vec v, int64_t n) {  // x += delta, rounded to T, kept in x
        if (dr == nullptr) return v;
        v = round_to<T>(add(v, n == kLanes ? load(dr + i) : load_n(dr + i, n)));
        n == kLanes ? store(xr + i, v) : store_n(xr + i, v, n);
        return v;
      };
      Vec squares = zero();
      int64_t i = 0;
      for (; i < whole_size; i += kLanes) {
        const Vec v = add_delta(i, load(xr + i), kLanes);
        squares = fma(v, v, squares);
      }
      if (tail > 0) {
        const Vec v = add_delta(i, load_n(xr + i, tail), tail);
        squares = fma(v, v, squares);
      }
      const Vec inv =
          set1(1.f / std::sqrt(reduce_add(squares) / static_cast<float>(size) + static_cast<float>(eps)));
      T* o = out + r * out_stride;
      for (i = 0; i < whole_size; i += kLanes)
        store(o + i, mul(load(weight + i), round_to<T>(mul(load(xr + i), inv))));
      if (tail > 0)
        store_n(o + i, mul(load_n(weight + i, tail), round_to<T>(mul(load_n(xr + i, tail), inv))), tail);
    }
  });
}

template <typename T>
void silu_mul_rows(const T* x, int64_t x_stride, T* out, int64_t rows, int64_t size) {
  using namespace vec;
  // Rows in chunks of about 16K values: one decode row runs on the calling thread, a prompt on all.
  const int64_t grain = std::max<int64_t>(1, 16384 / size), whole_size = whole(size),
                tail = size - whole_size;
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = x + r * x_stride;
      const T* up = gate + size;
      T* o = out + r * size;
      int64_t i = 0;
      for (; i < whole_size; i += kLanes) store(o + i, silu_mul<T>(load(gate + i), load(up + i)));
      if (tail > 0) store_n(o + i, silu_mul<T>(load_n(gate + i, tail), load_n(up + i, tail)), tail);
    }
  });
}

template <typename T>
void rotary_write_kv_rows(at::Tensor& qk, const at::Tensor& v, const at::Tensor& cos, const at::Tensor& sin,
                          at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slots) {
  using namespace vec;
  const int64_t num_tokens = qk.size(0), heads = qk.size(1), head_dim = qk.size(2), half = head_dim / 2;
  const int64_t num_kv_heads = v.size(1), num_heads = heads - num_kv_heads;
  const int64_t block_size = k_cache.size(1), num_slots = k_cache.size(0) * block_size;
  // Where slot dst's kv head h lies in the cache (either layout, see check_cache).
  const int64_t block_stride = k_cache.stride(0), row_stride = k_cache.stride(1),
                head_stride = k_cache.stride(2);
  const auto at_slot = [&](int64_t dst) {
    return dst / block_size * block_stride + dst % block_size * row_stride;
  };
  T* qk_ptr = qk.data_ptr<T>();
  const T* v_ptr = v.data_ptr<T>();
  const T* cos_ptr = cos.data_ptr<T>();
  const T* sin_ptr = sin.data_ptr<T>();
  T* kc = k_cache.data_ptr<T>();
  T* vc = v_cache.data_ptr<T>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t row_bytes = head_dim * static_cast<int64_t>(sizeof(T));
  std::atomic<int64_t> bad_slot{-1};
  at::parallel_for(0, num_tokens, pointwise_grain(heads * head_dim), [&](int64_t begin, int64_t end) {
    std::vector<float> c(head_dim), s(head_dim);
    // The rows' cache slots, owned before the rotations: each lies in a block last written a step ago, long
    // out of the caches, and a store that waits for its line stalls the next ones.
    for (int64_t t = begin; t < end; ++t) {
      const int64_t dst = slot[t];
      if (dst >= 0 && dst < num_slots)
        for (int64_t h = 0; h < num_kv_heads; ++h) {
          prefetch_write(kc + at_slot(dst) + h * head_stride, row_bytes);
          prefetch_write(vc + at_slot(dst) + h * head_stride, row_bytes);
        }
    }
    for (int64_t t = begin; t < end; ++t) {
      load_row(cos_ptr + t * cos.stride(0), c.data(), head_dim);
      load_row(sin_ptr + t * sin.stride(0), s.data(), head_dim);
      for (int64_t h = 0; h < heads; ++h) {
        T* xh = qk_ptr + t * qk.stride(0) + h * head_dim;
        // first half: x1 * cos + x2 * (-sin); second half: x2 * cos + x1 * sin, each product and the sum
        // rounded to T as the reference rounds them
        const auto rotate = [&](int64_t d, int64_t n) {
          const auto in = [n](const auto* p) { return n == kLanes ? load(p) : load_n(p, n); };
          const Vec x1 = in(xh + d), x2 = in(xh + half + d);
          const Vec lo = add(round_to<T>(mul(x2, in(&s[d]))), round_to<T>(mul(x1, in(&c[d]))));
          const Vec hi = add(round_to<T>(mul(x1, in(&s[half + d]))), round_to<T>(mul(x2, in(&c[half + d]))));
          if (n == kLanes) {
            store(xh + d, lo);
            store(xh + half + d, hi);
          } else {
            store_n(xh + d, lo, n);
            store_n(xh + half + d, hi, n);
          }
        };
        int64_t d = 0;
        for (; d < whole(half); d += kLanes) rotate(d, kLanes);
        if (d < half) rotate(d, half - d);
      }
      const int64_t dst = slot[t];
      if (dst < 0) continue;  // padding
      if (dst >= num_slots) {
        bad_slot.store(dst);
        continue;
      }
      const T* k_row = qk_ptr + t * qk.stride(0) + num_heads * head_dim;
      const T* v_row = v_ptr + t * v.stride(0);
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        std::memcpy(kc + at_slot(dst) + h * head_stride, k_row + h * head_dim, row_bytes);
        std::memcpy(vc + at_slot(dst) + h * head_stride, v_row + h * head_dim, row_bytes);
      }
    }
  });
  TORCH_CHECK(bad_slot.load() < 0, "slot ", bad_slot.load(), " is outside the cache (", num_slots, " slots)");
}

#define PAGEDSERVE_POINTWISE(T)                                                                           \
  template void rms_norm_rows<T>(T*, int64_t, const T*, int64_t, const T*, T*, int64_t, int64_t, int64_t, \
                                 double);                                                                 \
  template void silu_mul_rows<T>(const T*, int64_t, T*, int64_t, int64_t);                                \
  template void rotary_write_kv_rows<T>(at::Tensor&, const at::Tensor&, const at::Tensor&,                \
                                        const at::Tensor&, at::Tensor&, at::Tensor&, const at::Tensor&);
PAGEDSERVE_POINTWISE(float)
PAGEDSERVE_POINTWISE(c10::BFloat16)
PAGEDSERVE_POINTWISE(c10::Half)
#undef PAGEDSERVE_POINTWISE

namespace {

at::Tensor rms_norm_any(const at::Tensor& x, const c10::optional<at::Tensor>& delta, const at::Tensor& weight,
                        double eps) {
  TORCH_CHECK(x.dim() >= 1 && x.stride(-1) == 1, "x must have a contiguous last dimension");
  const int64_t size = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == size && weight.is_contiguous(), "weight must be [", size,
              "]");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "weight and x differ in dtype");
  // In place, x must be viewable as rows (view fails clearly otherwise); else any layout will do.
  at::Tensor rows = delta.has_value() ? x.view({-1, size}) : x.reshape({-1, size});
  at::Tensor d;
  if (delta.has_value()) {
    d = delta->reshape({-1, size});
    TORCH_CHECK(d.sizes() == rows.sizes() && d.stride(1) == 1 && d.scalar_type() == x.scalar_type(),
                "delta must match x");
  }
  at::Tensor out = at::empty(x.sizes(), x.options());
  with_dtype(x.scalar_type(), "rms_norm", [&](auto zero) {
    using T = decltype(zero);
    rms_norm_rows<T>(rows.data_ptr<T>(), rows.stride(0), d.defined() ? d.data_ptr<T>() : nullptr,
                     d.defined() ? d.stride(0) : 0, weight.data_ptr<T>(), out.data_ptr<T>(), size,
                     rows.size(0), size, eps);
  });
  return out;
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return rms_norm_any(x, c10::nullopt, weight, eps);
}

at::Tensor add_rms_norm_(at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight, double eps) {
  return rms_norm_any(x, delta, weight, eps);
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() >= 1 && gate_up.size(-1) % 2 == 0 && gate_up.stride(-1) == 1,
              "gate_up must be [..., 2 * I] with a contiguous last dimension");
  const int64_t size = gate_up.size(-1) / 2;
  const at::Tensor rows = gate_up.reshape({-1, 2 * size});
  std::vector<int64_t> shape(gate_up.sizes().begin(), gate_up.sizes().end());
  shape.back() = size;
  at::Tensor out = at::empty(shape, gate_up.options());
  with_dtype(gate_up.scalar_type(), "silu_mul", [&](auto zero) {
    using T = decltype(zero);
    silu_mul_rows<T>(rows.data_ptr<T>(), rows.stride(0), out.data_ptr<T>(), rows.size(0), size);
  });
  return out;
}

void rotary_write_kv_(at::Tensor& qk, const at::Tensor& v, const at::Tensor& cos, const at::Tensor& sin,
                      at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slot_mapping) {
  check_cache(k_cache, v_cache);
  TORCH_CHECK(qk.dim() == 3 && qk.stride(2) == 1 && qk.stride(1) == qk.size(2),
              "qk must be [num_tokens, heads, head_dim] with contiguous heads");
  TORCH_CHECK(v.dim() == 3 && v.stride(2) == 1 && v.stride(1) == v.size(2),
              "v must be [num_tokens, kv_heads, head_dim] with contiguous heads");
  TORCH_CHECK(v.size(0) == qk.size(0) && v.size(1) == k_cache.size(2) && v.size(2) == k_cache.size(3) &&
                  qk.size(2) == k_cache.size(3) && qk.size(1) > v.size(1),
              "qk ", qk.sizes(), ", v ", v.sizes(), " and the cache ", k_cache.sizes(), " disagree");
  TORCH_CHECK(qk.size(2) % 2 == 0, "head_dim must be even for RoPE");
  for (const at::Tensor& t : {v, cos, sin, k_cache})
    TORCH_CHECK(t.scalar_type() == qk.scalar_type(), "every tensor must have qk's dtype ", qk.scalar_type());
  TORCH_CHECK(cos.size(0) == qk.size(0) && cos.size(-1) == qk.size(2) && cos.stride(-1) == 1 &&
                  sin.sizes() == cos.sizes() && sin.stride(-1) == 1,
              "cos and sin must be [num_tokens, 1, head_dim]");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == qk.size(0),
              "slot_mapping must be [num_tokens]");
  const at::Tensor slots = slot_mapping.to(at::kLong).contiguous();
  with_dtype(qk.scalar_type(), "rotary_write_kv_", [&](auto zero) {
    rotary_write_kv_rows<decltype(zero)>(qk, v, cos, sin, k_cache, v_cache, slots);
  });
}

// For every cache, block src[i] copied to block dst[i], one copy after another (a block written by copy i
// and read by a later one passes on its new content): one call for all layers, where PyTorch's index_select
// and index_copy_ are two ops a cache.
void copy_blocks_(const std::vector<at::Tensor>& caches, const at::Tensor& src, const at::Tensor& dst) {
  TORCH_CHECK(src.dim() == 1 && dst.sizes() == src.sizes() && src.scalar_type() == at::kLong &&
                  dst.scalar_type() == at::kLong,
              "src and dst must be int64 [N]");
  const at::Tensor s = src.contiguous(), d = dst.contiguous();
  const int64_t* from = s.data_ptr<int64_t>();
  const int64_t* to = d.data_ptr<int64_t>();
  if (caches.empty() || s.numel() == 0) return;
  // Each block a run of memory: a contiguous cache, or one of check_cache's layouts.
  for (const at::Tensor& cache : caches)
    TORCH_CHECK((cache.is_contiguous() || is_cache_layout(cache)) && cache.dim() >= 1 &&
                    cache.sizes() == caches[0].sizes() && cache.strides() == caches[0].strides() &&
                    cache.scalar_type() == caches[0].scalar_type(),
                "the caches must be alike, each contiguous or a KV cache (see check_cache)");
  const int64_t num_blocks = caches[0].size(0);  // the same in every cache, as just checked
  for (int64_t i = 0; i < s.numel(); ++i)
    TORCH_CHECK(from[i] >= 0 && from[i] < num_blocks && to[i] >= 0 && to[i] < num_blocks, "copy ", from[i],
                " -> ", to[i], " is outside the cache (", num_blocks, " blocks)");
  const int64_t block_bytes = caches[0].stride(0) * caches[0].element_size();
  at::parallel_for(0, static_cast<int64_t>(caches.size()), 8, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      char* base = static_cast<char*>(caches[c].data_ptr());
      for (int64_t i = 0; i < s.numel(); ++i)
        if (from[i] != to[i])
          std::memcpy(base + to[i] * block_bytes, base + from[i] * block_bytes, block_bytes);
    }
  });
}

}  // namespace pagedserve::cpu
