"""One driver per output folder: `python -m pipeline.tune` holds an exclusive lock on `<output>/.study.lock` for the
study's life.

Two drivers on one folder (a `--resume` started beside a running study) tell Optuna and MLflow contradicting things:
the second one's trials collide with the first's, and the next resume measures the baseline again. The lock is
`flock(2)` on a file in the folder, which the kernel releases when the holder dies, however it dies; the file holds
the holder's PID, so a refusal can name it. A driver that ends normally empties the file; one that was killed leaves
its PID there, and the next driver takes the lock over and says so. The file descriptor is not inherited by the
programs the driver starts (Python opens it close-on-exec), so an engine left running cannot keep the folder locked.
"""

from __future__ import annotations

import fcntl
import os
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from pipeline.errors import PipelineError

LOCK_FILE = ".study.lock"


class StudyLocked(PipelineError):
    """Another process holds the folder's lock."""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        return True
    return True


def holder_pid(text: str) -> int | None:
    """The PID a lock file holds, or None (empty: released; anything else: not ours to read). Pure."""
    first = text.strip().split("\n", 1)[0].strip()
    return int(first) if first.isdigit() else None


def refusal(path: Path, pid: int | None, running: bool) -> str:
    """The one line that refuses a second driver. Pure."""
    if pid is None:
        who = "another process (its PID is not recorded yet)"
    elif running:
        who = f"the study driver with PID {pid}"
    else:
        who = f"a process started by PID {pid}, which has ended"
    return (f"{path.parent} is in use: {who} holds {path}. A second driver on the same folder would corrupt the "
            f"study. Fix: wait for it to finish or stop it (kill -INT {pid or '<pid>'}), then continue with --resume")


def takeover_note(path: Path, pid: int | None) -> str | None:
    """What to say when the lock was free but the file still names a driver (it was killed). Pure."""
    if pid is None or pid == os.getpid():
        return None
    return f"{path}: PID {pid} ended without releasing the study's lock (killed?); this driver takes it over"


@dataclass
class StudyLock:
    """The held lock; `release()` (or leaving the `with` block) empties the file and unlocks it."""

    path: Path
    fd: int
    note: str | None = None
    created: bool = False  # this lock created the folder: an empty one is removed again (nothing blocks a retry)
    released: bool = field(default=False, init=False)

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        try:
            os.ftruncate(self.fd, 0)  # empty = released cleanly: the next driver has nothing to take over
            if self.created and [p.name for p in self.path.parent.iterdir()] == [LOCK_FILE]:
                self.path.unlink()
                self.path.parent.rmdir()
        finally:
            os.close(self.fd)  # closing the descriptor releases the flock

    def __enter__(self) -> StudyLock:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()


def acquire(out: Path) -> StudyLock:
    """Lock `out` (created if missing) for this process, or raise StudyLocked naming the holder. Never blocks."""
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    path = out / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        text = os.pread(fd, 64, 0).decode("ascii", "replace")
        os.close(fd)
        pid = holder_pid(text)
        raise StudyLocked(refusal(path, pid, pid is not None and alive(pid))) from None
    except BaseException:
        os.close(fd)
        raise
    previous = holder_pid(os.pread(fd, 64, 0).decode("ascii", "replace"))
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    os.fsync(fd)
    return StudyLock(path, fd, takeover_note(path, previous), created)
