#include "trt_fields.h"

#include <cstdio>
#include <cstring>
#include <sstream>

#include "turboquant/attention_setup.h"  // InvalidArgument

namespace turboquant::trt {
namespace {

using nvinfer1::PluginFieldType;

nvinfer1::ILoggerFinder* g_finder = nullptr;

bool is_integer_type(PluginFieldType t) {
  return t == PluginFieldType::kINT8 || t == PluginFieldType::kINT16 || t == PluginFieldType::kINT32 ||
         t == PluginFieldType::kINT64;
}

bool is_float_type(PluginFieldType t) { return t == PluginFieldType::kFLOAT32 || t == PluginFieldType::kFLOAT64; }

const char* type_name(PluginFieldType t) {
  switch (t) {
    case PluginFieldType::kFLOAT16: return "kFLOAT16";
    case PluginFieldType::kFLOAT32: return "kFLOAT32";
    case PluginFieldType::kFLOAT64: return "kFLOAT64";
    case PluginFieldType::kINT8: return "kINT8";
    case PluginFieldType::kINT16: return "kINT16";
    case PluginFieldType::kINT32: return "kINT32";
    case PluginFieldType::kINT64: return "kINT64";
    case PluginFieldType::kCHAR: return "kCHAR";
    case PluginFieldType::kDIMS: return "kDIMS";
    case PluginFieldType::kBF16: return "kBF16";
    default: return "another type";
  }
}

// One number of a field whose type read_field checked (an integer type or a float type).
template <typename T>
T number(const nvinfer1::PluginField& f) {
  switch (f.type) {
    case PluginFieldType::kINT8: return static_cast<T>(*static_cast<const int8_t*>(f.data));
    case PluginFieldType::kINT16: return static_cast<T>(*static_cast<const int16_t*>(f.data));
    case PluginFieldType::kINT32: return static_cast<T>(*static_cast<const int32_t*>(f.data));
    case PluginFieldType::kINT64: return static_cast<T>(*static_cast<const int64_t*>(f.data));
    case PluginFieldType::kFLOAT32: return static_cast<T>(*static_cast<const float*>(f.data));
    default: return static_cast<T>(*static_cast<const double*>(f.data));
  }
}

}  // namespace

Fields& Fields::add_int(const char* name, int32_t dflt) {
  entries_.push_back({name, PluginFieldType::kINT32, dflt, 0.f, {}});
  return *this;
}
Fields& Fields::add_float(const char* name, float dflt) {
  entries_.push_back({name, PluginFieldType::kFLOAT32, 0, dflt, {}});
  return *this;
}
Fields& Fields::add_string(const char* name, const char* dflt) {
  entries_.push_back({name, PluginFieldType::kCHAR, 0, 0.f, dflt});
  return *this;
}

void Fields::read(const char* op, const nvinfer1::PluginFieldCollection* fc) {
  if (fc == nullptr) return;
  for (int32_t k = 0; k < fc->nbFields; ++k) {
    const nvinfer1::PluginField& f = fc->fields[k];
    if (f.name == nullptr) continue;
    // The ONNX parser consumes these two itself; tolerate them if a caller passes them on.
    if (!std::strcmp(f.name, "plugin_namespace") || !std::strcmp(f.name, "plugin_version")) continue;
    Entry* e = nullptr;
    for (auto& x : entries_) {
      if (x.name == f.name) e = &x;
    }
    std::ostringstream os;
    if (e == nullptr) {
      os << op << ": unknown field '" << f.name << "'; expected one of:";
      for (auto& x : entries_) os << " " << x.name;
      throw InvalidArgument(os.str());
    }
    // each field has the type its ONNX attribute declares (INT, FLOAT or STRING), one value
    const bool is_string = e->type == PluginFieldType::kCHAR, is_int = e->type == PluginFieldType::kINT32;
    const bool ok = f.data != nullptr &&
                    (is_string ? f.type == PluginFieldType::kCHAR && f.length >= 0
                               : f.length == 1 && (is_int ? is_integer_type(f.type) : is_float_type(f.type)));
    if (!ok) {
      os << op << ": field '" << f.name << "' has type " << type_name(f.type) << " and length " << f.length
         << "; expected " << (is_string ? "a string (kCHAR)" : is_int ? "one integer (kINT32 or kINT64)"
                                                                    : "one float (kFLOAT32 or kFLOAT64)");
      throw InvalidArgument(os.str());
    }
    if (is_string) {
      const char* c = static_cast<const char*>(f.data);
      e->s.assign(c, strnlen(c, static_cast<size_t>(f.length)));
    } else if (is_int) {
      e->i = number<int32_t>(f);
    } else {
      e->f = number<float>(f);
    }
  }
}

const Fields::Entry& Fields::find(const char* name) const {
  for (auto& e : entries_) {
    if (e.name == name) return e;
  }
  throw InvalidArgument(std::string("internal: no field ") + name);
}
int32_t Fields::get_int(const char* name) const { return find(name).i; }
float Fields::get_float(const char* name) const { return find(name).f; }
const std::string& Fields::get_string(const char* name) const { return find(name).s; }

const nvinfer1::PluginFieldCollection* Fields::collection() {
  view_.clear();
  for (auto& e : entries_) {
    if (e.type == PluginFieldType::kCHAR) {
      view_.emplace_back(e.name.c_str(), e.s.c_str(), e.type, static_cast<int32_t>(e.s.size() + 1));
    } else if (e.type == PluginFieldType::kINT32) {
      view_.emplace_back(e.name.c_str(), &e.i, e.type, 1);
    } else {
      view_.emplace_back(e.name.c_str(), &e.f, e.type, 1);
    }
  }
  collection_.nbFields = static_cast<int32_t>(view_.size());
  collection_.fields = view_.data();
  return &collection_;
}

const nvinfer1::PluginFieldCollection* Fields::names() {
  view_.clear();
  for (auto& e : entries_) view_.emplace_back(e.name.c_str(), nullptr, e.type, 1);
  collection_.nbFields = static_cast<int32_t>(view_.size());
  collection_.fields = view_.data();
  return &collection_;
}

void set_logger_finder(nvinfer1::ILoggerFinder* finder) noexcept { g_finder = finder; }

void log_error(const std::string& msg) noexcept {
  nvinfer1::ILogger* logger = g_finder ? g_finder->findLogger() : nullptr;
  if (logger) {
    logger->log(nvinfer1::ILogger::Severity::kERROR, msg.c_str());
  } else {
    std::fprintf(stderr, "[turboquant TensorRT] %s\n", msg.c_str());
  }
}

}  // namespace turboquant::trt
