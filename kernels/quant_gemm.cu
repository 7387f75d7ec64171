// Weight-only quantized linear on tensor cores: out[M, N] = x[M, K] @ W^T + bias, W held as int4 or int8
// codes with a scale and an offset per group of K (kernels/quant.py's QuantizedWeight, packed for this file by
// cuda_ops.pack_quant_weight_cuda). Marlin's ideas (IST-DASLab), written for this layout:
//
// - The codes are laid out in the order the warps consume them: for each 16 output columns (an n16 block)
//   and each chunk of K (64 k of int4, 32 k of int8), 32 lanes x 16 bytes, lane (g, t) holding exactly the
//   B fragments of mma.m16n8k16 it needs (column g of both n8 tiles, k 2t, 2t+1, 2t+8, 2t+9 of each k16 step).
//   A warp streams its n16 block along K with one coalesced 512-byte load per chunk, PIPE chunks in flight
//   in registers, read once, never through shared memory.
// - Codes become fp16 / bf16 in registers by the magic-number trick: a nibble ORed (lop3) into the mantissa
//   of 1024.0 (fp16) or 128.0 (bf16), the constant taken off by one fma; int8 bytes are permuted (prmt)
//   into the mantissa of 1024.0 (fp16) or of 2^23 in float32 (bf16, then cvt). Codes are small integers,
//   exact in either type.
// - mma.sync m16n8k16 multiplies x (fp16 or bf16, from shared memory) by the codes, float32 accumulators;
//   the group's float32 scale is applied once per group: out += scale * sum(x q) + offset * sum(x), where
//   sum(x) is one more mma against a fragment of ones. So the weights are never rounded to 16 bits.
// - x and the scales of a phase of KSTAGE k are staged in shared memory by cp.async, double-buffered.
// - Split-K over the grid's y: each CTA (4 warps, 64 output columns) takes a range of phases, so a single
//   row's decode still puts several CTAs on every SM; more than 64 rows take several CTAs along grid z, each
//   streaming the codes again (from L2 where they meet); the partial sums (float32) are added by
//   ps_quant_reduce, which also adds the bias and rounds, in a fixed order (no atomics).
//
// Prefill (many rows) dequantizes to the activation dtype (ps_quant_dequant) and leaves the product to
// cuBLAS.
#include "common.cuh"

#define PS_QG_WARPS 4
#define PS_QG_THREADS (PS_QG_WARPS * PS_WARP)
#define PS_QG_NCTA (PS_QG_WARPS * 16)  // output columns of a CTA
#define PS_QG_KSTAGE 256               // k of x (and its groups' scales) staged in shared memory at once
#define PS_QG_PIPE 4                   // 16-byte code loads in flight per lane
#define PS_QG_GSLOTS (PS_QG_KSTAGE / 16 + 1)  // groups a phase can touch (group size >= 16)

// ---- per-activation-type arithmetic -------------------------------------------------------------------

// c += a b: x's m16k16 A fragment times a k16n8 B fragment of codes (TYPE "bf16" or "f16"), float32.
#define PS_QG_MMA(TYPE, c, a, b0, b1)                                                                   \
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." TYPE "." TYPE ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, " \
               "{%8,%9}, {%0,%1,%2,%3};"                                                               \
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])                                        \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1))

template <class T>
struct qg_math;

