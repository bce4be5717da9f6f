"""Follow a run live: train.report_to hands the loop's events to Accelerate's experiment trackers.

    python -m vit_finetune --recipe demo "train.report_to=[tensorboard]"
    tensorboard --logdir outputs/demo/runs

The recipe goes in as hyper-parameters; each log entry as train/loss, train/lr, train/images_per_s at its
step; each evaluation as eval/accuracy, eval/loss, ... at the step it measured; the pictures as images.
Only the main process talks to the trackers (Accelerate's `log` already does nothing elsewhere).
"""

from __future__ import annotations

import importlib.util
import tempfile
from pathlib import Path

import numpy as np

from vit_finetune.artifacts.callbacks import Callback
from vit_finetune.core.errors import VitFinetuneError
from vit_finetune.core.layout import POSITION_FILE, TRACKER_DIR, describe_write_error, record
from vit_finetune.recipe import flatten
from vit_finetune.tasks.pictures import draw_confusion_matrix

# Each tracker: the package it needs (checked before the run starts), how it takes a picture, if it can, and
# whether it writes under output_dir/runs (checked to be writable before training).
TRACKERS = {
    "tensorboard": {"package": "tensorboard", "image": lambda tracker, name, pixels, step: tracker.writer.add_image(
        name, pixels, global_step=step, dataformats="HWC"), "writes_in_output_dir": True},
    "wandb": {"package": "wandb", "image": lambda tracker, name, pixels, step: tracker.log_images(
        {name: [pixels]}, step=step)},
    "mlflow": {"package": "mlflow", "image": lambda tracker, name, pixels, step: __import__("mlflow").log_image(
        pixels, key=name, step=step)},
    "trackio": {"package": "trackio", "image": None},  # Accelerate's trackio tracker logs scalars only
}


class TrackerMissing(VitFinetuneError):
    """train.report_to names a tracker whose package is not installed."""


def check_trackers(names: list[str]) -> None:
    """Before anything loads: every tracker named in train.report_to has its package installed."""
    missing = [name for name in names if importlib.util.find_spec(TRACKERS[name]["package"]) is None]
    if missing:
        packages = " ".join(TRACKERS[name]["package"] for name in missing)
        raise TrackerMissing(f"train.report_to={names} needs {packages!r}, which is not installed. "
                             f"Fix: pip install {packages}, or leave {missing} out of train.report_to")


def tracker_folder_refusal(output_dir: Path, names: list[str]) -> str | None:
    """Why the trackers in `names` could not write their files under output_dir/runs, or None; checked before
    training rather than met at the tracker's first write (a traceback after the data and model loaded)."""

    writers = [name for name in names if TRACKERS[name].get("writes_in_output_dir")]
    folder = Path(output_dir) / TRACKER_DIR
    if not writers:
        return None
    probe = folder / ".vit_finetune_probe"
    try:
        if folder.exists() and not folder.is_dir():
            raise NotADirectoryError(20, "it is a file, not a folder")
        made = not folder.exists()
        folder.mkdir(parents=True, exist_ok=True)
        probe.write_text("")
        probe.unlink()
        if made:  # nothing is left of the probe: the run may yet be refused, and runs/ be taken for the user's
            folder.rmdir()
    except OSError as error:
        return (f"train.report_to={writers} writes into {folder}, which cannot be written "
                f"({describe_write_error(error, Path(output_dir))}). Fix: move or remove what stands there, free "
                f"disk space or make it writable, or leave {writers} out of train.report_to")
    return None


def tracker_log_folder(output_dir: Path | str) -> str:
    """Where Accelerate's file-based trackers write, relative to output_dir: runs/<output folder's name>
    (init_trackers is given that name as the project's)."""
    return f"{TRACKER_DIR}/{Path(output_dir).name}"


def callbacks_for(names: list[str]) -> list[Callback]:
    """The callback that feeds the trackers, when train.report_to names any."""
    return [TrackingCallback(names)] if names else []


def flat_hyperparameters(recipe) -> dict:
    """The resolved recipe as flat key/value pairs a tracker accepts (lists and None as text)."""
    return {key: value if isinstance(value, (int, float, str, bool)) else str(value)
            for key, value in flatten(recipe.model_dump(mode="json")).items()}


def png_pixels(path: Path) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(path).convert("RGB"))


class TrackingCallback(Callback):
    """Sends the loop's events to the trackers Accelerate was created with (log_with=train.report_to)."""

    def __init__(self, names: list[str]):
        self.names = list(names)
        self.last_metrics: dict = {}  # the final evaluation is the last one before on_train_end

    def on_train_start(self, run) -> None:
        recipe, accelerator = run.recipe, run.accelerator
        if accelerator.is_main_process and any(TRACKERS[name].get("writes_in_output_dir") for name in self.names):
            record(recipe.output_dir, [tracker_log_folder(recipe.output_dir)])  # Accelerate writes it in full
        accelerator.init_trackers(Path(recipe.output_dir).name, config=flat_hyperparameters(recipe))
        position = Path(recipe.output_dir) / POSITION_FILE
        if position.is_file():
            self.log_picture(run, "pictures/position_embeddings", png_pixels(position))

    def on_log(self, run, entry: dict) -> None:
        values = {f"train/{key}": value for key, value in entry.items() if key in ("loss", "lr", "images_per_s")}
        run.accelerator.log(values, step=entry["step"])

    def on_evaluate(self, run, metrics: dict) -> None:
        values = {f"eval/{key.removeprefix('eval_')}": value for key, value in metrics.items()
                  if isinstance(value, float)}
        run.accelerator.log(values, step=run.state.step)
        self.last_metrics = metrics

    def on_train_end(self, run, model) -> None:
        matrix, labels = self.last_metrics.get("confusion_matrix"), run.parts.labels
        if matrix is None or not run.accelerator.is_main_process:
            return
        with tempfile.TemporaryDirectory() as folder:
            draw_confusion_matrix(matrix, labels, Path(folder) / "confusion.png")
            self.log_picture(run, "pictures/confusion_matrix", png_pixels(Path(folder) / "confusion.png"))

    def log_picture(self, run, name: str, pixels: np.ndarray) -> None:
        if not run.accelerator.is_main_process:
            return
        for tracker_name in self.names:
            log_image = TRACKERS[tracker_name]["image"]
            if log_image is not None:
                log_image(run.accelerator.get_tracker(tracker_name, unwrap=False), name, pixels, run.state.step)
