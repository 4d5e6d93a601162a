"""TensorRT with turboquant's plugin library: load it, and build an engine from a model rewritten
with `python -m turboquant.export ... --target tensorrt`.

    from turboquant import tensorrt as tq_trt
    engine = tq_trt.build_engine("model.tq.trt.onnx", tq_trt.decoder_profile("model.tq.trt.onnx"))

The same from the command line, with trtexec:
    trtexec --onnx=model.tq.trt.onnx --dynamicPlugins=$(python -c "import turboquant; print(turboquant.trt_plugin_path())") ...
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


def decoder_profile(model: str | os.PathLike, *, batch=(1, 1, 4), new=(1, 1, 256), past=(0, 256, 4096)) -> dict:
    """Shape ranges (min, opt, max) for every input of an exported decoder: input_ids, attention_mask,
    position_ids and the (packed or float) caches past_key_values.N.*."""
    import onnx

    m = onnx.load(os.fspath(model), load_external_data=False)
    prof = {}
    for i in m.graph.input:
        dims = [d.dim_value if d.HasField("dim_value") else None for d in i.type.tensor_type.shape.dim]
        if i.name in ("input_ids", "position_ids"):
            prof[i.name] = tuple((b, n) for b, n in zip(batch, new))
        elif i.name == "attention_mask":
            prof[i.name] = tuple((b, n + p) for b, n, p in zip(batch, new, past))
        elif len(dims) == 4:  # a cache [batch, kv_heads, past, last]
            prof[i.name] = tuple((b, dims[1], p, dims[3]) for b, p in zip(batch, past))
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
    config.add_optimization_profile(opt)
    if fp16:
        config.set_flag(trt.BuilderFlag.FP16)
    if version_compatible:
        config.set_flag(trt.BuilderFlag.VERSION_COMPATIBLE)
        config.set_plugins_to_serialize([trt_plugin_path()])
    engine = builder.build_serialized_network(network, config)
    if engine is None:
        raise RuntimeError(f"TensorRT could not build an engine from {model} (see the log above)")
    return bytes(engine)
