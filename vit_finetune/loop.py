"""The training loop: optimiser steps over the batches, epoch after epoch, and what happens after each step.

`train_loop` reads top to bottom: each optimiser step (forward, backward, clip, step), then note whether it stayed
finite (read back, and a NaN/Inf stops the run, only before a log, an evaluation, a checkpoint or the end: the host
never waits for the device inside a step), log, evaluate, checkpoint, stop (the last step, early stopping, or
SIGINT/SIGTERM, which with train.grad_accum > 1 is also heard between two forward passes). Everything a step does
not need to know (data, model, export) is train.py's; callbacks observe each event (callbacks.py).
"""

from __future__ import annotations

import json
import math
import random
import signal
import time
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from torch.distributed.tensor import DTensor

from . import checkpoint, distill, evaluation, layout, loss_scale, progress as display
from .data import streaming
from .callbacks import Callback, TrainingRun
from .errors import VitFinetuneError
from .parts import Parts
from .processes import any_process, sum_over_processes
from .recipe import Recipe


class NonFiniteLoss(VitFinetuneError):
    """The loss, a gradient or the weights became NaN/Inf; nothing from then on was saved."""

    exit_code = 3


class StuckProcess(VitFinetuneError):
    """Another process of the run stopped answering (stopped, frozen or dead) and the collectives timed out."""


class Interrupted(VitFinetuneError):
    """SIGINT/SIGTERM stopped training (after a checkpoint, if checkpoints are on); the shell's code for Ctrl-C."""

    exit_code = 130


class InterruptFlag:
    """SIGINT/SIGTERM set a flag; the loop checkpoints at the next optimiser step, or, with gradient accumulation,
    at the next forward pass (see StepBoundary), and exits.

    `heard`: this process received a signal. `raised`: the run stops, because some process heard one (all processes
    agree on it at a step's end). Only a second signal heard *here* means "stop now": Ctrl-C or a killed launcher
    reach every process, but not at the same instant, and the late one must still checkpoint with the others."""

    def __init__(self):
        self.heard = self.raised = False
        self.previous = {signum: signal.signal(signum, self._handle) for signum in (signal.SIGINT, signal.SIGTERM)}

    def restore(self) -> None:
        """After the loop, Ctrl-C must stop evaluation, export or a push at once, as usual."""
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)

    def _handle(self, signum, frame):
        if self.heard:  # a second Ctrl-C means: stop now
            raise KeyboardInterrupt
        self.heard = self.raised = True


