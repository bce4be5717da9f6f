"""Training: one run from a validated recipe to a finished output folder, driven by Accelerate.

`run()` reads top to bottom: check everything cheap first, then data, model, optimiser, the loop
(each optimiser step: forward, backward, clip, step, then log / evaluate / checkpoint / stop), final
evaluation, the choice of the weights to keep (selection.py: EMA, best evaluation), export and push.
"""

from __future__ import annotations

import math
import shutil
import signal
import time
from dataclasses import dataclass, field
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Iterable, Iterator

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, InitProcessGroupKwargs, ProjectConfiguration, set_seed
from torch.distributed.tensor import DTensor

from . import augment, balance, checkpoint, data, evaluation, export, hub, memory, model as vit, optim, outputs
from . import pictures, progress as display, selection, sharding, streaming, tracking
from .callbacks import REGISTERED, Callback, CallbackList, TrainingRun
from .errors import VitFinetuneError
from .processes import (SHARED_FOLDER_PATIENCE_S, any_process, check_launch, sum_over_processes,
                        unshared_folder_refusal)
from .recipe import Recipe, write_recipe


class RunError(VitFinetuneError):
    """A run refused before it started, or whose final model could not be written, with the reason and the fix."""


class NonFiniteLoss(VitFinetuneError):
    """The loss, a gradient or the weights became NaN/Inf; nothing from then on was saved."""

    exit_code = 3


class Interrupted(VitFinetuneError):
    """SIGINT/SIGTERM stopped training (after a checkpoint, if checkpoints are on); the shell's code for Ctrl-C."""

    exit_code = 130


@dataclass
class Parts:
    model: torch.nn.Module
    processor: object
    labels: list[str]
    train_loader: torch.utils.data.DataLoader | streaming.StreamLoader  # the latter with data.streaming
    eval_loader: torch.utils.data.DataLoader | streaming.StreamLoader
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    normalize: data.PixelNormalizer
    augment: augment.BatchAugmenter  # DeiT's batch augmentations, on the device; evaluation never uses it
    steps_per_epoch: int
    total_steps: int
    recipe_as_run: Recipe  # every `auto` resolved: what the output's recipe.yaml and card show (checkpoints keep auto)
    eval_split: str | None = None  # None: held out from train (data.eval_fraction)
    position_tables: dict = field(default_factory=dict)  # "before"/"after" the resample, for the picture
    data_identity: dict = field(default_factory=dict)  # the labels and the splits' fingerprints, in each checkpoint
    class_weights: torch.Tensor | None = None  # the loss's per-class weights (data.class_balance=weights), on the device


class InterruptFlag:
    """SIGINT/SIGTERM set a flag; the loop checkpoints at the next optimiser step and exits."""

    def __init__(self):
        self.raised = False
        self.previous = {signum: signal.signal(signum, self._handle) for signum in (signal.SIGINT, signal.SIGTERM)}

    def restore(self) -> None:
        """After the loop, Ctrl-C must stop evaluation, export or a push at once, as usual."""
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)

    def _handle(self, signum, frame):
        if self.raised:  # a second Ctrl-C means: stop now
            raise KeyboardInterrupt
        self.raised = True


def check_output_dir(recipe: Recipe) -> None:
    """Refuse to mix with or destroy an earlier run unless told to resume or overwrite, to write over what this
    toolkit did not write, or to write into the dataset's folder."""
    output_dir = Path(recipe.output_dir)
    refused = outputs.refusal(recipe, export.run_names())
    if refused:
        raise RunError(refused)
    if recipe.overwrite or recipe.train.resume is not None:
        if recipe.train.resume is not None and export.is_finished(output_dir):
            raise RunError(f"{output_dir} already holds a finished run; nothing to resume. "
                           "Use overwrite=true to train again, or another output_dir")
        return
    if export.is_finished(output_dir):
        raise RunError(f"output_dir={str(output_dir)!r} already holds a finished run ({export.METRICS_FILE}). "
                       "Fix: choose another output_dir, or pass overwrite=true to replace it")
    if checkpoint.complete_checkpoints(output_dir):
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
    return accelerator


