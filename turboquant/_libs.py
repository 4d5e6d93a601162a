"""Where the built native libraries are: inside the installed package, under turboquant/lib."""

from __future__ import annotations

import os
import pathlib

LIB_DIR = pathlib.Path(__file__).resolve().parent / "lib"


class LibraryNotBuiltError(FileNotFoundError):
    """A native library variant was not built into this installation."""


def _installed(filename: str) -> pathlib.Path | None:
    """The library in the installed distribution, also when `turboquant` was imported from a source
    checkout (python -m from the repository root puts the checkout first on sys.path)."""
    try:
        from importlib.metadata import PackageNotFoundError, distribution

        path = pathlib.Path(distribution("turboquant-onnx").locate_file(f"turboquant/lib/{filename}"))
    except (ImportError, PackageNotFoundError):
        return None
    return path if path.is_file() else None


def _find(env_var: str, filename: str, what: str, how: str) -> str:
    override = os.environ.get(env_var)
    if override:
        path = pathlib.Path(override)
        if not path.is_file():
            raise LibraryNotBuiltError(f"{env_var} points at {path}, which is not a file")
        return str(path)
    path = LIB_DIR / filename
    if not path.is_file():
        path = _installed(filename) or path
    if not path.is_file():
        raise LibraryNotBuiltError(
            f"the {what} ({filename}) is not in {LIB_DIR}: {how}. Set {env_var} to use a library built elsewhere."
        )
    return str(path)


def ort_library_path() -> str:
    """Path of the ONNX Runtime custom-op library (for SessionOptions.register_custom_ops_library)."""
    return _find(
        "TURBOQUANT_ORT_LIBRARY",
        "libturboquant_ort.so",
        "ONNX Runtime custom-op library",
        "install the package with pip (which builds it), not by importing the source tree",
    )


def trt_plugin_path() -> str:
    """Path of the TensorRT plugin library (for IPluginRegistry.load_library / trtexec)."""
    return _find(
        "TURBOQUANT_TRT_PLUGIN",
        "libturboquant_trt.so",
        "TensorRT plugin library",
        "it is built only when the install finds nvcc and the TensorRT headers (TENSORRT_INCLUDE_DIR or scripts/fetch_headers.sh)",
    )
