// CUDA kernels of the turboquant ops: device pointers, sizes and a stream; no runtime types.
// Every launcher enqueues on `stream`, never synchronises and returns the launch status.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "turboquant/format.h"
#include "turboquant/params.h"
#include "turboquant/split_plan.h"

namespace turboquant::cuda {

// x: n vectors of d elements of type dt; out: n * packed_size(fmt, d) bytes. Byte-identical to
// the CPU kernels.
cudaError_t pack(Format fmt, int d, bool norm_correction, DType dt, const void* x, int64_t n, const Offset& offset,
                 uint8_t* out, cudaStream_t stream);
cudaError_t unpack(Format fmt, int d, const uint8_t* in, int64_t n, const Offset& offset, DType dt, void* out,
                   cudaStream_t stream);

// Where the attention writes the new tokens: sequence b's new rows start at past_of(b) in a cache of
// present_rows rows of row_bytes bytes per (b, h), or in a pool of blocks (present_rows: the rows
// the table maps); rows beyond the cache are skipped.
struct NewTokenRows {
  int64_t present_rows = 0, row_bytes = 0, past_len = 0;
  const int32_t* past_lens = nullptr;  // device memory, or null: every sequence has past_len
  int64_t past_lens_bias = 0;
  BlockTable blocks;
  TQ_HD int64_t past_of(int64_t b) const { return sequence_past(past_lens, b, past_len, past_lens_bias); }
  TQ_HD int64_t offset(int64_t bh, int64_t b, int64_t h, int64_t row) const {
    return blocks.table ? blocks.row_offset(b, h, row, row_bytes) : (bh * present_rows + row) * row_bytes;
  }
};

// The packed caches of attention() and gqa_attention() must start at multiples of this many bytes
// (cudaErrorMisalignedAddress otherwise): their kernels read and write rows in 2- and 4-byte words
// (a cache at an odd address faulted). ONNX Runtime's and TensorRT's allocations are 256-byte
// aligned; only a caller's own pointer can be less.
constexpr uintptr_t kCacheAlignment = 4;
inline bool caches_aligned(const uint8_t* past_key, const uint8_t* past_value, const uint8_t* present_key,
                           const uint8_t* present_value) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(past_key) | reinterpret_cast<uintptr_t>(past_value) |
                      reinterpret_cast<uintptr_t>(present_key) | reinterpret_cast<uintptr_t>(present_value);
  return a % kCacheAlignment == 0;
}

// Scratch the attention needs (split-KV partial results), in bytes; 0 means none. Enough for caches
// at any address (the split kernel can depend on their alignment).
size_t attention_workspace_bytes(const AttentionParams& p, int num_sms);

// The split-KV plan attention() follows for these parameters and caches on the current device
// (plan_split with its properties; num_sms 0: the device's multiprocessors).
SplitPlan attention_plan(const AttentionParams& p, const uint8_t* past_key, const uint8_t* past_value, int num_sms = 0);
// The split kernel of the process's latest attention() call (kNone: it had no past or no queries),
// for tests that check which kernel ran.
SplitKernel last_split_kernel();
// The kernel of the new tokens of the process's latest call with several query rows on tensor cores
// (kNone before any), for tests that check which kernel ran.
PrefillKernel last_prefill_kernel();

// TQAttention: present = past ++ pack(new); Y over the packed past (split-KV, merged with
// log-sum-exp) and the exact new tokens. workspace: attention_workspace_bytes(p, num_sms) bytes.
// rotary (where fuses_rotary, else cudaErrorInvalidValue): Q and the new K are not rotated yet,
// and the kernels apply this rotary embedding as they load them (rounded to p.dtype, as a rotated
// copy would hold them), instead of a launch that writes rotated copies first.
cudaError_t attention(const AttentionParams& p, const void* q, const void* k, const void* v, const void* mask,
                      const uint8_t* past_key, const uint8_t* past_value, void* y, uint8_t* present_key,
                      uint8_t* present_value, void* workspace, int num_sms, cudaStream_t stream,
                      const RotaryParams* rotary = nullptr);

// Whether attention() applies a rotary embedding itself for these parameters and caches: a decode
// step (one query position, one new token) whose past the tensor-core split kernel reads (or that
// has no past).
bool fuses_rotary(const AttentionParams& p, const uint8_t* past_key, const uint8_t* past_value);

// TQGroupQueryAttention: each sequence's past length from seqlens_k (device memory; 0 for a first
// prompt, else seqlens_k[b] + 1 - S, clamped to the buffers since it cannot be checked before the
// launch), rotary (when rot.rotary_dim > 0) on Q and the new K, then attention() over buffers that
// may be shared (present_key == past_key: the new rows are written in place). p.past_lens is set
// here; p.past_len must be total_sequence_length - S. workspace: gqa_workspace_bytes(...) bytes.
size_t gqa_workspace_bytes(const AttentionParams& p, const RotaryParams& rot, int num_sms);
cudaError_t gqa_attention(const AttentionParams& p, const RotaryParams& rot, const int32_t* seqlens_k,
                          bool first_prompt, const void* q, const void* k, const void* v, const uint8_t* past_key,
                          const uint8_t* past_value, void* y, uint8_t* present_key, uint8_t* present_value,
                          void* workspace, int num_sms, cudaStream_t stream);

// gqa_attention's rotary and attention with p.past_lens (device memory) already set: the rows of each
// sequence's past, positions from them or rot.position_ids. workspace: gqa_workspace_bytes(p, ...).
cudaError_t gqa_attention_with_lengths(const AttentionParams& p, const RotaryParams& rot, const void* q,
                                       const void* k, const void* v, const uint8_t* past_key,
                                       const uint8_t* past_value, void* y, uint8_t* present_key,
                                       uint8_t* present_value, void* workspace, int num_sms, cudaStream_t stream);

// TQPagedAttention (p from setup_paged, p.blocks.table on the device): cumulative [B + 1] and past
// [B] in host memory, checked (check_paged_tables without the table); the pools key_pool/value_pool
// are updated in place (key_cache/value_cache copied into them first when they are other buffers).
// workspace: paged_workspace_bytes(...) bytes.
size_t paged_workspace_bytes(const AttentionParams& p, const RotaryParams& rot, const int32_t* cumulative,
                             const int32_t* past, int num_sms);
cudaError_t paged_attention(const AttentionParams& p, const RotaryParams& rot, const int32_t* cumulative,
                            const int32_t* past, const void* q, const void* k, const void* v,
                            const uint8_t* key_cache, const uint8_t* value_cache, void* y, uint8_t* key_pool,
                            uint8_t* value_pool, void* workspace, int num_sms, cudaStream_t stream);

// gqa_attention over a window-sized buffer (p.window_cache = C > 0, turboquant/window_cache.h), which
// gqa_attention hands such calls to: lengths from seqlens_k on the device, the kept rows moved to the
// front (a decode step, in place) or the step run on a staging copy (several tokens). Any C >= W.
size_t window_cache_workspace_bytes(const AttentionParams& p, const RotaryParams& rot, int num_sms);
cudaError_t window_cache_attention(const AttentionParams& p, const RotaryParams& rot, const int32_t* seqlens_k,
                                   const void* q, const void* k, const void* v, const uint8_t* past_key,
                                   const uint8_t* past_value, void* y, uint8_t* present_key, uint8_t* present_value,
                                   void* workspace, int num_sms, cudaStream_t stream);

}  // namespace turboquant::cuda
