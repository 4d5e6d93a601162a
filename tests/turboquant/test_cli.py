"""The `turboquant` console script, run as installed: help, version, dispatch to the entry points."""

from __future__ import annotations

import importlib.metadata
import os
import pathlib
import subprocess
import sys

import pytest

import turboquant
from turboquant import cli

DIST = "turboquant-onnx"


def installed_script() -> pathlib.Path:
    """The `turboquant` script of the installation whose package the tests import."""
    candidates = [pathlib.Path(turboquant.__file__).parents[1] / "bin" / "turboquant"]  # pip install --target
    dist = importlib.metadata.distribution(DIST)
    candidates += [pathlib.Path(dist.locate_file(f)) for f in dist.files or [] if f.name == "turboquant" and f.parent.name == "bin"]
    candidates.append(pathlib.Path(sys.executable).parent / "turboquant")  # a virtual environment's bin/
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return c
    pytest.fail(f"no installed turboquant script among {[str(c) for c in candidates]}: is the package installed?")


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(installed_script()), *args], capture_output=True, text=True, timeout=300)


def test_the_wheel_declares_the_script():
    scripts = {e.name: e.value for e in importlib.metadata.entry_points(group="console_scripts") if e.dist and e.dist.name == DIST}
    assert scripts.get("turboquant") == "turboquant.cli:main"


def test_help_lists_every_command_with_an_example():
    r = run("--help")
    assert r.returncode == 0, r.stderr
    for name in ("export", "eval", "bench", "serve-triton", "hf-export", "example"):
        assert f"\n  {name} " in r.stdout
        assert f"  turboquant {name} " in r.stdout  # its example line


def test_version_has_one_source():
    r = run("--version")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"turboquant {turboquant.__version__}"
    assert importlib.metadata.version(DIST) == turboquant.__version__  # the wheel's metadata read it from __init__.py


@pytest.mark.parametrize("name", list(cli.COMMANDS))
def test_subcommand_help_names_the_script_and_shows_examples(name):
    r = run(name, "--help")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"usage: turboquant {name}")
    assert "python -m" not in r.stdout.split("\nexamples:")[0]
    examples = r.stdout.split("\nexamples:\n")[1].splitlines()
    assert examples and all(e.startswith(f"  turboquant {name} ") for e in examples)


def test_bench_subcommand_help_reaches_its_own_parser():
    r = run("bench", "pack", "--help")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: turboquant bench pack") and "--vectors" in r.stdout


def test_export_with_bad_arguments_fails_as_the_module_does(tmp_path):
    model = tmp_path / "missing.onnx"
    for args in (["--preset", "no_such_preset", str(model)], ["--preset", "turboquant_4bit_nc", str(model)]):
        script = run("export", *args)
        module = subprocess.run([sys.executable, "-m", "turboquant.export", *args], capture_output=True, text=True)
        assert module.returncode == 2 and script.returncode == 2, (script.stderr, module.stderr)
        assert script.stderr.strip().splitlines()[-1] == module.stderr.strip().splitlines()[-1]
        assert "Traceback" not in script.stderr
        assert script.stdout == module.stdout


def test_export_runs_through_the_script(tmp_path):
    # dispatch passes the arguments on: a real model goes through the rewrite's dry run
    from onnx import TensorProto, helper, save

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])
    src = tmp_path / "no-cache.onnx"
    save(helper.make_model(helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g", [x], [y])), src)
    r = run("export", str(src), "--preset", "turboquant_4bit_nc", "--dry-run")
    assert r.returncode == 2 and "KV cache" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("args", [[], ["no-such-command"], ["--no-such-flag"]])
def test_unknown_or_missing_command_exits_2_with_one_line(args):
    r = run(*args)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    if args:
        assert len(r.stderr.strip().splitlines()) == 1 and "choose from export, eval, bench" in r.stderr


def test_a_source_checkout_maps_export_and_nothing_else(repo_root):
    """Run from the repository root, `turboquant` is the source tree: turboquant.export is export/,
    and no other folder of the checkout becomes part of the package."""
    code = ("import importlib.util as u, turboquant.export as e, turboquant.export.rewrite; "
            "print(e.__file__); print(u.find_spec('turboquant.turboquant'), u.find_spec('turboquant.tests'))")
    r = subprocess.run([sys.executable, "-c", code], cwd=repo_root, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(repo_root)})
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == str(repo_root / "export" / "__init__.py")
    assert lines[1] == "None None"
