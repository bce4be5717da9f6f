"""Single-label classification: one class per image, a softmax over the classes, cross-entropy."""

from __future__ import annotations

from pathlib import Path

import torch

from vit_finetune.recipe.train_section import SINGLE_LABEL_GOALS
from vit_finetune.tasks import evaluation, pictures
from vit_finetune.tasks.base import Answers, SKIPPED, SplitPredictions, Task

DEFAULT_TOP_K = 5  # the labels predict lists per image when --top-k is not given


class SingleLabel(Task):
    name = "single_label"
    problem_type = None
    selection_metric = "eval_accuracy"
    keep_best_metrics = frozenset(SINGLE_LABEL_GOALS)
    metric_names = {"accuracy": "Accuracy", "top5_accuracy": "Top-5 accuracy", "macro_f1": "Macro F1"}
    curve = ("eval_accuracy", "Eval accuracy", (0, 1))
    distills = True
    wise_ft_measured = True

    def kept(self, labels):
        return labels != SKIPPED

    def per_image_loss(self, logits, labels):
        return torch.nn.functional.cross_entropy(logits, labels, reduction="none", ignore_index=SKIPPED)

    def loss(self, logits, targets, soft_targets, class_weights, label_smoothing):
        """Mean cross-entropy over the batch's real images, leaving out the places of images skipped as bad; 0, with
        a zero gradient, when all were skipped (the forward and backward still run: under DDP every process must
        join each step's gradient all-reduce)."""
        if soft_targets is not None:  # a Mixup/CutMix batch; label smoothing is already in its targets
            return soft_target_loss(logits, soft_targets, class_weights)
        per_image = torch.nn.functional.cross_entropy(logits.float(), targets, weight=class_weights, reduction="none",
                                                      ignore_index=SKIPPED, label_smoothing=label_smoothing)
        # A weighted mean over the real images (weight 1 each without class weights), as cross_entropy's own mean
        # is; computed on the device, no sync. With no real image the sum is 0 and so is the loss, with a zero
        # gradient.
        real = (targets != SKIPPED).float()
        image_weights = real if class_weights is None else class_weights[targets.clamp(min=0)] * real
        total = image_weights.sum()
        return per_image.sum() / torch.where(total > 0, total, torch.ones_like(total))

    def mixed_targets(self, labels, own, partner, partner_weight, num_classes, label_smoothing):
        """Probability rows over the classes, label smoothing in them (soft_targets, below)."""
        return soft_targets(labels[own], labels[partner], partner_weight, num_classes, label_smoothing)

    def probe_weights(self, labels, class_weights):
        """Its class's weight, as training's cross-entropy weighs the image."""
        return torch.ones(len(labels), dtype=torch.float32) if class_weights is None else class_weights.float()[labels]

    def probe_strata(self, labels):
        """Its class: every fold holds its share of each class."""
        return labels

    mirror_tested = True

    def probe_decisions(self, logits):
        return logits.argmax(dim=-1)

    def batch_outputs(self, logits, labels, k):
        return logits.topk(k, dim=-1).indices, labels, self.per_image_loss(logits, labels)

    def predictions_of(self, batches, k):
        if not batches:
            return SplitPredictions(torch.empty(0, k, dtype=torch.long), torch.empty(0, dtype=torch.long),
                                    torch.empty(0))
        ranked, references, losses = (torch.cat([part.cpu() for part in parts]) for parts in zip(*batches))
        return SplitPredictions(ranked, references, losses)

    def report(self, predictions, labels):
        metrics = evaluation.summarise(predictions, len(labels))
        if "confusion_matrix" in metrics:
            metrics.update(evaluation.label_report(metrics["confusion_matrix"], labels))
        else:
            kept = predictions.kept
            counts = evaluation.class_counts(predictions.ranked[kept, 0].numpy(), predictions.references[kept].numpy(),
                                             len(labels))
            metrics.update(evaluation.per_class_report(*counts, labels), confusion_matrix_labels=list(labels),
                           confusion_matrix_axes=evaluation.SPARSE_AXES)
        return metrics

    def headline(self, metrics):
        return f"accuracy {metrics['accuracy']:.4f}, loss {metrics['eval_loss']:.4f}"

    def draw(self, predictions, dataset, labels, folder, metrics):
        return pictures.draw_classification(predictions, dataset, labels, Path(folder))

    def scores(self, logits):
        return logits.softmax(-1)

    def labels_given(self, scores, labels, top_k):
        ranked = sorted(range(len(scores)), key=lambda index: -scores[index])[:top_k or DEFAULT_TOP_K]
        return [(labels[index], scores[index]) for index in ranked]

    def write_csv(self, rows, path, top_k, open_writer):
        header = ["image", "error"] + [f"{kind}_{rank}" for rank in range(1, top_k + 1) for kind in ("label", "score")]
        count = 0
        with open(path, "w", newline="") as out:
            writer = open_writer(out)
            writer.writerow(header)
            for row in rows:
                ranked = [value for guess in row["predictions"] for value in (guess["label"], f"{guess['score']:.6f}")]
                writer.writerow([row["image"], row["error"] or ""] + ranked + [""] * (len(header) - 2 - len(ranked)))
                count += 1
        return count

    @classmethod
    def card_section(cls, metrics, escape):
        rows = "\n".join(f"| {escape(label)} | {s['precision']:.3f} | {s['recall']:.3f} | {s['f1']:.3f} | "
                         f"{s['support']} |" for label, s in metrics.get("per_class", {}).items())
        return f"### Per class\n| class | precision | recall | F1 | eval images |\n|---|---|---|---|---|\n{rows}\n"

    def answers(self, config):
        return Answers("top-1", lambda logits: logits.argmax(-1), lambda a, b: a == b, self.kept)


