"""Pictures: attention rollout (known answers on hand-made attention, per-class gradient maps on real tiny models),
explain end to end, position-embedding similarity, and the card's confusion matrix and per-class table."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tiny import COLOURS, colour_image, make_tiny_vit
from vit_finetune.cli import main
from vit_finetune.serving import explain
from vit_finetune.tasks import evaluation, pictures

CLS_LAYOUT = explain.TokenLayout(prefix=1, grid=3, mean_pooled=False)
MEAN_LAYOUT = explain.TokenLayout(prefix=1, grid=3, mean_pooled=True)


@pytest.mark.parametrize("layout", [CLS_LAYOUT, MEAN_LAYOUT])
def test_identity_attention_gives_a_uniform_map(layout):
    identity = [torch.eye(10).expand(2, 10, 10) for _ in range(3)]  # 2 heads, CLS + 3x3 patches, 3 layers
    heat_map = explain.rollout(identity, layout)
    assert heat_map.shape == (3, 3) and torch.all(heat_map == heat_map[0, 0])


@pytest.mark.parametrize("layout", [CLS_LAYOUT, MEAN_LAYOUT])
def test_attention_to_one_patch_puts_the_map_on_it(layout):
    attention = torch.full((2, 10, 10), 0.01)
    attention[:, :, 1 + 5] = 1.0  # every token looks at patch 5: row 1, column 2 of the 3x3 grid
    attention = attention / attention.sum(-1, keepdim=True)
    heat_map = explain.rollout([attention] * 2, layout)
    assert heat_map[1, 2] == 1.0 and (heat_map.flatten().argsort()[-1] == 5)
    assert heat_map.flatten()[torch.arange(9) != 5].max() < 0.5


def test_gradient_rollout_with_no_gradient_is_uniform_and_follows_positive_gradients():
    attention = torch.full((1, 10, 10), 0.1)
    zero = [torch.zeros(1, 10, 10)]
    assert torch.all(explain.gradient_rollout([attention], zero, CLS_LAYOUT) == 0.5)
    towards_patch_2 = torch.zeros(1, 10, 10)
    towards_patch_2[0, 0, 1 + 2] = 1.0
    towards_patch_2[0, 0, 1 + 7] = -1.0  # negative evidence is dropped, not ranked low
    heat_map = explain.gradient_rollout([attention], [towards_patch_2], CLS_LAYOUT).flatten()
    assert heat_map.argmax() == 2 and heat_map[7] == heat_map[0]


def tiny_beit(folder: Path) -> Path:
    """A mean-pooled family (BEiT with use_mean_pooling), saved like a checkpoint."""
    from transformers import BeitConfig, BeitForImageClassification, ViTImageProcessor

    torch.manual_seed(0)
    config = BeitConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                        image_size=32, patch_size=8, num_labels=3, use_mean_pooling=True,
                        id2label={0: "a", 1: "b", 2: "c"}, label2id={"a": 0, "b": 1, "c": 2})
    BeitForImageClassification(config).save_pretrained(folder)
    ViTImageProcessor(size={"height": 32, "width": 32}).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def families(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {"vit (CLS-pooled)": make_tiny_vit(root / "vit", num_labels=4), "beit (mean-pooled)": tiny_beit(root / "beit")}


@pytest.mark.parametrize("family", ["vit (CLS-pooled)", "beit (mean-pooled)"])
def test_gradient_maps_differ_per_class_on_real_models(families, family):
    from vit_finetune.model.saved_model import load_classifier

    model, processor = load_classifier(str(families[family]), eager_attention=True)
    assert model.config._attn_implementation == "eager"
    pixels = processor(images=colour_image(COLOURS["red"], np.random.default_rng(0)), return_tensors="pt")["pixel_values"]
    maps = [explain.explain_pixels(model, pixels, "gradient", label).heat_map for label in list(model.config.label2id)[:2]]
    grid = model.config.image_size // model.config.patch_size
    assert maps[0].shape == (grid, grid) and not torch.allclose(maps[0], maps[1], atol=1e-3)
    rolled = explain.explain_pixels(model, pixels, "rollout")
    assert rolled.heat_map.shape == (grid, grid) and 0 <= rolled.heat_map.min() <= rolled.heat_map.max() <= 1
    assert len(rolled.top) == model.config.num_labels and abs(sum(p for _, p in rolled.top) - 1) < 1e-5  # <= 5 labels


def test_training_never_uses_eager_attention(base):
    from vit_finetune.model.loading import build_model
    from vit_finetune.recipe import ModelSettings

    model = build_model(ModelSettings(base=str(base), image_size=32), ["a", "b"])
    assert model.config._attn_implementation != "eager"


def test_explain_writes_one_picture_per_readable_image(base, tmp_path, capsys):
    photos = tmp_path / "photos"
    photos.mkdir()
    for name in ("red", "blue"):
        colour_image(COLOURS[name], np.random.default_rng(1)).save(photos / f"{name}.png")
    (photos / "broken.jpg").write_bytes(b"nope")
    assert main(["explain", str(base), str(photos), "--output-dir", str(tmp_path / "out"),
                 "--method", "gradient", "--class", "imagenet_3"]) == 0
    written = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert written == ["blue.gradient.png", "red.gradient.png"]
    assert "broken.jpg" in capsys.readouterr().out
    assert Image.open(tmp_path / "out" / "red.gradient.png").size[0] > 400


def test_explain_refuses_an_unknown_class_and_windowed_attention(base, tmp_path, capsys):
    from transformers import SwinConfig, SwinForImageClassification, ViTImageProcessor

    image = tmp_path / "red.png"
    colour_image(COLOURS["red"], np.random.default_rng(1)).save(image)
    assert main(["explain", str(base), str(image), "--method", "gradient", "--class", "dog"]) == 1
    assert "--class 'dog' is not a label of the model" in capsys.readouterr().err
    swin = tmp_path / "swin"
    SwinForImageClassification(SwinConfig(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[1, 2],
                                          window_size=4)).save_pretrained(swin)
    ViTImageProcessor(size={"height": 32, "width": 32}).save_pretrained(swin)
    assert main(["explain", str(swin), str(image), "--output-dir", str(tmp_path / "out")]) == 1
    assert "does not support 'swin' models" in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_position_similarity_maps():
    grid = torch.randn(4, 4, 8)
    maps = pictures.similarity_maps(grid)
    assert maps.shape == (4, 4, 4, 4)
    assert np.allclose([maps[i, j, i, j] for i in range(4) for j in range(4)], 1, atol=1e-6)
    assert np.allclose(maps.reshape(16, 16), maps.reshape(16, 16).T, atol=1e-6)
    table = torch.cat([torch.randn(1, 1, 8), grid.reshape(1, 16, 8)], dim=1)  # CLS + grid
    assert torch.equal(pictures.patch_grid(table), grid)
    image = pictures.mosaic(maps)
    assert image.shape == (4 * 5, 4 * 5) and np.isnan(image[4]).all() and image[0, 0] == pytest.approx(1)


def test_per_class_table_and_labelled_confusion_matrix(tmp_path):
    matrix = [[3, 1, 0], [0, 2, 2], [0, 0, 0]]  # rows: true a, b, c (c never occurs)
    report = evaluation.label_report(matrix, ["a", "b", "c"])
    assert report["confusion_matrix_labels"] == ["a", "b", "c"] and report["confusion_matrix_axes"].startswith("rows: true")
    assert report["per_class"]["a"] == {"precision": 1.0, "recall": 0.75, "f1": pytest.approx(6 / 7), "support": 4}
    assert report["per_class"]["b"]["precision"] == pytest.approx(2 / 3) and report["per_class"]["b"]["recall"] == 0.5
    assert report["per_class"]["c"] == {"precision": 0.0, "recall": 0.0, "f1": 0.0, "support": 0}
    shares = pictures.normalised_by_true_class(matrix)
    assert np.allclose(shares[:2].sum(1), 1) and np.all(shares[2] == 0)
    predicted, references = np.array([0, 1, 1, 2, 0]), np.array([0, 1, 2, 2, -1])
    assert pictures.misclassified_positions(predicted, references) == [2]  # -1: a skipped image, not a mistake


@pytest.mark.slow
def test_a_run_writes_its_pictures_and_shows_them_in_the_card(args, tmp_path):
    from runs import train

    output = tmp_path / "run"
    assert train([*args, f"output_dir={output}", "model.image_size=64", "train.epochs=1", "pictures=true"]) == 0
    card = (output / "README.md").read_text()
    metrics = json.loads((output / "metrics.json").read_text())
    for picture in ("position_embeddings.png", "confusion_matrix.png", "misclassified.png"):
        assert Image.open(output / picture).format == "PNG" and f"]({picture})" in card
    for label, scores in metrics["per_class"].items():
        assert f"| {label} | {scores['precision']:.3f} | {scores['recall']:.3f} | {scores['f1']:.3f} |" in card
    info = json.loads((output / "run_info.json").read_text())
    assert info["weights"] == "last step" and info["processes"] == 1 and info["device"].startswith("cpu")
    assert set(info["versions"]) == {"torch", "transformers", "peft", "accelerate", "datasets"}
    assert f'model="{output}"' in card and "github.com/)" not in card  # not pushed: the folder loads the model


@pytest.mark.slow
def test_a_run_without_pictures_draws_none_links_none_and_trains_the_same_model(args, tmp_path):
    from runs import assert_bit_identical, train

    drawn, plain = tmp_path / "drawn", tmp_path / "plain"
    run = [*args, "model.image_size=64", "train.epochs=1"]
    assert train([*run, f"output_dir={drawn}", "pictures=true"]) == 0
    assert train([*run, f"output_dir={plain}", "pictures=false"]) == 0
    pictures = {path.name for path in drawn.glob("*.png")}
    assert pictures == {"training_curves.png", "position_embeddings.png", "confusion_matrix.png", "misclassified.png"}
    assert not list(plain.glob("*.png"))
    assert not [name for name in pictures if name in (plain / "README.md").read_text()]
    assert_bit_identical(plain / "model.safetensors", drawn / "model.safetensors")
    assert json.loads((plain / "metrics.json").read_text()) == json.loads((drawn / "metrics.json").read_text())


def test_card_usage_names_the_repo_when_pushed_and_the_folder_otherwise(tmp_path):
    from vit_finetune.artifacts.card import model_card, usage_id
    from vit_finetune.recipe import load_recipe

    metrics = {"accuracy": 0.5, "eval_samples": 4, "eval_split": "validation", "eval_carved_from_train": False}
    pushed = load_recipe("demo", ["hub.push=true", "hub.repo_id=you/shapes"])
    local = load_recipe("demo", ["hub.repo_id=you/shapes"])  # a repo id alone does not publish anything
    assert usage_id(pushed, tmp_path) == "you/shapes" and usage_id(local, tmp_path) == str(tmp_path)
    card = str(model_card(local, metrics, ["a", "b"], "shapes", False, usage_id(local, tmp_path)))
    assert f'model="{tmp_path}"' in card and "https://github.com/" not in card
