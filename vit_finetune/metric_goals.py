"""The metrics each task measures that train.keep_best can follow, and whether higher or lower is better.

One place for both readers: each task takes its own table (tasks/), and the recipe's schema accepts any metric of
them for train.keep_best; a low module, so that the schema needs none of the tasks' heavy imports.
"""

from __future__ import annotations

# Each task's metrics train.keep_best may follow -> "max" or "min".
SINGLE_LABEL_GOALS = {"eval_accuracy": "max", "eval_top5_accuracy": "max", "eval_macro_f1": "max", "eval_loss": "min"}
MULTI_LABEL_GOALS = {"eval_accuracy": "max", "eval_macro_f1": "max", "eval_loss": "min", "eval_map": "max",
                     "eval_micro_f1": "max"}
REGRESSION_GOALS = {"eval_mae": "min", "eval_rmse": "min", "eval_r2": "max", "eval_loss": "min"}
# Every metric train.keep_best accepts, and its goal (the same wherever two tasks measure it).
KEEP_BEST_GOALS: dict[str, str] = {**SINGLE_LABEL_GOALS, **MULTI_LABEL_GOALS, **REGRESSION_GOALS}
