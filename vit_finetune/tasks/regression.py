"""Image regression: one or several numbers per image (a defect probability, an age, a count), a linear head.

transformers' `problem_type="regression"`: num_labels is the number of targets and id2label names them. The head
learns the targets standardised by the training split's mean and standard deviation (each target weighs alike in the
loss, and the head's scale is that of a classifier's logits); both are saved in config.json (`target_mean`,
`target_std`) and undone wherever the model answers: evaluation, predict, explain, export and the page. The loss
is the mean squared error of the standardised values (train.regression_loss=huber: Huber's, delta 1, i.e. one
standard deviation). Metrics are in the targets' own units: MAE, RMSE and R² per target and their mean.
"""

from __future__ import annotations

import html
from pathlib import Path

import numpy as np
import torch

from vit_finetune.core import layout
from vit_finetune.core.errors import printable
from vit_finetune.recipe.train_section import REGRESSION_GOALS
from vit_finetune.tasks import pictures
from vit_finetune.tasks.base import Answers, SplitPredictions, Task

PROBLEM_TYPE = "regression"
MEAN_KEY, STD_KEY, LOSS_KEY = "target_mean", "target_std", "regression_loss"  # config.json keys
LOSSES = ("mse", "huber")
# export's int8 scoring: two answers agree when every value is within this share of its target's standard deviation
AGREEMENT_SHARE_OF_STD = 0.05


