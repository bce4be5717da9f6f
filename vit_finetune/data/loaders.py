"""Datasets and loaders: each row made into (pixels, label) with its label encoded as the loss reads it, a seeded
order per epoch, batches, how many workers decode, and the normalisation of uint8 batches, done on the device.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset, Sampler

from vit_finetune.core.errors import BadImageError
from vit_finetune.data.pixels import decode_image, sample_name
from vit_finetune.data.splits import Splits, target_encoding
from vit_finetune.recipe import DataSettings


# The label of an image skipped as bad. Training and evaluation keep such an image's place (blank pixels, this
# label) so that batch shapes never change: every process's eval batch keeps its shape (gather_for_metrics needs
# equal shapes, and drops the padding Accelerate adds to the last batch by counting positions), and a training
# batch is never smaller (no recompile under torch.compile). The loss and the metrics leave these places out.
SKIPPED_LABEL = -1


def class_id(label: int, outputs: int) -> int:
    return label


def label_set_row(label, outputs: int) -> list[int]:
    """A set of class ids as a 0/1 row over the classes; a row of SKIPPED_LABEL for a skipped image."""
    if label == SKIPPED_LABEL:
        return [SKIPPED_LABEL] * outputs
    row = [0] * outputs
    for class_id in label if isinstance(label, list) else [label]:  # a stream's single ClassLabel: a set of one
        row[class_id] = 1
    return row


def value_row(label, outputs: int) -> list[float]:
    """A regression's target values as floats; NaN for a skipped image (every number is a possible target)."""
    return [float("nan")] * outputs if label == SKIPPED_LABEL else [float(value) for value in label]


# How a label column's cells reach the loss, by what they hold: a class, a set of classes, or numbers.
TARGET_ENCODINGS: dict[str, Callable[[Any, int], Any]] = {"class": class_id, "set": label_set_row, "values": value_row}


class ImageClassificationDataset(Dataset):
    """Indexed by (sample index, epoch); yields (pixels, label, None), and for a bad image skipped with
    data.skip_bad_images (placeholder, SKIPPED_LABEL, its name): the placeholder keeps the image's place."""

    def __init__(self, table, image_column: str, label_column: str, settings: DataSettings,
                 make_pixels: Callable[[Image.Image, int, int], torch.Tensor], placeholder: torch.Tensor,
                 image_folders: tuple[Path, ...] | None = None, encoding: str = "class", outputs: int = 0):
        self.table = table
        self.image_folders = image_folders
        self.image_column = image_column
        self.label_column = label_column
        self.settings = settings
        self.make_pixels = make_pixels
        self.placeholder = placeholder
        self.encode = TARGET_ENCODINGS[encoding]  # how a row's label reaches the loss (see TARGET_ENCODINGS)
        self.outputs = outputs  # the model's outputs: classes, or a regression's targets

    def target(self, label) -> int | list:
        """The label as the loss reads it: a class id, a 0/1 row over the classes, or a row of values; SKIPPED_LABEL
        (a skipped image) becomes the encoding's mark of one."""
        return self.encode(label, self.outputs)

    def __len__(self) -> int:
        return len(self.table)

    def __getitem__(self, key: tuple[int, int]) -> tuple[torch.Tensor, int, str | None]:
        index, epoch = key
        return self.sample(self.table[int(index)], int(index), epoch)

    def sample(self, row: dict, index: int, epoch: int) -> tuple[torch.Tensor, int, str | None]:
        """One row decoded and made into pixels; `index` names it and, with `epoch`, seeds its augmentation."""
        try:
            image = self.decode(row, index)
        except BadImageError:
            if not self.settings.skip_bad_images:
                raise
            return self.placeholder, self.target(SKIPPED_LABEL), sample_name(row[self.image_column], index)
        return self.make_pixels(image, index, epoch), self.target(row[self.label_column]), None


    def decode(self, row: dict, index: int) -> Image.Image:
        """The row's image (BadImageError naming it): a path-only cell is read only from self.image_folders."""
        return decode_image(row[self.image_column], index, self.settings, self.image_folders)


class EpochSampler(Sampler):
    """A seeded permutation per epoch (or the natural order), yielding (index, epoch) keys.

    Owning the epoch here lets persistent workers know it, so augmentation depends only on
    (seed, epoch, index) and a resumed run sees exactly the samples and crops it would have seen.
    """

    def __init__(self, size: int, seed: int, shuffle: bool):
        self.size, self.seed, self.shuffle, self.epoch = size, seed, shuffle, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.size

    def __iter__(self):
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
            order = torch.randperm(self.size, generator=generator).tolist()
        else:
            order = range(self.size)
        epoch = self.epoch
        return iter([(index, epoch) for index in order])


def collate(samples: list) -> dict:
    """(B, 3, H, W) pixels and labels: (B,) class ids, or (B, C) 0/1 rows for label sets."""
    pixels = torch.stack([pixels for pixels, _label, _skipped in samples])
    targets = [label for _pixels, label, _skipped in samples]
    # class ids and 0/1 rows as integers, a regression's values (NaN: a skipped image) as floats
    labels = torch.tensor(targets, dtype=torch.float32 if is_float_target(targets[0]) else torch.long)
    # `skipped` (the names of the bad images in the batch) stays on the host: Accelerate moves tensors to the
    # device, and counting them there would need a sync to read the count back.
    return {"pixel_values": pixels, "labels": labels, "skipped": [name for *_, name in samples if name is not None]}


