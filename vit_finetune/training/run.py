"""Training: one run from a validated recipe to a finished output folder, driven by Accelerate.

`run()` reads top to bottom: each wing's pre-flight (the launch, the output folder, the token, the trackers; then
from the base's config: the base, the memory, the data, the teacher), every problem said at once, hold the output
folder, then `_run`: the run built (build.py: data, the run's plan, model, optimiser), the loop (loop.py: each
optimiser step, then log / evaluate / checkpoint / stop), the end (finish.py: the final evaluation, the weights kept,
the output folder written) and the push.
"""

from __future__ import annotations

import time
from functools import partial
from pathlib import Path
from typing import Iterable

from accelerate import Accelerator
from accelerate.utils import set_seed

from vit_finetune import data
from vit_finetune.artifacts import checkpoint, output_guard, publish, tracking
from vit_finetune.artifacts.callbacks import Callback, CallbackList, REGISTERED, TrainingRun
from vit_finetune.artifacts.final_outputs import begin_outputs
from vit_finetune.artifacts.parts import Parts
from vit_finetune.core import hub, previous_run, progress
from vit_finetune.core.errors import raise_together
from vit_finetune.core.processes import let_gloo_threads_settle, local_main_first, watch_launcher
from vit_finetune.model import loading, memory
from vit_finetune.model.loading import count_parameters, describe, family_of
from vit_finetune.recipe import Recipe
from vit_finetune.tasks import evaluation, pictures
from vit_finetune.training import build, devices, distill, finish, loop, selection, sharding
from vit_finetune.training.devices import make_accelerator, prepare, torch_threads
from vit_finetune.training.interrupts import StoppedAtOnce
from vit_finetune.training.optim import reapply_hyperparameters


def run(recipe: Recipe, callbacks: Iterable[Callback] = ()) -> dict:
    """Train, evaluate, export and (optionally) push; returns the final metrics. `callbacks` observe this run,
    after those registered with vit_finetune.artifacts.callbacks.register (see that module for the events)."""
    # Each wing's pre-flight, cheap checks first: every problem said at once, before any download or output.
    raise_together(devices.preflight(recipe) + output_guard.preflight(recipe))
    watch_launcher(grace_s=recipe.train.collective_timeout_s)  # a killed launcher must not leave this one training
    accelerator = make_accelerator(recipe)
    threads = recipe.train.cpu_threads if accelerator.device.type == "cpu" else None
    with torch_threads(threads):  # before any weight exists: every sum splits the same way
        # One process per machine downloads; the others then read its cache, so only it talks to the Hub.
        config = local_main_first(accelerator, partial(preflight_with_base, recipe, accelerator))
        slow = memory.why_a_pass_is_slow(family_of(config).vision_config(config), recipe, accelerator.device)
        if slow and accelerator.is_main_process:
            progress.say(slow)
        lock = output_guard.hold_output_dir(accelerator, recipe)  # the first write into output_dir
        try:
            return _run(recipe, callbacks, accelerator)
        except KeyboardInterrupt:  # a second Ctrl-C: no traceback, and what it leaves where (nothing is put back)
            raise StoppedAtOnce(f"stopped at once by Ctrl-C; "
                                f"{previous_run.after_a_stop_at_once(Path(recipe.output_dir))}") from None
        except Exception:
            said = previous_run.after_a_failed_run(Path(recipe.output_dir)) if accelerator.is_main_process else None
            if said:
                progress.say(said)
            raise
        finally:
            lock.release()


def preflight_with_base(recipe: Recipe, accelerator: Accelerator):
    """The pre-flight's second pass, from the base's config and the data's source alone (no weights, no images): the
    model's, the data's and the teacher's problems, said together, before output_dir is touched. Returns the base's
    config."""
    with hub.offline_unless(accelerator.is_local_main_process):
        config, problems = loading.preflight(recipe, accelerator.device)
        problems += data.preflight(recipe.data) + distill.preflight(recipe.train.distill)
    raise_together(problems)
    return config


