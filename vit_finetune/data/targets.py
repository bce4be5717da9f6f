"""A regression's targets: which columns hold them, read into one list of floats per image, and checked to be finite,
within float32's reach and spread enough to learn (with a note of how each is standardised).
"""

from __future__ import annotations

import numpy as np

from vit_finetune.core.errors import DataError, excerpt
from vit_finetune.data.labels import LABEL_COLUMN_NAMES


TARGETS_COLUMN = "vit_finetune_targets"  # a regression's loaded column: each image's list of target values


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


FLOAT32_ROUNDING = 2.0 ** -24
