"""Training: one run from a validated recipe to a finished output folder, driven by Accelerate.

`run()` reads top to bottom: check everything cheap first, then data, model, optimiser, the loop (loop.py:
each optimiser step, then log / evaluate / checkpoint / stop), final evaluation, the choice of the weights to
keep (selection.py: EMA, best evaluation), export and push.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Iterable

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, InitProcessGroupKwargs, ProjectConfiguration, set_seed

from . import checkpoint, compiling, data, evaluation, hub, loop, memory, model as vit, optim, outputs
from . import distill, methods, pictures, precision, probe, progress as display, selection, sharding, tasks
from .data import augment, streaming
from . import layout, loss_scale, plan, publish, run_outputs, student, tracking, wise_ft
from .callbacks import REGISTERED, Callback, CallbackList, TrainingRun
from .errors import RunError
from .parts import Parts
from .processes import (SHARED_FOLDER_PATIENCE_S, any_process, let_gloo_threads_settle, local_main_first,
                        refuse_a_lone_process, unshared_folder_refusal, watch_launcher, world_size)
from .recipe import (Recipe, probe_unused_settings, step_only_settings, weight_selection_settings,
                     without_pixel_draws)


def check_output_dir(recipe: Recipe) -> None:
    """Refuse to mix with or destroy an earlier run unless told to resume or overwrite, to write over what this
    toolkit did not write, or to write into the dataset's folder. A previous run that a killed overwrite=true run set
    aside is put back first (one process alone can do it here; a launch of several does it once it holds the lock),
    and the checks are of the run the folder will then hold."""
    output_dir = Path(recipe.output_dir)
    resuming = recipe.train.resume is not None
    if world_size(os.environ) == 1:
        said = outputs.recover_if_free(output_dir, resuming)
        if said:
            display.say(said)
    refused = outputs.refusal(recipe, layout.RUN_NAMES)
    if refused:
        raise RunError(refused)
    met = outputs.run_a_new_run_meets(output_dir, resuming)
    if recipe.overwrite or resuming:
        if resuming and run_outputs.is_finished(met):
            raise RunError(f"{output_dir} already holds a finished run; nothing to resume. "
                           "Use overwrite=true to train again, or another output_dir")
        return
    if run_outputs.is_finished(met):
        raise RunError(f"output_dir={str(output_dir)!r} already holds a finished run ({layout.METRICS_FILE}). "
                       "Fix: choose another output_dir, or pass overwrite=true to replace it")
    if checkpoint.complete_checkpoints(met):
        raise RunError(f"output_dir={str(output_dir)!r} holds checkpoints of an unfinished run. "
                       "Fix: resume it with train.resume=auto, or pass overwrite=true to start again")


def make_accelerator(recipe: Recipe) -> Accelerator:
    """Accelerate's Accelerator for the recipe; the launch's config file (DDP, FSDP, DeepSpeed) adds the rest."""
    engine = sharding.requested_engine()
    try:
        accelerator = _accelerator(recipe)
    except RuntimeError as error:
        if engine is None:
            raise
        raise sharding.could_not_set_up(engine, error) from None
    sharding.check_set_up(engine, accelerator, recipe)
    if recipe.train.mixed_precision == "fp16" and accelerator.device.type == "cpu":
        # Accelerate turns fp16 off on CPU without a word: the run would say fp16 and compute in float32.
        raise RunError("train.mixed_precision=fp16 needs a GPU; on CPU it would train in float32. "
                       "Fix: train.mixed_precision=bf16 (CPUs autocast to bfloat16) or train.mixed_precision=no")
    return accelerator


def _accelerator(recipe: Recipe) -> Accelerator:
    t = recipe.train
    on_cpu = not torch.accelerator.is_available()
    device_type = "cpu" if on_cpu else torch.accelerator.current_accelerator().type
    return Accelerator(
        # Without cpu=True, Accelerate ignores torchrun's ranks on a machine with no accelerator and every
        # process believes it is the main one.
        cpu=on_cpu,
        mixed_precision=precision.resolved(t.mixed_precision, device_type),  # the plan (plan.py) says auto's reason
        gradient_accumulation_steps=t.grad_accum,
        # non_blocking: with pinned memory the copy overlaps the previous step instead of waiting for it
        dataloader_config=DataLoaderConfiguration(even_batches=True, non_blocking=torch.cuda.is_available()),
        step_scheduler_with_optimizer=False,
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=t.collective_timeout_s))],
        # Trackers (train.report_to) are Accelerate's; file-based ones write under output_dir/runs.
        log_with=t.report_to or None,
        project_config=ProjectConfiguration(project_dir=str(Path(recipe.output_dir) / layout.TRACKER_DIR)),
    )


FUSED_ADAMW_DEVICES = ("cpu", "cuda")


def build_optimizer(model: torch.nn.Module, recipe: Recipe, device_type: str) -> torch.optim.Optimizer:
    """The optimiser of `recipe` as run (plan.py resolved every `auto`)."""
    t = recipe.train
    lr, head_lr = t.lr, t.head_lr
    config, family = model.config, vit.family_of(model.config)
    block_index = (lambda name: family.block_index(name, config)) if t.layer_decay is not None else None
    heads = "|".join(re.escape(name) for name in vit.head_names(model))
    head = re.compile(rf"(?:^|\.)(?:{heads})\.")  # under peft too: base_model.model.classifier...
    groups = optim.parameter_groups(model, t.weight_decay, t.layer_decay, block_index, family.num_blocks(config),
                                    lambda name: bool(head.search(name)), head_lr / lr)
    for group in groups:
        group["lr"] = lr * group["lr_scale"]
    if t.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=t.momentum)
    # PyTorch's fused kernel exists for CPU and CUDA. On CPU its default is a per-tensor loop, which took 100-140 ms
    # a step for DINOv2-S's 22M weights on one thread here against 17 ms fused (the Trainer uses fused too); the
    # two updates agree to float32 rounding.
    return torch.optim.AdamW(groups, lr=lr, fused=device_type in FUSED_ADAMW_DEVICES)


def build_scheduler(optimizer, recipe: Recipe, total_steps: int):
    """The lr schedule of `recipe` (resolved: no `auto`) over `total_steps`."""
    t, warmup = recipe.train, recipe.train.warmup_steps

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = (step - warmup) / max(1, total_steps - warmup)
        if t.scheduler == "cosine":
            return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
        if t.scheduler == "linear":
            return max(0.0, 1 - progress)
        return 1.0

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def reapply_hyperparameters(parts: Parts, recipe: Recipe) -> None:
    """After a resume: the loaded optimizer and scheduler states carry the lr, weight decay and momentum of
    the checkpoint. They equal the recipe's unless a change was accepted with train.resume_ignore_changes,
    and then the recipe's values (`recipe`: as run) must apply from the resumed step on, not be silently replaced."""
    t = recipe.train
    scheduler = parts.scheduler.scheduler  # the LambdaLR inside Accelerate's wrapper
    groups = parts.optimizer.param_groups
    # A checkpoint written before groups carried lr_scale and decayed had two: decayed, then not decayed.
    lr = t.lr
    scheduler.base_lrs = [lr * group.get("lr_scale", 1.0) for group in groups]
    for index, (group, base_lr, factor) in enumerate(zip(groups, scheduler.base_lrs, scheduler.lr_lambdas)):
        group.update(initial_lr=base_lr, lr=base_lr * factor(scheduler.last_epoch),
                     weight_decay=t.weight_decay if group.get("decayed", index == 0) else 0.0)
        if "momentum" in group:
            group["momentum"] = t.momentum


