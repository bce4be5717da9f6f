"""fp16's loss scaler: a step whose float16 gradients overflowed is skipped and counted, not a failure.

Under train.mixed_precision=fp16 Accelerate multiplies the loss by a scale before backward (PyTorch's GradScaler:
2**16 at first), so that small gradients survive in float16, and divides it out before the optimiser step. When a
gradient overflowed (Inf/NaN), the scaler skips that step, leaving the weights and the optimiser state as they were,
and halves the scale; after 2,000 clean steps in a row it doubles it. The first steps of a run routinely overflow
while the scale comes down. A skipped step trained nothing, so the lr schedule waits for it (as the Trainer does),
and the run counts it: the log line, metrics.json and the card say how many.

A skip is read off the scale, which falls exactly when the step was skipped. Accelerate's own flag
(`optimizer_step_was_skipped`) cannot tell under PyTorch's fused AdamW, which the run uses: the scaler hands the
overflow to the fused kernel, which skips inside, so Accelerate sees a step that was called and reports none skipped.
"""

from __future__ import annotations

from accelerate import Accelerator

from vit_finetune.artifacts.checkpoint import TrainState
from vit_finetune.core.errors import VitFinetuneError

# The scale below which a run stops. Under 1 the loss is scaled down, not up, and its gradients still overflow:
# they are Inf/NaN in float16 on their own, which no scale can fix (GradScaler's documentation: "if the scale falls
# below 1 ... something is likely wrong"). From the initial 2**16 that takes 17 skipped steps with fewer than 2,000
# clean steps between them, far more than the handful a healthy run skips at its start.
MIN_SCALE = 1.0

FIX = ("Fix: train.mixed_precision=bf16 on a GPU that computes bfloat16 (Ampere or newer), or "
       "train.mixed_precision=no (float32); else lower train.lr and keep train.max_grad_norm set")


class LossScaleCollapsed(VitFinetuneError):
    """fp16's loss scale fell below MIN_SCALE: the gradients overflow float16 unscaled; nothing was saved since."""

    exit_code = 3  # as a NaN/Inf loss (non_finite.NonFiniteLoss): the training diverged


class SkippedSteps:
    """After each optimiser step, whether the loss scaler skipped it; counts the skips in state.skipped_steps."""

    def __init__(self, scaler, state: TrainState):
        self.scaler, self.state = scaler, state
        self.scale = scaler.get_scale()  # what the next step is scaled by (a resume: the checkpoint's)
        self.in_a_row = 0

    def step_was_skipped(self) -> bool:
        """Whether the step just taken was skipped (its scale fell); raises LossScaleCollapsed when the scale falls
        below MIN_SCALE. Reading the scale waits for the step to finish on the device: the schedule must know before
        the next step whether to move."""
        before, self.scale = self.scale, self.scaler.get_scale()
        if self.scale >= before:
            self.in_a_row = 0
            return False
        self.state.skipped_steps += 1
        self.in_a_row += 1
        if self.scale < MIN_SCALE:
            step = self.state.step + 1
            first = step - self.in_a_row + 1
            raise LossScaleCollapsed(
                f"under train.mixed_precision=fp16 the gradients overflowed float16 at optimiser step {step} "
                f"({'steps ' + str(first) + '-' if self.in_a_row > 1 else 'step '}{step} skipped in a row, "
                f"{self.state.skipped_steps} in the run) and the loss scale fell to {self.scale:g}, below "
                f"{MIN_SCALE:g}: the gradients overflow float16 even unscaled. Training stopped; the weights are those "
                f"of step {first - 1} and nothing was saved from then on. {FIX}")
        return True


def skipped_steps(accelerator: Accelerator, state: TrainState) -> SkippedSteps | None:
    """The run's skip counter where Accelerate scales the loss (fp16), else None: no step is ever skipped."""
    return None if accelerator.scaler is None else SkippedSteps(accelerator.scaler, state)


def describe(skipped: int, steps: int) -> str:
    """The console's line at the end of an fp16 run."""
    return (f"train.mixed_precision=fp16: the loss scaler skipped {skipped} of {steps} optimiser steps (their gradients "
            "overflowed float16; a skipped step leaves the weights and the lr schedule as they were)")
