"""Metrics are computed offline with evaluate.Metric classes and match hand-computed values."""

from __future__ import annotations

import numpy as np
import pytest

from vit_finetune.evaluation import Accuracy, MacroF1, compute_metrics, confusion_matrix, label_report


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
