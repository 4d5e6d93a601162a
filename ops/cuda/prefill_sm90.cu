// The new tokens' own attention of a call with several query rows on Hopper's warpgroup products
// (wgmma, compiled for sm_90a alone): the contract of prefill.cu's kernel without a mask. A block of
// two warpgroups takes 128 query rows of one head, 64 per warpgroup, against tiles of 128 keys in
// shared memory: S = Q K^T with both operands in shared memory, an online softmax in registers, then
// O += P V with P from registers and V read transposed. The tiles are copied by every thread with
// cp.async into the 128-byte swizzle the products read, the next tile while this one is used. While
// one warpgroup works on its softmax the other's products keep the tensor cores busy.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "device_attributes.h"
#include "flash_tile.cuh"
#include "prefill.cuh"
#include "wgmma.cuh"

namespace turboquant::cuda::detail {
namespace {

constexpr int kGroups = 2;             // warpgroups per block
constexpr int kThreads = 128 * kGroups;
constexpr int kRows = 64 * kGroups;    // query rows per block, 64 per warpgroup (the products' M)
constexpr int kKeys = 128;             // keys per tile (the score product's N)

template <int D>
constexpr uint32_t q_bytes() {
  return kRows * D * 2;
}
template <int D>
constexpr uint32_t tile_bytes() {
  return kKeys * D * 2;
}
template <int D>
constexpr int smem_bytes() {  // Q, two buffers each of K and V, and the slack that aligns them to 1024
  return static_cast<int>(1024 + q_bytes<D>() + 4 * tile_bytes<D>());
}

// rows x D elements from g (row r at g + r * stride) into the swizzled tile at smem (rows of it);
// rows at or past `valid` are zero-filled.
template <int D, typename T>
__device__ __forceinline__ void load(uint32_t smem, const T* g, int64_t stride, int rows, int valid) {
  constexpr int kChunks = D / 8;
  for (int i = threadIdx.x; i < rows * kChunks; i += kThreads) {
    const int r = i / kChunks, c = i % kChunks;
    const bool on = r < valid;
    cp_async16(smem + wgmma::sw128_offset(rows, r, c), on ? g + r * stride + c * 8 : g, on ? 16 : 0);
  }
}

template <int D, typename T>
__global__ void __launch_bounds__(kThreads, 1)
    prefill_sm90_kernel(AttentionParams p, const T* q, const T* k, const T* v, T* y, float* part) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ uint8_t smem_raw[];
  const uint32_t q_at = (smem_u32(smem_raw) + 1023u) & ~1023u;  // the swizzle repeats every 1024 bytes
  const uint32_t k_at = q_at + q_bytes<D>(), v_at = k_at + 2 * tile_bytes<D>();
  const int wg = threadIdx.x / 128, warp = threadIdx.x / 32 % 4, lane = threadIdx.x % 32;
  const int64_t group = p.q_heads / p.kv_heads;
  const int64_t b = blockIdx.z, hq = blockIdx.y, hkv = hq / group;
  // causal blocks in decreasing order of work, so that the longest start first
  const int tiles_q = static_cast<int>((p.q_len + kRows - 1) / kRows);
  const int tq = p.is_causal ? tiles_q - 1 - static_cast<int>(blockIdx.x) : static_cast<int>(blockIdx.x);
  const int64_t q0 = static_cast<int64_t>(tq) * kRows;
  const int64_t diag = p.new_len - p.q_len;  // key t is visible to row i when t <= i + diag
  int64_t kv_end = p.new_len;
  if (p.is_causal) kv_end = std::min<int64_t>(kv_end, q0 + kRows + diag);
  const int tiles = kv_end > 0 ? static_cast<int>((kv_end + kKeys - 1) / kKeys) : 0;

  const T* qg = q + b * p.q.b + hq * p.q.h + q0 * p.q.s;
  const T* kg = k + b * p.k.b + hkv * p.k.h;
  const T* vg = v + b * p.v.b + hkv * p.v.h;
  load<D>(q_at, qg, p.q.s, kRows, static_cast<int>(std::min<int64_t>(kRows, p.q_len - q0)));
  if (tiles > 0) {
    const int valid = static_cast<int>(std::min<int64_t>(kKeys, p.new_len));
    load<D>(k_at, kg, p.k.s, kKeys, valid);
    load<D>(v_at, vg, p.v.s, kKeys, valid);
  }
  cp_async_commit();

