"""Knowledge distillation (train.distill) through the real CLI, with tiny teachers trained by the toolkit here.

The teacher that proves the loss is used is a WRONG one: trained on the colour images with every class folder
renamed (red images called green, green called blue, blue called red), so it agrees with the dataset's label names
but never with its labels. A student that follows it cannot be told apart from one that ignores it by "the run
finished": only by what it predicts.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from pathlib import Path

import pytest
import torch

from runs import (RECIPE, TRAIN_IMAGES, SimulatedKill, assert_bit_identical, history, kill_at, losses, train,
                  weights)
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


def test_soft_targets_pull_the_student_towards_the_teacher(args, base, wrong_teacher, student_without_teacher,
                                                          tmp_path, capsys):
    out = tmp_path / "out"
    assert train([*args, "model.image_size=16", f"train.distill.teacher={wrong_teacher}", "train.distill.weight=1.0",
                  "train.distill.mode=soft", "train.distill.temperature=2", f"output_dir={out}"]) == 0
    assert metrics(out)["accuracy"] < metrics(student_without_teacher)["accuracy"] - 0.5
    # The console says who taught, how, which student it taught and at what cost, as metrics.json does
    said = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("train.distill: "))
    facts = metrics(out)["distillation"]
    assert said == f"train.distill: taught by the teacher {wrong_teacher} (soft distillation, weight 1.0, " \
                   f"temperature 2.0); the student: 2 blocks, fine-tuned from {base}; the teacher's forwards " \
                   f"took {facts['teacher_seconds']} s of the {facts['training_seconds']} s of training " \
                   f"({facts['teacher_share']:.0%})"


def test_the_teacher_sees_the_students_batch_at_its_own_size_and_normalisation():
    """Teacher.pixels: the student's rescaled batch (0-1) resized to the teacher's processor size and normalised
    with the teacher's mean/std, whatever the student's were."""
    from transformers import ViTConfig, ViTForImageClassification, ViTImageProcessorPil

    from vit_finetune.training.distill import Teacher

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

    import vit_finetune.model.loading

    out = tmp_path / "out"
    code = train([f"model.base={base}", f"data.dataset={four_classes}", *RECIPE, f"output_dir={out}",
                  f"train.distill.teacher={wrong_teacher}"], patches=[(vit_finetune.model.loading, "build_model", never)])
    error = capsys.readouterr().err
    assert code == 2, error
    assert "['blue', 'green', 'red']" in error and "['blue', 'green', 'red', 'yellow']" in error
    assert "Fix:" in error and "train.distill" in error
    assert not (out / "model.safetensors").exists() and not (out / "recipe.yaml").exists()


def test_a_missing_teacher_is_refused_before_output_dir_is_touched(args, tmp_path, capsys):
    out = tmp_path / "out"
    code = train([*args, f"output_dir={out}", f"train.distill.teacher={tmp_path / 'no-such-teacher'}"])
    error = capsys.readouterr().err
    assert code == 2, error[-2000:]
    assert "train.distill.teacher=" in error and "folder not found" in error
    assert "Traceback" not in error
    assert not out.exists()


def test_distillation_keys_are_validated_together(args, tmp_path):
    result = run_cli(*args, f"output_dir={tmp_path / 'out'}", "train.distill.weight=1.5",
                     "train.distill.temperature=0", "train.distill.mode=medium")
    assert result.returncode == 2
    for problem in ("train.distill.weight=1.5", "train.distill.temperature=0", "train.distill.mode='medium'",
                    "train.distill.teacher is required"):
        assert problem in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "out").exists()


def test_multi_label_runs_refuse_distillation(base, wrong_teacher, tmp_path, capsys):
    explicit = train([f"model.base={base}", f"data.dataset={tmp_path}", "data.task=multi_label",
                      f"train.distill.teacher={wrong_teacher}", f"output_dir={tmp_path / 'a'}"])
    error = capsys.readouterr().err
    assert explicit == 2 and "single-label" in error, error[-2000:]
    # Detected from a label file whose cells hold several labels: refused once the data says so, before training.
    labels = write_label_sets(tmp_path / "sets", images=12, classes=3)
    detected = train([f"model.base={base}", f"data.dataset={labels}", *RECIPE, f"output_dir={tmp_path / 'b'}",
                      f"train.distill.teacher={wrong_teacher}"])
    error = capsys.readouterr().err
    assert detected != 0 and "single-label" in error, error[-2000:]
    assert "Traceback" not in error
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
    capsys.readouterr()
    changed = train([*run, "train.resume=auto", "train.distill.weight=0.25"])
    error = capsys.readouterr().err
    assert changed != 0 and "train.distill.weight" in error, error[-2000:]

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
def test_two_processes_each_with_its_own_teacher_follow_it(args, wrong_teacher, warm_launcher, tmp_path):
    """2 CPU processes (gloo; torchrun's environment, forked by the session's warm launcher: conftest.warm_launcher):
    each rank loads the teacher and labels its own share of every batch."""
    out = tmp_path / "out"
    result = warm_launcher.run([*args, "model.image_size=16", "train.epochs=4",
                                f"train.distill.teacher={wrong_teacher}", "train.distill.weight=1.0",
                                f"output_dir={out}"],
                               {}, tmp_path / "two.log")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "2 process(es)" in result.stdout
    assert metrics(out)["accuracy"] <= 1 / 9
    confusion, labels = metrics(out)["confusion_matrix"], metrics(out)["confusion_matrix_labels"]
    for row, name in zip(confusion, labels):
        assert max(range(len(row)), key=row.__getitem__) == labels.index(DERANGEMENT[name])


def test_a_teacher_given_as_a_hub_id_is_fetched_and_followed(args, wrong_teacher, hub, hub_token, hub_repo_id,
                                                             tmp_path, monkeypatch):
    """The loopback Hub (tests/hub_server/) serves the teacher run pushed there."""
    from vit_finetune.artifacts.publish import push_folder

    monkeypatch.setenv("HF_TOKEN", hub_token)
    push_folder(wrong_teacher, hub_repo_id)
    out = tmp_path / "out"
    assert train([*args, "model.image_size=16", f"train.distill.teacher={hub_repo_id}", "train.distill.weight=1.0",
                  f"output_dir={out}"]) == 0
    assert metrics(out)["accuracy"] <= 1 / 9


# ---------------------------------------------------------------- train.distill.cache_logits


@pytest.fixture(scope="module")
def distilled(base, images, wrong_teacher) -> list[str]:
    """Soft targets, so every value of the teacher's rows matters, not only its top class. The images are 40 x 48 px:
    not square, which no crop must leave whole, the same every epoch."""
    # No flip: the runs with train.distill.cache_logits=true (whose pixels stay fixed) are compared with those without.
    return [f"model.base={base}", f"data.dataset={images}", *RECIPE, "model.image_size=16", "data.horizontal_flip=false",
            f"train.distill.teacher={wrong_teacher}", "train.distill.mode=soft", "train.distill.temperature=2"]


class TeacherCalls:
    """Counts calls of Teacher.logits (patched in for a run), and what a run's parts were."""

    def __init__(self):
        from vit_finetune.artifacts.callbacks import Callback
        from vit_finetune.training.distill import Teacher

        self.calls, self.at_batches, self.parts, self.seconds = 0, [], None, 0.0
        original = Teacher.logits
        counter = self

        def counted(teacher, rescaled):
            counter.calls += 1
            started = time.perf_counter()
            try:
                return original(teacher, rescaled)
            finally:
                counter.seconds += time.perf_counter() - started

        self.patch = (Teacher, "logits", counted)

        class Watch(Callback):
            def on_train_start(self, run):
                counter.parts = run.parts

            def on_batch(self, run, batch):
                counter.at_batches.append(counter.calls)

        self.callback = Watch()


