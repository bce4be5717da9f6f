"""Evaluation: run the model over the eval split on every process and compute metrics with `evaluate`.

`evaluate.load("accuracy")` fetches its script from the Hub, so the metrics are `evaluate.Metric`
classes defined here: the same API and result format, and they work offline.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import datasets
import evaluate
import numpy as np
import torch
from accelerate.utils import gather_object

from vit_finetune.core.processes import any_process
from vit_finetune.data import DataError, SKIPPED_LABEL

TOP_K = 5
# Up to this many labels metrics.json holds the whole confusion matrix (and confusion_matrix.png is drawn); beyond,
# only its non-zero cells (confusion_matrix_cells): 5,000 labels would write 25 million numbers, 150 MB of JSON.
DENSE_CONFUSION_LABELS = 100


def as_test_key(key: str) -> str:
    """An eval metric's name in metrics.json's "test" section (data.test_split): eval_loss is test_loss
    there, as the Trainer's predict() names a test split's; a name without the prefix (accuracy) is kept."""
    return "test_" + key.removeprefix("eval_") if key.startswith("eval_") else key


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
    """F1 per class averaged with equal weight over the classes present in the evaluated references.

    A class with no image in the split has no F1 to measure; counting it as 0 would make a split that lacks a
    class look worse for a reason that has nothing to do with the model. Images predicted as such a class still
    cost their own class's recall. `macro_f1_classes` says how many classes the average covers.
    """

    def _info(self):
        return _info("Macro-averaged F1 over the classes present in the references.", datasets.Value("int64"))

    def _compute(self, predictions, references, num_classes: int):
        true_positive, predicted, actual = class_counts(np.asarray(predictions), np.asarray(references), num_classes)
        present = actual > 0
        f1 = 2 * true_positive[present] / (predicted[present] + actual[present])
        return {"macro_f1": float(f1.mean()) if present.any() else 0.0, "macro_f1_classes": int(present.sum())}


def confusion_matrix(predictions: np.ndarray, references: np.ndarray, num_classes: int) -> np.ndarray:
    """Rows are true classes, columns predicted classes."""
    matrix = np.zeros((num_classes, num_classes), dtype=np.int64)
    np.add.at(matrix, (references, predictions), 1)
    return matrix


def class_counts(predictions: np.ndarray, references: np.ndarray, num_classes: int) -> tuple[np.ndarray, ...]:
    """Per class: (images right, images predicted as it, images of it), as floats; no num_classes² matrix."""
    hits = np.bincount(references[predictions == references], minlength=num_classes).astype(float)
    return (hits, np.bincount(predictions, minlength=num_classes).astype(float),
            np.bincount(references, minlength=num_classes).astype(float))


def confusion_cells(predictions: np.ndarray, references: np.ndarray) -> list[list[int]]:
    """The confusion matrix's non-zero cells as [true, predicted, count], in row order."""
    pairs, counts = np.unique(np.stack([references, predictions], axis=1), axis=0, return_counts=True)
    return [[int(true), int(guess), int(count)] for (true, guess), count in zip(pairs, counts)]


def as_eval_entry(metrics: dict) -> dict:
    """The float metrics named as history.json and train.keep_best name them (accuracy -> eval_accuracy)."""
    return {k if k.startswith("eval_") else f"eval_{k}": v for k, v in metrics.items() if isinstance(v, float)}


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
    if num_classes <= DENSE_CONFUSION_LABELS:
        metrics["confusion_matrix"] = confusion_matrix(predictions, references, num_classes).tolist()
    else:
        metrics["confusion_matrix_cells"] = confusion_cells(predictions, references)
    return metrics


# train.eval_every_steps=auto. An evaluation forwards each eval image once; a training step forwards, backwards and
# updates, about three times a forward's work per image (EVAL_IMAGE_COST). Evaluations during training are spaced by
# whole epochs so that they cost at most EVAL_SHARE of the training; the final evaluation is not counted (it always
# runs). On a few hundred images that leaves only the final one: most of a short run's extra time went to them.
EVAL_IMAGE_COST = 1 / 3
EVAL_SHARE = 0.1


