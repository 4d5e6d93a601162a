// TQAttention on the GPU (docs/design.md section 3), in launches that each file names:
// 1. present = past ++ pack(new - offset): a copy kernel (copy.cu, when present is not past's buffer)
//    and the finish kernel's packing blocks (same codec as the CPU).
// 2. the split kernel the planner chooses (split_plan.cpp): attention_tc.cu, attention_mma.cu,
//    past_chunk.cu, raw_past.cu or the CUDA-core attention_split.cu; each writes (max, sum, acc[Dv]) per
//    query row and slice (split) of the past.
// 3. For a call with several query rows, prefill.cu attends the new tokens on tensor cores: Y itself
//    for a first prompt, one more partial result per row over a past.
// 4. finish.cu: one block per query row merges the partial results with log-sum-exp, adds the new
//    tokens exactly (or their part from step 3), restores the value offset and writes Y; other blocks
//    of the same launch pack the new tokens into the present caches (a first prompt's: TQPack's
//    four-lane kernel instead, pack.cu).
// On sm_90 the tensor-core split kernels and the finish kernel are programmatic dependent launches
// (split_common.cuh): each may start while the launch before it runs, and waits for it before
// reading what it wrote.
#include <algorithm>
#include <atomic>

#include "attention_steps.cuh"
#include "prefill.cuh"
#include "split_common.cuh"
#include "turboquant/cuda_kernels.h"

namespace turboquant::cuda {
using namespace detail;

namespace {
bool aligned16(const uint8_t* past_key, const uint8_t* past_value) {
  return ((reinterpret_cast<uintptr_t>(past_key) | reinterpret_cast<uintptr_t>(past_value)) & 15) == 0;
}

std::atomic<int> last_kernel{static_cast<int>(SplitKernel::kNone)};
}  // namespace

// Enough for either alignment of the caches: the kernel, and with it the splits, can depend on it,
// and callers (TensorRT's getWorkspaceSize) size the workspace before they know the addresses.
size_t attention_workspace_bytes(const AttentionParams& p, int num_sms) {
  const DeviceProps dev = current_device_props(num_sms);
  return std::max(plan_split(p, true, dev).workspace, plan_split(p, false, dev).workspace);
}

SplitPlan attention_plan(const AttentionParams& p, const uint8_t* past_key, const uint8_t* past_value, int num_sms) {
  return plan_split(p, aligned16(past_key, past_value), current_device_props(num_sms));
}

SplitKernel last_split_kernel() { return static_cast<SplitKernel>(last_kernel.load()); }

bool fuses_rotary(const AttentionParams& p, const uint8_t* past_key, const uint8_t* past_value) {
  return p.q_len == 1 && p.new_len == 1 &&
         (p.past_len == 0 || attention_plan(p, past_key, past_value).kernel == SplitKernel::kTensorCoreBulk);
}

cudaError_t attention(const AttentionParams& p, const void* q, const void* k, const void* v, const void* mask,
                      const uint8_t* past_key, const uint8_t* past_value, void* y, uint8_t* present_key,
                      uint8_t* present_value, void* workspace, int num_sms, cudaStream_t stream,
                      const RotaryParams* rotary) {
  if (!caches_aligned(past_key, past_value, present_key, present_value)) return cudaErrorMisalignedAddress;
  const RotaryParams rot = rotary ? *rotary : RotaryParams{};
  // the one plan of this call: its kernel, splits (of the query rows: none when q_len is 0) and
  // shared memory; the workspace was sized by the same planner
  const SplitPlan plan = attention_plan(p, past_key, past_value, num_sms);
  const bool fused = p.q_len == 1 && p.new_len == 1 && (p.past_len == 0 || plan.kernel == SplitKernel::kTensorCoreBulk);
  if (rot.rotary_dim > 0 && !fused) return cudaErrorInvalidValue;
  cudaError_t e = copy_past(p, past_key, present_key, past_value, present_value, num_sms, stream);
  if (e != cudaSuccess) return e;
  if (p.batch == 0) return cudaSuccess;
  const Layout& l = plan.layout;
  const bool split = plan.kernel != SplitKernel::kNone;
  last_kernel.store(static_cast<int>(plan.kernel));
  if (split) {
    float* part = static_cast<float*>(workspace);
    switch (plan.kernel) {
      case SplitKernel::kTensorCoreBulk: e = launch_tc_split(p, rot, plan, q, mask, past_key, past_value, part, stream); break;
      case SplitKernel::kTensorCoreMma: e = launch_mma_split(p, plan, q, past_key, past_value, part, stream); break;
      case SplitKernel::kTensorCoreChunk: e = launch_chunk_split(p, plan, q, past_key, past_value, part, stream); break;
      case SplitKernel::kDensePrefill:
        e = launch_dense_prefill_split(p, plan, q, past_key, past_value, y, part, static_cast<uint8_t*>(workspace), stream);
        break;
#ifdef TQ_SM90A
      case SplitKernel::kTensorCoreChunkWgmma:
        e = launch_chunk_split_sm90(p, plan, q, past_key, past_value, part, stream);
        break;
#endif
      default: e = launch_cuda_core_split(p, plan, q, mask, past_key, past_value, part, stream); break;
    }
    if (e != cudaSuccess) return e;
    if ((e = cudaGetLastError()) != cudaSuccess) return e;
    if (plan.new_part && prefill_supported(p, q, k, v, mask, y)) {  // a continuation chunk's new tokens on tensor cores
      float* new_part = reinterpret_cast<float*>(static_cast<uint8_t*>(workspace) + plan.new_part_offset);
      if ((e = launch_prefill(p, q, k, v, mask, y, new_part, stream)) != cudaSuccess) return e;
      return finish(p, rot, l, q, k, v, mask, part, new_part, y, present_key, present_value, false, stream);
    }
  } else if (p.past_len == 0 && prefill_supported(p, q, k, v, mask, y)) {  // a first prompt: its rows on tensor cores
    if ((e = launch_prefill(p, q, k, v, mask, y, nullptr, stream)) != cudaSuccess) return e;
    Layout packs_only = l;
    packs_only.rows = 0;  // the finish kernel then only packs the new tokens
    return finish(p, rot, packs_only, q, k, v, mask, nullptr, nullptr, y, present_key, present_value, false, stream);
  }
  return finish(p, rot, l, q, k, v, mask, static_cast<const float*>(workspace), nullptr, y, present_key, present_value,
                split, stream);
}

}  // namespace turboquant::cuda
