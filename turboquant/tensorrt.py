"""TensorRT with turboquant's plugin library: load it, and build an engine from a model rewritten
with `python -m turboquant.export ... --target tensorrt`.

    from turboquant import tensorrt as tq_trt
    engine = tq_trt.build_engine("model.tq.trt.onnx", tq_trt.decoder_profile("model.tq.trt.onnx"))

The same from the command line: `turboquant build-engine model.tq.trt.onnx -o model.plan`, or trtexec:
    trtexec --onnx=model.tq.trt.onnx --dynamicPlugins=$(python -c "import turboquant; print(turboquant.trt_plugin_path())") ...

Either TensorRT builds: TensorRT itself (the `tensorrt` module, 10 or later) or TensorRT for RTX
(`pip install "turboquant-onnx[tensorrt-rtx]"`, the module `tensorrt_rtx_bindings`), which builds
engines ahead of time on a machine without a GPU. TensorRT-RTX's ONNX parser dlopens the unversioned
libtensorrt_rtx.so, which its wheel lacks: the link to libtensorrt_rtx.so.1 is made here, beside it.

A model rewritten from onnxruntime-genai's (TQGroupQueryAttention, TensorRT 10.3 or later) has its
present.N.* aliased to past_key_values.N.* (the preview feature ALIASED_PLUGIN_IO_10_03, which
build_engine turns on; trtexec: --preview=+aliasedPluginIO1003): bind both names to the same
device buffer of the profile's capacity rows, and each step writes only its new rows there.
Packed caches are int8 tensors in the engine (export/tensorrt.py says why): the same bytes as ONNX
Runtime's uint8 caches.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import pathlib
import re

from ._libs import trt_plugin_path

RUNTIMES = ("auto", "tensorrt", "tensorrt-rtx")


class TensorRTMissing(ImportError):
    """Neither TensorRT (10 or later) nor TensorRT-RTX is installed, or the one asked for is not."""


class EngineBuildError(RuntimeError):
    """TensorRT's parser or builder refused the model: one line naming the node where TensorRT said which."""


def _link_rtx_parser_dependency() -> None:
    """TensorRT-RTX's ONNX parser dlopens libtensorrt_rtx.so (no version) from its own folder (RPATH
    $ORIGIN), and the wheel ships only libtensorrt_rtx.so.1: without the link the process aborts."""
    spec = importlib.util.find_spec("tensorrt_rtx_libs")
    if spec is None or not spec.submodule_search_locations:
        return  # a TensorRT-RTX installed otherwise (a tarball's lib folder has the link)
    folder = pathlib.Path(list(spec.submodule_search_locations)[0])
    link, target = folder / "libtensorrt_rtx.so", folder / "libtensorrt_rtx.so.1"
    if os.path.lexists(link) or not target.is_file():
        return
    try:
        link.symlink_to(target.name)
    except FileExistsError:  # another process made it meanwhile
        pass
    except OSError as e:
        raise TensorRTMissing(f"TensorRT-RTX's ONNX parser needs {link} (a link to {target.name}), which cannot be made "
                              f"here ({e.strerror or e}): run `ln -s {target.name} {link}` once") from None


def _import_tensorrt():
    try:
        trt = importlib.import_module("tensorrt")
    except Exception as e:  # noqa: BLE001 - pip's stub packages fail in their own ways on import
        return None, f"tensorrt: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
    version = getattr(trt, "__version__", "0")
    if int(version.split(".")[0]) < 10:
        return None, f"tensorrt {version} is older than 10 (IPluginV3)"
    return trt, None


def _import_rtx():
    if importlib.util.find_spec("tensorrt_rtx_bindings") is None:
        return None, "tensorrt_rtx_bindings: not installed"
    _link_rtx_parser_dependency()
    try:
        return importlib.import_module("tensorrt_rtx_bindings"), None
    except Exception as e:  # noqa: BLE001
        return None, f"tensorrt_rtx_bindings: {str(e).splitlines()[0] if str(e) else type(e).__name__}"


