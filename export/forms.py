"""Locating the attention that reads one layer's KV cache, in the forms exporters produce.

- "attention": ONNX Attention (opset 23/24) with past_key/past_value inputs (mobius; torch.onnx
  dynamo exports after onnxscript's GQA fusion). Replaced one-for-one.
- "attention-concat": ONNX Attention whose K/V are Concat(past, new) on the sequence axis, possibly
  repeated over query heads (Unsqueeze/Expand/Reshape, GQA) - torch.onnx dynamo exports before that
  fusion.
- "decomposed": Concat(past, new) on the sequence axis, then MatMul(Q, K^T), scaling, an additive
  mask, Softmax, MatMul(P, V) - the TorchScript exporter and optimum.
- com.microsoft GroupQueryAttention (onnxruntime-genai) has its own rewrite (export/gqa.py).

Each form yields an AttentionSite: what TQAttention needs (Q, the new K/V, mask, scale, ...) and
which values it replaces. The walk is structural and lists the node that stopped it, so that an
unrecognised form is refused by name.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from .cache_io import CacheLayer
from .errors import RewriteError

# Ops that only repeat K/V over the query heads of a group (repeat_kv) or reshape them.
_REPEAT_OPS = {"Unsqueeze", "Expand", "Reshape"}
_PASS_OPS = {"Cast", "Identity", "Dropout"}


@dataclasses.dataclass
class AttentionSite:
    layer: int
    form: str
    anchor: ir.Node  # the new node goes right before it
    q: ir.Value
    k_new: ir.Value
    v_new: ir.Value
    mask: ir.Value | None
    y: ir.Value  # replaced by TQAttention's Y
    present_key: ir.Value  # replaced by TQAttention's present_key
    present_value: ir.Value
    scale: float | None = None  # None: the op's default 1/sqrt(D)
    y_cast_to: int | None = None  # the original output's type where it differs from Q's (a Cast follows)
    is_causal: int = 0
    q_num_heads: int = 0
    kv_num_heads: int = 0


def _real_consumers(v: ir.Value) -> list[ir.Node]:
    """Consumers other than Shape (shape computations survive a change of the last dim's size)."""
    return [n for n in v.consumers() if n.op_type != "Shape"]


def _scalar_const(v: ir.Value | None) -> float | None:
    if v is None:
        return None
    t = ir.convenience.get_const_tensor(v)
    if t is None:
        return None
    a = t.numpy()
    return float(a.reshape(-1)[0]) if a.size == 1 else None


def _describe(n: ir.Node) -> str:
    return f"node {n.name!r} ({n.domain + '.' if n.domain else ''}{n.op_type})"


def _attr(n: ir.Node, name: str, default):
    a = n.attributes.get(name)
    return default if a is None else a.value


def _skip_identities(v: ir.Value) -> ir.Value:
    """Follows Identity and one-input Concat nodes (exporters emit both for a cache passed through)."""
    while True:
        users = _real_consumers(v)
        if len(users) == 1 and (users[0].op_type == "Identity" or (users[0].op_type == "Concat" and len(users[0].inputs) == 1)):
            v = users[0].outputs[0]
        else:
            return v


def _cache_concat(past: ir.Value) -> ir.Node | None:
    """Concat(past, new) on the sequence axis, when that is how past is consumed."""
    past = _skip_identities(past)
    users = _real_consumers(past)
    if len(users) == 1 and users[0].op_type == "Concat" and users[0].domain == "":
        n = users[0]
        if _attr(n, "axis", None) in (2, -2) and len(n.inputs) == 2 and n.inputs[0] is past:
            return n
    return None


def _trace_back(v: ir.Value, target: ir.Value, allowed: set[str]) -> tuple[bool, list[ir.Node]]:
    """Follows v's producers through `allowed` ops (first input) to target."""
    path = []
    while v is not target:
        p = v.producer()
        if p is None or p.op_type not in allowed or not p.inputs or p.inputs[0] is None:
            return False, path
        path.append(p)
        v = p.inputs[0]
    return True, path


def locate(layer: CacheLayer) -> AttentionSite:
    pk, pv = layer.past_key, layer.past_value
    users = _real_consumers(_skip_identities(pk))
    if not users:
        raise RewriteError(f"layer {layer.index}: nothing reads {pk.name!r}")
    first = users[0]
    if first.op_type == "GroupQueryAttention":  # whole GQA models go to export/gqa.py before this point
        raise RewriteError(f"layer {layer.index}: {_describe(first)} is com.microsoft GroupQueryAttention in a model "
                           "that also has other attention forms; such mixed models are not supported")
    if first.op_type == "Attention" and first.domain == "" and len(first.inputs) > 5 and first.inputs[4] is pk:
        return _site_attention(layer, first)
    ck, cv = _cache_concat(pk), _cache_concat(pv)
    if ck is None or cv is None:
        raise RewriteError(
            f"layer {layer.index}: {pk.name!r} is read by {_describe(first)}, which is neither ONNX Attention with "
            "past inputs nor a Concat of past and new keys on the sequence axis"
        )
    return _site_after_concat(layer, ck, cv)


def _site_attention(layer: CacheLayer, n: ir.Node) -> AttentionSite:
    if n.inputs[5] is not layer.past_value:
        raise RewriteError(f"layer {layer.index}: {_describe(n)} takes {layer.past_key.name!r} but not {layer.past_value.name!r}")
    if len(n.inputs) > 6 and n.inputs[6] is not None:
        raise RewriteError(f"layer {layer.index}: {_describe(n)} uses nonpad_kv_seqlen, which TQAttention does not support")
    _check_attention_attrs(layer, n)
    return AttentionSite(layer.index, "attention", n, n.inputs[0], n.inputs[1], n.inputs[2], n.inputs[3], n.outputs[0],
                         n.outputs[1], n.outputs[2], scale=_attr(n, "scale", None), is_causal=_attr(n, "is_causal", 0),
                         q_num_heads=_attr(n, "q_num_heads", 0), kv_num_heads=_attr(n, "kv_num_heads", 0))


def _check_attention_attrs(layer: CacheLayer, n: ir.Node) -> None:
    if _attr(n, "softcap", 0.0):
        raise RewriteError(f"layer {layer.index}: {_describe(n)} uses softcap, which TQAttention does not support")
    if len(n.outputs) > 3 and n.outputs[3].uses():
        raise RewriteError(f"layer {layer.index}: {_describe(n)} uses qk_matmul_output, which TQAttention does not produce")


def _forward_to_attention(present: ir.Value) -> ir.Node:
    """The Attention or score MatMul that reads present through repeat_kv / transpose / scaling ops."""
    frontier, seen, found = [present], set(), []
    while frontier:
        v = frontier.pop()
        for n in _real_consumers(v):
            if id(n) in seen:
                continue
            seen.add(id(n))
            if n.op_type in ("Attention", "MatMul"):
                found.append(n)
            elif n.op_type in _REPEAT_OPS | _PASS_OPS | {"Transpose", "Mul", "Div"}:
                frontier.extend(n.outputs)
            else:
                raise RewriteError(f"{_describe(n)} reads the concatenated cache {present.name!r}; turboquant does not recognise it")
    if len(found) != 1:
        names = ", ".join(_describe(n) for n in found) or "none"
        raise RewriteError(f"the concatenated cache {present.name!r} should feed one attention, found: {names}")
    return found[0]


def _site_after_concat(layer: CacheLayer, ck: ir.Node, cv: ir.Node) -> AttentionSite:
    present_k, present_v = ck.outputs[0], cv.outputs[0]
    target = _forward_to_attention(present_k)
    if target.op_type == "Attention":
        ok_k, _ = _trace_back(target.inputs[1], present_k, _REPEAT_OPS)
        ok_v, _ = _trace_back(target.inputs[2], present_v, _REPEAT_OPS)
        if not (ok_k and ok_v) or (len(target.inputs) > 4 and any(x is not None for x in target.inputs[4:])):
            raise RewriteError(f"layer {layer.index}: {_describe(target)} does not read K and V from the cache concats")
        _check_attention_attrs(layer, target)
        if len(target.outputs) > 1 and any(o.uses() for o in target.outputs[1:]):
            raise RewriteError(f"layer {layer.index}: {_describe(target)} has used present outputs of its own")
        return AttentionSite(layer.index, "attention-concat", target, target.inputs[0], ck.inputs[1], cv.inputs[1],
                             target.inputs[3] if len(target.inputs) > 3 else None, target.outputs[0], present_k,
                             present_v, scale=_attr(target, "scale", None), is_causal=_attr(target, "is_causal", 0),
                             q_num_heads=_attr(target, "q_num_heads", 0), kv_num_heads=_attr(target, "kv_num_heads", 0))
    return _site_decomposed(layer, target, ck, cv)


def _nan_guard(p: ir.Value) -> ir.Node | None:
    """Where(IsNaN(p), 0, p) reading p, when p's only readers are that IsNaN and that Where."""
    users = p.consumers()
    if len(users) != 2:
        return None
    isnan = next((n for n in users if n.op_type == "IsNaN"), None)
    where = next((n for n in users if n.op_type == "Where"), None)
    if isnan is None or where is None or len(isnan.outputs[0].consumers()) != 1:
        return None
    if where.inputs[0] is isnan.outputs[0] and where.inputs[2] is p and _scalar_const(where.inputs[1]) == 0.0:
        return where
    return None


def _site_decomposed(layer: CacheLayer, m1: ir.Node, ck: ir.Node, cv: ir.Node) -> AttentionSite:
    where = f"layer {layer.index}: decomposed attention at {_describe(m1)}"
    scale = 1.0
    # K side: present_k -> repeat_kv -> Transpose(last two axes) -> optional scalar Mul/Div -> m1.B
    v, transposes = m1.inputs[1], 0
    while v is not ck.outputs[0]:
        p = v.producer()
        if p is None:
            raise RewriteError(f"{where}: its second input does not come from the key cache")
        if p.op_type in ("Mul", "Div") and _scalar_const(p.inputs[1]) is not None:
            c = _scalar_const(p.inputs[1])
            scale *= c if p.op_type == "Mul" else 1.0 / c
        elif p.op_type == "Transpose":
            perm = list(_attr(p, "perm", []))
            if perm != [0, 1, 3, 2]:
                raise RewriteError(f"{where}: {_describe(p)} has perm {perm}, expected [0, 1, 3, 2]")
            transposes += 1
        elif p.op_type not in _REPEAT_OPS | _PASS_OPS:
            raise RewriteError(f"{where}: {_describe(p)} between the key cache and the scores is not recognised")
        v = p.inputs[0]
    if transposes != 1:
        raise RewriteError(f"{where}: expected one transpose of the keys, found {transposes}")
    # Q side: strip scalar scaling that only feeds the scores
    q = m1.inputs[0]
    while (p := q.producer()) is not None and p.op_type in ("Mul", "Div") and len(q.uses()) == 1 and _scalar_const(p.inputs[1]) is not None:
        c = _scalar_const(p.inputs[1])
        scale *= c if p.op_type == "Mul" else 1.0 / c
        q = p.inputs[0]
    # scores -> scale / mask / casts -> Softmax(last axis)
    mask, v = None, m1.outputs[0]
    while True:
        users = v.consumers()
        if len(users) != 1:
            raise RewriteError(f"{where}: the scores feed {len(users)} nodes, expected one chain to Softmax")
        n = users[0]
        if n.op_type == "Softmax":
            if _attr(n, "axis", -1) not in (-1, 3):
                raise RewriteError(f"{where}: {_describe(n)} is not over the last axis")
            break
        if n.op_type in ("Mul", "Div") and n.inputs[0] is v and _scalar_const(n.inputs[1]) is not None:
            c = _scalar_const(n.inputs[1])
            scale *= c if n.op_type == "Mul" else 1.0 / c
        elif n.op_type == "Add" and mask is None:
            other = n.inputs[1] if n.inputs[0] is v else n.inputs[0]
            mask = other
        elif n.op_type not in _PASS_OPS:
            why = " (attention logit softcapping, as Gemma 2's: the ops do not take it)" if n.op_type == "Tanh" else ""
            raise RewriteError(f"{where}: {_describe(n)} between the scores and Softmax is not recognised{why}")
        v = n.outputs[0]
    # Softmax -> casts / NaN guard -> MatMul(P, V)
    v = n.outputs[0]
    while True:
        users = v.consumers()
        guard = _nan_guard(v)
        if guard is not None:  # where(isnan(p), 0, p): rows with every key masked give 0, as TQAttention does
            v = guard.outputs[0]
            continue
        if len(users) != 1:
            raise RewriteError(f"{where}: the attention weights feed {len(users)} nodes, expected one MatMul")
        n = users[0]
        if n.op_type == "MatMul" and n.inputs[0] is v:
            m2 = n
            break
        if n.op_type not in _PASS_OPS:
            raise RewriteError(f"{where}: {_describe(n)} between Softmax and the value MatMul is not recognised")
        v = n.outputs[0]
    ok, path = _trace_back(m2.inputs[1], cv.outputs[0], _REPEAT_OPS | _PASS_OPS)
    if not ok:
        raise RewriteError(f"{where}: the value MatMul {_describe(m2)} does not read the value cache")
    # Half-precision exports often attend in float32 (values cast up before the value MatMul): the
    # attention output then keeps that type, which TQAttention's output (Q's type) must be cast to.
    casts = [n for n in path if n.op_type == "Cast"]
    y_cast_to = int(_attr(casts[0], "to", 0)) if casts else None
    return AttentionSite(layer.index, "decomposed", m2, q, ck.inputs[1], cv.inputs[1], mask, m2.outputs[0],
                         ck.outputs[0], cv.outputs[0], scale=float(np.float32(scale)), y_cast_to=y_cast_to)
