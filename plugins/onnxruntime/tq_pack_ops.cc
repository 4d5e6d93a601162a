#include "tq_pack_ops.h"

#include "cuda_dispatch.h"

namespace turboquant::ort {
namespace {

constexpr const char* kPack = "TQPack";
constexpr const char* kUnpack = "TQUnpack";

int64_t count_vectors(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (size_t i = 0; i + 1 < shape.size(); ++i) n *= shape[i];
  return n;
}

bool is_float_type(ONNXTensorElementDataType t) {
  return t == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT || t == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16 ||
         t == ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16;
}

}  // namespace

cpu::Offset read_offset(const char* op, const Ort::ConstValue& offset, const std::vector<int64_t>& vec_shape,
                        int64_t d, const char* input_name) {
  cpu::Offset out;
  if (!offset) return out;
  auto info = offset.GetTensorTypeAndShapeInfo();
  if (info.GetElementType() != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT) {
    fail(op, "input '", input_name, "' must be float32, got ", dtype_name(info.GetElementType()));
  }
  const auto s = info.GetShape();
  const size_t r = vec_shape.size();
  if (s.size() == 1 && s[0] == d) {
    out.rows = 1;
  } else if (s.size() == 2 && s[1] == d && r >= 3 && s[0] == vec_shape[r - 3]) {
    out.rows = s[0];
    out.period = vec_shape[r - 2];
  } else {
    fail(op, "input '", input_name, "' has shape ", shape_str(s), "; expected [", d, "] or [H, ", d,
         "] with H the third-last dimension of a tensor shaped ", shape_str(vec_shape));
  }
  out.data = offset.GetTensorData<float>();
  if (out.period == 0) out.data = nullptr;  // no vectors
  return out;
}

PackKernel::PackKernel(const OrtKernelInfo* info, ONNXTensorElementDataType, Device dev) : device(dev) {
  format = attr_format(kPack, info, "format", "");
  head_dim = attr_int(kPack, info, "head_dim", 0);
  norm_correction = attr_bool(kPack, info, "norm_correction", true);
  if (head_dim != 0 && !head_dim_supported(head_dim)) {
    fail(kPack, "attribute 'head_dim' is ", head_dim, "; expected a multiple of 8 from ", kMinHeadDim, " to ",
         kMaxHeadDim);
  }
}

OrtStatusPtr PackKernel::ComputeV2(OrtKernelContext* context) {
  return guarded([&] {
    Ort::KernelContext ctx(context);
    auto x = ctx.GetInput(0);
    auto info = x.GetTensorTypeAndShapeInfo();
    const auto shape = info.GetShape();
    const auto type = info.GetElementType();
    if (!is_float_type(type)) fail(kPack, "input 'x' must be float32, float16 or bfloat16, got ", dtype_name(type));
    if (shape.empty()) fail(kPack, "input 'x' must have rank >= 1 (vectors on the last axis), got a scalar");
    const int64_t d = shape.back();
    if (head_dim != 0 && d != head_dim) {
      fail(kPack, "input 'x' has last dimension ", d, " but attribute 'head_dim' is ", head_dim);
    }
    if (!head_dim_supported(d)) {
      fail(kPack, "input 'x' has last dimension ", d, "; expected a head_dim that is a multiple of 8 from ",
           kMinHeadDim, " to ", kMaxHeadDim);
    }
    const cpu::Offset offset = read_offset(kPack, ctx.GetInput(1), shape, d, "offset");
    auto out_shape = shape;
    out_shape.back() = packed_size(format, static_cast<int>(d));
    auto y = ctx.GetOutput(0, out_shape);
    if (device == Device::kCuda) {
      cuda_pack(context, format, static_cast<int>(d), norm_correction, to_dtype(type), x.GetTensorRawData(),
                count_vectors(shape), offset, y.GetTensorMutableData<uint8_t>());
      return;
    }
    cpu::pack(format, static_cast<int>(d), norm_correction, to_dtype(type), x.GetTensorRawData(),
              count_vectors(shape), offset, y.GetTensorMutableData<uint8_t>(), ort_parallel_for(context));
  });
}

// Output: the input's shape with the last dimension replaced by head_dim, of type 'dtype'.
OrtStatusPtr ORT_API_CALL infer_unpack_output(const OrtCustomOp*, OrtShapeInferContext* ctx) {
  return guarded([&] {
    const OrtApi& api = Ort::GetApi();
    const int64_t dtype = infer_attr_int(kUnpack, ctx, "dtype", ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT);
    const int64_t head_dim = infer_attr_int(kUnpack, ctx, "head_dim", 0);
    if (dtype != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT && dtype != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16 &&
        dtype != ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16) {
      fail(kUnpack, "attribute 'dtype' is ", dtype, "; expected 1 (float32), 10 (float16) or 16 (bfloat16)");
    }
    OrtTensorTypeAndShapeInfo* raw_in = nullptr;
    Ort::ThrowOnError(api.ShapeInferContext_GetInputTypeShape(ctx, 0, &raw_in));
    Ort::ConstTensorTypeAndShapeInfo in(raw_in);  // owned by ORT
    std::vector<int64_t> dims = in.GetShape();
    std::vector<const char*> sym(dims.size(), "");
    if (!dims.empty()) in.GetSymbolicDimensions(sym.data(), sym.size());
    OrtTensorTypeAndShapeInfo* raw_out = nullptr;
    Ort::ThrowOnError(api.CreateTensorTypeAndShapeInfo(&raw_out));
    Ort::TensorTypeAndShapeInfo out(raw_out);
    Ort::ThrowOnError(api.SetTensorElementType(raw_out, static_cast<ONNXTensorElementDataType>(dtype)));
    if (!dims.empty()) {
      dims.back() = head_dim > 0 ? head_dim : -1;
      sym.back() = "";
      Ort::ThrowOnError(api.SetDimensions(raw_out, dims.data(), dims.size()));
      Ort::ThrowOnError(api.SetSymbolicDimensions(raw_out, sym.data(), sym.size()));
    }
    Ort::ThrowOnError(api.ShapeInferContext_SetOutputTypeShape(ctx, 0, raw_out));
  });
}

UnpackKernel::UnpackKernel(const OrtKernelInfo* info, ONNXTensorElementDataType, Device dev) : device(dev) {
  format = attr_format(kUnpack, info, "format", "");
  head_dim = attr_int(kUnpack, info, "head_dim", 0);
  if (!head_dim_supported(head_dim)) {
    fail(kUnpack, "attribute 'head_dim' is ", head_dim, "; expected a multiple of 8 from ", kMinHeadDim, " to ",
         kMaxHeadDim);
  }
  const int64_t want = attr_int(kUnpack, info, "dtype", ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT);
  if (want != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT && want != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16 &&
      want != ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16) {
    fail(kUnpack, "attribute 'dtype' is ", want, "; expected 1 (float32), 10 (float16) or 16 (bfloat16)");
  }
  out_type = static_cast<ONNXTensorElementDataType>(want);
}

OrtStatusPtr UnpackKernel::ComputeV2(OrtKernelContext* context) {
  return guarded([&] {
    Ort::KernelContext ctx(context);
    auto x = ctx.GetInput(0);
    const auto shape = x.GetTensorTypeAndShapeInfo().GetShape();
    const int d = static_cast<int>(head_dim);
    const int64_t bytes = packed_size(format, d);
    if (shape.empty() || shape.back() != bytes) {
      fail(kUnpack, "input 'packed' has shape ", shape_str(shape), "; its last dimension must be ", bytes,
           " (", format_name(format), " vectors of head_dim ", d, ")");
    }
    auto out_shape = shape;
    out_shape.back() = d;
    const cpu::Offset offset = read_offset(kUnpack, ctx.GetInput(1), out_shape, d, "offset");
    auto y = ctx.GetOutput(0, out_shape);
    const auto got = y.GetTensorTypeAndShapeInfo().GetElementType();
    if (got != out_type) {
      fail(kUnpack, "output 'x' is ", dtype_name(got), " but attribute 'dtype' asks for ", dtype_name(out_type),
           "; they must agree");
    }
    if (device == Device::kCuda) {
      cuda_unpack(context, format, d, x.GetTensorData<uint8_t>(), count_vectors(shape), offset, to_dtype(out_type),
                  y.GetTensorMutableRawData());
      return;
    }
    cpu::unpack(format, d, x.GetTensorData<uint8_t>(), count_vectors(shape), offset, to_dtype(out_type),
                y.GetTensorMutableRawData(), ort_parallel_for(context));
  });
}

}  // namespace turboquant::ort
