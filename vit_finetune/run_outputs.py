"""Final outputs: model (safetensors), image processor, recipe, metrics, curves and model card.

Everything is written into a staging folder first and moved into `output_dir` file by file, with
`metrics.json` last: its presence is what marks a finished run, so a crash mid-export never leaves a
folder that looks finished.
"""

from __future__ import annotations

import html
import json
import re
import shutil
import statistics
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Callable

from huggingface_hub import EvalResult, ModelCard, ModelCardData

from . import distill, methods, tasks
from .data import alpha_card_text
from .families import FAMILIES
from .layout import (ADAPTER_DIR, CARD_FILE, CONFUSION_FILE, CURVES_FILE, HISTORY_FILE, METRICS_FILE, MISCLASSIFIED_FILE,
                     PICTURE_FILES, POSITION_FILE, PRECISION_RECALL_FILE, PREDICTED_VS_TRUE_FILE, PROCESSOR_FILE,
                     RECIPE_FILE, RUN_INFO_FILE, STAGING, move_into, record)
from .outputs import OutputDirError, drop_previous_run, set_previous_run_aside, unwritable
from .pictures import plot_curves
from .recipe import Recipe, write_recipe
from .recipe.limits import REPO_ID_PATTERN
from .text import printable

VERSIONED_PACKAGES = ("torch", "transformers", "peft", "accelerate", "datasets")
# Marks that start Markdown syntax inside a line (emphasis, links, code, tables, headings, lists, escapes).
MARKDOWN_MARKS = re.compile(r"[\\`*_{}\[\]()#+\-.!|~]")
# What metrics.json records of the training itself: `evaluate` on the run's own eval split measures everything else.
TRAINING_ONLY_METRICS = ("steps", "skipped_images", "labels_without_train_images", "train_images_without_labels",
                         "distillation", "method", "probe")
def metric_names(metrics: dict) -> dict[str, str]:
    """The card's name of each metric, as the task the metrics were measured for names them."""
    return tasks.of_metrics(metrics).metric_names


def is_finished(output_dir: Path) -> bool:
    return (Path(output_dir) / METRICS_FILE).is_file()


def is_hub_id(value: str) -> bool:
    """A Hub id, not a local path: the Hub rejects model cards that list local paths (autotrain#648)."""
    return not Path(value).expanduser().exists() and not value.startswith((".", "/", "~")) and bool(
        REPO_ID_PATTERN.match(value)
    )