def _accelerator(recipe: Recipe) -> Accelerator:
    t = recipe.train
    return Accelerator(
        # Without cpu=True, Accelerate ignores torchrun's ranks on a machine with no accelerator and every
        # process believes it is the main one.
        cpu=not torch.accelerator.is_available(),
        mixed_precision=t.mixed_precision,
        gradient_accumulation_steps=t.grad_accum,
        # non_blocking: with pinned memory the copy overlaps the previous step instead of waiting for it
        dataloader_config=DataLoaderConfiguration(even_batches=True, non_blocking=torch.cuda.is_available()),
        step_scheduler_with_optimizer=False,
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=t.collective_timeout_s))],
        # Trackers (train.report_to) are Accelerate's; file-based ones write under output_dir/runs.
        log_with=t.report_to or None,
        project_config=ProjectConfiguration(project_dir=str(Path(recipe.output_dir) / tracking.TRACKER_DIR)),
    )


def build_optimizer(model: torch.nn.Module, recipe: Recipe, device_type: str) -> torch.optim.Optimizer:
    t = recipe.train
    config, family = model.config, vit.family_of(model.config)
    block_index = (lambda name: family.block_index(name, config)) if t.layer_decay is not None else None
    groups = optim.parameter_groups(model, t.weight_decay, t.layer_decay, block_index, family.num_blocks(config))
    for group in groups:
        group["lr"] = t.lr * group["lr_scale"]
    if t.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=t.lr, momentum=t.momentum)
    return torch.optim.AdamW(groups, lr=t.lr, fused=device_type == "cuda")


def build_scheduler(optimizer, recipe: Recipe, total_steps: int):
    t = recipe.train

    def factor(step: int) -> float:
        if step < t.warmup_steps:
            return (step + 1) / (t.warmup_steps + 1)
        progress = (step - t.warmup_steps) / max(1, total_steps - t.warmup_steps)
        if t.scheduler == "cosine":
            return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
        if t.scheduler == "linear":
            return max(0.0, 1 - progress)
        return 1.0

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def reapply_hyperparameters(parts: Parts, recipe: Recipe) -> None:
    """After a resume: the loaded optimizer and scheduler states carry the lr, weight decay and momentum of
    the checkpoint. They equal the recipe's unless a change was accepted with train.resume_ignore_changes,
    and then the recipe's values must apply from the resumed step on, not be silently replaced."""
    t = recipe.train
    scheduler = parts.scheduler.scheduler  # the LambdaLR inside Accelerate's wrapper
    groups = parts.optimizer.param_groups
    # A checkpoint written before groups carried lr_scale and decayed had two: decayed, then not decayed.
    scheduler.base_lrs = [t.lr * group.get("lr_scale", 1.0) for group in groups]
    for index, (group, base_lr, factor) in enumerate(zip(groups, scheduler.base_lrs, scheduler.lr_lambdas)):
        group.update(initial_lr=base_lr, lr=base_lr * factor(scheduler.last_epoch),
                     weight_decay=t.weight_decay if group.get("decayed", index == 0) else 0.0)
        if "momentum" in group:
            group["momentum"] = t.momentum


def build_parts(recipe: Recipe, accelerator: Accelerator) -> Parts:
    streamed = recipe.data.streaming
    if streamed:
        splits = streaming.open_streams(recipe.data, accelerator.process_index, accelerator.num_processes)
        rows = streaming.epoch_rows(splits, recipe, accelerator.num_processes)
    else:
        splits = data.load_splits(recipe.data, recipe.train.seed)
        rows = len(splits.train)
    tables: dict = {}
    model = vit.build_model(recipe.model, splits.labels,
                            on_resample=lambda before, after: tables.update(before=before, after=after))
    processor = vit.load_image_processor(recipe.model, recipe.model.image_size)
    if recipe.model.lora is not None:
        model = vit.apply_lora(model, recipe.model.lora)
    size = recipe.model.image_size
    seed = recipe.train.seed
    images_per_step = recipe.train.batch_size * accelerator.num_processes * recipe.train.grad_accum
    steps_per_epoch = math.ceil(math.ceil(rows / (recipe.train.batch_size * accelerator.num_processes))
                                / recipe.train.grad_accum)
    total_steps = recipe.train.max_steps or recipe.train.epochs * steps_per_epoch
    if recipe.train.warmup_steps >= total_steps:
        raise RunError(f"train.warmup_steps={recipe.train.warmup_steps} is not below the run's {total_steps} steps; "
                       "lower it or train longer")
    as_run = resolve_auto(recipe, total_steps * images_per_step, accelerator)

    def train_pixels(image, index, epoch):
        return data.train_transform(image, size, data.sample_rng(seed, epoch, index), as_run.data)

    workers = recipe.data.num_workers
    if workers is None:
        workers = data.default_num_workers(accelerator.device.type, accelerator.num_processes)
    if streamed:
        train_loader, eval_loader = streaming.make_loaders(splits, recipe.data, seed, recipe.train.batch_size, workers,
                                                           accelerator, train_pixels, processor, size)
        class_weights = None  # data.class_balance is refused with streaming (the recipe says why)
    else:
        pin = accelerator.device.type == "cuda"
        train_set = data.train_dataset(splits, recipe.data, size, train_pixels)
        eval_set = data.eval_dataset(splits, recipe.data, processor, size)
        sampler, class_weights = balance.balancing(recipe.data.class_balance, splits, seed)
        train_loader = data.make_loader(train_set, recipe.train.batch_size, True, seed, workers, pin, sampler)
        eval_loader = data.make_loader(eval_set, recipe.train.batch_size, False, seed, workers, pin)
    optimizer = build_optimizer(model, recipe, accelerator.device.type)
    scheduler = build_scheduler(optimizer, recipe, total_steps)
    batch_augmenter = augment.BatchAugmenter(recipe.augment, len(splits.labels), seed,
                                             augment.total_epochs(total_steps, steps_per_epoch),
                                             accelerator.process_index, recipe.train.label_smoothing)
    return Parts(model, processor, splits.labels, train_loader, eval_loader, optimizer, scheduler,
                 data.PixelNormalizer(processor, accelerator.device), batch_augmenter, steps_per_epoch, total_steps,
                 as_run, splits.eval_split, tables, splits.identity if streamed else data.identity(splits),
                 None if class_weights is None else class_weights.to(accelerator.device))


