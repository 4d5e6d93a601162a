"""The output projection in the op's own type where the exporter widened it.

torch.onnx's TorchScript export of a float16 decoder computes its attention in float32 (V cast up,
the scores' mask in float32), and the output projection with it, on a float32 copy of the float16
weight (a Cast the exporter folded into the constant). Once the op's float16 output feeds that
projection (export/mask_probe.py), the product would read twice the weight's bytes and run as a
float32 GEMM, about twice the float16 one's time on the H200 (docs/performance.md). Where
every value of that weight is a value of the op's type, the product is taken in the op's type and
its result widened after it: the same weights and inputs, only the product's rounding differs.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from .packed_qkv import _const


def narrow(model: ir.Model, build, y: ir.Value, widened: ir.Value, layer: int) -> int:
    """Each MatMul(widened, W) where widened = Cast(y) and W a constant whose values y's type holds
    exactly becomes Cast(MatMul(y, W in y's type)), built by `build` (export/in_place.py's _Builder);
    returns how many. The old products are left for RemoveUnusedNodesPass."""
    narrow_type = y.dtype.numpy()
    done = 0
    for user, index in list(widened.uses()):
        weight = _const(user.inputs[1]) if user.op_type == "MatMul" and user.domain == "" and index == 0 else None
        if weight is None or weight.dtype == narrow_type or weight.ndim != 2:
            continue
        narrowed = weight.astype(narrow_type)
        if not np.array_equal(narrowed.astype(weight.dtype), weight):
            continue
        name = f"tq_o_proj_weight_{layer}" + (f"_{done}" if done else "")
        w = ir.Value(name=name, const_value=ir.tensor(narrowed, name=name))
        model.graph.register_initializer(w)
        out = user.outputs[0]
        product = build("MatMul", [y, w], f"o_proj{done or ''}", y.dtype)
        wide = build("Cast", [product], f"o_proj{done or ''}_cast", widened.dtype, to=widened.dtype)
        wide.shape = out.shape
        out.replace_all_uses_with(wide)
        done += 1
    return done
