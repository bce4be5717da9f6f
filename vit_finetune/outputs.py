"""The output folder: a run only ever removes or replaces what a run of this toolkit wrote there.

A manifest (`.vit_finetune_manifest.json`) lists what a run wrote, path by path (a file, or a folder the run made
for itself: a checkpoint, its tracker's log folder), each recorded before it is written, so a run killed midway
leaves nothing a later run would take for the user's. Anything else in the folder is the user's: a run refuses to
write into a folder holding it (or, with overwrite=true, to replace a file of the user's), and never removes it,
even inside a folder a run writes in (`runs/`, `checkpoints/`).

overwrite=true replaces the previous run only once the new one has passed every check made before training: its
recorded paths are then moved, one rename each, into a hidden folder (`.vit_finetune_previous`), removed once the
new run's outputs are written, and moved back if it fails before it can be resumed. A run that finds that folder
left by a killed run puts the previous run back, or keeps it aside while train.resume continues the killed one.

The folder may not overlap the dataset's, and a lock held for the run's life keeps a second run out (the kernel
drops it when the process dies, even by SIGKILL). With several processes, all must see one folder
(processes.unshared_folder_refusal): a token file the main process writes, every process reads.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
from pathlib import Path
from typing import IO

from .data import BUILTIN_SHAPES, cache_dir
from .errors import VitFinetuneError
from .data.labels import READERS
from .layout import (CHECKPOINTS, COMPLETE, LOCK, MANIFEST, OWN_FILES, PREVIOUS_RUN, SHARED_FOLDERS,
                     describe_write_error, fsync_folder, record, written)
from .recipe import Recipe
from .recipe.limits import BUILTIN_PREFIX, _is_dir, _is_file, excerpt

class OutputDirError(VitFinetuneError):
    """The output folder could not be written, or an earlier run's files could not be moved."""


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


def foreign_entries(output_dir: Path) -> list[str]:
    """What `output_dir` holds that no run of this toolkit claimed."""
    if not Path(output_dir).is_dir():
        return []
    ours = claimed(output_dir) | OWN_FILES  # the manifest's partial: a save cut short
    return sorted(entry.name for entry in Path(output_dir).iterdir() if entry.name not in ours)


def resolved(path: Path | str) -> Path:
    """`path` absolute, `~`, `..` and symlinks resolved (realpath: a loop of links stops the resolving, not the run)."""
    return Path(os.path.realpath(Path(path).expanduser()))


def dataset_folder(recipe: Recipe) -> Path | None:
    """The local folder the data is read from, if any: an image or saved-dataset folder, or a label file's folder
    (its images lie in it or below). A Hub id has none."""
    if recipe.data.dataset == BUILTIN_SHAPES:
        return cache_dir() / "shapes"
    source = Path(recipe.data.dataset).expanduser()
    if _is_dir(source):
        return source
    return source.parent if _is_file(source) and source.suffix.lower() in READERS else None


def model_folders(recipe: Recipe) -> list[tuple[str, str]]:
    """(key, value) of each local model folder the run loads: model.base, train.distill.teacher (a Hub id or a
    builtin: model has none). A resume loads both again, so neither may change during the run."""
    keys = [("model.base", recipe.model.base)]
    if recipe.train.distill is not None:
        keys.append(("train.distill.teacher", recipe.train.distill.teacher))
    return [(key, value) for key, value in keys
            if not value.startswith(BUILTIN_PREFIX) and _is_dir(Path(value).expanduser())]


def read_path_refusal(recipe: Recipe, run_names: tuple[str, ...]) -> str | None:
    """Why a folder this run reads lies where the run writes: overwrite=true first clears what earlier runs wrote
    (the names in `run_names`) and the run then replaces them, so a model loaded from there would be gone (or changed
    under a resume) and a dataset would get the run's files among its own. Paths are compared resolved (`~`,
    relative parts, symlinks), and nothing is written to find out. train.resume is not among them: a resume reads
    the run's own checkpoints by design, and the recipe refuses it with overwrite=true, which would clear them."""
    out = resolved(recipe.output_dir)
    shown = excerpt(str(recipe.output_dir))
    written = [out / name for name in run_names]
    for key, value in model_folders(recipe):
        source = resolved(Path(value))
        if source == out or any(source.is_relative_to(folder) for folder in written):
            return (f"{key}={excerpt(value)} is output_dir={shown} or a folder a run writes in it: the run would clear "
                    f"or replace the model it reads. Fix: write into another output_dir (e.g. output_dir=<a new "
                    f"folder>) and keep {key} as it is")
    data = dataset_folder(recipe)
    if data is not None:
        source = resolved(data)
        if out == source or out.is_relative_to(source) or source.is_relative_to(out):
            return (f"output_dir={shown} overlaps the dataset's folder {str(data)!r}: the run's files would land among "
                    "its images (and overwrite=true could delete them). Fix: an output_dir outside the dataset")
    return None


