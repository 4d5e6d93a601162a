"""TensorRT with turboquant's plugin library: load it, and build an engine from a model rewritten
with `python -m turboquant.export ... --target tensorrt`.

    from turboquant import tensorrt as tq_trt
    engine = tq_trt.build_engine("model.tq.trt.onnx", tq_trt.decoder_profile("model.tq.trt.onnx"))

The same from the command line, with trtexec:
    trtexec --onnx=model.tq.trt.onnx --dynamicPlugins=$(python -c "import turboquant; print(turboquant.trt_plugin_path())") ...

A model rewritten from onnxruntime-genai's (TQGroupQueryAttention, TensorRT 10.3 or later) has its
present.N.* aliased to past_key_values.N.* (the preview feature ALIASED_PLUGIN_IO_10_03, which
build_engine turns on; trtexec: --preview=+aliasedPluginIO1003): bind both names to the same
device buffer of the profile's capacity rows, and each step writes only its new rows there.
"""

from __future__ import annotations

import os
import pathlib

from ._libs import trt_plugin_path


def _trt():
    try:
        import tensorrt
    except ImportError as e:
        raise ImportError("turboquant.tensorrt needs the TensorRT Python package (pip install tensorrt, from NVIDIA's "
                          f"index): {e}") from None
    return tensorrt


def load_plugins(registry=None):
    """Loads the plugin library into `registry` (default: TensorRT's global plugin registry, which the
    ONNX parser and the builder use; pass runtime.get_plugin_registry() for a runtime). Returns the
    library handle (keep it alive while the plugins are used)."""
    trt = _trt()
    registry = registry or trt.get_plugin_registry()
    handle = registry.load_library(trt_plugin_path())
    if handle is None:
        raise RuntimeError(f"TensorRT could not load {trt_plugin_path()}")
    return handle


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


def build_engine(model: str | os.PathLike, profile: dict, *, fp16: bool = False, version_compatible: bool = False,
                 workspace_bytes: int | None = None) -> bytes:
    """A serialized engine for `model` (an ONNX file rewritten with --target tensorrt).

    version_compatible: an engine that newer TensorRT versions can run, which then carries the plugin
    library inside it (IBuilderConfig.set_plugins_to_serialize)."""
    trt = _trt()
    logger = trt.Logger(trt.Logger.WARNING)
    load_plugins()
    builder = trt.Builder(logger)
    network = builder.create_network(0)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(os.fspath(pathlib.Path(model))):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise RuntimeError(f"TensorRT's ONNX parser refused {model}: {errors}")
    config = builder.create_builder_config()
    if workspace_bytes:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_bytes)
    opt = builder.create_optimization_profile()
    for name, (lo, mid, hi) in profile.items():
        opt.set_shape(name, lo, mid, hi)
    for name, (lo, mid, hi) in getattr(profile, "values", {}).items():
        opt.set_shape_input(name, lo, mid, hi)
    config.add_optimization_profile(opt)
    if _has_op(model, "TQGroupQueryAttention"):  # present aliases past: the caches are updated in place
        config.set_preview_feature(trt.PreviewFeature.ALIASED_PLUGIN_IO_10_03, True)
    if fp16:
        config.set_flag(trt.BuilderFlag.FP16)
    if version_compatible:
        config.set_flag(trt.BuilderFlag.VERSION_COMPATIBLE)
        config.set_plugins_to_serialize([trt_plugin_path()])
    engine = builder.build_serialized_network(network, config)
    if engine is None:
        raise RuntimeError(f"TensorRT could not build an engine from {model} (see the log above)")
    return bytes(engine)


def _has_op(model: str | os.PathLike, op_type: str) -> bool:
    import onnx

    return any(n.op_type == op_type for n in onnx.load(os.fspath(model), load_external_data=False).graph.node)