def resolve_auto(recipe: Recipe, images_seen: int, accelerator: Accelerator) -> Recipe:
    """The recipe with every `auto` replaced by its value for this run, which is printed."""
    if recipe.data.crop_scale != "auto":
        return recipe
    crop_scale = data.auto_crop_scale(images_seen)
    if accelerator.is_main_process:
        display.say(f"data.crop_scale=auto -> {list(crop_scale)} for {images_seen:,} training images seen; "
                    "set data.crop_scale=[low, high] to choose")
    return recipe.model_copy(update={"data": recipe.data.model_copy(update={"crop_scale": crop_scale})})


def prepare(accelerator: Accelerator, parts: Parts, recipe: Recipe) -> None:
    """Hand model, optimiser and loaders to Accelerate (DDP wrapping is a collective: all processes at once)."""
    model = parts.model
    if _compiles(recipe, accelerator):
        model = torch.compile(model)
    # Prepared (not register_for_checkpointing), the scheduler is saved as scheduler.bin and read back with
    # torch.load(weights_only=True); a registered object is read back with weights_only=False, a full unpickle.
    if recipe.data.streaming:  # each process already reads only its share: Accelerate must not deal it out again
        parts.model, parts.optimizer, parts.scheduler = accelerator.prepare(model, parts.optimizer, parts.scheduler)
        return
    parts.model, parts.optimizer, parts.train_loader, parts.eval_loader, parts.scheduler = accelerator.prepare(
        model, parts.optimizer, parts.train_loader, parts.eval_loader, parts.scheduler)


def _compiles(recipe: Recipe, accelerator: Accelerator) -> bool:
    """model.compile, or by default on CUDA; never before sharding (run() refused model.compile=true there):
    Accelerate compiles a sharded model itself, after sharding, when its config file has a dynamo_config."""
    if sharding.is_sharded(accelerator):
        return False
    return recipe.model.compile if recipe.model.compile is not None else accelerator.device.type == "cuda"


