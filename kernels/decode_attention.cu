// Paged decode attention: one query token per sequence against its whole paged context.
//
// Decode is memory-bound: every K/V byte of the context is read once per step and used for a handful of
// FLOPs, so the kernel is built around reading the cache at full bandwidth:
//  * One CTA per (kv head [or a group of up to GMAX query heads of it], sequence, split). All query heads that
//    share a kv head (GQA) are computed against each K/V vector while it is in registers, so each K/V byte is
//    read from memory exactly once per step.
//  * K/V are read only as 16-byte vectors (uint4), GS lanes per token row so that a warp reads whole 32-byte
//    sectors; a warp issues all the loads of a work item (K and V) before using any of them, so every SM has
//    many KB in flight.
//  * Softmax is online (running max / sum per warp) in float32, merged across warps in shared memory, and for
//    the split-K variant across CTAs by merge_splits_kernel with a log-sum-exp weighting.
//  * A token at or past context_len is never loaded: its vector is zero and its score -inf, so the unused
//    part of the last block (any bytes at all, NaN included) cannot reach the result.
#include "common.cuh"

#define DECODE_WARPS 4

// Compile-time work decomposition for one (dtype, head size, block size, heads per CTA).
template <typename DT, int D, int BS, int GMAX>
struct DecodeShape {
  static constexpr int VEC = DT::VEC;                         // elements per 16-byte vector
  static constexpr int NV = D / VEC;                          // vectors per token row of one head
  static constexpr int GS = ps_min(PS_WARP, ps_next_pow2(NV));  // lanes that share one token row
  static constexpr int TPP = PS_WARP / GS;                    // tokens a warp covers per pass
  static constexpr int VPL = (NV + GS - 1) / GS;              // vectors per lane per token row
  // Passes per work item: as many as keep the K and V registers of one item at <= 8 vectors each (4 when the
  // CTA also holds 8 query heads' accumulators), and never more than one KV block.
  static constexpr int NP = ps_max(1, ps_min(BS / TPP, (GMAX >= 8 ? 4 : 8) / VPL));
  static constexpr int CHUNK = NP * TPP;  // tokens per work item
  static constexpr int CPB = BS / CHUNK;  // work items per KV block

  static_assert(D % VEC == 0, "head size must be a multiple of 16 bytes");
  static_assert(is_pow2<BS>::value && BS % CHUNK == 0, "block size must be a power of two >= one chunk");
};

// Grid: x = kv head * ceil(G / GMAX) (query-head subgroup), y = sequence, z = split.
// num_splits == gridDim.z. With one split the CTA writes `out` directly; with more it writes its normalised
// partial output and log-sum-exp, merged afterwards by merge_splits_kernel.
// Kernel parameters (shared by the implementation and its extern "C" entry points).
#define PS_DECODE_PARAMS(T)                                                                                      \
  T *__restrict__ out,                /* [B, Hq, D]            (1 split)   */                                    \
      float *__restrict__ part_out,   /* [B, Hq, splits, D]    (> 1 split) */                                    \
      float *__restrict__ part_lse,   /* [B, Hq, splits]       (> 1 split) */                                    \
      const T *__restrict__ q,        /* [B, Hq, D]                        */                                    \
      const T *__restrict__ k_cache,  /* [blocks, BS, Hkv, D]              */                                    \
      const T *__restrict__ v_cache,  /* [blocks, BS, Hkv, D]              */                                    \
      const int *__restrict__ block_tables, /* [B, max_blocks]             */                                    \
      const int *__restrict__ context_lens, /* [B]                         */                                    \
      float scale, int num_q_heads, int num_kv_heads, int max_blocks,                                            \
      int blocks_per_split /* KV blocks per split (>= all blocks when there is one split) */
#define PS_DECODE_ARGS                                                                                           \
  out, part_out, part_lse, q, k_cache, v_cache, block_tables, context_lens, scale, num_q_heads, num_kv_heads,   \
      max_blocks, blocks_per_split

