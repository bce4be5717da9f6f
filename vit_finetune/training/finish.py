"""The end of a run: the final evaluation, the weights kept (WiSE-FT's average where it scores no worse, then
keep-best's or the EMA's choice), what metrics.json records of the run, and the output folder written (on the main
process) with the lines that close the run.
"""

from __future__ import annotations

import contextlib
import copy
from functools import partial
from pathlib import Path

from accelerate import Accelerator

from vit_finetune import tasks
from vit_finetune.artifacts import card, checkpoint
from vit_finetune.artifacts.callbacks import Callback, TrainingRun
from vit_finetune.artifacts.final_outputs import clear_staging, run_info, write_outputs
from vit_finetune.artifacts.parts import Parts
from vit_finetune.core import layout, progress
from vit_finetune.core.errors import RunError
from vit_finetune.core.run_lock import OutputDirError
from vit_finetune.model import student
from vit_finetune.model.lora import is_lora, merged_copy
from vit_finetune.recipe import Recipe
from vit_finetune.tasks import evaluation
from vit_finetune.training import distill, loop, loss_scale, selection, sharding
from vit_finetune.training.devices import device_name


def final_result(training: TrainingRun, keeper: selection.WeightSelection, hooks: Callback,
                 training_seconds: float) -> tuple[dict, object]:
    """The final evaluation and the weights kept, now the model's: their (metrics, predictions), the metrics with
    what metrics.json records of the run itself."""
    recipe, accelerator, parts, state = training.recipe, training.accelerator, training.parts, training.state
    # An early stop follows an evaluation of these very weights; otherwise the last step's are evaluated here.
    final = None if state.stopped_early else loop.evaluate(training, hooks)
    final, average = average_with_probe(training, final)
    metrics, predictions = keeper.final_result(training, final)  # the weights it chose are now the model's
    if parts.test_loader is not None:
        metrics["test"] = score_test_split(training, metrics)
    # skipped_images: bad images skipped over the whole run, by all processes. Each epoch draws every file again,
    # so a bad file counts once per epoch (once more if Accelerate's even_batches padding draws it twice).
    metrics.update(steps=state.step, skipped_images=state.skipped_images, method=recipe.train.method,
                   **parts.data_facts)
    if accelerator.scaler is not None:  # fp16: the steps its loss scaler skipped (loss_scale.py)
        metrics["skipped_steps"] = state.skipped_steps
    if average is not None:
        metrics["wise_ft"] = average
        if average["kept"] == "average":  # what the card and the method's line say of the saved weights
            metrics["wise_ft_alpha"] = average["alpha"]
    if state.probe is not None:
        metrics["probe"] = state.probe
    if parts.teacher is not None:
        facts = student.facts(recipe.model, accelerator.unwrap_model(parts.model).config, recipe.train.distill.teacher)
        metrics["distillation"] = distill.report(recipe.train.distill, parts.teacher, parts.teacher_cache,
                                                 training_seconds, facts)
    return metrics, predictions


def score_test_split(training: TrainingRun, metrics: dict) -> dict:
    """data.test_split scored once by the weights the run keeps, as `evaluate OUTPUT_DIR --dataset D --split S` scores
    the saved model: the task read back from the config the model is saved with, so a multi-label model's thresholds
    are those chosen on the eval split, never on the test split. metrics.json's "test": the split's name and the
    eval split's metrics, eval_loss and eval_samples named test_loss and test_samples (evaluation.as_test_key)."""
    parts, accelerator = training.parts, training.accelerator
    config = copy.deepcopy(accelerator.unwrap_model(parts.model, keep_torch_compile=False).config)
    parts.task.finish_config(config, metrics)
    task = tasks.of_config(config)
    predictions = evaluation.predict_split(parts.model, parts.test_loader, accelerator, parts.normalize, task,
                                           len(parts.labels))
    scored = task.report(predictions, parts.labels)
    if accelerator.is_main_process:
        progress.say(f"test split {parts.test_split!r}: {task.headline(scored)} on {scored['eval_samples']} images, "
                     "scored once by the weights kept")
    return {"split": parts.test_split,
            **{evaluation.as_test_key(key): value for key, value in scored.items()}}


