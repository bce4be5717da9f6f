"""The tasks a model can be trained for, chosen once from the data and the recipe (for_training) or read back from
a saved model's config (of_config). Everything that differs between them lives in the task's own module; adding a
task is one module and one entry in TASKS."""

from __future__ import annotations

from vit_finetune.recipe import TrainSettings
from vit_finetune.tasks.base import Answers, SplitPredictions, Task
from vit_finetune.tasks.multi_label import MultiLabel
from vit_finetune.tasks.regression import Regression
from vit_finetune.tasks.single_label import SingleLabel

TASKS: dict[str, type[Task]] = {task.name: task for task in (SingleLabel, MultiLabel, Regression)}
# config.problem_type -> task; transformers writes "single_label_classification" when it trains a classifier itself
BY_PROBLEM_TYPE: dict[str | None, type[Task]] = {
    **{task.problem_type: task for task in TASKS.values()}, "single_label_classification": SingleLabel}

__all__ = ["TASKS", "Answers", "MultiLabel", "Regression", "SingleLabel", "SplitPredictions", "Task", "for_training", "of_config", "of_metrics"]


def of_config(config, train: TrainSettings | None = None) -> Task:
    """The task of a saved (or just built) model, from its config.problem_type; `train`: its run's train section, to
    evaluate on the run's own split as the run did (Task.from_config)."""
    return BY_PROBLEM_TYPE.get(getattr(config, "problem_type", None), SingleLabel).from_config(config, train)


def of_metrics(metrics: dict) -> type[Task]:
    """The task a metrics.json was measured for (the card reads it)."""
    if metrics.get("multi_label"):
        return MultiLabel
    return BY_PROBLEM_TYPE.get(metrics.get("task"), SingleLabel)


def for_training(splits, train: TrainSettings) -> Task:
    """The task of a new run, as the loaded data holds it (data.task, or what the data showed), with what it learns
    from the training split (a regression's standardisation) and the recipe's train section (multi-label's rule for
    its thresholds, a regression's loss)."""
    return TASKS[splits.task].for_training(splits, train)
