"""Knowledge distillation (train.distill) through the real CLI, with tiny teachers trained by the toolkit here.

The teacher that proves the loss is used is a WRONG one: trained on the colour images with every class folder
renamed (red images called green, green called blue, blue called red), so it agrees with the dataset's label names
but never with its labels. A student that follows it cannot be told apart from one that ignores it by "the run
finished": only by what it predicts.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from runs import RECIPE, assert_bit_identical, history, kill_at, train, SimulatedKill
from tiny import make_tiny_family, run_cli, write_colour_folder, write_label_sets

pytestmark = pytest.mark.slow

DERANGEMENT = {"red": "green", "green": "blue", "blue": "red"}  # no class keeps its name


def metrics(output: Path) -> dict:
    return json.loads((output / "metrics.json").read_text())


@pytest.fixture(scope="module")
def wrong_teacher(base, images, tmp_path_factory) -> Path:
    """A toolkit run at 32 px that learned the colours under permuted names: perfect on its own data, always wrong
    on the real labels."""
    renamed = tmp_path_factory.mktemp("renamed")
    for split in ("train", "validation"):
        for name, wrong_name in DERANGEMENT.items():
            shutil.copytree(images / split / name, renamed / split / wrong_name)
    out = tmp_path_factory.mktemp("wrong-teacher") / "out"
    assert train([f"model.base={base}", f"data.dataset={renamed}", *RECIPE, f"output_dir={out}"]) == 0
    assert metrics(out)["accuracy"] == 1.0  # it did learn its (renamed) colours
    return out


@pytest.fixture(scope="module")
def student_without_teacher(args, tmp_path_factory) -> Path:
    """The control: the student's recipe (16 px) without distillation."""
    out = tmp_path_factory.mktemp("alone") / "out"
    assert train([*args, "model.image_size=16", f"output_dir={out}"]) == 0
    return out


def test_a_student_with_weight_one_and_hard_targets_follows_the_teacher_not_the_labels(
        args, wrong_teacher, student_without_teacher, tmp_path):
    """At 16 px, half the teacher's 32 px: the teacher sees the student's batches resampled to its own size."""
    out = tmp_path / "out"
    assert train([*args, "model.image_size=16", f"train.distill.teacher={wrong_teacher}", "train.distill.weight=1.0",
                  "train.distill.mode=hard", f"output_dir={out}"]) == 0
    assert metrics(student_without_teacher)["accuracy"] >= 2 / 3  # the labels alone teach the colours
    assert metrics(out)["accuracy"] <= 1 / 9  # it learned the teacher's names for the colours instead
    # Rows: true class. The student's answer for each colour is the teacher's name for it.
    confusion, labels = metrics(out)["confusion_matrix"], metrics(out)["confusion_matrix_labels"]
    for row, name in zip(confusion, labels):
        assert max(range(len(row)), key=row.__getitem__) == labels.index(DERANGEMENT[name])


def test_soft_targets_pull_the_student_towards_the_teacher(args, wrong_teacher, student_without_teacher, tmp_path):
    out = tmp_path / "out"
    assert train([*args, "model.image_size=16", f"train.distill.teacher={wrong_teacher}", "train.distill.weight=1.0",
                  "train.distill.mode=soft", "train.distill.temperature=2", f"output_dir={out}"]) == 0
    assert metrics(out)["accuracy"] < metrics(student_without_teacher)["accuracy"] - 0.5


def test_the_teacher_sees_the_students_batch_at_its_own_size_and_normalisation():
    """Teacher.pixels: the student's rescaled batch (0-1) resized to the teacher's processor size and normalised
    with the teacher's mean/std, whatever the student's were."""
    from transformers import ViTConfig, ViTForImageClassification, ViTImageProcessorPil

    from vit_finetune.distill import Teacher

    model = ViTForImageClassification(ViTConfig(hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                                                intermediate_size=8, image_size=24, patch_size=4, num_labels=3))
    processor = ViTImageProcessorPil(size={"height": 24, "width": 24}, image_mean=[0.2, 0.4, 0.6],
                                     image_std=[0.1, 0.2, 0.3])
    teacher = Teacher(model, processor, student_scale=1 / 255, device=torch.device("cpu"))
    batch = torch.full((2, 3, 12, 12), 0.5)  # a mid-grey student batch at 12 px
    pixels = teacher.pixels(batch)
    assert pixels.shape == (2, 3, 24, 24)
    expected = torch.tensor([(0.5 - 0.2) / 0.1, (0.5 - 0.4) / 0.2, (0.5 - 0.6) / 0.3]).view(1, 3, 1, 1)
    assert torch.allclose(pixels, expected.expand_as(pixels), atol=1e-5)
    assert not any(p.requires_grad for p in teacher.model.parameters()) and not teacher.model.training


