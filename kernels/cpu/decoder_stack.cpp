// DecoderStack: all decoder layers of a step in one call. The Python model calls about ten kernels a layer,
// each through its module, its wrapper and the conversion of its arguments, some microseconds a call: for a
// single sequence as much as attention and the pointwise ops together. The stack holds every layer's weights
// and runs the same kernels in the same order as model.CausalLM.forward (but for linear_silu_to, the MLP's
// gate_up linear and SiLU in one pass in bf16), so it computes the same bits.
//
// Inside, a layer makes no tensors: the kernels run on pointers into buffers the stack keeps, and the
// tensors' checks, the attention's plan and the views the attention and RoPE kernels take are made once a
// forward pass. Each torch op costs microseconds there, cold (the weights streamed since the last one have
// pushed PyTorch's own code and data out of the caches), while the other threads wait.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "attention.h"
#include "common.h"
#include "linear.h"
#include "linear_quant.h"
#include "ops.h"
#include "pointwise.h"

namespace pagedserve::cpu {
namespace {

struct StackLayer {
  at::Tensor qkv, o, gate_up, down;  // packed by pack_linear_weight, or quantized (pack_quant_weight)
  c10::optional<at::Tensor> qkv_bias, o_bias, gate_up_bias, down_bias;
  at::Tensor input_norm, post_attention_norm;
  c10::optional<at::Tensor> q_norm, k_norm;  // per-head RMSNorm of q and k (qwen3)
};

// The data of an optional tensor of T, or null.
template <typename T>
const T* data_or_null(const c10::optional<at::Tensor>& t) {
  return t.has_value() ? t->const_data_ptr<T>() : nullptr;
}

// What the interface's DecoderStack calls, whichever the dtype of the stack's model.
class StackBase {
 public:
  virtual ~StackBase() = default;
  virtual void add_layer(at::Tensor qkv, c10::optional<at::Tensor> qkv_bias, at::Tensor o,
                         c10::optional<at::Tensor> o_bias, at::Tensor gate_up,
                         c10::optional<at::Tensor> gate_up_bias, at::Tensor down,
                         c10::optional<at::Tensor> down_bias, at::Tensor input_norm,
                         at::Tensor post_attention_norm, c10::optional<at::Tensor> q_norm,
                         c10::optional<at::Tensor> k_norm) = 0;
  virtual at::Tensor forward_tokens(const at::Tensor& input_ids, const at::Tensor& positions,
                                    const at::Tensor& embedding, const at::Tensor& rope_table,
                                    const std::vector<at::Tensor>& k_caches,
                                    const std::vector<at::Tensor>& v_caches, const at::Tensor& slot_mapping,
                                    const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                                    const at::Tensor& context_lens,
                                    const c10::optional<at::Tensor>& output_rows) const = 0;
  virtual int64_t num_layers() const = 0;
};

// The stack of a bf16 model (T = at::BFloat16: the kernels' bf16 linear, with the MLP's gate_up and SiLU in
// one pass where linear_silu_to fuses them) or of a float32 one (T = float: linear_f32_avx2, then
// silu_mul, as the Python loop runs them).
template <typename T>
class DecoderStackT final : public StackBase {
  static constexpr at::ScalarType kType = c10::CppTypeToScalarType<T>::value;
  static constexpr const char* kTypeName = std::is_same_v<T, float> ? "float32" : "bf16";

