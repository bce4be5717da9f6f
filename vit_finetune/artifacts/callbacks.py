"""The training loop's hook: callbacks observe a run through named events, so tests, trackers and the
displays share one event stream and nobody patches the loop's functions by name.

    class PrintLoss(Callback):
        def on_log(self, run, entry):
            if run.accelerator.is_main_process and "loss" in entry:
                print(entry["step"], entry["loss"])

    vit_finetune.train(recipe, callbacks=[PrintLoss()])  # this run only (or training.run: the same)
    callbacks.register(PrintLoss())                     # every later run in this process (e.g. a sitecustomize.py)

Each event is called on every process, registered callbacks first, then the run's own, in order. An
exception raised by a callback stops the run like any error of the loop. `run` is the TrainingRun:
`run.state.step` counts optimiser steps done, `run.state.epoch` the current epoch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterable

from vit_finetune.artifacts.parts import Parts

if TYPE_CHECKING:
    from accelerate import Accelerator
    from torch import nn

    from vit_finetune.artifacts.checkpoint import TrainState
    from vit_finetune.recipe import Recipe


@dataclass
class TrainingRun:
    """What the loop works on: the recipe as run (every `auto` resolved: plan.py), Accelerate, the prepared parts
    (model, optimizer, scheduler, loaders) and where the loop stands (state: step, epoch, batches_done,
    skipped_images, history); `asked`: the recipe as given, which each checkpoint records for a resume to compare."""

    recipe: Recipe
    accelerator: Accelerator
    parts: Parts
    state: TrainState
    asked: Recipe


class Callback:
    """Base class: override the events you need; every method does nothing here."""

    def on_train_start(self, run: TrainingRun) -> None:
        """Before the first batch; on a resume, run.state is the checkpoint's (run.state.step > 0)."""

    def on_batch(self, run: TrainingRun, batch: dict) -> None:
        """Before the forward and backward of one batch (pixel_values uint8, labels, skipped); the optimiser
        step it belongs to is run.state.step + 1. With train.grad_accum > 1 several batches make one step."""

    def on_step_end(self, run: TrainingRun) -> None:
        """After each optimiser step (weights updated, run.state.step already counts it)."""

    def on_log(self, run: TrainingRun, entry: dict) -> None:
        """Every train.log_every_steps and at the last step: the history entry just added, with step, epoch, lr,
        images_per_s and loss (the mean over all processes; absent if every image since the last entry was
        skipped as bad)."""

    def on_evaluate(self, run: TrainingRun, metrics: dict) -> None:
        """After each evaluation, during training and the final one: accuracy, eval_loss, macro_f1, eval_samples,
        confusion_matrix, ... of the current weights."""

    def on_save_checkpoint(self, run: TrainingRun, folder: Path) -> None:
        """While a checkpoint is written, before it is marked complete: add your own files to `folder` (each
        process is called; write from one, e.g. run.accelerator.is_main_process). A write error fails the save."""

    def on_load_checkpoint(self, run: TrainingRun, folder: Path) -> None:
        """On a resume, after the checkpoint `folder` was loaded into the model, optimizer and run.state."""

    def on_checkpoint(self, run: TrainingRun, path: Path) -> None:
        """After a checkpoint folder was published (complete) at run.state.step."""

    def on_train_end(self, run: TrainingRun, model: nn.Module) -> None:
        """After the final evaluation, before the output folder is written: the trained model, unwrapped from
        Accelerate and torch.compile (a peft model for LoRA). Not called when the run stops on an error."""


class CallbackList(Callback):
    """Several callbacks seen as one: each event goes to each of them, in order."""

    def __init__(self, callbacks: Iterable[Callback] = ()):
        self.callbacks = list(callbacks)

    def _each(self, event: str, *args) -> None:
        for callback in self.callbacks:
            getattr(callback, event)(*args)

    def on_train_start(self, run):
        self._each("on_train_start", run)

    def on_batch(self, run, batch):
        self._each("on_batch", run, batch)

    def on_step_end(self, run):
        self._each("on_step_end", run)

    def on_log(self, run, entry):
        self._each("on_log", run, entry)

    def on_evaluate(self, run, metrics):
        self._each("on_evaluate", run, metrics)

    def on_save_checkpoint(self, run, folder):
        self._each("on_save_checkpoint", run, folder)

    def on_load_checkpoint(self, run, folder):
        self._each("on_load_checkpoint", run, folder)

    def on_checkpoint(self, run, path):
        self._each("on_checkpoint", run, path)

    def on_train_end(self, run, model):
        self._each("on_train_end", run, model)


REGISTERED: list[Callback] = []  # observe every run of this process; see register()


def register(callback: Callback) -> Callback:
    """Observe every later `training.run` in this process (for code that cannot pass callbacks=, e.g. one started
    by the CLI); returns the callback. Remove it again with REGISTERED.remove(callback)."""
    REGISTERED.append(callback)
    return callback
