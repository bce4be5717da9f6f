"""Finding and loading the splits: a Hub id, a saved dataset, a label file or an image folder becomes train and
eval splits with their image and label columns (classes, label sets, or a regression's targets), an eval part held
out when the dataset has none, and subsampling; what a checkpoint records of the data; and where a Hub dataset's
image cells that hold only a path may be read from.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .. import hub
from ..recipe import DataSettings
from ..errors import excerpt
from ..sources import REPO_ID_PATTERN
from . import labels
from .errors import DataError
from .labels import LABEL_COLUMN_NAMES, label_sets_chosen
from .synthetic import ensure_demo_dataset


BUILTIN_SHAPES = "builtin:shapes"  # the demo's dataset, generated deterministically on first use
IMAGE_COLUMN_NAMES = ("image", "img", "picture", "photo", "pixel_values")
TARGETS_COLUMN = "vit_finetune_targets"  # a regression's loaded column: each image's list of target values


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




def cache_dir() -> Path:
    return Path(os.environ.get("VIT_FINETUNE_CACHE", Path.home() / ".cache" / "vit_finetune"))


def refuse_unreachable(settings: DataSettings) -> None:
    """A dataset that is neither on this disk nor fetchable from the Hub stops here, the Hub asked once, with the
    absolute path looked at and the offline fix (an existing folder or file is not asked)."""
    name = settings.dataset
    if name.startswith(BUILTIN_SHAPES) or Path(name).expanduser().exists():
        return
    could_be_hub_id = not name.startswith((".", "/", "~")) and bool(REPO_ID_PATTERN.match(name))
    problem = hub.missing_source_problem(name, "dataset", could_be_hub_id)
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
    train = subsample(train, settings.max_train_samples, seed)
    evaluation = subsample(evaluation, settings.max_eval_samples, seed)
    # Keep encoded bytes/paths: we decode ourselves to name bad files and to crop before resizing.
    train = train.cast_column(image_column, datasets.Image(decode=False)).select_columns([image_column, label_column])
    evaluation = evaluation.cast_column(image_column, datasets.Image(decode=False)).select_columns([image_column, label_column])
    return Splits(train, evaluation, image_column, label_column, list(labels), eval_split, image_folders=folders,
                  notes=notes, task="multi_label" if multi_label else "single_label")


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
    notes.extend(standardisation_notes(target_values(train), names, settings.train_split))
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

    features = table.features  # a deep copy of every column's feature at each read: read once, not per target
    for name in names:
        if name not in features:
            raise DataError(f"data.target_columns: {name!r} is not a column of split {split!r}; its columns are "
                            f"{excerpt(list(features))}")
        if not is_numeric(features[name]):
            raise DataError(f"the target column {name!r} of split {split!r} holds {features[name]}, not numbers; "
                            "data.task=regression needs a number per image in each target column")
    columns = table.select_columns(names).with_format("arrow")[:]  # Arrow columns, rows in the split's order
    values = np.stack([columns.column(name).to_numpy().astype(np.float64) for name in names], axis=1) \
        if len(table) else np.zeros((0, len(names)))
    bad = np.flatnonzero(~np.isfinite(values).all(axis=1))
    if len(bad):
        row = int(bad[0])
        found = dict(zip(names, values[row].tolist()))
        raise DataError(f"row {row} of split {split!r} has a target that is missing or not finite ({excerpt(found)}); "
                        f"{len(bad)} row(s) do. Give finite numbers, or remove those rows")
    refuse_huge_targets(values, names, split)
    return table.select_columns([image_column]).add_column(TARGETS_COLUMN, values.tolist(),
                                                           feature=datasets.List(datasets.Value("float64")))


# A regression's targets are learned in float32 (largest 3.4e38, normal down to 1.2e-38): the loss standardises them
# as (value - mean) / std and every answer is output x std + mean, both in float32. Values and spreads within these
# bounds keep eight orders of magnitude of headroom on either side, so neither overflows nor loses its digits.
TARGET_MAGNITUDE_MAX = 1e30
TARGET_SPREAD_MIN = 1e-30
# float32 rounds a value v by up to |v| x 2^-24; standardised, a column whose standard deviation is not at least
# this many times that rounding would be learned largely as rounding noise.
TARGET_SPREAD_OVER_ROUNDING = 100
FLOAT32_ROUNDING = 2.0 ** -24


def refuse_huge_targets(values: np.ndarray, names: list[str], split: str) -> None:
    """A target beyond TARGET_MAGNITUDE_MAX (finite in float64, but overflowing float32 once standardised or undone)
    is refused, naming its column, row and value, with the fix."""
    huge = np.abs(values) > TARGET_MAGNITUDE_MAX
    if huge.any():
        row, column = (int(i) for i in np.argwhere(huge)[0])
        raise DataError(f"the target column {names[column]!r} holds {values[row, column]:.6g} (row {row} of split "
                        f"{split!r}); {int(huge.sum())} value(s) are beyond ±{TARGET_MAGNITUDE_MAX:g}, which float32 "
                        "training cannot standardise and undo without overflowing. Fix: rescale the column (e.g. "
                        "divide it by a power of ten, or take its logarithm) and scale the predictions back")


def target_values(table) -> np.ndarray:
    """A loaded regression split's targets as an (images, targets) float64 array, read from Arrow at once."""
    import pyarrow.compute as pc

    column = table.with_format("arrow")[TARGETS_COLUMN]
    flat = pc.list_flatten(column).to_numpy(zero_copy_only=False).astype(np.float64)
    return flat.reshape(len(table), -1) if len(table) else flat.reshape(0, 0)


def standardisation_notes(values: np.ndarray, names: list[str], split: str) -> list[str]:
    """The training split's targets checked as the task standardises them (tasks.regression): a spread too small for
    float32 to hold is refused, naming the column and the fix; a constant column is said (it is learned as that
    constant, its target_std recorded as 1), and refused when every column is constant (nothing to learn)."""
    if not len(values):
        return []
    mean, std, largest = values.mean(axis=0), values.std(axis=0), np.abs(values).max(axis=0)
    constant = [t for t in range(len(names)) if std[t] == 0]
    for t in range(len(names)):
        rounding = largest[t] * FLOAT32_ROUNDING
        if std[t] == 0 or (std[t] >= TARGET_SPREAD_MIN and std[t] >= TARGET_SPREAD_OVER_ROUNDING * rounding):
            continue
        why = (f"below {TARGET_SPREAD_MIN:g}, where float32 (in which targets are learned) loses its digits"
               if std[t] < TARGET_SPREAD_MIN else
               f"while float32 (in which targets are learned) rounds values of that size by up to {rounding:.3g}")
        raise DataError(f"the target column {names[t]!r} of split {split!r} varies by {std[t]:.3g} (standard "
                        f"deviation) around {mean[t]:.8g}, {why}: standardised, its values would be mostly rounding. "
                        f"Fix: rescale the column, e.g. subtract {mean[t]:.8g} from every value (and multiply by a "
                        "power of ten if the spread is still tiny); add it back to the predictions")
    if not constant:
        return []
    shown = excerpt({names[t]: float(mean[t]) for t in constant})
    if len(constant) == len(names):
        raise DataError(f"every target is constant on the {len(values)} image(s) of split {split!r} ({shown}): there "
                        "is nothing to learn. Fix: check data.target_columns (or data.label_column), and give images "
                        "whose values differ")
    return [f"{len(constant)} target(s) are constant on the training split ({shown}): each is learned as that value "
            "(standardised to 0, its target_std saved as 1) and scores R² 0. Fix: remove it from data.target_columns, "
            "or add training images where it varies"]


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
