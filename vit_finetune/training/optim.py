"""The optimiser and its lr schedule: parameter groups with no weight decay on biases, norms and embeddings, and
layer-wise lr decay; a resumed run's hyper-parameters applied again.

Layer-wise lr decay (BEiT, MAE) trains the blocks near the input less than those near the head:
a parameter at depth d gets lr × decay^(L + 1 − d), where the embeddings have depth 0, block i (from 0)
depth i + 1, and the final norm and the head depth L + 1 (so they train at the full lr). A LoRA adapter
takes the depth of the block it sits in. Each family says which block a parameter is in (families.py).

The new head may train at its own lr (train.head_lr): it starts from zero while the rest starts from pretraining.
Each group carries its `lr_scale` (its lr over train.lr); the scheduler scales every group by the same factor, and
the log reports train.lr's scheduled value (loop._scheduled_lr), whichever group comes first.

The auto learning rates (train.lr, train.head_lr) and weight decay are chosen here too, from the measurements.
"""

from __future__ import annotations

import math
import re
from typing import Callable

import torch
from torch import nn

from vit_finetune.model.families import NO_WEIGHT_DECAY
from vit_finetune.model.loading import family_of, head_names
from vit_finetune.recipe import Recipe


BlockIndex = Callable[[str], "int | None"]  # parameter name -> its block's index from 0, None outside the blocks
# What comes before the first block, in every family: patch and position embeddings, CLIP's pre-norm.
BEFORE_BLOCKS = re.compile(r"(?:^|\.)(?:embeddings|pre_layrnorm)\.")


def layer_depth(name: str, block_index: BlockIndex, num_blocks: int) -> int:
    """0 for the embeddings, i + 1 for a parameter of block i, num_blocks + 1 for everything after the blocks."""
    block = block_index(name)
    if block is not None:
        return block + 1
    return 0 if BEFORE_BLOCKS.search(name) else num_blocks + 1


def is_decayed(name: str, parameter: nn.Parameter) -> bool:
    """Weight decay on matrices only: not on biases, norms, tokens or position tables (families.NO_WEIGHT_DECAY)."""
    return parameter.ndim >= 2 and parameter.shape[:2] != (1, 1) and not NO_WEIGHT_DECAY.search(name)


def parameter_groups(model: nn.Module, weight_decay: float, layer_decay: float | None,
                     block_index: BlockIndex | None = None, num_blocks: int = 0,
                     is_head: Callable[[str], bool] = lambda name: False, head_lr_scale: float = 1.0) -> list[dict]:
    """Trainable parameters grouped by (lr scale, weight decay). Without layer decay: the decayed group, then the
    rest (always both, as before). With it (and the model's block_index and num_blocks): one pair per depth, the
    head's first, empty groups left out. With a head_lr_scale other than 1, the new head's parameters (`is_head`)
    form their own groups, first, at that multiple of their depth's lr."""
    groups: dict[tuple[bool, int, bool], dict] = {}
    for name, parameter in model.named_parameters():
        if not parameter.requires_grad:
            continue
        depth = layer_depth(name, block_index, num_blocks) if layer_decay is not None else 0
        scale = layer_decay ** (num_blocks + 1 - depth) if layer_decay is not None else 1.0
        head = head_lr_scale != 1.0 and is_head(name)
        decayed = is_decayed(name, parameter)
        key = (head, depth, decayed)
        groups.setdefault(key, _group(scale * (head_lr_scale if head else 1.0), decayed, weight_decay))
        groups[key]["params"].append(parameter)
    if layer_decay is None:
        for decayed in (True, False):
            groups.setdefault((False, 0, decayed), _group(1.0, decayed, weight_decay))
    # The head's groups first, then deepest first, decayed before not.
    return [groups[key] for key in sorted(groups, key=lambda key: (not key[0], -key[1], not key[2]))]


# train.lr=auto (AdamW), by the size of the pretrained base (its parameters, the new head left out): the peak lr
# measured best for full fine-tuning of a base of that size. On a real DINOv2-S/14 (22M parameters) fine-tuned on four
# small real sets, 1e-4 (the earlier default) lost most of what the pretraining knew within 48-80 steps and 2e-5 kept it
# (the Hugging Face example's documented lr too; docs/training.md, "Transfer on a real base"). The demo's tiny ViT
# (0.46M parameters, pretrained on generated shapes) learns the demo's other shapes best at 2e-3 (docs/training.md,
# "The learning rate by the base's size"). No base in between or above those was measured: every base from
# SMALL_BASE_PARAMETERS on takes 2e-5, the smaller lr, which keeps what its pretrained weights know. LoRA's adapters,
# starting from zero, want 1e-3 whatever the base.
SMALL_BASE_PARAMETERS = 1_000_000
AUTO_LR_ADAMW = {"small": 2e-3, "full": 2e-5, "lora": 1e-3}
# A pinned AdamW lr this many times above or below what auto measured for a base of its size gets a warning line.
FAR_FROM_MEASURED = 10


