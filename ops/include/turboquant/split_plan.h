// The split-KV planner of CUDA decode attention: for one call's parameters, its caches' alignment
// and the device, which split kernel runs, how the past is split among its blocks, its shared
// memory and the partial results' workspace. attention() sizes the workspace, lays out the splits
// and launches from this one plan. Host-only C++ (no CUDA headers), built into the CPU library too,
// so that tests can ask it for a plan on any machine.
#pragma once

#include <cstddef>
#include <cstdint>

#include "turboquant/params.h"

namespace turboquant::cuda {

enum class SplitKernel : int {
  kNone = 0,        // no split kernel: no past or no query rows (the finish kernel does it all)
  kTensorCoreBulk,  // attention_tc.cu: one block per SM, warps on 32-token tiles (bulk copies on sm_90)
  kTensorCoreMma,   // attention_mma.cu: MSE keys and uint values the first does not take
  kCudaCore,        // attention_split.cu's split_kernel: every call (masks, float32, any format pair)
  kTensorCoreChunk,  // past_chunk.cu: a continuation chunk's rows (64 or more per KV head) in 64-row tiles
  kTensorCoreChunkWgmma,  // past_chunk_sm90.cu: the same in 128-row blocks on Hopper's warpgroup products
  kDensePrefill,  // dense_past.cu: a chunk's rows over its past decoded dense, on the prefill kernel
};
// "none", "tc_bulk", "tc_mma", "cuda_core", "tc_chunk", "tc_chunk_wgmma", "dense_prefill": the names tests
// and logs use.
const char* split_kernel_name(SplitKernel k);

// What the plan needs of the device (the launchers ask the driver for them once per device).
struct DeviceProps {
  int sms = 0;         // multiprocessors
  int smem_optin = 0;  // the most shared memory a block may opt in to (227 KiB on sm_90)
  int cc_major = 0, cc_minor = 0;
  bool sm90a = false;  // the library holds sm_90a code (prefill_sm90.cu) that this device runs
};

// How the past is split among the blocks of a split kernel (and the finish kernel's query rows).
struct SplitLayout {
  int rows_per_block = 1;  // 1, 2, 4 or 8 (64 and 128 for the chunk kernels): the query rows a split block scores together
  int stage_bytes = 0;  // CUDA-core kernel: shared memory staging a tile's packed K and V (0: none)
  int buffers = 1;  // CUDA-core kernel: 2 when the next tile is fetched while this one is computed
  int group = 1;  // Hq / Hkv
  int64_t rows = 0;  // rows per (b, hkv) = q_len * group
  int row_blocks = 0;
  int splits = 1;
  int64_t split_len = 0;
};

struct SplitPlan {
  SplitKernel kernel = SplitKernel::kNone;
  SplitLayout layout;
  int warps = 0;  // tensor-core bulk kernel: warps per block (16, 8 or 4)
  int smem = 0;   // dynamic shared memory of the split launch, in bytes
  // The new tokens' part of a call over a past (a continuation chunk) is one more partial result that
  // prefill.cu writes after the split kernel's, where new_tokens_on_tensor_cores (else the finish
  // kernel attends each row's new tokens itself); its rows follow the split kernel's in the workspace.
  bool new_part = false;
  size_t new_part_offset = 0;  // bytes into the workspace
  size_t past_copy_offset = 0;  // kDensePrefill: the past's K then V decoded dense, bytes into the workspace
  size_t workspace = 0;  // bytes of partial results the split kernel (and prefill.cu) write and the finish kernel merges
};

// Whether the new tokens' own attention of a call runs on tensor cores (prefill.cu), by its shapes:
// several query rows, fp16 or bf16, head size 64, 128 or 256 for keys and values alike. (The launcher also
// needs the tensors' rows at 16-byte boundaries.)
bool new_tokens_on_tensor_cores(const AttentionParams& p);

// Which kernel attends a call's new tokens on tensor cores (where new_tokens_on_tensor_cores).
enum class PrefillKernel : int {
  kNone = 0,  // not on tensor cores: the finish kernel attends each query row
  kMma,       // prefill.cu: mma.sync, 16-row tiles per warp, with any mask TQAttention takes
  kWgmma,     // prefill_sm90.cu: Hopper's warpgroup products (sm_90a code), without a mask
};
// "none", "mma", "wgmma": the names tests and logs use.
const char* prefill_kernel_name(PrefillKernel k);
PrefillKernel plan_prefill(const AttentionParams& p, const DeviceProps& dev);

// Whether the planner may choose kTensorCoreChunkWgmma: while that kernel awaits its measurements on
// the GPU (docs/performance.md, which kernel runs), only where the environment sets
// TURBOQUANT_CHUNK_WGMMA=1 (read at each plan, so that a process's tests can set it).
bool chunk_wgmma_enabled();
// Whether the planner may choose kDensePrefill: unless the environment sets TURBOQUANT_DENSE_PREFILL=0
// (read at each plan: A/B runs against the split kernels).
bool dense_prefill_enabled();

// caches_aligned16: past_key and past_value start at multiples of 16 bytes (the tensor-core bulk
// kernel copies fp8 and raw16 rows in swizzled 16-byte chunks).
SplitPlan plan_split(const AttentionParams& p, bool caches_aligned16, const DeviceProps& dev);

// Tokens per tile of the CUDA-core split kernel: its splits are multiples of it.
constexpr int kCudaCoreTile = 128;
// The CUDA-core kernel's staging of one tile's packed K and V, at most (two tiles in flight).
constexpr int kCudaCoreStageMax = 32 * 1024;

}  // namespace turboquant::cuda
