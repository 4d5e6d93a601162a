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
    """A temporary folder inside `folder` (created with its parents), removed with what is left in it;
    the folders made for it are removed too where nothing was published into them."""
    folder = pathlib.Path(folder)
    made = []  # deepest first
    missing = folder
    while not os.path.lexists(missing):
        made.append(missing)
        missing = missing.parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=".tq-", dir=folder))
    except BaseException:
        _remove_empty(made)
        raise
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        _remove_empty(made)


def _remove_empty(folders: list[pathlib.Path]) -> None:
    for f in folders:
        try:
            f.rmdir()
        except OSError:  # it holds an output (or another's file): kept, with its parents
            return


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


def publish_folder(src: pathlib.Path, dst: pathlib.Path, what: str = "output") -> None:
    """Gives a staged folder its name, which must not exist (a rename that cannot replace, where the
    kernel and file system have one; elsewhere checked, then renamed)."""
    if not _rename_noreplace(src, dst, what):
        refuse_existing([dst], what)
        os.rename(src, dst)


def _rename_noreplace(src: pathlib.Path, dst: pathlib.Path, what: str) -> bool:
    """Linux's renameat2(RENAME_NOREPLACE): True when done, False where it is not available; OutputExists
    where dst exists."""
    import ctypes

    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2  # the C library the interpreter runs on
    except (OSError, AttributeError):
        return False
    at_fdcwd, noreplace = -100, 1
    if renameat2(at_fdcwd, os.fsencode(src), at_fdcwd, os.fsencode(dst), noreplace) == 0:
        return True
    code = ctypes.get_errno()
    if code == errno.EEXIST:
        raise OutputExists(f"{what} {dst} appeared while it was being written; left as it was")
    if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(src), None, str(dst))


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
