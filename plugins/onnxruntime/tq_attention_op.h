// TQAttention for the CPU execution provider: validation and dispatch to ops/cpu.
#pragma once

#include "ort_utils.h"
#include "turboquant/attention_setup.h"

namespace turboquant::ort {

struct AttentionKernel {
  AttentionKernel(const OrtKernelInfo* info, ONNXTensorElementDataType type, Device device);
  OrtStatusPtr ComputeV2(OrtKernelContext* context);

  ONNXTensorElementDataType type;
  Device device;
  AttentionAttrs attrs;
};

// Inputs: Q, K, V (T), attn_mask (any of bool/float types, optional), past_key, past_value (uint8,
// optional), key_offset, value_offset (float32, optional). Outputs: Y (T), present_key,
// present_value (uint8). One registration per T.
template <ONNXTensorElementDataType T, Device kDevice>
struct AttentionOp : OpBase<AttentionOp<T, kDevice>, AttentionKernel, kDevice> {
  const char* GetName() const { return "TQAttention"; }
  ONNXTensorElementDataType dtype() const { return T; }
  size_t GetInputTypeCount() const { return 8; }
  ONNXTensorElementDataType GetInputType(size_t i) const {
    if (i < 3) return T;
    if (i == 3) return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;  // bool or additive float mask
    if (i < 6) return ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8;
    return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t i) const {
    return i < 3 ? INPUT_OUTPUT_REQUIRED : INPUT_OUTPUT_OPTIONAL;
  }
  size_t GetOutputTypeCount() const { return 3; }
  ONNXTensorElementDataType GetOutputType(size_t i) const { return i == 0 ? T : ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8; }
};

}  // namespace turboquant::ort
