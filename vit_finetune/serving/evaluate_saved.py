"""evaluate: a saved model's metrics on its run's own eval split, rebuilt from its recipe.yaml exactly as training
built it (metrics.json reproduced), or on any split of any dataset the data module loads, its labels matched to the
model's by name; the metrics and pictures written atomically.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from vit_finetune.core.errors import VitFinetuneError
from vit_finetune.core.layout import (
    CONFUSION_FILE, METRICS_FILE, MISCLASSIFIED_FILE, PREDICTED_VS_TRUE_FILE, RECIPE_FILE, describe_write_error,
    replace_atomically,
)
from vit_finetune.model.saved_model import InputError, load_classifier, model_location, path_kind
from vit_finetune.recipe import load_recipe
from vit_finetune.serving.prediction import dataset_settings, dataset_split

# torch, transformers and datasets are imported where they are used: a wrong model path or output name must
# fail in a fraction of a second, before seconds of imports.


def check_evaluation_folder(output_dir: Path, overwrite: bool) -> None:
    """evaluate --output-dir: a folder (or a name for a new one) whose metrics.json and pictures may be written,
    checked before the model loads: a file there is replaced only with --overwrite."""
    kind = path_kind(output_dir, str(output_dir), "--output-dir")
    if kind == "file":
        raise InputError(f"--output-dir {str(output_dir)!r} is a file, not a folder; choose another --output-dir")
    taken = [name for name in (METRICS_FILE, CONFUSION_FILE, MISCLASSIFIED_FILE, PREDICTED_VS_TRUE_FILE)
             if kind == "folder" and (output_dir / name).exists()]
    if taken and not overwrite:
        raise InputError(f"--output-dir {str(output_dir)!r} already holds {taken}; pass --overwrite to replace them, "
                         "or choose a new --output-dir")


def classes_of_dataset(dataset: str, split: str | None, labels: list[str], task, target_columns: list[str] | None):
    """(table, image column, label column, split) of a classifier's --dataset, its labels matched to the model's by
    name."""
    from vit_finetune.data import DataError, relabel_by_name

    if target_columns is not None:
        raise InputError("--target-columns names a regression model's target columns; this model is a classifier, "
                         "whose labels are matched by name: leave --target-columns out")
    table, image_column, label_column, split = dataset_split(dataset, split)
    if label_column is None:
        raise DataError(f"split {split!r} of {dataset!r} has no label column: use predict for unlabelled images")
    table = relabel_by_name(table, label_column, labels, task.label_sets, "the model",
                            "evaluate on a dataset with the model's classes")
    return table, image_column, label_column, split


def targets_of_dataset(dataset: str, split: str | None, labels: list[str], task, target_columns: list[str] | None):
    """(table, image column, TARGETS_COLUMN, split) of a regression's --dataset: read as the run read its data
    (data.task=regression), each of the model's targets from the column of its name, or from --target-columns."""
    from vit_finetune.data.targets import TARGETS_COLUMN, as_targets

    columns = target_columns or labels
    if len(columns) != len(labels):
        raise InputError(f"--target-columns {','.join(columns)}: the model predicts {len(labels)} target(s) "
                         f"{labels}; name one column for each, in that order")
    fix = (f"the model predicts {labels}. Fix: --target-columns with the dataset's column for each target, "
           "comma-separated in that order")
    try:
        table, image_column, _, split = dataset_split(dataset, split, task=task.name, target_columns=columns)
    except VitFinetuneError as error:
        if "target_columns" not in str(error):  # not a missing column: the reader's own message says all
            raise
        raise InputError(f"{error}; {fix}") from None
    missing = [name for name in columns if name not in table.features]
    if missing:
        raise InputError(f"split {split!r} of {dataset!r} has no column {missing} (its columns: "
                         f"{list(table.features)}); {fix}")
    return as_targets(table, image_column, columns, split), image_column, TARGETS_COLUMN, split


# How a --dataset's labels become what the model is scored against, per Task.label_encoding.
OTHER_DATASET_READERS = {"class": classes_of_dataset, "set": classes_of_dataset, "values": targets_of_dataset}


@dataclass
class EvalSplit:
    """A split ready to evaluate: its images preprocessed by the saved processor, and how to batch them."""
    dataset: object  # data.ImageClassificationDataset
    batch_size: int
    precision: str  # the run's mixed precision, from its recipe.yaml ("no" for a folder without one)
    fields: dict  # eval_split and eval_carved_from_train, as metrics.json records them
    task: object  # tasks.Task that scores the split: on the run's own, as the run scored it (its thresholds chosen again)


