"""The tasks a model can be trained for, chosen once from the data and the recipe (for_training) or read back from
a saved model's config (of_config). Everything that differs between them lives in the task's own module; adding a
task is one module and one entry in TASKS."""

from __future__ import annotations

from .base import Answers, SplitPredictions, Task
from .multi_label import MultiLabel
from .regression import Regression
from .single_label import SingleLabel

TASKS: dict[str, type[Task]] = {task.name: task for task in (SingleLabel, MultiLabel, Regression)}
# config.problem_type -> task; transformers writes "single_label_classification" when it trains a classifier itself
BY_PROBLEM_TYPE: dict[str | None, type[Task]] = {
    **{task.problem_type: task for task in TASKS.values()}, "single_label_classification": SingleLabel}

__all__ = ["TASKS", "Answers", "MultiLabel", "Regression", "SingleLabel", "SplitPredictions", "Task", "for_training", "of_config", "of_metrics"]


def of_config(config) -> Task:
    """The task of a saved (or just built) model, from its config.problem_type."""
    return BY_PROBLEM_TYPE.get(getattr(config, "problem_type", None), SingleLabel).from_config(config)


def of_metrics(metrics: dict) -> type[Task]:
    """The task a metrics.json was measured for (the card reads it)."""
    if metrics.get("multi_label"):
        return MultiLabel
    return BY_PROBLEM_TYPE.get(metrics.get("task"), SingleLabel)


def for_training(splits, loss_kind: str = "mse") -> Task:
    """The task of a new run, with what it learns from the training split (a regression's standardisation)."""
    return TASKS[splits.task].for_training(splits, loss_kind)