 public:
  DecoderStackT(int64_t hidden, int64_t intermediate, int64_t num_heads, int64_t num_kv_heads,
                int64_t head_dim, double eps, double scale, int64_t min_tile_lanes, at::Tensor final_norm)
      : hidden_(hidden),
        intermediate_(intermediate),
        num_heads_(num_heads),
        num_kv_heads_(num_kv_heads),
        head_dim_(head_dim),
        q_size_(num_heads * head_dim),
        kv_size_(num_kv_heads * head_dim),
        eps_(eps),
        scale_(scale),
        min_tile_lanes_(min_tile_lanes),
        final_norm_(std::move(final_norm)) {
    TORCH_CHECK((std::is_same_v<T, float> ? has_linear_f32() : has_linear()),
                "DecoderStack needs the kernels' linear for its dtype (see has_linear and has_linear_f32)");
    TORCH_CHECK(num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads");
    // linear_to reads x in whole pairs; every released model's sizes are even.
    TORCH_CHECK(hidden % 2 == 0 && intermediate % 2 == 0 && head_dim % 2 == 0,
                "DecoderStack needs even hidden, intermediate and head sizes");
    check_norm(final_norm_, hidden_, "final_norm");
  }

  void add_layer(at::Tensor qkv, c10::optional<at::Tensor> qkv_bias, at::Tensor o,
                 c10::optional<at::Tensor> o_bias, at::Tensor gate_up, c10::optional<at::Tensor> gate_up_bias,
                 at::Tensor down, c10::optional<at::Tensor> down_bias, at::Tensor input_norm,
                 at::Tensor post_attention_norm, c10::optional<at::Tensor> q_norm,
                 c10::optional<at::Tensor> k_norm) override {
    check_packed(qkv, qkv_bias, q_size_ + 2 * kv_size_, hidden_, "qkv");
    check_packed(o, o_bias, hidden_, q_size_, "o");
    check_packed(gate_up, gate_up_bias, 2 * intermediate_, hidden_, "gate_up");
    check_packed(down, down_bias, hidden_, intermediate_, "down");
    check_norm(input_norm, hidden_, "input_norm");
    check_norm(post_attention_norm, hidden_, "post_attention_norm");
    TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "q_norm and k_norm come together");
    if (q_norm.has_value()) {
      check_norm(*q_norm, head_dim_, "q_norm");
      check_norm(*k_norm, head_dim_, "k_norm");
    }
    layers_.push_back({std::move(qkv), std::move(o), std::move(gate_up), std::move(down), std::move(qkv_bias),
                       std::move(o_bias), std::move(gate_up_bias), std::move(down_bias),
                       std::move(input_norm), std::move(post_attention_norm), std::move(q_norm),
                       std::move(k_norm)});
  }

  // forward over token ids: their embedding rows and the RoPE table rows of their positions (cos | sin, as
  // model.RotaryEmbedding.lookup splits them) are gathered here, where from Python they would be two more
  // torch calls, cold after the weights streamed through the caches.
  at::Tensor forward_tokens(const at::Tensor& input_ids, const at::Tensor& positions,
                            const at::Tensor& embedding, const at::Tensor& rope_table,
                            const std::vector<at::Tensor>& k_caches, const std::vector<at::Tensor>& v_caches,
                            const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                            const at::Tensor& query_start_loc, const at::Tensor& context_lens,
                            const c10::optional<at::Tensor>& output_rows) const override {
    TORCH_CHECK(input_ids.dim() == 1 && input_ids.scalar_type() == at::kLong &&
                    positions.sizes() == input_ids.sizes() && positions.scalar_type() == at::kLong,
                "input_ids and positions must be int64 [num_tokens]");
    TORCH_CHECK(embedding.dim() == 2 && embedding.size(1) == hidden_ && embedding.scalar_type() == kType &&
                    embedding.is_contiguous(),
                "embedding must be contiguous ", kTypeName, " [vocab, ", hidden_, "]");
    TORCH_CHECK(rope_table.dim() == 2 && rope_table.size(1) == 2 * head_dim_ &&
                    rope_table.scalar_type() == kType && rope_table.is_contiguous(),
                "rope_table must be contiguous ", kTypeName, " [max_position, ", 2 * head_dim_, "]");
    const at::Tensor ids = input_ids.contiguous(), pos = positions.contiguous();
    const int64_t t = ids.numel(), vocab = embedding.size(0), max_position = rope_table.size(0);
    const int64_t* id = ids.const_data_ptr<int64_t>();
    const int64_t* at_pos = pos.const_data_ptr<int64_t>();
    for (int64_t i = 0; i < t; ++i) {
      TORCH_CHECK(id[i] >= 0 && id[i] < vocab, "token id ", id[i], " is outside the vocabulary (", vocab,
                  ")");
      TORCH_CHECK(at_pos[i] >= 0 && at_pos[i] < max_position, "position ", at_pos[i],
                  " is beyond the RoPE table (", max_position, " positions)");
    }
    at::Tensor x = at::empty({t, hidden_}, embedding.options());
    at::Tensor rope = at::empty({t, 1, 2 * head_dim_}, rope_table.options());
    const T* emb = embedding.const_data_ptr<T>();
    const T* table = rope_table.const_data_ptr<T>();
    T* x_rows = x.mutable_data_ptr<T>();
    T* rope_rows = rope.mutable_data_ptr<T>();
    at::parallel_for(0, t, 256, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        std::memcpy(x_rows + i * hidden_, emb + id[i] * hidden_, hidden_ * sizeof(T));
        std::memcpy(rope_rows + i * 2 * head_dim_, table + at_pos[i] * 2 * head_dim_,
                    2 * head_dim_ * sizeof(T));
      }
    });
    return forward(x, rope.narrow(2, 0, head_dim_), rope.narrow(2, head_dim_, head_dim_), k_caches, v_caches,
                   slot_mapping, block_tables, query_start_loc, context_lens, output_rows);
  }