def build_parts(recipe: Recipe, accelerator: Accelerator, resuming: bool = False) -> tuple[Recipe, Parts]:
    """The recipe as run (plan.py: every `auto` resolved) and what it trains with: data, model (its head fitted by
    the linear probe first when the method says so, unless `resuming`: the checkpoint holds the head then, and the
    probe runs again only for WiSE-FT), loaders, optimiser and schedule."""
    streamed = recipe.data.streaming
    if streamed:
        splits = streaming.open_streams(recipe.data, accelerator.process_index, accelerator.num_processes)
        rows = streaming.epoch_rows(splits, recipe, accelerator.num_processes)
    else:
        splits = data.load_splits(recipe.data, recipe.train.seed)
        rows = len(splits.train)
    task = tasks.for_training(splits, recipe.train)  # chosen once: everything after asks it
    data_facts = check_training_data(splits, recipe, accelerator, task)
    processor = vit.load_image_processor(recipe.model, recipe.model.image_size)
    normalize = data.PixelNormalizer(processor, accelerator.device)
    teacher = None
    if recipe.train.distill is not None:  # its labels are checked before the student is built
        if not task.distills:
            raise RunError(f"train.distill works with single-label classification only, and data.dataset is "
                           f"{task.name.replace('_', '-')}; set train.distill=null")
        teacher = distill.load_teacher(recipe.train.distill, splits.labels, normalize.scale, accelerator.device)
    size = plan.RunSize.of(recipe, rows, len(splits.labels), None if streamed else len(splits.eval),
                           accelerator.num_processes, vit.base_parameter_count(recipe.model))
    recipe = plan.plan_run(recipe, size, accelerator, task, head_kept=vit.keeps_base_head(recipe.model, splits.labels))
    # From here on `recipe` is the recipe as run: nothing reads the one given.
    method = methods.METHODS[recipe.train.method]
    total_steps = size.total_steps if method.fine_tunes else 0  # the probe alone is the whole training
    if method.fine_tunes and recipe.train.warmup_steps >= total_steps:
        raise RunError(f"train.warmup_steps={recipe.train.warmup_steps} is not below the run's {total_steps} steps; "
                       "lower it or train longer")
    tables: dict = {}
    model = vit.build_model(recipe.model, splits.labels,
                            on_resample=lambda before, after: tables.update(before=before, after=after))
    task.configure(model.config)  # pipeline(), predict and evaluate read the task back from the config
    if recipe.data.alpha_background is not None:  # predict, explain, export and the page read it back
        setattr(model.config, data.ALPHA_BACKGROUND_KEY, recipe.data.alpha_background)
    size_px = recipe.model.image_size
    seed = recipe.train.seed
    workers = recipe.data.num_workers
    if workers is None:
        workers = data.default_num_workers(accelerator.device.type, accelerator.num_processes)
    pin = accelerator.device.type == "cuda"
    sampler, class_weights = (None, None) if streamed else task.balancing(recipe.data.class_balance, splits, seed)
    fitted = wise_ft_start = None
    # A resumed run fits the probe again only for WiSE-FT's average: its model is the start the average goes back to,
    # and the probe, deterministic, gives the same head as before the stop.
    averages = method.probes and method.fine_tunes and recipe.train.wise_ft_alpha < 1
    if method.probes and (averages or not resuming):
        fitted = fit_head_by_probe(model, splits, recipe, processor, accelerator, workers, task, class_weights,
                                   fine_tuned_after=method.fine_tunes)
    if averages:
        wise_ft_start = wise_ft.snapshot(model)
    if not method.fine_tunes:
        freeze_all_but_heads(model)
    if teacher is not None and vit.has_distillation_token(model):
        model = vit.with_distillation_head(model)  # DeiT: its distillation token gets a head of its own
    if recipe.model.lora is not None:
        model = vit.apply_lora(model, recipe.model.lora)

    resample = data.resample_of(processor)  # training resizes as evaluation does

    def train_pixels(image, index, epoch):
        return data.train_transform(image, size_px, data.sample_rng(seed, epoch, index), recipe.data, resample)

    if streamed:  # data.class_balance is refused with streaming (the recipe says why)
        train_loader, eval_loader = streaming.make_loaders(splits, recipe.data, seed, recipe.train.batch_size, workers,
                                                           accelerator, train_pixels, processor, size_px)
    else:
        train_set = data.train_dataset(splits, recipe.data, size_px, train_pixels)
        eval_set = data.eval_dataset(splits, recipe.data, processor, size_px)
        train_loader = data.make_loader(train_set, recipe.train.batch_size, True, seed, workers, pin, sampler,
                                        distill.collate_with_digests if caches_teacher_logits(recipe) else data.collate)
        eval_loader = data.make_loader(eval_set, recipe.train.batch_size, False, seed, workers, pin)
    optimizer = build_optimizer(model, recipe, accelerator.device.type)
    scheduler = build_scheduler(optimizer, recipe, total_steps)
    batch_augmenter = augment.BatchAugmenter(recipe.augment, len(splits.labels), seed,
                                             augment.total_epochs(total_steps, size.steps_per_epoch),
                                             accelerator.process_index, recipe.train.label_smoothing,
                                             mix_targets=task.mixed_targets)
    identity = dict(splits.identity if streamed else data.identity(splits))
    if teacher is not None:  # what the student also learned from: a resume refuses another teacher
        identity["teacher_weights"] = teacher.digest
    return recipe, Parts(task=task, model=model, processor=processor, labels=splits.labels, train_loader=train_loader,
                         eval_loader=eval_loader, optimizer=optimizer, scheduler=scheduler, normalize=normalize,
                         augment=batch_augmenter, steps_per_epoch=size.steps_per_epoch, total_steps=total_steps,
                         eval_split=splits.eval_split, position_tables=tables, data_identity=identity,
                         class_weights=None if class_weights is None else class_weights.to(accelerator.device),
                         teacher=teacher, probe=fitted, data_facts=data_facts, wise_ft_start=wise_ft_start)


