"""The schema of a recipe: its sections as pydantic models that refuse keys they do not know, each field with its
type, its default, its one-line meaning (what `--keys` prints) and the checks of its own value.

Checks between keys live in checks.py; each section's validator below hands its keys over to it.
"""

from __future__ import annotations

import os
import re
from typing import Annotated, Any, Literal

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, StrictInt, field_validator,
                      model_validator)

from ..methods import METHODS
from ..metric_goals import KEEP_BEST_GOALS  # each task's, for train.keep_best
from .checks import check_data_section, check_recipe, check_train_section, fold_older_spellings
from ..errors import excerpt
from ..sources import REPO_ID_PATTERN
from .limits import SEED_MAX, WHOLE_NUMBER_LIMITS, names_fit


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


def at_most(key: str) -> AfterValidator:
    """The bound WHOLE_NUMBER_LIMITS sets on `key`'s whole number (auto and null pass), refused with its reason."""
    limit, why = WHOLE_NUMBER_LIMITS[key]

    def check(value: Any) -> Any:
        if isinstance(value, int) and value > limit:
            raise ValueError(f"must be at most {limit:,} ({why}); give a smaller number")
        return value

    return AfterValidator(check)


def Bounded(key: str, kind: Any = StrictInt) -> Any:
    """A whole-number key (`kind`: the type as it may also be auto or null) within its WHOLE_NUMBER_LIMITS bound."""
    return Annotated[kind, at_most(key)]


ALPHA_COLOUR = re.compile(r"^(white|black|#[0-9a-fA-F]{6})$")


def _colour(value: str) -> str:
    if not ALPHA_COLOUR.match(value):
        raise ValueError("must be white, black or a colour written #rrggbb, e.g. #ffffff")
    return value


# A path a run reads or writes (or a Hub id); `~` is expanded here and nowhere else.
HomePath = Annotated[str, AfterValidator(expand_home), AfterValidator(names_fit)]
HOME_PATH_KEYS = ("model.base", "data.dataset", "train.resume", "train.distill.teacher", "output_dir")
# Numbers refuse booleans; a float key still takes a YAML int (lr: 1) and YAML 1.1's 1e-4, which it reads as a string.
Float = Annotated[float, BeforeValidator(_not_a_bool)]


class Strict(BaseModel):
    # No path, id or name is longer than PATH_MAX: a longer string is a mistake, and would flood every message.
    # Frozen: a recipe is read and checked once; what a run changes (plan.py) is a copy.
    model_config = ConfigDict(extra="forbid", frozen=True, str_max_length=4096)


class LoraSettings(Strict):
    r: Bounded("model.lora.r") = Field(16, gt=0, description="LoRA rank: higher = more capacity, more memory")
    alpha: Float = Field(16, gt=0, description="LoRA scale: the update is multiplied by alpha / r")
    dropout: Float = Field(0.1, ge=0, lt=1, description="dropout on the LoRA branch's input")
    # Roles, not module names: they are mapped onto the loaded model's own names (transformers 4.x or 5.x).
    target_modules: list[Literal["query", "key", "value", "attention_output", "mlp_in", "mlp_out"]] = Field(
        ["query", "value"], description="layers that get LoRA, by role: query, key, value, attention_output, mlp_in, mlp_out")