  int64_t num_layers() const override { return static_cast<int64_t>(layers_.size()); }

 private:
  // x [T, hidden] is the embedded batch, the residual stream (updated in place); returns the final norm
  // of the last layer's output. cos and sin are rotary_write_kv_'s [T, 1, head_dim], the other arguments
  // those of rotary_write_kv_ and paged_attention_, with one K and one V cache per layer. output_rows (int64
  // indices of x's rows): the rows returned, in that order; the last layer computes attention, o and the MLP
  // for them alone (see OutputRows), and every row's K and V as always. None: all rows.
  at::Tensor forward(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                     const std::vector<at::Tensor>& k_caches, const std::vector<at::Tensor>& v_caches,
                     const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                     const at::Tensor& query_start_loc, const at::Tensor& context_lens,
                     const c10::optional<at::Tensor>& output_rows) const {
    const int64_t num_layers = static_cast<int64_t>(layers_.size());
    TORCH_CHECK(num_layers > 0, "the stack has no layers");
    TORCH_CHECK(static_cast<int64_t>(k_caches.size()) == num_layers &&
                    static_cast<int64_t>(v_caches.size()) == num_layers,
                "one K and one V cache per layer: ", num_layers, " layers, ", k_caches.size(), " and ",
                v_caches.size(), " caches");
    TORCH_CHECK(x.dim() == 2 && x.size(1) == hidden_ && x.is_contiguous() && x.scalar_type() == kType,
                "x must be contiguous ", kTypeName, " [num_tokens, ", hidden_, "]");
    for (int64_t i = 0; i < num_layers; ++i) {
      check_cache(k_caches[i], v_caches[i]);
      TORCH_CHECK(k_caches[i].scalar_type() == kType && k_caches[i].size(2) == num_kv_heads_ &&
                      k_caches[i].size(3) == head_dim_ && k_caches[i].sizes() == k_caches[0].sizes(),
                  "layer ", i, ": the caches must be ", kTypeName, " [num_blocks, block_size, ",
                  num_kv_heads_, ", ", head_dim_, "], as every layer's");
    }
    const int64_t t = x.size(0);
    TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == t, "slot_mapping must be [num_tokens]");
    const at::Tensor slots = slot_mapping.to(at::kLong).contiguous();
    const c10::optional<OutputRows> out_rows =
        output_rows.has_value()
            ? c10::make_optional(OutputRows(*output_rows, t, block_tables, query_start_loc, context_lens))
            : c10::nullopt;
    // The same for every layer: the attention's plan and the buffers' views.
    const AttentionPlan plan = plan_attention(t, num_heads_, k_caches[0], block_tables, query_start_loc,
                                              context_lens, -1, min_tile_lanes_);
    const Buffers b = buffers(t);
    at::Tensor out = out_rows.has_value() ? at::Tensor() : at::empty({t, hidden_}, x.options());
    T* const xp = x.mutable_data_ptr<T>();
    rms_norm_rows<T>(xp, hidden_, nullptr, 0, layers_[0].input_norm.const_data_ptr<T>(), b.h, hidden_, t,
                     hidden_, eps_);
    for (int64_t i = 0; i < num_layers; ++i) {
      const StackLayer& layer = layers_[i];
      at::Tensor k_cache = k_caches[i], v_cache = v_caches[i];
      linear(b.h, t, layer.qkv, hidden_, q_size_ + 2 * kv_size_, layer.qkv_bias, b.qkv);
      at::Tensor qk = b.qk;
      if (layer.q_norm.has_value())
        qk = at::cat({rms_norm(qk.narrow(1, 0, num_heads_), *layer.q_norm, eps_),
                      rms_norm(qk.narrow(1, num_heads_, num_kv_heads_), *layer.k_norm, eps_)},
                     1);
      rotary_write_kv_rows<T>(qk, b.v, cos, sin, k_cache, v_cache, slots);
      const at::Tensor q = layer.q_norm.has_value() ? qk.narrow(1, 0, num_heads_) : b.q;
      if (i + 1 == num_layers && out_rows.has_value()) {  // only the output rows go on (see OutputRows)
        at::Tensor xr = x.index_select(0, out_rows->rows);
        const int64_t r = xr.size(0);
        if (r == 0) return xr;
        const AttentionPlan rows_plan = plan_attention(r, num_heads_, k_cache, out_rows->tables,
                                                       out_rows->starts, out_rows->lens, -1, min_tile_lanes_);
        out = at::empty({r, hidden_}, x.options());
        attend_and_mlp(xr, q.index_select(0, out_rows->rows), layer, k_cache, v_cache, out_rows->tables,
                       rows_plan, b, b.attn.narrow(0, 0, r), final_norm_, out.mutable_data_ptr<T>());
        return out;
      }
      const bool last = i + 1 == num_layers;  // its output is the final norm's, the call's result
      attend_and_mlp(x, q, layer, k_cache, v_cache, block_tables, plan, b, b.attn,
                     last ? final_norm_ : layers_[i + 1].input_norm, last ? out.mutable_data_ptr<T>() : b.h);
    }
    return out;
  }

  // The rows a step's caller reads (the rows it samples from, or scores prompt tokens with): only their
  // final hidden states matter, and in the last layer a row's attention output, o and MLP feed nothing
  // but its own final state, so there they are computed for these rows alone, each as one query over its
  // sequence up to its own position (a decode row). The other rows' K and V are written as always.
  struct OutputRows {
    at::Tensor rows;                  // int64 [R], rows of the batch
    at::Tensor tables, starts, lens;  // paged_attention_'s metadata for them: one sequence each
    OutputRows(const at::Tensor& output_rows, int64_t num_tokens, const at::Tensor& block_tables,
               const at::Tensor& query_start_loc, const at::Tensor& context_lens) {
      TORCH_CHECK(output_rows.dim() == 1 && output_rows.scalar_type() == at::kLong,
                  "output_rows must be int64 [R]");
      rows = output_rows.contiguous();
      const at::Tensor starts_in = query_start_loc.contiguous(), ctx_in = context_lens.contiguous();
      const int64_t num_seqs = ctx_in.numel(), count = rows.numel();
      TORCH_CHECK(starts_in.scalar_type() == at::kInt && ctx_in.scalar_type() == at::kInt &&
                      starts_in.numel() == num_seqs + 1,
                  "query_start_loc must be int32 [S + 1] and context_lens int32 [S]");
      const int32_t* start = starts_in.const_data_ptr<int32_t>();
      const int32_t* ctx = ctx_in.const_data_ptr<int32_t>();
      TORCH_CHECK(start[0] == 0 && start[num_seqs] == num_tokens, "query_start_loc must run from 0 to ",
                  num_tokens);
      const int64_t* row = rows.const_data_ptr<int64_t>();
      at::Tensor seqs = at::empty({count}, rows.options());
      lens = at::empty({count}, ctx_in.options());
      int64_t* seq = seqs.mutable_data_ptr<int64_t>();
      int32_t* len = lens.mutable_data_ptr<int32_t>();
      for (int64_t i = 0; i < count; ++i) {
        TORCH_CHECK(row[i] >= 0 && row[i] < num_tokens, "output row ", row[i], " is outside the batch (",
                    num_tokens, " rows)");
        seq[i] = std::upper_bound(start, start + num_seqs + 1, row[i]) - start - 1;
        len[i] = ctx[seq[i]] - (start[seq[i] + 1] - static_cast<int32_t>(row[i])) + 1;  // its position + 1
      }
      tables = block_tables.index_select(0, seqs);
      starts = at::arange(count + 1, ctx_in.options());
    }
  };

  // A forward pass's intermediate rows, in workspace_: pointers to [T, width] buffers, and the views of them
  // that the RoPE and attention kernels take.
  struct Buffers {
    T *h, *qkv, *o, *act, *down, *scratch;
    at::Tensor qk, v, q;  // of qkv: [T, Hq + Hkv, D], [T, Hkv, D], [T, Hq, D]
    at::Tensor attn;      // [T, Hq, D], contiguous
  };

  // Buffers for t rows, in workspace_ (grown to fit, never shrunk: its pages are touched only as far as
  // the longest step has used them). NOTE: every forward pass uses the same workspace, so a stack serves
  // one at a time; pybind11 holds the GIL through the call.
  Buffers buffers(int64_t t) const {
    const int64_t qkv_width = q_size_ + 2 * kv_size_;
    // h, qkv, attn, o, act, down, scratch
    const int64_t widths[] = {hidden_,       qkv_width, q_size_,          hidden_,
                              intermediate_, hidden_,   2 * intermediate_};
    int64_t offsets[7], total = 0;
    for (int i = 0; i < 7; ++i) offsets[i] = total, total += t * widths[i];
    if (workspace_.numel() < total) workspace_ = at::empty({total}, final_norm_.options());
    T* const base = workspace_.mutable_data_ptr<T>();
    Buffers b;
    b.h = base + offsets[0];
    b.qkv = base + offsets[1];
    b.o = base + offsets[3];
    b.act = base + offsets[4];
    b.down = base + offsets[5];
    b.scratch = base + offsets[6];
    const at::Tensor qkv = workspace_.narrow(0, offsets[1], t * qkv_width).view({t, qkv_width});
    b.qk = qkv.narrow(1, 0, q_size_ + kv_size_).view({t, num_heads_ + num_kv_heads_, head_dim_});
    b.v = qkv.narrow(1, q_size_ + kv_size_, kv_size_).view({t, num_kv_heads_, head_dim_});
    b.q = b.qk.narrow(1, 0, num_heads_);
    b.attn = workspace_.narrow(0, offsets[2], t * q_size_).view({t, num_heads_, head_dim_});
    return b;
  }

  // A layer from its rotated queries q [R, num_heads, head_dim] on: attention over its caches with the given
  // metadata and plan into attn (a [R, num_heads, head_dim] buffer), o, the residual add into x (R rows,
  // updated in place) with the post-attention norm, the MLP, and the residual add with next_norm (the next
  // layer's input norm or the final one), written to h_out [R, hidden].
  void attend_and_mlp(at::Tensor& x, const at::Tensor& q, const StackLayer& layer, const at::Tensor& k_cache,
                      const at::Tensor& v_cache, const at::Tensor& block_tables, const AttentionPlan& plan,
                      const Buffers& b, at::Tensor attn, const at::Tensor& next_norm, T* h_out) const {
    const int64_t rows = q.size(0);
    T* const xp = x.mutable_data_ptr<T>();
    run_attention(plan, attn, q, k_cache, v_cache, block_tables, scale_);
    linear(attn.const_data_ptr<T>(), rows, layer.o, q_size_, hidden_, layer.o_bias, b.o);
    rms_norm_rows<T>(xp, hidden_, b.o, hidden_, layer.post_attention_norm.const_data_ptr<T>(), b.h, hidden_,
                     rows, hidden_, eps_);
    const bool quantized = layer.gate_up.scalar_type() == at::kByte;  // see linear
    if (std::is_same_v<T, float> || quantized) {
      linear(b.h, rows, layer.gate_up, hidden_, 2 * intermediate_, layer.gate_up_bias, b.scratch);
      silu_mul_rows<T>(b.scratch, 2 * intermediate_, b.act, rows, intermediate_);
    } else if constexpr (!std::is_same_v<T, float>) {
      linear_silu_to(b.h, rows, layer.gate_up.const_data_ptr<T>(), hidden_ / 2, intermediate_,
                     data_or_null<T>(layer.gate_up_bias), b.act, intermediate_, b.scratch);
    }
    linear(b.act, rows, layer.down, intermediate_, hidden_, layer.down_bias, b.down);
    rms_norm_rows<T>(xp, hidden_, b.down, hidden_, next_norm.const_data_ptr<T>(), h_out, hidden_, rows,
                     hidden_, eps_);
  }

  // y [rows, n] = x [rows, k] @ W^T + bias for a W packed by pack_linear_weight, or quantized (uint8, from
  // pack_quant_weight) (x and y contiguous).
  static void linear(const T* x, int64_t rows, const at::Tensor& packed, int64_t k, int64_t n,
                     const c10::optional<at::Tensor>& bias, T* y) {
    if (packed.scalar_type() == at::kByte)
      return linear_quant_to(x, k, rows, packed.const_data_ptr<uint8_t>(), data_or_null<T>(bias), y, n);
    if constexpr (std::is_same_v<T, float>) {
      linear_f32_to(x, k, rows, packed.const_data_ptr<float>(), k, n, data_or_null<float>(bias), y, n);
    } else {
      linear_to(x, k, rows, packed.const_data_ptr<T>(), k / 2, n, data_or_null<T>(bias), y, n);
    }
  }

  static void check_packed(const at::Tensor& packed, const c10::optional<at::Tensor>& bias, int64_t n,
                           int64_t k, const char* name) {
    if (is_quant_weight(packed)) {
      const QuantHeader h = quant_header(packed, (std::string(name) + ": ").c_str());
      TORCH_CHECK(h.n == n && h.k == k, name, ": expected a quantized weight [", n, ", ", k, "], got [", h.n,
                  ", ", h.k, "]");
      check_linear_bias(bias, n, (std::string(name) + ": the ").c_str(), std::is_same_v<T, float>);
      return;
    }
    // bf16: [blocks, K / 2, 16, 2]; float32: [blocks, K, 16] (see pack_linear_weight)
    const bool shaped =
        std::is_same_v<T, float>
            ? packed.dim() == 3 && packed.size(1) == k && packed.size(2) == kBlock
            : packed.dim() == 4 && packed.size(1) == k / 2 && packed.size(2) == kBlock && packed.size(3) == 2;
    TORCH_CHECK(shaped && packed.size(0) == (n + kBlock - 1) / kBlock && packed.scalar_type() == kType &&
                    packed.is_contiguous(),
                name, ": expected a ", kTypeName, " weight [", n, ", ", k,
                "] packed by pack_linear_weight, got ", packed.sizes());
    check_linear_bias(bias, n, (std::string(name) + ": the ").c_str(), std::is_same_v<T, float>);
  }
  static void check_norm(const at::Tensor& weight, int64_t size, const char* name) {
    TORCH_CHECK(weight.dim() == 1 && weight.size(0) == size && weight.scalar_type() == kType &&
                    weight.is_contiguous(),
                name, " must be contiguous ", kTypeName, " [", size, "]");
  }

  const int64_t hidden_, intermediate_, num_heads_, num_kv_heads_, head_dim_, q_size_, kv_size_;
  const double eps_, scale_;
  const int64_t min_tile_lanes_;
  const at::Tensor final_norm_;
  std::vector<StackLayer> layers_;
  mutable at::Tensor workspace_;  // see buffers
};

}  // namespace

