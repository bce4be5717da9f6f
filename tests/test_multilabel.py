"""Multi-label classification: the loss, Mixup/CutMix of label sets, thresholds and metrics, and runs through the
real CLI (one process and two) whose saved folder `pipeline()` reads with sigmoid scores equal to `predict`'s."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from runs import FLOAT32, NO_FLIP, assert_bit_identical, killed_after_a_checkpoint, train
from tiny import make_tiny_vit, write_label_sets
from vit_finetune.artifacts.final_outputs import TRAINING_ONLY_METRICS
from vit_finetune.cli import main
from vit_finetune.data.augment import BatchAugmenter
from vit_finetune.recipe import AugmentSettings
from vit_finetune.tasks import MultiLabel, label_sets as multilabel

RECIPE = ["model.image_size=32", "train.batch_size=8", "train.epochs=3", "train.lr=0.005", "train.seed=1",
          "data.num_workers=0", "train.log_every_steps=1",
          FLOAT32, NO_FLIP]


# ---------------------------------------------------------------- pieces


def test_loss_is_binary_cross_entropy_over_the_images_not_skipped():
    logits = torch.tensor([[2.0, -1.0, 0.5], [0.3, 0.3, -2.0], [9.0, 9.0, 9.0]])
    rows = torch.tensor([[1, 0, 1], [0, 1, 0], [-1, -1, -1]])  # the third image was skipped as bad
    expected = torch.nn.functional.binary_cross_entropy_with_logits(logits[:2], rows[:2].float())
    assert torch.allclose(multilabel.loss(logits, rows), expected)
    weights = torch.tensor([1.0, 3.0, 0.5])
    weighted = torch.nn.functional.binary_cross_entropy_with_logits(logits[:2], rows[:2].float(), pos_weight=weights)
    assert torch.allclose(multilabel.loss(logits, rows, weights), weighted)
    none_real = multilabel.loss(logits[2:].requires_grad_(), rows[2:])
    none_real.backward()
    assert none_real.item() == 0


def test_positive_weights_are_negatives_over_positives():
    rows = torch.tensor([[1, 0, 1], [0, 0, 1], [0, 1, 1], [0, 0, 1]])
    assert multilabel.positive_weights(rows).tolist() == [3.0, 3.0, 1.0]  # the third has no negative: 1


@pytest.mark.parametrize("mix", ["mixup", "cutmix"])
def test_mixup_and_cutmix_blend_label_sets_by_the_partners_share_of_the_pixels(mix):
    rows = torch.tensor([[1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0], [-1, -1, -1, -1]])  # image 3 skipped as bad
    values = torch.tensor([0.1, 0.4, 0.7, 0.0])  # image i is flat at values[i]
    pixels = values[:, None, None, None].expand(4, 3, 16, 16).clone()
    seen_a_blend = False
    for batch in range(6):
        augmenter = BatchAugmenter(AugmentSettings(**{mix: True}), num_classes=4, seed=3, total_epochs=1,
                                   mix_targets=MultiLabel().mixed_targets)
        mixed, targets = augmenter(pixels, rows, 0, batch)
        assert targets.shape == (4, 4) and (targets[3] == -1).all()  # a skipped image stays skipped
        for own in range(3):
            weight = 1 - targets[own, own].item()
            assert targets[own].sum().item() == pytest.approx(1.0, abs=1e-5)  # one label set's worth in all
            if weight < 1e-6:  # mixed with itself or with the skipped blank: its own labels alone
                continue
            seen_a_blend = True
            partner = int(max((c for c in range(3) if c != own), key=lambda c: targets[own, c].item()))
            assert targets[own, partner].item() == pytest.approx(weight, abs=1e-5)
            if mix == "mixup":  # pixels = (1 - w) own + w partner
                expected = (1 - weight) * values[own] + weight * values[partner]
                assert mixed[own].mean().item() == pytest.approx(expected.item(), abs=1e-4)
            else:  # the pasted box is the partner's; its area share is the partner's label weight
                pasted = (mixed[own, 0] - values[partner]).abs().lt(1e-6).float().mean().item()
                assert pasted == pytest.approx(weight, abs=1e-4)
    assert seen_a_blend


def test_average_precision_and_f1_thresholds_on_a_worked_example():
    scores = np.array([0.9, 0.8, 0.7, 0.6, 0.2])
    truth = np.array([1, 0, 1, 0, 1])
    # precision at each hit: 1/1, 2/3, 3/5; each hit adds a third of the recall
    assert multilabel.average_precision(scores, truth) == pytest.approx((1 + 2 / 3 + 3 / 5) / 3)
    # F1 at the cuts: top1 2/4, top3 4/6, top5 6/8 = 0.75 (the best): the threshold sits below the lowest score
    assert multilabel.best_threshold(scores, truth, 1.0) == pytest.approx(0.1)
    # F0.5 favours precision: top1 gives (1.25 * 1 * 1/3) / (0.25 + 1/3) = 0.714, the best: between 0.9 and 0.8
    assert multilabel.best_threshold(scores, truth, 0.5) == pytest.approx(0.85)
    assert multilabel.best_threshold(scores, np.zeros(5, dtype=int), 1.0) == multilabel.DEFAULT_THRESHOLD


def test_a_threshold_holdout_chooses_on_one_part_and_scores_the_other():
    rng = np.random.default_rng(0)
    rows = (rng.random((40, 3)) < 0.4).astype(int)
    scores = np.clip(rows * 0.5 + rng.random((40, 3)) * 0.6, 0, 1)
    rule = multilabel.ThresholdRule("f1", holdout=0.25, seed=7)
    metrics = multilabel.summarise(scores, rows, np.zeros(40), ["a", "b", "c"], rule)
    choosing, scored = multilabel.holdout_parts(40, 0.25, 7)
    assert (len(choosing), len(scored), metrics["eval_samples"]) == (10, 30, 30)
    assert not set(choosing) & set(scored)
    assert list(metrics["thresholds"].values()) == pytest.approx(
        multilabel.choose_thresholds(scores[choosing], rows[choosing], "f1").tolist())
    assert "held out for choosing them" in metrics["thresholds_chosen_on"]
    same = multilabel.summarise(scores, rows, np.zeros(40), ["a", "b", "c"], multilabel.ThresholdRule("f1"))
    assert same["eval_samples"] == 40 and "the same eval images" in same["thresholds_chosen_on"]


# ---------------------------------------------------------------- through the CLI


@pytest.fixture(scope="module")
def label_sets(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("multilabel")
    return {"base": make_tiny_vit(root / "tiny-vit"), "csv": write_label_sets(root / "csv", images=36, split_column=True),
            "jsonl": write_label_sets(root / "jsonl", images=30, kind="jsonl", seed=1), "root": root}


@pytest.fixture(scope="module")
def trained(label_sets) -> Path:
    out = label_sets["root"] / "out"
    assert train([*RECIPE, f"model.base={label_sets['base']}", f"data.dataset={label_sets['csv']}", f"output_dir={out}",
                  "augment.mixup=true", "augment.cutmix=true", "data.class_balance=weights"]) == 0
    return out


@pytest.mark.slow
def test_a_multi_label_csv_trains_and_saves_its_problem_type_thresholds_and_card(trained):
    config = json.loads((trained / "config.json").read_text())
    metrics = json.loads((trained / "metrics.json").read_text())
    assert config["problem_type"] == "multi_label_classification"
    assert config["label_thresholds"] == metrics["thresholds"] and set(metrics["thresholds"]) == {
        "blue", "green", "red", "yellow"}
    assert metrics["eval_samples"] == 12 and metrics["multi_label"] is True
    for key in ("map", "micro_f1", "macro_f1", "accuracy", "eval_loss"):
        assert 0 <= metrics[key] <= (1 if key != "eval_loss" else 10)
    assert {"precision", "recall", "f1", "ap", "threshold", "support"} <= set(metrics["per_class"]["red"])
    card = (trained / "README.md").read_text()
    red = metrics["per_class"]["red"]
    assert f"| red | {red['precision']:.3f} | {red['recall']:.3f} | {red['f1']:.3f} | {red['ap']:.3f} | " \
           f"{red['threshold']:.3f} | {red['support']} |" in card
    assert "the same eval images the metrics are measured on" in card and "Exact-match accuracy" in card
    assert (trained / "precision_recall.png").read_bytes()[:4] == b"\x89PNG"
    assert not (trained / "confusion_matrix.png").exists()


@pytest.mark.slow
def test_predict_lists_every_label_over_its_threshold_with_the_pipelines_sigmoid_scores(trained, label_sets, tmp_path):
    from transformers import pipeline

    images = sorted((label_sets["csv"].parent / "images").glob("*.png"))[:6]
    assert main(["predict", str(trained), *map(str, images), "--output", str(tmp_path / "p.jsonl")]) == 0
    assert main(["predict", str(trained), *map(str, images), "--output", str(tmp_path / "p.csv")]) == 0
    rows = [json.loads(line) for line in (tmp_path / "p.jsonl").read_text().splitlines()]
    thresholds = json.loads((trained / "config.json").read_text())["label_thresholds"]
    classify = pipeline("image-classification", model=str(trained), top_k=None)
    listed = 0
    for row, image in zip(rows, images):
        scores = {guess["label"]: guess["score"] for guess in classify(str(image))}
        assert abs(sum(scores.values()) - 1) > 1e-3 or len(scores) == 1  # sigmoid scores, not a softmax
        over = {label for label, score in scores.items() if score >= thresholds[label]}
        assert {guess["label"] for guess in row["predictions"]} == over
        for guess in row["predictions"]:
            assert guess["score"] == pytest.approx(scores[guess["label"]], abs=1e-6)
        listed += len(over)
    assert listed > 0
    with open(tmp_path / "p.csv", newline="") as file:
        table = list(csv.DictReader(file))
    assert [row["labels"].split(";") if row["labels"] else [] for row in table] == [
        [guess["label"] for guess in row["predictions"]] for row in rows]


@pytest.mark.slow
def test_explain_shows_a_multi_label_models_own_sigmoid_scores(trained, label_sets):
    from transformers import pipeline

    from vit_finetune.serving import explain
    from vit_finetune.model.saved_model import load_classifier

    image = sorted((label_sets["csv"].parent / "images").glob("*.png"))[0]
    model, processor = load_classifier(str(trained), eager_attention=True)
    from PIL import Image
    pixels = processor(images=Image.open(image).convert("RGB"), return_tensors="pt")["pixel_values"]
    shown = dict(explain.explain_pixels(model, pixels, "rollout").top)
    scores = {guess["label"]: guess["score"] for guess in pipeline("image-classification", model=str(trained),
                                                                   top_k=None)(str(image))}
    assert shown == pytest.approx(scores, abs=1e-5)  # a softmax over the labels would sum to 1 instead
    assert abs(sum(shown.values()) - 1) > 1e-3


@pytest.mark.slow
def test_evaluate_reproduces_a_multi_label_runs_metrics_exactly(trained, tmp_path):
    assert main(["evaluate", str(trained), "--output-dir", str(tmp_path / "eval")]) == 0
    saved = json.loads((trained / "metrics.json").read_text())
    again = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert {k: v for k, v in saved.items() if k not in TRAINING_ONLY_METRICS} == again
    assert (tmp_path / "eval" / "precision_recall.png").is_file()


@pytest.mark.slow
def test_an_int8_export_of_a_multi_label_model_scores_its_label_sets(trained, tmp_path):
    pytest.importorskip("onnxruntime", reason="the [onnx] extra is not installed (pip install -e .[dev] installs it)")
    assert main(["export", str(trained), "--onnx", "--quantize", "int8", "--output", str(tmp_path / "onnx")]) == 0
    quantized = json.loads((tmp_path / "onnx" / "export.json").read_text())["quantized"]
    saved = json.loads((trained / "metrics.json").read_text())
    # The float graph equals PyTorch, so its exact-match accuracy with the saved thresholds is the run's own.
    assert quantized["images"] == saved["eval_samples"] and quantized["agreement_of"] == "label-set"
    assert quantized["float_accuracy"] == pytest.approx(saved["accuracy"])
    assert 0 <= quantized["top1_agreement"] <= 1


@pytest.mark.slow
def test_thresholds_chosen_on_a_held_out_part_are_labelled_and_saved(label_sets):
    out = label_sets["root"] / "holdout"
    assert train([*RECIPE, "train.epochs=1", f"model.base={label_sets['base']}", f"data.dataset={label_sets['jsonl']}",
                  f"output_dir={out}", "data.eval_fraction=0.4", "train.threshold_holdout=0.5",
                  "train.threshold_metric=f2"]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["eval_samples"] == 6 and metrics["threshold_metric"] == "f2"  # 12 eval images, half choose
    assert "6 eval images held out for choosing them" in metrics["thresholds_chosen_on"]
    assert json.loads((out / "config.json").read_text())["label_thresholds"] == metrics["thresholds"]
    assert "held out for choosing them" in (out / "README.md").read_text()


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_two_processes_count_each_eval_image_once_and_match_one_process_evaluation(label_sets, warm_launcher,
                                                                                   tmp_path):
    """Two ranks forked by the session's warm launcher (conftest.warm_launcher): the subject is their evaluation."""
    out = tmp_path / "ddp"
    # 30 images, 20 % held out: 6 eval images over 2 processes x batch 4: Accelerate pads the last batch
    result = warm_launcher.run([*RECIPE, "train.batch_size=4", "train.epochs=2", "data.eval_fraction=0.2",
                                "augment.mixup=true", f"model.base={label_sets['base']}",
                                f"data.dataset={label_sets['jsonl']}", f"output_dir={out}"],
                               {}, tmp_path / "ddp.log")
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["eval_samples"] == 6 and sum(c["support"] for c in metrics["per_class"].values()) > 0
    assert main(["evaluate", str(out), "--output-dir", str(tmp_path / "eval")]) == 0
    again = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert {k: v for k, v in metrics.items() if k not in TRAINING_ONLY_METRICS} == again