def train_step(accelerator: Accelerator, parts: Parts, batch: dict, recipe: Recipe) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward and backward on one batch; on accumulation boundaries, clip and step. Returns (loss, finite flag)."""
    with accelerator.accumulate(parts.model):
        loss = batch_loss(parts, batch, recipe)
        accelerator.backward(loss)
        finite = torch.isfinite(loss.detach())
        if accelerator.sync_gradients and recipe.train.max_grad_norm is not None:
            norm = accelerator.clip_grad_norm_(parts.model.parameters(), recipe.train.max_grad_norm)
            if isinstance(norm, DTensor):  # FSDP2's norm over all shards; a collective, as clipping is
                norm = norm.full_tensor()
            if norm is not None:  # DeepSpeed clips inside its own step and may not know the norm yet
                finite = finite & torch.isfinite(torch.as_tensor(norm, device=finite.device))
        parts.optimizer.step()
        if accelerator.sync_gradients:
            parts.scheduler.step()
        parts.optimizer.zero_grad(set_to_none=True)
    return loss.detach(), finite


def batch_loss(parts: Parts, batch: dict, recipe: Recipe) -> torch.Tensor:
    """Mean cross-entropy over the batch's real images, leaving out the places of images skipped as bad; 0, with a
    zero gradient, when all were skipped (the forward and backward still run: under DDP every process must join
    each step's gradient all-reduce)."""
    labels = batch["labels"]
    pixels, soft_targets = parts.augment(parts.normalize.rescale(batch["pixel_values"]), labels, *batch["position"])
    logits = parts.model(pixel_values=parts.normalize.standardize(pixels)).logits
    if soft_targets is not None:  # a Mixup/CutMix batch; label smoothing is already in its targets
        return augment.soft_target_loss(logits, soft_targets, parts.class_weights)
    per_image = torch.nn.functional.cross_entropy(logits.float(), labels, weight=parts.class_weights,
                                                  reduction="none", ignore_index=data.SKIPPED_LABEL,
                                                  label_smoothing=recipe.train.label_smoothing)
    # A weighted mean over the real images (weight 1 each without class weights), as cross_entropy's own mean is;
    # computed on the device, no sync. With no real image the sum is 0 and so is the loss, with a zero gradient.
    real = (labels != data.SKIPPED_LABEL).float()
    image_weights = real if parts.class_weights is None else parts.class_weights[labels.clamp(min=0)] * real
    total = image_weights.sum()
    return per_image.sum() / torch.where(total > 0, total, torch.ones_like(total))


def run(recipe: Recipe, callbacks: Iterable[Callback] = ()) -> dict:
    """Train, evaluate, export and (optionally) push; returns the final metrics. `callbacks` observe this run,
    after those registered with vit_finetune.callbacks.register (see that module for the events)."""
    lone = check_launch()  # `accelerate launch --cpu --num_processes 2` starts this process alone
    if lone:
        raise RunError(lone)
    check_output_dir(recipe)
    sharding.refuse_unsupported(recipe, sharding.requested_engine())
    if recipe.hub.push:
        hub.require_token()
    tracking.check_trackers(recipe.train.report_to)
    accelerator = make_accelerator(recipe)
    # One process per machine downloads; the others then read its cache, so only it talks to the Hub.
    with accelerator.local_main_process_first(), hub.offline_unless(accelerator.is_local_main_process):
        config = vit.load_base_config(recipe.model)  # config only: a wrong base or size fails before any download
    # CLIP and SigLIP keep the vision tower's sizes under vision_config, as every family entry knows.
    too_big = memory.why_it_cannot_fit(vit.family_of(config).vision_config(config), recipe, accelerator.device)
    if too_big:
        raise RunError(too_big)
    lock = hold_output_dir(accelerator, recipe)  # the first write into output_dir
    try:
        return _run(recipe, callbacks, accelerator)
    finally:
        lock.release()


def hold_output_dir(accelerator: Accelerator, recipe: Recipe) -> outputs.RunLock:
    """The main process locks output_dir for the run's life and claims, in its manifest, the names a run writes;
    if another run holds the lock, or a machine sees another folder there, every process stops (collectives)."""
    lock = outputs.RunLock(Path(recipe.output_dir))
    refused = lock.acquire() if accelerator.is_main_process else None
    if any_process(accelerator, refused is not None):
        raise RunError(refused or "the main process could not lock output_dir")
    if accelerator.is_main_process:
        outputs.claim(Path(recipe.output_dir), export.run_names())
    # A process that does not see the check file looks again for a while; the others must not time out meanwhile.
    patience_s = min(SHARED_FOLDER_PATIENCE_S, recipe.train.collective_timeout_s / 2)
    unshared = unshared_folder_refusal(accelerator, Path(recipe.output_dir), outputs.SHARED_CHECK, patience_s)
    if unshared:
        lock.release()
        raise RunError(f"output_dir={unshared}")
    return lock


def _run(recipe: Recipe, callbacks: Iterable[Callback], accelerator: Accelerator) -> dict:
    """run() once output_dir is held: data, model, the loop, evaluation, export and push."""
    output_dir = Path(recipe.output_dir)
    # As in run(): one process per machine downloads, the others then read its cache.
    with accelerator.local_main_process_first(), hub.offline_unless(accelerator.is_local_main_process):
        set_seed(recipe.train.seed)
        if accelerator.is_main_process and recipe.overwrite:
            export.clear_previous_run(output_dir)
        resume_from = checkpoint.resolve_resume(recipe.train.resume, output_dir, accelerator.is_main_process)
        if resume_from:
            checkpoint.refuse_changed_recipe(resume_from, recipe)  # before any data or weights are loaded
        parts = build_parts(recipe, accelerator)
    prepare(accelerator, parts, recipe)
    state = checkpoint.TrainState()
    if resume_from:
        resume_from, state = checkpoint.load_resumable(accelerator, resume_from, recipe, parts.data_identity)
    state.data = parts.data_identity  # recorded in each checkpoint: a resume refuses other data
    if resume_from:
        reapply_hyperparameters(parts, recipe)
    if accelerator.is_main_process:
        output_dir.mkdir(parents=True, exist_ok=True)
        write_recipe(parts.recipe_as_run, output_dir)
        trainable, total = vit.count_parameters(parts.model)
        display.say(f"{vit.describe(accelerator.unwrap_model(parts.model).config)}; trainable {trainable:,} of {total:,} "
                    f"parameters; {parts.total_steps} steps on {accelerator.num_processes} process(es)"
                    + (f"; resuming from {resume_from} at step {state.step}" if resume_from else ""))
        display.say(evaluation.describe_eval_split(parts.eval_split, len(parts.eval_loader.dataset), recipe.data))
        if parts.position_tables:
            pictures.draw_position_similarity(parts.position_tables["before"], parts.position_tables["after"],
                                              output_dir / pictures.POSITION_FILE)

    training = TrainingRun(recipe, accelerator, parts, state)
    keeper = selection.WeightSelection(recipe, accelerator.unwrap_model(parts.model, keep_torch_compile=False),
                                       parts.labels, measure=lambda: measure(training))
    stream_positions = [streaming.StreamPositions(parts.train_loader)] if recipe.data.streaming else []
    hooks = CallbackList([keeper, *stream_positions, *REGISTERED, *tracking.callbacks_for(recipe.train.report_to),
                          *callbacks])
    if resume_from:
        hooks.on_load_checkpoint(training, resume_from)
    started = time.perf_counter()
    train_loop(training, hooks)
    training_seconds = time.perf_counter() - started
    # An early stop follows an evaluation of these very weights; otherwise the last step's are evaluated here.
    final = None if state.stopped_early else evaluate(training, hooks)
    metrics, predictions = keeper.final_result(training, final)  # the weights it chose are now the model's
    # skipped_images: bad images skipped over the whole run, by all processes. Each epoch draws every file again,
    # so a bad file counts once per epoch (once more if Accelerate's even_batches padding draws it twice).
    metrics.update(steps=state.step, skipped_images=state.skipped_images)
    hooks.on_train_end(training, accelerator.unwrap_model(parts.model, keep_torch_compile=False))
    # Sharded, the weights are gathered into one whole model on the main process: every process must take part.
    gathered = sharding.full_state_dict(accelerator, parts.model) if sharding.is_sharded(accelerator) else None
    if accelerator.is_main_process:
        info = export.run_info(device_name(accelerator.device), accelerator.num_processes, accelerator.mixed_precision,
                               state.history, training_seconds, resume_from, metrics)
        # The pictures show eval images by their place in the split, which a stream cannot look up.
        draw = None if recipe.data.streaming else partial(pictures.draw_evaluation, predictions,
                                                          parts.eval_loader.dataset, parts.labels)
        save_final(accelerator, parts, parts.recipe_as_run, metrics, state, info, draw, gathered)
        keeper.remove_best_file()
        print(f"eval accuracy {metrics['accuracy']:.4f} on {metrics['eval_samples']} images; outputs in {output_dir}")
        if recipe.hub.push:
            url = hub.push_folder(output_dir, recipe.hub.repo_id, recipe.hub.private)
            print(f"pushed to {url}")
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return metrics


def device_name(device: torch.device) -> str:
    """For run_info.json and the card: the accelerator's model name, or the CPU and its usable cores."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{device.type} ({data.cpu_cores()} cores)" if device.type == "cpu" else device.type


class TrainLog:
    """The loop's counters and its progress bar: loss and images since the last log entry, bad images skipped
    by this process. `write` turns the counters into one history entry for all processes."""

    def __init__(self, accelerator: Accelerator, state: checkpoint.TrainState, total_steps: int):
        self.accelerator = accelerator
        # A redrawn bar on a terminal, one plain line per log entry in a log file or CI, nothing with --quiet.
        self.progress = display.progress(total_steps, state.step, "train", enabled=accelerator.is_main_process)
        # Skipped images are counted per process and summed over processes only where the count is saved (each
        # checkpoint, the end): reading a count back every step would sync host and device.
        self.skipped_before, self.skipped_here = state.skipped_images, 0  # all processes' at a resume; ours since
        self.skipped_this_epoch: list[str] = []  # this process's bad files, named on the console at the epoch's end
        self.loss_total = torch.zeros((), device=accelerator.device)
        self._restart()

    def _restart(self) -> None:
        self.loss_total.zero_()
        self.loss_batches, self.images, self.clock = 0, 0, time.perf_counter()

    def add_batch(self, loss: torch.Tensor, batch: dict) -> None:
        self.skipped_here += len(batch["skipped"])
        self.skipped_this_epoch += batch["skipped"]
        images = batch["labels"].numel() - len(batch["skipped"])  # the real ones: a bad image's place is blank
        if images:  # a batch of skipped images only has no loss to report
            self.loss_total += loss
            self.loss_batches += 1
        self.images += images * self.accelerator.num_processes

    def add_step(self) -> None:
        self.progress.update(1)

    def write(self, state: checkpoint.TrainState, lr: float) -> dict:
        """A collective: append the history entry of the steps since the last one (mean loss over processes, lr,
        images/s), show it on the progress bar and return it."""
        mean_loss = self._mean_loss_over_processes()
        rate = self.images / (time.perf_counter() - self.clock)
        # No "loss" when no process trained on any image since the last entry (all were skipped as bad).
        trained = {} if mean_loss is None else {"loss": mean_loss}
        entry = {"step": state.step, "epoch": state.epoch, **trained, "lr": lr, "images_per_s": rate}
        state.history.append(entry)
        self.progress.set_postfix(loss="-" if mean_loss is None else f"{mean_loss:.4f}", lr=f"{lr:.2e}",
                                  img_s=f"{rate:.0f}")
        self._restart()
        return entry

    def _mean_loss_over_processes(self) -> float | None:
        """The mean batch loss over all processes; None if no process had a batch with images."""
        totals = torch.stack([self.loss_total, torch.tensor(float(self.loss_batches), device=self.loss_total.device)])
        loss_sum, count = self.accelerator.reduce(totals, reduction="sum").tolist()
        return loss_sum / count if count else None

    def count_skipped_into(self, state: checkpoint.TrainState) -> None:
        """A collective: state.skipped_images becomes the count of all processes over the whole run."""
        state.skipped_images = self.skipped_before + sum_over_processes(self.accelerator, self.skipped_here)


def train_loop(run: TrainingRun, callbacks: Callback = Callback()) -> None:
    """Optimiser steps until the run's last one, or until interrupted; SIGINT/SIGTERM checkpoint first."""
    interrupt = InterruptFlag()
    log = TrainLog(run.accelerator, run.state, run.parts.total_steps)
    callbacks.on_train_start(run)
    try:
        _optimise(run, interrupt, log, callbacks)
    except RuntimeError as error:
        if run.accelerator.num_processes > 1 and "timed out" in str(error).lower():
            raise RunError(_collective_timeout_message(run.accelerator, run.recipe, run.state)) from None
        raise
    finally:
        log.progress.close()  # on an error too: its message must start on a line of its own
        interrupt.restore()


def _optimise(run: TrainingRun, interrupt: InterruptFlag, log: TrainLog, callbacks: Callback) -> None:
    """After each optimiser step: check, log, evaluate, checkpoint, stop."""
    state, t, last = run.state, run.recipe.train, run.parts.total_steps
    pending_finite = None  # the previous step's flag: read one step late so the device is never idle waiting
    for finite in _optimiser_steps(run, log, callbacks):
        if pending_finite is not None:
            _stop_if_non_finite(pending_finite, state.step - 1, run.accelerator)
        pending_finite = finite
        callbacks.on_step_end(run)
        if _due(state.step, t.log_every_steps) or state.step == last:
            callbacks.on_log(run, log.write(state, run.parts.scheduler.get_last_lr()[0]))
        if _due(state.step, t.eval_every_steps) and state.step < last:  # run() evaluates the last step's weights
            _evaluate_during_training(run, callbacks)
        stop = state.step >= last or state.stopped_early or _interrupted(interrupt, run.accelerator)
        _checkpoint_if_due(run, finite, log, interrupt.raised, callbacks)
        if interrupt.raised:
            raise Interrupted(_interrupt_message(run.recipe, state))
        if stop:
            break
    if state.batches_done:  # the run ended inside an epoch
        _report_skipped(run.accelerator, run.recipe, state.epoch, log)
    log.count_skipped_into(state)
    if pending_finite is not None:
        _stop_if_non_finite(pending_finite & _weights_finite(run.parts.model), state.step, run.accelerator)


def _optimiser_steps(run: TrainingRun, log: TrainLog, callbacks: Callback) -> Iterator[torch.Tensor]:
    """Forward and backward over the batches, epoch after epoch; yields each optimiser step's finite flag once
    the step is done. An epoch that runs to its end is evaluated, unless train.eval_every_steps is set."""
    accelerator, parts, state = run.accelerator, run.parts, run.state
    while state.step < parts.total_steps and not state.stopped_early:
        for batch in _epoch_batches(run):
            callbacks.on_batch(run, batch)
            batch["position"] = (state.epoch, state.batches_done)  # seeds the batch's augmentation on the device
            loss, finite = train_step(accelerator, parts, batch, run.recipe)
            state.batches_done += 1
            log.add_batch(loss, batch)
            if accelerator.sync_gradients:
                state.step += 1
                log.add_step()
                yield finite
        _report_skipped(accelerator, run.recipe, state.epoch, log)
        state.epoch += 1
        state.batches_done = 0
        if not run.recipe.train.eval_every_steps and state.step < parts.total_steps:
            _evaluate_during_training(run, callbacks)


def _epoch_batches(run: TrainingRun) -> Iterable[dict]:
    """The current epoch's batches from state.batches_done on."""
    parts, state = run.parts, run.state
    if run.recipe.data.streaming:  # its position, restored from the checkpoint, already stands after batches_done
        return parts.train_loader.batches(parts.steps_per_epoch * run.recipe.train.grad_accum - state.batches_done)
    # Through the prepared loader: Accelerate's loader re-sets its sampler's epoch from its own pass
    # counter on every pass, which starts at 0 again in a resumed run (and in skip_first_batches' copy).
    parts.train_loader.set_epoch(state.epoch)
    if state.batches_done:
        return run.accelerator.skip_first_batches(parts.train_loader, state.batches_done)
    return parts.train_loader


def _due(step: int, every: int | None) -> bool:
    """Whether a `*_every_steps` setting (None or 0: never) falls on this step."""
    return bool(every) and step % every == 0


def _checkpoint_if_due(run: TrainingRun, finite: torch.Tensor, log: TrainLog, interrupted: bool,
                       callbacks: Callback) -> None:
    """Every train.checkpoint_every_steps, and at once when interrupted (if checkpoints are on at all); never
    from non-finite weights."""
    every = run.recipe.train.checkpoint_every_steps
    if not every or not (_due(run.state.step, every) or interrupted):
        return
    _stop_if_non_finite(finite & _weights_finite(run.parts.model), run.state.step, run.accelerator)
    log.count_skipped_into(run.state)
    path = checkpoint.save_checkpoint(run.accelerator, Path(run.recipe.output_dir), run.state, run.recipe,
                                      run.recipe.train.keep_checkpoints,
                                      write_extras=lambda folder: callbacks.on_save_checkpoint(run, folder))
    callbacks.on_checkpoint(run, path)


def _collective_timeout_message(accelerator: Accelerator, recipe: Recipe, state: checkpoint.TrainState) -> str:
    """Gloo raises on the processes still waiting; the frozen or dead one is among the others."""
    me = accelerator.process_index
    others = [rank for rank in range(accelerator.num_processes) if rank != me]
    who = f"process (rank) {others[0]}" if len(others) == 1 else f"one of the processes (ranks) {others}"
    return (f"process {me} waited train.collective_timeout_s={recipe.train.collective_timeout_s} s at step "
            f"{state.step + 1} for {who}, which is stuck (stopped, frozen or swapping) or died; the run stopped. "
            "Find and end it, then resume with train.resume=auto (if train.checkpoint_every_steps is set); raise "
            "train.collective_timeout_s if a step, evaluation or checkpoint can legitimately take that long")


def _report_skipped(accelerator: Accelerator, recipe: Recipe, epoch: int, log: TrainLog, shown: int = 5) -> None:
    """A collective: the epoch's count of bad images skipped by all processes, and the first few, on the console."""
    skipped, log.skipped_this_epoch = log.skipped_this_epoch, []
    if not recipe.data.skip_bad_images:  # nothing can have been skipped; every process knows it, so none gathers
        return
    from accelerate.utils import gather_object

    total = sum_over_processes(accelerator, len(skipped))
    first = [name for names in gather_object([skipped[:shown]]) for name in names][:shown]
    if accelerator.is_main_process and total:
        display.say(f"epoch {epoch}: skipped {total} bad image(s) (data.skip_bad_images=true), e.g. {', '.join(first)}")


def _interrupted(flag: InterruptFlag, accelerator: Accelerator) -> bool:
    # Every rank must agree to stop at the same step, or the others wait forever in the next collective.
    flag.raised = any_process(accelerator, flag.raised)
    return flag.raised


def _interrupt_message(recipe: Recipe, state: checkpoint.TrainState) -> str:
    if recipe.train.checkpoint_every_steps:
        return (f"interrupted at step {state.step}; a checkpoint was saved in {recipe.output_dir}/checkpoints. "
                f"Resume with: python -m vit_finetune --recipe <recipe> output_dir={recipe.output_dir} train.resume=auto")
    return (f"interrupted at step {state.step}; no checkpoint was saved because train.checkpoint_every_steps is "
            "not set. Set it to make runs resumable")


def _weights_finite(model: torch.nn.Module) -> torch.Tensor:
    """Checked before anything is saved: a finite loss and gradient can still step the weights to Inf."""
    # Sharded (FSDP2), a parameter is a DTensor: each process checks its own shard, _stop_if_non_finite asks all.
    local = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters() if p.requires_grad]
    return torch.stack([torch.isfinite(p).all() for p in local]).all()


