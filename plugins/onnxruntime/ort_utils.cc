#include "ort_utils.h"

#include <exception>
#include <functional>
#include <mutex>
#include <sstream>

namespace turboquant::ort {

std::string shape_str(const std::vector<int64_t>& s) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < s.size(); ++i) os << (i ? ", " : "") << s[i];
  os << "]";
  return os.str();
}

std::optional<Dims> shape_of(const Ort::ConstValue& x) {
  if (!x) return std::nullopt;
  return x.GetTensorTypeAndShapeInfo().GetShape();
}

void check_input_type(const char* op, const Ort::ConstValue& x, const char* name, ONNXTensorElementDataType want) {
  if (!x) return;
  const auto t = x.GetTensorTypeAndShapeInfo().GetElementType();
  if (t != want) fail(op, "input '", name, "' must be ", dtype_name(want), ", got ", dtype_name(t));
}

namespace {

// The ONNX attribute types the ops declare.
enum class AttrType { kInt, kFloat, kString };

bool succeeded(OrtStatus* st) {
  if (st == nullptr) return true;
  Ort::GetApi().ReleaseStatus(st);
  return false;
}

const char* type_name(AttrType t) {
  switch (t) {
    case AttrType::kInt: return "INT";
    case AttrType::kFloat: return "FLOAT";
    default: return "STRING";
  }
}

// The node's attribute `name` read as type t into out (int64_t, float or std::string); false when
// it has none of that name and type.
bool read_as(const OrtKernelInfo* info, const char* name, AttrType t, void* out) {
  const OrtApi& api = Ort::GetApi();
  if (t == AttrType::kInt) return succeeded(api.KernelInfoGetAttribute_int64(info, name, static_cast<int64_t*>(out)));
  if (t == AttrType::kFloat) return succeeded(api.KernelInfoGetAttribute_float(info, name, static_cast<float*>(out)));
  size_t size = 0;
  if (!succeeded(api.KernelInfoGetAttribute_string(info, name, nullptr, &size))) return false;
  std::string& s = *static_cast<std::string*>(out);
  s.assign(size, '\0');
  if (!succeeded(api.KernelInfoGetAttribute_string(info, name, s.data(), &size))) return false;
  s.resize(size > 0 ? size - 1 : 0);  // size counts the terminating NUL
  return true;
}

// The ONNX type of a node's attribute that did not read as `declared`, or nullptr when the node has
// none of that name.
const char* given_type(const OrtKernelInfo* info, const char* name, AttrType declared) {
  const OrtApi& api = Ort::GetApi();
  int64_t i = 0;
  float f = 0.f;
  std::string s;
  for (AttrType t : {AttrType::kInt, AttrType::kFloat, AttrType::kString}) {
    void* out = t == AttrType::kInt ? static_cast<void*>(&i) : t == AttrType::kFloat ? static_cast<void*>(&f) : &s;
    if (t != declared && read_as(info, name, t, out)) return type_name(t);
  }
  // arrays: ORT reads any attribute's ints or floats list, empty unless it is of that type
  size_t ints = 0, floats = 0;
  if (succeeded(api.KernelInfoGetAttributeArray_int64(info, name, nullptr, &ints)) &&
      succeeded(api.KernelInfoGetAttributeArray_float(info, name, nullptr, &floats))) {
    return ints > 0 ? "INTS" : floats > 0 ? "FLOATS" : "another type";
  }
  return nullptr;  // absent, or a type the C API cannot read (strings, tensors, graphs)
}

// The one reader behind attr_int, attr_float and attr_string.
template <typename T>
T typed_attr(const char* op, const OrtKernelInfo* info, const char* name, AttrType t, T dflt) {
  T v = dflt;
  if (read_as(info, name, t, &v)) return v;
  if (const char* given = given_type(info, name, t)) {
    fail(op, "attribute '", name, "' has type ", given, "; expected ", type_name(t));
  }
  return dflt;
}

}  // namespace

int64_t attr_int(const char* op, const OrtKernelInfo* info, const char* name, int64_t dflt) {
  return typed_attr<int64_t>(op, info, name, AttrType::kInt, dflt);
}