def parameters_in_words(count: int) -> str:
    """22M, 0.46M, 21k: two significant digits."""
    return f"{count / 1e6:.2g}M" if count >= 100_000 else f"{count / 1e3:.2g}k"


def auto_lr(lora: bool, base_parameters: int) -> tuple[float, str]:
    """The peak lr train.lr=auto stands for (AdamW; the recipe refuses auto with SGD) on a base of
    `base_parameters` parameters (its head left out), and why."""
    if lora:
        return AUTO_LR_ADAMW["lora"], "LoRA: the adapters start from zero"
    size = parameters_in_words(base_parameters)
    if base_parameters < SMALL_BASE_PARAMETERS:
        return AUTO_LR_ADAMW["small"], (f"full fine-tuning of a base of {size} parameters: measured best on the demo's "
                                        "0.46M-parameter ViT")
    return AUTO_LR_ADAMW["full"], (f"full fine-tuning of a base of {size} parameters: a small lr keeps what the "
                                   "pretrained weights know (measured on a 22M-parameter DINOv2-S)")


def pinned_lr_warning(lr: float, lora: bool, base_parameters: int) -> str | None:
    """One line when a pinned AdamW lr is far from what was measured for fine-tuning a base of this size, else None."""
    measured = auto_lr(lora, base_parameters)[0]
    ratio = lr / measured
    if 1 / FAR_FROM_MEASURED < ratio < FAR_FROM_MEASURED:
        return None
    times = f"{ratio:.3g}x" if ratio > 1 else f"1/{1 / ratio:.3g} of"
    tuning = "LoRA" if lora else f"full fine-tuning of a pretrained base of {parameters_in_words(base_parameters)} parameters"
    return (f"warning: train.lr={lr:g} is {times} the lr measured for {tuning} ({measured:g}); a recipe's lr "
            "chosen for another model can ruin this one. Set train.lr=auto to use the measured value")


# train.weight_decay=auto: none. Every measurement behind the other auto values (the transfer study, the demo's lr)
# trained without it, and none measured a gain from it.
AUTO_WEIGHT_DECAY = 0.0


def auto_weight_decay() -> tuple[float, str]:
    """The decoupled weight decay train.weight_decay=auto stands for, and why."""
    return AUTO_WEIGHT_DECAY, "every auto value was measured without weight decay"


# train.head_lr=auto. The new head starts at zero (model.head_init) while the backbone starts from pretraining. At a
# fine-tuning lr for the backbone (AdamW 2e-5), the head then moves too slowly: on a real DINOv2-S/14 the first 80
# steps reached 0.45 on digits with one lr against 0.96 with the head at 2e-3 (docs/training.md, "Transfer on a
# real base"). AdamW normalises each update, so one head lr serves any head; below it the head's lr is raised,
# never lowered. SGD is not measured: its head keeps train.lr.
AUTO_HEAD_LR_ADAMW = 2e-3


def auto_head_lr(optimizer: str, lr: float, head_fitted: bool = False, head_kept: bool = False) -> tuple[float, str]:
    """The head's peak lr that train.head_lr=auto stands for, and why; `head_fitted`: a linear probe fitted it;
    `head_kept`: a student cut from a classifier of the same labels (student.py) kept that classifier's head."""
    if head_fitted:
        return lr, "train.lr: the linear probe fitted the head, so it fine-tunes with the rest"
    if optimizer != "adamw":
        return lr, f"train.lr: a separate head lr is measured for AdamW only, not {optimizer}"
    if lr >= AUTO_HEAD_LR_ADAMW:
        return lr, f"train.lr, already at least {AUTO_HEAD_LR_ADAMW:g}"
    if head_kept:
        return AUTO_HEAD_LR_ADAMW, (f"the student keeps the teacher's trained head; {AUTO_HEAD_LR_ADAMW:g}, as every "
                                    "student of the student study (docs/training.md) trained it")
    return AUTO_HEAD_LR_ADAMW, (f"the new head starts from zero and needs at least {AUTO_HEAD_LR_ADAMW:g} with AdamW, "
                                f"more than train.lr={lr:g} gives the pretrained weights")


# train.warmup_steps=auto. After the linear probe (train.method=lp_ft) the head already fits the training images, and
# AdamW's first update moves every weight by the full lr whatever its gradient (its moment estimates hold one sample),
# which on a real DINOv2-S/14 undid the probe's fit in one step. A linear warm-up over a tenth of the steps lets the
# estimates form first. In the transfer study it decided the result where the runs did not recover and moved the other
# cells within noise (docs/studies/transfer.md, "The methods side by side"). Fine-tuning from a new head keeps
# 0, as the study measured it: the head starts at zero, so the first step moves no backbone weight.
AUTO_WARMUP_SHARE_AFTER_PROBE = 0.1
# From random weights (model.pretrained=false) nothing is small at the start: every recipe that trains a ViT from
# scratch warms up (DeiT: 5 of 300 epochs). The same tenth of the steps; on the demo it is what lifted random weights
# above chance (docs/training.md, "The demo's learning rate").
AUTO_WARMUP_SHARE_FROM_RANDOM = 0.1