def fit_head_by_probe(model, splits, recipe: Recipe, processor, accelerator: Accelerator, workers: int,
                      task: tasks.Task, class_weights, fine_tuned_after: bool) -> probe.ProbeResult:
    """The linear probe: the head fitted on the frozen features of every training image, computed once in the
    split's order (by each process: every process fits the same head), preprocessed as evaluation does; printed with
    its cost. Without gradients a batch costs about a third of a training step's: four times the batch. The features
    are float32 where the head is the final model, in the run's precision where fine-tuning goes on
    (probe.head_inputs)."""
    images = data.train_dataset_as_evaluated(splits, recipe.data, processor, recipe.model.image_size)
    loader = data.make_loader(images, 4 * recipe.train.batch_size, False, recipe.train.seed, workers,
                              accelerator.device.type == "cuda")
    model.to(accelerator.device)
    result = probe.probe(model, display.passes(loader, "features", accelerator.is_main_process), accelerator, task,
                         class_weights, mixed_precision=fine_tuned_after)
    if accelerator.is_main_process:
        display.say(result.describe())
    return result


def freeze_all_but_heads(model) -> None:
    """train.method=linear_probe: the backbone never changes, and the count of trainable parameters says so."""
    heads = tuple(f"{name}." for name in vit.head_names(model))
    for name, parameter in model.named_parameters():
        parameter.requires_grad = name.startswith(heads)


