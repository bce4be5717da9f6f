"""Linear probing: the classifier head fitted on the frozen backbone's features of every training image.

The features are what the head itself reads (its input, caught by a forward hook), so the fitted head drops into the
model unchanged and the saved folder is a plain classifier that pipeline() runs: for a ViT the final CLS token, for
DINOv2 the CLS token beside the mean patch token, for Swin or BEiT their pooled output. Each training image is
preprocessed as evaluation does (the saved image processor, no augmentation) and passed through the backbone once.

The head is an L2-regularised logistic regression (softmax over classes; one sigmoid per class for label sets),
fitted by L-BFGS on standardised features, its strength chosen by stratified k-fold
cross-validation on the training images (the usual careful probe: DINOv2's linear evaluation reads the same
features, scikit-learn's LogisticRegressionCV chooses C the same way). The standardisation is folded back into the
weights. What differs by task the task says (tasks.Task): which images hold a label, each image's loss and weight,
and the groups the folds are stratified by. Everything here is deterministic and draws nothing from the run's random
generators, so a run that resumes after the probe trains exactly as one that did not stop.

train.method=linear_probe stops there (the backbone never changes); lp_ft then fine-tunes everything from the fitted
head (LP-FT, Kumar et al., ICLR 2022: a head that already fits moves the pretrained features less than a new one).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from accelerate import Accelerator
from torch import nn

from . import model as vit

if TYPE_CHECKING:  # annotations only
    from .tasks import Task

# The regularisation strengths tried, as scikit-learn's C (inverse strength, per image): 10 values, 1e-4 to 1e4, as
# LogisticRegressionCV's default grid.
STRENGTHS = tuple(10 ** (-4 + 8 * i / 9) for i in range(10))
FOLDS = 5
# Cross-validation reads at most this many images (a seeded, stratified subset); the final fit reads them all. Beyond
# a few thousand images the chosen strength hardly moves, and each fit costs time linear in the images.
CV_IMAGES = 8192
# L-BFGS stops after this many iterations, or once no gradient entry exceeds GRADIENT_TOLERANCE (scikit-learn's lbfgs
# defaults: 100 and 1e-4); tighter settings moved the chosen C and the accuracy on the transfer study's sets by nothing,
# a looser tolerance (1e-3) fitted twice as fast but lost accuracy on 13 of its 23 probe cells (mean -0.005).
MAX_ITERATIONS = 100
GRADIENT_TOLERANCE = 1e-4


@dataclass
class ProbeResult:
    """What the probe did, for the console and metrics.json."""

    images: int  # training images the head was fitted on (skipped bad images left out)
    features: int  # the head's input width
    c: float  # the chosen inverse regularisation strength (scikit-learn's C)
    cv_loss: float  # its mean validation loss over the folds (NaN when there were too few images to fold)
    folds: int
    feature_seconds: float
    fit_seconds: float
    precision: str = "float32"  # what the features' forward pass computed in: float32, or the run's bf16

    def as_metrics(self) -> dict:
        """What metrics.json (and each checkpoint, for a resumed run's) says of the probe; its time is in run_info."""
        return {"images": self.images, "features": self.features, "c": self.c,
                "cv_loss": None if math.isnan(self.cv_loss) else self.cv_loss, "folds": self.folds,
                "precision": self.precision}

    @property
    def seconds(self) -> float:
        return self.feature_seconds + self.fit_seconds

    def describe(self) -> str:
        cv = (f"C={self.c:.3g} chosen by {self.folds}-fold cross-validation (validation loss {self.cv_loss:.4f})"
              if self.folds else f"C={self.c:.3g} (too few images to cross-validate)")
        return (f"linear probe: features of {self.images:,} training images ({self.features} each, {self.precision}) "
                f"in {self.feature_seconds:.1f} s; head fitted in {self.fit_seconds:.1f} s, {cv}")


# ---------------------------------------------------------------- features


def head_module(model: nn.Module) -> nn.Linear:
    """The classifier head (the first, for a DeiT with two): its input is the feature the probe fits on."""
    return model.get_submodule(vit.head_names(model)[0])


@torch.no_grad()
def head_inputs(model: nn.Module, loader, accelerator: Accelerator, mixed_precision: bool
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(features, targets) of every image `loader` yields, in its order, on the CPU: the head's input, as float32, and
    the labels (class ids, or 0/1 rows for label sets). Each process reads every image: the probe runs while the model
    is being built, where no process may wait for another (the main process of each machine loads first).

    `mixed_precision`: the forward pass under the run's autocast (bf16 where it runs so), else float32. A head that
    is the final model is fitted on float32 features: on bf16 ones it lost 1 to 4 of 300 eval images on 8 of 24 of
    the transfer study's probe cells and gained on none. A head that fine-tuning goes on training (LP-FT) is not:
    in bf16 the pass took a third of float32's time, and LP-FT's accuracy moved by nothing beyond its seeds' spread
    (docs/training.md)."""
    captured: list[torch.Tensor] = []
    hook = head_module(model).register_forward_hook(lambda module, inputs, output: captured.append(inputs[0]))
    was_training = model.training
    model.eval()
    features, targets = [], []
    try:
        for batch in loader:
            with accelerator.autocast() if mixed_precision else torch.autocast(accelerator.device.type, enabled=False):
                model(pixel_values=batch["pixel_values"].to(accelerator.device))
            features.append(captured.pop().float().cpu())
            targets.append(batch["labels"])
    finally:
        hook.remove()
        model.train(was_training)
    return torch.cat(features), torch.cat(targets)


# ---------------------------------------------------------------- the fit


def _loss(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, task: Task) -> torch.Tensor:
    """The task's per-image loss (softmax cross-entropy, or mean BCE over classes), weighted by `weights`, averaged."""
    return (task.per_image_loss(logits, labels) * weights).sum() / weights.sum()


def fit_logistic(features: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, classes: int, c: float,
                 task: Task, start: tuple[torch.Tensor, torch.Tensor] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight, bias) minimising C x sum(loss) + |W|^2 / 2 (scikit-learn's objective; the bias is not penalised),
    written as mean loss + |W|^2 / (2 C n); float32, L-BFGS with a strong-Wolfe line search, from `start` or zero."""
    width = features.shape[1]
    weight = (start[0].clone() if start else torch.zeros(classes, width, dtype=torch.float32)).requires_grad_(True)
    bias = (start[1].clone() if start else torch.zeros(classes, dtype=torch.float32)).requires_grad_(True)
    penalty = 1.0 / (2 * c * float(weights.sum()))
    optimiser = torch.optim.LBFGS([weight, bias], lr=1, max_iter=MAX_ITERATIONS, tolerance_grad=GRADIENT_TOLERANCE,
                                  tolerance_change=1e-7, history_size=20, line_search_fn="strong_wolfe")

    def closure():
        optimiser.zero_grad()
        objective = _loss(features @ weight.T + bias, labels, weights, task) + penalty * weight.pow(2).sum()
        objective.backward()
        return objective

    optimiser.step(closure)
    return weight.detach(), bias.detach()


def fold_of_each_image(strata: torch.Tensor, folds: int) -> torch.Tensor:
    """A fold number per image, stratified: each stratum (Task.probe_strata: an image's class, or one for all label
    sets) dealt round-robin in a fixed shuffled order; from a generator of its own, so the run's random state is
    untouched."""
    generator = torch.Generator().manual_seed(0)
    order = torch.randperm(len(strata), generator=generator)
    fold = torch.empty(len(strata), dtype=torch.long)
    dealt = 0
    for stratum in torch.unique(strata).tolist():
        members = order[strata[order] == stratum]
        fold[members] = (torch.arange(len(members)) + dealt) % folds
        dealt += len(members)  # the next stratum starts where this one stopped: folds stay even in size
    return fold


def subset_for_cross_validation(strata: torch.Tensor, most: int) -> torch.Tensor:
    """Indices of at most `most` images, every fold-th image of the stratified deal: a fixed, class-balanced subset."""
    if len(strata) <= most:
        return torch.arange(len(strata))
    step = len(strata) / most
    order = torch.argsort(fold_of_each_image(strata, max(2, math.ceil(step))), stable=True)
    return order[:most].sort().values


def choose_c(features: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, classes: int, task: Task
             ) -> tuple[float, float, int]:
    """(C, its mean validation loss, folds) by k-fold cross-validation over STRENGTHS, strongest first, each fold's
    fit warm-started from the previous strength's. The validation loss falls, then rises as the head overfits; once it
    has risen at two strengths in a row the weaker ones, the slowest to fit, are not tried. Every fold holds an image
    of every stratum: at most as many folds as the smallest stratum has images. Too few to fold: C = 1
    (scikit-learn's default)."""
    strata = task.probe_strata(labels)
    sizes = torch.bincount(strata)
    sizes = sizes[sizes > 0]
    folds = min(FOLDS, int(sizes.min())) if len(sizes) else 0
    if folds < 2:
        return 1.0, math.nan, 0
    fold = fold_of_each_image(strata, folds)
    starts: list = [None] * folds
    scores = []
    for c in STRENGTHS:
        losses = []
        for k in range(folds):
            fit, held = fold != k, fold == k
            starts[k] = fit_logistic(features[fit], labels[fit], weights[fit], classes, c, task, starts[k])
            weight, bias = starts[k]
            logits = features[held] @ weight.T + bias
            losses.append(float(_loss(logits, labels[held], weights[held], task)))
        scores.append(sum(losses) / folds)
        if len(scores) >= 3 and scores[-1] > scores[-2] > scores[-3]:
            break
    best = min(range(len(scores)), key=lambda i: (scores[i], i))  # a tie goes to the stronger regularisation
    return STRENGTHS[best], scores[best], folds


def fit_head(features: torch.Tensor, labels: torch.Tensor, classes: int, task: Task,
             class_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, float, float, int]:
    """(weight, bias) of the head on the raw features, float32, and (C, cv loss, folds); skipped images left out.
    `class_weights`: data.class_balance=weights' per-class weights, which weigh each image's loss where the task
    says they apply (Task.probe_weights)."""
    kept = task.kept(labels)
    features, labels = features[kept].float(), labels[kept]
    weights = task.probe_weights(labels, class_weights)
    mean, std = features.mean(dim=0), features.std(dim=0).clamp(min=1e-6)
    standard = (features - mean) / std
    subset = subset_for_cross_validation(task.probe_strata(labels), CV_IMAGES)
    c, cv_loss, folds = choose_c(standard[subset], labels[subset], weights[subset], classes, task)
    weight, bias = fit_logistic(standard, labels, weights, classes, c, task)
    # logits = ((x - mean) / std) W^T + b = x (W / std)^T + (b - (W / std) mean): the same head on raw features.
    raw_weight = weight / std
    raw_bias = bias - raw_weight @ mean
    return raw_weight.float(), raw_bias.float(), c, cv_loss, folds


def set_heads(model: nn.Module, weight: torch.Tensor, bias: torch.Tensor) -> None:
    """Copy the fitted head into every classifier head of the model (a DeiT's two heads get the same one)."""
    for name in vit.head_names(model):
        head = model.get_submodule(name)
        if head.weight.shape != weight.shape:
            raise ValueError(f"the probe fitted a {tuple(weight.shape)} head, the model's {name} is {tuple(head.weight.shape)}")
        with torch.no_grad():
            head.weight.copy_(weight)
            head.bias.copy_(bias)


def probe(model: nn.Module, loader, accelerator: Accelerator, task: Task, class_weights: torch.Tensor | None = None,
          mixed_precision: bool = False) -> ProbeResult:
    """Fit the model's head for `task` on the frozen features of every image of `loader` (in a fixed order) and put
    it into the model; the random generators are left as they were. `mixed_precision`: see head_inputs."""
    started = time.perf_counter()
    with torch.random.fork_rng(devices=[]):
        features, labels = head_inputs(model, loader, accelerator, mixed_precision)
        extracted = time.perf_counter()
        weight, bias, c, cv_loss, folds = fit_head(features, labels, head_module(model).out_features, task,
                                                   None if class_weights is None else class_weights.cpu())
    set_heads(model, weight.to(head_module(model).weight.device), bias.to(head_module(model).bias.device))
    images = int(task.kept(labels).sum())
    precision = accelerator.mixed_precision if mixed_precision and accelerator.mixed_precision != "no" else "float32"
    return ProbeResult(images, features.shape[1], c, cv_loss, folds, extracted - started,
                       time.perf_counter() - extracted, precision)

