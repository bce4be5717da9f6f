"""Building a run: its data opened and checked, its plan (plan.py: every `auto` resolved and said once), and what it
trains with (parts.py): the model at its resolution with its head fitted by the linear probe first where the method
says, the loaders, the optimiser and its schedule, the batch augmentations, and a teacher where the run distils.
"""

from __future__ import annotations

import copy
from functools import partial

from accelerate import Accelerator

from vit_finetune import data, tasks
from vit_finetune.artifacts.parts import Parts
from vit_finetune.core import progress
from vit_finetune.core.errors import RunError
from vit_finetune.data import augment, streaming
from vit_finetune.model import compiling
from vit_finetune.model.loading import (
    base_on_meta, base_parameter_count, build_model, has_distillation_token, head_names, keeps_base_head,
    load_image_processor, processor_at_size, with_distillation_head,
)
from vit_finetune.model.lora import apply_lora
from vit_finetune.recipe import Recipe, methods
from vit_finetune.training import distill, plan, probe, probe_checks, resolution, wise_ft
from vit_finetune.training.optim import build_optimizer, build_scheduler


def run_parts(asked: Recipe, accelerator: Accelerator, resuming: bool = False) -> tuple[Recipe, Parts]:
    """The recipe as run (every `auto` of `asked` resolved) and what it trains with. `resuming`: the checkpoint holds
    the head, so the linear probe runs again only for WiSE-FT's average."""
    streamed = asked.data.streaming
    splits, rows = open_data(asked, accelerator)
    task = tasks.for_training(splits, asked.train)  # chosen once: everything after asks it
    data_facts = check_training_data(splits, asked, accelerator, task)
    # A stream's eval split is not read ahead of training: what its metric needs is not known.
    refused = None if streamed else task.keep_best_refusal(asked.train.keep_best, splits)
    if refused:
        raise RunError(refused)
    processor = load_image_processor(asked.model, asked.model.image_size)
    normalize = data.PixelNormalizer(processor, accelerator.device)
    teacher = None
    if asked.train.distill is not None:  # its labels are checked before the student is built
        if not task.distills:
            raise RunError(f"train.distill works with single-label classification only, and data.dataset is "
                           f"{task.name.replace('_', '-')}; set train.distill=null")
        teacher = distill.load_teacher(asked.train.distill, splits.labels, normalize.scale, accelerator.device)
    base = base_on_meta(asked.model)
    size = plan.RunSize.of(asked, rows, len(splits.labels), None if streamed else len(splits.eval),
                           accelerator.num_processes, base_parameter_count(base))
    recipe = plan.plan_run(asked, size, accelerator, task, head_kept=keeps_base_head(asked.model, splits.labels),
                           compile_facts=compiling.facts_of(base.model, asked.model.image_size),
                           base_image_size=base.family.image_size(base.model.config))
    # From here on only the recipe as run is read.
    method = methods.METHODS[recipe.train.method]
    total_steps = size.total_steps if method.fine_tunes else 0  # the probe alone is the whole training
    if method.fine_tunes and recipe.train.warmup_steps >= total_steps:
        raise RunError(f"train.warmup_steps={recipe.train.warmup_steps} is not below the run's {total_steps} steps; "
                       "lower it or train longer")
    stages = resolution.stages_of(recipe.train.resolution_schedule, total_steps)  # []: one size throughout
    tables: dict = {}
    kept = []  # the base's own position tensors, which each stage is resampled from
    model = build_model(recipe.model, splits.labels,
                        on_resample=lambda before, after: tables.update(before=before, after=after),
                        keep_base=kept.append if stages else None)
    checks = probe_checks.FeatureChecks(model, splits, recipe.data, processor, accelerator, task, recipe.train.seed,
                                        recipe.train.batch_size, recipe.model.image_size)
    recipe, checked = plan.plan_from_features(recipe, checks, accelerator.is_main_process,
                                              crop_was_auto=asked.data.crop_scale == "auto",
                                              images_seen=size.images_seen)
    data_facts.update(checked)
    task.configure(model.config)  # pipeline(), predict and evaluate read the task back from the config
    if recipe.data.alpha_background is not None:  # predict, explain, export and the page read it back
        setattr(model.config, data.ALPHA_BACKGROUND_KEY, recipe.data.alpha_background)
    workers = recipe.data.num_workers
    if workers is None:
        workers = data.default_num_workers(accelerator.device.type, accelerator.num_processes)
    sampler, class_weights = (None, None) if streamed else task.balancing(recipe.data.class_balance, splits,
                                                                          recipe.train.seed)
    fitted = wise_ft_start = None
    # A resumed run fits the probe again only for WiSE-FT's average: its model is the start the average goes back to,
    # and the probe, deterministic, gives the same head as before the stop.
    averages = method.probes and method.fine_tunes and recipe.train.wise_ft_alpha < 1
    if method.probes and (averages or not resuming):
        fitted = fit_head_by_probe(model, splits, recipe, processor, accelerator, workers, task, class_weights,
                                   fine_tuned_after=method.fine_tunes)
    if averages:
        wise_ft_start = wise_ft.snapshot(model)
    if fitted is not None and method.fine_tunes:  # after the snapshot: WiSE-FT goes back to the probe's own head
        probe.scale_heads(model, recipe.train.lp_ft_head_scale)
    if not method.fine_tunes:
        freeze_all_but_heads(model)
    if teacher is not None and has_distillation_token(model):
        model = with_distillation_head(model)  # DeiT: its distillation token gets a head of its own
    if recipe.model.lora is not None:
        model = apply_lora(model, recipe.model.lora)
    train_loader, eval_loader = make_loaders(splits, recipe, processor, accelerator, workers, sampler)
    test_loader = None if streamed else make_test_loader(splits, recipe, processor, accelerator, workers)
    optimizer = build_optimizer(model, recipe, accelerator.device.type)
    scheduler = build_scheduler(optimizer, recipe, total_steps)
    batch_augmenter = augment.BatchAugmenter(recipe.augment, len(splits.labels), recipe.train.seed,
                                             augment.total_epochs(total_steps, size.steps_per_epoch),
                                             accelerator.process_index, recipe.train.label_smoothing,
                                             mix_targets=task.mixed_targets)
    schedule = None
    if stages:
        per_step = recipe.train.batch_size * accelerator.num_processes * recipe.train.grad_accum
        schedule = resolution.Schedule(
            stages, kept[0], lambda px: make_loaders(splits, recipe, processor_at_size(copy.deepcopy(processor), px),
                                                     accelerator, workers, sampler, px),
            partial(plan.images_read, rows, size.steps_per_epoch, images_per_step=per_step), recipe.model.image_size)
    identity = dict(splits.identity if streamed else data.identity(splits))
    if teacher is not None:  # what the student also learned from: a resume refuses another teacher
        identity["teacher_weights"] = teacher.digest
    return recipe, Parts(task=task, model=model, processor=processor, labels=splits.labels, train_loader=train_loader,
                         eval_loader=eval_loader, test_loader=test_loader, optimizer=optimizer, scheduler=scheduler, normalize=normalize,
                         augment=batch_augmenter, steps_per_epoch=size.steps_per_epoch, total_steps=total_steps,
                         eval_split=splits.eval_split, test_split=None if streamed else splits.test_split,
                         position_tables=tables, data_identity=identity,
                         class_weights=None if class_weights is None else class_weights.to(accelerator.device),
                         teacher=teacher, probe=fitted, data_facts=data_facts, wise_ft_start=wise_ft_start,
                         resolution=schedule)