def check_training_data(splits: data.Splits | streaming.StreamedSplits, recipe: Recipe,
                        accelerator: Accelerator, task: tasks.Task) -> dict:
    """Say what the data loader noticed (a label file found multi-label, labels with no training image, images with
    no label) and refuse training images that are mostly one flat colour where the task finds that suspect; returns
    what metrics.json records of the training split. A stream is not read ahead of training: only what its metadata
    says is known."""
    notes = list(getattr(splits, "notes", []))
    facts = {} if recipe.data.streaming else data.training_facts(splits)
    if not recipe.data.streaming:
        notes += data.training_facts_notes(facts, len(splits.train))
        flat = data.flat_images(splits, recipe.data, recipe.train.seed, task.flat_image_suspect)
        if flat.refuses(recipe.data):
            raise RunError(f"{flat.problem(recipe.data)}; or set data.allow_flat_images=true to train anyway")
        notes += [flat.problem(recipe.data)] if flat.flat else []
    if accelerator.is_main_process:
        for note in notes:
            display.say(f"data: {note}")
    return facts


def caches_teacher_logits(recipe: Recipe) -> bool:
    return recipe.train.distill is not None and recipe.train.distill.cache_logits


def cache_teacher_logits(parts: Parts, recipe: Recipe, accelerator: Accelerator) -> None:
    """train.distill.cache_logits: the teacher labels the training images once, here, not on every batch (every
    process, each the whole split; see distill.label_training_images)."""
    if not caches_teacher_logits(recipe):
        return
    started = time.perf_counter()
    images = parts.train_loader.dataset
    parts.teacher_cache = distill.label_training_images(parts.teacher, images, recipe.train.batch_size,
                                                        parts.normalize.rescale, parts.train_loader.num_workers)
    if accelerator.is_main_process:
        display.say(f"train.distill.cache_logits: the teacher labelled the {len(images):,} training images once, in "
                    f"{time.perf_counter() - started:.1f} s")


