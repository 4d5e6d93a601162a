// The CUDA execution provider's half of the adapter: runs the validated call on ORT's compute
// stream with scratch from ORT's allocator. Without CUDA support compiled in, these fail with a
// message saying so (the CUDA registrations are then absent, so ORT never calls them).
#pragma once

#include "ort_utils.h"

namespace turboquant::ort {

bool cuda_compiled();

// The name of the split kernel the process's latest CUDA attention call ran ("none" without CUDA).
const char* cuda_last_split_kernel();
// The name of the kernel that attended the new tokens of the latest CUDA call with several query rows
// on tensor cores ("none" without CUDA).
const char* cuda_last_prefill_kernel();
// Whether the library holds the sm_90a kernels (prefill_sm90.cu).
bool cuda_sm90a_compiled();

void cuda_pack(OrtKernelContext* context, Format fmt, int d, bool norm_correction, DType dt, const void* x, int64_t n,
               const Offset& offset, uint8_t* out);
void cuda_unpack(OrtKernelContext* context, Format fmt, int d, const uint8_t* in, int64_t n, const Offset& offset,
                 DType dt, void* out);
void cuda_attention(OrtKernelContext* context, const AttentionParams& p, const void* q, const void* k, const void* v,
                    const void* mask, const uint8_t* past_key, const uint8_t* past_value, void* y,
                    uint8_t* present_key, uint8_t* present_value);

// TQGroupQueryAttention: seqlens_k in device memory; p.past_len = total_sequence_length - S.
void cuda_gqa(OrtKernelContext* context, const AttentionParams& p, const RotaryParams& rot, const int32_t* seqlens_k,
              bool first_prompt, const void* q, const void* k, const void* v, const uint8_t* past_key,
              const uint8_t* past_value, void* y, uint8_t* present_key, uint8_t* present_value);

// TQPagedAttention: cumulative and past_seqlens in host memory (checked), the block table in p on the device.
void cuda_paged(OrtKernelContext* context, const AttentionParams& p, const RotaryParams& rot, const int32_t* cumulative,
                const int32_t* past_seqlens, const void* q, const void* k, const void* v, const uint8_t* key_cache,
                const uint8_t* value_cache, void* y, uint8_t* key_pool, uint8_t* value_pool);

}  // namespace turboquant::ort