float attr_float(const char* op, const OrtKernelInfo* info, const char* name, float dflt) {
  return typed_attr<float>(op, info, name, AttrType::kFloat, dflt);
}

std::string attr_string(const char* op, const OrtKernelInfo* info, const char* name, const std::string& dflt) {
  return typed_attr<std::string>(op, info, name, AttrType::kString, dflt);
}

int64_t infer_attr_int(const char* op, OrtShapeInferContext* ctx, const char* name, int64_t dflt) {
  const OrtApi& api = Ort::GetApi();
  const OrtOpAttr* attr = nullptr;
  if (!succeeded(api.ShapeInferContext_GetAttribute(ctx, name, &attr)) || attr == nullptr) return dflt;
  int64_t v = dflt;
  size_t len = 0;
  if (succeeded(api.ReadOpAttr(attr, ORT_OP_ATTR_INT, &v, sizeof(v), &len))) return v;
  float f = 0.f;
  const char* given = succeeded(api.ReadOpAttr(attr, ORT_OP_ATTR_FLOAT, &f, sizeof(f), &len)) ? "FLOAT" : "another type";
  fail(op, "attribute '", name, "' has type ", given, "; expected INT");
}

Format attr_format(const char* op, const OrtKernelInfo* info, const char* name, const char* dflt) {
  const std::string s = attr_string(op, info, name, dflt);
  const Format f = parse_format(s.c_str());
  if (f == Format::kInvalid) fail(op, "attribute '", name, "' is '", s, "'; expected one of ", kFormatList);
  return f;
}

bool attr_bool(const char* op, const OrtKernelInfo* info, const char* name, bool dflt) {
  const int64_t v = attr_int(op, info, name, dflt ? 1 : 0);
  if (v != 0 && v != 1) fail(op, "attribute '", name, "' is ", v, "; expected 0 or 1");
  return v == 1;
}

void read_grouped_attrs(const char* op, const OrtKernelInfo* info, GroupedAttrs& a) {
  a.key_format = attr_format(op, info, "key_format", "mse4");
  a.value_format = attr_format(op, info, "value_format", "uint4");
  a.norm_correction = attr_bool(op, info, "norm_correction", true);
  a.num_heads = attr_int(op, info, "num_heads", 0);
  a.kv_num_heads = attr_int(op, info, "kv_num_heads", 0);
  a.scale = attr_float(op, info, "scale", 0.0f);
  a.do_rotary = attr_bool(op, info, "do_rotary", false);
  a.rotary_interleaved = attr_bool(op, info, "rotary_interleaved", false);
  a.local_window_size = attr_int(op, info, "local_window_size", -1);
  a.softcap = attr_float(op, info, "softcap", 0.0f);
}

DType to_dtype(ONNXTensorElementDataType t) {
  switch (t) {
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16: return DType::kFloat16;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16: return DType::kBFloat16;
    default: return DType::kFloat32;
  }
}

const char* dtype_name(ONNXTensorElementDataType t) {
  switch (t) {
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT: return "float32";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16: return "float16";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16: return "bfloat16";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8: return "uint8";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL: return "bool";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64: return "int64";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32: return "int32";
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_DOUBLE: return "float64";
    default: return "another type";
  }
}

namespace {
struct Job {
  const std::function<void(size_t)>* fn;
};
void trampoline(void* user, size_t i) { (*static_cast<Job*>(user)->fn)(i); }
}  // namespace

cpu::ParallelFor ort_parallel_for(const OrtKernelContext* raw) {
  return [raw](size_t n, const std::function<void(size_t)>& fn) {
    if (n == 0) return;
    if (n == 1) {
      fn(0);
      return;
    }
    // Exceptions must not cross ORT's thread pool: the kernels throw none (inputs are validated
    // before they run), but keep the first one, should it happen, and rethrow it here.
    std::exception_ptr error;
    std::mutex mu;
    std::function<void(size_t)> safe = [&](size_t i) {
      try {
        fn(i);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu);
        if (!error) error = std::current_exception();
      }
    };
    Job job{&safe};
    Ort::ThrowOnError(Ort::GetApi().KernelContext_ParallelFor(raw, trampoline, n, 0, &job));
    if (error) std::rethrow_exception(error);
  };
}

}  // namespace turboquant::ort
