"""Linear probing: the classifier head fitted on the frozen backbone's features of every training image.

The features are what the head itself reads (its input, caught by a forward hook), so the fitted head drops into the
model unchanged and the saved folder is a plain classifier that pipeline() runs: for a ViT the final CLS token, for
DINOv2 the CLS token beside the mean patch token, for Swin or BEiT their pooled output. Each training image is
preprocessed as evaluation does (the saved image processor, no augmentation) and passed through the backbone once.

A classifier's head is an L2-regularised logistic regression (softmax over classes; one sigmoid per class for label
sets), fitted by L-BFGS on standardised features, its strength chosen by stratified k-fold
cross-validation on the training images (the usual careful probe: DINOv2's linear evaluation reads the same
features, scikit-learn's LogisticRegressionCV chooses C the same way). A regression's head is ridge regression of
the standardised targets, solved in closed form, its alpha chosen by leave-one-out cross-validation (scikit-learn's
RidgeCV: same grid, same criterion). The standardisation is folded back into the weights. What differs by task the task says (tasks.Task): which images hold a label, each image's loss and weight,
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

from vit_finetune.model.loading import head_names

if TYPE_CHECKING:  # annotations only
    from vit_finetune.tasks import Task

# The regularisation strengths tried, as scikit-learn's C (inverse strength, per image): 10 values, 1e-4 to 1e4, as
# LogisticRegressionCV's default grid.
STRENGTHS = tuple(10 ** (-4 + 8 * i / 9) for i in range(10))
FOLDS = 5
# Cross-validation reads at most this many images (a seeded, stratified subset); the final fit reads them all. Beyond
# a few thousand images the chosen strength hardly moves, and each fit costs time linear in the images.
CV_IMAGES = 8192
# L-BFGS stops after this many iterations, or once no gradient entry exceeds GRADIENT_TOLERANCE (scikit-learn's lbfgs
# defaults: 100 and 1e-4); on the transfer study's sets tighter settings moved the chosen C and the accuracy by
# nothing, and a looser tolerance fitted faster but lost accuracy on most probe cells.
MAX_ITERATIONS = 100
GRADIENT_TOLERANCE = 1e-4
# Ridge's alphas (its penalty on the sum of squares, standardised features), 1e-2 to 1e6: 33 values, 4 per decade.
RIDGE_ALPHAS = tuple(10 ** (-2 + 8 * i / 32) for i in range(33))


@dataclass
class ProbeResult:
    """What the probe did, for the console and metrics.json."""

    images: int  # training images the head was fitted on (skipped bad images left out)
    features: int  # the head's input width
    strength: float  # the chosen regularisation: scikit-learn's C (logistic), or ridge's alpha
    cv_loss: float  # its mean validation loss over the folds (NaN when there were too few images to fold)
    folds: int  # k of k-fold cross-validation; for ridge's leave-one-out, the images it left out one at a time
    feature_seconds: float
    fit_seconds: float
    precision: str = "float32"  # what the features' forward pass computed in: float32, or the run's bf16
    fit: str = "logistic"  # the task's head: "logistic" or "ridge" (Task.probe_fit)

    def as_metrics(self) -> dict:
        """What metrics.json (and each checkpoint, for a resumed run's) says of the probe; its time is in run_info."""
        return {"images": self.images, "features": self.features, "fit": self.fit,
                STRENGTH_NAMES[self.fit]: self.strength,
                "cv_loss": None if math.isnan(self.cv_loss) else self.cv_loss, "folds": self.folds,
                "precision": self.precision}

    @property
    def seconds(self) -> float:
        return self.feature_seconds + self.fit_seconds

    def describe(self) -> str:
        name = STRENGTH_NAMES[self.fit]
        if self.fit == "ridge":
            cv = (f"ridge {name}={self.strength:.3g} chosen by leave-one-out cross-validation on {self.folds:,} images "
                  f"(validation MSE of the standardised targets {self.cv_loss:.4f})")
        elif self.folds:
            cv = f"C={self.strength:.3g} chosen by {self.folds}-fold cross-validation (validation loss {self.cv_loss:.4f})"
        else:
            cv = f"C={self.strength:.3g} (too few images to cross-validate)"
        return (f"linear probe: features of {self.images:,} training images ({self.features} each, {self.precision}) "
                f"in {self.feature_seconds:.1f} s; head fitted in {self.fit_seconds:.1f} s, {cv}")


STRENGTH_NAMES = {"logistic": "c", "ridge": "alpha"}  # metrics.json's key for each fit's regularisation


# ---------------------------------------------------------------- features


def head_module(model: nn.Module) -> nn.Linear:
    """The classifier head (the first, for a DeiT with two): its input is the feature the probe fits on."""
    return model.get_submodule(head_names(model)[0])


@torch.no_grad()
def head_inputs(model: nn.Module, loader, accelerator: Accelerator, mixed_precision: bool
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(features, targets) of every image `loader` yields, in its order, on the CPU: the head's input, as float32, and
    the labels (class ids, or 0/1 rows for label sets). Each process reads every image: the probe runs while the model
    is being built, where no process may wait for another (the main process of each machine loads first).

    `mixed_precision`: the forward pass under the run's autocast (bf16 where it runs so), else float32. A head that
    is the final model is fitted on float32 features: on bf16 ones it lost eval images on a third of the transfer
    study's probe cells and gained on none. A head that fine-tuning goes on training (LP-FT) is not: in bf16 the pass
    is several times faster, and LP-FT's accuracy moved by nothing beyond its seeds' spread (docs/studies/transfer.md,
    "Precision: bf16 against float32")."""
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


def fit_logistic_head(standard: torch.Tensor, labels: torch.Tensor, classes: int, task: Task,
                      class_weights: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, float, float, int]:
    """A classifier's head on standardised features: (weight, bias, C, cv loss, folds)."""
    weights = task.probe_weights(labels, class_weights)
    subset = subset_for_cross_validation(task.probe_strata(labels), CV_IMAGES)
    c, cv_loss, folds = choose_c(standard[subset], labels[subset], weights[subset], classes, task)
    weight, bias = fit_logistic(standard, labels, weights, classes, c, task)
    return weight, bias, c, cv_loss, folds


def ridge_leave_one_out(standard: torch.Tensor, targets: torch.Tensor) -> tuple[float, float]:
    """(alpha, its mean squared leave-one-out error) over RIDGE_ALPHAS, in closed form as RidgeCV computes it: with
    the centred features X = U S V^T, the hat matrix of alpha is U diag(s^2 / (s^2 + alpha)) U^T (+ 1/n for the
    intercept), and image i's left-out residual is its residual / (1 - H_ii). A tie goes to the larger alpha."""
    x = standard.double() - standard.double().mean(dim=0)
    y = targets.double() - targets.double().mean(dim=0)
    u, s, _ = torch.linalg.svd(x, full_matrices=False)
    projected = u.T @ y  # (rank, targets)
    errors = []
    for alpha in RIDGE_ALPHAS:
        shrink = s.square() / (s.square() + alpha)
        residual = y - u @ (shrink[:, None] * projected)
        leverage = (u.square() @ shrink + 1.0 / len(x)).clamp(max=1 - 1e-9)
        errors.append(float((residual / (1 - leverage)[:, None]).square().mean()))
    best = min(range(len(errors)), key=lambda i: (errors[i], -i))
    return RIDGE_ALPHAS[best], errors[best]


def fit_ridge(standard: torch.Tensor, targets: torch.Tensor, alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight (targets, features), bias) minimising |X W^T + b - y|^2 + alpha |W|^2 (the bias not penalised), in
    float64 by the normal equations."""
    x, y = standard.double(), targets.double()
    x_mean, y_mean = x.mean(dim=0), y.mean(dim=0)
    centred = x - x_mean
    gram = centred.T @ centred + alpha * torch.eye(x.shape[1], dtype=torch.float64)
    weight = torch.linalg.solve(gram, centred.T @ (y - y_mean)).T
    return weight.float(), (y_mean - weight @ x_mean).float()


def fit_ridge_head(standard: torch.Tensor, labels: torch.Tensor, classes: int, task: Task,
                   class_weights: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, float, float, int]:
    """A regression's head on standardised features: (weight, bias, alpha, leave-one-out MSE, images left out one at
    a time). It learns the targets as the head does (Task.probe_targets: standardised by the training split)."""
    targets = task.probe_targets(labels)
    subset = torch.arange(len(targets))[:CV_IMAGES]  # the images come in the split's order: the first ones
    alpha, loo_error = ridge_leave_one_out(standard[subset], targets[subset])
    weight, bias = fit_ridge(standard, targets, alpha)
    return weight, bias, alpha, loo_error, len(subset)


FITS = {"logistic": fit_logistic_head, "ridge": fit_ridge_head}  # Task.probe_fit -> how its head is fitted


def fit_head(features: torch.Tensor, labels: torch.Tensor, classes: int, task: Task,
             class_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, float, float, int]:
    """(weight, bias) of the head on the raw features, float32, and (its regularisation, cv loss, folds); skipped
    images left out. `class_weights`: data.class_balance=weights' per-class weights, which weigh each image's loss
    where the task says they apply (Task.probe_weights)."""
    kept = task.kept(labels)
    features, labels = features[kept].float(), labels[kept]
    mean, std = features.mean(dim=0), features.std(dim=0).clamp(min=1e-6)
    standard = (features - mean) / std
    weight, bias, strength, cv_loss, folds = FITS[task.probe_fit](standard, labels, classes, task, class_weights)
    # logits = ((x - mean) / std) W^T + b = x (W / std)^T + (b - (W / std) mean): the same head on raw features.
    raw_weight = weight / std
    raw_bias = bias - raw_weight @ mean
    return raw_weight.float(), raw_bias.float(), strength, cv_loss, folds


def set_heads(model: nn.Module, weight: torch.Tensor, bias: torch.Tensor) -> None:
    """Copy the fitted head into every classifier head of the model (a DeiT's two heads get the same one)."""
    for name in head_names(model):
        head = model.get_submodule(name)
        if head.weight.shape != weight.shape:
            raise ValueError(f"the probe fitted a {tuple(weight.shape)} head, the model's {name} is {tuple(head.weight.shape)}")
        with torch.no_grad():
            head.weight.copy_(weight)
            head.bias.copy_(bias)


def scale_heads(model: nn.Module, scale: float) -> None:
    """Every classifier head's weight and bias times `scale` (train.lp_ft_head_scale): the probe's direction, its
    outputs that many times smaller."""
    for name in head_names(model):
        head = model.get_submodule(name)
        with torch.no_grad():
            head.weight.mul_(scale)
            head.bias.mul_(scale)


def probe(model: nn.Module, loader, accelerator: Accelerator, task: Task, class_weights: torch.Tensor | None = None,
          mixed_precision: bool = False) -> ProbeResult:
    """Fit the model's head for `task` on the frozen features of every image of `loader` (in a fixed order) and put
    it into the model; the random generators are left as they were. `mixed_precision`: see head_inputs."""
    started = time.perf_counter()
    with torch.random.fork_rng(devices=[]):
        features, labels = head_inputs(model, loader, accelerator, mixed_precision)
        extracted = time.perf_counter()
        weight, bias, strength, cv_loss, folds = fit_head(features, labels, head_module(model).out_features, task,
                                                          None if class_weights is None else class_weights.cpu())
    set_heads(model, weight.to(head_module(model).weight.device), bias.to(head_module(model).bias.device))
    images = int(task.kept(labels).sum())
    precision = accelerator.mixed_precision if mixed_precision and accelerator.mixed_precision != "no" else "float32"
    return ProbeResult(images, features.shape[1], strength, cv_loss, folds, extracted - started,
                       time.perf_counter() - extracted, precision, task.probe_fit)

