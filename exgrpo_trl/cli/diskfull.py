"""A full disk (a quota used up, a read-only filesystem) while a command writes, told in one line.

Python's own writes raise OSError with the errno (ENOSPC, EDQUOT, EROFS); safetensors raises its own error class with
the message only, and torch's checkpoint writer a RuntimeError without either ("unexpected pos 3703616 vs 3703508"),
so an error raised while the filesystem has almost nothing left is taken for a full disk too.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

REASONS = {
    errno.ENOSPC: "no space left on the disk",
    errno.EDQUOT: "the disk quota is used up",
    errno.EROFS: "the filesystem is read-only",
}
NEARLY_FULL = 1 << 20  # bytes free below which a failed write is taken for a full disk


class DiskFull(OSError):
    """A write failed for lack of space (or of write access); the message is the whole line to show."""


def _existing(path: str | os.PathLike) -> Path:
    path = Path(path).expanduser().resolve()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def disk_problem(error: BaseException, folder: str | os.PathLike) -> str | None:
    """Why writing into `folder` failed, when `error` (or an exception it was raised from) says the disk is full, a
    quota is used up or the filesystem is read-only (by its errno or, for a writer that keeps only the message, its
    words), or is a write error (OSError, RuntimeError) raised while the filesystem holding `folder` has less than
    `NEARLY_FULL` free; None otherwise."""
    reason, seen = None, set()
    stack = [error]
    while stack and reason is None:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in REASONS:
            reason = REASONS[e.errno]
            folder = e.filename or folder  # the file the write was for, wherever it is
        stack += [e.__cause__, e.__context__]
    try:
        free = shutil.disk_usage(_existing(folder)).free
    except OSError:
        free = None
    if reason is None and "No space left on device" in str(error):  # a writer that keeps only the message
        reason = REASONS[errno.ENOSPC]
    nearly_full = free is not None and free < NEARLY_FULL
    if reason is None and isinstance(error, (OSError, RuntimeError)) and nearly_full:  # torch's: neither
        reason = REASONS[errno.ENOSPC]
    if reason is None:
        return None
    left = f", {_size(free)} free there" if free is not None and reason != REASONS[errno.EROFS] else ""
    return f"{reason} ({Path(folder).expanduser()}{left})"


@contextlib.contextmanager
def told_when_full(folder: str | os.PathLike, what: str, then: Callable[[], str]) -> Iterator[None]:
    """Within the block, a write that fails for lack of space becomes `DiskFull` with one line: `what` could not be
    written, why (`disk_problem`), and `then()` (how to go on)."""
    try:
        yield
    except Exception as error:  # safetensors raises its own error class for a failed write
        if isinstance(error, DiskFull):
            raise
        problem = disk_problem(error, folder)
        if problem is None:
            raise
        raise DiskFull(f"could not write {what}: {problem}; free some space, then {then()}") from error
