"""Where a run computes: Accelerate's Accelerator for the recipe (the launch's config file adds DDP, FSDP or
DeepSpeed), torch's CPU threads for the run's life, handing the model, optimiser and loaders to Accelerate (compiled
first where model.compile says so), and the device's name as the card gives it.
"""

from __future__ import annotations

from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, InitProcessGroupKwargs, ProjectConfiguration

from vit_finetune.artifacts.parts import Parts
from vit_finetune.core import layout, progress
from vit_finetune.core.errors import RunError, VitFinetuneError, problems_of
from vit_finetune.core.processes import refuse_a_lone_process
from vit_finetune.data import cpu_cores
from vit_finetune.model import compiling, precision, speedups
from vit_finetune.recipe import Recipe
from vit_finetune.training import sharding


def preflight(recipe: Recipe) -> list[VitFinetuneError]:
    """The launch's problems with a recipe, before anything loads: a process started alone by a launch of several
    (`accelerate launch --cpu --num_processes 2` does), settings the launch's sharding engine cannot run."""
    return problems_of(refuse_a_lone_process, lambda: sharding.refuse_unsupported(recipe, sharding.requested_engine()))


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


def prepare(accelerator: Accelerator, parts: Parts, recipe: Recipe) -> None:
    """The step's speed-ups that are on (speedups.ON), the model compiled if model.compile says so (`recipe`: as run),
    then model, optimiser and loaders handed to Accelerate (DDP wrapping is a collective: all processes at once)."""
    model = parts.model
    speedups.apply_those_on(model, accelerator.device.type)  # before compiling, which traces what they change
    # Never before sharding (run() refused model.compile=true there, auto resolves to false): Accelerate compiles a
    # sharded model itself, after sharding, when its config file has a dynamo_config.
    if recipe.model.compile and not sharding.is_sharded(accelerator):
        model, compiled = compiling.compile_for_training(model, compiling.MODES[recipe.model.compile])
        if accelerator.is_main_process:
            progress.say(f"model.compile: {compiled}")
    # Prepared (not register_for_checkpointing), the scheduler is saved as scheduler.bin and read back with
    # torch.load(weights_only=True); a registered object is read back with weights_only=False, a full unpickle.
    if recipe.data.streaming:  # each process already reads only its share: Accelerate must not deal it out again
        parts.model, parts.optimizer, parts.scheduler = accelerator.prepare(model, parts.optimizer, parts.scheduler)
        return
    parts.model, parts.optimizer, parts.train_loader, parts.eval_loader, parts.scheduler = accelerator.prepare(
        model, parts.optimizer, parts.train_loader, parts.eval_loader, parts.scheduler)
    if parts.test_loader is not None:  # dealt out like the eval split: each process scores its share
        parts.test_loader = accelerator.prepare(parts.test_loader)


def device_name(device: torch.device) -> str:
    """For run_info.json and the card: the accelerator's model name, or the CPU and its usable cores."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{device.type} ({cpu_cores()} cores)" if device.type == "cpu" else device.type
