"""Image regression (data.task=regression): the loss on standardised targets, the metrics, bad label files, and one
run through the real CLI whose folder predict, evaluate, export, push and a plain transformers user all read."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from runs import FLOAT32, assert_bit_identical, killed_after_a_checkpoint, train
from tiny import colour_image, make_tiny_vit
from vit_finetune.artifacts.final_outputs import TRAINING_ONLY_METRICS
from vit_finetune.cli import main
from vit_finetune.recipe import TrainSettings
from vit_finetune.tasks import Regression, of_config
from vit_finetune.tasks.regression import summarise

RECIPE = ["model.image_size=32", "train.batch_size=8", "train.epochs=3", "train.lr=0.005", "train.seed=1",
          "data.num_workers=0", "train.log_every_steps=1", "data.task=regression",
          "data.target_columns=[brightness,redness]",
          FLOAT32]


def write_targets(root: Path, images: int = 32, seed: int = 0, rows: list[str] | None = None) -> Path:
    """root/metadata.csv: each noisy image's brightness and redness (0-1), the two targets; a `split` column."""
    rng = np.random.default_rng(seed)
    (root / "images").mkdir(parents=True, exist_ok=True)
    lines = ["file_name,brightness,redness,split"]
    for i in range(images):
        brightness, redness = rng.uniform(0.1, 0.9, 2)
        level = 40 + 180 * brightness
        colour_image((int(min(255, level * (0.5 + redness))), int(level), int(level)), rng).save(root / "images" / f"{i}.png")
        lines.append(f"images/{i}.png,{brightness:.4f},{redness:.4f},{'validation' if i % 4 == 0 else 'train'}")
    (root / "metadata.csv").write_text("\n".join(lines + (rows or [])) + "\n")
    return root


# ---------------------------------------------------------------- pieces


def test_the_loss_is_the_squared_error_of_standardised_targets_over_the_images_not_skipped():
    task = Regression(mean=[2.0, 10.0], std=[0.5, 4.0])
    logits = torch.tensor([[1.0, -1.0], [0.0, 0.5], [9.0, 9.0]])
    targets = torch.tensor([[2.5, 2.0], [2.0, 12.0], [float("nan")] * 2])  # the third image was skipped as bad
    standard = torch.tensor([[1.0, -2.0], [0.0, 0.5]])
    assert task.loss(logits, targets, None, None, 0.0).item() == pytest.approx(((logits[:2] - standard) ** 2).mean().item())
    huber = Regression(mean=[2.0, 10.0], std=[0.5, 4.0], loss_kind="huber")
    assert huber.loss(logits, targets, None, None, 0.0).item() == pytest.approx(
        torch.nn.functional.huber_loss(logits[:2], standard).item())
    none_real = task.loss(logits[2:].requires_grad_(), targets[2:], None, None, 0.0)
    none_real.backward()
    assert none_real.item() == 0
    assert task.values(torch.tensor([[1.0, -1.0]])).tolist() == [[2.5, 6.0]]  # undone wherever the model answers


def test_mae_rmse_and_r2_on_a_worked_example():
    true = np.array([[1.0], [2.0], [3.0], [4.0]])
    predicted = np.array([[1.5], [2.0], [2.0], [4.0]])
    metrics = summarise(predicted, true, ["y"])
    assert metrics["mae"] == pytest.approx(0.375)
    assert metrics["rmse"] == pytest.approx(np.sqrt(1.25 / 4))
    assert metrics["r2"] == pytest.approx(1 - 1.25 / 5.0)  # residual 1.25 against 5 around the mean 2.5
    assert summarise(np.full((4, 1), 2.5), true, ["y"])["r2"] == pytest.approx(0.0)  # the mean predicts nothing


@pytest.mark.parametrize("cell, said", [("heavy", "'heavy' in column 'brightness' is not a number"),
                                        ("nan", "'nan' in column 'brightness' is not finite"),
                                        ("inf", "'inf' in column 'brightness' is not finite")])
def test_a_bad_target_cell_is_refused_with_its_line_before_training(made, tmp_path, capsys, cell, said):
    data = write_targets(tmp_path / "data", images=8, rows=[f"images/0.png,{cell},0.5,train"])
    # line 10: the header, 8 rows, then the bad one (it also lists images/0.png twice)
    assert main([f"data.dataset={data}", f"output_dir={tmp_path / 'out'}", f"model.base={made['base']}", *RECIPE]) != 0
    err = capsys.readouterr().err
    assert f"line 10: {said}" in err and "Traceback" not in err and "nothing was trained" in err


