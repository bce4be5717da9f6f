"""Label files: a CSV or JSON Lines file naming each image's relative path and its label or labels.

`data.dataset` may be such a file, or a folder holding `metadata.csv` / `metadata.jsonl` (the names datasets'
imagefolder reads). Every row is checked before anything trains, and all problems are reported at once, each with
its line: a path that is absolute or leaves the file's folder, a file that is missing or listed twice, an empty
label, a label written two ways ("Cat" and "cat "). A cell holding a list (a JSON list, or labels joined by
data.label_separator) makes the dataset multi-label. A `split` column sorts the rows into splits.
"""

from __future__ import annotations

import csv
import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from .recipe import DataSettings, excerpt

METADATA_NAMES = ("metadata.csv", "metadata.jsonl")
PATH_COLUMNS = ("file_name", "image", "path", "file", "filename")  # file_name: datasets' imagefolder's name
SPLIT_COLUMN = "split"
SHOWN_PROBLEMS = 30  # a file with thousands of bad rows is reported by its first ones and a count


@dataclass
class Row:
    line: int  # where the row starts in the file, counting from 1 (a CSV's header is line 1)
    cells: dict[str, Any]


def read_csv(path: Path) -> Iterator[Row | str]:
    """The rows of a CSV file with a header; a problem (str) for a row that cannot be read."""
    with open(path, newline="", encoding="utf-8-sig") as file:
        reader = csv.DictReader(file)
        reader.fieldnames  # reads the header now, so line_num counts it
        line = reader.line_num + 1
        for cells in reader:
            if None in cells:  # more cells than the header has names
                yield f"line {line}: {len(cells) - 1 + len(cells[None])} cells, the header names {len(cells) - 1}"
            else:
                yield Row(line, cells)
            line = reader.line_num + 1


def read_jsonl(path: Path) -> Iterator[Row | str]:
    """The rows of a JSON Lines file (one object per line, blank lines skipped)."""
    with open(path, encoding="utf-8") as file:
        for line, text in enumerate(file, start=1):
            if not text.strip():
                continue
            try:
                cells = json.loads(text)
            except json.JSONDecodeError as error:
                yield f"line {line}: not JSON ({error.msg} at column {error.colno})"
                continue
            if isinstance(cells, dict):
                yield Row(line, cells)
            else:
                yield f"line {line}: a JSON {type(cells).__name__}, not an object with named fields"


READERS: dict[str, Callable[[Path], Iterator[Row | str]]] = {".csv": read_csv, ".jsonl": read_jsonl}


class LabelFileError(ValueError):
    """Problems found in a label file; data.py reports them as a DataError."""


def label_file_of(source: Path) -> Path | None:
    """The label file `data.dataset` names: the file itself, or a folder's metadata.csv / metadata.jsonl."""
    if source.is_file() and source.suffix.lower() in READERS:
        return source
    if source.is_dir() and not any((source / name).exists() for name in ("dataset_dict.json", "state.json")):
        found = [source / name for name in METADATA_NAMES if (source / name).is_file()]
        if len(found) > 1:
            raise LabelFileError(f"{source} holds both {METADATA_NAMES[0]} and {METADATA_NAMES[1]}; keep one")
        return found[0] if found else None
    return None


def cell_labels(cell: Any, separator: str) -> list[str] | str | None:
    """A label cell as a list of labels (a JSON list, or text joined by `separator`), a single label, or None."""
    if isinstance(cell, list):
        return [str(item) for item in cell]
    if cell is None:
        return None
    text = str(cell)
    if text.lstrip().startswith("["):
        try:
            parsed = json.loads(text)
        except json.JSONDecodeError:
            parsed = None
        if isinstance(parsed, list):
            return [str(item) for item in parsed]
    if separator and separator in text:
        return text.split(separator)
    return text


def choose_column(columns: list[str], wanted: str | None, names: tuple[str, ...], kind: str, key: str) -> str:
    if wanted is not None:
        if wanted not in columns:
            raise LabelFileError(f"{key}={wanted!r} is not a column of the label file; its columns are {columns}")
        return wanted
    found = [name for name in names if name in columns]
    if not found:
        raise LabelFileError(f"no {kind} column among the label file's columns {columns}; name one "
                             f"{' or '.join(names[:3])}, or set {key}=<column>")
    return found[0]


@dataclass
class LabelTable:
    """A checked label file: each row's image file, its labels, its split; whether any row holds a list."""
    paths: list[str]
    labels: list[list[str]]
    splits: list[str]
    names: list[str]  # every label, sorted
    multi_label: bool
    path_column: str = "image"  # the file's own column names, which data.image_column / label_column name
    label_column: str = "label"


