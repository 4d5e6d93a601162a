#include "turboquant/gqa_setup.h"

#include <algorithm>
#include <cmath>
#include <utility>

namespace turboquant {
namespace {

constexpr const char* kOp = "TQGroupQueryAttention";

template <typename... Args>
[[noreturn]] void fail(Args&&... args) {
  throw_invalid(kOp, std::forward<Args>(args)...);
}

void check_rank(const Dims& s, size_t rank, const char* name, const char* what) {
  if (s.size() != rank) fail("input '", name, "' must be ", what, ", got shape ", dims_str(s));
}

void check_cache(const Dims& s, const char* name, int64_t b, int64_t hkv, int64_t bytes, Format f, int64_t d) {
  if (s.size() != 4 || s[0] != b || s[1] != hkv || s[3] < bytes) {
    fail("input '", name, "' has shape ", dims_str(s), "; expected [", b, ", ", hkv, ", max_length, W] with W >= ",
         bytes, " (", format_name(f), " vectors of head size ", d, " take ", bytes, " bytes)");
  }
}

}  // namespace

void GroupedAttrs::validate(const char* op) const {
  auto refuse = [op](auto&&... args) { throw_invalid(op, args...); };
  if (key_format == Format::kInvalid || value_format == Format::kInvalid) refuse("invalid key or value format");
  if (is_uint(key_format)) refuse("key_format '", format_name(key_format), "' is a value format");
  if (num_heads <= 0 || kv_num_heads <= 0 || num_heads % kv_num_heads != 0 || num_heads > kMaxHeads) {
    refuse("attributes num_heads (", num_heads, ") and kv_num_heads (", kv_num_heads,
           ") must be positive, num_heads a multiple of kv_num_heads and at most ", kMaxHeads);
  }
  if (!(scale >= 0.f) || !std::isfinite(scale)) refuse("attribute 'scale' must be finite and >= 0, got ", scale);
  if (local_window_size == 0 || local_window_size < -1) {
    refuse("attribute 'local_window_size' must be -1 (no window) or positive, got ", local_window_size);
  }
  if (!(softcap >= 0.f) || !std::isfinite(softcap)) refuse("attribute 'softcap' must be finite and >= 0, got ", softcap);
}

void GqaAttrs::validate() const {
  GroupedAttrs::validate(kOp);
  if (smooth_softmax) fail("smooth_softmax is not supported");
  if (qk_output != 0) fail("qk_output = ", qk_output, " is not supported");
  if (sliding_window_cache && local_window_size <= 0) fail("sliding_window_cache=1 requires local_window_size > 0.");
}

GqaSetup setup_gqa(const GqaAttrs& a, const GqaShapes& s, DType dtype, int64_t total) {
  a.validate();
  if (s.attention_bias) fail("input 'attention_bias' is not supported");
  check_rank(s.query, 3, "query", "3-D [batch, sequence, hidden]");
  GqaSetup r;
  const int64_t b = s.query[0], sq = s.query[1], hq = a.num_heads, hkv = a.kv_num_heads;
  r.packed_qkv = !s.key;
  if (r.packed_qkv != !s.value) fail("inputs 'key' and 'value' must both be given or both be absent (packed QKV)");
  const int64_t heads_in_query = r.packed_qkv ? hq + 2 * hkv : hq;
  if (s.query[2] % heads_in_query != 0) {
    fail("input 'query' has last dimension ", s.query[2], ", not a multiple of ", heads_in_query,
         r.packed_qkv ? " (num_heads + 2 * kv_num_heads, packed QKV)" : " (num_heads)");
  }
  const int64_t d = s.query[2] / heads_in_query;
  if (!head_dim_supported(d)) {
    fail("head size ", d, " (from input 'query' ", dims_str(s.query), ") must be a multiple of 8 from ", kMinHeadDim,
         " to ", kMaxHeadDim);
  }
  const int64_t row = s.query[2];
  if (!r.packed_qkv) {
    for (const auto* x : {&*s.key, &*s.value}) {
      const char* name = x == &*s.key ? "key" : "value";
      if (x->size() != 3 || (*x)[0] != b || (*x)[1] != sq || (*x)[2] != hkv * d) {
        fail("input '", name, "' has shape ", dims_str(*x), "; expected [", b, ", ", sq, ", ", hkv * d, "]");
      }
    }
  }
  const int64_t key_bytes = packed_size(a.key_format, static_cast<int>(d));
  const int64_t value_bytes = packed_size(a.value_format, static_cast<int>(d));
  check_cache(s.past_key, "past_key", b, hkv, key_bytes, a.key_format, d);
  check_cache(s.past_value, "past_value", b, hkv, value_bytes, a.value_format, d);
  if (s.past_key[2] != s.past_value[2] || s.past_key[3] != s.past_value[3]) {
    fail("inputs 'past_key' ", dims_str(s.past_key), " and 'past_value' ", dims_str(s.past_value),
         " must have the same shape");
  }
  if (s.seqlens_k != Dims{b}) fail("input 'seqlens_k' has shape ", dims_str(s.seqlens_k), "; expected [", b, "]");
  if (!s.total_sequence_length.empty() && s.total_sequence_length != Dims{1}) {
    fail("input 'total_sequence_length' must be a scalar, got shape ", dims_str(s.total_sequence_length));
  }
  if (total < sq) fail("total_sequence_length (", total, ") is smaller than the sequence length ", sq);
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
  p.q_len = p.new_len = sq;
  p.past_len = total - sq;
  p.head_dim = p.v_head_dim = static_cast<int>(d);
  p.key_format = a.key_format;
  p.value_format = a.value_format;
  p.norm_correction = a.norm_correction;
  p.is_causal = true;
  p.scale = a.scale > 0.f ? a.scale : 1.0f / std::sqrt(static_cast<float>(d));
  p.window = a.local_window_size > 0 ? a.local_window_size : 0;
  p.softcap = a.softcap;  // head_sink's pointer is the adapter's to set
  p.dtype = dtype;
  p.q = {sq * row, d, row};
  const int64_t kv_row = r.packed_qkv ? row : hkv * d;
  p.k = p.v = {sq * kv_row, d, kv_row};
  p.y = {sq * hq * d, d, hq * d};
  r.k_first = r.packed_qkv ? hq * d : 0;
  r.v_first = r.packed_qkv ? (hq + hkv) * d : 0;
  p.past_rows = s.past_key[2];
  p.present_rows = std::max(s.past_key[2], total);
  if (a.sliding_window_cache) {  // ORT's text; no bound involves S: a longer step runs on a staging copy
    if (s.past_key[2] < a.local_window_size) {
      fail("sliding_window_cache: KV cache capacity (", s.past_key[2], ") must be at least local_window_size (",
           a.local_window_size, ").");
    }
    p.present_rows = p.window_cache = s.past_key[2];
  }
  p.key_row_bytes = p.value_row_bytes = s.past_key[3];
  r.first_prompt = sq == total;

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
    if (s.position_ids && *s.position_ids != Dims{b, sq}) {
      fail("input 'position_ids' has shape ", dims_str(*s.position_ids), "; expected [", b, ", ", sq, "]");
    }
    r.position_ids = s.position_ids.has_value();
  }
  if (s.key_scale) {  // applied after the rotary; without it a model scales Q and K before the op
    if (!a.do_rotary) fail("input 'key_scale' needs do_rotary = 1 (without the rotary, scale Q and K before the op)");
    check_offset(s.key_scale, "key_scale");
  }
  r.y = {b, sq, hq * d};
  r.present_key = {b, hkv, p.present_rows, s.past_key[3]};
  r.present_value = {b, hkv, p.present_rows, s.past_value[3]};
  return r;
}

