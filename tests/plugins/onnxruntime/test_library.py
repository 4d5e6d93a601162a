"""The built custom-op library: where it is, what it exports, how it fails when missing."""

import shutil
import subprocess

import pytest

import turboquant


def test_ort_library_exists_and_exports_only_the_entry_point():
    path = turboquant.ort_library_path()
    if shutil.which("nm") is None:
        pytest.skip("nm (binutils) is not installed: cannot list the dynamic symbols")
    out = subprocess.run(["nm", "-D", "--defined-only", path], check=True, capture_output=True, text=True).stdout
    names = sorted(line.split()[-1] for line in out.splitlines() if line.strip())
    assert names == ["RegisterCustomOps"]


def test_trt_plugin_path_says_what_is_missing(monkeypatch):
    monkeypatch.delenv("TURBOQUANT_TRT_PLUGIN", raising=False)
    with pytest.raises(turboquant.LibraryNotBuiltError, match="TensorRT plugin library"):
        turboquant.trt_plugin_path()


def test_override_must_exist(monkeypatch, tmp_path):
    monkeypatch.setenv("TURBOQUANT_ORT_LIBRARY", str(tmp_path / "missing.so"))
    with pytest.raises(turboquant.LibraryNotBuiltError, match="not a file"):
        turboquant.ort_library_path()
