"""Cache directory and the atomic, lock-protected build helper shared by all assets.

Builds run in a temporary directory inside the cache and are published with a single
``os.rename``, so a reader never sees a half-written directory.  A per-target ``fcntl``
lock keeps two processes from spending minutes on the same build; if the lock is somehow
bypassed (e.g. a filesystem without working locks) the rename still guarantees that one
complete copy wins and the other is discarded.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from tokenwire.settings import asset_cache_dir

Progress = Callable[[str], None]

MARKER = "tokenwire-asset.json"
"""File written last into every built directory: name, recipe version and source hashes."""


def cache_root() -> Path:
    """Root of all cached assets (``settings.asset_cache_dir``: the one place env is read)."""
    return asset_cache_dir()


def quiet(_: str) -> None:
    """Progress sink used when the caller passes none."""


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    """Hex SHA-256 of a file, streamed so large weights don't sit in memory twice."""
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def library_versions() -> dict[str, str]:
    """Versions of the libraries whose behaviour shapes the built files (for the marker)."""
    import tokenizers
    import torch
    import transformers

    return {
        "tokenizers": tokenizers.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def read_marker(target: Path) -> dict[str, Any] | None:
    """The parsed marker of a built directory, or None if it isn't a finished build."""
    try:
        data = json.loads((target / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _is_current(target: Path, name: str, recipe: int) -> bool:
    marker = read_marker(target)
    return marker is not None and marker.get("name") == name and marker.get("recipe") == recipe


@contextlib.contextmanager
def _locked(lock_path: Path, progress: Progress, what: str) -> Iterator[None]:
    """Exclusive ``flock`` on ``lock_path``; tells the user when it has to wait."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            progress(f"{what}: waiting for another process that is building it ({lock_path})")
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def _file_hashes(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): sha256_file(p)
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != MARKER
    }


def _make_readable(root: Path) -> None:
    """mkdtemp (0700) and safetensors (0600) are private; cached files are plain data."""
    os.chmod(root, 0o755)
    for p in root.rglob("*"):
        os.chmod(p, 0o755 if p.is_dir() else 0o644)


def build_once(
    target: Path,
    *,
    name: str,
    recipe: int,
    build: Callable[[Path], dict[str, Any]],
    progress: Progress | None = None,
) -> Path:
    """Return ``target``, building it with ``build(tmp_dir)`` first if it isn't there yet.

    ``build`` fills the empty temporary directory and returns extra marker fields (e.g.
    ``{"sources": {...}}``).  The marker is written last, then the directory is renamed into
    place.  A finished directory of an older recipe version is replaced.
    """
    progress = progress or quiet
    if _is_current(target, name, recipe):
        return target
    parent = target.parent
    parent.mkdir(parents=True, exist_ok=True)
    with _locked(parent / f".{target.name}.lock", progress, name):
        if _is_current(target, name, recipe):  # somebody else finished while we waited
            return target
        # Under the lock no other build of this target is running: leftovers are from
        # killed builds.
        for kind in ("tmp", "old"):
            for stale in parent.glob(f".{target.name}.{kind}-*"):
                shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=parent))
        try:
            extra = build(tmp)
            marker: dict[str, Any] = {"name": name, "recipe": recipe, **extra}
            marker["files"] = _file_hashes(tmp)
            (tmp / MARKER).write_text(
                json.dumps(marker, indent=2, sort_keys=True) + "\n", encoding="utf-8"
            )
            _make_readable(tmp)
            _publish(tmp, target, name, recipe)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    progress(f"{name}: ready at {target}")
    return target


def _publish(tmp: Path, target: Path, name: str, recipe: int) -> None:
    """Rename ``tmp`` to ``target``; keep an existing current build, replace a stale one."""
    try:
        os.rename(tmp, target)
        return
    except OSError as exc:
        if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
            raise
    if _is_current(target, name, recipe):
        return  # another builder won the race; ours is discarded by the caller
    # A stale or unmarked directory is in the way: move it aside, then publish ours.
    trash = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
    os.rename(target, trash / "old")
    try:
        os.rename(tmp, target)
    finally:
        shutil.rmtree(trash, ignore_errors=True)
