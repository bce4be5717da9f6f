"""Data: any `datasets` source to train/eval splits, labels, decoding, augmentation and loaders.

Images are decoded here (not by `datasets`) so a bad file is reported by its path or index. Training
batches leave the workers as uint8 and are normalised on the device; evaluation uses exactly the image
processor that is saved with the model, so reported accuracy is what a `pipeline()` user gets.
"""

from __future__ import annotations

import io
import os
import random
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from PIL import Image, ImageFile, ImageOps, UnidentifiedImageError
from torch.utils.data import DataLoader, Dataset, Sampler

from . import hub, labels
from .labels import LABEL_COLUMN_NAMES
from .errors import VitFinetuneError
from .recipe import DataSettings
from .recipe.limits import REPO_ID_PATTERN, excerpt
from .synthetic import ensure_demo_dataset

BUILTIN_SHAPES = "builtin:shapes"  # the demo's dataset, generated deterministically on first use
IMAGE_COLUMN_NAMES = ("image", "img", "picture", "photo", "pixel_values")
TARGETS_COLUMN = "vit_finetune_targets"  # a regression's loaded column: each image's list of target values


class DataError(VitFinetuneError):
    """A dataset that cannot be used as configured; the message names the value and the fix."""


class BadImageError(DataError):
    """One sample that cannot be decoded into a usable image."""

    def __init__(self, message: str):
        # Raised in a DataLoader worker, torch re-raises it in the main process as BadImageError(its banner and
        # the worker's traceback as text). Keep our own sentence: the user needs the file, not the worker's stack.
        if "Original Traceback" in message:
            message = message.rsplit(f"{BadImageError.__name__}: ", 1)[-1].strip()
        super().__init__(message)


@dataclass
class Splits:
    train: Any  # datasets.Dataset
    eval: Any
    image_column: str
    label_column: str
    labels: list[str]
    eval_split: str | None = None  # the dataset's split evaluated on; None: held out from train
    image_folders: tuple[Path, ...] | None = None  # where a cell holding only a path may be read: image_folders()
    multi_label: bool = False  # each row's label is a list of class ids (a set of labels), which may be empty
    notes: list[str] = field(default_factory=list)  # what the run should say of the data before it trains
    task: str | None = None  # "regression": `labels` names the targets, each row's label is a list of their values


# ---------------------------------------------------------------- loading


def cache_dir() -> Path:
    return Path(os.environ.get("VIT_FINETUNE_CACHE", Path.home() / ".cache" / "vit_finetune"))


def refuse_unreachable(settings: DataSettings) -> None:
    """A Hub dataset that cannot be fetched stops here, asked once, with the offline fix (a folder is not asked)."""
    name = settings.dataset
    if name.startswith((BUILTIN_SHAPES, ".", "/", "~")) or Path(name).expanduser().exists():
        return
    problem = REPO_ID_PATTERN.match(name) and hub.unreachable_problem(name, "dataset")
    if problem:
        raise DataError(f"data.dataset={name!r}: {problem}")


def open_dataset(settings: DataSettings, notes: list[str] | None = None):
    """A DatasetDict from a Hub id, a saved dataset (save_to_disk), a label file or an image folder; what the run
    should say of it (a label file found multi-label) is added to `notes`."""
    import datasets

    source = Path(settings.dataset).expanduser()
    if settings.dataset == BUILTIN_SHAPES:
        source = ensure_demo_dataset(cache_dir() / "shapes")
    try:
        label_file = labels.label_file_of(source)
        if label_file is not None and settings.task == "regression":
            loaded = labels.load_target_file(label_file, settings)
        elif label_file is not None:
            loaded = labels.load_label_file(label_file, settings, notes)
        elif source.is_dir() and ((source / "dataset_dict.json").exists() or (source / "state.json").exists()):
            loaded = datasets.load_from_disk(str(source))
        elif source.is_dir():
            check_image_folder_layout(source, settings.dataset)
            loaded = datasets.load_dataset("imagefolder", data_dir=str(source))
        elif source.exists() or settings.dataset.startswith((".", "/", "~")):
            raise DataError(f"data.dataset={settings.dataset!r} is not a folder; give an image folder, a label file "
                        "(.csv or .jsonl) or a Hub id")
        else:
            refuse_unreachable(settings)
            loaded = datasets.load_dataset(settings.dataset)
    except DataError:
        raise
    except labels.LabelFileError as error:
        raise DataError(f"data.dataset={excerpt(settings.dataset)}: {error}") from None
    except Exception as error:  # datasets raises many types; the user needs the id and the reason
        raise DataError(
            f"data.dataset={settings.dataset!r} could not be loaded: {type(error).__name__}: {error}\n"
            "Fix: give a Hub dataset id, a folder of class sub-folders, or a folder written by save_to_disk."
        ) from None
    if isinstance(loaded, datasets.Dataset):
        loaded = datasets.DatasetDict({settings.train_split: loaded})
    return loaded


