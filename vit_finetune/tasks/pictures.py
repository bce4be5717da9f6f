"""Pictures a person looks at before the numbers, and the one way every picture is drawn: position-embedding
similarity, the training curves, the confusion matrix and the eval images the model got wrong, a multi-label run's
precision-recall curves, a regression's predicted against true values, and the panels explain and the page show. Each
function computes its array (tested) and draws it (looked at).

matplotlib is imported when a figure is drawn, not with this module: a run with pictures=false never loads it.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from vit_finetune.core.layout import CONFUSION_FILE, MISCLASSIFIED_FILE, replace_atomically
from vit_finetune.data import BadImageError
from vit_finetune.tasks.evaluation import DENSE_CONFUSION_LABELS, confusion_matrix

MAX_MAPS_PER_SIDE = 16  # a 24x24 grid would draw 576 maps; every other patch still shows the structure
MAX_MISCLASSIFIED = 24


def pyplot():
    """matplotlib.pyplot on the Agg backend: training machines have no display."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(figure, path: Path, **options) -> None:
    """`figure` drawn into `path` through a temporary file renamed over it, then closed: a kill or a full disk
    midway leaves a picture already there (a user's, or an earlier evaluation's) as it was, never half of one."""
    try:
        replace_atomically(Path(path), lambda partial: figure.savefig(partial, **options))
    finally:
        pyplot().close(figure)


def patch_grid(table: torch.Tensor) -> torch.Tensor:
    """(1, prefix + g*g, D) position table -> (g, g, D), the prefix rows (CLS, distillation) left aside."""
    rows = table.reshape(-1, table.shape[-1]).float()
    for prefix in (0, 1, 2):
        side = math.isqrt(rows.shape[0] - prefix)
        if side * side == rows.shape[0] - prefix:
            return rows[prefix:].reshape(side, side, -1)
    raise ValueError(f"a position table of {rows.shape[0]} rows is not a square grid after 0-2 prefix rows")


def similarity_maps(grid: torch.Tensor) -> np.ndarray:
    """(g, g, D) -> (g, g, g, g): [i, j] is the cosine similarity of patch (i, j)'s embedding to every patch."""
    side = grid.shape[0]
    unit = torch.nn.functional.normalize(grid.reshape(side * side, -1), dim=-1)
    return (unit @ unit.T).reshape(side, side, side, side).numpy()


def mosaic(maps: np.ndarray, max_per_side: int = MAX_MAPS_PER_SIDE) -> np.ndarray:
    """The (g, g, g, g) maps as one image: map (i, j) at row i, column j, a NaN gap (drawn blank) between maps."""
    side = maps.shape[0]
    chosen = np.unique(np.linspace(0, side - 1, min(side, max_per_side)).round().astype(int))
    cell = side + 1
    image = np.full((len(chosen) * cell, len(chosen) * cell), np.nan)
    for row, i in enumerate(chosen):
        for column, j in enumerate(chosen):
            image[row * cell:row * cell + side, column * cell:column * cell + side] = maps[i, j]
    return image


def draw_position_similarity(before: torch.Tensor | None, after: torch.Tensor, path: Path) -> None:
    """Base and resampled position embeddings side by side (only the resampled ones for a model from scratch)."""
    plt = pyplot()
    panels = [("base", before), ("resampled", after)] if before is not None else [("position embeddings", after)]
    figure, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 5.4), squeeze=False)
    for axis, (name, table) in zip(axes[0], panels):
        grid = patch_grid(table)
        shown = axis.imshow(mosaic(similarity_maps(grid)), cmap="viridis", vmin=-1, vmax=1, interpolation="nearest")
        axis.set_title(f"{name}: {grid.shape[0]}x{grid.shape[1]} patch grid")
        axis.set_axis_off()
    figure.colorbar(shown, ax=axes[0].tolist(), shrink=0.8, label="cosine similarity")
    figure.suptitle("Each small map: one patch's position embedding compared with every patch's")
    save_figure(figure, path, dpi=80, bbox_inches="tight")


def normalised_by_true_class(matrix: list[list[int]]) -> np.ndarray:
    """Each row (a true class) divided by its count: the diagonal is that class's recall."""
    counts = np.asarray(matrix, dtype=float)
    totals = counts.sum(axis=1, keepdims=True)
    return np.divide(counts, totals, out=np.zeros_like(counts), where=totals > 0)


