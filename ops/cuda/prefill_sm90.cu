// The new tokens' own attention of a call with several query rows on Hopper's warpgroup products
// (wgmma, compiled for sm_90a alone): the contract of prefill.cu's kernel without a mask. A block
// takes 128 query rows of one head in three warpgroups:
// - a producer, one thread of which copies Q once and the tiles of 128 keys and values by the tensor
//   copy engine (TMA, into the 128-byte swizzle the products read), two buffers each, each buffer's
//   arrival and release signalled on mbarriers;
// - two consumers of 64 query rows each: S = Q K^T with both operands in shared memory, an online
//   softmax in registers, O += P V with P from registers and V read transposed. The two take turns
//   issuing their products (named barriers 1 and 2): one's softmax runs while the other's products
//   keep the tensor cores busy.
// The producer gives its registers to the consumers (setmaxnreg).
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <mutex>
#include <type_traits>

#include "device_attributes.h"
#include "flash_tile.cuh"
#include "prefill.cuh"
#include "wgmma.cuh"
#include "wgmma_flash.cuh"

namespace turboquant::cuda::detail {
namespace {

constexpr int kConsumers = 2;                  // consumer warpgroups, 64 query rows each
constexpr int kThreads = 128 * (kConsumers + 1);  // and the producer's
constexpr int kRows = 64 * kConsumers;         // query rows per block (the products' M, per consumer 64)
constexpr int kKeys = wgmma_flash::kKeys;      // keys per tile (the score product's N)
constexpr int kStages = 2;                     // buffers of keys, and of values
#ifndef TQ_PREFILL_L2_BYTES  // developer variant: 1 orders the blocks pair by pair (each pair's tiles together)
#define TQ_PREFILL_L2_BYTES (32LL << 20)
#endif

template <int D>
constexpr uint32_t q_bytes() {
  return kRows * D * 2;
}
template <int D>
constexpr uint32_t tile_bytes() {
  return kKeys * D * 2;
}
// Q, the buffers, the mbarriers (full and empty for each buffer of keys and of values, Q's), and the
// slack that aligns the tiles to 1024 bytes (the swizzle's period)
template <int D>
constexpr int smem_bytes() {
  return static_cast<int>(1024 + q_bytes<D>() + 2 * kStages * tile_bytes<D>() + 8 * (4 * kStages + 1));
}

// The tensor maps of Q, K and V: 4-d views of D elements by heads, positions and batch, in boxes of
// 64 elements x rows, their dimensions in increasing order of stride (the encoder's rule): heads
// inside positions for [B, S, H * D] tensors (heads_inner), outside for [B, H, S, D] ones.
struct Maps {
  CUtensorMap q, k, v;
  int q_heads_inner, k_heads_inner, v_heads_inner;
};

// The box of the map at element d, position s, head h, batch b into shared memory at dst; its
// bytes complete bar.
__device__ __forceinline__ void tma_load(uint32_t dst, const CUtensorMap* map, int heads_inner, int d, int s, int h,
                                         int b, uint32_t bar) {
  const int c1 = heads_inner ? h : s, c2 = heads_inner ? s : h;
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], [%6];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(d), "r"(c1), "r"(c2), "r"(b), "r"(bar)
      : "memory");
}

// Which rows a block takes: the (batch, KV head) pairs in sections whose keys and values fit in L2
// together; in a section, tile by tile, every pair's query heads at one tile before the next tile, so
// that blocks running at once share their keys in L2 and (causal) the longest tiles start first.
struct BlockWork {
  int tile, hq, b;
};
__device__ __forceinline__ BlockWork block_work(int block, int tiles_q, int group, int kv_heads, int batch,
                                                int section) {
  const int pairs = kv_heads * batch, per_section = section * group * tiles_q;
  const int first = block / per_section * section, in_section = min(section, pairs - first);
  const int r = block % per_section, tile = r / (in_section * group), k = r % (in_section * group);
  const int pair = first + k / group;
  return {tile, pair % kv_heads * group + k % group, pair / kv_heads};
}

