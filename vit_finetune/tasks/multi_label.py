"""Multi-label classification: a set of labels per image, a sigmoid per class and a threshold per class, chosen by
the task's own rule (the arithmetic lives in label_sets.py)."""

from __future__ import annotations

import html
from pathlib import Path

import numpy as np
import torch

from vit_finetune.core.errors import printable
from vit_finetune.core.layout import PRECISION_RECALL_FILE
from vit_finetune.data import DataError
from vit_finetune.recipe import TrainSettings
from vit_finetune.recipe.train_section import MULTI_LABEL_GOALS
from vit_finetune.tasks import label_sets, pictures
from vit_finetune.tasks.base import Answers, SKIPPED, SplitPredictions, Task
from vit_finetune.tasks.label_sets import ThresholdRule


class MultiLabel(Task):
    name = "multi_label"
    problem_type = label_sets.PROBLEM_TYPE  # pipeline() applies a sigmoid per class for it
    selection_metric = "eval_map"  # exact match is too coarse to rank by
    keep_best_metrics = frozenset(MULTI_LABEL_GOALS)
    metric_names = {"accuracy": "Exact-match accuracy", "macro_f1": "Macro F1", "map": "mAP", "micro_f1": "Micro F1"}
    curve = ("eval_accuracy", "Eval exact-match accuracy", (0, 1))
    label_sets = True
    label_encoding = "set"
    ranks = False

    def kept(self, labels):
        return labels[:, 0] != SKIPPED

    def per_image_loss(self, logits, labels):
        return label_sets.per_image_loss(logits, labels)

    def loss(self, logits, targets, soft_targets, class_weights, label_smoothing):
        return label_sets.loss(logits, targets if soft_targets is None else soft_targets, class_weights,
                               label_smoothing)

    def mixed_targets(self, labels, own, partner, partner_weight, num_classes, label_smoothing):
        """Blended 0/1 rows (label_sets.mixed_rows); the loss applies label smoothing to them as to unmixed rows."""
        return label_sets.mixed_rows(labels, own, partner, partner_weight)

    def flat_image_suspect(self, label):
        """A blank image with no label is a deliberate negative (docs/multilabel.md); one holding labels is not."""
        return bool(label)

    def balancing(self, kind, splits, seed):
        """data.class_balance=weights weighs each class's positives by its negatives / positives (BCE's pos_weight)."""
        if kind is None:
            return None, None
        if kind == "sampler":  # the recipe refuses it with data.task=multi_label; a detected label set lands here
            raise DataError("data.class_balance=sampler draws images by their one class, but this dataset's images "
                            "hold label sets (multi-label); use data.class_balance=weights or null")
        rows = torch.zeros(len(splits.train), len(splits.labels))
        for row, class_ids in zip(rows, splits.train[splits.label_column]):
            row[class_ids] = 1
        return None, label_sets.positive_weights(rows)

    def probe_weights(self, labels, class_weights):
        """1 each: its class weights are BCE's positive weights, which weigh a label's positives, not an image."""
        return torch.ones(len(labels), dtype=torch.float32)

    def probe_strata(self, labels):
        """One group: a label set has no one class to stratify by, so the images are dealt round-robin."""
        return torch.zeros(len(labels), dtype=torch.long)

    mirror_tested = True

    def probe_decisions(self, logits):
        """The labels whose sigmoid passes 0.5: the probe's head has no threshold of its own yet."""
        return logits > 0

    def batch_outputs(self, logits, labels, k):
        return logits.sigmoid(), labels, self.per_image_loss(logits, labels)

    def predictions_of(self, batches, k):
        if not batches:
            return SplitPredictions(torch.empty(0, k, dtype=torch.long), torch.empty(0, dtype=torch.long),
                                    torch.empty(0))
        scores, references, losses = (torch.cat([part.cpu() for part in parts]) for parts in zip(*batches))
        return SplitPredictions(scores.topk(k, dim=-1).indices, references, losses, scores=scores)

    def kept_outputs(self, predictions):
        return predictions.scores

    def report(self, predictions, labels):
        """The metrics at thresholds chosen by the task's rule (a new run's, or its run's own split again: chosen
        for train.threshold_metric on the eval split; another split: the model's saved thresholds)."""
        kept, rule = predictions.kept_for_metrics(), self.rule
        if rule.holdout is not None and rule.fixed is None and int(kept.sum()) < 2:
            raise DataError(f"train.threshold_holdout={rule.holdout} splits the eval images in two, but there is "
                            f"{int(kept.sum())}; evaluate on more images or set train.threshold_holdout=null")
        metrics = label_sets.summarise(predictions.scores[kept].double().numpy(), predictions.references[kept].numpy(),
                                       predictions.losses[kept].numpy(), labels, rule)
        metrics["eval_skipped_images"] = int((~kept).sum())
        return metrics

    def headline(self, metrics):
        return (f"mAP {metrics['map']:.4f}, micro F1 {metrics['micro_f1']:.4f}, exact match {metrics['accuracy']:.4f}, "
                f"loss {metrics['eval_loss']:.4f}")

    def draw(self, predictions, dataset, labels, folder, metrics):
        kept = predictions.kept.numpy()
        pictures.draw_precision_recall(predictions.scores[kept].double().numpy(), predictions.references[kept].numpy(),
                                         labels, metrics.get("thresholds"), Path(folder) / PRECISION_RECALL_FILE)
        return [PRECISION_RECALL_FILE]

    def scores(self, logits):
        return logits.sigmoid()

    def labels_given(self, scores, labels, top_k):
        return label_sets.labels_given(scores, labels, self.thresholds, top_k)

    def __init__(self, labels: list[str] | None = None, thresholds: list[float] | None = None,
                 rule: ThresholdRule | None = None):
        self.labels, self.thresholds = labels or [], thresholds or []  # saved with a model; a new one has none yet
        self.rule = rule or ThresholdRule(fixed=tuple(self.thresholds))  # how report() comes to its thresholds

    @classmethod
    def for_training(cls, splits, train):
        return cls(rule=choosing(train))

    @classmethod
    def from_config(cls, config, train=None) -> MultiLabel:
        labels = [config.id2label[i] for i in range(config.num_labels)]
        return cls(labels, label_sets.saved_thresholds(config, labels), None if train is None else choosing(train))

    def saved_thresholds(self):
        return dict(zip(self.labels, self.thresholds))

    def draw_shown(self, axis, shown, given):
        pictures.draw_label_scores(axis, shown, given, self.saved_thresholds(), self.score_format)

    def page_note(self, shown, given, top_k):
        """Which labels pass their thresholds, and the best of those that do not."""
        thresholds, chosen = self.saved_thresholds(), {label for label, _ in given}

        def written(label: str, score: float) -> str:
            return f"{html.escape(printable(label))} {score:.2f} (threshold {thresholds[label]:.2f})"

        passing = ", ".join(f"<b>{written(label, score)}</b>" for label, score in given[:top_k])
        below = ", ".join(written(label, score) for label, score in shown if label not in chosen)
        return (f"<p>Labels given (score at or over the label's threshold): {passing or 'none'}."
                + (f" Below their thresholds: {below}." if below else "") + "</p>")

    def finish_config(self, config, metrics: dict) -> None:
        """The thresholds chosen on the eval split travel with the model (predict reads them)."""
        setattr(config, label_sets.THRESHOLDS_KEY, metrics["thresholds"])

    def write_csv(self, rows, path, top_k, open_writer):
        """Each image's labels over their thresholds and their scores, ';'-joined."""
        count = 0
        with open(path, "w", newline="") as out:
            writer = open_writer(out)
            writer.writerow(["image", "error", "labels", "scores"])
            for row in rows:
                writer.writerow([row["image"], row["error"] or "",
                                 ";".join(guess["label"] for guess in row["predictions"]),
                                 ";".join(f"{guess['score']:.6f}" for guess in row["predictions"])])
                count += 1
        return count

    @classmethod
    def card_section(cls, metrics, escape):
        return label_sets.card_section(metrics, escape)

    def answers(self, config):
        thresholds = torch.tensor(np.asarray(self.thresholds, dtype=np.float32))
        return Answers("label-set", lambda logits: logits.sigmoid() >= thresholds,
                       lambda a, b: (a == b.bool()).all(-1), self.kept, metric_name="exact-match accuracy")


def choosing(train: TrainSettings) -> ThresholdRule:
    """The rule a run's train section sets: each threshold chosen on the eval split for train.threshold_metric (on a
    seeded train.threshold_holdout share of it, the metrics then on the rest)."""
    return ThresholdRule(train.threshold_metric, train.threshold_holdout, train.seed)
