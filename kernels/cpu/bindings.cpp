// Python bindings of the CPU kernels (interface in ops.h), compiled with them by kernels/cpu_ops.py.

#include <torch/extension.h>

#include "linear_quant.h"
#include "ops.h"

namespace ps = pagedserve::cpu;

// The calls that run long release the GIL (their arguments are converted before, their result after), so
// another Python thread runs meanwhile: the worker's event loop writes the last step's result and reads the
// next plan during a forward pass rather than after it. The short ones keep it: a release is cheap, but it
// lets another thread take the GIL at each of them, which the step's Python would then wait for.
using release_gil = py::call_guard<py::gil_scoped_release>;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "pagedserve CPU kernels: paged attention and fused decoder ops";
  m.def("paged_attention_", &ps::paged_attention_,
        "Causal attention of a flat token batch over the paged KV cache", release_gil());
  m.def("argmax_rows", &ps::argmax_rows, "Index of the largest value of each row (as torch.argmax)");
  m.def("masked_argmax_rows", &ps::masked_argmax_rows,
        "argmax_rows with -inf on the tokens that packed bit masks ban, the bits read as they are");
  m.def("copy_blocks_", &ps::copy_blocks_, "Block src[i] to dst[i] in every cache, in order");
  m.def("rms_norm", &ps::rms_norm, "RMSNorm of the rows of x");
  m.def("silu_mul", &ps::silu_mul, "silu(gate) * up of gate_up [..., 2 * I], gate first");
  m.def("add_rms_norm_", &ps::add_rms_norm_, "x += delta in place, then RMSNorm of x");
  m.def("rotary_write_kv_", &ps::rotary_write_kv_, "RoPE on q and k in place, then k and v into the cache");
  m.def("pack_linear_weight", &ps::pack_linear_weight,
        "Pack an nn.Linear weight [N, K] (bf16, or float32 where has_linear_f32) for linear");
  m.def("linear", &ps::linear, "y = x @ W^T + bias with W packed by pack_linear_weight; n is W's N",
        release_gil());
  m.def("linear_silu", &ps::linear_silu,
        "silu_mul(linear(x, packed, 2 * size, bias)) without the [..., 2 * size] intermediate",
        release_gil());
  m.def("linear_quant", &ps::linear_quant,
        "y = x @ W^T + bias with W quantized (int4 or int8 codes, a scale and offset a group; see "
        "kernels/quant.py pack_quant_weight), x float32 or bf16",
        py::arg("x"), py::arg("packed"), py::arg("bias") = py::none(), release_gil());
  m.def("has_linear_quant", &ps::has_linear_quant, "Whether this build has linear_quant (AVX-512)");
  m.def("quant_dequant_min_rows", &ps::quant_dequant_min_rows,
        "Rows of bf16 x from which linear_quant dequantizes blocks for the bf16 linear, -1 never");
  m.def("set_quant_dequant_min_rows", &ps::set_quant_dequant_min_rows, py::arg("rows"),
        "Sets quant_dequant_min_rows (-1 never, -2 the build's choice); returns the setting before");
  m.def("has_linear", &ps::has_linear, "Whether this build has linear (AVX-512 BF16, or AVX2 with FMA)");
  m.def("has_linear_f32", &ps::has_linear_f32, "Whether this build has linear for float32 (AVX2 with FMA)");
  m.def("prefetches_into_l2", &ps::prefetches_into_l2,
        "Whether the tiled attention and the bf16 linear's decode rows prefetch into L2 rather than L1 "
        "(on every CPU but an AMD Zen 5)");
  m.def("instruction_set", &ps::instruction_set,
        "The instruction set the kernels are built for: avx512-bf16-amx, avx512-bf16, avx512, avx2 or plain");
  m.def("has_amx", &ps::has_amx,
        "Whether the bf16 linear takes AMX tiles from 16 rows on (a build with AMX, and Linux's permission)");
  m.def(
      "set_amx_enabled", &ps::set_amx_enabled, py::arg("enabled"),
      "Lets the bf16 linear take AMX or keeps it on AVX-512 (for benchmarks and tests); returns the setting "
      "before");
  m.def(
      "set_batch_invariant", &ps::set_batch_invariant, py::arg("on"),
      "Makes every row's result independent of the rest of its batch and of the thread count (one "
      "reduction order whatever the rows, fixed attention splits), or lets the kernels choose by the batch; "
      "returns the setting before");
  m.def("batch_invariant", &ps::batch_invariant, "Whether the kernels are batch-invariant now");
  m.def(
      "tiles_sum_in_chains", &ps::tiles_sum_in_chains,
      "Whether this CPU's AMX tiles round as the few-row linear's tiles' order does (probed once a process): "
      "batch-invariant, one to five rows then take AVX-512 in that order instead of the tiles");
  m.def("onednn_min_rows", &ps::onednn_min_rows, py::arg("f32"),
        "Rows from which the linear of bf16 (float32 where f32) hands the product to oneDNN, -1 never");
  m.def(
      "set_onednn_min_rows", &ps::set_onednn_min_rows, py::arg("f32"), py::arg("rows"),
      "Sets onednn_min_rows (-1 never, -2 the build's choice: for benchmarks and tests); returns the setting "
      "before");
  py::class_<ps::DecoderStack>(m, "DecoderStack", "A decoder's layers run in one call (see model.CausalLM)")
      .def(py::init<int64_t, int64_t, int64_t, int64_t, int64_t, double, double, int64_t, at::Tensor>(),
           py::arg("hidden"), py::arg("intermediate"), py::arg("num_heads"), py::arg("num_kv_heads"),
           py::arg("head_dim"), py::arg("eps"), py::arg("scale"), py::arg("min_tile_lanes"),
           py::arg("final_norm"))
      .def("add_layer", &ps::DecoderStack::add_layer, py::arg("qkv"), py::arg("qkv_bias"), py::arg("o"),
           py::arg("o_bias"), py::arg("gate_up"), py::arg("gate_up_bias"), py::arg("down"),
           py::arg("down_bias"), py::arg("input_norm"), py::arg("post_attention_norm"), py::arg("q_norm"),
           py::arg("k_norm"))
      .def("forward_tokens", &ps::DecoderStack::forward_tokens,
           "forward over token ids and positions, with the embedding and RoPE table rows gathered here",
           py::arg("input_ids"), py::arg("positions"), py::arg("embedding"), py::arg("rope_table"),
           py::arg("k_caches"), py::arg("v_caches"), py::arg("slot_mapping"), py::arg("block_tables"),
           py::arg("query_start_loc"), py::arg("context_lens"), py::arg("output_rows") = py::none(),
           release_gil())
      .def_property_readonly("num_layers", &ps::DecoderStack::num_layers);
}