def evaluate_model(model, loader, accelerator, normalize, num_classes: int) -> dict:
    """Metrics over the whole eval split of a single-label model (evaluation.predict_split, then summarise)."""
    predictions = evaluation.predict_split(model, loader, accelerator, normalize, SingleLabel(), num_classes)
    return evaluation.summarise(predictions, num_classes)


# ---------------------------------------------------------------- Mixup/CutMix's soft targets


def soft_targets(own: torch.Tensor, partner: torch.Tensor, partner_weight: torch.Tensor, num_classes: int,
                 label_smoothing: float = 0.0) -> torch.Tensor:
    """Mixup/CutMix of class ids: each image's (class, its partner's class, the partner's weight) -> a probability
    row that sums to 1, label smoothing applied.

    A bad image's row (label -1) is all zeros: it trains nothing. An image mixed with a bad image's blank
    keeps its own label alone, with weight 1: the blank part carries no class.
    """
    weight = partner_weight * (partner != SKIPPED)
    targets = (one_hot(own, num_classes) * (1 - weight)[:, None]
               + one_hot(partner, num_classes) * weight[:, None])
    valid = (own != SKIPPED).float()[:, None]
    return (targets * (1 - label_smoothing) + label_smoothing / num_classes) * valid


def one_hot(labels: torch.Tensor, num_classes: int) -> torch.Tensor:
    """One-hot rows; a label of -1 (a skipped bad image) gives a row of zeros."""
    rows = torch.nn.functional.one_hot(labels.clamp(min=0), num_classes).float()
    return rows * (labels >= 0).float()[:, None]


def soft_target_loss(logits: torch.Tensor, targets: torch.Tensor, class_weights: torch.Tensor | None = None) -> torch.Tensor:
    """Cross-entropy against probability rows, averaged over the rows that hold a target (not bad images).

    With class weights (data.class_balance=weights) each class's term is weighted and each row weighs
    sum_c w_c t_c (lambda w_a + (1 - lambda) w_b for a mixed pair), then a weighted mean: for one-hot rows
    exactly cross_entropy(weight=w)'s mean, as unmixed batches have it.
    """
    per_class = -(targets * torch.log_softmax(logits.float(), dim=-1))
    if class_weights is None:
        per_row, row_weights = per_class.sum(dim=-1), (targets.sum(dim=-1) > 0).float()
    else:
        per_row, row_weights = (per_class * class_weights).sum(dim=-1), (targets * class_weights).sum(dim=-1)
    total = row_weights.sum()
    return per_row.sum() / torch.where(total > 0, total, torch.ones_like(total))