def test_auto_refuses_to_read_fractional_numbers_as_classes(made, tmp_path, capsys):
    data = write_targets(tmp_path / "data", images=8)
    base = made["base"]
    assert main([f"data.dataset={data}", "data.label_column=brightness", f"output_dir={tmp_path / 'out'}",
                 f"model.base={base}", "model.image_size=32"]) != 0
    err = capsys.readouterr().err
    assert "data.task=auto does not guess" in err and "data.task=regression" in err


def test_settings_that_need_classes_are_refused_with_regression(tmp_path, capsys):
    assert main(["data.dataset=builtin:shapes", "data.task=regression", "train.label_smoothing=0.1",
                 "augment.mixup=true", f"output_dir={tmp_path / 'out'}"]) != 0
    err = capsys.readouterr().err
    assert "train.label_smoothing works on class labels" in err and "augment.mixup works on class labels" in err


def write_values(root: Path, columns: dict[str, list[float]]) -> Path:
    """root/metadata.csv: one noisy image per row and the given target columns (a plain list of values each)."""
    rng = np.random.default_rng(0)
    (root / "images").mkdir(parents=True, exist_ok=True)
    rows = len(next(iter(columns.values())))
    lines = ["file_name," + ",".join(columns)]
    for i in range(rows):
        colour_image((120, 120, 120), rng, size=(8, 8)).save(root / "images" / f"{i}.png")
        lines.append(f"images/{i}.png," + ",".join(repr(float(values[i])) for values in columns.values()))
    (root / "metadata.csv").write_text("\n".join(lines) + "\n")
    return root


def regression_data(root: Path, columns: dict[str, list[float]]):
    """data.load_splits of those columns as a regression's targets (one image in eight held out for eval)."""
    from vit_finetune import data
    from vit_finetune.recipe import DataSettings

    return data.load_splits(DataSettings(dataset=str(write_values(root, columns)), task="regression",
                                         target_columns=list(columns)), seed=0)


@pytest.mark.parametrize("rows, fraction, said", [
    (1, 0.1, "no eval_fraction can, each part needs an image"),
    (4, 0.9, "Fix: an eval_fraction of at most 0.75"),
])
def test_an_eval_split_that_cannot_be_held_out_of_a_regressions_images_is_a_clean_error(tmp_path, rows, fraction,
                                                                                         said):
    """A label file with no split column: eval_fraction of its images is held out, as for classes."""
    from vit_finetune import data
    from vit_finetune.recipe import DataSettings

    folder = write_values(tmp_path / "data", {"target": [float(i) for i in range(rows)]})
    with pytest.raises(data.DataError) as caught:
        data.load_splits(DataSettings(dataset=str(folder), task="regression", eval_fraction=fraction), seed=0)
    assert f"data.eval_fraction={fraction} cannot hold out an eval split" in str(caught.value)
    assert said in str(caught.value)


def test_a_target_too_large_for_float32_is_refused_before_any_model_loads(made, tmp_path, capsys):
    from vit_finetune.model import loading as vit

    data = write_values(tmp_path / "data", {"size": [1e308] * 8, "other": list(range(8))})
    built = []
    recipe = [arg for arg in RECIPE if not arg.startswith("data.target_columns=")]
    code = train([*recipe, f"data.dataset={data}", "data.target_columns=[size,other]", f"output_dir={tmp_path / 'out'}",
                  f"model.base={made['base']}"],
                 patches=[(vit, "build_model", lambda *a, **k: built.append(1))])
    err = capsys.readouterr().err
    assert code != 0 and built == [] and "Traceback" not in err
    assert "the target column 'size' holds 1e+308" in err and "Fix: rescale the column" in err
    assert not (tmp_path / "out" / "model.safetensors").exists()


@pytest.mark.parametrize("values, said", [
    ([i * 1e200 for i in range(8)], "holds 1e+200"),  # finite in float64; once standardised in float32, not
    ([1e9 + i / 1000 for i in range(8)], "rounds values of that size by up to"),  # the spread drowns in rounding
    ([i * 1e-40 for i in range(8)], "below 1e-30"),  # float32 has no digits left down there
])
def test_targets_float32_cannot_standardise_are_refused_when_read_naming_the_column_and_fix(tmp_path, values, said):
    from vit_finetune import data

    with pytest.raises(data.DataError) as caught:
        regression_data(tmp_path, {"y": list(range(8)), "reading": values})
    message = str(caught.value)
    assert "'reading'" in message and said in message and "Fix: rescale the column" in message


