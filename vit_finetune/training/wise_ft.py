"""WiSE-FT after LP-FT: the saved weights interpolated between the fine-tuned model and the probe's model.

Fine-tuning a pretrained backbone on a few hundred images can pull its features away from what made the linear probe
good: on sets where the probe alone is strong, LP-FT ended a little below it. WiSE-FT (Wortsman et al., CVPR 2022,
"Robust fine-tuning of zero-shot models") averages, weight by weight, the fine-tuned model with the one it started
from: alpha x fine-tuned + (1 - alpha) x start. After LP-FT the start is the probe's model (the pretrained backbone
with the probe's head), a classifier in its own right, and fine-tuning began there, so the average is a classifier
too. It costs no training: one copy of the weights, kept on the CPU, and one weighted sum at the end.

train.wise_ft_alpha chooses alpha (1: the fine-tuned weights as they are). Evaluations during training and the
checkpoints see the fine-tuned weights. At the end both the fine-tuned weights and the average are evaluated, and the
average is saved only where it scores no worse on the eval split (selection.average_if_no_worse): an average that
hurt would otherwise be saved with nobody told.
"""

from __future__ import annotations

import torch
from torch import nn

from vit_finetune.recipe import methods

# train.wise_ft_alpha=auto after LP-FT. On the transfer study's real DINOv2-S/14, every LP-FT cell was evaluated at
# alpha 0.75, 0.5, 0.25 and 1 in the same runs (docs/studies/transfer.md, "What the defaults chose, cell by cell").
# 0.75 moved toward the probe where the probe led and cost little where it did not; 0.5 and 0.25 gained more where the
# probe led but lost more where fine-tuning moved far from it, so the conservative 0.75.
AUTO_ALPHA = 0.75
# Under methods.SHORT_BELOW_EPOCHS (many images, few steps) fine-tuning has not seen the data once and the probe alone
# led on some datasets: halfway, which was within noise of the better of the probe alone and LP-FT on every such cell
# of the study, including cells measured after the rule was chosen.
SHORT_SCHEDULE_ALPHA = 0.5
MEASURED_TEXT = "measured on full fine-tuning of single-label classifiers and regressions"


def auto_alpha(method: str, unmeasured: str | None, epochs: float,
               task_alpha: float | None = None) -> tuple[float, str]:
    """train.wise_ft_alpha=auto: the alpha for this run, and why. `unmeasured`: a setting of the run the average was
    not measured with (LoRA, a teacher, weight selection, sharding, a task whose study did not measure it), or None;
    `epochs`: passes over the training images the fine-tuning makes; `task_alpha`: the alpha the task's own study
    chose (Task.wise_ft_auto_alpha), or None."""
    if method != "lp_ft":
        return 1.0, f"train.method={method}: there is no probe's model to average with"
    if unmeasured:
        return 1.0, f"the average was {MEASURED_TEXT}, not with {unmeasured}, so the fine-tuned weights as they are"
    if task_alpha == 0:
        return 0.0, ("the probe's model where it scores no worse on the eval split than the fine-tuned weights: on "
                     "short schedules the regression study's probe alone often led (docs/regression.md)")
    if epochs < methods.SHORT_BELOW_EPOCHS:
        alpha = SHORT_SCHEDULE_ALPHA
        return alpha, (f"under {methods.SHORT_BELOW_EPOCHS:g} epoch of fine-tuning, {alpha:g} x the fine-tuned weights + "
                       f"{1 - alpha:g} x the probe's model (WiSE-FT) was within noise of the better of the probe alone "
                       "and LP-FT on every such cell of the transfer study")
    return AUTO_ALPHA, (f"after LP-FT, {AUTO_ALPHA:g} x the fine-tuned weights + {1 - AUTO_ALPHA:g} x the probe's "
                        "model (WiSE-FT) kept LP-FT's gains and came closer to the probe where the probe alone led")


def refusal(method: str, alpha: float, sharded: bool) -> str | None:
    """Why this run cannot honour an alpha below 1, known only once auto chose the method or the launch chose
    sharding (the recipe's own contradictions are refused when it is read), or None."""
    if alpha == 1 or method == "linear_probe":  # the probe alone: nothing fine-tuned to average
        return None
    if method == "finetune":
        return (f"train.wise_ft_alpha={alpha:g} averages the fine-tuned weights with the probe's model, but "
                "train.method=auto chose finetune for this run (its line above says why), which fits no probe; set "
                "train.method=lp_ft, or train.wise_ft_alpha=auto")
    if sharded:
        return (f"train.wise_ft_alpha={alpha:g} averages whole weights, which a sharded run splits across its "
                "processes; set train.wise_ft_alpha=auto, or launch without FSDP")
    return None


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    """A CPU copy of the model's floating-point weights and buffers: the start the average goes back toward."""
    return {name: tensor.detach().to("cpu", copy=True) for name, tensor in model.state_dict().items()
            if tensor.is_floating_point()}


@torch.no_grad()
def interpolate(model: nn.Module, start: dict[str, torch.Tensor], alpha: float) -> None:
    """In place: every weight of `start` becomes alpha x the model's + (1 - alpha) x start's."""
    current = model.state_dict()
    missing = sorted(set(start) - set(current))
    if missing:
        raise ValueError(f"the probe's model has weights the fine-tuned one lacks: {', '.join(missing[:3])}")
    for name, begun in start.items():
        tensor = current[name]  # shares its storage with the parameter: changing it changes the model
        tensor.mul_(alpha).add_(begun.to(tensor.device, tensor.dtype), alpha=1 - alpha)


@torch.no_grad()
def restore(model: nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """In place: every weight of `weights` (a snapshot) copied back into the model."""
    current = model.state_dict()
    for name, saved in weights.items():
        current[name].copy_(saved)