def counted_run(args: list[str], out: Path) -> TeacherCalls:
    calls = TeacherCalls()
    assert train([*args, f"output_dir={out}"], patches=[calls.patch], callbacks=[calls.callback]) == 0
    return calls


@pytest.fixture(scope="module")
def online_run(distilled, tmp_path_factory) -> tuple[Path, TeacherCalls]:
    out = tmp_path_factory.mktemp("online") / "out"
    return out, counted_run(distilled, out)


@pytest.fixture(scope="module")
def cached_run(distilled, tmp_path_factory) -> tuple[Path, TeacherCalls]:
    out = tmp_path_factory.mktemp("cached") / "out"
    return out, counted_run([*distilled, "train.distill.cache_logits=true"], out)


def test_cached_teacher_logits_train_the_same_student_as_the_online_teacher(online_run, cached_run):
    (online, _), (cached, _) = online_run, cached_run
    online_weights, cached_weights = weights(online / "model.safetensors"), weights(cached / "model.safetensors")
    assert online_weights.keys() == cached_weights.keys()
    # A key's bias adds the same score to every key of a query, which the softmax cancels: its true gradient is zero,
    # so AdamW moves it only by rounding, scaled up by the lr over its epsilon: noise of the order of 1e-6 that differs
    # between two runs whose teachers round alike only to 1e-5 (the losses below).
    trained = [name for name in online_weights if not name.endswith("attention.key.bias")]
    assert len(trained) > len(online_weights) / 2
    for name in trained:
        assert torch.allclose(online_weights[name], cached_weights[name], rtol=1e-4, atol=1e-6), name
    assert [step for step, _ in losses(cached)] == [step for step, _ in losses(online)] == list(range(1, 13))
    assert [loss for _, loss in losses(cached)] == pytest.approx([loss for _, loss in losses(online)], rel=1e-5)


