"""What a run trains with: the model, its data loaders, optimiser and schedule, built by training/run.py and worked on by
the loop (loop.py) and the callbacks (callbacks.py), which import it from here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: the callbacks' module stays light to import
    import torch

    from vit_finetune.data import PixelNormalizer
    from vit_finetune.data.augment import BatchAugmenter
    from vit_finetune.training.distill import Teacher, TeacherLogitsCache
    from vit_finetune.training.probe import ProbeResult
    from vit_finetune.training.resolution import Schedule
    from vit_finetune.data.streaming import StreamLoader
    from vit_finetune.tasks import Task


@dataclass
class Parts:
    task: Task  # what the model learns (single-label, multi-label, regression): its loss, metrics and outputs
    model: torch.nn.Module
    processor: object
    labels: list[str]
    train_loader: torch.utils.data.DataLoader | StreamLoader  # the latter with data.streaming
    eval_loader: torch.utils.data.DataLoader | StreamLoader
    test_loader: torch.utils.data.DataLoader | None  # data.test_split's, scored once after training; None: none
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    normalize: PixelNormalizer
    augment: BatchAugmenter  # DeiT's batch augmentations, on the device; evaluation never uses it
    steps_per_epoch: int
    total_steps: int
    eval_split: str | None = None  # None: held out from train (data.eval_fraction)
    test_split: str | None = None  # data.test_split
    position_tables: dict = field(default_factory=dict)  # "before"/"after" the resample, for the picture
    data_identity: dict = field(default_factory=dict)  # the labels and the splits' fingerprints, in each checkpoint
    class_weights: torch.Tensor | None = None  # the loss's per-class weights (data.class_balance=weights), on the device
    teacher: Teacher | None = None  # train.distill: the frozen classifier the student also learns from
    teacher_cache: TeacherLogitsCache | None = None  # train.distill.cache_logits: its logits of every training image
    probe: ProbeResult | None = None  # train.method linear_probe / lp_ft: how the head was fitted (None on a resume)
    data_facts: dict = field(default_factory=dict)  # what metrics.json records of the training split (data.training_facts)
    wise_ft_start: dict | None = None  # train.wise_ft_alpha < 1: the probe's model, which the final weights move toward
    resolution: Schedule | None = None  # train.resolution_schedule: its stages (None: one size throughout)