template <>
struct qg_math<bf16> {
  static constexpr unsigned ONES = 0x3F803F80u;  // bf16x2 (1, 1)
  static __device__ __forceinline__ void mma(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    PS_QG_MMA("bf16", c, a, b0, b1);
  }
  // Nibbles at bits 0-3 and 16-19 of w -> bf16x2 (low, high) of their values 0..15.
  static __device__ __forceinline__ unsigned int4_pair(unsigned w) {
    unsigned h;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(h) : "r"(w), "r"(0x000F000Fu), "r"(0x43004300u));  // 128 + q
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(h) : "r"(h), "r"(ONES), "r"(0xC300C300u));       // - 128
    return h;
  }
  // Bytes lo, hi of w (int8 codes stored as q + 128) -> bf16x2 (q_lo, q_hi). 128 + byte does not fit bf16's
  // mantissa, so the bytes go through float32's 2^23.
  static __device__ __forceinline__ unsigned int8_pair(unsigned w, unsigned lo, unsigned hi) {
    const float f0 = __uint_as_float(__byte_perm(w, 0x4B000000u, 0x7440u | lo)) - 8388736.0f;  // 2^23 + 128
    const float f1 = __uint_as_float(__byte_perm(w, 0x4B000000u, 0x7440u | hi)) - 8388736.0f;
    unsigned h;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(h) : "f"(f1), "f"(f0));
    return h;
  }
};

template <>
struct qg_math<fp16> {
  static constexpr unsigned ONES = 0x3C003C00u;  // f16x2 (1, 1)
  static __device__ __forceinline__ void mma(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    PS_QG_MMA("f16", c, a, b0, b1);
  }
  static __device__ __forceinline__ unsigned int4_pair(unsigned w) {
    unsigned h;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(h) : "r"(w), "r"(0x000F000Fu), "r"(0x64006400u));  // 1024 + q
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(h) : "r"(h), "r"(ONES), "r"(0xE400E400u));        // - 1024
    return h;
  }
  static __device__ __forceinline__ unsigned int8_pair(unsigned w, unsigned lo, unsigned hi) {
    // bytes (lo, 0x64, hi, 0x64): f16x2 1024 + byte, exact up to 2047
    unsigned h = __byte_perm(w, 0x64646464u, 0x4040u | lo | (hi << 8));
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(h) : "r"(h), "r"(ONES), "r"(0xE480E480u));  // - 1152
    return h;
  }
};

// Scale storage: float32, or fp16 where the values are fp16 exactly (GGUF's d and m).
__device__ __forceinline__ float qg_scale(float s) { return s; }
__device__ __forceinline__ float qg_scale(unsigned short s) { return fp16::to_float(s); }

// ---- async copies -------------------------------------------------------------------------------------

// 16 bytes global -> shared; bytes past `src_bytes` (0 or 16) are zero-filled.
__device__ __forceinline__ void qg_cp_async16(void* smem, const void* gmem, int src_bytes) {
  unsigned s;  // the shared-window address (inline PTX: NVRTC need not have the intrinsic's header)
  asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(s) : "l"(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(s), "l"(gmem), "r"(src_bytes));
}
__device__ __forceinline__ void qg_cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void qg_cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N));
}