def eval_split_of(name: str, model, processor, dataset: str | None = None, split: str | None = None,
                  batch_size: int | None = None, target_columns: list[str] | None = None) -> EvalSplit:
    """With no dataset, the run's own eval split rebuilt from its recipe.yaml exactly as training built it (same
    rows, order, batch size and precision); else `split` of `dataset` (predict.chosen_split when None), its labels
    matched to the model's by name or a regression's targets read from the columns of their names (or
    `target_columns`), evaluated at the run's precision too where its recipe.yaml says it (the same images, the same
    numbers)."""
    from vit_finetune import data, tasks
    from vit_finetune.tasks import evaluation
    from vit_finetune.model.families import FAMILIES

    labels = [model.config.id2label[i] for i in range(model.config.num_labels)]
    recipe_file = Path(model_location(name)) / RECIPE_FILE
    recipe = load_recipe(str(recipe_file)) if recipe_file.is_file() else None
    precision = recipe.train.mixed_precision if recipe is not None else "no"
    if dataset is None:
        if recipe is None:
            raise InputError(f"{name} holds no recipe.yaml, so its eval split is unknown; "
                                    "pass --dataset D --split S")
        splits = data.load_splits(recipe.data, recipe.train.seed)
        table, image_column, label_column = splits.eval, splits.image_column, splits.label_column
        settings, batch_size = recipe.data, batch_size or recipe.train.batch_size
        split_fields = evaluation.eval_split_fields(splits.eval_split)
        # The run's own split: scored as training scored it (multi-label thresholds chosen again, as training chose
        # them), so metrics.json is reproduced.
        task = tasks.of_config(model.config, recipe.train)
    else:
        task = tasks.of_config(model.config)
        read = OTHER_DATASET_READERS[task.label_encoding]
        table, image_column, label_column, split = read(dataset, split, labels, task, target_columns)
        settings = dataset_settings(dataset, alpha_background=getattr(model.config, data.ALPHA_BACKGROUND_KEY, None))
        split_fields = {"eval_split": split, "eval_carved_from_train": False}
    # A skipped image's placeholder has the model's own size, asked of its family (CLIP and SigLIP keep it under
    # vision_config, where config.image_size does not exist).
    size = FAMILIES[model.config.model_type].image_size(model.config)
    eval_set = data.ImageClassificationDataset(table, image_column, label_column, settings,
                                               data.eval_pixels_from_processor(processor),
                                               data.blank_pixels(size, training=False), data.image_folders(settings),
                                               encoding=task.label_encoding, outputs=len(labels))
    return EvalSplit(eval_set, batch_size or 32, precision, split_fields, task)


def evaluate_saved(name: str, dataset: str | None = None, split: str | None = None, batch_size: int | None = None,
                   device: str = "cpu", output_dir: Path | None = None, target_columns: list[str] | None = None) -> dict:
    """Metrics of a saved model on a split (eval_split_of says which), so metrics.json is reproduced on the run's own."""
    from accelerate import Accelerator

    from vit_finetune import data
    from vit_finetune.tasks import evaluation
    from vit_finetune.model.precision import resolved

    model_location(name)  # a wrong path fails before the imports below
    model, processor = load_classifier(name, device)
    labels = [model.config.id2label[i] for i in range(model.config.num_labels)]
    chosen = eval_split_of(name, model, processor, dataset, split, batch_size, target_columns)
    # A run's recipe.yaml says the precision it resolved; one written by hand may say auto.
    accelerator = Accelerator(cpu=device == "cpu", mixed_precision=resolved(chosen.precision, device.split(":")[0]))
    loader = accelerator.prepare(data.make_loader(chosen.dataset, chosen.batch_size, False, 0, 0,
                                                  device.startswith("cuda")))
    task = chosen.task
    predictions = evaluation.predict_split(model, loader, accelerator, data.PixelNormalizer(processor, model.device),
                                           task, len(labels))
    metrics = task.report(predictions, labels)
    metrics.update(chosen.fields)
    if output_dir is not None:
        write_evaluation(output_dir, metrics, lambda: task.draw(predictions, chosen.dataset, labels, output_dir, metrics))
    return metrics


def write_evaluation(output_dir: Path, metrics: dict, draw_pictures) -> None:
    """The pictures, then metrics.json, each through a temporary file renamed into place: a full disk or a kill
    midway leaves every file there whole (new, or as it was), and is reported as an error, not a traceback."""

    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        draw_pictures()
        replace_atomically(output_dir / METRICS_FILE, lambda partial: partial.write_text(json.dumps(metrics, indent=1)))
    except OSError as error:
        reason = describe_write_error(error, output_dir)
        raise InputError(f"--output-dir {str(output_dir)!r} cannot be written ({reason}); no file there is "
                         "half-written, those not yet replaced are as they were. Free disk space or choose another "
                         "--output-dir") from None
