"""Every shipped recipe validates; overrides are typed by the schema; bad recipes list all their errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from vit_finetune.artifacts import checkpoint
from vit_finetune.recipe import (
    RECIPE_DIRS, Recipe, RecipeError, apply_overrides, available_recipes, find_recipe, load_recipe, recipe_files,
    to_yaml, validate,
)

# Recursive: recipes in sub-folders count too (recipes/accelerate/ holds Accelerate's configs: test_sharded.py).
RECIPE_FILES = recipe_files(Path(RECIPE_DIRS[0]))


def test_the_required_recipes_are_shipped():
    assert {"demo", "food101_384", "food101_384_lora", "cifar100_384", "oxford_pets_384"} <= set(available_recipes())


@pytest.mark.parametrize("path", RECIPE_FILES, ids=[p.stem for p in RECIPE_FILES])
def test_every_recipe_file_validates_and_documents_its_command(path):
    recipe = load_recipe(str(path))
    assert isinstance(recipe, Recipe)
    header = path.read_text().splitlines()[:4]
    assert header[0].startswith("#"), "a recipe opens with a comment saying what it is"
    assert any("vit_finetune --recipe" in line for line in header), "and the command that runs it"
    # a round trip through the resolved form changes nothing
    assert validate(yaml.safe_load(to_yaml(recipe))) == recipe


def test_food101_recipe_is_the_original_vit_family():
    recipe = load_recipe("food101_384")
    assert recipe.model.base == "google/vit-base-patch16-224" and recipe.model.image_size == 384
    assert recipe.model.lora is None and recipe.train.optimizer == "sgd" and recipe.train.momentum == 0.9
    assert recipe.train.batch_size * recipe.train.grad_accum == 512
    assert recipe.train.scheduler == "cosine" and recipe.train.warmup_steps > 0 and recipe.train.max_grad_norm == 1.0
    lora = load_recipe("food101_384_lora")
    assert lora.model.lora is not None and lora.train.optimizer == "adamw"


def test_overrides_are_typed_by_the_schema():
    recipe = load_recipe("food101_384", ["train.lr=3e-4", "train.epochs=2", "data.max_train_samples=2000",
                                         "model.lora.r=8", "train.mixed_precision=no", "hub.private=true",
                                         "data.crop_scale=[0.5, 1.0]"])
    assert recipe.train.lr == pytest.approx(3e-4) and isinstance(recipe.train.lr, float)
    assert recipe.train.epochs == 2 and recipe.data.max_train_samples == 2000
    assert recipe.model.lora.r == 8 and recipe.model.lora.target_modules == ["query", "value"]
    assert recipe.hub.private is True and recipe.data.crop_scale == (0.5, 1.0)
    assert load_recipe("food101_384_lora", ["model.lora=null"]).model.lora is None


def test_override_creates_nested_keys_without_touching_others():
    data = apply_overrides({"train": {"lr": 1.0}}, ["train.seed=7", "model.image_size=224"])
    assert data == {"train": {"lr": 1.0, "seed": 7}, "model": {"image_size": 224}}


def test_all_errors_are_reported_at_once_with_keys_values_and_fixes():
    with pytest.raises(RecipeError) as caught:
        load_recipe("food101_384", ["train.lrr=0.1", "train.lr=fast", "model.image_size=big", "train.optimizer=adam",
                                    "hub.repo_id=a/b/c"])
    problems = caught.value.problems
    assert len(problems) == 5
    text = str(caught.value)
    assert "unknown key 'train.lrr'; did you mean 'train.lr'?" in text
    assert "train.lr='fast'" in text and "model.image_size='big'" in text
    assert "train.optimizer='adam'" in text and "'adamw'" in text and "'sgd'" in text
    assert "'a/b/c' is not a valid Hub repo id" in text


@pytest.mark.parametrize("typed, meant", [
    ("train.learning_rate", "train.lr"),  # difflib alone: 'train.early_stopping_patience'
    ("learning_rate", "train.lr"),  # no section: the synonym's own
    ("model.model_name_or_path", "model.base"),  # transformers' examples' name
    ("train.wd", "train.weight_decay"),
])
def test_an_unknown_key_gets_the_key_it_most_likely_means(typed, meant):
    with pytest.raises(RecipeError) as caught:
        load_recipe("demo", [f"{typed}=1"])
    assert f"unknown key {typed!r}; did you mean {meant!r}?" in str(caught.value)


def test_the_rules_between_keys_list_each_broken_one_apart_by_its_keys():
    """Within a section and across the whole recipe: one problem per broken rule, each naming its keys, never the
    section's values dumped in front of them."""
    with pytest.raises(RecipeError) as caught:
        load_recipe(None, ["data.task=multi_label", "data.class_balance=sampler", "data.target_columns=[a]",
                           "data.label_names=[x]"])
    problems = caught.value.problems
    assert len(problems) == 4
    assert problems[0].startswith("data.class_balance=sampler draws images by their one class")
    assert problems[1].startswith("data.target_columns names a regression's targets")
    assert problems[2].startswith("data.label_names names the classes of a stream's")
    assert problems[3].startswith("data.label_names=['x'] must hold at least two distinct names")
    with pytest.raises(RecipeError) as caught:
        load_recipe(None, ["hub.push=true", "train.early_stopping_patience=2"])
    assert [problem.split(" ")[0] for problem in caught.value.problems] == ["hub.push=true",
                                                                            "train.early_stopping_patience"]