def trt_module(runtime: str = "auto"):
    """The TensorRT Python module that builds: `tensorrt` (10 or later) for runtime "tensorrt",
    TensorRT-RTX's `tensorrt_rtx_bindings` for "tensorrt-rtx", and for "auto" the first of them
    installed. TensorRTMissing (one line) otherwise."""
    if runtime not in RUNTIMES:
        raise ValueError(f"runtime must be one of {', '.join(RUNTIMES)}, got {runtime!r}")
    tried = []
    for name, load in (("tensorrt", _import_tensorrt), ("tensorrt-rtx", _import_rtx)):
        if runtime in ("auto", name):
            module, why = load()
            if module is not None:
                return module
            tried.append(why)
    raise TensorRTMissing("no TensorRT to build with (" + "; ".join(tried) + "): pip install \"turboquant-onnx[tensorrt-rtx]\" "
                          "(TensorRT for RTX, from PyPI) or TensorRT 10 from NVIDIA's index")


def is_rtx(trt) -> bool:
    return trt.__name__.startswith("tensorrt_rtx")


def load_plugins(registry=None, trt=None):
    """Loads the plugin library into `registry` (default: the global plugin registry of `trt`, the
    TensorRT module, which the ONNX parser and the builder use; pass runtime.get_plugin_registry()
    for a runtime). Returns the library handle (keep it alive while the plugins are used)."""
    trt = trt or trt_module()
    registry = registry or trt.get_plugin_registry()
    key = (trt.__name__, trt_plugin_path())
    handle = registry.load_library(trt_plugin_path())
    if handle is None and key in _LOADED:  # loaded before: TensorRT's registries are one per process
        return _LOADED[key]
    if handle is None:
        raise RuntimeError(f"TensorRT could not load {trt_plugin_path()}")
    _LOADED[key] = handle
    return handle


_LOADED: dict = {}  # (module, library) -> the handle of its first load, kept for the process's life


class Profile(dict):
    """Shape ranges (min, opt, max) by input name, and in `values` the value ranges of the inputs
    TensorRT takes as shape tensors (on the host): IOptimizationProfile.set_shape and set_shape_input."""

    def __init__(self, shapes=(), values=None):
        super().__init__(shapes)
        self.values = dict(values or {})


def decoder_profile(model: str | os.PathLike, *, batch=(1, 1, 4), new=(1, 1, 256), past=(0, 256, 4096),
                    capacity: int | tuple[int, int, int] | None = None) -> Profile:
    """Shape ranges (min, opt, max) for every input of an exported decoder: input_ids, attention_mask,
    position_ids and the (packed or float) caches past_key_values.N.*.

    Models rewritten from onnxruntime-genai's (TQGroupQueryAttention) keep their caches in shared
    buffers of `capacity` rows (default: past[2] + new[2], the most tokens a sequence holds), which
    present aliases; their seqlens_k ([batch]) and total_sequence_length (a scalar whose value
    TensorRT reads on the host, in `values`: new + past) are profiled too where they are graph inputs."""
    import onnx

    m = onnx.load(os.fspath(model), load_external_data=False)
    shared = any(n.op_type == "TQGroupQueryAttention" for n in m.graph.node)
    if capacity is None:
        capacity = past[2] + new[2]
    rows = tuple(capacity) if isinstance(capacity, (tuple, list)) else (capacity,) * 3
    if shared and min(rows) < past[2] + new[2]:
        raise ValueError(f"capacity {rows} cannot hold past[2] + new[2] = {past[2] + new[2]} tokens: present is updated "
                         "in place in the cache buffers")
    totals = tuple(n + p for n, p in zip(new, past))
    prof = Profile()
    for i in m.graph.input:
        dims = [d.dim_value if d.HasField("dim_value") else None for d in i.type.tensor_type.shape.dim]
        if i.name in ("input_ids", "position_ids"):
            prof[i.name] = tuple((b, n) for b, n in zip(batch, new))
        elif i.name == "attention_mask":
            prof[i.name] = tuple((b, t) for b, t in zip(batch, totals))
        elif i.name == "seqlens_k":
            prof[i.name] = tuple((b,) for b in batch)
        elif i.name == "total_sequence_length":
            prof.values[i.name] = tuple((t,) for t in totals)
        elif len(dims) == 4:  # a cache [batch, kv_heads, past or capacity, last]
            prof[i.name] = tuple((b, dims[1], r if shared else p, dims[3]) for b, p, r in zip(batch, past, rows))
    return prof


