"""Loading the splits: an opened dataset (opening.py) becomes train and eval splits with their image and label
columns (classes, label sets, or a regression's targets: targets.py), an eval part held out when the dataset has
none, and subsampling; and what a checkpoint records of the data.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from vit_finetune.core.errors import DataError, excerpt
from vit_finetune.data.labels import LABEL_COLUMN_NAMES, label_sets_chosen
from vit_finetune.data.opening import image_folders, open_dataset, refuse_foreign_paths
from vit_finetune.data.targets import TARGETS_COLUMN, as_targets, standardisation_notes, target_column, target_values
from vit_finetune.recipe import DataSettings


IMAGE_COLUMN_NAMES = ("image", "img", "picture", "photo", "pixel_values")


@dataclass
class Splits:
    train: Any  # datasets.Dataset
    eval: Any
    image_column: str
    label_column: str
    labels: list[str]
    eval_split: str | None = None  # the dataset's split evaluated on; None: held out from train
    image_folders: tuple[Path, ...] | None = None  # where a cell holding only a path may be read: image_folders()
    notes: list[str] = field(default_factory=list)  # what the run should say of the data before it trains
    # what the data holds, as data.task names it: single_label (a class id per row), multi_label (a list of class
    # ids, a set of labels that may be empty) or regression (`labels` names the targets, a list of values per row)
    task: str = "single_label"
    test: Any = None  # data.test_split's rows, labelled as train's; None without one
    test_split: str | None = None


def detect_column(features: dict, wanted: str | None, kind: str, names: tuple[str, ...], feature_type: type) -> str:
    columns = list(features)
    key = f"data.{kind}_column"
    if wanted is not None:
        if wanted not in features:
            raise DataError(f"{key}={wanted!r} is not a column of the dataset; its columns are {columns}")
        return wanted
    typed = [name for name, feature in features.items()
             if isinstance(feature, feature_type) or isinstance(getattr(feature, "feature", None), feature_type)]
    named = [name for name in names if name in features]
    found = typed or named
    if not found and kind == "label":  # a lone string/int column beside the image is the label
        plain = [name for name, f in features.items() if getattr(f, "dtype", "").startswith(("string", "int"))]
        found = plain if len(plain) == 1 else []
    if not found:
        raise DataError(f"no {kind} column found among the dataset's columns {columns}; set {key}=<one of them>")
    return found[0]


def load_splits(settings: DataSettings, seed: int) -> Splits:
    """Train and eval splits with detected columns, ClassLabel labels and optional subsampling."""
    import datasets

    notes: list[str] = []
    loaded = open_dataset(settings, notes)
    if settings.train_split not in loaded:
        raise DataError(f"data.train_split={settings.train_split!r} not in the dataset; its splits are {list(loaded)}")
    train = loaded[settings.train_split]
    image_column = detect_column(train.features, settings.image_column, "image", IMAGE_COLUMN_NAMES, datasets.Image)
    if settings.task == "regression":
        return regression_splits(loaded, settings, image_column, seed, notes)
    if list(train.features) == [image_column] and settings.label_column is None:
        # datasets' imagefolder drops the label column when it finds a single class folder
        raise DataError(f"data.dataset={settings.dataset!r} holds a single class (one class folder, or no label "
                        "column); a classifier needs at least two. Use one sub-folder per class")
    label_column = detect_column(train.features, settings.label_column, "label", LABEL_COLUMN_NAMES, datasets.ClassLabel)
    refuse_fractional_classes(train.features[label_column], label_column, settings)
    eval_split = eval_split_in(loaded, settings)
    folders = image_folders(settings)
    for name in dict.fromkeys([settings.train_split, eval_split or settings.train_split]):
        refuse_foreign_paths(loaded[name], name, image_column, folders, settings)
    chosen = label_sets_chosen(settings)
    multi_label = is_label_set(train.features[label_column]) if chosen is None else chosen
    if multi_label and chosen is None and not notes:  # a label file's note already says why
        notes.append(f"data.dataset={excerpt(settings.dataset)} is multi-label (a set of labels per image: a sigmoid "
                     f"score and a threshold per label) because its label column {label_column!r} is a list of labels")
    if multi_label:
        train = as_label_sets(train, label_column, settings.dataset)
    elif not isinstance(train.features[label_column], datasets.ClassLabel):
        train = encode_labels(train, label_column, loaded, eval_split)
    labels = class_names(train.features[label_column])
    if len(labels) < 2:
        raise DataError(
            f"the label column {label_column!r} holds a single class {labels}; a classifier needs at least two. "
            "Check data.label_column or the dataset's class folders."
        )
    if eval_split is None:
        train, evaluation = hold_out_eval(train, settings, None if multi_label else label_column, len(labels), seed)
    else:
        evaluation = loaded[eval_split]
        if multi_label:
            evaluation = as_label_sets(evaluation, label_column, settings.dataset)
        if evaluation.features[label_column] != train.features[label_column]:
            evaluation = evaluation.cast_column(label_column, train.features[label_column])
    test = rows_of_test_split(loaded, settings, eval_split, image_column, folders)
    if test is not None:
        test = relabel_by_name(test, label_column, list(labels), multi_label, "the training split",
                               "score a split of the training split's classes, or remove data.test_split")
    train = subsample(train, settings.max_train_samples, seed)
    evaluation = subsample(evaluation, settings.max_eval_samples, seed)
    train, evaluation, test = (undecoded(table, image_column, [image_column, label_column])
                               for table in (train, evaluation, test))
    return Splits(train, evaluation, image_column, label_column, list(labels), eval_split, image_folders=folders,
                  notes=notes, task="multi_label" if multi_label else "single_label", test=test,
                  test_split=settings.test_split)


def undecoded(table, image_column: str, columns: list[str] | None = None):
    """`table` (None stays None) with its images kept as encoded bytes or paths, and only `columns` where given: the
    loaders decode them, to name a bad file and to crop before resizing."""
    import datasets

    if table is None:
        return None
    table = table.cast_column(image_column, datasets.Image(decode=False))
    return table if columns is None else table.select_columns(columns)


def rows_of_test_split(loaded, settings: DataSettings, eval_split: str | None, image_column: str, folders):
    """data.test_split's rows as the dataset holds them, or None without one: refused where the dataset has no such
    split, or where it is the split the run evaluates on (a dataset without data.eval_split's split evaluates on its
    test split)."""
    name = settings.test_split
    if name is None:
        return None
    if name not in loaded:
        raise DataError(f"data.test_split={name!r} is not a split of the dataset; its splits are {list(loaded)}. "
                        "Name one of them, or remove data.test_split")
    if name == eval_split:
        raise DataError(f"data.test_split={name!r} is the split this run evaluates on: the dataset has no "
                        f"data.eval_split={settings.eval_split!r}, so the run chooses by {name!r}. Set "
                        "data.eval_split=null to hold out part of the training split for those choices, or remove "
                        "data.test_split")
    refuse_foreign_paths(loaded[name], name, image_column, folders, settings)
    return loaded[name]


def eval_split_in(loaded, settings: DataSettings) -> str | None:
    """The dataset's split to evaluate on, or None (then one is held out from train)."""
    eval_split = settings.eval_split if settings.eval_split in loaded else None
    if eval_split is None and "test" in loaded and settings.eval_split == "validation":
        eval_split = "test"  # many image datasets ship train/test only
    return eval_split