def read_label_file(path: Path, settings: DataSettings) -> LabelTable:
    """Read and check every row; LabelFileError lists all problems, each with its line."""
    from .data import LABEL_COLUMN_NAMES

    folder = path.parent.resolve()
    rows, problems = [], []
    for item in READERS[path.suffix.lower()](path):
        (problems if isinstance(item, str) else rows).append(item)
    if not rows and not problems:
        raise LabelFileError(f"{path} holds no rows")
    columns = list(dict.fromkeys(name for row in rows for name in row.cells))
    path_column = choose_column(columns, settings.image_column, PATH_COLUMNS, "image path", "data.image_column")
    label_column = choose_column(columns, settings.label_column, LABEL_COLUMN_NAMES, "label", "data.label_column")
    table = LabelTable([], [], [], [], False, path_column, label_column)
    first_line_of_path: dict[Path, int] = {}
    spellings: dict[str, dict[str, int]] = defaultdict(dict)  # comparable form -> spelling -> its first line
    for row in rows:
        where = f"line {row.line}"
        image = check_path(row.cells.get(path_column), folder, path_column, where, problems)
        if image is not None:
            if image in first_line_of_path:
                problems.append(f"{where}: {excerpt(str(row.cells[path_column]))} is already listed on line "
                                f"{first_line_of_path[image]}; list each image once")
            first_line_of_path.setdefault(image, row.line)
        found = cell_labels(row.cells.get(label_column), settings.label_separator)
        table.multi_label |= isinstance(found, list)
        values = found if isinstance(found, list) else [found]
        if found is None or found == [] or any(value is None or not value.strip() for value in values):
            problems.append(f"{where}: empty label in column {label_column!r} (got {excerpt(row.cells.get(label_column))})")
            values = []
        for value in values:
            spellings[" ".join(value.split()).casefold()].setdefault(value, row.line)
        table.paths.append(str(image) if image is not None else "")
        table.labels.append(list(dict.fromkeys(values)))
        table.splits.append(str(row.cells.get(SPLIT_COLUMN) or settings.train_split))
    for ways in spellings.values():
        if len(ways) > 1:
            written = ", ".join(f"{value!r} (line {line})" for value, line in ways.items())
            problems.append(f"line {sorted(ways.values())[1]}: one label written {len(ways)} ways: {written}; "
                            "write each label one way (case and spaces count)")
    if problems:
        problems.sort(key=lambda problem: int(problem.split(":")[0].removeprefix("line ")))
        shown = problems[:SHOWN_PROBLEMS]
        more = f"\n  ... and {len(problems) - len(shown)} more" if len(problems) > len(shown) else ""
        raise LabelFileError(f"{path} has {len(problems)} problem(s); nothing was trained:\n"
                             + "\n".join(f"  - {problem}" for problem in shown) + more)
    table.names = sorted({value for values in table.labels for value in values})
    return table


def check_path(cell: Any, folder: Path, column: str, where: str, problems: list[str]) -> Path | None:
    """The image file a path cell names, inside `folder`; None, with the problem noted, otherwise."""
    if cell is None or not str(cell).strip():
        problems.append(f"{where}: no image path in column {column!r}")
        return None
    given = str(cell)
    if Path(given).is_absolute() or given.startswith("~"):
        problems.append(f"{where}: {excerpt(given)} is an absolute path; give it relative to the label file's "
                        f"folder {str(folder)!r}")
        return None
    try:
        resolved = (folder / given).resolve()
    except RuntimeError:  # Python 3.11: "Symlink loop"
        problems.append(f"{where}: {excerpt(given)} is a loop of symbolic links in {str(folder)!r}; point it at an "
                        "image file")
        return None
    if not resolved.is_relative_to(folder):
        problems.append(f"{where}: {excerpt(given)} leaves the label file's folder {str(folder)!r}; images must "
                        "lie in it or below it")
        return None
    if not resolved.is_file():
        found = "is not a regular file (a FIFO, socket or device, which reading would hang on)" if resolved.exists() \
            else "not found"
        problems.append(f"{where}: image file {excerpt(given)} {found} in {str(folder)!r}")
        return None
    return resolved


def load_label_file(path: Path, settings: DataSettings):
    """A DatasetDict (the file's path and label columns) from a checked label file: one split per `split` value, else data.train_split.
    Labels are a ClassLabel, or a list of ClassLabel when rows hold lists (or data.multi_label=true)."""
    import datasets

    table = read_label_file(path, settings)
    classes = datasets.ClassLabel(names=table.names)
    multi = table.multi_label if settings.multi_label is None else settings.multi_label
    if not multi and table.multi_label:
        raise LabelFileError(f"{path}: some rows hold several labels but data.multi_label=false; set it to "
                             "true (or null), or give each image one label")
    label_feature = datasets.List(classes) if multi else classes
    image_column, label_column = table.path_column, table.label_column
    features = datasets.Features({image_column: datasets.Image(), label_column: label_feature})
    by_split: dict[str, dict[str, list]] = defaultdict(lambda: {image_column: [], label_column: []})
    for image, labels, split in zip(table.paths, table.labels, table.splits):
        by_split[split][image_column].append(image)
        by_split[split][label_column].append(labels if multi else labels[0])
    return datasets.DatasetDict({split: datasets.Dataset.from_dict(columns, features=features)
                                 for split, columns in by_split.items()})