def refusal(recipe: Recipe, run_names: tuple[str, ...]) -> str | None:
    """Why this run may not write into its output_dir (None if it may); nothing is written to find out."""
    read_refused = read_path_refusal(recipe, run_names)
    if read_refused:
        return read_refused
    output_dir = Path(recipe.output_dir).expanduser()
    shown = excerpt(str(recipe.output_dir))
    a_file = next((path for path in (output_dir, *output_dir.parents) if path.exists() and not path.is_dir()), None)
    if a_file is not None:
        where = "is a file" if a_file == output_dir else f"lies under {excerpt(str(a_file))}, which is a file"
        return f"output_dir={shown} {where}, not a folder. Fix: an output_dir that is a folder or a new name"
    foreign = foreign_entries(output_dir)
    if not foreign:
        return None
    listed = excerpt(foreign)
    # A resume continues a run that already wrote beside these (it was started with overwrite=true, or they came later).
    if not recipe.overwrite and recipe.train.resume is None:
        return (f"output_dir={shown} holds files this toolkit did not write ({listed}); a run could replace them. "
                "Fix: choose a new or empty output_dir, or pass overwrite=true, which writes beside them and only "
                "ever removes or replaces what a run of this toolkit wrote")
    colliding = sorted(set(foreign) & set(run_names) - SHARED_FOLDERS)
    if colliding:
        return (f"output_dir={shown} holds {excerpt(colliding)}, which this toolkit did not write and a run would "
                "replace, even with overwrite=true or a resume. Fix: move them out, or choose a new or empty output_dir")
    return None


# ---------------------------------------------------------------- overwrite=true: the previous run set aside


def _outermost(paths: list[str]) -> list[str]:
    """`paths` less those inside another of them (moving a folder moves them)."""
    chosen: list[str] = []
    for path in sorted(paths, key=lambda path: path.count("/")):
        if not any(path.startswith(f"{outer}/") for outer in chosen):
            chosen.append(path)
    return chosen


def _present(folder: Path) -> list[str]:
    """The outermost recorded paths of `folder`'s manifest that exist there."""
    return [path for path in _outermost(written(folder)) if os.path.lexists(folder / path)]


def _move(source: Path, target: Path) -> None:
    """`source` renamed to `target` (a file there replaced); a folder onto an existing folder is merged entry by
    entry. Both lie in output_dir, so each step is a rename on one disk."""
    if source.is_dir() and not source.is_symlink() and target.is_dir() and not target.is_symlink():
        for entry in list(source.iterdir()):
            _move(entry, target / entry.name)
        source.rmdir()
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    os.replace(source, target)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def _prune_empty_folders(folder: Path, top: Path) -> None:
    """Folders from `folder` up to `top` (not included) that a move or removal left empty."""
    while folder != top and folder.is_relative_to(top):
        try:
            folder.rmdir()
        except OSError:  # not empty: it holds something else (the user's)
            return
        folder = folder.parent


def set_previous_run_aside(output_dir: Path) -> int:
    """overwrite=true, once the new run has passed its checks: what the previous run recorded moves into the hidden
    folder, its manifest first (what to put back if this is cut short); returns how many paths moved."""
    output_dir = Path(output_dir)
    paths = _present(output_dir)
    if not paths:
        return 0
    aside = output_dir / PREVIOUS_RUN
    try:
        aside.mkdir()
        os.replace(output_dir / MANIFEST, aside / MANIFEST)
        for path in paths:
            _move(output_dir / path, aside / path)
            _prune_empty_folders((output_dir / path).parent, output_dir)
        fsync_folder(output_dir)
    except OSError as error:
        raise OutputDirError(f"could not set the previous run in output_dir={output_dir} aside "
                             f"({describe_write_error(error, output_dir)}); nothing was trained. Fix: make the folder "
                             "writable, or choose another output_dir") from None
    return len(paths)


