// TQGroupQueryAttention as a TensorRT IPluginV3 plugin over ops/cuda's gqa_attention, its packed
// caches updated in place: present_key and present_value alias past_key and past_value
// (IPluginV3OneBuildV2::getAliasedInput, PreviewFeature::kALIASED_PLUGIN_IO_10_03), so a step
// writes only its new rows.
// Inputs, absent optional ones left out: query (T), then key and value (T) unless QKV is packed in
// query, past_key and past_value (uint8 [B, Hkv, capacity, W]), seqlens_k (int32 [B], device),
// the length carrier (int32 [N, total_sequence_length]: its shape gives the total on the host, its
// data is never read), cos_cache and sin_cache (T) exactly when do_rotary, position_ids (int64
// [B, S]), key_offset, value_offset and key_scale (float32 [Hkv, D]; each needs the ones before it).
// Outputs: output (T [B, S, Hq*D]), present_key and present_value (past's shapes, aliased).
// Packed tensors are int8 instead where the packed_dtype field is 3 (--target tensorrt: plugin_base.h).
#pragma once

#include "plugin_base.h"
#include "turboquant/gqa_setup.h"

namespace turboquant::trt {

class GqaPlugin : public Plugin<GqaPlugin, nvinfer1::IPluginV3OneBuildV2> {
 public:
  static constexpr const char* kName = "TQGroupQueryAttention";
  static Fields declare();
  explicit GqaPlugin(Fields f);

  int32_t getNbOutputs() const noexcept override { return 3; }
  int32_t getOutputDataTypes(nvinfer1::DataType* out, int32_t nbOutputs, const nvinfer1::DataType* in,
                             int32_t nbInputs) const noexcept override;
  int32_t getOutputShapes(const nvinfer1::DimsExprs* inputs, int32_t nbInputs, const nvinfer1::DimsExprs* shapeInputs,
                          int32_t nbShapeInputs, nvinfer1::DimsExprs* outputs, int32_t nbOutputs,
                          nvinfer1::IExprBuilder& eb) noexcept override;
  bool supportsFormatCombination(int32_t pos, const nvinfer1::DynamicPluginTensorDesc* inOut, int32_t nbInputs,
                                 int32_t nbOutputs) noexcept override;
  int32_t configurePlugin(const nvinfer1::DynamicPluginTensorDesc* in, int32_t nbInputs,
                          const nvinfer1::DynamicPluginTensorDesc* out, int32_t nbOutputs) noexcept override;
  size_t getWorkspaceSize(const nvinfer1::DynamicPluginTensorDesc* inputs, int32_t nbInputs,
                          const nvinfer1::DynamicPluginTensorDesc* outputs, int32_t nbOutputs) const noexcept override;
  int32_t getAliasedInput(int32_t outputIndex) noexcept override;
  int32_t enqueue(const nvinfer1::PluginTensorDesc* inputDesc, const nvinfer1::PluginTensorDesc* outputDesc,
                  const void* const* inputs, void* const* outputs, void* workspace, cudaStream_t stream) noexcept override;

  // Which input is which (-1: absent), and how many inputs that layout has.
  struct Roles {
    int key = -1, value = -1, past_key = -1, past_value = -1, seqlens_k = -1, total = -1;
    int cos = -1, sin = -1, position_ids = -1, key_offset = -1, value_offset = -1, key_scale = -1;
    int count = 0;
  };
  // From the packing (packed: no key and value inputs) and the types of the first n inputs.
  Roles roles(bool packed, const nvinfer1::DataType* types, int32_t n) const;

 private:
  // The setup for these input shapes and types, with total_sequence_length from the carrier's shape.
  GqaSetup setup(const nvinfer1::Dims* dims, const nvinfer1::DataType* types, int32_t n, int64_t* total,
                 Roles* roles = nullptr) const;
  Roles checked_roles(const nvinfer1::Dims* dims, const nvinfer1::DataType* types, int32_t n) const;
  GqaAttrs attrs_;
  int packed_qkv_;  // the field: 1, 0, or -1 (infer from input 1)
  int packed_known_ = -1;  // packed_qkv_, or what the inputs showed once configured
};

}  // namespace turboquant::trt
