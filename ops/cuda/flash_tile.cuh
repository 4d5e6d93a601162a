// The flash-attention tile steps that the many-row kernels share (prefill.cu: the new tokens'
// attention; past_chunk.cu: a chunk's rows over the packed past): 4 warps, each owning kMt m-tiles
// of 16 query rows, against tiles of kKeys keys in swizzled shared memory; scores and P.V on tensor
// cores (mma.sync m16n8k16, fp32 accumulators) and an online softmax in registers.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "ptx.cuh"

namespace turboquant::cuda::detail::flash {

constexpr int kWarps = 4;
constexpr int kKeys = 64;  // keys per tile

template <typename T>
struct Mma;
template <>
struct Mma<__half> {
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) { return pack_half2(lo, hi); }
  static __device__ __forceinline__ void run(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
    mma16816_f16(c, a, b0, b1);
  }
};
template <>
struct Mma<__nv_bfloat16> {
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) { return pack_bf162(lo, hi); }
  static __device__ __forceinline__ void run(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
    mma16816_bf16(c, a, b0, b1);
  }
};

// Byte offset of 16-byte chunk c of row r in a tile of D-element rows: chunks XOR-swizzled by the
// row so that the 8 rows an ldmatrix phase reads fall in 8 different bank groups.
template <int D>
__device__ __forceinline__ uint32_t tile_offset(int r, int c) {
  return static_cast<uint32_t>((r * (D / 8) + (c ^ (r & 7))) * 16);
}

// rows x D elements from g (row r at g + r * stride) into the tile at smem; rows at or past `valid`
// are zero-filled.
template <int D, typename T>
__device__ __forceinline__ void load_tile(uint32_t smem, const T* g, int64_t stride, int rows, int valid) {
  constexpr int kChunks = D / 8;
  for (int i = threadIdx.x; i < rows * kChunks; i += kWarps * 32) {
    const int r = i / kChunks, c = i % kChunks;
    const bool on = r < valid;
    cp_async16(smem + tile_offset<D>(r, c), on ? g + r * stride + c * 8 : g, on ? 16 : 0);
  }
}

// Lane element (mt, nt, e) of a score tile: its key's column in the tile and its row's offset in
// the warp's rows.
__device__ __forceinline__ int key_of(int nt, int e, int lane) { return nt * 8 + (lane % 4) * 2 + (e & 1); }
__device__ __forceinline__ int row_of(int mt, int e, int lane) { return mt * 16 + lane / 4 + (e >> 1) * 8; }

// s[mt] = Q (rows warp_row + mt * 16 ..) . K (the tile at kt)^T: Q fragments from registers (qf) when
// kQInRegisters, else from the Q tile at q_at.
template <int D, int kMt, bool kQInRegisters, typename T>
__device__ __forceinline__ void scores(float (&s)[kMt][kKeys / 8][4], const uint32_t (&qf)[kQInRegisters ? D / 16 : 1][4],
                                       uint32_t q_at, uint32_t kt, int warp_row, int lane) {
#pragma unroll
  for (int mt = 0; mt < kMt; ++mt) {
#pragma unroll
    for (int nt = 0; nt < kKeys / 8; ++nt) s[mt][nt][0] = s[mt][nt][1] = s[mt][nt][2] = s[mt][nt][3] = 0.0f;
  }
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks) {
    uint32_t a[kMt][4];
#pragma unroll
    for (int mt = 0; mt < kMt; ++mt) {
#pragma unroll
      for (int i = 0; i < 4; ++i) a[mt][i] = kQInRegisters ? qf[kQInRegisters ? ks : 0][i] : 0u;
      if constexpr (!kQInRegisters) ldmatrix_x4(a[mt], q_at + tile_offset<D>(warp_row + mt * 16 + lane % 16, 2 * ks + lane / 16));
    }
#pragma unroll
    for (int np = 0; np < kKeys / 16; ++np) {
      uint32_t r[4];
      ldmatrix_x4(r, kt + tile_offset<D>(np * 16 + (lane / 16) * 8 + lane % 8, 2 * ks + (lane / 8) % 2));
#pragma unroll
      for (int mt = 0; mt < kMt; ++mt) {
        Mma<T>::run(s[mt][2 * np], a[mt], r[0], r[1]);
        Mma<T>::run(s[mt][2 * np + 1], a[mt], r[2], r[3]);
      }
    }
  }
}

