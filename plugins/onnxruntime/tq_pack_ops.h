// TQPack and TQUnpack for the CPU execution provider: validation and dispatch to ops/cpu.
#pragma once

#include "ort_utils.h"

namespace turboquant::ort {

struct PackKernel {
  PackKernel(const OrtKernelInfo* info, ONNXTensorElementDataType type, Device device);
  OrtStatusPtr ComputeV2(OrtKernelContext* context);

  Device device;
  Format format;
  int64_t head_dim;
  bool norm_correction;
};

struct UnpackKernel {
  UnpackKernel(const OrtKernelInfo* info, ONNXTensorElementDataType type, Device device);
  OrtStatusPtr ComputeV2(OrtKernelContext* context);

  Device device;
  Format format;
  int64_t head_dim;
  ONNXTensorElementDataType out_type;
};

// One registration per float type T (of TQPack's x, of TQUnpack's output).
template <ONNXTensorElementDataType T, Device kDevice>
struct PackOp : OpBase<PackOp<T, kDevice>, PackKernel, kDevice> {
  const char* GetName() const { return "TQPack"; }
  ONNXTensorElementDataType dtype() const { return T; }
  size_t GetInputTypeCount() const { return 2; }
  ONNXTensorElementDataType GetInputType(size_t i) const { return i == 0 ? T : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t i) const {
    return i == 0 ? INPUT_OUTPUT_REQUIRED : INPUT_OUTPUT_OPTIONAL;
  }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8; }
};

// The output type comes from the 'dtype' attribute; ORT picks a kernel by input types only, so
// there is one registration whose output type is left open and set by shape inference.
OrtStatusPtr ORT_API_CALL infer_unpack_output(const OrtCustomOp*, OrtShapeInferContext* ctx);

template <Device kDevice>
struct UnpackOp : OpBase<UnpackOp<kDevice>, UnpackKernel, kDevice> {
  UnpackOp() { OrtCustomOp::InferOutputShapeFn = &infer_unpack_output; }
  const char* GetName() const { return "TQUnpack"; }
  ONNXTensorElementDataType dtype() const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED; }
  size_t GetInputTypeCount() const { return 2; }
  ONNXTensorElementDataType GetInputType(size_t i) const {
    return i == 0 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t i) const {
    return i == 0 ? INPUT_OUTPUT_REQUIRED : INPUT_OUTPUT_OPTIONAL;
  }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED; }
};

// Offset for a tensor [..., H, S, D] of vectors: float32 [D] or [H, D]; fails otherwise.
cpu::Offset read_offset(const char* op, const Ort::ConstValue& offset, const std::vector<int64_t>& vec_shape,
                        int64_t d, const char* input_name);

}  // namespace turboquant::ort
