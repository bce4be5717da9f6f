"""A run's plan: the recipe as the run will run it, every `auto` resolved once, here, and said.

Each key that accepts `auto` has one entry in AUTO: a function of the recipe resolved so far and the run's facts (its
size, device, task) that returns (value, why). `plan_run` applies them in the table's order (a later one may read an
earlier one's value: the head's lr reads the lr and the method), prints one line per choice, and returns the recipe
as run. From then on everything reads that recipe: the loop, the weight selection, the outputs and the card, and a
resumed run's optimiser; only a checkpoint keeps the recipe as the user gave it, for a resume to compare with.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from vit_finetune import data
from vit_finetune.core import progress
from vit_finetune.core.errors import RunError
from vit_finetune.model import compiling, precision
from vit_finetune.recipe import (
    Recipe, methods, probe_unused_settings, step_only_settings, weight_selection_settings, without_pixel_draws,
)
from vit_finetune.tasks import Task, evaluation
from vit_finetune.training import optim, probe_checks, resolution, sharding, wise_ft


@dataclass(frozen=True)
class RunSize:
    """What the `auto` choices are measured against: the training images the run will see, and the data's size."""

    images_seen: int
    training_images: int
    classes: int
    eval_images: int | None  # None: not known before it is read (a stream)
    steps_per_epoch: int
    total_steps: int
    base_parameters: int  # the backbone's, its head left out: train.lr=auto follows the base's size

    @property
    def epochs(self) -> float:
        return self.images_seen / max(1, self.training_images)

    @classmethod
    def of(cls, recipe: Recipe, rows: int, classes: int, eval_images: int | None, processes: int,
           base_parameters: int) -> RunSize:
        """The size of a run of `recipe` on `rows` training images (each epoch) over `processes` processes."""
        t = recipe.train
        steps_per_epoch = math.ceil(math.ceil(rows / (t.batch_size * processes)) / t.grad_accum)
        total_steps = t.max_steps or t.epochs * steps_per_epoch
        return cls(images_read(rows, steps_per_epoch, total_steps, t.batch_size * processes * t.grad_accum), rows,
                   classes, eval_images, steps_per_epoch, total_steps, base_parameters)


def images_read(rows: int, steps_per_epoch: int, total_steps: int, images_per_step: int) -> int:
    """The training images `total_steps` steps read: an epoch's last step takes what is left of it (no batch is
    padded, none repeats an image), so an epoch reads each of its `rows` images once however large the step is."""
    whole_epochs, steps_left = divmod(total_steps, max(1, steps_per_epoch))
    per_epoch = min(rows, steps_per_epoch * images_per_step)
    return whole_epochs * per_epoch + min(rows, steps_left * images_per_step)


@dataclass(frozen=True)
class RunFacts:
    """What the resolvers may read besides the recipe: the run's size, where it computes, and its task."""

    size: RunSize
    device_type: str
    processes: int
    sharded: bool
    mixed_precision: str  # what the accelerator runs: it resolved train.mixed_precision when it was built
    task: Task
    head_kept: bool  # a student keeps its base's trained head
    unaveraged: str | None  # a setting WiSE-FT's average was not measured with (auto's alpha is then 1)
    compile_facts: compiling.CompileFacts = compiling.CompileFacts()  # the base, as model.compile=auto reads it
    base_image_size: int = 0  # the base's own size, as train.resolution_schedule=auto reads it


def _method(recipe: Recipe, facts: RunFacts) -> tuple[str, str]:
    asked, size = recipe.train.wise_ft_alpha, facts.size
    averages = facts.unaveraged is None if asked == "auto" else asked < 1
    rule = methods.AUTO_RULES[facts.task.method_rule]
    return rule(size.training_images, size.classes, size.images_seen, recipe.model.pretrained, recipe.data.streaming,
                needs_optimiser_steps(recipe), averages)


def _eval_every_steps(recipe: Recipe, facts: RunFacts) -> tuple[int | None, str]:
    size = facts.size
    every, why = evaluation.auto_eval_every_steps(size.eval_images, size.training_images, size.steps_per_epoch,
                                                  size.total_steps, weight_selection(recipe))
    return every, f"evaluating {why}"