def is_local(settings: DataSettings) -> bool:
    """Whether data.dataset is on the user's own disk (a folder, a label file, or the built-in shapes), not a Hub id."""
    return settings.dataset == BUILTIN_SHAPES or Path(settings.dataset).exists()


def image_folders(settings: DataSettings) -> tuple[Path, ...] | None:
    """Where an image cell that holds only a path (no bytes) may be read from. A local dataset is the user's: any
    path (None). A Hub dataset's cells come from whoever wrote the repo: only the files datasets downloaded for it
    (the repo's folder in the Hub cache, datasets' download folder), never a file the repo names on this disk."""
    if is_local(settings):
        return None
    import datasets
    from huggingface_hub.constants import HF_HUB_CACHE

    downloaded = (Path(HF_HUB_CACHE) / ("datasets--" + settings.dataset.replace("/", "--")),
                  Path(datasets.config.DOWNLOADED_DATASETS_PATH))
    # As written (the cells spell them so) and resolved (decode_image resolves a cell's path before comparing).
    return tuple(dict.fromkeys([*(Path(os.path.abspath(f)) for f in downloaded), *(f.resolve() for f in downloaded)]))


def refuse_foreign_paths(split, split_name: str, image_column: str, folders: tuple[Path, ...] | None,
                         settings: DataSettings) -> None:
    """Before training: the first image cell of a Hub dataset's split that holds only a path outside `folders` (a
    file on this machine) stops the run, naming its row. Only the path column is read (Arrow, no image bytes), and
    paths are compared as written; decode_image checks each image again with links resolved."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if folders is None or settings.skip_bad_images:  # a local dataset; or such cells are skipped as they come
        return
    start = 0
    for chunk in split.data.column(image_column).chunks:
        if pa.types.is_struct(chunk.type):
            paths, pathless = chunk.field("path"), pc.is_null(chunk.field("bytes"))
        else:  # a column of plain strings: each one a path
            paths, pathless = chunk, pa.array([True] * len(chunk))
        for row, path in zip(pc.indices_nonzero(pathless).to_pylist(), pc.filter(paths, pathless).to_pylist()):
            if not path_allowed(path, folders, follow_links=False):
                raise DataError(f"data.dataset={excerpt(settings.dataset)}: row {start + row} of split {split_name!r} "
                                + not_the_datasets_file(path))
        start += len(chunk)


def names_a_split(folder_name: str) -> bool:
    """Whether datasets' imagefolder reads a top-level folder of this name as a split (train, test, val, ...)."""
    from datasets.data_files import SPLIT_KEYWORDS

    first_word = re.split(r"[-._ ]", folder_name)[0]
    return any(first_word == word for words in SPLIT_KEYWORDS.values() for word in words)


