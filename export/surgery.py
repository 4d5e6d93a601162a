"""Graph surgery on one layer: TQAttention in place of its attention, the packed cache I/O, the
shape computations that read the old float cache, and the other branch of a merged decoder."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

import turboquant
from turboquant.config import packed_size

from .cache_io import CacheLayer
from .errors import RewriteError
from .forms import AttentionSite
from .plan import LayerPlan

_SAFE_SHAPE_AXES = (0, 1, 2)  # batch, kv heads, sequence: the same for a packed cache


def shape_only_uses_are_safe(v: ir.Value) -> ir.Node | None:
    """A Shape consumer that might read the last axis (whose size packing changes), or None."""
    for n in v.consumers():
        if n.op_type != "Shape":
            continue
        end = n.attributes.get("end")
        if end is not None and 0 <= end.value <= 3:
            continue
        for u in n.outputs[0].consumers():
            idx = ir.convenience.get_const_tensor(u.inputs[1]) if u.op_type == "Gather" and len(u.inputs) > 1 else None
            if idx is None or any(int(i) not in _SAFE_SHAPE_AXES for i in idx.numpy().reshape(-1)):
                return n
    return None


def _packed_type(v: ir.Value, nbytes: int) -> None:
    dims = list(v.shape) if v.shape is not None else [None, None, None, None]
    v.dtype = ir.DataType.UINT8
    v.shape = ir.Shape([*dims[:3], nbytes])


def _replace_graph_output(graph: ir.Graph, old: ir.Value, new: ir.Value) -> None:
    """new takes old's place (and name) among the graph outputs; old's other readers stay on it."""
    name = old.name
    for i, o in enumerate(graph.outputs):
        if o is old:
            graph.outputs[i] = new
    old.name = f"{name}_replaced"
    new.name = name


def take_outputs(graph: ir.Graph, old_outputs: list[ir.Value], new_outputs: list[ir.Value]) -> None:
    """Each new output takes its old one's readers, name and place among the graph outputs."""
    for o_old, o_new in zip(old_outputs, new_outputs):
        name = o_old.name
        if o_old.is_graph_output():
            _replace_graph_output(graph, o_old, o_new)
        o_old.replace_all_uses_with(o_new)
        o_new.name = name
        o_old.name = f"{name}_replaced"


def _initializer(model: ir.Model, name: str, array: np.ndarray) -> ir.Value:
    value = ir.Value(name=name, const_value=ir.tensor(array, name=name))
    model.graph.register_initializer(value)
    return value


def _scaled(graph: ir.Graph, before: ir.Node | None, x: ir.Value, factor: np.ndarray, name: str) -> ir.Value:
    """x * factor (a constant broadcast over x's trailing axes), inserted before `before`, or at the
    end of the graph when before is None."""
    const = ir.node("Constant", [], {"value": ir.tensor(factor, name=f"{name}_factor")}, name=f"{name}_factor")
    mul = ir.node("Mul", [x, const.outputs[0]], name=name)
    for n in (const, mul):
        if before is None:
            graph.append(n)
        else:
            graph.insert_before(before, n)
    out = mul.outputs[0]
    out.name = name
    if x.dtype is not None:  # TorchScript exports often leave intermediate values untyped
        out.dtype, out.shape = x.dtype, x.shape
    return out


