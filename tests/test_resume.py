"""Exactness: the same recipe and seed give the same run, and a run killed anywhere and resumed with
train.resume=auto ends bit-identical to one never interrupted (CPU, tiny ViT, data made here).

Every interrupted run is compared with one uninterrupted reference run: its history (loss and lr of
every step, eval entries), its final weights (torch.equal) and the samples of every optimiser step,
observed from outside the package by tests/recorder.py.
"""

from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path

import pytest

import recorder
from runs import (SimulatedKill, assert_bit_identical, assert_each_sample_once_per_epoch, completed,
                  before_batch, exists, history, kill_at, launch_and_kill, losses, train)

pytestmark = pytest.mark.slow



@pytest.fixture(scope="module")
def reference(args, tmp_path_factory) -> Path:
    """The uninterrupted run every other run is compared with; its samples are in <folder>/record."""
    folder = tmp_path_factory.mktemp("reference")
    assert train([*args, f"output_dir={folder / 'out'}"], record=folder / "record") == 0
    return folder


def reference_steps(reference: Path) -> dict[int, dict]:
    return recorder.steps_as_trained(recorder.read_samples(reference / "record"))


def assert_same_run(output: Path, record_segments: list[list[dict]], reference: Path) -> None:
    """Same history, same final weights, same samples in the same order as the reference."""
    assert history(output) == history(reference / "out")
    assert_bit_identical(output / "model.safetensors", reference / "out" / "model.safetensors")
    steps = recorder.steps_as_trained(*record_segments)
    assert steps == reference_steps(reference)
    assert_each_sample_once_per_epoch(steps)


# ---------------------------------------------------------------- 1. determinism


def test_same_recipe_and_seed_give_identical_losses_weights_and_samples(args, reference, tmp_path):
    assert train([*args, f"output_dir={tmp_path / 'out'}"], record=tmp_path / "record") == 0
    assert len(losses(reference / "out")) == 12  # train.log_every_steps=1: one loss per optimiser step
    assert losses(tmp_path / "out") == losses(reference / "out")  # exact float equality, not a tolerance
    assert_same_run(tmp_path / "out", [recorder.read_samples(tmp_path / "record")], reference)


# ---------------------------------------------------------------- 2. SIGKILL and resume


def test_killed_twice_in_one_epoch_then_resumed_equals_the_uninterrupted_run(args, reference, warm_launcher,
                                                                             tmp_path):
    out = tmp_path / "out"
    run = [*args, f"output_dir={out}", "train.checkpoint_every_steps=2", "train.keep_checkpoints=10"]
    first = launch_and_kill(warm_launcher, run, tmp_path / "r1", exists(completed(out, 2)), tmp_path / "1.log")
    assert first.returncode == -signal.SIGKILL, first.stderr[-2000:]
    second = launch_and_kill(warm_launcher, [*run, "train.resume=auto"], tmp_path / "r2", exists(completed(out, 4)),
                             tmp_path / "2.log")
    assert second.returncode == -signal.SIGKILL, second.stderr[-2000:]
    assert "resuming from" in second.stdout and "at step 2" in second.stdout
    assert not (out / "metrics.json").exists()
    assert train([*run, "train.resume=auto"], record=tmp_path / "r3") == 0

    segments = [recorder.read_samples(tmp_path / name) for name in ("r1", "r2", "r3")]
    assert segments[1][0]["step"] == 3 and segments[2][0]["step"] == 5  # both kills fell inside epoch 0 (steps 1-6)
    assert_same_run(out, segments, reference)


def test_a_kill_across_an_epoch_boundary_replays_the_end_of_the_epoch_once(args, reference, tmp_path, capsys):
    out = tmp_path / "out"
    run = [*args, f"output_dir={out}", "train.checkpoint_every_steps=5"]
    # Killed once epoch 0 has ended and been evaluated, as step 7 starts: the last checkpoint (step 5) lies before the
    # boundary. In this process (a real SIGKILL is the test above's).
    with pytest.raises(SimulatedKill):
        train(run, record=tmp_path / "r1", callbacks=[kill_at(7)])
    assert "step 6: eval accuracy" in capsys.readouterr().out
    assert not completed(out, 10).exists()
    assert train([*run, "train.resume=auto"], record=tmp_path / "r2") == 0

    segments = [recorder.read_samples(tmp_path / name) for name in ("r1", "r2")]
    assert max(entry["step"] for entry in segments[0]) >= 6 and segments[1][0]["step"] == 6
    assert_same_run(out, segments, reference)


def test_with_every_batch_augmentation_on_a_killed_and_resumed_run_equals_the_uninterrupted_one(args, tmp_path):
    """Mixup, CutMix, TrivialAugment and erasing draw from (seed, epoch, batch), not the global RNG: a resume is exact."""
    options = ["augment.mixup=true", "augment.cutmix=true", "augment.policy=trivialaugment",
               "augment.erasing_prob=0.5", "train.label_smoothing=0.1"]
    reference = tmp_path / "reference"
    assert train([*args, *options, f"output_dir={reference}"]) == 0
    out = tmp_path / "out"
    run = [*args, *options, f"output_dir={out}", "train.checkpoint_every_steps=4"]
    with pytest.raises(SimulatedKill):
        train(run, callbacks=[kill_at(8)])  # in epoch 1; the checkpoint of step 4 lies in epoch 0
    assert train([*run, "train.resume=auto"]) == 0
    assert history(out) == history(reference)
    assert_bit_identical(out / "model.safetensors", reference / "model.safetensors")