@pytest.mark.slow
def test_evaluate_on_a_label_file_uses_the_saved_thresholds(trained, label_sets, tmp_path, capsys):
    assert main(["evaluate", str(trained), "--dataset", str(label_sets["csv"]), "--split", "validation",
                 "--output-dir", str(tmp_path / "eval")]) == 0
    saved = json.loads((trained / "metrics.json").read_text())
    again = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert again["thresholds_chosen_on"] == "saved with the model" and again["thresholds"] == saved["thresholds"]
    # the same split at the same thresholds: the same numbers
    for key in ("eval_samples", "accuracy", "map", "micro_f1", "macro_f1", "eval_loss", "per_class"):
        assert again[key] == saved[key], key


@pytest.mark.slow
def test_a_resumed_multi_label_run_ends_bit_identical(label_sets, tmp_path):
    args = [*RECIPE, f"model.base={label_sets['base']}", f"data.dataset={label_sets['jsonl']}", "train.epochs=1",
            "augment.mixup=true", "pictures=false"]
    assert train([*args, f"output_dir={tmp_path / 'whole'}"]) == 0
    out = killed_after_a_checkpoint(args, tmp_path / "resumed")
    assert train([*args, f"output_dir={out}", "train.resume=auto"]) == 0
    assert_bit_identical(out / "model.safetensors", tmp_path / "whole" / "model.safetensors")
    assert json.loads((out / "metrics.json").read_text()) == json.loads((tmp_path / "whole" / "metrics.json").read_text())


