// The new tokens' own attention of a call with several query rows: ordinary causal (or unmasked)
// attention over exact K/V, flash-attention style. Tiles of 16 query rows per warp against tiles of
// 64 keys in shared memory, scores and P.V on tensor cores (mma.sync m16n8k16, fp32 accumulators),
// an online softmax in registers; no [Sq x Skv] buffer. With no past (a first prompt) it writes Y;
// over a packed past (a continuation chunk) it writes each row's (max, sum, acc) as one more partial
// result, which the finish kernel (finish.cu) merges with the split kernel's by log-sum-exp. The
// finish kernel also packs the new K/V into present, as for any call.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "device_attributes.h"
#include "flash_tile.cuh"
#include "mask.cuh"
#include "prefill.cuh"
#include "turboquant/split_plan.h"

namespace turboquant::cuda::detail {
namespace {

using flash::kKeys;
using flash::kWarps;
using flash::Mma;
using flash::tile_offset;
// 16-row m-tiles per warp, which share each K and V fragment: two at head size 128 (fewer shared
// memory reads per product), one at 64, with a mask (whose indexing would spill the second's
// registers) and at 256 (whose 128 accumulators per thread leave no room for a second);
// docs/performance.md, prefill
template <int D, bool kMask>
constexpr int mtiles() {
  return D == 128 && !kMask ? 2 : 1;
}
template <int D, bool kMask>
constexpr int block_rows() {
  return 16 * mtiles<D, kMask>() * kWarps;
}

// one_buffer (head size 256 only: elsewhere both buffers always fit): one buffer each of K and V,
// the next tile copied after this one is used, on devices whose shared memory holds no second
// (one_buffer_at_256)
template <int D, typename T, bool kMask>
__global__ void __launch_bounds__(kWarps * 32)
    prefill_kernel(AttentionParams p, const T* q, const T* k, const T* v, const void* mask, T* y, float* part,
                   bool one_buffer_arg) {
  extern __shared__ __align__(128) uint8_t smem[];
  constexpr int kMt = mtiles<D, kMask>(), kRows = block_rows<D, kMask>(), kTileBytes = kKeys * D * 2;
  // two m-tiles' fragments would not fit beside their accumulators, nor head size 256's beside its
  // 128: those read Q from shared memory at each tile
  constexpr bool kQInRegisters = kMt == 1 && D <= 128;
  const bool one_buffer = D == 256 && one_buffer_arg;  // (a constant false at 64 and 128)
  const uint32_t q_at = smem_u32(smem), k_at = q_at + kRows * D * 2, v_at = k_at + (one_buffer ? 1 : 2) * kTileBytes;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t b = blockIdx.z, hq = blockIdx.y, hkv = hq / (p.q_heads / p.kv_heads);
  // causal blocks in decreasing order of work, so that the longest start first
  const int tiles_q = static_cast<int>((p.q_len + kRows - 1) / kRows);
  const int tq = p.is_causal ? tiles_q - 1 - static_cast<int>(blockIdx.x) : static_cast<int>(blockIdx.x);
  const int64_t q0 = static_cast<int64_t>(tq) * kRows;
  const int64_t diag = p.new_len - p.q_len;  // key t is visible to row i when t <= i + diag
  const int64_t mask_col = kMask ? p.past_of(b) : 0;  // the mask's column of new key 0
  int64_t kv_end = p.new_len;
  if (p.is_causal) kv_end = std::min<int64_t>(kv_end, q0 + kRows + diag);
  const int tiles = kv_end > 0 ? static_cast<int>((kv_end + kKeys - 1) / kKeys) : 0;
  // the sliding window: key t is visible to row i when t >= i + diag - window + 1, so the block's
  // tiles start at its first row's first key (the ones before are skipped, not masked)
  const int64_t window_from = kMask && p.window > 0 ? q0 + diag - p.window + 1 : 0;
  const int tile0 = window_from > 0 ? static_cast<int>(std::min<int64_t>(window_from / kKeys, tiles)) : 0;

  const T* qg = q + b * p.q.b + hq * p.q.h + q0 * p.q.s;
  const T* kg = k + b * p.k.b + hkv * p.k.h;
  const T* vg = v + b * p.v.b + hkv * p.v.h;
  flash::load_tile<D>(q_at, qg, p.q.s, kRows, static_cast<int>(std::min<int64_t>(kRows, p.q_len - q0)));
  if (tiles > tile0) {
    const int64_t t0 = static_cast<int64_t>(tile0) * kKeys;
    const int valid = static_cast<int>(std::min<int64_t>(kKeys, p.new_len - t0));
    const uint32_t buf = one_buffer ? 0u : (tile0 & 1) * kTileBytes;
    flash::load_tile<D>(k_at + buf, kg + t0 * p.k.s, p.k.s, kKeys, valid);
    flash::load_tile<D>(v_at + buf, vg + t0 * p.v.s, p.v.s, kKeys, valid);
  }
  cp_async_commit();

  const float scale = p.scale * 1.4426950408889634f;  // scores in log2 units: exp2 instead of exp
  const int warp_row = warp * 16 * kMt;               // the warp's first row in the block's tile
  float o[kMt][D / 8][4] = {};
  float m[kMt][2], l[kMt][2];  // per m-tile, rows lane / 4 (elements 0, 1) and lane / 4 + 8 (2, 3)
#pragma unroll
  for (int mt = 0; mt < kMt; ++mt) m[mt][0] = m[mt][1] = -INFINITY, l[mt][0] = l[mt][1] = 0.0f;
  uint32_t qf[kQInRegisters ? D / 16 : 1][4];
  const float cap = p.softcap * 1.4426950408889634f;  // softcap in the scores' log2 units
  for (int j = tile0; j < tiles; ++j) {
    const int buf = one_buffer ? 0 : j & 1;
    cp_async_wait<0>();
    __syncthreads();  // tile j has landed, and every warp is done with tile j - 1, whose buffer is refilled now
    if (!one_buffer && j + 1 < tiles) {
      const int64_t t0 = static_cast<int64_t>(j + 1) * kKeys;
      const int valid = static_cast<int>(std::min<int64_t>(kKeys, p.new_len - t0));
      flash::load_tile<D>(k_at + (buf ^ 1) * kTileBytes, kg + t0 * p.k.s, p.k.s, kKeys, valid);
      flash::load_tile<D>(v_at + (buf ^ 1) * kTileBytes, vg + t0 * p.v.s, p.v.s, kKeys, valid);
      cp_async_commit();
    }
    if constexpr (kQInRegisters) {
      if (j == tile0) {
#pragma unroll
        for (int ks = 0; ks < D / 16; ++ks) ldmatrix_x4(qf[ks], q_at + tile_offset<D>(warp_row + lane % 16, 2 * ks + lane / 16));
      }
    }
    const uint32_t kt = k_at + buf * kTileBytes, vt = v_at + buf * kTileBytes;
    float s[kMt][kKeys / 8][4];
    flash::scores<D, kMt, kQInRegisters, T>(s, qf, q_at, kt, warp_row, lane);
    const int64_t t0 = static_cast<int64_t>(j) * kKeys;
    // (the masked variant, which takes the window, tests every score)
    const bool edge = kMask || t0 + kKeys > p.new_len || (p.is_causal && t0 + kKeys - 1 > q0 + warp_row + diag);
#pragma unroll
    for (int mt = 0; mt < kMt; ++mt) {
#pragma unroll
      for (int nt = 0; nt < kKeys / 8; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float x = s[mt][nt][e] * scale;
          if (kMask && p.softcap > 0.0f) x = cap * tanhf(x / cap);
          if (edge) {
            const int64_t t = t0 + flash::key_of(nt, e, lane), row = q0 + warp_row + flash::row_of(mt, e, lane);
            float add = 0.0f;
            if (t >= p.new_len || (p.is_causal && t > row + diag) || (kMask && p.window > 0 && t < row + diag - p.window + 1)) {
              x = -INFINITY;
            } else if (kMask && row < p.q_len) {  // rows past the prompt are not written: no mask element to read
              x = mask_allows(p, mask, mask_at(p, b, hq, row, mask_col + t), &add) ? x + add * 1.4426950408889634f
                                                                                   : -INFINITY;
            }
          }
          s[mt][nt][e] = x;
        }
      }
    }
    float alpha[kMt][2];
    flash::softmax_step<D, kMt>(s, m, l, o, alpha);
    flash::add_values<D, kMt, T>(o, s, vt, lane);
    if (one_buffer && j + 1 < tiles) {
      __syncthreads();  // every warp is done with tile j, whose buffers take tile j + 1 now
      const int64_t t1 = static_cast<int64_t>(j + 1) * kKeys;
      const int valid = static_cast<int>(std::min<int64_t>(kKeys, p.new_len - t1));
      flash::load_tile<D>(k_at, kg + t1 * p.k.s, p.k.s, kKeys, valid);
      flash::load_tile<D>(v_at, vg + t1 * p.v.s, p.v.s, kKeys, valid);
      cp_async_commit();
    }
  }