def prepare(accelerator: Accelerator, parts: Parts, recipe: Recipe) -> None:
    """Compile the model if model.compile says so (`recipe`: as run), then hand model, optimiser and loaders to Accelerate
    (DDP wrapping is a collective: all processes at once)."""
    model = parts.model
    # Never before sharding (run() refused model.compile=true there, auto resolves to false): Accelerate compiles a
    # sharded model itself, after sharding, when its config file has a dynamo_config.
    if recipe.model.compile and not sharding.is_sharded(accelerator):
        model, where_attention_runs = compiling.compile_for_training(model)
        if accelerator.is_main_process:
            display.say(f"model.compile: {where_attention_runs}")
    # Prepared (not register_for_checkpointing), the scheduler is saved as scheduler.bin and read back with
    # torch.load(weights_only=True); a registered object is read back with weights_only=False, a full unpickle.
    if recipe.data.streaming:  # each process already reads only its share: Accelerate must not deal it out again
        parts.model, parts.optimizer, parts.scheduler = accelerator.prepare(model, parts.optimizer, parts.scheduler)
        return
    parts.model, parts.optimizer, parts.train_loader, parts.eval_loader, parts.scheduler = accelerator.prepare(
        model, parts.optimizer, parts.train_loader, parts.eval_loader, parts.scheduler)


def run(recipe: Recipe, callbacks: Iterable[Callback] = ()) -> dict:
    """Train, evaluate, export and (optionally) push; returns the final metrics. `callbacks` observe this run,
    after those registered with vit_finetune.callbacks.register (see that module for the events)."""
    refuse_a_lone_process()  # `accelerate launch --cpu --num_processes 2` starts this process alone
    watch_launcher(grace_s=recipe.train.collective_timeout_s)  # a killed launcher must not leave this one training
    check_output_dir(recipe)
    sharding.refuse_unsupported(recipe, sharding.requested_engine())
    if recipe.hub.push:
        hub.require_token()
        hub.request_timeout()  # a malformed VIT_FINETUNE_HUB_TIMEOUT fails now, not after the training
    tracking.check_trackers(recipe.train.report_to)
    accelerator = make_accelerator(recipe)
    threads = recipe.train.cpu_threads if accelerator.device.type == "cpu" else None
    with torch_threads(threads):  # before any weight exists: every sum splits the same way
        # One process per machine downloads; the others then read its cache, so only it talks to the Hub.
        config = local_main_first(accelerator, partial(check_base_and_data, recipe, accelerator))
        # CLIP and SigLIP keep the vision tower's sizes under vision_config, as every family entry knows.
        too_big = memory.why_it_cannot_fit(vit.family_of(config).vision_config(config), recipe, accelerator.device)
        if too_big:
            raise RunError(too_big)
        lock = hold_output_dir(accelerator, recipe)  # the first write into output_dir
        try:
            return _run(recipe, callbacks, accelerator)
        except Exception:
            said = outputs.after_a_failed_run(Path(recipe.output_dir)) if accelerator.is_main_process else None
            if said:
                display.say(said)
            raise
        finally:
            lock.release()


def check_base_and_data(recipe: Recipe, accelerator: Accelerator):
    """The base's config (config only: a wrong base or size fails before any download); a Hub dataset that cannot
    be fetched is refused here too, before output_dir is touched."""
    with hub.offline_unless(accelerator.is_local_main_process):
        config = vit.load_base_config(recipe.model)
        data.refuse_unreachable(recipe.data)
        if recipe.train.distill is not None:
            distill.teacher_config(recipe.train.distill)  # a missing or multi-label teacher fails now
    return config


