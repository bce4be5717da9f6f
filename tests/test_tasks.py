"""The task seam: every task is one module (vit_finetune/tasks) and a registry entry, and nothing outside the task
modules asks which task a model is, by its name or by the shape of its labels; the model's image size is asked of its
family, one way."""

from __future__ import annotations

import json
import re
from pathlib import Path

from runs import train
from tiny import REPO, make_tiny_family, write_colour_folder
from vit_finetune import tasks
from vit_finetune.cli import main

# What only a task (or the multi-label helper module it uses) may read: which task a model is.
TASK_TESTS = re.compile(r"problem_type|multi_label|\"regression\"")
# The same question asked of the labels' shape: class ids are (B,), label sets (B, C), so a test of the number of
# dimensions of labels or targets (`labels.dim() == 2`, `batch["labels"].ndim`, `len(targets.shape)`) tells them apart.
LABELS = r"(?:label|target)\w*(?:[\"']\])?(?:\[[^\]]*\])*"  # labels, batch["labels"], targets[kept], label_rows[:, 0]
SHAPE_TESTS = re.compile(rf"{LABELS}\.(?:dim\(\)|ndim\b)|len\([^()]*?{LABELS}\.shape\)")
# And asked by the task's name: `task.name != "single_label"`, or a name kept aside to compare with (`SingleLabel.name`).
NAME_TESTS = re.compile(r"task\w*\.name\s*(?:[!=]=|(?:not\s+)?in\b)|\b(?:SingleLabel|MultiLabel|Regression)\.name\b")
# The modules that choose the task, besides the tasks themselves: data.task in the recipe (recipe/schema.py, and its
# rules in checks.py) and, where it says auto, the loaders that find it in the data (a label file's cells, a dataset's
# or a stream's label column: data/labels.py, opening.py, splits.py, streaming.py). The rest of data/ and recipe/ is
# not exempt.
CHOOSERS = {"labels.py", "opening.py", "splits.py", "streaming.py", "schema.py", "checks.py"}


def questions_of_the_task(text: str) -> list[str]:
    return sorted({match.group() for pattern in (TASK_TESTS, SHAPE_TESTS, NAME_TESTS) for match in pattern.finditer(text)})


def test_no_module_outside_the_tasks_asks_which_task_a_model_is():
    package = REPO / "vit_finetune"
    asking = {path.relative_to(package).as_posix(): questions_of_the_task(path.read_text())
              for path in package.rglob("*.py") if path.parent.name != "tasks" and path.name not in CHOOSERS}
    assert {path: found for path, found in asking.items() if found} == {}


def test_the_scan_knows_a_shape_test_of_labels_from_other_shapes():
    asked = ["label_sets = labels.dim() == 2", "if targets.dim() == 1:", 'batch["labels"].ndim > 1',
             "len(targets[kept].shape) == 2", "rows = label_rows[:, 0].dim()", "if task.name != STUDENT:",
             "STUDENT_TASK = tasks.SingleLabel.name", "if parts.task.name in ('regression',):"]
    assert all(questions_of_the_task(line) for line in asked)
    not_asked = ["table = position_embeddings if position_embeddings.dim() == 3 else x", "values.ndim == 3",
                 "targets = labels.float()", "label_smoothing / num_classes", "len(labels)",
                 'f"{task.name} run"', "data.task = task.name"]
    assert not any(questions_of_the_task(line) for line in not_asked)


def test_every_task_is_registered_by_its_name_and_read_back_from_its_problem_type():
    from transformers import ViTConfig

    assert set(tasks.TASKS) == {"single_label", "multi_label", "regression"}
    for name, task in tasks.TASKS.items():
        config = ViTConfig(num_labels=2, problem_type=task.problem_type, target_mean=[1.0, 2.0], target_std=[3.0, 4.0])
        assert tasks.of_config(config).name == name
    regression = tasks.of_config(ViTConfig(num_labels=2, problem_type="regression", target_mean=[1.0, 2.0],
                                           target_std=[3.0, 4.0]))
    assert regression.mean.tolist() == [1.0, 2.0] and regression.std.tolist() == [3.0, 4.0]


def test_evaluating_a_clip_run_with_a_skipped_image_uses_a_placeholder_of_the_models_size(tmp_path, capsys):
    """CLIP keeps its image size under vision_config: a skipped image's blank must still match the other pixels."""
    images = write_colour_folder(tmp_path / "images", train=8, validation=4)
    (images / "validation" / "red" / "broken.png").write_bytes(b"not an image")
    base = make_tiny_family("clip", tmp_path / "clip", image_size=32)
    out = tmp_path / "out"
    assert train([f"model.base={base}", "model.image_size=32", f"data.dataset={images}", f"output_dir={out}",
                  "data.skip_bad_images=true", "train.epochs=1", "train.batch_size=8", "data.num_workers=0",
                  "pictures=false"]) == 0
    saved = json.loads((out / "metrics.json").read_text())
    assert saved["eval_skipped_images"] == 1
    assert main(["evaluate", str(out), "--output-dir", str(tmp_path / "eval")]) == 0, capsys.readouterr().err[-2000:]
    again = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert again["eval_skipped_images"] == 1 and again["accuracy"] == saved["accuracy"]
