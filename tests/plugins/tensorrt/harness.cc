// A C ABI over TensorRT's plugin interfaces, for tests that drive turboquant's plugin library the
// way TensorRT does (creators, fields, serialisation, format queries, workspace, enqueue) without
// TensorRT itself, which no machine here has. Compiled by the tests against the TensorRT headers.
#include <NvInferRuntime.h>
#include <dlfcn.h>

#include <cstring>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

using namespace nvinfer1;

namespace {
std::string g_error;
std::string g_text;

using GetCreators = IPluginCreatorInterface* const* (*)(int32_t&);

IPluginCreatorV3One* find_creator(void* lib, const char* name) {
  auto get = reinterpret_cast<GetCreators>(dlsym(lib, "getCreators"));
  if (!get) return nullptr;
  int32_t n = 0;
  IPluginCreatorInterface* const* cs = get(n);
  for (int32_t i = 0; i < n; ++i) {
    auto* c = static_cast<IPluginCreatorV3One*>(cs[i]);
    if (!std::strcmp(c->getPluginName(), name)) return c;
  }
  return nullptr;
}

PluginTensorDesc desc(int type, int rank, const int64_t* dims) {
  PluginTensorDesc d{};
  d.type = static_cast<DataType>(type);
  d.format = TensorFormat::kLINEAR;
  d.dims.nbDims = rank;
  for (int i = 0; i < rank; ++i) d.dims.d[i] = dims[i];
  d.scale = 1.f;
  return d;
}

std::vector<PluginTensorDesc> descs(int n, const int* types, const int* ranks, const int64_t* dims) {
  std::vector<PluginTensorDesc> v;
  for (int i = 0; i < n; ++i) v.push_back(desc(types[i], ranks[i], dims + 8 * i));
  return v;
}

std::vector<DynamicPluginTensorDesc> dyn(const std::vector<PluginTensorDesc>& d) {
  std::vector<DynamicPluginTensorDesc> v(d.size());
  for (size_t i = 0; i < d.size(); ++i) v[i].desc = d[i], v[i].min = v[i].opt = v[i].max = d[i].dims;
  return v;
}

IPluginV3OneCore* core(void* p) {
  return static_cast<IPluginV3OneCore*>(static_cast<IPluginV3*>(p)->getCapabilityInterface(PluginCapabilityType::kCORE));
}
IPluginV3OneBuild* build(void* p) {
  return static_cast<IPluginV3OneBuild*>(static_cast<IPluginV3*>(p)->getCapabilityInterface(PluginCapabilityType::kBUILD));
}
IPluginV3OneRuntime* runtime(void* p) {
  return static_cast<IPluginV3OneRuntime*>(static_cast<IPluginV3*>(p)->getCapabilityInterface(PluginCapabilityType::kRUNTIME));
}
// A symbolic IExprBuilder: dimensions are constants or text ("B", "(Sp+Sn)"); operations on two
// constants fold, as TensorRT's do.
class DimImpl : public apiv::VDimensionExpr {
 public:
  bool constant = false;
  int64_t value = 0;
  std::string text;
  bool isConstant() const override { return constant; }
  int64_t getConstantValue() const override { return constant ? value : -1; }
  bool isSizeTensor() const override { return false; }
};

class Expr : public IDimensionExpr {
 public:
  explicit Expr(DimImpl* impl) { mImpl = impl; }
  const DimImpl& impl() const { return *static_cast<const DimImpl*>(mImpl); }
};

class SymbolicBuilder : public apiv::VExprBuilder {
 public:
  const IDimensionExpr* make(bool constant, int64_t value, std::string text) {
    impls_.push_back(std::make_unique<DimImpl>());
    DimImpl* d = impls_.back().get();
    d->constant = constant, d->value = value, d->text = constant ? std::to_string(value) : std::move(text);
    exprs_.push_back(std::make_unique<Expr>(d));
    return exprs_.back().get();
  }
  const IDimensionExpr* constant(int64_t v) override { return make(true, v, ""); }
  const IDimensionExpr* operation(DimensionOperation op, const IDimensionExpr& a, const IDimensionExpr& b) override {
    const DimImpl &x = static_cast<const Expr&>(a).impl(), &y = static_cast<const Expr&>(b).impl();
    static const char* sym[] = {"+", "*", " max ", " min ", "-", "==", "<", "/", " ceildiv "};
    if (x.constant && y.constant) {
      int64_t v = 0;
      switch (op) {
        case DimensionOperation::kSUM: v = x.value + y.value; break;
        case DimensionOperation::kPROD: v = x.value * y.value; break;
        case DimensionOperation::kSUB: v = x.value - y.value; break;
        case DimensionOperation::kFLOOR_DIV: v = x.value / y.value; break;
        default: return make(false, 0, "?");
      }
      return make(true, v, "");
    }
    return make(false, 0, "(" + x.text + sym[static_cast<int>(op)] + y.text + ")");
  }
  const IDimensionExpr* declareSizeTensor(int32_t, const IDimensionExpr&, const IDimensionExpr&) override { return nullptr; }

