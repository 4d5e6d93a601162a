"""export/rotary.py: the exporters' rotary embedding moved into the in-place form's attention ops,
verified against the exporter's own nodes."""

import json
import shutil

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from turboquant.export import RewriteError, export, rotary
from turboquant.export.forms import locate
from turboquant.export.plan import plan_layers
from turboquant.shared_buffer import SharedBufferDecoder

from .conftest import MODELS

PRESET = "turboquant_4bit_nc"


@pytest.mark.parametrize("name", ["llama-gqa-torchscript", "llama-gqa-dynamo", "llama-gqa-torchscript-fp16",
                                  "llama-gqa-optimum"])
def test_exporters_rotary_moves_into_the_ops(rewritten, name):
    """Every layer's attention op rotates Q and K itself from one pair of tables; no rotary node of
    the exporter's is left (the decode tests of test_in_place.py run these models)."""
    cfg, _ = MODELS[name]
    result = rewritten(name, PRESET, "in-place")
    assert all("rotary in the op" in p.form for p in result.layers)
    m = onnx.load(str(result.output))
    ops = [n.op_type for n in m.graph.node]
    assert not {"Sin", "Cos", "Neg", "RotaryEmbedding"} & set(ops)
    attention = [n for n in m.graph.node if n.op_type in ("TQGroupQueryAttention", "GroupQueryAttention")]
    assert len(attention) == cfg.layers
    for n in attention:
        assert {a.name: a.i for a in n.attribute}["do_rotary"] == 1
        assert list(n.input[7:9]) == ["tq_rotary_cos_cache", "tq_rotary_sin_cache"]
    tables = {t.name: t for t in m.graph.initializer if t.name.startswith("tq_rotary_")}
    assert sorted(tables) == ["tq_rotary_cos_cache", "tq_rotary_sin_cache"]
    # optimum writes config.json beside the model: its max_position_embeddings sizes the tables
    positions = cfg.max_positions if name.endswith("optimum") else rotary.DEFAULT_POSITIONS
    assert list(tables["tq_rotary_cos_cache"].dims) == [positions, cfg.head_dim // 2]
    meta = {p.key: p.value for p in m.metadata_props}
    assert meta["turboquant.rotary_positions"] == str(positions)
    assert not any(n.op_type == "Mul" and n.name.startswith("tq_query_scaled") for n in m.graph.node)  # key_scale inside


def test_rotary_outside_or_inside_the_ops_decodes_alike(exported, tmp_path):
    """--rotary-positions 0 keeps the exporter's rotary (and the key scales as Muls); the fused form
    gives the same prompt logits to float tolerance and the same tokens; its tables take the
    positions asked for, and the loop refuses buffers longer than them."""
    name = "llama-gqa-torchscript"
    cfg, _ = MODELS[name]
    kw = dict(calibrate="random", progress=False)
    inside = export(exported(name), PRESET, tmp_path / "in.onnx", rotary_positions=64, **kw)
    outside = export(exported(name), PRESET, tmp_path / "out.onnx", rotary_positions=0, **kw)
    def nodes(r):
        return onnx.load(str(r.output), load_external_data=False).graph.node

    assert "Sin" in [n.op_type for n in nodes(outside)] and "Sin" not in [n.op_type for n in nodes(inside)]
    scaled = [[n.name for n in nodes(r) if n.name.startswith("tq_query_scaled")] for r in (outside, inside)]
    assert scaled[0] and not scaled[1]  # the key scales: Muls beside the exporter's rotary, the op's input after its own
    assert any("rotary embedding inside the attention ops" in n and "64 positions" in n for n in inside.notes)
    ids = np.random.default_rng(cfg.seed + 2).integers(0, cfg.vocab, (2, 40))
    a = SharedBufferDecoder(outside.output, max_length=64).teacher_forced(ids, 16)
    b = SharedBufferDecoder(inside.output, max_length=64).teacher_forced(ids, 16)
    np.testing.assert_allclose(b[:, 0], a[:, 0], atol=1e-4 * max(1.0, float(np.abs(a[:, 0]).max())))
    assert float((a.argmax(-1) == b.argmax(-1)).mean()) >= 0.95
    with pytest.raises(ValueError, match="64 positions of the rotary tables"):
        SharedBufferDecoder(inside.output, max_length=65)
    with pytest.raises(RewriteError, match="rotary_positions"):
        export(exported(name), PRESET, tmp_path / "bad.onnx", rotary_positions=-1, **kw)


def test_positions_from_config_json(exported, tmp_path):
    src = tmp_path / "src" / "model.onnx"
    src.parent.mkdir()
    shutil.copy(exported("llama-gqa-torchscript"), src)
    assert rotary.positions_for(src) == rotary.DEFAULT_POSITIONS
    (src.parent / "config.json").write_text(json.dumps({"max_position_embeddings": 96}))
    assert rotary.positions_for(src) == 96
    r = export(src, PRESET, tmp_path / "tq.onnx", offsets=False, progress=False)
    meta = {p.key: p.value for p in onnx.load(str(r.output), load_external_data=False).metadata_props}
    assert meta["turboquant.rotary_positions"] == "96"


def test_verification_rejects_tables_that_are_not_the_exporters(exported):
    """The exporter's own cos/sin pass; the same tables a position off, or at another base, do not."""
    model = ir.load(exported("llama-gqa-torchscript"))
    plans, layers = plan_layers(model, PRESET, 1, None, None)
    site = locate(layers[plans[0].index])
    found = rotary.match(site.q, site.k_new)
    position_ids = next(v for v in model.graph.inputs if v.name == "position_ids")
    t = rotary.tables(model, found, position_ids, 64)
    assert t is not None and t.seq_axis == 2 and t.cos.shape == (64, MODELS["llama-gqa-torchscript"][0].head_dim // 2)
    dtype = layers[plans[0].index].past_key.dtype
    check = lambda tables: rotary.verified(model, found.q, site.q, tables, position_ids, plans[0].head_dim, dtype)  # noqa: E731
    assert check(t)
    shifted = rotary.RotaryTables(np.roll(t.cos, 1, axis=0), np.roll(t.sin, 1, axis=0), t.seq_axis)
    other_base = rotary.RotaryTables(t.cos ** 2, np.sqrt(np.clip(1 - t.cos ** 4, 0, 1)) * np.sign(t.sin), t.seq_axis)
    assert not check(shifted) and not check(other_base)


def test_rotary_positions_bounded(exported, tmp_path, capsys):
    """More than 2**24 positions: refused by the CLI's argument and by export(), nothing written (the
    table build failed and the rotary stayed outside the ops, under a misleading note)."""
    from turboquant.export.__main__ import main

    src = exported("llama-gqa-torchscript")
    with pytest.raises(SystemExit) as e:
        main([str(src), "--preset", PRESET, "-o", str(tmp_path / "o.onnx"), "--rotary-positions", "99999999999"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1].endswith("argument --rotary-positions: at most 16777216 (2**24) positions, not 99999999999 (--help for the options)")
    with pytest.raises(RewriteError, match="rotary_positions must be at most 16777216"):
        export(src, PRESET, tmp_path / "o.onnx", rotary_positions=2**24 + 1, offsets=False)
    assert list(tmp_path.iterdir()) == []


def test_table_failures_are_not_swallowed(exported, monkeypatch):
    """A subgraph ONNX Runtime cannot run alone leaves the exporter's rotary (None); tables too large
    for memory are a RewriteError that says so; anything else is raised as it is."""
    from onnxruntime.capi import onnxruntime_pybind11_state as ort_state

    model = ir.load(exported("llama-gqa-torchscript"))
    plans, layers = plan_layers(model, PRESET, 1, None, None)
    site = locate(layers[plans[0].index])
    found = rotary.match(site.q, site.k_new)
    position_ids = next(v for v in model.graph.inputs if v.name == "position_ids")

    def fails_with(error):
        def run(*a, **k):
            raise error

        monkeypatch.setattr(rotary, "run", run)
        return lambda: rotary.tables(model, found, position_ids, 64)

    assert fails_with(ort_state.Fail("cannot run alone"))() is None
    for error in (MemoryError(), ort_state.RuntimeException("Failed to allocate memory for requested buffer")):
        with pytest.raises(RewriteError, match="the rotary tables of 64 positions do not fit in memory"):
            fails_with(error)()
    with pytest.raises(ValueError, match="a bug"):
        fails_with(ValueError("a bug"))()
