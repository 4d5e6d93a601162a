// CUDA kernels of the turboquant ops: device pointers, sizes and a stream; no runtime types.
// Every launcher enqueues on `stream`, never synchronises and returns the launch status.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "turboquant/format.h"
#include "turboquant/params.h"

namespace turboquant::cuda {

// x: n vectors of d elements of type dt; out: n * packed_size(fmt, d) bytes. Byte-identical to
// the CPU kernels.
cudaError_t pack(Format fmt, int d, bool norm_correction, DType dt, const void* x, int64_t n, const Offset& offset,
                 uint8_t* out, cudaStream_t stream);
cudaError_t unpack(Format fmt, int d, const uint8_t* in, int64_t n, const Offset& offset, DType dt, void* out,
                   cudaStream_t stream);

// New tokens x [B, H, N, d] (strides st, in elements) minus offset[h] (float32 [H, d], or null),
// packed into rows past_len .. past_len+N-1 of present [B, H, past_len+N, bytes].
cudaError_t pack_new_tokens(Format fmt, int d, bool norm_correction, DType dt, const void* x, const BhsStrides& st,
                            int64_t batch, int64_t heads, int64_t new_len, int64_t past_len, const float* offset,
                            uint8_t* present, cudaStream_t stream);

// Scratch the attention needs (split-KV partial results), in bytes; 0 means none.
size_t attention_workspace_bytes(const AttentionParams& p, int num_sms);

// TQAttention: present = past ++ pack(new); Y over the packed past (split-KV, merged with
// log-sum-exp) and the exact new tokens. workspace: attention_workspace_bytes(p, num_sms) bytes.
cudaError_t attention(const AttentionParams& p, const void* q, const void* k, const void* v, const void* mask,
                      const uint8_t* past_key, const uint8_t* past_value, void* y, uint8_t* present_key,
                      uint8_t* present_value, void* workspace, int num_sms, cudaStream_t stream);

}  // namespace turboquant::cuda
