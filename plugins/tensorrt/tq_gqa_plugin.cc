#include "tq_gqa_plugin.h"

#include <algorithm>
#include <optional>
#include <vector>

#include "turboquant/cuda_kernels.h"

namespace turboquant::trt {

using nvinfer1::DataType;
using nvinfer1::DimensionOperation;

namespace {

constexpr const char* kOp = GqaPlugin::kName;

const char* type_name(DataType t) {
  switch (t) {
    case DataType::kFLOAT: return "float32";
    case DataType::kHALF: return "float16";
    case DataType::kBF16: return "bfloat16";
    case DataType::kINT32: return "int32";
    case DataType::kINT64: return "int64";
    case DataType::kUINT8: return "uint8";
    case DataType::kINT8: return "int8";
    case DataType::kBOOL: return "bool";
    default: return "another type";
  }
}

std::optional<Dims> dims_at(const nvinfer1::Dims* dims, int i) {
  return i >= 0 ? std::optional<Dims>(to_dims(dims[i])) : std::nullopt;
}

}  // namespace

Fields GqaPlugin::declare() {
  Fields f;
  f.add_string("key_format", "mse4")
      .add_string("value_format", "uint4")
      .add_int("norm_correction", 1)
      .add_int("num_heads", 0)
      .add_int("kv_num_heads", 0)
      .add_float("scale", 0.f)
      .add_int("do_rotary", 0)
      .add_int("rotary_interleaved", 0)
      .add_int("local_window_size", -1)
      .add_float("softcap", 0.f)
      .add_int("smooth_softmax", 0)
      .add_int("qk_output", 0)
      .add_int("packed_qkv", -1)
      .add_int("packed_dtype", 2);
  return f;
}

GqaPlugin::GqaPlugin(Fields f) : Plugin(std::move(f)) {
  auto flag = [&](const char* name) {
    const int32_t v = fields_.get_int(name);
    if (v != 0 && v != 1) throw_invalid(kOp, "field '", name, "' must be 0 or 1, got ", v);
    return v == 1;
  };
  attrs_.key_format = field_format(kOp, fields_, "key_format");
  attrs_.value_format = field_format(kOp, fields_, "value_format");
  attrs_.norm_correction = flag("norm_correction");
  attrs_.num_heads = fields_.get_int("num_heads");
  attrs_.kv_num_heads = fields_.get_int("kv_num_heads");
  attrs_.scale = fields_.get_float("scale");
  attrs_.do_rotary = flag("do_rotary");
  attrs_.rotary_interleaved = flag("rotary_interleaved");
  attrs_.local_window_size = fields_.get_int("local_window_size");
  attrs_.softcap = fields_.get_float("softcap");
  attrs_.smooth_softmax = flag("smooth_softmax");
  attrs_.qk_output = fields_.get_int("qk_output");
  attrs_.validate();
  packed_qkv_ = fields_.get_int("packed_qkv");
  if (packed_qkv_ < -1 || packed_qkv_ > 1) {
    throw_invalid(kOp, "field 'packed_qkv' must be -1 (infer from input 1), 0 (key and value inputs) or 1 (QKV packed in "
                       "query), got ", packed_qkv_);
  }
  packed_known_ = packed_qkv_;
  packed_type_ = field_packed_type(kOp, fields_);
}

GqaPlugin::Roles GqaPlugin::roles(bool packed, const DataType* types, int32_t n) const {
  Roles r;
  int i = 1;
  if (!packed) r.key = i++, r.value = i++;
  r.past_key = i++;
  r.past_value = i++;
  r.seqlens_k = i++;
  r.total = i++;
  if (attrs_.do_rotary) r.cos = i++, r.sin = i++;
  if (i < n && types[i] == DataType::kINT64) r.position_ids = i++;
  if (i < n) r.key_offset = i++;
  if (i < n) r.value_offset = i++;
  if (i < n) r.key_scale = i++;
  r.count = i;
  return r;
}

GqaPlugin::Roles GqaPlugin::checked_roles(const nvinfer1::Dims* dims, const DataType* types, int32_t n) const {
  const bool packed = n > 1 && is_packed_type(types[1]);
  if (packed_qkv_ >= 0 && packed != (packed_qkv_ == 1)) {
    throw_invalid(kOp, "field packed_qkv = ", packed_qkv_, " but input 1 is ", type_name(n > 1 ? types[1] : DataType::kFLOAT),
                  " [", n > 1 ? dims_str(to_dims(dims[1])) : "", "] (", packed ? "past_key: QKV packed" : "key", ")");
  }
  const Roles r = roles(packed, types, n);
  if (n <= r.total || n > r.count) {
    throw_invalid(kOp, "has ", n, " inputs; expected query, ", packed ? "" : "key, value, ",
                  "past_key, past_value, seqlens_k, the length carrier", attrs_.do_rotary ? ", cos_cache, sin_cache" : "",
                  ", then optionally position_ids (int64), key_offset, value_offset and key_scale (float32)");
  }
  const DataType t = types[0];
  auto expect = [&](int i, DataType want, const char* name) {
    if (i >= 0 && types[i] != want) {
      throw_invalid(kOp, "input ", i, " (", name, ") is ", type_name(types[i]), "; expected ", type_name(want));
    }
  };
  if (!is_float(t)) throw_invalid(kOp, "input 0 (query) is ", type_name(t), "; expected float32, float16 or bfloat16");
  expect(r.key, t, "key");
  expect(r.value, t, "value");
  expect(r.past_key, packed_type_, "past_key");
  expect(r.past_value, packed_type_, "past_value");
  expect(r.seqlens_k, DataType::kINT32, "seqlens_k");
  expect(r.total, DataType::kINT32, "the length carrier of total_sequence_length");
  expect(r.cos, t, "cos_cache");
  expect(r.sin, t, "sin_cache");
  // GroupQueryAttention's head_sink ([num_heads], input 11 of the ONNX node) has no place among the
  // plugin's inputs: a 1-D input where key_offset ([kv_num_heads, head_size]) goes is refused by name,
  // not read as an offset
  if (r.key_offset >= 0 && dims[r.key_offset].nbDims == 1) {
    throw_invalid(kOp, "input ", r.key_offset, " is 1-D [", dims_str(to_dims(dims[r.key_offset])),
                  "]: head_sink (attention sinks) is not supported by the TensorRT plugin; key_offset is [kv_num_heads, head_size]");
  }
  expect(r.key_offset, DataType::kFLOAT, "key_offset");
  expect(r.value_offset, DataType::kFLOAT, "value_offset");
  expect(r.key_scale, DataType::kFLOAT, "key_scale");
  return r;
}

GqaSetup GqaPlugin::setup(const nvinfer1::Dims* dims, const DataType* types, int32_t n, int64_t* total,
                          Roles* roles_out) const {
  const Roles r = checked_roles(dims, types, n);
  if (roles_out) *roles_out = r;
  const Dims carrier = to_dims(dims[r.total]);
  if (carrier.size() != 2) {
    throw_invalid(kOp, "input ", r.total, " has shape ", dims_str(carrier),
                  "; expected the length carrier [N, total_sequence_length] (--target tensorrt makes it from the "
                  "total_sequence_length scalar, whose value TensorRT keeps on the device)");
  }
  *total = carrier[1];
  const Dims past_key = to_dims(dims[r.past_key]), past_value = to_dims(dims[r.past_value]);
  if (past_key.size() == 4 && *total > past_key[2]) {
    throw_invalid(kOp, "total_sequence_length (", *total, ") is beyond the ", past_key[2], " rows of the cache buffers ",
                  dims_str(past_key), ": present aliases past (updated in place), so the buffers must hold every token");
  }
  const GqaShapes s{to_dims(dims[0]), dims_at(dims, r.key), dims_at(dims, r.value), past_key, past_value,
                    to_dims(dims[r.seqlens_k]), Dims{}, dims_at(dims, r.cos), dims_at(dims, r.sin),
                    dims_at(dims, r.position_ids), std::nullopt, std::nullopt, dims_at(dims, r.key_offset),
                    dims_at(dims, r.value_offset), dims_at(dims, r.key_scale)};
  return setup_gqa(attrs_, s, to_dtype(types[0]), *total);
}

int32_t GqaPlugin::getOutputDataTypes(DataType* out, int32_t, const DataType* in, int32_t) const noexcept {
  out[0] = in[0];
  out[1] = out[2] = packed_type_;
  return 0;
}

int32_t GqaPlugin::getOutputShapes(const nvinfer1::DimsExprs* in, int32_t n, const nvinfer1::DimsExprs*, int32_t,
                                   nvinfer1::DimsExprs* out, int32_t, nvinfer1::IExprBuilder& eb) noexcept {
  // Input 1 is past_key (4-D) when QKV is packed, else key (3-D).
  const bool packed = packed_qkv_ >= 0 ? packed_qkv_ == 1 : n > 1 && in[1].nbDims == 4;
  const int past = packed ? 1 : 3;
  if (n < past + 4 || in[0].nbDims != 3 || in[past].nbDims != 4 || in[past + 1].nbDims != 4 ||
      (!packed && (in[1].nbDims != 3 || in[2].nbDims != 3))) {
    log_error(std::string(kOp) + ": expected query [B, S, hidden], " + (packed ? "" : "key and value [B, S, Hkv*D], ") +
              "past_key and past_value [B, Hkv, capacity, W], seqlens_k and the length carrier" +
              (packed_qkv_ >= 0 ? " (as the packed_qkv field says)" : ""));
    return -1;
  }
  packed_known_ = packed ? 1 : 0;
  out[0] = in[0];
  if (packed) {  // [B, S, (Hq + 2 Hkv) D] -> [B, S, Hq D]
    const int64_t hq = attrs_.num_heads, all = hq + 2 * attrs_.kv_num_heads;
    out[0].d[2] = eb.operation(DimensionOperation::kFLOOR_DIV, *eb.operation(DimensionOperation::kPROD, *in[0].d[2], *eb.constant(hq)),
                               *eb.constant(all));
  }
  out[1] = in[past];
  out[2] = in[past + 1];
  return 0;
}

bool GqaPlugin::supportsFormatCombination(int32_t pos, const nvinfer1::DynamicPluginTensorDesc* io, int32_t nbInputs,
                                          int32_t) noexcept {
  const auto& t = io[pos].desc;
  if (t.format != nvinfer1::TensorFormat::kLINEAR) return false;
  const DataType q = io[0].desc.type;
  if (pos == 0) return is_float(t.type);
  if (pos >= nbInputs) return t.type == (pos == nbInputs ? q : packed_type_);
  const bool packed = packed_qkv_ >= 0 ? packed_qkv_ == 1 : is_packed_type(io[1].desc.type);
  std::vector<DataType> types(pos + 1);
  for (int i = 0; i <= pos; ++i) types[i] = io[i].desc.type;
  const Roles r = roles(packed, types.data(), pos + 1);
  if (pos >= r.count) return false;
  if (pos == r.key || pos == r.value || pos == r.cos || pos == r.sin) return t.type == q;
  if (pos == r.past_key || pos == r.past_value) return t.type == packed_type_;
  if (pos == r.seqlens_k || pos == r.total) return t.type == DataType::kINT32;
  if (pos == r.position_ids) return true;  // int64, by which it was recognised
  return t.type == DataType::kFLOAT;       // the offsets and key_scale
}

int32_t GqaPlugin::configurePlugin(const nvinfer1::DynamicPluginTensorDesc* in, int32_t nbInputs,
                                   const nvinfer1::DynamicPluginTensorDesc* out, int32_t nbOutputs) noexcept {
  if (packed_qkv_ < 0 && nbInputs > 1) packed_known_ = is_packed_type(in[1].desc.type) ? 1 : 0;
  return Plugin::configurePlugin(in, nbInputs, out, nbOutputs);
}

int32_t GqaPlugin::getAliasedInput(int32_t outputIndex) noexcept {
  if (outputIndex != 1 && outputIndex != 2) return -1;
  if (packed_known_ < 0) {
    // Not aliased: present is then a buffer of its own, the past copied in every step (correct, slower).
    log_error(std::string(kOp) + ": cannot tell which input is past_key before the inputs are known; set the "
              "packed_qkv field (--target tensorrt does) for present to alias past");
    return -1;
  }
  return (packed_known_ == 1 ? 1 : 3) + (outputIndex - 1);
}

size_t GqaPlugin::getWorkspaceSize(const nvinfer1::DynamicPluginTensorDesc* in, int32_t n,
                                   const nvinfer1::DynamicPluginTensorDesc*, int32_t) const noexcept {
  try {
    std::vector<nvinfer1::Dims> dims(n);
    std::vector<DataType> types(n);
    for (int i = 0; i < n; ++i) dims[i] = in[i].max, types[i] = in[i].desc.type;
    const Roles r = checked_roles(dims.data(), types.data(), n);
    // The most tokens a call can hold: the carrier's largest total within the buffers' rows.
    nvinfer1::Dims& carrier = dims[r.total];
    const int64_t s_max = in[0].max.d[1], s_min = in[0].min.d[1];
    if (carrier.nbDims == 2 && dims[r.past_key].nbDims == 4) {
      carrier.d[1] = std::max(std::min(carrier.d[1], dims[r.past_key].d[2]), s_max);
    }
    int64_t total = 0;
    const GqaSetup st = setup(dims.data(), types.data(), n, &total);
    // each batch size and S with the longest past it can have
    const int sms = sm_count();
    return largest_over_profile(st.params, in[0].min.d[0], s_min, [&](AttentionParams& p) {
      p.new_len = p.q_len;
      p.past_len = total - p.q_len;
      return cuda::gqa_workspace_bytes(p, st.rotary, sms);
    });
  } catch (const std::exception& e) {
    log_error(e.what());
    return 0;
  }
}

int32_t GqaPlugin::enqueue(const nvinfer1::PluginTensorDesc* in, const nvinfer1::PluginTensorDesc*,
                           const void* const* inputs, void* const* outputs, void* workspace, cudaStream_t stream) noexcept {
  try {
    const int32_t n = num_inputs_;
    std::vector<nvinfer1::Dims> dims(n);
    std::vector<DataType> types(n);
    for (int i = 0; i < n; ++i) dims[i] = in[i].dims, types[i] = in[i].type;
    int64_t total = 0;
    Roles r;
    GqaSetup st = setup(dims.data(), types.data(), n, &total, &r);
    AttentionParams& p = st.params;
    if (r.key_offset >= 0) p.key_offset = static_cast<const float*>(inputs[r.key_offset]);
    if (r.value_offset >= 0) p.value_offset = static_cast<const float*>(inputs[r.value_offset]);
    RotaryParams& rot = st.rotary;
    if (rot.rotary_dim > 0) {
      rot.cos = inputs[r.cos];
      rot.sin = inputs[r.sin];
      rot.position_ids = r.position_ids >= 0 ? static_cast<const int64_t*>(inputs[r.position_ids]) : nullptr;
      rot.key_scale = r.key_scale >= 0 ? static_cast<const float*>(inputs[r.key_scale]) : nullptr;
    }
    const size_t es = static_cast<size_t>(dtype_size(p.dtype));
    const auto* qbase = static_cast<const uint8_t*>(inputs[0]);
    const void* k = st.packed_qkv ? qbase + st.k_first * es : inputs[r.key];
    const void* v = st.packed_qkv ? qbase + st.v_first * es : inputs[r.value];
    const auto* past_key = static_cast<const uint8_t*>(inputs[r.past_key]);
    const auto* past_value = static_cast<const uint8_t*>(inputs[r.past_value]);
    auto* present_key = static_cast<uint8_t*>(outputs[1]);
    auto* present_value = static_cast<uint8_t*>(outputs[2]);
    if (!cuda::caches_aligned(past_key, past_value, present_key, present_value)) {
      throw_invalid(kOp, "the packed caches (past_key, past_value, present_key, present_value) must start at multiples of ",
                    cuda::kCacheAlignment, " bytes");
    }
    return launch_status(kOp, cuda::gqa_attention(p, rot, static_cast<const int32_t*>(inputs[r.seqlens_k]),
                                                  st.first_prompt, qbase, k, v, past_key, past_value, outputs[0],
                                                  present_key, present_value, workspace, sm_count(), stream));
  } catch (const std::exception& e) {
    log_error(e.what());
    return -1;
  }
}

}  // namespace turboquant::trt
