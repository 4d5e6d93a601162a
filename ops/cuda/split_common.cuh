// What the split-KV attention kernels share (ops/cuda/attention.cu and attention_mma.cu): how the
// past is split into blocks, and the partial results the merge kernel combines.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "turboquant/params.h"

namespace turboquant::cuda::detail {

constexpr int kTile = 128;                 // tokens per tile of the CUDA-core kernel; splits are multiples
constexpr int kMaxStageBytes = 32 * 1024;  // one tile's packed K and V, at most

struct Layout {
  int rows_per_block;  // 1, 2, 4 or 8: the query rows a split block scores together
  int stage_bytes;  // shared memory staging a tile's packed K and V (0: read them from global memory)
  int buffers;  // 2: the next tile is fetched (cp.async) while this one is computed
  int group;  // Hq / Hkv
  int64_t rows;  // rows per (b, hkv) = q_len * group
  int row_blocks;
  int splits;
  int64_t split_len;
};

inline Layout make_layout(const AttentionParams& p, int num_sms) {
  Layout l;
  l.group = static_cast<int>(p.q_heads / p.kv_heads);
  l.rows = p.q_len * l.group;
  l.rows_per_block = l.rows >= 8 ? 8 : l.rows >= 4 ? 4 : l.rows >= 2 ? 2 : 1;
  l.rows_per_block = l.rows > 4 && l.rows < 8 ? 8 : l.rows > 2 && l.rows < 4 ? 4 : l.rows_per_block;
  l.row_blocks = static_cast<int>((l.rows + l.rows_per_block - 1) / l.rows_per_block);
  const int64_t base = p.batch * p.kv_heads * l.row_blocks;
  int64_t splits = base > 0 ? (8LL * num_sms + base - 1) / base : 1;
  const int64_t max_splits = (p.past_len + kTile - 1) / kTile;
  splits = splits < 1 ? 1 : splits;
  splits = splits > max_splits ? max_splits : splits;
  l.splits = static_cast<int>(splits < 1 ? 1 : splits);
  l.split_len = (p.past_len + l.splits - 1) / l.splits;
  l.split_len = (l.split_len + kTile - 1) / kTile * kTile;
  const int64_t stage = static_cast<int64_t>(kTile) * (p.key_row() + p.value_row());
  l.stage_bytes = stage <= kMaxStageBytes ? static_cast<int>((stage + 15) / 16 * 16) : 0;
  l.buffers = l.stage_bytes > 0 && l.split_len > kTile ? 2 : 1;  // double-buffer when a block takes several tiles
  return l;
}

// Partial results: [B*Hkv][rows][splits] x (max, sum, acc[Dv]).
__host__ __device__ inline int64_t partial_stride(int dv) { return 2 + dv; }

// The tensor-core split kernel (attention_mma.cu): MSE keys and uint values, no mask, every past
// token visible to every query row. When it applies it writes the same partials as split_kernel.
bool mma_split_supported(const AttentionParams& p);
cudaError_t launch_mma_split(const AttentionParams& p, const Layout& l, const void* q, const uint8_t* past_key,
                             const uint8_t* past_value, float* partial, cudaStream_t stream);

}  // namespace turboquant::cuda::detail
