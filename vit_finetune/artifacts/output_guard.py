"""Which output folder a run may write into, checked before anything loads, and held for the run's life.

A run only ever removes or replaces what a run of this toolkit wrote there (run_lock.py: the manifest's claim): it
refuses a folder holding the user's files (or, with overwrite=true, one where it would replace a file of the user's),
a folder that overlaps the dataset's or a model it reads, and a finished or unfinished run it was not told to resume
or overwrite. The main process then locks the folder and claims it; with several processes, all must see one folder
(processes.unshared_folder_refusal: a token file the main process writes, every process reads).
"""

from __future__ import annotations

import os
from pathlib import Path

from accelerate import Accelerator

from vit_finetune.artifacts import checkpoint, tracking
from vit_finetune.core import hub, layout, previous_run, progress
from vit_finetune.core.errors import RunError, VitFinetuneError, excerpt, problems_of
from vit_finetune.core.layout import BUILTIN_PREFIX
from vit_finetune.core.processes import SHARED_FOLDER_PATIENCE_S, any_process, unshared_folder_refusal, world_size
from vit_finetune.core.run_lock import OutputDirError, RunLock, claim, foreign_entries, staging_refusal
from vit_finetune.data import BUILTIN_SHAPES, cache_dir
from vit_finetune.data.labels import READERS
from vit_finetune.recipe import Recipe
from vit_finetune.recipe.limits import _is_dir, _is_file


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
    staged = staging_refusal(output_dir)
    if staged:
        return staged
    foreign = foreign_entries(output_dir)
    if not foreign:
        return None
    listed = excerpt(foreign)
    # A resume continues a run that already wrote beside these (it was started with overwrite=true, or they came later).
    if not recipe.overwrite and recipe.train.resume is None:
        return (f"output_dir={shown} holds files this toolkit did not write ({listed}); a run could replace them. "
                "Fix: choose a new or empty output_dir, or pass overwrite=true, which writes beside them and only "
                "ever removes or replaces what a run of this toolkit wrote")
    colliding = sorted(set(foreign) & set(run_names) - layout.SHARED_FOLDERS)
    if colliding:
        return (f"output_dir={shown} holds {excerpt(colliding)}, which this toolkit did not write and a run would "
                "replace, even with overwrite=true or a resume. Fix: move them out, or choose a new or empty output_dir")
    return None


def preflight(recipe: Recipe) -> list[VitFinetuneError]:
    """The outputs' problems with a recipe, before anything loads: the output folder (check_output_dir), a tracker
    whose package is missing, and for hub.push=true a missing token or a malformed VIT_FINETUNE_HUB_TIMEOUT (a push
    must not fail after the training)."""
    checks = [lambda: check_output_dir(recipe), lambda: tracking.check_trackers(recipe.train.report_to)]
    if recipe.hub.push:
        checks += [hub.require_token, hub.request_timeout]
    return problems_of(*checks)


def check_output_dir(recipe: Recipe) -> None:
    """Refuse to mix with or destroy an earlier run unless told to resume or overwrite, to write over what this
    toolkit did not write, or to write into the dataset's folder. A previous run that a killed overwrite=true run set
    aside is put back first (one process alone can do it here; a launch of several does it once it holds the lock),
    and the checks are of the run the folder will then hold."""
    output_dir = Path(recipe.output_dir)
    resuming = recipe.train.resume is not None
    if world_size(os.environ) == 1:
        said = previous_run.recover_if_free(output_dir, resuming)
        if said:
            progress.say(said)
    refused = refusal(recipe, layout.RUN_NAMES)
    if refused:
        raise RunError(refused)
    met = previous_run.run_a_new_run_meets(output_dir, resuming)
    if recipe.overwrite or resuming:
        if resuming and layout.is_finished(met):
            raise RunError(f"{output_dir} already holds a finished run; nothing to resume. "
                           "Use overwrite=true to train again, or another output_dir")
        return
    if layout.is_finished(met):
        raise RunError(f"output_dir={str(output_dir)!r} already holds a finished run ({layout.METRICS_FILE}). "
                       "Fix: choose another output_dir, or pass overwrite=true to replace it")
    if checkpoint.complete_checkpoints(met):
        raise RunError(f"output_dir={str(output_dir)!r} holds checkpoints of an unfinished run. "
                       "Fix: resume it with train.resume=auto, or pass overwrite=true to start again")


def hold_output_dir(accelerator: Accelerator, recipe: Recipe) -> RunLock:
    """The main process locks output_dir for the run's life and claims, in its manifest, the names a run writes;
    if another run holds the lock, or a machine sees another folder there, every process stops (collectives)."""
    lock = RunLock(Path(recipe.output_dir))
    refused = _lock_and_claim(lock, recipe) if accelerator.is_main_process else None
    if any_process(accelerator, refused is not None):
        raise RunError(refused or "the main process could not lock output_dir")
    # A process that does not see the check file looks again for a while; the others must not time out meanwhile.
    patience_s = min(SHARED_FOLDER_PATIENCE_S, recipe.train.collective_timeout_s / 2)
    unshared = unshared_folder_refusal(accelerator, Path(recipe.output_dir), layout.SHARED_CHECK, patience_s)
    if unshared:
        lock.release()
        raise RunError(f"output_dir={unshared}")
    return lock


def _lock_and_claim(lock: RunLock, recipe: Recipe) -> str | None:
    """The main process's first writes into output_dir: the lock, the manifest's claim and the trackers' folder;
    why one failed (a refusal, the lock released), or None."""
    output_dir = Path(recipe.output_dir)
    refused = lock.acquire()
    if refused:
        return refused
    try:
        said = previous_run.recover_interrupted_overwrite(output_dir, recipe.train.resume is not None)
        if said:
            progress.say(said)
        claim(output_dir)
    except OutputDirError as error:
        refused = str(error)
    refused = refused or tracking.tracker_folder_refusal(output_dir, recipe.train.report_to)
    if refused:
        lock.release()
    return refused
