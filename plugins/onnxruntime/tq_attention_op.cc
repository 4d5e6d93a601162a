#include "tq_attention_op.h"

#include "cuda_dispatch.h"

namespace turboquant::ort {
namespace {

constexpr const char* kOp = "TQAttention";

cpu::MaskType mask_type(ONNXTensorElementDataType t) {
  switch (t) {
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL: return cpu::MaskType::kBool;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT: return cpu::MaskType::kFloat32;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16: return cpu::MaskType::kFloat16;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16: return cpu::MaskType::kBFloat16;
    default: return cpu::MaskType::kNone;
  }
}

void check_type(const Ort::ConstValue& x, const char* name, ONNXTensorElementDataType want) {
  check_input_type(kOp, x, name, want);
}

}  // namespace

AttentionKernel::AttentionKernel(const OrtKernelInfo* info, ONNXTensorElementDataType t, Device dev)
    : type(t), device(dev) {
  attrs.key_format = attr_format(kOp, info, "key_format", "mse4");
  attrs.value_format = attr_format(kOp, info, "value_format", "uint4");
  attrs.norm_correction = attr_bool(kOp, info, "norm_correction", true);
  attrs.is_causal = attr_bool(kOp, info, "is_causal", false);
  attrs.head_dim = attr_int(kOp, info, "head_dim", 0);
  attrs.q_num_heads = attr_int(kOp, info, "q_num_heads", 0);
  attrs.kv_num_heads = attr_int(kOp, info, "kv_num_heads", 0);
  attrs.scale = attr_float(kOp, info, "scale", 0.0f);
  // ONNX Attention's attributes that TQAttention does not take: refused, not ignored
  if (attr_float(kOp, info, "softcap", 0.0f) != 0.0f) fail(kOp, "attribute 'softcap' is not supported");
  if (attr_int(kOp, info, "qk_matmul_output_mode", 0) != 0) fail(kOp, "attribute 'qk_matmul_output_mode' is not supported");
  attrs.validate();
}

OrtStatusPtr AttentionKernel::ComputeV2(OrtKernelContext* context) {
  return guarded([&] {
    Ort::KernelContext ctx(context);
    auto q_in = ctx.GetInput(0), k_in = ctx.GetInput(1), v_in = ctx.GetInput(2), m = ctx.GetInput(3);
    auto pk = ctx.GetInput(4), pv = ctx.GetInput(5), koff = ctx.GetInput(6), voff = ctx.GetInput(7);
    check_type(pk, "past_key", ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8);
    check_type(pv, "past_value", ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8);
    check_type(koff, "key_offset", ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT);
    check_type(voff, "value_offset", ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT);
    cpu::MaskType mt = cpu::MaskType::kNone;
    if (m) {
      const auto t = m.GetTensorTypeAndShapeInfo().GetElementType();
      mt = mask_type(t);
      if (mt == cpu::MaskType::kNone) {
        fail(kOp, "input 'attn_mask' must be bool or float32/float16/bfloat16 (additive), got ", dtype_name(t));
      }
    }
    const AttentionShapes shapes{*shape_of(q_in), *shape_of(k_in), *shape_of(v_in), shape_of(m),
                                 shape_of(pk), shape_of(pv), shape_of(koff), shape_of(voff)};
    AttentionSetup setup = setup_attention(attrs, shapes, to_dtype(type), mt);
    AttentionParams& p = setup.params;
    const void* mask = m ? m.GetTensorRawData() : nullptr;
    p.key_offset = koff ? koff.GetTensorData<float>() : nullptr;
    p.value_offset = voff ? voff.GetTensorData<float>() : nullptr;
    const uint8_t* past_key = pk ? pk.GetTensorData<uint8_t>() : nullptr;
    const uint8_t* past_value = pv ? pv.GetTensorData<uint8_t>() : nullptr;
    auto y = ctx.GetOutput(0, setup.y);
    auto present_key = ctx.GetOutput(1, setup.present_key);
    auto present_value = ctx.GetOutput(2, setup.present_value);
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
