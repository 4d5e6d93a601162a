"""The CLI: text and JSON output, sensitivity mode, clear errors."""

import dataclasses
import json

import numpy as np
import onnxruntime as ort
import pytest

from turboquant.eval.__main__ import main

from .conftest import CFG


def test_cli_json_and_table(tiny, tmp_path, capsys):
    src, dst, text = tiny
    out = tmp_path / "r.json"
    assert main([str(src), str(src), str(dst), "--text", str(text), "--context", "64", "--prefill", "32",
                 "--max-tokens", "64", "--json", str(out), "--no-progress"]) == 0
    table = capsys.readouterr().out
    assert "original perplexity" in table and "tiny.3bit_nc.onnx" in table
    doc = json.loads(out.read_text())
    same, rewritten = doc["results"]
    assert doc["scored_tokens"] == 64 and same["mean_kl"] == 0.0 and same["ppl"] == doc["ppl_original"]
    assert rewritten["mean_kl"] > 0


@pytest.mark.parametrize("mode", ["only", "all-but-one"])
def test_sensitivity_mode(tiny, tmp_path, mode, capsys, monkeypatch):
    """One row per layer examined; the rewrites' calibration text written once, not once per layer."""
    from turboquant.export import self_text

    written = []
    real = self_text.self_generated_tokens
    monkeypatch.setattr(self_text, "self_generated_tokens", lambda *a, **k: written.append(1) or real(*a, **k))
    src, _, text = tiny
    out = tmp_path / "s.json"
    layers = (0, 1, 2) if mode == "only" else (1, 2)
    assert main([str(src), "--text", str(text), "--context", "48", "--prefill", "24", "--max-tokens", "24",
                 "--sensitivity", "turboquant_3bit_nc", "--sensitivity-mode", mode, "--layers", ",".join(map(str, layers)),
                 "--boundary", "1", "--json", str(out), "--no-progress"]) == 0
    doc = json.loads(out.read_text())
    rows = doc["results"]
    assert [r["model"] for r in rows] == [f"turboquant_3bit_nc {'only' if mode == 'only' else 'all but'} layer {i}" for i in layers]
    assert all(np.isfinite(r["ppl_increase"]) and r["mean_kl"] > 0 for r in rows)
    assert len(written) == 1
    if mode == "only":  # the two (2 x boundary) layers of highest mean KL, offered as --keep-layers
        by_kl = sorted(layers, key=lambda i: rows[layers.index(i)]["mean_kl"])
        assert doc["costliest_layers"] == sorted(by_kl[1:])
        assert f"--keep-layers {','.join(map(str, sorted(by_kl[1:])))}" in capsys.readouterr().out
    else:
        assert doc["costliest_layers"] is None


def test_errors_name_what_was_wrong(tiny, tmp_path, capsys):
    src, dst, text = tiny
    assert main([str(src), str(tmp_path / "missing.onnx"), "--text", str(text)]) == 2
    assert "missing.onnx: no such file" in capsys.readouterr().err
    (tmp_path / "t.txt").write_text("hello")
    assert main([str(src), str(dst), "--text", str(tmp_path / "t.txt")]) == 2
    assert "give --tokenizer DIR" in capsys.readouterr().err
    assert main([str(src), str(dst), "--text", str(text), "--context", "4096"]) == 2
    assert "fewer than one window" in capsys.readouterr().err
    assert main([str(src), "--text", str(text), "--sensitivity", "turboquant_4bit_nc", "--layers", "9"]) == 2
    assert "not cache layers" in capsys.readouterr().err
    assert main([str(src), "--text", str(text), "--sensitivity", "turboquant_4bit_nc", "--sensitivity-mode", "all-but-one",
                 "--layers", "0"]) == 2
    assert "boundary layers" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([str(src), "--text", str(text)])  # nothing to compare


