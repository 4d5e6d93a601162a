"""export/surgery.py's scaled_at_source: a per-channel factor folded into the projection that makes
the value where that is exact, a Mul otherwise; the graph computes x * factor either way."""

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from turboquant.export.surgery import scaled_at_source

K, N = 6, 8
RNG = np.random.default_rng(0)
W, BIAS = RNG.normal(size=(K, N)).astype(np.float32), RNG.normal(size=N).astype(np.float32)
FACTOR = RNG.uniform(0.5, 2.0, N).astype(np.float32)


def _model(form: str) -> onnx.ModelProto:
    """y = consumer(x) where x is made by `form` from the input a [2, 3, K]."""
    inits = [numpy_helper.from_array(W, "w"), numpy_helper.from_array(BIAS, "bias")]
    nodes = {
        "matmul": [helper.make_node("MatMul", ["a", "w"], ["x"])],
        "matmul_bias": [helper.make_node("MatMul", ["a", "w"], ["p"]), helper.make_node("Add", ["bias", "p"], ["x"])],
        "shared_weight": [helper.make_node("MatMul", ["a", "w"], ["x"]), helper.make_node("MatMul", ["a", "w"], ["z"])],
        "read_twice": [helper.make_node("MatMul", ["a", "w"], ["x"]), helper.make_node("Neg", ["x"], ["z"])],
        "not_a_matmul": [helper.make_node("MatMul", ["a", "w"], ["p"]), helper.make_node("Relu", ["p"], ["x"])],
    }[form]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3, N])]
    if any("z" in n.output for n in nodes):
        outputs.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, [2, 3, N]))
    graph = helper.make_graph([*nodes, helper.make_node("Identity", ["x"], ["y"], name="consumer")], form,
                              [helper.make_tensor_value_info("a", TensorProto.FLOAT, [2, 3, K])], outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("form, folded", [("matmul", True), ("matmul_bias", True), ("shared_weight", False),
                                          ("read_twice", False), ("not_a_matmul", False)])
def test_folded_where_exact_else_a_mul(form, folded):
    a = RNG.normal(size=(2, 3, K)).astype(np.float32)
    proto = _model(form)
    want = ReferenceEvaluator(proto).run(None, {"a": a})
    model = ir.serde.deserialize_model(proto)
    consumer = next(n for n in model.graph if n.name == "consumer")
    consumer.replace_input_with(0, scaled_at_source(model.graph, consumer, consumer.inputs[0], FACTOR, "scaled"))
    out = ir.serde.serialize_model(model)
    onnx.checker.check_model(out)
    got = ReferenceEvaluator(out).run(None, {"a": a})
    assert any(n.op_type == "Mul" for n in out.graph.node) != folded
    np.testing.assert_allclose(got[0], want[0] * FACTOR, rtol=1e-5, atol=1e-6)
    for g, w in zip(got[1:], want[1:]):  # the value's other reader, or the weight's, sees what it saw
        np.testing.assert_allclose(g, w, rtol=1e-6)
