#include "tq_attention_op.h"

#include "cuda_dispatch.h"

#include <cmath>

namespace turboquant::ort {
namespace {

constexpr const char* kOp = "TQAttention";

// Q/K/V in either layout, viewed as [B, H, S, D].
struct HeadView {
  int64_t b = 0, h = 0, s = 0, d = 0;
  cpu::BhsStrides strides;
};

HeadView view_heads(const Ort::ConstValue& x, const char* name, int64_t num_heads_attr, const char* attr_name) {
  const auto shape = x.GetTensorTypeAndShapeInfo().GetShape();
  HeadView v;
  if (shape.size() == 4) {
    v = {shape[0], shape[1], shape[2], shape[3], {}};
    if (num_heads_attr > 0 && num_heads_attr != v.h) {
      fail(kOp, "input '", name, "' has ", v.h, " heads (shape ", shape_str(shape), ") but attribute '", attr_name,
           "' is ", num_heads_attr);
    }
    v.strides = {v.h * v.s * v.d, v.s * v.d, v.d};
  } else if (shape.size() == 3) {
    if (num_heads_attr <= 0) {
      fail(kOp, "input '", name, "' is 3-D ", shape_str(shape), " ([B, S, heads * head_dim]); attribute '",
           attr_name, "' must give the head count");
    }
    if (shape[2] % num_heads_attr != 0) {
      fail(kOp, "input '", name, "' has last dimension ", shape[2], ", not a multiple of attribute '", attr_name,
           "' = ", num_heads_attr);
    }
    v = {shape[0], num_heads_attr, shape[1], shape[2] / num_heads_attr, {}};
    v.strides = {v.s * v.h * v.d, v.d, v.h * v.d};
  } else {
    fail(kOp, "input '", name, "' must be 4-D [B, H, S, D] or 3-D [B, S, H*D], got shape ", shape_str(shape));
  }
  return v;
}

void check_head_dim(const char* name, int64_t d) {
  if (!head_dim_supported(d)) {
    fail(kOp, "input '", name, "' has head size ", d, "; expected a multiple of 8 from ", kMinHeadDim, " to ",
         kMaxHeadDim);
  }
}

void check_cache(const Ort::ConstValue& c, const char* name, int64_t b, int64_t hkv, int64_t bytes, Format f,
                 int64_t d) {
  auto info = c.GetTensorTypeAndShapeInfo();
  if (info.GetElementType() != ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8) {
    fail(kOp, "input '", name, "' must be uint8, got ", dtype_name(info.GetElementType()));
  }
  const auto s = info.GetShape();
  if (s.size() != 4 || s[0] != b || s[1] != hkv || s[3] != bytes) {
    fail(kOp, "input '", name, "' has shape ", shape_str(s), "; expected [", b, ", ", hkv, ", S_past, ", bytes,
         "] (", format_name(f), " vectors of head_dim ", d, " take ", bytes, " bytes)");
  }
}

cpu::MaskType mask_type(ONNXTensorElementDataType t) {
  switch (t) {
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL: return cpu::MaskType::kBool;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT: return cpu::MaskType::kFloat32;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16: return cpu::MaskType::kFloat16;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16: return cpu::MaskType::kBFloat16;
    default: return cpu::MaskType::kNone;
  }
}

void check_offset(const Ort::ConstValue& off, const char* name, int64_t hkv, int64_t d) {
  auto info = off.GetTensorTypeAndShapeInfo();
  const auto s = info.GetShape();
  if (info.GetElementType() != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT || s.size() != 2 || s[0] != hkv || s[1] != d) {
    fail(kOp, "input '", name, "' must be float32 [", hkv, ", ", d, "] (kv heads, head size), got ",
         dtype_name(info.GetElementType()), " ", shape_str(s));
  }
}

}  // namespace

AttentionKernel::AttentionKernel(const OrtKernelInfo* info, ONNXTensorElementDataType t, Device dev)
    : type(t), device(dev) {
  key_format = attr_format(kOp, info, "key_format", "mse4");
  value_format = attr_format(kOp, info, "value_format", "uint4");
  norm_correction = attr_bool(kOp, info, "norm_correction", true);
  is_causal = attr_bool(kOp, info, "is_causal", false);
  head_dim = attr_int(info, "head_dim", 0);
  q_num_heads = attr_int(info, "q_num_heads", 0);
  kv_num_heads = attr_int(info, "kv_num_heads", 0);
  scale = attr_float(info, "scale", 0.0f);
  if (head_dim != 0 && !head_dim_supported(head_dim)) {
    fail(kOp, "attribute 'head_dim' is ", head_dim, "; expected a multiple of 8 from ", kMinHeadDim, " to ",
         kMaxHeadDim);
  }
  if (q_num_heads < 0 || kv_num_heads < 0) fail(kOp, "attributes 'q_num_heads' and 'kv_num_heads' must be >= 0");
  if (!std::isfinite(scale) || scale < 0.0f) fail(kOp, "attribute 'scale' is ", scale, "; expected a finite value >= 0 (0: 1/sqrt(head_dim))");
}

OrtStatusPtr AttentionKernel::ComputeV2(OrtKernelContext* context) {
  return guarded([&] {
    Ort::KernelContext ctx(context);
    auto q_in = ctx.GetInput(0), k_in = ctx.GetInput(1), v_in = ctx.GetInput(2);
    const size_t rank = q_in.GetTensorTypeAndShapeInfo().GetShape().size();
    const HeadView q = view_heads(q_in, "Q", q_num_heads, "q_num_heads");
    for (auto [val, name] : {std::pair{k_in, "K"}, std::pair{v_in, "V"}}) {
      const size_t r = val.GetTensorTypeAndShapeInfo().GetShape().size();
      if (r != rank) fail(kOp, "input '", name, "' has rank ", r, " but 'Q' has rank ", rank, "; they must agree");
    }
    const HeadView k = view_heads(k_in, "K", kv_num_heads, "kv_num_heads");
    const HeadView v = view_heads(v_in, "V", kv_num_heads, "kv_num_heads");
    if (k.b != q.b || v.b != q.b) fail(kOp, "inputs 'Q', 'K', 'V' must share the batch size, got ", q.b, ", ", k.b, ", ", v.b);
    if (k.h != v.h) fail(kOp, "inputs 'K' and 'V' must have the same head count, got ", k.h, " and ", v.h);
    if (k.s != v.s) fail(kOp, "inputs 'K' and 'V' must have the same sequence length, got ", k.s, " and ", v.s);
    if (k.h <= 0 || q.h % k.h != 0) {
      fail(kOp, "the query head count ", q.h, " must be a positive multiple of the kv head count ", k.h);
    }
    if (k.d != q.d) fail(kOp, "inputs 'Q' and 'K' must have the same head size, got ", q.d, " and ", k.d);
    check_head_dim("Q", q.d);
    check_head_dim("V", v.d);
    if (head_dim != 0 && q.d != head_dim) {
      fail(kOp, "input 'Q' has head size ", q.d, " but attribute 'head_dim' is ", head_dim);
    }

    AttentionParams p;
    p.batch = q.b;
    p.q_heads = q.h;
    p.kv_heads = k.h;
    p.q_len = q.s;
    p.new_len = k.s;
    p.head_dim = static_cast<int>(q.d);
    p.v_head_dim = static_cast<int>(v.d);
    p.key_format = key_format;
    p.value_format = value_format;
    p.norm_correction = norm_correction;
    p.is_causal = is_causal;
    p.scale = scale > 0.0f ? scale : 1.0f / std::sqrt(static_cast<float>(q.d));
    p.dtype = to_dtype(type);
    p.q = q.strides;
    p.k = k.strides;
    p.v = v.strides;

    const int64_t kb = packed_size(key_format, p.head_dim), vb = packed_size(value_format, p.v_head_dim);
    auto pk = ctx.GetInput(4), pv = ctx.GetInput(5);
    if (static_cast<bool>(pk) != static_cast<bool>(pv)) {
      fail(kOp, "inputs 'past_key' and 'past_value' must be given together");
    }
    const uint8_t *past_key = nullptr, *past_value = nullptr;
    if (pk) {
      check_cache(pk, "past_key", q.b, k.h, kb, key_format, p.head_dim);
      check_cache(pv, "past_value", q.b, k.h, vb, value_format, p.v_head_dim);
      const int64_t sk = pk.GetTensorTypeAndShapeInfo().GetShape()[2];
      const int64_t sv = pv.GetTensorTypeAndShapeInfo().GetShape()[2];
      if (sk != sv) fail(kOp, "inputs 'past_key' and 'past_value' hold ", sk, " and ", sv, " tokens; they must agree");
      p.past_len = sk;
      past_key = pk.GetTensorData<uint8_t>();
      past_value = pv.GetTensorData<uint8_t>();
    }
    const int64_t total = p.past_len + p.new_len;
    if (is_causal && q.s > total) {
      fail(kOp, "is_causal needs at most as many queries as keys, got ", q.s, " queries and ", total, " keys");
    }

    const void* mask = nullptr;
    if (auto m = ctx.GetInput(3)) {
      auto info = m.GetTensorTypeAndShapeInfo();
      p.mask_type = mask_type(info.GetElementType());
      if (p.mask_type == cpu::MaskType::kNone) {
        fail(kOp, "input 'attn_mask' must be bool or float32/float16/bfloat16 (additive), got ",
             dtype_name(info.GetElementType()));
      }
      const auto ms = info.GetShape();
      const int64_t target[4] = {q.b, q.h, q.s, total};
      if (ms.size() > 4) fail(kOp, "input 'attn_mask' has rank ", ms.size(), "; expected at most 4");
      int64_t stride = 1;
      for (int i = 3, j = static_cast<int>(ms.size()) - 1; i >= 0; --i, --j) {
        const int64_t dim = j >= 0 ? ms[j] : 1;
        if (dim != 1 && dim != target[i]) {
          fail(kOp, "input 'attn_mask' of shape ", shape_str(ms), " does not broadcast to [batch, q_heads, q_len, ",
               "total_len] = ", shape_str({target[0], target[1], target[2], target[3]}));
        }
        p.mask_stride[i] = dim == 1 ? 0 : stride;
        stride *= dim;
      }
      mask = m.GetTensorRawData();
    }
    if (auto off = ctx.GetInput(6)) {
      check_offset(off, "key_offset", k.h, p.head_dim);
      p.key_offset = off.GetTensorData<float>();
    }
    if (auto off = ctx.GetInput(7)) {
      check_offset(off, "value_offset", k.h, p.v_head_dim);
      p.value_offset = off.GetTensorData<float>();
    }

    std::vector<int64_t> y_shape = rank == 4 ? std::vector<int64_t>{q.b, q.h, q.s, v.d}
                                             : std::vector<int64_t>{q.b, q.s, q.h * v.d};
    p.y = rank == 4 ? cpu::BhsStrides{q.h * q.s * v.d, q.s * v.d, v.d} : cpu::BhsStrides{q.s * q.h * v.d, v.d, q.h * v.d};
    auto y = ctx.GetOutput(0, y_shape);
    auto present_key = ctx.GetOutput(1, {q.b, k.h, total, kb});
    auto present_value = ctx.GetOutput(2, {q.b, k.h, total, vb});
    if (device == Device::kCuda) {
      cuda_attention(context, p, q_in.GetTensorRawData(), k_in.GetTensorRawData(), v_in.GetTensorRawData(), mask,
                     past_key, past_value, y.GetTensorMutableRawData(), present_key.GetTensorMutableData<uint8_t>(),
                     present_value.GetTensorMutableData<uint8_t>());
      return;
    }
    cpu::attention(p, q_in.GetTensorRawData(), k_in.GetTensorRawData(), v_in.GetTensorRawData(), mask, past_key,
                   past_value, y.GetTensorMutableRawData(), present_key.GetTensorMutableData<uint8_t>(),
                   present_value.GetTensorMutableData<uint8_t>(), ort_parallel_for(context));
  });
}

}  // namespace turboquant::ort
