// A continuation chunk's query rows for the kernels over the packed past (past_chunk.cu,
// past_chunk_sm90.cu): a block's rows of one KV head, rotated into the MSE keys' domain.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>

#include "split_common.cuh"

namespace turboquant::cuda::detail {

// Whether Q's rows may be read as 16-byte vectors (load_rotated_queries' q_vectors).
inline bool query_vectors(const AttentionParams& p, const void* q) {
  return (reinterpret_cast<uintptr_t>(q) & 15) == 0 && p.q.b % 8 == 0 && p.q.h % 8 == 0 && p.q.s % 8 == 0;
}
// The chunk kernels' grid: the rows' blocks, the splits, the (b, KV head) pairs.
inline dim3 chunk_grid(const AttentionParams& p, const Layout& l) {
  return dim3(static_cast<unsigned>(l.row_blocks), static_cast<unsigned>(l.splits), static_cast<unsigned>(p.batch * p.kv_heads));
}

// Rows r0 .. r0 + rows of (b, hkv) into a 16-bit tile in shared memory (16-byte chunk c of row r at
// tile + offset(r, c), the kernel's swizzle): row r is head hkv * group + r % group at position
// r / group, zeros past l.rows; then rotated in place, q H / sqrt(D), a warp per row (lane: kE
// consecutive elements; the butterflies below kE in registers, the others across lanes, in
// codec::fwht_inplace's order). q_vectors: Q's rows may be read as 16-byte vectors. The block's
// kThreads threads all take part; the caller syncs after.
template <int D, int kThreads, typename T, typename Offset>
__device__ __forceinline__ void load_rotated_queries(uint8_t* tile, const Offset& offset, const AttentionParams& p,
                                                     const Layout& l, const T* q, int64_t b, int64_t hkv, int64_t r0,
                                                     int rows, bool q_vectors) {
  const int tid = threadIdx.x, lane = tid % 32;
  for (int i = tid; i < rows * (D / 8); i += kThreads) {
    const int r = i / (D / 8), c = i % (D / 8);
    const int64_t row = r0 + r, pos = row / l.group, hq = hkv * l.group + row % l.group;
    uint4 w = make_uint4(0, 0, 0, 0);
    if (row < l.rows) {
      const T* src = q + b * p.q.b + hq * p.q.h + pos * p.q.s + c * 8;
      if (q_vectors) {
        w = *reinterpret_cast<const uint4*>(src);
      } else {
        T e[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) e[u] = src[u];
        memcpy(&w, e, 16);
      }
    }
    *reinterpret_cast<uint4*>(tile + offset(r, c)) = w;
  }
  __syncthreads();
  constexpr int kE = D / 32;
  for (int r = tid / 32; r < rows; r += kThreads / 32) {
    T* at = reinterpret_cast<T*>(tile + offset(r, lane * kE / 8) + (lane * kE % 8) * 2);
    float x[kE];
#pragma unroll
    for (int u = 0; u < kE; ++u) x[u] = static_cast<float>(at[u]);
#pragma unroll
    for (int h = 1; h < kE; h <<= 1) {
#pragma unroll
      for (int u = 0; u < kE; ++u) {
        if ((u & h) == 0) {
          const float a = x[u], c = x[u + h];
          x[u] = a + c;
          x[u + h] = a - c;
        }
      }
    }
#pragma unroll
    for (int h = kE; h < D; h <<= 1) {
      const int mask = h / kE;
#pragma unroll
      for (int u = 0; u < kE; ++u) {
        const float other = __shfl_xor_sync(0xffffffffu, x[u], mask);
        x[u] = (lane & mask) ? other - x[u] : x[u] + other;
      }
    }
    constexpr float kNorm = D == 128 ? 0.08838834764831845f : 0.125f;  // 1 / sqrt(D)
#pragma unroll
    for (int u = 0; u < kE; ++u) at[u] = static_cast<T>(x[u] * kNorm);
  }
}

}  // namespace turboquant::cuda::detail
