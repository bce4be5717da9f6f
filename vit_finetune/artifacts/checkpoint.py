"""Checkpoints: written under a temporary name, marked complete, then published by an atomic rename.

A checkpoint folder `checkpoints/step-00000100/` holds Accelerate's state (model, optimizer, scheduler,
RNG), `trainer_state.json` (where the loop stands), the recipe it was made with and a `COMPLETE`
marker. Only folders with the marker are ever loaded; leftovers of an interrupted save are removed by
the next save.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import yaml
from safetensors import SafetensorError

from vit_finetune.core.errors import VitFinetuneError, excerpt, shortened
from vit_finetune.core.layout import (
    CHECKPOINTS, COMPLETE, DAMAGED_PREFIX, PARTIAL_PREFIX, RECIPE_FILE, STATE_FILE, checkpoint_name,
    describe_write_error, record, rename_into_place,
)
from vit_finetune.core.processes import any_process
from vit_finetune.recipe import HOME_PATH_KEYS, Recipe, default_values, flatten, fold_older_spellings, write_recipe

# Keys that may differ on resume without changing the computation.
NEUTRAL_KEYS = {
    "train.resume", "train.resume_ignore_changes", "train.checkpoint_every_steps", "train.keep_checkpoints",
    "train.log_every_steps", "data.num_workers", "overwrite", "output_dir", "hub.push", "hub.repo_id", "hub.private",
    "train.collective_timeout_s", "pictures",
    "data.test_split",  # scored after training, read by none of its choices: a resume may add or change it
}


# A full or failing disk raises OSError from Python's own writes, but SafetensorError from safetensors' writer
# and RuntimeError ("unexpected pos ...") from torch.save's zip writer: none of the three may become a traceback.
WRITE_ERRORS = (OSError, RuntimeError, SafetensorError)
# A damaged or foreign file read back: truncated zip, bad header, or a pickle that weights_only=True refuses.
READ_ERRORS = (OSError, RuntimeError, ValueError, KeyError, EOFError, pickle.UnpicklingError, SafetensorError)


class CheckpointError(VitFinetuneError):
    """A checkpoint that cannot be written or resumed from."""


class DamagedCheckpoint(CheckpointError):
    """A checkpoint whose files cannot be read back (not one that is intact but does not fit this run)."""


@dataclass
class TrainState:
    step: int = 0  # optimiser steps done
    epoch: int = 0  # current epoch
    batches_done: int = 0  # batches of the current epoch already consumed
    skipped_images: int = 0
    skipped_steps: int = 0  # fp16: optimiser steps its loss scaler skipped (loss_scale.py)
    history: list[dict] = field(default_factory=list)
    data: dict = field(default_factory=dict)  # the data trained on: labels and the splits' fingerprints
    # train.keep_best: the best evaluation so far ({step, value, weights: raw | ema}; its weights are under
    # output_dir/best and copied into each checkpoint), and the early-stopping count since it
    best: dict | None = None
    evaluations_without_gain: int = 0
    stopped_early: bool = False
    probe: dict | None = None  # train.method linear_probe / lp_ft: how the head was fitted (probe.ProbeResult)
    # train.resolution_schedule: the stage and size these weights are at, and each stage's record (resolution.py)
    resolution: dict | None = None



def complete_checkpoints(output_dir: Path) -> list[Path]:
    root = Path(output_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.name.startswith("step-") and (p / COMPLETE).is_file()]
    return sorted(found, key=lambda p: p.name)


def latest_checkpoint(output_dir: Path) -> Path | None:
    found = complete_checkpoints(output_dir)
    return found[-1] if found else None



def save_checkpoint(accelerator, output_dir: Path, state: TrainState, recipe: Recipe, keep: int,
                    write_extras: Callable[[Path], None] = lambda folder: None) -> Path:
    """Every process writes its part into `.partial-step-N` (Accelerate's state, then `write_extras(folder)`);
    the main process marks it and renames it."""
    root = Path(output_dir) / CHECKPOINTS
    final = root / checkpoint_name(state.step)
    partial = root / f"{PARTIAL_PREFIX}{final.name}"
    if accelerator.is_main_process:
        record(output_dir, [f"{CHECKPOINTS}/{partial.name}", f"{CHECKPOINTS}/{final.name}"])
        root.mkdir(parents=True, exist_ok=True)
        for leftover in root.glob(f"{PARTIAL_PREFIX}*"):  # an earlier save that was killed half-way
            shutil.rmtree(leftover, ignore_errors=True)
        partial.mkdir()
    accelerator.wait_for_everyone()
    failure = None
    try:
        accelerator.save_state(str(partial), safe_serialization=True)
        write_extras(partial)
    except WRITE_ERRORS as error:
        failure = error
    _stop_everywhere_if_failed(accelerator, failure, partial, final, output_dir)
    if accelerator.is_main_process:
        try:
            (partial / STATE_FILE).write_text(json.dumps(asdict(state)))
            write_recipe(recipe, partial)
            (partial / COMPLETE).write_text("")
            rename_into_place(partial, final)  # durable before older checkpoints are deleted
        except WRITE_ERRORS as error:
            failure = error
    _stop_everywhere_if_failed(accelerator, failure, partial, final, output_dir)
    if accelerator.is_main_process:
        for old in complete_checkpoints(output_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def _stop_everywhere_if_failed(accelerator, failure: Exception | None, partial: Path, final: Path,
                               output_dir: Path) -> None:
    """A collective: if any process failed to write, all of them raise (none trains on alone, none hangs)."""
    if not any_process(accelerator, failure is not None):
        return
    if accelerator.is_main_process:
        shutil.rmtree(partial, ignore_errors=True)
    reason = describe_write_error(failure, partial.parent) if failure else "another process could not write its part"
    previous = latest_checkpoint(output_dir)
    raise CheckpointError(
        f"could not write checkpoint {final} ({reason}). "
        f"Previous checkpoint {'intact: ' + str(previous) if previous else 'none'}. "
        "Free disk space, then resume with train.resume=auto"
    )


def resolve_resume(resume: str | None, output_dir: Path, is_main_process: bool = True) -> Path | None:
    """null -> None; auto -> the latest complete checkpoint whose saved recipe and state read back (or None; a
    damaged newer one is moved aside); a path -> that checkpoint, if complete."""
    if resume is None:
        return None
    if resume == "auto":
        for candidate in reversed(complete_checkpoints(output_dir)):
            try:
                read_saved_state(candidate)
                return candidate
            except DamagedCheckpoint as error:
                set_aside(candidate, error, is_main_process)
        return None
    path = Path(resume)
    if not (path / COMPLETE).is_file():
        raise CheckpointError(
            f"train.resume={excerpt(resume)} is not a complete checkpoint (no {COMPLETE} marker); "
            f"use train.resume=auto to pick the latest complete one in {output_dir}/{CHECKPOINTS}"
        )
    return path


def set_aside(checkpoint: Path, error: Exception, is_main_process: bool) -> None:
    """Move a damaged checkpoint to checkpoints/damaged-step-N (never loaded again, never deleted) and say so."""
    if not is_main_process:  # the main process moves it; the others reach the same verdict from the same files
        return
    target = checkpoint.with_name(DAMAGED_PREFIX + checkpoint.name)
    for attempt in range(1, 1000):
        if not target.exists():
            break
        target = checkpoint.with_name(f"{DAMAGED_PREFIX}{checkpoint.name}-{attempt}")
    record(checkpoint.parent.parent, [f"{CHECKPOINTS}/{target.name}"])
    os.rename(checkpoint, target)
    print(f"checkpoint {checkpoint} is damaged ({error}); moved to {target} for inspection. "
          "Looking for an older complete checkpoint", flush=True)


def read_saved_state(checkpoint: Path) -> tuple[dict, dict]:
    """The checkpoint's recipe and trainer state as mappings, or DamagedCheckpoint saying which file is bad."""
    found = []
    for name, parse in ((RECIPE_FILE, yaml.safe_load), (STATE_FILE, json.loads)):
        try:
            value = parse((checkpoint / name).read_text())
        except (OSError, UnicodeDecodeError, ValueError, yaml.YAMLError) as error:
            reason = error.strerror if isinstance(error, OSError) and error.strerror else type(error).__name__
            raise DamagedCheckpoint(f"its {name} cannot be read: {reason}") from None
        if not isinstance(value, dict):
            raise DamagedCheckpoint(f"its {name} holds no mapping")
        found.append(value)
    return found[0], found[1]


def changed_keys(checkpoint: Path, recipe: Recipe) -> list[str]:
    """Recipe keys whose value differs from the checkpoint's, other than neutral or explicitly allowed ones."""
    saved_recipe = read_saved_state(checkpoint)[0]
    if isinstance(saved_recipe.get("data"), dict):  # spelled as earlier versions saved it
        saved_recipe["data"] = fold_older_spellings(saved_recipe["data"])
    saved = flatten(saved_recipe)
    if "model.compile" in saved and saved["model.compile"] is None:  # auto, as earlier versions spelled it
        saved["model.compile"] = "auto"
    # A checkpoint written before the recipe expanded `~` kept it: compare the folders, not their spellings.
    saved.update({key: os.path.expanduser(saved[key]) for key in HOME_PATH_KEYS if isinstance(saved.get(key), str)})
    current = flatten(recipe.model_dump(mode="json"))
    allowed = NEUTRAL_KEYS | set(recipe.train.resume_ignore_changes)
    before = saved_values(saved, set(current))
    return sorted(f"{key}: {excerpt(before.get(key))} -> {excerpt(current.get(key))}"
                  for key in set(before) | set(current) if key not in allowed and before.get(key) != current.get(key))


def saved_values(saved: dict, keys: set[str]) -> dict:
    """The checkpoint's flattened recipe, plus what each of `keys` it lacks ran with: a key its version did not have
    yet ran with what is now its default. Inside a section that was on (train.distill), that is the key's own default;
    a section that was null or absent stays null, so switching it on at a resume is a change."""
    recipe_defaults, key_defaults = flatten(Recipe().model_dump(mode="json")), default_values()
    values = dict(saved)
    for key in keys - set(saved):
        section = key.rpartition(".")[0]
        section_was_on = any(other.startswith(f"{section}.") for other in saved)
        values[key] = (key_defaults if section_was_on else recipe_defaults).get(key)
    return values


def refuse_changed_recipe(checkpoint: Path, recipe: Recipe) -> None:
    """Cheap, so run() calls it before loading any data or weights."""
    try:
        changes = changed_keys(checkpoint, recipe)
    except DamagedCheckpoint as error:
        raise DamagedCheckpoint(f"cannot resume from {checkpoint}: {error}. Resume from an earlier checkpoint with "
                                "train.resume=auto or train.resume=<its folder>, or start again with overwrite=true"
                                ) from None
    if changes:
        keys = [c.split(":")[0] for c in changes]
        raise CheckpointError(
            f"cannot resume from {checkpoint}: the recipe changed since it was written ({'; '.join(changes)}). "
            f"Resuming would not reproduce the run. Restore those values, or accept the change with "
            f"train.resume_ignore_changes=[{','.join(keys)}]"
        )


def refuse_changed_data(checkpoint: Path, data_identity: dict) -> None:
    """The labels and the splits' contents must be those the checkpoint trained on (checked before any weight loads)."""
    saved = read_saved_state(checkpoint)[1].get("data") or {}
    if not saved:  # written before checkpoints recorded their data
        return
    old, new = saved.get("labels", []), data_identity["labels"]
    if old != new:
        added, removed = sorted(set(new) - set(old)), sorted(set(old) - set(new))
        change = "; ".join(part for part in (f"added {excerpt(added)}" if added else "",
                                             f"removed {excerpt(removed)}" if removed else "") if part) or "reordered"
        raise CheckpointError(
            f"cannot resume from {checkpoint}: the dataset's labels changed since it was written ({change}); the "
            "checkpoint's classifier has one output per old label. Restore the class folders as they were, or train "
            "again with overwrite=true (or another output_dir)"
        )
    changed = [split for split in ("train", "eval") if saved.get(split) != data_identity[split]
               or _differs(saved.get(f"{split}_content"), data_identity.get(f"{split}_content"))]
    if changed:
        raise CheckpointError(
            f"cannot resume from {checkpoint}: the data of the {' and '.join(changed)} split(s) changed since it was "
            "written (images added, removed or modified: the datasets fingerprint, or the image files' bytes, "
            "differ). Resuming would re-draw "
            "the eval split and the sample order, so images trained on could land in evaluation. Restore the data "
            "as it was, or train again with overwrite=true (or another output_dir)"
        )


def refuse_changed_teacher(checkpoint: Path, data_identity: dict) -> None:
    """train.distill: the teacher's weights must be those the checkpoint's steps followed (a teacher retrained in
    place keeps its folder name, which the recipe check sees unchanged)."""
    saved = (read_saved_state(checkpoint)[1].get("data") or {}).get("teacher_weights")
    if _differs(saved, data_identity.get("teacher_weights")):
        raise CheckpointError(
            f"cannot resume from {checkpoint}: the teacher's weights (train.distill.teacher) changed since it was "
            "written; the steps before it followed another teacher, so the resumed run would match neither. Restore "
            "that teacher, or train again with overwrite=true (or another output_dir)"
        )


def _differs(saved_hash: str | None, current_hash: str | None) -> bool:
    """Whether two content hashes disagree; one not taken (a checkpoint from before hashing, files over
    data.CONTENT_HASH_LIMIT_BYTES) leaves the check to the fingerprint."""
    return saved_hash is not None and current_hash is not None and saved_hash != current_hash


def load_checkpoint(accelerator, checkpoint: Path, recipe: Recipe, data_identity: dict,
                    before_load: Callable[[dict], None] | None = None) -> TrainState:
    """Model from safetensors; optimizer, scheduler and RNG through torch.load(weights_only=True). `before_load`
    sees the saved trainer state first (a resolution schedule moves the model to the size it was saved at)."""
    from accelerate.utils import load

    refuse_changed_recipe(checkpoint, recipe)
    refuse_changed_data(checkpoint, data_identity)
    refuse_changed_teacher(checkpoint, data_identity)
    writers = len(list(checkpoint.glob("random_states_*.pkl")))
    if writers and writers != accelerator.num_processes:
        raise CheckpointError(
            f"cannot resume from {checkpoint}: it was written by {writers} process(es) and this run has "
            f"{accelerator.num_processes}; each optimiser step would see other batches. Launch "
            f"{writers} process(es) to resume it"
        )
    try:
        # Accelerate skips an RNG file it cannot read without a word, and the resumed run would then quietly
        # differ from the original; reading it here first turns that into an error.
        load(checkpoint / f"random_states_{accelerator.process_index}.pkl")
        if before_load is not None:
            before_load(read_saved_state(checkpoint)[1])
        accelerator.load_state(str(checkpoint))
        return TrainState(**read_saved_state(checkpoint)[1])
    except READ_ERRORS as error:
        if unreadable_file(checkpoint) is None:  # every file reads back: intact, but saved for another shape of run
            raise CheckpointError(
                f"cannot resume from {checkpoint}: it is intact, but what it saved does not fit this run "
                f"({type(error).__name__}: {shortened(error)}); a change accepted with train.resume_ignore_changes"
                f"={excerpt(recipe.train.resume_ignore_changes)} changes the model or optimiser it saved. Fix: restore "
                "those keys' values to resume it, or train again with overwrite=true (or another output_dir)"
            ) from None
        raise DamagedCheckpoint(
            f"cannot resume from {checkpoint}: it is damaged or was not written by vit_finetune "
            f"({type(error).__name__}: {shortened(error)}). Resume from an earlier checkpoint with "
            f"train.resume=<its folder>, or start again with overwrite=true"
        ) from None


def unreadable_file(checkpoint: Path) -> str | None:
    """The first of a checkpoint's weight and state files that does not read back, with why; None when all do. Only
    asked after a load failed: a failure with every file readable is a run that does not fit, never damage."""
    from accelerate.utils import load  # torch.load(weights_only=True), with the NumPy types RNG states hold
    from safetensors.torch import load_file

    for path in sorted(checkpoint.rglob("*")):
        if path.suffix not in (".safetensors", ".bin", ".pkl", ".pt"):
            continue
        try:
            load_file(str(path)) if path.suffix == ".safetensors" else load(path)
        except READ_ERRORS as error:
            return f"{path.name}: {type(error).__name__}"
    return None


def load_resumable(accelerator, checkpoint: Path, recipe: Recipe, data_identity: dict,
                   before_load: Callable[[dict], None] | None = None) -> tuple[Path, TrainState]:
    """Load `checkpoint`; with train.resume=auto, a damaged one is moved aside and the next older one loaded.

    Every process must agree: one that cannot read its part makes all of them move on (or stop) together."""
    while True:
        damage = None
        try:
            state = load_checkpoint(accelerator, checkpoint, recipe, data_identity, before_load)
        except DamagedCheckpoint as error:
            damage = error
        if not any_process(accelerator, damage is not None):
            return checkpoint, state
        if recipe.train.resume != "auto":
            raise damage or DamagedCheckpoint(f"cannot resume from {checkpoint}: another process could not read its part")
        accelerator.wait_for_everyone()  # every process is done with its files before the folder moves
        set_aside(checkpoint, damage or "another process could not read its part", accelerator.is_main_process)
        accelerator.wait_for_everyone()
        older = resolve_resume("auto", checkpoint.parent.parent, accelerator.is_main_process)
        if older is None:
            raise CheckpointError(
                f"{damage or 'a checkpoint could not be read by another process'}. No older checkpoint in "
                f"{checkpoint.parent} loads; the damaged ones were moved aside ({DAMAGED_PREFIX}*). Run the same "
                "command again to start from the beginning"
            )
        checkpoint = older

