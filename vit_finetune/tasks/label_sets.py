"""The multi-label task's arithmetic (tasks/multi_label.py): a set of labels per image, a sigmoid per class.

The loss is binary cross-entropy per class (with data.class_balance=weights, each class's positives weighted by
its negatives / positives). The labels reach the loss as (B, C) rows of 0/1 (-1 for a bad image skipped, which
trains nothing); Mixup/CutMix blend two rows by the mix's weight, as they blend two one-hot rows for one label.
Each class's threshold is chosen on the eval split for train.threshold_metric, saved in the model's config
(`label_thresholds`) and used by `predict`, `explain` and the page (labels_given); the metrics (mAP, micro/macro F1,
exact match, per class precision, recall, AP and threshold) are measured at those thresholds. An image may hold none
of the labels (a negative for every one); metrics.json counts those, and the images the model gives no label.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


PROBLEM_TYPE = "multi_label_classification"  # config.problem_type: pipeline() applies a sigmoid for it
THRESHOLDS_KEY = "label_thresholds"  # config.json: {label: threshold}, read by predict
DEFAULT_THRESHOLD = 0.5
SKIPPED = -1  # data.SKIPPED_LABEL
BETAS = {"f1": 1.0, "f2": 2.0, "f0.5": 0.5}  # train.threshold_metric -> the F-beta it maximises


# ---------------------------------------------------------------- training


def positive_weights(rows: torch.Tensor) -> torch.Tensor:
    """data.class_balance=weights for label sets: each class's negatives / positives (BCE's pos_weight), 1 for a
    class with no positive or no negative image in train."""
    positives = rows.double().sum(dim=0)
    negatives = len(rows) - positives
    weights = torch.where((positives > 0) & (negatives > 0), negatives / positives.clamp(min=1), torch.ones_like(positives))
    return weights.float()


def loss(logits: torch.Tensor, targets: torch.Tensor, positive_weight: torch.Tensor | None = None,
         label_smoothing: float = 0.0) -> torch.Tensor:
    """Binary cross-entropy, the mean over classes then over the images that are not skipped (rows of -1); 0 with
    a zero gradient when all are. Label smoothing pulls each target towards 1/2."""
    real = (targets[:, 0] != SKIPPED).float()
    targets = targets.float().clamp(min=0) * (1 - label_smoothing) + label_smoothing / 2
    per_class = torch.nn.functional.binary_cross_entropy_with_logits(logits.float(), targets, reduction="none",
                                                                     pos_weight=positive_weight)
    per_image = per_class.mean(dim=-1) * real
    total = real.sum()
    return per_image.sum() / torch.where(total > 0, total, torch.ones_like(total))


def per_image_loss(logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Evaluation's loss per image (mean BCE over classes); a skipped image's is 0 (left out by its kept mask)."""
    per_class = torch.nn.functional.binary_cross_entropy_with_logits(logits.float(), rows.float().clamp(min=0),
                                                                     reduction="none")
    return per_class.mean(dim=-1) * (rows[:, 0] != SKIPPED)


def mixed_rows(rows: torch.Tensor, own: torch.Tensor, partner: torch.Tensor, partner_weight: torch.Tensor
               ) -> torch.Tensor:
    """Mixup/CutMix of label sets: image i became image own[i] blended with image partner[i] (positions in the
    batch), partner_weight[i] the partner's share of the image; its target row is (1 - w) own + w partner. A skipped
    image stays skipped; an image mixed with a skipped one keeps its own labels alone."""
    own_rows, partner_rows = rows[own].float(), rows[partner].float()
    weight = partner_weight * (partner_rows[:, 0] != SKIPPED)
    blended = own_rows * (1 - weight)[:, None] + partner_rows.clamp(min=0) * weight[:, None]
    return torch.where(own_rows[:, :1] == SKIPPED, own_rows, blended)


# ---------------------------------------------------------------- thresholds and metrics


def average_precision(scores: np.ndarray, truth: np.ndarray) -> float:
    """Area under the precision-recall steps (scikit-learn's average_precision_score): sum over distinct score
    thresholds of (recall gained) x precision there. NaN for a class with no positive."""
    positives = truth.sum()
    if positives == 0:
        return float("nan")
    order = np.argsort(-scores, kind="mergesort")
    scores, truth = scores[order], truth[order]
    last_of_tie = np.r_[np.flatnonzero(np.diff(scores)), len(scores) - 1]  # ties count together
    hits = np.cumsum(truth)[last_of_tie]
    precision = hits / (last_of_tie + 1)
    recall_gain = np.diff(np.r_[0, hits]) / positives
    return float((recall_gain * precision).sum())