def refuse_fractional_classes(feature, label_column: str, settings: DataSettings) -> None:
    """data.task=auto does not guess whether a column of fractional numbers holds classes or values."""
    if settings.task == "auto" and getattr(feature, "dtype", "").startswith("float"):
        raise DataError(f"the label column {label_column!r} holds numbers ({feature.dtype}); data.task=auto does not "
                        "guess whether they are classes or values. Set data.task=regression to learn them as values, "
                        "or data.task=single_label to read each distinct number as a class")


def regression_splits(loaded, settings: DataSettings, image_column: str, seed: int, notes: list[str]) -> Splits:
    """Train and eval splits of a regression: each row's targets (data.target_columns, else the label column) as one
    list of floats in TARGETS_COLUMN; `labels` names the targets. Every value must be a finite number."""
    train = loaded[settings.train_split]
    names = settings.target_columns or [target_column(train.features, settings.label_column)]
    eval_split = eval_split_in(loaded, settings)
    folders = image_folders(settings)
    for name in dict.fromkeys([settings.train_split, eval_split or settings.train_split]):
        refuse_foreign_paths(loaded[name], name, image_column, folders, settings)
    train = as_targets(train, image_column, names, settings.train_split)
    if eval_split is None:
        train, evaluation = hold_out_eval(train, settings, None, None, seed)
    else:
        evaluation = as_targets(loaded[eval_split], image_column, names, eval_split)
    test = rows_of_test_split(loaded, settings, eval_split, image_column, folders)
    if test is not None:
        test = as_targets(test, image_column, names, settings.test_split)
    train = subsample(train, settings.max_train_samples, seed)
    evaluation = subsample(evaluation, settings.max_eval_samples, seed)
    notes.extend(standardisation_notes(target_values(train), names, settings.train_split))
    train, evaluation, test = (undecoded(table, image_column) for table in (train, evaluation, test))
    return Splits(train, evaluation, image_column, TARGETS_COLUMN, list(names), eval_split, image_folders=folders,
                  notes=notes, task="regression", test=test, test_split=settings.test_split)


