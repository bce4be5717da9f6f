"""One batch through the model: the loss (on the labels, blended with a teacher's when distilling), backward, and on
an accumulation boundary the clipped optimiser step and the schedule's."""

from __future__ import annotations

import torch
from accelerate import Accelerator
from torch.distributed.tensor import DTensor

from vit_finetune.artifacts.parts import Parts
from vit_finetune.recipe import Recipe
from vit_finetune.training import distill, loss_scale


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