// Streaming 16-byte load: read once, kept out of L1.
__device__ __forceinline__ uint4 qg_ld_stream(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// ---- the decode GEMM ------------------------------------------------------------------------------------

template <int BITS>
struct qg_chunk {
  static constexpr int K = BITS == 4 ? 64 : 32;  // k of one 16-byte lane load
};

// Shared memory: two phases of x (ROWS x (KSTAGE + 8), the padding spreads a fragment's rows over all
// banks) and of their groups' scales and offsets (GSLOTS x 64 columns each).
template <class T, class S, int MT>
struct qg_smem {
  static constexpr int ROWS = MT * 16;
  static constexpr int XS = PS_QG_KSTAGE + 8;
  static constexpr int X_BYTES = ROWS * XS * 2;
  static constexpr int S_BYTES = PS_QG_GSLOTS * PS_QG_NCTA * (int)sizeof(S);
  static constexpr int STAGE = X_BYTES + 2 * S_BYTES;  // x, scales, offsets
  static constexpr int BYTES = 2 * STAGE;
};

template <class T, int BITS, class S, bool HAS_OFFSET, int MT>
__device__ __forceinline__ void ps_quant_gemm(
    typename T::storage* __restrict__ out,      // [M, N], written when gridDim.y == 1
    float* __restrict__ partial,                // [gridDim.y, M, n_pad], written when gridDim.y > 1
    const typename T::storage* __restrict__ x,  // [M, K], rows contiguous, 16-byte aligned; grid z: 16 MT rows
    const uint4* __restrict__ codes,            // [n_pad / 16, k_pad / CHUNK, 32] lane vectors
    const S* __restrict__ scales,               // [groups, n_pad]
    const S* __restrict__ offsets,              // [groups, n_pad] (HAS_OFFSET)
    const typename T::storage* __restrict__ bias,  // [N] or null
    int M, int N, int K, int n_pad, int k_pad, int group_size, int phases_per_split) {
  typedef typename T::storage st;
  typedef qg_smem<T, S, MT> L;
  constexpr int CHUNK = qg_chunk<BITS>::K;
  constexpr int STEPS = CHUNK / 16;
  constexpr int CHUNKS = PS_QG_KSTAGE / CHUNK;
  static_assert(CHUNKS % PS_QG_PIPE == 0, "a phase holds whole rounds of the load ring");
  constexpr int VEC = 8;  // 16-bit elements of a 16-byte copy
  extern __shared__ __align__(16) unsigned char qg_shared[];

  const int warp = threadIdx.x / PS_WARP, lane = threadIdx.x % PS_WARP;
  const int g = lane >> 2, t = lane & 3;
  const int row0 = blockIdx.z * L::ROWS;  // this CTA's rows: row0 .. row0 + rows
  const int rows = min(M - row0, L::ROWS);
  const int nblock = blockIdx.x * PS_QG_WARPS + warp;  // this warp's n16 block
  const int n_cta = blockIdx.x * PS_QG_NCTA;
  const bool active = nblock * 16 < N;
  const int groups = K / group_size;
  const int chunks_total = k_pad / CHUNK;
  const int k_begin = blockIdx.y * phases_per_split * PS_QG_KSTAGE;
  const int k_end = min(k_pad, k_begin + phases_per_split * PS_QG_KSTAGE);
  const int c_end = k_end / CHUNK;
  const int num_phases = (k_end - k_begin + PS_QG_KSTAGE - 1) / PS_QG_KSTAGE;
  const uint4* wp = codes + (size_t)nblock * chunks_total * PS_WARP + lane;

  // Stages phase `ph` (k from k_begin + ph * KSTAGE) into buffer ph & 1: x rows (zero past M and K) and the
  // scales (and offsets) of the groups it touches, for this CTA's 64 columns.
  auto stage = [&](int ph) {
    unsigned char* base = qg_shared + (ph & 1) * L::STAGE;
    st* xs = reinterpret_cast<st*>(base);
    const int p = k_begin + ph * PS_QG_KSTAGE;
    for (int i = threadIdx.x; i < L::ROWS * (PS_QG_KSTAGE / VEC); i += PS_QG_THREADS) {
      const int r = i / (PS_QG_KSTAGE / VEC), v = i % (PS_QG_KSTAGE / VEC);
      const int k = p + v * VEC;
      const bool ok = r < rows && k < K;
      qg_cp_async16(xs + r * L::XS + v * VEC, ok ? (const void*)(x + (size_t)(row0 + r) * K + k) : (const void*)x,
                    ok ? 16 : 0);
    }
    const int g_lo = min(p / group_size, groups - 1);
    const int g_n = min(groups - 1, (min(p + PS_QG_KSTAGE, K) - 1) / group_size) - g_lo + 1;
    constexpr int PER_ROW = PS_QG_NCTA * (int)sizeof(S) / 16;  // 16-byte copies per group row
    for (int part = 0; part < (HAS_OFFSET ? 2 : 1); ++part) {
      const S* src = part == 0 ? scales : offsets;
      unsigned char* dst = base + L::X_BYTES + part * L::S_BYTES;
      for (int i = threadIdx.x; i < g_n * PER_ROW; i += PS_QG_THREADS) {
        const int row = i / PER_ROW, v = i % PER_ROW;
        qg_cp_async16(dst + (row * PER_ROW + v) * 16,
                      reinterpret_cast<const unsigned char*>(src + (size_t)(g_lo + row) * n_pad + n_cta) + v * 16,
                      16);
      }
    }
    qg_cp_async_commit();
  };

  float acc[MT][2][4], part_sum[MT][2][4], xsum[MT][4];
#pragma unroll
  for (int m = 0; m < MT; ++m) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      acc[m][0][i] = acc[m][1][i] = part_sum[m][0][i] = part_sum[m][1][i] = xsum[m][i] = 0.f;
    }
  }

  // The k at which the group being summed ends for this CTA (its group's end, or the CTA's range's).
  int flush_at = min(k_end, (k_begin / group_size + 1) * group_size);

  uint4 ring[PS_QG_PIPE];
  const int c_begin = k_begin / CHUNK;
