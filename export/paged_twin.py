"""The GroupQueryAttention twin of a paged model: the same weights and layers with each
com.microsoft PagedAttention replaced by a GroupQueryAttention over a cache [batch, Hkv, length, D],
and the model's packed tokens [num_tokens] as a batch [batch, sequence] (input_ids and
attention_mask, as genai's builder writes GroupQueryAttention models).

ONNX Runtime has no CPU kernel for PagedAttention, so the paged rewrite runs this twin where the
GroupQueryAttention rewrite runs the original: to calibrate (export/calibrate_gqa.py, on the same
layer numbers), to write its self-generated calibration text, and (tests) as the original's
numbers on the CPU. GroupQueryAttention's semantics are PagedAttention's per sequence (rotary at
the sequence's positions, causal attention, window, softcap, sink), so the twin computes what the
original does, for right-padded batches of prompts and decode steps alike.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from .errors import RewriteError
from .gqa import _attr
from .paged import _HEAD_SINK, is_paged_node, unsupported_features

_ENGINE_INPUTS = ("block_table", "cumulative_sequence_lengths", "past_sequence_lengths", "attention_metadata")
_KEPT = ("num_heads", "kv_num_heads", "scale", "do_rotary", "rotary_interleaved", "local_window_size", "softcap")


def _add(graph: ir.Graph, op: str, inputs: list, name: str, before: ir.Node | None = None, **attrs) -> ir.Value:
    node = ir.node(op, inputs, attrs, name=name)
    if before is None:
        graph.append(node)
    else:
        graph.insert_before(before, node)
    node.outputs[0].name = name
    return node.outputs[0]


def _const(graph: ir.Graph, array, name: str, before: ir.Node | None = None) -> ir.Value:
    return _add(graph, "Constant", [], name, before, value=ir.tensor(np.asarray(array), name=name))


def gqa_twin(model: ir.Model) -> ir.Model:
    """Turns a paged model (loaded with onnx-ir) into its GroupQueryAttention twin, in place."""
    graph = model.graph
    nodes = [n for n in graph if is_paged_node(n)]
    if not nodes:
        raise RewriteError("no PagedAttention node to turn into GroupQueryAttention")
    for n in nodes:
        found = unsupported_features(n, model)
        if found:
            raise RewriteError(f"node {n.name!r} (com.microsoft.PagedAttention) uses {', '.join(found)}, which "
                               "TQPagedAttention does not take")
    inputs = {v.name: v for v in graph.inputs}
    if "input_ids" not in inputs:
        raise RewriteError("the paged model has no input_ids input (genai's exclude_embeds); its twin needs one")
    first = next(iter(graph))
    # input_ids [batch, sequence] and attention_mask [batch, total]: the tokens flattened for the model's
    # packed layers, the lengths for GroupQueryAttention
    flat_ids = inputs["input_ids"]
    ids = ir.Value(name="input_ids", shape=ir.Shape(["batch_size", "sequence_length"]),
                   type=ir.TensorType(ir.DataType.INT64))
    mask = ir.Value(name="attention_mask", shape=ir.Shape(["batch_size", "total_sequence_length"]),
                    type=ir.TensorType(ir.DataType.INT64))
    flat_ids.name = "tq_twin_flat_input_ids"
    graph.inputs[graph.inputs.index(flat_ids)] = ids
    graph.inputs.append(mask)
    flat = _add(graph, "Reshape", [ids, _const(graph, np.array([-1], np.int64), "tq_twin_minus_one", first)],
                "tq_twin_input_ids_flat", first)
    flat_ids.replace_all_uses_with(flat)
    batch_shape = _add(graph, "Shape", [ids], "tq_twin_ids_shape", first)
    rows_shape = _add(graph, "Concat", [batch_shape, _const(graph, np.array([-1], np.int64), "tq_twin_rest", first)],
                      "tq_twin_rows_shape", first, axis=0)
    one = _const(graph, np.array([1], np.int64), "tq_twin_one", first)
    summed = _add(graph, "ReduceSum", [mask, one], "tq_twin_lengths", first, keepdims=0)
    seqlens = _add(graph, "Cast", [_add(graph, "Sub", [summed, one], "tq_twin_lengths_minus_one", first)],
                   "tq_twin_seqlens_k", first, to=ir.DataType.INT32)
    total = _add(graph, "Cast", [_add(graph, "Gather", [_add(graph, "Shape", [mask], "tq_twin_mask_shape", first),
                                                        _const(graph, np.array(1, np.int64), "tq_twin_axis1", first)],
                                      "tq_twin_total_i64", first, axis=0)],
                 "tq_twin_total_sequence_length", first, to=ir.DataType.INT32)
    for n in nodes:
        d, hq, hkv = _head_dim(n), _attr(n, "num_heads", 0), _attr(n, "kv_num_heads", 0)
        packed = len(n.inputs) < 2 or n.inputs[1] is None
        q = _add(graph, "Reshape", [n.inputs[0], rows_shape], f"{n.name}/twin_q", n)
        q.shape, q.dtype = ir.Shape(["batch_size", "sequence_length", (hq + 2 * hkv if packed else hq) * d]), n.inputs[0].dtype
        kv = [None, None]
        if not packed:
            kv = [_add(graph, "Reshape", [n.inputs[i], rows_shape], f"{n.name}/twin_{w}", n) for i, w in ((1, "k"), (2, "v"))]
            for x in kv:
                x.shape, x.dtype = ir.Shape(["batch_size", "sequence_length", hkv * d]), n.inputs[0].dtype
        sink = n.inputs[_HEAD_SINK] if len(n.inputs) > _HEAD_SINK else None
        gqa_inputs = [q, *kv, n.inputs[3], n.inputs[4], seqlens, total, n.inputs[8], n.inputs[9], None, None, sink]
        while gqa_inputs[-1] is None:
            gqa_inputs.pop()
        attrs = {k: a.value for k, a in n.attributes.items() if k in _KEPT}
        gqa = ir.node("GroupQueryAttention", gqa_inputs, attrs, domain="com.microsoft", num_outputs=3,
                      name=f"{n.name}/twin")
        graph.insert_before(n, gqa)
        hidden = _attr(n, "num_heads", 0) * _head_dim(n)
        y = _add(graph, "Reshape", [gqa.outputs[0], _const(graph, np.array([-1, hidden], np.int64), f"{n.name}/twin_rows", n)],
                 f"{n.name}/twin_y", n)
        y.dtype = n.outputs[0].dtype
        n.outputs[0].replace_all_uses_with(y)
        for old, new in zip(n.outputs[1:3], gqa.outputs[1:3]):
            name = old.name
            graph.outputs[graph.outputs.index(old)] = new
            old.name = f"{name}_paged"
            new.name, new.dtype = name, old.dtype
            new.shape = ir.Shape(["batch_size", _attr(n, "kv_num_heads", 0), "total_sequence_length", _head_dim(n)])
        for past in n.inputs[3:5]:
            past.shape = ir.Shape(["batch_size", _attr(n, "kv_num_heads", 0), "past_sequence_length", _head_dim(n)])
        graph.remove(n, safe=True)
    logits = next((o for o in graph.outputs if o.name == "logits"), None)
    if logits is not None:
        shaped = _add(graph, "Reshape", [logits, _add(graph, "Concat", [batch_shape, _const(graph, np.array([-1], np.int64),
                                                                                          "tq_twin_vocab")],
                                                       "tq_twin_logits_shape", axis=0)], "tq_twin_logits")
        graph.outputs[graph.outputs.index(logits)] = shaped
        logits.name, shaped.name, shaped.dtype = "tq_twin_logits_flat", "logits", logits.dtype
    for name in _ENGINE_INPUTS:
        v = next((x for x in graph.inputs if x.name == name), None)
        if v is not None and not v.uses():
            graph.inputs.remove(v)
    return model


def _head_dim(n: ir.Node) -> int:
    from .gqa import head_dim

    d = head_dim(n)
    if d is None:
        raise RewriteError(f"node {n.name!r}: cannot tell its head size")
    return d
