// A continuation chunk's query rows over the packed past on tensor cores (plan kTensorCoreChunk):
// flash-attention tiles of 64 query rows (the GQA group's heads at consecutive positions, all of one
// KV head) against 64-token tiles of the past, decoded once per block into shared memory and shared
// by its rows. MSE keys are scored in the rotated domain: the block rotates its query rows once
// (q H / sqrt(Dp)), the key tile holds the codebook's centroids and each token's scale (s / sqrt(Dp))
// multiplies its score; uint values enter as their codes, each token's value scale multiplying its
// weight and its zero adding weight x zero to every column. Each block takes one slice (split) of the
// past and writes the split kernels' partial results, which the finish kernel merges with the new
// tokens' part (prefill.cu).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "chunk_queries.cuh"
#include "flash_tile.cuh"
#include "mask.cuh"  // window_first_key
#include "split_common.cuh"
#include "split_geometry.h"
#include "turboquant/vector_codec.h"

namespace turboquant::cuda::detail {
namespace {

using namespace flash;  // the tile steps shared with prefill.cu

constexpr int kThreads = kWarps * 32;
constexpr int kRows = chunk_geometry::kRows;  // one m-tile per warp: room for the next tile's bytes in registers
static_assert(kRows == 16 * kWarps && chunk_geometry::kKeys == kKeys, "the planner's geometry is the kernel's");

template <int D>
constexpr int tile_bytes() {
  return kKeys * D * 2;
}
template <int D>
constexpr int smem_bytes() {
  return chunk_geometry::smem_bytes(D);
}

// Bytes [at, at + n) of a packed row (n <= 4) as a little-endian word: one load where `words`.
template <int kBytes>
__device__ __forceinline__ uint32_t load_word(const uint8_t* at, bool words) {
  if (kBytes == 4 && words) return __ldg(reinterpret_cast<const uint32_t*>(at));
  uint32_t w = 0;
#pragma unroll
  for (int u = 0; u < kBytes; ++u) w |= static_cast<uint32_t>(__ldg(at + u)) << (8 * u);
  return w;
}
__device__ __forceinline__ float load_half(const uint8_t* at) {
  return __half2float(__ushort_as_half(__ldg(reinterpret_cast<const unsigned short*>(at))));
}

// One thread's share of a tile's packed bytes, loaded a tile ahead: 8 codes of one row per item.
template <int D>
struct Raw {
  static constexpr int kItems = kKeys * (D / 8) / kThreads;
  uint32_t k[kItems], v[kItems];
  float ks = 0.0f, vs = 0.0f, vz = 0.0f;  // thread t < kKeys: token t's key scale, value scale, zero
};

template <int D, int KB, int VB, typename T>
__global__ void __launch_bounds__(kThreads)
    past_chunk_kernel(AttentionParams p, Layout l, const T* q, const uint8_t* past_key, const uint8_t* past_value,
                      float* partial, bool q_vectors, bool key_words, bool value_words) {
  extern __shared__ __align__(128) uint8_t smem[];
  const uint32_t q_at = smem_u32(smem), k_at = q_at + kRows * D * 2, v_at = k_at + tile_bytes<D>();
  float* key_scale = reinterpret_cast<float*>(smem + kRows * D * 2 + 2 * tile_bytes<D>());
  float* value_scale = key_scale + kKeys;
  float* value_zero = value_scale + kKeys;
  float* centroid = value_zero + kKeys;
  uint8_t* k_tile = smem + kRows * D * 2;
  uint8_t* v_tile = k_tile + tile_bytes<D>();
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int64_t bh = blockIdx.z, b = bh / p.kv_heads, hkv = bh % p.kv_heads;
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * kRows;
  const int split = blockIdx.y;
  // the splits start at the sliding window's first key for the chunk's first row (plan_split)
  const int64_t past = p.past_of(b), begin = window_first_key(p, past) + split * l.split_len;
  const int64_t end = min(past, begin + l.split_len);
  const int tiles = end > begin ? static_cast<int>((end - begin + kKeys - 1) / kKeys) : 0;
  const int64_t kb = p.key_row(), vb = p.value_row();
  // the split's row t (from begin), wherever row_offset puts it (a pool's block or a contiguous cache);
  // only rows before `end` are addressed
  const int64_t cache_rows = p.past_rows_or_len();
  const auto key_row = [&](int64_t t) { return past_key + p.row_offset(b, hkv, begin + t, cache_rows, kb); };
  const auto value_row = [&](int64_t t) { return past_value + p.row_offset(b, hkv, begin + t, cache_rows, vb); };
  constexpr int kCodeBytes = D * KB / 8, kValueBytes = D * VB / 8;

  grid_dependency_wait();  // the past may be the copy kernel's present
  if (tid < (1 << KB)) centroid[tid] = static_cast<float>(codec::centroids(KB)[tid]);

  // the query rows, rotated
  load_rotated_queries<D, kThreads>(smem, [](int r, int c) { return tile_offset<D>(r, c); }, p, l, q, b, hkv, r0, kRows,
                                    q_vectors);
  __syncthreads();
  constexpr bool kQInRegisters = D == 64;  // at 128 its 32 registers would spill beside the next tile's bytes
  uint32_t qf[kQInRegisters ? D / 16 : 1][4];
  if constexpr (kQInRegisters) {
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) ldmatrix_x4(qf[ks], q_at + tile_offset<D>(warp * 16 + lane % 16, 2 * ks + lane / 16));
  }

