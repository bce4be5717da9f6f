"""Fuzzed recipes: whatever YAML file and key=value overrides a user gives, the answer is a valid recipe
or a RecipeError whose message lists the problems, never another exception, never a traceback.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from vit_finetune.cli import main
from vit_finetune.recipe import Recipe, RecipeError, apply_overrides, load_recipe, read_yaml, validate
from vit_finetune.recipe.loading import _valid_keys

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
VALID_KEYS = _valid_keys(Recipe)

# Keys: the schema's own, near misses of them, and anything at all.
keys = st.one_of(
    st.sampled_from(VALID_KEYS),
    st.sampled_from(VALID_KEYS).map(lambda key: key[:-1] or "x"),
    st.sampled_from(VALID_KEYS).map(lambda key: key + ".sub"),
    st.text(min_size=0, max_size=20),
)
scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=30),
    st.text(alphabet="ab.", min_size=256, max_size=300),  # too long to be a file name: stat() raises
    st.sampled_from(["auto", "no", "cosine", "zero", "[1, 2]", "{r: 4}", "query", "~", ".inf", "-1"]),
)
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                       st.dictionaries(st.text(max_size=8), inner, max_size=3)),
                      max_leaves=6)


@st.composite
def recipe_mappings(draw) -> dict:
    """A nested mapping shaped like a recipe: sections, dotted keys expanded, values of any type."""
    data: dict = {}
    for key, value in draw(st.lists(st.tuples(keys, values), max_size=6)):
        node, parts = data, key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {}) if isinstance(node.get(part, {}), dict) else node
        node[parts[-1]] = value
    return data


documents = st.one_of(
    recipe_mappings().map(lambda data: yaml.safe_dump(data, allow_unicode=True)),
    st.text(max_size=200),  # anything: broken YAML, a list, a scalar, tabs...
    st.sampled_from(["", "---\n", "- a\n- b\n", "model: [", "!!python/object/apply:os.system ['true']\n",
                     "model: !!python/name:os.system\n", "train: {lr: &a 1, seed: *a}\n", "? [a]\n: 1\n"]),
)
overrides = st.lists(st.one_of(
    st.tuples(keys, st.text(max_size=30)).map("=".join),
    st.tuples(keys, scalars.map(lambda v: yaml.safe_dump(v).removesuffix("\n...\n").strip())).map("=".join),
    st.text(max_size=30),
), max_size=4)


def load_or_refuse(path: Path, given_overrides: list[str]):
    try:
        return load_recipe(str(path), given_overrides)
    except RecipeError as error:
        assert error.problems and all(isinstance(p, str) and p for p in error.problems)
        assert str(error).count("\n  - ") == len(error.problems)  # every problem on a line of its own
        return error


@pytest.fixture(scope="module")
def recipe_file(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz") / "recipe.yaml"


LONG_NAME = ["train.resume=" + "a" * 300]  # found by hand: stat() raised "File name too long"


@FUZZ
@given(document=documents, given_overrides=overrides)
@example(document="", given_overrides=LONG_NAME)
def test_any_yaml_and_overrides_load_or_give_a_recipe_error(recipe_file, document, given_overrides):
    recipe_file.write_text(document)
    load_or_refuse(recipe_file, given_overrides)


@FUZZ
@given(raw=st.binary(max_size=200))
def test_any_bytes_as_a_recipe_file_give_a_recipe_error_naming_the_file(recipe_file, raw):
    recipe_file.write_bytes(raw)
    result = load_or_refuse(recipe_file, [])
    if isinstance(result, RecipeError) and any("UTF-8" in p for p in result.problems):
        assert str(recipe_file) in str(result)


@FUZZ
@given(data=recipe_mappings(), given_overrides=overrides)
def test_apply_overrides_then_validate_never_raise_anything_else(data, given_overrides):
    try:
        validate(apply_overrides(data, given_overrides))
    except RecipeError as error:
        assert error.problems


@FUZZ
@given(document=documents, given_overrides=overrides)
@example(document="", given_overrides=LONG_NAME)
def test_the_cli_prints_a_recipe_or_one_clean_error(recipe_file, document, given_overrides):
    recipe_file.write_text(document)
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            code = main(["--recipe", str(recipe_file), "--print", *given_overrides])
        except SystemExit as usage:  # argparse: an override that looks like an option (-x=1)
            code = usage.code
            assert code == 2 and "usage:" in stderr.getvalue()
            return
    assert "Traceback" not in stderr.getvalue()
    if code == 0:
        printed = yaml.safe_load(stdout.getvalue())
        assert Recipe.model_validate(printed) == load_recipe(str(recipe_file), given_overrides)
    else:
        assert code == 2 and stderr.getvalue().startswith("error: ")


@FUZZ
@given(name=st.one_of(st.text(max_size=40), st.text(alphabet="ab.", min_size=256, max_size=300)))
def test_any_recipe_name_is_found_or_refused_with_the_shipped_names(name):
    try:
        load_recipe(name)
    except RecipeError as error:
        assert error.problems


def test_a_recipe_can_never_construct_python_objects(recipe_file, tmp_path):
    marker = tmp_path / "ran"
    recipe_file.write_text(f"model: !!python/object/apply:os.system ['touch {marker}']\n")
    with pytest.raises(RecipeError, match="not valid YAML"):
        read_yaml(recipe_file)
    assert not marker.exists()
