"""The training methods (train.method) and the rule that chooses one for `auto`.

finetune trains every weight (or LoRA's adapters) from a new head; linear_probe fits only the head, on the frozen
backbone's features (probe.py); lp_ft fits the head so, then fine-tunes from it (LP-FT, Kumar et al., ICLR 2022).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Method:
    """What a train.method does: fit the head on frozen features first, and/or take optimiser steps."""

    probes: bool
    fine_tunes: bool


METHODS = {
    "finetune": Method(probes=False, fine_tunes=True),
    "linear_probe": Method(probes=True, fine_tunes=False),
    "lp_ft": Method(probes=True, fine_tunes=True),
}


def fits_head_first(method: str) -> bool:
    """Whether train.method fits the head by the linear probe before any step (an unresolved `auto`: not known, no)."""
    return method != "auto" and METHODS[method].probes


# Where the transfer study measured the methods (docs/training.md, "Transfer on a real base"): 10 to 400 training images
# per class, and schedules of 20 to 600 steps of 16 images (0.4 to 32 epochs). Outside it, auto keeps to fine-tuning,
# what every reference recipe does at scale: a probe's gain was measured on small data and short schedules only.
MEASURED_IMAGES_PER_CLASS = (10, 400)
MEASURED_IMAGES_SEEN = (320, 9600)
# The probe alone wins while fine-tuning is short in steps: below this many images seen it beat LP-FT and fine-tuning
# on every dataset of the transfer study; above it LP-FT led on most (docs/studies/transfer.md, "The methods side by
# side").
PROBE_ALONE_BELOW_IMAGES_SEEN = 960
# Short in passes over the data (many images, few steps) is another matter: there the probe alone led on some datasets
# and LP-FT on others, so neither arm is safe; LP-FT with its weights averaged halfway back to the probe's model
# (wise_ft.py) was within noise of the better of the two on every such cell, including cells measured after the rule
# was chosen. Below this many epochs auto takes LP-FT with that average; from it on, LP-FT led or tied the probe alone
# (docs/studies/transfer.md, "What the defaults chose, cell by cell").
SHORT_BELOW_EPOCHS = 0.6


def probe_unusable(pretrained: bool, streaming: bool) -> str | None:
    """Why no probe serves this run, whatever its size (auto then fine-tunes), or None."""
    if streaming:
        return "a stream is not read whole before training, which the probe needs"
    if not pretrained:
        return "model.pretrained=false: random features are not worth probing"
    return None


def auto_method(training_images: int, classes: int, images_seen: int, pretrained: bool, streaming: bool,
                needs_steps: str | None = None, averages: bool = False) -> tuple[str, str]:
    """The method train.method=auto stands for with a classifier, and why. `needs_steps`: a setting that only
    optimiser steps serve (LoRA's adapters, a teacher), which rules the probe alone out; `averages`: whether an LP-FT
    run would average its weights with the probe's model as wise_ft.auto_alpha says (where that was measured), which
    makes LP-FT safe on short schedules."""
    unusable = probe_unusable(pretrained, streaming)
    if unusable:
        return "finetune", unusable
    images_per_class, epochs = training_images / max(1, classes), images_seen / max(1, training_images)
    low, high = MEASURED_IMAGES_PER_CLASS
    shortest, longest = MEASURED_IMAGES_SEEN
    size = f"{images_per_class:,.0f} training images per class, {images_seen:,} seen ({epochs:,.1f} epochs)"
    measured = f"the methods were measured on {low}-{high} images per class and {shortest:,}-{longest:,} images seen"
    if not low <= images_per_class <= high:
        return "finetune", f"{size}: {measured}, not here, so fine-tuning, as at scale"
    if images_seen > longest:
        # A longer schedule on data of a measured size: no cliff at the range's end. From the probe's head the
        # fine-tuning moves the pretrained features least (Kumar et al.), and LP-FT led or tied fine-tuning from a
        # new head on the longest schedules measured, the shift study's included.
        return "lp_ft", (f"{size}: {measured}; past that, LP-FT, the conservative side: on the longest schedules "
                         "measured it led or tied fine-tuning from a new head, with and without a shift between "
                         "sources")
    if images_seen < PROBE_ALONE_BELOW_IMAGES_SEEN:
        short = f"with fewer than {PROBE_ALONE_BELOW_IMAGES_SEEN:,} images seen"
        why = "the probe alone beat fine-tuning and LP-FT in the transfer study"
    elif epochs < SHORT_BELOW_EPOCHS:
        short = f"under {SHORT_BELOW_EPOCHS:g} epoch"
        if averages:
            return "lp_ft", (f"{size}: {short} the probe alone led on some datasets of the transfer study and LP-FT on "
                             "others; LP-FT averaged halfway back to the probe's model was within noise of the better "
                             "on each")
        why = ("the probe alone led on some datasets of the transfer study and LP-FT on others, LP-FT safely only when "
               "averaged with the probe's model, which this run does not do; so the probe, which never moves the "
               "backbone")
    else:
        return "lp_ft", (f"{size}: the probe's head, then fine-tuning, beat either alone on most datasets in the "
                         "transfer study")
    if needs_steps:
        return "lp_ft", (f"{size}: {short} the probe alone is auto's choice, but {needs_steps} needs optimiser steps, "
                         "so the probe's head, then fine-tuning")
    return "linear_probe", f"{size}: {short} {why}"


# Regression: where the regression study measured the methods (docs/regression.md): three real sets, 640 and 2,000
# training images, 40 to 400 steps of 16 images. There LP-FT from the probe's ridge head, with the probe's model saved
# instead where it scored no worse on the eval split's MAE (wise_ft_alpha 0), was within noise of the best arm in
# every cell, and fine-tuning from a new head (what auto chose before) lost to it on short schedules. Outside,
# fine-tuning.
REGRESSION_MEASURED_TRAINING_IMAGES = (640, 2000)
REGRESSION_MEASURED_IMAGES_SEEN = (640, 6400)
REGRESSION_MEASURED_TEXT = (f"{REGRESSION_MEASURED_TRAINING_IMAGES[0]:,}-{REGRESSION_MEASURED_TRAINING_IMAGES[1]:,} "
                            f"training images and {REGRESSION_MEASURED_IMAGES_SEEN[0]:,}-"
                            f"{REGRESSION_MEASURED_IMAGES_SEEN[1]:,} seen")


def regression_study_measured(training_images: int, images_seen: int) -> bool:
    """Whether a regression run of this size is inside what the regression study measured (both ends included): the
    range every regression rule of `auto` keeps to."""
    low, high = REGRESSION_MEASURED_TRAINING_IMAGES
    shortest, longest = REGRESSION_MEASURED_IMAGES_SEEN
    return low <= training_images <= high and shortest <= images_seen <= longest


def auto_method_for_regression(training_images: int, classes: int, images_seen: int, pretrained: bool,
                               streaming: bool, needs_steps: str | None = None,
                               averages: bool = False) -> tuple[str, str]:
    """The method train.method=auto stands for with a regression, and why (auto_method's arguments; `classes`, the
    targets, do not divide the images: every image holds a value of each)."""
    unusable = probe_unusable(pretrained, streaming)
    if unusable:
        return "finetune", unusable
    epochs = images_seen / max(1, training_images)
    size = f"{training_images:,.0f} training images, {images_seen:,} seen ({epochs:,.1f} epochs)"
    if not regression_study_measured(training_images, images_seen):
        return "finetune", f"{size}: the regression study measured {REGRESSION_MEASURED_TEXT}, not here, so fine-tuning"
    kept = (", the probe's model kept where it scores no worse on the eval split" if averages else "")
    return "lp_ft", (f"{size}: the probe's ridge head, then fine-tuning{kept}, was within noise of the best arm on "
                     "every set of the regression study")


AUTO_RULES = {"classifier": auto_method, "regressor": auto_method_for_regression}  # Task.method_rule -> its rule


# train.lp_ft_head_scale=auto. The probe's head already fits the training images, so LP-FT's fine-tuning starts with
# little loss left for the backbone, and the head, free to move, takes up much of what is left. Shrunk, the head
# starts nearer the mean and the backbone does more of the fitting, along the probe's direction: what a head on raw
# targets of a wide spread starts as in standardised units, which is how the Trainer led the defaults on the
# regression study's rotation angle (docs/regression.md). Measured there from 1/25 to 1/2 (seed 0): the smaller the
# head, the more the rotations gained (10 epochs of rotation_2000: 2.90 degrees as fitted, 2.29 at 1/2, 2.02 at 1/5,
# 1.91 at 1/25; one epoch of rotation: 9.83, 9.13, 7.49, 7.03), and 1/5 took most of 1/25's gain on the rotations
# and digit sums while staying nearer the head as fitted, so 1/5. On the ELPV sets it tied with the head as fitted
# (ten epochs of ELPV: 0.204 against 0.206 MAE). Slowing the head's lr instead did not help. Measured for regressions
# within REGRESSION_MEASURED_*; elsewhere, and for a classifier's LP-FT (not measured), 1.
LP_FT_HEAD_SCALE = {"classifier": 1.0, "regressor": 0.2}  # Task.method_rule -> what auto takes where measured


def auto_lp_ft_head_scale(method: str, method_rule: str, lora: bool, training_images: int,
                          images_seen: int) -> tuple[float, str]:
    """What train.lp_ft_head_scale=auto stands for, and why: `method` as chosen, `method_rule` the task's
    (Task.method_rule), `lora` whether adapters are fine-tuned instead of every weight, and the run's size."""
    if method != "lp_ft":
        return 1.0, f"train.method={method}: no probe's head to start from"
    if lora:
        return 1.0, ("the shrunk head was measured with every weight fine-tuned, not LoRA's adapters, so the probe's "
                     "head as fitted")
    scale = LP_FT_HEAD_SCALE[method_rule]
    if scale == 1:
        return 1.0, "the shrunk head was measured for regressions, not classifiers, so the probe's head as fitted"
    if not regression_study_measured(training_images, images_seen):
        return 1.0, (f"{training_images:,} training images, {images_seen:,} seen: the shrunk head was measured on "
                     f"{REGRESSION_MEASURED_TEXT}, not here, so the probe's head as fitted")
    return scale, (f"the probe's head times {scale:g}: its predictions start nearer the mean, so the backbone does "
                   "more of the fitting; in the regression study it gained on every rotation and digit-sum cell and "
                   "tied on the ELPV sets (docs/regression.md)")


def lp_ft_head_scale_refusal(method: str, scale: float | str, auto_chose: bool = False) -> str | None:
    """Why a train.lp_ft_head_scale other than 1 cannot be honoured once the method is known (`auto_chose`: by
    train.method=auto), or None."""
    if scale in ("auto", 1) or method == "lp_ft" or (auto_chose and method == "linear_probe"):
        return None  # a probe alone that auto chose says once what it leaves unused (plan.probe_alone)
    fits = "fits no probe" if method == "finetune" else "fine-tunes nothing"
    chosen = (f"train.method=auto chose {method} for this run (its line above says why), which {fits}" if auto_chose
              else f"train.method={method} {fits}")
    return (f"train.lp_ft_head_scale={scale:g} scales the probe's head before LP-FT fine-tunes from it, and {chosen}; "
            "use train.method=lp_ft, or train.lp_ft_head_scale=auto")


def card_text(method: str, metrics: dict, tuning: str, head_scale: float | str = 1.0) -> str:
    """The card's line on how the model was trained; `tuning`: what the fine-tuning trained (full or LoRA's);
    `head_scale`: train.lp_ft_head_scale as run."""
    method = metrics.get("method", method)  # a card written from the recipe as given names the method as run
    if method not in METHODS or not METHODS[method].probes:
        return tuning
    probe = metrics.get("probe") or {}
    images = f"{probe.get('images', 0):,} training images"
    if probe.get("fit") == "ridge":
        probe_text = (f"a linear probe (the backbone frozen; the head fitted as a ridge regression on its features of "
                      f"{images}, alpha={probe.get('alpha', float('nan')):.3g} chosen by leave-one-out "
                      "cross-validation)")
    else:
        probe_text = (f"a linear probe (the backbone frozen; the head fitted as a logistic regression on its features "
                      f"of {images}, C={probe.get('c', float('nan')):.3g}"
                      + (f" chosen by {probe['folds']}-fold cross-validation)" if probe.get("folds") else ")"))
    if method == "linear_probe":
        return probe_text
    alpha = metrics.get("wise_ft_alpha")
    if alpha == 0:
        averaged = ", the saved weights the probe's model, which scored no worse on the eval split than the fine-tuned ones"
    else:
        averaged = (f", the saved weights {alpha:g} x the fine-tuned ones + {1 - alpha:g} x the probe's model "
                    "(WiSE-FT)" if alpha is not None else "")
    shrunk = f" times {head_scale:g}" if isinstance(head_scale, float) and head_scale != 1 else ""
    return f"{probe_text}, then {tuning} from that head{shrunk}{averaged}"
