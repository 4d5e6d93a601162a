"""The TensorRT form of a rewritten model (--target tensorrt).

TensorRT's ONNX parser maps a node it does not know to the plugin whose name is the node's op_type,
in the namespace its `plugin_namespace` attribute names (version: `plugin_version`); every other
attribute becomes a plugin field. The plugins tell their optional inputs apart by type and position,
so absent optional inputs are dropped instead of left as empty names, and TQAttention says whether
it has a mask (has_mask), which the shapes alone cannot tell while the engine is built.

TQGroupQueryAttention says whether QKV is packed in query (packed_qkv: which input is past_key,
which present_key aliases, must be known before any shape is), drops cos_cache, sin_cache and
position_ids when do_rotary is 0 (the op ignores them then), gives zeros for an absent key_offset or
value_offset that a later float input follows (the plugin counts them by position), and takes total_sequence_length as
the length carrier: TensorRT keeps an int32 tensor on the device, where the plugin cannot read it
before its launch, but gives every tensor's shape on the host; ConstantOfShape([0, total]) is an
empty int32 tensor whose second dimension is the total (no memory, no kernel), one per graph.

Packed tensors are int8 there (packed_dtype = 3 on every node), the same bytes as ONNX Runtime's
uint8: TensorRT refuses UINT8 for tensors between layers and for network outputs that no Identity or
Cast layer makes, so every packed value (caches in and out, TQPack's outputs, whatever passes them
on) is retyped, while the ONNX Runtime target keeps uint8.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir

import turboquant

from .errors import RewriteError

PLUGIN_VERSION = "1"
PACKED_DTYPE = ir.DataType.INT8  # the packed_dtype field's 3
_GQA_TOTAL, _GQA_COS, _GQA_SIN, _GQA_POSITIONS, _GQA_HEAD_SINK, _GQA_KEY_OFFSET, _GQA_KEY_SCALE = 6, 7, 8, 9, 11, 12, 14


def for_tensorrt(model: ir.Model) -> int:
    """Rewrites the turboquant nodes of `model` (subgraphs included) in place; returns how many."""
    count = 0
    carriers: dict[tuple[int, int], ir.Value] = {}
    for node in list(ir.traversal.RecursiveGraphIterator(model.graph)):
        if node.domain != turboquant.DOMAIN:
            continue
        inputs = list(node.inputs)
        if node.op_type == "TQAttention":
            has_mask = len(inputs) > 3 and inputs[3] is not None
            node.attributes["has_mask"] = ir.AttrInt64("has_mask", int(has_mask))
        elif node.op_type == "TQGroupQueryAttention":
            inputs = _gqa_inputs(node, inputs, carriers)
        node.attributes["plugin_namespace"] = ir.AttrString("plugin_namespace", turboquant.DOMAIN)
        node.attributes["plugin_version"] = ir.AttrString("plugin_version", PLUGIN_VERSION)
        node.attributes["packed_dtype"] = ir.AttrInt64("packed_dtype", int(PACKED_DTYPE))
        kept = [v for v in inputs if v is not None]
        if kept != list(node.inputs):
            node.resize_inputs(0)
            node.resize_inputs(len(kept))
            for i, v in enumerate(kept):
                node.replace_input_with(i, v)
        count += 1
    _packed_as_int8(model)
    model.metadata_props["turboquant.target"] = "tensorrt"
    return count


def _packed_as_int8(model: ir.Model) -> None:
    """Retypes every uint8 value that a turboquant node reads or writes to int8, and the uint8 values
    joined to those through other nodes (an Identity, a graph output): packed bytes move as int8."""
    todo = []
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        if node.domain == turboquant.DOMAIN:
            todo += [v for v in (*node.inputs, *node.outputs) if v is not None and v.dtype == ir.DataType.UINT8]
    seen: set[int] = set()
    while todo:
        v = todo.pop()
        if id(v) in seen:
            continue
        seen.add(id(v))
        v.dtype = PACKED_DTYPE
        if v.const_value is not None:  # an initializer of packed bytes: the same bytes as int8
            v.const_value = ir.tensor(v.const_value.numpy().view(np.int8), name=v.name)
        joined = [u for u in v.producer().outputs if u is not None] if v.producer() is not None else []
        for use, _ in v.uses():
            joined += [u for u in use.outputs if u is not None]
            joined += [u for u in use.inputs if u is not None]
        todo += [u for u in joined if u.dtype == ir.DataType.UINT8 and id(u) not in seen]


def _gqa_inputs(node: ir.Node, inputs: list, carriers: dict) -> list:
    """TQGroupQueryAttention's inputs in the plugin's form (module docstring); sets packed_qkv."""
    inputs = inputs + [None] * (_GQA_KEY_SCALE + 1 - len(inputs))
    if inputs[_GQA_HEAD_SINK] is not None:  # the plugin's inputs, counted by position, have no place for it
        raise RewriteError(f"node {node.name!r} uses input head_sink (attention sinks), which the TensorRT plugin does "
                           "not take (--target onnxruntime runs it)")
    packed = inputs[1] is None
    node.attributes["packed_qkv"] = ir.AttrInt64("packed_qkv", int(packed))
    rotary = node.attributes.get("do_rotary")
    if rotary is None or not rotary.value:
        inputs[_GQA_COS] = inputs[_GQA_SIN] = inputs[_GQA_POSITIONS] = None
    floats = inputs[_GQA_KEY_OFFSET:_GQA_KEY_SCALE + 1]
    last = max((i for i, v in enumerate(floats) if v is not None), default=-1)
    for i in range(last):
        if floats[i] is None:
            inputs[_GQA_KEY_OFFSET + i] = _zero_offset(node, next(v for v in floats if v is not None), i)
    total = inputs[_GQA_TOTAL]
    if total is None:
        raise RewriteError(f"node {node.name!r} has no total_sequence_length input")
    key = (id(node.graph), id(total))
    if key not in carriers:
        carriers[key] = _length_carrier(node, total)
    inputs[_GQA_TOTAL] = carriers[key]
    return inputs


def _zero_offset(node: ir.Node, like: ir.Value, i: int) -> ir.Value:
    """A float32 zero tensor of `like`'s [Hkv, D] shape (an offset that changes nothing), as a
    Constant before node."""
    shape = like.const_value.shape if like.const_value is not None else like.shape
    if shape is None or not all(isinstance(d, int) for d in shape):
        raise RewriteError(f"node {node.name!r}: input {like.name!r} has no static shape; the TensorRT plugin needs "
                           "every offset before it given")
    name = f"{node.name}_tq_zero_{('key_offset', 'value_offset')[i]}"
    const = ir.node("Constant", [], {"value": ir.tensor(np.zeros(tuple(shape), np.float32), name=name)}, name=name)
    node.graph.insert_before(node, const)
    out = const.outputs[0]
    out.name, out.dtype, out.shape = name, ir.DataType.FLOAT, ir.Shape(shape)  # typed, as the parser and tools read it
    return out


def _length_carrier(before: ir.Node, total: ir.Value) -> ir.Value:
    """ConstantOfShape([0, total]): an empty int32 tensor whose shape holds the total, inserted
    before the first node that reads it."""
    name = f"{total.name}_tq_length"
    zero = ir.node("Constant", [], {"value": ir.tensor(np.array([0], np.int64), name=f"{name}_zero")}, name=f"{name}_zero")
    one = ir.node("Constant", [], {"value": ir.tensor(np.array([1], np.int64), name=f"{name}_one")}, name=f"{name}_one")
    cast = ir.node("Cast", [total], {"to": ir.DataType.INT64}, name=f"{name}_cast")
    flat = ir.node("Reshape", [cast.outputs[0], one.outputs[0]], name=f"{name}_flat")
    shape = ir.node("Concat", [zero.outputs[0], flat.outputs[0]], {"axis": 0}, name=f"{name}_shape")
    fill = ir.node("ConstantOfShape", [shape.outputs[0]], {"value": ir.tensor(np.array([0], np.int32), name=f"{name}_value")},
                   name=name)
    for n in (zero, one, cast, flat, shape, fill):
        before.graph.insert_before(before, n)
    out = fill.outputs[0]
    out.name = name
    out.dtype = ir.DataType.INT32
    out.shape = ir.Shape([0, None])
    return out


def foreign_ops(model: ir.Model) -> list[str]:
    """Op types of the graph (subgraphs included) that are neither standard ONNX nor turboquant's:
    TensorRT's ONNX parser knows none of them (it looks each up as a plugin)."""
    found: dict[str, int] = {}
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        if node.domain == turboquant.DOMAIN or onnx.defs.has(node.op_type, node.domain or ""):
            continue
        name = f"{node.domain}.{node.op_type}" if node.domain else node.op_type
        found[name] = found.get(name, 0) + 1
    return [f"{name} x{n}" for name, n in sorted(found.items())]
