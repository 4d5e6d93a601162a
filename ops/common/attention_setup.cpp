#include "turboquant/attention_setup.h"

#include <cmath>
#include <utility>

namespace turboquant {
namespace {

constexpr const char* kOp = "TQAttention";

template <typename... Args>
[[noreturn]] void fail(Args&&... args) {
  throw_invalid(kOp, std::forward<Args>(args)...);
}

// Q/K/V in either layout, viewed as [B, H, S, D].
struct HeadView {
  int64_t b = 0, h = 0, s = 0, d = 0;
  BhsStrides strides;
};

HeadView view_heads(const Dims& shape, const char* name, int64_t num_heads_attr, const char* attr_name) {
  HeadView v;
  if (shape.size() == 4) {
    v = {shape[0], shape[1], shape[2], shape[3], {}};
    if (num_heads_attr > 0 && num_heads_attr != v.h) {
      fail("input '", name, "' has ", v.h, " heads (shape ", dims_str(shape), ") but attribute '", attr_name, "' is ",
           num_heads_attr);
    }
    v.strides = {v.h * v.s * v.d, v.s * v.d, v.d};
  } else if (shape.size() == 3) {
    if (num_heads_attr <= 0) {
      fail("input '", name, "' is 3-D ", dims_str(shape), " ([B, S, heads * head_dim]); attribute '", attr_name,
           "' must give the head count");
    }
    if (shape[2] % num_heads_attr != 0) {
      fail("input '", name, "' has last dimension ", shape[2], ", not a multiple of attribute '", attr_name, "' = ",
           num_heads_attr);
    }
    v = {shape[0], num_heads_attr, shape[1], shape[2] / num_heads_attr, {}};
    v.strides = {v.s * v.h * v.d, v.d, v.h * v.d};
  } else {
    fail("input '", name, "' must be 4-D [B, H, S, D] or 3-D [B, S, H*D], got shape ", dims_str(shape));
  }
  return v;
}

void check_head_dim(const char* name, int64_t d) {
  if (!head_dim_supported(d)) {
    fail("input '", name, "' has head size ", d, "; expected a multiple of 8 from ", kMinHeadDim, " to ", kMaxHeadDim);
  }
}

void check_cache(const Dims& s, const char* name, int64_t b, int64_t hkv, int64_t bytes, Format f, int64_t d) {
  if (s.size() != 4 || s[0] != b || s[1] != hkv || s[3] != bytes) {
    fail("input '", name, "' has shape ", dims_str(s), "; expected [", b, ", ", hkv, ", S_past, ", bytes, "] (",
         format_name(f), " vectors of head_dim ", d, " take ", bytes, " bytes)");
  }
}

void check_offset(const Dims& s, const char* name, int64_t hkv, int64_t d) {
  if (s.size() != 2 || s[0] != hkv || s[1] != d) {
    fail("input '", name, "' must be float32 [", hkv, ", ", d, "] (kv heads, head size), got shape ", dims_str(s));
  }
}

}  // namespace

std::string dims_str(const Dims& d) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < d.size(); ++i) os << (i ? ", " : "") << d[i];
  os << "]";
  return os.str();
}

void AttentionAttrs::validate() const {
  if (head_dim != 0 && !head_dim_supported(head_dim)) {
    fail("attribute 'head_dim' is ", head_dim, "; expected a multiple of 8 from ", kMinHeadDim, " to ", kMaxHeadDim);
  }
  if (q_num_heads < 0 || kv_num_heads < 0) fail("attributes 'q_num_heads' and 'kv_num_heads' must be >= 0");
  if (!std::isfinite(scale) || scale < 0.0f) {
    fail("attribute 'scale' is ", scale, "; expected a finite value >= 0 (0: 1/sqrt(head_dim))");
  }
}