def is_float_target(target) -> bool:
    return isinstance(target[0] if isinstance(target, list) and target else target, float)


def cpu_cores() -> int:
    """The cores this process may run on (a container's or taskset's limit, not the machine's count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def default_num_workers(device_type: str, processes: int) -> int:
    """CUDA: most cores decode (the GPU waits otherwise). CPU: decoding would steal the training cores."""
    per_process = max(1, cpu_cores() // max(1, processes))
    if device_type == "cuda":
        return min(16, max(1, per_process - 1))
    return 0 if per_process <= 4 else min(4, per_process // 2)


def make_loader(dataset: ImageClassificationDataset, batch_size: int, shuffle: bool, seed: int,
                num_workers: int, pin_memory: bool, sampler: Sampler | None = None,
                collate_fn: Callable[[list], dict] = collate) -> DataLoader:
    """Batches of the keys `sampler` yields, by default EpochSampler's (index, epoch) keys (shuffled or in order)."""
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler if sampler is not None else EpochSampler(len(dataset), seed, shuffle),
        collate_fn=collate_fn,
        num_workers=num_workers,
        pin_memory=pin_memory,
        persistent_workers=num_workers > 0,
        prefetch_factor=4 if num_workers > 0 else None,
        drop_last=False,  # every sample is seen once per epoch
        # Each pass over a loader draws a worker seed from this generator. Left to torch's global RNG, that
        # draw would shift the dropout masks of a resumed run, which makes one more pass (its first, partial
        # epoch) than the run it resumes. Augmentation does not use it: see sample_rng.
        generator=torch.Generator().manual_seed(seed),
    )


def train_dataset(splits: Splits, settings: DataSettings, image_size: int,
                  make_pixels: Callable[[Image.Image, int, int], torch.Tensor]) -> ImageClassificationDataset:
    """The train split as uint8 crops from `make_pixels`; a skipped bad image keeps its place, blank."""
    return ImageClassificationDataset(splits.train, splits.image_column, splits.label_column, settings, make_pixels,
                                      blank_pixels(image_size, training=True), splits.image_folders,
                                      encoding=target_encoding(splits), outputs=len(splits.labels))


def eval_dataset(splits: Splits, settings: DataSettings, processor, image_size: int,
                 table=None) -> ImageClassificationDataset:
    """The eval split (or `table`, another split of the same data: data.test_split's) preprocessed by the saved image
    processor; a skipped bad image keeps its place, blank."""
    return ImageClassificationDataset(splits.eval if table is None else table, splits.image_column,
                                      splits.label_column, settings, eval_pixels_from_processor(processor),
                                      blank_pixels(image_size, training=False), splits.image_folders,
                                      encoding=target_encoding(splits), outputs=len(splits.labels))


def train_dataset_as_evaluated(splits: Splits, settings: DataSettings, processor, image_size: int) -> ImageClassificationDataset:
    """The train split preprocessed as evaluation does (the saved image processor, no augmentation): what a linear
    probe fits the head on, so the head meets at evaluation the features it was fitted to."""
    return ImageClassificationDataset(splits.train, splits.image_column, splits.label_column, settings,
                                      eval_pixels_from_processor(processor), blank_pixels(image_size, training=False),
                                      splits.image_folders, encoding=target_encoding(splits), outputs=len(splits.labels))


def blank_pixels(image_size: int, training: bool) -> torch.Tensor:
    """What stands in for a skipped bad image: uint8 like a train crop (normalised later, on the device), float like
    the pixels the image processor makes for evaluation."""
    return torch.zeros(3, image_size, image_size, dtype=torch.uint8 if training else torch.float32)


def eval_pixels_from_processor(processor) -> Callable[[Image.Image, int, int], torch.Tensor]:
    """Evaluation preprocessing: the saved image processor itself, so pipeline() users see the same pixels."""

    def make_pixels(image: Image.Image, index: int, epoch: int) -> torch.Tensor:
        return processor(images=image, return_tensors="pt")["pixel_values"][0]

    return make_pixels


class PixelNormalizer:
    """uint8 batches -> the processor's rescale and mean/std, done on the device; float batches pass through."""

    def __init__(self, processor, device: torch.device):
        self.scale = float(getattr(processor, "rescale_factor", 1 / 255))
        mean = getattr(processor, "image_mean", None) or [0.5, 0.5, 0.5]
        std = getattr(processor, "image_std", None) or [0.5, 0.5, 0.5]
        self.mean = torch.tensor(mean, dtype=torch.float32, device=device).view(1, -1, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32, device=device).view(1, -1, 1, 1)

    def __call__(self, pixels: torch.Tensor) -> torch.Tensor:
        if pixels.dtype != torch.uint8:
            return pixels
        return self.standardize(self.rescale(pixels))

    def rescale(self, pixels: torch.Tensor) -> torch.Tensor:
        """uint8 -> float in the processor's range ([0, 1] for 1/255), where batch augmentation works."""
        return pixels.float() * self.scale

    def standardize(self, rescaled: torch.Tensor) -> torch.Tensor:
        return (rescaled - self.mean) / self.std