@pytest.mark.slow
def test_push_carries_the_thresholds_and_problem_type_to_the_hub(trained, hub, hub_token, monkeypatch):
    from transformers import AutoConfig

    monkeypatch.setenv("HF_TOKEN", hub_token)
    assert main(["push", str(trained), "--repo-id", "user/vit-label-sets"]) == 0
    config = AutoConfig.from_pretrained("user/vit-label-sets", token=hub_token)
    saved = json.loads((trained / "config.json").read_text())
    assert config.problem_type == "multi_label_classification" and config.label_thresholds == saved["label_thresholds"]
    assert 'model="user/vit-label-sets")' in hub.repo_files("user/vit-label-sets")["README.md"].decode()


@pytest.mark.slow
def test_keep_best_follows_map_and_refuses_a_metric_multi_label_runs_do_not_measure(label_sets, capsys):
    out = label_sets["root"] / "best"
    args = [*RECIPE, "train.epochs=2", f"model.base={label_sets['base']}", f"data.dataset={label_sets['jsonl']}",
            "data.eval_fraction=0.4"]
    assert train([*args, f"output_dir={out}-refused", "train.keep_best=eval_top5_accuracy"]) == 1
    assert "eval_top5_accuracy is measured for single-label runs only" in capsys.readouterr().err
    assert not (Path(f"{out}-refused") / "metrics.json").exists()
    assert train([*args, f"output_dir={out}", "train.keep_best=eval_map", "train.ema_decay=0.5"]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    history = json.loads((out / "history.json").read_text())
    best = max((entry for entry in history if "eval_map" in entry), key=lambda entry: max(
        entry["eval_map"], entry.get("ema_eval_map", 0)))
    assert metrics["best_metric"] == "eval_map" and metrics["best_step"] == best["step"]


def test_a_saved_dataset_with_a_list_of_classlabel_column_is_multi_label(tmp_path):
    import datasets

    from tiny import colour_image
    from vit_finetune import data
    from vit_finetune.recipe import DataSettings

    rng = np.random.default_rng(0)
    images = []
    for i in range(8):
        path = tmp_path / f"{i}.png"
        colour_image((200, 40, 40), rng).save(path)
        images.append(str(path))
    features = datasets.Features({"image": datasets.Image(),
                                  "tags": datasets.Sequence(datasets.ClassLabel(names=["sky", "sea", "sand"]))})
    table = datasets.Dataset.from_dict({"image": images, "tags": [[0], [1, 2], [0, 2], [1]] * 2}, features=features)
    datasets.DatasetDict({"train": table.select(range(6)), "validation": table.select(range(6, 8))}).save_to_disk(
        tmp_path / "saved")
    splits = data.load_splits(DataSettings(dataset=str(tmp_path / "saved")), seed=0)
    assert splits.task == "multi_label" and splits.label_column == "tags" and splits.labels == ["sky", "sea", "sand"]
    dataset = data.eval_dataset(splits, DataSettings(), lambda images, return_tensors: {
        "pixel_values": torch.zeros(1, 3, 8, 8)}, 8)
    assert dataset[(0, 0)][1] == [1, 0, 1] and dataset[(1, 0)][1] == [0, 1, 0]  # [sky, sand] and [sea] as 0/1 rows


# ---------------------------------------------------------------- images with no label, and every surface agreeing


@pytest.fixture(scope="module")
def unlabelled(label_sets) -> dict:
    """A label file of 50 rows of which 4 (8 %) hold no label; 'cyan' only on a train row, 'purple' only on a
    validation row; trained through the CLI."""
    root = label_sets["root"] / "unlabelled"
    path = write_label_sets(root, images=50, split_column=True, seed=4)
    with open(path, newline="") as file:
        rows = list(csv.DictReader(file))
    for i in (3, 6, 4, 8):  # validation rows are every third: two of each split hold no label
        rows[i]["labels"] = ""
    rows[9]["labels"] += ";purple"
    rows[10]["labels"] += ";cyan"
    with open(path, "w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    out = label_sets["root"] / "unlabelled-out"  # beside the label file's folder: a run never writes into it
    assert train([*RECIPE, "pictures=false", f"model.base={label_sets['base']}", f"data.dataset={path}",
                  f"output_dir={out}"]) == 0
    validation = [root / row["file_name"] for row in rows if row["split"] == "validation"]
    truth = [row["labels"].split(";") if row["labels"] else [] for row in rows if row["split"] == "validation"]
    return {"out": out, "validation": validation, "truth": truth}


def predicted_sets(model: Path, images: list[Path], folder: Path, *options: str) -> list[list[str]]:
    """`predict`'s labels per image, in order, through the CLI's JSONL output."""
    output = folder / f"predict{''.join(options)}.jsonl"
    assert main(["predict", str(model), *map(str, images), "--output", str(output), *options]) == 0
    return [[guess["label"] for guess in json.loads(line)["predictions"]] for line in output.read_text().splitlines()]


@pytest.mark.slow
def test_images_with_no_label_train_as_negatives_and_metrics_count_them(unlabelled, tmp_path, capsys):
    from transformers import pipeline

    out = unlabelled["out"]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["eval_samples"] == 17 and metrics["eval_images_without_labels"] == 2
    assert metrics["train_images_without_labels"] == 2
    # Thresholds chosen with the unlabelled rows among the negatives: recomputed from pipeline()'s scores of all
    # 17 validation images
    classify = pipeline("image-classification", model=str(out))
    labels = list(metrics["thresholds"])
    scores = np.array([[{g["label"]: g["score"] for g in classify(str(image), top_k=len(labels))}[label]
                        for label in labels]
                       for image in unlabelled["validation"]])
    rows = np.array([[int(label in truth) for label in labels] for truth in unlabelled["truth"]])
    assert list(metrics["thresholds"].values()) == pytest.approx(multilabel.choose_thresholds(scores, rows, "f1"),
                                                                 abs=1e-5)
    given = predicted_sets(out, unlabelled["validation"], tmp_path)
    assert metrics["eval_images_given_no_label"] == sum(not labels_of for labels_of in given)
    # A label no training image holds is named; one no eval image holds is named as left out of macro F1 and mAP
    assert metrics["labels_without_train_images"] == ["purple"]
    assert metrics["macro_f1_absent_classes"] == ["cyan"] and metrics["per_class"]["cyan"]["ap"] is None
    card = (out / "README.md").read_text()
    assert "2 of the 17 eval images hold none of the labels" in card and "left out of macro F1 and mAP: cyan" in card


@pytest.mark.slow
def test_predict_explain_and_the_page_give_an_image_the_same_labels(unlabelled, tmp_path, capsys):
    from vit_finetune.serving.app import build_app, classifier

    out, images = unlabelled["out"], unlabelled["validation"]
    given = predicted_sets(out, images, tmp_path)
    assert any(len(labels_of) >= 2 for labels_of in given)  # so that --top-k 1 has something to cut
    assert predicted_sets(out, images, tmp_path, "--top-k", "1") == [labels_of[:1] for labels_of in given]
    capsys.readouterr()
    assert main(["explain", str(out), *map(str, images), "--output-dir", str(tmp_path / "explain")]) == 0
    printed = capsys.readouterr().out.splitlines()
    for image, labels_of in zip(images, given):
        line = next(line for line in printed if line.startswith(f"{image}: "))
        shown = line.split(": ", 1)[1].split(" -> ")[0]
        assert [] if shown == "no label" else [part.rsplit(" ", 1)[0] for part in shown.split(", ")] == labels_of
    assert f"{len(images)} picture(s) in {(tmp_path / 'explain').resolve()}" in printed[-1]
    classify, _config, _size = classifier(str(out), top_k=5, scratch=tmp_path)
    for image, labels_of in zip(images[:6], given):
        shown, picture, verdict = classify(str(image))
        assert list(shown) == labels_of[:5] and picture is not None
        assert all(f"<b>{label} " in verdict for label in labels_of[:5])
    # The page's pictures carry their titles as headings, not as gradio's label badge drawn over the picture's own
    components = build_app(str(out)).config["components"]
    pictures = [c["props"] for c in components if c["type"] == "image" and c["props"].get("elem_id") != "image"]
    assert pictures and not any(props["show_label"] for props in pictures)