  Raw<D> raw;
  const auto fetch = [&](int j) {  // tile j's bytes into registers; tokens at or past `end` as zeros
    const int64_t t0 = static_cast<int64_t>(j) * kKeys;
#pragma unroll
    for (int u = 0; u < Raw<D>::kItems; ++u) {
      const int i = tid + u * kThreads, t = i / (D / 8), c = i % (D / 8);
      const bool on = begin + t0 + t < end;
      raw.k[u] = on ? load_word<KB>(key_row(t0 + t) + c * KB, key_words) : 0u;
      raw.v[u] = on ? load_word<VB>(value_row(t0 + t) + c * VB, value_words) : 0u;
    }
    if (tid < kKeys) {
      const bool on = begin + t0 + tid < end;
      const uint8_t* kr = on ? key_row(t0 + tid) : past_key;
      const uint8_t* vr = on ? value_row(t0 + tid) : past_value;
      raw.ks = on ? load_half(kr + kCodeBytes) * (D == 128 ? 0.08838834764831845f : 0.125f) : 0.0f;
      raw.vs = on ? load_half(vr + kValueBytes) : 0.0f;
      raw.vz = on ? load_half(vr + kValueBytes + 2) : 0.0f;
    }
  };
  if (tiles > 0) fetch(0);

  const float scale = p.scale * 1.4426950408889634f;  // scores in log2 units: exp2 instead of exp
  // the sliding window: the first key (counted from begin) that each of the thread's two rows sees,
  // -1 for every key (no window)
  int first_key[2] = {-1, -1};
  if (p.window > 0) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t pos = (r0 + warp * 16 + flash::row_of(0, 2 * h, lane)) / l.group;
      const int64_t first = past + p.new_len - p.q_len + pos - p.window + 1 - begin;
      first_key[h] = static_cast<int>(max(static_cast<int64_t>(-1), min(first, static_cast<int64_t>(INT32_MAX))));
    }
  }
  float o[1][D / 8][4] = {};
  float m[1][2] = {{-INFINITY, -INFINITY}}, lsum[1][2] = {{0.0f, 0.0f}}, zsum[2] = {0.0f, 0.0f};
  constexpr uint32_t kKeyMask = (1u << KB) - 1, kValueMask = (1u << VB) - 1;
  for (int j = 0; j < tiles; ++j) {
    __syncthreads();  // every warp is done with tile j - 1
#pragma unroll
    for (int u = 0; u < Raw<D>::kItems; ++u) {
      const int i = tid + u * kThreads, t = i / (D / 8), c = i % (D / 8);
      uint32_t kh[4], vh[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        kh[e] = Mma<T>::pack(centroid[(raw.k[u] >> (KB * 2 * e)) & kKeyMask], centroid[(raw.k[u] >> (KB * (2 * e + 1))) & kKeyMask]);
        vh[e] = Mma<T>::pack(static_cast<float>((raw.v[u] >> (VB * 2 * e)) & kValueMask),
                             static_cast<float>((raw.v[u] >> (VB * (2 * e + 1))) & kValueMask));
      }
      *reinterpret_cast<uint4*>(k_tile + tile_offset<D>(t, c)) = make_uint4(kh[0], kh[1], kh[2], kh[3]);
      *reinterpret_cast<uint4*>(v_tile + tile_offset<D>(t, c)) = make_uint4(vh[0], vh[1], vh[2], vh[3]);
    }
    if (tid < kKeys) key_scale[tid] = raw.ks, value_scale[tid] = raw.vs, value_zero[tid] = raw.vz;
    const int64_t t0 = static_cast<int64_t>(j) * kKeys;
    if (j + 1 < tiles) fetch(j + 1);  // in flight while this tile is computed
    __syncthreads();

    float s[1][kKeys / 8][4];
    flash::scores<D, 1, kQInRegisters, T>(s, qf, q_at, k_at, warp * 16, lane);
#pragma unroll
    for (int nt = 0; nt < kKeys / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int t = flash::key_of(nt, e, lane);
        const bool on = begin + t0 + t < end && static_cast<int>(t0) + t >= first_key[e >> 1];
        s[0][nt][e] = on ? s[0][nt][e] * key_scale[t] * scale : -INFINITY;
      }
    }
    float alpha[1][2];
    flash::softmax_step<D, 1>(s, m, lsum, o, alpha);
