"""Calibrated key offsets (--calibrate): computed from the original model, fed to TQAttention."""

import json

import numpy as np
import onnx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from turboquant import random_decoders
from turboquant.decoder import DecoderSession
from turboquant.eval.metrics import mean_kl
from turboquant.export import RewriteError, export
from turboquant.shared_buffer import SharedBufferDecoder


@pytest.fixture(scope="module")
def biased_model(module_tmp):
    """Qwen2-style keys with a large fixed per-channel component (k_proj biases), as real LLMs have."""
    cfg = random_decoders.TinyConfig(family="qwen2", layers=5, hidden=256, heads=4, kv_heads=2, head_dim=64, seed=11, key_bias=2.0)
    d = module_tmp.mktemp("calib")
    return cfg, random_decoders.export(cfg, d / "biased.onnx", "torchscript"), d


def test_offsets_cut_the_error_of_biased_keys(biased_model):
    cfg, src, d = biased_model
    rng = np.random.default_rng(0)
    np.save(d / "calib.npy", rng.integers(0, cfg.vocab, 1024))
    plain = export(src, "turboquant_k3v4_nc", d / "plain.onnx", boundary=1, cache="concat", offsets=False)
    # windows of 256, near the held-out sequences' 44 positions: offsets are means over the window's positions
    calibrated = export(src, "turboquant_k3v4_nc", d / "calibrated.onnx", boundary=1, cache="concat", calibrate=d / "calib.npy",
                        key_scales=False, calibration_window=256)
    ids = np.random.default_rng(99).integers(0, cfg.vocab, (2, 44))  # held apart from the calibration tokens
    ref = DecoderSession(src).teacher_forced(ids, 12)[:, 1:]
    kl_plain = mean_kl(ref, DecoderSession(plain.output).teacher_forced(ids, 12)[:, 1:])
    kl_cal = mean_kl(ref, DecoderSession(calibrated.output).teacher_forced(ids, 12)[:, 1:])
    print(f"k3v4_nc mean KL: {kl_plain:.4f} without offsets, {kl_cal:.4f} with calibrated key offsets")
    assert kl_cal < 0.7 * kl_plain

    out = onnx.load(str(calibrated.output))
    meta = {p.key: p.value for p in out.metadata_props}
    assert meta["turboquant.offsets"] == "keys" and "calib.npy" in meta["turboquant.calibration"]
    assert meta["turboquant.key_scales"] == "no"
    assert "1024 tokens" in meta["turboquant.calibration"]
    inits = {i.name for i in out.graph.initializer}
    assert {f"tq_key_offset_{i}" for i in calibrated.compressed} <= inits
    assert json.loads(meta["turboquant.layers"])[0]["compressed"] is False


def test_value_offsets_and_refusals(biased_model, tmp_path):
    cfg, src, d = biased_model
    np.save(tmp_path / "ids.npy", np.arange(300) % cfg.vocab)
    r = export(src, "turboquant_4bit_nc", tmp_path / "kv.onnx", boundary=1, cache="concat", calibrate=tmp_path / "ids.npy", value_offsets=True)
    out = onnx.load(str(r.output))
    assert {f"tq_value_offset_{i}" for i in r.compressed} <= {i.name for i in out.graph.initializer}
    logits = DecoderSession(r.output).teacher_forced(np.array([[1, 2, 3, 4, 5, 6]]), 3)
    assert np.isfinite(logits).all()
    (tmp_path / "t.txt").write_text("some text")
    with pytest.raises(RewriteError, match="give --tokenizer DIR"):
        export(src, "turboquant_4bit_nc", tmp_path / "x.onnx", calibrate=tmp_path / "t.txt")
    np.save(tmp_path / "f.npy", np.zeros(10, np.float32))
    with pytest.raises(RewriteError, match="expected integer token ids"):
        export(src, "turboquant_4bit_nc", tmp_path / "x.onnx", calibrate=tmp_path / "f.npy")


