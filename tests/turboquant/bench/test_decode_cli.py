"""bench decode and bench models: bad arguments refused in one line with exit status 2 before any
model runs or any weights are made; outputs never written over a file; a failed build leaves nothing."""

import argparse
import pathlib

import pytest

from turboquant.bench import __main__ as bench
from turboquant.bench import decode_cli, decode_models


@pytest.fixture(scope="module")
def tiny(module_tmp):
    """The tiny TorchScript model and its rewrite, through `models` (only this builder: quick)."""
    folder = module_tmp.mktemp("tiny") / "m"
    assert bench.main(["models", "--shape", "tiny", "--builder", "torchscript", "--precision", "fp32", "--device", "cpu",
                       "-o", str(folder), "--rewrite"]) == 0
    assert sorted(p.name for p in folder.iterdir()) == ["model", "tq"]  # the staging folder gone
    return str(folder / "model" / "model.onnx"), str(folder / "tq" / "model.onnx")


def _refused(capsys, argv, arg, message=""):
    try:
        rc = bench.main(argv)
    except SystemExit as e:  # argparse's own refusals
        rc = e.code
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert rc == 2 and "Traceback" not in err and f"argument {arg}" in last and message in last, err
    return err


def _files(folder):
    return sorted((p.relative_to(folder), p.read_bytes() if p.is_file() else None) for p in folder.rglob("*"))


@pytest.fixture
def no_run(monkeypatch):
    from turboquant.bench import decode

    monkeypatch.setattr(decode, "run", lambda *a, **k: pytest.fail("the run started"))


def test_outputs_refused_before_the_run(tiny, tmp_path, capsys, no_run):
    (tmp_path / "old.png").write_bytes(b"keep")
    before = _files(tmp_path)
    for extra, arg, message in [
        (["--plot", str(tmp_path / "p2.png"), "--json", str(tmp_path / "p2.png")], "--plot", "is also --json's file"),
        (["--json", "/sys/x.json"], "--json", "cannot write in /sys"),
        (["--json", ""], "--json", "is an empty name"),
        (["--plot", ""], "--plot", "is an empty name"),
        (["--plot", str(tmp_path / "old.png")], "--plot", "exists"),
        (["--plot", str(tmp_path / "p.onnx")], "--plot", "a plot is saved as one of"),
        (["--json", str(tmp_path)], "--json", "is a folder"),
    ]:
        err = _refused(capsys, ["decode", *tiny, "--context", "16", *extra], arg, message)
        assert len(err.strip().splitlines()) == 1
    assert _files(tmp_path) == before


