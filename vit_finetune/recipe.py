"""Recipes: the typed schema of a run, YAML loading, dotted overrides and error reporting.

A recipe is the single source of truth for a run. Every error of a recipe is reported at once, each
naming the key, the value and the fix, before anything expensive starts.
"""

from __future__ import annotations

import difflib
import os
import re
import reprlib
from pathlib import Path
from typing import Annotated, Any, Callable, Literal

import yaml
from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, StrictInt, ValidationError, field_validator,
                      model_validator)

from .errors import EXIT_USAGE, VitFinetuneError
from .layout import RECIPE_FILE
from .methods import METHODS

PACKAGE_DIR = Path(__file__).resolve().parent
BUILTIN_PREFIX = "builtin:"  # models shipped inside the package, e.g. builtin:tiny-vit-32 for the offline demo
ASSETS_DIR = PACKAGE_DIR / "assets"
# A checkout keeps recipes/ beside the package; an installed wheel carries a copy inside it.
RECIPE_DIRS = (PACKAGE_DIR.parent / "recipes", PACKAGE_DIR / "recipes")
# recipes/accelerate/ holds Accelerate's own config files (`accelerate launch --config_file`), not recipes.
ACCELERATE_CONFIGS = "accelerate"
# The Hub's own rule for repo ids: an optional namespace and a name, no spaces, at most 96 characters.
REPO_ID_PATTERN = re.compile(r"^(?:[A-Za-z0-9][\w.-]{0,95}/)?[A-Za-z0-9][\w.-]{0,95}$")
# A recipe has ~60 keys. A YAML alias bomb ("billion laughs") loads in milliseconds as shared references, then
# expands to hundreds of millions of values wherever it is walked (validation, messages): refuse it first.
MAX_RECIPE_VALUES = 10_000
MAX_RECIPE_BYTES = 1_000_000
# The deepest key (model.lora.target_modules) is a list 3 levels down; YAML and pydantic recurse per level, and a
# value nested thousands deep ends in a RecursionError. (An alias bomb is shallow: MAX_RECIPE_VALUES stops it.)
MAX_RECIPE_DEPTH = 32
NAME_MAX = 255  # bytes in one file or folder name: ext4, XFS, APFS and NTFS allow no more
SEED_MAX = 2**32 - 1  # NumPy's generators take no larger seed (nor a negative one)
EXCERPT = reprlib.Repr()
EXCERPT.maxlevel, EXCERPT.maxstring, EXCERPT.maxother, EXCERPT.maxlong = 2, 60, 60, 40
EXCERPT.maxlist = EXCERPT.maxtuple = EXCERPT.maxdict = EXCERPT.maxset = 4


def excerpt(value: Any) -> str:
    """A short repr for messages: never the whole of a huge or deeply nested value (reprlib stops early)."""
    return EXCERPT.repr(value)


def _not_a_bool(value: Any) -> Any:
    # YAML reads `true` as a bool, and pydantic's lax mode would take it as 1 for a number.
    if isinstance(value, bool):
        raise ValueError("a boolean is not a number; give a number")
    return value


def expand_home(value: str | None) -> str | None:
    """`~` (or `~user`) spelled out once, when the recipe is read: every safety check and every write then sees one
    folder (left to each consumer, a check looked in $HOME while a write went to a folder named `~`)."""
    if value is None or not value.startswith("~"):
        return value
    expanded = os.path.expanduser(value)
    if expanded.startswith("~"):
        raise ValueError(f"no home folder is known for {value.split('/')[0]!r}; give the full path")
    return expanded


ALPHA_COLOUR = re.compile(r"^(white|black|#[0-9a-fA-F]{6})$")


def _colour(value: str) -> str:
    if not ALPHA_COLOUR.match(value):
        raise ValueError("must be white, black or a colour written #rrggbb, e.g. #ffffff")
    return value


def names_fit(value: str | None) -> str | None:
    """A path's every name within NAME_MAX bytes; a longer one fails in the file system (ENAMETOOLONG) at first use."""
    for name in (value or "").split("/"):
        if len(name.encode()) > NAME_MAX:
            raise ValueError(f"holds a name of {len(name.encode())} bytes ({excerpt(name)}); file systems allow "
                             f"{NAME_MAX}. Shorten it")
    return value


# A path a run reads or writes (or a Hub id); `~` is expanded here and nowhere else.
HomePath = Annotated[str, AfterValidator(expand_home), AfterValidator(names_fit)]
HOME_PATH_KEYS = ("model.base", "data.dataset", "train.resume", "train.distill.teacher", "output_dir")
# Numbers refuse booleans; a float key still takes a YAML int (lr: 1) and YAML 1.1's 1e-4, which it reads as a string.
Float = Annotated[float, BeforeValidator(_not_a_bool)]
# The metrics train.keep_best can follow, and whether higher or lower is better.
KEEP_BEST_GOALS = {"eval_accuracy": "max", "eval_top5_accuracy": "max", "eval_macro_f1": "max", "eval_loss": "min",
                   "eval_map": "max", "eval_micro_f1": "max",  # these two: multi-label runs
                   "eval_mae": "min", "eval_rmse": "min", "eval_r2": "max"}  # regression runs


class RecipeError(VitFinetuneError):
    """A recipe that cannot run; the message lists every problem found, one per line."""

    exit_code = EXIT_USAGE

    def __init__(self, problems: list[str], source: str = "recipe"):
        self.problems = problems
        source = source if len(source) <= 300 else excerpt(source)
        super().__init__(f"{source} has {len(problems)} problem(s):\n" + "\n".join(f"  - {p}" for p in problems))


