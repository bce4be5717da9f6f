"""The model card (README.md of an output folder): what the model is, how to use it, its results and pictures, and
how it was trained, every string a user gave written in as inert Markdown; and the card's usage lines, which a later
push points at the repo it went to.
"""

from __future__ import annotations

import html
import json
import re
from pathlib import Path

from huggingface_hub import EvalResult, ModelCard, ModelCardData

from vit_finetune import tasks
from vit_finetune.core.errors import printable
from vit_finetune.core.layout import (
    ADAPTER_DIR, CONFUSION_FILE, CURVES_FILE, MISCLASSIFIED_FILE, POSITION_FILE, PRECISION_RECALL_FILE,
    PREDICTED_VS_TRUE_FILE, RECIPE_FILE, REPO_ID_PATTERN, RUN_INFO_FILE,
)
from vit_finetune.data import alpha_card_text
from vit_finetune.model import student
from vit_finetune.model.families import FAMILIES
from vit_finetune.recipe import Recipe, methods
from vit_finetune.tasks import evaluation

# Marks that start Markdown syntax inside a line (emphasis, links, code, tables, headings, lists, escapes).
MARKDOWN_MARKS = re.compile(r"[\\`*_{}\[\]()#+\-.!|~]")


def metric_names(metrics: dict) -> dict[str, str]:
    """The card's name of each metric, as the task the metrics were measured for names them."""
    return tasks.of_metrics(metrics).metric_names


def is_hub_id(value: str) -> bool:
    """A Hub id, not a local path: the Hub rejects model cards that list local paths (autotrain#648)."""
    return not Path(value).expanduser().exists() and not value.startswith((".", "/", "~")) and bool(
        REPO_ID_PATTERN.match(value)
    )


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
    eval_split = metrics.get("eval_split", recipe.data.eval_split)
    eval_results = [
        metric_result(dataset, eval_split, key, label, metrics[key])
        for key, label in metric_names(metrics).items()
        if key in metrics
    ] + results_on_test_split(metrics, dataset)
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
    rows = results_table(metrics)
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

{rows}

{"![training curves](" + CURVES_FILE + ")" if CURVES_FILE in pictures else ""}
{picture_text(tuple(name for name in pictures if name != CURVES_FILE))}
{tasks.of_metrics(metrics).card_section(metrics, markdown_text)}
## Training
{info_text(info)}- Method: {methods.card_text(t.method, metrics, lora_text, t.lp_ft_head_scale)}{distillation_text(metrics)}
- Labels: {len(labels)} ({", ".join(markdown_text(label) for label in labels[:10])}{", ..." if len(labels) > 10 else ""})
- Optimiser: {t.optimizer}, lr {t.lr} (new head: {t.head_lr}), weight decay {t.weight_decay}, {t.scheduler} schedule, {t.warmup_steps} warm-up steps
- Batch: {t.batch_size} per device × {t.grad_accum} accumulation, {t.epochs} epoch(s){f", at most {t.max_steps} steps" if t.max_steps else ""}
- Precision: {t.mixed_precision}{skipped_steps_text(metrics)}; gradient clipping: {t.max_grad_norm}; seed {t.seed}
- Full recipe: [`{RECIPE_FILE}`]({RECIPE_FILE})
"""
    return ModelCard(f"---\n{data.to_yaml()}\n---\n{body}")


def results_on_test_split(metrics: dict, dataset: str) -> list[EvalResult]:
    """The card metadata's results on data.test_split, beside the eval split's: one per metric, its split named."""
    test = metrics.get("test")
    if not test:
        return []
    return [metric_result(dataset, test["split"], key, label, test[evaluation.as_test_key(key)])
            for key, label in metric_names(metrics).items() if evaluation.as_test_key(key) in test]


def metric_result(dataset: str, split: str | None, key: str, label: str, value: float) -> EvalResult:
    """One metric of one split, as the card's model-index metadata records it."""
    return EvalResult(task_type="image-classification", task_name="Image Classification",
                      dataset_type=dataset if is_hub_id(dataset) else "local",
                      dataset_name=dataset if is_hub_id(dataset) else Path(dataset).name,
                      dataset_split=split, metric_type=key, metric_name=label, metric_value=round(float(value), 6))


def results_table(metrics: dict) -> str:
    """The card's table of the eval split's metrics, with a column for data.test_split's where the run scored one."""
    names = {key: label for key, label in metric_names(metrics).items() if key in metrics}
    test = metrics.get("test")
    if not test:
        return "| metric | value |\n|---|---|\n" + "\n".join(f"| {label} | {metrics[k]:.4f} |" for k, label in names.items())

    def cell(key: str) -> str:
        value = test.get(evaluation.as_test_key(key))
        return "" if value is None else f"{value:.4f}"
    head = (f"| metric | eval | test: split {markdown_code(test['split'])}, {test.get('test_samples', '?')} images, "
            "scored once by the saved weights |\n|---|---|---|\n")
    return head + "\n".join(f"| {label} | {metrics[k]:.4f} | {cell(k)} |" for k, label in names.items())


def skipped_steps_text(metrics: dict) -> str:
    """fp16: the card's note of the optimiser steps its loss scaler skipped (loss_scale.py)."""
    if "skipped_steps" not in metrics:
        return ""
    return (f" ({metrics['skipped_steps']} of {metrics['steps']} optimiser steps skipped by the loss scaler: their "
            "gradients overflowed float16)")


def describe_distillation(facts: dict) -> str:
    """The console's and the card's sentence on a distilled run (from report)."""
    how = (f"{facts['mode']} distillation, weight {facts['weight']}, temperature {facts['temperature']}"
           + ("" if facts["mode"] == "soft" else " (unused by hard)"))
    if facts["cache_logits"]:
        cost = (f"the teacher labelled the training images once before training, in {facts['labelling_seconds']} s, "
                f"then cost nothing in the {facts['training_seconds']} s of training (cache_logits)")
    else:
        share = facts["teacher_share"]
        cost = (f"the teacher's forwards took {facts['teacher_seconds']} s of the {facts['training_seconds']} s of "
                f"training" + (f" ({share:.0%})" if share is not None else ""))
    pupil = f"; the student: {student.describe(facts['student'])}" if "student" in facts else ""  # none in older metrics.json
    return f"taught by the teacher {facts['teacher']} ({how}){pupil}; {cost}"


def distillation_text(metrics: dict) -> str:
    """The card's line on a distilled run's teacher and student (describe_distillation), their names as inert code."""
    facts = metrics.get("distillation")
    if not facts:
        return ""
    inert = {"teacher": markdown_code(facts["teacher"])}
    if "student" in facts:  # its base is a path or id too
        inert["student"] = {**facts["student"], "from": markdown_code(facts["student"]["from"])}
    return "; " + describe_distillation({**facts, **inert})


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
    stages = info.get("resolution_stages")
    schedule = (f"- Resolution schedule (`train.resolution_schedule`): " + ", then ".join(
        f"{entry['image_size']} px for {entry['steps']} steps ({duration(entry['seconds'])})" for entry in stages)
        + "; the saved model runs at the last size\n") if stages else ""
    return (f"- Saved weights: {info['weights']}\n{schedule}"
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