def test_the_cached_rows_are_the_online_teachers_logits_of_the_same_images(cached_run):
    """Looked up in a shuffled order: a lookup that returned rows by position, or another image's, would fail."""
    from vit_finetune.training.distill import pixel_digest

    parts = cached_run[1].parts
    images = parts.train_loader.dataset
    order = torch.randperm(len(images), generator=torch.Generator().manual_seed(0)).tolist()
    pixels = torch.stack([images[(index, 3)][0] for index in order])  # any epoch: the pixels never change
    online = parts.teacher.logits(parts.normalize.rescale(pixels))
    cached = parts.teacher_cache.rows([pixel_digest(image) for image in pixels], torch.device("cpu"))
    assert cached.shape == (len(images), 3) and cached.dtype == torch.float32
    # Each image's row is its own: nearer its online logits than any other image's, by a wide margin.
    distance = (cached[:, None, :] - online[None, :, :]).abs().amax(dim=-1)  # [cached row, online row]
    own = distance.diagonal()
    others = distance + torch.eye(len(images)) * 1e9
    assert own.max() < 1e-6 and others.min() > 1e-5
    assert len(parts.teacher_cache.row_of) == len(images)


def test_the_cached_run_calls_the_teacher_only_before_training(online_run, cached_run):
    online_calls, cached_calls = online_run[1], cached_run[1]
    assert online_calls.calls == len(online_calls.at_batches) == 12  # the counter sees one call per batch
    prepass = math.ceil(TRAIN_IMAGES / 4)  # the whole split, train.batch_size at a time
    assert cached_calls.at_batches == [prepass] * 12 and cached_calls.calls == prepass


def test_a_distilled_run_records_its_teacher_and_what_the_teacher_cost(online_run, cached_run, wrong_teacher):
    for (out, calls), cached in ((online_run, False), (cached_run, True)):
        facts = metrics(out)["distillation"]
        assert {key: facts[key] for key in ("teacher", "mode", "weight", "temperature", "cache_logits")} == {
            "teacher": str(wrong_teacher), "mode": "soft", "weight": 0.5, "temperature": 2.0, "cache_logits": cached}
        assert facts["training_seconds"] == json.loads((out / "run_info.json").read_text())["training_seconds"]
        card = (out / "README.md").read_text()
        assert f"taught by the teacher `{wrong_teacher}` (soft distillation, weight 0.5, temperature 2.0)" in card
        if cached:  # the teacher ran only in the pre-pass, timed apart from training
            assert facts["teacher_seconds"] == 0 and facts["labelling_seconds"] >= calls.seconds - 0.01
            assert "labelled the training images once before training" in card
        else:  # each forward timed: what a stopwatch around the teacher's calls measured, to rounding
            assert 0 < facts["teacher_seconds"] < facts["training_seconds"]
            assert facts["teacher_seconds"] == pytest.approx(calls.seconds, rel=0.2, abs=0.01)
            # The share is of the unrounded times; metrics.json rounds training_seconds to 0.1 s and teacher_seconds
            # to 1 ms (a few ms of teacher on a short run: that rounding alone moves the ratio by a few percent).
            low = (facts["teacher_seconds"] - 0.0005) / (facts["training_seconds"] + 0.05)
            high = (facts["teacher_seconds"] + 0.0005) / max(facts["training_seconds"] - 0.05, 1e-9)
            assert low - 0.001 <= facts["teacher_share"] <= high + 0.001


