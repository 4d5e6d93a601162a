// TQAttention as a TensorRT IPluginV3 plugin over ops/cuda's split-KV decode attention.
// Inputs: Q, K, V (float32/float16/bfloat16, 4-D [B, H, S, D] or 3-D [B, S, H*D]), then optionally
// attn_mask (bool or additive float), past_key and past_value (uint8 [B, Hkv, S_past, bytes]), then
// optionally key_offset and value_offset (float32 [Hkv, D]; only after the past). Absent optional
// inputs are simply left out; the mask is told apart from the past by its type (and, while shapes
// are built, by the has_mask field, or else by whether input 3 has the packed cache's last
// dimension). Outputs: Y (Q's type), present_key, present_value (uint8 [B, Hkv, S_past + S_new, bytes]).
// Packed tensors are int8 instead where the packed_dtype field is 3 (--target tensorrt: plugin_base.h).
#pragma once

#include "plugin_base.h"
#include "turboquant/attention_setup.h"

namespace turboquant::trt {

class AttentionPlugin : public Plugin<AttentionPlugin> {
 public:
  static constexpr const char* kName = "TQAttention";
  static Fields declare();
  explicit AttentionPlugin(Fields f);

  int32_t getNbOutputs() const noexcept override { return 3; }
  int32_t getOutputDataTypes(nvinfer1::DataType* out, int32_t nbOutputs, const nvinfer1::DataType* in,
                             int32_t nbInputs) const noexcept override;
  int32_t getOutputShapes(const nvinfer1::DimsExprs* inputs, int32_t nbInputs, const nvinfer1::DimsExprs* shapeInputs,
                          int32_t nbShapeInputs, nvinfer1::DimsExprs* outputs, int32_t nbOutputs,
                          nvinfer1::IExprBuilder& eb) noexcept override;
  bool supportsFormatCombination(int32_t pos, const nvinfer1::DynamicPluginTensorDesc* inOut, int32_t nbInputs,
                                 int32_t nbOutputs) noexcept override;
  size_t getWorkspaceSize(const nvinfer1::DynamicPluginTensorDesc* inputs, int32_t nbInputs,
                          const nvinfer1::DynamicPluginTensorDesc* outputs, int32_t nbOutputs) const noexcept override;
  int32_t enqueue(const nvinfer1::PluginTensorDesc* inputDesc, const nvinfer1::PluginTensorDesc* outputDesc,
                  const void* const* inputs, void* const* outputs, void* workspace, cudaStream_t stream) noexcept override;

  // Which input is which: -1 for an absent one.
  struct Roles {
    int mask = -1, past_key = -1, past_value = -1, key_offset = -1, value_offset = -1;
  };
  static Roles roles_from_types(const nvinfer1::DataType* types, int32_t n);

 private:
  AttentionSetup setup(const nvinfer1::Dims* dims, const nvinfer1::DataType* types, int32_t n) const;
  AttentionAttrs attrs_;
  int has_mask_;  // 1, 0, or -1 (infer)
};

}  // namespace turboquant::trt