def test_bad_input_refused_before_the_run(tiny, tmp_path, capsys, monkeypatch):
    """One line naming what was wrong, exit status 2, and the models never run."""
    from turboquant.eval import runner

    def ran(*a, **k):
        raise AssertionError("the evaluation ran")

    monkeypatch.setattr(runner.Evaluator, "__init__", ran)
    src, dst, text = tiny
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not protobuf \x00\x01\x02")
    np.save(tmp_path / "big.npy", np.array([1, 2, 256, 3]))  # the vocabulary is 0..255
    np.save(tmp_path / "neg.npy", np.array([1, -2, 3]))
    (tmp_path / "folder").mkdir()
    base = ["--context", "64", "--prefill", "32", "--max-tokens", "64", "--no-progress"]
    for argv, message in [
        ([src, bad, "--text", text], "bad.onnx: not an ONNX model"),
        ([bad, dst, "--text", text], "bad.onnx: not an ONNX model"),
        ([src, dst, "--text", tmp_path / "big.npy"], "token id 256 is outside the model's vocabulary (0 to 255)"),
        ([src, dst, "--text", tmp_path / "neg.npy"], "token id -2 is outside the model's vocabulary (0 to 255)"),
    ]:
        assert main([str(a) for a in argv] + base) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err
    kept = tmp_path / "kept.json"
    kept.write_text("the user's")
    for argv, message in [
        ([src, dst, "--text", text, "--json", tmp_path / "folder"], f"--json {tmp_path / 'folder'} is a folder"),
        ([src, dst, "--text", text, "--json", kept], f"--json {kept} exists; turboquant does not overwrite files"),
        ([src, dst, "--text", text, "--json", ""], "--json is an empty name"),
        ([src, dst, "--text", text, "--cache-dir", "/proc/tq-eval"], "--cache-dir /proc/tq-eval: cannot write in /proc"),
        ([src, dst, "--text", text, "--layers", "1"], "--layers chooses the layers of --sensitivity"),
        ([src, "--text", text, "--sensitivity", "turboquant_4bit_nc", "--boundary", "-1"], "argument --boundary: must be zero or more"),
        ([src, dst, "--text", text, "--threads", "-1"], "argument --threads: must be a positive count, not -1"),
        ([src, dst, "--text", text, "--threads", "0"], "argument --threads: must be a positive count, not 0"),
        *([([src, dst, "--text", text, "--device", "cuda"], "--device cuda: this ONNX Runtime has no CUDAExecutionProvider")]
          if "CUDAExecutionProvider" not in ort.get_available_providers() else []),
    ]:
        with pytest.raises(SystemExit) as e:
            main([str(a) for a in argv] + base)
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and message in err[-1], err
    assert kept.read_text() == "the user's"


def test_models_that_do_not_belong_refused_before_the_run(tiny, tmp_path, capsys, monkeypatch):
    """A rewrite as the original, a rewrite of another model, a missing data file, --shared-buffer on
    an exporter's decoder: one line each, exit status 2, nothing run."""
    import onnx

    from turboquant import random_decoders
    from turboquant.eval import runner

    monkeypatch.setattr(runner.Evaluator, "__init__", lambda *a, **k: pytest.fail("the evaluation ran"))
    src, dst, text = tiny
    other = random_decoders.export(dataclasses.replace(CFG, layers=3), tmp_path / "other.onnx")
    split = tmp_path / "split" / "model.onnx"
    split.parent.mkdir()
    onnx.save(onnx.load(str(src)), str(split), save_as_external_data=True, location="model.onnx.data", size_threshold=0)
    (split.parent / "model.onnx.data").unlink()
    for argv, message in [
        ([dst, src], f"ORIGINAL {dst} is a turboquant rewrite (turboquant_3bit_nc)"),
        ([other, dst], f"{dst} is not a form of {other}"),
        ([src, split], f"its external data file {split.parent / 'model.onnx.data'} is missing"),
        ([src, dst, "--shared-buffer"], f"{src} has no such node"),
    ]:
        assert main([str(a) for a in argv] + ["--text", str(text), "--no-progress"]) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err


def test_json_written_into_new_folders_and_unkept_cache_a_warning(tiny, tmp_path, capsys, monkeypatch):
    from turboquant.eval import cache

    def refuse(*a, **k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(cache, "store", refuse)
    src, dst, text = tiny
    out = tmp_path / "new" / "deeper" / "r.json"
    assert main([str(src), str(dst), "--text", str(text), "--context", "64", "--prefill", "32", "--max-tokens", "64",
                 "--json", str(out), "--no-progress"]) == 0
    assert json.loads(out.read_text())["scored_tokens"] == 64
    captured = capsys.readouterr()
    assert "warning: the original's logits not kept" in captured.err and "logits kept in" not in captured.out
    assert [p.name for p in out.parent.iterdir()] == ["r.json"]  # no temporary file left beside it