def run_info(device: str, processes: int, mixed_precision: str, history: list[dict], training_seconds: float,
             resumed_from: Path | None = None, metrics: dict | None = None) -> dict:
    """How the model was made, beside the recipe: run_info.json and the card's Training section."""
    rates = [entry["images_per_s"] for entry in history if "images_per_s" in entry]
    return {
        "weights": saved_weights(metrics or {}),
        "training_seconds": round(training_seconds, 1),  # this process's loop only: a resumed run counts its part
        "resumed_from": str(resumed_from) if resumed_from else None,
        "device": device,
        "processes": processes,
        "mixed_precision": mixed_precision,
        "images_per_s": round(statistics.median(rates), 1) if rates else None,  # median over the logged windows
        "versions": {name: metadata.version(name) for name in VERSIONED_PACKAGES},
        "finished_at": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


# The model goes in as a Python string literal (json.dumps writes one), so no folder name can break out of it.
USAGE_SNIPPET = 'classify = pipeline("image-classification", model={})'
USAGE_LINE = re.compile(re.escape(USAGE_SNIPPET.split("{}")[0]) + r'"(?:[^"\\\n]|\\.)*"\)')


def usage_snippet(load_from: str) -> str:
    """The card's pipeline line loading `load_from`."""
    return USAGE_SNIPPET.format(json.dumps(load_from, ensure_ascii=False))


# A task's own snippet (a regression's raw values) loads the model by name too.
LOADING_CALL = re.compile(r'\.from_pretrained\("(?:[^"\\\n]|\\.)*"\)')


def card_loading_from(card_text: str, load_from: str) -> str:
    """The card with its usage snippets loading `load_from`: a later push names the repo it went to."""
    literal = json.dumps(load_from, ensure_ascii=False)
    card_text = LOADING_CALL.sub(lambda _: f".from_pretrained({literal})", card_text)
    return USAGE_LINE.sub(lambda _: usage_snippet(load_from), card_text)


def usage_id(recipe: Recipe, output_dir: Path) -> str:
    """What `pipeline(model=...)` should load: the Hub repo when the run pushes there, else the folder itself."""
    return recipe.hub.repo_id if recipe.hub.push and recipe.hub.repo_id else str(output_dir)


def markdown_text(value: str) -> str:
    """A label as inert Markdown text on one line: HTML and Markdown's marks escaped, line breaks made spaces, and
    controls and bidirectional overrides written as their escapes (text.printable), so none reorders the card."""
    one_line = printable(" ".join(str(value).split()))
    return MARKDOWN_MARKS.sub(r"\\\g<0>", html.escape(one_line, quote=False))


def markdown_code(value: str) -> str:
    """A path, id or split name as one inline code span that nothing in it can end: line breaks made spaces (a new
    line could start a heading), and a fence of more backticks than the longest run inside."""
    one_line = " ".join(str(value).split())
    longest = max((len(run) for run in re.findall(r"`+", one_line)), default=0)
    fence = "`" * (longest + 1)
    padded = f" {one_line} " if one_line.startswith("`") or one_line.endswith("`") else one_line
    return f"{fence}{padded}{fence}"


def model_card(recipe: Recipe, metrics: dict, labels: list[str], name: str, lora: bool, load_from: str | None = None,
               info: dict | None = None, pictures: tuple[str, ...] = (), model_type: str = "vit") -> ModelCard:
    family = FAMILIES[model_type]
    dataset = recipe.data.dataset
    eval_results = [
        EvalResult(
            task_type="image-classification",
            task_name="Image Classification",
            dataset_type=dataset if is_hub_id(dataset) else "local",
            dataset_name=dataset if is_hub_id(dataset) else Path(dataset).name,
            dataset_split=metrics.get("eval_split", recipe.data.eval_split),
            metric_type=key,
            metric_name=label,
            metric_value=round(float(metrics[key]), 6),
        )
        for key, label in metric_names(metrics).items()
        if key in metrics
    ]
    data = ModelCardData(
        model_name=name,
        library_name="transformers",
        pipeline_tag="image-classification",
        tags=["vision", "image-classification", model_type, "vit_finetune"] + (["lora", "peft"] if lora else []),
        base_model=recipe.model.base if is_hub_id(recipe.model.base) else None,
        datasets=[dataset] if is_hub_id(dataset) else None,
        eval_results=eval_results,
    )
    t = recipe.train
    rows = "\n".join(f"| {label} | {metrics[k]:.4f} |" for k, label in metric_names(metrics).items() if k in metrics)
    lora_text = (
        f"LoRA (r={recipe.model.lora.r}, alpha={recipe.model.lora.alpha}, targets "
        f"{markdown_text(recipe.model.lora.target_modules)}); "
        f"the repo root holds the merged model, `{ADAPTER_DIR}/` the adapter with the head."
        if lora else "full fine-tuning"
    )
    # Every string a user gave (folder names, paths, ids, split names) goes in as inert text or code: a folder named
    # like HTML or a heading must not change the card the Hub renders.
    body = f"""
# {markdown_text(name)}

A {family.name} fine-tuned with vit_finetune from {markdown_code(recipe.model.base)} on {markdown_code(dataset)}
at **{recipe.model.image_size}×{recipe.model.image_size} px**. Its position information was moved once to the new
size ({family.resized}), so the model runs at this size with no `interpolate_pos_encoding` flag.

## Use
```python
from transformers import pipeline
{usage_snippet(load_from or name)}
classify("photo.jpg")
```
{tasks.of_metrics(metrics).use_text(json.dumps(load_from or name, ensure_ascii=False))}{alpha_card_text(recipe.data)}
## Results ({eval_set_text(metrics, recipe)})
{weights_text(recipe, metrics)}

| metric | value |
|---|---|
{rows}

{"![training curves](" + CURVES_FILE + ")" if CURVES_FILE in pictures else ""}
{picture_text(tuple(name for name in pictures if name != CURVES_FILE))}
{tasks.of_metrics(metrics).card_section(metrics, markdown_text)}
## Training
{info_text(info)}- Method: {methods.card_text(t.method, metrics, lora_text)}{distillation_text(metrics)}
- Labels: {len(labels)} ({", ".join(markdown_text(label) for label in labels[:10])}{", ..." if len(labels) > 10 else ""})
- Optimiser: {t.optimizer}, lr {t.lr} (new head: {t.head_lr}), weight decay {t.weight_decay}, {t.scheduler} schedule, {t.warmup_steps} warm-up steps
- Batch: {t.batch_size} per device × {t.grad_accum} accumulation, {t.epochs} epoch(s){f", at most {t.max_steps} steps" if t.max_steps else ""}
- Precision: {t.mixed_precision}{skipped_steps_text(metrics)}; gradient clipping: {t.max_grad_norm}; seed {t.seed}
- Full recipe: [`{RECIPE_FILE}`]({RECIPE_FILE})
"""
    return ModelCard(f"---\n{data.to_yaml()}\n---\n{body}")


def skipped_steps_text(metrics: dict) -> str:
    """fp16: the card's note of the optimiser steps its loss scaler skipped (loss_scale.py)."""
    if "skipped_steps" not in metrics:
        return ""
    return (f" ({metrics['skipped_steps']} of {metrics['steps']} optimiser steps skipped by the loss scaler: their "
            "gradients overflowed float16)")


def distillation_text(metrics: dict) -> str:
    """The card's line on a distilled run's teacher and student (distill.describe), their names as inert code."""
    facts = metrics.get("distillation")
    if not facts:
        return ""
    inert = {"teacher": markdown_code(facts["teacher"])}
    if "student" in facts:  # its base is a path or id too
        inert["student"] = {**facts["student"], "from": markdown_code(facts["student"]["from"])}
    return "; " + distill.describe({**facts, **inert})


def saved_weights(metrics: dict) -> str:
    """Which weights were saved, in a few words (train.keep_best and train.ema_decay record themselves in metrics)."""
    kind = "EMA of the weights" if metrics.get("weights") == "ema" else "raw weights"
    if "best_step" in metrics:
        return f"{kind} of step {metrics['best_step']}, the best {metrics['best_metric']} ({metrics['best_value']:.4f})"
    return f"{kind} of the last step" if "weights" in metrics else "last step"


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
        compared = tasks.of_metrics(metrics).ema_compared
        text += (f" With `train.ema_decay={t.ema_decay}`, {chosen} scored better and were saved "
                 f"({compared}: EMA {metrics[f'ema_{compared}']:.4f}, raw {metrics[f'raw_{compared}']:.4f}).")
    return text


PICTURE_CAPTIONS = {
    CONFUSION_FILE: "Confusion matrix, each row (true label) normalised to 1",
    MISCLASSIFIED_FILE: "Eval images the model got wrong, with true and predicted labels",
    PRECISION_RECALL_FILE: "Precision-recall curve of each label, its chosen threshold marked",
    PREDICTED_VS_TRUE_FILE: "Predicted against true value of each eval image, per target (the diagonal: exact)",
    POSITION_FILE: "Cosine similarity of each patch's position embedding to every other, before and after "
                               "the resample to the new grid",
}


def picture_text(pictures: tuple[str, ...]) -> str:
    return "".join(f"\n{PICTURE_CAPTIONS[name]}:\n\n![{PICTURE_CAPTIONS[name]}]({name})\n" for name in pictures)


def duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def info_text(info: dict | None) -> str:
    """The card's lines on how the model was made (run_info.json in words)."""
    if not info:
        return ""
    versions = ", ".join(f"{name} {version}" for name, version in info["versions"].items())
    rate = f"{info['images_per_s']} images/s (median over logged steps)" if info["images_per_s"] else "images/s not logged"
    resumed = f"; resumed from {markdown_code(info['resumed_from'])}" if info["resumed_from"] else ""
    return (f"- Saved weights: {info['weights']}\n"
            f"- Training time: {duration(info['training_seconds'])} on {info['processes']} x {markdown_text(info['device'])} "
            f"(mixed precision: {info['mixed_precision']}), {rate}{resumed}\n"
            f"- Versions: {versions} (also in [`{RUN_INFO_FILE}`]({RUN_INFO_FILE}))\n")


def eval_set_text(metrics: dict, recipe: Recipe) -> str:
    """What the card's numbers were measured on, in words."""
    size = metrics.get("eval_samples", "?")
    if metrics.get("eval_carved_from_train"):
        why = (f"the dataset has no {markdown_code(recipe.data.eval_split)} split" if recipe.data.eval_split
               else "data.eval_split is null")
        return (f"{size} eval images held out from {markdown_code(recipe.data.train_split)} ({recipe.data.eval_fraction:.0%}, "
                f"stratified, seed {recipe.train.seed}) because {why}")
    return f"{size} eval images, split {markdown_code(metrics.get('eval_split', recipe.data.eval_split))}"


def save_image_processor(processor, folder: Path) -> None:
    """save_pretrained, with preprocessor_config.json naming the class that was used: transformers 5 writes a PIL
    processor under its family's name (ViTImageProcessorPil as ViTImageProcessor), which a machine with
    torchvision would load as the torchvision one, not the processor the reported metrics were measured with."""
    processor.save_pretrained(folder)
    path = Path(folder) / PROCESSOR_FILE
    settings = json.loads(path.read_text())
    settings["image_processor_type"] = type(processor).__name__
    path.write_text(json.dumps(settings, indent=2, sort_keys=True) + "\n")


def write_outputs(output_dir: Path, model, processor, recipe: Recipe, metrics: dict, history: list[dict],
                  labels: list[str], adapter_model=None, run_info: dict | None = None,
                  draw_pictures: Callable[[Path], list[str]] | None = None) -> None:
    """Stage every final file, then move them into output_dir with metrics.json last."""
    output_dir = Path(output_dir)
    staging = output_dir / STAGING
    record(output_dir, [STAGING])
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
    if recipe.pictures:
        plot_curves(history, staging / CURVES_FILE, tasks.of_metrics(metrics).curve)
    if run_info is not None:
        (staging / RUN_INFO_FILE).write_text(json.dumps(run_info, indent=1))
    if draw_pictures is not None:
        draw_pictures(staging)
    pictures = tuple(name for name in (CURVES_FILE, *PICTURE_FILES)
                     if (staging / name).is_file() or (output_dir / name).is_file())
    name = recipe.hub.repo_id or output_dir.name
    model_card(recipe, metrics, labels, name, adapter_model is not None, usage_id(recipe, output_dir), run_info,
               pictures, model.config.model_type).save(staging / CARD_FILE)
    (staging / METRICS_FILE).write_text(json.dumps(metrics, indent=1))

    record(output_dir, [entry.name for entry in staging.iterdir()])
    move_into(staging, output_dir, last=METRICS_FILE)
    drop_previous_run(output_dir)  # overwrite=true: the run these outputs replace goes only now


def begin_outputs(output_dir: Path, recipe: Recipe, overwrite: bool,
                  draw_positions: Callable[[Path], None] | None = None) -> None:
    """The run's first writes, once every check before training has passed: with overwrite=true the previous run
    is set aside first (outputs.set_previous_run_aside), then recipe.yaml and the position-embedding picture."""
    output_dir = Path(output_dir)
    if overwrite:
        set_previous_run_aside(output_dir)
    try:
        record(output_dir, [RECIPE_FILE] + ([POSITION_FILE] if draw_positions else []))
        write_recipe(recipe, output_dir)
    except OSError as error:
        raise OutputDirError(unwritable(output_dir, error)) from None
    if draw_positions is not None:
        draw_positions(output_dir / POSITION_FILE)