#pragma unroll
    for (int h = 0; h < 2; ++h) zsum[h] *= alpha[0][h];
#pragma unroll
    for (int nt = 0; nt < kKeys / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int t = flash::key_of(nt, e, lane);
        zsum[e >> 1] += s[0][nt][e] * value_zero[t];
        s[0][nt][e] *= value_scale[t];
      }
    }
    flash::add_values<D, 1, T>(o, s, v_at, lane);
  }

#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float sum = flash::quad_sum(lsum[0][h]), zero = flash::quad_sum(zsum[h]);
    const int64_t row = r0 + warp * 16 + flash::row_of(0, 2 * h, lane);
    if (row >= l.rows) continue;
    flash::store_partial<D, 1>(partial + ((bh * l.rows + row) * l.splits + split) * partial_stride(D), o, m[0][h], sum, 0,
                               h, lane, zero);
  }
}

template <int D, int KB, int VB, typename T>
cudaError_t launch(const AttentionParams& p, const SplitPlan& plan, const void* q, const uint8_t* past_key,
                   const uint8_t* past_value, float* partial, cudaStream_t stream) {
  auto* kernel = past_chunk_kernel<D, KB, VB, T>;
  static SharedMemoryOptIn opt_in;
  cudaError_t e = opt_in.raise(reinterpret_cast<const void*>(kernel), smem_bytes<D>());
  if (e != cudaSuccess) return e;
  const auto aligned4 = [](const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 3) == 0; };
  const bool blocks4 = !p.blocks.table || p.blocks.block_bytes % 4 == 0;  // a pool's rows then 4-byte aligned too
  const bool key_words = aligned4(past_key) && p.key_row() % 4 == 0 && KB == 4 && blocks4;
  const bool value_words = aligned4(past_value) && p.value_row() % 4 == 0 && VB == 4 && blocks4;
  return launch_dependent(kernel, chunk_grid(p, plan.layout), dim3(kThreads), smem_bytes<D>(), stream, p, plan.layout,
                          static_cast<const T*>(q), past_key, past_value, partial, query_vectors(p, q), key_words,
                          value_words);
}

template <int D, typename T>
cudaError_t launch_formats(const AttentionParams& p, const SplitPlan& plan, const void* q, const uint8_t* past_key,
                           const uint8_t* past_value, float* partial, cudaStream_t stream) {
  const int kb = format_bits(p.key_format), vb = format_bits(p.value_format);
  if (kb == 4 && vb == 4) return launch<D, 4, 4, T>(p, plan, q, past_key, past_value, partial, stream);
  if (kb == 3 && vb == 4) return launch<D, 3, 4, T>(p, plan, q, past_key, past_value, partial, stream);
  if (kb == 3 && vb == 3) return launch<D, 3, 3, T>(p, plan, q, past_key, past_value, partial, stream);
  return launch<D, 4, 3, T>(p, plan, q, past_key, past_value, partial, stream);
}

}  // namespace

cudaError_t launch_chunk_split(const AttentionParams& p, const SplitPlan& plan, const void* q, const uint8_t* past_key,
                               const uint8_t* past_value, float* partial, cudaStream_t stream) {
  return with_head_and_type(p, [&](auto d, auto t) {
    return launch_formats<decltype(d)::value, decltype(t)>(p, plan, q, past_key, past_value, partial, stream);
  });
}

}  // namespace turboquant::cuda::detail
