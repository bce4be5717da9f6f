"""The rules between a recipe's keys, gathered in one place: what one key accepts alone is its field's check in
schema.py; what several keys allow together is checked here, called by the schema's validators.

Each section's rules report all their problems together, as one problem of the section; those of the whole recipe run
once every section is valid and report all theirs together too. The table of settings that draw
training pixels anew (PIXEL_DRAWS) lives here too: two of the rules read it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import yaml
from pydantic import TypeAdapter, ValidationError

from vit_finetune.core.errors import excerpt
from vit_finetune.recipe.limits import _is_dir
from vit_finetune.recipe.methods import METHODS, lp_ft_head_scale_refusal

if TYPE_CHECKING:
    from vit_finetune.recipe.schema import DataSettings, Recipe
    from vit_finetune.recipe.train_section import TrainSettings

# A rule's problems leave in one ValueError (pydantic takes one per validator), apart, and are listed one by one.
PROBLEMS_APART = "\n"


def check_data_section(data: DataSettings) -> None:
    """The data section's rules, raising every one `data` breaks in one message. data.multi_label is data.task's
    older spelling (fold_older_spellings): it is left set only where it contradicts data.task."""
    problems = []
    # What a stream cannot do without reading it whole first: subsample it, carve an eval part from it, or
    # count its classes for balancing.
    unsupported = {"max_train_samples": data.max_train_samples, "max_eval_samples": data.max_eval_samples,
                   "class_balance": data.class_balance}
    given = [f"data.{key}={value}" for key, value in unsupported.items() if value is not None]
    if data.streaming and given:
        problems.append(f"data.streaming=true cannot be combined with {', '.join(given)} (a stream is not read "
                        "whole before training); set them to null, or data.streaming=false")
    if data.task == "multi_label" and data.class_balance == "sampler":
        problems.append("data.class_balance=sampler draws images by their one class; with data.multi_label "
                        "use class_balance=weights (a positive weight per class) or null")
    if data.multi_label is not None and data.task in TASK_OF_MULTI_LABEL.values():
        problems.append(f"data.task={data.task} and data.multi_label={str(data.multi_label).lower()} contradict "
                        "each other; set data.multi_label=null")
    if data.task == "regression":
        given = {"data.multi_label": data.multi_label, "data.class_balance": data.class_balance,
                 "data.label_names": data.label_names}
        given = [f"{key}={value}" for key, value in given.items() if value is not None]
        if data.streaming:
            given.append("data.streaming=true")
        if given:
            problems.append(f"data.task=regression has no classes: {', '.join(given)} do not apply; remove "
                            "them (a stream is read as classification only)")
    if data.target_columns is not None and data.task != "regression":
        problems.append("data.target_columns names a regression's targets; set data.task=regression, or remove it")
    if data.target_columns is not None and (not data.target_columns
                                            or len(set(data.target_columns)) != len(data.target_columns)):
        problems.append(f"data.target_columns={excerpt(data.target_columns)} must name at least one column, each "
                        "once")
    if data.test_split is not None and data.streaming:
        problems.append(f"data.test_split={excerpt(data.test_split)} is scored from a split read whole, and "
                        "data.streaming=true reads the data as a stream; remove data.test_split and score that "
                        "split after the run: python -m vit_finetune evaluate OUTPUT_DIR --dataset D --split S")
    if data.test_split is not None and data.test_split in (data.train_split, data.eval_split):
        role = "train_split" if data.test_split == data.train_split else "eval_split"
        problems.append(f"data.test_split={excerpt(data.test_split)} is also data.{role}; a test split must be one "
                        "the run neither trains on nor chooses by: name another split, or remove data.test_split")
    if data.label_names is not None and not data.streaming:
        problems.append("data.label_names names the classes of a stream's integer labels; it applies with "
                        "data.streaming=true only (a dataset loaded whole finds its classes itself)")
    if data.label_names is not None and (len(set(data.label_names)) != len(data.label_names) or len(data.label_names) < 2):
        problems.append(f"data.label_names={excerpt(data.label_names)} must hold at least two distinct names")
    if problems:
        raise ValueError(PROBLEMS_APART.join(problems))


# data.multi_label, data.task's older spelling, and the task each value stands for.
TASK_OF_MULTI_LABEL = {True: "multi_label", False: "single_label"}
BOOLEAN = TypeAdapter(bool)


def fold_older_spellings(section: dict) -> dict:
    """A data section as given, data.multi_label folded into data.task: true reads as data.task=multi_label, false as
    single_label, and data.multi_label is then null. Left as given where the two contradict (the section's rules
    name it) or the value is not a boolean (its field's check names it)."""
    given = as_boolean(section.get("multi_label"))
    if given is None or section.get("task", "auto") not in ("auto", TASK_OF_MULTI_LABEL[given]):
        return section
    return {**section, "task": TASK_OF_MULTI_LABEL[given], "multi_label": None}


def as_boolean(value: Any) -> bool | None:
    """`value` as the schema reads a boolean (true, "yes", 1...); None for null or anything it would refuse."""
    try:
        return None if value is None else BOOLEAN.validate_python(value)
    except ValidationError:
        return None


def older_spellings(data: dict) -> list[str]:
    """What a recipe mapping, as given, spells the older way: one line each, saying how it is read."""
    section = data.get("data") if isinstance(data, dict) else None
    given = as_boolean(section.get("multi_label")) if isinstance(section, dict) else None
    if given is None:
        return []
    return [f"data.multi_label={str(given).lower()}: read as data.task={TASK_OF_MULTI_LABEL[given]} "
            "(data.multi_label is the older spelling of data.task)"]


def check_train_section(train: TrainSettings) -> None:
    """The train section's rule: train.lr=auto is for AdamW only."""
    if train.lr == "auto" and train.optimizer != "adamw":
        raise ValueError(f"train.lr=auto is measured for AdamW only; set train.lr for train.optimizer="
                         f"{train.optimizer}, e.g. train.lr=0.01 (the ViT paper's SGD range is 0.003-0.03 at batch 512)")


def check_recipe(recipe: Recipe) -> None:
    """The rules between sections, raising every one `recipe` breaks in one message (pydantic runs them once each
    section is valid)."""
    problems = []
    if recipe.hub.push and not recipe.hub.repo_id:
        problems.append("hub.push=true needs hub.repo_id, e.g. hub.repo_id=your-name/vit-food101-384")
    if recipe.train.resume not in (None, "auto") and not _is_dir(recipe.train.resume):
        problems.append(f"train.resume={recipe.train.resume!r} is neither null, auto nor an existing checkpoint folder")
    unknown = sorted(set(recipe.train.resume_ignore_changes) - set(flatten(recipe.model_dump(mode="json"))))
    if unknown:
        problems.append(f"train.resume_ignore_changes names unknown keys {excerpt(unknown)}; use dotted keys such as train.epochs")
    if recipe.train.resume is not None and recipe.overwrite:
        problems.append("train.resume and overwrite=true contradict each other: choose one")
    if recipe.train.early_stopping_patience is not None and recipe.train.keep_best is None:
        problems.append("train.early_stopping_patience needs train.keep_best (the metric whose gain it waits "
                        "for), e.g. train.keep_best=eval_accuracy")
    if recipe.train.distill is not None and recipe.data.task == "multi_label":
        problems.append("train.distill works with single-label classification only (a teacher's top class or "
                        "softmax); set train.distill=null for data.task=multi_label")
    if recipe.data.task == "regression":
        problems.extend(_regression_problems(recipe))
    if recipe.train.distill is not None and recipe.train.distill.cache_logits:
        problems.extend(_cache_logits_problems(recipe))
    problems.extend(_method_problems(recipe))
    problems.extend(_resolution_problems(recipe))
    problems.extend(_wise_ft_problems(recipe))
    problems.extend(_lp_ft_head_scale_problems(recipe))
    warmup = recipe.train.warmup_steps
    if isinstance(warmup, int) and warmup and recipe.train.max_steps and warmup >= recipe.train.max_steps:
        problems.append(
            f"train.warmup_steps={recipe.train.warmup_steps} must be smaller than train.max_steps={recipe.train.max_steps}"
        )
    if problems:
        raise ValueError(PROBLEMS_APART.join(problems))


def _regression_problems(recipe: Recipe) -> list[str]:
    """What only classes give meaning to: soft labels, a teacher's classes."""
    t, a = recipe.train, recipe.augment
    given = {"train.label_smoothing": t.label_smoothing or None, "augment.mixup": a.mixup or None,
             "augment.cutmix": a.cutmix or None, "train.distill": t.distill}
    problems = [f"{key} works on class labels; data.task=regression has none: remove it"
                for key, value in given.items() if value is not None]
    return problems


def _cache_logits_problems(recipe: Recipe) -> list[str]:
    """train.distill.cache_logits labels each training image once: its pixels must never change."""
    problems = []
    drawing = pixel_drawing_settings(recipe)
    if drawing:
        problems.append(f"train.distill.cache_logits=true labels each training image once, so its pixels must be the "
                        f"same every epoch, but {', '.join(drawing)} draw(s) them anew; turn those off (data.crop_scale="
                        "[1, 1] or auto, data.horizontal_flip=false, augment.policy=none, augment.erasing_prob=0, "
                        "augment.mixup=false, augment.cutmix=false), or set train.distill.cache_logits=false")
    if recipe.data.streaming:
        problems.append("train.distill.cache_logits=true labels the whole training split before training, which a "
                        "stream is not (data.streaming=true); set train.distill.cache_logits=false or "
                        "data.streaming=false")
    return problems


def _method_problems(recipe: Recipe) -> list[str]:
    """What train.method=linear_probe or lp_ft cannot do, named with the way out."""
    method = recipe.train.method
    if method == "auto":  # methods.auto_method chooses what the data allows
        return []
    problems = []
    if METHODS[method].probes and recipe.data.streaming:
        problems.append(f"train.method={method} reads every training image once before training, which a stream is "
                        "not read as (data.streaming=true); use train.method=finetune, or data.streaming=false")
    if METHODS[method].probes and not recipe.model.pretrained:
        problems.append(f"train.method={method} fits the head on the frozen backbone's features, and "
                        "model.pretrained=false makes them random: the probe would fit noise. Fix: "
                        "model.pretrained=true, or train.method=finetune (auto chooses it for random weights)")
    if METHODS[method].fine_tunes:
        return problems
    selecting = weight_selection_settings(recipe)
    if selecting:
        problems.append(f"train.method=linear_probe fits the head once, with no optimiser steps and no evaluations "
                        f"during training to choose among or average, so {', '.join(selecting)} would never be used; "
                        "remove them, or use train.method=lp_ft")
    if recipe.model.lora is not None:
        problems.append("train.method=linear_probe trains the head alone, so model.lora's adapters would never "
                        "train; set model.lora=null, or train.method=lp_ft to fine-tune the adapters after the probe")
    if recipe.train.distill is not None:
        problems.append("train.method=linear_probe fits the head on the labels in one step, with no training steps a "
                        "teacher could guide; set train.distill=null, or train.method=lp_ft")
    drawing = pixel_drawing_settings(recipe)
    if drawing:
        problems.append(f"train.method=linear_probe reads each training image once, unaugmented, so {', '.join(drawing)} "
                        "would never be used; turn them off, or use train.method=lp_ft (the fine-tuning after the "
                        "probe uses them)")
    return problems


def _resolution_problems(recipe: Recipe) -> list[str]:
    """What a train.resolution_schedule cannot be combined with: a final size other than model.image_size, a stream,
    a method without optimiser steps, weight selections across sizes, a teacher's logits cached at one size."""
    schedule = recipe.train.resolution_schedule
    if schedule is None or schedule == "auto":
        return []
    given, t = schedule_as_given(schedule), recipe.train
    problems = []
    if schedule[-1][0] != recipe.model.image_size:
        problems.append(f"{given} ends at {schedule[-1][0]} px, and the saved model is model.image_size="
                        f"{recipe.model.image_size}: end the schedule at [{recipe.model.image_size}, share], or set "
                        f"model.image_size={schedule[-1][0]}")
    if recipe.data.streaming:
        problems.append(f"{given} restarts the epoch's reading at each new size, which a stream cannot "
                        "(data.streaming=true); set train.resolution_schedule=null or data.streaming=false")
    if t.method == "linear_probe":
        problems.append(f"{given} divides the optimiser steps, and train.method=linear_probe takes none; set "
                        "train.resolution_schedule=null, or train.method=finetune or lp_ft")
    selecting = weight_selection_settings(recipe)
    if selecting:
        problems.append(f"{given} evaluates each stage at its own size, so {', '.join(selecting)} would compare or "
                        "average weights across sizes; remove them, or set train.resolution_schedule=null")
    if t.distill is not None and t.distill.cache_logits:
        problems.append(f"{given} changes the training pixels' size between stages, and train.distill.cache_logits="
                        "true labels them once; set train.distill.cache_logits=false or train.resolution_schedule=null")
    return problems


def step_only_settings(recipe: Recipe) -> list[str]:
    """The settings of this recipe that only optimiser steps serve: LoRA's adapters and a teacher. A probe alone would
    leave them unused, and WiSE-FT's average has no counterpart for them in the probe's model."""
    return [key for key, value in (("model.lora", recipe.model.lora), ("train.distill", recipe.train.distill))
            if value is not None]


def probe_unused_settings(recipe: Recipe) -> list[str]:
    """`key=value` of this recipe's settings that the linear probe alone leaves unused: it reads each image once,
    unaugmented, fits the head in one go and takes no optimiser step (the pixel draws, the weight selections,
    train.max_steps, a resolution schedule, a train.wise_ft_alpha given as a number)."""
    t = recipe.train
    unused = pixel_drawing_settings(recipe) + weight_selection_settings(recipe)
    if t.max_steps is not None:
        unused.append(f"train.max_steps={t.max_steps}")
    if isinstance(t.resolution_schedule, list):  # the probe reads each image once, at model.image_size
        unused.append(schedule_as_given(t.resolution_schedule))
    for key in ("wise_ft_alpha", "lp_ft_head_scale"):
        if getattr(t, key) != "auto":
            unused.append(f"train.{key}={getattr(t, key):g}")
    return unused


def weight_selection_settings(recipe: Recipe) -> list[str]:
    """The settings of this recipe, as key=value, that choose the saved weights among the evaluations during
    training (so an evaluation must follow every epoch, and the weights saved may not be the last ones)."""
    t = recipe.train
    chooser = {"train.keep_best": t.keep_best, "train.early_stopping_patience": t.early_stopping_patience,
               "train.ema_decay": t.ema_decay}
    return [f"{key}={value}" for key, value in chooser.items() if value is not None]


def _wise_ft_problems(recipe: Recipe) -> list[str]:
    """What a train.wise_ft_alpha below 1 (averaging with the probe's model) cannot be combined with."""
    t = recipe.train
    alpha = t.wise_ft_alpha
    if alpha == "auto" or alpha == 1:
        return []
    given = f"train.wise_ft_alpha={alpha:g} averages the fine-tuned weights with the probe's model"
    if t.method in ("finetune", "linear_probe"):
        fits = "fits no probe" if t.method == "finetune" else "fine-tunes nothing"
        return [f"{given}, and train.method={t.method} {fits}; use train.method=lp_ft (or auto), or "
                "train.wise_ft_alpha=auto"]
    clashes = step_only_settings(recipe) + weight_selection_settings(recipe)
    if clashes:
        return [f"{given}, which is built for full fine-tuning that saves its last weights, not with "
                f"{', '.join(clashes)} (LoRA's adapters and a distillation head have no counterpart in the probe's "
                f"model; the weight selections choose among evaluations of other weights); remove them, or set "
                "train.wise_ft_alpha=auto"]
    return []


def _lp_ft_head_scale_problems(recipe: Recipe) -> list[str]:
    """A train.lp_ft_head_scale other than 1 with a method that fine-tunes from no probe's head (auto's choice is
    known only once the data is read: plan.py asks the same question then)."""
    t = recipe.train
    refused = None if t.method == "auto" else lp_ft_head_scale_refusal(t.method, t.lp_ft_head_scale)
    return [refused] if refused else []


# What makes a training image's pixels differ from epoch to epoch (a random draw per image or per batch): each key,
# and whether its value draws. `auto` counts as fixed: where the pixels must stay fixed (train.distill.cache_logits,
# a linear probe alone) auto draws nothing (tests hold data.auto_crop_scale and the flip's rule to that).
# train.distill.cache_logits needs every one of them off.
PIXEL_DRAWS: dict[str, Callable[[Any], bool]] = {
    "data.crop_scale": lambda value: value != "auto" and tuple(value) != (1.0, 1.0),
    "data.horizontal_flip": lambda value: value is True,
    "augment.policy": lambda value: value != "none",
    "augment.erasing_prob": lambda value: value > 0,
    "augment.mixup": bool,
    "augment.cutmix": bool,
}


# Each of PIXEL_DRAWS' keys at the value that draws nothing.
PIXEL_DRAWS_OFF = {"data.crop_scale": (1.0, 1.0), "data.horizontal_flip": False, "augment.policy": "none",
                   "augment.erasing_prob": 0.0, "augment.mixup": False, "augment.cutmix": False}


def without_pixel_draws(recipe: Recipe) -> Recipe:
    """The recipe with every setting that draws training pixels anew set to draw nothing."""
    sections: dict[str, dict] = {}
    for key, value in PIXEL_DRAWS_OFF.items():
        section, name = key.split(".")
        sections.setdefault(section, {})[name] = value
    return recipe.model_copy(update={section: getattr(recipe, section).model_copy(update=values)
                                     for section, values in sections.items()})


def pixel_drawing_settings(recipe: Recipe) -> list[str]:
    """`key=value` of each setting that makes the training pixels change between epochs; none: they are fixed."""
    values = flatten(recipe.model_dump(mode="json"))
    return [f"{key}={as_yaml_value(values[key])}" for key, draws in PIXEL_DRAWS.items() if draws(values[key])]


def schedule_as_given(schedule: list) -> str:
    """train.resolution_schedule as the user writes it: train.resolution_schedule=[[16, 0.25], [32, 0.75]]."""
    return f"train.resolution_schedule={as_yaml_value([list(pair) for pair in schedule])}"


def as_yaml_value(value: Any) -> str:
    """A value as it would be written after `key=` on the command line or in a recipe: [0.05, 1.0], true, null."""
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()


# The dotted form every rule above names keys in (train.distill.cache_logits); a resume compares two recipes in it.
def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{'train': {'lr': 1}} -> {'train.lr': 1}; used to compare recipes key by key."""
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