template <int D, typename T>
__global__ void __launch_bounds__(kThreads, 1)
    prefill_sm90_kernel(const __grid_constant__ Maps maps, AttentionParams p, T* y, float* part, int section) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ uint8_t smem_raw[];
  const uint32_t q_at = (smem_u32(smem_raw) + 1023u) & ~1023u;  // the swizzle repeats every 1024 bytes
  const uint32_t k_at = q_at + q_bytes<D>(), v_at = k_at + kStages * tile_bytes<D>();
  // the buffers' mbarriers (the producer's copies landed, every consumer thread done), then Q's
  const wgmma_flash::Pipeline<kStages> pl{k_at, v_at, tile_bytes<D>(), v_at + kStages * tile_bytes<D>()};
  const uint32_t full_q = pl.bars + pl.kBarrierBytes;

  const int wg = threadIdx.x / 128, warp = threadIdx.x / 32 % 4, lane = threadIdx.x % 32;
  const int64_t group = p.q_heads / p.kv_heads;
  const int tiles_q = static_cast<int>((p.q_len + kRows - 1) / kRows);
  const BlockWork w = block_work(static_cast<int>(blockIdx.x), tiles_q, static_cast<int>(group),
                                 static_cast<int>(p.kv_heads), static_cast<int>(p.batch), section);
  const int b = w.b, hq = w.hq, hkv = static_cast<int>(hq / group);
  // causal blocks in decreasing order of work, so that the longest start first
  const int tq = p.is_causal ? tiles_q - 1 - w.tile : w.tile;
  const int64_t q0 = static_cast<int64_t>(tq) * kRows;
  const int64_t diag = p.new_len - p.q_len;  // key t is visible to row i when t <= i + diag
  int64_t kv_end = p.new_len;
  if (p.is_causal) kv_end = std::min<int64_t>(kv_end, q0 + kRows + diag);
  const int tiles = kv_end > 0 ? static_cast<int>((kv_end + kKeys - 1) / kKeys) : 0;

  if (threadIdx.x == 0) {
    pl.init(1, 128 * kConsumers);
    mbar_init(full_q, 1);
    fence_mbarrier_init();
  }
  __syncthreads();

  if (wg == kConsumers) {  // the producer (the last warpgroup)
    asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n" ::: "memory");
    if (warp != 0 || lane != 0) return;
    constexpr int kAtoms = D / 64;
    mbar_arrive_expect(full_q, q_bytes<D>());
    for (int a = 0; a < kAtoms; ++a) {
      tma_load(q_at + a * kRows * 128, &maps.q, maps.q_heads_inner, 64 * a, static_cast<int>(q0), hq, b, full_q);
    }
    for (int j = 0; j < tiles; ++j) {
      const int s = j % kStages, use = j / kStages;
      if (use > 0) mbar_wait(pl.empty_k(s), (use - 1) & 1);
      mbar_arrive_expect(pl.full_k(s), tile_bytes<D>());
      for (int a = 0; a < kAtoms; ++a) {
        tma_load(k_at + s * tile_bytes<D>() + a * kKeys * 128, &maps.k, maps.k_heads_inner, 64 * a, j * kKeys, hkv, b,
                 pl.full_k(s));
      }
      if (use > 0) mbar_wait(pl.empty_v(s), (use - 1) & 1);
      mbar_arrive_expect(pl.full_v(s), tile_bytes<D>());
      for (int a = 0; a < kAtoms; ++a) {
        tma_load(v_at + s * tile_bytes<D>() + a * kKeys * 128, &maps.v, maps.v_heads_inner, 64 * a, j * kKeys, hkv, b,
                 pl.full_v(s));
      }
    }
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 240;\n" ::: "memory");

  const float scale = p.scale * 1.4426950408889634f;  // scores in log2 units: exp2 instead of exp
  const int64_t wg_row0 = q0 + 64 * wg;               // the warpgroup's first row
  const int64_t row = wg_row0 + 16 * warp + lane / 4;  // this thread's rows: row and row + 8
  const uint32_t q_wg = q_at + wg * 64 * 128;         // the warpgroup's rows in Q's first atom
  float o[D / 2], s[kKeys / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) o[i] = 0.0f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  uint32_t pa[kKeys / 16][4];  // the last tile's weights: the value product's A operand

  // Tile j's online softmax; the tiles that some row must not see all of (the end of the keys, the
  // causal diagonal) take the masked variant.
  const auto softmax = [&](int j) {
    const int64_t t0 = static_cast<int64_t>(j) * kKeys;
    if (t0 + kKeys > p.new_len || (p.is_causal && t0 + kKeys - 1 > wg_row0 + diag)) {
      const auto masked = [&](int column, int h) {
        const int64_t t = t0 + column, r = row + 8 * h;
        return t >= p.new_len || (p.is_causal && t > r + diag);
      };
      wgmma_flash::softmax<D, T, true>(s, o, m, l, pa, scale, lane, masked);
    } else {
      wgmma_flash::softmax<D, T, false>(s, o, m, l, pa, scale, lane, [](int, int) { return false; });
    }
  };
  mbar_wait(full_q, 0);  // (also where no tile follows: the block must not end with Q's copy in flight)
  wgmma_flash::take_turns<D, T>(pl, tiles, wg, q_wg, kRows, s, o, pa, softmax);

#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float sum = flash::quad_sum(l[h]);
    const int64_t r = row + 8 * h;
    if (r >= p.q_len) continue;
    if (part != nullptr) {  // row (b, hkv, r * group + hq % group) of the split kernels' partial results
      wgmma_flash::store_partial<D>(part + ((b * p.kv_heads + hkv) * p.q_len * group + r * group + hq % group) * (2 + D),
                                    o, m[h], sum, h, lane);
      continue;
    }
    const float inv = sum > 0.0f ? 1.0f / sum : (sum == sum ? 0.0f : sum);  // no key: zeros; a NaN sum (NaN or +inf score): NaN
    T* yr = y + b * p.y.b + hq * p.y.h + r * p.y.s;
#pragma unroll
    for (int nt = 0; nt < D / 8; ++nt) {
      *reinterpret_cast<uint32_t*>(yr + nt * 8 + (lane % 4) * 2) =
          flash::Mma<T>::pack(o[4 * nt + 2 * h] * inv, o[4 * nt + 2 * h + 1] * inv);
    }
  }