# Every key that accepts `auto` -> (its value for this run, why), in the order they are resolved and said.
AUTO: dict[str, Callable[[Recipe, RunFacts], tuple[Any, str]]] = {
    "train.method": _method,
    # The accelerator had to be built with it (precision.resolved): its choice is the one said here.
    "train.mixed_precision": lambda recipe, facts: (facts.mixed_precision,
                                                    precision.auto_mixed_precision(facts.device_type)[1]),
    "model.compile": lambda recipe, facts: compiling.auto_compile(facts.device_type, facts.sharded,
                                                                  facts.size.images_seen, facts.processes,
                                                                  facts.compile_facts),
    "data.crop_scale": lambda recipe, facts: data.auto_crop_scale(facts.size.images_seen),
    "train.lr": lambda recipe, facts: optim.auto_lr(recipe.model.lora is not None, facts.size.base_parameters),
    "train.weight_decay": lambda recipe, facts: optim.auto_weight_decay(),
    "train.lp_ft_head_scale": lambda recipe, facts: methods.auto_lp_ft_head_scale(
        recipe.train.method, facts.task.method_rule, recipe.model.lora is not None, facts.size.training_images,
        facts.size.images_seen),
    "train.head_lr": lambda recipe, facts: optim.auto_head_lr(
        recipe.train.optimizer, recipe.train.lr, head_fitted=methods.fits_head_first(recipe.train.method),
        head_kept=facts.head_kept),
    "train.warmup_steps": lambda recipe, facts: optim.auto_warmup_steps(
        methods.fits_head_first(recipe.train.method), facts.size.total_steps, facts.head_kept, recipe.model.pretrained),
    "train.wise_ft_alpha": lambda recipe, facts: wise_ft.auto_alpha(recipe.train.method, facts.unaveraged,
                                                                     facts.size.epochs, facts.task.wise_ft_auto_alpha),
    "train.eval_every_steps": _eval_every_steps,
    "train.resolution_schedule": lambda recipe, facts: resolution.auto_schedule(
        facts.base_image_size, recipe.model.image_size, facts.processes, facts.sharded),
}
# A linear probe takes no optimiser step: of the choices above only these two concern it.
SAID_FOR_A_PROBE = ("train.method", "train.mixed_precision")


def shown(value: Any) -> str:
    """A resolved value as its line writes it: true, null, 2e-05, 12."""
    if isinstance(value, bool):
        return str(value).lower()
    if value is None:
        return "null"
    return f"{value:g}" if isinstance(value, float) else str(value)


def said_plainly(key: str, value: Any, why: str, facts: RunFacts) -> str:
    return f"{key}=auto -> {shown(value)}: {why}; set {key} to choose"


def said_of_the_crop(key: str, value: Any, why: str, facts: RunFacts) -> str:
    # One short sentence, the reason on a line of its own.
    return (f"{key}=auto: {data.crop_in_words(value)} ({key}=[low, high] to choose)\n"
            f"  why: this run sees {facts.size.images_seen:,} training images; {why}")


def said_of_the_schedule(key: str, value: Any, why: str, facts: RunFacts) -> str:
    chosen = "off" if value is None else ", then ".join(f"{share:.0%} of the steps at {px} px" for px, share in value)
    return f"{key}=auto -> {chosen}: {why}; set {key} to choose"


# How a choice is said, where not plainly.
SAID: dict[str, Callable[[str, Any, str, RunFacts], str]] = {"data.crop_scale": said_of_the_crop,
                                                             "train.resolution_schedule": said_of_the_schedule}


def setting(recipe: Recipe, key: str) -> Any:
    section, name = key.split(".")
    return getattr(getattr(recipe, section), name)


def with_setting(recipe: Recipe, key: str, value: Any) -> Recipe:
    section, name = key.split(".")
    return recipe.model_copy(update={section: getattr(recipe, section).model_copy(update={name: value})})


