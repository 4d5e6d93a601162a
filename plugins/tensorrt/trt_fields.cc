#include "trt_fields.h"

#include <cstdio>
#include <cstring>
#include <sstream>

#include "turboquant/attention_setup.h"  // InvalidArgument

namespace turboquant::trt {
namespace {

using nvinfer1::PluginFieldType;

nvinfer1::ILoggerFinder* g_finder = nullptr;

template <typename T>
bool read_number(const nvinfer1::PluginField& f, T& out) {
  if (f.length < 1 || f.data == nullptr) return false;
  switch (f.type) {
    case PluginFieldType::kINT8: out = static_cast<T>(*static_cast<const int8_t*>(f.data)); return true;
    case PluginFieldType::kINT16: out = static_cast<T>(*static_cast<const int16_t*>(f.data)); return true;
    case PluginFieldType::kINT32: out = static_cast<T>(*static_cast<const int32_t*>(f.data)); return true;
    case PluginFieldType::kINT64: out = static_cast<T>(*static_cast<const int64_t*>(f.data)); return true;
    case PluginFieldType::kFLOAT32: out = static_cast<T>(*static_cast<const float*>(f.data)); return true;
    case PluginFieldType::kFLOAT64: out = static_cast<T>(*static_cast<const double*>(f.data)); return true;
    default: return false;
  }
}

bool is_integer_type(PluginFieldType t) {
  return t == PluginFieldType::kINT8 || t == PluginFieldType::kINT16 || t == PluginFieldType::kINT32 ||
         t == PluginFieldType::kINT64;
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
    bool ok = false;
    if (e->type == PluginFieldType::kCHAR) {
      if (f.type == PluginFieldType::kCHAR && f.data != nullptr && f.length >= 0) {
        const char* c = static_cast<const char*>(f.data);
        e->s.assign(c, strnlen(c, static_cast<size_t>(f.length)));
        ok = true;
      }
    } else if (e->type == PluginFieldType::kINT32) {
      ok = is_integer_type(f.type) && read_number(f, e->i);
    } else {
      ok = read_number(f, e->f);
    }
    if (!ok) {
      os << op << ": field '" << f.name << "' has type " << static_cast<int>(f.type) << " and length " << f.length
         << "; expected " << (e->type == PluginFieldType::kCHAR ? "a string (kCHAR)"
                              : e->type == PluginFieldType::kINT32 ? "one integer" : "one number");
      throw InvalidArgument(os.str());
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