def auto_eval_every_steps(eval_images: int | None, images_per_epoch: int, steps_per_epoch: int, total_steps: int,
                          selecting: str | None) -> tuple[int | None, str]:
    """(train.eval_every_steps that auto stands for: a number of steps, or None for every epoch; why).
    `selecting`: the setting that chooses weights among the evaluations (they must then come every epoch)."""
    if selecting:
        return None, f"{selecting} chooses among the evaluations, so every epoch has one"
    if eval_images is None:
        return None, "a stream's eval size is not known before it is read: every epoch"
    cost = eval_images * EVAL_IMAGE_COST / EVAL_SHARE  # training images between two evaluations
    epochs = max(1, math.ceil(cost / max(1, images_per_epoch)))
    share = f"an evaluation of {eval_images:,} images costs about {eval_images * EVAL_IMAGE_COST / max(1, images_per_epoch):.0%} of an epoch"
    if epochs == 1:
        return None, f"every epoch: {share}"
    every = epochs * steps_per_epoch
    if every >= total_steps:
        return every, f"only at the end: {share}, and evaluating every {epochs} epochs keeps them under {EVAL_SHARE:.0%} of the training"
    return every, f"every {epochs} epochs ({every} steps): {share}; so they stay under {EVAL_SHARE:.0%} of the training"


def eval_split_fields(eval_split: str | None) -> dict:
    """metrics.json's record of what was evaluated: a named split of the dataset, or a part held out from train."""
    return {"eval_split": eval_split or "held out from train", "eval_carved_from_train": eval_split is None}


def describe_eval_split(eval_split: str | None, size: int, settings) -> str:
    """The console line saying what the eval accuracy will be measured on."""
    if eval_split is not None:
        return f"eval split: {eval_split!r} ({size} images)"
    why = f"the dataset has no {settings.eval_split!r} split" if settings.eval_split else "data.eval_split is null"
    return (f"eval split: {settings.eval_fraction:.0%} of {settings.train_split!r} held out for evaluation ({size} images, "
            f"stratified, seeded by train.seed) because {why}")


@dataclass
class SplitPredictions:
    """Per-image results over a split, in the split's order; skipped bad images keep their place."""
    ranked: torch.Tensor  # (N, k) class ids, best first ((N, 0) for regression)
    references: torch.Tensor  # (N,) class ids; multi-label (N, C) 0/1 rows (skipped: -1); regression (N, T) values (NaN)
    losses: torch.Tensor  # (N,) the loss per image (the task's)
    scores: torch.Tensor | None = None  # multi-label: (N, C) sigmoid scores; regression: (N, T) predicted values

    @property
    def kept(self) -> torch.Tensor:
        first = self.references.reshape(len(self.references), -1)[:, 0]
        return ~first.isnan() if first.is_floating_point() else first != SKIPPED_LABEL

    def kept_for_metrics(self) -> torch.Tensor:
        """`kept`, refused when no image is left to measure."""
        kept = self.kept
        if not kept.any():
            raise DataError("the eval split is empty (every image was skipped or the split has no rows)")
        return kept


@torch.no_grad()
def predict_stream(model, loader, accelerator, normalize: Callable, task, num_classes: int) -> SplitPredictions:
    """predict_split for a stream (data.streaming.StreamLoader): each process predicts its own share (shares differ in
    length: no padding), then the shares are gathered once, rank after rank, so each image counts exactly once."""
    was_training = model.training
    model.eval()
    k = min(TOP_K, num_classes)
    blank = {"pixel_values": loader.dataset.placeholder[None].to(accelerator.device),
             "labels": torch.tensor([loader.dataset.target(SKIPPED_LABEL)], device=accelerator.device)}
    batches = []
    for batch in in_lockstep(loader.whole_split(), accelerator):
        predicted = batch_predictions(model, blank if batch is None else batch, accelerator, normalize, task, k)
        if batch is not None:
            batches.append(tuple(part.cpu() for part in predicted))
    model.train(was_training)
    mine = task.predictions_of(batches, k)
    # Each share gathered as batch_outputs' parts: what the split keeps of each image's output (ranked ids, or every
    # output's score), its reference, its loss.
    shares = gather_object([(task.kept_outputs(mine), mine.references, mine.losses)])
    return task.predictions_of(shares, k)


