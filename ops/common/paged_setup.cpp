#include "turboquant/paged_setup.h"

#include <cmath>
#include <tuple>
#include <utility>
#include <vector>

namespace turboquant {
namespace {

constexpr const char* kOp = "TQPagedAttention";

template <typename... Args>
[[noreturn]] void fail(Args&&... args) {
  throw_invalid(kOp, std::forward<Args>(args)...);
}

}  // namespace

void PagedAttrs::validate() const { GroupedAttrs::validate(kOp); }

PagedSetup setup_paged(const PagedAttrs& a, const PagedShapes& s, DType dtype) {
  a.validate();
  if (s.query.size() != 2) fail("input 'query' must be 2-D [num_tokens, hidden], got shape ", dims_str(s.query));
  PagedSetup r;
  const int64_t tokens = s.query[0], hq = a.num_heads, hkv = a.kv_num_heads;
  r.packed_qkv = !s.key;
  if (r.packed_qkv != !s.value) fail("inputs 'key' and 'value' must both be given or both be absent (packed QKV)");
  const int64_t heads_in_query = r.packed_qkv ? hq + 2 * hkv : hq;
  if (s.query[1] % heads_in_query != 0) {
    fail("input 'query' has last dimension ", s.query[1], ", not a multiple of ", heads_in_query,
         r.packed_qkv ? " (num_heads + 2 * kv_num_heads, packed QKV)" : " (num_heads)");
  }
  const int64_t d = s.query[1] / heads_in_query;
  if (!head_dim_supported(d)) {
    fail("head size ", d, " (from input 'query' ", dims_str(s.query), ") must be a multiple of 8 from ", kMinHeadDim,
         " to ", kMaxHeadDim);
  }
  if (!r.packed_qkv) {
    for (const auto* x : {&*s.key, &*s.value}) {
      if (*x != Dims{tokens, hkv * d}) {
        fail("input '", x == &*s.key ? "key" : "value", "' has shape ", dims_str(*x), "; expected [", tokens, ", ",
             hkv * d, "]");
      }
    }
  }
  const int64_t key_bytes = packed_size(a.key_format, static_cast<int>(d));
  const int64_t value_bytes = packed_size(a.value_format, static_cast<int>(d));
  const Dims& kc = s.key_cache;
  if (kc.size() != 4 || kc[0] <= 0 || kc[1] <= 0 || kc[2] <= 0 || kc[3] <= 0) {
    fail("input 'key_cache' has shape ", dims_str(kc), "; expected [num_blocks, block_size, heads, width]");
  }
  if (s.value_cache != kc) {
    fail("input 'value_cache' has shape ", dims_str(s.value_cache), "; expected key_cache's ", dims_str(kc));
  }
  // a block's KV heads take its first kv_num_heads * block_size rows of each format's packed size
  const int64_t slot = kc[2] * kc[3];
  for (const auto& [bytes, fmt, which] : {std::tuple{key_bytes, a.key_format, "key"},
                                          std::tuple{value_bytes, a.value_format, "value"}}) {
    if (hkv * bytes > slot) {
      fail("the pools' slots of ", kc[2], " x ", kc[3], " = ", slot, " bytes (", dims_str(kc), ") cannot hold ",
           hkv, " ", which, " rows of ", bytes, " bytes (", format_name(fmt), " vectors of head size ", d, ")");
    }
  }
  if (s.cumulative_sequence_length.size() != 1 || s.cumulative_sequence_length[0] < 2) {
    fail("input 'cumulative_sequence_length' has shape ", dims_str(s.cumulative_sequence_length),
         "; expected [batch_size + 1] with batch_size >= 1");
  }
  const int64_t b = s.cumulative_sequence_length[0] - 1;
  if (s.past_seqlens != Dims{b}) {
    fail("input 'past_seqlens' has shape ", dims_str(s.past_seqlens), "; expected [", b, "] (batch_size)");
  }
  if (s.block_table.size() != 2 || s.block_table[0] != b || s.block_table[1] <= 0) {
    fail("input 'block_table' has shape ", dims_str(s.block_table), "; expected [", b, ", max_blocks_per_sequence]");
  }
  auto check_offset = [&](const std::optional<Dims>& off, const char* name) {
    if (off && *off != Dims{hkv, d}) fail("input '", name, "' has shape ", dims_str(*off), "; expected [", hkv, ", ", d, "]");
  };
  check_offset(s.key_offset, "key_offset");
  check_offset(s.value_offset, "value_offset");
  if (s.head_sink && *s.head_sink != Dims{hq}) {
    fail("input 'head_sink' has shape ", dims_str(*s.head_sink), "; expected [", hq, "] (num_heads)");
  }

  AttentionParams& p = r.params;
  p.batch = b;
  p.q_heads = hq;
  p.kv_heads = hkv;
  p.head_dim = p.v_head_dim = static_cast<int>(d);
  p.key_format = a.key_format;
  p.value_format = a.value_format;
  p.norm_correction = a.norm_correction;
  p.is_causal = true;
  p.scale = a.scale > 0.f ? a.scale : 1.0f / std::sqrt(static_cast<float>(d));
  p.window = a.local_window_size > 0 ? a.local_window_size : 0;
  p.softcap = a.softcap;
  p.dtype = dtype;
  const int64_t row = s.query[1], kv_row = r.packed_qkv ? row : hkv * d;
  p.q = {0, d, row};
  p.k = p.v = {0, d, kv_row};
  p.y = {0, d, hq * d};
  r.k_first = r.packed_qkv ? hq * d : 0;
  r.v_first = r.packed_qkv ? (hq + hkv) * d : 0;
  p.key_row_bytes = key_bytes;
  p.value_row_bytes = value_bytes;
  p.blocks.block_size = kc[1];
  p.blocks.block_bytes = kc[1] * slot;
  p.blocks.num_blocks = kc[0];
  p.blocks.max_blocks = s.block_table[1];
  r.tokens = tokens;

  if (a.do_rotary) {
    if (!s.cos_cache || !s.sin_cache) fail("do_rotary = 1 needs inputs 'cos_cache' and 'sin_cache'");
    const Dims& c = *s.cos_cache;
    if (c.size() != 2 || *s.sin_cache != c || c[1] <= 0 || 2 * c[1] > d) {
      fail("inputs 'cos_cache' ", dims_str(c), " and 'sin_cache' ", dims_str(*s.sin_cache),
           " must both be [max_positions, rotary_dim / 2] with rotary_dim <= head size ", d);
    }
    r.rotary.rotary_dim = static_cast<int>(2 * c[1]);
    r.rotary.interleaved = a.rotary_interleaved;
    r.rotary.max_positions = c[0];
  }
  if (s.key_scale) {  // applied after the rotary; without it a model scales Q and K before the op
    if (!a.do_rotary) fail("input 'key_scale' needs do_rotary = 1 (without the rotary, scale Q and K before the op)");
    check_offset(s.key_scale, "key_scale");
  }
  r.y = {tokens, hq * d};
  return r;
}

void check_paged_tables(const PagedSetup& r, const int32_t* cu, const int32_t* past, const int32_t* table) {
  const AttentionParams& p = r.params;
  if (cu[0] != 0) fail("cumulative_sequence_length[0] = ", cu[0], " must be 0");
  if (cu[p.batch] != r.tokens) {
    fail("cumulative_sequence_length[", p.batch, "] = ", cu[p.batch], " must be the ", r.tokens,
         " tokens of input 'query'");
  }
  std::vector<int32_t> holder(static_cast<size_t>(p.blocks.num_blocks), -1);
  for (int64_t b = 0; b < p.batch; ++b) {
    if (cu[b + 1] < cu[b]) {
      fail("cumulative_sequence_length must not decrease: [", b, "] = ", cu[b], " > [", b + 1, "] = ", cu[b + 1]);
    }
    if (past[b] < 0) fail("past_seqlens[", b, "] = ", past[b], " must be >= 0");
    const int64_t total = static_cast<int64_t>(past[b]) + (cu[b + 1] - cu[b]);
    const BlockTable& t = p.blocks;
    const int64_t blocks = (total + t.block_size - 1) / t.block_size;
    if (blocks > t.max_blocks) {
      fail("sequence ", b, " holds ", total, " tokens: ", blocks, " blocks of ", t.block_size, ", more than the ",
           t.max_blocks, " columns of 'block_table'");
    }
    if (r.rotary.rotary_dim > 0 && total > r.rotary.max_positions) {
      fail("position ", total - 1, " of sequence ", b, " is beyond the ", r.rotary.max_positions,
           " rows of 'cos_cache'");
    }
    for (int64_t i = 0; table && i < blocks; ++i) {
      const int32_t block = table[b * t.max_blocks + i];
      if (block < 0 || block >= t.num_blocks) {
        fail("block_table[", b, ", ", i, "] = ", block, " must be a block of the pool, in [0, ", t.num_blocks,
             ") (sequence ", b, " holds ", total, " tokens)");
      }
      int32_t& h = holder[static_cast<size_t>(block)];
      if (h >= 0) {
        fail("block ", block, " is held by sequence ", h, " and again by sequence ", b,
             " (block_table[", b, ", ", i, "]): shared blocks are not supported");
      }
      h = static_cast<int32_t>(b);
    }
  }
}

}  // namespace turboquant
