"""A run's directory (``train.out_dir``): one run at a time, never clobbered by accident, never
written through a link.

- ``claim``: a directory that holds another run's files (a checkpoint, ``metrics.jsonl``,
  ``config.json``) is refused unless the run resumes it (``train.resume=true``) or replaces it
  (``train.overwrite=true``: the earlier run's own files are removed, nothing else); a lock file
  (``.lock``: pid and host) keeps a second run out while the first is alive (a lock whose process
  is gone from this host is taken over, and said so);
- ``write_text`` / ``open_log``: a run's files are created exclusively (``O_EXCL``) under a
  unique name and renamed into place, or opened with ``O_NOFOLLOW``: a symbolic link planted
  under one of the run's names is replaced, never followed.

torchrun: rank 0 claims the directory; the other ranks write nothing there but their share of
a sharded checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
from pathlib import Path

LOCK = ".lock"
# A run's own files: what overwrite removes and what makes a directory "a run".
RUN_FILES = ("ckpt.pt", "ckpt", "metrics.jsonl", "config.json", "run_info.json")
RUN_PREFIXES = ("ckpt.pt.", "ckpt.")  # history (.step<N>), .old, .tmp, .corrupt copies


class RunDirectoryError(RuntimeError):
    """``train.out_dir`` holds another run, or is in use by a live one."""


def run_files(out_dir: Path) -> list[Path]:
    """The files and directories of an earlier run in ``out_dir`` (checkpoints of both kinds
    and their copies, the metrics log, the config and run info), sorted."""
    if not out_dir.is_dir():
        return []
    return sorted(p for p in out_dir.iterdir() if p.name in RUN_FILES or p.name.startswith(RUN_PREFIXES))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


class RunLock:
    """``out_dir/.lock`` held by this process (``release`` removes it)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def release(self) -> None:
        try:
            held = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return
        if held.get("pid") == os.getpid() and held.get("host") == socket.gethostname():
            self.path.unlink(missing_ok=True)


def lock(out_dir: Path, warn=print) -> RunLock:
    """Take ``out_dir/.lock`` for this process; ``RunDirectoryError`` naming the holder's pid
    and host when a live run holds it."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / LOCK
    me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}
    for _ in range(3):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            try:
                held = json.loads(path.read_text())
                pid, host = int(held["pid"]), str(held["host"])
            except (OSError, ValueError, KeyError, TypeError):
                held, pid, host = None, -1, "?"
            if held is not None and (host != socket.gethostname() or _alive(pid)):
                raise RunDirectoryError(
                    f"{out_dir} is in use by another run (pid {pid} on {host}, its {path}): wait for it, or choose "
                    "another train.out_dir (remove the lock file only if that run is gone)"
                ) from None
            what = f"pid {pid} on this host is gone" if held is not None else "it is unreadable"
            warn(f"{path}: took over a stale lock ({what})")
            path.unlink(missing_ok=True)
            continue
        with os.fdopen(fd, "w") as f:
            json.dump(me, f)
        return RunLock(path)
    raise RunDirectoryError(f"{path}: could not take the lock (another run keeps taking it)")


def claim(out_dir: str | Path, resume: bool, overwrite: bool, warn=print) -> RunLock:
    """Lock ``out_dir`` for this run, refusing (``RunDirectoryError``) a directory holding an
    earlier run unless ``resume`` or ``overwrite`` (which removes that run's files)."""
    out_dir = Path(out_dir)
    held = lock(out_dir, warn)
    found = run_files(out_dir)
    if found and not resume:
        if not overwrite:
            held.release()
            names = ", ".join(p.name for p in found[:6]) + (", ..." if len(found) > 6 else "")
            raise RunDirectoryError(
                f"{out_dir} holds an earlier run ({names}): set train.resume=true to continue it, "
                "train.overwrite=true to replace it, or choose another train.out_dir"
            )
        for p in found:
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
        warn(f"{out_dir}: train.overwrite=true removed the earlier run's {len(found)} files")
    return held


def write_text(path: Path, text: str) -> None:
    """Write ``path`` as a new file under a unique name, renamed over ``path``: a link at
    ``path`` is replaced, its target untouched."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    with open(tmp, "x", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def open_log(path: Path, append: bool):
    """``path`` opened for text writing, continued when ``append``; never through a link (a
    link is replaced when starting afresh, refused when continuing)."""
    if not append:
        path.unlink(missing_ok=True)
        return open(path, "x", encoding="utf-8")  # noqa: SIM115
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as e:
        raise RunDirectoryError(f"{path} is a symbolic link: a run's log is never written through one") from e
    return os.fdopen(fd, "a", encoding="utf-8")