def f_beta(hits: np.ndarray, predicted: np.ndarray, actual: np.ndarray, beta: float) -> np.ndarray:
    """F-beta from counts (arrays broadcast); 0 where it is undefined."""
    denominator = (1 + beta**2) * hits + beta**2 * (actual - hits) + (predicted - hits)
    return np.divide((1 + beta**2) * hits, denominator, out=np.zeros(np.shape(denominator)), where=denominator > 0)


def best_threshold(scores: np.ndarray, truth: np.ndarray, beta: float) -> float:
    """The threshold that maximises F-beta of one class on these images: halfway between the lowest score taken
    as positive and the next one down, so that an unseen image scoring in that gap is not decided by a tie.
    DEFAULT_THRESHOLD for a class with no positive image (nothing to choose from)."""
    if truth.sum() == 0:
        return DEFAULT_THRESHOLD
    order = np.argsort(-scores, kind="mergesort")
    ordered, hits = scores[order], np.cumsum(truth[order])
    cuts = np.r_[np.flatnonzero(np.diff(ordered)), len(ordered) - 1]  # positive = the top cut + 1 images
    best = int(cuts[np.argmax(f_beta(hits[cuts], cuts + 1, truth.sum(), beta))])
    below = ordered[best + 1] if best + 1 < len(ordered) else 0.0
    return float((ordered[best] + below) / 2)


def choose_thresholds(scores: np.ndarray, rows: np.ndarray, metric: str) -> np.ndarray:
    beta = BETAS[metric]
    return np.array([best_threshold(scores[:, c], rows[:, c], beta) for c in range(rows.shape[1])])


@dataclass(frozen=True)
class ThresholdRule:
    """Where the thresholds come from: chosen for `metric` (on a `holdout` share of the split, seeded, the metrics
    then on the rest), or `fixed` ones saved with a model."""
    metric: str = "f1"
    holdout: float | None = None
    seed: int = 0
    fixed: tuple[float, ...] | None = None


