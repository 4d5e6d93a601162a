"""ONNX Runtime helpers: sessions with the turboquant custom-op library registered."""

from __future__ import annotations

import ctypes
import os
import pathlib
from collections.abc import Sequence

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto

from ._libs import ort_library_path
from .reference.numerics import bfloat16


def session_options(threads: int | None = None, *, library: str | None = None) -> ort.SessionOptions:
    """SessionOptions with the custom-op library registered; threads sets the intra-op pool size."""
    so = ort.SessionOptions()
    so.register_custom_ops_library(library or ort_library_path())
    if threads:
        so.intra_op_num_threads = int(threads)
    return so


def session_options_beside(model_path: str | os.PathLike, threads: int | None = None) -> ort.SessionOptions:
    """session_options for a model given as bytes whose external data stays in model_path's folder
    (a changed copy of a model run from memory, its weights not written again)."""
    so = session_options(threads)
    so.add_session_config_entry("session.model_external_initializers_file_folder_path",
                                str(pathlib.Path(model_path).resolve().parent))
    return so


def inference_session(
    model: onnx.ModelProto | str | os.PathLike,
    providers: Sequence[str] = ("CPUExecutionProvider",),
    threads: int | None = None,
    options: ort.SessionOptions | None = None,
) -> ort.InferenceSession:
    """An InferenceSession for a model that uses turboquant ops (a ModelProto or a path). `options`,
    when given, must already have the library registered (session_options does that)."""
    so = options or session_options(threads)
    source = model.SerializeToString() if isinstance(model, onnx.ModelProto) else os.fspath(model)
    return ort.InferenceSession(source, so, providers=list(providers))


def to_ort_value(x: np.ndarray) -> ort.OrtValue:
    """An OrtValue for a numpy array, bfloat16 (ml_dtypes) included, which ORT's numpy path lacks."""
    x = np.ascontiguousarray(x)
    if x.dtype == bfloat16:
        return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(x.view(np.uint16), onnx_element_type=TensorProto.BFLOAT16)
    return ort.OrtValue.ortvalue_from_numpy(x)


def from_ort_value(v: ort.OrtValue) -> np.ndarray:
    """A numpy copy of a CPU OrtValue, bfloat16 included (as ml_dtypes.bfloat16)."""
    if v.data_type() != "tensor(bfloat16)":
        return v.numpy()
    out = np.empty(v.shape(), np.uint16)
    if out.size:
        ctypes.memmove(out.ctypes.data, v.data_ptr(), out.nbytes)
    return out.view(bfloat16)


def run(session: ort.InferenceSession, feeds: dict[str, np.ndarray], outputs: Sequence[str] | None = None) -> list[np.ndarray]:
    """session.run for numpy feeds of any float type, bfloat16 included."""
    names = list(outputs) if outputs else [o.name for o in session.get_outputs()]
    if not any(np.asarray(x).dtype == bfloat16 for x in feeds.values()) and not any(
        o.type == "tensor(bfloat16)" for o in session.get_outputs() if o.name in names
    ):
        return session.run(names, feeds)
    values = session.run_with_ort_values(names, {k: to_ort_value(np.asarray(x)) for k, x in feeds.items()})
    return [from_ort_value(v) for v in values]