#pragma unroll
  for (int i = 0; i < PS_QG_PIPE; ++i) {
    ring[i] = active && c_begin + i < c_end ? qg_ld_stream(wp + (size_t)(c_begin + i) * PS_WARP) : ps_zero4();
  }
  stage(0);

  for (int ph = 0; ph < num_phases; ++ph) {
    if (ph + 1 < num_phases) {
      stage(ph + 1);
      qg_cp_async_wait<1>();
    } else {
      qg_cp_async_wait<0>();
    }
    __syncthreads();
    const unsigned char* base = qg_shared + (ph & 1) * L::STAGE;
    const st* xs = reinterpret_cast<const st*>(base);
    const S* ss = reinterpret_cast<const S*>(base + L::X_BYTES);
    const S* os = reinterpret_cast<const S*>(base + L::X_BYTES + L::S_BYTES);
    const int p = k_begin + ph * PS_QG_KSTAGE;
    const int g_lo = min(p / group_size, groups - 1);

#pragma unroll 1
    for (int c0 = 0; c0 < CHUNKS; c0 += PS_QG_PIPE) {
#pragma unroll
      for (int i = 0; i < PS_QG_PIPE; ++i) {
        const int c = p / CHUNK + c0 + i;
        const uint4 cur = ring[i];
        ring[i] = active && c + PS_QG_PIPE < c_end ? qg_ld_stream(wp + (size_t)(c + PS_QG_PIPE) * PS_WARP)
                                                   : ps_zero4();
        if (!active || c >= c_end) continue;
        const unsigned words[4] = {cur.x, cur.y, cur.z, cur.w};
#pragma unroll
        for (int s = 0; s < STEPS; ++s) {
          const int kk = (c0 + i) * CHUNK + s * 16;  // k within the phase
          unsigned b[2][2];
          if (BITS == 4) {
            const unsigned w = words[s];
            b[0][0] = qg_math<T>::int4_pair(w);
            b[0][1] = qg_math<T>::int4_pair(w >> 4);
            b[1][0] = qg_math<T>::int4_pair(w >> 8);
            b[1][1] = qg_math<T>::int4_pair(w >> 12);
          } else {
#pragma unroll
            for (int nt = 0; nt < 2; ++nt) {
              const unsigned w = words[2 * s + nt];
              b[nt][0] = qg_math<T>::int8_pair(w, 0, 1);
              b[nt][1] = qg_math<T>::int8_pair(w, 2, 3);
            }
          }
#pragma unroll
          for (int m = 0; m < MT; ++m) {
            const st* r0 = xs + (m * 16 + g) * L::XS + kk + 2 * t;
            const st* r1 = r0 + 8 * L::XS;
            const unsigned a[4] = {*reinterpret_cast<const unsigned*>(r0), *reinterpret_cast<const unsigned*>(r1),
                                   *reinterpret_cast<const unsigned*>(r0 + 8),
                                   *reinterpret_cast<const unsigned*>(r1 + 8)};
            qg_math<T>::mma(part_sum[m][0], a, b[0][0], b[0][1]);
            qg_math<T>::mma(part_sum[m][1], a, b[1][0], b[1][1]);
            if (HAS_OFFSET) qg_math<T>::mma(xsum[m], a, qg_math<T>::ONES, qg_math<T>::ONES);
          }
          // End of a group, or of this CTA's range (a group split between CTAs adds up linearly).
          if (p + kk + 16 == flush_at) {
            flush_at = min(k_end, flush_at + group_size);
            const int slot = min((p + kk) / group_size, groups - 1) - g_lo;
#pragma unroll
            for (int nt = 0; nt < 2; ++nt) {
              const int col = slot * PS_QG_NCTA + warp * 16 + nt * 8 + 2 * t;
              const float s0 = qg_scale(ss[col]), s1 = qg_scale(ss[col + 1]);
              const float o0 = HAS_OFFSET ? qg_scale(os[col]) : 0.f, o1 = HAS_OFFSET ? qg_scale(os[col + 1]) : 0.f;
#pragma unroll
              for (int m = 0; m < MT; ++m) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                  float v = fmaf((e & 1) ? s1 : s0, part_sum[m][nt][e], acc[m][nt][e]);
                  if (HAS_OFFSET) v = fmaf((e & 1) ? o1 : o0, xsum[m][e], v);
                  acc[m][nt][e] = v;
                  part_sum[m][nt][e] = 0.f;
                }
              }
            }
            if (HAS_OFFSET) {
#pragma unroll
              for (int m = 0; m < MT; ++m) {
#pragma unroll
                for (int e = 0; e < 4; ++e) xsum[m][e] = 0.f;
              }
            }
          }
        }
      }
    }
    __syncthreads();  // the buffer is staged again two phases on
  }

  if (!active) return;
  // C fragment: element e of tile (m, nt) is row m * 16 + g + 8 * (e >> 1), column nt * 8 + 2 t + (e & 1).