  const float scale = p.scale * 1.4426950408889634f;  // scores in log2 units: exp2 instead of exp
  const int64_t wg_row0 = q0 + 64 * wg;               // the warpgroup's first row
  const int64_t row = wg_row0 + 16 * warp + lane / 4;  // this thread's rows: row and row + 8
  const uint32_t q_wg = q_at + wg * 64 * 128;         // the warpgroup's rows in Q's first atom
  float o[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) o[i] = 0.0f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};

  for (int j = 0; j < tiles; ++j) {
    const int buf = j & 1;
    cp_async_wait<0>();
    wgmma::fence_shared();
    __syncthreads();  // tile j has landed, and both warpgroups are done with tile j - 1, whose buffers are refilled now
    if (j + 1 < tiles) {
      const int64_t t1 = static_cast<int64_t>(j + 1) * kKeys;
      const int valid = static_cast<int>(std::min<int64_t>(kKeys, p.new_len - t1));
      load<D>(k_at + (buf ^ 1) * tile_bytes<D>(), kg + t1 * p.k.s, p.k.s, kKeys, valid);
      load<D>(v_at + (buf ^ 1) * tile_bytes<D>(), vg + t1 * p.v.s, p.v.s, kKeys, valid);
      cp_async_commit();
    }
    const int64_t t0 = static_cast<int64_t>(j) * kKeys;
    if (p.is_causal && t0 > wg_row0 + 63 + diag) continue;  // keys none of the warpgroup's rows sees
    const uint32_t kt = k_at + buf * tile_bytes<D>(), vt = v_at + buf * tile_bytes<D>();

    float s[kKeys / 2];
#pragma unroll
    for (int i = 0; i < kKeys / 2; ++i) s[i] = 0.0f;
    wgmma::fence();
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {  // 16 elements of the head (32 bytes of each row) per product
      const uint32_t in_atom = (ks % 4) * 32u;  // the slice's 32 bytes within its 128-byte rows
      wgmma::Ops<T>::ss_n128(s, wgmma::desc_k_major(q_wg + (ks / 4) * (kRows * 128) + in_atom),
                             wgmma::desc_k_major(kt + (ks / 4) * (kKeys * 128) + in_atom), ks > 0);
    }
    wgmma::commit();
    wgmma::wait<0>();
    wgmma::fence_registers(s);

    // element e of n-tile nt: key t0 + 8 nt + 2 (lane % 4) + (e & 1) of row `row + 8 (e >> 1)`
    const bool edge = t0 + kKeys > p.new_len || (p.is_causal && t0 + kKeys - 1 > wg_row0 + diag);
#pragma unroll
    for (int nt = 0; nt < kKeys / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float x = s[4 * nt + e] * scale;
        if (edge) {
          const int64_t t = t0 + 8 * nt + 2 * (lane % 4) + (e & 1), r = row + 8 * (e >> 1);
          if (t >= p.new_len || (p.is_causal && t > r + diag)) x = -INFINITY;
        }
        s[4 * nt + e] = x;
      }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // the online softmax of rows `row` (h = 0) and `row + 8`
      float mx = m[h];
#pragma unroll
      for (int nt = 0; nt < kKeys / 8; ++nt) mx = fmaxf(mx, fmaxf(s[4 * nt + 2 * h], s[4 * nt + 2 * h + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float base = mx == -INFINITY ? 0.0f : mx;  // a row that sees no key yet stays empty
      const float alpha = fast_exp2(m[h] - base);
      float sum = 0.0f;
#pragma unroll
      for (int nt = 0; nt < kKeys / 8; ++nt) {
        s[4 * nt + 2 * h] = fast_exp2(s[4 * nt + 2 * h] - base);
        s[4 * nt + 2 * h + 1] = fast_exp2(s[4 * nt + 2 * h + 1] - base);
        sum += s[4 * nt + 2 * h] + s[4 * nt + 2 * h + 1];
      }
      l[h] = l[h] * alpha + sum;
      m[h] = mx;
#pragma unroll
      for (int nt = 0; nt < D / 8; ++nt) o[4 * nt + 2 * h] *= alpha, o[4 * nt + 2 * h + 1] *= alpha;
    }
    // the weights as the value product's A operand: its 16 keys kk are n-tiles 2 kk and 2 kk + 1
    uint32_t pa[kKeys / 16][4];
#pragma unroll
    for (int kk = 0; kk < kKeys / 16; ++kk) {
#pragma unroll
      for (int i = 0; i < 4; ++i) pa[kk][i] = flash::Mma<T>::pack(s[8 * kk + 2 * i], s[8 * kk + 2 * i + 1]);
    }
    wgmma::fence_registers(o);
    wgmma::fence();
#pragma unroll
    for (int kk = 0; kk < kKeys / 16; ++kk) {  // 16 keys (16 rows of V, 2048 bytes) per product
      wgmma::Ops<T>::rs_tb(o, pa[kk], wgmma::desc_mn_major(vt + kk * 16 * 128, kKeys * 128));
    }
    wgmma::commit();
    wgmma::wait<0>();
    wgmma::fence_registers(o);
  }
  cp_async_wait<0>();  // with no key tile (rows that see no key) the Q tile's copy is still in flight

#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float sum = flash::quad_sum(l[h]);
    const int64_t r = row + 8 * h;
    if (r >= p.q_len) continue;
    if (part != nullptr) {  // row (b, hkv, r * group + hq % group) of the split kernels' partial results
      float* pr = part + ((b * p.kv_heads + hkv) * p.q_len * group + r * group + hq % group) * (2 + D);
      if (lane % 4 == 0) pr[0] = m[h] * 0.6931471805599453f, pr[1] = sum;  // max in natural-log units
#pragma unroll
      for (int nt = 0; nt < D / 8; ++nt) {
        *reinterpret_cast<float2*>(pr + 2 + nt * 8 + (lane % 4) * 2) = make_float2(o[4 * nt + 2 * h], o[4 * nt + 2 * h + 1]);
      }
      continue;
    }
    const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;  // a row that sees no key: zeros
    T* yr = y + b * p.y.b + hq * p.y.h + r * p.y.s;
#pragma unroll
    for (int nt = 0; nt < D / 8; ++nt) {
      *reinterpret_cast<uint32_t*>(yr + nt * 8 + (lane % 4) * 2) =
          flash::Mma<T>::pack(o[4 * nt + 2 * h] * inv, o[4 * nt + 2 * h + 1] * inv);
    }
  }
#endif
}

template <int D, typename T>
cudaError_t launch(const AttentionParams& p, const void* q, const void* k, const void* v, void* y, float* part,
                   cudaStream_t stream) {
  static SharedMemoryOptIn opt_in;  // one per instantiation: each kernel has its own attribute
  auto* kernel = prefill_sm90_kernel<D, T>;
  constexpr int bytes = smem_bytes<D>();
  cudaError_t e = opt_in.raise(reinterpret_cast<const void*>(kernel), bytes);
  if (e != cudaSuccess) return e;
  const dim3 grid(static_cast<unsigned>((p.q_len + kRows - 1) / kRows), static_cast<unsigned>(p.q_heads),
                  static_cast<unsigned>(p.batch));
  kernel<<<grid, kThreads, bytes, stream>>>(p, static_cast<const T*>(q), static_cast<const T*>(k),
                                            static_cast<const T*>(v), static_cast<T*>(y), part);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_prefill_sm90(const AttentionParams& p, const void* q, const void* k, const void* v, void* y,
                                float* part, cudaStream_t stream) {
  using H = __half;
  using B = __nv_bfloat16;
  const bool bf16 = p.dtype == DType::kBFloat16;
  if (p.head_dim == 64) return bf16 ? launch<64, B>(p, q, k, v, y, part, stream) : launch<64, H>(p, q, k, v, y, part, stream);
  return bf16 ? launch<128, B>(p, q, k, v, y, part, stream) : launch<128, H>(p, q, k, v, y, part, stream);
}

}  // namespace turboquant::cuda::detail
