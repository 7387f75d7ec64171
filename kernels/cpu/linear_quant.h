// The weight-only quantized linear: y = x @ W^T + bias with W [N, K] held as int4 or int8 codes, a scale and
// an offset per group of K (w = scale * code + offset), dequantized in registers and summed in float32. Every
// format the loader reads (GGUF Q4_0, Q4_1, Q8_0, Q4_K, Q6_K; GPTQ; AWQ) is this one layout
// (worker_svc/quantization.py turns each into codes, scales and offsets; kernels/quant_pack.py packs them).
//
// Packed weight: one uint8 tensor, a 64-byte QuantHeader then the blocks of 16 output columns (N padded to a
// multiple of 16), one after the other, so that a thread's run of blocks is one stream. A block holds the
// scales (and offsets) of all its groups, padded to 64 bytes, then the codes of its groups in k order:
//   int4: lines of 64 bytes, one per 8 k: 32-bit lane c holds column c's 8 codes, k0 k2 k4 k6 in its low 16
//         bits (4 bits each, from bit 0 up) and k1 k3 k5 k7 in its high 16 bits, so that (lane >> 4p) &
//         0x000F000F is the pair (k 2p, k 2p + 1) of column c, as vdpbf16ps takes pairs;
//   int8: 16 signed bytes per k, the 16 columns.
// Scales: float32 scale and offset per column and group (kScaleF32: lossless for every format), fp16 scale
// and offset (kScaleF16: Q4_0, Q4_1 exactly, at their own size), or an fp16 scale alone (kScaleF16NoOffset:
// Q8_0).
//
// Decode reads each weight byte once a step: at 4 bits, a quarter of bf16's bytes. bf16 activations with int4
// codes multiply in vdpbf16ps (a code c as the bf16 1 + c/16, exact, and the group's sum of x taken back
// out); otherwise the codes are widened to float32 and multiplied by float32 FMAs (bf16 x widened first).

#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Optional.h>

#include <cstdint>

namespace at {
class Tensor;
}

namespace pagedserve::cpu {

enum QuantScale : int32_t { kScaleF32 = 0, kScaleF16 = 1, kScaleF16NoOffset = 2 };

// The first 64 bytes of a packed quantized weight.
struct QuantHeader {
  uint32_t magic;       // kQuantMagic
  int32_t bits;         // 4 or 8
  int32_t scale_kind;   // QuantScale
  int32_t group_size;   // k of a group: a multiple of 8 (int4) or 4 (int8); K is a multiple of it
  int64_t n, k;         // W's shape
  int64_t groups;       // K / group_size
  int64_t scale_bytes;  // bytes of a block's scales, a multiple of 64
  int64_t block_bytes;  // bytes of a block: scale_bytes + K * 16 * bits / 8
};
constexpr uint32_t kQuantMagic = 0x51505351;  // "QSPQ"
constexpr int64_t kQuantHeaderBytes = 64;
static_assert(sizeof(QuantHeader) <= kQuantHeaderBytes);

// The header of a packed quantized weight, checked (its size matches the header's shape); `what` names it.
QuantHeader quant_header(const at::Tensor& packed, const char* what);
// Whether a tensor is a packed quantized weight (uint8, starting with the header's magic).
bool is_quant_weight(const at::Tensor& packed);

// y [m, n] (rows ldy apart) = x [m, k] (rows ldx apart) @ W^T + bias, for W packed as above.
void linear_quant_to(const float* x, int64_t ldx, int64_t m, const uint8_t* packed, const float* bias,
                     float* y, int64_t ldy);
void linear_quant_to(const c10::BFloat16* x, int64_t ldx, int64_t m, const uint8_t* packed,
                     const c10::BFloat16* bias, c10::BFloat16* y, int64_t ldy);

// The binding: y = x @ W^T + bias, x float32 or bf16 [..., K], y of x's dtype.
at::Tensor linear_quant(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias);
// Whether this build has linear_quant (AVX-512).
bool has_linear_quant();
// Rows of bf16 x from which the codes are dequantized to bf16 and multiplied on AMX tiles (a W tile at a
// time; without AMX a few blocks at a time for the kernels' bf16 linear) rather than in registers; -1 never.
// The setter (-2: the build's choice, kQuantDequantRows) returns the setting before; for benchmarks and
// tests.
constexpr int64_t kQuantDequantRows = 6;
constexpr int64_t kQuantDequantDefault = -2;
int64_t quant_dequant_min_rows();
int64_t set_quant_dequant_min_rows(int64_t rows);

}  // namespace pagedserve::cpu
