// Parameters shared by the CPU and CUDA kernels: offsets, layouts and the attention call.
#pragma once

#include <cstdint>

#include "turboquant/format.h"

namespace turboquant {

// Optional per-head offsets, float32 [rows, D]: vector v uses row (v / period) % rows.
// (For a cache laid out [B, H, S, D]: rows = H, period = S.) data == nullptr means no offset.
struct Offset {
  const float* data = nullptr;
  int64_t rows = 1;
  int64_t period = 1;
  TQ_HD const float* row_for(int64_t v, int d) const { return data ? data + ((v / period) % rows) * d : nullptr; }
};

// Sequence b's past length: lens[b] + bias clamped to [0, max_len] (lengths in device memory cannot
// be checked before a launch, so the kernels clamp them), or max_len when there are no lengths.
// The bias lets GroupQueryAttention's seqlens_k (total length - 1) serve as they are.
TQ_HD int64_t sequence_past(const int32_t* lens, int64_t b, int64_t max_len, int64_t bias = 0) {
  if (!lens) return max_len;
  const int64_t n = lens[b] + bias;
  return n < 0 ? 0 : (n > max_len ? max_len : n);
}

// Strides (in elements) of a [B, H, S, D] view of a tensor stored as [B, H, S, D] or [B, S, H*D].
struct BhsStrides {
  int64_t b = 0, h = 0, s = 0;
};

enum class MaskType : int { kNone = 0, kBool, kFloat32, kFloat16, kBFloat16 };

// A pool of KV blocks (TQPagedAttention): num_blocks blocks of block_bytes bytes; row r of (b, h) is
// slot s = r % block_size of block table[b * max_blocks + r / block_size], at byte
// (h * block_size + s) * row bytes of it: head-major inside a block, so that a head's rows of one
// block lie back to back as in the contiguous layouts.
struct BlockTable {
  const int32_t* table = nullptr;  // host memory for the CPU kernels (checked by the adapter), device for CUDA
  int64_t block_size = 0, max_blocks = 0, block_bytes = 0, num_blocks = 0;

  // (a block id outside the pool, which only an unchecked table on the device can hold, is taken as
  // block 0's: the kernels stay inside the pool)
  TQ_HD int64_t row_offset(int64_t b, int64_t h, int64_t r, int64_t row_bytes) const {
    int64_t block = table[b * max_blocks + r / block_size];
    block = block >= 0 && block < num_blocks ? block : 0;
    return block * block_bytes + (h * block_size + r % block_size) * row_bytes;
  }
  // The table of sequences b.. (a sub-batch's)
  TQ_HD BlockTable from(int64_t b) const {
    BlockTable t = *this;
    t.table += b * max_blocks;
    return t;
  }
};

struct AttentionParams {
  int64_t batch = 0, q_heads = 0, kv_heads = 0;
  int64_t q_len = 0;     // Sq: query tokens in this call
  int64_t new_len = 0;   // new K/V tokens in this call
  int64_t past_len = 0;  // S_past: tokens already in the packed cache
  int head_dim = 0;      // D of Q and K
  int v_head_dim = 0;    // D of V and Y
  Format key_format = Format::kMse4, value_format = Format::kUint4;
  bool norm_correction = true;
  bool is_causal = false;
  float scale = 0.f;  // softmax scale; the adapter resolves the 1/sqrt(D) default
  DType dtype = DType::kFloat32;  // of Q, K, V and Y
  BhsStrides q, k, v, y;
  MaskType mask_type = MaskType::kNone;
  int64_t mask_stride[4] = {0, 0, 0, 0};  // b, hq, q, k strides in elements; 0 where broadcast
  const float* key_offset = nullptr;      // [kv_heads, head_dim] or nullptr
  const float* value_offset = nullptr;    // [kv_heads, v_head_dim] or nullptr
  // GroupQueryAttention's local_window_size: the query at position p sees keys p - window + 1 .. p
  // (window keys, itself included; ONNX Runtime's definition); 0: no window
  int64_t window = 0;
  // > 0: each score s (scaled, before any mask) becomes softcap * tanh(s / softcap) (Gemma 2)
  float softcap = 0.f;
  // [q_heads] of dtype, in the memory the caches are in, or null: head h's softmax denominator gains
  // exp(head_sink[h] - m), m the larger of the row's largest score and head_sink[h] (gpt-oss)
  const void* head_sink = nullptr;

