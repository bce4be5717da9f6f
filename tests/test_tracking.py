"""train.report_to: what TensorBoard's event files hold, read back, equals history.json; a tracker whose package
is missing is refused before anything loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from runs import train


def event_folders(root: Path) -> list[Path]:
    return sorted({path.parent for path in root.rglob("events.out.tfevents.*")})


def read_scalars_and_images(folder: Path) -> tuple[dict[str, list[tuple[int, float]]], set[str]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={"scalars": 0, "images": 0})
    events.Reload()
    scalars = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    return scalars, set(events.Tags()["images"])


@pytest.mark.slow
def test_tensorboard_holds_what_history_json_holds(args, tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard is a dev dependency (pip install -e '.[dev]')")
    output = tmp_path / "run"
    assert train([*args, f"output_dir={output}", "train.report_to=[tensorboard]", "train.eval_every_steps=4",
                  "train.log_every_steps=2", "pictures=true"]) == 0
    history = json.loads((output / "history.json").read_text())
    scalars, images = {}, set()
    for folder in event_folders(output / "runs"):  # the run's folder, and the sub-folder add_hparams writes
        folder_scalars, folder_images = read_scalars_and_images(folder)
        scalars.update(folder_scalars)
        images |= folder_images

    def logged(key: str) -> list[tuple[int, float]]:
        return [(entry["step"], pytest.approx(entry[key], rel=1e-6)) for entry in history if key in entry]

    assert scalars["train/loss"] == logged("loss") and len(scalars["train/loss"]) == 6  # 12 steps, every 2
    assert scalars["train/lr"] == logged("lr")
    assert scalars["train/images_per_s"] == logged("images_per_s")
    # Evaluations at steps 4 and 8 (eval_every_steps), then the final one at step 12.
    assert [step for step, _ in scalars["eval/accuracy"]] == [4, 8, 12]
    assert scalars["eval/accuracy"] == logged("eval_accuracy")
    assert scalars["eval/loss"] == logged("eval_loss")
    # The run is at the base's own size: no position table was resampled, so no picture of one.
    assert "pictures/confusion_matrix" in images and "pictures/position_embeddings" not in images
    stored = yaml.safe_load(next((output / "runs").rglob("hparams.yml")).read_text())
    assert stored["train.lr"] == 0.005 and stored["train.report_to"] == "['tensorboard']"
    assert stored["model.image_size"] == 32


def test_a_tracker_whose_package_is_missing_is_refused_first(args, tmp_path, capsys):
    import importlib.util

    missing = next((name for name in ("wandb", "mlflow", "trackio") if importlib.util.find_spec(name) is None), None)
    if missing is None:
        pytest.skip("wandb, mlflow and trackio are all installed here")
    assert train([*args, f"output_dir={tmp_path / 'run'}", f"train.report_to=[{missing}]"]) == 1
    error = capsys.readouterr().err
    assert f"pip install {missing}" in error and "Traceback" not in error
    assert not (tmp_path / "run").exists()  # refused before anything was loaded or written


def test_an_unknown_tracker_is_a_recipe_error(capsys):
    from vit_finetune.cli import main

    assert main(["--recipe", "demo", "--print", "train.report_to=[tensorbored]"]) == 2
    assert "train.report_to" in capsys.readouterr().err
