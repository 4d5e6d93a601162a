// TQPagedAttention on the CPU: each sequence of the packed batch through the TQGroupQueryAttention
// kernel as a batch of one, its cached rows addressed through its row of the block table
// (AttentionParams::row_offset), its new rows packed into their slots in place.
#include <cstring>

#include "turboquant/cpu_kernels.h"

namespace turboquant::cpu {
namespace {

// New tokens below which a sequence's call has few tasks (attention.cpp's decode path: one per KV
// head and 8 query rows), so sequences, not their tasks, are spread over the threads.
constexpr int64_t kFewTokens = 32;

}  // namespace

void paged_attention(const AttentionParams& p, const RotaryParams& rot, const int32_t* cumulative,
                     const int32_t* past_seqlens, const void* q, const void* k, const void* v,
                     const uint8_t* key_cache, const uint8_t* value_cache, void* y,
                     uint8_t* key_pool, uint8_t* value_pool, const ParallelFor& pfor) {
  const auto pool_bytes = static_cast<size_t>(p.blocks.num_blocks * p.blocks.block_bytes);
  if (key_pool != key_cache) std::memcpy(key_pool, key_cache, pool_bytes);
  if (value_pool != value_cache) std::memcpy(value_pool, value_cache, pool_bytes);
  const int64_t es = dtype_size(p.dtype);
  auto at = [es](const void* base, int64_t elements) { return static_cast<const uint8_t*>(base) + elements * es; };
  auto* y_bytes = static_cast<uint8_t*>(y);
  // Sequences write disjoint slots (check_paged_tables refuses shared blocks), so they may run at once.
  auto sequence = [&](int64_t b, const ParallelFor& inner) {
    const int64_t first = cumulative[b], count = cumulative[b + 1] - cumulative[b];
    if (count == 0) return;  // a sequence with no new token has no output row and no new cache row
    AttentionParams s = p;
    s.batch = 1;
    s.q_len = s.new_len = count;
    s.past_len = past_seqlens[b];
    s.past_lens = past_seqlens + b;
    s.past_rows = s.present_rows = 0;
    s.blocks = p.blocks.from(b);
    gqa_attention(s, rot, at(q, first * p.q.s), at(k, first * p.k.s), at(v, first * p.v.s), key_pool, value_pool,
                  y_bytes + first * p.y.s * es, key_pool, value_pool, inner);
  };
  bool few = true;
  for (int64_t b = 0; b < p.batch && few; ++b) few = cumulative[b + 1] - cumulative[b] < kFewTokens;
  if (few && p.batch > 1) {
    const ParallelFor serial = serial_for;
    pfor(static_cast<size_t>(p.batch), [&](size_t b) { sequence(static_cast<int64_t>(b), serial); });
    return;
  }
  for (int64_t b = 0; b < p.batch; ++b) sequence(b, pfor);
}

}  // namespace turboquant::cpu
