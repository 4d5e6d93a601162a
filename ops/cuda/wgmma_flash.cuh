// A consumer warpgroup's steps in the wgmma flash-attention kernels (prefill_sm90.cu: the new
// tokens' attention; past_chunk_sm90.cu: a chunk's rows over the packed past): 64 query rows against
// tiles of 128 keys, S = Q K^T with both operands in 128-byte-swizzled shared memory, the online
// softmax in registers, O += P V with P from registers and V read transposed (wgmma.cuh's layouts).
// Element e of n-tile nt of a thread's scores is key 8 nt + 2 (lane % 4) + (e & 1) of its row
// `row + 8 (e >> 1)`, row = 16 warp + lane / 4 of the warpgroup's; its accumulators likewise by
// column.
#pragma once

#include <cmath>

#include "flash_tile.cuh"
#include "ptx.cuh"
#include "wgmma.cuh"

namespace turboquant::cuda::detail::wgmma_flash {

constexpr int kKeys = 128;  // keys per tile (the score product's N)

// s = Q K^T: the warpgroup's 64 rows of Q at q_wg (Q's column atoms `q_rows` rows apart), the tile of
// keys at kt (atoms kKeys rows apart). Issued, not waited for.
template <int D, typename T>
__device__ __forceinline__ void scores(float (&s)[kKeys / 2], uint32_t q_wg, int q_rows, uint32_t kt) {
#pragma unroll
  for (int i = 0; i < kKeys / 2; ++i) s[i] = 0.0f;
  wgmma::fence();
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks) {  // 16 elements of the head (32 bytes of each row) per product
    const uint32_t in_atom = (ks % 4) * 32u;  // the slice's 32 bytes within its 128-byte rows
    wgmma::Ops<T>::ss_n128(s, wgmma::desc_k_major(q_wg + (ks / 4) * (q_rows * 128) + in_atom),
                           wgmma::desc_k_major(kt + (ks / 4) * (kKeys * 128) + in_atom), ks > 0);
  }
  wgmma::commit();
}

// o += P V: pa the weights packed as the A operand, the tile of values at vt. Issued, not waited for.
template <int D, typename T>
__device__ __forceinline__ void values(float (&o)[D / 2], const uint32_t (&pa)[kKeys / 16][4], uint32_t vt) {
  wgmma::fence_registers(o);
  wgmma::fence();
#pragma unroll
  for (int kk = 0; kk < kKeys / 16; ++kk) {  // 16 keys (16 rows of V, 2048 bytes) per product
    wgmma::Ops<T>::rs_tb(o, pa[kk], wgmma::desc_mn_major(vt + kk * 16 * 128, kKeys * 128));
  }
  wgmma::commit();
}

