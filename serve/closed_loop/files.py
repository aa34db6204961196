"""Files in folders others may reach (a capture directory, the loop's command queue).

Reading: regular files only, opened without blocking, so a FIFO (whose open or read would wait for a writer
forever), a device or a folder with a file's name is refused at once instead of hanging the reader.
Writing captured data (`serve.closed_loop.capture`, the re-tune's copies): into a folder that is the user's own and
closed to others, under an unpredictable temporary name created with O_EXCL | O_NOFOLLOW, mode 0600 from the first
byte, renamed into place.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path
from typing import Any

__all__ = ["NotRegular", "open_regular", "read_regular", "is_regular", "DIR_MODE", "FILE_MODE",
           "private_dir_problem", "make_private_dir", "write_private", "part_files"]

DIR_MODE, FILE_MODE = 0o700, 0o600  # captured prompts are user data: operators only (as identity.json, promoted.yaml)


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


def private_dir_problem(path: Path) -> str | None:
    """Why an existing directory must not hold captured data (None: it may, or it does not exist yet). Pure
    reading: others may read or write it, or another user owns it."""
    try:
        info = path.stat()
    except FileNotFoundError:
        return None
    if not stat.S_ISDIR(info.st_mode):
        return f"{str(path)!r} exists and is not a directory"
    if hasattr(os, "geteuid") and info.st_uid != os.geteuid():
        return (f"{str(path)!r} belongs to another user (uid {info.st_uid}); give a directory of this user's own "
                "(or a new path: it is created 0700)")
    if info.st_mode & 0o077:
        return (f"{str(path)!r} is open to other users (mode {stat.S_IMODE(info.st_mode):o}): they could read the "
                f"captured prompts or plant files in it. Fix: `chmod 700 {path}`, or give a new path (created 0700)")
    return None


def make_private_dir(path: Path) -> None:
    """Create `path` (and missing parents) with the capture's mode; an existing directory must already be private
    (`private_dir_problem`: ValueError naming the fix otherwise)."""
    problem = private_dir_problem(path)
    if problem:
        raise ValueError(f"capture directory {problem}")
    if path.is_dir():
        return
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, DIR_MODE)  # mkdir's mode is cut by the umask; chmod is not


def write_private(write: Any, path: Path) -> None:
    """`write(handle)` into a new temporary file, then rename it to `path`; the file is FILE_MODE from the first byte
    (created so, not chmod-ed after). The temporary name is unpredictable and created with O_EXCL | O_NOFOLLOW: a
    file or link planted in the folder under any name is never opened, let alone written through; the rename
    replaces whatever `path` was (a link itself, not its target)."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(tmp, flags, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)  # the umask may have removed bits of FILE_MODE at creation
        with os.fdopen(fd, "wb") as handle:
            write(handle)
        os.replace(tmp, path)  # readers (merge, the bound's count) never see half a file
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def part_files(directory: Path) -> list[Path]:
    """The capture's part files in `directory`: `part-*.parquet` names that are regular files themselves (no link,
    FIFO or folder), sorted."""
    return [p for p in sorted(Path(directory).glob("part-*.parquet")) if is_regular(p)]