# ---------------------------------------------------------------- 3. a kill during a checkpoint save


def test_a_kill_during_a_checkpoint_save_resumes_from_the_previous_complete_one(args, reference, tmp_path):
    import os

    out = tmp_path / "out"
    run = [*args, f"output_dir={out}", "train.checkpoint_every_steps=2"]
    rename = os.rename

    def killed_before_publishing(source, target):
        if Path(target).name == "step-00000004":
            raise SimulatedKill("killed after writing step 4, before the rename that publishes it")
        rename(source, target)

    with pytest.raises(SimulatedKill):
        train(run, record=tmp_path / "r1", patches=[(os, "rename", killed_before_publishing)])
    checkpoints = out / "checkpoints"
    partial = checkpoints / ".partial-step-00000004"
    # Written completely under its temporary name, marker included, yet not published: it must never load.
    assert (partial / "COMPLETE").is_file() and (partial / "model.safetensors").is_file()
    assert not (checkpoints / "step-00000004").exists()
    # Leftovers of other deaths: a partial folder and a step folder that never got its completion marker.
    (checkpoints / ".partial-step-00000003").mkdir()
    (checkpoints / ".partial-step-00000003" / "model.safetensors").write_bytes(b"half a file")
    shutil.copytree(partial, checkpoints / "step-00000009")
    (checkpoints / "step-00000009" / "COMPLETE").unlink()
    (checkpoints / "step-00000009" / "model.safetensors").write_bytes(b"\0" * 100)  # would fail to load

    assert train([*run, "train.resume=auto"], record=tmp_path / "r2") == 0
    segments = [recorder.read_samples(tmp_path / name) for name in ("r1", "r2")]
    assert segments[1][0]["step"] == 3  # resumed from step 2, the last complete checkpoint
    assert not list(checkpoints.glob(".partial-*"))  # cleaned by the resumed run's first save
    assert not (checkpoints / "step-00000009" / "COMPLETE").exists()  # never completed, never loaded
    assert_same_run(out, segments, reference)


# ---------------------------------------------------------------- 12. SIGINT / SIGTERM


def test_ctrl_c_saves_a_checkpoint_says_how_to_resume_and_the_resume_is_exact(args, reference, warm_launcher,
                                                                              tmp_path):
    out = tmp_path / "out"
    run = [*args, f"output_dir={out}", "train.checkpoint_every_steps=4"]
    interrupted = launch_and_kill(warm_launcher, run, tmp_path / "r1", exists(completed(out, 4)), tmp_path / "1.log",
                                  sig=signal.SIGINT)
    assert interrupted.returncode == 130, interrupted.stderr[-2000:]
    message = interrupted.stderr[interrupted.stderr.index("error: "):]
    assert "train.resume=auto" in message and str(out) in message and "Traceback" not in interrupted.stderr
    saved = json.loads((sorted((out / "checkpoints").glob("step-*"))[-1] / "trainer_state.json").read_text())
    recorded = recorder.read_samples(tmp_path / "r1")
    assert saved["step"] == recorded[-1]["step"]  # saved at the step where the interrupt was noticed
    assert not (out / "metrics.json").exists()

    assert train([*run, "train.resume=auto"], record=tmp_path / "r2") == 0
    assert_same_run(out, [recorded, recorder.read_samples(tmp_path / "r2")], reference)


def test_sigterm_saves_a_checkpoint_at_the_next_step_even_between_scheduled_ones(args, tmp_path, capsys):
    import os

    out = tmp_path / "out"
    calls = []

    def terminated_during_step_3(batch: int) -> None:
        calls.append(batch)
        if batch == 3:
            os.kill(os.getpid(), signal.SIGTERM)  # what a scheduler sends before pre-empting the machine

    code = train([*args, f"output_dir={out}", "train.checkpoint_every_steps=100"],
                 callbacks=[before_batch(terminated_during_step_3)])
    assert code == 130
    assert len(calls) == 3  # stopped at the step the signal arrived in
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-00000003"]
    assert "interrupted at step 3" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler does not outlive the run


# ---------------------------------------------------------------- 4. LoRA


def test_lora_resume_gives_the_same_adapter_as_an_uninterrupted_lora_run(args, tmp_path):
    # LoRA dropout draws from torch's RNG every step: equal adapters need the RNG restored exactly too.
    lora = [*args, "model.lora={r: 4, alpha: 8, dropout: 0.2}", "train.lr=0.01"]
    assert train([*lora, f"output_dir={tmp_path / 'whole'}"]) == 0
    run = [*lora, f"output_dir={tmp_path / 'out'}", "train.checkpoint_every_steps=4"]
    with pytest.raises(SimulatedKill):
        train(run, callbacks=[kill_at(7)])  # the last checkpoint is step 4, mid-epoch 0; step 6 ended the epoch
    assert train([*run, "train.resume=auto"]) == 0

    for name in ("adapter/adapter_model.safetensors", "model.safetensors"):
        assert_bit_identical(tmp_path / "out" / name, tmp_path / "whole" / name)
    assert history(tmp_path / "out") == history(tmp_path / "whole")