def average_with_probe(training: TrainingRun, final: tuple[dict, object]) -> tuple[tuple[dict, object], dict | None]:
    """WiSE-FT: the fine-tuned weights moved toward the probe's model (wise_ft.py), kept only where that scores no
    worse than the fine-tuned weights' final evaluation (`final`). Returns the kept weights' (metrics, predictions)
    and the choice as metrics.json records it, or None where the run averages nothing."""
    parts, accelerator = training.parts, training.accelerator
    if parts.wise_ft_start is None:
        return final, None
    model = accelerator.unwrap_model(parts.model, keep_torch_compile=False)
    kept, report = selection.average_if_no_worse(model, parts.wise_ft_start, training.recipe.train.wise_ft_alpha,
                                                 parts.task.selection_metric, final, lambda: loop.measure(training))
    parts.wise_ft_start = None  # the copy is spent
    if accelerator.is_main_process:
        progress.say(selection.describe_average(report))
    return kept, report


def save_and_say(training: TrainingRun, keeper: selection.WeightSelection, metrics: dict, predictions,
                 training_seconds: float, resumed_from: Path | None, gathered: dict | None) -> None:
    """On the main process: the output folder written (the pictures drawn from the final evaluation's predictions),
    keep-best's copy removed, then the lines that close the run."""
    recipe, accelerator, parts, state = training.recipe, training.accelerator, training.parts, training.state
    info = run_info(device_name(accelerator.device), accelerator.num_processes, accelerator.mixed_precision,
                    state.history, training_seconds, resumed_from, metrics)
    if parts.probe is not None:
        info["probe_seconds"] = round(parts.probe.seconds, 1)
    if state.resolution is not None:  # train.resolution_schedule: each stage's size, steps and cost
        info["resolution_stages"] = state.resolution["stages"]
    draw = None
    # The pictures show eval images by their place in the split, which a stream cannot look up.
    if recipe.pictures and not recipe.data.streaming:
        draw = partial(parts.task.draw, predictions, parts.eval_loader.dataset, parts.labels, metrics=metrics)
    write_final_outputs(accelerator, parts, recipe, metrics, state, info, draw, gathered)
    keeper.remove_best_file()
    if "distillation" in metrics:
        progress.say(f"train.distill: {card.describe_distillation(metrics['distillation'])}")
    if "skipped_steps" in metrics:
        progress.say(loss_scale.describe(metrics["skipped_steps"], state.step))
    print(f"eval {parts.task.headline(metrics)} on {metrics['eval_samples']} images; outputs in {Path(recipe.output_dir)}")


def write_final_outputs(accelerator: Accelerator, parts: Parts, recipe: Recipe, metrics: dict,
                        state: checkpoint.TrainState, info: dict | None = None, draw_pictures=None,
                        gathered: dict | None = None) -> None:
    """The output folder (model, processor, card, metrics...), or an error that names what is left to resume from;
    `gathered`: a sharded model's full weights."""
    output_dir = Path(recipe.output_dir)
    trained = accelerator.unwrap_model(parts.model, keep_torch_compile=False)
    if gathered is not None:
        trained = sharding.unsharded_model(trained, recipe, gathered)
    model, adapter = (merged_copy(trained), trained) if is_lora(trained) else (trained, None)
    parts.task.finish_config(model.config, metrics)  # e.g. multi-label's chosen thresholds, which predict reads
    try:
        write_outputs(output_dir, model, parts.processor, recipe, metrics, state.history, parts.labels,
                      adapter_model=adapter, run_info=info, draw_pictures=draw_pictures)
    except checkpoint.WRITE_ERRORS as error:
        with contextlib.suppress(OSError, OutputDirError):  # give back the space the attempt took (only its own files)
            clear_staging(output_dir)
        previous = checkpoint.latest_checkpoint(output_dir)
        raise RunError(
            f"could not write the final model into {output_dir} ({layout.describe_write_error(error, output_dir)}); "
            "nothing there looks finished. "
            + (f"The last checkpoint is intact: {previous}. Free disk space, then run the same command with "
               "train.resume=auto (only the steps after that checkpoint are redone)"
               if previous else "No checkpoint was kept (train.checkpoint_every_steps is not set); "
               "free disk space and train again")
        ) from None
