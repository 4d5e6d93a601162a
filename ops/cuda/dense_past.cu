// A continuation chunk over the past on the prefill kernel (SplitKernel::kDensePrefill): the past's
// rows, wherever row_offset puts them (a pool's blocks or a contiguous cache), decoded once into dense
// [past, Hkv, D] K and V of the call's dtype, then the prefill kernel the planner picks (wgmma on Hopper)
// attends every query row to all of them, unmasked, writing its partial results as one split's for the
// finish kernel's merge. The decoded keys are those the split kernels score (keys minus any key offset)
// and the values those they weigh (the finish kernel adds the value offset times the past's weight), so
// the merge is theirs.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "prefill.cuh"
#include "split_common.cuh"
#include "turboquant/cuda_kernels.h"
#include "turboquant/vector_codec.h"

namespace turboquant::cuda::detail {
namespace {

constexpr int kThreads = 256, kWarpsPerBlock = kThreads / 32;

// Codes [first, first + n) of a packed LSB-first stream of `bits`-bit codes, n * bits <= 32.
__device__ __forceinline__ uint32_t code_bits(const uint8_t* row, int first, int n, int bits) {
  const int bit = first * bits, byte = bit / 8, shift = bit % 8, bytes = (shift + n * bits + 7) / 8;
  uint64_t w = 0;
  for (int u = 0; u < bytes; ++u) w |= static_cast<uint64_t>(row[byte + u]) << (8 * u);
  return static_cast<uint32_t>(w >> shift);
}

// Lane `lane`'s E = DP / 32 consecutive elements of one packed vector, decoded as codec::decode_vector
// does (MSE keys: centroids, the inverse rotation as a Walsh-Hadamard transform across the warp, times
// s / DP), into x.
template <int DP>
__device__ __forceinline__ void decode_lanes(Format f, const uint8_t* row, const float* centroid, int lane,
                                             float (&x)[DP / 32]) {
  constexpr int E = DP / 32;
  const int first = lane * E;
  switch (f) {
    case Format::kMse3:
    case Format::kMse4: {
      const int bits = format_bits(f);
      const uint32_t codes = code_bits(row, first, E, bits), mask = (1u << bits) - 1;
#pragma unroll
      for (int e = 0; e < E; ++e) x[e] = centroid[(codes >> (bits * e)) & mask];
#pragma unroll
      for (int h = 1; h < E; h <<= 1) {  // butterflies inside the lane
#pragma unroll
        for (int e = 0; e < E; ++e) {
          if (e & h) continue;
          const float a = x[e], b = x[e + h];
          x[e] = a + b;
          x[e + h] = a - b;
        }
      }
#pragma unroll
      for (int m = 1; m < 32; m <<= 1) {  // and across lanes: element distance m * E
        const bool upper = lane & m;
#pragma unroll
        for (int e = 0; e < E; ++e) {
          const float other = __shfl_xor_sync(0xffffffffu, x[e], m);
          x[e] = upper ? other - x[e] : x[e] + other;
        }
      }
      const float s = codec::load_f16(row + DP * bits / 8) / static_cast<float>(DP);
#pragma unroll
      for (int e = 0; e < E; ++e) x[e] *= s;
      break;
    }
    case Format::kUint3:
    case Format::kUint4: {
      const int bits = format_bits(f);
      const uint32_t codes = code_bits(row, first, E, bits), mask = (1u << bits) - 1;
      const float sc = codec::load_f16(row + DP * bits / 8), zr = codec::load_f16(row + DP * bits / 8 + 2);
#pragma unroll
      for (int e = 0; e < E; ++e) x[e] = static_cast<float>((codes >> (bits * e)) & mask) * sc + zr;
      break;
    }
    case Format::kFp8:
#pragma unroll
      for (int e = 0; e < E; ++e) x[e] = fp8_to_f32(row[first + e]);
      break;
    default:  // kRaw16: fp16 elements
#pragma unroll
      for (int e = 0; e < E; ++e) x[e] = codec::load_f16(row + 2 * (first + e));
      break;
  }
}

// One warp per (token, KV head) row of the past: its key and value decoded into the dense copies.
template <int DP, typename T>
__global__ void __launch_bounds__(kThreads) decode_past(AttentionParams p, const uint8_t* past_key,
                                                        const uint8_t* past_value, T* dense_key, T* dense_value) {
  constexpr int E = DP / 32;
  __shared__ float centroid[16];
  if (threadIdx.x < 16) {
    const int bits = is_mse(p.key_format) ? format_bits(p.key_format) : 0;
    centroid[threadIdx.x] = bits ? static_cast<float>(codec::centroids(bits)[threadIdx.x & ((1 << bits) - 1)]) : 0.0f;
  }
  __syncthreads();
  grid_dependency_wait();  // the past may be the copy kernel's present
  const int lane = threadIdx.x % 32;
  const int64_t rows = p.past_len * p.kv_heads, cache_rows = p.past_rows_or_len();
  const int64_t kb = p.key_row(), vb = p.value_row();
  for (int64_t r = blockIdx.x * static_cast<int64_t>(kWarpsPerBlock) + threadIdx.x / 32; r < rows;
       r += static_cast<int64_t>(gridDim.x) * kWarpsPerBlock) {
    const int64_t h = r % p.kv_heads, t = r / p.kv_heads;
    float x[E];
    decode_lanes<DP>(p.key_format, past_key + p.row_offset(0, h, t, cache_rows, kb), centroid, lane, x);
#pragma unroll
    for (int e = 0; e < E; ++e) dense_key[r * DP + lane * E + e] = static_cast<T>(x[e]);
    decode_lanes<DP>(p.value_format, past_value + p.row_offset(0, h, t, cache_rows, vb), centroid, lane, x);
#pragma unroll
    for (int e = 0; e < E; ++e) dense_value[r * DP + lane * E + e] = static_cast<T>(x[e]);
  }
}

template <int DP, typename T>
cudaError_t launch_decode(const AttentionParams& p, const uint8_t* past_key, const uint8_t* past_value, void* dense_key,
                          void* dense_value, cudaStream_t stream) {
  const int64_t rows = p.past_len * p.kv_heads;
  const int64_t blocks = std::min<int64_t>((rows + kWarpsPerBlock - 1) / kWarpsPerBlock, 65535);
  decode_past<DP, T><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      p, past_key, past_value, static_cast<T*>(dense_key), static_cast<T*>(dense_value));
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_decode(const AttentionParams& p, const uint8_t* past_key, const uint8_t* past_value, void* dense_key,
                          void* dense_value, cudaStream_t stream) {
  switch (p.head_dim) {
    case 64: return launch_decode<64, T>(p, past_key, past_value, dense_key, dense_value, stream);
    case 128: return launch_decode<128, T>(p, past_key, past_value, dense_key, dense_value, stream);
    case 256: return launch_decode<256, T>(p, past_key, past_value, dense_key, dense_value, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

cudaError_t launch_dense_prefill_split(const AttentionParams& p, const SplitPlan& plan, const void* q,
                                       const uint8_t* past_key, const uint8_t* past_value, void* y, float* partial,
                                       uint8_t* workspace, cudaStream_t stream) {
  const int64_t elements = p.past_len * p.kv_heads * p.head_dim;
  uint8_t* dense_key = workspace + plan.past_copy_offset;
  uint8_t* dense_value = dense_key + elements * dtype_size(p.dtype);
  cudaError_t e = p.dtype == DType::kBFloat16
                      ? launch_decode<__nv_bfloat16>(p, past_key, past_value, dense_key, dense_value, stream)
                      : launch_decode<__half>(p, past_key, past_value, dense_key, dense_value, stream);
  if (e != cudaSuccess) return e;
  AttentionParams past = p;  // the past as the keys of an unmasked attention
  past.new_len = p.past_len;
  past.past_len = 0;
  past.past_lens = nullptr;
  past.past_lens_bias = 0;
  past.past_rows = past.present_rows = 0;
  past.blocks = BlockTable{};
  past.is_causal = false;
  past.key_offset = past.value_offset = nullptr;
  past.k = past.v = BhsStrides{elements, p.head_dim, p.kv_heads * p.head_dim};
  return launch_prefill(past, q, dense_key, dense_value, nullptr, y, partial, stream);
}

}  // namespace turboquant::cuda::detail
