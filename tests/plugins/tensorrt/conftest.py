"""The TensorRT plugin library driven through harness.cc, as TensorRT would drive it.

No machine here has TensorRT, so the harness (compiled here against the TensorRT headers) calls the
library's creators and plugins directly. Creation, fields, serialisation and format queries run on
any machine; enqueue needs a GPU (and onnxruntime-gpu, whose CUDA ops are the reference)."""

from __future__ import annotations

import ctypes
import os
import pathlib
import shutil
import subprocess

import numpy as np
import pytest

import turboquant

HERE = pathlib.Path(__file__).parent
REPO = HERE.parents[2]

# nvinfer1::DataType and PluginFieldType values (NvInferRuntimeBase.h, NvInferPluginBase.h)
DT = {"float32": 0, "float16": 1, "int8": 2, "int32": 3, "bool": 4, "uint8": 5, "bfloat16": 7, "int64": 8}
FIELD_INT32, FIELD_FLOAT32, FIELD_CHAR = 5, 1, 6


def _include_dirs() -> tuple[str | None, str | None]:
    trt = os.environ.get("TENSORRT_INCLUDE_DIR") or str(REPO / "third_party" / "tensorrt" / "include")
    trt = trt if pathlib.Path(trt, "NvInferRuntime.h").is_file() else None
    cuda = None
    for c in [os.environ.get("CUDA_HOME", ""), "/usr/local/cuda"]:
        if c and pathlib.Path(c, "include", "cuda_runtime_api.h").is_file():
            cuda = str(pathlib.Path(c, "include"))
            break
    return trt, cuda


class Harness:
    def __init__(self, so: pathlib.Path, library: str):
        h = ctypes.CDLL(str(so))
        vp, cp, ip = ctypes.c_void_p, ctypes.c_char_p, ctypes.POINTER(ctypes.c_int)
        lp = ctypes.POINTER(ctypes.c_int64)
        for name, res, args in [
            ("tqh_error", cp, []), ("tqh_open", vp, [cp]), ("tqh_creators", cp, [vp]),
            ("tqh_create", vp, [vp, cp, ctypes.c_int, ctypes.POINTER(cp), ip, ctypes.POINTER(vp), ip]),
            ("tqh_roundtrip", vp, [vp, vp]), ("tqh_fields", cp, [vp]), ("tqh_identity", cp, [vp]),
            ("tqh_clone", vp, [vp]), ("tqh_output_shapes", cp, [vp, cp]), ("tqh_destroy", None, [vp]), ("tqh_nb_outputs", ctypes.c_int, [vp]),
            ("tqh_output_types", ctypes.c_int, [vp, ctypes.c_int, ip, ctypes.c_int, ip]),
            ("tqh_supports", ctypes.c_int, [vp, ctypes.c_int, ctypes.c_int, ctypes.c_int, ip]),
            ("tqh_workspace", ctypes.c_longlong, [vp, ctypes.c_int, ip, ip, lp, ctypes.c_int, ip, ip, lp]),
            ("tqh_workspace_range", ctypes.c_longlong, [vp, ctypes.c_int, ip, ip, lp, lp, ctypes.c_int, ip, ip, lp]),
            ("tqh_configure", ctypes.c_int, [vp, ctypes.c_int, ip, ip, lp, ctypes.c_int, ip, ip, lp]),
            ("tqh_aliased_input", ctypes.c_int, [vp, ctypes.c_int]),
            ("tqh_enqueue", ctypes.c_int, [vp, ctypes.c_int, ip, ip, lp, ctypes.POINTER(vp), ctypes.c_int, ip, ip, lp,
                                           ctypes.POINTER(vp), vp, vp]),
        ]:
            fn = getattr(h, name)
            fn.restype, fn.argtypes = res, args
        self.h = h
        self.lib = h.tqh_open(library.encode())
        if not self.lib:
            raise RuntimeError(f"dlopen({library}) failed: {h.tqh_error().decode()}")

    def creators(self) -> list[str]:
        return [c for c in self.h.tqh_creators(self.lib).decode().split(";") if c]

    def create(self, name: str, **fields):
        """A plugin from fields typed as TensorRT's ONNX parser types node attributes; None on refusal."""
        keep, names, types, data, lengths = [], [], [], [], []
        for k, v in fields.items():
            if isinstance(v, str):
                buf, t, n = ctypes.create_string_buffer(v.encode()), FIELD_CHAR, len(v) + 1
            elif isinstance(v, float):
                buf, t, n = ctypes.c_float(v), FIELD_FLOAT32, 1
            else:
                buf, t, n = ctypes.c_int32(int(v)), FIELD_INT32, 1
            keep.append(buf)
            names.append(k.encode())
            types.append(t)
            data.append(ctypes.cast(ctypes.pointer(buf), ctypes.c_void_p))
            lengths.append(n)
        n = len(names)
        p = self.h.tqh_create(self.lib, name.encode(), n, (ctypes.c_char_p * n)(*names), (ctypes.c_int * n)(*types),
                              (ctypes.c_void_p * n)(*data), (ctypes.c_int * n)(*lengths))
        return Plugin(self, p) if p else None


