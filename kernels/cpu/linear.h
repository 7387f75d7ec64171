// The linear layers: y = x @ W^T + bias with x [M, K], W [N, K] (nn.Linear's layout), W packed once by
// pack_linear_weight (linear.cpp, which also picks the family that computes a call). Each family streams W
// once, a sequential run of blocks a thread, while the rows of x stay in L1 or L2:
//   linear_bf16_avx512.cpp  bf16, AVX-512 BF16's dot product of bf16 pairs (vdpbf16ps);
//   linear_bf16_amx.cpp     bf16, AMX tiles, from a few rows on;
//   linear_bf16_widen.cpp   bf16 without a bf16 dot product (AVX2, AVX-512 without BF16): the weights widened
//                           to float32 as they stream, float32 FMAs;
//   linear_f32.cpp          float32 models, float32 FMAs;
//   linear_onednn.cpp       many rows (prompts), through oneDNN's matmul where it clearly wins.
// Products are summed in float32 in k order (pairs of k at a time with vdpbf16ps and tdpbf16ps) and rounded
// once to the output's dtype, the bias added before that rounding.
//
// Batch invariance (common.h batch_invariant): a row's bits may not depend on how many rows came with it, so
// the body that computes a weight is chosen by the weight alone, and every body keeps one chain of sums a row
// in k order whatever the rows: AMX for every row count where it takes the weight (its pair products round
// in an order of their own), else AVX-512 BF16 with one chain a row (no interleaved sets of sums for few
// rows), the widening and float32 bodies as they always are; never oneDNN, which blocks K by the shape.
//
// Layout: W is packed into blocks of 16 output columns (N padded to a multiple of 16). bf16: inside a block
// K is walked in pairs, and pair p of the block's 16 columns is one 64-byte line [n0 k2p, n0 k2p+1, n1 k2p,
// ...] ([N / 16, K / 2, 16, 2], K padded to a multiple of 2): vdpbf16ps multiplies a line by one pair of x
// broadcast to all 16 lanes, 16 consecutive lines are one AMX W tile, and a shift and a mask widen a line to
// the float32 weights of k = 2p and of k = 2p + 1. float32: row k of a block is one 64-byte line
// ([N / 16, K, 16]). Blocks follow each other, so a thread's run of blocks is one stream.

#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Optional.h>

#include <algorithm>
#include <cstdint>

#include "pointwise.h"
#include "vec.h"

namespace at {
class Tensor;
}

