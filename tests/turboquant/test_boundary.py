"""turboquant.boundary: every command-line tool turns any failure into one line naming the input and
exit status 2; argparse's refusals are one line too."""

import errno
import importlib

import pytest

from turboquant import cli
from turboquant.boundary import Parser, boundary


def _one_line(capsys):
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_any_exception_is_one_line_naming_the_inputs(tmp_path, capsys):
    model = tmp_path / "model.onnx"
    model.write_bytes(b"x")

    @boundary("prog")
    def main(argv):
        raise RuntimeError("[ONNXRuntimeError] : 1 : FAIL : Load model failed\nsecond line\nthird")

    assert main([str(model), "--threads", "2"]) == 2
    err = _one_line(capsys)
    assert err == f"prog: error: {model}: RuntimeError: [ONNXRuntimeError] : 1 : FAIL : Load model failed\n"


def test_a_full_disk_is_one_line(tmp_path, capsys):
    @boundary("prog")
    def main(argv):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "out.json"))

    assert main(["--json", str(tmp_path / "out.json")]) == 2
    assert f"{tmp_path / 'out.json'}: No space left on device" in _one_line(capsys)


def test_a_tools_own_refusal_is_printed_as_it_is(capsys):
    @boundary("prog")
    def main(argv):
        raise ValueError("--context 9 is longer than the model's 8 positions")

    assert main([]) == 2
    assert _one_line(capsys) == "prog: error: --context 9 is longer than the model's 8 positions\n"


def test_parser_refusals_are_one_line(capsys):
    p = Parser(prog="prog")
    p.add_argument("--n", type=int)
    with pytest.raises(SystemExit) as e:
        p.parse_args(["--n", "x"])
    assert e.value.code == 2
    assert _one_line(capsys).startswith("prog: error: argument --n: invalid int value: 'x'")


@pytest.mark.parametrize("name", list(cli.COMMANDS))
def test_every_command_runs_inside_the_boundary(name, capsys, monkeypatch):
    """Each command's main is the boundary's: whatever its parser returns raises, it exits 2 with one line."""
    module = importlib.import_module(cli.COMMANDS[name].module)
    assert getattr(module.main, "__wrapped__", None) is not None, f"{name}'s main has no error boundary"

    def parse_fails(self, *a, **k):
        raise MemoryError("out of memory")

    monkeypatch.setattr(Parser, "parse_args", parse_fails)
    assert cli.main([name, "anything"]) == 2
    assert "MemoryError: out of memory" in _one_line(capsys)


def test_bench_on_a_full_disk(tmp_path, capsys, monkeypatch):
    from turboquant.bench import __main__ as bench

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(bench, "write_new_text", full)
    argv = ["attention", "--q-heads", "4", "--kv-heads", "2", "--head-dim", "64", "--context", "64", "--threads", "1",
            "--repeat", "1", "--presets", "turboquant_4bit_nc", "--json", str(tmp_path / "r.json")]
    assert bench.main(argv) == 2
    assert "No space left on device" in _one_line(capsys)


def test_example_on_a_full_disk(tmp_path, capsys, monkeypatch):
    from turboquant.example import __main__ as example

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "ex"))

    monkeypatch.setattr(example, "workspace", full)
    assert example.main(["--random", "--out", str(tmp_path / "ex")]) == 2
    assert "No space left on device" in _one_line(capsys)
