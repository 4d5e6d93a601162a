"""export/packed_qkv.py: the exporter's three projections as one product feeding the in-place op's
packed input, checked against the exporter's own nodes."""

import numpy as np
import onnx
import pytest

from turboquant import random_decoders
from turboquant.export import export
from turboquant.shared_buffer import SharedBufferDecoder

from .conftest import MODELS

PRESET = "turboquant_4bit_nc"


def _weights(path) -> dict:
    m = onnx.load(str(path))
    return {t.name: onnx.numpy_helper.to_array(t) for t in m.graph.initializer}, m


@pytest.mark.parametrize("family, external", [("llama", False), ("qwen2", False), ("llama", True)])
def test_projections_packed_and_decoding_as_before(tmp_path, family, external):
    """TorchScript exports, Llama's (no biases) and Qwen2's (q/k/v biases), the weights in the model
    file or in external data files (as large models have them): every layer's op takes
    [B, S, (Hq + 2 Hkv) D] from one product whose weight is the exporter's three side by side, no
    other projection of Q, K or V is left, and the logits are those of the rewrite that keeps the
    exporter's nodes (--rotary-positions 0)."""
    cfg = random_decoders.TinyConfig(family=family, layers=4, hidden=128, heads=4, kv_heads=2, head_dim=32, vocab=256,
                                     key_bias=0.5 if family == "qwen2" else 0.0, seed=11)
    src = random_decoders.export(cfg, tmp_path / "m.onnx", "torchscript")
    if external:
        onnx.save_model(onnx.load(str(src)), str(tmp_path / "x.onnx"), save_as_external_data=True,
                        all_tensors_to_one_file=False, size_threshold=1024)
        src = tmp_path / "x.onnx"
    kw = dict(boundary=1, calibrate="random", progress=False)
    fused = export(src, PRESET, tmp_path / "fused.onnx", **kw)
    kept = export(src, PRESET, tmp_path / "kept.onnx", rotary_positions=0, **kw)
    assert all("rotary in the op, Q, K and V packed" in p.form for p in fused.layers)
    assert not any("packed" in p.form for p in kept.layers)
    inits, m = _weights(fused.output)
    orig, om = _weights(src)
    attention = [n for n in m.graph.node if n.op_type in ("TQGroupQueryAttention", "GroupQueryAttention")]
    assert len(attention) == cfg.layers and all(n.input[1] == "" and n.input[2] == "" for n in attention)
    matmuls = [n for n in m.graph.node if n.op_type == "MatMul"]
    assert len(matmuls) == 5 * cfg.layers + 1  # per layer QKV, O, gate, up, down; the LM head
    for i in range(cfg.layers):
        w = inits[f"tq_qkv_weight_{i}"]
        assert w.shape == (cfg.hidden, (cfg.heads + 2 * cfg.kv_heads) * cfg.head_dim)
        proj = {n.name: n for n in om.graph.node if n.op_type == "MatMul"}
        originals = [orig[proj[f"/m/model/layers.{i}/self_attn/{x}_proj/MatMul"].input[1]] for x in "qkv"]
        assert np.array_equal(w, np.concatenate(originals, axis=1))
        assert (f"tq_qkv_bias_{i}" in inits) == (family == "qwen2")
    ids = np.random.default_rng(3).integers(0, cfg.vocab, (2, 30))
    a = SharedBufferDecoder(kept.output, max_length=48).teacher_forced(ids, 10)
    b = SharedBufferDecoder(fused.output, max_length=48).teacher_forced(ids, 10)
    np.testing.assert_allclose(b[:, 0], a[:, 0], atol=1e-4 * max(1.0, float(np.abs(a[:, 0]).max())))
    assert float((a.argmax(-1) == b.argmax(-1)).mean()) >= 0.95


def test_dynamo_exports_keep_their_projections(rewritten):
    """torch.onnx dynamo's reshapes read the shapes of graph inputs (input_ids, the past), which the
    check on h alone cannot evaluate: the three products stay (the rotary still moves)."""
    r = rewritten("llama-gqa-dynamo", PRESET, "in-place")
    assert all("rotary in the op" in p.form and "packed" not in p.form for p in r.layers)
    assert MODELS["llama-gqa-dynamo"][0].layers == len(r.layers)
