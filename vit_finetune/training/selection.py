"""Which weights a run ends with: the raw weights or their EMA (train.ema_decay), at the last step or at the
best evaluation (train.keep_best), and when to stop early (train.early_stopping_patience).

A callback on the training loop's hook. At each evaluation (each epoch, every train.eval_every_steps, and the
final one) the EMA is evaluated beside the raw weights and the better of the two, by train.keep_best (or
accuracy), is the candidate. With keep_best, a candidate better than every earlier one is written to
`output_dir/best/weights.safetensors` (replaced atomically; run.state.best records its step and value), and
each checkpoint holds a copy of it and of the EMA, so a killed run resumed with train.resume=auto knows and
has its best. At the end the chosen weights go into the model that is saved, are measured once more for the
metrics and pictures (unless the final evaluation already measured them: the last step's raw weights), and
metrics.json says which they are (`weights`, `best_step`, `best_metric`, `best_value`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file

from vit_finetune.artifacts.callbacks import Callback, TrainingRun
from vit_finetune.artifacts.checkpoint import WRITE_ERRORS
from vit_finetune.core.errors import VitFinetuneError
from vit_finetune.core.layout import (
    BEST_DIR, BEST_FILE, CHECKPOINT_BEST, CHECKPOINT_EMA, PARTIAL_PREFIX, describe_write_error, record,
    replace_atomically,
)
from vit_finetune.core.processes import any_process
from vit_finetune.recipe import Recipe
from vit_finetune.recipe.train_section import KEEP_BEST_GOALS
from vit_finetune.tasks import TASKS, Task
from vit_finetune.tasks.evaluation import as_eval_entry
from vit_finetune.training.ema import WeightEMA, load_trainable_state, trainable_state
from vit_finetune.training.wise_ft import interpolate, restore, snapshot



class SelectionError(VitFinetuneError):
    """keep_best asked for a metric this run does not have, or the best weights could not be written."""


def metric_value(metrics: dict, name: str) -> float:
    """A metric by its recipe name (eval_accuracy) from evaluate_model's keys (accuracy, eval_loss)."""
    return as_eval_entry(metrics)[name]


def is_better(name: str, value: float, than: float) -> bool:
    """Strictly better by the metric's goal (higher accuracy, lower loss); a tie is no gain."""
    return value > than if KEEP_BEST_GOALS[name] == "max" else value < than


