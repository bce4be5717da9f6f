"""Using a trained model: evaluate on any split (reproducing metrics.json on the run's own), batch predict to
CSV/JSONL from files, folders, globs and dataset splits, and fast, clear failures for missing models."""

from __future__ import annotations

import csv
import io
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tiny import COLOURS, colour_image, run_cli, write_colour_folder
from vit_finetune.artifacts.final_outputs import TRAINING_ONLY_METRICS
from vit_finetune.cli import main


@pytest.fixture(scope="module")
def trained(args, tmp_path_factory) -> Path:
    from runs import train

    output = tmp_path_factory.mktemp("use") / "run"
    assert train([*args, f"output_dir={output}"]) == 0
    return output


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> Path:
    """Two readable images in a folder, one in a sub-folder, and a file that is not an image."""
    folder = tmp_path_factory.mktemp("photos")
    rng = np.random.default_rng(3)
    colour_image(COLOURS["red"], rng).save(folder / "red.png")
    (folder / "more").mkdir()
    colour_image(COLOURS["blue"], rng).save(folder / "more" / "blue.jpg")
    (folder / "broken.png").write_bytes(b"not an image")
    return folder


def test_evaluate_reproduces_the_runs_metrics_exactly(trained, tmp_path):
    assert main(["evaluate", str(trained), "--output-dir", str(tmp_path / "eval")]) == 0
    saved = json.loads((trained / "metrics.json").read_text())
    again = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert {k: v for k, v in saved.items() if k not in TRAINING_ONLY_METRICS} == again  # equality, eval_loss included
    for picture in ("confusion_matrix.png", "misclassified.png"):
        assert (tmp_path / "eval" / picture).read_bytes()[:4] == b"\x89PNG"


def test_evaluate_any_split_matches_labels_by_name(trained, tmp_path, capsys):
    """A dataset holding two of the model's three classes, under a split name of its own: ids follow the model."""
    subset = tmp_path / "subset"
    write_colour_folder(subset / "unused", classes=3, train=1, validation=1)
    for name in ("green", "red"):  # imagefolder numbers these 0, 1; the model calls them 1, 2
        shutil.copytree(subset / "unused" / "validation" / name, subset / "holdout" / name)
    shutil.rmtree(subset / "unused")
    assert main(["evaluate", str(trained), "--dataset", str(subset), "--split", "train"]) == 0  # one folder = train
    shown = json.loads(capsys.readouterr().out)
    assert shown["eval_samples"] == 2 and shown["eval_split"] == "train"
    metrics = json.loads((trained / "metrics.json").read_text())
    assert metrics["accuracy"] == 1.0 and shown["accuracy"] == 1.0  # a wrong id mapping would score 0


def test_evaluate_refuses_labels_the_model_does_not_know(trained, tmp_path, capsys):
    other = write_colour_folder(tmp_path / "other", classes=5, train=1, validation=1)
    assert main(["evaluate", str(trained), "--dataset", str(other), "--split", "validation"]) == 1
    error = capsys.readouterr().err
    assert "['cyan', 'purple', 'yellow']" in error or "['purple', 'yellow']" in error
    assert "not labels of the model" in error


