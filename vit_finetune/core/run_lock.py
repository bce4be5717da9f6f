"""A run's hold on its output folder: the lock it keeps for its life, and the manifest's claim of what it wrote.

A manifest (`.vit_finetune_manifest.json`, layout.py) lists what a run wrote, path by path (a file, or a folder the
run made for itself: a checkpoint, its tracker's log folder), each recorded before it is written, so a run killed
midway leaves nothing a later run would take for the user's. Anything else in the folder is the user's
(foreign_entries). The lock keeps a second run out; the kernel drops it when the process dies, even by SIGKILL.
"""

from __future__ import annotations

import contextlib
import fcntl
import fnmatch
import os
from pathlib import Path
from typing import IO

from vit_finetune.core.errors import VitFinetuneError, excerpt
from vit_finetune.core.layout import (
    LOCK, MANIFEST, OWN_FILES, PREVIOUS_RUN, STAGED_NAMES, STAGING, describe_write_error, record, written,
)


class OutputDirError(VitFinetuneError):
    """The output folder could not be written, or an earlier run's files could not be moved."""


def unwritable(output_dir: Path, error: OSError) -> str:
    """Why a run cannot start in `output_dir`: its first write there failed (read-only, full, not a folder)."""
    existing = next(folder for folder in [Path(output_dir), *Path(output_dir).parents] if folder.exists())
    return (f"output_dir={output_dir} cannot be written ({describe_write_error(error, existing)}); nothing was "
            "trained. Fix: free disk space there or make it writable, or choose another output_dir")


class RunLock:
    """An exclusive flock on output_dir/.vit_finetune.lock for the life of a run; released when the process ends,
    however it ends, so a killed run never leaves the folder locked."""

    def __init__(self, output_dir: Path):
        self.path = Path(output_dir) / LOCK
        self.handle: IO | None = None

    def acquire(self) -> str | None:
        """None once held; else why not (another live run holds it, or the folder cannot be written), for the message."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            handle = open(self.path, "a+")
        except OSError as error:
            return unwritable(self.path.parent, error)
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "unknown"
            handle.close()
            return (f"another run (process {holder}) is writing into output_dir={excerpt(str(self.path.parent))}; two "
                    "runs would mix their files. Wait for it to end, or choose another output_dir")
        try:
            handle.seek(0)
            handle.truncate()
            handle.write(str(os.getpid()))
            handle.flush()
        except OSError as error:  # a full disk
            with contextlib.suppress(OSError):  # close() retries the failed write, fails again, and closes all the same
                handle.close()
            return unwritable(self.path.parent, error)
        self.handle = handle
        return None

    def release(self) -> None:
        if self.handle is not None:
            self.handle.close()  # closing drops the flock
            self.handle = None


def claimed(output_dir: Path) -> set[str]:
    """The names in `output_dir` that hold what a run of this toolkit wrote (with those of a previous run that an
    interrupted overwrite set aside)."""
    output_dir = Path(output_dir)
    return {path.split("/")[0] for path in written(output_dir) + written(output_dir / PREVIOUS_RUN)}


def claim(output_dir: Path) -> None:
    """The run's first write into output_dir once it holds the lock: an empty manifest where there is none (a
    read-only or full disk is met here, before any data loads). One that is there is not touched before training."""
    if (Path(output_dir) / MANIFEST).is_file():
        return
    try:
        record(output_dir, [])
    except OSError as error:
        raise OutputDirError(unwritable(output_dir, error)) from None


def foreign_staged(output_dir: Path) -> list[str]:
    """What the final save's staging folder in `output_dir` holds that the final save does not write (the user's)."""
    staging = Path(output_dir) / STAGING
    if not staging.is_dir() or staging.is_symlink():
        return []
    return sorted(entry.name for entry in staging.iterdir()
                  if not any(fnmatch.fnmatchcase(entry.name, pattern) for pattern in STAGED_NAMES))


def staging_refusal(output_dir: Path) -> str | None:
    """Why a run may not clear the final save's staging folder: a file there the toolkit did not write, by name."""
    foreign = foreign_staged(output_dir)
    if not foreign:
        return None
    staging = Path(output_dir) / STAGING
    return (f"{staging} holds {excerpt(foreign)}, which this toolkit did not write: {STAGING} is the folder a run "
            f"writes its final model in first and clears, and it would delete them. Fix: move "
            f"{str(staging / foreign[0])!r}{' and the others' if len(foreign) > 1 else ''} out of {STAGING}, "
            "then run again")


def foreign_entries(output_dir: Path) -> list[str]:
    """What `output_dir` holds that no run of this toolkit claimed."""
    if not Path(output_dir).is_dir():
        return []
    ours = claimed(output_dir) | OWN_FILES  # the manifest's partial: a save cut short
    return sorted(entry.name for entry in Path(output_dir).iterdir() if entry.name not in ours)