class Strict(BaseModel):
    # No path, id or name is longer than PATH_MAX: a longer string is a mistake, and would flood every message.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, str_max_length=4096)


class LoraSettings(Strict):
    r: StrictInt = Field(16, gt=0, description="LoRA rank: higher = more capacity, more memory")
    alpha: Float = Field(16, gt=0, description="LoRA scale: the update is multiplied by alpha / r")
    dropout: Float = Field(0.1, ge=0, lt=1, description="dropout on the LoRA branch's input")
    # Roles, not module names: they are mapped onto the loaded model's own names (transformers 4.x or 5.x).
    target_modules: list[Literal["query", "key", "value", "attention_output", "mlp_in", "mlp_out"]] = Field(
        ["query", "value"], description="layers that get LoRA, by role: query, key, value, attention_output, mlp_in, mlp_out")


class ModelSettings(Strict):
    base: HomePath = Field("google/vit-base-patch16-224", description=(
        "the pretrained ViT-family model (see docs/families.md): a Hub id, a local folder with config.json, or builtin:NAME for a model shipped in "
        "vit_finetune/assets (builtin:tiny-vit-32, the offline demo's)"))
    image_size: StrictInt = Field(384, gt=0, description="training and saved resolution in px; a multiple of the patch size")
    lora: LoraSettings | None = Field(None,
        description="null = full fine-tuning; {r, alpha, dropout, target_modules} = LoRA")
    head_init: Literal["zero", "random"] = Field(
        "zero", description="new classifier head: zero (big_vision's choice: start from uniform predictions) or random")
    pretrained: bool = Field(
        True, description="false = the same architecture from random weights, a baseline to compare against")
    revision: str | None = Field(None, description="Hub branch, tag or commit of model.base; null = main")
    trust_remote_code: bool = Field(False,
        description="run the base's own Python code from the Hub; off unless you trust it")
    compile: bool | None = Field(None, description="torch.compile the model; null = on for CUDA, off on CPU")
    window_size: StrictInt | None = Field(None, gt=0, description=(
        "Swin/Swinv2 attention window; null = keep the checkpoint's (a new one resizes Swin's bias tables)"))
    drop_path_rate: Float | None = Field(None, ge=0, lt=1, description=(
        "stochastic depth, e.g. 0.1; null = the base config's. Only families whose config has a drop-path rate "
        "(BEiT, DINOv2, Swin, Data2Vec), not ViT"))
    keep_blocks: StrictInt | list[StrictInt] | None = Field(None, description=(
        "a shallower model cut from model.base's own blocks, e.g. a student of a fine-tuned teacher (model.base="
        "the teacher's output_dir): N keeps the first N blocks (measured better than every other one), a list "
        "keeps those blocks (0-based), e.g. [0, 2, 4, 7, 9, 11]. Embeddings, position table, final norm and, when its "
        "labels are the dataset's, the head come with them; null = every block"))

    @field_validator("keep_blocks", mode="before")
    @classmethod
    def _blocks_to_keep(cls, value: Any) -> Any:
        """One clear problem for a count or list of blocks, not one per member of the union."""
        if value is None:
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            if value < 1:
                raise ValueError(f"must keep at least 1 block, got {value}; e.g. 6 (of 12)")
            return value
        if not isinstance(value, list) or not value or not all(
                isinstance(block, int) and not isinstance(block, bool) for block in value):
            raise ValueError(f"must be a number of blocks or a list of block indices, got {excerpt(value)}; e.g. 6 "
                             "or [0, 2, 4, 7, 9, 11]")
        if any(block < 0 for block in value) or value != sorted(set(value)):
            raise ValueError(f"a list of blocks must hold distinct 0-based indices in increasing order, got "
                             f"{excerpt(value)}; e.g. [0, 2, 4, 7, 9, 11]")
        return value


