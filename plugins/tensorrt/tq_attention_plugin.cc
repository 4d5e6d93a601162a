#include "tq_attention_plugin.h"

#include <cuda_runtime_api.h>

#include <vector>

#include "turboquant/cuda_kernels.h"

namespace turboquant::trt {

using nvinfer1::DataType;
using nvinfer1::DimensionOperation;

namespace {

MaskType mask_type_of(DataType t) {
  switch (t) {
    case DataType::kBOOL: return MaskType::kBool;
    case DataType::kFLOAT: return MaskType::kFloat32;
    case DataType::kHALF: return MaskType::kFloat16;
    case DataType::kBF16: return MaskType::kBFloat16;
    default: return MaskType::kNone;
  }
}

}  // namespace

Fields AttentionPlugin::declare() {
  Fields f;
  f.add_string("key_format", "mse4")
      .add_string("value_format", "uint4")
      .add_int("norm_correction", 1)
      .add_int("is_causal", 0)
      .add_int("head_dim", 0)
      .add_int("q_num_heads", 0)
      .add_int("kv_num_heads", 0)
      .add_float("scale", 0.f)
      .add_int("has_mask", -1)
      .add_int("packed_dtype", 2);
  return f;
}

AttentionPlugin::AttentionPlugin(Fields f) : Plugin(std::move(f)) {
  attrs_.key_format = field_format(kName, fields_, "key_format");
  attrs_.value_format = field_format(kName, fields_, "value_format");
  attrs_.norm_correction = fields_.get_int("norm_correction") != 0;
  attrs_.is_causal = fields_.get_int("is_causal") != 0;
  attrs_.head_dim = fields_.get_int("head_dim");
  attrs_.q_num_heads = fields_.get_int("q_num_heads");
  attrs_.kv_num_heads = fields_.get_int("kv_num_heads");
  attrs_.scale = fields_.get_float("scale");
  attrs_.validate();
  has_mask_ = fields_.get_int("has_mask");
  if (has_mask_ < -1 || has_mask_ > 1) throw InvalidArgument("TQAttention: field 'has_mask' must be -1 (infer), 0 or 1");
  packed_type_ = field_packed_type(kName, fields_);
}

AttentionPlugin::Roles AttentionPlugin::roles_from_types(const DataType* types, int32_t n) {
  Roles r;
  int i = 3;
  if (i < n && !is_packed_type(types[i])) r.mask = i++;
  if (i < n && is_packed_type(types[i])) {
    r.past_key = i++;
    r.past_value = i < n ? i++ : -1;
  }
  if (i < n) r.key_offset = i++;
  if (i < n) r.value_offset = i++;
  return r;
}

AttentionSetup AttentionPlugin::setup(const nvinfer1::Dims* dims, const DataType* types, int32_t n) const {
  if (n < 3) throw InvalidArgument("TQAttention: needs at least Q, K and V");
  const Roles r = roles_from_types(types, n);
  if (r.past_key >= 0 && r.past_value < 0) throw InvalidArgument("TQAttention: past_key given without past_value");
  if (r.key_offset >= 0 && r.past_key < 0) throw InvalidArgument("TQAttention: offsets need past_key and past_value");
  AttentionShapes s{to_dims(dims[0]), to_dims(dims[1]), to_dims(dims[2]), {}, {}, {}, {}, {}};
  if (r.mask >= 0) s.mask = to_dims(dims[r.mask]);
  if (r.past_key >= 0) s.past_key = to_dims(dims[r.past_key]), s.past_value = to_dims(dims[r.past_value]);
  if (r.key_offset >= 0) s.key_offset = to_dims(dims[r.key_offset]);
  if (r.value_offset >= 0) s.value_offset = to_dims(dims[r.value_offset]);
  const MaskType mt = r.mask >= 0 ? mask_type_of(types[r.mask]) : MaskType::kNone;
  if (r.mask >= 0 && mt == MaskType::kNone) throw InvalidArgument("TQAttention: attn_mask must be bool or a float type");
  return setup_attention(attrs_, s, to_dtype(types[0]), mt);
}

int32_t AttentionPlugin::getOutputDataTypes(DataType* out, int32_t, const DataType* in, int32_t) const noexcept {
  out[0] = in[0];
  out[1] = out[2] = packed_type_;
  return 0;
}

int32_t AttentionPlugin::getOutputShapes(const nvinfer1::DimsExprs* in, int32_t n, const nvinfer1::DimsExprs*, int32_t,
                                         nvinfer1::DimsExprs* out, int32_t, nvinfer1::IExprBuilder& eb) noexcept {
  const nvinfer1::DimsExprs &q = in[0], &k = in[1], &v = in[2];
  const bool rank4 = q.nbDims == 4;
  if ((q.nbDims != 4 && q.nbDims != 3) || k.nbDims != q.nbDims || v.nbDims != q.nbDims) {
    log_error("TQAttention: Q, K and V must all be 4-D [B, H, S, D] or all 3-D [B, S, H*D]");
    return -1;
  }
  // The head size D, needed for the packed sizes.
  int64_t d = attrs_.head_dim;
  if (d == 0 && rank4 && q.d[3]->isConstant()) d = q.d[3]->getConstantValue();
  if (d == 0 && !rank4 && attrs_.kv_num_heads > 0 && k.d[2]->isConstant()) d = k.d[2]->getConstantValue() / attrs_.kv_num_heads;
  int64_t dv = d;
  if (rank4 && v.d[3]->isConstant()) dv = v.d[3]->getConstantValue();
  if (!rank4 && attrs_.kv_num_heads > 0 && v.d[2]->isConstant()) dv = v.d[2]->getConstantValue() / attrs_.kv_num_heads;
  if (!head_dim_supported(d) || !head_dim_supported(dv)) {
    log_error("TQAttention: the head size must be known when the engine is built (a constant last dimension, or "
              "the head_dim and kv_num_heads fields)");
    return -1;
  }
  const int64_t kb = packed_size(attrs_.key_format, static_cast<int>(d));
  // Where the past is: after the mask if there is one.
  int past = -1;
  if (n >= 5) {
    bool mask = has_mask_ == 1;
    if (has_mask_ == -1) {  // input 3 is the past when it has the packed key size as its last dimension
      const auto* last = in[3].nbDims == 4 ? in[3].d[3] : nullptr;
      mask = !(last && last->isConstant() && last->getConstantValue() == kb);
    }
    past = mask ? 4 : 3;
    if (past + 1 >= n) past = -1;
  }
  out[0] = q;
  if (rank4) {
    out[0].d[3] = v.d[3];
  } else {  // [B, S, Hq*Dv] = (Hq*D / Hkv*D) * Hkv*Dv
    out[0].d[2] = eb.operation(DimensionOperation::kPROD, *eb.operation(DimensionOperation::kFLOOR_DIV, *q.d[2], *k.d[2]), *v.d[2]);
  }
  const nvinfer1::IDimensionExpr* new_len = rank4 ? k.d[2] : k.d[1];
  const nvinfer1::IDimensionExpr* hkv = rank4 ? k.d[1] : eb.constant(attrs_.kv_num_heads);
  for (int o = 1; o <= 2; ++o) {
    const int64_t bytes = packed_size(o == 1 ? attrs_.key_format : attrs_.value_format, static_cast<int>(o == 1 ? d : dv));
    out[o].nbDims = 4;
    out[o].d[0] = q.d[0];
    out[o].d[1] = past >= 0 ? in[past].d[1] : hkv;
    out[o].d[2] = past >= 0 ? eb.operation(DimensionOperation::kSUM, *in[past + o - 1].d[2], *new_len) : new_len;
    out[o].d[3] = eb.constant(bytes);
  }
  return 0;
}

bool AttentionPlugin::supportsFormatCombination(int32_t pos, const nvinfer1::DynamicPluginTensorDesc* io,
                                                int32_t nbInputs, int32_t) noexcept {
  const auto& t = io[pos].desc;
  if (t.format != nvinfer1::TensorFormat::kLINEAR) return false;
  if (pos == 0) return is_float(t.type);
  if (pos < 3) return t.type == io[0].desc.type;  // K, V
  if (pos >= nbInputs) return pos == nbInputs ? t.type == io[0].desc.type : t.type == packed_type_;
  // Optional inputs: input 3 is the mask (bool or float) or past_key (packed); the rest follow.
  std::vector<DataType> types(pos + 1);
  for (int i = 0; i <= pos; ++i) types[i] = io[i].desc.type;
  const Roles r = roles_from_types(types.data(), pos + 1);
  if (pos == r.mask) return has_mask_ != 0 && mask_type_of(t.type) != MaskType::kNone;
  if (pos == r.past_key) return t.type == packed_type_ && (has_mask_ != 1 || r.mask >= 0);
  if (pos == r.past_value) return t.type == packed_type_;
  return t.type == DataType::kFLOAT;  // offsets
}

size_t AttentionPlugin::getWorkspaceSize(const nvinfer1::DynamicPluginTensorDesc* in, int32_t n,
                                         const nvinfer1::DynamicPluginTensorDesc*, int32_t) const noexcept {
  try {
    std::vector<nvinfer1::Dims> dims(n);
    std::vector<DataType> types(n);
    for (int i = 0; i < n; ++i) dims[i] = in[i].max, types[i] = in[i].desc.type;
    const nvinfer1::Dims& q_min = in[0].min;  // [B, H, Sq, D] or [B, Sq, H*D]
    const int sms = sm_count();
    return largest_over_profile(setup(dims.data(), types.data(), n).params, q_min.d[0], q_min.d[q_min.nbDims == 4 ? 2 : 1],
                                [&](const AttentionParams& p) { return cuda::attention_workspace_bytes(p, sms); });
  } catch (const std::exception& e) {
    log_error(e.what());
    return 0;
  }
}

int32_t AttentionPlugin::enqueue(const nvinfer1::PluginTensorDesc* in, const nvinfer1::PluginTensorDesc*,
                                 const void* const* inputs, void* const* outputs, void* workspace,
                                 cudaStream_t stream) noexcept {
  try {
    const int32_t n = num_inputs_;
    std::vector<nvinfer1::Dims> dims(n);
    std::vector<DataType> types(n);
    for (int i = 0; i < n; ++i) dims[i] = in[i].dims, types[i] = in[i].type;
    AttentionSetup st = setup(dims.data(), types.data(), n);
    const Roles r = roles_from_types(types.data(), n);
    AttentionParams& p = st.params;
    if (r.key_offset >= 0) p.key_offset = static_cast<const float*>(inputs[r.key_offset]);
    if (r.value_offset >= 0) p.value_offset = static_cast<const float*>(inputs[r.value_offset]);
    const auto* past_key = r.past_key >= 0 ? static_cast<const uint8_t*>(inputs[r.past_key]) : nullptr;
    const auto* past_value = r.past_value >= 0 ? static_cast<const uint8_t*>(inputs[r.past_value]) : nullptr;
    return launch_status(kName, cuda::attention(p, inputs[0], inputs[1], inputs[2], r.mask >= 0 ? inputs[r.mask] : nullptr,
                                                past_key, past_value, outputs[0], static_cast<uint8_t*>(outputs[1]),
                                                static_cast<uint8_t*>(outputs[2]), workspace, sm_count(), stream));
  } catch (const std::exception& e) {
    log_error(e.what());
    return -1;
  }
}

}  // namespace turboquant::trt
