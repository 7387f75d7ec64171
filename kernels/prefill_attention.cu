// Attention of a prefill chunk (varlen batch) over each sequence's paged context plus its own new tokens.
//
// Sequence s owns query rows query_start_loc[s] .. query_start_loc[s+1]-1: its LAST q_len tokens, at
// positions context_len - q_len .. context_len - 1, already written into the cache. Causal: the query at
// position p attends to positions 0..p.
//
// Flash-attention style, SIMT float32 (correctness first; a tensor-core variant is future work):
//  * One CTA per (tile of PREFILL_ROWS query rows of one sequence, kv head). A "row" is a (token, query head)
//    pair of the kv head's GQA group, so all query heads sharing a kv head reuse each K/V tile from shared
//    memory. A CTA's rows never cross a sequence: tiles are numbered per sequence (tile_offsets, a prefix sum
//    computed by the loader on the device, so launching needs no host synchronisation) and CTAs past the
//    last tile exit.
//  * KV tiles of PREFILL_BK = 32 keys are gathered through the block table into shared memory as float
//    (16-byte loads); keys at or past the CTA's causal end are never loaded (zero in shared memory) and are
//    masked per row, so the unused part of a block is never read.
//  * Scores: lane j owns key j of the tile and computes full dot products (no shuffles); the softmax is online
//    in float32 per row; P·V: lane owns dims lane, lane+32, ...
#include "common.cuh"

#define PREFILL_WARPS 4
#define PREFILL_ROWS_PER_WARP 4
#define PREFILL_ROWS (PREFILL_WARPS * PREFILL_ROWS_PER_WARP)
#define PREFILL_BK 32

// Dynamic shared memory in bytes for head size D (the loader computes the same number).
__host__ __device__ constexpr int prefill_smem_bytes(int D) {
  return (PREFILL_ROWS * D + 2 * PREFILL_BK * (D + 1)) * (int)sizeof(float);
}

// Grid: x = tile (upper bound: sum over sequences of ceil(q_len * G / ROWS) <= ceil(T * G / ROWS) + S),
// y = kv head. Block: PREFILL_WARPS warps.
#define PS_PREFILL_PARAMS(T)                                                                                     \
  T *__restrict__ out,                     /* [T, Hq, D]           */                                            \
      const T *__restrict__ q,             /* [T, Hq, D]           */                                            \
      const T *__restrict__ k_cache,       /* [blocks, BS, Hkv, D] */                                            \
      const T *__restrict__ v_cache,       /* [blocks, BS, Hkv, D] */                                            \
      const int *__restrict__ block_tables,    /* [S, max_blocks]  */                                            \
      const int *__restrict__ query_start_loc, /* [S + 1]          */                                            \
      const int *__restrict__ context_lens,    /* [S]              */                                            \
      const int *__restrict__ tile_offsets,    /* [S + 1] first tile of each sequence */                         \
      int num_seqs, float scale, int num_q_heads, int num_kv_heads, int max_blocks
#define PS_PREFILL_ARGS                                                                                          \
  out, q, k_cache, v_cache, block_tables, query_start_loc, context_lens, tile_offsets, num_seqs, scale,          \
      num_q_heads, num_kv_heads, max_blocks

