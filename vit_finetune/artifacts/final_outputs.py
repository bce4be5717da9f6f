"""The final outputs: the model (safetensors), its image processor, the recipe as run, the history and pictures, the
card and metrics.json, written into a staging folder first and moved into output_dir file by file, `metrics.json`
last: its presence marks a finished run, so a crash mid-export never leaves a folder that looks finished.
"""

from __future__ import annotations

import json
import shutil
import statistics
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Callable

from vit_finetune import tasks
from vit_finetune.artifacts.card import model_card, saved_weights, usage_id
from vit_finetune.core.layout import (
    ADAPTER_DIR, CARD_FILE, CURVES_FILE, HISTORY_FILE, METRICS_FILE, PICTURE_FILES, POSITION_FILE, PROCESSOR_FILE,
    RECIPE_FILE, RUN_INFO_FILE, STAGING, move_into, record,
)
from vit_finetune.core.previous_run import drop_previous_run, set_previous_run_aside
from vit_finetune.core.run_lock import OutputDirError, staging_refusal, unwritable
from vit_finetune.recipe import Recipe, write_recipe
from vit_finetune.tasks.pictures import plot_curves


VERSIONED_PACKAGES = ("torch", "transformers", "peft", "accelerate", "datasets")


# What metrics.json records of the training itself: `evaluate` on the run's own eval split measures everything else.
TRAINING_ONLY_METRICS = ("steps", "skipped_images", "labels_without_train_images", "train_images_without_labels",
                         "distillation", "method", "probe", "eval_unlike_train")


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
    clear_staging(output_dir)
    staging.mkdir(parents=True, exist_ok=True)
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


def clear_staging(output_dir: Path) -> None:
    """What an earlier final save left in the staging folder removed: only the names the final save writes
    (layout.STAGED_NAMES); a file of anyone else's there is refused, by name, and left as it is."""
    refused = staging_refusal(output_dir)
    if refused:
        raise OutputDirError(refused)
    staging = Path(output_dir) / STAGING
    if staging.is_symlink() or staging.is_file():
        staging.unlink()
    elif staging.is_dir():
        for entry in staging.iterdir():
            shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
        staging.rmdir()


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