def read_csv(path: Path) -> list[dict]:
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def test_predict_folders_and_globs_to_csv_and_jsonl_skipping_a_bad_file(trained, photos, tmp_path, images):
    glob = str(images / "validation" / "*" / "0.png")
    assert main(["predict", str(trained), str(photos), glob, "--output", str(tmp_path / "p.csv"),
                 "--batch-size", "2", "--top-k", "2", "--device", "cpu"]) == 0
    rows = read_csv(tmp_path / "p.csv")
    names = [Path(row["image"]).relative_to(photos).as_posix() if row["image"].startswith(str(photos))
             else Path(row["image"]).parent.name for row in rows]
    assert names == ["broken.png", "more/blue.jpg", "red.png", "blue", "green", "red"]
    assert rows[0]["error"].startswith("bad image") and rows[0]["label_1"] == ""
    assert all(row["error"] == "" for row in rows[1:])
    assert [row["label_1"] for row in rows[3:]] == ["blue", "green", "red"]  # the model is 100 % on these
    assert list(rows[1]) == ["image", "error", "label_1", "score_1", "label_2", "score_2"]
    assert all(float(row["score_1"]) >= float(row["score_2"]) for row in rows[1:])

    assert main(["predict", str(trained), str(photos), glob, "--output", str(tmp_path / "p.jsonl"),
                 "--batch-size", "5"]) == 0
    records = [json.loads(line) for line in (tmp_path / "p.jsonl").read_text().splitlines()]
    assert [r["image"] for r in records] == [row["image"] for row in rows]
    for record, row in zip(records[1:], rows[1:]):  # another batch size, the same scores
        assert record["predictions"][0]["label"] == row["label_1"]
        assert record["predictions"][0]["score"] == pytest.approx(float(row["score_1"]), abs=1e-5)


