"""The example's folder and its steps' outputs: made by the example, reused by its later runs, and
never a file of the user's."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

from ..arguments import check_output_folder

MARK = ".turboquant-example"  # in a folder the example made: its models are reused, not made again


def workspace(out: str, files: tuple[str, ...]) -> pathlib.Path:
    """The example's folder: new, or one an earlier run made (its models reused); a folder holding
    files of the example's names that it did not make is refused, so no file of the user's is touched."""
    path = check_output_folder(out, "--out")
    if path.is_dir() and not (path / MARK).exists():
        taken = [f for f in files if os.path.lexists(path / f)]
        if taken:
            raise ValueError(f"--out {out} holds {taken[0]}, which the example did not write; give another folder")
    path.mkdir(parents=True, exist_ok=True)
    (path / MARK).touch()
    return path


def rewrite(src: pathlib.Path, dst: pathlib.Path, preset: str, step: str) -> None:
    """`python -m turboquant.export` as a user runs it, unless an earlier run wrote dst."""
    if dst.exists():
        print(f"{step} {dst} exists from an earlier run; kept (delete it to rewrite again)", flush=True)
        return
    cmd = [sys.executable, "-m", "turboquant.export", str(src), "--preset", preset, "-o", str(dst)]
    print(f"{step} {' '.join(cmd[1:])}", flush=True)
    subprocess.run(cmd, check=True)