@contextmanager
def torch_threads(count: int | None):
    """torch's intra-op thread count set to `count` for the run (None: left as it is), then restored, so a run in
    a process that goes on (a notebook, a test session) leaves the next run's arithmetic as it found it."""
    before = torch.get_num_threads()
    if count:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def hold_output_dir(accelerator: Accelerator, recipe: Recipe) -> outputs.RunLock:
    """The main process locks output_dir for the run's life and claims, in its manifest, the names a run writes;
    if another run holds the lock, or a machine sees another folder there, every process stops (collectives)."""
    lock = outputs.RunLock(Path(recipe.output_dir))
    refused = _lock_and_claim(lock, recipe) if accelerator.is_main_process else None
    if any_process(accelerator, refused is not None):
        raise RunError(refused or "the main process could not lock output_dir")
    # A process that does not see the check file looks again for a while; the others must not time out meanwhile.
    patience_s = min(SHARED_FOLDER_PATIENCE_S, recipe.train.collective_timeout_s / 2)
    unshared = unshared_folder_refusal(accelerator, Path(recipe.output_dir), layout.SHARED_CHECK, patience_s)
    if unshared:
        lock.release()
        raise RunError(f"output_dir={unshared}")
    return lock


def _lock_and_claim(lock: outputs.RunLock, recipe: Recipe) -> str | None:
    """The main process's first writes into output_dir: the lock, the manifest's claim and the trackers' folder;
    why one failed (a refusal, the lock released), or None."""
    output_dir = Path(recipe.output_dir)
    refused = lock.acquire()
    if refused:
        return refused
    try:
        said = outputs.recover_interrupted_overwrite(output_dir, recipe.train.resume is not None)
        if said:
            display.say(said)
        outputs.claim(output_dir)
    except outputs.OutputDirError as error:
        refused = str(error)
    refused = refused or tracking.tracker_folder_refusal(output_dir, recipe.train.report_to)
    if refused:
        lock.release()
    return refused


def _run(asked: Recipe, callbacks: Iterable[Callback], accelerator: Accelerator) -> dict:
    """run() once output_dir is held: data, the run's plan, model, the loop, evaluation, export and push. `asked`: the
    recipe as given, which a resume compares with its checkpoint's and each checkpoint records; everything after
    the plan reads the recipe as run."""
    output_dir = Path(asked.output_dir)

    def load_data_and_model() -> tuple[Path | None, Recipe, Parts]:
        with hub.offline_unless(accelerator.is_local_main_process):
            set_seed(asked.train.seed)
            resume_from = checkpoint.resolve_resume(asked.train.resume, output_dir, accelerator.is_main_process)
            if resume_from:
                checkpoint.refuse_changed_recipe(resume_from, asked)  # before any data or weights are loaded
            return resume_from, *build_parts(asked, accelerator, resuming=resume_from is not None)

    # As in run(): one process per machine downloads, the others then read its cache.
    resume_from, recipe, parts = local_main_first(accelerator, load_data_and_model)
    prepare(accelerator, parts, recipe)
    state = checkpoint.TrainState()
    if resume_from:
        resume_from, state = checkpoint.load_resumable(accelerator, resume_from, asked, parts.data_identity)
    state.data = parts.data_identity  # recorded in each checkpoint: a resume refuses other data
    if parts.probe is not None:  # a resumed run's comes from its checkpoint
        state.probe = parts.probe.as_metrics()
    if resume_from:
        reapply_hyperparameters(parts, recipe)
    cache_teacher_logits(parts, recipe, accelerator)
    training = TrainingRun(recipe, accelerator, parts, state, asked)
    keeper = selection.WeightSelection(recipe, accelerator.unwrap_model(parts.model, keep_torch_compile=False),
                                       parts.task, parts.labels, measure=lambda: loop.measure(training))  # may refuse the recipe
    if accelerator.is_main_process:
        draw = None
        if parts.position_tables and recipe.pictures:
            draw = partial(pictures.draw_position_similarity, parts.position_tables["before"],
                           parts.position_tables["after"])
        # Every check before training has passed: overwrite=true sets the previous run aside here, not before.
        run_outputs.begin_outputs(output_dir, recipe, recipe.overwrite, draw)
        trainable, total = vit.count_parameters(parts.model)
        display.say(f"{vit.describe(accelerator.unwrap_model(parts.model).config)}; trainable {trainable:,} of {total:,} "
                    f"parameters; {parts.total_steps} steps on {accelerator.num_processes} process(es)"
                    + (f"; resuming from {resume_from} at step {state.step}" if resume_from else ""))
        display.say(evaluation.describe_eval_split(parts.eval_split, len(parts.eval_loader.dataset), recipe.data))

    stream_positions = [loop.StreamPositions(parts.train_loader)] if recipe.data.streaming else []
    hooks = CallbackList([keeper, *stream_positions, *REGISTERED, *tracking.callbacks_for(recipe.train.report_to),
                          *callbacks])
    if resume_from:
        hooks.on_load_checkpoint(training, resume_from)
    started = time.perf_counter()
    loop.train_loop(training, hooks)
    training_seconds = time.perf_counter() - started
    # An early stop follows an evaluation of these very weights; otherwise the last step's are evaluated here.
    final = None if state.stopped_early else loop.evaluate(training, hooks)
    final, average = average_with_probe(training, final)
    metrics, predictions = keeper.final_result(training, final)  # the weights it chose are now the model's
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
    hooks.on_train_end(training, accelerator.unwrap_model(parts.model, keep_torch_compile=False))
    # Sharded, the weights are gathered into one whole model on the main process: every process must take part.
    gathered = accelerator.get_state_dict(parts.model) if sharding.is_sharded(accelerator) else None
    if accelerator.is_main_process:
        info = run_outputs.run_info(device_name(accelerator.device), accelerator.num_processes, accelerator.mixed_precision,
                               state.history, training_seconds, resume_from, metrics)
        if parts.probe is not None:
            info["probe_seconds"] = round(parts.probe.seconds, 1)
        draw = None
        # The pictures show eval images by their place in the split, which a stream cannot look up.
        if recipe.pictures and not recipe.data.streaming:
            draw = partial(parts.task.draw, predictions, parts.eval_loader.dataset, parts.labels, metrics=metrics)
        save_final(accelerator, parts, recipe, metrics, state, info, draw, gathered)
        keeper.remove_best_file()
        if "distillation" in metrics:
            display.say(f"train.distill: {distill.describe(metrics['distillation'])}")
        if "skipped_steps" in metrics:
            display.say(loss_scale.describe(metrics["skipped_steps"], state.step))
        print(f"eval {parts.task.headline(metrics)} on {metrics['eval_samples']} images; outputs in {output_dir}")
        if recipe.hub.push:
            url = publish.push_folder(output_dir, recipe.hub.repo_id, recipe.hub.private)
            print(f"pushed to {url}")
    accelerator.wait_for_everyone()
    accelerator.end_training()
    let_gloo_threads_settle(accelerator)
    return metrics


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
        display.say(selection.describe_average(report))
    return kept, report


