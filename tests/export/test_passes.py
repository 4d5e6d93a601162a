"""The rewrite as an onnx-ir pass (export/passes.py): in a PassManager, its preconditions checked
before anything changes."""

import numpy as np
import onnx_ir as ir
import pytest

from turboquant.decode_loop import open_decoder
from turboquant.decoder import DecoderSession
from turboquant.export import RewriteError, RewritePreconditionError, TurboQuantRewrite


@pytest.mark.parametrize("cache", ["concat", "in-place"])
def test_pass_in_a_pass_manager(exported, tmp_path, cache):
    src = exported("llama-gqa-dynamo")
    model = ir.load(src)
    rewrite = TurboQuantRewrite("turboquant_k8v4", cache=cache)
    result = ir.passes.PassManager([rewrite, ir.passes.common.RemoveUnusedNodesPass()])(model)
    assert result.modified and rewrite.result.compressed == [2, 3]
    ops = {n.op_type for n in model.graph}
    assert ("TQGroupQueryAttention" if cache == "in-place" else "TQAttention") in ops
    ir.save(model, tmp_path / "tq.onnx")
    ids = np.random.default_rng(0).integers(0, 512, (1, 10))
    a = DecoderSession(src).teacher_forced(ids, 6)
    b = open_decoder(tmp_path / "tq.onnx", 16).teacher_forced(ids, 6)
    np.testing.assert_allclose(b[:, 0], a[:, 0], atol=1e-3 * float(np.abs(a).max()))


def test_preconditions_refuse_before_any_change(exported):
    model = ir.load(exported("llama-gqa-torchscript"))
    nodes = len(model.graph)
    with pytest.raises(RewritePreconditionError, match="unknown preset") as e:
        TurboQuantRewrite("turboquant_9bit")(model)
    assert isinstance(e.value, ir.passes.PreconditionError) and isinstance(e.value, RewriteError)
    merged = ir.load(exported("llama-gqa-torchscript-merged"))
    with pytest.raises(RewritePreconditionError, match="merged"):
        TurboQuantRewrite("turboquant_4bit_nc", cache="in-place")(merged)
    for v in [v for v in model.graph.inputs if v.name.startswith("past_key_values")]:
        v.name = v.name.replace("past_key_values", "state")
    with pytest.raises(RewritePreconditionError, match="found no KV cache"):
        TurboQuantRewrite("turboquant_4bit_nc")(model)
    assert len(model.graph) == nodes
