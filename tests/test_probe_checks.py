"""What the base's features decide before training (vit_finetune.training.probe_checks): the flip from the mirror test, the
colour transparent pixels are laid on, and the line that says the eval images look unlike the training images. Every
run is the real CLI on the tiny ViT; the decisions are read back from the recipe as run and metrics.json."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

from runs import RECIPE, assert_bit_identical, train
from vit_finetune.data import CROP_UNDER_SHIFT, CROP_UNDER_SHIFT_GAINED_UP_TO, auto_crop_scale_under_shift
from tiny import write_colour_folder

# Every run here needs its flip and background resolved by auto, and nothing else from auto that takes time.
AUTO = ["data.horizontal_flip=auto", "data.alpha_background=auto"]


def resolved(out: Path) -> dict:
    return yaml.safe_load((out / "recipe.yaml").read_text())["data"]


def write_halves(root: Path, train_count: int = 16, validation: int = 6, seed: int = 0,
                 striped_validation: bool = False) -> Path:
    """Two classes a mirror swaps: bright on the left half, bright on the right half; `striped_validation`: the
    validation images striped, as another source's."""
    rng = np.random.default_rng(seed)
    for split, count in (("train", train_count), ("validation", validation)):
        for name, side in (("left", 0), ("right", 1)):
            folder = root / split / name
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(count):
                pixels = rng.normal(60, 20, (32, 32, 3))
                pixels[:, side * 16:(side + 1) * 16] += 140
                if striped_validation and split == "validation":
                    pixels[::4] = 255 - pixels[::4]
                Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(folder / f"{i}.png")
    return root


def test_the_mirror_test_turns_the_flip_off_where_a_mirror_swaps_the_classes(base, tmp_path, capsys):
    data = write_halves(tmp_path / "halves")
    out = tmp_path / "out"
    assert train([f"model.base={base}", f"data.dataset={data}", *RECIPE, *AUTO, f"output_dir={out}"]) == 0
    assert resolved(out)["horizontal_flip"] is False
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("data.horizontal_flip=auto"))
    assert "a mirror image is another thing" in line, line


def test_the_mirror_test_turns_the_flip_on_where_a_mirror_keeps_the_classes(base, images, tmp_path, capsys):
    out = tmp_path / "out"
    assert train([f"model.base={base}", f"data.dataset={images}", *RECIPE, *AUTO, f"output_dir={out}"]) == 0
    assert resolved(out)["horizontal_flip"] is True
    assert "to the base a mirror image is the same thing" in capsys.readouterr().out


def test_with_random_weights_or_a_regression_the_flip_stays_off_and_says_why(base, images, tmp_path, capsys):
    out = tmp_path / "out"
    assert train([f"model.base={base}", f"data.dataset={images}", *RECIPE, *AUTO, "model.pretrained=false",
                  f"output_dir={out}"]) == 0
    assert resolved(out)["horizontal_flip"] is False
    assert "random features cannot tell whether a mirror image is the same thing" in capsys.readouterr().out


def test_images_without_transparency_keep_alpha_dropped_and_train_bit_identically(base, images, tmp_path, capsys):
    auto, dropped = tmp_path / "auto", tmp_path / "dropped"
    common = [f"model.base={base}", f"data.dataset={images}", *RECIPE, "data.horizontal_flip=false"]
    assert train([*common, "data.alpha_background=auto", f"output_dir={auto}"]) == 0
    assert "data.alpha_background=auto -> null: 0 of the" in capsys.readouterr().out
    assert train([*common, "data.alpha_background=null", f"output_dir={dropped}"]) == 0
    assert resolved(auto)["alpha_background"] is None
    assert "alpha_background" not in json.loads((auto / "config.json").read_text())
    assert_bit_identical(auto / "model.safetensors", dropped / "model.safetensors")


def write_two_sources(root: Path, seed: int = 0) -> Path:
    """The same three colours, trained from smooth images and evaluated on striped ones: another source."""
    rng = np.random.default_rng(seed)
    write_colour_folder(root, classes=3, train=16, validation=0, seed=seed)
    for name, rgb in (("red", (210, 40, 40)), ("green", (40, 190, 60)), ("blue", (40, 60, 210))):
        folder = root / "validation" / name
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(16):
            pixels = np.clip(np.array(rgb) + rng.normal(0, 35, (48, 40, 3)), 0, 255)
            pixels[::4] = 255 - pixels[::4]
            Image.fromarray(pixels.astype(np.uint8)).save(folder / f"{i}.png")
    return root


@pytest.mark.parametrize("shifted", [True, False])
def test_eval_images_from_another_source_are_named_and_recorded(base, tmp_path, capsys, shifted):
    data = write_two_sources(tmp_path / "two") if shifted else write_colour_folder(tmp_path / "one", 3, 16, 16)
    out = tmp_path / "out"
    assert train([f"model.base={base}", f"data.dataset={data}", *RECIPE, *AUTO, f"output_dir={out}"]) == 0
    recorded = json.loads((out / "metrics.json").read_text())["eval_unlike_train"]
    assert recorded["likely"] is shifted, recorded
    said = capsys.readouterr().out
    assert ("the eval images look unlike the training images" in said) is shifted
    # A run judged on another source crops, as the shift study measured it there; one judged on its own source not.
    assert resolved(out)["crop_scale"] == ([0.08, 1.0] if shifted else [1.0, 1.0])
    assert ("data.crop_scale=auto -> random crops of 8% to 100% of the area, in place of no crop" in said) is shifted