class DataSettings(Strict):
    dataset: HomePath = Field("ethz/food101", description=(
        "a Hub dataset id, a folder of class sub-folders (optionally under train/ and validation/), a folder "
        "written by save_to_disk, a label file (.csv or .jsonl naming each image's relative path and its label or "
        "labels, or a folder holding metadata.csv / metadata.jsonl), or builtin:shapes (the demo's generated shapes)"))
    train_split: str = Field("train", description="split to train on")
    eval_split: str | None = Field("validation", description=(
        "split to evaluate on; null or missing from the dataset: data.eval_fraction of train is held out "
        "(a dataset with only train/test uses test)"))
    eval_fraction: Float = Field(0.1, gt=0, lt=1,
        description="share of train held out (stratified, seeded) when there is no eval split")
    image_column: str | None = Field(None, description="column holding the images; null = detect")
    label_column: str | None = Field(None, description="column holding the labels; null = detect")
    max_train_samples: StrictInt | None = Field(None, gt=0,
        description="train on a seeded random subset of this size; null = all")
    max_eval_samples: StrictInt | None = Field(None, gt=0,
        description="evaluate on a seeded random subset of this size; null = all")
    crop_scale: tuple[Float, Float] | Literal["auto"] = Field("auto", description=(
        "random-resized-crop area range [low, high] as shares of the image ([0.05, 1.0]: the original ViT recipe); "
        "auto: the toolkit's measured choice for the training images the run will see (data.auto_crop_scale: no "
        "crop, measured up to 7,040 images seen, kept beyond), printed with its reason and saved resolved in "
        "the output's recipe.yaml"))
    horizontal_flip: bool = Field(False, description=(
        "flip training crops left-right with probability 0.5; on for photos, off by default: wrong for digits, "
        "text and anything a mirror changes"))
    skip_bad_images: bool = Field(False, description="skip and count undecodable images instead of stopping the run")
    alpha_background: Annotated[str, AfterValidator(_colour)] | None = Field(None, description=(
        "lay images with transparency on this colour (white, black or #rrggbb) before their alpha channel is "
        "dropped, in training, evaluation, predict, explain, export and the page (saved with the model, named in its "
        "card); null = drop alpha as pipeline() does (a drawing kept only in the alpha channel is lost)"))
    allow_flat_images: bool = Field(False, description=(
        "train even when most of the training images checked decode to one flat colour (the run refuses otherwise, "
        "naming the fix)"))
    min_image_side: StrictInt = Field(2, gt=0, description="images with a smaller side (px) are treated as corrupt")
    max_image_pixels: StrictInt = Field(89_478_485, gt=0,
        description="larger images are refused (PIL's decompression-bomb limit)")
    num_workers: StrictInt | None = Field(None, ge=0,
        description="DataLoader decode processes; null = chosen from the CPU count and the device")
    class_balance: Literal["weights", "sampler"] | None = Field(None, description=(
        "skewed label counts: weights = each image's loss weighted by N / (classes x its class's count); "
        "sampler = each epoch drawn with replacement so classes come up equally often; null = off"))
    streaming: bool = Field(False, description=(
        "read data.dataset as a stream of parquet or WebDataset .tar shards (a Hub dataset id or a local folder) "
        "instead of downloading it whole: for datasets larger than the disk. Needs a ClassLabel label column, or a "
        "list of ClassLabel for multi-label (or data.label_names), and an eval split;"
        " each process reads its own shards (docs/data.md, 'Streaming')"))
    label_names: list[str] | None = Field(None, description=(
        "data.streaming with plain integer labels (WebDataset's .cls files): the class names in index order; "
        "null = the label column's ClassLabel names"))
    multi_label: bool | None = Field(None, description=(
        "each image has a set of labels, which may be empty (sigmoid scores, binary cross-entropy, per-class "
        "thresholds); null = detect: a label file whose cells hold lists, or a dataset whose label column is a list of "
        "ClassLabel (the run says which)"))
    task: Literal["auto", "single_label", "multi_label", "regression"] = Field("auto", description=(
        "what the model learns: auto = classification, multi-label when the labels are sets (data.multi_label) and "
        "refusing a label column of fractional numbers; regression = a number per image (the label column), or "
        "several (data.target_columns)"))
    target_columns: list[str] | None = Field(None, description=(
        "data.task=regression with several targets: the columns holding them (null = data.label_column alone)"))
    label_separator: str = Field(";", description=(
        "label files: the character joining several labels in one cell, e.g. 'cat;dog'; '' = never split"))
    shuffle_buffer: StrictInt = Field(1000, gt=0, description=(
        "data.streaming: rows each process holds to shuffle its stream (shard order is shuffled too, per pass); "
        "more = better mixed, more memory (rows x encoded image size)"))

    @field_validator("crop_scale")
    @classmethod
    def _crop_scale_ordered(cls, value: tuple[float, float] | str) -> tuple[float, float] | str:
        if value == "auto":
            return value
        low, high = value
        if not 0 < low <= high <= 1:
            raise ValueError(f"must satisfy 0 < low <= high <= 1, got {list(value)}; e.g. [0.05, 1.0]")
        return value

    @model_validator(mode="after")
    def _streaming_keys(self) -> DataSettings:
        # What a stream cannot do without reading it whole first: subsample it, carve an eval part from it, or
        # count its classes for balancing.
        unsupported = {"max_train_samples": self.max_train_samples, "max_eval_samples": self.max_eval_samples,
                       "class_balance": self.class_balance}
        given = [f"data.{key}={value}" for key, value in unsupported.items() if value is not None]
        if self.streaming and given:
            raise ValueError(f"data.streaming=true cannot be combined with {', '.join(given)} (a stream is not read "
                             "whole before training); set them to null, or data.streaming=false")
        if self.multi_label and self.class_balance == "sampler":
            raise ValueError("data.class_balance=sampler draws images by their one class; with data.multi_label "
                             "use class_balance=weights (a positive weight per class) or null")
        chosen_multi = {"single_label": False, "multi_label": True}.get(self.task)
        if chosen_multi is not None and self.multi_label is not None and self.multi_label != chosen_multi:
            raise ValueError(f"data.task={self.task} and data.multi_label={str(self.multi_label).lower()} contradict "
                             "each other; set data.multi_label=null")
        if chosen_multi is not None and self.multi_label is None:  # the loaders read data.multi_label
            self.multi_label = chosen_multi
        if self.task == "regression":
            given = {"data.multi_label": self.multi_label, "data.class_balance": self.class_balance,
                     "data.label_names": self.label_names}
            given = [f"{key}={value}" for key, value in given.items() if value is not None]
            if self.streaming:
                given.append("data.streaming=true")
            if given:
                raise ValueError(f"data.task=regression has no classes: {', '.join(given)} do not apply; remove "
                                 "them (a stream is read as classification only)")
        if self.target_columns is not None and self.task != "regression":
            raise ValueError("data.target_columns names a regression's targets; set data.task=regression, or remove it")
        if self.target_columns is not None and (not self.target_columns
                                                or len(set(self.target_columns)) != len(self.target_columns)):
            raise ValueError(f"data.target_columns={excerpt(self.target_columns)} must name at least one column, each "
                             "once")
        if self.label_names is not None and not self.streaming:
            raise ValueError("data.label_names names the classes of a stream's integer labels; it applies with "
                             "data.streaming=true only (a dataset loaded whole finds its classes itself)")
        if self.label_names is not None and (len(set(self.label_names)) != len(self.label_names) or len(self.label_names) < 2):
            raise ValueError(f"data.label_names={excerpt(self.label_names)} must hold at least two distinct names")
        return self