def test_a_constant_target_is_said_and_a_run_of_only_constant_targets_is_refused(tmp_path):
    from vit_finetune import data

    splits = regression_data(tmp_path / "one", {"y": list(range(8)), "flat": [5.0] * 8})
    assert any("constant" in note and "'flat': 5.0" in note and "target_std saved as 1" in note
               for note in splits.notes)
    task = Regression.for_training(splits, TrainSettings())
    assert task.std.tolist()[1] == 1.0 and task.mean.tolist()[1] == 5.0  # what the note says it is learned as
    with pytest.raises(data.DataError, match="every target is constant.*nothing to learn"):
        regression_data(tmp_path / "all", {"flat": [5.0] * 8, "also": [2.0] * 8})


def test_a_thousand_target_columns_are_read_without_copying_every_columns_features_per_column(monkeypatch):
    """Reading Dataset.features deep-copies every column's feature: done once per target, 1,000 columns took minutes."""
    import datasets

    from vit_finetune.data import targets

    names = [f"t{i}" for i in range(1000)]
    table = datasets.Dataset.from_dict({"image": [f"{i}.png" for i in range(4)],
                                        **{name: [float(i + row) for row in range(4)] for i, name in enumerate(names)}})
    copies = []
    copy = datasets.Features.copy
    monkeypatch.setattr(datasets.Features, "copy", lambda self: copies.append(1) or copy(self))
    read = targets.as_targets(table, "image", names, "train")
    assert len(copies) < 20  # a few per table, not one per target
    assert read[targets.TARGETS_COLUMN][3][:2] == [3.0, 4.0]  # row 3: column t0 holds 3, t1 holds 4


# ---------------------------------------------------------------- one run, every use of it


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("regression")
    return {"base": make_tiny_vit(root / "tiny-vit"), "data": write_targets(root / "data"), "root": root}


@pytest.fixture(scope="module")
def trained(made) -> Path:
    out = made["root"] / "out"
    assert train([*RECIPE, f"model.base={made['base']}", f"data.dataset={made['data']}", f"output_dir={out}"]) == 0
    return out


@pytest.mark.slow
def test_a_regression_run_saves_its_standardisation_metrics_picture_and_card(trained):
    config = json.loads((trained / "config.json").read_text())
    metrics = json.loads((trained / "metrics.json").read_text())
    assert config["problem_type"] == "regression" and len(config["id2label"]) == 2
    assert list(config["id2label"].values()) == ["brightness", "redness"]
    with open(trained.parent / "data" / "metadata.csv", newline="") as file:
        train_rows = [row for row in csv.DictReader(file) if row["split"] == "train"]
    brightness = np.array([float(row["brightness"]) for row in train_rows])
    assert config["target_mean"][0] == pytest.approx(brightness.mean()) and config["target_std"][0] == pytest.approx(brightness.std())
    assert metrics["task"] == "regression" and metrics["eval_samples"] == 8 and metrics["method"] == "finetune"
    assert set(metrics["per_target"]) == {"brightness", "redness"}
    assert metrics["mae"] == pytest.approx(np.mean([m["mae"] for m in metrics["per_target"].values()]))
    assert (trained / "predicted_vs_true.png").read_bytes()[:4] == b"\x89PNG"
    assert not (trained / "confusion_matrix.png").exists()
    card = (trained / "README.md").read_text()
    assert "| RMSE |" in card and "`output * target_std + target_mean`" in card
    assert f'AutoModelForImageClassification.from_pretrained("{trained}")' in card


def test_the_ridge_probes_leave_one_out_error_is_that_of_refitting_without_each_image():
    from vit_finetune.training import probe

    generator = torch.Generator().manual_seed(0)
    features = torch.randn(24, 5, generator=generator, dtype=torch.float64)
    targets = features[:, :2] * torch.tensor([1.0, -2.0], dtype=torch.float64) + torch.randn(24, 2, generator=generator)
    alpha, error = probe.ridge_leave_one_out(features, targets)
    residuals = []
    for left_out in range(24):
        kept = torch.arange(24) != left_out
        weight, bias = probe.fit_ridge(features[kept], targets[kept], alpha)
        residuals.append(targets[left_out] - (features[left_out].float() @ weight.T + bias).double())
    assert error == pytest.approx(float(torch.stack(residuals).square().mean()), rel=1e-4)
    others = [probe.ridge_leave_one_out(features, targets)[1]]  # deterministic: the same choice again
    assert others == [error] and alpha in probe.RIDGE_ALPHAS[1:-1]  # the noise needs some, not the most, shrinkage


