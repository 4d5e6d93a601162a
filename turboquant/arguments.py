"""Argument checks shared by the command-line tools: counts, head sizes, devices and output paths,
each refused with a message naming what was wrong before any work starts."""

from __future__ import annotations

import argparse
import os
import pathlib


def _integer(text: str, what: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None


def positive(text: str) -> int:
    """argparse type: an integer >= 1."""
    n = _integer(text, "a positive integer")
    if n <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive count, not {text}")
    return n


def non_negative(text: str) -> int:
    """argparse type: an integer >= 0."""
    n = _integer(text, "a non-negative integer")
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be zero or more, not {text}")
    return n


def non_negative_list(text: str) -> list[int]:
    """argparse type: comma-separated integers >= 0 (device ids)."""
    return [non_negative(x.strip()) for x in text.split(",") if x.strip()]


def head_dim(text: str) -> int:
    """argparse type: a head size the packed formats support."""
    from .config import check_head_dim

    try:
        return check_head_dim(_integer(text, "an integer head size"))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def cuda_missing() -> str | None:
    """Why --device cuda cannot run here, or None when ONNX Runtime has its CUDA provider."""
    import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return "this ONNX Runtime has no CUDAExecutionProvider (install onnxruntime-gpu on a machine with a GPU)"
    return None


def check_output_file(path: str | os.PathLike, what: str = "output") -> pathlib.Path:
    """Refuses (ValueError naming `what`) a file path that cannot be written: an existing folder, a
    name longer than the file system takes, a parent that is a file or a folder it may not write in.
    Writes nothing: missing parent folders are created later, by the writer."""
    path = pathlib.Path(path)
    parent = path.parent
    while not os.path.exists(parent):  # os.path, not pathlib: a name too long is "missing", not an OSError
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"{what} {path}: {parent} is a file, not a folder")
    limit = _name_max(parent)
    for part in path.parts[len(parent.parts):]:  # parent is one of path's ancestors
        if len(os.fsencode(part)) > limit:
            raise ValueError(f"{what} {path}: the name {part[:40]}... is longer than the {limit} bytes its file system takes")
    if os.path.isdir(path):
        raise ValueError(f"{what} {path} is a folder; give a file name")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{what} {path}: {parent} is not writable")
    return path


def _name_max(folder: pathlib.Path) -> int:
    try:
        return os.pathconf(folder, "PC_NAME_MAX")
    except (OSError, ValueError):  # pragma: no cover - a file system that does not say
        return 255



def read_onnx(path: str | os.PathLike):
    """The ModelProto at `path`, without its external data; ValueError when it is not an ONNX model."""
    import onnx

    path = pathlib.Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such file")
    try:
        return onnx.load(str(path), load_external_data=False)
    except Exception as e:  # noqa: BLE001 - any parse failure means the same thing to the user
        detail = str(e).splitlines()[0][:200] if str(e) else ""
        raise ValueError(f"{path}: not an ONNX model ({type(e).__name__}: {detail})") from None