// The stack of final_norm's dtype: bf16 or float32.
class DecoderStack::Impl {
 public:
  Impl(int64_t hidden, int64_t intermediate, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
       double eps, double scale, int64_t min_tile_lanes, at::Tensor final_norm) {
    const at::ScalarType dtype = final_norm.scalar_type();
    TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat,
                "DecoderStack runs bf16 or float32 models, not ", dtype);
    if (dtype == at::kFloat)
      stack = std::make_unique<DecoderStackT<float>>(hidden, intermediate, num_heads, num_kv_heads, head_dim,
                                                     eps, scale, min_tile_lanes, std::move(final_norm));
    else
      stack = std::make_unique<DecoderStackT<at::BFloat16>>(hidden, intermediate, num_heads, num_kv_heads,
                                                            head_dim, eps, scale, min_tile_lanes,
                                                            std::move(final_norm));
  }
  std::unique_ptr<StackBase> stack;
  // NOTE: the bindings release the GIL through a forward pass (so the worker's event loop writes results and
  // reads plans while it runs), and every pass uses the stack's one workspace: passes take turns.
  std::mutex forward_mutex;
};

DecoderStack::DecoderStack(int64_t hidden, int64_t intermediate, int64_t num_heads, int64_t num_kv_heads,
                           int64_t head_dim, double eps, double scale, int64_t min_tile_lanes,
                           at::Tensor final_norm)
    : impl_(std::make_unique<Impl>(hidden, intermediate, num_heads, num_kv_heads, head_dim, eps, scale,
                                   min_tile_lanes, std::move(final_norm))) {}
