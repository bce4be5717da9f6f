"""What a linear probe on the base's features of a sample of training images tells about the data, before any
training step: whether a mirror image is still the same thing to the base (data.horizontal_flip=auto), whether
dropping the alpha channel would lose the drawings (data.alpha_background=auto: read from the pixels themselves), and
whether the eval images look like the training images at all (a line when they do not: a shift between sources is
likely).

Each check reads at most CHECKED_IMAGES training images, a seeded sample spread over the classes. The transparency
check reads their pixels alone; the others pass them, preprocessed as evaluation does, through the frozen pretrained
model once per variant (as they are, mirrored); their features are the head's input, as the probe's
(probe.head_inputs). Nothing here draws from the run's random generators, and every process computes the same answer,
so a resumed or multi-process run decides as one that did not stop.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from PIL import Image, ImageOps

from vit_finetune import data
from vit_finetune.data import Splits
from vit_finetune.recipe import DataSettings
from vit_finetune.tasks import SingleLabel, Task
from vit_finetune.training import probe

# Training images each check reads: enough for the probe's 5-fold answers to move by a few points at most, few enough
# that on a CPU the checks cost a few seconds at the sizes the studies ran.
CHECKED_IMAGES = 256


@dataclass(frozen=True)
class Sample:
    """The checked images: which rows of which split, and their labels as the probe reads them."""

    table: object  # a datasets.Dataset: the rows checked, in order
    labels: torch.Tensor


def sample_rows(table, label_column: str, seed: int, most: int = CHECKED_IMAGES) -> object:
    """At most `most` rows of `table`, a seeded sample that keeps each label's share (rows in their table order)."""
    count = len(table)
    if count <= most:
        return table
    by_label: dict = {}
    for index, label in enumerate(table[label_column]):
        by_label.setdefault(str(label), []).append(index)
    rng = random.Random(seed)
    chosen = []
    for members in by_label.values():
        rng.shuffle(members)
        chosen += members[:max(1, round(most * len(members) / count))]
    return table.select(sorted(chosen[:most] if len(chosen) > most else chosen))


