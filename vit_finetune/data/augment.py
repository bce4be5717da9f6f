"""Batch augmentation on the device, DeiT's toolbox through kornia: a policy (RandAugment or TrivialAugment),
random erasing, then Mixup or CutMix, whose targets the task mixes (its mixed_targets: soft targets for class ids).

It runs on whole training batches after they reach the device, on pixels in [0, 1] before the mean/std
normalisation; evaluation never passes through it. Its randomness comes from a generator seeded by
(seed, epoch, batch, process), never from the global RNG, whose state it leaves untouched: a resumed run draws
exactly what the uninterrupted one drew, and dropout draws the same masks with an option on or off.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from vit_finetune.recipe import AugmentSettings

# (labels, own, partner, partner_weight, num_classes, label_smoothing) -> a mixed batch's targets: the task's
# mixed_targets, which knows what its labels are
MixTargets = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, float], torch.Tensor]


def _kornia():
    import kornia.augmentation  # imported on first use: a run with every option off does not need it

    return kornia.augmentation


# Image policies: name -> the kornia module for the settings. Each image of a batch gets its own operations.
POLICIES: dict[str, Callable[[AugmentSettings], torch.nn.Module] | None] = {
    "none": None,
    "randaugment": lambda s: _kornia().auto.RandAugment(n=s.randaugment_ops, m=s.randaugment_magnitude),
    "trivialaugment": lambda s: _kornia().auto.TrivialAugment(),
}


@dataclass(frozen=True)
class Mix:
    """One way to mix pairs of images: the kornia module, and the weight of the partner's label from its lambda."""

    make: Callable[[], torch.nn.Module]
    partner_weight: Callable[[torch.Tensor], torch.Tensor]


MIXES = {
    # kornia's Mixup: x = (1 - lam) * x + lam * partner, lam ~ U(0, 1) per image; the partner's weight is lam.
    "mixup": Mix(lambda: _kornia().RandomMixUpV2(p=1.0, data_keys=["input", "class"]), lambda lam: lam),
    # kornia's CutMix (the paper's lambda): lam = 1 - pasted area / image area, so the partner's weight is 1 - lam.
    "cutmix": Mix(lambda: _kornia().RandomCutMixV2(p=1.0, data_keys=["input", "class"], use_correct_lambda=True),
                  lambda lam: 1 - lam),
}


class BatchAugmenter:
    """Augments one training batch: (pixels in [0, 1], labels) -> (pixels, the task's mixed targets or None when not
    mixed)."""

    def __init__(self, settings: AugmentSettings, num_classes: int, seed: int, total_epochs: int,
                 process_index: int = 0, label_smoothing: float = 0.0, *, mix_targets: MixTargets):
        self.settings = settings
        self.num_classes = num_classes
        self.seed, self.process_index = seed, process_index
        self.label_smoothing = label_smoothing
        self.mix_targets = mix_targets  # turns a mixed batch's pairs into its targets
        self.mix_until_epoch = total_epochs - settings.mix_off_epochs  # epochs from here on are never mixed
        make_policy = POLICIES[settings.policy]
        self.policy = make_policy(settings) if make_policy else None
        self.erasing = _kornia().RandomErasing(p=settings.erasing_prob) if settings.erasing_prob > 0 else None
        self.mixes = {name: MIXES[name].make() for name in MIXES if getattr(settings, name)}

    @property
    def active(self) -> bool:
        return bool(self.policy or self.erasing or self.mixes)

    def __call__(self, pixels: torch.Tensor, labels: torch.Tensor, epoch: int, batch: int
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`batch` counts the batches of the epoch (accumulation micro-batches included), so each key is drawn once.
        `labels`: the task's, one per image ((B,) class ids, (B, C) 0/1 rows for label sets); the task mixes them."""
        if not self.active or labels.numel() == 0:
            return pixels, None
        devices = [pixels.device] if pixels.device.type != "cpu" else []
        with torch.random.fork_rng(devices=devices, device_type=pixels.device.type):
            key = ((self.seed * 1_000_003 + epoch) * 1_000_003 + batch) * 1024 + self.process_index
            torch.manual_seed(key % 2**63)
            if self.policy is not None:
                pixels = self.policy(pixels)
            if self.erasing is not None:
                pixels = self.erasing(pixels)
            mix = self.choose_mix(epoch)
            if mix is None:
                return pixels, None
            # kornia mixes the images' positions in the batch, whatever the labels are: its draws depend on the
            # batch's shape alone, and its (own, partner, lambda) rows then say which images each one blends.
            pixels, mixed = self.mixes[mix](pixels, torch.arange(len(labels), device=labels.device))
        mixed = mixed.view(-1, 3)
        return pixels, self.mix_targets(labels, mixed[:, 0].long(), mixed[:, 1].long(),
                                        MIXES[mix].partner_weight(mixed[:, 2]).float(), self.num_classes,
                                        self.label_smoothing)

    def choose_mix(self, epoch: int) -> str | None:
        """Which mix this batch gets, drawn from the seeded global generator inside __call__; None: not mixed."""
        if not self.mixes or epoch >= self.mix_until_epoch or torch.rand(()).item() >= self.settings.mix_prob:
            return None
        if len(self.mixes) == 1:
            return next(iter(self.mixes))
        return "cutmix" if torch.rand(()).item() < self.settings.mix_switch_prob else "mixup"


def total_epochs(total_steps: int, steps_per_epoch: int) -> int:
    """The epochs a run touches, the last one partly when train.max_steps ends it mid-epoch."""
    return math.ceil(total_steps / steps_per_epoch)