class WeightSelection(Callback):
    """EMA, keep-best and early stopping of one run; `final_metrics` puts the chosen weights into the model."""

    def __init__(self, recipe: Recipe, model: torch.nn.Module, task: Task, labels: list[str],
                 measure: Callable[[], tuple[dict, object]]):
        t = recipe.train
        if t.keep_best is not None and t.keep_best not in task.keep_best_metrics:
            measured_by = [other.name.replace("_", "-") for other in TASKS.values()
                           if t.keep_best in other.keep_best_metrics]
            raise SelectionError(f"train.keep_best={t.keep_best} is measured for {' and '.join(measured_by)} runs "
                                 f"only; this run is {task.name.replace('_', '-')}. Use one of "
                                 f"{sorted(task.keep_best_metrics)}")
        self.selection_metric = task.selection_metric
        self.compared = task.ema_compared  # the metric the card shows for the raw and the EMA weights
        if t.keep_best == "eval_top5_accuracy" and len(labels) < 5:
            raise SelectionError(f"train.keep_best=eval_top5_accuracy needs at least 5 classes; this dataset has "
                                 f"{len(labels)}. Use train.keep_best=eval_accuracy")
        self.keep_best, self.patience = t.keep_best, t.early_stopping_patience
        self.model = model  # unwrapped: the same tensors as the prepared model's
        self.measure = measure  # (metrics, predictions) of the model's current weights, no history entry, no event
        self.ema = WeightEMA(model, t.ema_decay) if t.ema_decay is not None else None
        self.best_file = Path(recipe.output_dir) / BEST_DIR / BEST_FILE
        self.latest: tuple[str, dict] | None = None  # the last evaluation's candidate: ("raw" | "ema", metrics)
        self.raw_and_ema: dict[str, float] = {}  # the last evaluation's accuracy of each, when EMA is on

    # ------------------------------------------------------------ events of the loop

    def on_step_end(self, run: TrainingRun) -> None:
        if self.ema is not None:
            self.ema.update()

    def on_evaluate(self, run: TrainingRun, metrics: dict) -> None:
        candidates = {"raw": metrics}
        if self.ema is not None:
            with self.ema.applied():
                candidates["ema"] = self.measure()[0]
            run.state.history[-1].update({f"ema_{k}": v for k, v in as_eval_entry(candidates["ema"]).items()})
            self.raw_and_ema = {f"{kind}_{self.compared}": m[self.compared] for kind, m in candidates.items()}
        rule = self.keep_best or self.selection_metric
        kind = "ema" if "ema" in candidates and is_better(
            rule, metric_value(candidates["ema"], rule), metric_value(metrics, rule)) else "raw"
        self.latest = (kind, candidates[kind])
        if self.keep_best:
            self._keep_if_best(run, kind, candidates[kind])

    def on_save_checkpoint(self, run: TrainingRun, folder: Path) -> None:
        if not run.accelerator.is_main_process:
            return
        if self.ema is not None:
            save_file(_on_cpu(self.ema.state_dict()), str(folder / CHECKPOINT_EMA))
        if run.state.best is not None:
            _link_or_copy(self.best_file, folder / CHECKPOINT_BEST)

    def on_load_checkpoint(self, run: TrainingRun, folder: Path) -> None:
        if self.ema is not None and (folder / CHECKPOINT_EMA).is_file():
            self.ema.load_state_dict(load_file(str(folder / CHECKPOINT_EMA)))
        if run.accelerator.is_main_process:
            if run.state.best is not None:
                self._record_best_file()
                self.best_file.parent.mkdir(parents=True, exist_ok=True)
                replace_atomically(self.best_file, lambda partial: shutil.copyfile(folder / CHECKPOINT_BEST, partial))
            else:  # a best written after this checkpoint belongs to steps that will be trained again
                self.best_file.unlink(missing_ok=True)

    # ------------------------------------------------------------ the end

    def final_result(self, run: TrainingRun, final: tuple[dict, object] | None) -> tuple[dict, object]:
        """After the final evaluation (None after an early stop, which keep_best implies): the chosen weights go
        into the model; (their metrics, saying which weights they are, and their predictions)."""
        if self.keep_best:
            best = run.state.best
            said = {"best_step": best["step"], "best_metric": self.keep_best, "best_value": best["value"],
                    **({"stopped_early": run.state.stopped_early} if self.patience else {}),
                    **({k: best[k] for k in ("weights", f"raw_{self.compared}", f"ema_{self.compared}")}
                       if self.ema else {})}
            if final is not None and best["step"] == run.state.step and best["weights"] == "raw":
                # The model holds these very weights and the final evaluation measured them: nothing to load or
                # measure (every process sees the same run.state.best, so all skip the barrier alike).
                return {**final[0], **said}, final[1]
            run.accelerator.wait_for_everyone()  # the main process wrote the file
            load_trainable_state(self.model, load_file(str(self.best_file)))
        elif self.ema is not None:
            kind, said = self.latest[0], {"weights": self.latest[0], **self.raw_and_ema}
            if kind == "raw":
                return {**final[0], **said}, final[1]
            load_trainable_state(self.model, self.ema.state_dict())
        else:
            return final
        metrics, predictions = self.measure()  # of exactly the weights that are saved, for the metrics and pictures
        return {**metrics, **said}, predictions

    def remove_best_file(self) -> None:
        """Once the output folder holds the chosen weights, the copy under best/ has done its job (the folder goes
        too, unless it holds something else)."""
        self.best_file.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            self.best_file.parent.rmdir()

    def _record_best_file(self) -> None:
        """best/weights.safetensors, and the name it is written under first, in the run's manifest."""
        output_dir = self.best_file.parent.parent
        record(output_dir, [f"{BEST_DIR}/{BEST_FILE}", f"{BEST_DIR}/{PARTIAL_PREFIX}{BEST_FILE}"])

    # ------------------------------------------------------------ keep-best

    def _keep_if_best(self, run: TrainingRun, kind: str, metrics: dict) -> None:
        state, value = run.state, metric_value(metrics, self.keep_best)
        if state.best is not None and not is_better(self.keep_best, value, state.best["value"]):
            state.evaluations_without_gain += 1
            state.stopped_early = bool(self.patience) and state.evaluations_without_gain >= self.patience
            return
        weights = self.ema.state_dict() if kind == "ema" else trainable_state(self.model)
        failure = None
        if run.accelerator.is_main_process:
            try:
                self._record_best_file()
                self.best_file.parent.mkdir(parents=True, exist_ok=True)
                replace_atomically(self.best_file, lambda partial: save_file(_on_cpu(weights), str(partial)))
            except WRITE_ERRORS as error:
                failure = error
        if any_process(run.accelerator, failure is not None):  # no process may train on without its best
            reason = describe_write_error(failure, self.best_file.parent) if failure else "the main process failed"
            raise SelectionError(f"could not save the best weights (step {state.step}) to {self.best_file} "
                                 f"({reason}). Free disk space, then resume with train.resume=auto")
        state.best = {"step": state.step, "value": value, "weights": kind, **self.raw_and_ema}
        state.evaluations_without_gain = 0