def holdout_parts(count: int, share: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(positions that choose the thresholds, positions that are scored): a seeded split of the eval images."""
    order = np.random.default_rng(seed).permutation(count)
    chosen = max(1, min(count - 1, round(count * share)))
    return np.sort(order[:chosen]), np.sort(order[chosen:])


def summarise(scores: np.ndarray, rows: np.ndarray, losses: np.ndarray, labels: list[str], rule: ThresholdRule) -> dict:
    """Every reported metric of a multi-label split (skipped images already left out), at thresholds per `rule`."""
    if rule.fixed is not None:
        thresholds, scored = np.asarray(rule.fixed), np.arange(len(rows))
        chosen_on = "saved with the model"
    elif rule.holdout is not None:
        choosing, scored = holdout_parts(len(rows), rule.holdout, rule.seed)
        thresholds = choose_thresholds(scores[choosing], rows[choosing], rule.metric)
        chosen_on = (f"{len(choosing)} eval images held out for choosing them (train.threshold_holdout="
                     f"{rule.holdout}); the metrics are measured on the other {len(scored)}")
    else:
        thresholds, scored = choose_thresholds(scores, rows, rule.metric), np.arange(len(rows))
        chosen_on = ("the same eval images the metrics are measured on (optimistic; set train.threshold_holdout "
                     "to choose them on a held-out part)")
    scores, rows, losses = scores[scored], rows[scored], losses[scored]
    predicted = scores >= thresholds
    hits = (predicted & (rows == 1)).sum(axis=0)
    predicted_count, actual = predicted.sum(axis=0), rows.sum(axis=0)
    precision = np.divide(hits, predicted_count, out=np.zeros(len(labels)), where=predicted_count > 0)
    recall = np.divide(hits, actual, out=np.zeros(len(labels)), where=actual > 0)
    f1 = f_beta(hits, predicted_count, actual, 1.0)
    ap = np.array([average_precision(scores[:, c], rows[:, c]) for c in range(len(labels))])
    present = ~np.isnan(ap)
    unlabelled = rows.sum(axis=1) == 0
    given_none = predicted.sum(axis=1) == 0
    return {
        "eval_samples": int(len(rows)),
        "accuracy": float(np.mean((predicted == (rows == 1)).all(axis=1))),  # exact match: every label right
        "map": float(ap[present].mean()) if present.any() else 0.0,
        "micro_f1": float(f_beta(hits.sum(), predicted_count.sum(), actual.sum(), 1.0)),
        "macro_f1": float(f1[actual > 0].mean()) if (actual > 0).any() else 0.0,  # over labels the split holds
        # the labels macro F1 and mAP leave out: no scored eval image holds them (single-label runs name them too)
        "macro_f1_absent_classes": [label for label, n in zip(labels, actual) if n == 0],
        "eval_images_without_labels": int(unlabelled.sum()),  # negatives for every label
        "eval_images_given_no_label": int(given_none.sum()),  # no score reached its threshold
        "eval_images_without_labels_given_none": int((unlabelled & given_none).sum()),
        "eval_loss": float(losses.astype(np.float64).mean()),
        "multi_label": True,
        "threshold_metric": rule.metric,
        "thresholds_chosen_on": chosen_on,
        "thresholds": {label: float(t) for label, t in zip(labels, thresholds)},
        "per_class": {label: {"precision": float(p), "recall": float(r), "f1": float(f),
                              "ap": None if np.isnan(a) else float(a), "threshold": float(t), "support": int(n)}
                      for label, p, r, f, a, t, n in zip(labels, precision, recall, f1, ap, thresholds, actual)},
    }


def labels_given(scores: list[float], labels: list[str], thresholds: list[float],
                 at_most: int | None = None) -> list[tuple[str, float]]:
    """What a multi-label model gives one image: each label whose score reaches its threshold, highest first (the
    `at_most` highest when given). predict, explain and the page all list these."""
    over = sorted(((label, score) for label, score, threshold in zip(labels, scores, thresholds) if score >= threshold),
                  key=lambda pair: -pair[1])
    return over if at_most is None else over[:at_most]


def saved_thresholds(config, labels: list[str]) -> list[float]:
    """The per-class thresholds a model carries in its config, in label order (DEFAULT_THRESHOLD where none)."""
    saved = getattr(config, THRESHOLDS_KEY, None) or {}
    return [float(saved.get(label, DEFAULT_THRESHOLD)) for label in labels]


# ---------------------------------------------------------------- the card and the picture


def card_section(metrics: dict, escape) -> str:
    """The model card's multi-label results: the thresholds' origin and the per-class table."""
    rows = "\n".join(f"| {escape(label)} | {s['precision']:.3f} | {s['recall']:.3f} | {s['f1']:.3f} | "
                     f"{'-' if s['ap'] is None else format(s['ap'], '.3f')} | {s['threshold']:.3f} | {s['support']} |"
                     for label, s in metrics.get("per_class", {}).items())
    return (f"Multi-label: a sigmoid score per label; a label is predicted when its score reaches its threshold. "
            f"Each threshold was chosen for {metrics['threshold_metric'].upper()} on {metrics['thresholds_chosen_on']}. "
            f"They are saved in `config.json` (`{THRESHOLDS_KEY}`); `pipeline()` returns the scores and leaves the "
            f"thresholds to you. Accuracy here is exact match (every label of the image right).\n\n"
            f"{unlabelled_text(metrics, escape)}\n\n"
            "### Per class\n| label | precision | recall | F1 | AP | threshold | eval images with it |\n"
            f"|---|---|---|---|---|---|---|\n{rows}\n")


def unlabelled_text(metrics: dict, escape, shown: int = 20) -> str:
    """The card's sentence on eval images with no label, images given none, and labels the split lacks."""
    text = (f"{metrics['eval_images_without_labels']} of the {metrics['eval_samples']} eval images hold none of the "
            f"labels (negatives for every one); the model gave no label to {metrics['eval_images_given_no_label']}.")
    absent = metrics["macro_f1_absent_classes"]
    if absent:
        names = ", ".join(escape(label) for label in absent[:shown]) + (", ..." if len(absent) > shown else "")
        text += f" {len(absent)} label(s) have no eval image and are left out of macro F1 and mAP: {names}."
    return text


