"""The real entry point end to end on a tiny ViT and an image folder the test writes, and each bad input."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from runs import train
from tiny import COLOURS, colour_image, write_colour_folder
from vit_finetune.cli import main

TRAIN_ARGS = ["model.image_size=64", "train.epochs=3", "train.batch_size=8", "train.lr=0.005", "train.log_every_steps=2",
              "train.seed=1"]


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    return write_colour_folder(tmp_path_factory.mktemp("colours"), classes=3, train=16, validation=6)


def snapshot(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def trained(base, images, tmp_path_factory) -> Path:
    """A full run at twice the base's resolution, in this process: the entry point is the same `main`, and a fresh
    interpreter would cost more than the run (the first minutes' tests drive `python -m vit_finetune` itself)."""
    output = tmp_path_factory.mktemp("run") / "out"
    assert train([f"model.base={base}", f"data.dataset={images}", f"output_dir={output}", *TRAIN_ARGS]) == 0
    return output


@pytest.mark.slow
def test_training_reaches_an_accuracy_an_untrained_model_cannot(trained, images):
    metrics = json.loads((trained / "metrics.json").read_text())
    assert metrics["eval_samples"] == 18
    assert metrics["accuracy"] >= 0.9  # a zero-initialised head predicts one class: 1/3 here
    assert np.array(metrics["confusion_matrix"]).sum() == 18
    assert {"macro_f1", "eval_loss", "steps"} <= set(metrics) and "top5_accuracy" not in metrics  # 3 classes


@pytest.mark.slow
def test_output_folder_holds_everything_and_reloads_at_the_new_size(trained):
    from transformers import AutoImageProcessor, ViTForImageClassification

    for name in ("model.safetensors", "config.json", "preprocessor_config.json", "recipe.yaml", "metrics.json",
                 "README.md", "training_curves.png"):
        assert (trained / name).is_file(), name
    config = json.loads((trained / "config.json").read_text())
    assert config["image_size"] == 64 and config["id2label"] == {"0": "blue", "1": "green", "2": "red"}
    processor = AutoImageProcessor.from_pretrained(trained)
    assert processor.size == {"height": 64, "width": 64}
    saved_type = json.loads((trained / "preprocessor_config.json").read_text())["image_processor_type"]
    assert saved_type == type(processor).__name__ == "ViTImageProcessorPil"  # the class evaluation used
    model, info = ViTForImageClassification.from_pretrained(trained, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    assert model.vit.embeddings.position_embeddings.shape == (1, 1 + 16 * 16, 32)
    recipe = yaml.safe_load((trained / "recipe.yaml").read_text())
    assert recipe["model"]["image_size"] == 64 and recipe["train"]["lr"] == 0.005
    card = (trained / "README.md").read_text()
    assert "model-index" in card and "accuracy" in card and "training_curves.png" in card
    assert (trained / "training_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_pipeline_users_get_the_reported_accuracy(trained, images):
    from transformers import pipeline

    classify = pipeline("image-classification", model=str(trained), device=-1)
    files = sorted((images / "validation").rglob("*.png"))
    hits = [classify(str(path), top_k=1)[0]["label"] == path.parent.name for path in files]
    reported = json.loads((trained / "metrics.json").read_text())["accuracy"]
    assert np.mean(hits) == pytest.approx(reported, abs=1e-9)


@pytest.mark.slow
def test_predict_prints_ranked_labels(trained, images, tmp_path, capsys):
    red = tmp_path / "red.png"
    colour_image(COLOURS["red"], np.random.default_rng(9)).save(red)
    assert main(["predict", str(trained), str(red)]) == 0, capsys.readouterr().err[-2000:]
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == str(red) and lines[1].split()[1] == "red" and len(lines) == 4  # 3 classes -> top 3
    scores = [float(line.split()[0]) for line in lines[1:]]
    assert scores == sorted(scores, reverse=True) and abs(sum(scores) - 1) < 1e-3


@pytest.mark.slow
def test_lora_run_saves_adapter_and_merged_model_with_equal_logits(base, images, tmp_path):
    from peft import PeftModel
    from transformers import ViTForImageClassification

    from vit_finetune.model.loading import build_model
    from vit_finetune.recipe import ModelSettings

    output = tmp_path / "lora"
    assert train([f"model.base={base}", f"data.dataset={images}", f"output_dir={output}", *TRAIN_ARGS,
                  "train.lr=0.01", "model.lora={r: 4, alpha: 8, dropout: 0.0}"]) == 0
    assert (output / "adapter" / "adapter_model.safetensors").is_file()
    merged = ViTForImageClassification.from_pretrained(output).eval()
    fresh = build_model(ModelSettings(base=str(base), image_size=64), ["blue", "green", "red"])
    adapter = PeftModel.from_pretrained(fresh, output / "adapter").eval()
    pixels = torch.randn(4, 3, 64, 64)
    with torch.no_grad():
        assert (merged(pixels).logits - adapter(pixel_values=pixels).logits).abs().max() <= 1e-5
    assert json.loads((output / "metrics.json").read_text())["accuracy"] >= 0.9


@pytest.mark.slow
def test_skip_bad_images_completes_and_counts(base, images, tmp_path, capsys):
    dirty = tmp_path / "dirty"
    write_colour_folder(dirty, classes=3, train=8, validation=3)
    (dirty / "train" / "red" / "broken.png").write_bytes((dirty / "train" / "red" / "0.png").read_bytes()[:40])
    (dirty / "train" / "blue" / "empty.png").write_bytes(b"")
    assert train([f"model.base={base}", f"data.dataset={dirty}", f"output_dir={tmp_path / 'a'}", *TRAIN_ARGS]) == 1
    error = capsys.readouterr().err
    assert "broken.png" in error or "empty.png" in error
    assert "data.skip_bad_images=true" in error and "Traceback" not in error
    assert not (tmp_path / "a" / "metrics.json").exists()
    assert train([f"model.base={base}", f"data.dataset={dirty}", f"output_dir={tmp_path / 'b'}", *TRAIN_ARGS,
                  "train.epochs=1", "data.skip_bad_images=true"]) == 0, capsys.readouterr().err[-2000:]
    assert json.loads((tmp_path / "b" / "metrics.json").read_text())["skipped_images"] == 2


def test_print_shows_the_resolved_recipe_without_running(capsys, tmp_path):
    assert main(["--recipe", "food101_384", "--print", "train.epochs=1", f"output_dir={tmp_path / 'x'}"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["train"]["epochs"] == 1 and printed["model"]["image_size"] == 384
    assert not (tmp_path / "x").exists()


def test_list_recipes_names_every_shipped_recipe(capsys):
    assert main(["--list-recipes"]) == 0
    names = {line.split()[0] for line in capsys.readouterr().out.splitlines()}
    assert {"demo", "food101_384", "food101_384_lora", "cifar100_384", "oxford_pets_384"} <= names


# ---------------------------------------------------------------- bad input: exit code, message, nothing lost


def fails(capsys, args: list[str], code: int = 1) -> str:
    assert main(args) == code
    stderr = capsys.readouterr().err  # progress bars of datasets may come first
    assert "\nerror: " in "\n" + stderr and "Traceback" not in stderr
    return stderr[stderr.index("error: "):]


def test_unknown_recipe_name(capsys):
    error = fails(capsys, ["--recipe", "food101"], code=2)
    assert "'food101'" in error and "food101_384" in error and "oxford_pets_384" in error


def test_unknown_key_and_wrong_type(capsys):
    error = fails(capsys, ["--recipe", "demo", "train.batchsize=4", "train.epochs=many"], code=2)
    assert "did you mean 'train.batch_size'" in error and "train.epochs='many'" in error


def test_image_size_not_a_multiple_of_the_patch(capsys, base, images, tmp_path):
    error = fails(capsys, [f"model.base={base}", f"data.dataset={images}", f"output_dir={tmp_path}/o",
                           "model.image_size=62"])
    assert "model.image_size=62" in error and "patch size 4" in error and "use 60 or 64" in error
    assert not (tmp_path / "o").exists()


def test_missing_label_column_lists_the_columns(capsys, base, images, tmp_path):
    error = fails(capsys, [f"model.base={base}", f"data.dataset={images}", f"output_dir={tmp_path}/o",
                           "data.label_column=category"])
    assert "data.label_column='category'" in error and "['image', 'label']" in error


def test_a_dataset_with_one_class(capsys, base, tmp_path):
    single = write_colour_folder(tmp_path / "single", classes=1, train=4, validation=2)
    error = fails(capsys, [f"model.base={base}", f"data.dataset={single}", f"output_dir={tmp_path}/o"])
    assert "single class" in error and "at least two" in error


def test_a_base_model_outside_the_vit_family(capsys, images, tmp_path):
    from transformers import ResNetConfig

    ResNetConfig().save_pretrained(tmp_path / "resnet")
    error = fails(capsys, [f"model.base={tmp_path / 'resnet'}", f"data.dataset={images}", f"output_dir={tmp_path}/o"])
    assert "'resnet' model, which this toolkit cannot fine-tune; supported families" in error and "DINOv2" in error
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
def test_an_output_folder_holding_a_finished_run_is_refused_and_untouched(capsys, trained, base, images):
    before = snapshot(trained)
    error = fails(capsys, [f"model.base={base}", f"data.dataset={images}", f"output_dir={trained}", *TRAIN_ARGS])
    assert "already holds a finished run" in error and "overwrite=true" in error
    assert snapshot(trained) == before


def test_a_problem_set_on_the_command_line_is_not_blamed_on_the_recipe_file(capsys, tmp_path):
    recipe = tmp_path / "mine.yaml"
    recipe.write_text("train:\n  lr: fast\n")
    error = fails(capsys, ["--recipe", str(recipe), "train.epochs=many", "--print"], code=2)
    assert error.startswith(f"error: {recipe} with the command line's overrides has 2 problem(s)")
    lines = {line.strip().split("=")[0]: line for line in error.splitlines() if line.strip().startswith("- ")}
    assert lines["- train.epochs"].endswith("(set on the command line)")
    assert not lines["- train.lr"].endswith("(set on the command line)")  # that one is the file's


def test_a_missing_dataset_folder(capsys, base, tmp_path):
    error = fails(capsys, [f"model.base={base}", f"data.dataset={tmp_path / 'nowhere'}", f"output_dir={tmp_path}/o"])
    assert "nowhere" in error


def test_a_base_folder_without_a_config_is_named_with_the_fix(capsys, images, tmp_path):
    (tmp_path / "half-copied").mkdir()
    (tmp_path / "half-copied" / "model.safetensors").write_bytes(b"")
    error = fails(capsys, [f"model.base={tmp_path / 'half-copied'}", f"data.dataset={images}", f"output_dir={tmp_path}/o"])
    assert "half-copied" in error and "holds no config.json" in error and "save_pretrained" in error
    assert not (tmp_path / "o").exists()


def test_corrupt_image_is_named_by_path(capsys, base, tmp_path):
    folder = write_colour_folder(tmp_path / "imgs", classes=2, train=3, validation=2)
    (folder / "validation" / "red" / "0.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated")
    error = fails(capsys, [f"model.base={base}", f"data.dataset={folder}", f"output_dir={tmp_path}/o",
                           "model.image_size=32", "train.epochs=1", "train.batch_size=4"])
    assert "0.png" in error and "data.skip_bad_images=true" in error
    assert not (tmp_path / "o" / "metrics.json").exists()


def test_predict_names_missing_image_files(capsys, tmp_path):
    error = fails(capsys, ["predict", str(tmp_path), str(tmp_path / "nowhere.jpg")])
    assert "image file(s) not found" in error and "nowhere.jpg" in error


def test_push_refuses_an_invalid_repo_id_before_any_upload(capsys, tmp_path):
    error = fails(capsys, ["push", str(tmp_path), "--repo-id", "has space/x"], code=2)
    assert "--repo-id" in error and "'has space/x'" in error and "not a valid Hub repo id" in error


def test_push_without_a_repo_id_says_how_to_give_one(capsys, tmp_path):
    error = fails(capsys, ["push", str(tmp_path)])
    assert "pass --repo-id namespace/name" in error


def test_a_plain_library_error_is_a_bug_and_keeps_its_traceback(monkeypatch, base, images, tmp_path):
    """Only project errors become a one-line message: a ValueError from deep inside is not a user's mistake."""
    from vit_finetune.training import build

    def broken(*args, **kwargs):
        raise ValueError("a bug deep inside")

    monkeypatch.setattr(build, "run_parts", broken)
    with pytest.raises(ValueError, match="a bug deep inside"):
        main([f"model.base={base}", f"data.dataset={images}", f"output_dir={tmp_path}/o"])


def test_eval_every_steps_evaluates_on_schedule_and_the_last_step_once(args, tmp_path):
    from runs import train

    out = tmp_path / "out"
    assert train([*args, "train.max_steps=6", "train.eval_every_steps=2", f"output_dir={out}"]) == 0
    history = json.loads((out / "history.json").read_text())
    assert [entry["step"] for entry in history if "eval_accuracy" in entry] == [2, 4, 6]  # step 6: the final one
    metrics = json.loads((out / "metrics.json").read_text())
    assert history[-1]["eval_accuracy"] == metrics["accuracy"]
