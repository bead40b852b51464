"""Crash-safe writes: a file replaced whole or not at all, a folder's entries synced, and what a failed write means
(a full disk). The checkpoints, history.jsonl and metrics are written through these."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """Make a folder's entries (a file created or renamed in it) survive a power cut."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_text(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` whole: written beside it, synced, renamed over it; a crash leaves the old file
    or the new one, never a torn one."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def disk_full(error: BaseException, directory=None) -> bool:
    """Whether ``error`` (or what caused it) is a full disk: ENOSPC / EDQUOT, the same said in words (safetensors),
    or torch's zip writer failing ("unexpected pos …", "file write failed": it drops the errno) while
    ``directory``'s disk has no room left."""
    e = error
    while e is not None:
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(e) or "Disk quota exceeded" in str(e):
            return True
        e = e.__cause__ or e.__context__
    torn = isinstance(error, RuntimeError) and ("unexpected pos" in str(error) or "file write failed" in str(error))
    if torn and directory is not None:
        try:
            return shutil.disk_usage(directory).free < 1 << 20
        except OSError:
            return False
    return False
