// The launches of a TQAttention call besides the split kernels (attention.cu runs them in order):
// the copy of the past into a present of its own (copy.cu) and the merge and packing (finish.cu).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "turboquant/params.h"
#include "turboquant/split_plan.h"

namespace turboquant::cuda::detail {

// present = past (both caches), unless present is past's buffer; a fresh preallocated present's rows
// after the past zeroed (AttentionParams::zeroed_from).
cudaError_t copy_past(const AttentionParams& p, const uint8_t* past_key, uint8_t* present_key,
                      const uint8_t* past_value, uint8_t* present_value, int num_sms, cudaStream_t stream);

// The merge of every query row (the split kernel's partial results when after_split or partial is
// given, the new tokens exactly or new_part, prefill.cu's part of them) and the packing of the new
// tokens into present, in one launch, a programmatic dependent one. l.rows 0: packing only.
cudaError_t finish(const AttentionParams& p, const RotaryParams& rot, const SplitLayout& l, const void* q,
                   const void* k, const void* v, const void* mask, const float* partial, const float* new_part,
                   void* y, uint8_t* present_key, uint8_t* present_value, bool after_split, cudaStream_t stream);

}  // namespace turboquant::cuda::detail