// The online softmax of one tile of scores s (log2 units, -inf where masked): the rows' maxima m and
// sums l updated, s turned into the tile's weights exp2(s - m), the accumulators o rescaled; alpha:
// each row's rescale factor (for accumulators the caller keeps beside o).
template <int D, int kMt>
__device__ __forceinline__ void softmax_step(float (&s)[kMt][kKeys / 8][4], float (&m)[kMt][2], float (&l)[kMt][2],
                                             float (&o)[kMt][D / 8][4], float (&alpha)[kMt][2]) {
#pragma unroll
  for (int mt = 0; mt < kMt; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float mx = m[mt][h];
#pragma unroll
      for (int nt = 0; nt < kKeys / 8; ++nt) mx = fmaxf(mx, fmaxf(s[mt][nt][2 * h], s[mt][nt][2 * h + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float base = mx == -INFINITY ? 0.0f : mx;  // a row that sees no key yet stays empty
      const float a = fast_exp2(m[mt][h] - base);
      float sum = 0.0f;
#pragma unroll
      for (int nt = 0; nt < kKeys / 8; ++nt) {
        s[mt][nt][2 * h] = fast_exp2(s[mt][nt][2 * h] - base);
        s[mt][nt][2 * h + 1] = fast_exp2(s[mt][nt][2 * h + 1] - base);
        sum += s[mt][nt][2 * h] + s[mt][nt][2 * h + 1];
      }
      l[mt][h] = l[mt][h] * a + sum;
      m[mt][h] = mx;
      alpha[mt][h] = a;
#pragma unroll
      for (int nt = 0; nt < D / 8; ++nt) {
        o[mt][nt][2 * h] *= a;
        o[mt][nt][2 * h + 1] *= a;
      }
    }
  }
}

// o += P . V (the tile at vt): the weights' registers are the A operand's layout as they are.
template <int D, int kMt, typename T>
__device__ __forceinline__ void add_values(float (&o)[kMt][D / 8][4], const float (&s)[kMt][kKeys / 8][4], uint32_t vt,
                                           int lane) {
#pragma unroll
  for (int kk = 0; kk < kKeys / 16; ++kk) {
    uint32_t a[kMt][4];
#pragma unroll
    for (int mt = 0; mt < kMt; ++mt) {
      a[mt][0] = Mma<T>::pack(s[mt][2 * kk][0], s[mt][2 * kk][1]);
      a[mt][1] = Mma<T>::pack(s[mt][2 * kk][2], s[mt][2 * kk][3]);
      a[mt][2] = Mma<T>::pack(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
      a[mt][3] = Mma<T>::pack(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
    }
#pragma unroll
    for (int np = 0; np < D / 16; ++np) {
      uint32_t r[4];
      ldmatrix_x4_trans(r, vt + tile_offset<D>(kk * 16 + lane % 8 + ((lane / 8) % 2) * 8, 2 * np + lane / 16));
#pragma unroll
      for (int mt = 0; mt < kMt; ++mt) {
        Mma<T>::run(o[mt][2 * np], a[mt], r[0], r[1]);
        Mma<T>::run(o[mt][2 * np + 1], a[mt], r[2], r[3]);
      }
    }
  }
}

// A row's sum over the 4 lanes of its quad (each holds a share of its keys' columns).
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// Row (b, hkv, r) of the split kernels' partial results [B*Hkv][rows][splits] x (max, sum, acc[D]):
// max in natural-log units (m is in log2 units), from the lanes of row_of(mt, 2h) for every column.
template <int D, int kMt>
__device__ __forceinline__ void store_partial(float* pr, const float (&o)[kMt][D / 8][4], float m, float sum, int mt,
                                              int h, int lane, float add = 0.0f) {
  if (lane % 4 == 0) pr[0] = m * 0.6931471805599453f, pr[1] = sum;
#pragma unroll
  for (int nt = 0; nt < D / 8; ++nt) {
    *reinterpret_cast<float2*>(pr + 2 + nt * 8 + (lane % 4) * 2) = make_float2(o[mt][nt][2 * h] + add, o[mt][nt][2 * h + 1] + add);
  }
}

}  // namespace turboquant::cuda::detail::flash
