"""The rewritten onnxruntime-genai folder is checked before it is published (export/genai_check.py),
and genai_config.json agrees with the per-layer cache widths whatever its sliding_window section
says: the Mistral-7B-v0.1-style build (a 4096-token window in genai_config.json) that genai could
not run after the rewrite."""

import json
import shutil
from unittest import mock

import numpy as np
import onnx
import pytest

from turboquant import random_decoders
from turboquant.export import RewriteError, export
from turboquant.export import genai as genai_folder
from turboquant.export import genai_check

pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is not installed (its builder makes these models)")

WINDOWED = random_decoders.TinyConfig(family="mistral", layers=4, hidden=256, heads=4, kv_heads=2, head_dim=64, seed=3,
                                      vocab=640, window=4096, max_positions=8192)


@pytest.fixture(scope="module")
def windowed(module_tmp):
    return random_decoders.export_genai(WINDOWED, module_tmp.mktemp("mistral-window"))


def _rewrite(src, out, **kw):
    return export(src, "turboquant_4bit_nc", out, boundary=1, calibrate="random", progress=False, **kw)


def _generate(folder, steps=8):
    import onnxruntime_genai as og

    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=16 + steps, do_sample=False)
    gen = og.Generator(model, params)
    gen.append_tokens(np.random.default_rng(0).integers(3, 640, (1, 16)).astype(np.int32))
    while not gen.is_done():
        gen.generate_next_token()
    return gen.get_sequence(0)[16:].tolist()


def test_sliding_window_section_no_longer_breaks_the_folder(windowed, tmp_path):
    """The source's config has the section; the rewrite (per-layer widths) drops it, says so, and
    genai runs the folder, which the rewrite checked before publishing it."""
    assert json.loads((windowed.parent / "genai_config.json").read_text())["model"]["decoder"]["sliding_window"]
    result = _rewrite(windowed, tmp_path / "out" / "model.onnx")
    decoder = json.loads((tmp_path / "out" / "genai_config.json").read_text())["model"]["decoder"]
    assert "sliding_window" not in decoder and decoder["head_size"] == 128
    summary = result.summary()
    assert "its sliding_window section (window_size 4096) dropped" in summary
    assert "checked: onnxruntime-genai loaded the folder and generated 4 tokens" in summary
    assert len(_generate(tmp_path / "out")) == 8


def test_a_folder_genai_cannot_run_is_not_written(windowed, tmp_path):
    """With the section kept (the bug), the config check refuses the folder; with that check off too,
    genai's own run does; either way nothing is published and the CLI's status is 2."""
    from turboquant.export.__main__ import main

    out = tmp_path / "out" / "model.onnx"
    with mock.patch.object(genai_folder, "drop_sliding_window_section", return_value=None):
        with pytest.raises(RewriteError, match="would not run, so it is not written: a sliding_window section"):
            _rewrite(windowed, out)
        assert not out.parent.exists()
        with mock.patch.object(genai_check, "config_problems", return_value=[]):
            with pytest.raises(RewriteError, match="onnxruntime-genai could not run the rewritten folder.*present.0.key"):
                _rewrite(windowed, out)
            assert main([str(windowed), "--preset", "turboquant_4bit_nc", "--calibrate", "random", "--boundary", "1",
                         "-o", str(out), "--no-progress"]) == 2
    assert not out.parent.exists()


def test_checked_without_genai(windowed, tmp_path):
    """Without genai installed the check is the config's agreement with the model and ONNX Runtime's
    run over genai-shaped buffers; the summary says which check ran."""
    with mock.patch.object(genai_check, "genai_installed", return_value=False):
        result = _rewrite(windowed, tmp_path / "out" / "model.onnx")
        assert "checked without onnxruntime-genai (not installed)" in result.summary()
        with mock.patch.object(genai_check, "run_with_onnxruntime", return_value="RuntimeError: boom"):
            with pytest.raises(RewriteError, match="ONNX Runtime could not run .* boom"):
                _rewrite(windowed, tmp_path / "out2" / "model.onnx")
    assert not (tmp_path / "out2").exists()


def test_left_layers_in_a_genai_folder_are_refused(windowed, tmp_path):
    """A layer left as GroupQueryAttention keeps a float cache, which genai (one cache dtype for
    every layer) cannot allocate beside uint8 ones: refused before the calibration, naming the layer
    and the feature; the same model file without its genai_config.json is rewritten for ONNX Runtime."""
    m = onnx.load(windowed)
    node = [n for n in m.graph.node if n.op_type == "GroupQueryAttention"][2]
    node.output.append("qk_2")  # its QK output (qk_output = 1) used: a graph output
    node.attribute.append(onnx.helper.make_attribute("qk_output", 1))
    m.graph.output.append(onnx.helper.make_tensor_value_info("qk_2", onnx.TensorProto.FLOAT, None))
    (tmp_path / "src").mkdir()
    onnx.save(m, tmp_path / "src" / "model.onnx", save_as_external_data=True, location="model.onnx.data")
    shutil.copytree(tmp_path / "src", tmp_path / "plain")  # the same model file, without genai_config.json
    (tmp_path / "src" / "genai_config.json").write_text((windowed.parent / "genai_config.json").read_text())
    with pytest.raises(RewriteError, match=r"layers 2 use the QK output, .*one dtype, so the folder could not run"):
        _rewrite(tmp_path / "src" / "model.onnx", tmp_path / "out" / "model.onnx", unsupported="leave")
    assert not (tmp_path / "out").exists()
    result = _rewrite(tmp_path / "plain" / "model.onnx", tmp_path / "out2" / "model.onnx", unsupported="leave")
    assert result.left == [2] and result.compressed == [1]
