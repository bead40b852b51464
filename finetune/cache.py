"""Folders built once and reused by later runs (a GGUF model converted to safetensors, a trained tokenizer, a
tokenized data set), safe when several processes want the same folder at the same time.

* **One process builds.** It holds a file lock beside the folder while it builds, so two runs (or two ranks) never
  build the same folder at once. Inside a process group only global rank 0 builds: transformers' ``save_pretrained``
  writes a model's weights and config on rank 0 alone once ``torch.distributed`` is initialized (even when told
  ``is_main_process=True``), so a copy built on another rank would hold a tokenizer and nothing else.
* **The others wait** for the folder, up to a timeout, and stop with one line when it does not come.
* **A folder counts only when complete.** Its manifest, written last, lists every file with its size; a folder
  without one, or whose files differ from it (a half-written folder, one missing its weights), is rebuilt, never
  used. The folder is built under a temporary name and renamed into place whole.
* **A cache that cannot be built in is one line**, on every process, before building: FINETUNE_CACHE naming a file
  or a folder this process may not write in. A complete folder is only read, so a read-only cache that holds it
  still serves.

    >>> folder(root() / "tokenizers" / key, lambda tmp: tokenizer.save(str(tmp / "tokenizer.json")), "tokenizer")
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

import torch.distributed as dist

from finetune.errors import ConfigError
from finetune.runlock import try_lock


def file_digest(path):
    """The sha256 of a file's bytes, read in blocks (a checkpoint's manifest, a converted model's key); more may be
    added to it before ``hexdigest()``."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return digest


MANIFEST = "finetune-cache.json"
WAIT_SECONDS = float(os.environ.get("FINETUNE_CACHE_TIMEOUT", 3600))  # a large GGUF model converts for minutes
POLL_SECONDS = 0.2


def root() -> Path:
    """Where caches live: ``$FINETUNE_CACHE``, else ``~/.cache/finetune`` (read at each call, so a test or a job can
    point it elsewhere)."""
    return Path(os.environ.get("FINETUNE_CACHE") or Path.home() / ".cache" / "finetune")


def folder(target: Path, build: Callable[[Path], None], what: str, timeout: float = WAIT_SECONDS) -> Path:
    """``target``, complete: built by ``build(tmp)`` into a fresh folder ``tmp`` when it is missing or incomplete.

    Inside a process group this is a collective: every process calls it at the same point (as a task's ``build``
    is called on every process); rank 0 builds and the others wait for its folder.

    Args:
        target: the cache folder.
        build: writes every file of the folder into the empty folder it is given.
        what: what the folder holds, for the error lines ("converted GGUF model").
        timeout: seconds to wait for another process's build.

    Raises:
        ConfigError: ``cache: …`` when another process's build did not finish within ``timeout``, or failed.
    """
    target = Path(target)
    token = _group_token()
    if not is_complete(target):  # every process, so that all refuse alike (a complete folder is only read)
        _make_room(target.parent)
    if token is not None and not _is_rank_zero():
        return _wait(target, what, timeout, token)
    try:
        if not is_complete(target):
            with _locked(target, what, timeout):
                if not is_complete(target):
                    _publish(target, build)
    except BaseException as error:
        if token is not None:  # the waiting processes stop with this line instead of waiting out the timeout
            target.parent.mkdir(parents=True, exist_ok=True)
            _failure_note(target, token).write_text(_one_line(error))
        raise
    return target


def _make_room(parent: Path) -> None:
    """Make ``parent``, the folder a cache folder is built in, or refuse with one line naming FINETUNE_CACHE when
    it cannot be written in: a file where a folder must be (a typo, a stale mount) or a folder this process may not
    write in (os.access: what the kernel would say, a read-only file system included)."""
    try:
        parent.mkdir(parents=True, exist_ok=True)
        writable = os.access(parent, os.W_OK | os.X_OK)
    except (NotADirectoryError, FileExistsError):
        raise unusable(parent, f"{_file_on_the_way(parent)} is a file, not a folder") from None
    except OSError as error:  # no permission to make it, a read-only file system
        raise unusable(parent, f"cannot make {parent} ({error.strerror or error})") from None
    if not writable:
        raise unusable(parent, f"no permission to write in {parent}")