template <typename DT, int D, int BS, int GMAX>
__device__ __forceinline__ void paged_decode_impl(PS_DECODE_PARAMS(typename DT::storage)) {
  using S = DecodeShape<DT, D, BS, GMAX>;
  using T = typename DT::storage;
  constexpr int W = DECODE_WARPS;

  const int G = num_q_heads / num_kv_heads;
  const int n_sub = (G + GMAX - 1) / GMAX;
  const int kvh = blockIdx.x / n_sub;
  const int sub = blockIdx.x % n_sub;
  const int head0 = kvh * G + sub * GMAX;     // first query head of this CTA
  const int gcount = min(GMAX, G - sub * GMAX);  // query heads of this CTA (<= GMAX)
  const int b = blockIdx.y;
  const int split = blockIdx.z;
  const int num_splits = gridDim.z;
  const int warp = threadIdx.x / PS_WARP;
  const int lane = threadIdx.x % PS_WARP;
  const int gl = lane % S::GS;  // lane's place within its token row
  const int tg = lane / S::GS;  // which token of a pass this lane covers

  const int ctx = context_lens[b];
  const int nblk = (ctx + BS - 1) / BS;
  const int blk_begin = split * blocks_per_split;
  const int blk_end = min(nblk, blk_begin + blocks_per_split);

  __shared__ float s_m[W][GMAX];
  __shared__ float s_l[W][GMAX];
  __shared__ float s_acc[W][GMAX][D];

  if (blk_begin >= blk_end) {
    // Nothing to attend to in this split (the sequence is shorter than the split's range): an empty partial
    // (lse = -inf) weighs nothing in the merge. With one split this is only reachable for context_len 0.
    for (int i = threadIdx.x; i < gcount * D; i += blockDim.x) {
      const size_t row = (size_t)b * num_q_heads + head0 + i / D;
      if (num_splits == 1) {
        out[row * D + i % D] = DT::from_float(0.f);
      } else {
        part_out[(row * num_splits + split) * D + i % D] = 0.f;
        if (i % D == 0) part_lse[row * num_splits + split] = PS_NEG_INF;
      }
    }
    return;
  }

  // The lane's slice of every query head of the group, pre-multiplied by the softmax scale.
  float qr[GMAX][S::VPL][S::VEC];
#pragma unroll
  for (int g = 0; g < GMAX; ++g) {
#pragma unroll
    for (int j = 0; j < S::VPL; ++j) {
      const int v = j * S::GS + gl;
      if (g < gcount && v < S::NV) {
        DT::unpack(ps_ldg16(q + ((size_t)b * num_q_heads + head0 + g) * D + v * S::VEC), qr[g][j]);
#pragma unroll
        for (int e = 0; e < S::VEC; ++e) qr[g][j][e] *= scale;
      } else {
#pragma unroll
        for (int e = 0; e < S::VEC; ++e) qr[g][j][e] = 0.f;
      }
    }
  }

  // Per-warp online-softmax state. m is warp-uniform; l and acc hold this lane's token group's share and
  // are summed over token groups at the end.
  float m[GMAX], l[GMAX], acc[GMAX][S::VPL][S::VEC];
#pragma unroll
  for (int g = 0; g < GMAX; ++g) {
    m[g] = PS_NEG_INF;
    l[g] = 0.f;
#pragma unroll
    for (int j = 0; j < S::VPL; ++j)
#pragma unroll
      for (int e = 0; e < S::VEC; ++e) acc[g][j][e] = 0.f;
  }

  const size_t row_stride = (size_t)num_kv_heads * D;  // elements between consecutive tokens in the cache
  const size_t blk_stride = row_stride * BS;
  const T* k_head = k_cache + (size_t)kvh * D;
  const T* v_head = v_cache + (size_t)kvh * D;
  const int* table = block_tables + (size_t)b * max_blocks;
  const int n_items = (blk_end - blk_begin) * S::CPB;

  for (int it = warp; it < n_items; it += W) {
    const int kvb = blk_begin + it / S::CPB;  // logical block index within the sequence
    const int tok0 = (it % S::CPB) * S::CHUNK;
    if (kvb * BS + tok0 >= ctx) continue;  // whole chunk past the end of the context (warp-uniform)
    const size_t phys = (size_t)table[kvb];
    const T* k_blk = k_head + phys * blk_stride;
    const T* v_blk = v_head + phys * blk_stride;

    // Issue every load of the item first (memory-level parallelism), masked tokens read nothing.
    uint4 kr[S::NP][S::VPL], vr[S::NP][S::VPL];
    bool valid[S::NP];
#pragma unroll
    for (int p = 0; p < S::NP; ++p) {
      const int tib = tok0 + p * S::TPP + tg;
      valid[p] = kvb * BS + tib < ctx;
#pragma unroll
      for (int j = 0; j < S::VPL; ++j) {
        const int v = j * S::GS + gl;
        const size_t off = (size_t)tib * row_stride + v * S::VEC;
        const bool ok = valid[p] && v < S::NV;
        kr[p][j] = ok ? ps_ldg16(k_blk + off) : ps_zero4();
        vr[p][j] = ok ? ps_ldg16(v_blk + off) : ps_zero4();
      }
    }

    // Scores q·k for each pass and head, reduced over the GS lanes of the token row.
    float s[GMAX][S::NP];
#pragma unroll
    for (int p = 0; p < S::NP; ++p) {
      float dot[GMAX];
#pragma unroll
      for (int g = 0; g < GMAX; ++g) dot[g] = 0.f;
#pragma unroll
      for (int j = 0; j < S::VPL; ++j) {
        float kf[S::VEC];
        DT::unpack(kr[p][j], kf);
#pragma unroll
        for (int g = 0; g < GMAX; ++g)
#pragma unroll
          for (int e = 0; e < S::VEC; ++e) dot[g] = fmaf(qr[g][j][e], kf[e], dot[g]);
      }
#pragma unroll
      for (int g = 0; g < GMAX; ++g) {
#pragma unroll
        for (int off = S::GS / 2; off > 0; off /= 2) dot[g] += __shfl_xor_sync(0xffffffffu, dot[g], off);
        s[g][p] = valid[p] ? dot[g] : PS_NEG_INF;
      }
    }

    // Online softmax update. The chunk's first token is valid, so the new max is finite.
#pragma unroll
    for (int g = 0; g < GMAX; ++g) {
      float mx = s[g][0];
#pragma unroll
      for (int p = 1; p < S::NP; ++p) mx = fmaxf(mx, s[g][p]);
#pragma unroll
      for (int off = S::GS; off < PS_WARP; off *= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
      const float m_new = fmaxf(m[g], mx);
      const float alpha = expf(m[g] - m_new);  // 0 on the first chunk (m = -inf)
      m[g] = m_new;
      l[g] *= alpha;
#pragma unroll
      for (int j = 0; j < S::VPL; ++j)
#pragma unroll
        for (int e = 0; e < S::VEC; ++e) acc[g][j][e] *= alpha;
#pragma unroll
      for (int p = 0; p < S::NP; ++p) {
        s[g][p] = expf(s[g][p] - m_new);  // masked: exp(-inf) = 0
        l[g] += s[g][p];
      }
    }

    // acc += p · v
#pragma unroll
    for (int p = 0; p < S::NP; ++p) {
#pragma unroll
      for (int j = 0; j < S::VPL; ++j) {
        float vf[S::VEC];
        DT::unpack(vr[p][j], vf);
#pragma unroll
        for (int g = 0; g < GMAX; ++g)
#pragma unroll
          for (int e = 0; e < S::VEC; ++e) acc[g][j][e] = fmaf(s[g][p], vf[e], acc[g][j][e]);
      }
    }
  }

  // Sum the token groups of the warp: lanes with the same gl hold the same dims.
#pragma unroll
  for (int g = 0; g < GMAX; ++g) {
#pragma unroll
    for (int off = S::GS; off < PS_WARP; off *= 2) {
      l[g] += __shfl_xor_sync(0xffffffffu, l[g], off);
#pragma unroll
      for (int j = 0; j < S::VPL; ++j)
#pragma unroll
        for (int e = 0; e < S::VEC; ++e) acc[g][j][e] += __shfl_xor_sync(0xffffffffu, acc[g][j][e], off);
    }
  }
  if (lane < S::GS) {
#pragma unroll
    for (int g = 0; g < GMAX; ++g) {
#pragma unroll
      for (int j = 0; j < S::VPL; ++j) {
        const int v = j * S::GS + lane;
        if (v < S::NV) {
#pragma unroll
          for (int e = 0; e < S::VEC; ++e) s_acc[warp][g][v * S::VEC + e] = acc[g][j][e];
        }
      }
      if (lane == 0) {
        s_m[warp][g] = m[g];
        s_l[warp][g] = l[g];
      }
    }
  }
  __syncthreads();

  // Merge the warps (each saw a disjoint subset of the split's tokens).
  for (int i = threadIdx.x; i < gcount * D; i += blockDim.x) {
    const int g = i / D;
    const int d = i % D;
    float M = PS_NEG_INF;
#pragma unroll
    for (int w = 0; w < W; ++w) M = fmaxf(M, s_m[w][g]);
    float L = 0.f, o = 0.f;
#pragma unroll
    for (int w = 0; w < W; ++w) {
      const float f = expf(s_m[w][g] - M);  // warps that saw nothing have m = -inf: weight 0
      L += s_l[w][g] * f;
      o += s_acc[w][g][d] * f;
    }
    const size_t row = (size_t)b * num_q_heads + head0 + g;
    if (num_splits == 1) {
      out[row * D + d] = DT::from_float(o / L);
    } else {
      part_out[(row * num_splits + split) * D + d] = o / L;
      if (d == 0) part_lse[row * num_splits + split] = M + logf(L);
    }
  }
}

// Combines the splits of each (sequence, query head): out = sum_s exp(lse_s - LSE) * out_s.
// Grid: x = B * Hq rows.
template <typename DT>
__device__ __forceinline__ void merge_splits_impl(typename DT::storage* __restrict__ out,  // [B, Hq, D]
                        const float* __restrict__ part_out,      // [B, Hq, splits, D]
                        const float* __restrict__ part_lse,      // [B, Hq, splits]
                        int num_splits, int head_dim) {
  const size_t row = blockIdx.x;
  const float* lse = part_lse + row * num_splits;
  float M = PS_NEG_INF;
  for (int s = 0; s < num_splits; ++s) M = fmaxf(M, lse[s]);
  float total = 0.f;
  if (M != PS_NEG_INF)
    for (int s = 0; s < num_splits; ++s) total += expf(lse[s] - M);
  for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
    float o = 0.f;
    if (total > 0.f) {
      for (int s = 0; s < num_splits; ++s) o += expf(lse[s] - M) * part_out[(row * num_splits + s) * head_dim + d];
      o /= total;
    }
    out[row * head_dim + d] = DT::from_float(o);
  }
}

// Entry points: the loader appends one line per instantiation it needs, e.g.
//   PS_DECODE_KERNEL(paged_decode_bf16_d128_b16_g4, bf16, 128, 16, 4)
// extern "C" names (no C++ mangling) let CuPy fetch them by name and cache the binary on disk.
#define PS_DECODE_KERNEL(NAME, DT, D, BS, GMAX)                                                                  \
  extern "C" __global__ void __launch_bounds__(DECODE_WARPS * PS_WARP) NAME(PS_DECODE_PARAMS(DT::storage)) {     \
    paged_decode_impl<DT, D, BS, GMAX>(PS_DECODE_ARGS);                                                          \
  }

#define PS_MERGE_KERNEL(NAME, DT)                                                                                \
  extern "C" __global__ void __launch_bounds__(128)                                                              \
      NAME(DT::storage* out, const float* part_out, const float* part_lse, int num_splits, int head_dim) {       \
    merge_splits_impl<DT>(out, part_out, part_lse, num_splits, head_dim);                                        \
  }
