"""overwrite=true's previous run: set aside once the new run has passed every check made before training, put back
if the new one fails before it can be resumed, and dropped once the new one's outputs are written.

The previous run's recorded paths move, one rename each, into a hidden folder (`.vit_finetune_previous`). A run that
finds that folder left by a killed run puts the previous run back, or keeps it aside while train.resume continues
the killed one.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
from pathlib import Path

from vit_finetune.core.layout import (
    CHECKPOINTS, COMPLETE, MANIFEST, PREVIOUS_RUN, describe_write_error, fsync_folder, is_finished, written,
)
from vit_finetune.core.run_lock import OutputDirError, RunLock


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


def restore_command(output_dir: Path) -> str:
    """The command that puts back a run set aside in output_dir, as the user types it."""
    return f"python -m vit_finetune restore {shlex.quote(str(output_dir))}"


def kept_aside(output_dir: Path) -> Path | None:
    """The folder holding the run an overwrite=true run, stopped before it finished, was replacing; None if none."""
    aside = Path(output_dir) / PREVIOUS_RUN
    return aside if aside.is_dir() and not aside.is_symlink() and (aside / MANIFEST).is_file() else None


def where_the_previous_run_is(output_dir: Path) -> str | None:
    """One clause: where the run a stopped overwrite=true run was replacing is kept, and how to put it back (or to
    continue the stopped run instead, when it left a checkpoint); None if nothing is set aside."""
    aside = kept_aside(output_dir)
    if aside is None:
        return None
    resume = ", or continue the stopped run with train.resume=auto" if resumable(output_dir) else ""
    return (f"the run it was replacing is kept, whole, in {aside}: put it back with `{restore_command(output_dir)}` "
            f"(any later run into {output_dir} that does not resume also puts it back first){resume}")


def not_a_model_because_stopped(folder: Path) -> str | None:
    """Why a run folder holds no model when an overwrite=true run into it stopped before it finished: the clause
    saying where the model it was replacing is kept and how to put it back; None otherwise."""
    previous = where_the_previous_run_is(folder)
    if previous is None:
        return None
    return f"an overwrite=true run into it stopped before it finished; {previous}, then run this again"


def after_a_stop_at_once(output_dir: Path) -> str:
    """What a run stopped at once (a second Ctrl-C) leaves in output_dir, in one clause: where the run it was
    replacing is kept and how to put it back, else the finished run still there, else its checkpoint to resume
    from, else that nothing was saved."""
    previous = where_the_previous_run_is(output_dir)
    if previous:
        return f"this overwrite=true run was not finished; {previous}"
    if is_finished(output_dir):  # stopped before it set the finished run there aside: that one is untouched
        return f"the finished run in {output_dir} is as it was"
    if resumable(output_dir):
        return f"its last checkpoint is in {Path(output_dir) / CHECKPOINTS}: resume with train.resume=auto"
    return "no checkpoint of it was saved"


def restore(output_dir: Path) -> str:
    """`restore OUTPUT_DIR`: the run a stopped overwrite=true run was replacing put back (the stopped run's files
    removed), holding the folder's lock meanwhile; one line saying so. Refused when nothing is set aside or a live
    run holds the folder."""
    output_dir = Path(output_dir)
    if kept_aside(output_dir) is None:
        raise OutputDirError(f"{output_dir} holds no run set aside ({PREVIOUS_RUN}/ with its manifest): only a run "
                             "that an overwrite=true run was replacing, and that run stopped before it finished, can "
                             "be restored. Nothing was changed")
    lock = RunLock(output_dir)
    refused = lock.acquire()
    if refused:
        raise OutputDirError(f"{refused}; nothing was restored")
    try:
        return recover_interrupted_overwrite(output_dir, resuming=False) or ""
    finally:
        lock.release()


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
