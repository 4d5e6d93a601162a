"""A Hugging Face causal LM to one ONNX file and one external-data file, holding one copy of the weights.

torch.onnx's exporters keep a second copy of the weights: TorchScript folds every weight transpose
into a new tensor (and serialises the whole model in memory below 2 GB, or writes one file per
tensor above), and dynamo's optimizer folds them too. Here the graph is exported without its
weights (TorchScript) or without optimisation (dynamo); the weights become onnx-ir tensors that
read the model's own parameters, transposes of weights become lazy tensors, and onnx-ir writes
them into the data file one at a time.
"""

from __future__ import annotations

import os
import pathlib
import warnings

from .. import random_decoders
from ..saving import publish, refuse_existing, staging

EXPORTERS = ("dynamo", "torchscript")


class ExportFailed(ValueError):
    """torch.onnx could not export the model: the exporter's reason, on one line."""


IN_FLIGHT = 128 << 20  # bytes of tensors being written at once
IR_VERSION = 10  # onnxruntime 1.31 refuses IR versions above 13; a widely readable one


def export_to_files(model, out: str | os.PathLike, exporter: str = "torchscript", dtype: str = "float32") -> pathlib.Path:
    """Writes out (the graph) and out.data (every weight) for a Hugging Face causal LM, with
    past_key_values.N.key/value inputs and present.N.key/value outputs in dtype. Both are written
    under temporary names in out's folder and then given their names together; existing names are
    refused (turboquant.saving)."""
    out = pathlib.Path(out)
    refuse_existing([out, data_file(out)])
    with staging(out.parent) as tmp:
        publish(stage_export(model, tmp, out, exporter, dtype))
    return out


def stage_export(model, tmp: pathlib.Path, out: pathlib.Path, exporter: str, dtype: str) -> list[tuple[pathlib.Path, pathlib.Path]]:
    """The graph and its data file written into tmp (a staging folder in out's folder), as the
    (staged, final) pairs for turboquant.saving.publish, the data file first."""
    import onnx_ir as ir

    scratch = tmp / "export"
    scratch.mkdir()
    try:
        graph = _export_graph(model, scratch, exporter, dtype)
    except Exception as e:  # noqa: BLE001 - torch.onnx's failures on a model have no common type
        if exporter not in EXPORTERS:
            raise
        detail = str(e).splitlines()[0][:300] if str(e) else ""
        other = next(x for x in EXPORTERS if x != exporter)
        raise ExportFailed(f"torch.onnx's {exporter} exporter failed on this model ({type(e).__name__}: {detail}); "
                           f"try --exporter {other}") from None
    graph.ir_version = min(graph.ir_version, IR_VERSION)
    data = data_file(out)
    # the graph names its data file relative to itself; few tensors in flight at once
    ir.save(graph, tmp / out.name, external_data=data.name, **_bounded_writes(ir.save))
    return [(tmp / data.name, data), (tmp / out.name, out)]


def _bounded_writes(save) -> dict:
    """onnx-ir 1.1 writes tensors from several threads, up to 1 GB in flight: a smaller bound where it has one."""
    import inspect

    return {"max_in_flight_bytes": IN_FLIGHT} if "max_in_flight_bytes" in inspect.signature(save).parameters else {}


def data_file(out: pathlib.Path) -> pathlib.Path:
    return out.with_name(f"{out.name}.data")


