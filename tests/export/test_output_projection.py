"""export/output_projection.py: a float16 export whose attention the exporter widened to float32 gets
its output projection back in float16, on the exporter's own weight values."""

import numpy as np
import onnx
import pytest

from turboquant import random_decoders
from turboquant.decoder import DecoderSession
from turboquant.export import export
from turboquant.shared_buffer import SharedBufferDecoder

PRESET = "turboquant_4bit_nc"


def test_a_widened_projection_runs_in_the_ops_type(tmp_path):
    """TorchScript's float16 export projects a float32 attention output with a float32 copy of o_proj's
    weight; the in-place rewrite feeds the op's float16 output to a float16 product of the same values
    (no float32 weight left of that shape) whose result is widened as before, and decodes as the
    original: the prompt's logits within float16's rounding, the teacher-forced tokens the same."""
    cfg = random_decoders.TinyConfig(family="llama", layers=3, hidden=128, heads=4, kv_heads=2, head_dim=32, vocab=256, seed=5)
    src = random_decoders.export(cfg, tmp_path / "m.onnx", "torchscript", "float16")
    original = onnx.load(str(src))
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in original.graph.initializer}
    o_proj = {n.name: inits[n.input[1]] for n in original.graph.node if n.op_type == "MatMul" and "o_proj" in n.name}
    assert len(o_proj) == cfg.layers and all(w.dtype == np.float32 for w in o_proj.values()), "the exporter's widened form"
    # windows of 256: the decode below is 24 tokens long, far from the default 1024's span
    r = export(src, PRESET, tmp_path / "tq.onnx", boundary=1, progress=False, calibration_window=256)
    m = onnx.load(str(r.output))
    got = {t.name: onnx.numpy_helper.to_array(t) for t in m.graph.initializer}
    ops = [n for n in m.graph.node if n.op_type in ("TQGroupQueryAttention", "GroupQueryAttention")]
    for i, op in enumerate(ops):
        users = [n for n in m.graph.node if op.output[0] in n.input]
        product = next(n for n in users if n.op_type == "MatMul")
        assert product.input[1] == f"tq_o_proj_weight_{i}" and got[product.input[1]].dtype == np.float16
        assert np.array_equal(got[product.input[1]], o_proj[f"/m/model/layers.{i}/self_attn/o_proj/MatMul"])
        cast = [n for n in m.graph.node if product.output[0] in n.input]
        assert [n.op_type for n in cast] == ["Cast"] and cast[0].attribute[0].i == onnx.TensorProto.FLOAT
    assert not any(w.dtype == np.float32 and w.shape == (cfg.hidden, cfg.hidden) for w in got.values())
    ids = np.random.default_rng(6).integers(0, cfg.vocab, (2, 24))
    want = DecoderSession(src).teacher_forced(ids, 8).astype(np.float32)
    have = SharedBufferDecoder(r.output, max_length=32).teacher_forced(ids, 8).astype(np.float32)
    np.testing.assert_allclose(have[:, 0], want[:, 0], atol=2e-2 * max(1.0, float(np.abs(want[:, 0]).max())))
    assert float((have.argmax(-1) == want.argmax(-1)).mean()) >= 0.9


@pytest.mark.parametrize("values", ["float32", "not float16"])
def test_projections_kept_where_narrowing_would_change_them(tmp_path, values):
    """An export in float32 has no widening Cast, so nothing narrows; a float16 export whose o_proj
    weight holds values float16 cannot (edited here) keeps its float32 product."""
    cfg = random_decoders.TinyConfig(family="llama", layers=3, hidden=128, heads=4, kv_heads=2, head_dim=32, vocab=256, seed=5)
    src = random_decoders.export(cfg, tmp_path / "m.onnx", "torchscript", "float32" if values == "float32" else "float16")
    if values == "not float16":
        m = onnx.load(str(src))
        names = {n.input[1] for n in m.graph.node if n.op_type == "MatMul" and "o_proj" in n.name}
        for t in m.graph.initializer:
            if t.name in names:
                w = onnx.numpy_helper.to_array(t) + np.float32(1e-7)  # between float16 values
                t.CopyFrom(onnx.numpy_helper.from_array(w, t.name))
        onnx.save(m, str(src))
    # windows of 256: the decode below is 24 tokens long, far from the default 1024's span
    r = export(src, PRESET, tmp_path / "tq.onnx", boundary=1, progress=False, calibration_window=256)
    m = onnx.load(str(r.output))
    assert not any(t.name.startswith("tq_o_proj_weight_") for t in m.graph.initializer)