AttentionSetup setup_attention(const AttentionAttrs& a, const AttentionShapes& in, DType dtype, MaskType mask_type) {
  const size_t rank = in.q.size();
  const HeadView q = view_heads(in.q, "Q", a.q_num_heads, "q_num_heads");
  for (auto [shape, name] : {std::pair{&in.k, "K"}, std::pair{&in.v, "V"}}) {
    if (shape->size() != rank) {
      fail("input '", name, "' has rank ", shape->size(), " but 'Q' has rank ", rank, "; they must agree");
    }
  }
  const HeadView k = view_heads(in.k, "K", a.kv_num_heads, "kv_num_heads");
  const HeadView v = view_heads(in.v, "V", a.kv_num_heads, "kv_num_heads");
  if (k.b != q.b || v.b != q.b) fail("inputs 'Q', 'K', 'V' must share the batch size, got ", q.b, ", ", k.b, ", ", v.b);
  if (k.h != v.h) fail("inputs 'K' and 'V' must have the same head count, got ", k.h, " and ", v.h);
  if (k.s != v.s) fail("inputs 'K' and 'V' must have the same sequence length, got ", k.s, " and ", v.s);
  if (q.h <= 0 || k.h <= 0 || q.h % k.h != 0 || q.h > kMaxHeads) {
    fail("the query head count ", q.h, " must be a positive multiple of the kv head count ", k.h, ", at most ",
         kMaxHeads);
  }
  if (k.d != q.d) fail("inputs 'Q' and 'K' must have the same head size, got ", q.d, " and ", k.d);
  check_head_dim("Q", q.d);
  check_head_dim("V", v.d);
  if (a.head_dim != 0 && q.d != a.head_dim) fail("input 'Q' has head size ", q.d, " but attribute 'head_dim' is ", a.head_dim);

  AttentionSetup out;
  AttentionParams& p = out.params;
  p.batch = q.b;
  p.q_heads = q.h;
  p.kv_heads = k.h;
  p.q_len = q.s;
  p.new_len = k.s;
  p.head_dim = static_cast<int>(q.d);
  p.v_head_dim = static_cast<int>(v.d);
  p.key_format = a.key_format;
  p.value_format = a.value_format;
  p.norm_correction = a.norm_correction;
  p.is_causal = a.is_causal;
  p.scale = a.scale > 0.0f ? a.scale : 1.0f / std::sqrt(static_cast<float>(q.d));
  p.dtype = dtype;
  p.q = q.strides;
  p.k = k.strides;
  p.v = v.strides;

  const int64_t kb = packed_size(a.key_format, p.head_dim), vb = packed_size(a.value_format, p.v_head_dim);
  if (in.past_key.has_value() != in.past_value.has_value()) fail("inputs 'past_key' and 'past_value' must be given together");
  if (in.past_key) {
    check_cache(*in.past_key, "past_key", q.b, k.h, kb, a.key_format, p.head_dim);
    check_cache(*in.past_value, "past_value", q.b, k.h, vb, a.value_format, p.v_head_dim);
    const int64_t sk = (*in.past_key)[2], sv = (*in.past_value)[2];
    if (sk != sv) fail("inputs 'past_key' and 'past_value' hold ", sk, " and ", sv, " tokens; they must agree");
    p.past_len = sk;
  }
  const int64_t total = p.past_len + p.new_len;
  if (a.is_causal && q.s > total) {
    fail("is_causal needs at most as many queries as keys, got ", q.s, " queries and ", total, " keys");
  }
  if (in.mask) {
    const Dims& ms = *in.mask;
    p.mask_type = mask_type;
    const int64_t target[4] = {q.b, q.h, q.s, total};
    if (ms.size() > 4) fail("input 'attn_mask' has rank ", ms.size(), "; expected at most 4");
    int64_t stride = 1;
    for (int i = 3, j = static_cast<int>(ms.size()) - 1; i >= 0; --i, --j) {
      const int64_t dim = j >= 0 ? ms[j] : 1;
      if (dim != 1 && dim != target[i]) {
        fail("input 'attn_mask' of shape ", dims_str(ms), " does not broadcast to [batch, q_heads, q_len, ",
             "total_len] = ", dims_str({target[0], target[1], target[2], target[3]}));
      }
      p.mask_stride[i] = dim == 1 ? 0 : stride;
      stride *= dim;
    }
  }
  if (in.key_offset) check_offset(*in.key_offset, "key_offset", k.h, p.head_dim);
  if (in.value_offset) check_offset(*in.value_offset, "value_offset", k.h, p.v_head_dim);

  out.y = rank == 4 ? Dims{q.b, q.h, q.s, v.d} : Dims{q.b, q.s, q.h * v.d};
  p.y = rank == 4 ? BhsStrides{q.h * q.s * v.d, q.s * v.d, v.d} : BhsStrides{q.s * q.h * v.d, v.d, q.h * v.d};
  out.present_key = {q.b, k.h, total, kb};
  out.present_value = {q.b, k.h, total, vb};
  return out;
}

}  // namespace turboquant
