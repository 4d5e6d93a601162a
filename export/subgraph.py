"""Pieces of a graph evaluated on their own: what the rewrite checks a pattern against before it
replaces the exporter's nodes (export/rotary.py, export/packed_qkv.py)."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir


def producer(v: ir.Value, op: str) -> ir.Node | None:
    """v's producer if it is the standard-domain op `op`."""
    n = v.producer()
    return n if n is not None and n.op_type == op and n.domain in ("", "ai.onnx") else None


def subgraph(outputs: list[ir.Value], inputs: list[tuple[ir.Value, ir.DataType]],
             opsets: dict[str, int]) -> onnx.ModelProto | None:
    """The nodes from `inputs` (value, its type) and constants to `outputs` as a model; None where the
    outputs depend on any other graph input."""
    graph = outputs[0].graph
    stop = {id(v) for v, _ in inputs}
    needed, frontier, initializers = set(), list(outputs), {}
    while frontier:
        v = frontier.pop()
        if id(v) in stop:
            continue
        if v.is_initializer() or (v.const_value is not None and v.producer() is None):
            initializers[v.name] = v
            continue
        n = v.producer()
        if n is None:  # a graph input other than the given ones
            return None
        if n.graph is not graph or n.op_type in ("If", "Loop", "Scan"):
            return None
        if id(n) not in needed:
            needed.add(id(n))
            frontier.extend(i for i in n.inputs if i is not None)
    nodes = [ir.serde.serialize_node(n) for n in graph if id(n) in needed]
    # (an external tensor's bytes are read in: a model made from bytes cannot reach the data file)
    tensors = [ir.serde.serialize_tensor(ir.tensor(v.const_value.numpy()) if isinstance(v.const_value, ir.ExternalTensor)
                                         else v.const_value) for v in initializers.values()]
    for t, name in zip(tensors, initializers):
        t.name = name
    proto = onnx.helper.make_graph(
        nodes, "rotary", [onnx.helper.make_tensor_value_info(v.name, int(t), None) for v, t in inputs],
        [onnx.ValueInfoProto(name=v.name) for v in outputs], tensors)
    return onnx.helper.make_model(proto, opset_imports=[onnx.helper.make_opsetid(d, v) for d, v in opsets.items()],
                                  ir_version=10)


def run(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, feeds)


def ort_errors() -> tuple[type[Exception], ...]:
    """What ONNX Runtime raises for a graph it cannot load or run: a piece it does not take alone, which
    the callers leave to the exporter's nodes; anything else is a bug and is raised."""
    from onnxruntime.capi import onnxruntime_pybind11_state as s

    return (s.Fail, s.InvalidArgument, s.InvalidGraph, s.NotImplemented, s.RuntimeException)
