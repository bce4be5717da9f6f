"""Label files (CSV, JSON Lines, a folder's metadata file): rows become splits and labels, and every bad row is
reported with its line, all at once, before anything trains."""

from __future__ import annotations

import json
import os
from pathlib import Path

import datasets
import numpy as np
import pytest

from tiny import colour_image, write_label_sets
from vit_finetune import data
from vit_finetune.recipe import DataSettings


def images(folder: Path, count: int) -> list[str]:
    rng = np.random.default_rng(0)
    (folder / "pics").mkdir(parents=True, exist_ok=True)
    for i in range(count):
        colour_image((40 * i % 255, 90, 200), rng).save(folder / "pics" / f"{i}.png")
    return [f"pics/{i}.png" for i in range(count)]


def write_csv(path: Path, header: str, rows: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join([header, *rows]) + "\n")
    return path


def problems_of(path: Path, **settings) -> str:
    with pytest.raises(data.DataError) as refused:
        data.load_splits(DataSettings(dataset=str(path), **settings), seed=0)
    return str(refused.value)


def test_a_csv_of_single_labels_trains_with_its_split_column(tmp_path):
    paths = images(tmp_path, 8)
    rows = [f"{p},{'cat' if i % 2 else 'dog'},{'validation' if i < 4 else 'train'}" for i, p in enumerate(paths)]
    splits = data.load_splits(DataSettings(dataset=str(write_csv(tmp_path / "labels.csv", "file_name,label,split",
                                                                  rows))), seed=0)
    assert splits.labels == ["cat", "dog"] and splits.task == "single_label"
    assert (len(splits.train), len(splits.eval), splits.eval_split) == (4, 4, "validation")
    assert (splits.image_column, splits.label_column) == ("file_name", "label")
    assert isinstance(splits.train.features["label"], datasets.ClassLabel)
    first = splits.eval[0]
    assert Path(first["file_name"]["path"]) == (tmp_path / "pics" / "0.png").resolve() and first["label"] == 1  # dog


def test_a_jsonl_of_label_lists_is_multi_label_and_a_split_is_carved_without_strata(tmp_path):
    path = write_label_sets(tmp_path, images=20, kind="jsonl")
    splits = data.load_splits(DataSettings(dataset=str(path), eval_fraction=0.25), seed=0)
    assert splits.task == "multi_label" and splits.labels == ["blue", "green", "red", "yellow"]
    assert (len(splits.train), len(splits.eval)) == (15, 5)
    written = {json.loads(line)["file_name"]: sorted(json.loads(line)["labels"]) for line in path.read_text().splitlines()}
    row = splits.train[0]
    name = Path(row["file_name"]["path"]).relative_to(tmp_path.resolve()).as_posix()
    assert sorted(splits.labels[i] for i in row["labels"]) == written[name]


def test_a_folder_with_metadata_csv_is_read_as_the_label_file(tmp_path):
    path = write_label_sets(tmp_path / "set", images=12, split_column=True)
    path.rename(path.parent / "metadata.csv")
    splits = data.load_splits(DataSettings(dataset=str(tmp_path / "set")), seed=0)
    assert splits.task == "multi_label" and (len(splits.train), len(splits.eval)) == (8, 4)


def test_multi_label_false_refuses_rows_that_hold_several_labels(tmp_path):
    path = write_label_sets(tmp_path, images=6)
    assert "data.task=single_label" in problems_of(path, multi_label=False)


def test_every_bad_row_is_reported_at_once_with_its_line(tmp_path):
    paths = images(tmp_path / "set", 6)
    (tmp_path / "outside.png").write_bytes((tmp_path / "set" / paths[0]).read_bytes())
    rows = [f"{paths[0]},Cat",         # line 2: fine
            f"{paths[1]},cat ",        # line 3: the same label written another way
            "/etc/passwd,Cat",         # line 4: absolute
            "../outside.png,dog",      # line 5: leaves the folder
            "pics/missing.png,dog",    # line 6: no such file
            f"{paths[2]},",            # line 7: no label, in a single-label file
            f"{paths[0]},dog",         # line 8: listed twice
            f"{paths[3]},dog,extra"]   # line 9: a cell too many
    message = problems_of(write_csv(tmp_path / "set" / "labels.csv", "file_name,label", rows))
    expected = {3: "written 2 ways", 4: "absolute path", 5: "leaves the label file's folder", 6: "not found",
                7: "no label in column 'label'", 8: "already listed on line 2", 9: "3 cells"}
    lines = {int(line.split("line ")[1].split(":")[0]): line for line in message.splitlines() if "- line" in line}
    assert set(lines) == set(expected), message
    for line, words in expected.items():
        assert words in lines[line], (line, lines[line])
    assert "'Cat' (line 2)" in lines[3] and "7 problem(s)" in message and "/etc/passwd" in lines[4]
    assert "data.task=multi_label" in lines[7]  # the way to give an image no label