def test_a_teacher_with_other_labels_is_refused_before_the_student_is_built(base, wrong_teacher, tmp_path, capsys):
    four_classes = write_colour_folder(tmp_path / "four", classes=4, train=4, validation=2)

    def never(*args, **kwargs):
        raise AssertionError("the student model was built before the labels were compared")

    import vit_finetune.model

    out = tmp_path / "out"
    code = train([f"model.base={base}", f"data.dataset={four_classes}", *RECIPE, f"output_dir={out}",
                  f"train.distill.teacher={wrong_teacher}"], patches=[(vit_finetune.model, "build_model", never)])
    error = capsys.readouterr().err
    assert code == 2, error
    assert "['blue', 'green', 'red']" in error and "['blue', 'green', 'red', 'yellow']" in error
    assert "Fix:" in error and "train.distill" in error
    assert not (out / "model.safetensors").exists() and not (out / "recipe.yaml").exists()


def test_a_missing_teacher_is_refused_before_output_dir_is_touched(args, tmp_path):
    out = tmp_path / "out"
    result = run_cli(*args, f"output_dir={out}", f"train.distill.teacher={tmp_path / 'no-such-teacher'}")
    assert result.returncode == 2, result.stderr[-2000:]
    assert "train.distill.teacher=" in result.stderr and "folder not found" in result.stderr
    assert "Traceback" not in result.stderr
    assert not out.exists()


def test_distillation_keys_are_validated_together(args, tmp_path):
    result = run_cli(*args, f"output_dir={tmp_path / 'out'}", "train.distill.weight=1.5",
                     "train.distill.temperature=0", "train.distill.mode=medium")
    assert result.returncode == 2
    for problem in ("train.distill.weight=1.5", "train.distill.temperature=0", "train.distill.mode='medium'",
                    "train.distill.teacher is required"):
        assert problem in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "out").exists()


def test_multi_label_runs_refuse_distillation(base, wrong_teacher, tmp_path):
    explicit = run_cli(f"model.base={base}", f"data.dataset={tmp_path}", "data.multi_label=true",
                       f"train.distill.teacher={wrong_teacher}", f"output_dir={tmp_path / 'a'}")
    assert explicit.returncode == 2 and "single-label" in explicit.stderr, explicit.stderr[-2000:]
    # Detected from a label file whose cells hold several labels: refused once the data says so, before training.
    labels = write_label_sets(tmp_path / "sets", images=12, classes=3)
    detected = run_cli(f"model.base={base}", f"data.dataset={labels}", *RECIPE, f"output_dir={tmp_path / 'b'}",
                       f"train.distill.teacher={wrong_teacher}")
    assert detected.returncode != 0 and "single-label" in detected.stderr, detected.stderr[-2000:]
    assert "Traceback" not in detected.stderr
    assert not (tmp_path / "b" / "model.safetensors").exists()


@pytest.fixture(scope="module")
def deit_student(images, wrong_teacher, tmp_path_factory) -> Path:
    """A DeiT student with its distillation token, weight 0.5: the class head learns the labels, the distillation
    head the wrong teacher."""
    folder = tmp_path_factory.mktemp("deit")
    deit = make_tiny_family("deit", folder / "base")
    out = folder / "out"
    assert train([f"model.base={deit}", f"data.dataset={images}", *RECIPE, "model.image_size=16", "train.epochs=4",
                  f"train.distill.teacher={wrong_teacher}", "train.distill.weight=0.5", f"output_dir={out}"]) == 0
    return out


def test_a_deit_student_trains_its_class_head_on_the_labels_and_its_distillation_head_on_the_teacher(
        deit_student, images):
    from transformers import AutoImageProcessor, DeiTForImageClassificationWithTeacher
    from PIL import Image

    model = DeiTForImageClassificationWithTeacher.from_pretrained(deit_student).eval()
    processor = AutoImageProcessor.from_pretrained(deit_student)
    names = [model.config.id2label[i] for i in range(model.config.num_labels)]
    files = sorted((images / "validation").glob("*/*.png"))
    truth = [path.parent.name for path in files]
    with torch.no_grad():
        output = model(**processor([Image.open(path).convert("RGB") for path in files], return_tensors="pt"))
    by_class_head = [names[i] for i in output.cls_logits.argmax(-1)]
    by_distillation_head = [names[i] for i in output.distillation_logits.argmax(-1)]
    assert sum(a == b for a, b in zip(by_class_head, truth)) >= 2 / 3 * len(files)
    assert sum(a == DERANGEMENT[b] for a, b in zip(by_distillation_head, truth)) >= 2 / 3 * len(files)
    assert torch.allclose(output.logits, (output.cls_logits + output.distillation_logits) / 2)


def test_the_saved_deit_student_runs_in_a_plain_pipeline_with_both_heads(deit_student, images):
    from PIL import Image
    from transformers import pipeline

    assert json.loads((deit_student / "config.json").read_text())["architectures"] == [
        "DeiTForImageClassificationWithTeacher"]
    classify = pipeline("image-classification", model=str(deit_student))
    assert type(classify.model).__name__ == "DeiTForImageClassificationWithTeacher"
    image = Image.open(sorted((images / "validation" / "red").glob("*.png"))[0]).convert("RGB")
    scores = {row["label"]: row["score"] for row in classify(image, top_k=3)}
    with torch.no_grad():
        output = classify.model(**classify.image_processor(image, return_tensors="pt"))
    averaged = torch.softmax((output.cls_logits + output.distillation_logits)[0] / 2, -1)
    for index, label in classify.model.config.id2label.items():
        assert scores[label] == pytest.approx(averaged[index].item(), abs=1e-5)