def test_a_probed_regression_head_predicts_the_standardised_targets_from_the_raw_features():
    from vit_finetune.training import probe

    generator = torch.Generator().manual_seed(1)
    features = torch.randn(80, 6, generator=generator) * 4 + 10  # far from standard: the fold-back is exercised
    values = torch.stack([features[:, 0] * 3 + 7, -features[:, 1]], dim=1)
    values[5] = float("nan")  # a skipped image: left out of the fit
    task = Regression.from_targets(values[~values[:, 0].isnan()].numpy(), "mse")
    weight, bias, alpha, error, images = probe.fit_head(features, values, 2, task)
    assert weight.shape == (2, 6) and images == 79 and error < 0.01
    kept = torch.arange(80) != 5
    assert torch.allclose(task.values(features[kept] @ weight.T + bias), values[kept], atol=0.05 * float(task.std.max()))


@pytest.fixture(scope="module")
def probed(made) -> Path:
    out = made["root"] / "probed"
    recipe = [key for key in RECIPE if not key.startswith("train.log_every_steps")]  # a probe takes no step to log
    assert train([*recipe, f"model.base={made['base']}", f"data.dataset={made['data']}", f"output_dir={out}",
                  "train.method=linear_probe"]) == 0
    return out


@pytest.mark.slow
def test_a_regressions_linear_probe_saves_a_ridge_head_that_predict_and_the_metrics_agree_on(probed, made, trained):
    metrics = json.loads((probed / "metrics.json").read_text())
    assert metrics["method"] == "linear_probe" and metrics["steps"] == 0
    assert metrics["probe"]["fit"] == "ridge" and metrics["probe"]["images"] == 24
    from vit_finetune.training import probe

    assert metrics["probe"]["alpha"] in probe.RIDGE_ALPHAS
    assert "ridge regression" in (probed / "README.md").read_text()
    # Fitted on the frozen features of the brightness/redness images: better than the training mean on eval.
    assert metrics["r2"] > 0


@pytest.mark.slow
def test_lp_ft_of_a_regression_saves_the_probes_model_only_where_it_scores_no_worse(probed, made, capsys):
    from safetensors.torch import load_file

    out = made["root"] / "lp_ft"
    assert train([*RECIPE, f"model.base={made['base']}", f"data.dataset={made['data']}", f"output_dir={out}",
                  "train.method=lp_ft"]) == 0
    said = capsys.readouterr().out
    assert "train.wise_ft_alpha=auto -> 0: the probe's model where it scores no worse" in said
    # 24 training images, below what the shrunk head was measured on: auto keeps the probe's head as fitted.
    assert ("train.lp_ft_head_scale=auto -> 1: 24 training images, 72 seen: the shrunk head was measured on 640-2,000 "
            "training images") in said
    metrics = json.loads((out / "metrics.json").read_text())
    choice = metrics["wise_ft"]
    assert choice["alpha"] == 0 and choice["chosen_by"].startswith("eval_mae")
    # Both candidates' every rankable score is on record, so what RMSE would have kept can be read back.
    assert {"eval_mae", "eval_rmse", "eval_r2", "eval_loss"} <= set(choice["average"]) & set(choice["fine_tuned"])
    probe_mae, tuned_mae = choice["average"]["eval_mae"], choice["fine_tuned"]["eval_mae"]
    saved, probe_model = load_file(str(out / "model.safetensors")), load_file(str(probed / "model.safetensors"))
    same_as_probe = all(torch.equal(saved[name], probe_model[name]) for name in saved)
    # Float32 features both ways: LP-FT's probe is the linear_probe run's head, so its start is that very model.
    if probe_mae <= tuned_mae:
        assert choice["kept"] == "average" and same_as_probe and metrics["mae"] == pytest.approx(probe_mae)
        assert "saved: the probe's model, as fine-tuning scored no better" in said
    else:
        assert choice["kept"] == "fine_tuned" and not same_as_probe and metrics["mae"] == pytest.approx(tuned_mae)
        assert "saved: the fine-tuned weights, as the probe's model scored lower" in said