 private:
  std::vector<std::unique_ptr<DimImpl>> impls_;
  std::vector<std::unique_ptr<Expr>> exprs_;
};

class ExprBuilder : public IExprBuilder {
 public:
  explicit ExprBuilder(apiv::VExprBuilder* impl) { mImpl = impl; }
};

long long workspace_of(void* plugin, std::vector<DynamicPluginTensorDesc>& in, std::vector<DynamicPluginTensorDesc>& out) {
  const int nin = static_cast<int>(in.size()), nout = static_cast<int>(out.size());
  if (build(plugin)->configurePlugin(in.data(), nin, out.data(), nout) != 0) return -1;
  return static_cast<long long>(build(plugin)->getWorkspaceSize(in.data(), nin, out.data(), nout));
}

}  // namespace

extern "C" {

// Output shapes for inputs given as text ("B,32,1,128;B,8,Sp,66;..."; a token that is not a
// number is a symbolic dimension); returns "[B, 32, 1, 128];[B, 8, (Sp+Sn), 66];..." or "error".
const char* tqh_output_shapes(void* plugin, const char* spec) {
  SymbolicBuilder sb;
  ExprBuilder eb(&sb);
  std::vector<DimsExprs> in;
  std::stringstream all(spec);
  std::string tensor;
  while (std::getline(all, tensor, ';')) {
    DimsExprs d{};
    std::stringstream dims(tensor);
    std::string tok;
    while (std::getline(dims, tok, ',')) {
      const bool number = !tok.empty() && tok.find_first_not_of("0123456789") == std::string::npos;
      d.d[d.nbDims++] = number ? sb.constant(std::stoll(tok)) : sb.make(false, 0, tok);
    }
    in.push_back(d);
  }
  const int nout = build(plugin)->getNbOutputs();
  std::vector<DimsExprs> out(nout);
  if (build(plugin)->getOutputShapes(in.data(), static_cast<int32_t>(in.size()), nullptr, 0, out.data(), nout, eb) != 0) {
    g_text = "error";
    return g_text.c_str();
  }
  std::ostringstream os;
  for (int o = 0; o < nout; ++o) {
    os << (o ? ";" : "") << "[";
    for (int i = 0; i < out[o].nbDims; ++i) os << (i ? ", " : "") << static_cast<const Expr*>(out[o].d[i])->impl().text;
    os << "]";
  }
  g_text = os.str();
  return g_text.c_str();
}

const char* tqh_error() { return g_error.c_str(); }

void* tqh_open(const char* path) {
  void* lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!lib) g_error = dlerror();
  return lib;
}

// "name namespace version field:type ...;" for every creator.
const char* tqh_creators(void* lib) {
  auto get = reinterpret_cast<GetCreators>(dlsym(lib, "getCreators"));
  std::ostringstream os;
  int32_t n = 0;
  IPluginCreatorInterface* const* cs = get(n);
  for (int32_t i = 0; i < n; ++i) {
    auto* c = static_cast<IPluginCreatorV3One*>(cs[i]);
    os << c->getPluginName() << " " << c->getPluginNamespace() << " " << c->getPluginVersion();
    const PluginFieldCollection* fc = c->getFieldNames();
    for (int32_t k = 0; k < fc->nbFields; ++k) os << " " << fc->fields[k].name << ":" << static_cast<int>(fc->fields[k].type);
    os << ";";
  }
  g_text = os.str();
  return g_text.c_str();
}

void* tqh_create(void* lib, const char* name, int n, const char** names, const int* types, const void** data,
                 const int* lengths) {
  IPluginCreatorV3One* c = find_creator(lib, name);
  if (!c) {
    g_error = std::string("no creator ") + name;
    return nullptr;
  }
  std::vector<PluginField> f;
  for (int i = 0; i < n; ++i) f.emplace_back(names[i], data[i], static_cast<PluginFieldType>(types[i]), lengths[i]);
  PluginFieldCollection fc{n, f.data()};
  return c->createPlugin(name, &fc, TensorRTPhase::kBUILD);
}

// Serialises the plugin's fields and creates a runtime-phase plugin from them, as deserialisation does.
void* tqh_roundtrip(void* lib, void* plugin) {
  IPluginV3OneCore* c = core(plugin);
  const PluginFieldCollection* fc = runtime(plugin)->getFieldsToSerialize();
  // copy, as TensorRT does when it writes an engine
  std::vector<std::string> names;
  std::vector<std::vector<char>> bytes;
  std::vector<PluginField> f;
  for (int32_t i = 0; i < fc->nbFields; ++i) names.emplace_back(fc->fields[i].name);
  for (int32_t i = 0; i < fc->nbFields; ++i) {
    const PluginField& x = fc->fields[i];
    size_t sz = x.type == PluginFieldType::kCHAR ? 1 : 4;
    const char* p = static_cast<const char*>(x.data);
    bytes.emplace_back(p, p + sz * x.length);
  }
  for (int32_t i = 0; i < fc->nbFields; ++i) f.emplace_back(names[i].c_str(), bytes[i].data(), fc->fields[i].type, fc->fields[i].length);
  PluginFieldCollection copy{fc->nbFields, f.data()};
  IPluginCreatorV3One* cr = find_creator(lib, c->getPluginName());
  return cr->createPlugin(c->getPluginName(), &copy, TensorRTPhase::kRUNTIME);
}