DecoderStack::~DecoderStack() = default;

void DecoderStack::add_layer(at::Tensor qkv, c10::optional<at::Tensor> qkv_bias, at::Tensor o,
                             c10::optional<at::Tensor> o_bias, at::Tensor gate_up,
                             c10::optional<at::Tensor> gate_up_bias, at::Tensor down,
                             c10::optional<at::Tensor> down_bias, at::Tensor input_norm,
                             at::Tensor post_attention_norm, c10::optional<at::Tensor> q_norm,
                             c10::optional<at::Tensor> k_norm) {
  impl_->stack->add_layer(std::move(qkv), std::move(qkv_bias), std::move(o), std::move(o_bias),
                          std::move(gate_up), std::move(gate_up_bias), std::move(down), std::move(down_bias),
                          std::move(input_norm), std::move(post_attention_norm), std::move(q_norm),
                          std::move(k_norm));
}
at::Tensor DecoderStack::forward_tokens(const at::Tensor& input_ids, const at::Tensor& positions,
                                        const at::Tensor& embedding, const at::Tensor& rope_table,
                                        const std::vector<at::Tensor>& k_caches,
                                        const std::vector<at::Tensor>& v_caches,
                                        const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                                        const at::Tensor& query_start_loc, const at::Tensor& context_lens,
                                        const c10::optional<at::Tensor>& output_rows) const {
  const std::lock_guard<std::mutex> turn(impl_->forward_mutex);
  return impl_->stack->forward_tokens(input_ids, positions, embedding, rope_table, k_caches, v_caches,
                                      slot_mapping, block_tables, query_start_loc, context_lens, output_rows);
}
int64_t DecoderStack::num_layers() const { return impl_->stack->num_layers(); }

}  // namespace pagedserve::cpu
