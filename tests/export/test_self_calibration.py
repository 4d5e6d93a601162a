"""Data-free calibration on text the model writes itself (--calibrate self)."""

import numpy as np
import onnx
import pytest

from turboquant import random_decoders
from turboquant.decoder import DecoderSession
from turboquant.export import RewriteError, export
from turboquant.export import __main__ as cli
from turboquant.export.self_text import self_generated_tokens


@pytest.fixture(scope="module")
def tiny(module_tmp):
    cfg = random_decoders.TinyConfig(family="qwen2", layers=4, hidden=128, heads=4, kv_heads=2, head_dim=32, seed=5, key_bias=2.0)
    return cfg, random_decoders.export(cfg, module_tmp.mktemp("self") / "tiny.onnx", "torchscript")


def _meta(path):
    return {p.key: p.value for p in onnx.load(str(path), load_external_data=False).metadata_props}


def test_greedy_tokens_are_the_models_continuations(tiny):
    cfg, src = tiny
    ids, source = self_generated_tokens(src, cfg.vocab, sequences=3, window=20, prompt=4, temperature=0, seed=1)
    rows = ids.reshape(3, 20)
    assert ids.shape == (60,) and ((0 <= ids) & (ids < cfg.vocab)).all()
    np.testing.assert_array_equal(rows[:, 4:], DecoderSession(src).generate(rows[:, :4], 16))
    assert "greedy" in source and "seed 1" in source


def test_sampling_is_fixed_by_the_seed(tiny):
    cfg, src = tiny
    a, source = self_generated_tokens(src, cfg.vocab, sequences=2, window=24, seed=7)
    b, _ = self_generated_tokens(src, cfg.vocab, sequences=2, window=24, seed=7)
    c, _ = self_generated_tokens(src, cfg.vocab, sequences=2, window=24, seed=8)
    np.testing.assert_array_equal(a, b)
    assert (a != c).any() and "sampled at temperature 1" in source
    greedy, _ = self_generated_tokens(src, cfg.vocab, sequences=2, window=24, seed=7, temperature=0)
    assert (a.reshape(2, 24)[:, 4:] != greedy.reshape(2, 24)[:, 4:]).any()  # same prompts, sampled away from greedy


def test_the_rewrite_records_it(tiny, tmp_path):
    cfg, src = tiny
    r = export(src, "turboquant_4bit_nc", tmp_path / "self.onnx", boundary=1, calibrate="self", progress=False)
    meta = _meta(r.output)
    assert meta["turboquant.calibration"].startswith("data-free (self-generated: 16 continuations, sampled")
    assert meta["turboquant.calibration"].endswith(", 4096 tokens in windows of 1024") and meta["turboquant.key_scales"] == "yes"
    rnd = _meta(export(src, "turboquant_4bit_nc", tmp_path / "random.onnx", boundary=1, calibrate="random",
                       progress=False).output)
    assert rnd["turboquant.calibration"].startswith("data-free (random token ids, seed 0)")
    k8 = _meta(export(src, "turboquant_k8v4", tmp_path / "k8.onnx", boundary=1, calibrate="self", progress=False).output)
    assert "self-generated" in k8["turboquant.calibration"] and k8["turboquant.offsets"] == "keys"  # asked for: calibrated
    assert k8["turboquant.calibration"].endswith(", 4096 tokens in windows of 256")  # fp8 keys' default window


def test_the_calibration_window_sets_the_windows(tiny, tmp_path):
    """4096 tokens in all: the 16 self-written sequences of 256 tokens whatever the window (here 64
    windows of 64), or 2 windows of 2048 random ids."""
    cfg, src = tiny
    short = _meta(export(src, "turboquant_4bit_nc", tmp_path / "w64.onnx", boundary=1, calibrate="self",
                         calibration_window=64, progress=False).output)["turboquant.calibration"]
    assert short.startswith("data-free (self-generated: 16 continuations") and short.endswith(", 4096 tokens in windows of 64")
    long = _meta(export(src, "turboquant_4bit_nc", tmp_path / "w2k.onnx", boundary=1, calibrate="random",
                        calibration_window=2048, progress=False).output)["turboquant.calibration"]
    assert long.endswith(", 4096 tokens in windows of 2048")
    for window in (2048, 1024):  # the preset's default window too, when given
        with pytest.raises(RewriteError, match="--calibration-window and --no-offsets contradict"):
            export(src, "turboquant_4bit_nc", tmp_path / "bad.onnx", calibration_window=window, offsets=False)
    for bad in (8, 100000, 256.0, True):
        with pytest.raises(RewriteError, match="calibration window must be an integer from 16 to 65536"):
            export(src, "turboquant_4bit_nc", tmp_path / "bad.onnx", calibration_window=bad)
    assert not (tmp_path / "bad.onnx").exists()


def test_the_default_window_stays_within_the_models_positions(tmp_path):
    """A model whose config.json gives fewer positions than the preset's default window calibrates in
    windows of that many tokens, not past them."""
    cfg = random_decoders.TinyConfig(family="llama", layers=2, hidden=64, heads=2, kv_heads=1, head_dim=32, max_positions=320)
    src = random_decoders.export(cfg, tmp_path / "model.onnx", "torchscript")
    (tmp_path / "config.json").write_text('{"max_position_embeddings": 320}')  # as a Hugging Face folder has it
    meta = _meta(export(src, "turboquant_4bit_nc", tmp_path / "tq.onnx", boundary=0, calibrate="random", progress=False).output)
    assert meta["turboquant.calibration"].endswith("tokens in windows of 320")


@pytest.mark.parametrize("kw, match", [
    (dict(sequences=0), "sequences must be an integer of at least 1"),
    (dict(window=1), "window must be an integer of at least 2"),
    (dict(prompt=8, window=8), "must be shorter than the window"),
    (dict(temperature=-1.0), "temperature must be a number of 0"),
    (dict(temperature=float("nan")), "temperature must be a number of 0"),
    (dict(sequences=True), "sequences must be an integer"),
])
def test_bad_options_are_refused(tiny, kw, match):
    cfg, src = tiny
    with pytest.raises(RewriteError, match=match):
        self_generated_tokens(src, cfg.vocab, **kw)


def test_unknown_vocabulary_is_said(tiny):
    _, src = tiny
    assert self_generated_tokens(src, None) == (None, "none (the vocabulary size is not in the model)")


def test_cli(tiny, tmp_path, capsys):
    cfg, src = tiny
    out = tmp_path / "cli.onnx"
    assert cli.main([str(src), "--preset", "turboquant_k3v4_nc", "-o", str(out), "--boundary", "1", "--calibrate", "self", "--no-progress"]) == 0
    assert "self-generated" in _meta(out)["turboquant.calibration"]
    assert _meta(out)["turboquant.calibration"].endswith("windows of 1024")  # Lloyd-Max keys' default window
    capsys.readouterr()
    for extra, message in ((["--tokenizer", str(tmp_path)], "--tokenizer is for a text --calibrate file"),
                           (["--no-offsets"], "contradict"),
                           (["--calibration-window", "8"], "calibration window must be an integer from 16")):
        assert cli.main([str(src), "--preset", "turboquant_4bit_nc", "-o", str(tmp_path / "x.onnx"), "--calibrate", "self",
                         *extra]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "x.onnx").exists()
