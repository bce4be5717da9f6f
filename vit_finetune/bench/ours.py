"""Our configurations, through the library's own code: devices.make_accelerator, build.run_parts, devices.prepare,
loop.train_loop."""

from __future__ import annotations

import dataclasses

from vit_finetune.artifacts import checkpoint
from vit_finetune.artifacts.callbacks import TrainingRun
from vit_finetune.bench.device import PeakMemory
from vit_finetune.bench.flops import training_flops_per_image
from vit_finetune.bench.levers import DEFAULTS, Variant, unfused_adamw
from vit_finetune.bench.timing import TimedBatches, device_batches, measured
from vit_finetune.bench.workload import Setup
from vit_finetune.model import compiling, speedups
from vit_finetune.recipe import validate
from vit_finetune.training import loop
from vit_finetune.training.build import run_parts
from vit_finetune.training.devices import make_accelerator, prepare
from vit_finetune.training.optim import build_scheduler


def bench_recipe(setup: Setup, lora: bool, variant: Variant = DEFAULTS):
    """The recipe our configurations train with, validated by the same schema as any run. Fine-tuning from the first
    step: train.method=auto would first fit a linear probe on the bench's random-weight base (seconds, unmeasured)."""
    return validate({
        "model": {"base": str(setup.base), "image_size": setup.spec.image_size,
                  "compile": setup.compile if variant.compile == "auto" else variant.compile,
                  "lora": {} if lora else None},
        "data": {"dataset": str(setup.jpegs), "num_workers": setup.workers},
        "train": {"batch_size": setup.batch_size * variant.batch_scale, "max_steps": setup.warmup + setup.steps,
                  "mixed_precision": setup.precision, "scheduler": "constant", "method": "finetune"},
        "output_dir": str(setup.work_dir / "outputs"),
    }, "bench recipe")


def build(setup: Setup, lora: bool, variant: Variant = DEFAULTS):
    """The recipe as given, the accelerator, the recipe as run and the unprepared parts, seeded as a run would be."""
    from accelerate.utils import set_seed

    asked = bench_recipe(setup, lora, variant)
    accelerator = make_accelerator(asked)
    set_seed(asked.train.seed)
    return asked, accelerator, *run_parts(asked, accelerator)


def check_one_epoch_covers(setup: Setup, loader) -> None:
    """Crossing an epoch would time its restart and, in our loop, an evaluation."""
    if len(loader) < setup.warmup + setup.steps:
        raise RuntimeError(f"{setup.jpegs} gives {len(loader)} batches per epoch, fewer than "
                           f"warm-up + steps = {setup.warmup + setup.steps}; pass a larger --images")


def run_ours(config: str, setup: Setup, peak: dict, memory: PeakMemory, variant: Variant = DEFAULTS,
             label: str | None = None) -> dict:
    """model_step, end_to_end or lora: our training loop left unchanged, its loader's `next()` timed; `variant`: the
    levers' settings (levers.py); `label`: the measurement's name (its profile's file), `config` unless given."""
    memory.reset()
    asked, accelerator, recipe, parts = build(setup, config == "lora", variant)
    if not variant.fused_adamw:
        parts.optimizer = unfused_adamw(parts.optimizer)
        parts.scheduler = build_scheduler(parts.optimizer, recipe, parts.total_steps)
    changed = speedups.apply(parts.model, variant.speedups, accelerator.device.type)  # before prepare compiles it
    prepare(accelerator, parts, recipe)  # speedups.ON, torch.compile (model.compile) and accelerator.prepare
    clock = setup.clock(label or config)
    if config == "model_step":
        source = device_batches(setup.spec, recipe.train.batch_size, accelerator.device)
    else:
        check_one_epoch_covers(setup, parts.train_loader)
        source = parts.train_loader
    settings = our_settings(accelerator, parts, recipe, variant, changed)
    timed = dataclasses.replace(parts, train_loader=TimedBatches(source, clock, parts.train_loader))
    loop.train_loop(TrainingRun(recipe, accelerator, timed, checkpoint.TrainState(), asked),
                    finite_check_every_step=variant.finite_check_every_step)
    clock.close()
    flops = training_flops_per_image(setup.spec.vit_config(), recipe.model.lora)
    return measured(clock, flops, peak, memory, settings)


def run_our_loader(setup: Setup, peak: dict, memory: PeakMemory) -> dict:
    """data_ours: our prepared training loader alone (decode, crop-before-resize, flip, uint8 collation, the copy
    to the device), no model step: the rate our data pipeline can feed with these workers."""
    _, accelerator, _, parts = build(setup, lora=False)
    check_one_epoch_covers(setup, parts.train_loader)
    memory.reset()
    loader = accelerator.prepare(parts.train_loader)
    clock = setup.clock("data_ours")
    clock.drain(loader)
    return measured(clock, None, peak, memory, loader_settings(accelerator, loader))


def our_settings(accelerator, parts, recipe, variant: Variant, changed: dict[str, int]) -> dict:
    """The levers in effect, read off the built objects rather than assumed (`recipe`: as the run resolved it;
    `changed`: the modules each speed-up beyond speedups.ON changed)."""
    optimizer = getattr(parts.optimizer, "optimizer", parts.optimizer)
    model = accelerator.unwrap_model(parts.model, keep_torch_compile=False)
    compiled_blocks = sum(module._compiled_call_impl is not None for module in compiling.repeated_blocks(model))
    whole = hasattr(parts.model, "_orig_mod") or type(parts.model).__name__ == "OptimizedModule"
    return {
        "precision": recipe.train.mixed_precision,
        "batch_size": recipe.train.batch_size,
        "torch_compile": whole or compiled_blocks > 0,
        "compile_mode": "whole" if whole else "regional" if compiled_blocks else None,
        "speedups": {**{name: "on for every run" for name in speedups.ON}, **changed},
        "attention": getattr(model.config, "_attn_implementation", None),
        "optimizer": f"{type(optimizer).__name__}(fused={optimizer.defaults.get('fused')})",
        "finite_check": "after every step" if variant.finite_check_every_step else "at logs, evaluations, checkpoints",
        **loader_settings(accelerator, parts.train_loader),
        "lora": recipe.model.lora.model_dump() if recipe.model.lora else None,
    }


def loader_settings(accelerator, loader) -> dict:
    loader = getattr(loader, "base_dataloader", loader)
    return {
        "num_workers": loader.num_workers,
        "pin_memory": loader.pin_memory,
        "persistent_workers": loader.persistent_workers,
        "prefetch_factor": loader.prefetch_factor,
        "non_blocking_copies": accelerator.dataloader_config.non_blocking,
        "batch_dtype": "uint8, normalised on the device (data.PixelNormalizer)",
    }