def test_a_killed_and_resumed_cached_run_equals_the_uninterrupted_one(distilled, cached_run, tmp_path, capsys):
    reference = cached_run[0]
    out = tmp_path / "out"
    run = [*distilled, "train.distill.cache_logits=true", f"output_dir={out}", "train.checkpoint_every_steps=4"]
    with pytest.raises(SimulatedKill):
        train(run, callbacks=[kill_at(8)])
    capsys.readouterr()
    assert train([*run, "train.resume=auto"]) == 0
    assert "the teacher labelled the 24 training images once" in capsys.readouterr().out
    assert history(out) == history(reference)
    assert_bit_identical(out / "model.safetensors", reference / "model.safetensors")


def test_cache_logits_with_pixels_that_change_is_refused_before_anything_loads(distilled, tmp_path):
    out = tmp_path / "out"
    result = run_cli(*distilled, f"output_dir={out}", "train.distill.cache_logits=true", "data.crop_scale=[0.5, 1]",
                     "augment.mixup=true", "data.streaming=true")
    assert result.returncode == 2, result.stderr[-2000:]
    pixels, stream = result.stderr.split("train.distill.cache_logits=true")[1:3]
    assert "data.crop_scale=[0.5, 1.0], augment.mixup=true draw(s) them anew" in pixels
    assert "train.distill.cache_logits=false" in pixels
    assert "data.streaming=true" in stream and "train.distill.cache_logits=false" in stream
    assert "Traceback" not in result.stderr and not out.exists()
    # data.crop_scale=auto is let through as fixed because it never crops, at any run length.
    from vit_finetune.data import auto_crop_scale

    assert {auto_crop_scale(images)[0] for images in (1, 7_040, 10**9)} == {(1.0, 1.0)}


def test_a_training_image_the_teacher_never_labelled_stops_the_run_with_the_fix():
    from vit_finetune.training.distill import DistillError, TeacherLogitsCache, pixel_digest

    labelled, unseen = torch.zeros(3, 4, 4, dtype=torch.uint8), torch.ones(3, 4, 4, dtype=torch.uint8)
    cache = TeacherLogitsCache([pixel_digest(labelled)], torch.tensor([[1.0, 2.0]]))
    assert cache.rows([pixel_digest(labelled.clone())] * 2, torch.device("cpu")).tolist() == [[1.0, 2.0]] * 2
    with pytest.raises(DistillError, match="1 image.* never labelled.*train.distill.cache_logits=false"):
        cache.rows([pixel_digest(labelled), pixel_digest(unseen)], torch.device("cpu"))


def test_a_distillation_checkpoint_from_before_cache_logits_existed_resumes(distilled, online_run, tmp_path):
    """Its recipe.yaml has no train.distill.cache_logits: the key ran as its default, false, and is no change."""
    import yaml

    out = tmp_path / "out"
    run = [*distilled, f"output_dir={out}", "train.checkpoint_every_steps=4"]
    with pytest.raises(SimulatedKill):
        train(run, callbacks=[kill_at(5)])
    saved = out / "checkpoints" / "step-00000004" / "recipe.yaml"
    older = yaml.safe_load(saved.read_text())
    del older["train"]["distill"]["cache_logits"]
    saved.write_text(yaml.safe_dump(older, sort_keys=False))
    from vit_finetune.artifacts.checkpoint import changed_keys
    from vit_finetune.recipe import load_recipe

    # A section that was off is still a change when switched on, even with all its keys at their defaults.
    assert changed_keys(saved.parent, load_recipe(None, [*run, "model.lora={}"])) != []
    assert train([*run, "train.resume=auto"]) == 0
    assert history(out) == history(online_run[0])
    assert_bit_identical(out / "model.safetensors", online_run[0] / "model.safetensors")
