"""Shared fixtures. Tests import the installed package (pytest runs in importlib mode)."""

from __future__ import annotations

import functools
import os
import pathlib
import shutil

import numpy as np
import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]


def pytest_configure(config):
    """Under pytest-xdist (a worker per core), each worker's torch and ONNX Runtime sessions on one
    thread, so that the workers do not contend for each other's cores (ORT's pool spins as it waits)."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    import onnxruntime as ort
    import torch

    torch.set_num_threads(1)
    real = ort.InferenceSession

    class OneThreadSession(real):
        def __init__(self, path_or_bytes, sess_options=None, *args, **kwargs):
            if sess_options is None:
                sess_options = ort.SessionOptions()
            if sess_options.intra_op_num_threads == 0:  # the default: one thread a core
                sess_options.intra_op_num_threads = 1
            super().__init__(path_or_bytes, sess_options, *args, **kwargs)

    ort.InferenceSession = OneThreadSession


@pytest.fixture(scope="module")
def module_tmp(request, tmp_path_factory):
    """tmp_path_factory for a module's fixtures, whose folders go when the module is done unless one
    of its tests failed: a whole run's models would otherwise stay on disk to its end (GBs)."""
    made = []
    failed = request.session.testsfailed

    class Factory:
        def mktemp(self, name: str) -> pathlib.Path:
            made.append(tmp_path_factory.mktemp(name))
            return made[-1]

    yield Factory()
    if request.session.testsfailed == failed:
        for folder in made:
            shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


@pytest.fixture(scope="session")
def repo_root() -> pathlib.Path:
    return REPO


def cuda_unavailable_reason() -> str | None:
    """Why CUDA tests cannot run here, or None when they can."""
    import onnxruntime as ort

    if hasattr(ort, "preload_dlls"):
        try:
            ort.preload_dlls()
        except Exception:  # noqa: BLE001 - reported through the provider check below
            pass
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return "onnxruntime has no CUDAExecutionProvider here (install onnxruntime-gpu on a machine with a GPU)"
    import ctypes

    try:
        cuda = ctypes.CDLL("libcuda.so.1")
        count = ctypes.c_int(0)
        if cuda.cuInit(0) != 0 or cuda.cuDeviceGetCount(ctypes.byref(count)) != 0 or count.value == 0:
            return "no CUDA device"
    except OSError:
        return "no CUDA driver (libcuda.so.1)"
    return None


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def pytest_generate_tests(metafunc):
    """Tests taking a `device` argument run on the CPU and, where present, the GPU."""
    if "device" in metafunc.fixturenames:
        metafunc.parametrize("device", DEVICES)


@pytest.fixture
def device_ready(device):
    """The test's device, after skipping (saying why) a CUDA run where no GPU is usable."""
    if device == "cuda":
        reason = cuda_unavailable_reason()
        if reason:
            pytest.skip(f"CUDA test skipped: {reason}")
    return device


@pytest.fixture
def cuda_ready():
    """For GPU-only tests: skips, saying why, where no GPU and onnxruntime-gpu are usable."""
    reason = cuda_unavailable_reason()
    if reason:
        pytest.skip(f"CUDA test skipped: {reason}")


@functools.lru_cache(maxsize=256)
def _cached_session(model_bytes: bytes, threads: int, device: str):
    import onnx

    from turboquant.ort import inference_session, session_options

    so = session_options(threads)
    providers = ["CPUExecutionProvider"]
    if device == "cuda":
        # every node on the GPU, or the session fails: proves the CUDA kernels are the ones run
        so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
        providers = ["CUDAExecutionProvider"]
    return inference_session(onnx.load_from_string(model_bytes), providers=providers, options=so)


@pytest.fixture(scope="session")
def ort_session():
    """ort_session(model, threads=2, device="cpu"): a cached InferenceSession with the library
    registered; device "cuda" skips (saying why) where no GPU and onnxruntime-gpu are present."""

    def make(model, threads: int = 2, device: str = "cpu"):
        if device == "cuda":
            reason = cuda_unavailable_reason()
            if reason:
                pytest.skip(f"CUDA test skipped: {reason}")
        return _cached_session(model.SerializeToString(), threads, device)

    return make
