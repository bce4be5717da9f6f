"""Faults and bad input: non-finite loss, a full disk, a changed recipe on resume, corrupt images.

Each fault ends in one `error: ...` line that says what happened and what to do, a distinct exit code
where the issue asks for one, no traceback, and no lost or poisoned checkpoint.
"""

from __future__ import annotations

import errno
import gc
import hashlib
import json
import math
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import yaml
from PIL import Image
from torch.overrides import TorchFunctionMode

import recorder
from runs import RECIPE, before_batch, killed_after_a_checkpoint, train, weights
from tiny import make_tiny_vit, write_colour_folder

pytestmark = pytest.mark.slow



def error_line(stderr: str) -> str:
    """What cli.main printed last, from its `error: ` line on (progress bars come before it)."""
    assert "Traceback" not in stderr, stderr[-3000:]
    lines = stderr.splitlines()  # also splits at the carriage returns of progress bars
    start = max(i for i, line in enumerate(lines) if line.startswith("error: "))
    return "\n".join(lines[start:])


def snapshot(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.rglob("*") if p.is_file()}


def all_finite(path: Path) -> bool:
    return all(torch.isfinite(t).all() for t in weights(path).values())


# ---------------------------------------------------------------- 7. non-finite loss


def test_a_nan_loss_stops_at_the_next_checkpoint_naming_its_step_and_leaves_the_last_good_one(args, tmp_path, capsys,
                                                                                              hub, hub_repo_id,
                                                                                              monkeypatch):
    from conftest import HUB_TOKEN

    monkeypatch.setenv("HF_TOKEN", HUB_TOKEN)
    out = tmp_path / "out"
    cross_entropy = torch.nn.functional.cross_entropy
    steps, good = [], {}

    def count_steps(batch: int) -> None:
        steps.append(batch)
        if batch == 5:
            good.update(snapshot(out / "checkpoints" / "step-00000004"))  # as it was before anything went wrong

    def nan_loss_at_step_5(logits, labels, **kwargs):
        loss = cross_entropy(logits, labels, **kwargs)
        return loss * float("nan") if len(steps) == 5 and "label_smoothing" in kwargs else loss

    # Logged every 4 steps: step 6's checkpoint is the first point after step 5 where the loop reads the check back.
    code = train([*args, f"output_dir={out}", "train.checkpoint_every_steps=2", "train.log_every_steps=4",
                  "hub.push=true", f"hub.repo_id={hub_repo_id}"],
                 callbacks=[before_batch(count_steps)], patches=[(torch.nn.functional, "cross_entropy", nan_loss_at_step_5)])
    assert code == 3  # non_finite.NonFiniteLoss.exit_code: distinct from a usage error (2) or any other failure (1)
    assert len(steps) == 6  # stopped before step 6 was saved, the step where the NaN began named
    assert "NaN/Inf at optimiser step 5" in error_line(capsys.readouterr().err)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000002", "step-00000004"]
    assert snapshot(out / "checkpoints" / "step-00000004") == good
    assert all_finite(out / "checkpoints" / "step-00000004" / "model.safetensors")
    assert not (out / "metrics.json").exists() and not (out / "model.safetensors").exists()
    assert not hub.repo_exists(hub_repo_id)  # nothing pushed


class HostReads(TorchFunctionMode):
    """Records each call that, on a tensor in GPU memory, makes the host wait for the device to finish its queued work
    (a CPU has no such wait: on this machine the calls are what is counted, wherever their tensor lives)."""

    READS = {torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.__float__, torch.Tensor.__int__,
             torch.Tensor.__index__, torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.cpu, torch.Tensor.nonzero,
             torch.nonzero, torch.Tensor.any, torch.Tensor.all}

    def __init__(self):
        super().__init__()
        self.counting, self.calls = False, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.counting and func in self.READS:
            self.calls.append(func.__name__)
        return func(*args, **(kwargs or {}))


