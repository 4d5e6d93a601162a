// TQGroupQueryAttention for the CPU and CUDA execution providers: com.microsoft
// GroupQueryAttention's inputs, outputs and attributes over packed uint8 caches, for models built
// by onnxruntime-genai (docs/ops.md).
#pragma once

#include "ort_utils.h"
#include "turboquant/gqa_setup.h"

namespace turboquant::ort {

struct GqaKernel {
  GqaKernel(const OrtKernelInfo* info, ONNXTensorElementDataType type, Device device);
  OrtStatusPtr ComputeV2(OrtKernelContext* context);

  ONNXTensorElementDataType type;
  Device device;
  GqaAttrs attrs;
};

// Inputs (GroupQueryAttention's order): query, key, value (T; key/value absent = packed QKV),
// past_key, past_value (uint8 [B, Hkv, max_length, W]), seqlens_k (int32 [B]),
// total_sequence_length (int32 scalar, host memory), cos_cache, sin_cache (T), position_ids
// (int64), attention_bias (T, refused when given), head_sink (T [num_heads]), then key_offset,
// value_offset and key_scale (float32 [Hkv, D]). Outputs: output (T), present_key, present_value (uint8; each may be its past
// input's buffer: ORT and onnxruntime-genai's past_present_share_buffer then update it in place).
template <ONNXTensorElementDataType T, Device kDevice>
struct GqaOp : OpBase<GqaOp<T, kDevice>, GqaKernel, kDevice> {
  GqaOp() {
    // present_key may reuse past_key's buffer, present_value past_value's (GroupQueryAttention's
    // MayInplace(3, 1) and MayInplace(4, 2)).
    OrtCustomOp::GetMayInplace = [](int** input_index, int** output_index) -> size_t {
      *input_index = new int[2]{3, 4};
      *output_index = new int[2]{1, 2};
      return 2;
    };
    OrtCustomOp::ReleaseMayInplace = [](int* input_index, int* output_index) {
      delete[] input_index;
      delete[] output_index;
    };
  }
  const char* GetName() const { return "TQGroupQueryAttention"; }
  ONNXTensorElementDataType dtype() const { return T; }
  size_t GetInputTypeCount() const { return 15; }
  ONNXTensorElementDataType GetInputType(size_t i) const {
    switch (i) {
      case 3:
      case 4: return ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8;
      case 5:
      case 6: return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32;
      case 9: return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;
      case 12:
      case 13:
      case 14: return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
      default: return T;
    }
  }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t i) const {
    return (i == 0 || (i >= 3 && i <= 6)) ? INPUT_OUTPUT_REQUIRED : INPUT_OUTPUT_OPTIONAL;
  }
  // total_sequence_length sizes the outputs, so it is read on the host (as GroupQueryAttention does).
  OrtMemType GetInputMemoryType(size_t i) const { return i == 6 ? OrtMemTypeCPUInput : OrtMemTypeDefault; }
  size_t GetOutputTypeCount() const { return 3; }
  ONNXTensorElementDataType GetOutputType(size_t i) const { return i == 0 ? T : ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8; }
};

}  // namespace turboquant::ort