template <typename DT, int D, int BS>
__device__ __forceinline__ void paged_prefill_impl(PS_PREFILL_PARAMS(typename DT::storage)) {
  using T = typename DT::storage;
  constexpr int VEC = DT::VEC;
  constexpr int NV = D / VEC;
  constexpr int DP = D + 1;                       // padded row: lane j reading k_s[j][d] hits distinct banks
  constexpr int NDL = (D + PS_WARP - 1) / PS_WARP;  // dims per lane in P·V
  constexpr int RPW = PREFILL_ROWS_PER_WARP;
  static_assert(D % VEC == 0, "head size must be a multiple of 16 bytes");

  extern __shared__ float smem[];
  float* q_s = smem;                          // [ROWS][D], pre-scaled
  float* k_s = q_s + PREFILL_ROWS * D;        // [BK][DP]
  float* v_s = k_s + PREFILL_BK * DP;         // [BK][DP]

  // Which sequence and which of its tiles: binary search over tile_offsets (uniform across the CTA).
  const int tile = blockIdx.x;
  if (tile >= tile_offsets[num_seqs]) return;
  int lo = 0, hi = num_seqs - 1;
  while (lo < hi) {  // largest s with tile_offsets[s] <= tile
    const int mid = (lo + hi + 1) / 2;
    if (tile_offsets[mid] <= tile) lo = mid; else hi = mid - 1;
  }
  const int s = lo;
  const int local_tile = tile - tile_offsets[s];

  const int kvh = blockIdx.y;
  const int G = num_q_heads / num_kv_heads;
  const int q_begin = query_start_loc[s];
  const int q_len = query_start_loc[s + 1] - q_begin;
  const int ctx = context_lens[s];
  const int first_pos = ctx - q_len;  // position of the sequence's first query token
  const int row0 = local_tile * PREFILL_ROWS;
  const int n_rows = min(PREFILL_ROWS, q_len * G - row0);
  // The CTA's last query token bounds the keys any of its rows may see.
  const int kv_end = first_pos + (row0 + n_rows - 1) / G + 1;
  const int* table = block_tables + (size_t)s * max_blocks;
  const size_t row_stride = (size_t)num_kv_heads * D;

  const int warp = threadIdx.x / PS_WARP;
  const int lane = threadIdx.x % PS_WARP;

  for (int i = threadIdx.x; i < PREFILL_ROWS * D; i += blockDim.x) {
    const int r = i / D;
    float x = 0.f;
    if (r < n_rows) {
      const int gr = row0 + r;
      const size_t qrow = (size_t)(q_begin + gr / G) * num_q_heads + kvh * G + gr % G;
      x = DT::to_float(q[qrow * D + i % D]) * scale;
    }
    q_s[i] = x;
  }

  float m[RPW], l[RPW], acc[RPW][NDL];
  int pos[RPW];  // query position of each of the warp's rows (-1: no row)
#pragma unroll
  for (int rr = 0; rr < RPW; ++rr) {
    const int r = warp * RPW + rr;
    pos[rr] = r < n_rows ? first_pos + (row0 + r) / G : -1;
    m[rr] = PS_NEG_INF;
    l[rr] = 0.f;
#pragma unroll
    for (int i = 0; i < NDL; ++i) acc[rr][i] = 0.f;
  }

  for (int kt0 = 0; kt0 < kv_end; kt0 += PREFILL_BK) {
    __syncthreads();  // previous tile fully consumed (and q_s written, on the first pass)
    for (int i = threadIdx.x; i < PREFILL_BK * NV; i += blockDim.x) {
      const int j = i / NV;
      const int v = i % NV;
      const int key = kt0 + j;
      float kf[VEC], vf[VEC];
      if (key < kv_end) {
        const size_t off = ((size_t)table[key / BS] * BS + key % BS) * row_stride + (size_t)kvh * D + v * VEC;
        DT::unpack(ps_ldg16(k_cache + off), kf);
        DT::unpack(ps_ldg16(v_cache + off), vf);
      } else {
#pragma unroll
        for (int e = 0; e < VEC; ++e) kf[e] = vf[e] = 0.f;
      }
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        k_s[j * DP + v * VEC + e] = kf[e];
        v_s[j * DP + v * VEC + e] = vf[e];
      }
    }
    __syncthreads();

    // Scores of key (kt0 + lane) for all rows of the warp, sharing each k_s read across rows.
    float sc[RPW];
#pragma unroll
    for (int rr = 0; rr < RPW; ++rr) sc[rr] = 0.f;
    const float* q_w = q_s + warp * RPW * D;
#pragma unroll 8
    for (int d = 0; d < D; ++d) {
      const float kd = k_s[lane * DP + d];
#pragma unroll
      for (int rr = 0; rr < RPW; ++rr) sc[rr] = fmaf(q_w[rr * D + d], kd, sc[rr]);
    }

    const int key = kt0 + lane;
#pragma unroll
    for (int rr = 0; rr < RPW; ++rr) {
      if (pos[rr] < kt0) continue;  // no row, or every key of the tile is in this row's future (warp-uniform)
      const float sv = key <= pos[rr] ? sc[rr] : PS_NEG_INF;
      float mx = sv;
#pragma unroll
      for (int off = PS_WARP / 2; off > 0; off /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
      const float m_new = fmaxf(m[rr], mx);  // finite: key kt0 <= pos is valid
      const float alpha = expf(m[rr] - m_new);
      const float p = expf(sv - m_new);
      float psum = p;
#pragma unroll
      for (int off = PS_WARP / 2; off > 0; off /= 2) psum += __shfl_xor_sync(0xffffffffu, psum, off);
      m[rr] = m_new;
      l[rr] = l[rr] * alpha + psum;
#pragma unroll
      for (int i = 0; i < NDL; ++i) acc[rr][i] *= alpha;
      const int n_keys = min(PREFILL_BK, pos[rr] - kt0 + 1);
      for (int j = 0; j < n_keys; ++j) {
        const float pj = __shfl_sync(0xffffffffu, p, j);
#pragma unroll
        for (int i = 0; i < NDL; ++i) {
          const int d = lane + i * PS_WARP;
          if (d < D) acc[rr][i] = fmaf(pj, v_s[j * DP + d], acc[rr][i]);
        }
      }
    }
  }

#pragma unroll
  for (int rr = 0; rr < RPW; ++rr) {
    if (pos[rr] < 0) continue;
    const int gr = row0 + warp * RPW + rr;
    const size_t orow = (size_t)(q_begin + gr / G) * num_q_heads + kvh * G + gr % G;
    const float inv = 1.f / l[rr];
#pragma unroll
    for (int i = 0; i < NDL; ++i) {
      const int d = lane + i * PS_WARP;
      if (d < D) out[orow * D + d] = DT::from_float(acc[rr][i] * inv);
    }
  }
}

// Entry points: the loader appends one line per instantiation it needs, e.g.
//   PS_PREFILL_KERNEL(paged_prefill_bf16_d128_b16, bf16, 128, 16)
#define PS_PREFILL_KERNEL(NAME, DT, D, BS)                                                                       \
  extern "C" __global__ void __launch_bounds__(PREFILL_WARPS * PS_WARP) NAME(PS_PREFILL_PARAMS(DT::storage)) {   \
    paged_prefill_impl<DT, D, BS>(PS_PREFILL_ARGS);                                                              \
  }
