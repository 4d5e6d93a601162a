// A continuation chunk over a raw16 past (SplitKernel::kRawPrefill): the past's rows, wherever
// row_offset puts them (a pool's blocks or a contiguous cache), copied into dense [past, Hkv, D] K and V
// (raw16 rows are the fp16 values themselves), then prefill.cu's kernel attends every query row to
// all of them, unmasked, writing its partial results as one split's for the finish kernel's merge.
#include "prefill.cuh"
#include "split_common.cuh"
#include "turboquant/cuda_kernels.h"

namespace turboquant::cuda::detail {
namespace {

constexpr int kThreads = 256;

// One thread per 16-byte chunk of a row of K and of V.
__global__ void __launch_bounds__(kThreads) copy_raw_past(AttentionParams p, const uint8_t* past_key,
                                                          const uint8_t* past_value, uint8_t* dense_key,
                                                          uint8_t* dense_value) {
  const int64_t row_bytes = 2 * static_cast<int64_t>(p.head_dim), chunks = row_bytes / 16;
  const int64_t n = p.past_len * p.kv_heads * chunks, cache_rows = p.past_rows_or_len();
  for (int64_t i = blockIdx.x * static_cast<int64_t>(kThreads) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    const int64_t c = i % chunks, th = i / chunks, h = th % p.kv_heads, t = th / p.kv_heads;
    const int64_t from = p.row_offset(0, h, t, cache_rows, row_bytes) + 16 * c, to = th * row_bytes + 16 * c;
    *reinterpret_cast<uint4*>(dense_key + to) = *reinterpret_cast<const uint4*>(past_key + from);
    *reinterpret_cast<uint4*>(dense_value + to) = *reinterpret_cast<const uint4*>(past_value + from);
  }
}

}  // namespace

cudaError_t launch_raw_prefill_split(const AttentionParams& p, const SplitPlan& plan, const void* q,
                                     const uint8_t* past_key, const uint8_t* past_value, void* y, float* partial,
                                     uint8_t* workspace, cudaStream_t stream) {
  const int64_t row_bytes = 2 * static_cast<int64_t>(p.head_dim);
  uint8_t* dense_key = workspace + plan.past_copy_offset;
  uint8_t* dense_value = dense_key + p.past_len * p.kv_heads * row_bytes;
  const int64_t items = p.past_len * p.kv_heads * (row_bytes / 16);
  const int64_t blocks = std::min<int64_t>((items + kThreads - 1) / kThreads, 65535);
  copy_raw_past<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(p, past_key, past_value, dense_key, dense_value);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  AttentionParams past = p;  // the past as the keys of an unmasked attention
  past.new_len = p.past_len;
  past.past_len = 0;
  past.past_lens = nullptr;
  past.past_lens_bias = 0;
  past.past_rows = past.present_rows = 0;
  past.blocks = BlockTable{};
  past.is_causal = false;
  past.k = past.v = BhsStrides{p.past_len * p.kv_heads * p.head_dim, p.head_dim, p.kv_heads * p.head_dim};
  return launch_prefill(past, q, dense_key, dense_value, nullptr, y, partial, stream, PrefillKernel::kMma);
}

}  // namespace turboquant::cuda::detail