def _stop_if_non_finite(finite: torch.Tensor, step: int, accelerator: Accelerator) -> None:
    if any_process(accelerator, ~finite):
        raise NonFiniteLoss(
            f"the loss, a gradient or the weights became NaN/Inf at optimiser step {step}; training stopped, no "
            "checkpoint was written from then on and nothing was saved as the final model. "
            "Lower train.lr, keep train.max_grad_norm set, or use bf16 instead of fp16"
        )


def measure(run: TrainingRun) -> tuple[dict, evaluation.SplitPredictions]:
    """Metrics of the model's current weights on the eval split (labelled, with what the split was) and the
    per-image predictions behind them, for the pictures; no history entry, no event."""
    parts = run.parts
    predict = streaming.predict_stream if run.recipe.data.streaming else evaluation.predict_split
    predictions = predict(parts.model, parts.eval_loader, run.accelerator, parts.normalize, len(parts.labels))
    metrics = evaluation.summarise(predictions, len(parts.labels))
    metrics.update(evaluation.label_report(metrics["confusion_matrix"], parts.labels))
    metrics.update(evaluation.eval_split_fields(parts.eval_split))
    return metrics, predictions


def evaluate(run: TrainingRun, callbacks: Callback) -> tuple[dict, evaluation.SplitPredictions]:
    """measure(), added to the history and passed to the callbacks."""
    metrics, predictions = measure(run)
    run.state.history.append({"step": run.state.step, "epoch": run.state.epoch, **evaluation.as_eval_entry(metrics)})
    callbacks.on_evaluate(run, metrics)
    return metrics, predictions