std::vector<int32_t> gqa_past_lengths(const GqaSetup& r, const int32_t* seqlens_k) {
  const AttentionParams& p = r.params;
  std::vector<int32_t> past(static_cast<size_t>(p.batch), 0);
  const int64_t total = p.past_len + p.q_len;
  for (int64_t b = 0; b < p.batch; ++b) {
    const int64_t k = seqlens_k[b];
    if (k < 0 || k >= total) {
      fail("seqlens_k[", b, "] = ", k, " must be in [0, total_sequence_length - 1 = ", total - 1, "]");
    }
    // a window-sized buffer's first prompt takes the sequence's length as it is: no right padding
    const int64_t n = r.first_prompt && !p.window_cache ? 0 : k + 1 - p.q_len;
    if (n < 0) fail("seqlens_k[", b, "] = ", k, " is shorter than the ", p.q_len, " new tokens");
    // a window-sized buffer is shorter than the sequence: its rows are gqa_attention's to map
    if (!p.window_cache && n > p.past_rows) {
      fail("seqlens_k[", b, "] = ", k, " puts ", n, " past tokens in a past buffer of ", p.past_rows, " rows");
    }
    if (!p.window_cache && n + p.q_len > p.present_rows) {
      fail("seqlens_k[", b, "] = ", k, ": ", n + p.q_len, " tokens do not fit the ", p.present_rows, "-row buffer");
    }
    if (r.rotary.rotary_dim > 0 && !r.position_ids && n + p.q_len > r.rotary.max_positions) {
      fail("position ", n + p.q_len - 1, " of sequence ", b, " is beyond the ", r.rotary.max_positions,
           " rows of 'cos_cache'");
    }
    past[static_cast<size_t>(b)] = static_cast<int32_t>(n);
  }
  return past;
}

void check_position_ids(const GqaSetup& r, const int64_t* ids) {
  const int64_t n = r.params.batch * r.params.q_len;
  for (int64_t i = 0; i < n; ++i) {
    if (ids[i] < 0 || ids[i] >= r.rotary.max_positions) {
      fail("position_ids[", i / r.params.q_len, ", ", i % r.params.q_len, "] = ", ids[i], " is outside the ",
           r.rotary.max_positions, " rows of 'cos_cache'");
    }
  }
}

void check_key_scale(const float* key_scale, int64_t count, const char* op) {
  for (int64_t i = 0; i < count; ++i) {
    if (!(key_scale[i] > 0.f) || !std::isfinite(key_scale[i])) {
      throw_invalid(op, "key_scale[", i, "] = ", key_scale[i], " must be positive and finite (the keys are divided by it)");
    }
  }
}

}  // namespace turboquant