def check_image_folder_layout(root: Path, name: str) -> None:
    """Refuse, saying what is wrong, the class-folder layouts that imagefolder would misread without a word."""
    from datasets.packaged_modules.imagefolder.imagefolder import ImageFolder

    if any(root.rglob("metadata.*")):  # labels may then come from the metadata file, at any depth
        return
    folders = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith((".", "__")))
    splits = [f for f in folders if names_a_split(f)]
    classes = [f for f in folders if not names_a_split(f)]
    if splits and classes:
        raise DataError(
            f"data.dataset={excerpt(name)}: the folder holds class folders {excerpt(classes)} beside {splits}, which "
            f"datasets reads as a split, not a class. Fix: rename the class folder {splits[0]!r} (e.g. "
            f"'{splits[0]}_class'), or put all classes under train/ (and validation/ or test/)"
        )
    extensions = set(ImageFolder.EXTENSIONS)
    for split_root in [root / f for f in splits] or [root]:
        examples: dict[int, Path] = {}  # images' depth below the split -> one of them
        for path in split_root.rglob("*"):
            relative = path.relative_to(split_root)
            if path.suffix.lower() in extensions and not any(part.startswith((".", "__")) for part in relative.parts):
                examples.setdefault(len(relative.parts), relative)
        if len(examples) > 1:
            found = ", ".join(f"'{example.as_posix()}'" for _, example in sorted(examples.items()))
            raise DataError(
                f"data.dataset={excerpt(name)}: images sit at different depths below {str(split_root)!r} (e.g. {found}); "
                "each image's label is the folder that holds it only when all images are one folder deep, so "
                "datasets would drop the labels. Fix: one folder per class holding its images directly, "
                "e.g. red/1.png, green/2.png (move nested folders up, or make each its own class folder)"
            )


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
    multi_label = is_label_set(train.features[label_column]) if settings.multi_label is None else settings.multi_label
    if multi_label and settings.multi_label is None and not notes:  # a label file's note already says why
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
    train = subsample(train, settings.max_train_samples, seed)
    evaluation = subsample(evaluation, settings.max_eval_samples, seed)
    # Keep encoded bytes/paths: we decode ourselves to name bad files and to crop before resizing.
    train = train.cast_column(image_column, datasets.Image(decode=False)).select_columns([image_column, label_column])
    evaluation = evaluation.cast_column(image_column, datasets.Image(decode=False)).select_columns([image_column, label_column])
    return Splits(train, evaluation, image_column, label_column, list(labels), eval_split, image_folders=folders,
                  multi_label=multi_label, notes=notes)


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
    import datasets

    train = loaded[settings.train_split]
    names = settings.target_columns or [target_column(train.features, settings.label_column)]
    eval_split = eval_split_in(loaded, settings)
    folders = image_folders(settings)
    for name in dict.fromkeys([settings.train_split, eval_split or settings.train_split]):
        refuse_foreign_paths(loaded[name], name, image_column, folders, settings)
    train = as_targets(train, image_column, names, settings.train_split)
    if eval_split is None:
        carved = train.train_test_split(test_size=settings.eval_fraction, seed=seed)
        train, evaluation = carved["train"], carved["test"]
    else:
        evaluation = as_targets(loaded[eval_split], image_column, names, eval_split)
    train = subsample(train, settings.max_train_samples, seed)
    evaluation = subsample(evaluation, settings.max_eval_samples, seed)
    train = train.cast_column(image_column, datasets.Image(decode=False))
    evaluation = evaluation.cast_column(image_column, datasets.Image(decode=False))
    return Splits(train, evaluation, image_column, TARGETS_COLUMN, list(names), eval_split, image_folders=folders,
                  notes=notes, task="regression")


def is_numeric(feature) -> bool:
    """A column of plain numbers (a ClassLabel's ids are classes, not values)."""
    return getattr(feature, "_type", "") == "Value" and feature.dtype.startswith(("float", "int", "uint"))


def target_column(features: dict, wanted: str | None) -> str:
    """A regression's one target column: data.label_column, else a numeric column with a label's usual name, else
    the only numeric column."""
    if wanted is not None:
        if wanted not in features:
            raise DataError(f"data.label_column={wanted!r} is not a column of the dataset; its columns are "
                            f"{list(features)}")
        return wanted
    numeric = [name for name, feature in features.items() if is_numeric(feature)]
    found = [name for name in LABEL_COLUMN_NAMES if name in numeric] or (numeric if len(numeric) == 1 else [])
    if not found:
        raise DataError(f"no target column chosen among the dataset's columns {list(features)} (numeric: {numeric}); "
                        "set data.label_column=<column>, or data.target_columns=[...] for several targets")
    return found[0]


