// TQPack and TQUnpack as TensorRT IPluginV3 plugins over the ops/cuda launchers.
// TQPack: x (float32/float16/bfloat16 [..., D]) [, offset float32 [D] or [H, D]] -> uint8 [..., bytes].
// TQUnpack: packed uint8 [..., bytes] [, offset] -> [..., head_dim] of the type the dtype field names.
// Packed tensors are int8 instead where the packed_dtype field is 3 (--target tensorrt: plugin_base.h).
#pragma once

#include "plugin_base.h"

namespace turboquant::trt {

class PackPlugin : public Plugin<PackPlugin> {
 public:
  static constexpr const char* kName = "TQPack";
  static Fields declare();
  explicit PackPlugin(Fields f);

  int32_t getNbOutputs() const noexcept override { return 1; }
  int32_t getOutputDataTypes(nvinfer1::DataType* out, int32_t nbOutputs, const nvinfer1::DataType* in,
                             int32_t nbInputs) const noexcept override;
  int32_t getOutputShapes(const nvinfer1::DimsExprs* inputs, int32_t nbInputs, const nvinfer1::DimsExprs* shapeInputs,
                          int32_t nbShapeInputs, nvinfer1::DimsExprs* outputs, int32_t nbOutputs,
                          nvinfer1::IExprBuilder& eb) noexcept override;
  bool supportsFormatCombination(int32_t pos, const nvinfer1::DynamicPluginTensorDesc* inOut, int32_t nbInputs,
                                 int32_t nbOutputs) noexcept override;
  int32_t enqueue(const nvinfer1::PluginTensorDesc* inputDesc, const nvinfer1::PluginTensorDesc* outputDesc,
                  const void* const* inputs, void* const* outputs, void* workspace, cudaStream_t stream) noexcept override;

 private:
  Format format_;
  int head_dim_;
  bool norm_correction_;
};

class UnpackPlugin : public Plugin<UnpackPlugin> {
 public:
  static constexpr const char* kName = "TQUnpack";
  static Fields declare();
  explicit UnpackPlugin(Fields f);

  int32_t getNbOutputs() const noexcept override { return 1; }
  int32_t getOutputDataTypes(nvinfer1::DataType* out, int32_t nbOutputs, const nvinfer1::DataType* in,
                             int32_t nbInputs) const noexcept override;
  int32_t getOutputShapes(const nvinfer1::DimsExprs* inputs, int32_t nbInputs, const nvinfer1::DimsExprs* shapeInputs,
                          int32_t nbShapeInputs, nvinfer1::DimsExprs* outputs, int32_t nbOutputs,
                          nvinfer1::IExprBuilder& eb) noexcept override;
  bool supportsFormatCombination(int32_t pos, const nvinfer1::DynamicPluginTensorDesc* inOut, int32_t nbInputs,
                                 int32_t nbOutputs) noexcept override;
  int32_t enqueue(const nvinfer1::PluginTensorDesc* inputDesc, const nvinfer1::PluginTensorDesc* outputDesc,
                  const void* const* inputs, void* const* outputs, void* workspace, cudaStream_t stream) noexcept override;

 private:
  Format format_;
  int head_dim_;
  nvinfer1::DataType out_type_;
};

}  // namespace turboquant::trt