#pragma unroll
  for (int m = 0; m < MT; ++m) {
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int local = m * 16 + g + 8 * (e >> 1);
        const int row = row0 + local;
        const int col = nblock * 16 + nt * 8 + 2 * t + (e & 1);
        if (local >= rows) continue;
        if (gridDim.y == 1) {
          if (col < N) {
            const float b = bias == nullptr ? 0.f : T::to_float(bias[col]);
            out[(size_t)row * N + col] = T::from_float(acc[m][nt][e] + b);
          }
        } else {
          partial[((size_t)blockIdx.y * M + row) * n_pad + col] = acc[m][nt][e];
        }
      }
    }
  }
}

// The split-K partial sums [splits, M, n_pad] added in split order, plus the bias, rounded into out [M, N].
template <class T>
__device__ __forceinline__ void ps_quant_reduce(typename T::storage* __restrict__ out,
                                                const float* __restrict__ partial,
                                                const typename T::storage* __restrict__ bias, int M, int N,
                                                int n_pad, int splits) {
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (long long)M * N) return;
  const int row = (int)(i / N), col = (int)(i % N);
  float sum = 0.f;
  for (int s = 0; s < splits; ++s) sum += partial[((size_t)s * M + row) * n_pad + col];
  if (bias != nullptr) sum += T::to_float(bias[col]);
  out[i] = T::from_float(sum);
}

