"""Q, K and V from one matrix product in the in-place form, as onnxruntime-genai's builder makes them.

Exporters of Hugging Face decoders keep the three projections apart: per layer three MatMuls of
the same normed hidden state (plus their biases), each reshaped to heads and transposed. Once the
rotary is inside the op (export/rotary.py), Q and K are those projections as they are, so the op
can take them packed (its input 0 as [B, S, (Hq + 2 Hkv) D], inputs 1 and 2 absent): one product
over the three weights laid side by side, and the reshapes and transposes gone. At a decode step
that is two launches fewer per layer for the GPU, and a dozen nodes fewer for ONNX Runtime's host.

The form is checked, not assumed: each of Q, K, V must be Transpose(Reshape(h @ W [+ b])) with W
(and b) constants, the same h for all three, and the subgraph from h to them, evaluated on random
input, must equal (h @ W + b) split into heads. Anything else keeps the three products.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx_ir as ir

from .subgraph import producer, run, subgraph


@dataclasses.dataclass
class Projection:
    h: ir.Value  # the product's input
    weight: np.ndarray  # [hidden, heads * D]
    bias: np.ndarray | None  # [heads * D]
    outputs: list[ir.Value]  # the product, its reshape, its transpose: what Shape nodes may read


def _const(v: ir.Value | None) -> np.ndarray | None:
    """v's constant value, through Identity nodes (TorchScript aliases equal initializers by them)."""
    while v is not None and producer(v, "Identity") is not None:
        v = v.producer().inputs[0]
    t = ir.convenience.get_const_tensor(v) if v is not None else None
    return None if t is None else t.numpy()


def projection(x4: ir.Value) -> Projection | None:
    """h, W, b where x4 = Transpose(perm 0, 2, 1, 3)(Reshape(h @ W + b))."""
    t = producer(x4, "Transpose")
    if t is None or list(t.attributes.get("perm").value if t.attributes.get("perm") else []) != [0, 2, 1, 3]:
        return None
    r = producer(t.inputs[0], "Reshape")
    if r is None:
        return None
    src, bias = r.inputs[0], None
    add = producer(src, "Add")
    if add is not None:
        for a, b in ((0, 1), (1, 0)):
            if _const(add.inputs[b]) is not None and producer(add.inputs[a], "MatMul") is not None:
                src, bias = add.inputs[a], _const(add.inputs[b])
                break
        else:
            return None
    mm = producer(src, "MatMul")
    weight = _const(mm.inputs[1]) if mm is not None else None
    if weight is None or weight.ndim != 2 or (bias is not None and bias.shape != (weight.shape[1],)):
        return None
    return Projection(mm.inputs[0], weight, bias, [v for v in (src, add.outputs[0] if add else None, r.outputs[0], x4) if v])


def _verified(model: ir.Model, projections: list[Projection], values: list[ir.Value], heads: list[int], d: int,
              dtype: ir.DataType) -> bool:
    h = projections[0].h
    sub = subgraph(values, [(h, dtype)], dict(model.opset_imports))
    if sub is None:
        return False
    hv = np.random.default_rng(2).standard_normal((1, 3, projections[0].weight.shape[0])).astype(dtype.numpy())
    try:
        got = run(sub, {h.name: hv})
    except Exception:  # noqa: BLE001 - a subgraph ORT cannot run alone keeps the exporter's products
        return False
    tol = 1e-4 if dtype == ir.DataType.FLOAT else 2e-2
    for g, p, n in zip(got, projections, heads):
        want = hv.astype(np.float64) @ p.weight.astype(np.float64) + (0 if p.bias is None else p.bias.astype(np.float64))
        want = want.reshape(1, 3, n, d).transpose(0, 2, 1, 3)
        scale = max(1.0, float(np.abs(want).max()))
        if g.shape != want.shape or not np.allclose(g.astype(np.float64), want, atol=tol * scale, rtol=tol):
            return False
    return True


def packed(model: ir.Model, q4: ir.Value, k4: ir.Value, v4: ir.Value, heads: tuple[int, int, int], d: int,
           dtype: ir.DataType) -> tuple[list[Projection], np.ndarray, np.ndarray | None] | None:
    """The three projections and their weight [hidden, (Hq + 2 Hkv) D] (and bias) laid side by side,
    or None where the exporter's form is not the one the module docstring describes."""
    ps = [projection(x) for x in (q4, k4, v4)]
    if any(p is None for p in ps) or len({id(p.h) for p in ps}) != 1 or len({p.weight.dtype for p in ps}) != 1:
        return None
    if [p.weight.shape[1] for p in ps] != [n * d for n in heads] or len({p.weight.shape[0] for p in ps}) != 1:
        return None
    if len({p.bias is None for p in ps}) != 1 or not _verified(model, ps, [q4, k4, v4], list(heads), d, dtype):
        return None
    weight = np.concatenate([p.weight for p in ps], axis=1)
    bias = None if ps[0].bias is None else np.concatenate([p.bias for p in ps])
    return ps, weight, bias