class _Log:
    """A TensorRT logger that keeps the errors (and, verbose, prints every message)."""

    def __new__(cls, trt, verbose=False):
        class Log(trt.ILogger):
            def __init__(self):
                trt.ILogger.__init__(self)
                self.errors: list[str] = []

            def log(self, severity, msg):
                if severity in (trt.ILogger.Severity.ERROR, trt.ILogger.Severity.INTERNAL_ERROR):
                    self.errors.append(str(msg))  # for the one-line refusal
                if verbose:
                    print(f"[TensorRT {severity.name}] {msg}", flush=True)

        return Log()


def build_engine(model: str | os.PathLike, profile: dict, *, fp16: bool = False, version_compatible: bool = False,
                 workspace_bytes: int | None = None, runtime: str = "auto", compute_capability: str | None = None,
                 verbose: bool = False) -> bytes:
    """A serialized engine for `model` (an ONNX file rewritten with --target tensorrt), built by
    TensorRT or TensorRT-RTX (`runtime`: trt_module's). EngineBuildError, one line naming the node,
    where the parser or the builder refuses it.

    version_compatible: an engine that newer TensorRT versions can run, which then carries the plugin
    library inside it (IBuilderConfig.set_plugins_to_serialize). compute_capability (TensorRT-RTX):
    the GPU the engine is for, e.g. "SM89" (ComputeCapability's names; default: TensorRT-RTX's own,
    the GPU present, or every one it supports without one). fp16: the builder may choose float16
    where the network is not strongly typed (TensorRT-RTX's networks always are)."""
    trt = trt_module(runtime)
    log = _Log(trt, verbose)
    path = os.fspath(pathlib.Path(model))
    handle = load_plugins(trt=trt)  # noqa: F841 - the creators stay registered while the network is built
    builder = trt.Builder(log)
    flags = 0
    typed = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)
    if typed is not None and not fp16:  # the packed int8 tensors carry no quantization scales
        flags |= 1 << int(typed)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, log)
    if not parser.parse_from_file(path):
        errors = [parser.get_error(i) for i in range(parser.num_errors)]
        raise EngineBuildError(_parser_refusal(path, errors))
    config = builder.create_builder_config()
    if workspace_bytes:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_bytes)
    opt = builder.create_optimization_profile()
    for name, (lo, mid, hi) in profile.items():
        opt.set_shape(name, lo, mid, hi)
    for name, (lo, mid, hi) in getattr(profile, "values", {}).items():
        opt.set_shape_input(name, lo, mid, hi)
    config.add_optimization_profile(opt)
    if _has_op(path, "TQGroupQueryAttention"):  # present aliases past: the caches are updated in place
        config.set_preview_feature(trt.PreviewFeature.ALIASED_PLUGIN_IO_10_03, True)
    if fp16 and hasattr(trt.BuilderFlag, "FP16"):
        config.set_flag(trt.BuilderFlag.FP16)
    if compute_capability:
        caps = getattr(trt, "ComputeCapability", None)  # TensorRT-RTX's alone
        names = {c.lower(): getattr(caps, c) for c in dir(caps) if c.startswith("SM")} if caps is not None else {}
        if compute_capability.lower() not in names:
            raise ValueError(f"compute capability {compute_capability!r} is not one this TensorRT builds for "
                             f"({', '.join(sorted(n.upper() for n in names)) or 'none: TensorRT-RTX only'})")
        config.num_compute_capabilities = 1
        config.set_compute_capability(names[compute_capability.lower()], 0)
    if version_compatible:
        config.set_flag(trt.BuilderFlag.VERSION_COMPATIBLE)
        config.set_plugins_to_serialize([trt_plugin_path()])
    config.profiling_verbosity = trt.ProfilingVerbosity.DETAILED  # the layer names and plugins, for the inspector
    engine = builder.build_serialized_network(network, config)
    if engine is None:
        raise EngineBuildError(_builder_refusal(path, log.errors))
    return bytes(engine)