class ModelSettings(Strict):
    base: HomePath = Field("google/vit-base-patch16-224", description=(
        "the pretrained ViT-family model (see docs/families.md): a Hub id, a local folder with config.json, or builtin:NAME for a model shipped in "
        "vit_finetune/assets (builtin:tiny-vit-32, the offline demo's)"))
    image_size: Bounded("model.image_size") = Field(384, gt=0, description="training and saved resolution in px; a multiple of the patch size")
    lora: LoraSettings | None = Field(None,
        description="null = full fine-tuning; {r, alpha, dropout, target_modules} = LoRA")
    head_init: Literal["zero", "random"] = Field(
        "zero", description="new classifier head: zero (big_vision's choice: start from uniform predictions) or random")
    pretrained: bool = Field(
        True, description="false = the same architecture from random weights, a baseline to compare against")
    revision: str | None = Field(None, description="Hub branch, tag or commit of model.base; null = main")
    trust_remote_code: bool = Field(False,
        description="run the base's own Python code from the Hub; off unless you trust it")
    compile: bool | Literal["auto"] = Field("auto", description=(
        "torch.compile the model, its attention kept out of the compiled graph on the fused kernels (compiling.py); "
        "auto: compiling.auto_compile, on only where compiling was measured faster (so far nowhere: off), printed "
        "and saved resolved in the output's recipe.yaml"))
    window_size: Bounded("model.window_size", StrictInt | None) = Field(None, gt=0, description=(
        "Swin/Swinv2 attention window; null = keep the checkpoint's (a new one resizes Swin's bias tables)"))
    drop_path_rate: Float | None = Field(None, ge=0, lt=1, description=(
        "stochastic depth, e.g. 0.1; null = the base config's. Only families whose config has a drop-path rate "
        "(BEiT, DINOv2, Swin, Data2Vec), not ViT"))
    keep_blocks: StrictInt | list[StrictInt] | None = Field(None, description=(
        "a shallower model cut from model.base's own blocks, e.g. a student of a fine-tuned teacher (model.base="
        "the teacher's output_dir): N keeps the first N blocks (measured better than every other one), a list "
        "keeps those blocks (0-based), e.g. [0, 2, 4, 7, 9, 11]. Embeddings, position table, final norm and, when its "
        "labels are the dataset's, the head come with them; null = every block"))

    @field_validator("compile", mode="before")
    @classmethod
    def _null_is_auto(cls, value: Any) -> Any:
        """Earlier versions spelled auto as null: their recipes and checkpoints still read the same."""
        return "auto" if value is None else value

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
    num_workers: Bounded("data.num_workers", StrictInt | None) = Field(None, ge=0,
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
    shuffle_buffer: Bounded("data.shuffle_buffer") = Field(1000, gt=0, description=(
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

    @model_validator(mode="before")
    @classmethod
    def _multi_label_is_a_task(cls, values: Any) -> Any:
        """data.multi_label, the older spelling, is read as data.task: nothing after reads it."""
        return fold_older_spellings(values) if isinstance(values, dict) else values

    @model_validator(mode="after")
    def _keys_agree(self) -> DataSettings:
        check_data_section(self)
        return self


class AugmentSettings(Strict):
    """DeiT's batch augmentations, run on the device on whole batches (vit_finetune.data.augment); all off by default."""

    policy: Literal["none", "randaugment", "trivialaugment"] = Field("none", description="kornia's automatic augmentation policies")
    randaugment_ops: Bounded("augment.randaugment_ops") = Field(2, gt=0, description=(
        "RandAugment: operations per image, 1-15 (distinct ones, drawn from kornia's 15)"))
    # kornia refuses 0 and 30, and only when the augmenter is built, after data and model load
    randaugment_magnitude: Bounded("augment.randaugment_magnitude") = Field(9, gt=0, description=(
        "RandAugment: strength of every operation, 1-29"))
    erasing_prob: Float = Field(0.0, ge=0, le=1, description="random erasing: chance per image that a rectangle is blanked")
    mixup: bool = Field(False, description="blend pairs of images and their labels (soft-target loss)")
    cutmix: bool = Field(False, description="paste a box of another image; its label weighs the pasted area")
    mix_prob: Float = Field(1.0, ge=0, le=1, description="chance that a batch is mixed at all, with mixup or cutmix on")
    mix_switch_prob: Float = Field(0.5, ge=0, le=1, description="both on: chance that a mixed batch uses CutMix, not Mixup")
    mix_off_epochs: Bounded("augment.mix_off_epochs") = Field(0, ge=0, description="no mixing in the last N epochs (train on clean images at the end)")



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
    epochs: Bounded("train.epochs") = Field(1, gt=0, description="passes over the training split")
    max_steps: Bounded("train.max_steps", StrictInt | None) = Field(None, gt=0, description="stop after this many optimiser steps; null = run all epochs")
    batch_size: Bounded("train.batch_size") = Field(32, gt=0, description="images per device per forward pass")
    grad_accum: Bounded("train.grad_accum") = Field(1, gt=0,
        description="forward passes per optimiser step (batch = batch_size x devices x grad_accum)")
    optimizer: Literal["adamw", "sgd"] = Field("adamw", description="adamw or sgd (with train.momentum)")
    lr: Float | Literal["auto"] = Field("auto", description=(
        "peak learning rate, reached after the warm-up; auto (AdamW only): optim.auto_lr, by the base's size for full "
        "fine-tuning (2e-5 from 1M parameters on, 2e-3 below) and 1e-3 for LoRA, printed; a pinned lr 10x away from "
        "that gets a warning"))
    momentum: Float = Field(0.9, ge=0, lt=1, description="SGD momentum (sgd only)")
    weight_decay: Float | Literal["auto"] = Field("auto", description=(
        "decoupled weight decay; never on biases, norms, CLS or position embeddings; auto: optim.auto_weight_decay, "
        "none (every auto value was measured without it), printed"))
    warmup_steps: Bounded("train.warmup_steps", StrictInt | Literal["auto"]) = Field("auto", description=(
        "optimiser steps of linear warm-up from 0 to train.lr; auto: optim.auto_warmup_steps, a tenth of the steps "
        "after a linear probe (train.method=lp_ft) or from random weights (model.pretrained=false), else 0, printed "
        "with its reason"))
    scheduler: Literal["cosine", "linear", "constant"] = Field("cosine",
        description="lr decay after the warm-up: cosine, linear or constant")
    max_grad_norm: Float | None = Field(1.0, gt=0,
        description="clip the global gradient norm to this; null = no clipping")
    label_smoothing: Float = Field(0.0, ge=0, lt=1, description="cross-entropy label smoothing")
    seed: StrictInt = Field(0, description=(
        "seeds weights of the head, data order, augmentation and the carved eval split; 0 to 4294967295"))
    cpu_threads: Bounded("train.cpu_threads", StrictInt | None) = Field(None, gt=0, description=(
        "torch threads of a run on CPU; a result's last bits depend on the thread count, so a fixed count gives "
        "the same figures on every machine; null = torch's default (one per core)"))
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = Field("auto", description=(
        "no, bf16 or fp16 autocast; weights stay float32; fp16 (CUDA only) has a loss scaler, whose skipped steps "
        "are counted (skipped_steps); auto: bf16 where the device computes bfloat16 natively (a CUDA GPU that has "
        "it, a CPU with AVX512-BF16 or AMX), fp16 on a CUDA GPU with tensor cores but no bfloat16 (V100, T4), else no "
        "(precision.auto_mixed_precision), printed"))
    log_every_steps: Bounded("train.log_every_steps") = Field(10, gt=0,
        description="log loss, lr and images/s every this many steps (the loss is read back from the device only then)")
    eval_every_steps: Bounded("train.eval_every_steps", StrictInt | Literal["auto"] | None) = Field("auto", description=(
        "evaluate during training every this many steps; null = at the end of every epoch; auto: every epoch when "
        "that costs little, else every few epochs or only at the end, so evaluations take at most about 10% of the "
        "training (evaluation.auto_eval_every_steps; every epoch with keep_best, early stopping or an EMA), "
        "printed. The final evaluation is always on the whole eval split"))
    checkpoint_every_steps: Bounded("train.checkpoint_every_steps", StrictInt | None) = Field(None, gt=0,
        description="save a resumable checkpoint every this many steps; null = none")
    keep_checkpoints: Bounded("train.keep_checkpoints") = Field(2, gt=0, description="how many of the newest checkpoints to keep")
    resume: HomePath | None = Field(None,
        description="null, auto (the latest checkpoint in output_dir) or a checkpoint folder")
    resume_ignore_changes: list[str] = Field(
        [], description="recipe keys allowed to differ from the checkpoint's on resume, e.g. [train.epochs]")
    report_to: list[Literal["tensorboard", "trackio", "wandb", "mlflow"]] = Field(
        [], description="experiment trackers that follow the run live, through Accelerate, e.g. [tensorboard] "
                        "(files in output_dir/runs); each needs its package installed")
    collective_timeout_s: Bounded("train.collective_timeout_s") = Field(
        600, gt=0, description="several processes: seconds one waits for the others in a collective before the run "
                               "stops with the stuck rank named (a frozen process would hang the rest forever)")
    ema_decay: Float | None = Field(None, gt=0, lt=1, description=(
        "keep an EMA of the weights, e.g. 0.999 (it forgets over ~1/(1-decay) steps: keep that well below the run's "
        "steps); evaluated beside the raw weights, the better is saved; null = off"))
    keep_best: Literal[tuple(KEEP_BEST_GOALS)] | None = Field(None, description=(
        "save the weights of the best evaluation by this metric (eval_accuracy, eval_loss, eval_macro_f1, "
        "eval_top5_accuracy) instead of the last; null = the last"))
    early_stopping_patience: Bounded("train.early_stopping_patience", StrictInt | None) = Field(None, gt=0, description=(
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
    wise_ft_alpha: Float | Literal["auto"] = Field("auto", description=(
        "after train.method=lp_ft the saved weights are alpha x the fine-tuned ones + (1 - alpha) x the probe's "
        "model (WiSE-FT), in [0, 1], kept only where they score no worse on the eval split than the fine-tuned "
        "ones; 1 keeps the fine-tuned weights, 0 the probe's model where it scores no worse; auto: "
        "wise_ft.auto_alpha, 0.75 after LP-FT of a classifier where that was measured (0.5 under 0.6 epoch of "
        "fine-tuning), 0 for a regression, else 1, printed with its reason"))

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

    @field_validator("wise_ft_alpha", mode="before")
    @classmethod
    def _alpha_number_or_auto(cls, value):
        """A number in [0, 1] (a string of one too: YAML 1.1 reads some as strings) or auto."""
        if isinstance(value, str) and value != "auto":
            try:
                value = float(value)
            except ValueError:
                raise ValueError(f"must be a number in [0, 1] or auto, got {value!r}; e.g. 0.75") from None
        if value == "auto":
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
            raise ValueError(f"must be a number in [0, 1] or auto, got {value}: 1 keeps the fine-tuned weights, "
                             "0 the probe's model where it scores no worse; e.g. 0.75")
        return value

    # Beyond 1e6 the lr overflows inside the optimiser.
    @field_validator("lr", "head_lr")
    @classmethod
    def _lr_positive(cls, value: float | str) -> float | str:
        if value != "auto" and not 0 < value <= 1e6:
            raise ValueError(f"must be a learning rate above 0 (at most 1e6) or auto, got {value}; e.g. 0.002")
        return value

    @model_validator(mode="after")
    def _keys_agree(self) -> TrainSettings:
        check_train_section(self)
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

    @field_validator("weight_decay", mode="before")
    @classmethod
    def _decay_number_or_auto(cls, value):
        """A number of 0 or more (a string of one too: YAML 1.1 reads 1e-4 as one) or auto, in one clear problem."""
        if isinstance(value, bool):
            raise ValueError("a boolean is not a number; give a number or auto, e.g. 0.05")
        if isinstance(value, str) and value != "auto":
            try:
                value = float(value)
            except ValueError:
                raise ValueError(f"must be a number, 0 or more, or auto, got {value!r}; e.g. 0.05") from None
        if isinstance(value, (int, float)) and not value >= 0:
            raise ValueError(f"must be a number, 0 or more, or auto, got {value}; e.g. 0.05")
        return value

    @field_validator("warmup_steps")
    @classmethod
    def _warmup_not_negative(cls, value: int | str) -> int | str:
        if isinstance(value, int) and value < 0:
            raise ValueError(f"must be a number of steps, 0 or more, or auto, got {value}")
        return value

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
    def _keys_agree(self) -> Recipe:
        check_recipe(self)
        return self
