"""Reading files that others can put in a folder the endpoint or the loop reads (a capture directory, the loop's
command queue): regular files only, opened without blocking, so a FIFO (whose open or read would wait for a writer
forever), a device or a folder with a file's name is refused at once instead of hanging the reader.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

__all__ = ["NotRegular", "open_regular", "read_regular", "is_regular"]


class NotRegular(OSError):
    """The path exists but is not a regular file (a FIFO, a device, a folder, or a link where links are refused)."""


def open_regular(path: str | Path, follow_links: bool = True) -> int:
    """A read-only descriptor of `path`, checked to be a regular file after opening (so nothing can be swapped in
    between a check and the open). O_NONBLOCK: opening a FIFO does not wait for a writer. `follow_links` False
    refuses a symbolic link (O_NOFOLLOW)."""
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    if not follow_links:
        flags |= getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if not follow_links and os.path.islink(path):
            raise NotRegular(exc.errno, "a symbolic link, not a regular file", str(path)) from None
        raise
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise NotRegular(0, f"not a regular file (mode {stat.filemode(info.st_mode)})", str(path))
    os.set_blocking(fd, True)  # a regular file: the flag only mattered for the open
    return fd


def read_regular(path: str | Path, limit: int | None = None, follow_links: bool = True) -> bytes:
    """The bytes of the regular file at `path` (`open_regular`); more than `limit` bytes is an OSError."""
    with os.fdopen(open_regular(path, follow_links), "rb") as handle:
        data = handle.read(-1 if limit is None else limit + 1)
    if limit is not None and len(data) > limit:
        raise OSError(0, f"larger than {limit} bytes", str(path))
    return data


def is_regular(path: str | Path) -> bool:
    """Whether `path` itself (not a link's target) is a regular file now."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False