def draw_confusion_matrix(matrix: list[list[int]], labels: list[str], path: Path) -> None:
    plt = pyplot()
    shares = normalised_by_true_class(matrix)
    size = min(18.0, 2.5 + 0.35 * len(labels))
    figure, axis = plt.subplots(figsize=(size + 1.2, size))
    shown = axis.imshow(shares, cmap="Blues", vmin=0, vmax=1)
    ticks = range(len(labels))
    font = max(4, min(10, 200 // max(1, len(labels))))
    axis.set_xticks(ticks, labels, rotation=90, fontsize=font)
    axis.set_yticks(ticks, labels, fontsize=font)
    axis.set(xlabel="predicted label", ylabel="true label", title="Confusion matrix (each row sums to 1)")
    if len(labels) <= 20:  # numbers stay legible
        for (i, j), share in np.ndenumerate(shares):
            if share > 0:
                axis.text(j, i, f"{share:.2f}", ha="center", va="center", fontsize=font,
                          color="white" if share > 0.5 else "black")
    figure.colorbar(shown, ax=axis, shrink=0.8)
    figure.tight_layout()
    save_figure(figure, path, dpi=90)


def misclassified_positions(predicted: np.ndarray, references: np.ndarray, limit: int = MAX_MISCLASSIFIED) -> list[int]:
    """Positions of up to `limit` wrong predictions spread evenly over the split (which is often sorted by class),
    so the grid shows many classes; skipped images (label -1) are not mistakes."""
    wrong = np.flatnonzero((predicted != references) & (references >= 0))
    if len(wrong) <= limit:
        return wrong.tolist()
    return wrong[np.linspace(0, len(wrong) - 1, limit).round().astype(int)].tolist()


def draw_misclassified(images: list, truths: list[str], guesses: list[str], path: Path) -> None:
    """A grid of eval images, each titled with its true and predicted label."""
    plt = pyplot()
    columns = min(6, max(1, len(images)))
    rows = max(1, math.ceil(len(images) / columns))
    height = 2.4 * rows + 0.4
    figure, axes = plt.subplots(rows, columns, figsize=(2.1 * columns, height), squeeze=False)
    # fixed margins and captions as plain text: tight_layout and axis titles measured every one of the 24 panels,
    # most of the picture's cost
    figure.subplots_adjust(left=0.02, right=0.98, bottom=0.02, top=1 - 0.8 / height, wspace=0.1, hspace=0.4)
    for axis in axes.flat:
        axis.set_axis_off()
    for axis, image, truth, guess in zip(axes.flat, images, truths, guesses):
        axis.imshow(image)
        axis.text(0.5, 1.03, f"true: {truth}\npredicted: {guess}", transform=axis.transAxes, ha="center",
                  va="bottom", fontsize=8, color="darkred")
    if not images:
        axes[0][0].text(0.5, 0.5, "no misclassified eval image", ha="center", va="center")
    figure.suptitle("Misclassified eval images", y=1 - 0.1 / height, va="top")
    save_figure(figure, path, dpi=80)


def draw_classification(predictions, dataset, labels: list[str], folder: Path) -> list[str]:
    """confusion_matrix.png and misclassified.png for one single-label split's predictions
    (evaluation.SplitPredictions) over `dataset` (a data.ImageClassificationDataset, in the same order). No confusion
    matrix beyond DENSE_CONFUSION_LABELS labels (unreadable, and labels² cells). Returns the file names written."""
    kept = predictions.kept.numpy()
    predicted, references = predictions.ranked[:, 0].numpy(), predictions.references.numpy()
    drawn = []
    if len(labels) <= DENSE_CONFUSION_LABELS:
        draw_confusion_matrix(confusion_matrix(predicted[kept], references[kept], len(labels)).tolist(), labels,
                              Path(folder) / CONFUSION_FILE)
        drawn.append(CONFUSION_FILE)
    images, truths, guesses = [], [], []
    for position in misclassified_positions(predicted, references):
        try:
            image = dataset.decode(dataset.table[position], position)
        except BadImageError:
            continue
        image.thumbnail((160, 160))
        images.append(image)
        truths.append(labels[references[position]])
        guesses.append(labels[predicted[position]])
    draw_misclassified(images, truths, guesses, Path(folder) / MISCLASSIFIED_FILE)
    return [*drawn, MISCLASSIFIED_FILE]


def draw_predicted_vs_true(predicted: np.ndarray, true: np.ndarray, names: list[str], path: Path) -> None:
    """A regression's eval images as points (true value, predicted value), one panel per target (up to 6), with the
    diagonal where a perfect model's points would lie."""
    plt = pyplot()
    shown = range(min(6, len(names)))
    figure, axes = plt.subplots(1, len(shown), figsize=(3.4 * len(shown), 3.3), squeeze=False)
    for axis, t in zip(axes.flat, shown):
        low = float(min(predicted[:, t].min(), true[:, t].min()))
        high = float(max(predicted[:, t].max(), true[:, t].max()))
        axis.plot([low, high], [low, high], color="grey", linewidth=1)
        axis.scatter(true[:, t], predicted[:, t], s=10, alpha=0.6)
        axis.set(xlabel="true", ylabel="predicted", title=str(names[t])[:24])
    figure.suptitle("Predicted against true value (eval images)")
    figure.tight_layout()
    save_figure(figure, path, dpi=80)


# ---------------------------------------------------------------- explain's panel of what the model gives, per task


def draw_probabilities(axis, shown: list[tuple[str, float]], score_format: str) -> None:
    """A classifier's top labels as bars on a 0-1 probability axis, best at the top."""
    labels, scores = zip(*reversed(shown))
    drawn = axis.barh(range(len(labels)), scores, color="tab:blue")
    axis.set(xlim=(0, 1), xlabel="probability", title="top predictions")
    axis.bar_label(drawn, fmt=f"%{score_format}", padding=3)
    axis.set_yticks(range(len(labels)), labels)


def draw_label_scores(axis, shown: list[tuple[str, float]], given: list[tuple[str, float]],
                      thresholds: dict[str, float], score_format: str) -> None:
    """A multi-label model's top sigmoid scores on a 0-1 axis: the labels it gives (over their thresholds) stand out,
    each threshold is a tick."""
    labels, scores = zip(*reversed(shown))
    chosen = {label for label, _ in given}
    drawn = axis.barh(range(len(labels)), scores,
                      color=["tab:blue" if label in chosen else "lightgrey" for label in labels])
    axis.scatter([thresholds[label] for label in labels], range(len(labels)), marker="|", s=400, color="black",
                 zorder=3)
    axis.set(xlim=(0, 1), xlabel="sigmoid score (|: the label's threshold)",
             title="given: " + (", ".join(label for label, _ in given)[:60] or "no label"))
    axis.bar_label(drawn, fmt=f"%{score_format}", padding=3)
    axis.set_yticks(range(len(labels)), labels)


def draw_values(axis, shown: list[tuple[str, float]], total: int, score_format: str) -> None:
    """A regression's values, each target by name in the targets' order, as bars from 0 on an axis that spans them
    (negative values to the left), each bar labelled with its value; `total`: the model's number of targets."""
    names, values = zip(*reversed(shown))
    low, high = min(0.0, *values), max(0.0, *values)
    span = (high - low) or 1.0
    drawn = axis.barh(range(len(names)), values, color=["tab:blue" if value >= 0 else "tab:orange" for value in values])
    axis.axvline(0, color="grey", linewidth=1)
    # room beside the bars' ends for their labels
    axis.set_xlim(low - 0.35 * span if low < 0 else -0.02 * span, high + 0.35 * span if high > 0 else 0.02 * span)
    axis.set(xlabel="predicted value (each target in its own units)",
             title="predicted values" + (f" (first {len(shown)} of {total} targets)" if total > len(shown) else ""))
    axis.bar_label(drawn, fmt=f"%{score_format}", padding=3)
    axis.set_yticks(range(len(names)), names)


def plot_curves(history: list[dict], path: Path, curve: tuple[str, str, tuple[float, float] | None]) -> None:
    """training_curves.png: the loss, and the task's own metric (`curve`: its Task.curve, accuracy or a regression's
    RMSE), over the optimiser steps."""
    plt = pyplot()
    train = [h for h in history if "loss" in h]
    key, title, limits = curve
    evals = [h for h in history if key in h]
    figure, (loss_axis, metric_axis) = plt.subplots(1, 2, figsize=(10, 3.5))
    loss_axis.plot([h["step"] for h in train], [h["loss"] for h in train], label="train loss")
    if evals:
        loss_axis.plot([h["step"] for h in evals], [h["eval_loss"] for h in evals], "o-", label="eval loss")
        metric_axis.plot([h["step"] for h in evals], [h[key] for h in evals], "o-", color="tab:green")
    loss_axis.set(xlabel="optimiser step", ylabel="loss", title="Loss")
    loss_axis.legend()
    metric_axis.set(xlabel="optimiser step", ylabel=key.removeprefix("eval_"), title=title)
    if limits:
        metric_axis.set_ylim(*limits)
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)


# ---------------------------------------------------------------- multi-label


def precision_recall_curve(scores: np.ndarray, truth: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(recall, precision) at each distinct score threshold, highest first."""
    order = np.argsort(-scores, kind="mergesort")
    ordered, hits = scores[order], np.cumsum(truth[order])
    cuts = np.r_[np.flatnonzero(np.diff(ordered)), len(ordered) - 1]
    return hits[cuts] / max(1, truth.sum()), hits[cuts] / (cuts + 1)


def draw_precision_recall(scores: np.ndarray, rows: np.ndarray, labels: list[str], thresholds: dict, path) -> None:
    """One precision-recall curve per label (up to 20), each with a dot at its chosen threshold."""
    plt = pyplot()
    shown = range(min(20, len(labels)))
    columns = min(5, len(shown))
    rows_of_plots = -(-len(shown) // columns)
    figure, axes = plt.subplots(rows_of_plots, columns, figsize=(2.6 * columns, 2.5 * rows_of_plots), squeeze=False)
    for axis in axes.flat:
        axis.set_axis_off()
    for axis, c in zip(axes.flat, shown):
        axis.set_axis_on()
        truth = rows[:, c] == 1
        if truth.any():
            recall, precision = precision_recall_curve(scores[:, c], truth)
            axis.step(recall, precision, where="post")
            chosen = scores[:, c] >= thresholds[labels[c]]
            hits = (chosen & truth).sum()
            axis.plot(hits / truth.sum(), hits / max(1, chosen.sum()), "o", color="tab:red")
        axis.set(xlim=(0, 1.02), ylim=(0, 1.02), title=str(labels[c])[:24], xlabel="recall", ylabel="precision")
    figure.suptitle("Precision-recall per label (dot: the chosen threshold)")
    figure.tight_layout()
    save_figure(figure, path, dpi=80)
