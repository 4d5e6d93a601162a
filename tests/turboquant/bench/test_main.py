"""python -m turboquant.bench: bad arguments refused in one line with exit status 2, before anything runs."""

import subprocess
import sys

import onnxruntime as ort
import pytest

SMALL = ["--q-heads", "4", "--kv-heads", "2", "--head-dim", "64", "--context", "64", "--threads", "1", "--repeat", "2",
         "--presets", "turboquant_k8v4"]


def bench(*args):
    # a subprocess: ORT's GroupQueryAttention dies of SIGFPE on a zero batch, which must not take pytest along
    return subprocess.run([sys.executable, "-m", "turboquant.bench", *args], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("what", ["attention", "report"])
@pytest.mark.parametrize("bad, message", [
    (["--batch", "0"], "argument --batch: must be a positive count, not 0"),
    (["--context", "0"], "argument --context: must be a positive count, not 0"),
    (["--repeat", "0"], "argument --repeat: must be a positive count, not 0"),
    (["--kv-heads", "0"], "argument --kv-heads: must be a positive count, not 0"),
    (["--threads", "-1"], "argument --threads: must be a positive count, not -1"),
    (["--head-dim", "12"], "argument --head-dim: unsupported head_dim 12"),
    (["--batch", "two"], "argument --batch: expected a positive integer, got 'two'"),
    (["--q-heads", "6", "--kv-heads", "4"], "argument --q-heads: 6 is not a multiple of --kv-heads 4"),
    (["--threads", str(2**40)], "argument --threads: 1099511627776 is too large"),
    (["--threads", "100000"], "argument --threads: 100000 threads is more than"),
    (["--repeat", str(10**7)], "argument --repeat: 10000000 is more than 1000000"),
])
def test_bad_arguments(what, bad, message, tmp_path):
    r = bench(what, *SMALL, *bad, *(["--out", str(tmp_path / "r")] if what == "report" else []))
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and message in lines[0], r.stderr  # one line, no usage block
    assert "Traceback" not in r.stderr and not (tmp_path / "r").exists()


@pytest.mark.skipif("CUDAExecutionProvider" in ort.get_available_providers(), reason="this ONNX Runtime has CUDA")
@pytest.mark.parametrize("what", ["attention", "report", "pack"])
def test_cuda_without_cuda(what):
    r = bench(what, "--device", "cuda", "--repeat", "1")
    assert r.returncode == 2 and "argument --device: cuda: this ONNX Runtime has no CUDAExecutionProvider" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_shape_refuses_what_the_baselines_cannot_run():
    from turboquant.bench.attention import Shape

    for bad, message in [(dict(batch=0), "batch must be a positive count"), (dict(context=0), "context must be"),
                         (dict(q_heads=6, kv_heads=4), "not a multiple"), (dict(head_dim=12), "unsupported head_dim 12")]:
        with pytest.raises(ValueError, match=message):
            Shape(**bad)


def _refused(capsys, argv, message, one_line=True):
    """rc 2, the message on stderr's last line (its only one for checks past argparse), no traceback."""
    from turboquant.bench.__main__ import main

    try:
        rc = main(argv)
    except SystemExit as e:  # argparse's own refusals
        rc = e.code
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert rc == 2 and "Traceback" not in err and message in lines[-1], err
    assert not one_line or len(lines) == 1, err
    return lines[-1]


def _files(folder):
    return sorted((p.relative_to(folder), p.read_bytes() if p.is_file() else None) for p in folder.rglob("*"))


@pytest.mark.parametrize("what, args", [("attention", [*SMALL, "--context", "16", "--repeat", "1"]),
                                        ("pack", ["--vectors", "64", "--head-dim", "64", "--repeat", "1"])])
def test_outputs_refused_before_the_run(what, args, tmp_path, capsys):
    (tmp_path / "old.json").write_text("keep")
    (tmp_path / "adir.onnx").mkdir()
    before = _files(tmp_path)
    cases = [(["--json", str(tmp_path / "old.json")], "--json", "exists; turboquant does not overwrite files"),
             (["--plot", str(tmp_path / "old.json")], "--plot", "exists"),
             (["--json", str(tmp_path / "adir.onnx")], "--json", "is a folder"),
             (["--plot", str(tmp_path / "adir.onnx")], "--plot", "is a folder"),
             (["--plot", str(tmp_path / "p.onnx")], "--plot", "a plot is saved as one of"),
             (["--json", str(tmp_path / "x.png"), "--plot", str(tmp_path / "." / "x.png")], "--plot",
              "is also --json's file"),
             (["--json", ""], "--json", "is an empty name"),
             (["--json", "/sys/nodir/x.json"], "--json", "cannot write in /sys")]
    for extra, option, message in cases:
        assert option in _refused(capsys, [what, *args, *extra], message)
    assert _files(tmp_path) == before


@pytest.mark.parametrize("what, args", [("attention", [*SMALL, "--context", "16", "--repeat", "1"]),
                                        ("pack", ["--vectors", "64", "--head-dim", "64", "--threads", "1", "--repeat", "1"])])
def test_outputs_made_in_a_new_folder(what, args, tmp_path):
    from turboquant.bench.__main__ import main

    out = tmp_path / "new" / "deeper"
    assert main([what, *args, "--json", str(out / "r.json"), "--plot", str(out / "r.png")]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["r.json", "r.png"]  # no temporary left beside them
    assert (out / "r.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("argv, message", [
    (["attention", *SMALL, "--context", "2000000000"], "--context 2000000000 at batch 1 needs about"),
    (["report", *SMALL, "--context", "2000000000"], "--context 2000000000 at batch 1 needs about"),
    (["pack", "--vectors", "2000000000"], "--vectors 2000000000 needs about"),
])
def test_arrays_larger_than_the_machine_refused_before_allocating(argv, message, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # report's default folder
    assert "more than this machine's" in _refused(capsys, argv, message)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("what", ["attention", "pack", "prefill", "report"])
def test_a_custom_op_library_that_cannot_load_is_refused_first(what, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TURBOQUANT_ORT_LIBRARY", str(tmp_path / "nope.so"))
    _refused(capsys, [what, "--repeat", "1"], "nope.so, which is not a file")
    (tmp_path / "junk.so").write_text("not a library")
    monkeypatch.setenv("TURBOQUANT_ORT_LIBRARY", str(tmp_path / "junk.so"))
    _refused(capsys, [what, "--repeat", "1"], "junk.so cannot be loaded")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["junk.so"]