def _export_graph(model, tmp: pathlib.Path, exporter: str, dtype: str):
    """The exported onnx-ir model; its weights are tensors that read the torch model's parameters."""
    import onnx_ir as ir
    import torch

    io = random_decoders.cache_io(model, dtype)
    with warnings.catch_warnings(), torch.no_grad():  # tracer warnings about Python control flow in HF code: expected
        warnings.simplefilter("ignore")
        if exporter == "torchscript":
            path = tmp / "graph.onnx"
            torch.onnx.export(io.module, io.args, str(path), input_names=io.names_in, output_names=io.names_out,
                              dynamic_axes=random_decoders.torchscript_axes(io.names_in, io.names_out), opset_version=17,
                              dynamo=False, export_params=False, do_constant_folding=False)
            graph = ir.load(path)
            weights = dict(io.module.named_parameters()) | dict(io.module.named_buffers())
            attach_weights(graph, weights, io.names_in)
            fold_weight_transposes(graph)
            _fold_small_constants(graph)
            return graph
        if exporter == "dynamo":
            program = torch.onnx.export(io.module, io.args, input_names=io.names_in, output_names=io.names_out,
                                        dynamic_shapes=random_decoders.dynamo_shapes(io.past), opset_version=23, dynamo=True,
                                        optimize=False, verbose=False)
            fold_weight_transposes(program.model)  # before the optimizer, which would fold them into copies
            program.optimize()
            return program.model
    raise ValueError(f"exporter must be 'torchscript' or 'dynamo', got {exporter!r}")


def _fold_small_constants(graph) -> None:
    """What TorchScript's constant folding did besides the transposes (the attention scale, shape
    arithmetic), so that the rewrite finds the attention pattern it knows; tensors above
    onnxscript's small size limit, the weights, are left alone."""
    from onnxscript import optimizer

    optimizer.fold_constants(graph, onnx_shape_inference=False)
    optimizer.remove_unused_nodes(graph)


def attach_weights(graph, weights: dict, names_in: list[str]) -> None:
    """Graph inputs named after a torch tensor become initializers that read it when saved; every
    other input must be one of names_in."""
    import onnx_ir as ir

    for value in list(graph.graph.inputs):
        tensor = weights.get(value.name)
        if tensor is None:
            continue
        graph.graph.inputs.remove(value)
        value.const_value = ir.LazyTensor(_reader(tensor), dtype=ir.DataType.from_numpy(_numpy_dtype(tensor)),
                                          shape=ir.Shape(tensor.shape), name=value.name)
        graph.graph.register_initializer(value)
    missing = [v.name for v in graph.graph.inputs if v.name not in names_in]
    if missing:
        raise ValueError(f"the exported graph reads weights the model does not have: {missing[:5]}")


def fold_weight_transposes(graph) -> int:
    """Transpose nodes of an initializer become initializers computed when saved (one at a time);
    returns how many were folded. The original initializer goes once nothing else reads it."""
    import numpy as np
    import onnx_ir as ir

    g = graph.graph
    folded = 0
    for node in list(g):
        if node.op_type != "Transpose" or node.domain not in ("", "ai.onnx"):
            continue
        src = node.inputs[0]
        if src is None or not src.is_initializer() or src.const_value is None:
            continue
        perm = node.attributes["perm"].as_ints() if "perm" in node.attributes else None
        source = src.const_value
        shape = list(source.shape)
        perm = list(perm) if perm is not None else list(reversed(range(len(shape))))

        def transposed(source=source, perm=perm):
            return ir.Tensor(np.ascontiguousarray(source.numpy().transpose(perm)))

        result = node.outputs[0]
        if result in g.outputs:  # a graph output keeps its node
            continue
        new = ir.Value(name=result.name, shape=ir.Shape([shape[p] for p in perm]), type=ir.TensorType(source.dtype),
                       const_value=ir.LazyTensor(transposed, dtype=source.dtype, shape=ir.Shape([shape[p] for p in perm]),
                                                 name=result.name))
        ir.convenience.replace_all_uses_with(result, new)
        g.remove(node, safe=True)
        g.register_initializer(new)
        if not src.uses() and src not in g.outputs:
            del g.initializers[src.name]
        folded += 1
    return folded


def _reader(tensor):
    def read():
        import onnx_ir as ir

        return ir.Tensor(tensor.detach().cpu().numpy())

    return read


def _numpy_dtype(tensor):
    import torch

    return torch.empty((), dtype=tensor.dtype).numpy().dtype