// A tile's online softmax: the weights exp2(s scale - max) into pa (16 keys kk: n-tiles 2 kk and
// 2 kk + 1), the rows' maxima m (log2 units) and sums l updated, the accumulators rescaled. kEdge:
// masked(column, h) says which scores of rows `row + 8 h` no weight goes to (-inf); tiles that every
// row sees whole take the variant without it (where one code path held both, the compiler worked out
// every score's mask in every tile: some 400 integer instructions a thread). scale > 0: the maximum is
// taken over the raw scores, and each weight is one fused multiply-add and an exp2.
template <int D, typename T, bool kEdge, typename Masked>
__device__ __forceinline__ void softmax(float (&s)[kKeys / 2], float (&o)[D / 2], float (&m)[2], float (&l)[2],
                                        uint32_t (&pa)[kKeys / 16][4], float scale, int lane, const Masked& masked) {
  if constexpr (kEdge) {
#pragma unroll
    for (int nt = 0; nt < kKeys / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        if (masked(8 * nt + 2 * (lane % 4) + (e & 1), e >> 1)) s[4 * nt + e] = -INFINITY;
      }
    }
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {  // rows `row` (h = 0) and `row + 8`
    float mx = -INFINITY;
#pragma unroll
    for (int nt = 0; nt < kKeys / 8; ++nt) mx = fmaxf(mx, fmaxf(s[4 * nt + 2 * h], s[4 * nt + 2 * h + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    mx = fmaxf(m[h], mx == -INFINITY ? -INFINITY : mx * scale);
    const float base = mx == -INFINITY ? 0.0f : mx;  // a row that sees no key yet stays empty
    const float alpha = fast_exp2(m[h] - base);
    float sum = 0.0f;
#pragma unroll
    for (int nt = 0; nt < kKeys / 8; ++nt) {
      s[4 * nt + 2 * h] = fast_exp2(fmaf(s[4 * nt + 2 * h], scale, -base));
      s[4 * nt + 2 * h + 1] = fast_exp2(fmaf(s[4 * nt + 2 * h + 1], scale, -base));
      sum += s[4 * nt + 2 * h] + s[4 * nt + 2 * h + 1];
    }
    l[h] = l[h] * alpha + sum;
    m[h] = mx;
#pragma unroll
    for (int nt = 0; nt < D / 8; ++nt) o[4 * nt + 2 * h] *= alpha, o[4 * nt + 2 * h + 1] *= alpha;
  }
#pragma unroll
  for (int kk = 0; kk < kKeys / 16; ++kk) {
#pragma unroll
    for (int i = 0; i < 4; ++i) pa[kk][i] = flash::Mma<T>::pack(s[8 * kk + 2 * i], s[8 * kk + 2 * i + 1]);
  }
}

// The buffers of a producer and two consumer warpgroups: tile j's keys and values in buffer
// j % kStages of each (tile_bytes apart from k_at, v_at), the mbarriers 8 bytes apart from bars:
// full_k[s], full_v[s] (the producer filled the buffer), empty_k[s], empty_v[s] (every consumer
// thread done with it).
template <int kStages>
struct Pipeline {
  uint32_t k_at, v_at, tile_bytes, bars;
  __device__ __forceinline__ uint32_t full_k(int s) const { return bars + 8 * s; }
  __device__ __forceinline__ uint32_t full_v(int s) const { return bars + 8 * (kStages + s); }
  __device__ __forceinline__ uint32_t empty_k(int s) const { return bars + 8 * (2 * kStages + s); }
  __device__ __forceinline__ uint32_t empty_v(int s) const { return bars + 8 * (3 * kStages + s); }
  static constexpr uint32_t kBarrierBytes = 8 * 4 * kStages;
  // by one thread, before a fence_mbarrier_init and a block-wide sync: the producer's arrivals that
  // fill a buffer, the consumer threads that release it
  __device__ __forceinline__ void init(uint32_t producer_arrivals, uint32_t consumer_threads) const {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(full_k(s), producer_arrivals), mbar_init(full_v(s), producer_arrivals);
      mbar_init(empty_k(s), consumer_threads), mbar_init(empty_v(s), consumer_threads);
    }
  }
};

// Warpgroup wg's (0 or 1) turns over `tiles` tiles: tile j's scores, then (its turn held) tile j's
// values and tile j + 1's scores, the turn passed on (named barriers 1 and 2) while it waits for them
// and works out softmax(j), which fills pa from s and rescales o: one warpgroup's softmax runs while
// the other's products keep the tensor cores busy.
template <int D, typename T, int kStages, typename Softmax>
__device__ __forceinline__ void take_turns(const Pipeline<kStages>& pl, int tiles, int wg, uint32_t q_wg, int q_rows,
                                           float (&s)[kKeys / 2], float (&o)[D / 2],
                                           uint32_t (&pa)[kKeys / 16][4], const Softmax& softmax) {
  const auto sched_sync = [&] { asm volatile("bar.sync %0, 256;\n" ::"r"(1 + wg) : "memory"); };
  const auto sched_arrive = [&] { asm volatile("bar.arrive %0, 256;\n" ::"r"(2 - wg) : "memory"); };
  if (tiles <= 0) return;
  if (wg == 1) sched_arrive();  // the first turn is warpgroup 0's
  mbar_wait(pl.full_k(0), 0);
  sched_sync();
  scores<D, T>(s, q_wg, q_rows, pl.k_at);
  sched_arrive();
  wgmma::wait<0>();
  wgmma::fence_registers(s);
  mbar_arrive(pl.empty_k(0));
  softmax(0);
  for (int j = 1; j < tiles; ++j) {
    const int sv = (j - 1) % kStages, sk = j % kStages;
    mbar_wait(pl.full_v(sv), ((j - 1) / kStages) & 1);
    sched_sync();
    values<D, T>(o, pa, pl.v_at + sv * pl.tile_bytes);
    mbar_wait(pl.full_k(sk), (j / kStages) & 1);
    scores<D, T>(s, q_wg, q_rows, pl.k_at + sk * pl.tile_bytes);
    sched_arrive();
    wgmma::wait<0>();
    wgmma::fence_registers(o);
    wgmma::fence_registers(s);
    mbar_arrive(pl.empty_v(sv));
    mbar_arrive(pl.empty_k(sk));
    softmax(j);
  }
  const int sv = (tiles - 1) % kStages;  // the last tile's values
  mbar_wait(pl.full_v(sv), ((tiles - 1) / kStages) & 1);
  sched_sync();
  values<D, T>(o, pa, pl.v_at + sv * pl.tile_bytes);
  if (wg == 0) sched_arrive();  // (warpgroup 1's turn would go to no one)
  wgmma::wait<0>();
  wgmma::fence_registers(o);
}

// Row `row + 8 h`'s partial result at pr (the split kernels' (max, sum, acc[D]): max in natural-log
// units); sum: the row's sum over its quad.
template <int D>
__device__ __forceinline__ void store_partial(float* pr, const float (&o)[D / 2], float m, float sum, int h, int lane) {
  if (lane % 4 == 0) pr[0] = m * 0.6931471805599453f, pr[1] = sum;
#pragma unroll
  for (int nt = 0; nt < D / 8; ++nt) {
    *reinterpret_cast<float2*>(pr + 2 + nt * 8 + (lane % 4) * 2) = make_float2(o[4 * nt + 2 * h], o[4 * nt + 2 * h + 1]);
  }
}

}  // namespace turboquant::cuda::detail::wgmma_flash
