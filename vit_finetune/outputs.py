"""The output folder: a run only ever removes or replaces what a run of this toolkit wrote there.

A manifest (`.vit_finetune_manifest.json`) lists the names a run claims before writing any of them; a folder
holding anything else is the user's, and a run refuses to write into it (or, with overwrite=true, to touch
a name it would replace). The folder may not overlap the dataset's, and a lock held for the run's life
keeps a second run out (the kernel drops it when the process dies, even by SIGKILL). With several processes, all
must see one folder (processes.unshared_folder_refusal): a token file the main process writes, every process reads.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from pathlib import Path
from typing import IO

from .data import BUILTIN_SHAPES, cache_dir
from .labels import READERS
from .layout import LOCK, MANIFEST, PARTIAL_PREFIX, SHARED_CHECK, describe_write_error, replace_atomically
from .recipe import Recipe
from .recipe.limits import BUILTIN_PREFIX, _is_dir, _is_file, excerpt



def claimed(output_dir: Path) -> set[str]:
    """The names a run of this toolkit claimed in `output_dir` (empty if it never ran there)."""
    try:
        names = json.loads((Path(output_dir) / MANIFEST).read_text())["written"]
    except (OSError, ValueError, KeyError, TypeError):
        return set()
    return {name for name in names if isinstance(name, str) and "/" not in name and name not in ("", ".", "..")}


def claim(output_dir: Path, names: tuple[str, ...]) -> None:
    """Add `names` to the manifest, atomically, before any of them is written."""
    written = sorted(claimed(output_dir) | set(names) | {LOCK, SHARED_CHECK})
    content = json.dumps({"written": written}, indent=1)
    replace_atomically(Path(output_dir) / MANIFEST, lambda partial: partial.write_text(content))


def foreign_entries(output_dir: Path) -> list[str]:
    """What `output_dir` holds that no run of this toolkit claimed."""
    if not Path(output_dir).is_dir():
        return []
    ours = claimed(output_dir) | {MANIFEST, LOCK, PARTIAL_PREFIX + MANIFEST}  # the partial: a save cut short
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
    if not recipe.overwrite:
        return (f"output_dir={shown} holds files this toolkit did not write ({listed}); a run could replace them. "
                "Fix: choose a new or empty output_dir, or pass overwrite=true, which writes beside them and only "
                "ever removes or replaces what a run of this toolkit wrote")
    colliding = sorted(set(foreign) & set(run_names))
    if colliding:
        return (f"output_dir={shown} holds {excerpt(colliding)}, which this toolkit did not write and a run would "
                "replace, even with overwrite=true. Fix: move them out, or choose a new or empty output_dir")
    return None


def clear_claimed(output_dir: Path, run_names: tuple[str, ...]) -> None:
    """overwrite=true: remove what earlier runs claimed (among the names a run writes), and nothing else."""
    import shutil

    for name in sorted(claimed(output_dir) & set(run_names)):
        path = Path(output_dir) / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()


def unwritable(output_dir: Path, error: OSError) -> str:
    """Why a run cannot start in `output_dir`: its first write there failed (read-only, full, not a folder)."""
    existing = next(folder for folder in [output_dir, *output_dir.parents] if folder.exists())
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
