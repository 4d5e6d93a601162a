"""The command-line tools' one error boundary: whatever a tool's main lets through becomes one line on
stderr naming the input, and exit status 2; argparse's refusals are one line too (Parser).

A tool's own refusals (ValueError and its kinds: RewriteError, LayoutError, OutputExists) already
name what was wrong and are printed as they are; any other exception (ONNX Runtime's Fail, an
OSError of a full disk, numpy's errors on a file the checks let through) is named with the inputs
of the command line, its type and its first line.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from typing import Callable

STATUS = 2  # bad input, the status every tool's refusals exit with
LONGEST = 400  # characters of an exception's message kept in the line


class Parser(argparse.ArgumentParser):
    """argparse's parser, whose refusal of an argument is one line ("PROG: error: ...; --help for
    the options") and exit status 2, not the usage block and the error."""

    def error(self, message: str):
        self.exit(STATUS, f"{self.prog}: error: {_first_line(message)} (--help for the options)\n")


def _first_line(text: str) -> str:
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    line = " ".join(lines[:1]) if lines else ""
    return line if len(line) <= LONGEST else line[:LONGEST - 3] + "..."


def describe(e: BaseException) -> str:
    """One line for an exception: its message as it is for the tools' own ValueErrors, else its type
    and message (ONNX Runtime's messages put the reason after the status codes, on the first line)."""
    if isinstance(e, OSError) and e.strerror:
        where = f"{e.filename}: " if e.filename else ""
        return f"{where}{e.strerror}"
    text = _first_line(str(e)) or _first_line(repr(e))
    if isinstance(e, ValueError):
        return text
    return f"{type(e).__name__}: {text}"


def inputs_of(argv: list[str]) -> list[str]:
    """The command line's arguments that name files or folders that exist: the inputs a failure
    could be about."""
    named = []
    for a in argv:
        value = a.split("=", 1)[1] if a.startswith("--") and "=" in a else a
        if value.startswith("-") or value in named:
            continue
        try:
            if os.path.exists(value):
                named.append(value)
        except (OSError, ValueError):  # a name too long or holding a NUL names nothing
            continue
    return named


def quiet_runtime() -> None:
    """ONNX Runtime logs a failing node's error on stderr before raising it: the boundary's line is
    the one the user sees, so its logger keeps to fatal errors."""
    try:
        import onnxruntime as ort
    except ImportError:  # pragma: no cover - a dependency
        return
    ort.set_default_logger_severity(4)


def boundary(prog: str) -> Callable:
    """Decorates a tool's main(argv) -> int: argparse's own exits pass, and any other failure is one
    line "PROG: error: [INPUTS: ]WHAT" on stderr and exit status 2 (130 on Ctrl-C)."""
    def wrap(main: Callable) -> Callable:
        @functools.wraps(main)
        def run(argv: list[str] | None = None) -> int:
            args = sys.argv[1:] if argv is None else list(argv)
            try:
                quiet_runtime()
                return main(argv)
            except SystemExit:
                raise
            except KeyboardInterrupt:
                print(f"{prog}: interrupted", file=sys.stderr)
                return 130
            except BaseException as e:  # noqa: BLE001 - the boundary: nothing passes as a traceback
                what = describe(e)
                named = [p for p in inputs_of(args) if p not in what]
                if named and not isinstance(e, ValueError):
                    what = f"{', '.join(named)}: {what}"
                print(f"{prog}: error: {what}", file=sys.stderr)
                return STATUS
        return run
    return wrap