class FeatureChecks:
    """The features of the checked images under each variant, computed once each and on demand."""

    def __init__(self, model, splits: Splits, settings: DataSettings, processor, accelerator, task: Task, seed: int,
                 batch_size: int, image_size: int):
        self.model, self.splits, self.settings, self.processor = model, splits, settings, processor
        self.accelerator, self.task, self.batch_size, self.image_size = accelerator, task, batch_size, image_size
        self.seed = seed
        self._features: dict = {}
        self.mirror_tests: dict = {}  # background -> mirror_test's answer: the flip and the crop both ask it

    @functools.cached_property
    def train(self):
        """The checked training rows (read on first use: a stream's run never asks)."""
        return sample_rows(self.splits.train, self.splits.label_column, self.seed)

    @functools.cached_property
    def eval(self):
        return sample_rows(self.splits.eval, self.splits.label_column, self.seed + 1)

    def features(self, split: str, background: str | None, mirrored: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(features, labels) of the checked images of `split` ("train" or "eval"), decoded with transparent pixels
        laid on `background` (None: alpha dropped) and mirrored left-right or not."""
        key = (split, background, mirrored)
        if key not in self._features:
            table = self.train if split == "train" else self.eval
            settings = self.settings.model_copy(update={"alpha_background": background})

            def pixels(image: Image.Image, index: int, epoch: int) -> torch.Tensor:
                shown = ImageOps.mirror(image) if mirrored else image
                return self.processor(images=shown, return_tensors="pt")["pixel_values"][0]

            dataset = data.ImageClassificationDataset(
                table, self.splits.image_column, self.splits.label_column, settings, pixels,
                data.blank_pixels(self.image_size, training=False),
                self.splits.image_folders, encoding=data.target_encoding(self.splits),
                outputs=len(self.splits.labels))
            loader = data.make_loader(dataset, 4 * self.batch_size, False, 0, 0, False)
            self.model.to(self.accelerator.device)
            self._features[key] = probe.head_inputs(self.model, loader, self.accelerator, mixed_precision=False)
        return self._features[key]


# ---------------------------------------------------------------- the mirror test (data.horizontal_flip=auto)


@dataclass(frozen=True)
class MirrorTest:
    """How often the probe's answer changes when a held-out image is mirrored, against how often it is wrong."""

    images: int
    changed: float  # share of held-out images whose answer the mirror changes
    wrong: float  # share of held-out images the probe answers wrongly, unmirrored

    @property
    def flip_keeps_labels(self) -> bool:
        """A mirror image is the same thing to the base when mirroring changes fewer of the probe's answers than the
        probe gets wrong: its changes are then the probe's own uncertainty, not a different picture."""
        return self.changed <= self.wrong

    def describe(self) -> str:
        return (f"mirroring {self.images:,} held-out training images changed the linear probe's answer on "
                f"{self.changed:.0%} of them, and it answers {self.wrong:.0%} wrongly unmirrored")


def mirror_test(checks: FeatureChecks, background: str | None) -> MirrorTest | None:
    """The mirror test on the checked training images, k-fold: the probe fitted on the other folds answers each fold
    as it is and mirrored. None where the task does not answer by classes or the sample is too small to fold."""
    if background not in checks.mirror_tests:
        checks.mirror_tests[background] = _mirror_test(checks, background)
    return checks.mirror_tests[background]


def _mirror_test(checks: FeatureChecks, background: str | None) -> MirrorTest | None:
    if not checks.task.mirror_tested:
        return None
    features, labels = checks.features("train", background)
    mirrored, _ = checks.features("train", background, mirrored=True)
    kept = checks.task.kept(labels)
    features, mirrored, labels = features[kept], mirrored[kept], labels[kept]
    strata = checks.task.probe_strata(labels)
    sizes = torch.bincount(strata)
    folds = min(probe.FOLDS, int(sizes[sizes > 0].min())) if len(labels) else 0
    if folds < 2:
        return None
    mean, std = features.mean(dim=0), features.std(dim=0).clamp(min=1e-6)
    standard, standard_mirrored = (features - mean) / std, (mirrored - mean) / std
    weights = torch.ones(len(labels))
    classes = len(checks.splits.labels)
    c, _, _ = probe.choose_c(standard, labels, weights, classes, checks.task)
    fold = probe.fold_of_each_image(strata, folds)
    changed = wrong = 0
    for k in range(folds):
        fit, held = fold != k, fold == k
        weight, bias = probe.fit_logistic(standard[fit], labels[fit], weights[fit], classes, c, checks.task)
        answer = checks.task.probe_decisions(standard[held] @ weight.T + bias)
        answer_mirrored = checks.task.probe_decisions(standard_mirrored[held] @ weight.T + bias)
        changed += int((~same(answer, answer_mirrored)).sum())
        wrong += int((~same(answer, labels[held])).sum())
    return MirrorTest(len(labels), changed / len(labels), wrong / len(labels))


def same(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per image, whether two answers agree (a class id each, or a 0/1 row of labels each)."""
    return (a.long() == b.long()).reshape(len(a), -1).all(dim=1)


# ---------------------------------------------------------------- transparency (data.alpha_background=auto)

# Dropping alpha, as pipeline() does, shows the colours stored under the transparent pixels. Where an exporter left one
# flat colour there (black, usually), the drawing keeps its silhouette on a plain background, and dropping alpha lost
# nothing in the shift study (docs/studies/shift.md). It loses the drawing where those colours are not one flat colour
# (the drawing's own colours bled out: each image becomes a filled square) or where the drawing lives in the alpha
# channel alone (a flat image once alpha is dropped). When at least TRANSPARENT_IMAGES of the checked images do either,
# over at least TRANSPARENT_PIXELS of their area, transparent pixels are laid on white, as transformers' image
# processors lay RGBA images.
TRANSPARENT_IMAGES = 0.05
TRANSPARENT_PIXELS = 0.01


@dataclass(frozen=True)
class Transparency:
    """What the checked training images hold of transparency."""

    checked: int
    transparent: int  # images with fully transparent pixels over TRANSPARENT_PIXELS of their area
    bleeding: int  # of those, images whose fully transparent pixels store more than one flat colour
    drawn_in_alpha: int  # images flat once alpha is dropped, not flat laid on white or black

    @property
    def hides_content(self) -> bool:
        """Whether dropping alpha would lose the drawings: see TRANSPARENT_IMAGES."""
        return self.drawn_in_alpha > 0 or self.bleeding >= TRANSPARENT_IMAGES * max(1, self.checked)

    def describe(self) -> str:
        return (f"{self.transparent} of the {self.checked} training images checked have fully transparent pixels over "
                f"{TRANSPARENT_PIXELS:.0%} of their area, {self.bleeding} of them with more than one colour stored "
                f"under those pixels, and {self.drawn_in_alpha} keep their drawing in the alpha channel alone")


def transparency(checks: FeatureChecks) -> Transparency:
    """Decode the checked training images with their alpha channel and measure what dropping it would show."""
    transparent = bleeding = drawn = 0
    table, column = checks.train, checks.splits.image_column
    for index in range(len(table)):
        try:
            image = data.decode_image(table[index][column], index, checks.settings, checks.splits.image_folders,
                                      keep_alpha=True)
        except data.BadImageError:
            continue
        pixels = np.asarray(image)
        hidden = pixels[..., 3] == 0
        if hidden.mean() >= TRANSPARENT_PIXELS:
            transparent += 1
            stored = pixels[..., :3][hidden].astype(np.float64)
            bleeding += float(stored.std(axis=0).max()) >= data.FLAT_SPREAD
        if data.is_flat(image.convert("RGB")) and data.drawing_in_alpha(image):
            drawn += 1
    return Transparency(len(table), transparent, bleeding, drawn)


# ---------------------------------------------------------------- eval images from another source?

# Above this cross-validated accuracy a linear classifier of (training image, eval image) on the base's features tells
# the two splits apart: their images come from different sources. Split at random from one source, it stays near 0.5.
SHIFT_ACCURACY = 0.75


@dataclass(frozen=True)
class ShiftTest:
    images: int
    accuracy: float  # cross-validated, balanced: 0.5 = the splits look alike

    @property
    def likely(self) -> bool:
        return self.accuracy >= SHIFT_ACCURACY


def shift_test(checks: FeatureChecks, background: str | None) -> ShiftTest | None:
    """How well the base's features tell the checked training images from the checked eval images (logistic probe,
    k-fold, the two sides weighted equally); None when either side has too few images to fold."""
    train, _ = checks.features("train", background)
    evaluated, _ = checks.features("eval", background)
    if min(len(train), len(evaluated)) < probe.FOLDS:
        return None
    features = torch.cat([train, evaluated])
    side = torch.cat([torch.zeros(len(train), dtype=torch.long), torch.ones(len(evaluated), dtype=torch.long)])
    weights = torch.where(side == 0, len(features) / (2 * len(train)), len(features) / (2 * len(evaluated)))
    mean, std = features.mean(dim=0), features.std(dim=0).clamp(min=1e-6)
    standard = (features - mean) / std
    task = SingleLabel()  # two classes: the training side and the eval side
    # One strength, scikit-learn's default, not a search: the question is whether the sides can be told apart at all,
    # and the search over strengths would cost most of the check.
    c, folds = 1.0, probe.FOLDS
    fold = probe.fold_of_each_image(side, folds)
    right = torch.zeros(len(side))
    for k in range(folds):
        fit, held = fold != k, fold == k
        weight, bias = probe.fit_logistic(standard[fit], side[fit], weights[fit], 2, c, task)
        right[held] = ((standard[held] @ weight.T + bias).argmax(dim=1) == side[held]).float()
    balanced = 0.5 * (float(right[side == 0].mean()) + float(right[side == 1].mean()))
    return ShiftTest(len(side), balanced)