def device_name(device: torch.device) -> str:
    """For run_info.json and the card: the accelerator's model name, or the CPU and its usable cores."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{device.type} ({data.cpu_cores()} cores)" if device.type == "cpu" else device.type


def save_final(accelerator: Accelerator, parts: Parts, recipe: Recipe, metrics: dict, state: checkpoint.TrainState,
               info: dict | None = None, draw_pictures=None, gathered: dict | None = None) -> None:
    """The output folder (model, processor, card, metrics...); `gathered`: a sharded model's full weights."""
    output_dir = Path(recipe.output_dir)
    trained = accelerator.unwrap_model(parts.model, keep_torch_compile=False)
    if gathered is not None:
        trained = sharding.unsharded_model(trained, recipe, gathered)
    model, adapter = (vit.merged_copy(trained), trained) if vit.is_lora(trained) else (trained, None)
    parts.task.finish_config(model.config, metrics)  # e.g. multi-label's chosen thresholds, which predict reads
    try:
        run_outputs.write_outputs(output_dir, model, parts.processor, recipe, metrics, state.history, parts.labels,
                             adapter_model=adapter, run_info=info, draw_pictures=draw_pictures)
    except checkpoint.WRITE_ERRORS as error:
        shutil.rmtree(output_dir / layout.STAGING, ignore_errors=True)  # give back the space the attempt took
        previous = checkpoint.latest_checkpoint(output_dir)
        raise RunError(
            f"could not write the final model into {output_dir} ({layout.describe_write_error(error, output_dir)}); "
            "nothing there looks finished. "
            + (f"The last checkpoint is intact: {previous}. Free disk space, then run the same command with "
               "train.resume=auto (only the steps after that checkpoint are redone)"
               if previous else "No checkpoint was kept (train.checkpoint_every_steps is not set); "
               "free disk space and train again")
        ) from None