def _descs(tensors):
    """(types, ranks, dims[8 per tensor]) arrays from (dtype name, shape) pairs."""
    n = len(tensors)
    dims = np.zeros((max(n, 1), 8), np.int64)
    for i, (_, shape) in enumerate(tensors):
        dims[i, :len(shape)] = shape
    types = (ctypes.c_int * n)(*[DT[t] for t, _ in tensors])
    ranks = (ctypes.c_int * n)(*[len(s) for _, s in tensors])
    return types, ranks, dims


class Plugin:
    def __init__(self, harness: Harness, ptr):
        self.hx, self.ptr = harness, ptr

    def __del__(self):
        if self.ptr:
            self.hx.h.tqh_destroy(self.ptr)

    def identity(self) -> str:
        return self.hx.h.tqh_identity(self.ptr).decode()

    def fields(self) -> dict[str, str]:
        items = [f for f in self.hx.h.tqh_fields(self.ptr).decode().split(";") if f]
        return dict(f.split("=", 1) for f in items)

    def roundtrip(self) -> Plugin:
        return Plugin(self.hx, self.hx.h.tqh_roundtrip(self.hx.lib, self.ptr))

    def output_shapes(self, *inputs: str) -> list[str]:
        """Output shapes for inputs like "B,32,1,128" (non-numbers are symbols), as text."""
        out = self.hx.h.tqh_output_shapes(self.ptr, ";".join(inputs).encode()).decode()
        return out.split(";")

    def clone(self) -> Plugin:
        return Plugin(self.hx, self.hx.h.tqh_clone(self.ptr))

    def output_types(self, inputs: list[str]) -> list[str]:
        n = self.hx.h.tqh_nb_outputs(self.ptr)
        out = (ctypes.c_int * n)()
        assert self.hx.h.tqh_output_types(self.ptr, len(inputs), (ctypes.c_int * len(inputs))(*[DT[t] for t in inputs]), n, out) == 0
        names = {v: k for k, v in DT.items()}
        return [names[t] for t in out]

    def supports(self, pos: int, inputs: list[str], outputs: list[str]) -> bool:
        types = inputs + outputs
        return bool(self.hx.h.tqh_supports(self.ptr, pos, len(inputs), len(outputs), (ctypes.c_int * len(types))(*[DT[t] for t in types])))

    def workspace(self, inputs, outputs) -> int:
        it, ir, idims = _descs(inputs)
        ot, orank, odims = _descs(outputs)
        return self.hx.h.tqh_workspace(self.ptr, len(inputs), it, ir, idims.ctypes.data_as(ctypes.POINTER(ctypes.c_int64)),
                                       len(outputs), ot, orank, odims.ctypes.data_as(ctypes.POINTER(ctypes.c_int64)))

    def workspace_range(self, inputs_min, inputs, outputs) -> int:
        """The workspace for a profile whose inputs range from inputs_min's shapes to inputs'."""
        it, ir, idims = _descs(inputs)
        _, _, lo = _descs(inputs_min)
        ot, orank, odims = _descs(outputs)
        lp = ctypes.POINTER(ctypes.c_int64)
        return self.hx.h.tqh_workspace_range(self.ptr, len(inputs), it, ir, lo.ctypes.data_as(lp), idims.ctypes.data_as(lp),
                                             len(outputs), ot, orank, odims.ctypes.data_as(lp))

    def configure(self, inputs, outputs) -> int:
        it, ir, idims = _descs(inputs)
        ot, orank, odims = _descs(outputs)
        lp = ctypes.POINTER(ctypes.c_int64)
        return self.hx.h.tqh_configure(self.ptr, len(inputs), it, ir, idims.ctypes.data_as(lp), len(outputs), ot, orank,
                                       odims.ctypes.data_as(lp))

    def aliased_input(self, output: int) -> int:
        """getAliasedInput(output): -1 none, -2 when the plugin offers no IPluginV3OneBuildV2."""
        return self.hx.h.tqh_aliased_input(self.ptr, output)

    def enqueue_shapes(self, inputs, outputs) -> int:
        """enqueue on null buffers, for shapes it must refuse before launching anything; inputs and
        outputs are (dtype name, shape) pairs."""
        it, ir, idims = _descs(inputs)
        ot, orank, odims = _descs(outputs)
        lp = ctypes.POINTER(ctypes.c_int64)
        null_in, null_out = (ctypes.c_void_p * len(inputs))(), (ctypes.c_void_p * len(outputs))()
        return self.hx.h.tqh_enqueue(self.ptr, len(inputs), it, ir, idims.ctypes.data_as(lp), null_in, len(outputs), ot,
                                     orank, odims.ctypes.data_as(lp), null_out, None, None)

    def enqueue(self, inputs, outputs, workspace=None, stream=None) -> int:
        """inputs/outputs: torch CUDA tensors; returns enqueue's status (0: success)."""
        import torch

        def desc(ts):
            return _descs([(str(t.dtype).removeprefix("torch."), tuple(t.shape)) for t in ts])

        it, ir, idims = desc(inputs)
        ot, orank, odims = desc(outputs)
        iptr = (ctypes.c_void_p * len(inputs))(*[t.data_ptr() for t in inputs])
        optr = (ctypes.c_void_p * len(outputs))(*[t.data_ptr() for t in outputs])
        stream = stream or torch.cuda.current_stream().cuda_stream
        ws = workspace.data_ptr() if workspace is not None else None
        return self.hx.h.tqh_enqueue(self.ptr, len(inputs), it, ir, idims.ctypes.data_as(ctypes.POINTER(ctypes.c_int64)), iptr,
                                     len(outputs), ot, orank, odims.ctypes.data_as(ctypes.POINTER(ctypes.c_int64)), optr, ws, stream)


@pytest.fixture(scope="session")
def trt(tmp_path_factory) -> Harness:
    try:
        library = turboquant.trt_plugin_path()
    except turboquant.LibraryNotBuiltError as e:
        pytest.skip(f"TensorRT plugin library not built: {e}")
    trt_inc, cuda_inc = _include_dirs()
    if trt_inc is None or cuda_inc is None:
        pytest.skip("TensorRT plugin tests need the TensorRT headers (TENSORRT_INCLUDE_DIR or third_party/) and "
                    "cuda_runtime_api.h (CUDA_HOME) to compile their harness")
    cxx = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler to build the TensorRT test harness")
    so = tmp_path_factory.mktemp("trt") / "harness.so"
    subprocess.run([cxx, "-std=c++17", "-shared", "-fPIC", "-O1", "-o", str(so), str(HERE / "harness.cc"),
                    "-isystem", trt_inc, "-isystem", cuda_inc, "-ldl"], check=True)
    return Harness(so, library)


def torch_cuda_reason() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed (the enqueue tests hold device buffers in torch tensors)"
    if not torch.cuda.is_available():
        return "no CUDA device for torch"
    return None
