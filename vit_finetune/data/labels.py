"""Label files: a CSV or JSON Lines file naming each image's relative path and its label or labels.

`data.dataset` may be such a file, or a folder holding `metadata.csv` / `metadata.jsonl` (the names datasets'
imagefolder reads). Every row is checked before anything trains, and all problems are reported at once, each with
its line: a column named twice in the header, a path that is absolute or leaves the file's folder, a file that is
missing or listed twice, an empty label, a label written two ways ("Cat" and "cat ", or the JSON number 1 and the
text "1"). A cell holding a list (a JSON list, or labels joined by data.label_separator) makes the dataset
multi-label, and the run says which cell did; in a multi-label file an empty cell or `[]` is an image with none of
the labels (a negative for every one). A `split` column sorts the rows into splits.
"""

from __future__ import annotations

import csv
import json
import math
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from vit_finetune.core.errors import excerpt
from vit_finetune.recipe import DataSettings

METADATA_NAMES = ("metadata.csv", "metadata.jsonl")
# A label file's or a dataset's label column, when data.label_column does not name it (cls: WebDataset).
LABEL_COLUMN_NAMES = ("label", "labels", "fine_label", "class", "category", "target", "cls")
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
        # DictReader keeps the last of two columns with one name, silently: the first one's cells would be lost.
        yield from repeated_columns(reader.fieldnames or [])
        line = reader.line_num + 1
        for cells in reader:
            if None in cells:  # more cells than the header has names
                yield f"line {line}: {len(cells) - 1 + len(cells[None])} cells, the header names {len(cells) - 1}"
            else:
                yield Row(line, cells)
            line = reader.line_num + 1


def repeated_columns(header: list[str]) -> Iterator[str]:
    """A problem for each name the header gives to more than one column."""
    for name in dict.fromkeys(header):
        positions = [str(position) for position, given in enumerate(header, start=1) if given == name]
        if len(positions) > 1:
            yield (f"line 1: the header names {len(positions)} columns {name!r} (columns {', '.join(positions)}); only "
                   "the last one's cells would be read. Name each column once")


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
    """Problems found in a label file; data/opening.py reports them as a DataError."""


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


def cell_labels(cell: Any, separator: str) -> list | Any:
    """A label cell as a list of labels (a JSON list, or text joined by `separator`), or the cell itself (one label,
    or None). Items keep their JSON type, so that the number 1 and the text "1" can be told apart."""
    if not isinstance(cell, str):
        return cell
    if cell.lstrip().startswith("["):
        try:
            parsed = json.loads(cell)
        except json.JSONDecodeError:
            parsed = None
        if isinstance(parsed, list):
            return parsed
    if separator and separator in cell:
        return cell.split(separator)
    return cell


def written_as(value: Any) -> str:
    """How a label was written, for the check that one label is written one way: text, or a JSON number."""
    return "text" if isinstance(value, str) else f"a JSON {type(value).__name__}"


def is_blank(value: Any) -> bool:
    return value is None or (isinstance(value, str) and not value.strip())


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


# data.task's word on label sets: multi_label, a set per image; single_label, one label; auto: the data says.
LABEL_SETS_OF_TASK = {"multi_label": True, "single_label": False}


def label_sets_chosen(settings: DataSettings) -> bool | None:
    """Whether data.task says each image holds a set of labels (True) or one (False); None: auto, the data says."""
    return LABEL_SETS_OF_TASK.get(settings.task)


@dataclass
class LabelTable:
    """A checked label file: each row's image file, its labels, its split; whether it is multi-label, and why."""
    paths: list[str]
    labels: list[list[str]]
    splits: list[str]
    names: list[str]  # every label, sorted
    multi_label: bool
    path_column: str = "image"  # the file's own column names, which data.image_column / label_column name
    label_column: str = "label"
    first_label_set: tuple[int, Any] | None = None  # (line, cell) of the first cell holding a list of labels
    rows_with_label_sets: int = 0
    rows_without_labels: int = 0


def read_rows(path: Path) -> tuple[list, list[str], list[str]]:
    """A label file's rows, the problems its reader found (each with its line), and its columns in first-seen order."""
    rows, problems = [], []
    for item in READERS[path.suffix.lower()](path):
        (problems if isinstance(item, str) else rows).append(item)
    if not rows and not problems:
        raise LabelFileError(f"{path} holds no rows")
    return rows, problems, list(dict.fromkeys(name for row in rows for name in row.cells))


def listed_image(row, path_column: str, folder: Path, first_line_of_path: dict[Path, int],
                 problems: list[str]) -> Path | None:
    """The row's checked image path (None with a problem added when it is not one); an image listed twice is a
    problem naming the first line."""
    where = f"line {row.line}"
    image = check_path(row.cells.get(path_column), folder, path_column, where, problems)
    if image is not None:
        if image in first_line_of_path:
            problems.append(f"{where}: {excerpt(str(row.cells[path_column]))} is already listed on line "
                            f"{first_line_of_path[image]}; list each image once")
        first_line_of_path.setdefault(image, row.line)
    return image