def as_targets(table, image_column: str, names: list[str], split: str):
    """The image column and TARGETS_COLUMN (each row's target values); a missing, non-numeric or non-finite target is
    refused, naming the column and the row."""
    import datasets

    for name in names:
        if name not in table.features:
            raise DataError(f"data.target_columns: {name!r} is not a column of split {split!r}; its columns are "
                            f"{list(table.features)}")
        if not is_numeric(table.features[name]):
            raise DataError(f"the target column {name!r} of split {split!r} holds {table.features[name]}, not numbers; "
                            "data.task=regression needs a number per image in each target column")
    values = np.stack([np.asarray(table[name], dtype=np.float64) for name in names], axis=1) if len(table) else \
        np.zeros((0, len(names)))
    bad = np.flatnonzero(~np.isfinite(values).all(axis=1))
    if len(bad):
        row = int(bad[0])
        found = dict(zip(names, values[row].tolist()))
        raise DataError(f"row {row} of split {split!r} has a target that is missing or not finite ({found}); "
                        f"{len(bad)} row(s) do. Give finite numbers, or remove those rows")
    return table.select_columns([image_column]).add_column(TARGETS_COLUMN, values.tolist(),
                                                           feature=datasets.List(datasets.Value("float64")))


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


def hold_out_eval(train, settings: DataSettings, label_column: str | None, classes: int, seed: int):
    """(train, eval): data.eval_fraction of train held out, stratified by `label_column` so every class is in both
    parts (None: a plain seeded split, as for label sets, which have no single class to stratify by)."""
    try:
        carved = train.train_test_split(test_size=settings.eval_fraction, stratify_by_column=label_column, seed=seed)
    except ValueError as error:  # too few images for a part to hold every class, or a class of one image
        raise DataError(
            f"data.eval_fraction={settings.eval_fraction} cannot hold out a stratified eval split from "
            f"data.train_split={settings.train_split!r} ({len(train)} images, {classes} classes): {error}. Fix: "
            f"an eval_fraction between {classes / len(train):.2f} and {1 - classes / len(train):.2f}, at least two "
            "images per class, or a dataset split to evaluate on (data.eval_split)"
        ) from None
    return carved["train"], carved["test"]


def training_facts(splits: Splits) -> dict:
    """What metrics.json records of the training split: the labels no training image holds (the model cannot learn
    them; their eval scores measure nothing learned) and, for label sets, how many images hold none of the labels."""
    import pyarrow.compute as pc

    if splits.task == "regression":
        return {}  # no classes to count
    column = splits.train.with_format("arrow")[splits.label_column]
    ids = pc.list_flatten(column) if splits.multi_label else column
    ids = np.asarray(ids.to_numpy(zero_copy_only=False), dtype=np.int64)
    counts = np.bincount(ids[ids >= 0], minlength=len(splits.labels))  # -1: a ClassLabel's "no label"
    facts = {"labels_without_train_images": [label for label, n in zip(splits.labels, counts) if n == 0]}
    if splits.multi_label:
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


def random_resized_crop_box(width: int, height: int, rng: random.Random, scale: tuple[float, float]) -> tuple[int, int, int, int]:
    """A crop box covering `scale` of the area with aspect ratio in [3/4, 4/3], as in the original ViT recipe."""
    if tuple(scale) == (1.0, 1.0) and width != height:
        # No crop asked, and a draw of the whole area at another aspect than the image's own never fits. (A square
        # image takes the draws below, which give it whole too: its random stream stays as measured.)
        return whole_image_box(width, height)
    area = width * height
    for _ in range(10):
        target_area = area * rng.uniform(*scale)
        aspect = np.exp(rng.uniform(np.log(3 / 4), np.log(4 / 3)))
        crop_w = int(round(np.sqrt(target_area * aspect)))
        crop_h = int(round(np.sqrt(target_area / aspect)))
        if 0 < crop_w <= width and 0 < crop_h <= height:
            left = rng.randint(0, width - crop_w)
            top = rng.randint(0, height - crop_h)
            return left, top, left + crop_w, top + crop_h
    return whole_image_box(width, height)


def whole_image_box(width: int, height: int) -> tuple[int, int, int, int]:
    """torchvision's fallback when no draw fits: the whole image, centre-cropped only to bring its aspect ratio
    into [3/4, 4/3]. Evaluation resizes the whole image, so within that range training without a crop sees what
    evaluation sees."""
    crop_w = min(width, round(height * 4 / 3))
    crop_h = min(height, round(width * 4 / 3))
    left, top = (width - crop_w) // 2, (height - crop_h) // 2
    return left, top, left + crop_w, top + crop_h


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