def _one_line(text: str, limit: int = 400) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit] + "..."


def _parser_refusal(path: str, errors) -> str:
    if not errors:
        return f"{path}: TensorRT's ONNX parser refused the model without saying why"
    e = errors[0]
    node, op = _call(e, "node_name"), _call(e, "node_operator")
    where = f"node {node!r} ({op})" if node else f"a {op} node" if op else "the model"
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{path}: TensorRT's ONNX parser refused {where}: {_one_line(_call(e, 'desc') or e)}{more}"


def _call(obj, name: str) -> str:
    f = getattr(obj, name, None)
    try:
        return str(f()) if callable(f) else ""
    except Exception:  # noqa: BLE001 - an older parser without the accessor
        return ""


def _builder_refusal(path: str, errors: list[str]) -> str:
    if not errors:
        return f"{path}: TensorRT could not build an engine and logged no error"
    msg = next((e for e in errors if _named_node(path, e)), errors[0])
    found = _named_node(path, msg)
    where = f"node {found[0]!r} ({found[1]})" if found else "the model"
    return f"{path}: TensorRT refused {where}: {_one_line(msg)}"


def _named_node(path: str, message: str) -> tuple[str, str] | None:
    """The ONNX node a TensorRT message is about: a layer is named after its node, a tensor after a
    node's output (or a graph input, then its first reader)."""
    import onnx

    g = onnx.load(path, load_external_data=False).graph
    words = set(re.findall(r"[\w./:\-\[\]]+", message))
    for n in g.node:
        if n.name and (n.name in words or f"[{n.name}]" in message):
            return n.name, n.op_type
    for n in g.node:
        if any(o and o in words for o in n.output):
            return n.name or n.output[0], n.op_type
    for i in g.input:
        if i.name in words:
            reader = next((n for n in g.node if i.name in n.input), None)
            if reader is not None:
                return reader.name or reader.output[0], reader.op_type
    return None


def inspect_engine(engine: bytes, runtime: str = "auto") -> dict:
    """The engine deserialized and described by TensorRT's engine inspector: {"layers": [the
    inspector's JSON layer records], "io": {tensor name: (dtype name, shape)}}. Needs what TensorRT
    needs to deserialize (TensorRT-RTX: no GPU)."""
    import json

    trt = trt_module(runtime)
    rt = trt.Runtime(trt.Logger(trt.Logger.ERROR))
    handle = load_plugins(rt.get_plugin_registry(), trt=trt)  # noqa: F841 - kept alive while deserializing
    eng = rt.deserialize_cuda_engine(engine)
    if eng is None:
        raise EngineBuildError("TensorRT could not deserialize the engine")
    inspector = eng.create_engine_inspector()
    info = json.loads(inspector.get_engine_information(trt.LayerInformationFormat.JSON))
    io = {}
    for i in range(eng.num_io_tensors):
        name = eng.get_tensor_name(i)
        io[name] = (eng.get_tensor_dtype(name).name, tuple(eng.get_tensor_shape(name)))
    return {"layers": info.get("Layers", []), "io": io}


def _has_op(model: str | os.PathLike, op_type: str) -> bool:
    import onnx

    return any(n.op_type == op_type for n in onnx.load(os.fspath(model), load_external_data=False).graph.node)
