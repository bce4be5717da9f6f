"""A NaN/Inf loss, gradient or weight: noted on the device at every optimiser step, read back only where the loop
logs, evaluates, checkpoints or ends, and then an error naming the step where it began."""

from __future__ import annotations

import torch
from accelerate import Accelerator
from torch.distributed.tensor import DTensor

from vit_finetune.core.errors import VitFinetuneError


class NonFiniteLoss(VitFinetuneError):
    """The loss, a gradient or the weights became NaN/Inf; nothing from then on was saved."""

    exit_code = 3


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


def _weights_finite(model: torch.nn.Module) -> torch.Tensor:
    """Checked before anything is saved: a finite loss and gradient can still step the weights to Inf."""
    # Sharded (FSDP2), a parameter is a DTensor: each process checks its own shard, NonFiniteWatch.check asks all.
    local = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters() if p.requires_grad]
    return torch.stack([torch.isfinite(p).all() for p in local]).all()