// "name=value;..." of the fields the plugin would serialise.
const char* tqh_fields(void* plugin) {
  const PluginFieldCollection* fc = runtime(plugin)->getFieldsToSerialize();
  std::ostringstream os;
  for (int32_t i = 0; i < fc->nbFields; ++i) {
    const PluginField& x = fc->fields[i];
    os << x.name << "=";
    if (x.type == PluginFieldType::kCHAR) os << static_cast<const char*>(x.data);
    else if (x.type == PluginFieldType::kINT32) os << *static_cast<const int32_t*>(x.data);
    else os << *static_cast<const float*>(x.data);
    os << ";";
  }
  g_text = os.str();
  return g_text.c_str();
}

const char* tqh_identity(void* plugin) {
  IPluginV3OneCore* c = core(plugin);
  g_text = std::string(c->getPluginName()) + " " + c->getPluginNamespace() + " " + c->getPluginVersion();
  return g_text.c_str();
}

void* tqh_clone(void* plugin) { return static_cast<IPluginV3*>(plugin)->clone(); }
void tqh_destroy(void* plugin) { delete static_cast<IPluginV3*>(plugin); }

int tqh_nb_outputs(void* plugin) { return build(plugin)->getNbOutputs(); }

// The input that output `out` aliases (IPluginV3OneBuildV2::getAliasedInput; -1: none), or -2 when
// the plugin's build capability is not that interface (version 2 of PLUGIN_V3ONE_BUILD), so
// TensorRT would never ask.
int tqh_aliased_input(void* plugin, int out) {
  IPluginV3OneBuild* b = build(plugin);
  const InterfaceInfo info = b->getInterfaceInfo();
  if (std::strcmp(info.kind, "PLUGIN_V3ONE_BUILD") != 0 || info.major != 2) return -2;
  return static_cast<IPluginV3OneBuildV2*>(b)->getAliasedInput(out);
}

// configurePlugin with these input and output descriptors (types and shapes), as the builder
// calls it before asking for aliases and workspace; returns its status.
int tqh_configure(void* plugin, int nin, const int* it, const int* ir, const int64_t* id, int nout, const int* ot,
                  const int* orank, const int64_t* od) {
  auto in = dyn(descs(nin, it, ir, id)), out = dyn(descs(nout, ot, orank, od));
  return build(plugin)->configurePlugin(in.data(), nin, out.data(), nout);
}

int tqh_output_types(void* plugin, int nin, const int* in_types, int nout, int* out_types) {
  std::vector<DataType> in(nin), out(nout);
  for (int i = 0; i < nin; ++i) in[i] = static_cast<DataType>(in_types[i]);
  int rc = build(plugin)->getOutputDataTypes(out.data(), nout, in.data(), nin);
  for (int i = 0; i < nout; ++i) out_types[i] = static_cast<int>(out[i]);
  return rc;
}

int tqh_supports(void* plugin, int pos, int nin, int nout, const int* types) {
  std::vector<DynamicPluginTensorDesc> io(nin + nout);
  for (int i = 0; i < nin + nout; ++i) io[i].desc.type = static_cast<DataType>(types[i]), io[i].desc.format = TensorFormat::kLINEAR;
  return build(plugin)->supportsFormatCombination(pos, io.data(), nin, nout) ? 1 : 0;
}

long long tqh_workspace(void* plugin, int nin, const int* it, const int* ir, const int64_t* id, int nout, const int* ot,
                        const int* orank, const int64_t* od) {
  auto in = dyn(descs(nin, it, ir, id)), out = dyn(descs(nout, ot, orank, od));
  return workspace_of(plugin, in, out);
}

// The workspace for a profile whose inputs range from min_dims to id (the max) dims.
long long tqh_workspace_range(void* plugin, int nin, const int* it, const int* ir, const int64_t* min_dims,
                              const int64_t* id, int nout, const int* ot, const int* orank, const int64_t* od) {
  auto in = dyn(descs(nin, it, ir, id)), out = dyn(descs(nout, ot, orank, od));
  const auto lo = descs(nin, it, ir, min_dims);
  for (int i = 0; i < nin; ++i) in[i].min = lo[i].dims;
  return workspace_of(plugin, in, out);
}



int tqh_enqueue(void* plugin, int nin, const int* it, const int* ir, const int64_t* id, const void** inputs, int nout,
                const int* ot, const int* orank, const int64_t* od, void** outputs, void* workspace, void* stream) {
  auto in = descs(nin, it, ir, id), out = descs(nout, ot, orank, od);
  IPluginV3OneRuntime* r = runtime(plugin);
  if (r->onShapeChange(in.data(), nin, out.data(), nout) != 0) return -2;
  return r->enqueue(in.data(), out.data(), inputs, outputs, workspace, static_cast<cudaStream_t>(stream));
}

}  // extern "C"
