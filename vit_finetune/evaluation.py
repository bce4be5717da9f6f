"""Evaluation: run the model over the eval split on every process and compute metrics with `evaluate`.

`evaluate.load("accuracy")` fetches its script from the Hub, so the metrics are `evaluate.Metric`
classes defined here: the same API and result format, and they work offline.
"""

from __future__ import annotations

from typing import Callable

import datasets
import evaluate
import numpy as np
import torch

from .data import SKIPPED_LABEL, DataError

TOP_K = 5


def _info(description: str, prediction_feature) -> evaluate.MetricInfo:
    return evaluate.MetricInfo(
        description=description,
        citation="",
        inputs_description="predictions: predicted class ids (top-k lists for top-k accuracy); references: true ids",
        features=datasets.Features({"predictions": prediction_feature, "references": datasets.Value("int64")}),
    )


class Accuracy(evaluate.Metric):
    def _info(self):
        return _info("Share of samples whose top prediction is the true class.", datasets.Value("int64"))

    def _compute(self, predictions, references):
        return {"accuracy": float(np.mean(np.asarray(predictions) == np.asarray(references)))}


class TopKAccuracy(evaluate.Metric):
    def _info(self):
        return _info("Share of samples whose true class is among the k highest scores.",
                     datasets.Sequence(datasets.Value("int64")))

    def _compute(self, predictions, references):
        hits = [reference in ranked for ranked, reference in zip(predictions, references)]
        return {f"top{len(predictions[0])}_accuracy": float(np.mean(hits))}


class MacroF1(evaluate.Metric):
    """F1 per class averaged with equal weight; a class never predicted nor present counts as 0."""

    def _info(self):
        return _info("Macro-averaged F1 over all classes.", datasets.Value("int64"))

    def _compute(self, predictions, references, num_classes: int):
        matrix = confusion_matrix(np.asarray(predictions), np.asarray(references), num_classes)
        true_positive = np.diag(matrix).astype(float)
        predicted, actual = matrix.sum(axis=0), matrix.sum(axis=1)
        denominator = predicted + actual
        f1 = np.divide(2 * true_positive, denominator, out=np.zeros_like(true_positive), where=denominator > 0)
        return {"macro_f1": float(f1.mean())}


def confusion_matrix(predictions: np.ndarray, references: np.ndarray, num_classes: int) -> np.ndarray:
    """Rows are true classes, columns predicted classes."""
    matrix = np.zeros((num_classes, num_classes), dtype=np.int64)
    np.add.at(matrix, (references, predictions), 1)
    return matrix


def as_eval_entry(metrics: dict) -> dict:
    """The float metrics named as history.json and train.keep_best name them (accuracy -> eval_accuracy)."""
    return {k if k.startswith("eval_") else f"eval_{k}": v for k, v in metrics.items() if isinstance(v, float)}


def per_class_recall(matrix: list[list[int]], labels: list[str]) -> dict[str, float | None]:
    """Share of each class's images predicted as that class, by label name (None: no image of it was evaluated)."""
    matrix = np.asarray(matrix)
    actual = matrix.sum(axis=1)
    return {label: float(matrix[i, i] / actual[i]) if actual[i] else None for i, label in enumerate(labels)}


def compute_metrics(top_predictions: np.ndarray, references: np.ndarray, num_classes: int) -> dict:
    """All reported metrics from (N, k) ranked predictions and (N,) labels."""
    predictions = top_predictions[:, 0]
    metrics = {"eval_samples": int(len(references))}
    metrics.update(Accuracy(keep_in_memory=True).compute(predictions=predictions, references=references))
    if num_classes >= TOP_K:
        metrics.update(TopKAccuracy(keep_in_memory=True).compute(
            predictions=top_predictions[:, :TOP_K].tolist(), references=references))
    metrics.update(MacroF1(keep_in_memory=True).compute(
        predictions=predictions, references=references, num_classes=num_classes))
    metrics["confusion_matrix"] = confusion_matrix(predictions, references, num_classes).tolist()
    return metrics


@torch.no_grad()
def evaluate_model(model, loader, accelerator, normalize: Callable, num_classes: int) -> dict:
    """Metrics over the whole eval split; gather_for_metrics drops the samples padded onto the last batch, and the
    places of images skipped as bad (label SKIPPED_LABEL) are left out afterwards and counted."""
    was_training = model.training
    model.eval()
    ranked, references, losses = [], [], []
    k = min(TOP_K, num_classes)
    for batch in loader:
        with accelerator.autocast():
            logits = model(pixel_values=normalize(batch["pixel_values"])).logits.float()
        sample_losses = torch.nn.functional.cross_entropy(logits, batch["labels"], reduction="none",
                                                          ignore_index=SKIPPED_LABEL)
        top, labels, sample_losses = accelerator.gather_for_metrics(
            (logits.topk(k, dim=-1).indices, batch["labels"], sample_losses))
        ranked.append(top.cpu())
        references.append(labels.cpu())
        losses.append(sample_losses.cpu())
    model.train(was_training)
    references_all = torch.cat(references) if references else torch.empty(0, dtype=torch.long)
    kept = references_all != SKIPPED_LABEL
    if not kept.any():
        raise DataError("the eval split is empty (every image was skipped or the split has no rows)")
    metrics = compute_metrics(torch.cat(ranked)[kept].numpy(), references_all[kept].numpy(), num_classes)
    metrics["eval_loss"] = float(torch.cat(losses)[kept].double().mean())
    metrics["eval_skipped_images"] = int((~kept).sum())
    return metrics