# ---------------------------------------------------------------- decoding and transforms


def decode_image(encoded: dict, index: int, settings: DataSettings,
                 folders: tuple[Path, ...] | None = None) -> Image.Image:
    """An RGB PIL image from a datasets Image(decode=False) cell, or BadImageError naming the sample. A cell
    holding only a path is read only from `folders` (None: anywhere; see image_folders)."""
    where = sample_name(encoded, index)
    raw, path = encoded.get("bytes"), encoded.get("path")
    if raw is None and not path_allowed(path, folders):
        raise BadImageError(f"bad image sample #{index}: its cell " + not_the_datasets_file(path))
    try:
        source = io.BytesIO(raw) if raw is not None else path
        if raw is not None and len(raw) == 0:
            raise BadImageError("the file is empty (0 bytes)")
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(source)
            width, height = image.size
            if width * height > settings.max_image_pixels:
                raise BadImageError(f"{width}x{height} px is over data.max_image_pixels={settings.max_image_pixels}")
            if min(width, height) < settings.min_image_side:
                raise BadImageError(f"{width}x{height} px is under data.min_image_side={settings.min_image_side}")
            image.load()  # decode now, so a truncated file fails here and not inside a transform
        return to_rgb(image, settings.alpha_background)
    except BadImageError as error:
        raise BadImageError(f"bad image {where}: {error}. Fix the file, or set data.skip_bad_images=true") from None
    except (OSError, UnidentifiedImageError, SyntaxError, ValueError, Image.DecompressionBombError, Warning) as error:
        raise BadImageError(
            f"bad image {where}: cannot be decoded ({type(error).__name__}: {error}). "
            "Fix the file, or set data.skip_bad_images=true to skip and count such images"
        ) from None


def not_the_datasets_file(path: str | None) -> str:
    """Why a Hub dataset's image cell that holds only a path is refused, and the fix."""
    return (f"holds no image bytes, only the path {excerpt(path)}, which is not a file of the Hub dataset: a Hub "
            "dataset's images are read from the dataset, never from this machine's disk. Fix the dataset (embed the "
            "images, as push_to_hub does), or set data.skip_bad_images=true to skip and count such images")


def path_allowed(path: str | None, folders: tuple[Path, ...] | None, follow_links: bool = True) -> bool:
    """Whether a path-only image cell may be opened: anywhere when `folders` is None, else only inside one of them.
    `..` never leads out; with `follow_links`, nor does a symlink (the path is resolved first: a syscall per part)."""
    if folders is None:
        return True
    if not path:
        return False
    where = Path(path).resolve() if follow_links else Path(os.path.abspath(path))
    return any(where.is_relative_to(folder) for folder in folders)


# Grey deeper than 8 bits: convert("RGB") clips it at 255 (a white image) or truncates floats (a black one), so it
# is scaled to 8 bits instead, taking as white the top of the range its type conventionally spans:
#   16-bit ("I;16*"), and Pillow's "I" from a 16-bit PGM/PNM (Pillow stretches any maxval to 0..65535): 65535
#   32-bit integer TIFF ("I"): 2**31 - 1 if signed (Pillow writes these), 2**32 - 1 if unsigned
#   32-bit float ("F"): 1.0, as float images are kept in [0, 1] (skimage, OpenCV); values outside are clipped
# Data that uses only part of its type's range (12-bit counts in a 32-bit file) comes out dark: rescale it first.
SIXTEEN_BIT_MODES = ("I;16", "I;16L", "I;16B", "I;16N")
TIFF_BITS_PER_SAMPLE, TIFF_SAMPLE_FORMAT, TIFF_UNSIGNED = 258, 339, 1
WHITE_LEVELS = {**{mode: lambda image: 65535 for mode in SIXTEEN_BIT_MODES},
                "I": lambda image: _integer_white(image), "F": lambda image: 1.0}


def _integer_white(image: Image.Image) -> int:
    """White for Pillow's 32-bit signed mode "I": by the bits the file declares (only TIFF declares 32)."""
    tags = getattr(image, "tag_v2", {})
    if 32 not in tuple(tags.get(TIFF_BITS_PER_SAMPLE, ())):
        return 65535
    return 2**32 - 1 if tuple(tags.get(TIFF_SAMPLE_FORMAT, (TIFF_UNSIGNED,)))[0] == TIFF_UNSIGNED else 2**31 - 1


