"""The training loop: optimiser steps over the batches, epoch after epoch, and what happens after each step.

`train_loop` reads top to bottom: each optimiser step (forward, backward, clip, step), then note whether it stayed
finite (read back, and a NaN/Inf stops the run, only before a log, an evaluation, a checkpoint or the end: the host
never waits for the device inside a step), log, evaluate, checkpoint, stop (the last step, early stopping, or
SIGINT/SIGTERM, which with train.grad_accum > 1 is also heard between two forward passes). Everything a step does
not need to know (data, model, export) is training.py's; callbacks observe each event (callbacks.py). Its named steps
live beside it: one batch's step (train_step.py), the log (train_log.py), the NaN/Inf watch (non_finite.py) and
stopping on a signal (interrupts.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Iterator

import torch
from accelerate import Accelerator

from vit_finetune.artifacts import checkpoint
from vit_finetune.artifacts.callbacks import Callback, TrainingRun
from vit_finetune.artifacts.train_log import TrainLog, report_skipped
from vit_finetune.core import layout, progress
from vit_finetune.core.errors import VitFinetuneError
from vit_finetune.data import streaming
from vit_finetune.recipe import Recipe
from vit_finetune.tasks import evaluation
from vit_finetune.training import loss_scale
from vit_finetune.training.interrupts import (
    InterruptFlag, Interrupted, StepBoundary, any_process_interrupted, interrupt_message, stops_between_passes,
)
from vit_finetune.training.non_finite import NonFiniteWatch
from vit_finetune.training.train_step import train_step


class StuckProcess(VitFinetuneError):
    """Another process of the run stopped answering (stopped, frozen or dead) and the collectives timed out."""


def train_loop(run: TrainingRun, callbacks: Callback = Callback(), finite_check_every_step: bool = False) -> None:
    """Optimiser steps until the run's last one, or until interrupted; SIGINT/SIGTERM checkpoint first.
    `finite_check_every_step`: read the NaN/Inf check back after every step (NonFiniteWatch), for the bench."""
    interrupt = InterruptFlag()
    log = TrainLog(run.accelerator, run.state, run.parts.total_steps)
    watch = NonFiniteWatch(run.accelerator.device, every_step=finite_check_every_step)
    callbacks.on_train_start(run)
    try:
        _optimise(run, interrupt, log, watch, callbacks)
    except RuntimeError as error:
        if run.accelerator.num_processes > 1 and "timed out" in str(error).lower():
            raise StuckProcess(_collective_timeout_message(run.accelerator, run.recipe, run.state)) from None
        raise
    finally:
        log.progress.close()  # on an error too: its message must start on a line of its own
        interrupt.restore()


def _optimise(run: TrainingRun, interrupt: InterruptFlag, log: TrainLog, watch: NonFiniteWatch,
              callbacks: Callback) -> None:
    """After each optimiser step: note whether it was finite, log, evaluate, checkpoint, stop."""
    state, t, last = run.state, run.recipe.train, run.parts.total_steps
    accelerator = run.accelerator
    for finite in _optimiser_steps(run, log, watch, callbacks, interrupt):
        watch.note(finite, state.step, accelerator)
        callbacks.on_step_end(run)
        if _due(state.step, t.log_every_steps) or state.step == last:
            watch.check(accelerator, state.step)  # the log reads the loss back here anyway
            callbacks.on_log(run, log.write(state))
        if _due(state.step, eval_every_steps(run)) and state.step < last:  # run() evaluates the last step's weights
            _evaluate_during_training(run, callbacks, watch)
        stop = state.step >= last or state.stopped_early or any_process_interrupted(interrupt, accelerator)
        _checkpoint_if_due(run, watch, log, interrupt.raised, callbacks)
        if interrupt.raised:
            raise Interrupted(interrupt_message(run.recipe, state))
        if stop:
            break
    if interrupt.raised:  # heard between two forward passes: state stands at the last step's end again
        latest = checkpoint.latest_checkpoint(Path(run.recipe.output_dir))
        # Not again for a step already saved (the one resumed from, say): its folder would be replaced for nothing.
        if state.step > 0 and (latest is None or latest.name != layout.checkpoint_name(state.step)):
            _checkpoint_if_due(run, watch, log, True, callbacks)
        raise Interrupted(interrupt_message(run.recipe, state))
    if state.batches_done:  # the run ended inside an epoch
        report_skipped(accelerator, run.recipe, state.epoch, log)
    log.count_skipped_into(state)
    if state.step > 0:
        watch.check(accelerator, state.step, run.parts.model)


def _optimiser_steps(run: TrainingRun, log: TrainLog, watch: NonFiniteWatch, callbacks: Callback,
                     interrupt: InterruptFlag) -> Iterator[torch.Tensor]:
    """Forward and backward over the batches, epoch after epoch; yields each optimiser step's finite flag once
    the step is done. An epoch that runs to its end is evaluated, unless train.eval_every_steps is set.
    A stop heard between two forward passes of a step ends it early, the step's partial work dropped."""
    accelerator, parts, state = run.accelerator, run.parts, run.state
    boundary = StepBoundary(accelerator, state, log) if stops_between_passes(run) else None
    skips = loss_scale.skipped_steps(accelerator, state)
    stages = parts.resolution  # None: one size throughout
    while state.step < parts.total_steps and not state.stopped_early:
        if stages is not None:
            stages.enter(run)  # the next step's size: the model and the loaders moved to it if it changed
        step_starts = True
        for batch in _epoch_batches(run):
            if boundary is not None and step_starts:
                boundary.take()
            callbacks.on_batch(run, batch)
            batch["position"] = (state.epoch, state.batches_done)  # seeds the batch's augmentation on the device
            lr = _scheduled_lr(run)  # the lr this step trains at; the scheduler moves it once the step is taken
            loss, finite = train_step(accelerator, parts, batch, run.recipe, skips)
            state.batches_done += 1
            log.add_batch(loss, batch)
            step_starts = accelerator.sync_gradients
            if accelerator.sync_gradients:
                state.step += 1
                log.add_step(lr)
                yield finite
                if stages is not None and stages.changes_after(state.step):
                    break  # a new size from the next step on: the epoch's reading restarts, as a resume's does
            elif boundary is not None and any_process_interrupted(interrupt, accelerator):  # a collective, as at a step's end
                boundary.restore(parts.model)
                return
        else:
            report_skipped(accelerator, run.recipe, state.epoch, log)
            state.epoch += 1
            state.batches_done = 0
            if not eval_every_steps(run) and state.step < parts.total_steps:
                _evaluate_during_training(run, callbacks, watch)