def open_data(recipe: Recipe, accelerator: Accelerator) -> tuple[data.Splits | streaming.StreamedSplits, int]:
    """The train and eval splits (this process's share of each, for a stream), and the training images an epoch
    reads."""
    if recipe.data.streaming:
        splits = streaming.open_streams(recipe.data, accelerator.process_index, accelerator.num_processes)
        return splits, streaming.epoch_rows(splits, recipe, accelerator.num_processes)
    splits = data.load_splits(recipe.data, recipe.train.seed)
    return splits, len(splits.train)


def check_training_data(splits: data.Splits | streaming.StreamedSplits, recipe: Recipe,
                        accelerator: Accelerator, task: tasks.Task) -> dict:
    """Say what the data loader noticed (a label file found multi-label, labels with no training image, images with
    no label) and refuse training images that are mostly one flat colour where the task finds that suspect; returns
    what metrics.json records of the training split. A stream is not read ahead of training: only what its metadata
    says is known."""
    notes = list(splits.notes)
    facts = {} if recipe.data.streaming else data.training_facts(splits)
    if not recipe.data.streaming:
        notes += data.training_facts_notes(facts, len(splits.train))
        flat = data.flat_images(splits, recipe.data, recipe.train.seed, task.flat_image_suspect)
        if flat.refuses(recipe.data):
            raise RunError(f"{flat.problem(recipe.data)}; or set data.allow_flat_images=true to train anyway")
        notes += [flat.problem(recipe.data)] if flat.flat else []
    if accelerator.is_main_process:
        for note in notes:
            progress.say(f"data: {note}")
    return facts


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
    result = probe.probe(model, progress.passes(loader, "features", accelerator.is_main_process), accelerator, task,
                         class_weights, mixed_precision=fine_tuned_after)
    if accelerator.is_main_process:
        progress.say(result.describe())
    return result