def is_label_set(feature) -> bool:
    """Whether a label column holds a list of labels per row (a Sequence/List of ClassLabel or of strings)."""
    import datasets

    return isinstance(feature, (datasets.List, datasets.LargeList)) or isinstance(feature, datasets.Sequence)


def class_names(feature) -> list[str]:
    """The class names of a ClassLabel column, or of a list-of-ClassLabel column."""
    return list(getattr(feature, "feature", feature).names)


def as_label_sets(table, label_column: str, name: str):
    """A multi-label table: the column as a list of ClassLabel (a single ClassLabel becomes one-element lists)."""
    import datasets

    feature = table.features[label_column]
    inner = getattr(feature, "feature", feature)
    if not isinstance(inner, datasets.ClassLabel):
        raise DataError(f"data.dataset={excerpt(name)}: the label column {label_column!r} is {feature}; a multi-label "
                        "dataset needs a list of ClassLabel there (or a label file, whose labels are read as names)")
    if is_label_set(feature):
        return table
    features = datasets.Features({**table.features, label_column: datasets.List(inner)})
    return table.map(lambda row: {label_column: [row[label_column]]}, features=features)


def hold_out_eval(train, settings: DataSettings, label_column: str | None, classes: int | None, seed: int):
    """(train, eval): data.eval_fraction of train held out, stratified by `label_column` over its `classes` so every
    class is in both parts (None: a plain seeded split, as for label sets, which have no single class to stratify
    by, and regression targets)."""
    try:
        carved = train.train_test_split(test_size=settings.eval_fraction, stratify_by_column=label_column, seed=seed)
    except ValueError as error:  # too few images for a part to hold every class, or a class of one image
        raise DataError(cannot_hold_out(train, settings, label_column, classes, error)) from None
    return carved["train"], carved["test"]


def eval_fractions(images: int, least: int) -> tuple[float, float] | None:
    """The eval fractions, rounded inward, that leave both parts at least `least` images (the held-out part is
    ceil(fraction x images), as datasets counts it); None where there are none."""
    if images < 2 * least:
        return None
    for decimals in (2, 4, 6):
        scale = 10 ** decimals
        low, high = math.ceil(least / images * scale) / scale, math.floor((1 - least / images) * scale) / scale
        if 0 < low <= high < 1:
            return low, high
    return None