  // Caches in preallocated buffers (GroupQueryAttention's shared past/present): rows per (b, h) of
  // each buffer, bytes per row (>= the packed size; padding bytes are never interpreted) and each sequence's
  // own past length (<= past_len, which is then their maximum). Left at 0 / nullptr they mean the
  // dense TQAttention layout. When present_key == past_key the past rows are not copied: the new
  // rows are written in place.
  int64_t past_rows = 0, present_rows = 0;
  int64_t key_row_bytes = 0, value_row_bytes = 0;
  const int32_t* past_lens = nullptr;  // [batch]: host memory for the CPU kernels, device for CUDA
  int64_t past_lens_bias = 0;          // added to each past_lens[b]
  // TQGroupQueryAttention's sliding_window_cache: C, the rows of a window-sized buffer
  // (turboquant/window_cache.h), 0 when the buffer is full-length. past_lens are then the absolute
  // pasts the rotary turns by; gqa_attention maps them to rows before the attention kernels run.
  int64_t window_cache = 0;
  // Paged caches (TQPagedAttention): past and present are one pool, updated in place (BlockTable).
  // Default (no table): the contiguous layouts above.
  BlockTable blocks;

  TQ_HD int64_t past_rows_or_len() const { return past_rows ? past_rows : past_len; }
  TQ_HD int64_t present_rows_or_total() const { return present_rows ? present_rows : past_len + new_len; }
  TQ_HD int64_t key_row() const { return key_row_bytes ? key_row_bytes : packed_size(key_format, head_dim); }
  TQ_HD int64_t value_row() const { return value_row_bytes ? value_row_bytes : packed_size(value_format, v_head_dim); }
  // Byte offset of row r of (b, h) in a cache of `rows` rows per (b, h) (paged: in the pool), every
  // kernel's one way to a cached row.
  TQ_HD int64_t row_offset(int64_t b, int64_t h, int64_t r, int64_t rows, int64_t row_bytes) const {
    return blocks.table ? blocks.row_offset(b, h, r, row_bytes) : ((b * kv_heads + h) * rows + r) * row_bytes;
  }
  // Rows from r on that lie back to back: to the end of r's block when paged, all of them otherwise
  TQ_HD int64_t run_length(int64_t r) const { return blocks.table ? blocks.block_size - r % blocks.block_size : INT64_MAX; }
  // sequence b's past length, within past_len and the past buffer's rows (lengths read on the device
  // are clamped, not checked: no row past the buffer is read)
  // (a window-sized buffer's absolute past is bounded by past_len alone)
  TQ_HD int64_t past_of(int64_t b) const {
    const int64_t rows = window_cache ? past_len : past_rows_or_len();
    return sequence_past(past_lens, b, past_len < rows ? past_len : rows, past_lens_bias);
  }
  // The first row of each (b, h) that a fresh present (not past's buffer) of the preallocated
  // layout gets zeroed from: the rows past the copied past, which the new tokens reach for some
  // sequences only and then not in their padding bytes. present_rows_or_total() when nothing is to
  // be zeroed: a shared buffer, or the dense layout, which the past and the new tokens fill.
  TQ_HD int64_t zeroed_from(const uint8_t* past, const uint8_t* present) const {
    if (present_rows == 0 || past == present) return present_rows_or_total();
    const int64_t from = past ? past_rows_or_len() : 0;
    return from < present_rows ? from : present_rows;
  }
};

// Rotary embedding of Q and the new K inside the op (GroupQueryAttention's do_rotary), as ORT's
// RotaryEmbedding: the first rotary_dim elements of each head turn by the angle of the token's
// position; halves (x[i], x[i + rotary_dim/2]) or, interleaved, neighbours (x[2i], x[2i+1]).
struct RotaryParams {
  int rotary_dim = 0;  // 0: no rotary; else 2 * cos_cache.shape[1] (<= head_dim)
  bool interleaved = false;
  int64_t max_positions = 0;                  // rows of cos and sin
  const void* cos = nullptr;                  // [max_positions, rotary_dim / 2], Q's dtype
  const void* sin = nullptr;
  const int64_t* position_ids = nullptr;      // [B, S], or null: position = the sequence's past + s
  // [kv_heads, head_dim] or null: after the rotation, query channels multiplied by their KV head's
  // row and key channels divided by it (every score unchanged; TQGroupQueryAttention's key_scale)
  const float* key_scale = nullptr;
};

}  // namespace turboquant