def test_outputs_in_a_new_folder(tiny, tmp_path):
    out = tmp_path / "nodir"
    assert bench.main(["decode", *tiny, "--context", "16", "--steps", "1", "--json", str(out / "d.json"),
                       "--plot", str(out / "d.png")]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["d.json", "d.png"]


@pytest.mark.parametrize("text, value", [("4", 4), ("4e3", 4000), ("80e9", 80 * 10**9), ("1_000", 1000), (" 7 ", 7)])
def test_counts_taken_exactly(text, value):
    assert decode_cli._count(text) == value


@pytest.mark.parametrize("text, message", [("2.5e0", "whole number"), ("1.5", "whole number"), ("1e400", "too large"),
                                           ("1e999999999", "too large"), ("nan", "whole number"), ("inf", "whole number"),
                                           ("0", "positive"), ("-3e0", "positive"), ("two", "whole number")])
def test_counts_refused(text, message):
    with pytest.raises(argparse.ArgumentTypeError, match=message):
        decode_cli._count(text)


def test_counts_refused_on_the_command_line(tiny, capsys):
    _refused(capsys, ["decode", *tiny, "--context", "1e400"], "--context", "too large")
    _refused(capsys, ["decode", *tiny, "--steps", "2.5e0"], "--steps", "whole number")


@pytest.mark.parametrize("value", ["nan", "inf", "-1"])
def test_ttft_budget_refused(tiny, capsys, value):
    _refused(capsys, ["decode", *tiny, "--ttft-budget", value], "--ttft-budget")


def test_context_past_the_rotary_tables(tiny, capsys, no_run):
    err = _refused(capsys, ["decode", tiny[1], "--context", "140000"], "--context", "131072 positions")
    assert tiny[1] in err


def test_arrays_larger_than_the_machine(tiny, capsys, no_run):
    _refused(capsys, ["decode", tiny[0], "--context", "1000000000", "--fill", "random"], "--context", "needs about")
    _refused(capsys, ["decode", tiny[1], "--context", "100000", "--batch", "1000000", "--fill", "random"], "--context",
             "more than this machine's")


def test_decode_library_that_cannot_load(tiny, capsys, monkeypatch, no_run):
    monkeypatch.setenv("TURBOQUANT_ORT_LIBRARY", "/nope.so")
    _refused(capsys, ["decode", *tiny, "--context", "16"], "MODEL", "/nope.so")


def test_models_refusals_leave_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(decode_models, "build", lambda *a, **k: pytest.fail("built"))
    base = ["models", "--shape", "tiny", "--builder", "torchscript", "--precision", "fp32"]
    _refused(capsys, [*base, "-o", "/sys/m6"], "-o", "cannot write in /sys")
    _refused(capsys, [*base, "-o", ""], "-o", "empty name")
    (tmp_path / "afile").write_bytes(b"a file")
    _refused(capsys, [*base, "-o", str(tmp_path / "afile" / "m")], "-o", "is a file, not a folder")
    for extra in (["--no-calibration"], ["--boundary", "1"], ["--cache", "concat"]):
        _refused(capsys, [*base, "-o", str(tmp_path / "m"), *extra], extra[0], "no --rewrite")
    monkeypatch.setenv("TURBOQUANT_ORT_LIBRARY", "/nope.so")
    _refused(capsys, [*base, "-o", str(tmp_path / "m"), "--rewrite"], "--rewrite", "/nope.so")
    assert _files(tmp_path) == [(pathlib.Path("afile"), b"a file")]


def test_genai_fp16_on_the_cpu_refused(tmp_path, capsys, monkeypatch):
    pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is not installed (its builder makes these models)")
    monkeypatch.setattr(decode_models, "build", lambda *a, **k: pytest.fail("built"))
    genai = ["models", "--shape", "tiny", "--builder", "genai", "--precision", "fp16", "--device", "cpu"]
    _refused(capsys, [*genai, "-o", str(tmp_path / "m")], "--precision", "genai's builder writes MultiHeadAttention")
    assert list(tmp_path.iterdir()) == []


def test_a_model_the_rewrite_refuses_one_line(tmp_path, capsys, monkeypatch):
    from turboquant.export import RewriteError

    def refused_build(shape, builder, precision, device, out, *a, **k):
        (out / "model").mkdir()
        raise RewriteError("layer 0: the model's refusal")

    monkeypatch.setattr(decode_models, "build", refused_build)
    out = tmp_path / "a" / "m"
    _refused(capsys, ["models", "--shape", "tiny", "--builder", "torchscript", "-o", str(out), "--rewrite"],
             "--rewrite", "layer 0: the model's refusal")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("exists", [False, True])
def test_a_failed_build_leaves_nothing(tmp_path, monkeypatch, capsys, exists):
    def half_build(shape, builder, precision, device, out, *a, **k):
        (out / "model").mkdir(parents=True)
        (out / "model" / "model.onnx").write_bytes(b"half")
        raise RuntimeError("the exporter died")

    monkeypatch.setattr(decode_models, "build", half_build)
    out = tmp_path / "a" / "m"
    if exists:
        out.mkdir(parents=True)
    assert bench.main(["models", "--shape", "tiny", "--builder", "torchscript", "-o", str(out), "--rewrite"]) == 2
    err = capsys.readouterr().err  # the error boundary's one line
    assert err.count("\n") == 1 and "RuntimeError: the exporter died" in err, err
    assert (list(out.iterdir()) == []) if exists else list(tmp_path.iterdir()) == []  # the folders made for it too


def test_a_json_file_replaced_during_the_run_is_left_alone(tiny, tmp_path, capsys, monkeypatch):
    from turboquant.bench import decode

    path = tmp_path / "r.json"

    def run(paths, infos, opts, log, on_record):
        records = [decode.Record(p, "cpu", 1, 16, 1.0, 1000.0, 2.0, 100, None) for p in paths]
        on_record(records[:1])
        path.unlink()
        path.write_text("theirs")  # another program's file under the name meanwhile
        on_record(records)
        return records

    monkeypatch.setattr(decode, "run", run)
    assert bench.main(["decode", *tiny, "--context", "16", "--json", str(path)]) == 1
    err = capsys.readouterr().err
    assert "removed or replaced during the run" in err and "Traceback" not in err
    assert path.read_text() == "theirs" and [p.name for p in tmp_path.iterdir()] == ["r.json"]