class StepBoundary:
    """What moves between two optimiser steps and is saved in a checkpoint: the position in the epoch,
    Accelerate's accumulation counter, the random generators (dropout draws from them) and the count of skipped
    images. Taken before each step's first forward pass; put back when a stop between two forward passes drops
    the step's partial gradients, so that the checkpoint then written resumes exactly as one written at the step's start would.
    The weights, optimiser and scheduler do not move between steps."""

    def __init__(self, accelerator: Accelerator, state: checkpoint.TrainState, log: "TrainLog"):
        self.accelerator, self.state, self.log = accelerator, state, log

    def take(self) -> None:
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
        self.saved = (self.state.batches_done, self.accelerator.step, self.log.skipped_here,
                      len(self.log.skipped_this_epoch), random.getstate(), np.random.get_state(),
                      torch.get_rng_state(), cuda)

    def restore(self, model: torch.nn.Module) -> None:
        (self.state.batches_done, self.accelerator.step, self.log.skipped_here, skipped_names, python, numpy,
         torch_cpu, cuda) = self.saved
        del self.log.skipped_this_epoch[skipped_names:]
        random.setstate(python)
        np.random.set_state(numpy)
        torch.set_rng_state(torch_cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
        # The dropped step's partial gradients (Accelerate's optimizer.zero_grad does nothing between two steps).
        model.zero_grad(set_to_none=True)


def stops_between_passes(run: TrainingRun) -> bool:
    """Whether a stop is heard between two forward passes of one optimiser step. Not with one pass per step
    (the step's end is as soon), nor under DeepSpeed (its engine counts passes itself) or with data.streaming (the
    stream's position is not put back): there a stop waits for the step's end."""
    return (run.recipe.train.grad_accum > 1 and not run.recipe.data.streaming
            and run.accelerator.distributed_type != DistributedType.DEEPSPEED)


def train_step(accelerator: Accelerator, parts: Parts, batch: dict, recipe: Recipe,
               skips: loss_scale.SkippedSteps | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward and backward on one batch; on accumulation boundaries, clip and step, and move the lr schedule unless
    fp16's loss scaler skipped the step (`skips`, loss_scale.py). Returns (loss, finite flag)."""
    with accelerator.accumulate(parts.model):
        loss = batch_loss(parts, batch, recipe)
        accelerator.backward(loss)
        finite = torch.isfinite(loss.detach())
        if accelerator.sync_gradients and recipe.train.max_grad_norm is not None:
            norm = accelerator.clip_grad_norm_(parts.model.parameters(), recipe.train.max_grad_norm)
            if isinstance(norm, DTensor):  # FSDP2's norm over all shards; a collective, as clipping is
                norm = norm.full_tensor()
            # DeepSpeed clips inside its own step and may not know the norm yet. Under a loss scaler an overflowing
            # gradient only skips its step: no failure.
            if norm is not None and skips is None:
                finite = finite & torch.isfinite(torch.as_tensor(norm, device=finite.device))
        parts.optimizer.step()
        if accelerator.sync_gradients and not (skips is not None and skips.step_was_skipped()):
            parts.scheduler.step()
        parts.optimizer.zero_grad(set_to_none=True)
    return loss.detach(), finite


def batch_loss(parts: Parts, batch: dict, recipe: Recipe) -> torch.Tensor:
    """The loss on the labels, blended with the loss on the teacher's predictions of the same (augmented, mixed)
    images when train.distill is on."""
    labels = batch["labels"]
    pixels, soft_targets = parts.augment(parts.normalize.rescale(batch["pixel_values"]), labels, *batch["position"])
    output = parts.model(pixel_values=parts.normalize.standardize(pixels))
    if parts.teacher is None:
        return label_loss(parts, output.logits, labels, soft_targets, recipe)
    class_logits, distillation_logits = distill.student_heads(output)
    settings = recipe.train.distill
    return distill.blend(label_loss(parts, class_logits, labels, soft_targets, recipe),
                         distill.teacher_loss(distillation_logits, teacher_logits(parts, batch, pixels), labels,
                                              settings),
                         settings)


def teacher_logits(parts: Parts, batch: dict, pixels: torch.Tensor) -> torch.Tensor:
    """The teacher's logits of the batch's (augmented) pixels: looked up when train.distill.cache_logits labelled the
    unchanging training images before training, else computed now."""
    if parts.teacher_cache is not None:
        return parts.teacher_cache.rows(batch["pixel_digests"], pixels.device)
    return parts.teacher.logits(pixels)


def label_loss(parts: Parts, logits: torch.Tensor, labels: torch.Tensor, soft_targets: torch.Tensor | None,
               recipe: Recipe) -> torch.Tensor:
    """The task's loss over the batch's real images (see each task's `loss`): images skipped as bad train nothing."""
    return parts.task.loss(logits, labels, soft_targets, parts.class_weights, recipe.train.label_smoothing)


class TrainLog:
    """The loop's counters and its progress bar: loss and images since the last log entry, bad images skipped
    by this process. `write` turns the counters into one history entry for all processes."""

    def __init__(self, accelerator: Accelerator, state: checkpoint.TrainState, total_steps: int):
        self.accelerator = accelerator
        # A redrawn bar on a terminal, one plain line per log entry in a log file or CI, nothing with --quiet.
        self.progress = display.progress(total_steps, state.step, "train", enabled=accelerator.is_main_process)
        # Skipped images are counted per process and summed over processes only where the count is saved (each
        # checkpoint, the end): reading a count back every step would sync host and device.
        self.skipped_before, self.skipped_here = state.skipped_images, 0  # all processes' at a resume; ours since
        self.skipped_this_epoch: list[str] = []  # this process's bad files, named on the console at the epoch's end
        self.loss_total = torch.zeros((), device=accelerator.device)
        self.lr = math.nan  # the lr of the last optimiser step (add_step)
        self._restart()

    def _restart(self) -> None:
        self.loss_total.zero_()
        self.loss_batches, self.images, self.clock = 0, 0, time.perf_counter()

    def add_batch(self, loss: torch.Tensor, batch: dict) -> None:
        self.skipped_here += len(batch["skipped"])
        self.skipped_this_epoch += batch["skipped"]
        images = len(batch["labels"]) - len(batch["skipped"])  # the real ones: a bad image's place is blank
        if images:  # a batch of skipped images only has no loss to report
            self.loss_total += loss
            self.loss_batches += 1
        self.images += images * self.accelerator.num_processes

    def add_step(self, lr: float) -> None:
        """One optimiser step done, at `lr`: read before the step, since the scheduler moves it for the next one."""
        self.progress.update(1)
        self.lr = lr

    def write(self, state: checkpoint.TrainState) -> dict:
        """A collective: append the history entry of the steps since the last one (mean loss over processes, the lr
        the last of them trained at, images/s), show it on the progress bar and return it."""
        lr = self.lr
        mean_loss = self._mean_loss_over_processes()
        rate = self.images / (time.perf_counter() - self.clock)
        # No "loss" when no process trained on any image since the last entry (all were skipped as bad).
        trained = {} if mean_loss is None else {"loss": mean_loss}
        # fp16: the steps its loss scaler skipped so far (loss_scale.py); no other precision skips any.
        skipped = {} if self.accelerator.scaler is None else {"skipped_steps": state.skipped_steps}
        entry = {"step": state.step, "epoch": state.epoch, **trained, "lr": lr, "images_per_s": rate, **skipped}
        state.history.append(entry)
        self.progress.set_postfix(loss="-" if mean_loss is None else f"{mean_loss:.4f}", lr=f"{lr:.2e}",
                                  img_s=f"{rate:.0f}", **skipped)
        self._restart()
        return entry

    def _mean_loss_over_processes(self) -> float | None:
        """The mean batch loss over all processes; None if no process had a batch with images."""
        totals = torch.stack([self.loss_total, torch.tensor(float(self.loss_batches), device=self.loss_total.device)])
        loss_sum, count = self.accelerator.reduce(totals, reduction="sum").tolist()
        return loss_sum / count if count else None

    def count_skipped_into(self, state: checkpoint.TrainState) -> None:
        """A collective: state.skipped_images becomes the count of all processes over the whole run."""
        state.skipped_images = self.skipped_before + sum_over_processes(self.accelerator, self.skipped_here)


class NonFiniteWatch:
    """The first optimiser step whose loss or gradient norm was NaN/Inf, kept on the device. Noting a step's flag
    queues two tiny kernels and never waits for the device; `check` reads the step back (a collective) where the
    loop logs, evaluates, checkpoints or ends, so nothing non-finite is ever evaluated or saved, and the error names
    the step where it began. Read after every step instead, the host would wait each step for the previous one's
    end, leaving the GPU idle while the next step is queued (`every_step`: how the bench measures that cost)."""

    NONE = torch.iinfo(torch.int64).max

    def __init__(self, device: torch.device, every_step: bool = False):
        self.first = torch.full((), self.NONE, dtype=torch.int64, device=device)
        self.every_step = every_step

    def note(self, finite: torch.Tensor, step: int, accelerator: Accelerator) -> None:
        self.first = torch.where(finite, self.first, self.first.clamp(max=step))
        if self.every_step:
            self.check(accelerator, step)

    def check(self, accelerator: Accelerator, step: int, model: torch.nn.Module | None = None) -> None:
        """Raise NonFiniteLoss if a step so far was not finite, or, given the `model`, if its weights are not (a
        finite loss and gradient can still step them to Inf): on every process, if on any (a collective)."""
        first = self.first if model is None else torch.where(_weights_finite(model), self.first,
                                                             self.first.clamp(max=step))
        if accelerator.num_processes > 1:
            first = accelerator.gather(first.reshape(1)).min()
        bad_step = int(first.item())
        if bad_step != self.NONE:
            raise NonFiniteLoss(
                f"the loss, a gradient or the weights became NaN/Inf at optimiser step {bad_step}; training stopped, "
                "no checkpoint was written from then on and nothing was saved as the final model. "
                "Lower train.lr, keep train.max_grad_norm set, or use bf16 instead of fp16"
            )


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
        stop = state.step >= last or state.stopped_early or _interrupted(interrupt, accelerator)
        _checkpoint_if_due(run, watch, log, interrupt.raised, callbacks)
        if interrupt.raised:
            raise Interrupted(_interrupt_message(run.recipe, state))
        if stop:
            break
    if interrupt.raised:  # heard between two forward passes: state stands at the last step's end again
        latest = checkpoint.latest_checkpoint(Path(run.recipe.output_dir))
        # Not again for a step already saved (the one resumed from, say): its folder would be replaced for nothing.
        if state.step > 0 and (latest is None or latest.name != layout.checkpoint_name(state.step)):
            _checkpoint_if_due(run, watch, log, True, callbacks)
        raise Interrupted(_interrupt_message(run.recipe, state))
    if state.batches_done:  # the run ended inside an epoch
        _report_skipped(accelerator, run.recipe, state.epoch, log)
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
    while state.step < parts.total_steps and not state.stopped_early:
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
            elif boundary is not None and _interrupted(interrupt, accelerator):  # a collective, as at a step's end
                boundary.restore(parts.model)
                return
        _report_skipped(accelerator, run.recipe, state.epoch, log)
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


def _report_skipped(accelerator: Accelerator, recipe: Recipe, epoch: int, log: TrainLog, shown: int = 5) -> None:
    """A collective: the epoch's count of bad images skipped by all processes, and the first few, on the console."""
    skipped, log.skipped_this_epoch = log.skipped_this_epoch, []
    if not recipe.data.skip_bad_images:  # nothing can have been skipped; every process knows it, so none gathers
        return
    from accelerate.utils import gather_object

    total = sum_over_processes(accelerator, len(skipped))
    first = [name for names in gather_object([skipped[:shown]]) for name in names][:shown]
    if accelerator.is_main_process and total:
        display.say(f"epoch {epoch}: skipped {total} bad image(s) (data.skip_bad_images=true), e.g. {', '.join(first)}")


def _interrupted(flag: InterruptFlag, accelerator: Accelerator) -> bool:
    # Every rank must agree to stop at the same step, or the others wait forever in the next collective.
    flag.raised = any_process(accelerator, flag.raised)
    return flag.raised


def _interrupt_message(recipe: Recipe, state: checkpoint.TrainState) -> str:
    if state.step == 0:  # stopped between two forward passes of the first step
        return "interrupted before the first optimiser step ended; nothing was trained or saved"
    if recipe.train.checkpoint_every_steps:
        return (f"interrupted at step {state.step}; a checkpoint was saved in {recipe.output_dir}/checkpoints. "
                f"Resume with: python -m vit_finetune --recipe <recipe> output_dir={recipe.output_dir} train.resume=auto")
    return (f"interrupted at step {state.step}; no checkpoint was saved because train.checkpoint_every_steps is "
            "not set. Set it to make runs resumable")


def _weights_finite(model: torch.nn.Module) -> torch.Tensor:
    """Checked before anything is saved: a finite loss and gradient can still step the weights to Inf."""
    # Sharded (FSDP2), a parameter is a DTensor: each process checks its own shard, NonFiniteWatch.check asks all.
    local = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters() if p.requires_grad]
    return torch.stack([torch.isfinite(p).all() for p in local]).all()


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
        display.say(f"step {run.state.step}: eval {run.parts.task.headline(metrics)}")


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