class Regression(Task):
    name = "regression"
    problem_type = PROBLEM_TYPE
    # The headline metric chooses, as accuracy (not the loss) does for a classifier: on a target of few values
    # (ELPV's four) a model that hedges toward the mean can tie on RMSE with one that is right far more often.
    selection_metric = "eval_mae"
    keep_best_metrics = frozenset(REGRESSION_GOALS)
    ema_compared = "mae"
    metric_names = {"mae": "MAE", "rmse": "RMSE", "r2": "R²"}
    curve = ("eval_mae", "Eval MAE", None)  # the headline, which also chooses the weights
    ranks = False
    label_encoding = "values"
    probe_fit = "ridge"  # least squares, as the head is trained
    method_rule = "regressor"
    wise_ft_measured = True
    wise_ft_auto_alpha = 0.0  # the probe's model where it scores no worse than LP-FT's weights (methods.py)

    def __init__(self, mean: list[float], std: list[float], loss_kind: str = "mse"):
        self.mean = torch.tensor(mean, dtype=torch.float32)
        self.std = torch.tensor(std, dtype=torch.float32)
        self.loss_kind = loss_kind

    def flat_image_suspect(self, label):
        """Never on its own: a blank image can have a value (a count of 0, an empty dish)."""
        return False

    def keep_best_refusal(self, keep_best, splits):
        """R² divides by the eval targets' spread: with no target that varies over the eval split (fewer than two
        images, or the same values in every one) it is undefined, `summarise` writes 0 at every evaluation, and
        keep_best would keep the first evaluation's weights whatever came after."""
        if keep_best != "eval_r2":
            return None
        values = np.asarray(splits.eval[splits.label_column], dtype=np.float64).reshape(len(splits.eval), -1)
        if len(values) >= 2 and (values.max(axis=0) > values.min(axis=0)).any():
            return None
        seen = f"{len(values)} eval image{'s' * (len(values) != 1)}" + (", every target the same in each"
                                                                       if len(values) >= 2 else "")
        return (f"train.keep_best=eval_r2: R² is undefined on this eval split ({seen}): it needs at least 2 eval "
                "images whose targets differ, else it reads 0 at every evaluation and the first is kept. Fix: "
                "train.keep_best=eval_mae (or eval_rmse), or more eval images (a larger data.eval_fraction, or "
                "data.eval_split naming a larger split)")

    @classmethod
    def from_targets(cls, values: np.ndarray, loss_kind: str) -> Regression:
        """Standardised by the training targets (N, T); a constant target keeps a scale of 1."""
        values = np.asarray(values, dtype=np.float64)
        std = values.std(axis=0)
        return cls(values.mean(axis=0).tolist(), np.where(std > 0, std, 1.0).tolist(), loss_kind)

    @classmethod
    def for_training(cls, splits, train):
        return cls.from_targets(np.asarray(splits.train[splits.label_column], dtype=np.float64), train.regression_loss)

    @classmethod
    def from_config(cls, config, train=None) -> Regression:
        count = config.num_labels
        return cls(getattr(config, MEAN_KEY, None) or [0.0] * count, getattr(config, STD_KEY, None) or [1.0] * count,
                   getattr(config, LOSS_KEY, None) or "mse")

    def configure(self, config) -> None:
        config.problem_type = PROBLEM_TYPE
        setattr(config, MEAN_KEY, self.mean.tolist())
        setattr(config, STD_KEY, self.std.tolist())
        setattr(config, LOSS_KEY, self.loss_kind)

    # ------------------------------------------------------------ training

    def kept(self, labels):
        """A skipped image's row is NaN."""
        return ~labels[:, 0].float().isnan()

    def per_image_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The loss of each image on the standardised scale, the mean over targets; 0 for a skipped image (NaN row)."""
        kept = self.kept(targets)
        standard = (targets.float().nan_to_num() - self.mean.to(logits.device)) / self.std.to(logits.device)
        if self.loss_kind == "huber":
            per_value = torch.nn.functional.huber_loss(logits.float(), standard, reduction="none", delta=1.0)
        else:
            per_value = torch.nn.functional.mse_loss(logits.float(), standard, reduction="none")
        return per_value.mean(dim=-1) * kept

    def loss(self, logits, targets, soft_targets, class_weights, label_smoothing):
        """The mean over the batch's real images; 0 with a zero gradient when all were skipped."""
        total = self.kept(targets).float().sum()
        return self.per_image_loss(logits, targets).sum() / torch.where(total > 0, total, torch.ones_like(total))

    def probe_targets(self, labels):
        """The targets standardised, as per_image_loss compares them to the head's outputs."""
        return (labels.float() - self.mean) / self.std

    # ------------------------------------------------------------ evaluation

    def values(self, logits: torch.Tensor) -> torch.Tensor:
        """The head's standardised outputs in the targets' own units."""
        return logits.float() * self.std.to(logits.device) + self.mean.to(logits.device)

    def batch_outputs(self, logits, labels, k):
        return self.values(logits), labels, self.per_image_loss(logits, labels)

    def predictions_of(self, batches, k):
        if not batches:
            return SplitPredictions(torch.empty(0, 0, dtype=torch.long), torch.empty(0, len(self.mean)),
                                    torch.empty(0), scores=torch.empty(0, len(self.mean)))
        values, references, losses = (torch.cat([part.cpu() for part in parts]) for parts in zip(*batches))
        return SplitPredictions(torch.empty(len(values), 0, dtype=torch.long), references.float(), losses,
                                scores=values)

    def kept_outputs(self, predictions):
        return predictions.scores

    def report(self, predictions, labels):
        kept = predictions.kept_for_metrics()
        metrics = summarise(predictions.scores[kept].double().numpy(), predictions.references[kept].double().numpy(),
                            labels)
        metrics["eval_loss"] = float(predictions.losses[kept].double().mean())
        metrics["regression_loss"] = self.loss_kind
        metrics["eval_skipped_images"] = int((~kept).sum())
        return metrics

    def headline(self, metrics):
        return (f"MAE {metrics['mae']:.4f}, RMSE {metrics['rmse']:.4f}, R² {metrics['r2']:.4f}, "
                f"loss {metrics['eval_loss']:.4f}")

    def draw(self, predictions, dataset, labels, folder, metrics):
        kept = predictions.kept
        pictures.draw_predicted_vs_true(predictions.scores[kept].numpy(), predictions.references[kept].numpy(), labels,
                                        Path(folder) / layout.PREDICTED_VS_TRUE_FILE)
        return [layout.PREDICTED_VS_TRUE_FILE]

    # ------------------------------------------------------------ using the model

    def scores(self, logits):
        return self.values(logits)

    def labels_given(self, scores, labels, top_k):
        """Every target's value, in the targets' order (there is nothing to rank)."""
        return list(zip(labels, scores))

    model_noun = "regression model"
    output_noun = "targets"
    score_format = ".4g"  # a value in its target's units: 59.94, -2.41, 0.0031
    confidences = False

    def shown(self, scores, labels, top_k):
        """The first top_k targets' values, in the targets' order (there is nothing to rank)."""
        return [(label, value) for label, value in zip(labels, scores.tolist()[:top_k])]

    def draw_shown(self, axis, shown, given):
        pictures.draw_values(axis, shown, len(given), self.score_format)

    def page_note(self, shown, given, top_k):
        """The values as a table of numbers in the targets' own units (not as confidences)."""
        rows = "".join(f"<tr><td>{html.escape(printable(name))}</td><td>{value:{self.score_format}}</td></tr>"
                       for name, value in given[:top_k])
        more = f" The first {top_k} of {len(given)} targets; predict lists them all." if len(given) > top_k else ""
        return f"<p>Predicted values, each in its target's own units:{more}</p><table>{rows}</table>"

    def write_csv(self, rows, path, top_k, open_writer):
        """One column per target, holding its predicted value."""
        count, header = 0, None
        with open(path, "w", newline="") as out:
            writer = open_writer(out)
            for row in rows:
                if header is None:
                    header = [guess["label"] for guess in row["predictions"]] or None
                    if header is not None or row["error"] is None:
                        writer.writerow(["image", "error", *(header or [])])
                values = [f"{guess['score']:.6g}" for guess in row["predictions"]]
                writer.writerow([row["image"], row["error"] or "", *values])
                count += 1
        return count

    @classmethod
    def card_section(cls, metrics, escape):
        rows = "\n".join(f"| {escape(name)} | {s['mae']:.4g} | {s['rmse']:.4g} | {s['r2']:.4f} | {s['true_mean']:.4g} | "
                         f"{s['true_std']:.4g} |" for name, s in metrics.get("per_target", {}).items())
        return ("Regression: the model gives a number per target. Its head outputs the targets *standardised* by "
                f"the training split's mean and standard deviation, saved in `config.json` (`{MEAN_KEY}`, "
                f"`{STD_KEY}`); the value is `output * {STD_KEY} + {MEAN_KEY}`. Trained with the "
                f"{metrics.get('regression_loss', 'mse').upper()} loss of the standardised values.\n\n"
                "### Per target\n| target | MAE | RMSE | R² | eval mean | eval std |\n|---|---|---|---|---|---|\n"
                f"{rows}\n")

    @classmethod
    def use_text(cls, load_from: str) -> str:
        return RAW_VALUE_SNIPPET.format(model=load_from)

    def answers(self, config):
        """Values agree within a share of each target's std; they are scored by their MAE, the mean over the targets
        of the absolute error in each target's units (metrics.json's `mae`)."""
        tolerance = AGREEMENT_SHARE_OF_STD * self.std
        largest_std = float(self.std.max()) if len(self.std) else 1.0
        return Answers(f"values within {AGREEMENT_SHARE_OF_STD:.0%} of each target's std",
                       self.values, lambda a, b: ((a - b.float()).abs() <= tolerance).all(-1), self.kept,
                       metric="mae", metric_name="MAE", score=lambda a, b: (a - b.float()).abs().mean(-1),
                       in_own_terms=lambda difference: (f", at most {difference * largest_std:.3g} in the targets' "
                                                        "units (x target_std)"))