@pytest.mark.parametrize("given, task", [("true", "multi_label"), ("false", "single_label")])
def test_data_multi_label_is_read_as_data_task_and_said_in_one_line(given, task):
    """data.multi_label, data.task's older spelling, keeps working: it is folded into data.task when the recipe is
    read, so nothing after it has two keys to reconcile, and the run is told so in one line."""
    notes: list[str] = []
    recipe = load_recipe(None, [f"data.multi_label={given}"], notes)
    assert (recipe.data.task, recipe.data.multi_label) == (task, None)
    assert notes == [f"data.multi_label={given}: read as data.task={task} (data.multi_label is the older spelling "
                     "of data.task)"]
    assert load_recipe(None, [f"data.task={task}", f"data.multi_label={given}"]).data == recipe.data
    other = "single_label" if task == "multi_label" else "multi_label"
    with pytest.raises(RecipeError, match=f"data.task={other} and data.multi_label={given} contradict each other"):
        load_recipe(None, [f"data.task={other}", f"data.multi_label={given}"])
    with pytest.raises(RecipeError, match=r"data.task=regression has no classes: data.multi_label="):
        load_recipe(None, ["data.task=regression", f"data.multi_label={given}"])


def test_a_checkpoint_that_saved_data_multi_label_resumes_under_data_task(tmp_path):
    """A checkpoint written before the fold saved data.multi_label beside data.task=auto: the same command, now read
    as data.task=multi_label, is the same recipe to a resume."""
    asked = load_recipe(None, ["data.multi_label=true"])
    saved = asked.model_dump(mode="json")
    saved["data"].update(task="auto", multi_label=True)
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(saved))
    (tmp_path / "trainer_state.json").write_text("{}")
    assert checkpoint.changed_keys(tmp_path, asked) == []
    assert checkpoint.changed_keys(tmp_path, load_recipe(None, ["data.task=single_label"])) == [
        "data.task: 'multi_label' -> 'single_label'"]


def test_a_recipe_is_frozen_once_read():
    """What a run changes (plan.py) is a copy: a recipe read and checked is never changed in place."""
    recipe = load_recipe(None)
    with pytest.raises(ValueError, match="frozen"):
        recipe.train.lr = 0.1
    assert recipe.train.lr == "auto"


@pytest.mark.parametrize("repo_id", ["a/b/c", "my repo", "user/my model", "-bad/name", "user/"])
def test_invalid_repo_ids_are_rejected_at_validation(repo_id):
    with pytest.raises(RecipeError, match="not a valid Hub repo id"):
        load_recipe(None, [f"hub.repo_id={repo_id}"])