def to_rgb(image: Image.Image, alpha_background: str | None = None) -> Image.Image:
    """RGB pixels as `pipeline()` reads a file (transformers' load_image): EXIF orientation applied, then
    convert("RGB"), which drops alpha and maps grey, palette and CMYK. Two exceptions: grey deeper than 8 bits is
    scaled to 8 bits (WHITE_LEVELS; load_image clips it); and with `alpha_background` (data.alpha_background) an
    image with transparency is laid on that colour first, so a drawing kept in the alpha channel survives.
    `predict`, `explain` and the page decode with this function, so their pixels match evaluation."""
    ImageOps.exif_transpose(image, in_place=True)
    white_level = WHITE_LEVELS.get(image.mode)
    if white_level is not None:
        white = white_level(image)
        values = np.asarray(image)
        if white == 2**32 - 1:  # unsigned 32-bit samples, held by Pillow in a signed int32
            values = values.astype(np.int32).view(np.uint32)
        scaled = np.clip(values.astype(np.float64) / white, 0.0, 1.0) * 255.0
        image = Image.fromarray(np.round(np.nan_to_num(scaled)).astype(np.uint8))  # mode L; NaN as black
    elif alpha_background is not None and has_alpha(image):
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (*background_rgb(alpha_background), 255)),
                                     rgba).convert("RGB")
    return image if image.mode == "RGB" else image.convert("RGB")


# ---------------------------------------------------------------- transparency and flat images

# data.alpha_background: the colour transparent pixels are laid on before the alpha channel goes (a name here, or
# #rrggbb). Saved in the model's config.json under ALPHA_BACKGROUND_KEY, where predict, evaluate --dataset, explain,
# export and the page read it back; the card tells pipeline() users to do the same.
ALPHA_BACKGROUNDS = {"white": (255, 255, 255), "black": (0, 0, 0)}
ALPHA_BACKGROUND_KEY = "alpha_background"
ALPHA_MODES = ("RGBA", "RGBa", "LA", "La", "PA")


def has_alpha(image: Image.Image) -> bool:
    """Whether an image has transparency: an alpha channel, or a palette or grey value marked transparent."""
    return image.mode in ALPHA_MODES or "transparency" in image.info


def background_rgb(name: str) -> tuple[int, int, int]:
    """data.alpha_background as an (r, g, b) colour: white, black or #rrggbb (the recipe checks the spelling)."""
    if name in ALPHA_BACKGROUNDS:
        return ALPHA_BACKGROUNDS[name]
    return tuple(int(name[start:start + 2], 16) for start in (1, 3, 5))


def decoding_settings(config, **settings) -> DataSettings:
    """The data settings an image is read with for a saved model: its data.alpha_background (config.json), so
    that predict, evaluate, explain, export and the page see the pixels the model was trained and evaluated on."""
    return DataSettings(alpha_background=getattr(config, ALPHA_BACKGROUND_KEY, None), **settings)


def alpha_card_text(settings: DataSettings) -> str:
    """The card's word on transparency: what training did with it, and what a pipeline() user must do the same."""
    if settings.alpha_background is None:
        return ""
    return (f"Images with transparency were laid on {settings.alpha_background} before their alpha channel was "
            f"dropped (`data.alpha_background: {settings.alpha_background}`, saved as `{ALPHA_BACKGROUND_KEY}` in "
            "`config.json`); vit_finetune's `predict`, `explain` and page do the same. `pipeline()` drops alpha "
            "without it: give it such images composited first, e.g. `Image.alpha_composite(Image.new(\"RGBA\", "
            f"image.size, {background_rgb(settings.alpha_background)}), image.convert(\"RGBA\")).convert(\"RGB\")`.\n")


# Before training, this many training images (seeded, spread over the split) are decoded as training will decode
# them, to find those that come out as one flat colour: what a drawing kept only in the alpha channel becomes once
# alpha is dropped. A flat field keeps a spread below FLAT_SPREAD (8-bit values, the largest channel's standard
# deviation) even after JPEG compression; any drawing or photo is far above it.
FLAT_CHECKED = 256
FLAT_SPREAD = 2.0