def _evaluate_during_training(run: TrainingRun, callbacks: Callback) -> None:
    metrics, _ = evaluate(run, callbacks)
    if run.accelerator.is_main_process:
        display.say(f"step {run.state.step}: eval accuracy {metrics['accuracy']:.4f}, loss {metrics['eval_loss']:.4f}")


def save_final(accelerator: Accelerator, parts: Parts, recipe: Recipe, metrics: dict, state: checkpoint.TrainState,
               info: dict | None = None, draw_pictures=None, gathered: dict | None = None) -> None:
    """The output folder (model, processor, card, metrics...); `gathered`: a sharded model's full weights."""
    output_dir = Path(recipe.output_dir)
    trained = accelerator.unwrap_model(parts.model, keep_torch_compile=False)
    if gathered is not None:
        trained = sharding.unsharded_model(trained, recipe, gathered)
    model, adapter = (vit.merged_copy(trained), trained) if vit.is_lora(trained) else (trained, None)
    try:
        export.write_outputs(output_dir, model, parts.processor, recipe, metrics, state.history, parts.labels,
                             adapter_model=adapter, run_info=info, draw_pictures=draw_pictures)
    except checkpoint.WRITE_ERRORS as error:
        shutil.rmtree(output_dir / export.STAGING, ignore_errors=True)  # give back the space the attempt took
        previous = checkpoint.latest_checkpoint(output_dir)
        raise RunError(
            f"could not write the final model into {output_dir} ({checkpoint.describe_write_error(error, output_dir)}); "
            "nothing there looks finished. "
            + (f"The last checkpoint is intact: {previous}. Free disk space, then run the same command with "
               "train.resume=auto (only the steps after that checkpoint are redone)"
               if previous else "No checkpoint was kept (train.checkpoint_every_steps is not set); "
               "free disk space and train again")
        ) from None
