"""The export CLI on bad input the rewrite reads beside the model: config.json values out of bounds,
a genai context shorter than the default calibration window, a model ONNX Runtime cannot run."""

import json
import shutil

import onnx
import pytest

from turboquant import random_decoders
from turboquant.export import export

from .cli_helpers import run_main

MODEL = "llama-gqa-torchscript"


def _one_line(rc, err, *fragments):
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    for f in fragments:
        assert str(f) in err, err


def _copy(exported, folder):
    """The model alone in a folder of its own (no config.json beside it unless the test writes one)."""
    folder.mkdir()
    src = exported(MODEL)
    for f in src.parent.glob(src.name + "*"):  # the model and any external data file
        shutil.copy(f, folder / f.name)
    return folder / src.name


@pytest.mark.parametrize("value", [2**62, 2**24 + 1])
def test_max_position_embeddings_beyond_rotary_tables(exported, tmp_path, capsys, value):
    src = _copy(exported, tmp_path / "m")
    (src.parent / "config.json").write_text(json.dumps({"max_position_embeddings": value}))
    rc, err = run_main(capsys, src, "--preset", "turboquant_4bit_nc", "--no-offsets", "--dry-run", "--cache", "in-place")
    _one_line(rc, err, "config.json: max_position_embeddings", str(value), "--rotary-positions")


def test_a_model_onnx_runtime_cannot_run(exported, tmp_path, capsys):
    """The mask probe runs the model: ONNX Runtime's Fail on a weight cut short is one line."""
    src = _copy(exported, tmp_path / "m")
    m = onnx.load(src)
    big = max(m.graph.initializer, key=lambda t: len(t.raw_data))
    big.raw_data = big.raw_data[: len(big.raw_data) // 2]
    onnx.save(m, src)
    rc, err = run_main(capsys, src, "--preset", "turboquant_4bit_nc", "--no-offsets", "--dry-run")
    _one_line(rc, err, src)


def test_a_genai_context_shorter_than_the_window_sets_the_window(tmp_path):
    """genai_config.json's context_length of 512 (its rotary tables too): the default calibration window
    (1024 for Lloyd-Max keys) is cut to it, not failed on and --no-offsets advised."""
    pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai's builder makes the model")
    cfg = random_decoders.TinyConfig(family="llama", layers=6, hidden=128, heads=4, kv_heads=2, head_dim=32, seed=3,
                                     vocab=320, max_positions=512)
    src = random_decoders.export_genai(cfg, tmp_path / "genai")
    assert json.loads((src.parent / "genai_config.json").read_text())["model"]["context_length"] == 512
    result = export(src, "turboquant_4bit_nc", tmp_path / "tq" / "model.onnx", calibrate="random", progress=False)
    meta = {p.key: p.value for p in onnx.load(result.output, load_external_data=False).metadata_props}
    assert "in windows of 512" in meta["turboquant.calibration"], meta["turboquant.calibration"]