def is_flat(image: Image.Image) -> bool:
    """Whether an image is one colour, or nearly (measured on a thumbnail: the same for a flat field, and fast)."""
    thumbnail = image.copy()
    thumbnail.thumbnail((128, 128))
    values = np.asarray(thumbnail, dtype=np.float64)
    return float(values.reshape(-1, values.shape[-1] if values.ndim == 3 else 1).std(axis=0).max()) < FLAT_SPREAD


@dataclass
class FlatImages:
    """What the check found: how many training images it decoded, which came out flat, and which of those hold
    a drawing in their alpha channel (not flat when laid on white or black)."""
    checked: int
    flat: list[str]
    drawn_in_alpha: list[str]

    def problem(self, settings: DataSettings) -> str | None:
        """The console's word on the flat images (None if there is none)."""
        if not self.flat:
            return None
        alpha = (f"; {len(self.drawn_in_alpha)} of them keep their drawing in the alpha channel (transparency), which "
                 "decoding drops as pipeline() does" if self.drawn_in_alpha else "")
        fix = ("Fix: data.alpha_background=white (or black, or #rrggbb) lays transparent pixels on that colour in "
               "training, evaluation, predict, explain, export and the page, and the model card asks pipeline() "
               "users to do the same" if self.drawn_in_alpha and settings.alpha_background is None
               else "Fix: check those files")
        return (f"{len(self.flat)} of the {self.checked} training images checked decode to one flat colour, which "
                f"teaches nothing (e.g. {', '.join(excerpt(name) for name in self.flat[:3])}){alpha}. {fix}")

    def refuses(self, settings: DataSettings) -> bool:
        """Most training images flat: the run would train on nothing, unless data.allow_flat_images says so."""
        return len(self.flat) * 2 > self.checked and not settings.allow_flat_images


def flat_images(splits: Splits, settings: DataSettings, seed: int) -> FlatImages:
    """Decode up to FLAT_CHECKED training images (a seeded sample) as training does; find the flat ones."""
    table, count = splits.train, len(splits.train)
    chosen = range(count) if count <= FLAT_CHECKED else sorted(random.Random(seed).sample(range(count), FLAT_CHECKED))
    checked, flat, drawn = 0, [], []
    on = {name: settings.model_copy(update={"alpha_background": name}) for name in ALPHA_BACKGROUNDS}
    for index in chosen:
        cell = table[index][splits.image_column]
        try:
            image = decode_image(cell, index, settings, splits.image_folders)
        except BadImageError:  # reported, or skipped and counted, where training decodes it
            continue
        checked += 1
        if not is_flat(image):
            continue
        flat.append(sample_name(cell, index))
        if settings.alpha_background is None and any(
                not is_flat(decode_image(cell, index, laid, splits.image_folders)) for laid in on.values()):
            drawn.append(sample_name(cell, index))
    return FlatImages(checked, flat, drawn)


# data.crop_scale=auto: the crop area from the training images a run will see (optimiser steps x images per step).
# Measured (docs/training.md, "Small data"): against no crop, every random-resized-crop range tried lost or tied up to
# AUTO_CROP_MEASURED_UP_TO images seen: 5-100 %, 35-100 % and 60-100 % at 1,280 (three real sets, tiny ViT) and
# 75-100 % at 7,040 (held-out digits 5-9: 0.47 vs 0.63 from one digits-0-4 pretraining, 0.859 vs 0.865 from
# scripts/heldout_digits.py's; with the head at train.head_lr=auto 0.880 vs 0.870, two images of 192, a tie, and
# with the fused AdamW 0.891 vs 0.938; one seed each). No crop range is measured to help clearly anywhere,
# and longer runs are not measured: there auto stays conservative (no crop) rather than extrapolate toward the
# ViT paper's 5-100 % over 250k+ images.
AUTO_CROP_MEASURED_UP_TO = 7_040  # training images seen: the longest run where crops were compared with none


def auto_crop_scale(images_seen: int) -> tuple[tuple[float, float], str]:
    """The random-resized-crop area range data.crop_scale=auto stands for, and why, for a run that sees
    `images_seen` training images."""
    if images_seen <= AUTO_CROP_MEASURED_UP_TO:
        return (1.0, 1.0), (f"every crop range measured up to {AUTO_CROP_MEASURED_UP_TO:,} training images seen lost to "
                            "no crop or tied (docs/training.md: Small data)")
    return (1.0, 1.0), (f"crops are not measured beyond {AUTO_CROP_MEASURED_UP_TO:,} training images seen, so auto "
                        "stays at no crop")