namespace pagedserve::cpu {

constexpr int64_t kBlock = 16;  // output columns of a packed block
// MXCSR's FTZ and DAZ: denormal results and inputs as zeros, as tdpbf16ps takes them (see amx_tile_order).
constexpr unsigned kFlushDenormals = 0x8040;
constexpr int64_t kAmxTilePairs = 16;  // K pairs of an AMX tile: 32 bf16, 64 bytes, a W tile's 16 lines
// How far ahead of the line being read a stream of W is prefetched, into L2; four streams side by side (the
// decode rows, see BlockRuns) each prefetch nearer.
constexpr int64_t kPrefetchBytes = 4096;
constexpr int64_t kFourStreamPrefetchBytes = 1024;

// y [m, n] (rows ldy apart) = x [m, 2 * pairs] (rows ldx apart) @ W^T + bias for a bf16 W that
// pack_linear_weight packed: the kernel of the interface's linear, on buffers the caller owns.
void linear_to(const c10::BFloat16* x, int64_t ldx, int64_t m, const c10::BFloat16* w, int64_t pairs,
               int64_t n, const c10::BFloat16* bias, c10::BFloat16* y, int64_t ldy);
// linear_to's float32 twin, x [m, k].
void linear_f32_to(const float* x, int64_t ldx, int64_t m, const float* w, int64_t k, int64_t n,
                   const float* bias, float* y, int64_t ldy);
// Of m rows of x [m, k], how many linear_silu_to computes in one pass (size a multiple of kBlock, K even,
// and enough rows for the family's fused pass); the others go through linear_to then silu_mul_rows. The same
// bits either way.
int64_t silu_fused_rows(int64_t m, int64_t k, int64_t size);
// out [m, size] (rows ld_out apart) = silu_mul(x @ W^T + bias) for a gate_up W of N = 2 * size (gate first)
// and x [m, 2 * pairs] contiguous. scratch: room for the [m - silu_fused_rows, 2 * size] products of the rows
// not fused.
void linear_silu_to(const c10::BFloat16* x, int64_t m, const c10::BFloat16* w, int64_t pairs, int64_t size,
                    const c10::BFloat16* bias, c10::BFloat16* out, int64_t ld_out, c10::BFloat16* scratch);
// A linear layer's bias for N = n: contiguous [n] of the weight's dtype; `what` starts the message.
void check_linear_bias(const c10::optional<at::Tensor>& bias, int64_t n, const char* what, bool f32 = false);

// The families' entry points (see above), each in the builds that have it.
// tile_order: the sums in the order of AMX's tiles (see amx_tile_order), for up to 8 rows and K in whole
// tiles.
void linear_bf16dot(const c10::BFloat16* x, int64_t ldx, int64_t m, const c10::BFloat16* w, int64_t pairs,
                    int64_t n, const c10::BFloat16* bias, c10::BFloat16* y, int64_t ldy, bool tile_order);
void linear_silu_bf16dot(const c10::BFloat16* x, int64_t ldx, int64_t m, const c10::BFloat16* w,
                         int64_t pairs, int64_t size, const c10::BFloat16* bias, c10::BFloat16* out,
                         int64_t ld_out);
int64_t bf16dot_silu_rows(int64_t m);
bool use_amx(int64_t m, int64_t pairs);
// Batch-invariant, whether the few rows of a weight of `pairs` K pairs that AMX takes for many rows go to
// linear_bf16dot in the tiles' order: where this CPU's tiles round as that order says (ops.h
// tiles_sum_in_chains, probed once a process; else AMX takes every row count).
bool amx_tile_order(int64_t pairs);
void linear_amx(const c10::BFloat16* x, int64_t ldx, int64_t m, const c10::BFloat16* w, int64_t pairs,
                int64_t n, const c10::BFloat16* bias, c10::BFloat16* y, int64_t ldy);
void linear_silu_amx(const c10::BFloat16* x, int64_t ldx, int64_t m, const c10::BFloat16* w, int64_t pairs,
                     int64_t size, const c10::BFloat16* bias, c10::BFloat16* out, int64_t ld_out);
void linear_widen(const c10::BFloat16* x, int64_t ldx, int64_t m, const c10::BFloat16* w, int64_t pairs,
                  int64_t n, const c10::BFloat16* bias, c10::BFloat16* y, int64_t ldy, bool silu);
int64_t widen_silu_rows(int64_t m, int64_t k);
void linear_f32(const float* x, int64_t ldx, int64_t m, const float* w, int64_t k, int64_t n,
                const float* bias, float* y, int64_t ldy);
// The sentinel of set_onednn_min_rows that restores the build's choice.
constexpr int64_t kOneDnnDefault = -2;
// Whether m rows of the dtype go to oneDNN (from onednn_min_rows on).
bool use_onednn(int64_t m, bool f32);
void linear_onednn(const c10::BFloat16* x, int64_t ldx, int64_t m, const c10::BFloat16* w, int64_t pairs,
                   int64_t n, const c10::BFloat16* bias, c10::BFloat16* y, int64_t ldy);
void linear_f32_onednn(const float* x, int64_t ldx, int64_t m, const float* w, int64_t k, int64_t n,
                       const float* bias, float* y, int64_t ldy);

#if defined(PAGEDSERVE_AVX512)
// The columns of block b that exist among n (the last block's may be fewer than 16).
inline __mmask16 block_cols(int64_t n, int64_t b) {
  return static_cast<__mmask16>((1u << std::min<int64_t>(kBlock, n - b * kBlock)) - 1);
}

// Block b's bias (its columns in cols) in float32, added before the one rounding (as oneDNN and F.linear
// do); zero without a bias.
inline __m512 bias_block(const c10::BFloat16* bias, int64_t b, __mmask16 cols) {
  return bias == nullptr ? _mm512_setzero_ps()
                         : _mm512_castsi512_ps(_mm512_slli_epi32(
                               _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(cols, bias + b * kBlock)), 16));
}

// silu(gate) * up of a block's 16 bf16 values, rounded as silu_mul_rows rounds.
inline void silu_mul_block(c10::BFloat16* out, const c10::BFloat16* gate, const c10::BFloat16* up) {
  vec::store(out, silu_mul<c10::BFloat16>(vec::load(gate), vec::load(up)));
}
#endif

}  // namespace pagedserve::cpu