// The packed weight back to w[n, k] = scale * code + offset (float32, rounded once to T) for rows
// [n_begin, n_begin + rows) of out [rows, K]: the prefill path's weight, the same bits as kernels/quant.py's
// dequantize cast to T. One thread per 32-bit code word.
template <class T, int BITS, class S, bool HAS_OFFSET>
__device__ __forceinline__ void ps_quant_dequant(typename T::storage* __restrict__ out,
                                                 const unsigned* __restrict__ codes, const S* __restrict__ scales,
                                                 const S* __restrict__ offsets, int K, int n_pad, int k_pad,
                                                 int group_size, int n_begin, int rows) {
  constexpr int CHUNK = qg_chunk<BITS>::K;
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;  // word within the rows' blocks
  const int chunks_total = k_pad / CHUNK;
  const long long words_per_block = (long long)chunks_total * PS_WARP * 4;
  const int first_block = n_begin / 16;
  const int num_blocks = (rows + 15) / 16;
  if (i >= words_per_block * num_blocks) return;
  const int nb = first_block + (int)(i / words_per_block);
  const long long rem = i % words_per_block;
  const int chunk = (int)(rem / (PS_WARP * 4));
  const int lane = (int)(rem / 4 % PS_WARP), j = (int)(rem % 4);
  const int g = lane >> 2, t = lane & 3;
  const unsigned w = codes[(size_t)nb * words_per_block + rem];
  constexpr int PER_WORD = BITS == 4 ? 8 : 4;
#pragma unroll
  for (int e = 0; e < PER_WORD; ++e) {
    int n, k, q;
    if (BITS == 4) {  // nibble e: n tile (e >> 1) & 1, k + 8 (e & 1), k + 1 (e >> 2); step j
      n = nb * 16 + 8 * ((e >> 1) & 1) + g;
      k = chunk * CHUNK + 16 * j + 2 * t + (e >> 2) + 8 * (e & 1);
      q = (int)((w >> (4 * e)) & 0xFu);
    } else {  // word j: step j >> 1, n tile j & 1; byte e: k + 1 (e & 1), k + 8 (e >> 1)
      n = nb * 16 + 8 * (j & 1) + g;
      k = chunk * CHUNK + 16 * (j >> 1) + 2 * t + (e & 1) + 8 * (e >> 1);
      q = (int)((w >> (8 * e)) & 0xFFu) - 128;
    }
    if (n - n_begin >= rows || k >= K) continue;
    const size_t sg = (size_t)(k / group_size) * n_pad + n;
    float v = __fmul_rn(qg_scale(scales[sg]), (float)q);
    if (HAS_OFFSET) v = __fadd_rn(v, qg_scale(offsets[sg]));
    out[(size_t)(n - n_begin) * K + k] = T::from_float(v);
  }
}

#define PS_QUANT_GEMM_KERNEL(NAME, T, BITS, S, HAS_OFFSET, MT)                                              \
  extern "C" __global__ void __launch_bounds__(PS_QG_THREADS) NAME(                                        \
      T::storage* out, float* partial, const T::storage* x, const uint4* codes, const S* scales,          \
      const S* offsets, const T::storage* bias, int M, int N, int K, int n_pad, int k_pad, int group_size, \
      int phases_per_split) {                                                                              \
    ps_quant_gemm<T, BITS, S, HAS_OFFSET, MT>(out, partial, x, codes, scales, offsets, bias, M, N, K, n_pad, \
                                              k_pad, group_size, phases_per_split);                        \
  }

#define PS_QUANT_REDUCE_KERNEL(NAME, T)                                                                     \
  extern "C" __global__ void NAME(T::storage* out, const float* partial, const T::storage* bias, int M,    \
                                  int N, int n_pad, int splits) {                                          \
    ps_quant_reduce<T>(out, partial, bias, M, N, n_pad, splits);                                           \
  }

#define PS_QUANT_DEQUANT_KERNEL(NAME, T, BITS, S, HAS_OFFSET)                                               \
  extern "C" __global__ void NAME(T::storage* out, const unsigned* codes, const S* scales, const S* offsets, \
                                  int K, int n_pad, int k_pad, int group_size, int n_begin, int rows) {    \
    ps_quant_dequant<T, BITS, S, HAS_OFFSET>(out, codes, scales, offsets, K, n_pad, k_pad, group_size,    \
                                             n_begin, rows);                                                \
  }
