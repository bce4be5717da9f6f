"""train.mixed_precision=fp16's loss scaler: a step whose gradients overflow float16 is skipped (the weights, the
optimiser state and the lr schedule stay as they were) and counted, not a failure; a loss scale that falls below 1,
or a NaN loss, stops the run with the fix.

Accelerate has no fp16 on CPU: it sets up neither autocast nor a loss scaler there. `fp16_as_on_cuda` makes the three
settings Accelerate makes for fp16 on a CUDA GPU, with PyTorch's CPU GradScaler standing in for the CUDA one, which
cannot exist on this machine; prepare() then wraps the forward in float16 autocast and the optimiser with the scaler,
exactly as on CUDA. An overflow is injected where a test wants one (an Inf gradient, as float16 gives when a scaled
gradient exceeds 65,504), so that which steps overflow does not depend on the numbers of this tiny model.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from runs import SimulatedKill, history, kill_at, train
from vit_finetune.artifacts.callbacks import Callback
from vit_finetune.training import devices, run as training

pytestmark = pytest.mark.slow

ONE_EPOCH = ["train.epochs=1"]  # 6 optimiser steps (runs.RECIPE: 24 images, batch 4)


def fp16_as_on_cuda(init_scale: float) -> tuple:
    """A patch of devices.make_accelerator (as training/run.py calls it): the run's Accelerator with fp16 set up as
    Accelerate sets it up on CUDA (mixed precision fp16, native autocast, a GradScaler starting at `init_scale`)."""
    made = devices.make_accelerator

    def make_accelerator(recipe):
        accelerator = made(recipe)
        accelerator.state._mixed_precision = "fp16"
        accelerator.native_amp = True
        accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
        return accelerator

    return training, "make_accelerator", make_accelerator  # the name training/run.py calls


class Overflow(Callback):
    """Makes one weight's gradient Inf at the optimiser steps `overflow_at`, and the logits NaN at `nan_loss_at`;
    records after each step the weights, the optimiser's step counts and the dtype a Linear layer computed in."""

    def __init__(self, overflow_at=(), nan_loss_at=()):
        self.overflow_at, self.nan_loss_at = set(overflow_at), set(nan_loss_at)
        self.step = 0
        self.weights: dict[int, dict] = {}
        self.adam_steps: dict[int, list[float]] = {}
        self.linear_dtypes: set[torch.dtype] = set()

    def on_train_start(self, run):
        model = run.parts.model
        weight = next(p for p in model.parameters() if p.requires_grad)
        weight.register_hook(lambda grad: torch.full_like(grad, math.inf) if self.step in self.overflow_at else grad)
        head = model.classifier
        head.register_forward_hook(
            lambda _module, _inputs, output: output * math.nan if self.step in self.nan_loss_at else None)
        layer = next(module for module in model.modules() if isinstance(module, torch.nn.Linear))
        layer.register_forward_hook(lambda _module, _inputs, output: self.linear_dtypes.add(output.dtype)
                                    if torch.is_grad_enabled() else None)
        self.optimizer = run.parts.optimizer.optimizer
        self.starting_scale = run.accelerator.scaler.get_scale()
        self.on_step_end(run)  # the weights the run starts from

    def on_batch(self, run, batch):
        self.step = run.state.step + 1  # the step this batch trains (one batch per step here)

    def on_step_end(self, run):
        step = run.state.step
        self.weights[step] = {name: p.detach().clone() for name, p in run.parts.model.named_parameters()}
        self.adam_steps[step] = [float(state["step"]) for state in self.optimizer.state.values()]


def same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[name], b[name]) for name in a)


