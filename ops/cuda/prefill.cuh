// The new tokens' own attention on tensor cores for calls of several query rows (prefill.cu).
#pragma once

#include <cuda_runtime_api.h>

#include "turboquant/params.h"
#include "turboquant/split_plan.h"

namespace turboquant::cuda::detail {

// Whether launch_prefill takes these parameters and tensors: the planner's shapes
// (new_tokens_on_tensor_cores), rows at 16-byte boundaries (any mask TQAttention takes).
bool prefill_supported(const AttentionParams& p, const void* q, const void* k, const void* v, const void* mask,
                       const void* y);
// Every query row's attention over the call's new K/V (causal when p.is_causal, masked by mask where
// given, its columns after each sequence's past): Y, as the finish kernel's merge would write it, when
// part is null; else (max, sum, acc[Dv]) per row at part, laid out as the split kernels' partial
// results of one split (the finish kernel merges them with the past's).
// The kernel is the planner's (plan_prefill) unless `kernel` names one (developer probes compare them).
cudaError_t launch_prefill(const AttentionParams& p, const void* q, const void* k, const void* v, const void* mask,
                           void* y, float* part, cudaStream_t stream, PrefillKernel kernel = PrefillKernel::kNone);
// prefill_sm90.cu (in builds with sm_90a code): launch_prefill's wgmma kernel, without a mask;
// cudaErrorNotSupported where the driver cannot encode its tensor maps.
cudaError_t launch_prefill_sm90(const AttentionParams& p, const void* q, const void* k, const void* v, void* y,
                                float* part, cudaStream_t stream);

}  // namespace turboquant::cuda::detail
