// TQPagedAttention's shape contract: com.microsoft PagedAttention's inputs and attributes over pools
// of packed uint8 KV blocks, turned into the kernels' AttentionParams and RotaryParams, or an
// InvalidArgument naming what was wrong.
#pragma once

#include <cstdint>
#include <optional>

#include "turboquant/attention_setup.h"  // Dims, InvalidArgument
#include "turboquant/gqa_setup.h"        // GroupedAttrs
#include "turboquant/params.h"

namespace turboquant {

struct PagedAttrs : GroupedAttrs {
  void validate() const;  // throws InvalidArgument
};

// Input shapes, by TQPagedAttention's input order (key/value absent: QKV packed in query).
struct PagedShapes {
  Dims query;
  std::optional<Dims> key, value;
  Dims key_cache, value_cache, cumulative_sequence_length, past_seqlens, block_table;
  std::optional<Dims> cos_cache, sin_cache, head_sink, key_offset, value_offset, key_scale;
};

struct PagedSetup {
  // What every sequence's call shares: heads, formats, scale, window, softcap, the rows' packed
  // bytes, block_size, block_bytes, num_blocks and max_blocks; batch = the number of sequences. q, k, v, y strides are per token
  // (s: elements from one token to the next, h: from one head to the next, b unused): the kernel
  // runs one sequence at a time from its first token. Pointers are the adapter's to set.
  AttentionParams params;
  RotaryParams rotary;  // rotary_dim and max_positions set when do_rotary
  bool packed_qkv = false;
  int64_t k_first = 0, v_first = 0;  // element offsets of K and V inside `query` when packed_qkv
  int64_t tokens = 0;
  Dims y;
};

PagedSetup setup_paged(const PagedAttrs& attrs, const PagedShapes& shapes, DType dtype);

// cumulative_sequence_length [B + 1], past_seqlens [B] and block_table [B, max_blocks] (host memory)
// against each other and the pool: lengths from 0 to the token count, non-decreasing; every block a
// sequence holds after the call (its first ceil((past + new) / block_size)) mapped, inside the pool,
// and held by no other sequence nor twice (the new rows are written in place, and a block two
// sequences share would make the result depend on their order); positions inside the rotary table.
// block_table null (device memory, the CUDA kernels'): the lengths alone. Throws InvalidArgument.
void check_paged_tables(const PagedSetup& setup, const int32_t* cumulative, const int32_t* past_seqlens,
                        const int32_t* block_table);

}  // namespace turboquant
