"""Shared fixtures. Tests import the installed package (pytest runs in importlib mode)."""

from __future__ import annotations

import functools
import pathlib

import numpy as np
import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


@pytest.fixture(scope="session")
def repo_root() -> pathlib.Path:
    return REPO


@functools.lru_cache(maxsize=256)
def _cached_session(model_bytes: bytes, threads: int):
    import onnx

    from turboquant.ort import inference_session

    return inference_session(onnx.load_from_string(model_bytes), threads=threads)


@pytest.fixture(scope="session")
def ort_session():
    """ort_session(model, threads=2): a cached CPU InferenceSession with the library registered."""

    def make(model, threads: int = 2):
        return _cached_session(model.SerializeToString(), threads)

    return make
