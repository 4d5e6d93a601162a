"""export/subgraph.py: a piece of a graph evaluated on its own, refused where it reaches other inputs."""

import numpy as np
import onnx_ir as ir

from turboquant.export.subgraph import producer, run, subgraph


def _model():
    a = ir.Value(name="a", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([2]))
    b = ir.Value(name="b", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([2]))
    c = ir.Value(name="c", const_value=ir.tensor(np.array([3.0, 4.0], np.float32), name="c"))
    add = ir.node("Add", [a, b], name="add")
    mul = ir.node("Mul", [add.outputs[0], c], name="mul")
    add.outputs[0].name, mul.outputs[0].name = "s", "y"
    graph = ir.Graph([a, b], [mul.outputs[0]], nodes=[add, mul], initializers=[c], opset_imports={"": 17})
    return ir.Model(graph, ir_version=10), a, b, mul.outputs[0]


def test_evaluates_the_piece_between_the_given_inputs_and_constants():
    model, a, b, y = _model()
    sub = subgraph([y], [(a, ir.DataType.FLOAT), (b, ir.DataType.FLOAT)], dict(model.opset_imports))
    (got,) = run(sub, {"a": np.array([1, 2], np.float32), "b": np.array([5, 6], np.float32)})
    np.testing.assert_array_equal(got, [18.0, 32.0])
    assert producer(y, "Mul").name == "mul" and producer(y, "Add") is None


def test_refuses_a_piece_that_reads_another_input():
    model, a, _, y = _model()
    assert subgraph([y], [(a, ir.DataType.FLOAT)], dict(model.opset_imports)) is None