def _file_on_the_way(path: Path) -> Path:
    """The first file among ``path`` and the folders above it."""
    return next((p for p in reversed([path, *path.parents]) if p.exists() and not p.is_dir()), path)


def unusable(parent: Path, why: str) -> ConfigError:
    """The one line for a cache folder this process cannot build in: named by FINETUNE_CACHE where it lies under
    the cache root (a folder a caller named itself is named as it is)."""
    base = Path(root())
    if parent != base and base not in parent.parents:
        return ConfigError(f"cache: {why}; give a folder you can write in")
    name = "FINETUNE_CACHE" if os.environ.get("FINETUNE_CACHE") else f"FINETUNE_CACHE (unset: {base})"
    return ConfigError(f"{name}: {why}; point it at a folder you can write in")


def is_complete(target: Path) -> bool:
    """Whether ``target`` holds exactly what its manifest lists (every file, at its size)."""
    try:
        listed = json.loads((Path(target) / MANIFEST).read_text())["files"]
        return bool(listed) and all((Path(target) / name).stat().st_size == size for name, size in listed.items())
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _files(directory: Path) -> dict:
    """Every file under ``directory`` but the manifest: relative path → size in bytes."""
    return {p.relative_to(directory).as_posix(): p.stat().st_size
            for p in sorted(directory.rglob("*")) if p.is_file() and p.name != MANIFEST}


def _publish(target: Path, build: Callable[[Path], None]) -> None:
    """Build into a temporary sibling, write the manifest last, and rename the whole folder into place (replacing an
    incomplete one). Called with the lock held, so no one else builds or replaces ``target`` meanwhile."""
    target.parent.mkdir(parents=True, exist_ok=True)
    for stale in target.parent.glob(f".{target.name}.tmp-*"):  # left by a builder that died mid-build
        shutil.rmtree(stale, ignore_errors=True)
    for note in target.parent.glob(f".{target.name}.failed-*"):  # earlier runs' failures, read by no one now
        note.unlink(missing_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    tmp.mkdir()
    try:
        build(tmp)
        (tmp / MANIFEST).write_text(json.dumps({"files": _files(tmp)}, indent=1))
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextmanager
def _locked(target: Path, what: str, timeout: float):
    """Hold the exclusive lock ``.<name>.lock`` beside ``target``; wait up to ``timeout`` s for another holder."""
    target.parent.mkdir(parents=True, exist_ok=True)
    path = target.with_name(f".{target.name}.lock")
    deadline = time.monotonic() + timeout
    while (fd := try_lock(path)) is None:
        if time.monotonic() > deadline:
            raise ConfigError(f"cache: another process has been building the {what} in {target} for over "
                              f"{timeout:.0f} s; wait for it or remove {path} and its folder")
        time.sleep(POLL_SECONDS)
    try:
        yield
    finally:
        os.close(fd)  # releases the lock


def _wait(target: Path, what: str, timeout: float, token: str) -> Path:
    """A process other than rank 0: wait until rank 0's folder is complete (or its build failed, or the timeout)."""
    deadline = time.monotonic() + timeout
    note = _failure_note(target, token)
    while not is_complete(target):
        if note.is_file():
            raise ConfigError(f"cache: rank 0 could not build the {what} in {target}: {note.read_text().strip()}")
        if time.monotonic() > deadline:
            raise ConfigError(f"cache: rank 0 did not finish the {what} in {target} within {timeout:.0f} s "
                              "(FINETUNE_CACHE_TIMEOUT); on several machines, put FINETUNE_CACHE on a shared disk")
        time.sleep(POLL_SECONDS)
    return target


def _group_token():
    """A name shared by this call on every process of the process group (rank 0's, broadcast), or None outside a
    group of several processes. It names rank 0's failure note, so a note left by an earlier run is never read."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    token = [uuid.uuid4().hex if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(token, src=0)
    return token[0]


def _is_rank_zero() -> bool:
    return dist.get_rank() == 0


def _failure_note(target: Path, token: str) -> Path:
    return target.with_name(f".{target.name}.failed-{token}")


def _one_line(error: BaseException) -> str:
    text = "; ".join(error.problems) if isinstance(error, ConfigError) else f"{type(error).__name__}: {error}"
    return (text.strip().splitlines() or [type(error).__name__])[0][:300]