def apply_site(model: ir.Model, site: AttentionSite, layer: CacheLayer, plan: LayerPlan, norm_correction: bool,
               key_offset: np.ndarray | None = None, value_offset: np.ndarray | None = None,
               key_scale: np.ndarray | None = None, q_heads: int | None = None) -> ir.Node:
    """key_scale (float32 [Hkv, D]): queries are multiplied by it (per group) and keys divided by it
    before TQAttention, which leaves every score unchanged and moves the key quantization error to
    the channels the queries read least (export/calibrate.py). q_heads: the query head count."""
    graph = site.anchor.graph
    q, k = site.q, site.k_new
    if key_scale is not None:
        dtype = layer.past_key.dtype.numpy()  # Q and K have the cache's float type
        hkv = key_scale.shape[0]
        sq, sk = np.repeat(key_scale, q_heads // hkv, axis=0), 1.0 / key_scale
        if site.q_num_heads:  # 3-D [B, S, H * D]
            sq, sk = sq.reshape(-1), sk.reshape(-1)
        else:  # 4-D [B, H, S, D]
            sq, sk = sq[:, None, :], sk[:, None, :]
        q = _scaled(graph, site.anchor, q, sq.astype(dtype), f"tq_query_scaled_{layer.index}")
        k = _scaled(graph, site.anchor, k, sk.astype(dtype), f"tq_key_scaled_{layer.index}")
        if key_offset is not None:
            key_offset = (key_offset / key_scale).astype(np.float32)
    attrs = {"key_format": plan.key_format, "value_format": plan.value_format, "norm_correction": int(norm_correction),
             "is_causal": int(site.is_causal)}
    if site.scale:
        attrs["scale"] = float(site.scale)
    if site.q_num_heads:
        attrs["q_num_heads"] = int(site.q_num_heads)
    if site.kv_num_heads:
        attrs["kv_num_heads"] = int(site.kv_num_heads)
    inputs = [q, k, site.v_new, site.mask, layer.past_key, layer.past_value]
    if key_offset is not None or value_offset is not None:
        zeros = np.zeros((key_offset if key_offset is not None else value_offset).shape, np.float32)
        inputs.append(_initializer(model, f"tq_key_offset_{layer.index}", key_offset if key_offset is not None else zeros))
        if value_offset is not None:
            inputs.append(_initializer(model, f"tq_value_offset_{layer.index}", value_offset))
    node = ir.node("TQAttention", inputs, attributes=attrs, domain=turboquant.DOMAIN, num_outputs=3,
                   name=f"tq_attention_{layer.index}")
    graph.insert_before(site.anchor, node)
    y, pk_out, pv_out = node.outputs
    y.name = f"tq_attention_{layer.index}_y"
    if site.y_cast_to is not None:  # the original attended in another type than Q's: keep its output type
        cast = ir.node("Cast", [y], {"to": ir.DataType(site.y_cast_to)}, name=f"tq_attention_{layer.index}_cast")
        graph.insert_after(node, cast)
        y = cast.outputs[0]
        y.name = f"tq_attention_{layer.index}_y_cast"
    if site.y.dtype is not None:  # TorchScript exports often leave intermediate values untyped
        y.dtype, y.shape = site.y.dtype, site.y.shape
    if site.y.is_graph_output():
        _replace_graph_output(graph, site.y, y)
    site.y.replace_all_uses_with(y)
    for old, new, past, nbytes in ((site.present_key, pk_out, layer.past_key, packed_size(plan.key_format, plan.head_dim)),
                                   (site.present_value, pv_out, layer.past_value, packed_size(plan.value_format, plan.head_dim))):
        new.shape = old.shape
        if old.is_graph_output():
            _replace_graph_output(graph, old, new)
        else:
            new.name = f"tq_attention_{layer.index}_{'present_key' if new is pk_out else 'present_value'}"
        _packed_type(new, nbytes)
        _packed_type(past, nbytes)
    return node


def reroute_cache_shapes(site: AttentionSite, node: ir.Node, head_dim: int) -> None:
    """Shape computations that still read the float cache (or its repeat over query heads) after
    the attention is gone, e.g. the output reshape of TorchScript exports or the mask's slice to the
    keys' length in optimum's, are given the same numbers from the op's inputs, so that none depends
    on its outputs (a mask the op reads would make a cycle): batch and heads from the packed past's
    shape, the length as the past's plus the new tokens', the head size as a constant, and the query
    head count from Q's shape. Without a past input, from the packed present."""
    for old, new, past, fresh in ((site.present_key, node.outputs[1], node.inputs[4], node.inputs[1]),
                                  (site.present_value, node.outputs[2], node.inputs[5], node.inputs[2])):
        frontier, chain = [(old, False)], []
        while frontier:
            v, repeated = frontier.pop()
            for user in list(v.consumers()):
                if user.op_type in _REPEAT_CHAIN:
                    frontier.append((user.outputs[0], repeated or user.op_type == "Reshape"))
                elif user.op_type == "Shape" and not user.attributes:
                    chain.append((user, repeated, len(v.shape) if v.shape is not None else None))
                else:
                    raise RewriteError(f"layer {site.layer}: {user.name!r} ({user.op_type}) still reads the float cache "
                                       f"{old.name!r} after its attention was replaced")
        for shape_node, repeated, rank in chain:
            for g in list(shape_node.outputs[0].consumers()):
                idx = ir.convenience.get_const_tensor(g.inputs[1]) if g.op_type == "Gather" and len(g.inputs) > 1 else None
                axis = g.attributes.get("axis")
                if idx is None or (axis is not None and axis.value != 0) or idx.numpy().size != 1:
                    raise RewriteError(f"layer {site.layer}: {g.name!r} ({g.op_type}) reads the shape of the float cache "
                                       f"{old.name!r} in a way turboquant cannot re-derive")
                i = int(idx.numpy().reshape(-1)[0])
                i = i + 4 if i < 0 else i
                graph = g.graph
                if i == 3:
                    value = ir.node("Constant", [], {"value": ir.tensor(np.full(idx.numpy().shape, head_dim, np.int64))}, name=f"{g.name}_tq")
                    graph.insert_before(g, value)
                elif i == 2 and past is not None:  # past + new: the K/V inputs' sequence axis is -2 in either rank
                    last = ir.node("Constant", [], {"value": ir.tensor(np.full(idx.numpy().shape, -2, np.int64))}, name=f"{g.name}_tq_axis")
                    nodes = [ir.node("Shape", [past], name=f"{g.name}_tq_past_shape"),
                             ir.node("Shape", [fresh], name=f"{g.name}_tq_new_shape"), last]
                    nodes.append(ir.node("Gather", [nodes[0].outputs[0], g.inputs[1]], {"axis": 0}, name=f"{g.name}_tq_past"))
                    nodes.append(ir.node("Gather", [nodes[1].outputs[0], last.outputs[0]], {"axis": 0}, name=f"{g.name}_tq_new"))
                    value = ir.node("Add", [nodes[3].outputs[0], nodes[4].outputs[0]], name=f"{g.name}_tq")
                    for n in (*nodes, value):
                        graph.insert_before(g, n)
                else:
                    source = site.q if (i == 1 and repeated) else (past if past is not None else new)
                    shp = ir.node("Shape", [source], name=f"{g.name}_tq_shape")
                    value = ir.node("Gather", [shp.outputs[0], g.inputs[1]], {"axis": 0}, name=f"{g.name}_tq")
                    graph.insert_before(g, shp)
                    graph.insert_before(g, value)
                value.outputs[0].name = f"{g.outputs[0].name}_tq"
                g.outputs[0].replace_all_uses_with(value.outputs[0])


_REPEAT_CHAIN = {"Unsqueeze", "Expand", "Reshape", "Transpose", "Cast", "Identity"}


def _owning_if(model: ir.Model, graph: ir.Graph) -> tuple[ir.Node, str] | None:
    """The If node whose then_branch or else_branch is `graph`, and which one."""
    for n in ir.traversal.RecursiveGraphIterator(model.graph):
        if n.op_type != "If":
            continue
        for attr in ("then_branch", "else_branch"):
            a = n.attributes.get(attr)
            if a is not None and a.value is graph:
                return n, attr
    return None


def pack_other_branch(model: ir.Model, node: ir.Node, plan: LayerPlan, norm_correction: bool,
                       key_offset, value_offset, key_scale=None, dtype=None) -> None:
    """Merged decoders: the attention was rewritten in one branch of an If (the one with a past);
    the other branch (no past) still returns float presents. Pack those with TQPack, so that both
    branches, and the If's outputs, return the packed cache (keys divided by key_scale, in the
    cache's float dtype, as the rewritten branch stores them)."""
    graph = node.graph
    owner = _owning_if(model, graph)
    if owner is None:
        raise RewriteError(f"layer {plan.index}: the attention sits in a subgraph that is not an If branch")
    if_node, attr = owner
    other = if_node.attributes["else_branch" if attr == "then_branch" else "then_branch"].value
    for new, fmt, offset in ((node.outputs[1], plan.key_format, key_offset), (node.outputs[2], plan.value_format, value_offset)):
        k = next((i for i, o in enumerate(graph.outputs) if o is new), None)
        if k is None:
            raise RewriteError(f"layer {plan.index}: the present cache is not an output of its If branch")
        src = other.outputs[k]
        if key_scale is not None and new is node.outputs[1]:
            factor = (1.0 / key_scale)[:, None, :].astype(dtype.numpy())  # present keys are [B, Hkv, S, D]
            if offset is not None:
                offset = (offset / key_scale).astype(np.float32)
            src = _scaled(other, None, src, factor, f"tq_key_scaled_{plan.index}_pack")
        inputs = [src]
        if offset is not None:
            inputs.append(_initializer(model, f"tq_{'key' if new is node.outputs[1] else 'value'}_offset_{plan.index}_pack", offset))
        pack = ir.node("TQPack", inputs, {"format": fmt, "head_dim": plan.head_dim, "norm_correction": int(norm_correction)},
                       domain=turboquant.DOMAIN, name=f"tq_pack_{plan.index}_{len(other)}")
        other.append(pack)
        packed = pack.outputs[0]
        packed.name = f"{src.name}_packed"
        _packed_type(packed, packed_size(fmt, plan.head_dim))
        if src.shape is not None:
            packed.shape = ir.Shape([*list(src.shape)[:3], packed_size(fmt, plan.head_dim)])
        other.outputs[k] = packed
        _packed_type(if_node.outputs[k], packed_size(fmt, plan.head_dim))


def present_outputs(model: ir.Model, layer: int) -> list[ir.Value]:
    node = next((n for n in ir.traversal.RecursiveGraphIterator(model.graph) if n.name == f"tq_attention_{layer}"), None)
    return list(node.outputs[1:]) if node is not None else []