@pytest.mark.timeout(120)  # a FIFO read would wait for a writer: the test fails instead of hanging
def test_a_loop_of_links_and_a_fifo_in_a_label_file_are_named_on_their_lines(base, tmp_path, capsys):
    from vit_finetune.cli import main

    paths = images(tmp_path / "set", 2)
    (tmp_path / "set" / "pics" / "a.png").symlink_to("b.png")
    (tmp_path / "set" / "pics" / "b.png").symlink_to("a.png")
    os.mkfifo(tmp_path / "set" / "pics" / "camera.png")
    label_file = write_csv(tmp_path / "set" / "labels.csv", "file_name,label",
                           [f"{paths[0]},cat", f"{paths[1]},dog", "pics/a.png,cat", "pics/camera.png,dog"])
    assert main([f"model.base={base}", f"data.dataset={label_file}", f"output_dir={tmp_path / 'out'}"]) == 1
    error = capsys.readouterr().err
    assert "Traceback" not in error and "save_to_disk" not in error  # the fix of a folder dataset: not this one
    assert "line 4: 'pics/a.png' is a loop of symbolic links" in error
    assert "line 5: image file 'pics/camera.png' is not a regular file" in error
    assert not (tmp_path / "out" / "metrics.json").exists()


def test_jsonl_rows_that_are_not_objects_or_lists_with_an_empty_label_name_their_lines(tmp_path):
    paths = images(tmp_path, 4)
    path = tmp_path / "labels.jsonl"
    path.write_text("\n".join([json.dumps({"file_name": paths[0], "labels": ["a", "b"]}),
                               "not json",
                               json.dumps(["a list"]),
                               json.dumps({"file_name": paths[1], "labels": ["a", " "]}),
                               json.dumps({"file_name": paths[2], "labels": None}),
                               json.dumps({"file_name": paths[3], "labels": []})]) + "\n")
    message = problems_of(path)
    for line, words in {2: "not JSON", 3: "a JSON list, not an object", 4: "empty label", 5: "no value"}.items():
        assert f"line {line}: {words}" in message, message
    assert "4 problem(s)" in message and "line 6" not in message  # [] in a multi-label file: none of the labels


def test_a_label_file_without_a_path_column_says_which_to_name(tmp_path):
    paths = images(tmp_path, 4)
    rows = [f"{p},{'ab'[i % 2]}" for i, p in enumerate(paths)]
    message = problems_of(write_csv(tmp_path / "labels.csv", "picture_url,label", rows))
    assert "no image path column" in message and "data.image_column" in message
    splits = data.load_splits(DataSettings(dataset=str(tmp_path / "labels.csv"), image_column="picture_url",
                                           eval_fraction=0.5), seed=0)
    assert (len(splits.train), len(splits.eval)) == (2, 2)


def test_a_folder_holding_both_metadata_files_is_refused(tmp_path):
    write_label_sets(tmp_path, images=3)
    (tmp_path / "labels.csv").rename(tmp_path / "metadata.csv")
    (tmp_path / "metadata.jsonl").write_text("")
    assert "keep one" in problems_of(tmp_path)


# ---------------------------------------------------------------- through the CLI: what a run says and refuses


def run(base: Path, dataset: Path, out: Path, *extra: str) -> int:
    from runs import RECIPE, train

    return train([f"model.base={base}", f"data.dataset={dataset}", *RECIPE, "train.epochs=1", f"output_dir={out}",
                  *extra])