def in_lockstep(batches: Iterable[dict], accelerator) -> Iterator[dict | None]:
    """This process's batches, then None until every process has run out: a forward of a DDP or sharded (FSDP)
    model is a collective, so all processes forward the same number of times; a None is a blank forward."""
    remaining = iter(batches)
    while True:
        batch = next(remaining, None)
        if not any_process(accelerator, batch is not None):
            return
        yield batch


@torch.no_grad()
def predict_split(model, loader, accelerator, normalize: Callable, task, outputs: int) -> SplitPredictions:
    """Run the model over the whole split on every process; gather_for_metrics drops the samples padded onto the
    last batch, so each image counts once and the order is the split's. `task`: a tasks.Task; `outputs`: the
    model's num_labels."""
    was_training = model.training
    model.eval()
    k = min(TOP_K, outputs)
    gathered = [accelerator.gather_for_metrics(batch_predictions(model, batch, accelerator, normalize, task, k))
                for batch in loader]
    model.train(was_training)
    return task.predictions_of(gathered, k)


def batch_predictions(model, batch: dict, accelerator, normalize: Callable, task, k: int) -> tuple[torch.Tensor, ...]:
    """What the task keeps of one batch's outputs (task.batch_outputs), on the device."""
    with accelerator.autocast():
        logits = model(pixel_values=normalize(batch["pixel_values"])).logits.float()
    return task.batch_outputs(logits, batch["labels"], k)


def summarise(predictions: SplitPredictions, num_classes: int) -> dict:
    """The reported metrics; the places of images skipped as bad are left out and counted."""
    kept = predictions.kept_for_metrics()
    metrics = compute_metrics(predictions.ranked[kept].numpy(), predictions.references[kept].numpy(), num_classes)
    metrics["eval_loss"] = float(predictions.losses[kept].double().mean())
    metrics["eval_skipped_images"] = int((~kept).sum())
    return metrics


SPARSE_AXES = (f"more than {DENSE_CONFUSION_LABELS} labels: confusion_matrix_cells holds the non-zero cells as "
               "[true label, predicted label, images], both as positions in confusion_matrix_labels")


def label_report(matrix: list[list[int]], labels: list[str]) -> dict:
    """metrics.json's labelled view of the confusion matrix and each class's precision, recall and F1."""
    counts = np.asarray(matrix, dtype=float)
    return {**per_class_report(np.diag(counts), counts.sum(axis=0), counts.sum(axis=1), labels),
            "confusion_matrix_labels": list(labels),
            "confusion_matrix_axes": "rows: true label, columns: predicted label (both in confusion_matrix_labels order)"}


def per_class_report(hits: np.ndarray, predicted: np.ndarray, actual: np.ndarray, labels: list[str]) -> dict:
    """Each class's precision, recall, F1 and support from its counts, and the classes macro F1 leaves out."""
    precision = np.divide(hits, predicted, out=np.zeros_like(hits), where=predicted > 0)
    recall = np.divide(hits, actual, out=np.zeros_like(hits), where=actual > 0)
    f1 = np.divide(2 * precision * recall, precision + recall, out=np.zeros_like(hits), where=precision + recall > 0)
    return {
        # the classes macro_f1 leaves out: no image of theirs was evaluated (their rows of the matrix are empty)
        "macro_f1_absent_classes": [label for label, n in zip(labels, actual) if n == 0],
        "per_class": {label: {"precision": float(p), "recall": float(r), "f1": float(f), "support": int(n)}
                      for label, p, r, f, n in zip(labels, precision, recall, f1, actual)},
    }
