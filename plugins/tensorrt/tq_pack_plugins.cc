#include "tq_pack_plugins.h"

#include <sstream>

#include "turboquant/attention_setup.h"  // InvalidArgument
#include "turboquant/cuda_kernels.h"

namespace turboquant::trt {

using nvinfer1::DataType;

Format field_format(const char* op, const Fields& f, const char* name) {
  const Format fmt = parse_format(f.get_string(name).c_str());
  if (fmt == Format::kInvalid) {
    throw InvalidArgument(std::string(op) + ": field '" + name + "' is '" + f.get_string(name) + "'; expected one of " +
                          kFormatList);
  }
  return fmt;
}

DataType field_packed_type(const char* op, const Fields& f) {
  switch (f.get_int("packed_dtype")) {  // ONNX TensorProto element types
    case 2: return DataType::kUINT8;
    case 3: return DataType::kINT8;
    default:
      throw InvalidArgument(std::string(op) + ": field 'packed_dtype' is " + std::to_string(f.get_int("packed_dtype")) +
                            "; expected 2 (uint8) or 3 (int8, the same bytes)");
  }
}

namespace {

void check_head_dim(const char* op, int64_t d, bool allow_zero) {
  if ((allow_zero && d == 0) || head_dim_supported(d)) return;
  std::ostringstream os;
  os << op << ": head_dim " << d << " is not supported; expected a multiple of 8 from " << kMinHeadDim << " to "
     << kMaxHeadDim;
  throw InvalidArgument(os.str());
}

// The Offset view of an optional offset input ([D] or [H, D] over x's [..., H, S, D]).
Offset offset_of(const nvinfer1::PluginTensorDesc* desc, const void* const* inputs, int32_t nb, const nvinfer1::Dims& x) {
  Offset off;
  if (nb < 2) return off;
  const nvinfer1::Dims& o = desc[1].dims;
  off.data = static_cast<const float*>(inputs[1]);
  if (o.nbDims == 2 && x.nbDims >= 3) {
    off.rows = o.d[0];
    off.period = x.d[x.nbDims - 2];
  }
  return off;
}

}  // namespace

// ---- TQPack -------------------------------------------------------------------------------------

Fields PackPlugin::declare() {
  Fields f;
  f.add_string("format", "").add_int("head_dim", 0).add_int("norm_correction", 1).add_int("packed_dtype", 2);
  return f;
}

PackPlugin::PackPlugin(Fields f) : Plugin(std::move(f)) {
  format_ = field_format(kName, fields_, "format");
  head_dim_ = fields_.get_int("head_dim");
  check_head_dim(kName, head_dim_, /*allow_zero=*/true);
  norm_correction_ = fields_.get_int("norm_correction") != 0;
  packed_type_ = field_packed_type(kName, fields_);
}

int32_t PackPlugin::getOutputDataTypes(DataType* out, int32_t, const DataType*, int32_t) const noexcept {
  out[0] = packed_type_;
  return 0;
}

int32_t PackPlugin::getOutputShapes(const nvinfer1::DimsExprs* in, int32_t, const nvinfer1::DimsExprs*, int32_t,
                                    nvinfer1::DimsExprs* out, int32_t, nvinfer1::IExprBuilder& eb) noexcept {
  const nvinfer1::DimsExprs& x = in[0];
  if (x.nbDims < 1) return -1;
  int64_t d = head_dim_;
  const nvinfer1::IDimensionExpr* last = x.d[x.nbDims - 1];
  if (d == 0 && last->isConstant()) d = last->getConstantValue();
  if (!head_dim_supported(d)) {
    log_error("TQPack: the vector length (last dimension, or field head_dim) must be a build-time constant and a "
              "supported head_dim");
    return -1;
  }
  out[0] = x;
  out[0].d[x.nbDims - 1] = eb.constant(packed_size(format_, static_cast<int>(d)));
  return 0;
}

bool PackPlugin::supportsFormatCombination(int32_t pos, const nvinfer1::DynamicPluginTensorDesc* io, int32_t nbInputs,
                                           int32_t) noexcept {
  const auto& t = io[pos].desc;
  if (t.format != nvinfer1::TensorFormat::kLINEAR) return false;
  if (pos == 0) return is_float(t.type);
  if (pos < nbInputs) return t.type == DataType::kFLOAT;  // offset
  return t.type == packed_type_;
}

int32_t PackPlugin::enqueue(const nvinfer1::PluginTensorDesc* in, const nvinfer1::PluginTensorDesc* out,
                            const void* const* inputs, void* const* outputs, void*, cudaStream_t stream) noexcept {
  const nvinfer1::Dims& x = in[0].dims;
  const int d = static_cast<int>(x.d[x.nbDims - 1]);
  if (!head_dim_supported(d) || (head_dim_ != 0 && d != head_dim_)) {
    log_error("TQPack: the input's last dimension " + std::to_string(d) + " is not the packed vector length");
    return -1;
  }
  (void)out;
  return launch_status(kName, cuda::pack(format_, d, norm_correction_, to_dtype(in[0].type), inputs[0], volume_but_last(x),
                                  offset_of(in, inputs, num_inputs_, x), static_cast<uint8_t*>(outputs[0]), stream));
}

// ---- TQUnpack -----------------------------------------------------------------------------------

Fields UnpackPlugin::declare() {
  Fields f;
  f.add_string("format", "").add_int("head_dim", 0).add_int("dtype", 1).add_int("packed_dtype", 2);
  return f;
}

UnpackPlugin::UnpackPlugin(Fields f) : Plugin(std::move(f)) {
  format_ = field_format(kName, fields_, "format");
  head_dim_ = fields_.get_int("head_dim");
  check_head_dim(kName, head_dim_, /*allow_zero=*/false);
  packed_type_ = field_packed_type(kName, fields_);
  switch (fields_.get_int("dtype")) {  // ONNX TensorProto element types, as the ONNX op's attribute
    case 1: out_type_ = DataType::kFLOAT; break;
    case 10: out_type_ = DataType::kHALF; break;
    case 16: out_type_ = DataType::kBF16; break;
    default:
      throw InvalidArgument("TQUnpack: field 'dtype' is " + std::to_string(fields_.get_int("dtype")) +
                            "; expected 1 (float32), 10 (float16) or 16 (bfloat16)");
  }
}

int32_t UnpackPlugin::getOutputDataTypes(DataType* out, int32_t, const DataType*, int32_t) const noexcept {
  out[0] = out_type_;
  return 0;
}

int32_t UnpackPlugin::getOutputShapes(const nvinfer1::DimsExprs* in, int32_t, const nvinfer1::DimsExprs*, int32_t,
                                      nvinfer1::DimsExprs* out, int32_t, nvinfer1::IExprBuilder& eb) noexcept {
  if (in[0].nbDims < 1) return -1;
  out[0] = in[0];
  out[0].d[in[0].nbDims - 1] = eb.constant(head_dim_);
  return 0;
}

bool UnpackPlugin::supportsFormatCombination(int32_t pos, const nvinfer1::DynamicPluginTensorDesc* io,
                                             int32_t nbInputs, int32_t) noexcept {
  const auto& t = io[pos].desc;
  if (t.format != nvinfer1::TensorFormat::kLINEAR) return false;
  if (pos == 0) return t.type == packed_type_;
  if (pos < nbInputs) return t.type == DataType::kFLOAT;  // offset
  return t.type == out_type_;
}

int32_t UnpackPlugin::enqueue(const nvinfer1::PluginTensorDesc* in, const nvinfer1::PluginTensorDesc* out,
                              const void* const* inputs, void* const* outputs, void*, cudaStream_t stream) noexcept {
  const nvinfer1::Dims& x = in[0].dims;
  if (x.nbDims < 1 || x.d[x.nbDims - 1] != packed_size(format_, head_dim_)) {
    log_error("TQUnpack: the input's last dimension must be " + std::to_string(packed_size(format_, head_dim_)) +
              " bytes (" + format_name(format_) + " vectors of head_dim " + std::to_string(head_dim_) + ")");
    return -1;
  }
  return launch_status(kName, cuda::unpack(format_, head_dim_, static_cast<const uint8_t*>(inputs[0]), volume_but_last(x),
                                    offset_of(in, inputs, num_inputs_, out[0].dims), to_dtype(out[0].type), outputs[0],
                                    stream));
}

}  // namespace turboquant::trt