def test_a_header_that_names_a_column_twice_is_refused_before_training(base, tmp_path, capsys):
    paths = images(tmp_path / "data", 6)  # the run writes outside the data
    # DictReader would keep the last 'label' column: the run would train on 'x'/'y', not the first column's labels
    rows = [f"{p},{'ab'[i % 2]},{'xy'[i // 3]},{'validation' if i % 3 == 0 else 'train'}" for i, p in enumerate(paths)]
    path = write_csv(tmp_path / "data" / "labels.csv", "file_name,label,label,split", rows)
    assert run(base, path, tmp_path / "out") == 1
    error = capsys.readouterr().err
    assert "line 1: the header names 2 columns 'label' (columns 2, 3)" in error and "Traceback" not in error
    assert not (tmp_path / "out" / "metrics.json").exists()


def test_one_joined_cell_makes_the_run_multi_label_and_the_run_says_which_and_how_to_keep_one_label(
        base, tmp_path, capsys):
    paths = images(tmp_path / "data", 12)  # the run writes outside the data
    rows = [f"{p},{'cat' if i % 2 else 'dog'},{'validation' if i % 4 == 0 else 'train'}" for i, p in enumerate(paths)]
    rows[5] = f"{paths[5]},cat;dog,train"  # line 7: one cell joined by the separator
    path = write_csv(tmp_path / "data" / "labels.csv", "file_name,label,split", rows)
    assert run(base, path, tmp_path / "multi") == 0
    said = capsys.readouterr().out
    note = next(line for line in said.splitlines() if "is multi-label" in line)
    assert "line 7's cell 'cat;dog'" in note and "1 of 12 rows" in note and "data.label_separator=''" in note
    assert json.loads((tmp_path / "multi" / "metrics.json").read_text())["multi_label"] is True
    # The fix the line names: the cell is one label of its own, the run single-label (3 labels), and says nothing
    assert run(base, path, tmp_path / "single", "data.label_separator=''") == 0
    assert "is multi-label" not in capsys.readouterr().out
    config = json.loads((tmp_path / "single" / "config.json").read_text())
    assert "problem_type" not in config or config["problem_type"] != "multi_label_classification"
    assert sorted(config["label2id"]) == ["cat", "cat;dog", "dog"]


def test_a_label_written_as_a_number_and_as_text_is_refused_naming_both_lines(base, tmp_path, capsys):
    paths = images(tmp_path / "data", 6)  # the run writes outside the data
    path = tmp_path / "data" / "labels.jsonl"
    path.write_text("".join(json.dumps({"file_name": p, "label": [1, "2"][i % 2] if i != 4 else "1"}) + "\n"
                            for i, p in enumerate(paths)))
    assert run(base, path, tmp_path / "out") == 1
    error = capsys.readouterr().err
    assert "line 5: the label '1' is written as a JSON int (line 1) and as text (line 5)" in error, error[-2000:]
    assert not (tmp_path / "out" / "metrics.json").exists()


def test_a_label_with_no_training_image_is_named_on_the_console_and_in_metrics(base, tmp_path, capsys):
    paths = images(tmp_path / "data", 10)  # the run writes outside the data
    rows = [f"{p},{'ab'[i % 2]},{'validation' if i >= 7 else 'train'}" for i, p in enumerate(paths)]
    rows[9] = f"{paths[9]},c,validation"  # 'c' only in the eval split: nothing trains it
    path = write_csv(tmp_path / "data" / "labels.csv", "file_name,label,split", rows)
    assert run(base, path, tmp_path / "out") == 0
    note = next(line for line in capsys.readouterr().out.splitlines() if "no training image" in line)
    assert "1 label(s) have no training image: ['c']" in note
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert metrics["labels_without_train_images"] == ["c"] and metrics["per_class"]["c"]["support"] == 1


def test_an_image_with_no_label_in_a_single_label_file_names_the_key_that_allows_it(base, tmp_path, capsys):
    paths = images(tmp_path / "data", 6)  # the run writes outside the data
    rows = [f"{p},{'ab'[i % 2] if i != 3 else ''}" for i, p in enumerate(paths)]
    path = write_csv(tmp_path / "data" / "labels.csv", "file_name,label", rows)
    assert run(base, path, tmp_path / "out") == 1
    error = capsys.readouterr().err
    assert "line 5: no label in column 'label'" in error and "data.task=multi_label" in error
    assert run(base, path, tmp_path / "out", "data.multi_label=true", "data.eval_fraction=0.5") == 0
    said = capsys.readouterr().out
    assert said.count("data.multi_label=true: read as data.task=multi_label") == 1  # the older key still works
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert metrics["multi_label"] is True
    assert metrics["train_images_without_labels"] + metrics["eval_images_without_labels"] == 1