def refuse_problems(path: Path, problems: list[str]) -> None:
    """Every problem of the file at once, sorted by line, the first SHOWN_PROBLEMS of them shown."""
    if problems:
        problems.sort(key=lambda problem: int(problem.split(":")[0].removeprefix("line ")))
        shown = problems[:SHOWN_PROBLEMS]
        more = f"\n  ... and {len(problems) - len(shown)} more" if len(problems) > len(shown) else ""
        raise LabelFileError(f"{path} has {len(problems)} problem(s); nothing was trained:\n"
                             + "\n".join(f"  - {problem}" for problem in shown) + more)


def read_label_file(path: Path, settings: DataSettings) -> LabelTable:
    """Read and check every row; LabelFileError lists all problems, each with its line."""
    folder = path.parent.resolve()
    rows, problems, columns = read_rows(path)
    path_column = choose_column(columns, settings.image_column, PATH_COLUMNS, "image path", "data.image_column")
    label_column = choose_column(columns, settings.label_column, LABEL_COLUMN_NAMES, "label", "data.label_column")
    table = LabelTable([], [], [], [], False, path_column, label_column)
    first_line_of_path: dict[Path, int] = {}
    spellings: dict[str, dict[str, int]] = defaultdict(dict)  # comparable form -> spelling -> its first line
    kinds: dict[str, dict[str, int]] = defaultdict(dict)  # label -> how it was written (text, a number) -> first line
    unlabelled_lines = []
    for row in rows:
        where = f"line {row.line}"
        image = listed_image(row, path_column, folder, first_line_of_path, problems)
        cell = row.cells.get(label_column)
        found = cell_labels(cell, settings.label_separator)
        if isinstance(found, list) and found:
            table.multi_label = True
            table.rows_with_label_sets += 1
            table.first_label_set = table.first_label_set or (row.line, cell)
        items = found if isinstance(found, list) else [found]
        if cell is None:
            problems.append(f"{where}: no value in column {label_column!r} (missing, or null); for an image with none "
                            "of the labels write an empty cell (CSV) or [] (JSON Lines) in a multi-label file")
            items = []
        elif found == [] or (not isinstance(found, list) and is_blank(found)):
            unlabelled_lines.append(row.line)  # an empty set: allowed only if the run is multi-label (below)
            items = []
        elif any(is_blank(item) for item in items):
            problems.append(f"{where}: empty label in column {label_column!r} (got {excerpt(cell)})")
            items = []
        values = [str(item) for item in items]
        for item, value in zip(items, values):
            spellings[" ".join(value.split()).casefold()].setdefault(value, row.line)
            kinds[value].setdefault(written_as(item), row.line)
        table.paths.append(str(image) if image is not None else "")
        table.labels.append(list(dict.fromkeys(values)))
        table.splits.append(str(row.cells.get(SPLIT_COLUMN) or settings.train_split))
    for ways in spellings.values():
        if len(ways) > 1:
            written = ", ".join(f"{value!r} (line {line})" for value, line in ways.items())
            problems.append(f"line {sorted(ways.values())[1]}: one label written {len(ways)} ways: {written}; "
                            "write each label one way (case and spaces count)")
    for value, ways in kinds.items():
        if len(ways) > 1:
            written = " and ".join(f"as {kind} (line {line})" for kind, line in ways.items())
            problems.append(f"line {sorted(ways.values())[1]}: the label {value!r} is written {written}, which would "
                            "be read as one label; write it one way throughout (as text or as a number)")
    problems += label_set_problems(table, settings, unlabelled_lines, label_column)
    refuse_problems(path, problems)
    chosen = label_sets_chosen(settings)
    table.multi_label = table.multi_label if chosen is None else chosen
    table.rows_without_labels = len(unlabelled_lines)
    table.names = sorted({value for values in table.labels for value in values})
    fraction = fractional_labels(table) if settings.task == "auto" else None
    if fraction is not None:
        raise LabelFileError(f"{path}: every label in column {label_column!r} is a number, and {fraction!r} has a "
                             "fraction; data.task=auto does not guess whether these are classes or values. Set "
                             "data.task=regression to learn the numbers as values, or data.task=single_label to read "
                             "each distinct number as a class")
    return table


def number_in(cell: Any) -> float | None:
    """A cell's number (a JSON number, or text such as "0.25" or "1e-3"); None when it holds none."""
    if isinstance(cell, bool) or cell is None:
        return None
    if isinstance(cell, (int, float)):
        return float(cell)
    try:
        return float(str(cell).strip())
    except ValueError:
        return None


def fractional_labels(table: LabelTable) -> str | None:
    """A label written as a number with a fraction ("0.333"), when every label is a number: data.task=auto does not
    guess whether such a column is classes or values (None when the labels are not all numbers, or all whole)."""
    numbers = [number_in(name) for name in table.names]
    if not numbers or any(number is None for number in numbers):
        return None
    return next((name for name, number in zip(table.names, numbers) if not float(number).is_integer()), None)


