"""The built custom-op library: where it is, what it exports, how it fails when missing."""

import shutil
import subprocess
import sys

import pytest

import turboquant


def test_ort_library_exists_and_exports_only_the_entry_point_and_the_plan_hooks():
    """RegisterCustomOps for ORT, and the C functions turboquant.kernel_plan calls (the split-KV and
    prefill planners, the kernels the latest CUDA calls ran, whether the library holds sm_90a code, the CPU
    kernels' instruction set);
    nothing else."""
    path = turboquant.ort_library_path()
    if shutil.which("nm") is None:
        pytest.skip("nm (binutils) is not installed: cannot list the dynamic symbols")
    out = subprocess.run(["nm", "-D", "--defined-only", path], check=True, capture_output=True, text=True).stdout
    names = sorted(line.split()[-1] for line in out.splitlines() if line.strip())
    assert names == ["RegisterCustomOps", "turboquant_cpu_instruction_set", "turboquant_last_prefill_kernel",
                     "turboquant_last_split_kernel", "turboquant_prefill_plan", "turboquant_sm90a_compiled",
                     "turboquant_split_plan"]


def test_found_from_a_source_checkout(repo_root):
    """python -m from the repository root imports the checkout's turboquant, without the built
    library; it still finds the installed one, and turboquant.export maps to export/."""
    code = "import turboquant, turboquant.export; print(turboquant.ort_library_path()); print(turboquant.export.__file__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=repo_root, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    lib, export_file = out.stdout.split()
    assert lib.endswith("libturboquant_ort.so") and export_file.endswith("__init__.py")


def test_trt_plugin_path_says_what_is_missing(monkeypatch, tmp_path):
    from turboquant import _libs

    monkeypatch.delenv("TURBOQUANT_TRT_PLUGIN", raising=False)
    monkeypatch.setattr(_libs, "LIB_DIR", tmp_path)  # an installation built without nvcc or the TensorRT headers
    monkeypatch.setattr(_libs, "_installed", lambda filename: None)
    with pytest.raises(turboquant.LibraryNotBuiltError, match="TensorRT plugin library .* built only when"):
        turboquant.trt_plugin_path()


def test_override_must_exist(monkeypatch, tmp_path):
    monkeypatch.setenv("TURBOQUANT_ORT_LIBRARY", str(tmp_path / "missing.so"))
    with pytest.raises(turboquant.LibraryNotBuiltError, match="not a file"):
        turboquant.ort_library_path()
