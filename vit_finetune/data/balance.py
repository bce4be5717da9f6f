"""Skewed label counts (data.class_balance): class weights in the loss, or a sampler that draws classes equally often.
(The multi-label task weighs each class's positives instead: see vit_finetune/tasks.)

`weights`: the loss of an image of class c is weighted by N / (C × n_c) (inverse frequency, normalised so that
the average weight over the training images is 1). `sampler`: each epoch draws N images with replacement, each
with probability proportional to 1 / n_c, so every class is drawn about N / C times; the draw is fixed by
(seed, epoch) like the shuffle it replaces, so a resumed run sees the same images.
"""

from __future__ import annotations

import torch

from vit_finetune.data.loaders import EpochSampler
from vit_finetune.data.splits import Splits


def class_counts(labels: list[int], num_classes: int) -> torch.Tensor:
    """Images per class, from the label column (class ids 0..num_classes-1)."""
    return torch.bincount(torch.as_tensor(labels, dtype=torch.long), minlength=num_classes)


def class_weights(labels: list[int], num_classes: int) -> torch.Tensor:
    """N / (C × n_c) per class, float32; 0 for a class with no training image (it is never a target)."""
    counts = class_counts(labels, num_classes).double()
    weights = counts.sum() / (num_classes * counts)
    return torch.where(counts > 0, weights, torch.zeros_like(weights)).float()


def balancing(kind: str | None, splits: Splits, seed: int) -> tuple[EpochSampler | None, torch.Tensor | None]:
    """data.class_balance -> (the training sampler, or None for the usual shuffle; the loss's class weights, or None)."""
    if kind is None:
        return None, None
    labels = list(splits.train[splits.label_column])
    if kind == "sampler":
        return BalancedEpochSampler(labels, len(splits.labels), seed), None
    return None, class_weights(labels, len(splits.labels))


class BalancedEpochSampler(EpochSampler):
    """EpochSampler's (index, epoch) keys, drawn with replacement so that each class comes up equally often."""

    def __init__(self, labels: list[int], num_classes: int, seed: int):
        super().__init__(len(labels), seed, shuffle=True)
        counts = class_counts(labels, num_classes).double()
        per_class = torch.where(counts > 0, 1 / counts, torch.zeros_like(counts))
        self.sample_weights = per_class[torch.as_tensor(labels, dtype=torch.long)]

    def __iter__(self):
        generator = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
        order = torch.multinomial(self.sample_weights, self.size, replacement=True, generator=generator).tolist()
        epoch = self.epoch
        return iter([(index, epoch) for index in order])