def plan_run(asked: Recipe, size: RunSize, accelerator, task: Task, head_kept: bool = False,
             compile_facts: compiling.CompileFacts = compiling.CompileFacts(), base_image_size: int = 0) -> Recipe:
    """The recipe as this run runs it: every `auto` of `asked` resolved (AUTO) and said on the main process, and
    under a linear probe the settings it leaves unused switched off; `head_kept`: a student keeps its base's trained
    head; `compile_facts`: the base as model.compile=auto reads it (compiling.facts_of).
    A WiSE-FT average or a probe head scale the run cannot honour is refused after the lines that say what auto
    chose."""
    sharded = sharding.is_sharded(accelerator)
    facts = RunFacts(size, accelerator.device.type, accelerator.num_processes, sharded, accelerator.mixed_precision,
                     task, head_kept, wise_ft_unmeasured(asked, task, sharded), compile_facts, base_image_size)
    recipe, said = asked, {}
    for key, resolve in AUTO.items():
        if setting(recipe, key) == "auto":
            value, why = resolve(recipe, facts)
            said[key] = SAID.get(key, said_plainly)(key, value, why, facts)
            recipe = with_setting(recipe, key, value)
    if methods.METHODS[recipe.train.method].fine_tunes:
        warning = pinned_lr_warning(recipe, size)
        if warning:
            said["train.lr"] = warning
    else:
        recipe, said = probe_alone(asked, recipe, said)
    if accelerator.is_main_process:
        for key in AUTO:
            if key in said:
                progress.say(said[key])
    refused = (wise_ft.refusal(recipe.train.method, recipe.train.wise_ft_alpha, sharded)
               or methods.lp_ft_head_scale_refusal(recipe.train.method, recipe.train.lp_ft_head_scale,
                                                   auto_chose=asked.train.method == "auto")
               or resolution.refusal(recipe.train.resolution_schedule, facts.processes, sharded))
    if refused:
        raise RunError(refused)
    return recipe


def pinned_lr_warning(recipe: Recipe, size: RunSize) -> str | None:
    """A line when an lr the user pinned for AdamW is far from what was measured for a base of this size."""
    if recipe.train.optimizer != "adamw" or not recipe.model.pretrained:
        return None
    return optim.pinned_lr_warning(recipe.train.lr, recipe.model.lora is not None, size.base_parameters)


def probe_alone(asked: Recipe, recipe: Recipe, said: dict[str, str]) -> tuple[Recipe, dict[str, str]]:
    """train.method=linear_probe: the probe alone reads each image once, unaugmented, so the settings of `asked` it
    leaves unused are said once and switched off in the recipe as run; only the method and the precision are said."""
    unused = probe_unused_settings(asked)
    if unused:
        said["train.method"] = (said.get("train.method", f"train.method={recipe.train.method}")
                                + f"\n  {', '.join(unused)} not used: the probe alone reads each image once, "
                                "unaugmented, fits the head in one go and takes no optimiser step")
        recipe = without_pixel_draws(recipe)
    # Each switched off as the probe leaves it (one size, the final one; no evaluation to choose among; nothing to
    # average), so the recipe saved with the run loads again: a linear_probe recipe refuses what it would never use.
    for key, off in (("train.resolution_schedule", None), ("train.keep_best", None),
                     ("train.early_stopping_patience", None), ("train.ema_decay", None),
                     ("train.wise_ft_alpha", 1.0), ("train.lp_ft_head_scale", 1.0)):
        recipe = with_setting(recipe, key, off)
    return recipe, {key: line for key, line in said.items() if key in SAID_FOR_A_PROBE}


def wise_ft_unmeasured(recipe: Recipe, task: Task, sharded: bool) -> str | None:
    """A setting of this run that WiSE-FT's average was not measured with (train.wise_ft_alpha=auto keeps 1), if any."""
    if not task.wise_ft_measured:
        return f"{task.name.replace('_', '-')} labels"
    chosen = needs_optimiser_steps(recipe) or weight_selection(recipe)
    if chosen:
        return chosen
    return "sharded weights" if sharded else None


def needs_optimiser_steps(recipe: Recipe) -> str | None:
    """A setting that only optimiser steps serve, if the recipe has one."""
    return next(iter(step_only_settings(recipe)), None)


def weight_selection(recipe: Recipe) -> str | None:
    """The setting that chooses the saved weights among the evaluations during training, if any."""
    return next(iter(weight_selection_settings(recipe)), None)


# ---------------------------------------------------------------- what the base's features decide

# The keys whose `auto` the base's features of the training images decide (probe_checks.py), resolved once the model
# is built, in this order: the mirror test reads the images laid on the background chosen first.


def _alpha_background(recipe: Recipe, checks: probe_checks.FeatureChecks) -> tuple[str | None, str]:
    if recipe.data.streaming:
        return None, "a stream is not read ahead of training, so alpha is dropped as pipeline() does"
    found = probe_checks.transparency(checks)
    if found.hides_content:
        return "white", (f"{found.describe()}: with alpha dropped their drawings would be lost, so transparent pixels "
                         "are laid on white, as the image processors lay RGBA images")
    return None, f"{found.describe()}: dropping alpha loses no drawing, so alpha is dropped as pipeline() does"


