"""What every task answers: the loop, evaluation, predict, explain, export, the page and the card ask a Task, and
never which task they are in. A task is one module holding one Task subclass, plus an entry in tasks.TASKS."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, ClassVar

import torch

from vit_finetune.tasks import pictures
from vit_finetune.data import SKIPPED_LABEL as SKIPPED  # an unreadable image's class id (a regression's row is NaN instead)
from vit_finetune.data import balance
from vit_finetune.tasks.evaluation import SplitPredictions
from vit_finetune.recipe import TrainSettings


@dataclass
class Answers:
    """How logits become the model's answer, which answers count as the same (export's float against int8 graph), and
    how they are scored against the labels: single-label, the top class and accuracy; multi-label, the labels over
    their thresholds and exact-match accuracy; regression, the values (the same within a tolerance) and their MAE."""
    kind: str  # what the agreement counts, in words
    decide: Callable[[torch.Tensor], torch.Tensor]
    matches: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    kept: Callable[[torch.Tensor], torch.Tensor]  # labels -> the images not skipped as unreadable
    metric: str = "accuracy"  # what `score` measures, as metrics.json names it
    metric_name: str = "accuracy"  # ... and as the console writes it
    # (answers, labels) -> each image's score; None: 1 where the answer matches the label, else 0
    score: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    # a max abs logit difference (export's parity check) in the task's own terms, "" where the logits are its terms
    in_own_terms: Callable[[float], str] = lambda difference: ""

    def scores(self, answers: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Each image's score under `metric`."""
        return self.score(answers, labels) if self.score else self.matches(answers, labels).float()


