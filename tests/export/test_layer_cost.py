"""--keep-layers auto: each layer's cost with its cache alone packed (export/layer_cost.py), and the
rewrite keeping the costliest, on exported and genai-built models."""

import dataclasses

import numpy as np
import onnx_ir as ir
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from turboquant import random_decoders
from turboquant.export import RewriteError, export
from turboquant.export import __main__ as cli
from turboquant.export.calibrate import collect
from turboquant.export.layer_cost import costliest, layer_costs, stored
from turboquant.export.plan import plan_layers

CFG = random_decoders.TinyConfig(family="qwen2", layers=5, hidden=256, heads=4, kv_heads=2, head_dim=64, seed=5, key_bias=2.0)


@pytest.fixture(scope="module")
def model(module_tmp):
    d = module_tmp.mktemp("layer-cost")
    src = random_decoders.export(CFG, d / "model.onnx", "torchscript")
    np.save(d / "ids.npy", np.random.default_rng(3).integers(0, CFG.vocab, 1024))
    return src, d / "ids.npy"


@settings(max_examples=25, deadline=None)
@given(st.sampled_from(["mse3", "mse4", "fp8", "uint3", "uint4"]), st.integers(0, 2**31 - 1))
def test_stored_undoes_offset_and_scale(fmt, seed):
    """The packed cache's view of x is the packer's view of (x - m) / s, mapped back: an offset and a
    scale move the quantization grid with the data, so the error scales with s."""
    rng = np.random.default_rng(seed)
    y = rng.standard_normal((1, 2, 9, 64)).astype(np.float32)
    m = rng.standard_normal((2, 64)).astype(np.float32) * 5
    s = np.exp(rng.uniform(-1.5, 1.5, (2, 64))).astype(np.float32)
    x = y * s[None, :, None] + m[None, :, None]
    got = stored(x, fmt, offset=m, scale=s, norm_correction=True)
    # the packer's input as float32 gives it ((x - m) / s, not y: a value at a rounding boundary of
    # the format would otherwise land on the next code)
    seen = (x - m[None, :, None]) / s[None, :, None]
    plain = stored(seen, fmt, offset=None, scale=None, norm_correction=True)
    np.testing.assert_allclose(got, plain * s[None, :, None] + m[None, :, None], rtol=1e-6, atol=1e-6 * np.abs(m).max())
    # in units of s, the error is the format's own on y (a value at a rounding boundary is half a step
    # from either code)
    own = np.abs(stored(y, fmt, offset=None, scale=None, norm_correction=True) - y).max()
    assert 0 < np.abs((got - x) / s[None, :, None]).max() <= own * 1.001


def _plans_and_calibration(src, ids):
    plans, _ = plan_layers(ir.load(src), "turboquant_k3v4_nc", keep_layers=[])
    plan_args = dict(preset="turboquant_k3v4_nc", boundary=2, skip_layers=None, keep_layers=[])
    return plans, collect(src, np.load(ids), [p.index for p in plans], str(ids), plan_args=plan_args, progress=False)


def test_a_lossless_layer_costs_nothing(model):
    src, ids = model
    plans, calibration = _plans_and_calibration(src, ids)
    plans[2] = dataclasses.replace(plans[2], key_format="raw16", value_format="raw16")  # fp16 rounding only
    costs = layer_costs(src, np.load(ids), calibration, plans, "turboquant_k3v4_nc", max_windows=2, steps=8)
    print({i: f"{c:.2e}" for i, c in costs.items()})
    assert costs[2] < 1e-6
    assert all(c > 100 * costs[2] for i, c in costs.items() if i != 2)


def test_keep_layers_auto_keeps_the_costliest(model, tmp_path):
    src, ids = model
    r = export(src, "turboquant_k3v4_nc", tmp_path / "auto.onnx", boundary=1, keep_layers="auto", calibrate=ids, progress=False)
    plans, calibration = _plans_and_calibration(src, ids)
    costs = layer_costs(src, np.load(ids), calibration, plans, "turboquant_k3v4_nc")
    assert r.kept == costliest(costs, 2) and len(r.kept) == 2
    note = next(n for n in r.notes if n.startswith("kept layers chosen by their measured cost"))
    assert all(f"{i} (" in note for i in r.kept)


def test_keep_layers_auto_refusals(model, tmp_path, capsys):
    src, ids = model
    with pytest.raises(RewriteError, match="--keep-layers auto and --no-offsets"):
        export(src, "turboquant_4bit_nc", tmp_path / "a.onnx", keep_layers="auto", offsets=False)
    with pytest.raises(RewriteError, match="keeps 2 x --boundary = 6 layers; the model has 5"):
        export(src, "turboquant_4bit_nc", tmp_path / "b.onnx", keep_layers="auto", boundary=3, calibrate=ids, progress=False)
    assert cli.main([str(src), "--preset", "turboquant_4bit_nc", "-o", str(tmp_path / "c.onnx"), "--keep-layers", "auto",
                     "--no-offsets"]) == 2
    assert "--keep-layers auto and --no-offsets" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        cli.main([str(src), "--preset", "turboquant_4bit_nc", "--keep-layers", "most"])
    assert e.value.code == 2
    assert not (tmp_path / "c.onnx").exists()


def test_keep_layers_auto_on_a_genai_model(tmp_path):
    pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is not installed (its builder makes these models)")
    cfg = dataclasses.replace(CFG, vocab=640, layers=6)
    src = random_decoders.export_genai(cfg, tmp_path / "genai")
    np.save(tmp_path / "ids.npy", np.random.default_rng(4).integers(0, cfg.vocab, 1024))
    r = export(src, "turboquant_4bit_nc", tmp_path / "tq" / "model.onnx", boundary=1, keep_layers="auto",
               calibrate=tmp_path / "ids.npy", progress=False)
    note = next(n for n in r.notes if n.startswith("kept layers chosen by their measured cost"))
    assert len(r.kept) == 2 and all(f"{i} (" in note for i in r.kept)