def test_a_lora_deit_student_keeps_both_heads_in_its_adapter(images, wrong_teacher, tmp_path):
    deit = make_tiny_family("deit", tmp_path / "base")
    out = tmp_path / "out"
    assert train([f"model.base={deit}", f"data.dataset={images}", *RECIPE, "model.image_size=16",
                  "model.lora={r: 2}", "train.max_steps=2", f"train.distill.teacher={wrong_teacher}",
                  f"output_dir={out}"]) == 0
    adapter_config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert sorted(adapter_config["modules_to_save"]) == ["cls_classifier", "distillation_classifier"]
    from safetensors.torch import load_file

    saved = load_file(str(out / "adapter" / "adapter_model.safetensors"))
    for head in ("cls_classifier", "distillation_classifier"):
        assert any(f"{head}.modules_to_save" in key or f"{head}.weight" in key for key in saved), sorted(saved)[:20]


def test_a_killed_and_resumed_distillation_run_equals_the_uninterrupted_one(args, wrong_teacher, tmp_path, capsys):
    """Mixup on too: the teacher sees the same mixed images after the resume. It is not in the checkpoint, but its
    weights' digest is: a teacher retrained in place (same folder, so the same recipe) is refused."""
    from safetensors.torch import load_file, save_file

    teacher = shutil.copytree(wrong_teacher, tmp_path / "teacher")
    options = ["model.image_size=16", f"train.distill.teacher={teacher}", "train.distill.mode=soft",
               "train.distill.temperature=2", "augment.mixup=true"]
    reference = tmp_path / "reference"
    assert train([*args, *options, f"output_dir={reference}"]) == 0
    out = tmp_path / "out"
    run = [*args, *options, f"output_dir={out}", "train.checkpoint_every_steps=4"]
    with pytest.raises(SimulatedKill):
        train(run, callbacks=[kill_at(8)])
    checkpoint = out / "checkpoints" / "step-00000004"
    assert not any("teacher" in path.name for path in checkpoint.rglob("*"))
    changed = run_cli(*run, "train.resume=auto", "train.distill.weight=0.25")
    assert changed.returncode != 0 and "train.distill.weight" in changed.stderr, changed.stderr[-2000:]

    weights_file = teacher / "model.safetensors"
    original = weights_file.read_bytes()
    retrained = {name: tensor + 0.01 for name, tensor in load_file(weights_file).items()}
    save_file(retrained, weights_file, metadata={"format": "pt"})
    capsys.readouterr()
    assert train([*run, "train.resume=auto"]) != 0
    assert "the teacher's weights (train.distill.teacher) changed" in capsys.readouterr().err
    assert (out / "checkpoints" / "step-00000004").is_dir() and not (out / "model.safetensors").exists()
    weights_file.write_bytes(original)
    assert train([*run, "train.resume=auto"]) == 0
    assert history(out) == history(reference)
    assert_bit_identical(out / "model.safetensors", reference / "model.safetensors")


@pytest.mark.timeout(600)
def test_two_processes_each_with_its_own_teacher_follow_it(args, wrong_teacher, tmp_path):
    """torchrun, 2 CPU processes (gloo): each rank loads the teacher and labels its own share of every batch."""
    import os
    import subprocess
    import sys

    from runs import torchrun_command
    from tiny import REPO

    out = tmp_path / "out"
    result = subprocess.run(
        [*torchrun_command(), "-m", "vit_finetune", *args, "model.image_size=16", "train.epochs=4",
         f"train.distill.teacher={wrong_teacher}", "train.distill.weight=1.0", f"output_dir={out}"],
        capture_output=True, text=True, timeout=500, cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "2 process(es)" in result.stdout
    assert metrics(out)["accuracy"] <= 1 / 9
    confusion, labels = metrics(out)["confusion_matrix"], metrics(out)["confusion_matrix_labels"]
    for row, name in zip(confusion, labels):
        assert max(range(len(row)), key=row.__getitem__) == labels.index(DERANGEMENT[name])


def test_a_teacher_given_as_a_hub_id_is_fetched_and_followed(args, wrong_teacher, hub, hub_token, hub_repo_id,
                                                             tmp_path, monkeypatch):
    """The loopback Hub (tests/hub_server.py) serves the teacher run pushed there."""
    from vit_finetune.hub import push_folder

    monkeypatch.setenv("HF_TOKEN", hub_token)
    push_folder(wrong_teacher, hub_repo_id)
    out = tmp_path / "out"
    assert train([*args, "model.image_size=16", f"train.distill.teacher={hub_repo_id}", "train.distill.weight=1.0",
                  f"output_dir={out}"]) == 0
    assert metrics(out)["accuracy"] <= 1 / 9