def test_an_overflowing_step_is_skipped_the_schedule_waits_for_it_and_the_run_counts_it(args, tmp_path, capsys):
    out, seen = tmp_path / "out", Overflow(overflow_at={2, 3})
    # 2**8: the scale stays far above 1 after two skips, and no gradient of this model overflows at it by itself.
    code = train([*args, *ONE_EPOCH, f"output_dir={out}"], callbacks=[seen], patches=[fp16_as_on_cuda(2.0 ** 8)])
    said = capsys.readouterr()
    assert code == 0, said.err[-2000:]
    assert seen.linear_dtypes == {torch.float16}  # the forwards ran under float16 autocast, as on CUDA
    # The skipped steps changed neither the weights nor the optimiser's state; every other step did.
    for step in range(1, 7):
        skipped = step in (2, 3)
        assert same(seen.weights[step], seen.weights[step - 1]) == skipped, step
        assert (seen.adam_steps[step] == seen.adam_steps[step - 1]) == skipped, step
    assert set(seen.adam_steps[6]) == {4.0}  # AdamW took 4 steps of the 6
    # The schedule moved after steps 1, 4 and 5 only: steps 2-4 trained at one lr (cosine, no warm-up).
    lrs = [entry["lr"] for entry in history(out) if "loss" in entry]
    assert lrs[1] == lrs[2] == lrs[3] and lrs[0] > lrs[1] > lrs[4] > lrs[5]
    assert [entry["skipped_steps"] for entry in history(out) if "loss" in entry] == [0, 1, 2, 2, 2, 2]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["skipped_steps"] == 2 and metrics["steps"] == 6
    assert json.loads((out / "run_info.json").read_text())["mixed_precision"] == "fp16"
    last_log_line = [line for line in said.err.splitlines() if line.startswith("train step 6/6")][-1]
    assert "skipped_steps 2" in last_log_line
    assert "the loss scaler skipped 2 of 6 optimiser steps" in said.out
    assert "2 of 6 optimiser steps skipped by the loss scaler" in (out / "README.md").read_text()


def test_a_resumed_fp16_run_keeps_its_count_and_its_loss_scale(args, tmp_path):
    out, run = tmp_path / "out", [*args, *ONE_EPOCH, "train.checkpoint_every_steps=2"]
    with pytest.raises(SimulatedKill):  # as step 5 starts: the last checkpoint is step 4's
        train([*run, f"output_dir={out}"], callbacks=[Overflow(overflow_at={2}), kill_at(5)],
              patches=[fp16_as_on_cuda(2.0 ** 8)])
    resumed = Overflow(overflow_at={5})
    assert train([*run, f"output_dir={out}", "train.resume=auto"], callbacks=[resumed],
                 patches=[fp16_as_on_cuda(2.0 ** 8)]) == 0
    assert resumed.starting_scale == 2.0 ** 7  # the checkpoint's scale, halved once, not the scaler's initial one
    assert json.loads((out / "metrics.json").read_text())["skipped_steps"] == 2
    assert [entry["skipped_steps"] for entry in history(out) if "loss" in entry] == [0, 1, 1, 1, 2, 2]


def test_a_loss_scale_fallen_below_one_stops_the_run_and_names_the_step_and_the_fix(args, tmp_path, capsys):
    out = tmp_path / "out"
    # From 2.0 the second skip in a row halves the scale to 0.5: below 1 the gradients overflow even unscaled.
    code = train([*args, *ONE_EPOCH, f"output_dir={out}"], callbacks=[Overflow(overflow_at=range(2, 7))],
                 patches=[fp16_as_on_cuda(2.0)])
    assert code == 3
    error = capsys.readouterr().err
    assert "at optimiser step 3 (steps 2-3 skipped in a row, 2 in the run)" in error
    assert "loss scale fell to 0.5" in error and "Fix: train.mixed_precision=bf16" in error
    assert not (out / "metrics.json").exists() and not (out / "model.safetensors").exists()


def test_a_nan_loss_stops_an_fp16_run_where_an_overflow_did_not(args, tmp_path, capsys):
    out = tmp_path / "out"
    code = train([*args, *ONE_EPOCH, f"output_dir={out}"], callbacks=[Overflow(overflow_at={2}, nan_loss_at={4})],
                 patches=[fp16_as_on_cuda(2.0 ** 8)])
    assert code == 3
    error = capsys.readouterr().err
    assert "NaN/Inf at optimiser step 4" in error and "bf16 instead of fp16" in error
    assert not (out / "metrics.json").exists()


def test_fp16_at_the_scalers_default_scale_trains_and_counts_its_skips(args, tmp_path):
    """The run that stopped at step 3 on a GPU: the scale starts at 2**16, where this model's first gradients
    overflow float16 by themselves; each such step is skipped, and the run goes on."""
    out, seen = tmp_path / "out", Overflow()
    assert train([*args, *ONE_EPOCH, f"output_dir={out}"], callbacks=[seen], patches=[fp16_as_on_cuda(2.0 ** 16)]) == 0
    skipped = [step for step in range(1, 7) if same(seen.weights[step], seen.weights[step - 1])]
    assert skipped  # step 3 here (2026-11-29), as on the GPU
    assert json.loads((out / "metrics.json").read_text())["skipped_steps"] == len(skipped)
    assert all(math.isfinite(entry["loss"]) for entry in history(out) if "loss" in entry)