def test_steps_between_logs_never_wait_for_the_device(args, tmp_path):
    """The NaN/Inf check of each step stays on the device until the next log, evaluation or checkpoint: reading it
    back after every step (as the loop once did) made the host wait for each step's end before it queued the next."""
    from vit_finetune.artifacts.callbacks import Callback

    reads = HostReads()

    class CountBetweenSteps(Callback):
        def on_step_end(self, run):  # from the end of step 1 to the end of step 4: steps 2-4 and what follows each
            reads.counting = run.state.step in (1, 2, 3)

    run = [*args, "train.max_steps=5", "train.log_every_steps=5", f"output_dir={tmp_path / 'out'}"]
    with reads:
        assert train(run, callbacks=[CountBetweenSteps()]) == 0
    assert reads.calls == []


@pytest.mark.parametrize("lr", ["1e6"])  # the largest the recipe accepts (inf and nan are refused at validation)
def test_a_huge_learning_rate_never_saves_non_finite_weights(args, tmp_path, capsys, lr):
    out = tmp_path / "out"
    # A huge lr can keep the loss and gradient finite while it steps the weights to Inf/NaN: the checkpoint of
    # that step must be refused too, or resume=auto would pick it and fail forever.
    assert train([*args, f"output_dir={out}", f"train.lr={lr}", "train.checkpoint_every_steps=1"]) == 3
    assert "NaN/Inf" in error_line(capsys.readouterr().err)
    for saved in (out / "checkpoints").glob("step-*"):
        assert all_finite(saved / "model.safetensors"), saved.name
    assert not (out / "metrics.json").exists() and not (out / "model.safetensors").exists()


# ---------------------------------------------------------------- 8. disk full