class Task:
    """One kind of problem a model solves. Class attributes say what it is; methods do what differs."""

    name: ClassVar[str]  # the recipe's data.task value
    problem_type: ClassVar[str | None]  # config.problem_type (None: transformers' single-label default)
    selection_metric: ClassVar[str]  # chooses raw against EMA weights when train.keep_best is not set
    keep_best_metrics: ClassVar[frozenset[str]]  # the train.keep_best names this task measures (recipe/train_section.py)
    ema_compared: ClassVar[str] = "accuracy"  # the metric the card gives for the raw and the EMA weights
    metric_names: ClassVar[dict[str, str]]  # metrics.json key -> the card's name, in the card's order
    curve: ClassVar[tuple[str, str, tuple[float, float] | None]]  # training_curves.png: (history key, title, y range)
    probe_fit: ClassVar[str] = "logistic"  # how the linear probe fits this task's head (probe.FITS)
    method_rule: ClassVar[str] = "classifier"  # which of methods.AUTO_RULES train.method=auto follows
    # whether train.wise_ft_alpha=auto averages LP-FT's weights with the probe's model: where the average was measured
    wise_ft_measured: ClassVar[bool] = False
    # the alpha train.wise_ft_alpha=auto takes on every schedule, where the task's study chose one (None: wise_ft's rule)
    wise_ft_auto_alpha: ClassVar[float | None] = None
    # whether distillation serves it: a teacher of this task teaches a student of it by its top class or softmax
    distills: ClassVar[bool] = False

    @classmethod
    def for_training(cls, splits, train: TrainSettings) -> Task:
        """The task of a new run on `splits` (data.Splits), with what it learns from the training split and what the
        recipe's train section says of it."""
        return cls()

    @classmethod
    def from_config(cls, config, train: TrainSettings | None = None) -> Task:
        """The task of a saved model, with what it carries in its config; `train`: its run's train section, where
        evaluating on its run's own split chooses what the final evaluation chose, as it chose it."""
        return cls()

    def configure(self, config) -> None:
        """Write what the task needs into a new model's config (pipeline() and predict read it back)."""
        config.problem_type = self.problem_type

    def finish_config(self, config, metrics: dict) -> None:
        """Write what the final evaluation chose into the saved model's config (nothing by default)."""

    # ------------------------------------------------------------ training

    def kept(self, labels: torch.Tensor) -> torch.Tensor:
        """Which images of a batch are kept, holding a label: False for one skipped as unreadable (it kept its place)."""
        raise NotImplementedError

    def per_image_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Each image's unweighted loss against its labels, 0 for a skipped image: evaluation's, and the probe's."""
        raise NotImplementedError

    def loss(self, logits: torch.Tensor, targets: torch.Tensor, soft_targets: torch.Tensor | None,
             class_weights: torch.Tensor | None, label_smoothing: float) -> torch.Tensor:
        raise NotImplementedError

    def mixed_targets(self, labels: torch.Tensor, own: torch.Tensor, partner: torch.Tensor,
                      partner_weight: torch.Tensor, num_classes: int, label_smoothing: float) -> torch.Tensor:
        """The targets of a Mixup/CutMix batch (augment.BatchAugmenter), which `loss` takes as its soft targets: image
        i became image own[i] blended with image partner[i] (positions in the batch), the partner's share
        partner_weight[i]."""
        raise NotImplementedError(f"{self.name} targets are not mixed (the recipe refuses augment.mixup and cutmix)")

    def flat_image_suspect(self, label) -> bool:
        """Whether a training image that decodes to one flat colour, holding `label` (its row's label cell), is worth
        a word: a flat image filed under a class is a broken file or a lost drawing (the default)."""
        return True

    def keep_best_refusal(self, keep_best: str | None, splits) -> str | None:
        """Why train.keep_best cannot choose on this eval split (its metric is undefined there), with the fix; None
        where it can. Read before the model is built."""
        return None

    def balancing(self, kind: str | None, splits, seed: int) -> tuple:
        """data.class_balance -> (the training sampler or None, the loss's class weights or None)."""
        return balance.balancing(kind, splits, seed)

    # ------------------------------------------------------------ the linear probe (probe.py)

    def probe_weights(self, labels: torch.Tensor, class_weights: torch.Tensor | None) -> torch.Tensor:
        """Each image's float32 weight in the probe's loss, given data.class_balance=weights' class weights or None."""
        raise NotImplementedError

    def probe_strata(self, labels: torch.Tensor) -> torch.Tensor:
        """Each image's group (an id >= 0) that the probe's cross-validation deals evenly into its folds."""
        raise NotImplementedError

    def probe_targets(self, labels: torch.Tensor) -> torch.Tensor:
        """What a least-squares head learns for each image, as a float (images, outputs) table (probe_fit "ridge")."""
        raise NotImplementedError

    # whether data.horizontal_flip=auto asks the mirror test (probe_checks.mirror_test): the task answers with classes,
    # so an answer either changes or does not when the image is mirrored
    mirror_tested: ClassVar[bool] = False

    def probe_decisions(self, logits: torch.Tensor) -> torch.Tensor:
        """A logistic probe's answer for each image, comparable with its labels: a class id, or a 0/1 row of labels."""
        raise NotImplementedError

    # ------------------------------------------------------------ evaluation

    def batch_outputs(self, logits: torch.Tensor, labels: torch.Tensor, k: int) -> tuple[torch.Tensor, ...]:
        """(what the split keeps of each image's output, its reference, its loss) for one batch, on the device."""
        raise NotImplementedError

    def predictions_of(self, batches: list[tuple[torch.Tensor, ...]], k: int) -> SplitPredictions:
        """SplitPredictions from per-batch batch_outputs, in order, on the CPU."""
        raise NotImplementedError

    def kept_outputs(self, predictions: SplitPredictions) -> torch.Tensor:
        """What the split keeps of each image's output (batch_outputs' first part), for gathering a split's shares
        (streaming) back through predictions_of()."""
        return predictions.ranked

    def report(self, predictions: SplitPredictions, labels: list[str]) -> dict:
        """Everything metrics.json says of a split's predictions."""
        raise NotImplementedError

    def headline(self, metrics: dict) -> str:
        """The console's few words on an evaluation."""
        raise NotImplementedError

    def draw(self, predictions: SplitPredictions, dataset, labels: list[str], folder: Path, metrics: dict) -> list[str]:
        """The evaluation's pictures into `folder`; the file names written."""
        raise NotImplementedError

    # ------------------------------------------------------------ using the model

    def scores(self, logits: torch.Tensor) -> torch.Tensor:
        """Each output's value for predict, explain and the page."""
        raise NotImplementedError

    def labels_given(self, scores: list[float], labels: list[str], top_k: int | None) -> list[tuple[str, float]]:
        """What the model gives one image, best first: (label or target name, score or value) pairs."""
        raise NotImplementedError

    def write_csv(self, rows, path: Path, top_k: int, open_writer) -> int:
        """predict's CSV; `open_writer(file)` gives a csv writer that writes formula-like cells inert."""
        raise NotImplementedError

    @classmethod
    def card_section(cls, metrics: dict, escape: Callable[[str], str]) -> str:
        """The model card's results beyond the headline table."""
        raise NotImplementedError

    @classmethod
    def use_text(cls, load_from: str) -> str:
        """The card's note after its pipeline() snippet (nothing by default)."""
        return ""

    # ------------------------------------------------------------ showing an answer (explain's picture, the page)

    model_noun: ClassVar[str] = "classifier"  # what the page calls the model
    output_noun: ClassVar[str] = "labels"  # what it calls the model's outputs
    score_format: ClassVar[str] = ".2f"  # how explain and the page write a score
    confidences: ClassVar[bool] = True  # its scores are probabilities in [0, 1]: the page shows them as bars

    def shown(self, scores: torch.Tensor, labels: list[str], top_k: int) -> list[tuple[str, float]]:
        """What explain draws beside its map: the top_k outputs by score, best first."""
        values, indices = scores.topk(min(top_k, scores.numel()))
        return [(labels[index], value) for value, index in zip(values.tolist(), indices.tolist())]

    def draw_shown(self, axis, shown: list[tuple[str, float]], given: list[tuple[str, float]]) -> None:
        """explain's panel of `shown` on a matplotlib axis: probabilities as bars on a 0-1 axis."""
        pictures.draw_probabilities(axis, shown, self.score_format)

    def page_note(self, shown: list[tuple[str, float]], given: list[tuple[str, float]], top_k: int) -> str:
        """The page's line under what the model gives, as HTML whose every label is escaped ('' for none)."""
        return ""

    label_sets: ClassVar[bool] = False  # each row's label is a list of labels
    label_encoding: ClassVar[str] = "class"  # data.TARGET_ENCODINGS: how its labels reach the loss
    ranks: ClassVar[bool] = True  # predict lists the top_k outputs; else what labels_given decides (thresholds, targets)

    def saved_thresholds(self) -> dict[str, float] | None:
        """The per-label thresholds the model decides by, if its task has them (explain draws them)."""
        return None

    def answers(self, config) -> Answers:
        """How export scores its float and int8 graphs."""
        raise NotImplementedError