def average_if_no_worse(model: torch.nn.Module, start: dict[str, torch.Tensor], alpha: float, metric: str,
                        fine_tuned: tuple[dict, object], measure: Callable[[], tuple[dict, object]]
                        ) -> tuple[tuple[dict, object], dict]:
    """WiSE-FT's average of `model`'s fine-tuned weights with `start` (the probe's model), kept only if its `metric`
    on the eval split is no worse than the fine-tuned weights' (`fine_tuned`: their metrics and predictions), as
    train.keep_best chooses among evaluations; otherwise the fine-tuned weights are put back. Returns the kept
    weights' (metrics, predictions) and what metrics.json records of the choice."""
    fine_tuned_weights = snapshot(model)
    interpolate(model, start, alpha)
    averaged = measure()
    kept_average = not is_better(metric, metric_value(fine_tuned[0], metric), metric_value(averaged[0], metric))
    if not kept_average:
        restore(model, fine_tuned_weights)
    # Every metric keep_best could rank by, the chooser first: what another choice would have kept is on record.
    scores = {kind: {name: value for name, value in sorted(as_eval_entry(result[0]).items(),
                                                           key=lambda item: item[0] != metric)
                     if name in KEEP_BEST_GOALS}
              for kind, result in (("fine_tuned", fine_tuned), ("average", averaged))}
    report = {"alpha": alpha, "kept": "average" if kept_average else "fine_tuned",
              "chosen_by": f"{metric} on the eval split (as train.keep_best chooses: the reported score is the better "
                           "of the two)", **scores}
    return (averaged if kept_average else fine_tuned), report


def describe_average(report: dict) -> str:
    """The console's line on WiSE-FT's choice: both scores and which weights are saved."""
    metric = report["chosen_by"].split()[0]
    alpha = report["alpha"]
    names = {"average": "the probe's model" if alpha == 0 else "average", "fine_tuned": "fine-tuned"}
    scores = ", ".join(f"{names[kind]} {report[kind][metric]:.4f}" for kind in names)
    if alpha == 0:  # the "average" is the probe's model itself
        kept = ("saved: the probe's model, as fine-tuning scored no better" if report["kept"] == "average" else
                "saved: the fine-tuned weights, as the probe's model scored lower")
    else:
        kept = (f"saved: {alpha:g} x the fine-tuned weights + {1 - alpha:g} x the probe's model"
                if report["kept"] == "average" else "saved: the fine-tuned weights, as the average scored lower")
    return f"WiSE-FT: {metric} on the eval split {scores}; {kept}"


def _on_cpu(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: t.detach().to("cpu", copy=True).contiguous() for name, t in tensors.items()}


def _link_or_copy(source: Path, target: Path) -> None:
    """A hard link costs no space; the best file is only ever replaced by a rename, so the link stays its copy."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)
