"""Argument checks shared by the command-line tools: counts, head sizes, devices and output paths,
each refused with a message naming what was wrong before any work starts."""

from __future__ import annotations

import argparse
import os
import pathlib
import tempfile

from .saving import refuse_existing


LARGEST = 2**31 - 1  # counts ONNX Runtime and the kernels take as C ints; beyond it a count is a typo


def max_threads() -> int:
    """The most intra-op threads an option takes: 4 per core of this machine (at least 16); ONNX
    Runtime starts every one, and 100000 spinning threads never finish."""
    return max(16, 4 * (os.cpu_count() or 1))


def _integer(text: str, what: str) -> int:
    text = str(text).strip()
    if len(text.lstrip("+-")) > 30:  # int() of a huge literal takes a while, and no count is that long
        raise argparse.ArgumentTypeError(f"{text[:20]}... is too large (at most {LARGEST})")
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None


def positive(text: str) -> int:
    """argparse type: an integer from 1 to 2**31 - 1."""
    n = _integer(text, "a positive integer")
    if n <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive count, not {text}")
    if n > LARGEST:
        raise argparse.ArgumentTypeError(f"{text} is too large (at most {LARGEST})")
    return n


def non_negative(text: str) -> int:
    """argparse type: an integer from 0 to 2**31 - 1."""
    n = _integer(text, "a non-negative integer")
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be zero or more, not {text}")
    if n > LARGEST:
        raise argparse.ArgumentTypeError(f"{text} is too large (at most {LARGEST})")
    return n


def threads(text: str) -> int:
    """argparse type: an intra-op thread count, 1 to max_threads()."""
    n = positive(text)
    if n > max_threads():
        raise argparse.ArgumentTypeError(f"{text} threads is more than {max_threads()} (4 per core of this machine)")
    return n


def at_most(limit: int, kind=positive):
    """argparse type: `kind` (positive, non_negative) and at most `limit`."""
    def check(text: str) -> int:
        n = kind(text)
        if n > limit:
            raise argparse.ArgumentTypeError(f"{text} is more than {limit}")
        return n

    check.__name__ = f"{kind.__name__}_at_most_{limit}"
    return check


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
    """Refuses (ValueError naming `what`) a file path that cannot be written: a name that exists (a
    file is never overwritten), an empty name, a name longer than the file system takes, a parent that
    is a file or a folder it may not write in. Leaves nothing behind: missing parent folders are
    created later, by the writer (turboquant.saving)."""
    if not str(path).strip():
        raise ValueError(f"{what} is an empty name")
    path = pathlib.Path(path)
    parent = _nearest_existing(path.parent, f"{what} {path}")
    if not parent.is_dir():
        raise ValueError(f"{what} {path}: {parent} is a file, not a folder")
    limit = _name_max(parent)
    for part in path.parts[len(parent.parts):]:  # parent is one of path's ancestors
        if len(os.fsencode(part)) > limit:
            raise ValueError(f"{what} {path}: the name {part[:40]}... is longer than the {limit} bytes its file system takes")
    if os.path.isdir(path):
        raise ValueError(f"{what} {path} is a folder; give a file name")
    refuse_existing([path], what)
    check_writable_folder(parent, f"{what} {path}")
    return path


def check_output_folder(folder: str | os.PathLike, what: str) -> pathlib.Path:
    """Refuses (ValueError naming `what`) a folder path where nothing could be written: an empty name,
    a file, a nearest existing parent that is a file or takes no files. Makes nothing."""
    if not str(folder).strip():
        raise ValueError(f"{what} is an empty name")
    path = pathlib.Path(folder)
    existing = _nearest_existing(path, f"{what} {folder}")  # the rest made later, by the writer
    if existing == path and not path.is_dir():
        raise ValueError(f"{what} {folder} is a file, not a folder")
    if not existing.is_dir():
        raise ValueError(f"{what} {folder}: {existing} is a file, not a folder")
    check_writable_folder(existing, f"{what} {folder}")
    return path


def _nearest_existing(path: pathlib.Path, what: str) -> pathlib.Path:
    """path or its nearest ancestor that exists; ValueError where that is a link to nothing (the
    writer could not make the folders below it)."""
    while not os.path.lexists(path):  # os.path, not pathlib: a name too long is "missing", not an OSError
        path = path.parent
    if not os.path.exists(path):
        raise ValueError(f"{what}: {path} is a link to {os.readlink(path)}, which does not exist")
    return path


def check_writable_folder(folder: str | os.PathLike, what: str) -> None:
    """ValueError unless a file can be made in `folder` (tried: permissions alone do not say so for
    root, nor in /proc or /sys)."""
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise ValueError(f"{what}: cannot write in {folder} ({e.strerror or e})") from None


def check_plot_file(path: str | os.PathLike, what: str = "--plot") -> pathlib.Path:
    """check_output_file, and a suffix matplotlib can save (.png, .svg, .pdf, ...)."""
    from matplotlib.backend_bases import FigureCanvasBase

    path = check_output_file(path, what)
    kinds = set(FigureCanvasBase.get_supported_filetypes()) - {"pgf"}  # pgf: saved through a LaTeX installation
    if path.suffix.lstrip(".").lower() not in kinds:
        raise ValueError(f"{what} {path}: a plot is saved as one of {', '.join('.' + k for k in sorted(kinds))}")
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
    if path.is_dir():
        raise ValueError(f"{path} is a folder, not an ONNX model")
    if not path.is_file():
        raise ValueError(f"{path}: no such file")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as e:  # noqa: BLE001 - any parse failure means the same thing to the user
        detail = str(e).splitlines()[0][:200] if str(e) else ""
        raise ValueError(f"{path}: not an ONNX model ({type(e).__name__}: {detail})") from None
    missing = sorted(f for f in external_data_files(model, path.parent) if not f.is_file())
    if missing:
        raise ValueError(f"{path}: its external data file {missing[0]} is missing")
    return model


def external_data_files(model, folder: pathlib.Path) -> set[pathlib.Path]:
    """The files that the tensors of a ModelProto (its graphs and subgraphs) keep their data in."""
    import onnx

    def tensors(graph):
        yield from graph.initializer
        for node in graph.node:
            for a in node.attribute:
                yield from ([a.t] if a.HasField("t") else []) + list(a.tensors)
                for g in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                    yield from tensors(g)

    files = set()
    for t in tensors(model.graph):
        if t.data_location == onnx.TensorProto.EXTERNAL:
            location = next((e.value for e in t.external_data if e.key == "location"), "")
            files.add(folder / location)
    return files
