"""SIGINT/SIGTERM during training: heard as a flag, agreed on by every process at a step's end (or between two
forward passes, where the step's partial work is dropped), then a checkpoint and an exit with the shell's code.
A second signal stops the process at once, even in the middle of a pass."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import threading

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType

from vit_finetune.artifacts import checkpoint
from vit_finetune.artifacts.callbacks import TrainingRun
from vit_finetune.artifacts.train_log import TrainLog
from vit_finetune.core.errors import EXIT_INTERRUPTED, VitFinetuneError
from vit_finetune.core.processes import any_process
from vit_finetune.recipe import Recipe


class Interrupted(VitFinetuneError):
    """SIGINT/SIGTERM stopped training (after a checkpoint, if checkpoints are on); the shell's code for Ctrl-C."""

    exit_code = EXIT_INTERRUPTED


class StoppedAtOnce(VitFinetuneError):
    """A second Ctrl-C heard here (or one once the loop is over): the run stops where it is, nothing more saved; the
    message says what it leaves (previous_run.after_a_stop_at_once)."""

    exit_code = EXIT_INTERRUPTED


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# After a second signal the main thread's KeyboardInterrupt has this long to leave the loop before the process ends.
SECOND_SIGNAL_GRACE_S = 2.0


class SecondSignalWatch:
    """Ends the process soon after a second SIGINT/SIGTERM, even while the main thread cannot hear it.

    Python runs a signal's handler only between two bytecodes of the main thread: during one long forward pass (a
    single C call) or a collective that waits for another process, a second Ctrl-C would wait as long as the first.
    Python's C-level handler writes each signal's number to the wakeup fd at once, so a thread reading it hears the
    second signal on time; if the main thread has not left the loop SECOND_SIGNAL_GRACE_S later, it ends the process
    with the shell's code (128 + the signal). Nothing is left half-written: a checkpoint is published by an atomic
    rename, and a partial one is recorded as the run's own."""

    def __init__(self):
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.write_fd, False)  # set_wakeup_fd requires it: the C handler must never block
        self.previous_fd = signal.set_wakeup_fd(self.write_fd, warn_on_full_buffer=False)
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="second-signal-watch", daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        heard = 0
        while not self.stopped.is_set():
            for signum in os.read(self.read_fd, 64):
                heard += signum in STOP_SIGNALS
                if heard == 2 and not self.stopped.wait(SECOND_SIGNAL_GRACE_S):
                    os.write(2, f"\nerror: a second {signal.Signals(signum).name}: stopped at once, without a "
                                "checkpoint of this step (a checkpoint already saved is whole)\n".encode())
                    os._exit(128 + signum)

    def stop(self) -> None:
        """Back to the previous wakeup fd; the thread wakes on a byte that is no signal and ends."""
        signal.set_wakeup_fd(self.previous_fd)
        self.stopped.set()
        with contextlib.suppress(BlockingIOError):  # a full pipe: the thread has bytes to wake on already
            os.write(self.write_fd, b"\0")
        self.thread.join(timeout=SECOND_SIGNAL_GRACE_S)
        if not self.thread.is_alive():  # else it is still reading: its pipe stays open for the process's life
            os.close(self.read_fd)
            os.close(self.write_fd)


class InterruptFlag:
    """SIGINT/SIGTERM set a flag; the loop checkpoints at the next optimiser step, or, with gradient accumulation,
    at the next forward pass (see StepBoundary), and exits.

    `heard`: this process received a signal. `raised`: the run stops, because some process heard one (all processes
    agree on it at a step's end). Only a second signal heard *here* means "stop now": Ctrl-C or a killed launcher
    reach every process, but not at the same instant, and the late one must still checkpoint with the others."""

    def __init__(self):
        self.heard = self.raised = False
        self.previous = {signum: signal.signal(signum, self._handle) for signum in STOP_SIGNALS}
        self.watch = SecondSignalWatch()

    def restore(self) -> None:
        """After the loop, Ctrl-C must stop evaluation, export or a push at once, as usual."""
        self.watch.stop()
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

    def __init__(self, accelerator: Accelerator, state: checkpoint.TrainState, log: TrainLog):
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


def any_process_interrupted(flag: InterruptFlag, accelerator: Accelerator) -> bool:
    # Every rank must agree to stop at the same step, or the others wait forever in the next collective.
    flag.raised = any_process(accelerator, flag.raised)
    return flag.raised


def interrupt_message(recipe: Recipe, state: checkpoint.TrainState) -> str:
    if state.step == 0:  # stopped between two forward passes of the first step
        return "interrupted before the first optimiser step ended; nothing was trained or saved"
    if recipe.train.checkpoint_every_steps:
        return (f"interrupted at step {state.step}; a checkpoint was saved in {recipe.output_dir}/checkpoints. "
                f"Resume with: python -m vit_finetune --recipe <recipe> output_dir={recipe.output_dir} train.resume=auto")
    return (f"interrupted at step {state.step}; no checkpoint was saved because train.checkpoint_every_steps is "
            "not set. Set it to make runs resumable")
