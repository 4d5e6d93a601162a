// The new tokens' own attention on tensor cores for calls with no past (prefill.cu).
#pragma once

#include <cuda_runtime_api.h>

#include "turboquant/params.h"

namespace turboquant::cuda::detail {

// Whether launch_prefill computes Y for these parameters and tensors: no past, several query rows,
// fp16 or bf16, head size 64 or 128, rows at 16-byte boundaries (any mask TQAttention takes).
bool prefill_supported(const AttentionParams& p, const void* q, const void* k, const void* v, const void* mask,
                       const void* y);
// Y of every query row over the call's new K/V (causal when p.is_causal, masked by mask where given),
// as the merge of the finish kernel would write it.
cudaError_t launch_prefill(const AttentionParams& p, const void* q, const void* k, const void* v, const void* mask,
                           void* y, cudaStream_t stream);

}  // namespace turboquant::cuda::detail
