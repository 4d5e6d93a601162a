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

int64_t attr_int(const OrtKernelInfo* info, const char* name, int64_t dflt) {
  int64_t v = dflt;
  OrtStatus* st = Ort::GetApi().KernelInfoGetAttribute_int64(info, name, &v);
  if (st) {
    Ort::GetApi().ReleaseStatus(st);
    return dflt;
  }
  return v;
}

float attr_float(const OrtKernelInfo* info, const char* name, float dflt) {
  float v = dflt;
  OrtStatus* st = Ort::GetApi().KernelInfoGetAttribute_float(info, name, &v);
  if (st) {
    Ort::GetApi().ReleaseStatus(st);
    return dflt;
  }
  return v;
}

std::string attr_string(const OrtKernelInfo* info, const char* name, const std::string& dflt) {
  size_t size = 0;
  OrtStatus* st = Ort::GetApi().KernelInfoGetAttribute_string(info, name, nullptr, &size);
  if (st) {
    Ort::GetApi().ReleaseStatus(st);
    return dflt;
  }
  std::string out(size, '\0');
  st = Ort::GetApi().KernelInfoGetAttribute_string(info, name, out.data(), &size);
  if (st) {
    Ort::GetApi().ReleaseStatus(st);
    return dflt;
  }
  out.resize(size > 0 ? size - 1 : 0);  // size counts the terminating NUL
  return out;
}

Format attr_format(const char* op, const OrtKernelInfo* info, const char* name, const char* dflt) {
  const std::string s = attr_string(info, name, dflt);
  const Format f = parse_format(s.c_str());
  if (f == Format::kInvalid) fail(op, "attribute '", name, "' is '", s, "'; expected one of ", kFormatList);
  return f;
}

bool attr_bool(const char* op, const OrtKernelInfo* info, const char* name, bool dflt) {
  const int64_t v = attr_int(info, name, dflt ? 1 : 0);
  if (v != 0 && v != 1) fail(op, "attribute '", name, "' is ", v, "; expected 0 or 1");
  return v == 1;
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