  cp_async_wait<0>();  // with no key tile (rows that see no key) the Q tile's copy is still in flight

  const int64_t group = p.q_heads / p.kv_heads;
#pragma unroll
  for (int mt = 0; mt < kMt; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float sum = flash::quad_sum(l[mt][h]);
      const int64_t row = q0 + warp_row + flash::row_of(mt, 2 * h, lane);
      if (row >= p.q_len) continue;
      if (part != nullptr) {  // row (b, hkv, row * group + hq % group) of the split kernels' partial results
        flash::store_partial<D, kMt>(part + ((b * p.kv_heads + hkv) * p.q_len * group + row * group + hq % group) * (2 + D),
                                     o, m[mt][h], sum, mt, h, lane);
        continue;
      }
      float inv = sum > 0.0f ? 1.0f / sum : (sum == sum ? 0.0f : sum);  // no key: zeros; a NaN sum (NaN or +inf score): NaN
      if (kMask && p.head_sink) {  // the sink joins the denominator only (a continuation chunk's: in the finish kernel)
        const float sink = load_float(p.dtype, p.head_sink, hq) * 1.4426950408889634f, mr = m[mt][h];
        const float mx = fmaxf(mr, sink), rescale = mr == -INFINITY ? 0.0f : exp2f(mr - mx);
        const float total = sum * rescale + (sink == -INFINITY ? 0.0f : exp2f(sink - mx));
        inv = total > 0.0f ? rescale / total : (total == total ? 0.0f : total);
      }
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
constexpr int smem_bytes(bool one_buffer = false) {
  return (block_rows<D, kMask>() + (one_buffer ? 2 : 4) * kKeys) * D * 2;  // Q, and two buffers (or one) each of K and V
}
static_assert(smem_bytes<256, true>() == 160 * 1024 && smem_bytes<256, false>() == 160 * 1024 &&
                  smem_bytes<256, true>(true) == 96 * 1024,
              "head size 256: two buffers fit sm_80 and sm_90 (163 and 227 KiB), one sm_86 and sm_89 (99 KiB)");

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

// Whether head size 256 runs with one buffer each of K and V: where the device's shared memory
// holds no second (sm_86, sm_89), or where TURBOQUANT_PREFILL_ONE_BUFFER=1 asks for it (read at each
// launch, so that a process's tests on a larger device can run this variant too).
bool one_buffer_at_256(int smem_optin) {
  if (smem_optin < smem_bytes<256, true>()) return true;
  const char* env = std::getenv("TURBOQUANT_PREFILL_ONE_BUFFER");
  return env != nullptr && std::strcmp(env, "1") == 0;
}

template <int D, typename T, bool kMask>
cudaError_t launch(const AttentionParams& p, const void* q, const void* k, const void* v, const void* mask, void* y,
                   float* part, cudaStream_t stream) {
  auto* kernel = prefill_kernel<D, T, kMask>;
  const int optin = current_device_props().smem_optin;
  const bool one_buffer = D == 256 && one_buffer_at_256(optin);
  const int bytes = smem_bytes<D, kMask>(one_buffer);
  if (bytes > optin) return cudaErrorNotSupported;  // (no device of compute capability 8.0 or newer has less)
  // the opt-in to both buffers where they fit, so that either variant launches after it
  cudaError_t e = raise_shared<D, T, kMask>(smem_bytes<D, kMask>() <= optin ? smem_bytes<D, kMask>() : bytes);
  if (e != cudaSuccess) return e;
  const dim3 grid(static_cast<unsigned>((p.q_len + block_rows<D, kMask>() - 1) / block_rows<D, kMask>()), static_cast<unsigned>(p.q_heads),
                  static_cast<unsigned>(p.batch));
  kernel<<<grid, kWarps * 32, bytes, stream>>>(p, static_cast<const T*>(q), static_cast<const T*>(k),
                                               static_cast<const T*>(v), mask, static_cast<T*>(y), part, one_buffer);
  return cudaGetLastError();
}

bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15) == 0; }

std::atomic<int> last_kernel{static_cast<int>(PrefillKernel::kNone)};
bool rows16(const BhsStrides& st) { return st.b % 8 == 0 && st.h % 8 == 0 && st.s % 8 == 0; }  // 8 elements

}  // namespace

