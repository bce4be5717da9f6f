"""Recipes: the typed schema of a run, YAML loading, dotted overrides and error reporting.

A recipe is the single source of truth for a run. Every error of a recipe is reported at once, each naming the key,
the value and the fix, before anything expensive starts. The package's modules, lowest first: limits.py (the limits
input must fit), checks.py (every rule between keys), fields.py (the field types), train_section.py (the train
section), schema.py (the other sections and the recipe), loading.py (find, read, override, validate, write, and the
keys' meanings).
"""

from __future__ import annotations

from vit_finetune.recipe.checks import (
    flatten, fold_older_spellings, pixel_drawing_settings, probe_unused_settings, step_only_settings,
    weight_selection_settings, without_pixel_draws,
)
from vit_finetune.recipe.fields import HOME_PATH_KEYS
from vit_finetune.recipe.loading import (
    RECIPE_DIRS, RecipeError, apply_overrides, available_recipes, default_values, find_recipe, format_keys,
    key_descriptions, load_recipe, read_yaml, recipe_files, to_yaml, validate, write_recipe,
)
from vit_finetune.recipe.schema import AugmentSettings, DataSettings, HubSettings, LoraSettings, ModelSettings, Recipe
from vit_finetune.recipe.train_section import DistillSettings, TrainSettings

__all__ = ["HOME_PATH_KEYS", "RECIPE_DIRS",
           "AugmentSettings", "DataSettings", "DistillSettings", "HubSettings", "LoraSettings", "ModelSettings",
           "Recipe", "RecipeError", "TrainSettings", "apply_overrides", "available_recipes", "default_values",
           "find_recipe", "flatten", "fold_older_spellings", "format_keys", "key_descriptions", "load_recipe",
           "pixel_drawing_settings", "probe_unused_settings", "read_yaml", "recipe_files", "step_only_settings", "to_yaml", "validate",
           "weight_selection_settings", "without_pixel_draws", "write_recipe"]
