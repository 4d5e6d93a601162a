// The new tokens' own attention for a call with no past (a first prompt): ordinary causal (or
// unmasked) attention over exact K/V, flash-attention style. Tiles of 16 query rows per warp
// against tiles of 64 keys in shared memory, scores and P.V on tensor cores (mma.sync m16n8k16,
// fp32 accumulators), an online softmax in registers; no [Sq x Skv] buffer. The finish kernel of
// attention.cu then packs the new K/V into present, as for any call.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>

#include "prefill.cuh"
#include "ptx.cuh"

namespace turboquant::cuda::detail {
namespace {

constexpr int kWarps = 4;
constexpr int kKeys = 64;  // keys per tile
// 16-row m-tiles per warp, which share each K and V fragment: two at head size 128 (fewer shared
// memory reads per product), one at 64 and with a mask (whose indexing would spill the second's
// registers); docs/performance.md, prefill
template <int D, bool kMask>
constexpr int mtiles() {
  return D >= 128 && !kMask ? 2 : 1;
}
template <int D, bool kMask>
constexpr int block_rows() {
  return 16 * mtiles<D, kMask>() * kWarps;
}

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

// Whether row i sees key t by the attention mask, and the mask's term added to its score: element
// (b, hq, i, t) of a bool or additive mask through p.mask_stride (0 where it broadcasts).
__device__ __forceinline__ bool mask_term(const AttentionParams& p, const void* mask, int64_t b, int64_t hq, int64_t i,
                                          int64_t t, float* add) {
  const int64_t at = b * p.mask_stride[0] + hq * p.mask_stride[1] + i * p.mask_stride[2] + t * p.mask_stride[3];
  switch (p.mask_type) {
    case MaskType::kBool: return static_cast<const uint8_t*>(mask)[at] != 0;
    case MaskType::kFloat32: *add = static_cast<const float*>(mask)[at]; return true;
    case MaskType::kFloat16: *add = __half2float(static_cast<const __half*>(mask)[at]); return true;
    default: *add = __bfloat162float(static_cast<const __nv_bfloat16*>(mask)[at]); return true;
  }
}

template <int D, typename T, bool kMask>
__global__ void __launch_bounds__(kWarps * 32)
    prefill_kernel(AttentionParams p, const T* q, const T* k, const T* v, const void* mask, T* y) {
  extern __shared__ __align__(128) uint8_t smem[];
  constexpr int kMt = mtiles<D, kMask>(), kRows = block_rows<D, kMask>(), kTileBytes = kKeys * D * 2;
  constexpr bool kQInRegisters = kMt == 1;  // two m-tiles' fragments would not fit beside their accumulators
  const uint32_t q_at = smem_u32(smem), k_at = q_at + kRows * D * 2, v_at = k_at + 2 * kTileBytes;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t b = blockIdx.z, hq = blockIdx.y, hkv = hq / (p.q_heads / p.kv_heads);
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
  load_tile<D>(q_at, qg, p.q.s, kRows, static_cast<int>(std::min<int64_t>(kRows, p.q_len - q0)));
  if (tiles > 0) {
    const int valid = static_cast<int>(std::min<int64_t>(kKeys, p.new_len));
    load_tile<D>(k_at, kg, p.k.s, kKeys, valid);
    load_tile<D>(v_at, vg, p.v.s, kKeys, valid);
  }
  cp_async_commit();

  const float scale = p.scale * 1.4426950408889634f;  // scores in log2 units: exp2 instead of exp
  const int warp_row = warp * 16 * kMt;               // the warp's first row in the block's tile
  float o[kMt][D / 8][4] = {};
  float m[kMt][2], l[kMt][2];  // per m-tile, rows lane / 4 (elements 0, 1) and lane / 4 + 8 (2, 3)
#pragma unroll
  for (int mt = 0; mt < kMt; ++mt) m[mt][0] = m[mt][1] = -INFINITY, l[mt][0] = l[mt][1] = 0.0f;
  uint32_t qf[kQInRegisters ? D / 16 : 1][4];
  for (int j = 0; j < tiles; ++j) {
    const int buf = j & 1;
    cp_async_wait<0>();
    __syncthreads();  // tile j has landed, and every warp is done with tile j - 1, whose buffer is refilled now
    if (j + 1 < tiles) {
      const int64_t t0 = static_cast<int64_t>(j + 1) * kKeys;
      const int valid = static_cast<int>(std::min<int64_t>(kKeys, p.new_len - t0));
      load_tile<D>(k_at + (buf ^ 1) * kTileBytes, kg + t0 * p.k.s, p.k.s, kKeys, valid);
      load_tile<D>(v_at + (buf ^ 1) * kTileBytes, vg + t0 * p.v.s, p.v.s, kKeys, valid);
      cp_async_commit();
    }
    if constexpr (kQInRegisters) {
      if (j == 0) {
#pragma unroll
        for (int ks = 0; ks < D / 16; ++ks) ldmatrix_x4(qf[ks], q_at + tile_offset<D>(warp_row + lane % 16, 2 * ks + lane / 16));
      }
    }
    const uint32_t kt = k_at + buf * kTileBytes, vt = v_at + buf * kTileBytes;
    float s[kMt][kKeys / 8][4] = {};
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
    const int64_t t0 = static_cast<int64_t>(j) * kKeys;
    const bool edge = kMask || t0 + kKeys > p.new_len || (p.is_causal && t0 + kKeys - 1 > q0 + warp_row + diag);
#pragma unroll
    for (int mt = 0; mt < kMt; ++mt) {
#pragma unroll
      for (int nt = 0; nt < kKeys / 8; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float x = s[mt][nt][e] * scale;
          if (edge) {
            const int64_t t = t0 + nt * 8 + (lane % 4) * 2 + (e & 1);
            const int64_t row = q0 + warp_row + mt * 16 + lane / 4 + (e >> 1) * 8;
            float add = 0.0f;
            if (t >= p.new_len || (p.is_causal && t > row + diag)) {
              x = -INFINITY;
            } else if (kMask && row < p.q_len) {  // rows past the prompt are not written: no mask element to read
              x = mask_term(p, mask, b, hq, row, t, &add) ? x + add * 1.4426950408889634f : -INFINITY;
            }
          }
          s[mt][nt][e] = x;
        }
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float mx = m[mt][h];
#pragma unroll
        for (int nt = 0; nt < kKeys / 8; ++nt) mx = fmaxf(mx, fmaxf(s[mt][nt][2 * h], s[mt][nt][2 * h + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float base = mx == -INFINITY ? 0.0f : mx;  // a row that sees no key yet stays empty
        const float alpha = fast_exp2(m[mt][h] - base);
        float sum = 0.0f;
#pragma unroll
        for (int nt = 0; nt < kKeys / 8; ++nt) {
          s[mt][nt][2 * h] = fast_exp2(s[mt][nt][2 * h] - base);
          s[mt][nt][2 * h + 1] = fast_exp2(s[mt][nt][2 * h + 1] - base);
          sum += s[mt][nt][2 * h] + s[mt][nt][2 * h + 1];
        }
        l[mt][h] = l[mt][h] * alpha + sum;
        m[mt][h] = mx;
#pragma unroll
        for (int nt = 0; nt < D / 8; ++nt) {
          o[mt][nt][2 * h] *= alpha;
          o[mt][nt][2 * h + 1] *= alpha;
        }
      }
    }
#pragma unroll
    for (int kk = 0; kk < kKeys / 16; ++kk) {  // P as the A operand: the score tiles' layout is its layout
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

  cp_async_wait<0>();  // with no key tile (rows that see no key) the Q tile's copy is still in flight

#pragma unroll
  for (int mt = 0; mt < kMt; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float sum = l[mt][h];
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      const int64_t row = q0 + warp_row + mt * 16 + lane / 4 + h * 8;
      if (row >= p.q_len) continue;
      const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;  // a row that sees no key: zeros
      T* yr = y + b * p.y.b + hq * p.y.h + row * p.y.s;
#pragma unroll
      for (int nt = 0; nt < D / 8; ++nt) {
        *reinterpret_cast<uint32_t*>(yr + nt * 8 + (lane % 4) * 2) =
            Mma<T>::pack(o[mt][nt][2 * h] * inv, o[mt][nt][2 * h + 1] * inv);
      }
    }
  }
}

template <int D, bool kMask>
constexpr int smem_bytes() {
  return (block_rows<D, kMask>() + 4 * kKeys) * D * 2;  // Q, and two buffers each of K and V
}

// The opt-in to more than 48 KiB of dynamic shared memory, per kernel (one `raised` per
// instantiation: kernels of one signature must not share it) and device.
template <int D, typename T, bool kMask>
cudaError_t raise_shared(int bytes) {
  static std::atomic<bool> raised[64];
  int dev = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e != cudaSuccess) return e;
  if (dev < 64 && raised[dev].load()) return cudaSuccess;
  e = cudaFuncSetAttribute(prefill_kernel<D, T, kMask>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (e == cudaSuccess && dev < 64) raised[dev].store(true);
  return e;
}

template <int D, typename T, bool kMask>
cudaError_t launch(const AttentionParams& p, const void* q, const void* k, const void* v, const void* mask, void* y,
                   cudaStream_t stream) {
  auto* kernel = prefill_kernel<D, T, kMask>;
  constexpr int bytes = smem_bytes<D, kMask>();
  cudaError_t e = raise_shared<D, T, kMask>(bytes);
  if (e != cudaSuccess) return e;
  const dim3 grid(static_cast<unsigned>((p.q_len + block_rows<D, kMask>() - 1) / block_rows<D, kMask>()), static_cast<unsigned>(p.q_heads),
                  static_cast<unsigned>(p.batch));
  kernel<<<grid, kWarps * 32, bytes, stream>>>(p, static_cast<const T*>(q), static_cast<const T*>(k),
                                               static_cast<const T*>(v), mask, static_cast<T*>(y));
  return cudaGetLastError();
}

bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15) == 0; }
bool rows16(const BhsStrides& st) { return st.b % 8 == 0 && st.h % 8 == 0 && st.s % 8 == 0; }  // 8 elements

}  // namespace

bool prefill_supported(const AttentionParams& p, const void* q, const void* k, const void* v, const void* mask,
                       const void* y) {
  const bool half = p.dtype == DType::kFloat16 || p.dtype == DType::kBFloat16;
  const bool shape = (p.head_dim == 64 || p.head_dim == 128) && p.v_head_dim == p.head_dim;
  const bool grid = p.batch <= 65535 && p.q_heads <= 65535 && (p.q_len + 63) / 64 <= INT32_MAX;
  const bool y_pairs = (reinterpret_cast<uintptr_t>(y) & 3) == 0 && p.y.b % 2 == 0 && p.y.h % 2 == 0 && p.y.s % 2 == 0;
  const bool masked = p.mask_type != MaskType::kNone;
  return half && shape && grid && p.past_len == 0 && p.q_len > 1 && p.new_len > 0 && masked == (mask != nullptr) &&
         aligned16(q) && aligned16(k) && aligned16(v) && rows16(p.q) && rows16(p.k) && rows16(p.v) && y_pairs;
}

cudaError_t launch_prefill(const AttentionParams& p, const void* q, const void* k, const void* v, const void* mask,
                           void* y, cudaStream_t stream) {
  using H = __half;
  using B = __nv_bfloat16;
  const bool bf16 = p.dtype == DType::kBFloat16;
  if (mask != nullptr) {
    if (p.head_dim == 64) return bf16 ? launch<64, B, true>(p, q, k, v, mask, y, stream) : launch<64, H, true>(p, q, k, v, mask, y, stream);
    return bf16 ? launch<128, B, true>(p, q, k, v, mask, y, stream) : launch<128, H, true>(p, q, k, v, mask, y, stream);
  }
  if (p.head_dim == 64) return bf16 ? launch<64, B, false>(p, q, k, v, mask, y, stream) : launch<64, H, false>(p, q, k, v, mask, y, stream);
  return bf16 ? launch<128, B, false>(p, q, k, v, mask, y, stream) : launch<128, H, false>(p, q, k, v, mask, y, stream);
}

}  // namespace turboquant::cuda::detail