def crop_in_words(scale: tuple[float, float]) -> str:
    """A crop area range as the console names it."""
    low, high = scale
    return "no random crop" if (low, high) == (1.0, 1.0) else f"random crops of {low:.0%} to {high:.0%} of the area"


# The image processor's resampling filter (PIL's number) -> torch's uint8 kernel for it, which gives PIL's antialiased
# resize to within one grey level, about 3x faster on one core for ~512 px photos to 384 px. Training must resize
# as evaluation (the saved processor, which pipeline() runs) does: on 8 px digits upscaled to 56 px a head fitted on
# bicubic pixels scored 0.863 on bilinear ones against 0.950 on bicubic. Filters not listed resize with PIL itself.
TORCH_RESIZE = {Image.Resampling.BILINEAR: "bilinear", Image.Resampling.BICUBIC: "bicubic"}


def resample_of(processor) -> int:
    """The PIL filter an image processor resizes with (bilinear when it names none)."""
    return int(getattr(processor, "resample", None) or Image.Resampling.BILINEAR)


def train_transform(image: Image.Image, size: int, rng: random.Random, settings: DataSettings,
                    resample: int = Image.Resampling.BILINEAR) -> torch.Tensor:
    """Random resized crop + horizontal flip to a uint8 CHW tensor; the crop is resized with `resample` (PIL's
    filter number: the image processor's, resample_of)."""
    if settings.crop_scale == "auto":
        raise ValueError("train_transform needs data.crop_scale resolved (auto_crop_scale) before it runs")
    left, top, right, bottom = random_resized_crop_box(*image.size, rng, settings.crop_scale)
    mode = TORCH_RESIZE.get(resample)
    if mode is None:
        resized = image.crop((left, top, right, bottom)).resize((size, size), resample)
        pixels = torch.from_numpy(np.array(resized, dtype=np.uint8)).permute(2, 0, 1)
    else:
        crop = torch.from_numpy(np.array(image, dtype=np.uint8))[top:bottom, left:right].permute(2, 0, 1)
        pixels = torch.nn.functional.interpolate(crop[None], size=(size, size), mode=mode, antialias=True,
                                                 align_corners=False)[0]
    if settings.horizontal_flip and rng.random() < 0.5:
        pixels = pixels.flip(-1)
    return pixels.contiguous()


def sample_rng(seed: int, epoch: int, index: int) -> random.Random:
    """Augmentation randomness fixed by (seed, epoch, sample): resumes and worker counts cannot change it."""
    return random.Random(f"{seed}-{epoch}-{index}")


# The label of an image skipped as bad. Training and evaluation keep such an image's place (blank pixels, this
# label) so that batch shapes never change: every process's eval batch keeps its shape (gather_for_metrics needs
# equal shapes, and drops the padding Accelerate adds to the last batch by counting positions), and a training
# batch is never smaller (no recompile under torch.compile). The loss and the metrics leave these places out.
SKIPPED_LABEL = -1


def sample_name(encoded: dict, index: int) -> str:
    """How messages name a sample: its file, or its index when it came as bytes."""
    return encoded.get("path") or f"sample #{index}"


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


def target_encoding(splits) -> str:
    """The TARGET_ENCODINGS entry of loaded splits (a stream's too)."""
    return "values" if getattr(splits, "task", None) == "regression" else "set" if splits.multi_label else "class"


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


def eval_dataset(splits: Splits, settings: DataSettings, processor, image_size: int) -> ImageClassificationDataset:
    """The eval split preprocessed by the saved image processor; a skipped bad image keeps its place, blank."""
    return ImageClassificationDataset(splits.eval, splits.image_column, splits.label_column, settings,
                                      eval_pixels_from_processor(processor), blank_pixels(image_size, training=False),
                                      splits.image_folders, encoding=target_encoding(splits), outputs=len(splits.labels))


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


ImageFile.LOAD_TRUNCATED_IMAGES = False  # a truncated JPEG is an error, never silently grey pixels