def auto_warmup_steps(head_fitted: bool, total_steps: int, head_kept: bool = False,
                      pretrained: bool = True) -> tuple[int, str]:
    """The warm-up steps train.warmup_steps=auto stands for, and why; `head_fitted`: a linear probe fitted the head;
    `head_kept`: a student kept its teacher's trained head; `pretrained`: model.pretrained."""
    if not pretrained:
        steps = int(total_steps * AUTO_WARMUP_SHARE_FROM_RANDOM)
        return steps, (f"a tenth of the {total_steps:,} steps: from random weights every weight moves by the full lr "
                       "from the first step, and training from scratch warms up")
    if not head_fitted:
        if head_kept:
            return 0, "none, as every student of the student study (docs/training.md), each keeping its head, trained"
        return 0, "the new head starts at zero, so the first steps move the backbone little; none, as measured"
    steps = int(total_steps * AUTO_WARMUP_SHARE_AFTER_PROBE)
    return steps, (f"a tenth of the {total_steps:,} steps: the probe's head already fits, and AdamW's first full-size "
                   "steps would undo the fit before its estimates form")


def _group(lr_scale: float, decayed: bool, weight_decay: float) -> dict:
    # `decayed` and `lr_scale` travel in the optimizer's state, so a resume can re-apply a changed lr or weight decay.
    return {"params": [], "weight_decay": weight_decay if decayed else 0.0, "decayed": decayed, "lr_scale": lr_scale}


FUSED_ADAMW_DEVICES = ("cpu", "cuda")


def build_optimizer(model: torch.nn.Module, recipe: Recipe, device_type: str) -> torch.optim.Optimizer:
    """The optimiser of `recipe` as run (plan.py resolved every `auto`)."""
    t = recipe.train
    lr, head_lr = t.lr, t.head_lr
    config, family = model.config, family_of(model.config)
    block_index = (lambda name: family.block_index(name, config)) if t.layer_decay is not None else None
    heads = "|".join(re.escape(name) for name in head_names(model))
    head = re.compile(rf"(?:^|\.)(?:{heads})\.")  # under peft too: base_model.model.classifier...
    groups = parameter_groups(model, t.weight_decay, t.layer_decay, block_index, family.num_blocks(config),
                              lambda name: bool(head.search(name)), head_lr / lr)
    for group in groups:
        group["lr"] = lr * group["lr_scale"]
    if t.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=t.momentum)
    # PyTorch's fused kernel exists for CPU and CUDA. On CPU its default is a per-tensor loop, which took 100-140 ms
    # a step for DINOv2-S's 22M weights on one thread here against 17 ms fused (the Trainer uses fused too); the
    # two updates agree to float32 rounding.
    return torch.optim.AdamW(groups, lr=lr, fused=device_type in FUSED_ADAMW_DEVICES)


def build_scheduler(optimizer, recipe: Recipe, total_steps: int):
    """The lr schedule of `recipe` (resolved: no `auto`) over `total_steps`."""
    t, warmup = recipe.train, recipe.train.warmup_steps

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = (step - warmup) / max(1, total_steps - warmup)
        if t.scheduler == "cosine":
            return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
        if t.scheduler == "linear":
            return max(0.0, 1 - progress)
        return 1.0

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def reapply_hyperparameters(optimizer: torch.optim.Optimizer, scheduler, recipe: Recipe) -> None:
    """After a resume: the loaded optimizer and scheduler states carry the lr, weight decay and momentum of
    the checkpoint (`scheduler`: the LambdaLR, inside Accelerate's wrapper). They equal the recipe's unless a change was accepted with train.resume_ignore_changes,
    and then the recipe's values (`recipe`: as run) must apply from the resumed step on, not be silently replaced."""
    t = recipe.train
    groups = optimizer.param_groups
    # A checkpoint written before groups carried lr_scale and decayed had two: decayed, then not decayed.
    lr = t.lr
    scheduler.base_lrs = [lr * group.get("lr_scale", 1.0) for group in groups]
    for index, (group, base_lr, factor) in enumerate(zip(groups, scheduler.base_lrs, scheduler.lr_lambdas)):
        group.update(initial_lr=base_lr, lr=base_lr * factor(scheduler.last_epoch),
                     weight_decay=t.weight_decay if group.get("decayed", index == 0) else 0.0)
        if "momentum" in group:
            group["momentum"] = t.momentum