@pytest.fixture
def small_disk(tmp_path):
    """A real 480 KiB tmpfs: one checkpoint of the tiny run (~310 KiB) fits, a second does not."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=480k", "tmpfs", str(mount)],
                                           capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs needs root; test_disk_full_injected covers the same path")
    yield mount
    gc.collect()  # what the run left in reference cycles may still map a file there (tests/conftest.py: the collector)
    subprocess.run(["umount", str(mount)], check=True)


def test_a_full_disk_during_a_checkpoint_keeps_the_previous_one_loadable(args, small_disk, tmp_path, capsys):
    out = small_disk / "out"
    run = [*args, f"output_dir={out}", "train.checkpoint_every_steps=2", "train.keep_checkpoints=1"]
    assert train(run, record=tmp_path / "r1") == 1
    error = error_line(capsys.readouterr().err)
    # On a real full disk safetensors raises SafetensorError and torch.save a RuntimeError, not OSError.
    assert "could not write checkpoint" in error and "step-00000004" in error and "MiB free" in error
    assert f"intact: {out / 'checkpoints' / 'step-00000002'}" in error and "train.resume=auto" in error
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-00000002"]  # the partial one removed

    subprocess.run(["mount", "-o", "remount,size=16m", str(small_disk)], check=True)  # the user frees space
    assert train([*run, "train.resume=auto"], record=tmp_path / "r2") == 0
    assert recorder.read_samples(tmp_path / "r2")[0]["step"] == 3  # resumed from step 2
    assert json.loads((out / "metrics.json").read_text())["steps"] == 12


def test_disk_full_injected_during_a_checkpoint_and_during_the_final_save(args, tmp_path, capsys):
    """Injected faults, for machines where a tmpfs cannot be mounted; the errors are what a full disk raises."""
    import accelerate
    from safetensors import SafetensorError

    out = tmp_path / "out"
    run = [*args, f"output_dir={out}", "train.checkpoint_every_steps=6"]
    save_state, calls = accelerate.Accelerator.save_state, []

    def second_save_hits_a_full_disk(self, output_dir=None, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            (Path(output_dir) / "optimizer.bin").write_bytes(b"half written")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return save_state(self, output_dir, **kwargs)

    assert train(run, patches=[(accelerate.Accelerator, "save_state", second_save_hits_a_full_disk)]) == 1
    error = error_line(capsys.readouterr().err)
    assert "could not write checkpoint" in error and "No space left on device" in error
    assert f"intact: {out / 'checkpoints' / 'step-00000006'}" in error
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-00000006"]

    import safetensors.torch

    serialize_file = safetensors.torch.serialize_file

    def final_model_hits_a_full_disk(tensors, filename, *rest, **kwargs):
        if ".staging-final" in str(filename):
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        return serialize_file(tensors, filename, *rest, **kwargs)

    assert train([*run, "train.resume=auto"], patches=[(safetensors.torch, "serialize_file", final_model_hits_a_full_disk)]) == 1
    error = error_line(capsys.readouterr().err)
    assert "could not write the final model" in error and "No space left on device" in error
    assert f"intact: {out / 'checkpoints' / 'step-00000012'}" in error and "train.resume=auto" in error
    assert not (out / "metrics.json").exists() and not (out / ".staging-final").exists()
    assert train([*run, "train.resume=auto"]) == 0  # the space is back: only export is left to do
    assert json.loads((out / "metrics.json").read_text())["steps"] == 12


# ---------------------------------------------------------------- 9. resume with a changed recipe


@pytest.fixture(scope="module")
def unfinished(args, tmp_path_factory) -> Path:
    """A run killed at step 3 whose last checkpoint is step 2."""
    return killed_after_a_checkpoint(args, tmp_path_factory.mktemp("unfinished") / "out")


@pytest.fixture(scope="module")
def other_base(tmp_path_factory) -> Path:
    return make_tiny_vit(tmp_path_factory.mktemp("other-vit"), seed=1)


@pytest.mark.parametrize("change, key", [
    ("train.seed=2", "train.seed: 1 -> 2"),
    ("train.batch_size=8", "train.batch_size: 4 -> 8"),
    ("train.lr=0.01", "train.lr: 0.005 -> 0.01"),
    ("model.base=OTHER", "model.base: "),
])
def test_resuming_with_a_changed_recipe_is_refused_before_training(args, unfinished, other_base, tmp_path, capsys,
                                                                   change, key):
    change = change.replace("OTHER", str(other_base))
    before = snapshot(unfinished)
    code = train([*args, f"output_dir={unfinished}", "train.checkpoint_every_steps=2", "train.resume=auto", change],
                 record=tmp_path / "record")
    assert code == 1
    error = error_line(capsys.readouterr().err)
    assert "cannot resume" in error and key in error
    assert f"train.resume_ignore_changes=[{key.split(':')[0]}]" in error
    assert recorder.read_samples(tmp_path / "record") == []  # not one optimiser step ran
    assert snapshot(unfinished) == before


def test_every_changed_key_is_named_at_once(args, unfinished, capsys):
    assert train([*args, f"output_dir={unfinished}", "train.resume=auto", "train.seed=2", "train.lr=0.01"]) == 1
    error = error_line(capsys.readouterr().err)
    assert "train.seed: 1 -> 2" in error and "train.lr: 0.005 -> 0.01" in error
    assert "train.resume_ignore_changes=[train.lr,train.seed]" in error


def test_the_documented_override_accepts_a_change(args, unfinished, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(unfinished, out)
    run = [*args, f"output_dir={out}", "train.resume=auto", "train.lr=0.01"]
    assert train([*run, "train.resume_ignore_changes=[train.lr]"], record=tmp_path / "record") == 0
    assert recorder.read_samples(tmp_path / "record")[0]["step"] == 3
    steps = [h for h in json.loads((out / "history.json").read_text()) if "lr" in h]
    assert steps[1]["lr"] < 0.005 < steps[2]["lr"]  # steps 1-2 ran at 0.005, step 3 on at the new lr's schedule


# ---------------------------------------------------------------- 10. corrupt data


@pytest.fixture(scope="module")
def dirty_images(tmp_path_factory) -> Path:
    """Normal images plus five kinds of bad one, all in the training split."""
    root = write_colour_folder(tmp_path_factory.mktemp("dirty"), classes=3, train=8, validation=3)
    train_dir = root / "train"
    jpeg = train_dir / "red" / "truncated.jpg"
    Image.open(train_dir / "red" / "0.png").convert("RGB").save(jpeg, quality=90)
    jpeg.write_bytes(jpeg.read_bytes()[: jpeg.stat().st_size // 2])
    (train_dir / "green" / "empty.png").write_bytes(b"")
    (train_dir / "blue" / "notes.jpg").write_text("not an image, a text file with an image's name\n")
    Image.new("RGB", (1, 1), (200, 30, 30)).save(train_dir / "red" / "one-pixel.png")
    Image.new("1", (10_000, 10_000)).save(train_dir / "green" / "huge.png")  # 100 MP: over the decompression-bomb limit
    return root


BAD_FILES = ("truncated.jpg", "empty.png", "notes.jpg", "one-pixel.png", "huge.png")


@pytest.mark.timeout(180)
def test_a_bad_image_is_named_cleanly_even_from_a_dataloader_worker(base, dirty_images, tmp_path, capsys):
    code = train([f"model.base={base}", f"data.dataset={dirty_images}", *RECIPE, "data.num_workers=2",
                  f"output_dir={tmp_path / 'out'}"])
    assert code == 1
    error = error_line(capsys.readouterr().err)
    first_line = error.splitlines()[0]
    assert first_line.startswith("error: bad image ") and any(name in first_line for name in BAD_FILES)
    assert "data.skip_bad_images=true" in first_line and "worker" not in error
    assert not (tmp_path / "out" / "metrics.json").exists()


@pytest.mark.timeout(180)
def test_skip_bad_images_completes_and_counts_each_skipped_image(base, dirty_images, tmp_path):
    out = tmp_path / "out"
    assert train([f"model.base={base}", f"data.dataset={dirty_images}", *RECIPE, "train.epochs=1",
                  "data.num_workers=2", "data.skip_bad_images=true", f"output_dir={out}"]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["skipped_images"] == len(BAD_FILES) and metrics["eval_samples"] == 9


@pytest.mark.timeout(180)
def test_a_batch_of_only_bad_images_trains_nothing_and_does_not_stop_the_run(base, tmp_path, capsys):
    # 2 good and 4 bad training images in batches of 2: 3 batches an epoch, and the 2 good images can fill at most
    # 2 of them, so whatever order the seeded sampler picks, every epoch has a batch of bad images only.
    images = write_colour_folder(tmp_path / "images", classes=2, train=3, validation=3)
    for name in ("red", "green"):
        (images / "train" / name / "1.png").write_bytes(b"")
        (images / "train" / name / "2.png").write_bytes(b"not an image")
    out, record = tmp_path / "out", tmp_path / "record"
    code = train([f"model.base={base}", f"data.dataset={images}", *RECIPE, "train.batch_size=2",
                  "data.skip_bad_images=true", f"output_dir={out}"], record=record)
    assert code == 0  # not 3: the mean loss over no image (NaN) must not trip the non-finite guard
    steps = recorder.read_samples(record)
    empty_steps = {entry["step"] for entry in steps if not entry["samples"]}
    assert len(empty_steps) >= 2  # at least one per epoch: the case under test did happen
    assert {entry["places"] for entry in steps} == {2}  # every bad image keeps its place: batch shapes never change
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["skipped_images"] == 4 * 2 and metrics["steps"] == 6  # 4 bad files, met once in each of 2 epochs
    history = json.loads((out / "history.json").read_text())
    assert all(math.isfinite(value) for entry in history for key, value in entry.items() if "loss" in key)
    # train.log_every_steps=1: a step that trained on no image logs no loss; every other step does.
    assert {entry["step"] for entry in history if "lr" in entry and "loss" not in entry} == empty_steps
    assert all_finite(out / "model.safetensors")
    console = capsys.readouterr().out
    for epoch in (0, 1):  # the count and the first files, at the end of each epoch
        line = next(line for line in console.splitlines() if line.startswith(f"epoch {epoch}: skipped "))
        assert line.startswith(f"epoch {epoch}: skipped 4 bad image(s)") and line.count(".png") == 4, line


def test_a_key_newer_than_the_checkpoint_counts_as_unchanged_while_it_keeps_its_default(unfinished, tmp_path):
    """A checkpoint written before a recipe key existed ran with what is now that key's default."""
    from vit_finetune.artifacts import checkpoint
    from vit_finetune.recipe import Recipe

    old = tmp_path / "step-00000002"
    shutil.copytree(unfinished / "checkpoints" / "step-00000002", old)
    saved = yaml.safe_load((old / "recipe.yaml").read_text())
    del saved["train"]["label_smoothing"]  # as if written by a version without the key
    (old / "recipe.yaml").write_text(yaml.safe_dump(saved))
    assert checkpoint.changed_keys(old, Recipe.model_validate(saved)) == []
    changed = Recipe.model_validate({**saved, "train": {**saved["train"], "label_smoothing": 0.1}})
    assert checkpoint.changed_keys(old, changed) == ["train.label_smoothing: 0.0 -> 0.1"]