@pytest.mark.slow
def test_lp_ft_of_a_regression_fine_tunes_from_the_probes_head_shrunk_while_the_average_keeps_it_whole(probed, made,
                                                                                                      capsys):
    from safetensors.torch import load_file

    probe_model = load_file(str(probed / "model.safetensors"))
    # At an lr of 1e-12 nothing moves: the fine-tuned weights saved are the start fine-tuning had.
    still = made["root"] / "shrunk"
    assert train([*RECIPE, f"model.base={made['base']}", f"data.dataset={made['data']}", f"output_dir={still}",
                  "train.method=lp_ft", "train.lr=1e-12", "train.lp_ft_head_scale=0.04", "train.wise_ft_alpha=1"]) == 0
    started_from = load_file(str(still / "model.safetensors"))
    for name, tensor in probe_model.items():
        expected = tensor * 0.04 if name.startswith("classifier.") else tensor
        torch.testing.assert_close(started_from[name], expected, rtol=1e-5, atol=1e-7)
    recipe = yaml.safe_load((still / "recipe.yaml").read_text())["train"]
    assert recipe["lp_ft_head_scale"] == 0.04 and recipe["head_lr"] == 1e-12
    assert "then full fine-tuning from that head times 0.04" in (still / "README.md").read_text()
    # The probe's model WiSE-FT goes back to is the probe's own head, not the shrunk one: a head 25 times too small
    # predicts almost the mean, so the probe's model scores better and is saved, equal to the linear probe's.
    kept = made["root"] / "shrunk-kept"
    assert train([*RECIPE, f"model.base={made['base']}", f"data.dataset={made['data']}", f"output_dir={kept}",
                  "train.method=lp_ft", "train.lr=1e-12", "train.lp_ft_head_scale=0.04"]) == 0
    choice = json.loads((kept / "metrics.json").read_text())["wise_ft"]
    assert choice["kept"] == "average" and choice["average"]["eval_mae"] < choice["fine_tuned"]["eval_mae"]
    saved = load_file(str(kept / "model.safetensors"))
    assert all(torch.equal(saved[name], probe_model[name]) for name in probe_model)


@pytest.mark.slow
def test_predict_gives_the_values_the_cards_transformers_call_gives(trained, made, tmp_path):
    from PIL import Image
    from transformers import AutoImageProcessor, AutoModelForImageClassification

    images = sorted((made["data"] / "images").glob("*.png"))[:5]
    assert main(["predict", str(trained), *map(str, images), "--output", str(tmp_path / "p.jsonl")]) == 0
    assert main(["predict", str(trained), *map(str, images), "--output", str(tmp_path / "p.csv")]) == 0
    rows = [json.loads(line) for line in (tmp_path / "p.jsonl").read_text().splitlines()]
    # the card's call, as a plain transformers user runs it
    model = AutoModelForImageClassification.from_pretrained(str(trained))
    processor = AutoImageProcessor.from_pretrained(str(trained))
    with torch.no_grad():
        standardised = model(**processor(images=[Image.open(p).convert("RGB") for p in images], return_tensors="pt")).logits
    values = standardised * torch.tensor(model.config.target_std) + torch.tensor(model.config.target_mean)
    for row, expected in zip(rows, values.tolist()):
        assert [guess["label"] for guess in row["predictions"]] == ["brightness", "redness"]
        assert [guess["score"] for guess in row["predictions"]] == pytest.approx(expected, abs=1e-5)
    with open(tmp_path / "p.csv", newline="") as file:
        table = list(csv.DictReader(file))
    assert list(table[0]) == ["image", "error", "brightness", "redness"]
    assert [float(row["redness"]) for row in table] == pytest.approx([v[1] for v in values.tolist()], abs=1e-4)


@pytest.mark.slow
def test_evaluate_reproduces_a_regression_runs_metrics_exactly(trained, tmp_path):
    assert main(["evaluate", str(trained), "--output-dir", str(tmp_path / "eval")]) == 0
    saved = json.loads((trained / "metrics.json").read_text())
    again = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert {k: v for k, v in saved.items() if k not in TRAINING_ONLY_METRICS} == again
    assert (tmp_path / "eval" / "predicted_vs_true.png").is_file()


@pytest.mark.slow
def test_an_onnx_export_of_a_regression_model_matches_and_scores_its_values(trained, tmp_path, capsys):
    pytest.importorskip("onnxruntime", reason="the [onnx] extra is not installed (pip install -e .[dev] installs it)")
    assert main(["export", str(trained), "--onnx", "--quantize", "int8", "--output", str(tmp_path / "onnx")]) == 0
    printed = capsys.readouterr().out
    assert "in the targets' units" in printed and ", MAE " in printed and "accuracy" not in printed
    report = json.loads((tmp_path / "onnx" / "export.json").read_text())
    assert report["parity"]["max_abs_logit_difference"] <= 1e-3
    quantized = report["quantized"]
    assert quantized["agreement_of"].startswith("values within 5%") and quantized["images"] == 8
    # scored as the run was: the float graph's MAE on the eval split is the run's own
    metrics = json.loads((trained / "metrics.json").read_text())
    assert quantized["metric"] == "mae" and quantized["float_mae"] == pytest.approx(metrics["mae"], abs=1e-4)
    assert quantized["mae_change"] == pytest.approx(quantized["int8_mae"] - quantized["float_mae"])
    assert "float_accuracy" not in quantized