def test_predicted_scores_are_the_models_softmax(trained, photos):
    from transformers import AutoImageProcessor, AutoModelForImageClassification
    from PIL import Image

    from vit_finetune.serving import prediction
    from vit_finetune.model.saved_model import load_classifier

    model, processor = load_classifier(str(trained))
    rows = list(prediction.predict_rows(model, processor, prediction.collect_images([str(photos / "red.png")]), 3, 4))
    reference = AutoModelForImageClassification.from_pretrained(trained).eval()
    pixels = AutoImageProcessor.from_pretrained(trained)(images=Image.open(photos / "red.png").convert("RGB"),
                                                         return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        expected = reference(pixel_values=pixels).logits.softmax(-1)[0]
    for guess in rows[0]["predictions"]:
        assert guess["score"] == pytest.approx(float(expected[reference.config.label2id[guess["label"]]]), abs=1e-6)


def test_predict_a_dataset_split(trained, images, tmp_path):
    assert main(["predict", str(trained), "--dataset", str(images), "--split", "validation",
                 "--output", str(tmp_path / "v.jsonl")]) == 0
    records = [json.loads(line) for line in (tmp_path / "v.jsonl").read_text().splitlines()]
    assert len(records) == 9 and all(r["error"] is None for r in records)
    assert sum(Path(r["image"]).parent.name == r["predictions"][0]["label"] for r in records) == 9


def test_predict_and_evaluate_read_the_same_split_by_default(trained, images, tmp_path, capsys):
    """With --dataset and no --split, both commands read the validation split (3 images of each of 3 classes)."""
    assert main(["predict", str(trained), "--dataset", str(images), "--output", str(tmp_path / "d.jsonl")]) == 0
    predicted = [json.loads(line)["image"] for line in (tmp_path / "d.jsonl").read_text().splitlines()]
    assert len(predicted) == 9 and all(Path(image).parts[-3] == "validation" for image in predicted)
    capsys.readouterr()
    assert main(["evaluate", str(trained), "--dataset", str(images)]) == 0
    evaluated = json.loads(capsys.readouterr().out)
    assert evaluated["eval_split"] == "validation" and evaluated["eval_samples"] == len(predicted)


def test_with_no_split_a_dataset_is_read_by_the_split_it_has(trained, tmp_path, capsys):
    """A plain class folder has one split (train): evaluate and predict read it. Of several, validation, else test;
    else the splits are named, with the option."""
    flat = write_colour_folder(tmp_path / "flat", classes=3, train=1, splits=False)
    assert main(["evaluate", str(trained), "--dataset", str(flat)]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["eval_split"] == "train" and shown["eval_samples"] == 3
    assert main(["predict", str(trained), "--dataset", str(flat), "--output", str(tmp_path / "flat.jsonl")]) == 0
    assert len((tmp_path / "flat.jsonl").read_text().splitlines()) == 3
    capsys.readouterr()
    two = write_colour_folder(tmp_path / "two", classes=3, train=1, validation=1)
    (two / "validation").rename(two / "test")
    assert main(["evaluate", str(trained), "--dataset", str(two)]) == 0
    assert json.loads(capsys.readouterr().out)["eval_split"] == "test"
    listed = [f"{path.relative_to(flat)},{path.parent.name},{split}"
              for path, split in zip(sorted(flat.rglob("*.png")), ("train", "holdout", "spare"))]
    (flat / "labels.csv").write_text("\n".join(["file_name,label,split", *listed]) + "\n")
    assert main(["evaluate", str(trained), "--dataset", str(flat / "labels.csv")]) == 1
    error = capsys.readouterr().err
    assert "has the splits ['train', 'holdout', 'spare'] and none is validation or test" in error, error
    assert "--split spare" in error


class Terminal(io.StringIO):
    """stdout as a terminal is (none exists under pytest): predict asks isatty() to know it writes to one."""

    def isatty(self) -> bool:
        return True


def test_predict_lists_a_long_run_on_a_terminal_in_a_few_rows_and_writes_the_whole_listing_to_a_file(
        trained, tmp_path, monkeypatch, capsys):
    many = write_colour_folder(tmp_path / "many", classes=3, train=8, splits=False)  # 24 images
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    captured = sys.stdout
    for name in ("predictions.csv", "predictions-2.csv"):
        terminal = Terminal()
        monkeypatch.setattr(sys, "stdout", terminal)
        assert main(["predict", str(trained), str(many)]) == 0
        monkeypatch.setattr(sys, "stdout", captured)
        printed = terminal.getvalue().splitlines()
        assert len([line for line in printed if line.endswith(".png")]) == 20 and len(printed) < 120
        assert printed[-1] == (f"24 images -> {work / name} (the first 20 listed above; --output FILE.csv or "
                               "FILE.jsonl names the file)"), printed[-1]
        assert len(read_csv(work / name)) == 24
    assert (work / "predictions.csv").read_text() == (work / "predictions-2.csv").read_text()  # never replaced
    capsys.readouterr()
    assert main(["predict", str(trained), str(many)]) == 0  # piped: every row on stdout, as ever, no file
    assert len([line for line in capsys.readouterr().out.splitlines() if line.endswith(".png")]) == 24
    assert sorted(path.name for path in work.iterdir()) == ["predictions-2.csv", "predictions.csv"]


@pytest.mark.parametrize("model", ["outputs/nonexist", "./nonexist", "/no/such/run"])
def test_a_missing_model_folder_fails_at_once(model, photos):
    start = time.perf_counter()
    result = run_cli("predict", model, str(photos))
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.startswith(f"error: folder not found: {model}")
    assert time.perf_counter() - start < 5  # no minute of Hub retries


def test_a_wrong_output_format_is_refused_before_work(trained, photos, tmp_path, capsys):
    assert main(["predict", str(trained), str(photos), "--output", str(tmp_path / "p.xlsx")]) == 1
    assert "'.xlsx'" in capsys.readouterr().err and not (tmp_path / "p.xlsx").exists()


@pytest.mark.slow
def test_predict_with_a_hub_model_id(trained, photos, hub, hub_token, hub_repo_id, tmp_path, monkeypatch, capsys):
    from vit_finetune.artifacts.publish import push_folder

    monkeypatch.setenv("HF_TOKEN", hub_token)
    push_folder(trained, hub_repo_id)
    assert main(["predict", hub_repo_id, str(photos / "red.png"), "--output", str(tmp_path / "h.csv")]) == 0
    assert read_csv(tmp_path / "h.csv")[0]["label_1"] == "red"
    assert main(["predict", "user/not-there", str(photos / "red.png")]) == 1
    assert "folder not found: user/not-there, and the Hub has no model" in capsys.readouterr().err
