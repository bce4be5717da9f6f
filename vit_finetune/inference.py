"""Using a trained model: find it (folder or Hub id), gather images (files, folders, globs, a dataset split),
predict in batches, write CSV or JSONL, and evaluate it on any split of any dataset the data module loads.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Iterator

from .errors import VitFinetuneError, shortened
from .layout import (CONFIG_FILE, CONFUSION_FILE, METRICS_FILE, MISCLASSIFIED_FILE, PREDICTED_VS_TRUE_FILE, RECIPE_FILE,
                     describe_write_error, replace_atomically)
from .progress import progress
from .recipe import DataSettings, load_recipe
from .errors import excerpt
from .sources import ASSETS_DIR, BUILTIN_PREFIX, REPO_ID_PATTERN
from .spreadsheet import csv_writer
from .text import printable

# torch, transformers and datasets are imported where they are used: a wrong model path or output name must
# fail in a fraction of a second, before seconds of imports.

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm"}


class InputError(VitFinetuneError):
    """A model, image or output that cannot be used as given; the message names it and the fix."""


@dataclass
class ImageSource:
    """One image to classify: a name for the output row, the encoded cell decode_image reads, and where a cell
    holding only a path may be read from (data.image_folders: None for the user's own files)."""
    name: str
    encoded: dict
    folders: tuple[Path, ...] | None = None


def model_location(name: str) -> str:
    """A folder that exists, builtin:NAME, or a Hub id that is cached or found on the Hub.

    Anything else fails at once with "folder not found": handed to from_pretrained, a missing `outputs/run` is
    looked up as a Hub id through a minute of retries and ends in a traceback.
    """
    if name.startswith(BUILTIN_PREFIX):
        return str(ASSETS_DIR / name.removeprefix(BUILTIN_PREFIX))
    path = Path(name).expanduser()
    if path_kind(path, name, "the model") == "folder":
        if not (path / CONFIG_FILE).is_file():
            raise InputError(f"{name} is a folder but holds no config.json: not a saved model. "
                                    "Give a run's output_dir or a Hub model id")
        return str(path)
    not_found = f"folder not found: {name}"
    looks_local = (name.startswith((".", "/", "~")) or name.endswith("/") or name.count("/") > 1
                   or path.parent != Path(".") and path.parent.is_dir() or not REPO_ID_PATTERN.match(name))
    if looks_local:
        raise InputError(f"{not_found}. Give an existing output folder, or a Hub model id such as "
                                "google/vit-base-patch16-224")
    from .hub import unreachable_problem  # here: inference's module stays light to import (the CLI's --help)

    problem = unreachable_problem(name)
    if problem:
        raise InputError(f"{not_found}, and {problem}")
    return name


OWN_CODE = ("{name} ships its own Python code (an auto_map in its config), which vit_finetune never runs: it would "
            "run with your permissions. Use a model of a supported family saved with save_pretrained (no auto_map), "
            "such as a run's output_dir")


def refuse_own_code(name: str, location: str) -> None:
    """A model whose config maps its classes to its own Python code (`auto_map`) is refused, read from config.json
    alone, even when its model_type is a built-in one: loaded with the built-in class instead, it would silently not
    be the model its author wrote."""
    from transformers import PretrainedConfig

    try:
        raw, _ = PretrainedConfig.get_config_dict(location)
    except (OSError, ValueError):  # unreadable: loading it says why
        return
    if isinstance(raw, dict) and raw.get("auto_map"):
        raise InputError(OWN_CODE.format(name=name))


def load_classifier(name: str, device: str = "cpu", eager_attention: bool = False):
    """(model in eval mode on `device`, its saved image processor). Eager attention returns attention weights,
    which explain needs and training never does (it is slower).

    A model's own Python code (an `auto_map` in its config) never runs: trust_remote_code is False, not left unset,
    so transformers refuses instead of asking on stdin, where a piped `yes` would have run it."""
    from safetensors import SafetensorError
    from transformers import AutoImageProcessor, AutoModelForImageClassification
    from transformers.utils import SAFE_WEIGHTS_NAME

    location = model_location(name)
    refuse_own_code(name, location)
    extra = {"attn_implementation": "eager"} if eager_attention else {}
    try:
        model = AutoModelForImageClassification.from_pretrained(location, trust_remote_code=False, **extra)
        processor = AutoImageProcessor.from_pretrained(location, trust_remote_code=False)
    except SafetensorError as error:
        raise InputError(f"{name}: its weights file {SAFE_WEIGHTS_NAME} is damaged or incomplete ({error}); "
                         "copy or download the model again") from None
    except (OSError, ValueError) as error:
        if "trust_remote_code" in str(error):
            raise InputError(OWN_CODE.format(name=name)) from None
        raise InputError(f"{name} could not be loaded as an image classifier: {shortened(error, 400)}") from None
    return model.to(device).eval(), processor


def path_kind(path: Path, given: str, what: str) -> str:
    """'folder', 'file' or 'missing'; a path the system refuses to look up (a name over 255 bytes, a loop of
    links) is an InputError naming it, not an OSError from deep inside a glob."""
    try:
        return "folder" if path.is_dir() else "file" if path.exists() else "missing"
    except OSError as error:
        shown = given if len(given) <= 120 else given[:60] + "..." + given[-40:]
        raise InputError(f"{what} {shown!r} cannot be looked up: {error.strerror or error}; give a shorter or "
                         "valid path") from None


def glob_files(pattern: str) -> list[Path]:
    """The files a glob names. pathlib's `**` never descends into a linked folder, so a link back to an ancestor
    cannot make the search endless (glob.glob follows it: two such links never return)."""
    path = Path(pattern).expanduser()
    root = Path(path.anchor) if path.is_absolute() else Path(".")
    relative = str(path.relative_to(root)) if path.is_absolute() else str(path)
    try:
        return sorted(match for match in root.glob(relative) if match.is_file())
    except (ValueError, OSError):  # an unacceptable pattern ("/" alone) or an unreadable folder: nothing found
        return []


def collect_images(specs: list[str]) -> list[ImageSource]:
    """Files, folders (searched recursively for image files, linked folders not followed) and globs, in the order
    given, each file once however many links or specs reach it."""
    found: dict[Path, str] = {}  # resolved path -> the name it was first reached by
    unmatched = []
    for spec in specs:
        path = Path(spec).expanduser()
        kind = path_kind(path, spec, "image path")
        if kind == "folder":
            matches = sorted(p for p in path.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())
        elif kind == "file":
            if not path.is_file():  # reading a FIFO waits for a writer that never comes; a device never ends
                raise InputError(f"image path {spec!r} is not a regular file (a FIFO, socket or device); give image "
                                 "files, folders or globs")
            matches = [path]
        else:
            matches = glob_files(spec)
        if not matches:
            unmatched.append(spec)
        for match in matches:
            found.setdefault(match.resolve(), str(match))
    if unmatched:
        raise InputError(f"image file(s) not found: {unmatched}; give files, folders or globs such as 'photos/*.jpg'")
    return [ImageSource(name, {"path": name, "bytes": None}) for name in found.values()]


def dataset_settings(dataset: str, **settings) -> DataSettings:
    """The data settings a --dataset is read with; a value the recipe would refuse (a name over 255 bytes) is an
    InputError naming it, as the recipe names data.dataset."""
    from pydantic import ValidationError

    try:
        return DataSettings(dataset=dataset, **settings)
    except ValidationError as error:
        problem = error.errors()[0]["msg"].removeprefix("Value error, ")
        raise InputError(f"--dataset {excerpt(dataset)}: {problem}") from None


def dataset_split(dataset: str, split: str) -> tuple[object, str, str | None]:
    """(rows with undecoded images, image column, label column or None) of one split of any dataset source."""
    import datasets

    from .data import IMAGE_COLUMN_NAMES, LABEL_COLUMN_NAMES, DataError, detect_column, open_dataset

    loaded = open_dataset(dataset_settings(dataset, train_split=split))
    if split not in loaded:
        raise DataError(f"--split {split!r} is not a split of {dataset!r}; its splits are {list(loaded)}")
    table = loaded[split]
    image_column = detect_column(table.features, None, "image", IMAGE_COLUMN_NAMES, datasets.Image)
    try:
        label_column = detect_column(table.features, None, "label", LABEL_COLUMN_NAMES, datasets.ClassLabel)
    except DataError:
        label_column = None
    return table.cast_column(image_column, datasets.Image(decode=False)), image_column, label_column


def dataset_images(dataset: str, split: str) -> list[ImageSource]:
    from .data import image_folders

    table, image_column, _ = dataset_split(dataset, split)
    folders = image_folders(dataset_settings(dataset))
    return [ImageSource(cell.get("path") or f"{dataset}[{split}]#{index}", cell, folders)
            for index, cell in enumerate(table[image_column])]


DEFAULT_TOP_K = 5  # a single-label model's labels listed per image when --top-k is not given


def label_scores(config, logits):
    """Each output's score as predict gives it: as pipeline() does for a classifier (a softmax, or a sigmoid per label
    for a multi-label model), a regression's values in the targets' own units."""
    from . import tasks

    return tasks.of_config(config).scores(logits)


def labels_given(config, scores: list[float], top_k: int | None = None) -> list[tuple[str, float]]:
    """What a model gives one image, best first (the task's labels_given): a single-label model its top_k labels
    (DEFAULT_TOP_K when None); a multi-label model each label whose score reaches its saved threshold (at most top_k
    when given); a regression model each target's value. predict, explain and the page all show these."""
    from . import tasks

    labels = [config.id2label[i] for i in range(config.num_labels)]
    return tasks.of_config(config).labels_given(scores, labels, top_k)


def predict_rows(model, processor, sources: list[ImageSource], top_k: int | None, batch_size: int,
                 show_progress: bool = True) -> Iterator[dict]:
    """One row per image, in order: the labels the model gives it with their scores (labels_given), or the reason
    it could not be read. Images are decoded as the model's training decoded them (data.decoding_settings)."""
    import torch

    from .data import BadImageError, decode_image, decoding_settings
    settings = decoding_settings(model.config)
    device = model.device  # a transformers model's, or an onnx_export.OnnxClassifier's
    bar = progress(len(sources), desc="predict", enabled=show_progress and len(sources) > batch_size, unit="image")
    for start in range(0, len(sources), batch_size):
        batch = sources[start:start + batch_size]
        images, errors = [], {}
        for position, source in enumerate(batch):
            try:
                images.append(decode_image(source.encoded, start + position, settings, source.folders))
            except BadImageError as error:
                errors[position] = str(error)
        given = iter(())
        if images:
            pixels = processor(images=images, return_tensors="pt")["pixel_values"].to(device)
            with torch.no_grad():
                logits = model(pixel_values=pixels).logits.float()
            given = iter([labels_given(model.config, row, top_k) for row in label_scores(model.config, logits).tolist()])
        for position, source in enumerate(batch):
            if position in errors:
                yield {"image": source.name, "error": errors[position], "predictions": []}
                continue
            yield {"image": source.name, "error": None,
                   "predictions": [{"label": label, "score": score} for label, score in next(given)]}
        bar.update(len(batch))
        bar.set_postfix(unreadable=len(errors))
    bar.close()


def write_jsonl(rows: Iterator[dict], path: Path, top_k: int) -> int:
    count = 0
    with open(path, "w") as out:
        for row in rows:
            out.write(json.dumps(row) + "\n")
            count += 1
    return count


def write_csv(rows: Iterator[dict], path: Path, top_k: int, config=None) -> int:
    """The CSV of the model's task (a single-label model's ranks, label sets, or a regression's values per target);
    cells a spreadsheet would run as formulas are written inert."""
    from . import tasks

    task = tasks.of_config(config) if config is not None else tasks.SingleLabel()
    return task.write_csv(rows, path, top_k, csv_writer)


def write_text(rows: Iterator[dict], stream=None) -> int:
    """No --output: the human-readable listing on stdout."""
    stream = stream or sys.stdout
    count = 0
    for row in rows:
        print(printable(row["image"]), file=stream)
        if row["error"]:
            print(f"  error: {printable(row['error'])}", file=stream)
        for guess in row["predictions"]:
            print(f"  {guess['score']:.4f}  {printable(guess['label'])}", file=stream)
        count += 1
    return count


WRITERS = {".csv": write_csv, ".jsonl": write_jsonl}


def writer_for_model(write, config):
    """The writer for a model: the CSV's columns are the task's (write_csv)."""
    return partial(write_csv, config=config) if write is write_csv else write


def writer_for(output: str | None, overwrite: bool = False):
    """The writer for --output's suffix, and the file checked, before any model or image is read: a folder, a
    missing folder, or a file the user did not ask to replace is refused."""
    if output is None:
        return None
    path = Path(output).expanduser()
    kind = path_kind(path, output, "--output")
    if kind == "folder":
        raise InputError(f"--output {output!r} is a folder; give a file name in it, such as {str(path / 'predictions.csv')!r}")
    suffix = path.suffix.lower()
    if suffix not in WRITERS:
        raise InputError(f"--output {output!r}: unknown format {suffix or '(no suffix)'!r}; use a name ending in "
                         f"{' or '.join(WRITERS)}")
    if path_kind(path.parent, str(path.parent), "--output's folder") != "folder":
        raise InputError(f"--output {output!r}: the folder {str(path.parent)!r} does not exist; create it first or "
                         "write elsewhere")
    if kind == "file" and not overwrite:
        raise InputError(f"--output {output!r} already exists; pass --overwrite to replace it, or choose a new name")
    return WRITERS[suffix]


def refuse_output_among_inputs(output: str | None, sources: list[ImageSource], dataset: str | None) -> None:
    """--output may not be a file predict reads: an image it was given, or the --dataset's label file, which
    --overwrite would replace with the predictions. Compared resolved (`~`, `..`, symlinks)."""
    if output is None:
        return
    target = os.path.realpath(Path(output).expanduser())
    reads = [Path(source.name) for source in sources]
    if dataset is not None:
        from .data.labels import LabelFileError, label_file_of  # data/ loads torch: only for a --dataset

        try:
            reads.append(label_file_of(Path(dataset).expanduser()))
        except LabelFileError:  # two label files: the dataset's own error says so when it loads
            pass
    for read in reads:
        if read is not None and os.path.realpath(read) == target:
            raise InputError(f"--output {output!r} is {str(read)!r}, a file this command reads; writing the "
                             "predictions there would replace it. Fix: choose another --output")


def write_output(write, rows: Iterator[dict], path: Path, top_k: int) -> int:
    """`write` into a temporary file beside `path`, renamed over it once complete: a kill or an error midway leaves
    no partial file under the name, and a file that was there stays as it was."""

    counted: list[int] = []
    try:
        replace_atomically(path, lambda into: counted.append(write(rows, into, top_k)))
    except OSError as error:
        raise InputError(f"--output {str(path)!r} cannot be written ({describe_write_error(error, path.parent)}); "
                         "nothing was written under that name, a file already there is as it was. Free disk space "
                         "or write elsewhere") from None
    return counted[0]


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


def to_model_labels(table, label_column: str, labels: list[str], label_sets: bool = False):
    """The split's labels re-numbered by the model's own label order, matched by name; with `label_sets` (a
    multi-label model) each row's labels as a list (a single label becomes a list of one)."""
    import datasets

    from .data import DataError, is_label_set

    feature = table.features[label_column]
    inner = getattr(feature, "feature", feature)
    names = inner.names if isinstance(inner, datasets.ClassLabel) else None
    rows_are_sets = is_label_set(feature)
    if rows_are_sets and not label_sets:
        raise DataError(f"the dataset's {label_column!r} column holds label sets, but the model is single-label; "
                        "evaluate a multi-label model on it")

    def name_of(value) -> str:
        return names[value] if names is not None else str(value)

    def values_of(cell) -> list:
        return list(cell) if rows_are_sets else [cell]

    found = {name_of(value) for cell in table[label_column] for value in values_of(cell)}
    unknown = sorted(found - set(labels))
    if unknown:
        raise DataError(f"labels {unknown[:10]} of the dataset are not labels of the model ({labels[:10]}"
                        f"{' ...' if len(labels) > 10 else ''}); evaluate on a dataset with the model's classes")
    index = {label: position for position, label in enumerate(labels)}
    classes = datasets.ClassLabel(names=labels)
    features = datasets.Features({**table.features, label_column: datasets.List(classes) if label_sets else classes})
    if label_sets:
        return table.map(lambda row: {label_column: [index[name_of(v)] for v in values_of(row[label_column])]},
                         features=features)
    return table.map(lambda row: {label_column: index[name_of(row[label_column])]}, features=features)


@dataclass
class EvalSplit:
    """A split ready to evaluate: its images preprocessed by the saved processor, and how to batch them."""
    dataset: object  # data.ImageClassificationDataset
    batch_size: int
    precision: str  # the run's mixed precision, from its recipe.yaml ("no" for a folder without one)
    fields: dict  # eval_split and eval_carved_from_train, as metrics.json records them
    task: object  # tasks.Task that scores the split: on the run's own, as the run scored it (its thresholds chosen again)


def eval_split_of(name: str, model, processor, dataset: str | None = None, split: str | None = None,
                  batch_size: int | None = None) -> EvalSplit:
    """With no dataset, the run's own eval split rebuilt from its recipe.yaml exactly as training built it (same
    rows, order, batch size and precision); else `split` of `dataset`, its labels matched to the model's by name,
    evaluated at the run's precision too where its recipe.yaml says it (the same images, the same numbers)."""
    from . import data, evaluation, tasks
    from .families import FAMILIES

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
        table, image_column, label_column = dataset_split(dataset, split)
        if label_column is None:
            raise data.DataError(f"split {split!r} of {dataset!r} has no label column: use predict for unlabelled images")
        if task.other_dataset_refusal:
            raise data.DataError(task.other_dataset_refusal)
        table = to_model_labels(table, label_column, labels, task.label_sets)
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
                   device: str = "cpu", output_dir: Path | None = None) -> dict:
    """Metrics of a saved model on a split (eval_split_of says which), so metrics.json is reproduced on the run's own."""
    from accelerate import Accelerator

    from . import data, evaluation
    from .precision import resolved

    model_location(name)  # a wrong path fails before the imports below
    model, processor = load_classifier(name, device)
    labels = [model.config.id2label[i] for i in range(model.config.num_labels)]
    chosen = eval_split_of(name, model, processor, dataset, split, batch_size)
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