def put_previous_run_back(output_dir: Path) -> int:
    """The run set aside back in place: first what the run that replaced it recorded is removed (it never finished),
    then the set-aside paths move back, its manifest last. Safe to repeat after a kill at any point; returns how
    many paths moved back."""
    output_dir = Path(output_dir)
    aside = output_dir / PREVIOUS_RUN
    if not (aside / MANIFEST).is_file():  # cut short before anything moved: the manifest goes first
        with contextlib.suppress(OSError):
            aside.rmdir()
        return 0
    for path in _present(output_dir):
        _remove(output_dir / path)
        _prune_empty_folders((output_dir / path).parent, output_dir)
    (output_dir / MANIFEST).unlink(missing_ok=True)
    fsync_folder(output_dir)
    back = _present(aside)
    for path in back:
        _move(aside / path, output_dir / path)
    os.replace(aside / MANIFEST, output_dir / MANIFEST)
    shutil.rmtree(aside)
    fsync_folder(output_dir)
    return len(back)


def drop_previous_run(output_dir: Path) -> None:
    """The new run's final outputs are in place: the run it replaced goes for good."""
    shutil.rmtree(Path(output_dir) / PREVIOUS_RUN, ignore_errors=True)


def resumable(output_dir: Path) -> bool:
    """Whether output_dir holds a complete checkpoint a run could resume from."""
    folder = Path(output_dir) / CHECKPOINTS
    return folder.is_dir() and any((step / COMPLETE).is_file() for step in folder.glob("step-*"))


def recover_interrupted_overwrite(output_dir: Path, resuming: bool) -> str | None:
    """A previous run set aside by an overwrite=true run that was killed: put back (the killed run's files removed),
    or, when `resuming` continues the killed run, kept aside until it finishes. One line saying which, or None."""
    output_dir = Path(output_dir)
    aside = output_dir / PREVIOUS_RUN
    if not aside.is_dir() or aside.is_symlink():
        return None
    if resuming:
        return (f"output_dir: the run being resumed was started with overwrite=true; the run it replaces stays set "
                f"aside in {aside} until it finishes")
    try:
        count = put_previous_run_back(output_dir)
    except OSError as error:
        raise OutputDirError(f"could not put back the previous run set aside in {aside} "
                             f"({describe_write_error(error, output_dir)}). Fix: make output_dir writable") from None
    return (f"output_dir: an overwrite=true run into {output_dir} was stopped before it finished; the run it was "
            f"replacing is back as it was ({count} file(s) and folder(s)), that run's files removed")


def recover_if_free(output_dir: Path, resuming: bool) -> str | None:
    """recover_interrupted_overwrite, if no live run holds the folder (that one's refusal comes later)."""
    if not (Path(output_dir) / PREVIOUS_RUN).is_dir():
        return None
    lock = RunLock(Path(output_dir))
    if lock.acquire() is not None:
        return None
    try:
        return recover_interrupted_overwrite(output_dir, resuming)
    finally:
        lock.release()


def run_a_new_run_meets(output_dir: Path, resuming: bool) -> Path:
    """The folder holding the run a new run meets in output_dir: output_dir itself, or the set-aside folder of a
    killed overwrite when the new run will put that back first (when not resuming the killed run)."""
    aside = Path(output_dir) / PREVIOUS_RUN
    return aside if aside.is_dir() and (aside / MANIFEST).is_file() and not resuming else Path(output_dir)


def after_a_failed_run(output_dir: Path) -> str | None:
    """An overwrite that failed: the previous run is put back, unless this run left a complete checkpoint (it can
    then be resumed with train.resume=auto, as after a kill). One line saying which, or None (nothing set aside)."""
    output_dir = Path(output_dir)
    aside = output_dir / PREVIOUS_RUN
    if not aside.is_dir():
        return None
    if resumable(output_dir):
        return (f"output_dir: the run this overwrite=true run replaces stays set aside in {aside}: train.resume=auto "
                f"continues this run (and removes it once it finishes); any other run into {output_dir} puts it back")
    try:
        put_previous_run_back(output_dir)
    except OSError as error:  # the run's own error is the one to raise; this says where the previous run is
        return (f"output_dir: the run this overwrite=true run was replacing could not be put back "
                f"({describe_write_error(error, output_dir)}); it is in {aside}, and the next run into "
                f"{output_dir} puts it back")
    return f"output_dir: this overwrite=true run failed; the run it was replacing is back in {output_dir} as it was"


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