class AugmentSettings(Strict):
    """DeiT's batch augmentations, run on the device on whole batches (vit_finetune.augment); all off by default."""

    policy: Literal["none", "randaugment", "trivialaugment"] = Field("none", description="kornia's automatic augmentation policies")
    randaugment_ops: StrictInt = Field(2, gt=0, description="RandAugment: operations per image")
    randaugment_magnitude: StrictInt = Field(9, ge=0, le=30, description="RandAugment: strength of every operation, 0-30")
    erasing_prob: Float = Field(0.0, ge=0, le=1, description="random erasing: chance per image that a rectangle is blanked")
    mixup: bool = Field(False, description="blend pairs of images and their labels (soft-target loss)")
    cutmix: bool = Field(False, description="paste a box of another image; its label weighs the pasted area")
    mix_prob: Float = Field(1.0, ge=0, le=1, description="chance that a batch is mixed at all, with mixup or cutmix on")
    mix_switch_prob: Float = Field(0.5, ge=0, le=1, description="both on: chance that a mixed batch uses CutMix, not Mixup")
    mix_off_epochs: StrictInt = Field(0, ge=0, description="no mixing in the last N epochs (train on clean images at the end)")


# What makes a training image's pixels differ from epoch to epoch (a random draw per image or per batch): each key,
# and whether its value draws. data.crop_scale=auto counts as fixed: data.auto_crop_scale never crops (a test holds it
# to that). train.distill.cache_logits needs every one of them off.
PIXEL_DRAWS: dict[str, Callable[[Any], bool]] = {
    "data.crop_scale": lambda value: value != "auto" and tuple(value) != (1.0, 1.0),
    "data.horizontal_flip": bool,
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
    return [f"{key}={yaml.safe_dump(values[key], default_flow_style=True).strip().removesuffix('...').strip()}"
            for key, draws in PIXEL_DRAWS.items() if draws(values[key])]


class DistillSettings(Strict):
    """Knowledge distillation from a trained classifier of the same labels (DeiT, arXiv 2012.12877)."""

    teacher: HomePath = Field(..., description=(
        "the teacher: a run's output_dir, a folder saved with save_pretrained or a Hub id of an image classifier "
        "with the dataset's labels; it runs frozen, at its own resolution and normalisation"))
    weight: Float = Field(0.5, ge=0, le=1, description=(
        "share of the loss that follows the teacher (the rest follows the labels); a DeiT student's distillation "
        "head follows the teacher, its class head the labels, both weighted so"))
    temperature: Float = Field(1.0, gt=0, description=(
        "soft targets: both logits are divided by it before the softmax (higher = flatter, timm uses 4); the loss "
        "is multiplied by its square"))
    mode: Literal["soft", "hard"] = Field("hard", description=(
        "hard: cross-entropy on the teacher's top class (DeiT's better choice); soft: KL divergence to the "
        "teacher's softened probabilities"))
    cache_logits: bool = Field(False, description=(
        "the teacher labels every training image once before training instead of every batch, so a step costs "
        "about what one without distillation does; only when the training pixels are the same every epoch (no crop, "
        "flip, policy, erasing, Mixup/CutMix, no streaming). Memory: one float32 row of class scores per training "
        "image, in each process's host memory"))


class TrainSettings(Strict):
    epochs: StrictInt = Field(1, gt=0, description="passes over the training split")
    max_steps: StrictInt | None = Field(None, gt=0, description="stop after this many optimiser steps; null = run all epochs")
    batch_size: StrictInt = Field(32, gt=0, description="images per device per forward pass")
    grad_accum: StrictInt = Field(1, gt=0,
        description="forward passes per optimiser step (batch = batch_size x devices x grad_accum)")
    optimizer: Literal["adamw", "sgd"] = Field("adamw", description="adamw or sgd (with train.momentum)")
    lr: Float | Literal["auto"] = Field("auto", description=(
        "peak learning rate, reached after the warm-up; auto (AdamW only): optim.auto_lr, 2e-5 for full fine-tuning "
        "and 1e-3 for LoRA, printed"))
    momentum: Float = Field(0.9, ge=0, lt=1, description="SGD momentum (sgd only)")
    weight_decay: Float = Field(0.0, ge=0,
        description="decoupled weight decay; never on biases, norms, CLS or position embeddings")
    warmup_steps: StrictInt = Field(0, ge=0, description="optimiser steps of linear warm-up from 0 to train.lr")
    scheduler: Literal["cosine", "linear", "constant"] = Field("cosine",
        description="lr decay after the warm-up: cosine, linear or constant")
    max_grad_norm: Float | None = Field(1.0, gt=0,
        description="clip the global gradient norm to this; null = no clipping")
    label_smoothing: Float = Field(0.0, ge=0, lt=1, description="cross-entropy label smoothing")
    seed: StrictInt = Field(0, description=(
        "seeds weights of the head, data order, augmentation and the carved eval split; 0 to 4294967295"))
    cpu_threads: StrictInt | None = Field(None, gt=0, description=(
        "torch threads of a run on CPU; a result's last bits depend on the thread count, so a fixed count gives "
        "the same figures on every machine; null = torch's default (one per core)"))
    mixed_precision: Literal["no", "bf16", "fp16"] = Field("no",
        description="no, bf16 or fp16 autocast; weights stay float32")
    log_every_steps: StrictInt = Field(10, gt=0,
        description="log loss, lr and images/s every this many steps (the loss is read back from the device only then)")
    eval_every_steps: StrictInt | Literal["auto"] | None = Field("auto", description=(
        "evaluate during training every this many steps; null = at the end of every epoch; auto: every epoch when "
        "that costs little, else every few epochs or only at the end, so evaluations take at most about 10% of the "
        "training (evaluation.auto_eval_every_steps; every epoch with keep_best, early stopping or an EMA), "
        "printed. The final evaluation is always on the whole eval split"))
    checkpoint_every_steps: StrictInt | None = Field(None, gt=0,
        description="save a resumable checkpoint every this many steps; null = none")
    keep_checkpoints: StrictInt = Field(2, gt=0, description="how many of the newest checkpoints to keep")
    resume: HomePath | None = Field(None,
        description="null, auto (the latest checkpoint in output_dir) or a checkpoint folder")
    resume_ignore_changes: list[str] = Field(
        [], description="recipe keys allowed to differ from the checkpoint's on resume, e.g. [train.epochs]")
    report_to: list[Literal["tensorboard", "trackio", "wandb", "mlflow"]] = Field(
        [], description="experiment trackers that follow the run live, through Accelerate, e.g. [tensorboard] "
                        "(files in output_dir/runs); each needs its package installed")
    collective_timeout_s: StrictInt = Field(
        600, gt=0, description="several processes: seconds one waits for the others in a collective before the run "
                               "stops with the stuck rank named (a frozen process would hang the rest forever)")
    ema_decay: Float | None = Field(None, gt=0, lt=1, description=(
        "keep an EMA of the weights, e.g. 0.999 (it forgets over ~1/(1-decay) steps: keep that well below the run's "
        "steps); evaluated beside the raw weights, the better is saved; null = off"))
    keep_best: Literal[tuple(KEEP_BEST_GOALS)] | None = Field(None, description=(
        "save the weights of the best evaluation by this metric (eval_accuracy, eval_loss, eval_macro_f1, "
        "eval_top5_accuracy) instead of the last; null = the last"))
    early_stopping_patience: StrictInt | None = Field(None, gt=0, description=(
        "stop after this many evaluations without gain in train.keep_best; null = never"))
    layer_decay: Float | None = Field(None, gt=0, le=1, description=(
        "layer-wise lr decay, e.g. 0.75: lr x decay^(blocks + 1 - depth), embeddings at depth 0, the head at "
        "blocks + 1; null = one lr"))
    method: Literal[("auto", *METHODS)] = Field("auto", description=(
        "finetune: train every weight (or LoRA's) from a new head; linear_probe: fit only the head, on the frozen "
        "backbone's features of each training image, computed once; lp_ft: that probe, then fine-tuning from its "
        "head; auto: chosen from the data and the schedule (methods.auto_method), printed with its reason"))
    head_lr: Float | Literal["auto"] = Field("auto", description=(
        "peak lr of the new classifier head (it starts from nothing, the backbone from pretraining); auto: "
        "optim.auto_head_lr, printed with its reason (AdamW: at least 2e-3; SGD: train.lr)"))

    @field_validator("lr", "head_lr", mode="before")
    @classmethod
    def _lr_number_or_auto(cls, value):
        """One clear problem for a misspelt lr, not one per member of the union."""
        if isinstance(value, bool):
            raise ValueError("a boolean is not a number; give a number or auto, e.g. 2e-5")
        if isinstance(value, str) and value != "auto":
            try:
                return float(value)  # YAML 1.1 reads 1e-4 as a string
            except ValueError:
                raise ValueError(f"must be a number or auto, got {value!r}; e.g. 2e-5") from None
        return value

    # Beyond 1e6 the lr overflows inside the optimiser.
    @field_validator("lr", "head_lr")
    @classmethod
    def _lr_positive(cls, value: float | str) -> float | str:
        if value != "auto" and not 0 < value <= 1e6:
            raise ValueError(f"must be a learning rate above 0 (at most 1e6) or auto, got {value}; e.g. 0.002")
        return value

    @model_validator(mode="after")
    def _auto_lr_for_adamw(self) -> TrainSettings:
        if self.lr == "auto" and self.optimizer != "adamw":
            raise ValueError(f"train.lr=auto is measured for AdamW only; set train.lr for train.optimizer="
                             f"{self.optimizer}, e.g. train.lr=0.01 (the ViT paper's SGD range is 0.003-0.03 at batch 512)")
        return self

    distill: DistillSettings | None = Field(None, description=(
        "null = off; {teacher, weight, temperature, mode, cache_logits} = train against a teacher's predictions as well as the labels"))

    regression_loss: Literal["mse", "huber"] = Field("mse", description=(
        "data.task=regression: the loss of the standardised targets; huber = squared below one standard deviation, "
        "linear beyond (less pulled by outliers)"))
    threshold_metric: Literal["f1", "f2", "f0.5"] = Field("f1", description=(
        "multi-label: each class's threshold is chosen on the eval split to maximise this (f2 favours recall, f0.5 "
        "precision); saved with the model and used by predict"))
    threshold_holdout: Float | None = Field(None, gt=0, lt=1, description=(
        "multi-label: share of the eval split (seeded) on which the thresholds are chosen; the metrics are then "
        "measured on the rest. null = chosen on the same images they are scored on (optimistic; metrics.json "
        "says so)"))

    @field_validator("eval_every_steps")
    @classmethod
    def _eval_every_positive(cls, value: int | str | None) -> int | str | None:
        if isinstance(value, int) and value <= 0:
            raise ValueError(f"must be a number of steps above 0, null (every epoch) or auto, got {value}")
        return value

    @field_validator("seed")
    @classmethod
    def _seed_in_range(cls, value: int) -> int:
        if not 0 <= value <= SEED_MAX:
            raise ValueError(f"must be between 0 and {SEED_MAX} (the seeds NumPy's generators take), e.g. 0")
        return value

    @field_validator("mixed_precision", mode="before")
    @classmethod
    def _yaml_no_is_a_string(cls, value: Any) -> Any:
        return "no" if value is False else value  # YAML 1.1 reads a bare `no` as false


class HubSettings(Strict):
    push: bool = Field(False,
        description="upload the finished output folder to the Hub (needs a token and hub.repo_id)")
    repo_id: str | None = Field(None, description="namespace/name of the Hub model repo to push to")
    private: bool = Field(False, description="create the Hub repo as private")

    @field_validator("repo_id")
    @classmethod
    def _repo_id_is_valid(cls, value: str | None) -> str | None:
        """huggingface_hub's own rules (no '--' or '..', no '.git' ending...), then the Hub's (the name starts with a
        letter or digit): an id either refuses fails only at the push, after training."""
        from huggingface_hub.errors import HFValidationError
        from huggingface_hub.utils import validate_repo_id

        if value is None:
            return value
        try:
            validate_repo_id(value)
        except HFValidationError as error:
            reason = str(error).replace(f": {value!r}", "").rstrip(".")
        else:
            reason = None if REPO_ID_PATTERN.match(value) else "a name must start with a letter or digit"
        if reason:
            raise ValueError(f"{excerpt(value)} is not a valid Hub repo id ({reason}); use 'name' or 'namespace/name' with letters, digits, "
                             "'-', '_' and '.', e.g. your-name/vit-food101-384")
        return value


class Recipe(Strict):
    model: ModelSettings = ModelSettings()
    data: DataSettings = DataSettings()
    augment: AugmentSettings = AugmentSettings()
    train: TrainSettings = TrainSettings()
    hub: HubSettings = HubSettings()
    output_dir: HomePath = Field("outputs/run", description="folder for the model, metrics, pictures and checkpoints")
    overwrite: bool = Field(False, description="replace a finished run (or checkpoints) already in output_dir")
    pictures: bool = Field(True, description="draw the PNG pictures (training curves, confusion matrix, misclassified "
                           "images, position embeddings) into output_dir; false saves their time in sweeps")

    @model_validator(mode="after")
    def _consistent(self) -> Recipe:
        problems = []
        if self.hub.push and not self.hub.repo_id:
            problems.append("hub.push=true needs hub.repo_id, e.g. hub.repo_id=your-name/vit-food101-384")
        if self.train.resume not in (None, "auto") and not _is_dir(self.train.resume):
            problems.append(f"train.resume={self.train.resume!r} is neither null, auto nor an existing checkpoint folder")
        unknown = sorted(set(self.train.resume_ignore_changes) - set(flatten(self.model_dump(mode="json"))))
        if unknown:
            problems.append(f"train.resume_ignore_changes names unknown keys {excerpt(unknown)}; use dotted keys such as train.epochs")
        if self.train.resume is not None and self.overwrite:
            problems.append("train.resume and overwrite=true contradict each other: choose one")
        if self.train.early_stopping_patience is not None and self.train.keep_best is None:
            problems.append("train.early_stopping_patience needs train.keep_best (the metric whose gain it waits "
                            "for), e.g. train.keep_best=eval_accuracy")
        if self.train.distill is not None and self.data.multi_label:
            problems.append("train.distill works with single-label classification only (a teacher's top class or "
                            "softmax); set train.distill=null for data.multi_label=true")
        if self.data.task == "regression":
            problems.extend(_regression_problems(self))
        if self.train.distill is not None and self.train.distill.cache_logits:
            problems.extend(_cache_logits_problems(self))
        problems.extend(_method_problems(self))
        if self.train.warmup_steps and self.train.max_steps and self.train.warmup_steps >= self.train.max_steps:
            problems.append(
                f"train.warmup_steps={self.train.warmup_steps} must be smaller than train.max_steps={self.train.max_steps}"
            )
        if problems:
            raise ValueError("; ".join(problems))
        return self


def _regression_problems(recipe: Recipe) -> list[str]:
    """What only classes give meaning to: soft labels, a teacher's classes, a probe's logistic head."""
    t, a = recipe.train, recipe.augment
    given = {"train.label_smoothing": t.label_smoothing or None, "augment.mixup": a.mixup or None,
             "augment.cutmix": a.cutmix or None, "train.distill": t.distill}
    problems = [f"{key} works on class labels; data.task=regression has none: remove it"
                for key, value in given.items() if value is not None]
    if t.method in ("linear_probe", "lp_ft"):
        problems.append(f"train.method={t.method} fits a classifier's head (logistic regression) on the frozen "
                        "features, not a regression's; use train.method=finetune (or auto) with data.task=regression")
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
    if METHODS[method].fine_tunes:
        return problems
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


def _is_file(path: str | Path) -> bool:
    """Path.is_file, but False (not OSError) for a name the file system refuses, e.g. longer than 255 bytes."""
    try:
        return Path(path).is_file()
    except OSError:
        return False


def _is_dir(path: str | Path) -> bool:
    try:
        return Path(path).is_dir()
    except OSError:
        return False


def available_recipes() -> dict[str, Path]:
    """Recipe names (relative paths without .yaml, sub-folders included) mapped to their files."""
    found: dict[str, Path] = {}
    for directory in RECIPE_DIRS:
        if directory.is_dir():
            for path in recipe_files(directory):
                found.setdefault(path.relative_to(directory).with_suffix("").as_posix(), path)
    return found


def recipe_files(directory: Path) -> list[Path]:
    """The recipe files under `directory`, sub-folders included, Accelerate's config files left out."""
    return sorted(path for path in directory.rglob("*.yaml")
                  if path.relative_to(directory).parts[0] != ACCELERATE_CONFIGS)


def find_recipe(name_or_path: str) -> Path:
    """A recipe file from a shipped name (food101_384) or a path; unknown names list the shipped ones."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or _is_file(path):
        if not _is_file(path):
            raise RecipeError([f"recipe file {name_or_path!r} does not exist"], "--recipe")
        return path
    recipes = available_recipes()
    if name_or_path not in recipes:
        close = difflib.get_close_matches(name_or_path, recipes, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise RecipeError(
            [f"no recipe named {name_or_path!r}.{hint} Available: {', '.join(recipes)}; or pass a path to a .yaml file"],
            "--recipe",
        )
    return recipes[name_or_path]


def read_yaml(path: Path) -> dict[str, Any]:
    try:
        if path.stat().st_size > MAX_RECIPE_BYTES:
            raise RecipeError([f"{path} is {path.stat().st_size:,} bytes; a recipe is a few KB (limit "
                               f"{MAX_RECIPE_BYTES:,}). Is it the right file?"], str(path))
        data = yaml.safe_load(path.read_text())  # safe loader: a recipe can never construct Python objects
    except yaml.YAMLError as error:
        raise RecipeError([f"{path} is not valid YAML: {error}"], str(path)) from None
    except RecursionError:
        raise RecipeError([f"{path} is nested deeper than Python can read; a recipe is at most "
                           f"{MAX_RECIPE_DEPTH} levels deep"], str(path)) from None
    except UnicodeDecodeError as error:
        raise RecipeError([f"{path} is not UTF-8 text ({error.reason} at byte {error.start}); save it as UTF-8"],
                          str(path)) from None
    except OSError as error:
        raise RecipeError([f"{path} cannot be read: {error.strerror or error}"], str(path)) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise RecipeError([f"{path} must hold a mapping of sections (model:, data:, ...), got {type(data).__name__}"])
    return data


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `section.key=value` overrides; values are parsed as YAML scalars and typed by the schema later."""
    problems = []
    for override in overrides:
        key, sep, raw = override.partition("=")
        parts = key.strip().split(".")
        if not sep or not all(parts):
            problems.append(f"override {excerpt(override)} must look like section.key=value, e.g. train.lr=0.01")
            continue
        try:
            value = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError:
            value = raw  # let the schema decide whether a plain string is acceptable here
        except RecursionError:
            problems.append(f"override {key.strip()}=... is nested deeper than Python can read; a recipe value is at "
                            f"most {MAX_RECIPE_DEPTH} levels deep")
            continue
        node = data
        for part in parts[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[parts[-1]] = value
    if problems:
        raise RecipeError(problems, "command line")
    return data


def _valid_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    keys = []
    for name, field in model.model_fields.items():
        keys.append(prefix + name)
        for candidate in (field.annotation, *getattr(field.annotation, "__args__", ())):
            if isinstance(candidate, type) and issubclass(candidate, BaseModel):
                keys.extend(_valid_keys(candidate, f"{prefix}{name}."))
    return keys


def key_descriptions(model: type[BaseModel] = Recipe, prefix: str = "") -> dict[str, str]:
    """Every recipe key (dotted) mapped to its one-line meaning, from the schema's Field descriptions."""
    described: dict[str, str] = {}
    for name, field in model.model_fields.items():
        sections = [c for c in (field.annotation, *getattr(field.annotation, "__args__", ()))
                    if isinstance(c, type) and issubclass(c, BaseModel)]
        if field.description or not sections:  # a section that may be null (model.lora) is a key itself
            described[prefix + name] = field.description or ""
        for section in sections:
            described.update(key_descriptions(section, f"{prefix}{name}."))
    return described


def default_values(model: type[BaseModel] = Recipe, prefix: str = "") -> dict[str, Any]:
    """Every key's default (dotted, as JSON values), keys inside sections that default to null (train.distill)
    included: what a key that a recipe or a checkpoint does not name stands for."""
    from pydantic_core import to_jsonable_python

    values: dict[str, Any] = {}
    for name, field in model.model_fields.items():
        sections = [c for c in (field.annotation, *getattr(field.annotation, "__args__", ()))
                    if isinstance(c, type) and issubclass(c, BaseModel)]
        if not field.is_required():
            default = field.get_default(call_default_factory=True)
            if not isinstance(default, BaseModel):  # a section's keys come from its own fields, below
                values[prefix + name] = to_jsonable_python(default)
        for section in sections:
            values.update(default_values(section, f"{prefix}{name}."))
    return values


def format_keys(recipe: Recipe) -> str:
    """One line per key, `key = value  # meaning`, with the values this recipe resolves to (`-`: its section is null)."""
    values = flatten(recipe.model_dump(mode="json"))

    def shown_value(key: str) -> str:
        if key in values:
            return yaml.safe_dump(values[key], default_flow_style=True).strip().removesuffix("...").strip()
        return "(set, below)" if any(k.startswith(f"{key}.") for k in values) else "-"

    shown = {key: shown_value(key) for key in key_descriptions()}
    width = max(len(f"{key} = {value}") for key, value in shown.items())
    return "".join(f"{f'{key} = {value}':<{width}}  # {meaning}\n"
                   for (key, value), meaning in zip(shown.items(), key_descriptions().values()))


def _location(error: dict[str, Any]) -> str:
    location = ".".join(str(part) for part in error["loc"] if not str(part).startswith("function-"))
    # Pydantic appends the union member it tried (e.g. "lora.LoraSettings"); keep only recipe keys.
    return re.sub(r"\.(LoraSettings|DistillSettings|list\[.*?\]|tuple\[.*?\])", "", location)


def _describe(error: dict[str, Any]) -> str:
    location = _location(error)
    if error["type"] == "extra_forbidden":
        close = difflib.get_close_matches(location, _valid_keys(Recipe), n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]!r}?" if close else "; run with --print to see every valid key"
        return f"unknown key {location!r}{hint}"
    if error["type"] == "missing":  # its input is the section around it, which says nothing useful
        return f"{location} is required and has no default; set it, e.g. {location}=VALUE"
    value = error.get("input")
    message = error["msg"].removeprefix("Value error, ")
    if location == "":
        return message
    return f"{location}={excerpt(value)}: {message}"


def count_values(data: Any, limit: int = MAX_RECIPE_VALUES) -> int:
    """Values in `data` with YAML aliases expanded, counted without expanding them (each shared node's count is
    remembered); anything over `limit`, or a node that contains itself, counts as limit + 1."""
    counts: dict[int, int] = {}
    open_nodes: set[int] = set()

    def count(node: Any) -> int:
        if not isinstance(node, (dict, list)):
            return 1
        key = id(node)
        if key in open_nodes:  # `a: &a [*a]` is a list that holds itself: infinitely large once expanded
            return limit + 1
        if key not in counts:
            open_nodes.add(key)
            children = node.values() if isinstance(node, dict) else node
            counts[key] = min(limit + 1, 1 + sum(count(child) for child in children))
            open_nodes.discard(key)
        return counts[key]

    try:
        return count(data)
    except RecursionError:  # nested deeper than Python's stack: no recipe is
        return limit + 1


def deepest(data: Any, limit: int = MAX_RECIPE_DEPTH) -> tuple[int, str]:
    """How deep `data` nests (counted up to limit + 1, without recursion) and the dotted key where it does. A node
    shared through YAML aliases is walked once, so an alias bomb costs no more than its text."""
    stack, found, seen = [(data, 1, "")], (0, ""), set()
    while stack:
        node, depth, key = stack.pop()
        if not isinstance(node, (dict, list)) or id(node) in seen:
            continue
        seen.add(id(node))
        found = max(found, (depth, key))
        if depth > limit:
            break
        children = node.items() if isinstance(node, dict) else ((None, child) for child in node)
        stack.extend((child, depth + 1, f"{key}.{name}".lstrip(".") if name is not None else key)
                     for name, child in children)
    return found


def validate(data: dict[str, Any], source: str = "recipe", overridden: tuple[str, ...] = ()) -> Recipe:
    """Type and check a recipe mapping; raise RecipeError listing every problem, those of a key set on the command
    line (`overridden`) marked as such: the recipe file does not hold them."""
    depth, key = deepest(data)
    if depth > MAX_RECIPE_DEPTH:
        raise RecipeError([f"{key or 'the recipe'} is nested more than {MAX_RECIPE_DEPTH} levels deep (lists or "
                           f"mappings inside each other, or a YAML alias that contains itself); a recipe is at most "
                           f"{MAX_RECIPE_DEPTH}. Write the value out flat"], source)
    if count_values(data) > MAX_RECIPE_VALUES:
        raise RecipeError([f"the recipe expands to more than {MAX_RECIPE_VALUES:,} values (YAML aliases repeated "
                           "inside each other, or a value that contains itself); a recipe has about 60. Write the "
                           "values out instead of nesting aliases"], source)
    try:
        return Recipe.model_validate(data)
    except ValidationError as error:
        def from_command_line(e: dict[str, Any]) -> bool:
            return any(f"{_location(e)}.".startswith(f"{key}.") for key in overridden)

        problems = list(dict.fromkeys(_describe(e) + (" (set on the command line)" if from_command_line(e) else "")
                                      for e in error.errors()))
        raise RecipeError(problems, source) from None


def load_recipe(name_or_path: str | None, overrides: list[str] = ()) -> Recipe:
    """Find, read, override and validate a recipe; with no name, the schema's defaults."""
    data: dict[str, Any] = {}
    source = "recipe"
    if name_or_path:
        path = find_recipe(name_or_path)
        data, source = read_yaml(path), str(path)
    overridden = tuple(override.partition("=")[0].strip() for override in overrides)
    if overridden:
        source = f"{source} with the command line's overrides"
    return validate(apply_overrides(data, list(overrides)), source, overridden)


def to_yaml(recipe: Recipe) -> str:
    return yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False)


def write_recipe(recipe: Recipe, folder: Path) -> None:
    """The resolved recipe as `recipe.yaml` in an output folder, its staging folder or a checkpoint."""
    (Path(folder) / RECIPE_FILE).write_text(to_yaml(recipe))


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{'train': {'lr': 1}} -> {'train.lr': 1}; used to compare recipes key by key."""
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
