"""Checks the bench subcommands make before anything is measured: their output files, the memory a
run will allocate, the custom-op library. Each raises ValueError with a message naming what was wrong."""

from __future__ import annotations

import argparse
import math
import os
import sys

from ..arguments import check_output_file, check_plot_file

PROG = "python -m turboquant.bench"


def fail(what: str, message: str) -> int:
    """One line on stderr and exit status 2 (bad input)."""
    print(f"{PROG} {what}: error: {message}", file=sys.stderr)
    return 2


def non_negative_float(text: str) -> float:
    """argparse type: a finite number >= 0 (nan compares false to everything, so it is named)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, not {text!r}") from None
    if not math.isfinite(v) or v < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number, zero or more, not {text}")
    return v


def check_outputs(files: dict[str, str | None], plots: tuple[str, ...] = ()) -> None:
    """Each named output (option -> path; None: not asked for) can be written as a new file, plots
    in a format matplotlib saves, and no two options name the same file."""
    seen: dict[str, str] = {}
    for option, path in files.items():
        if path is None:
            continue
        (check_plot_file if option in plots else check_output_file)(path, option)
        key = os.path.realpath(path)  # ./a.json and a.json, or a link's parent, are one file
        if key in seen:
            raise ValueError(f"{option} {path} is also {seen[key]}'s file; give each output its own name")
        seen[key] = option


def host_memory() -> int | None:
    """The machine's physical memory in bytes, or None where it cannot be read."""
    try:
        import psutil

        return int(psutil.virtual_memory().total)
    except ImportError:
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - a system that does not say
        return None


def check_fits(need: int, what: str) -> None:
    """Refuses a run whose arrays alone would need more than the machine's memory."""
    total = host_memory()
    if total is not None and need > total:
        raise ValueError(f"{what} needs about {_gb(need)} of arrays, more than this machine's {_gb(total)} of memory")


def _gb(n: int) -> str:
    return f"{n / 1e9:.3g} GB"


def check_library() -> None:
    """The custom-op library that our candidates run on can be registered with ONNX Runtime."""
    import onnxruntime as ort

    from .._libs import ort_library_path

    try:
        path = ort_library_path()
        ort.SessionOptions().register_custom_ops_library(path)
    except FileNotFoundError as e:  # LibraryNotBuiltError: not built, or the variable names no file
        raise ValueError(f"turboquant's ONNX Runtime library: {e}") from None
    except Exception as e:  # noqa: BLE001 - ORT's own refusal of a file that is no library for it
        detail = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        raise ValueError(f"turboquant's ONNX Runtime library {path} cannot be loaded: {detail}") from None