@pytest.mark.parametrize("overrides, kept", [
    (["data.crop_scale=[0.5, 1.0]"], [0.5, 1.0]),  # a crop the user chose stays theirs
    (["train.method=linear_probe"], [1.0, 1.0]),  # the probe alone reads each image once, unaugmented
])
def test_a_run_judged_on_another_source_keeps_a_crop_it_did_not_leave_to_auto(base, tmp_path, capsys, overrides,
                                                                               kept):
    data = write_two_sources(tmp_path / "two")
    out = tmp_path / "out"
    assert train([f"model.base={base}", f"data.dataset={data}", *RECIPE, *AUTO, *overrides, f"output_dir={out}"]) == 0
    said = capsys.readouterr().out
    assert "the eval images look unlike the training images" in said
    assert resolved(out)["crop_scale"] == kept and "in place of no crop" not in said


def test_a_run_judged_on_another_source_does_not_crop_where_a_mirror_swaps_the_classes(base, tmp_path, capsys):
    data = write_halves(tmp_path / "halves", validation=16, striped_validation=True)
    out = tmp_path / "out"
    assert train([f"model.base={base}", f"data.dataset={data}", *RECIPE, *AUTO, f"output_dir={out}"]) == 0
    said = capsys.readouterr().out
    assert json.loads((out / "metrics.json").read_text())["eval_unlike_train"]["likely"] is True
    assert resolved(out)["horizontal_flip"] is False  # the mirror test: a mirror image is another thing here
    assert resolved(out)["crop_scale"] == [1.0, 1.0] and "in place of no crop" not in said
    # and the console says why the crop a run judged on another source may get was not taken
    assert ("data.crop_scale=auto stays at no random crop for eval images from another source: to the base a mirror "
            "image may be another thing") in " ".join(said.split())


def test_the_crop_for_another_source_needs_a_mirror_to_keep_the_labels_and_stops_where_it_stopped_gaining():
    measured = CROP_UNDER_SHIFT_GAINED_UP_TO
    assert auto_crop_scale_under_shift(measured, True)[0] == CROP_UNDER_SHIFT == (0.08, 1.0)
    scale, why = auto_crop_scale_under_shift(measured + 1, True)
    assert scale == (1.0, 1.0) and f"crops gained up to {measured:,}" in why
    # Where a mirror image is another thing to the base (digits, letters) or the test could not run: no crop.
    for answer in (False, None):
        scale, why = auto_crop_scale_under_shift(measured, answer)
        assert scale == (1.0, 1.0) and "mirror image may be another thing" in why


def write_discs(root: Path, under: str, seed: int = 0) -> Path:
    """Three classes of coloured discs on transparent corners, RGBA. Under the transparent pixels the file stores
    black (`under="flat"`, what most exporters leave) or the disc's own colours with noise (`under="bleeding"`: with
    alpha dropped, every image is a filled square)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[:32, :32]
    inside = (y - 15.5) ** 2 + (x - 15.5) ** 2 < 12 ** 2
    for split, count in (("train", 8), ("validation", 3)):
        for name, rgb in (("red", (210, 40, 40)), ("green", (40, 190, 60)), ("blue", (40, 60, 210))):
            folder = root / split / name
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(count):
                colour = np.clip(np.array(rgb) + rng.normal(0, 20, (32, 32, 3)), 0, 255)
                pixels = np.zeros((32, 32, 4), dtype=np.uint8)
                pixels[..., :3] = colour if under == "bleeding" else colour * inside[..., None]
                pixels[..., 3] = 255 * inside
                Image.fromarray(pixels, "RGBA").save(folder / f"{i}.png")
    return root


def test_transparency_over_one_flat_colour_keeps_alpha_dropped_bit_identically(base, tmp_path, capsys):
    images = write_discs(tmp_path / "flat", "flat")
    auto, dropped = tmp_path / "auto", tmp_path / "dropped"
    common = [f"model.base={base}", f"data.dataset={images}", *RECIPE]
    assert train([*common, "data.alpha_background=auto", f"output_dir={auto}"]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("data.alpha_background=auto"))
    assert line.startswith("data.alpha_background=auto -> null: 24 of the 24") and "0 of them with more than" in line
    assert train([*common, "data.alpha_background=null", f"output_dir={dropped}"]) == 0
    assert_bit_identical(auto / "model.safetensors", dropped / "model.safetensors")


def test_colours_bleeding_under_transparency_are_laid_on_white_and_saved_with_the_model(base, tmp_path, capsys):
    images = write_discs(tmp_path / "bleeding", "bleeding")
    out = tmp_path / "out"
    assert train([f"model.base={base}", f"data.dataset={images}", *RECIPE, "data.alpha_background=auto",
                  f"output_dir={out}"]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("data.alpha_background=auto"))
    assert line.startswith("data.alpha_background=auto -> white: 24 of the 24") and "24 of them with more than" in line
    assert resolved(out)["alpha_background"] == "white"
    assert json.loads((out / "config.json").read_text())["alpha_background"] == "white"