def _run(asked: Recipe, callbacks: Iterable[Callback], accelerator: Accelerator) -> dict:
    """run() once output_dir is held: the run built, the loop, the end, the push. `asked`: the recipe as given, which
    a resume compares with its checkpoint's and each checkpoint records; after the plan only the recipe as run is
    read."""
    output_dir = Path(asked.output_dir)

    def load_data_and_model() -> tuple[Path | None, Recipe, Parts]:
        with hub.offline_unless(accelerator.is_local_main_process):
            set_seed(asked.train.seed)
            resume_from = checkpoint.resolve_resume(asked.train.resume, output_dir, accelerator.is_main_process)
            if resume_from:
                checkpoint.refuse_changed_recipe(resume_from, asked)  # before any data or weights are loaded
            return resume_from, *build.run_parts(asked, accelerator, resuming=resume_from is not None)

    # As in run(): one process per machine downloads, the others then read its cache.
    with sharding.models_built_whole(accelerator):
        resume_from, recipe, parts = local_main_first(accelerator, load_data_and_model)
    prepare(accelerator, parts, recipe)
    state = checkpoint.TrainState()
    if resume_from:
        resize = None if parts.resolution is None else partial(  # the weights load at the size they were saved at
            parts.resolution.size_of_checkpoint, accelerator.unwrap_model(parts.model, keep_torch_compile=False))
        resume_from, state = checkpoint.load_resumable(accelerator, resume_from, asked, parts.data_identity, resize)
    state.data = parts.data_identity  # recorded in each checkpoint: a resume refuses other data
    if parts.probe is not None:  # a resumed run's comes from its checkpoint
        state.probe = parts.probe.as_metrics()
    if resume_from:
        reapply_hyperparameters(parts.optimizer, parts.scheduler.scheduler, recipe)
    if distill.caches_teacher_logits(recipe):
        parts.teacher_cache = distill.cache_teacher_logits(parts.teacher, parts.train_loader, recipe.train.batch_size,
                                                           parts.normalize.rescale, accelerator.is_main_process)
    training = TrainingRun(recipe, accelerator, parts, state, asked)
    keeper = selection.WeightSelection(recipe, accelerator.unwrap_model(parts.model, keep_torch_compile=False),
                                       parts.task, parts.labels, measure=lambda: loop.measure(training))  # may refuse
    if accelerator.is_main_process:
        begin(training, resume_from)
    stream_positions = [loop.StreamPositions(parts.train_loader)] if recipe.data.streaming else []
    hooks = CallbackList([keeper, *stream_positions, *REGISTERED, *tracking.callbacks_for(recipe.train.report_to),
                          *callbacks])
    if resume_from:
        hooks.on_load_checkpoint(training, resume_from)

    started = time.perf_counter()
    loop.train_loop(training, hooks)
    if parts.resolution is not None:  # the last stage's cost said; the model is at model.image_size
        parts.resolution.close(training)
    training_seconds = time.perf_counter() - started

    metrics, predictions = finish.final_result(training, keeper, hooks, training_seconds)
    hooks.on_train_end(training, accelerator.unwrap_model(parts.model, keep_torch_compile=False))
    # Sharded, the weights are gathered into one whole model on the main process: every process must take part.
    gathered = accelerator.get_state_dict(parts.model) if sharding.is_sharded(accelerator) else None
    if accelerator.is_main_process:
        finish.save_and_say(training, keeper, metrics, predictions, training_seconds, resume_from, gathered)
        if recipe.hub.push:
            url = publish.push_folder(output_dir, recipe.hub.repo_id, recipe.hub.private)
            print(f"pushed to {url}")
    accelerator.wait_for_everyone()
    accelerator.end_training()
    let_gloo_threads_settle(accelerator)
    return metrics


def begin(training: TrainingRun, resume_from: Path | None) -> None:
    """The main process's first outputs, once every check before training has passed (overwrite=true sets the
    previous run aside here, not before), and the lines that say what is trained and evaluated."""
    recipe, accelerator, parts = training.recipe, training.accelerator, training.parts
    draw = None
    if parts.position_tables and recipe.pictures:
        draw = partial(pictures.draw_position_similarity, parts.position_tables["before"],
                       parts.position_tables["after"])
    begin_outputs(Path(recipe.output_dir), recipe, recipe.overwrite, draw)
    trainable, total = count_parameters(parts.model)
    progress.say(f"{describe(accelerator.unwrap_model(parts.model).config)}; trainable {trainable:,} of {total:,} "
                 f"parameters; {parts.total_steps} steps on {accelerator.num_processes} process(es)"
                 + (f"; resuming from {resume_from} at step {training.state.step}" if resume_from else ""))
    progress.say(evaluation.describe_eval_split(parts.eval_split, len(parts.eval_loader.dataset), recipe.data))