def _horizontal_flip(recipe: Recipe, checks: probe_checks.FeatureChecks) -> tuple[bool, str]:
    if recipe.train.distill is not None and recipe.train.distill.cache_logits:
        return False, "train.distill.cache_logits=true labels each training image once, so its pixels stay fixed"
    if recipe.data.streaming:
        return False, ("a stream is not read ahead of training, so no mirror test: no flip, the safe side for digits "
                       "and text")
    if not recipe.model.pretrained:
        return False, ("model.pretrained=false: random features cannot tell whether a mirror image is the same "
                       "thing, so no flip, the safe side for digits and text")
    test = probe_checks.mirror_test(checks, recipe.data.alpha_background)
    if test is None:
        return False, (f"{checks.task.name.replace('_', '-')} targets or too few training images per class to test "
                       "whether a mirror image is the same thing, so no flip, the safe side for digits and text")
    if test.flip_keeps_labels:
        return True, f"{test.describe()}: to the base a mirror image is the same thing"
    return False, f"{test.describe()}: to the base a mirror image is another thing, as a mirrored digit is"


def draws_pixels(recipe: Recipe) -> bool:
    """Whether this run may draw its training pixels anew each epoch: not a probe alone (it reads each image once,
    unaugmented) nor a student whose teacher labels each image once (train.distill.cache_logits)."""
    cached = recipe.train.distill is not None and recipe.train.distill.cache_logits
    return methods.METHODS[recipe.train.method].fine_tunes and not cached


FROM_FEATURES: dict[str, Callable[[Recipe, probe_checks.FeatureChecks], tuple[Any, str]]] = {
    "data.alpha_background": _alpha_background,
    "data.horizontal_flip": _horizontal_flip,
}


def plan_from_features(recipe: Recipe, checks: probe_checks.FeatureChecks, main_process: bool,
                       crop_was_auto: bool = False, images_seen: int = 0) -> tuple[Recipe, dict]:
    """The recipe with FROM_FEATURES' keys resolved where they are `auto`, each said on the main process, and what
    metrics.json records of the checks: a line too where the eval images look unlike the training images, and there
    the crop `auto` chose (`crop_was_auto`; `images_seen`: the run's) decided again for a run judged on another
    source."""
    said, facts = [], {}
    for key, resolve in FROM_FEATURES.items():
        if setting(recipe, key) == "auto":
            value, why = resolve(recipe, checks)
            said.append(f"{key}=auto -> {shown(value)}: {why}; set {key} to choose")
            recipe = with_setting(recipe, key, value)
    # An eval part held out from the training split comes from its source by construction: nothing to test.
    if not recipe.data.streaming and checks.splits.eval_split is not None:
        shift = probe_checks.shift_test(checks, recipe.data.alpha_background)
        if shift is not None:
            facts["eval_unlike_train"] = {"accuracy": round(shift.accuracy, 4), "images": shift.images,
                                          "likely": shift.likely}
            if shift.likely:
                said.append(f"data: the eval images look unlike the training images: a linear probe of the base's "
                            f"features tells them apart {shift.accuracy:.0%} of the time (chance 50%), so they likely "
                            "come from another source; accuracy on them measures how the model carries over to it "
                            "(docs/studies/shift.md)")
                if crop_was_auto and draws_pixels(recipe):
                    mirror = probe_checks.mirror_test(checks, recipe.data.alpha_background)
                    scale, why = data.auto_crop_scale_under_shift(images_seen, mirror and mirror.flip_keeps_labels)
                    if tuple(scale) != tuple(recipe.data.crop_scale):
                        said.append(f"data.crop_scale=auto -> {data.crop_in_words(scale)}, in place of no crop: "
                                    f"{why}; set data.crop_scale to choose")
                        recipe = with_setting(recipe, "data.crop_scale", scale)
                    else:  # the user reads why a run judged on another source was not given the crop
                        said.append(f"data.crop_scale=auto stays at {data.crop_in_words(scale)} for eval images "
                                    f"from another source: {why}; set data.crop_scale to choose")
    if main_process:
        for line in said:
            progress.say(line)
    return recipe, facts
