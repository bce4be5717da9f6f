"""Metrics are computed offline with evaluate.Metric classes and match hand-computed values."""

from __future__ import annotations

import numpy as np
import pytest

from vit_finetune.tasks.evaluation import Accuracy, MacroF1, compute_metrics, confusion_matrix, label_report


def test_metrics_match_hand_computed_values(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # evaluate.load("accuracy") would need the Hub; ours must not
    references = np.array([0, 0, 1, 1, 2, 2, 3, 4, 5, 5])
    ranked = np.array([[0, 1, 2, 3, 4], [1, 0, 2, 3, 4], [1, 0, 2, 3, 4], [1, 2, 0, 3, 4], [2, 0, 1, 3, 4],
                       [0, 1, 3, 4, 5], [3, 0, 1, 2, 4], [4, 0, 1, 2, 3], [0, 1, 2, 3, 4], [5, 0, 1, 2, 3]])
    metrics = compute_metrics(ranked, references, num_classes=6)
    assert metrics["eval_samples"] == 10
    assert metrics["accuracy"] == pytest.approx(0.7)  # 0,1,1,2,3,4,5 right; 1,0,0 wrong
    assert metrics["top5_accuracy"] == pytest.approx(0.8)  # samples 5 and 8 have their class outside the top 5
    # per-class F1 = 2TP / (predicted + actual): c0 2/5, c1 4/5, c2 2/3, c3 1, c4 1, c5 2/3
    assert metrics["macro_f1"] == pytest.approx(np.mean([0.4, 0.8, 2 / 3, 1, 1, 2 / 3]))
    assert metrics["macro_f1_classes"] == 6
    matrix = np.array(metrics["confusion_matrix"])
    assert matrix.sum() == 10 and matrix[0, 1] == 1 and matrix[2, 0] == 1 and matrix[5, 0] == 1


def test_top5_is_left_out_below_five_classes():
    metrics = compute_metrics(np.array([[0, 1], [1, 0]]), np.array([0, 0]), num_classes=2)
    assert "top5_accuracy" not in metrics and metrics["accuracy"] == 0.5


def test_macro_f1_averages_the_classes_present_and_says_which():
    """Classes 1 and 2 have no image in the split: they are left out of the average, not counted as 0."""
    result = MacroF1(keep_in_memory=True).compute(predictions=[0, 0], references=[0, 0], num_classes=3)
    assert result == {"macro_f1": 1.0, "macro_f1_classes": 1}
    # an image of class 0 predicted as absent class 2 still costs class 0's recall: F1 = 2*1 / (1 + 2)
    result = MacroF1(keep_in_memory=True).compute(predictions=[0, 2], references=[0, 0], num_classes=3)
    assert result == {"macro_f1": pytest.approx(2 / 3), "macro_f1_classes": 1}
    report = label_report(confusion_matrix(np.array([0, 2]), np.array([0, 0]), 3).tolist(), ["a", "b", "c"])
    assert report["macro_f1_absent_classes"] == ["b", "c"]


def test_metric_classes_use_the_evaluate_api():
    assert Accuracy(keep_in_memory=True).compute(predictions=[1, 2, 3], references=[1, 2, 0]) == {
        "accuracy": pytest.approx(2 / 3)}
    assert confusion_matrix(np.array([1, 1]), np.array([0, 1]), 2).tolist() == [[0, 1], [0, 1]]


def test_a_run_with_a_thousand_labels_writes_a_small_metrics_json_that_evaluate_reproduces(base, tmp_path):
    """Its confusion matrix would be a million numbers: metrics.json keeps only the non-zero cells."""
    import json

    import datasets

    from runs import RECIPE, train
    from tiny import colour_image
    from vit_finetune.cli import main
    from vit_finetune.tasks.evaluation import DENSE_CONFUSION_LABELS
    from vit_finetune.artifacts.final_outputs import TRAINING_ONLY_METRICS

    names = [f"class_{i:04d}" for i in range(1000)]
    rng = np.random.default_rng(0)
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=names)})
    files = []
    for i in range(24):
        files.append(str(tmp_path / f"{i}.png"))
        colour_image((10 * i, 90, 200), rng).save(files[-1])
    table = datasets.Dataset.from_dict({"image": files, "label": [i % 16 for i in range(24)]}, features=features)
    datasets.DatasetDict({"train": table.select(range(16)), "validation": table.select(range(16, 24))}).save_to_disk(
        tmp_path / "saved")
    out = tmp_path / "out"
    assert train([f"model.base={base}", f"data.dataset={tmp_path / 'saved'}", *RECIPE, "train.epochs=1",
                  f"output_dir={out}"]) == 0
    assert (out / "metrics.json").stat().st_size < 300_000  # a dense matrix alone: over 2 MB
    metrics = json.loads((out / "metrics.json").read_text())
    assert len(names) > DENSE_CONFUSION_LABELS and "confusion_matrix" not in metrics
    cells = metrics["confusion_matrix_cells"]
    assert sum(count for _true, _guess, count in cells) == metrics["eval_samples"] == 8
    assert sorted(true for true, _guess, count in cells for _ in range(count)) == list(range(8))
    right = sum(count for true, guess, count in cells if true == guess)
    assert metrics["accuracy"] == pytest.approx(right / 8) and len(metrics["per_class"]) == 1000
    assert len(metrics["labels_without_train_images"]) == 1000 - 16
    assert main(["evaluate", str(out), "--output-dir", str(tmp_path / "again")]) == 0
    again = json.loads((tmp_path / "again" / "metrics.json").read_text())
    assert {k: v for k, v in metrics.items() if k not in TRAINING_ONLY_METRICS} == again