# Where the images to evaluate on can come from when none can be held out of train.
EVAL_SPLIT_SOURCES = ("a split column in a label file (train / validation), a validation/ folder beside train/, or "
                      "data.eval_split naming one of the dataset's splits")


def cannot_hold_out(train, settings: DataSettings, label_column: str | None, classes: int | None,
                    error: ValueError) -> str:
    """Why data.eval_fraction cannot be held out of `train`, and a fix that works: the fractions that can where there
    are some (each part needs an image, or, stratified, an image of every class), else more images or an eval split."""
    images = len(train)
    stratified = label_column is not None
    what = f"{images} images, {classes} classes" if stratified else f"{images} image{'s' * (images != 1)}"
    said = f"data.eval_fraction={settings.eval_fraction} cannot hold out {'a stratified' if stratified else 'an'} " \
           f"eval split from data.train_split={settings.train_split!r} ({what})"
    smallest = min(Counter(train[label_column]).values()) if stratified and images else None
    fractions = eval_fractions(images, classes if stratified else 1)
    if fractions and (smallest is None or smallest >= 2):
        low, high = fractions
        which = f"between {low} and {high}" if stratified else f"of at most {high}"
        return (f"{said}: {error}. Fix: an eval_fraction {which}, or images to evaluate on as a split of their own "
                f"({EVAL_SPLIT_SOURCES})")
    need = (f"a stratified split puts every class in both parts: at least two images of each class and "
            f"{2 * classes} in all" if stratified else "each part needs an image: at least two in all")
    return (f"{said}: no eval_fraction can, {need}. Fix: add images to data.train_split, or give the images to "
            f"evaluate on as a split of their own ({EVAL_SPLIT_SOURCES})")


def training_facts(splits: Splits) -> dict:
    """What metrics.json records of the training split: the labels no training image holds (the model cannot learn
    them; their eval scores measure nothing learned) and, for label sets, how many images hold none of the labels."""
    import pyarrow.compute as pc

    if splits.task == "regression":
        return {}  # no classes to count
    column = splits.train.with_format("arrow")[splits.label_column]
    ids = pc.list_flatten(column) if splits.task == "multi_label" else column
    ids = np.asarray(ids.to_numpy(zero_copy_only=False), dtype=np.int64)
    counts = np.bincount(ids[ids >= 0], minlength=len(splits.labels))  # -1: a ClassLabel's "no label"
    facts = {"labels_without_train_images": [label for label, n in zip(splits.labels, counts) if n == 0]}
    if splits.task == "multi_label":
        facts["train_images_without_labels"] = int((pc.list_value_length(column).to_numpy() == 0).sum())
    return facts


def training_facts_notes(facts: dict, train_images: int) -> list[str]:
    """The console's lines on training_facts."""
    notes = []
    missing = facts.get("labels_without_train_images", [])
    if missing:
        notes.append(f"{len(missing)} label(s) have no training image: {excerpt(missing)}; the model cannot learn "
                     "them, and their eval scores (and, multi-label, their thresholds) measure nothing learned. Add "
                     "training images of them, or leave them out of the dataset")
    if facts.get("train_images_without_labels"):
        notes.append(f"{facts['train_images_without_labels']} of the {train_images} training images have none of the "
                     "labels: each is a negative for every label")
    return notes


# Image files (an image folder) up to this many bytes in all are hashed, so a resume notices a file changed in place
# even with its size and modification time kept; beyond it, hashing would slow every start (sha256 read ~150 MiB/s
# on a busy 2-core machine: ~2 s at this bound), and only datasets' fingerprint is compared (the file names, sizes
# and modification times).
CONTENT_HASH_LIMIT_BYTES = 256 << 20