def test_key_scales_leave_scores_unchanged(biased_model, tmp_path):
    """Queries times s, keys over s: the prefill (whose new tokens attend exactly) is the original's."""
    cfg, src, d = biased_model
    r = export(src, "turboquant_k3v4_nc", tmp_path / "scaled.onnx", boundary=1, cache="concat", calibrate=d / "calib.npy")
    meta = {p.key: p.value for p in onnx.load(str(r.output)).metadata_props}
    assert meta["turboquant.key_scales"] == "yes"
    nodes = {n.name for n in onnx.load(str(r.output)).graph.node}
    assert {f"tq_query_scaled_{i}" for i in r.compressed} <= nodes and {f"tq_key_scaled_{i}" for i in r.compressed} <= nodes
    ids = np.random.default_rng(5).integers(0, cfg.vocab, (1, 20))
    want = DecoderSession(src).teacher_forced(ids, 20)[:, 0]
    got = DecoderSession(r.output).teacher_forced(ids, 20)[:, 0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_fp8_key_scales_put_each_channels_extreme_key_on_64(biased_model, tmp_path):
    """k8v4 calibrated: per channel, s = the largest |k - offset| of the calibration's keys / 64 (the
    present keys of one window, read here from the original model), queries times s and keys over
    s before the op, and the prefill (exact new tokens) still the original's."""
    from turboquant.export.calibrate import collect, fp8_key_scale

    cfg, src, d = biased_model
    np.testing.assert_array_equal(fp8_key_scale(np.array([128.0, 64.0, 0.0, 1e9, 1e-9])),
                                  np.array([2.0, 1.0, 1.0, 4096.0, 1 / 4096], np.float32))
    ids = np.random.default_rng(4).integers(0, cfg.vocab, 256)  # one window
    plan = dict(preset="turboquant_k8v4", boundary=1, skip_layers=None, keep_layers=None)
    cal = collect(src, ids, [1, 2, 3], "ids", plan_args=plan, progress=False)
    sess = DecoderSession(src)
    outs = sess.run_all(ids[None], sess.empty_cache(1), 0)
    for i in (1, 2, 3):
        k = np.asarray(outs[sess.cache_outputs[(i, "key")]], np.float64)[0]  # [Hkv, S, D]
        off = k.mean(1)
        np.testing.assert_allclose(cal.keys[i], off, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(cal.key_scales[i], np.abs(k - off[:, None]).max(1) / 64, rtol=1e-5)

    np.save(tmp_path / "ids.npy", ids)
    held_out = np.random.default_rng(5).integers(0, cfg.vocab, (1, 20))
    want = DecoderSession(src).teacher_forced(held_out, 20)[:, 0]
    for cache, loop in (("concat", DecoderSession), ("in-place", lambda m: SharedBufferDecoder(m, 32))):
        r = export(src, "turboquant_k8v4", tmp_path / cache / "m.onnx", boundary=1, cache=cache, calibrate=tmp_path / "ids.npy")
        out = onnx.load(str(r.output))
        assert {p.key: p.value for p in out.metadata_props}["turboquant.key_scales"] == "yes"
        nodes = {n.name for n in out.graph.node}
        if cache == "concat":
            assert {f"tq_query_scaled_{i}" for i in r.compressed} <= nodes and {f"tq_key_scaled_{i}" for i in r.compressed} <= nodes
        else:  # the rotary inside the op (export/rotary.py), which scales after it: its key_scale input
            inits = {t.name: onnx.numpy_helper.to_array(t) for t in out.graph.initializer}
            for i in r.compressed:
                np.testing.assert_allclose(inits[f"tq_key_scale_{i}"], cal.key_scales[i], rtol=1e-6)
        np.testing.assert_allclose(loop(r.output).teacher_forced(held_out, 20)[:, 0], want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("preset", ["turboquant_4bit_nc", "turboquant_k8v4"])
def test_data_free_calibration_is_the_default(biased_model, tmp_path, preset):
    cfg, src, d = biased_model
    meta = lambda r: {p.key: p.value for p in onnx.load(str(r.output)).metadata_props}  # noqa: E731
    default = meta(export(src, preset, tmp_path / "a.onnx", boundary=1))
    assert default["turboquant.calibration"].startswith("data-free (self-generated: 16 continuations, sampled")
    window = 256 if preset == "turboquant_k8v4" else 1024  # fp8 keys' default, Lloyd-Max keys'
    assert default["turboquant.calibration"].endswith(f", 4096 tokens in windows of {window}")
    assert default["turboquant.key_scales"] == "yes"
    none = {"turboquant.offsets": "none", "turboquant.key_scales": "no", "turboquant.calibration": "none"}
    m = meta(export(src, preset, tmp_path / "b.onnx", boundary=1, offsets=False))
    assert {k: m.get(k) for k in none} == none  # said, not left out
    with pytest.raises(RewriteError, match="contradict"):
        export(src, "turboquant_4bit_nc", tmp_path / "x.onnx", calibrate=d / "calib.npy", offsets=False)


def test_calibration_reads_a_models_external_data_in_place(biased_model, tmp_path, monkeypatch):
    """The query probe runs from memory with its weights read from the model's own data file (no copy
    is written), from any working folder: the same offsets and scales as from embedded weights."""
    import onnx_ir as ir

    from turboquant.export.calibrate import collect

    cfg, src, _ = biased_model
    ext = tmp_path / "ext" / "model.onnx"
    ext.parent.mkdir()
    ir.save(ir.load(src), ext, external_data="model.onnx.data", size_threshold_bytes=0)
    monkeypatch.chdir(tmp_path)  # relative data locations must not resolve against the working folder
    ids = np.random.default_rng(3).integers(0, cfg.vocab, 512)
    args = dict(preset="turboquant_4bit_nc", boundary=1, skip_layers=None, keep_layers=None)
    a = collect(src, ids, [1, 2], "ids", plan_args=args, progress=False)
    b = collect(ext, ids, [1, 2], "ids", plan_args=args, progress=False)
    assert (ext.parent / "model.onnx.data").stat().st_size > 10**5 and sorted(p.name for p in ext.parent.iterdir()) == [
        "model.onnx", "model.onnx.data"]
    for i in (1, 2):
        np.testing.assert_allclose(a.keys[i], b.keys[i], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(a.key_scales[i], b.key_scales[i], rtol=1e-5)


@given(size=st.integers(2, 20000), window=st.integers(2, 512), most=st.integers(1, 64))
def test_calibration_windows_spread_over_the_whole_text(size, window, most):
    """Whole windows that do not overlap, as many as the text holds up to the most asked for, the
    first at the text's start and, when the text holds more, the last in its final stretch."""
    from turboquant.export.calibrate import windows

    _, w, starts = windows(np.arange(size), window, most)
    held = size // w
    assert w == min(window, size)
    assert len(starts) == min(held, most)
    assert starts[0] == 0 and all(s % w == 0 for s in starts)
    assert all(b - a >= w for a, b in zip(starts, starts[1:]))
    assert starts[-1] + w <= size
    if held > 1 and len(starts) > 1:
        assert starts[-1] == (held - 1) * w