def freeze_all_but_heads(model) -> None:
    """train.method=linear_probe: the backbone never changes, and the count of trainable parameters says so."""
    heads = tuple(f"{name}." for name in head_names(model))
    for name, parameter in model.named_parameters():
        parameter.requires_grad = name.startswith(heads)


def make_loaders(splits, recipe: Recipe, processor, accelerator: Accelerator, workers: int, sampler,
                 image_size: int | None = None) -> tuple:
    """The training loader (each image cropped and flipped as data.crop_scale and data.horizontal_flip say, resized as
    evaluation resizes) and the eval loader (the saved image processor's preprocessing); a stream's own loaders.
    `image_size`: a resolution stage's, with `processor` at it (None: model.image_size)."""
    size, seed, batch_size = image_size or recipe.model.image_size, recipe.train.seed, recipe.train.batch_size
    resample = data.resample_of(processor)  # training resizes as evaluation does

    def train_pixels(image, index, epoch):
        return data.train_transform(image, size, data.sample_rng(seed, epoch, index), recipe.data, resample)

    if recipe.data.streaming:  # data.class_balance is refused with streaming (the recipe says why)
        return streaming.make_loaders(splits, recipe.data, seed, batch_size, workers, accelerator, train_pixels,
                                      processor, size)
    pin = accelerator.device.type == "cuda"
    train_set = data.train_dataset(splits, recipe.data, size, train_pixels)
    eval_set = data.eval_dataset(splits, recipe.data, processor, size)
    collate = distill.collate_with_digests if distill.caches_teacher_logits(recipe) else data.collate
    return (data.make_loader(train_set, batch_size, True, seed, workers, pin, sampler, collate),
            data.make_loader(eval_set, batch_size, False, seed, workers, pin))


def make_test_loader(splits: data.Splits, recipe: Recipe, processor, accelerator: Accelerator, workers: int):
    """data.test_split's loader, preprocessed as the eval split is at model.image_size (the size the run ends at), or
    None without one."""
    if splits.test is None:
        return None
    test_set = data.eval_dataset(splits, recipe.data, processor, recipe.model.image_size, table=splits.test)
    return data.make_loader(test_set, recipe.train.batch_size, False, recipe.train.seed, workers,
                            accelerator.device.type == "cuda")
