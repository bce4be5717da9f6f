"""predict: the images gathered (files, folders, globs, a dataset split), what the model gives each one, in batches,
and the rows written as CSV or JSON Lines (atomically), or listed on the console.
"""

from __future__ import annotations

import csv
import re
from typing import IO, Iterable
import itertools
import json
import os
import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Iterator

from vit_finetune.core.errors import excerpt, printable
from vit_finetune.core.layout import describe_write_error, replace_atomically
from vit_finetune.core.progress import progress
from vit_finetune.model.saved_model import InputError, path_kind
from vit_finetune.recipe import DataSettings

# torch, transformers and datasets are imported where they are used: a wrong model path or output name must
# fail in a fraction of a second, before seconds of imports.

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm"}


@dataclass
class ImageSource:
    """One image to classify: a name for the output row, the encoded cell decode_image reads, and where a cell
    holding only a path may be read from (data.image_folders: None for the user's own files)."""
    name: str
    encoded: dict
    folders: tuple[Path, ...] | None = None


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


# A --dataset with several splits and no --split: the first of these it has (the held-out ones, as a run evaluates).
DEFAULT_SPLITS = ("validation", "test")


def chosen_split(loaded, split: str | None, dataset: str) -> str:
    """`split` if the dataset has it; with no --split, its only split (a plain class folder has only train), else
    validation, else test; anything else names the splits it has."""
    splits = list(loaded)
    if split is not None:
        if split not in loaded:
            raise InputError(f"--split {split!r} is not a split of {dataset!r}; its splits are {splits}")
        return split
    if len(splits) == 1:
        return splits[0]
    found = next((name for name in DEFAULT_SPLITS if name in loaded), None)
    if found is None:
        raise InputError(f"--dataset {dataset!r} has the splits {splits} and none is {' or '.join(DEFAULT_SPLITS)}; "
                         f"choose one with --split, e.g. --split {splits[-1]}")
    return found


def dataset_split(dataset: str, split: str | None, **settings) -> tuple[object, str, str | None, str]:
    """(rows with undecoded images, image column, label column or None, the split's name) of one split of any dataset
    source (chosen_split when `split` is None); `settings`: the data settings it is read with (a regression's)."""
    import datasets

    from vit_finetune.data import IMAGE_COLUMN_NAMES, LABEL_COLUMN_NAMES, DataError, detect_column, open_dataset

    loaded = open_dataset(dataset_settings(dataset, **settings, **({"train_split": split} if split else {})))
    split = chosen_split(loaded, split, dataset)
    table = loaded[split]
    image_column = detect_column(table.features, None, "image", IMAGE_COLUMN_NAMES, datasets.Image)
    try:
        label_column = detect_column(table.features, None, "label", LABEL_COLUMN_NAMES, datasets.ClassLabel)
    except DataError:
        label_column = None
    return table.cast_column(image_column, datasets.Image(decode=False)), image_column, label_column, split


def dataset_images(dataset: str, split: str | None) -> list[ImageSource]:
    from vit_finetune.data import image_folders

    table, image_column, _, split = dataset_split(dataset, split)
    folders = image_folders(dataset_settings(dataset))
    return [ImageSource(cell.get("path") or f"{dataset}[{split}]#{index}", cell, folders)
            for index, cell in enumerate(table[image_column])]


DEFAULT_TOP_K = 5  # a single-label model's labels listed per image when --top-k is not given


def label_scores(config, logits):
    """Each output's score as predict gives it: as pipeline() does for a classifier (a softmax, or a sigmoid per label
    for a multi-label model), a regression's values in the targets' own units."""
    from vit_finetune import tasks

    return tasks.of_config(config).scores(logits)


def labels_given(config, scores: list[float], top_k: int | None = None) -> list[tuple[str, float]]:
    """What a model gives one image, best first (the task's labels_given): a single-label model its top_k labels
    (DEFAULT_TOP_K when None); a multi-label model each label whose score reaches its saved threshold (at most top_k
    when given); a regression model each target's value. predict, explain and the page all show these."""
    from vit_finetune import tasks

    labels = [config.id2label[i] for i in range(config.num_labels)]
    return tasks.of_config(config).labels_given(scores, labels, top_k)


def predict_rows(model, processor, sources: list[ImageSource], top_k: int | None, batch_size: int,
                 show_progress: bool = True) -> Iterator[dict]:
    """One row per image, in order: the labels the model gives it with their scores (labels_given), or the reason
    it could not be read. Images are decoded as the model's training decoded them (data.decoding_settings)."""
    import torch

    from vit_finetune.data import BadImageError, decode_image, decoding_settings
    settings = decoding_settings(model.config)
    device = model.device  # a transformers model's, or an onnx_classifier.OnnxClassifier's
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
    from vit_finetune import tasks

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
# No --output, on a terminal: images listed there at most; past them, the whole listing goes to a file (listing_file)
# and the terminal shows these first rows and where the rest are. Piped, every row goes to stdout as ever.
TERMINAL_ROWS = 20
LISTING_STEM = "predictions"


def listing_file(folder: Path) -> Path | None:
    """The file a listing too long for the terminal is written to: predictions.csv in `folder`, or the first of
    predictions-2.csv, predictions-3.csv, ... that does not exist (a file is never replaced); None if `folder`
    cannot be written."""
    if not os.access(folder, os.W_OK):
        return None
    names = (f"{LISTING_STEM}.csv" if n == 1 else f"{LISTING_STEM}-{n}.csv" for n in itertools.count(1))
    return next(folder / name for name in names if not os.path.lexists(folder / name))


def listing_first(rows: Iterator[dict], shown: int, stream=None) -> Iterator[dict]:
    """`rows` passed on, the first `shown` of them also listed as write_text lists them."""
    for index, row in enumerate(rows):
        if index < shown:
            write_text([row], stream)
        yield row


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
        from vit_finetune.data.labels import LabelFileError, label_file_of  # data/ loads torch: only for a --dataset

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


# CSV files as a spreadsheet opens them: a cell that begins with `=`, `+`, `-`, `@`, a tab or a carriage return is
# read as a formula by Excel, LibreOffice and Google Sheets (OWASP's "CSV injection"), so a label or file name such as
# `=HYPERLINK("http://…"&A1,"click")` would run when the file is opened. Every CSV this toolkit writes goes through
# `csv_writer`, which writes such a cell with a leading single quote: shown as the text it is, never evaluated. A
# plain number (`-5.99903`, `+2`, `-1e-05`) runs nothing and stays as written, so a negative prediction reads back as
# a number.
FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")
# A decimal number with an optional sign and exponent, and nothing else: what every spreadsheet reads as a number.
PLAIN_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")


def inert_cell(value: object) -> object:
    """`value`, or its text behind a single quote when a spreadsheet would take it for a formula."""
    if isinstance(value, str) and value.startswith(FORMULA_STARTS) and not PLAIN_NUMBER.fullmatch(value):
        return f"'{value}"
    return value


class InertWriter:
    """csv.writer whose rows are written with every cell made inert (`inert_cell`)."""

    def __init__(self, file: IO[str]):
        self.writer = csv.writer(file)

    def writerow(self, row: Iterable[object]) -> None:
        self.writer.writerow([inert_cell(cell) for cell in row])


def csv_writer(file: IO[str]) -> InertWriter:
    return InertWriter(file)
