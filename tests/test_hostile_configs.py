"""Recipes and base configs that used to end in a Python traceback (or a huge allocation): each is refused with
the key, the value and the fix, before any model is built or any file written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from runs import RECIPE, train

SHORT = ["train.max_steps=2"]


def refused(args: list[str], capsys, code: int) -> str:
    assert train(args) == code
    err = capsys.readouterr().err
    assert "Traceback" not in err and "Loading weights" not in err, err[-3000:]
    return err


def test_a_recipe_nested_thousands_deep_is_refused(args, tmp_path, capsys):
    deep = tmp_path / "deep.yaml"
    deep.write_text("data:\n  image_column: " + "[" * 5000 + "]" * 5000 + "\n")
    err = refused(["--recipe", str(deep), *args, f"output_dir={tmp_path / 'out'}"], capsys, 2)
    assert "nested" in err and str(deep) in err
    override = "data.image_column=" + "[" * 5000 + "]" * 5000
    err = refused([*args, override, f"output_dir={tmp_path / 'out'}"], capsys, 2)
    assert "data.image_column" in err and "nested" in err
    # Deep enough to pass YAML, too deep for a recipe: refused by the schema's own depth limit.
    err = refused([*args, "data.image_column=" + "[" * 200 + "]" * 200, f"output_dir={tmp_path / 'out'}"], capsys, 2)
    assert "nested" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("seed", ["-5", str(2**32)])
def test_a_seed_outside_what_the_generators_take_is_a_recipe_error(args, tmp_path, capsys, seed):
    err = refused([*args, f"train.seed={seed}", f"output_dir={tmp_path / 'out'}"], capsys, 2)
    assert f"train.seed={seed}" in err and "4294967295" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("key", ["output_dir", "data.dataset", "model.base"])
def test_a_path_component_longer_than_file_systems_allow_is_a_recipe_error(args, tmp_path, capsys, key):
    long_path = tmp_path / ("a" * 300) / "x"
    out = [] if key == "output_dir" else [f"output_dir={tmp_path / 'out'}"]
    err = refused([*args, *out, f"{key}={long_path}"], capsys, 2)
    assert f"{key}=" in err and "300 bytes" in err and "255" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("repo_id", ["user/a--b", "user/x.git", "user/a..b", "user/-x", "user/x-"])
def test_a_repo_id_the_hub_would_refuse_is_refused_before_training(args, tmp_path, capsys, repo_id):
    err = refused([*args, *SHORT, "hub.push=true", f"hub.repo_id={repo_id}", f"output_dir={tmp_path / 'out'}"],
                  capsys, 2)
    assert f"hub.repo_id={repo_id!r}" in err and "not a valid Hub repo id" in err
    assert not (tmp_path / "out").exists()


def base_with(base: Path, folder: Path, **changes) -> Path:
    shutil.copytree(base, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("change, message", [
    ({"patch_size": 0}, "patch_size=0"),
    ({"patch_size": -4}, "patch_size=-4"),
    ({"image_size": 100000}, "a 25000x25000 grid"),
    ({"id2label": {str(i): f"l{i}" for i in range(1_000_000)}}, "1,000,000 labels"),
])
def test_a_base_config_that_would_allocate_wildly_or_divide_by_zero_is_refused_from_config_json(
        base, images, tmp_path, capsys, change, message):
    damaged = base_with(base, tmp_path / "base", **change)
    err = refused([f"model.base={damaged}", f"data.dataset={images}", *RECIPE, *SHORT,
                   f"output_dir={tmp_path / 'out'}"], capsys, 1)
    error = next(line for line in reversed(err.splitlines()) if line.startswith("error: "))
    assert f"model.base={str(damaged)!r}" in error and message in error, error
    assert not (tmp_path / "out").exists()


def whole_number_keys(section=None, prefix: str = "") -> list[str]:
    """Every recipe key whose value may be a whole number (alone, or beside auto or null), read off the schema."""
    import types
    import typing

    from pydantic import BaseModel

    from vit_finetune.recipe import Recipe

    def members(annotation) -> list:
        if typing.get_origin(annotation) is typing.Annotated:
            return members(typing.get_args(annotation)[0])
        if typing.get_origin(annotation) in (typing.Union, types.UnionType):
            return [member for argument in typing.get_args(annotation) for member in members(argument)]
        return [annotation]

    keys = []
    for name, field in (section or Recipe).model_fields.items():
        kinds = members(field.annotation)
        sections = [kind for kind in kinds if isinstance(kind, type) and issubclass(kind, BaseModel)]
        for inner in sections:
            keys += whole_number_keys(inner, f"{prefix}{name}.")
        if not sections and int in kinds:
            keys.append(prefix + name)
    return keys


def test_every_whole_number_key_refuses_a_number_that_would_overflow_or_run_for_years_when_the_recipe_is_read():
    from vit_finetune.recipe import RecipeError, load_recipe
    from vit_finetune.recipe.limits import UNBOUNDED_WHOLE_NUMBERS, WHOLE_NUMBER_LIMITS

    keys = whole_number_keys()
    assert {"train.grad_accum", "train.epochs", "model.image_size", "data.num_workers"} <= set(keys)
    assert set(WHOLE_NUMBER_LIMITS) | set(UNBOUNDED_WHOLE_NUMBERS) >= set(keys)  # a new key says which it is
    for key in keys:
        if key in UNBOUNDED_WHOLE_NUMBERS:
            continue
        with pytest.raises(RecipeError) as caught:
            load_recipe(None, [f"{key}={10 ** 20}"])
        assert f"{key}={10 ** 20}" in str(caught.value)
        if key in WHOLE_NUMBER_LIMITS:
            limit, why = WHOLE_NUMBER_LIMITS[key]
            assert f"must be at most {limit:,} ({why})" in str(caught.value)


def test_a_twenty_digit_grad_accum_is_a_recipe_error_before_data_or_model_load(args, tmp_path, capsys):
    err = refused([*args, "train.grad_accum=99999999999999999999", f"output_dir={tmp_path / 'out'}"], capsys, 2)
    assert "train.grad_accum=99999999999999999999: must be at most 65,536" in err and "OverflowError" not in err
    assert not (tmp_path / "out").exists()


@pytest.mark.timeout(120)  # before the check, 2048 px hung in the first forward pass
@pytest.mark.parametrize("size", [2048, 8192])
def test_a_target_grid_over_256_patches_a_side_is_refused_from_the_config_before_weights_load(args, tmp_path,
                                                                                            capsys, size):
    from vit_finetune.model import loading as vit

    def never_built(*_args, **_kwargs):
        raise AssertionError("the model was built")

    assert train([*args, f"model.image_size={size}", f"output_dir={tmp_path / 'out'}"],
                 patches=[(vit, "build_model", never_built)]) == 1
    err = capsys.readouterr().err
    error = next(line for line in reversed(err.splitlines()) if line.startswith("error: "))
    grid = size // 4  # the tiny ViT's patch is 4 px
    assert f"model.image_size={size} at the base's patch size 4 makes a {grid}x{grid} grid" in error, error
    assert "at most 256 a side" in error and "Fix: model.image_size=1024 or less" in error
    assert not (tmp_path / "out").exists()