bool prefill_supported(const AttentionParams& p, const void* q, const void* k, const void* v, const void* mask,
                       const void* y) {
  const bool grid = p.batch <= 65535 && p.q_heads <= 65535 && (p.q_len + 63) / 64 <= INT32_MAX;
  const bool y_pairs = (reinterpret_cast<uintptr_t>(y) & 3) == 0 && p.y.b % 2 == 0 && p.y.h % 2 == 0 && p.y.s % 2 == 0;
  const bool masked = p.mask_type != MaskType::kNone;
  return new_tokens_on_tensor_cores(p) && grid && masked == (mask != nullptr) && aligned16(q) && aligned16(k) &&
         aligned16(v) && rows16(p.q) && rows16(p.k) && rows16(p.v) && y_pairs;
}

cudaError_t launch_prefill(const AttentionParams& p, const void* q, const void* k, const void* v, const void* mask,
                           void* y, float* part, cudaStream_t stream, PrefillKernel kernel) {
  if (kernel == PrefillKernel::kNone) kernel = plan_prefill(p, current_device_props());
  last_kernel.store(static_cast<int>(kernel));
#ifdef TQ_SM90A
  if (kernel == PrefillKernel::kWgmma && mask == nullptr) {
    const cudaError_t e = launch_prefill_sm90(p, q, k, v, y, part, stream);
    if (e != cudaErrorNotSupported) return e;
    kernel = PrefillKernel::kMma;  // (a driver that cannot encode the tensor maps)
    last_kernel.store(static_cast<int>(kernel));
  }
#endif
  if (kernel != PrefillKernel::kMma) return cudaErrorInvalidValue;
  using H = __half;
  using B = __nv_bfloat16;
  const bool bf16 = p.dtype == DType::kBFloat16;
  // the sliding window, softcap and head_sink run on the masked variant (with or without a mask), which
  // tests every score anyway: the unmasked one's code stays as it was
  const bool features = p.window > 0 || p.softcap > 0.0f || p.head_sink != nullptr;
  if (mask != nullptr || features) {
    if (p.head_dim == 64) return bf16 ? launch<64, B, true>(p, q, k, v, mask, y, part, stream) : launch<64, H, true>(p, q, k, v, mask, y, part, stream);
    if (p.head_dim == 256) return bf16 ? launch<256, B, true>(p, q, k, v, mask, y, part, stream) : launch<256, H, true>(p, q, k, v, mask, y, part, stream);
    return bf16 ? launch<128, B, true>(p, q, k, v, mask, y, part, stream) : launch<128, H, true>(p, q, k, v, mask, y, part, stream);
  }
  if (p.head_dim == 64) return bf16 ? launch<64, B, false>(p, q, k, v, mask, y, part, stream) : launch<64, H, false>(p, q, k, v, mask, y, part, stream);
  if (p.head_dim == 256) return bf16 ? launch<256, B, false>(p, q, k, v, mask, y, part, stream) : launch<256, H, false>(p, q, k, v, mask, y, part, stream);
  return bf16 ? launch<128, B, false>(p, q, k, v, mask, y, part, stream) : launch<128, H, false>(p, q, k, v, mask, y, part, stream);
}

}  // namespace turboquant::cuda::detail

namespace turboquant::cuda {
PrefillKernel last_prefill_kernel() { return static_cast<PrefillKernel>(detail::last_kernel.load()); }
}  // namespace turboquant::cuda