#endif
}

// The driver's tensor-map encoder, found once (the runtime library is linked statically, the driver
// is the process's).
PFN_cuTensorMapEncodeTiled_v12000 encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = nullptr;
  static std::once_flag once;
  std::call_once(once, [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult found;
#if CUDART_VERSION >= 12050
    const cudaError_t e = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &found);
#else
    const cudaError_t e = cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &f, cudaEnableDefault, &found);
#endif
    if (e == cudaSuccess && found == cudaDriverEntryPointSuccess) fn = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  });
  return fn;
}

// The view of x (strides st, in elements) as the kernel reads it, into *map; *heads_inner: its heads
// are the map's second dimension. Rows past S read as zeros.
bool make_map(CUtensorMap* map, int* heads_inner, DType dt, const void* x, const BhsStrides& st, int64_t b,
              int64_t heads, int64_t s, int d, int rows) {
  const auto encode = encoder();
  if (encode == nullptr) return false;
  *heads_inner = st.h < st.s;
  const int64_t n1 = *heads_inner ? heads : s, n2 = *heads_inner ? s : heads;
  const int64_t s1 = *heads_inner ? st.h : st.s, s2 = *heads_inner ? st.s : st.h;
  const cuuint64_t dims[4] = {static_cast<cuuint64_t>(d), static_cast<cuuint64_t>(n1), static_cast<cuuint64_t>(n2),
                              static_cast<cuuint64_t>(b)};
  const int64_t sb = b > 1 ? st.b : n2 * s2;  // (a batch of one: its stride is unused, and may be 0)
  const cuuint64_t strides[3] = {static_cast<cuuint64_t>(s1) * 2, static_cast<cuuint64_t>(s2) * 2,
                                 static_cast<cuuint64_t>(sb) * 2};
  const cuuint32_t box[4] = {64, *heads_inner ? 1u : static_cast<cuuint32_t>(rows),
                             *heads_inner ? static_cast<cuuint32_t>(rows) : 1u, 1};
  const cuuint32_t unit[4] = {1, 1, 1, 1};
  const auto type = dt == DType::kBFloat16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  return encode(map, type, 4, const_cast<void*>(x), dims, strides, box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE,
                CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) ==
         CUDA_SUCCESS;
}

template <int D, typename T>
cudaError_t launch(const AttentionParams& p, const void* q, const void* k, const void* v, void* y, float* part,
                   cudaStream_t stream) {
  static SharedMemoryOptIn opt_in;  // one per instantiation: each kernel has its own attribute
  auto* kernel = prefill_sm90_kernel<D, T>;
  constexpr int bytes = smem_bytes<D>();
  cudaError_t e = opt_in.raise(reinterpret_cast<const void*>(kernel), bytes);
  if (e != cudaSuccess) return e;
  Maps maps;
  if (!make_map(&maps.q, &maps.q_heads_inner, p.dtype, q, p.q, p.batch, p.q_heads, p.q_len, D, kRows) ||
      !make_map(&maps.k, &maps.k_heads_inner, p.dtype, k, p.k, p.batch, p.kv_heads, p.new_len, D, kKeys) ||
      !make_map(&maps.v, &maps.v_heads_inner, p.dtype, v, p.v, p.batch, p.kv_heads, p.new_len, D, kKeys)) {
    return cudaErrorNotSupported;  // a driver without the tensor-map encoder: launch_prefill takes the other kernel
  }
  const int64_t tiles_q = (p.q_len + kRows - 1) / kRows, pairs = p.batch * p.kv_heads;
  // (batch, KV head) pairs per section: FlashAttention 3's L2 budget for its tile order
  const int64_t pair_bytes = std::max<int64_t>(1, p.new_len * D * 2 * 2);
  const int64_t section = std::clamp<int64_t>(TQ_PREFILL_L2_BYTES / pair_bytes, 1, pairs);
  kernel<<<static_cast<unsigned>(tiles_q * p.q_heads * p.batch), kThreads, bytes, stream>>>(
      maps, p, static_cast<T*>(y), part, static_cast<int>(section));
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_prefill_sm90(const AttentionParams& p, const void* q, const void* k, const void* v, void* y,
                                float* part, cudaStream_t stream) {
  if (!(p.scale > 0.0f)) return cudaErrorNotSupported;  // the softmax takes the raw scores' maximum: launch_prefill takes the other kernel
  if (p.head_dim != 64 && p.head_dim != 128) return cudaErrorNotSupported;  // (head size 256: plan_prefill's mma kernel)
  using H = __half;
  using B = __nv_bfloat16;
  const bool bf16 = p.dtype == DType::kBFloat16;
  if (p.head_dim == 64) return bf16 ? launch<64, B>(p, q, k, v, y, part, stream) : launch<64, H>(p, q, k, v, y, part, stream);
  return bf16 ? launch<128, B>(p, q, k, v, y, part, stream) : launch<128, H>(p, q, k, v, y, part, stream);
}

}  // namespace turboquant::cuda::detail