def eval_every_steps(run: TrainingRun) -> int | None:
    """train.eval_every_steps as this run resolved it (auto chooses from the data): steps, or None for every epoch."""
    return run.recipe.train.eval_every_steps


def _epoch_batches(run: TrainingRun) -> Iterable[dict]:
    """The current epoch's batches from state.batches_done on."""
    parts, state = run.parts, run.state
    if run.recipe.data.streaming:  # its position, restored from the checkpoint, already stands after batches_done
        return parts.train_loader.batches(parts.steps_per_epoch * run.recipe.train.grad_accum - state.batches_done)
    # Through the prepared loader: Accelerate's loader re-sets its sampler's epoch from its own pass
    # counter on every pass, which starts at 0 again in a resumed run (and in skip_first_batches' copy).
    parts.train_loader.set_epoch(state.epoch)
    if state.batches_done:
        return run.accelerator.skip_first_batches(parts.train_loader, state.batches_done)
    return parts.train_loader


def _scheduled_lr(run: TrainingRun) -> float:
    """train.lr times the schedule's factor now: what the log calls the run's lr (each group trains at its
    lr_scale times this: layer decay, the head's scale)."""
    group = run.parts.optimizer.param_groups[0]
    return group["lr"] / group.get("lr_scale", 1.0)


def _due(step: int, every: int | None) -> bool:
    """Whether a `*_every_steps` setting (None or 0: never) falls on this step."""
    return bool(every) and step % every == 0