def test_cross_field_checks():
    with pytest.raises(RecipeError, match="hub.push=true needs hub.repo_id"):
        load_recipe(None, ["hub.push=true"])
    with pytest.raises(RecipeError, match="warmup_steps=10 must be smaller than train.max_steps=5"):
        load_recipe(None, ["train.warmup_steps=10", "train.max_steps=5"])
    with pytest.raises(RecipeError, match="crop_scale"):
        load_recipe(None, ["data.crop_scale=[0.9, 0.1]"])


def test_unknown_recipe_name_lists_the_available_ones():
    with pytest.raises(RecipeError) as caught:
        find_recipe("food101")
    assert "Did you mean 'food101_384'?" in str(caught.value)
    for name in available_recipes():
        assert name in str(caught.value)


def test_a_malformed_override_is_explained():
    with pytest.raises(RecipeError, match="must look like section.key=value"):
        load_recipe(None, ["train.lr"])


def test_recipes_are_read_with_the_safe_loader(tmp_path):
    hostile = tmp_path / "hostile.yaml"
    hostile.write_text("train: !!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(RecipeError, match="not valid YAML"):
        load_recipe(str(hostile))


@pytest.mark.parametrize("value", ["inf", ".inf", "nan", "1e38"])
def test_a_learning_rate_must_be_finite_and_plausible(value):
    with pytest.raises(RecipeError, match="train.lr"):
        load_recipe(None, [f"train.lr={value}"])


def test_resume_ignore_changes_must_name_real_keys():
    assert load_recipe(None, ["train.resume_ignore_changes=[train.epochs]"]).train.resume_ignore_changes == ["train.epochs"]
    with pytest.raises(RecipeError, match=r"unknown keys \['train.epoch'\]"):
        load_recipe(None, ["train.resume_ignore_changes=[train.epoch]"])


@pytest.mark.parametrize("text, key, where", [
    ("train:\n  lr: 0.01\nmodel:\n  image_size: 32\ntrain:\n  epochs: 3\n", "'train'", "on lines 1 and 5"),
    ("train:\n  lr: 0.01\n  epochs: 2\n  lr: 0.02\n", "'lr'", "on lines 2 and 4"),
    ("model: {lora: {r: 2, r: 4}}\n", "'r'", "on line 1"),
])
def test_a_key_given_twice_in_a_recipe_is_refused_with_its_lines(tmp_path, text, key, where):
    """YAML itself forbids it; PyYAML kept the last block and dropped the first's keys without a word."""
    path = tmp_path / "twice.yaml"
    path.write_text(text)
    with pytest.raises(RecipeError) as caught:
        load_recipe(str(path))
    assert f"the key {key} is given twice, {where}" in str(caught.value) and "merge them into one" in str(caught.value)


def test_a_key_given_twice_in_an_override_is_refused_and_a_merge_key_may_still_be_overridden(tmp_path):
    with pytest.raises(RecipeError, match="the key 'r' is given twice"):
        load_recipe(None, ["model.lora={r: 2, r: 4}"])
    path = tmp_path / "merged.yaml"  # YAML's merge key: its values are defaults the mapping may override
    path.write_text("train:\n  resume_ignore_changes: &keys [train.epochs]\n  distill:\n    <<: {teacher: a, weight: 0.3}\n"
                    "    weight: 0.7\n")
    assert load_recipe(str(path)).train.distill.weight == 0.7


@pytest.mark.parametrize("holds", [["demo.yaml", "mine.yaml"], []])
def test_a_folder_given_as_recipe_is_named_as_a_folder_with_the_recipes_it_holds(tmp_path, holds):
    folder = tmp_path / "my_recipes"
    folder.mkdir()
    for name in holds:
        (folder / name).write_text("train: {epochs: 1}\n")
    with pytest.raises(RecipeError) as caught:
        load_recipe(str(folder))
    message = str(caught.value)
    assert f"{str(folder)!r} is a folder, not a recipe file" in message and "does not exist" not in message
    if holds:
        assert "the recipes in it: demo.yaml, mine.yaml" in message and f"--recipe {folder}/demo.yaml" in message
    else:
        assert "holds no .yaml recipe" in message and "--list-recipes" in message