# pipeline("image-classification") applies a softmax (one target) or a sigmoid to the head's output and ranks it:
# for a regression model its scores are not the values. The card gives the call that is.
RAW_VALUE_SNIPPET = """
`pipeline()` applies a softmax or a sigmoid to the head's output, so its scores are not this model's values. The
values, in the targets' own units:
```python
import torch
from PIL import Image
from transformers import AutoImageProcessor, AutoModelForImageClassification

model = AutoModelForImageClassification.from_pretrained({model})
processor = AutoImageProcessor.from_pretrained({model})
with torch.no_grad():
    standardised = model(**processor(images=Image.open("image.png").convert("RGB"), return_tensors="pt")).logits
values = standardised * torch.tensor(model.config.target_std) + torch.tensor(model.config.target_mean)
print(dict(zip(model.config.id2label.values(), values[0].tolist())))
```
"""


def summarise(predicted: np.ndarray, true: np.ndarray, names: list[str]) -> dict:
    """MAE, RMSE and R² of each target (in its units) and their means over the targets. R² is 1 - residual sum of
    squares / the sum of squares around the eval mean: 0 for predicting that mean, negative when worse; 0 for a
    target that is constant on the split."""
    error = predicted - true
    mae = np.abs(error).mean(axis=0)
    rmse = np.sqrt((error ** 2).mean(axis=0))
    around_mean = ((true - true.mean(axis=0)) ** 2).sum(axis=0)
    residual = (error ** 2).sum(axis=0)
    r2 = np.divide(residual, around_mean, out=np.ones_like(residual), where=around_mean > 0)
    r2 = np.where(around_mean > 0, 1 - r2, 0.0)
    return {
        "eval_samples": int(len(true)),
        "task": PROBLEM_TYPE,
        "mae": float(mae.mean()), "rmse": float(rmse.mean()), "r2": float(r2.mean()),
        "per_target": {name: {"mae": float(a), "rmse": float(b), "r2": float(c), "true_mean": float(m),
                              "true_std": float(s)}
                       for name, a, b, c, m, s in zip(names, mae, rmse, r2, true.mean(axis=0), true.std(axis=0))},
    }