def load_target_file(path: Path, settings: DataSettings):
    """A regression's label file as a DatasetDict: the image path column and one float column per target
    (data.target_columns, else the label column). Every cell must be a finite number; all problems are reported at
    once, each with its line."""
    import datasets

    folder = path.parent.resolve()
    rows, problems, columns = read_rows(path)
    path_column = choose_column(columns, settings.image_column, PATH_COLUMNS, "image path", "data.image_column")
    names = settings.target_columns or [choose_column(columns, settings.label_column, LABEL_COLUMN_NAMES, "target",
                                                      "data.label_column")]
    missing = [name for name in names if name not in columns]
    if missing:
        raise LabelFileError(f"data.target_columns names {missing}, not columns of the label file; its columns are "
                             f"{columns}")
    by_split: dict[str, dict[str, list]] = defaultdict(lambda: {path_column: [], **{name: [] for name in names}})
    first_line_of_path: dict[Path, int] = {}
    for row in rows:
        where = f"line {row.line}"
        image = listed_image(row, path_column, folder, first_line_of_path, problems)
        values = []
        for name in names:
            cell = row.cells.get(name)
            number = number_in(cell)
            if number is None:
                problems.append(f"{where}: {excerpt(cell)} in column {name!r} is not a number; data.task=regression "
                                "needs a number in every target cell")
            elif not math.isfinite(number):
                problems.append(f"{where}: {excerpt(cell)} in column {name!r} is not finite; give a finite number "
                                "(NaN and infinity cannot be learned), or remove the row")
            values.append(number)
        split = by_split[str(row.cells.get(SPLIT_COLUMN) or settings.train_split)]
        split[path_column].append(str(image) if image is not None else "")
        for name, value in zip(names, values):
            split[name].append(value)
    refuse_problems(path, problems)
    features = datasets.Features({path_column: datasets.Image(), **{name: datasets.Value("float64") for name in names}})
    return datasets.DatasetDict({split: datasets.Dataset.from_dict(columns, features=features)
                                 for split, columns in by_split.items()})


def label_set_problems(table: LabelTable, settings: DataSettings, unlabelled_lines: list[int],
                       label_column: str) -> list[str]:
    """Rows that only a multi-label run can take: several labels, or none (an empty set), in a run that is not."""
    chosen = label_sets_chosen(settings)
    if table.multi_label if chosen is None else chosen:
        return []
    problems = [f"line {line}: no label in column {label_column!r}; an image with none of the labels needs "
                "data.task=multi_label (a set of labels per image, which may be empty), or remove the row"
                for line in unlabelled_lines]
    if table.first_label_set is not None:
        line, cell = table.first_label_set
        problems.append(f"line {line}: {excerpt(cell)} holds several labels ({table.rows_with_label_sets} row(s) do) "
                        "but data.task=single_label; set data.task=multi_label (or auto), or give each image one label")
    return problems


def multi_label_note(table: LabelTable, path: Path, settings: DataSettings) -> str | None:
    """The console's word on a label file detected as multi-label: which cell made it so, and how to keep one label
    per image (None when the recipe chose with data.task, or the file is single-label)."""
    if label_sets_chosen(settings) is not None or table.first_label_set is None:
        return None
    line, cell = table.first_label_set
    joined = isinstance(cell, str) and not cell.lstrip().startswith("[")
    how = (f"labels joined by data.label_separator={settings.label_separator!r}" if joined else "a JSON list of labels")
    keep = ((f"data.label_separator='' reads such a cell as one label, or " if joined else "")
            + "data.task=single_label refuses those rows, naming their lines")
    return (f"{path.name} is multi-label (a set of labels per image: a sigmoid score and a threshold per label) because "
            f"line {line}'s cell {excerpt(cell)} holds {how}; {table.rows_with_label_sets} of {len(table.paths)} rows "
            f"hold several labels. To keep one label per image: {keep}")


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


def load_label_file(path: Path, settings: DataSettings, notes: list[str] | None = None):
    """A DatasetDict (the file's path and label columns) from a checked label file: one split per `split` value, else
    data.train_split. Labels are a ClassLabel, or a list of ClassLabel for a multi-label file (rows holding lists, or
    data.task=multi_label), where a row may hold none. What the run should say of the file is added to `notes`."""
    import datasets

    table = read_label_file(path, settings)
    note = multi_label_note(table, path, settings)
    if note and notes is not None:
        notes.append(note)
    classes = datasets.ClassLabel(names=table.names)
    multi = table.multi_label
    label_feature = datasets.List(classes) if multi else classes
    image_column, label_column = table.path_column, table.label_column
    features = datasets.Features({image_column: datasets.Image(), label_column: label_feature})
    by_split: dict[str, dict[str, list]] = defaultdict(lambda: {image_column: [], label_column: []})
    for image, labels, split in zip(table.paths, table.labels, table.splits):
        by_split[split][image_column].append(image)
        by_split[split][label_column].append(labels if multi else labels[0])
    return datasets.DatasetDict({split: datasets.Dataset.from_dict(columns, features=features)
                                 for split, columns in by_split.items()})
