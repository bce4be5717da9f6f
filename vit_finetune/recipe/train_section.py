"""The schema's train section: the optimiser, schedule and method, what is kept (checkpoints, the best weights, EMA),
stopping, the precision and devices, and distillation from a teacher (DistillSettings).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, StrictInt, field_validator, model_validator

from vit_finetune.recipe.checks import check_train_section
from vit_finetune.recipe.fields import Bounded, Float, HomePath, PositiveFloat, Strict, survives_float32
from vit_finetune.recipe.limits import SEED_MAX
from vit_finetune.recipe.methods import METHODS


# The metrics each task measures that train.keep_best can follow, and whether higher or lower is better. One place for
# both readers: each task takes its own table (tasks/), and the recipe's schema accepts any metric of them for
# train.keep_best; a low module, so that the schema needs none of the tasks' heavy imports.
# Each task's metrics train.keep_best may follow -> "max" or "min".
SINGLE_LABEL_GOALS = {"eval_accuracy": "max", "eval_top5_accuracy": "max", "eval_macro_f1": "max", "eval_loss": "min"}
MULTI_LABEL_GOALS = {"eval_accuracy": "max", "eval_macro_f1": "max", "eval_loss": "min", "eval_map": "max",
                     "eval_micro_f1": "max"}
REGRESSION_GOALS = {"eval_mae": "min", "eval_rmse": "min", "eval_r2": "max", "eval_loss": "min"}
# Every metric train.keep_best accepts, and its goal (the same wherever two tasks measure it).
KEEP_BEST_GOALS: dict[str, str] = {**SINGLE_LABEL_GOALS, **MULTI_LABEL_GOALS, **REGRESSION_GOALS}


class DistillSettings(Strict):
    """Knowledge distillation from a trained classifier of the same labels (DeiT, arXiv 2012.12877)."""

    teacher: HomePath = Field(..., description=(
        "the teacher: a run's output_dir, a folder saved with save_pretrained or a Hub id of an image classifier "
        "with the dataset's labels; it runs frozen, at its own resolution and normalisation"))
    weight: Float = Field(0.5, ge=0, le=1, description=(
        "share of the loss that follows the teacher (the rest follows the labels); a DeiT student's distillation "
        "head follows the teacher, its class head the labels, both weighted so"))
    temperature: PositiveFloat = Field(1.0, gt=0, description=(
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


def _number_or_auto(value: Any, what: str, example: str) -> Any:
    """A string that is not auto read as a number (YAML 1.1 reads 1e-4 as a string); one that is no number raises one
    clear problem, that the key must be `what` or auto, with `example`. Anything else is returned for the field's own
    checks."""
    if isinstance(value, str) and value != "auto":
        try:
            return float(value)
        except ValueError:
            raise ValueError(f"must be {what} or auto, got {value!r}; e.g. {example}") from None
    return value


def _share_or_auto(value: Any, zero_allowed: bool, ends: str, example: str) -> Any:
    """A number in [0, 1], or (0, 1] without `zero_allowed` (a string of one too: YAML 1.1 reads some as strings),
    or auto; a problem names the range, what `ends` says its ends mean, and `example`."""
    interval = "[0, 1]" if zero_allowed else "(0, 1]"
    value = _number_or_auto(value, f"a number in {interval}", example)
    if value == "auto":
        return value
    in_range = (lambda v: 0 <= v <= 1) if zero_allowed else (lambda v: 0 < v <= 1)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not in_range(value):
        raise ValueError(f"must be a number in {interval} or auto, got {value}: {ends}; e.g. {example}")
    return value if zero_allowed else survives_float32(value)


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
    max_grad_norm: PositiveFloat | None = Field(1.0, gt=0,
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
    ema_decay: PositiveFloat | None = Field(None, gt=0, lt=1, description=(
        "keep an EMA of the weights, e.g. 0.999 (it forgets over ~1/(1-decay) steps: keep that well below the run's "
        "steps); evaluated beside the raw weights, the better is saved; null = off"))
    keep_best: Literal[tuple(KEEP_BEST_GOALS)] | None = Field(None, description=(
        "save the weights of the best evaluation by this metric (eval_accuracy, eval_loss, eval_macro_f1, "
        "eval_top5_accuracy) instead of the last; null = the last"))
    early_stopping_patience: Bounded("train.early_stopping_patience", StrictInt | None) = Field(None, gt=0, description=(
        "stop after this many evaluations without gain in train.keep_best; null = never"))
    layer_decay: PositiveFloat | None = Field(None, gt=0, le=1, description=(
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
    lp_ft_head_scale: Float | Literal["auto"] = Field("auto", description=(
        "after the linear probe (train.method=lp_ft) the fitted head times this, in (0, 1], before fine-tuning "
        "starts: a shrunk head starts near the mean, so the backbone does the fitting along the probe's direction; "
        "1 fine-tunes from the probe's head as fitted; auto: "
        "methods.auto_lp_ft_head_scale, 0.2 for a regression where the regression study measured it, else 1, "
        "printed with its reason"))

    resolution_schedule: list[tuple[StrictInt, Float]] | Literal["auto"] | None = Field(None, description=(
        "train at lower sizes first: [[size, share], ...] of the optimiser steps, sizes increasing, shares summing to "
        "1, the last size model.image_size, e.g. [[224, 0.7], [384, 0.3]]; each stage's position tables resampled "
        "from the base's own, its crops and evaluations at its size, the saved model at model.image_size; null = "
        "off; auto: resolution.auto_schedule, a measured schedule (none yet: off), printed with its reason"))

    @field_validator("resolution_schedule", mode="before")
    @classmethod
    def _schedule_shape(cls, value):
        """One clear problem for a schedule that is not [[size, share], ...] in order, not one per union member."""
        if value is None or value == "auto":
            return value
        example = "e.g. [[224, 0.7], [384, 0.3]]"
        pairs = value if isinstance(value, (list, tuple)) else None
        if not pairs or not all(isinstance(p, (list, tuple)) and len(p) == 2 and isinstance(p[0], int)
                                and not isinstance(p[0], bool) and isinstance(p[1], (int, float))
                                and not isinstance(p[1], bool) for p in pairs):
            raise ValueError(f"must be null, auto or a list of [size, share] pairs, got {value!r}; {example}")
        sizes, shares = [p[0] for p in pairs], [float(p[1]) for p in pairs]
        if len(pairs) < 2:
            raise ValueError(f"{value!r} has one size, which is the run without a schedule: give two or more sizes, "
                             f"{example}, or null")
        if any(size <= 0 for size in sizes) or sizes != sorted(set(sizes)):
            raise ValueError(f"sizes {sizes} must be positive and strictly increasing (the last is model.image_size); "
                             f"{example}")
        if any(not 0 < share <= 1 for share in shares) or abs(sum(shares) - 1) > 1e-6:
            raise ValueError(f"shares {shares} must each be in (0, 1] and sum to 1 (they sum to {sum(shares):g}): "
                             f"they are shares of the optimiser steps; {example}")
        return value

    @field_validator("lr", "head_lr", mode="before")
    @classmethod
    def _lr_number_or_auto(cls, value):
        """One clear problem for a misspelt lr, not one per member of the union."""
        if isinstance(value, bool):
            raise ValueError("a boolean is not a number; give a number or auto, e.g. 2e-5")
        return _number_or_auto(value, "a number", "2e-5")

    @field_validator("wise_ft_alpha", mode="before")
    @classmethod
    def _alpha_number_or_auto(cls, value):
        return _share_or_auto(value, True, "1 keeps the fine-tuned weights, 0 the probe's model where it scores no "
                                           "worse", "0.75")

    @field_validator("lp_ft_head_scale", mode="before")
    @classmethod
    def _head_scale_number_or_auto(cls, value):
        return _share_or_auto(value, False, "1 fine-tunes from the probe's head as fitted, 0.2 from a head 5 times "
                                            "smaller", "0.2")

    # Beyond 1e6 the lr overflows inside the optimiser.
    @field_validator("lr", "head_lr")
    @classmethod
    def _lr_positive(cls, value: float | str) -> float | str:
        if value != "auto" and not 0 < value <= 1e6:
            raise ValueError(f"must be a learning rate above 0 (at most 1e6) or auto, got {value}; e.g. 0.002")
        return survives_float32(value)

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
        value = _number_or_auto(value, "a number, 0 or more,", "0.05")
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
