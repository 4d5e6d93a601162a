// TQGroupQueryAttention's shape contract: com.microsoft GroupQueryAttention's inputs and attributes
// over packed uint8 caches in a preallocated (possibly shared) buffer, turned into the kernels'
// AttentionParams and RotaryParams, or an InvalidArgument naming what was wrong.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "turboquant/attention_setup.h"  // Dims, InvalidArgument
#include "turboquant/params.h"

namespace turboquant {

// The attributes GroupQueryAttention and PagedAttention share, and turboquant's formats.
struct GroupedAttrs {
  Format key_format = Format::kMse4, value_format = Format::kUint4;
  bool norm_correction = true;
  int64_t num_heads = 0, kv_num_heads = 0;
  float scale = 0.f;
  bool do_rotary = false, rotary_interleaved = false;
  int64_t local_window_size = -1;  // -1: none; > 0: the window W (AttentionParams::window)
  float softcap = 0.f;              // 0: none
  void validate(const char* op) const;  // throws InvalidArgument("<op>: ...")
};

struct GqaAttrs : GroupedAttrs {
  // ORT's sliding_window_cache: past_key's rows are a window-sized buffer of capacity C >= W in the
  // layout of turboquant/window_cache.h, and present has C rows
  bool sliding_window_cache = false;
  // GroupQueryAttention features this op does not implement; validate() refuses other values.
  int64_t qk_output = 0;
  bool smooth_softmax = false;
  void validate() const;  // throws InvalidArgument
};

// Input shapes, by GroupQueryAttention's input order (key/value absent: QKV packed in query).
struct GqaShapes {
  Dims query;
  std::optional<Dims> key, value;
  Dims past_key, past_value, seqlens_k, total_sequence_length;
  std::optional<Dims> cos_cache, sin_cache, position_ids, attention_bias, head_sink, key_offset, value_offset;
  std::optional<Dims> key_scale;  // turboquant's, after value_offset
};

struct GqaSetup {
  // q, k, v strides are in elements from the base pointers below; past_len = total - S (the most any
  // sequence may have); past_lens, offsets, rotary tables and key_scale are left for the adapter to set.
  AttentionParams params;
  RotaryParams rotary;  // rotary_dim and max_positions set when do_rotary
  bool packed_qkv = false;
  int64_t k_first = 0, v_first = 0;  // element offsets of K and V inside `query` when packed_qkv
  bool first_prompt = false;         // S == total_sequence_length: every sequence starts at 0
  bool position_ids = false;         // positions given: check_position_ids checks them, not the past lengths
  Dims y, present_key, present_value;
};

GqaSetup setup_gqa(const GqaAttrs& attrs, const GqaShapes& shapes, DType dtype, int64_t total_sequence_length);

// Each sequence's past length from seqlens_k (host memory): 0 for a first prompt, else
// seqlens_k[b] + 1 - S; checked against the buffers and the rotary table (a window-sized buffer is
// shorter than the sequence it serves: its rows are gqa_attention's to map). Throws InvalidArgument.
std::vector<int32_t> gqa_past_lengths(const GqaSetup& setup, const int32_t* seqlens_k);

// position_ids (host memory, [B, S]) inside the rotary table. Throws InvalidArgument.
void check_position_ids(const GqaSetup& setup, const int64_t* position_ids);

// key_scale (host memory, one value per rotated channel of a KV head): positive and finite, as the
// keys are divided by it before packing. Throws InvalidArgument.
// op: the name the message starts with (TQPagedAttention shares the check).
void check_key_scale(const float* key_scale, int64_t count, const char* op = "TQGroupQueryAttention");

}  // namespace turboquant
