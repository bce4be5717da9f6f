"""data.test_split: a split scored once after training, by the weights the run keeps, as `evaluate OUTPUT_DIR
--dataset D --split S` scores the saved model; read by none of the run's choices; refused up front where it would not
be held out (the training split, the eval split, the split a dataset without the eval split evaluates on) or does not
exist."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import pytest
import yaml

from runs import RECIPE, assert_bit_identical, train
from test_output_dir import error_line
from test_regression import write_targets
from tiny import make_tiny_vit, write_colour_folder, write_label_sets

pytestmark = pytest.mark.slow  # short runs of the tiny ViT

CLASSES, TRAIN, VALIDATION, TEST = 3, 8, 3, 4  # per class


@pytest.fixture(scope="module")
def three_splits(tmp_path_factory) -> Path:
    return write_colour_folder(tmp_path_factory.mktemp("three-splits"), classes=CLASSES, train=TRAIN,
                               validation=VALIDATION, test=TEST, seed=3)


def metrics_of(output: Path) -> dict:
    return json.loads((output / "metrics.json").read_text())


def test_the_test_split_is_scored_by_the_saved_weights_as_evaluate_scores_it_and_changes_nothing_else(
        base, three_splits, tmp_path, capsys):
    from vit_finetune.serving.evaluate_saved import evaluate_saved

    scored, plain = tmp_path / "scored", tmp_path / "plain"
    common = [f"model.base={base}", f"data.dataset={three_splits}", *RECIPE]
    assert train([*common, f"output_dir={scored}", "data.test_split=test"]) == 0
    said = "".join(capsys.readouterr())
    assert train([*common, f"output_dir={plain}"]) == 0
    metrics, without = metrics_of(scored), metrics_of(plain)
    test = metrics.pop("test")

    # Read by no choice of the run: the same weights and the same eval figures as the run without a test split.
    assert_bit_identical(scored / "model.safetensors", plain / "model.safetensors")
    for key in ("accuracy", "eval_loss", "eval_samples", "confusion_matrix", "eval_split"):
        assert metrics[key] == without[key], key
    assert "test" not in without

    # The whole test split, scored as `evaluate --dataset D --split test` scores the saved model.
    assert test["split"] == "test" and test["test_samples"] == CLASSES * TEST != metrics["eval_samples"]
    assert sum(map(sum, test["confusion_matrix"])) == CLASSES * TEST
    evaluated = evaluate_saved(str(scored), dataset=str(three_splits), split="test")
    assert evaluated["eval_samples"] == test["test_samples"]
    assert (test["accuracy"], test["confusion_matrix"]) == (evaluated["accuracy"], evaluated["confusion_matrix"])
    assert test["test_loss"] == pytest.approx(evaluated["eval_loss"], abs=1e-6)
    assert f"test split 'test': accuracy {test['accuracy']:.4f}" in said and f"on {CLASSES * TEST} images" in said

    card = (scored / "README.md").read_text()
    assert f"| Accuracy | {metrics['accuracy']:.4f} | {test['accuracy']:.4f} |" in card
    assert f"test: split `test`, {CLASSES * TEST} images" in card
    results = yaml.safe_load(card.split("---")[1])["model-index"][0]["results"]
    by_split = {result["dataset"]["split"]: {m["type"]: m["value"] for m in result["metrics"]} for result in results}
    assert by_split == {"validation": {"accuracy": round(metrics["accuracy"], 6), "macro_f1": round(metrics["macro_f1"], 6)},
                        "test": {"accuracy": round(test["accuracy"], 6), "macro_f1": round(test["macro_f1"], 6)}}


def with_splits(label_file: Path, target: Path, split_of_row) -> Path:
    """A copy of a label file's folder whose rows are put in the splits `split_of_row(index, row)` says; returns the
    copy's label file."""
    shutil.copytree(label_file.parent, target)
    metadata = target / label_file.name
    with open(metadata, newline="") as file:
        rows = list(csv.DictReader(file))
    for index, row in enumerate(rows):
        row["split"] = split_of_row(index, row)
    with open(metadata, "w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return metadata


def test_a_multi_label_test_split_is_scored_at_the_thresholds_chosen_on_the_eval_split(tmp_path):
    from vit_finetune.serving.evaluate_saved import evaluate_saved

    source = write_label_sets(tmp_path / "source", images=48, split_column=True)
    dataset = with_splits(source, tmp_path / "labels", lambda i, row: "test" if i % 4 == 1 else row["split"])
    out = tmp_path / "out"
    assert train([*RECIPE, f"model.base={make_tiny_vit(tmp_path / 'base')}", f"data.dataset={dataset}",
                  f"output_dir={out}", "data.test_split=test"]) == 0
    metrics = metrics_of(out)
    test = metrics["test"]
    assert test["test_samples"] == 12 and test["thresholds"] == metrics["thresholds"]  # not chosen again on it
    evaluated = evaluate_saved(str(out), dataset=str(dataset), split="test")
    for key in ("map", "micro_f1", "macro_f1", "accuracy"):
        assert test[key] == pytest.approx(evaluated[key], abs=1e-9), key


def test_a_regression_test_split_gets_its_errors_under_test_names(tmp_path):
    from vit_finetune.serving.evaluate_saved import evaluate_saved

    dataset = with_splits(write_targets(tmp_path / "source") / "metadata.csv", tmp_path / "targets",
                          lambda i, row: "test" if i % 4 == 1 else row["split"])
    out = tmp_path / "out"
    assert train([*RECIPE, f"model.base={make_tiny_vit(tmp_path / 'base')}", f"data.dataset={dataset}",
                  "data.task=regression", "data.target_columns=[brightness,redness]", f"output_dir={out}",
                  "data.test_split=test"]) == 0
    test = metrics_of(out)["test"]
    evaluated = evaluate_saved(str(out), dataset=str(dataset), split="test")
    assert test["test_samples"] == evaluated["eval_samples"] == 8
    assert test["mae"] == pytest.approx(evaluated["mae"], abs=1e-6)
    assert test["per_target"].keys() == {"brightness", "redness"} and "test_loss" in test


@pytest.mark.parametrize("split, refusal", [
    ("train", "data.test_split='train' is also data.train_split; a test split must be one the run neither trains on "
              "nor chooses by"),
    ("validation", "data.test_split='validation' is also data.eval_split"),
])
def test_a_test_split_the_run_trains_on_or_chooses_by_is_refused_by_the_recipe(split, refusal):
    from vit_finetune.recipe import Recipe

    with pytest.raises(ValueError, match=refusal):
        Recipe(data={"dataset": "somewhere", "test_split": split})


def test_a_test_split_is_refused_with_a_stream():
    from vit_finetune.recipe import Recipe

    with pytest.raises(ValueError, match=r"data\.test_split='test' is scored from a split read whole.*"
                                         r"python -m vit_finetune evaluate OUTPUT_DIR --dataset D --split S"):
        Recipe(data={"dataset": "somewhere", "streaming": True, "test_split": "test"})


def test_a_missing_test_split_is_refused_before_training_naming_the_splits(base, three_splits, tmp_path, capsys):
    out = tmp_path / "out"
    assert train([f"model.base={base}", f"data.dataset={three_splits}", *RECIPE, f"output_dir={out}",
                  "data.test_split=tset"]) == 1
    assert error_line(capsys.readouterr().err) == (
        "error: data.test_split='tset' is not a split of the dataset; its splits are ['train', 'validation', 'test']. "
        "Name one of them, or remove data.test_split")
    assert not (out / "metrics.json").exists() and not (out / "model.safetensors").exists()


def test_the_test_split_a_dataset_without_the_eval_split_evaluates_on_is_refused(base, tmp_path, capsys):
    """A dataset of train/ and test/ only evaluates on test (data.eval_split=validation is missing): scoring test as
    well would report a split the run chose by as if it were held out."""
    dataset = write_colour_folder(tmp_path / "train-and-test", classes=CLASSES, train=TRAIN, validation=VALIDATION)
    (dataset / "validation").rename(dataset / "test")
    out = tmp_path / "out"
    common = [f"model.base={base}", f"data.dataset={dataset}", *RECIPE, f"output_dir={out}"]
    assert train([*common, "data.test_split=test"]) == 1
    assert "data.test_split='test' is the split this run evaluates on: the dataset has no " \
           "data.eval_split='validation', so the run chooses by 'test'. Set data.eval_split=null" \
           in error_line(capsys.readouterr().err)
    assert not (out / "metrics.json").exists()
    # The fix the message names: an eval part held out from train, and test scored once at the end.
    assert train([*common, "data.test_split=test", "data.eval_split=null"]) == 0
    metrics = metrics_of(out)
    assert metrics["eval_carved_from_train"] is True and metrics["test"]["test_samples"] == CLASSES * VALIDATION
