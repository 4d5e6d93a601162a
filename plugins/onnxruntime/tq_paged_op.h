// TQPagedAttention for the CPU execution provider: com.microsoft PagedAttention's inputs, outputs and
// attributes over pools of packed uint8 KV blocks (docs/ops.md), for the CPU and CUDA execution
// providers (cumulative_sequence_length and past_seqlens in host memory: the calls are planned from them).
#pragma once

#include "ort_utils.h"
#include "turboquant/paged_setup.h"

namespace turboquant::ort {

struct PagedKernel {
  PagedKernel(const OrtKernelInfo* info, ONNXTensorElementDataType type, Device device);
  OrtStatusPtr ComputeV2(OrtKernelContext* context);

  ONNXTensorElementDataType type;
  Device device;
  PagedAttrs attrs;
};

// Inputs (PagedAttention's order to sin_cache): query, key, value (T [num_tokens, hidden]; key/value
// absent = packed QKV), key_cache, value_cache (uint8 [num_blocks, block_size, Hkv, W]),
// cumulative_sequence_length (int32 [B + 1]), past_seqlens (int32 [B]), block_table (int32 [B, max_blocks]),
// cos_cache, sin_cache (T), then turboquant's: head_sink (T [num_heads]), key_offset, value_offset and
// key_scale (float32 [Hkv, D]). Outputs: output (T), key_cache_out, value_cache_out (uint8; each
// ORT may make its cache input's buffer, which is then updated in place).
template <ONNXTensorElementDataType T, Device kDevice>
struct PagedOp : OpBase<PagedOp<T, kDevice>, PagedKernel, kDevice> {
  PagedOp() {
    // key_cache_out may reuse key_cache's buffer, value_cache_out value_cache's (PagedAttention's pools).
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
  const char* GetName() const { return "TQPagedAttention"; }
  ONNXTensorElementDataType dtype() const { return T; }
  size_t GetInputTypeCount() const { return 14; }
  ONNXTensorElementDataType GetInputType(size_t i) const {
    switch (i) {
      case 3:
      case 4: return ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8;
      case 5:
      case 6:
      case 7: return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32;
      case 11:
      case 12:
      case 13: return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
      default: return T;
    }
  }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t i) const {
    return (i == 0 || (i >= 3 && i <= 7)) ? INPUT_OUTPUT_REQUIRED : INPUT_OUTPUT_OPTIONAL;
  }
  OrtMemType GetInputMemoryType(size_t i) const { return i == 5 || i == 6 ? OrtMemTypeCPUInput : OrtMemTypeDefault; }
  size_t GetOutputTypeCount() const { return 3; }
  ONNXTensorElementDataType GetOutputType(size_t i) const { return i == 0 ? T : ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8; }
};

}  // namespace turboquant::ort
