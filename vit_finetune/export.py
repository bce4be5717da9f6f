"""Final outputs: model (safetensors), image processor, recipe, metrics, curves and model card.

Everything is written into a staging folder first and moved into `output_dir` file by file, with
`metrics.json` last: its presence is what marks a finished run, so a crash mid-export never leaves a
folder that looks finished.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from huggingface_hub import EvalResult, ModelCard, ModelCardData
from transformers.utils import CONFIG_NAME, IMAGE_PROCESSOR_NAME, SAFE_WEIGHTS_NAME

from .recipe import RECIPE_FILE, REPO_ID_PATTERN, Recipe, write_recipe

METRICS_FILE = "metrics.json"
CURVES_FILE = "training_curves.png"
HISTORY_FILE = "history.json"
CARD_FILE = "README.md"
ADAPTER_DIR = "adapter"
STAGING = ".staging-final"
METRIC_NAMES = {"accuracy": "Accuracy", "top5_accuracy": "Top-5 accuracy", "macro_f1": "Macro F1"}


def is_finished(output_dir: Path) -> bool:
    return (Path(output_dir) / METRICS_FILE).is_file()


def is_hub_id(value: str) -> bool:
    """A Hub id, not a local path: the Hub rejects model cards that list local paths (autotrain#648)."""
    return not Path(value).expanduser().exists() and not value.startswith((".", "/", "~")) and bool(
        REPO_ID_PATTERN.match(value)
    )


def plot_curves(history: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display on training machines
    import matplotlib.pyplot as plt

    train = [h for h in history if "loss" in h]
    evals = [h for h in history if "eval_accuracy" in h]
    figure, (loss_axis, accuracy_axis) = plt.subplots(1, 2, figsize=(10, 3.5))
    loss_axis.plot([h["step"] for h in train], [h["loss"] for h in train], label="train loss")
    if evals:
        loss_axis.plot([h["step"] for h in evals], [h["eval_loss"] for h in evals], "o-", label="eval loss")
        accuracy_axis.plot([h["step"] for h in evals], [h["eval_accuracy"] for h in evals], "o-", color="tab:green")
    loss_axis.set(xlabel="optimiser step", ylabel="loss", title="Loss")
    loss_axis.legend()
    accuracy_axis.set(xlabel="optimiser step", ylabel="accuracy", title="Eval accuracy", ylim=(0, 1))
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)


def model_card(recipe: Recipe, metrics: dict, labels: list[str], name: str, lora: bool) -> ModelCard:
    dataset = recipe.data.dataset
    eval_results = [
        EvalResult(
            task_type="image-classification",
            task_name="Image Classification",
            dataset_type=dataset if is_hub_id(dataset) else "local",
            dataset_name=dataset if is_hub_id(dataset) else Path(dataset).name,
            dataset_split=recipe.data.eval_split or "held-out part of train",
            metric_type=key,
            metric_name=label,
            metric_value=round(float(metrics[key]), 6),
        )
        for key, label in METRIC_NAMES.items()
        if key in metrics
    ]
    data = ModelCardData(
        model_name=name,
        library_name="transformers",
        pipeline_tag="image-classification",
        tags=["vision", "image-classification", "vit", "vit_finetune"] + (["lora", "peft"] if lora else []),
        base_model=recipe.model.base if is_hub_id(recipe.model.base) else None,
        datasets=[dataset] if is_hub_id(dataset) else None,
        eval_results=eval_results,
    )
    t = recipe.train
    rows = "\n".join(f"| {METRIC_NAMES[k]} | {metrics[k]:.4f} |" for k in METRIC_NAMES if k in metrics)
    lora_text = (
        f"LoRA (r={recipe.model.lora.r}, alpha={recipe.model.lora.alpha}, targets {recipe.model.lora.target_modules}); "
        f"the repo root holds the merged model, `{ADAPTER_DIR}/` the adapter with the head."
        if lora else "full fine-tuning"
    )
    body = f"""
# {name}

A ViT fine-tuned with [vit_finetune](https://github.com/) from `{recipe.model.base}` on `{dataset}`
at **{recipe.model.image_size}×{recipe.model.image_size} px**. The position embeddings were resampled once
to the new grid, so the model runs at this size with no `interpolate_pos_encoding` flag.

## Use
```python
from transformers import pipeline
classify = pipeline("image-classification", model="{name}")
classify("photo.jpg")
```

## Results ({metrics.get("eval_samples", "?")} eval images)
{weights_text(recipe, metrics)}

| metric | value |
|---|---|
{rows}

![training curves]({CURVES_FILE})

## Training
- Method: {lora_text}
- Labels: {len(labels)} ({", ".join(labels[:10])}{", ..." if len(labels) > 10 else ""})
- Optimiser: {t.optimizer}, lr {t.lr}, weight decay {t.weight_decay}, {t.scheduler} schedule, {t.warmup_steps} warm-up steps
- Batch: {t.batch_size} per device × {t.grad_accum} accumulation, {t.epochs} epoch(s){f", at most {t.max_steps} steps" if t.max_steps else ""}
- Precision: {t.mixed_precision}; gradient clipping: {t.max_grad_norm}; seed {t.seed}
- Full recipe: [`{RECIPE_FILE}`]({RECIPE_FILE})
"""
    return ModelCard(f"---\n{data.to_yaml()}\n---\n{body}")


def weights_text(recipe: Recipe, metrics: dict) -> str:
    """Which weights were saved and where their numbers come from: the last step, the best evaluation, an EMA."""
    t = recipe.train
    if "best_step" in metrics:
        text = (f"The saved weights are those of optimiser step {metrics['best_step']} of {metrics['steps']}, the best "
                f"`{metrics['best_metric']}` ({metrics['best_value']:.4f}) of the evaluations during training "
                f"(`train.keep_best`); the metrics below were measured with them.")
        if metrics.get("stopped_early"):
            text += (f" Training stopped early after {t.early_stopping_patience} evaluations without gain "
                     "(`train.early_stopping_patience`).")
    else:
        text = "Measured at the end of training."
    if "weights" in metrics:
        chosen = "the EMA of the weights" if metrics["weights"] == "ema" else "the raw weights"
        text += (f" With `train.ema_decay={t.ema_decay}`, {chosen} scored better and were saved "
                 f"(accuracy: EMA {metrics['ema_accuracy']:.4f}, raw {metrics['raw_accuracy']:.4f}).")
    return text


def save_image_processor(processor, folder: Path) -> None:
    """save_pretrained, with preprocessor_config.json naming the class that was used: transformers 5 writes a PIL
    processor under its family's name (ViTImageProcessorPil as ViTImageProcessor), which a machine with
    torchvision would load as the torchvision one, not the processor the reported metrics were measured with."""
    processor.save_pretrained(folder)
    path = Path(folder) / IMAGE_PROCESSOR_NAME
    settings = json.loads(path.read_text())
    settings["image_processor_type"] = type(processor).__name__
    path.write_text(json.dumps(settings, indent=2, sort_keys=True) + "\n")


def write_outputs(output_dir: Path, model, processor, recipe: Recipe, metrics: dict, history: list[dict],
                  labels: list[str], adapter_model=None) -> None:
    """Stage every final file, then move them into output_dir with metrics.json last."""
    output_dir = Path(output_dir)
    staging = output_dir / STAGING
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    model.save_pretrained(staging, safe_serialization=True)
    save_image_processor(processor, staging)
    if adapter_model is not None:
        adapter_model.save_pretrained(staging / ADAPTER_DIR, safe_serialization=True)
        # peft writes a stub card whose base_model may be a local path, which the Hub rejects; the root card covers it.
        (staging / ADAPTER_DIR / CARD_FILE).unlink(missing_ok=True)
    write_recipe(recipe, staging)
    (staging / HISTORY_FILE).write_text(json.dumps(history, indent=1))
    plot_curves(history, staging / CURVES_FILE)
    name = recipe.hub.repo_id or output_dir.name
    model_card(recipe, metrics, labels, name, adapter_model is not None).save(staging / CARD_FILE)
    (staging / METRICS_FILE).write_text(json.dumps(metrics, indent=1))

    for entry in sorted(staging.iterdir(), key=lambda p: p.name == METRICS_FILE):
        target = output_dir / entry.name
        if target.is_dir():
            shutil.rmtree(target)
        os.replace(entry, target)
    staging.rmdir()


def clear_previous_run(output_dir: Path) -> None:
    """overwrite=true: remove what an earlier run left, so its files cannot mix with the new ones."""
    from .checkpoint import CHECKPOINTS
    from .selection import BEST_DIR

    for name in (METRICS_FILE, CARD_FILE, RECIPE_FILE, HISTORY_FILE, CURVES_FILE, CONFIG_NAME,
                 SAFE_WEIGHTS_NAME, IMAGE_PROCESSOR_NAME, ADAPTER_DIR, CHECKPOINTS, BEST_DIR, STAGING):
        path = Path(output_dir) / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