def _checkpoint_if_due(run: TrainingRun, watch: NonFiniteWatch, log: TrainLog, interrupted: bool,
                       callbacks: Callback) -> None:
    """Every train.checkpoint_every_steps, and at once when interrupted (if checkpoints are on at all); never
    after a non-finite step or from non-finite weights."""
    every = run.recipe.train.checkpoint_every_steps
    if not every or not (_due(run.state.step, every) or interrupted):
        return
    watch.check(run.accelerator, run.state.step, run.parts.model)
    log.count_skipped_into(run.state)
    path = checkpoint.save_checkpoint(run.accelerator, Path(run.recipe.output_dir), run.state, run.asked,
                                      run.recipe.train.keep_checkpoints,
                                      write_extras=lambda folder: callbacks.on_save_checkpoint(run, folder))
    callbacks.on_checkpoint(run, path)


def _collective_timeout_message(accelerator: Accelerator, recipe: Recipe, state: checkpoint.TrainState) -> str:
    """Gloo raises on the processes still waiting; the frozen or dead one is among the others."""
    me = accelerator.process_index
    others = [rank for rank in range(accelerator.num_processes) if rank != me]
    who = f"process (rank) {others[0]}" if len(others) == 1 else f"one of the processes (ranks) {others}"
    return (f"process {me} waited train.collective_timeout_s={recipe.train.collective_timeout_s} s at step "
            f"{state.step + 1} for {who}, which is stuck (stopped, frozen or swapping) or died; the run stopped. "
            "Find and end it, then resume with train.resume=auto (if train.checkpoint_every_steps is set); raise "
            "train.collective_timeout_s if a step, evaluation or checkpoint can legitimately take that long")


def measure(run: TrainingRun) -> tuple[dict, evaluation.SplitPredictions]:
    """Metrics of the model's current weights on the eval split (labelled, with what the split was) and the
    per-image predictions behind them, for the pictures; no history entry, no event."""
    parts = run.parts
    predict = evaluation.predict_stream if run.recipe.data.streaming else evaluation.predict_split
    predictions = predict(parts.model, parts.eval_loader, run.accelerator, parts.normalize, parts.task,
                          len(parts.labels))
    metrics = parts.task.report(predictions, parts.labels)
    metrics.update(evaluation.eval_split_fields(parts.eval_split))
    return metrics, predictions


def evaluate(run: TrainingRun, callbacks: Callback) -> tuple[dict, evaluation.SplitPredictions]:
    """measure(), added to the history and passed to the callbacks."""
    metrics, predictions = measure(run)
    run.state.history.append({"step": run.state.step, "epoch": run.state.epoch, **evaluation.as_eval_entry(metrics)})
    callbacks.on_evaluate(run, metrics)
    return metrics, predictions


def _evaluate_during_training(run: TrainingRun, callbacks: Callback, watch: NonFiniteWatch) -> None:
    watch.check(run.accelerator, run.state.step)  # keep_best and early stopping must never see NaN weights' metrics
    metrics, _ = evaluate(run, callbacks)
    if run.accelerator.is_main_process:
        progress.say(f"step {run.state.step}: eval {run.parts.task.headline(metrics)}")


class StreamPositions(Callback):
    """Saves each process's train-stream position in every checkpoint, and restores it on a resume."""

    def __init__(self, loader: streaming.StreamLoader):
        self.loader = loader

    def on_save_checkpoint(self, run, folder: Path) -> None:
        position = self.loader.position
        (folder / layout.STREAM_POSITION_FILE.format(rank=run.accelerator.process_index)).write_text(json.dumps(
            {"pass": position.pass_, "offset": position.offset, "epoch": run.state.epoch,
             "batches_done": run.state.batches_done}))

    def on_load_checkpoint(self, run, folder: Path) -> None:
        path = folder / layout.STREAM_POSITION_FILE.format(rank=run.accelerator.process_index)
        try:
            saved = json.loads(path.read_text())
            self.loader.position = streaming.Position(int(saved["pass"]), int(saved["offset"]))
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise checkpoint.CheckpointError(
                f"cannot resume from {folder}: this process's stream position {path.name} cannot be read "
                f"({type(error).__name__}: {error}); it was written by a run without data.streaming, or is damaged. "
                "Resume from another checkpoint with train.resume=<its folder>, or start again with overwrite=true"
            ) from None
