"""The loop's log: the loss, lr and images/s of the steps since the last entry (one history entry for all processes),
the progress bar, and the bad images skipped, counted and named at each epoch's end."""

from __future__ import annotations

import math
import time

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object

from vit_finetune.artifacts import checkpoint
from vit_finetune.core import progress
from vit_finetune.core.processes import sum_over_processes
from vit_finetune.recipe import Recipe


class TrainLog:
    """The loop's counters and its progress bar: loss and images since the last log entry, bad images skipped
    by this process. `write` turns the counters into one history entry for all processes."""

    def __init__(self, accelerator: Accelerator, state: checkpoint.TrainState, total_steps: int):
        self.accelerator = accelerator
        # A redrawn bar on a terminal, one plain line per log entry in a log file or CI, nothing with --quiet.
        self.progress = progress.progress(total_steps, state.step, "train", enabled=accelerator.is_main_process)
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


def report_skipped(accelerator: Accelerator, recipe: Recipe, epoch: int, log: TrainLog, shown: int = 5) -> None:
    """A collective: the epoch's count of bad images skipped by all processes, and the first few, on the console."""
    skipped, log.skipped_this_epoch = log.skipped_this_epoch, []
    if not recipe.data.skip_bad_images:  # nothing can have been skipped; every process knows it, so none gathers
        return
    total = sum_over_processes(accelerator, len(skipped))
    first = [name for names in gather_object([skipped[:shown]]) for name in names][:shown]
    if accelerator.is_main_process and total:
        progress.say(f"epoch {epoch}: skipped {total} bad image(s) (data.skip_bad_images=true), e.g. {', '.join(first)}")
