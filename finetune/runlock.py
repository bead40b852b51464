"""One writer per run directory: the run's main process holds an exclusive lock on ``<run>/.lock`` while it runs.

Two runs on one directory would interleave their checkpoints and their ``history.jsonl``. The lock is an
``fcntl.flock`` on a file holding the holder's pid, so a second run (or a ``--resume`` while the first run's processes
still live — a SIGKILLed ``accelerate launch`` leaves its workers running) is refused with one line naming that pid.
The kernel drops the lock when the holder dies, however it dies; a lock file left behind holds no lock.

    >>> lock = acquire(Path("runs/mine"))      # ConfigError naming the holder's pid when another run holds it
    >>> release_all()                           # at the end of the run (also at exit)

Only the main process of a run takes the lock; its other processes write nothing that a second run could tear.
"""

from __future__ import annotations

import atexit
import fcntl
import os
from pathlib import Path

from finetune.errors import ConfigError

LOCK = ".lock"

_held: dict = {}  # directory → (file descriptor, directories this process created for it, outermost first)


def acquire(directory: Path) -> Path:
    """Create ``directory`` if needed and take its lock for this process; return the directory.

    Raises:
        ConfigError: another live process holds the lock (named by its pid), or the directory cannot be created.
    """
    directory = Path(directory).absolute()
    if directory in _held:
        return directory
    created = [p for p in (directory, *directory.parents) if not p.exists()][::-1]
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd = try_lock(directory / LOCK)
    except OSError as e:
        _remove_created(created)
        reason = "a file is in the way" if isinstance(e, (NotADirectoryError, FileExistsError)) else \
            (e.strerror or str(e)).lower()
        raise ConfigError(f"output.dir: cannot write {directory} ({reason}); give a directory you can write to") \
            from None
    if fd is None:
        _remove_created(created)
        raise ConfigError(f"output.dir: {directory} is in use by another run (pid {holder(directory)}); wait for "
                          "it to end, or stop it, or pick another directory")
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    _held[directory] = (fd, created)
    return directory


def try_lock(path: Path):
    """An open descriptor of ``path`` holding its exclusive lock, or None when another process holds it."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        try:
            if os.fstat(fd).st_ino == os.stat(path).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)  # the previous holder removed the file between our open and our lock: lock the new one


def holder(directory: Path) -> str:
    """The pid written in ``directory``'s lock file ("unknown" when unreadable)."""
    try:
        return (Path(directory) / LOCK).read_text().strip() or "unknown"
    except OSError:
        return "unknown"


def release(directory: Path) -> None:
    """Drop this process's lock on ``directory`` and remove the lock file, and the directories taking the lock
    created if they stayed empty (a refused run leaves nothing behind)."""
    directory = Path(directory).absolute()
    fd, created = _held.pop(directory, (None, []))
    if fd is None:
        return
    try:
        os.unlink(directory / LOCK)  # while still locked: a process waiting on this file re-checks and retries
    except OSError:
        pass
    os.close(fd)
    _remove_created(created)


def release_all() -> None:
    for directory in list(_held):
        release(directory)


def _remove_created(created: list) -> None:
    for path in reversed(created):
        try:
            path.rmdir()
        except OSError:
            return


atexit.register(release_all)