@pytest.fixture(scope="module")
def fixed_values(tmp_path_factory) -> Path:
    """A saved regression model that gives every image age 59.94 and smile -2.41: its head's weights are zero and
    its bias the standardised values."""
    from transformers import ViTConfig, ViTForImageClassification, ViTImageProcessorPil

    folder = tmp_path_factory.mktemp("fixed-values")
    config = ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=32,
                       patch_size=4, num_labels=2, id2label={0: "age", 1: "smile"}, label2id={"age": 0, "smile": 1},
                       problem_type="regression", target_mean=[50.0, 0.0], target_std=[10.0, 1.0])
    model = ViTForImageClassification(config)
    with torch.no_grad():
        model.classifier.weight.zero_()
        model.classifier.bias.copy_(torch.tensor([0.994, -2.41]))
    model.save_pretrained(folder)
    ViTImageProcessorPil(size={"height": 32, "width": 32}).save_pretrained(folder)
    colour_image((90, 160, 40), np.random.default_rng(0)).save(folder.parent / "photo.png")
    return folder


def test_explain_draws_a_regressions_values_on_an_axis_of_their_own_by_target_name(fixed_values, tmp_path, capsys):
    from PIL import Image

    from vit_finetune.serving import explain
    from vit_finetune.tasks.pictures import pyplot
    from vit_finetune.model.saved_model import load_classifier

    model, processor = load_classifier(str(fixed_values), eager_attention=True)
    image = fixed_values.parent / "photo.png"
    pixels = processor(images=Image.open(image).convert("RGB"), return_tensors="pt")["pixel_values"]
    explanation = explain.explain_pixels(model, pixels, "rollout")
    assert [name for name, _ in explanation.top] == ["age", "smile"]  # the targets' order, not ranked
    assert [value for _, value in explanation.top] == pytest.approx([59.94, -2.41], abs=1e-4)
    figure, axis = pyplot().subplots()
    explanation.task.draw_shown(axis, explanation.top, explanation.given)  # the panel explain's picture draws
    low, high = axis.get_xlim()
    assert low < -2.41 and high > 59.94  # neither clipped at 1 nor hidden below 0
    assert [tick.get_text() for tick in axis.get_yticklabels()] == ["smile", "age"]  # the first target on top
    assert "probability" not in axis.get_xlabel() and "value" in axis.get_xlabel()
    pyplot().close(figure)
    assert main(["explain", str(fixed_values), str(image), "--output-dir", str(tmp_path / "explain")]) == 0
    assert "photo.png: age 59.94, smile -2.41 ->" in capsys.readouterr().out
    assert (tmp_path / "explain" / "photo.rollout.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow  # importing gradio takes seconds
def test_the_page_writes_a_regressions_values_as_numbers_not_as_confidences(fixed_values, tmp_path):
    pytest.importorskip("gradio", reason="the [app] extra is not installed")
    from vit_finetune.serving.app import build_app, classifier, header_html

    classify, config, size = classifier(str(fixed_values), top_k=5, scratch=tmp_path)
    confidences, picture, note = classify(str(fixed_values.parent / "photo.png"))
    assert confidences is None and picture is not None  # no confidence bars of 5994% and -241%
    assert "<td>age</td><td>59.94</td>" in note and "<td>smile</td><td>-2.41</td>" in note
    assert "regression model" in header_html("m", config, size) and "2 targets (age, smile)" in header_html("m", config, size)
    components = build_app(str(fixed_values), scratch=tmp_path).config["components"]
    labels = next(c["props"] for c in components if c["props"].get("elem_id") == "labels")
    assert labels["visible"] is False


@pytest.mark.slow
def test_explain_shows_the_regression_values(trained, made):
    from PIL import Image

    from vit_finetune.serving import explain
    from vit_finetune.model.saved_model import load_classifier

    model, processor = load_classifier(str(trained), eager_attention=True)
    image = Image.open(sorted((made["data"] / "images").glob("*.png"))[0]).convert("RGB")
    pixels = processor(images=image, return_tensors="pt")["pixel_values"]
    given = explain.explain_pixels(model, pixels, "rollout").given
    with torch.no_grad():
        expected = of_config(model.config).values(model(pixel_values=pixels).logits)[0].tolist()
    assert [name for name, _ in given] == ["brightness", "redness"]
    assert [value for _, value in given] == pytest.approx(expected, abs=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("method", [[], ["train.method=lp_ft", "train.lp_ft_head_scale=0.2"]],
                         ids=["auto", "lp_ft_from_a_shrunk_head"])
def test_a_resumed_regression_run_ends_bit_identical(made, tmp_path, method):
    # LP-FT: the resumed run fits the probe again for the end's choice and shrinks its head again; the checkpoint's
    # weights then replace the model's, and the end compares with the probe's own head as the whole run did.
    args = [*RECIPE, f"model.base={made['base']}", f"data.dataset={made['data']}", "train.epochs=1", "pictures=false",
            *method]
    assert train([*args, f"output_dir={tmp_path / 'whole'}"]) == 0
    out = killed_after_a_checkpoint(args, tmp_path / "resumed")
    assert train([*args, f"output_dir={out}", "train.resume=auto"]) == 0
    assert_bit_identical(out / "model.safetensors", tmp_path / "whole" / "model.safetensors")


@pytest.mark.slow
def test_push_puts_the_regression_model_on_the_hub_with_its_card_loading_the_repo(trained, hub, hub_token, monkeypatch):
    from transformers import AutoModelForImageClassification

    monkeypatch.setenv("HF_TOKEN", hub_token)
    repo_id = "user/vit-regression"
    assert main(["push", str(trained), "--repo-id", repo_id]) == 0
    files = hub.repo_files(repo_id)
    assert f'AutoModelForImageClassification.from_pretrained("{repo_id}")' in files["README.md"].decode()
    pulled = AutoModelForImageClassification.from_pretrained(repo_id, token=hub_token)
    assert pulled.config.problem_type == "regression" and pulled.config.target_std == json.loads(
        (trained / "config.json").read_text())["target_std"]


@pytest.mark.slow
def test_keep_best_follows_a_regression_metric_and_refuses_accuracy(made, tmp_path, capsys):
    args = [*RECIPE, f"model.base={made['base']}", f"data.dataset={made['data']}", "train.epochs=2", "pictures=false"]
    assert train([*args, f"output_dir={tmp_path / 'refused'}", "train.keep_best=eval_accuracy"]) == 1
    err = capsys.readouterr().err
    assert "this run is regression" in err and "eval_rmse" in err
    assert train([*args, f"output_dir={tmp_path / 'best'}", "train.keep_best=eval_r2", "train.ema_decay=0.5"]) == 0
    metrics = json.loads((tmp_path / "best" / "metrics.json").read_text())
    history = json.loads((tmp_path / "best" / "history.json").read_text())
    best = max((entry for entry in history if "eval_r2" in entry),
               key=lambda entry: max(entry["eval_r2"], entry["ema_eval_r2"]))
    assert metrics["best_metric"] == "eval_r2" and metrics["best_step"] == best["step"]
    assert metrics["best_value"] == pytest.approx(max(best["eval_r2"], best["ema_eval_r2"]))
    assert {"raw_mae", "ema_mae"} <= set(metrics)  # what the card compares the raw and EMA weights by


def test_keep_best_eval_r2_on_one_eval_image_is_refused_before_the_model_is_built(made, tmp_path, capsys):
    from vit_finetune.training import build

    data = write_targets(tmp_path / "data", images=4)  # its split column puts image 0 alone in validation
    built = []
    code = train([*RECIPE, f"model.base={made['base']}", f"data.dataset={data}", "train.keep_best=eval_r2",
                  f"output_dir={tmp_path / 'out'}"],
                 patches=[(build, "build_model", lambda *a, **k: built.append(1))])
    err = capsys.readouterr().err
    assert code == 1 and built == [] and "Traceback" not in err, err[-2000:]
    assert "train.keep_best=eval_r2: R² is undefined on this eval split (1 eval image)" in err
    assert "Fix: train.keep_best=eval_mae" in err


def test_keep_best_eval_r2_needs_eval_targets_that_differ(tmp_path):
    from vit_finetune import data
    from vit_finetune.recipe import DataSettings

    def splits_with_eval(values: list[float]):
        """Six training images of different values; the eval split's images hold `values`."""
        folder = write_values(tmp_path / str(len(list(tmp_path.iterdir()))), {"target": [*range(6), *values]})
        lines = (folder / "metadata.csv").read_text().splitlines()
        (folder / "metadata.csv").write_text("\n".join([lines[0] + ",split"] + [
            f"{line},{'train' if row < 6 else 'validation'}" for row, line in enumerate(lines[1:])]) + "\n")
        return data.load_splits(DataSettings(dataset=str(folder), task="regression"), seed=0)

    task = Regression(mean=[2.0], std=[1.0])
    same = splits_with_eval([2.0, 2.0])
    assert len(same.eval) == 2 and "(2 eval images, every target the same in each)" in task.keep_best_refusal(
        "eval_r2", same)
    assert task.keep_best_refusal("eval_mae", same) is None  # MAE is defined on any eval split
    assert task.keep_best_refusal("eval_r2", splits_with_eval([2.0, 3.0])) is None


def test_a_saved_dataset_with_a_column_of_numbers_is_read_as_targets(tmp_path):
    import datasets

    from vit_finetune import data
    from vit_finetune.recipe import DataSettings

    rng = np.random.default_rng(0)
    images = []
    for i in range(6):
        colour_image((200, 40, 40), rng).save(tmp_path / f"{i}.png")
        images.append(str(tmp_path / f"{i}.png"))
    features = datasets.Features({"image": datasets.Image(), "name": datasets.Value("string"),
                                  "tag": datasets.ClassLabel(names=["a", "b"]), "score": datasets.Value("float32")})
    scores = [0.5, 1.5, 2.0, 3.25, 4.0, float("nan")]
    table = datasets.Dataset.from_dict({"image": images, "name": list("uvwxyz"), "tag": [0, 1] * 3, "score": scores},
                                       features=features)
    datasets.DatasetDict({"train": table.select(range(4)), "validation": table.select(range(4, 5))}).save_to_disk(
        tmp_path / "saved")
    splits = data.load_splits(DataSettings(dataset=str(tmp_path / "saved"), task="regression"), seed=0)
    assert splits.labels == ["score"] and splits.task == "regression"  # the only plain numbers: not the ClassLabel
    assert list(splits.train[splits.label_column]) == [[0.5], [1.5], [2.0], [3.25]]
    with pytest.raises(data.DataError, match="holds numbers"):  # auto does not read them as classes
        data.load_splits(DataSettings(dataset=str(tmp_path / "saved"), label_column="score"), seed=0)
    datasets.DatasetDict({"train": table}).save_to_disk(tmp_path / "with-nan")
    with pytest.raises(data.DataError, match=r"row 5 of split 'train' has a target that is missing or not finite"):
        data.load_splits(DataSettings(dataset=str(tmp_path / "with-nan"), task="regression"), seed=0)


def test_evaluate_scores_a_regression_model_on_a_label_file_by_its_own_target_columns(fixed_values, tmp_path, capsys):
    """No --split, no data.task, no column named: the saved model says it is a regression of `age` and `smile`, and
    the file's only split is read. Every image is given age 59.94 and smile -2.41, so the errors are known."""
    rng = np.random.default_rng(1)
    ages, smiles = [40.0, 60.0, 70.0, 55.0], [-2.0, -3.0, 0.0, -2.41]
    for i in range(len(ages)):
        colour_image((30 * i, 90, 40), rng).save(tmp_path / f"{i}.png")
    rows = [f"{i}.png,{age},{smile}" for i, (age, smile) in enumerate(zip(ages, smiles))]
    (tmp_path / "faces.csv").write_text("\n".join(["file_name,age,smile", *rows]) + "\n")
    assert main(["evaluate", str(fixed_values), "--dataset", str(tmp_path / "faces.csv")]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["task"] == "regression" and shown["eval_samples"] == 4 and shown["eval_split"] == "train"
    errors = np.abs(np.array([[59.94 - age, -2.41 - smile] for age, smile in zip(ages, smiles)]))
    assert shown["mae"] == pytest.approx(errors.mean(), abs=1e-4)

    # Columns of other names: refused naming the model's targets and the option; with it, the same numbers.
    (tmp_path / "renamed.csv").write_text("\n".join(["file_name,years,grin", *rows]) + "\n")
    assert main(["evaluate", str(fixed_values), "--dataset", str(tmp_path / "renamed.csv")]) == 1
    error = capsys.readouterr().err
    assert "the model predicts ['age', 'smile']" in error and "--target-columns" in error
    assert "data.task" not in error and "Traceback" not in error
    assert main(["evaluate", str(fixed_values), "--dataset", str(tmp_path / "renamed.csv"),
                 "--target-columns", "years,grin"]) == 0
    assert json.loads(capsys.readouterr().out)["mae"] == pytest.approx(shown["mae"], abs=1e-6)
    assert main(["evaluate", str(fixed_values), "--dataset", str(tmp_path / "renamed.csv"),
                 "--target-columns", "years"]) == 1
    assert "the model predicts 2 target(s) ['age', 'smile']" in capsys.readouterr().err
