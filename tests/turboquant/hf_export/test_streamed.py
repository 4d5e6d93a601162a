"""turboquant.hf_export.streamed: one graph file and one data file, the weights read from the model itself."""

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import onnx_ir as ir  # noqa: E402

from turboquant import random_decoders  # noqa: E402
from turboquant.hf_export import streamed  # noqa: E402
from turboquant.decoder import DecoderSession  # noqa: E402
from turboquant.saving import OutputExists  # noqa: E402

CFG = random_decoders.TinyConfig(family="llama", layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, vocab=128)


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_weights_are_read_from_the_model_not_copied(tmp_path, exporter):
    """Before saving, every large initializer either shares the model's parameter memory or is a
    lazy tensor computed when written: the exporter holds no second copy of the weights."""
    model = random_decoders.build_model(CFG)
    graph = streamed._export_graph(model, tmp_path, exporter, "float32")
    streamed.fold_weight_transposes(graph)
    params = [p.detach().numpy() for p in model.parameters()]
    large = [v for v in graph.graph.initializers.values() if v.const_value.size >= 1024]
    assert len(large) >= 2 * CFG.layers  # the projections at least
    for v in large:
        t = v.const_value
        if isinstance(t, ir.LazyTensor):
            continue
        assert any(np.shares_memory(t.numpy(), p) for p in params), (v.name, type(t))
    transposes = [n for n in graph.graph if n.op_type == "Transpose" and n.inputs[0].is_initializer()]
    assert not transposes  # folded into lazy tensors


def test_one_data_file_and_the_model_unchanged(tmp_path):
    model = random_decoders.build_model(CFG)
    out = tmp_path / "out" / "model.onnx"
    streamed.export_to_files(model, out, "torchscript")
    assert sorted(p.name for p in out.parent.iterdir()) == ["model.onnx", "model.onnx.data"]  # no temporary folder left
    locations = {t.const_value.location for t in ir.load(out).graph.initializers.values()
                 if isinstance(t.const_value, ir.ExternalTensor)}
    assert locations == {"model.onnx.data"}
    ids = np.array([[3, 1, 4, 1, 5]])
    import torch

    with torch.no_grad():
        want = model(torch.from_numpy(ids)).logits.numpy()
    sess = DecoderSession(out)
    got, _ = sess.step(ids, sess.empty_cache(1), 0)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_fp16_model_has_fp16_caches(tmp_path):
    import onnx

    model = random_decoders.build_model(CFG)
    out = tmp_path / "model.onnx"
    streamed.export_to_files(model, out, "torchscript", "float16")
    m = onnx.load(out, load_external_data=False)
    cache = [i for i in list(m.graph.input) + list(m.graph.output) if i.name.startswith(("past_key_values.", "present."))]
    assert len(cache) == 4 * CFG.layers
    assert {i.type.tensor_type.elem_type for i in cache} == {onnx.TensorProto.FLOAT16}
    sess = DecoderSession(out)
    ids = np.array([[3, 1, 4, 1, 5]])
    got, _ = sess.step(ids, sess.empty_cache(1), 0)
    import torch

    with torch.no_grad():
        want = model.float()(torch.from_numpy(ids)).logits.numpy()
    np.testing.assert_allclose(got.astype(np.float32), want, rtol=0.05, atol=0.05)


def test_existing_files_refused(tmp_path):
    model = random_decoders.build_model(CFG)
    out = tmp_path / "model.onnx"
    (tmp_path / "model.onnx.data").write_bytes(b"someone's data")
    with pytest.raises(OutputExists, match="model.onnx.data exists"):
        streamed.export_to_files(model, out, "torchscript")
    assert (tmp_path / "model.onnx.data").read_bytes() == b"someone's data"
    assert not out.exists()
