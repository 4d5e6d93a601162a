"""Writing the tools' outputs: never over a file that exists, and atomically (each file written under
a temporary name in its folder, then linked to its name, which fails if the name was taken meanwhile;
a failure leaves none of the new files behind)."""

from __future__ import annotations

import contextlib
import errno
import os
import pathlib
import shutil
import tempfile
from typing import Callable, Iterable, Iterator


class OutputExists(ValueError):
    """An output's name is taken: turboquant does not overwrite files."""


def refuse_existing(paths: Iterable[str | os.PathLike], what: str = "output") -> None:
    """OutputExists naming the first of `paths` that exists (a file, a folder or a link, even a broken one)."""
    for p in paths:
        if os.path.lexists(p):
            raise OutputExists(f"{what} {p} exists; turboquant does not overwrite files (give a new name or remove it)")


@contextlib.contextmanager
def staging(folder: str | os.PathLike) -> Iterator[pathlib.Path]:
    """A temporary folder inside `folder` (created with its parents), removed with what is left in it."""
    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=".tq-", dir=folder))
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _publish_one(src: pathlib.Path, dst: pathlib.Path, what: str) -> None:
    try:
        os.link(src, dst)  # fails where dst exists: nothing is ever replaced
    except FileExistsError:
        raise OutputExists(f"{what} {dst} appeared while it was being written; left as it was") from None
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.EXDEV, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
            raise
        refuse_existing([dst], what)  # a file system without hard links: checked, then renamed
        os.rename(src, dst)


def publish(files: list[tuple[pathlib.Path, pathlib.Path]], what: str = "output") -> None:
    """Gives each staged file (source, name) its name, in order; if one fails, the ones already named
    are removed again, so the outputs appear together or not at all."""
    done: list[pathlib.Path] = []
    try:
        for src, dst in files:
            _publish_one(src, dst, what)
            done.append(dst)
    except BaseException:
        for dst in done:
            with contextlib.suppress(OSError):
                os.unlink(dst)
        raise


def write_new(path: str | os.PathLike, write: Callable[[pathlib.Path], None], what: str = "output") -> None:
    """Calls write(temporary path) and gives the file `path`, which must not exist."""
    path = pathlib.Path(path)
    refuse_existing([path], what)
    with staging(path.parent) as tmp:
        staged = tmp / path.name
        write(staged)
        publish([(staged, path)], what)


def write_new_text(path: str | os.PathLike, text: str, what: str = "output") -> None:
    write_new(path, lambda p: p.write_text(text), what)


def save_new_figure(fig, path: str | os.PathLike, what: str = "--plot", **kwargs) -> None:
    """A matplotlib figure saved to `path` (its format from the suffix, as matplotlib takes it)."""
    fmt = pathlib.Path(path).suffix.lstrip(".") or "png"
    write_new(path, lambda p: fig.savefig(p, format=fmt, **kwargs), what)
