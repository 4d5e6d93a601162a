#include "tq_gqa_op.h"

#include "cuda_dispatch.h"

namespace turboquant::ort {
namespace {

constexpr const char* kOp = "TQGroupQueryAttention";

void check_type(const Ort::ConstValue& x, const char* name, ONNXTensorElementDataType want) {
  check_input_type(kOp, x, name, want);
}

}  // namespace

GqaKernel::GqaKernel(const OrtKernelInfo* info, ONNXTensorElementDataType t, Device dev) : type(t), device(dev) {
  read_grouped_attrs(kOp, info, attrs);
  attrs.smooth_softmax = attr_bool(kOp, info, "smooth_softmax", false);
  attrs.qk_output = attr_int(kOp, info, "qk_output", 0);
  const int64_t window_cache = attr_int(kOp, info, "sliding_window_cache", 0);
  if (window_cache != 0 && window_cache != 1) {
    fail(kOp, "attribute 'sliding_window_cache' must be 0 or 1, got ", window_cache);
  }
  attrs.sliding_window_cache = window_cache == 1;
  attrs.validate();
}

OrtStatusPtr GqaKernel::ComputeV2(OrtKernelContext* context) {
  return guarded([&] {
    Ort::KernelContext ctx(context);
    Ort::ConstValue in[15];
    for (size_t i = 0; i < 15; ++i) in[i] = ctx.GetInput(i);
    const auto& [query, key, value, pk, pv, seqlens, total, cos, sin, pos_ids, bias, sink, koff, voff, kscale] = in;
    check_type(pk, "past_key", ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8);
    check_type(pv, "past_value", ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8);
    check_type(seqlens, "seqlens_k", ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32);
    check_type(total, "total_sequence_length", ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32);
    check_type(pos_ids, "position_ids", ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64);
    check_type(koff, "key_offset", ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT);
    check_type(voff, "value_offset", ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT);
    check_type(kscale, "key_scale", ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT);
    check_type(sink, "head_sink", type);
    const Dims total_shape = *shape_of(total);
    if (total.GetTensorTypeAndShapeInfo().GetElementCount() != 1) {
      fail(kOp, "input 'total_sequence_length' must hold one value, got shape ", shape_str(total_shape));
    }
    const GqaShapes shapes{*shape_of(query), shape_of(key), shape_of(value), *shape_of(pk), *shape_of(pv),
                           *shape_of(seqlens), total_shape, shape_of(cos), shape_of(sin), shape_of(pos_ids),
                           shape_of(bias), shape_of(sink), shape_of(koff), shape_of(voff), shape_of(kscale)};
    GqaSetup setup = setup_gqa(attrs, shapes, to_dtype(type), *total.GetTensorData<int32_t>());
    AttentionParams& p = setup.params;
    p.key_offset = koff ? koff.GetTensorData<float>() : nullptr;
    p.value_offset = voff ? voff.GetTensorData<float>() : nullptr;
    p.head_sink = sink ? sink.GetTensorRawData() : nullptr;
    RotaryParams& rot = setup.rotary;
    if (rot.rotary_dim > 0) {
      rot.cos = cos.GetTensorRawData();
      rot.sin = sin.GetTensorRawData();
      rot.position_ids = pos_ids ? pos_ids.GetTensorData<int64_t>() : nullptr;
      rot.key_scale = kscale ? kscale.GetTensorData<float>() : nullptr;
    }
    const size_t es = static_cast<size_t>(dtype_size(p.dtype));
    const auto* qbase = static_cast<const uint8_t*>(query.GetTensorRawData());
    const void* q = qbase;
    const void* k = setup.packed_qkv ? qbase + setup.k_first * es : key.GetTensorRawData();
    const void* v = setup.packed_qkv ? qbase + setup.v_first * es : value.GetTensorRawData();
    auto y = ctx.GetOutput(0, setup.y);
    auto present_key = ctx.GetOutput(1, setup.present_key);
    auto present_value = ctx.GetOutput(2, setup.present_value);
    const uint8_t* past_key = pk.GetTensorData<uint8_t>();
    const uint8_t* past_value = pv.GetTensorData<uint8_t>();
    if (device == Device::kCuda) {
      cuda_gqa(context, p, rot, seqlens.GetTensorData<int32_t>(), setup.first_prompt, q, k, v, past_key, past_value,
               y.GetTensorMutableRawData(), present_key.GetTensorMutableData<uint8_t>(),
               present_value.GetTensorMutableData<uint8_t>());
      return;
    }
    const std::vector<int32_t> past = gqa_past_lengths(setup, seqlens.GetTensorData<int32_t>());
    if (rot.position_ids) check_position_ids(setup, rot.position_ids);
    if (rot.key_scale) check_key_scale(rot.key_scale, static_cast<int64_t>(kscale.GetTensorTypeAndShapeInfo().GetElementCount()));
    p.past_lens = past.data();
    cpu::gqa_attention(p, rot, q, k, v, past_key, past_value, y.GetTensorMutableRawData(),
                       present_key.GetTensorMutableData<uint8_t>(), present_value.GetTensorMutableData<uint8_t>(),
                       ort_parallel_for(context));
  });
}

}  // namespace turboquant::ort
