// The CPU kernels' interface: what bindings.cpp binds for Python (kernels/cpu_ops.py), each defined in the
// file of its topic. Every op's contract (shapes, layouts, dtypes) is kernels/reference.py's.
//
// NOTE: the kernels include ATen's headers only, and the bindings torch/extension.h (pybind11 and all of
// torch's Python API, most of a compile at -O0): the test suite compiles the kernels for every instruction
// set without them (tests/test_kernels_cpu.py).

#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace pagedserve::cpu {

// Causal attention of a flat token batch over the paged KV cache; returns the bad block ids it met.
std::vector<int64_t> paged_attention_(at::Tensor& out, const at::Tensor& query, const at::Tensor& k_cache,
                                      const at::Tensor& v_cache, const at::Tensor& block_tables,
                                      const at::Tensor& query_start_loc, const at::Tensor& context_lens,
                                      double scale, int64_t max_pairs, int64_t min_tile_lanes);
at::Tensor argmax_rows(const at::Tensor& x);
// argmax_rows with -inf on the tokens the packed masks [R, ceil(n / 32)] ban in rows (int64 [R]; None: all).
at::Tensor masked_argmax_rows(const at::Tensor& x, const at::Tensor& masks,
                              const c10::optional<at::Tensor>& rows);
void copy_blocks_(const std::vector<at::Tensor>& caches, const at::Tensor& src, const at::Tensor& dst);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor silu_mul(const at::Tensor& gate_up);
at::Tensor add_rms_norm_(at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight, double eps);
void rotary_write_kv_(at::Tensor& qk, const at::Tensor& v, const at::Tensor& cos, const at::Tensor& sin,
                      at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slot_mapping);
at::Tensor pack_linear_weight(const at::Tensor& weight);
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                  const c10::optional<at::Tensor>& bias);
at::Tensor linear_silu(const at::Tensor& x, const at::Tensor& packed, int64_t size,
                       const c10::optional<at::Tensor>& bias);
bool has_linear();
bool has_linear_f32();
bool prefetches_into_l2();
// The instruction set this build's kernels are compiled for: "avx512-bf16-amx", "avx512-bf16", "avx512",
// "avx2" or "plain".
std::string instruction_set();
bool has_amx();
bool set_amx_enabled(bool enabled);
// Makes the kernels batch-invariant (see common.h batch_invariant) or lets them choose by the batch;
// returns the setting before.
bool set_batch_invariant(bool on);
bool batch_invariant();
// Whether this CPU's AMX tiles round as the AVX-512 linear's tiles' order does (see linear.h
// amx_tile_order), probed once a process.
bool tiles_sum_in_chains();
// Rows from which the linear of bf16 (f32: float32) goes to oneDNN, -1 never; and its setting (-1 never, -2
// the build's choice), which returns the setting before.
int64_t onednn_min_rows(bool f32);
int64_t set_onednn_min_rows(bool f32, int64_t rows);

// A decoder's layers run in one call (see the kernels' DecoderStack).
class DecoderStack {
 public:
  DecoderStack(int64_t hidden, int64_t intermediate, int64_t num_heads, int64_t num_kv_heads,
               int64_t head_dim, double eps, double scale, int64_t min_tile_lanes, at::Tensor final_norm);
  ~DecoderStack();
  DecoderStack(const DecoderStack&) = delete;
  DecoderStack& operator=(const DecoderStack&) = delete;

  void add_layer(at::Tensor qkv, c10::optional<at::Tensor> qkv_bias, at::Tensor o,
                 c10::optional<at::Tensor> o_bias, at::Tensor gate_up, c10::optional<at::Tensor> gate_up_bias,
                 at::Tensor down, c10::optional<at::Tensor> down_bias, at::Tensor input_norm,
                 at::Tensor post_attention_norm, c10::optional<at::Tensor> q_norm,
                 c10::optional<at::Tensor> k_norm);
  at::Tensor forward_tokens(const at::Tensor& input_ids, const at::Tensor& positions,
                            const at::Tensor& embedding, const at::Tensor& rope_table,
                            const std::vector<at::Tensor>& k_caches, const std::vector<at::Tensor>& v_caches,
                            const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                            const at::Tensor& query_start_loc, const at::Tensor& context_lens,
                            const c10::optional<at::Tensor>& output_rows) const;
  int64_t num_layers() const;

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace pagedserve::cpu