def identity(splits: Splits) -> dict:
    """What a checkpoint records of the data: the labels, datasets' fingerprints of the loaded splits (any image
    added, removed or modified changes them; for an image folder, so does a file's modification time), and, for
    image files up to CONTENT_HASH_LIMIT_BYTES, a hash of their bytes."""
    return {"labels": list(splits.labels), "train": splits.train._fingerprint, "eval": splits.eval._fingerprint,
            "train_content": content_hash(splits.train, splits.image_column),
            "eval_content": content_hash(splits.eval, splits.image_column)}


def content_hash(split, image_column: str) -> str | None:
    """A hash of the split's image files, in order; None when the images are stored in the dataset itself (its
    fingerprint covers them), the files total over CONTENT_HASH_LIMIT_BYTES, or one cannot be read."""
    if len(split) == 0 or split[0][image_column].get("bytes") is not None:
        return None
    return files_digest([cell["path"] for cell in split[image_column]])


def files_digest(paths: list[str]) -> str | None:
    """A sha256 over the files' bytes, in order; None when they total over CONTENT_HASH_LIMIT_BYTES or one cannot
    be read."""
    import hashlib

    try:
        if sum(os.path.getsize(path) for path in paths) > CONTENT_HASH_LIMIT_BYTES:
            return None
        digest = hashlib.sha256()
        for path in paths:
            with open(path, "rb") as file:
                digest.update(hashlib.file_digest(file, "sha256").digest())
    except (OSError, TypeError):  # a missing file is reported where it is decoded, by name
        return None
    return digest.hexdigest()


def relabel_by_name(table, label_column: str, labels: list[str], label_sets: bool, whose: str, fix: str):
    """`table`'s labels re-numbered by `labels`' order, matched by name (a ClassLabel's names, else the values as
    text); with `label_sets` each row's labels as a list (a single label becomes a list of one). A label not in
    `labels` is refused, naming `whose` labels they are and the `fix`."""
    import datasets

    feature = table.features[label_column]
    inner = getattr(feature, "feature", feature)
    names = inner.names if isinstance(inner, datasets.ClassLabel) else None
    rows_are_sets = is_label_set(feature)
    if rows_are_sets and not label_sets:
        raise DataError(f"the dataset's {label_column!r} column holds label sets, but {whose} is single-label; "
                        f"{fix}")

    def name_of(value) -> str:
        return names[value] if names is not None else str(value)

    def values_of(cell) -> list:
        return list(cell) if rows_are_sets else [cell]

    found = {name_of(value) for cell in table[label_column] for value in values_of(cell)}
    unknown = sorted(found - set(labels))
    if unknown:
        raise DataError(f"labels {unknown[:10]} of the dataset are not labels of {whose} ({labels[:10]}"
                        f"{' ...' if len(labels) > 10 else ''}); {fix}")
    index = {label: position for position, label in enumerate(labels)}
    classes = datasets.ClassLabel(names=labels)
    features = datasets.Features({**table.features, label_column: datasets.List(classes) if label_sets else classes})
    if label_sets:
        return table.map(lambda row: {label_column: [index[name_of(v)] for v in values_of(row[label_column])]},
                         features=features)
    return table.map(lambda row: {label_column: index[name_of(row[label_column])]}, features=features)


def encode_labels(train, label_column: str, loaded, eval_split: str | None):
    """String (or plain integer) labels become a ClassLabel over the classes seen in train and eval."""
    import datasets

    values = set(train.unique(label_column))
    if eval_split is not None:
        values |= set(loaded[eval_split].unique(label_column))
    names = sorted(str(v) for v in values)
    feature = datasets.ClassLabel(names=names)
    return train.map(lambda row: {label_column: feature.str2int(str(row[label_column]))}, features=datasets.Features(
        {**train.features, label_column: feature}
    ))


def subsample(dataset, limit: int | None, seed: int):
    if limit is None or limit >= len(dataset):
        return dataset
    return dataset.shuffle(seed=seed).select(range(limit))


def target_encoding(splits) -> str:
    """The TARGET_ENCODINGS entry (loaders.py) of loaded splits (a stream's too)."""
    return {"multi_label": "set", "regression": "values"}.get(splits.task, "class")
