// TQPagedAttention on the GPU: the packed batch's sequences as TQGroupQueryAttention calls over the
// pool (AttentionParams::blocks): each run of consecutive one-token sequences (decode steps) as one
// batched call, each sequence with several new tokens (first prompts, chunks) as a call of its own.
// The host knows every sequence's token count and past (cumulative_sequence_length and past_seqlens
// in host memory) to choose the calls and their plans; the kernels read the past lengths and the
// block table on the device.
#include <algorithm>
#include <cstring>

#include "turboquant/cuda_kernels.h"

namespace turboquant::cuda {
namespace {

size_t align256(size_t n) { return (n + 255) / 256 * 256; }

// Calls f(call params, first sequence) for each call of the batch, in order.
template <typename F>
void for_each_call(const AttentionParams& p, const int32_t* cumulative, const int32_t* past, F&& f) {
  for (int64_t b = 0; b < p.batch;) {
    const int64_t count = cumulative[b + 1] - cumulative[b];
    int64_t end = b + 1;
    if (count == 1) {
      while (end < p.batch && cumulative[end + 1] - cumulative[end] == 1) ++end;
    }
    if (count > 0) {
      AttentionParams s = p;
      s.batch = end - b;
      s.q_len = s.new_len = count;
      s.past_len = *std::max_element(past + b, past + end);
      s.past_rows = s.present_rows = 0;
      s.blocks = p.blocks.from(b);
      if (count == 1) {  // one token a sequence: the next sequence's is one token on
        s.q.b = s.q.s;
        s.k.b = s.k.s;
        s.v.b = s.v.s;
        s.y.b = s.y.s;
      }
      f(s, b);
    }
    b = end;
  }
}

}  // namespace

size_t paged_workspace_bytes(const AttentionParams& p, const RotaryParams& rot, const int32_t* cumulative,
                             const int32_t* past, int num_sms) {
  size_t most = 0;
  for_each_call(p, cumulative, past, [&](const AttentionParams& s, int64_t) {
    most = std::max(most, gqa_workspace_bytes(s, rot, num_sms));
  });
  return align256(static_cast<size_t>(p.batch) * sizeof(int32_t)) + most;
}

cudaError_t paged_attention(const AttentionParams& p, const RotaryParams& rot, const int32_t* cumulative,
                            const int32_t* past, const void* q, const void* k, const void* v,
                            const uint8_t* key_cache, const uint8_t* value_cache, void* y, uint8_t* key_pool,
                            uint8_t* value_pool, void* workspace, int num_sms, cudaStream_t stream) {
  if (!caches_aligned(key_cache, value_cache, key_pool, value_pool)) return cudaErrorMisalignedAddress;
  const auto pool_bytes = static_cast<size_t>(p.blocks.num_blocks * p.blocks.block_bytes);
  cudaError_t e = cudaSuccess;
  if (key_pool != key_cache && (e = cudaMemcpyAsync(key_pool, key_cache, pool_bytes, cudaMemcpyDeviceToDevice, stream))) return e;
  if (value_pool != value_cache &&
      (e = cudaMemcpyAsync(value_pool, value_cache, pool_bytes, cudaMemcpyDeviceToDevice, stream))) {
    return e;
  }
  // the past lengths on the device, where the kernels read each sequence's (rotary positions, rows)
  auto* lengths = static_cast<int32_t*>(workspace);
  if ((e = cudaMemcpyAsync(lengths, past, static_cast<size_t>(p.batch) * sizeof(int32_t), cudaMemcpyHostToDevice,
                           stream))) {
    return e;
  }
  void* scratch = static_cast<uint8_t*>(workspace) + align256(static_cast<size_t>(p.batch) * sizeof(int32_t));
  const int64_t es = dtype_size(p.dtype);
  auto at = [es](const void* base, int64_t elements) { return static_cast<const uint8_t*>(base) + elements * es; };
  for_each_call(p, cumulative, past, [&](AttentionParams s, int64_t b) {
    if (e != cudaSuccess) return;
    const int64_t first = cumulative[b];
    s.past_lens = lengths + b;
    s.past_lens_bias = 0;
    e = gqa_attention_with_lengths(s, rot, at(q, first * p.q.s), at(k, first * p.k.s), at(v, first * p.v.s),
                                   key_pool, value_pool, static_cast<uint8_t*>(y) + first * p.y.s * es, key_pool,
                                   value_pool, scratch, num_sms, stream);
  });
  return e;
}

}  // namespace turboquant::cuda
