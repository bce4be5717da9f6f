"""Loading a recipe: find it by name or path, read its YAML within the input limits, apply `key.sub=value`
overrides, validate it against the schema with every problem described for a user (the key, the value, the fix, a
did-you-mean), and write the resolved recipe back; the keys' meanings and defaults, for `--keys`.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError
from pydantic_core import to_jsonable_python

from vit_finetune.core.errors import EXIT_USAGE, VitFinetuneError, excerpt
from vit_finetune.core.layout import PACKAGE_DIR, RECIPE_FILE
from vit_finetune.recipe.checks import PROBLEMS_APART, as_yaml_value, flatten, older_spellings
from vit_finetune.recipe.limits import (
    MAX_RECIPE_BYTES, MAX_RECIPE_DEPTH, MAX_RECIPE_VALUES, _is_dir, _is_file, count_values, deepest,
)
from vit_finetune.recipe.schema import Recipe


# A checkout keeps recipes/ beside the package; an installed wheel carries a copy inside it.
RECIPE_DIRS = (PACKAGE_DIR.parent / "recipes", PACKAGE_DIR / "recipes")
# recipes/accelerate/ holds Accelerate's own config files (`accelerate launch --config_file`), not recipes.
ACCELERATE_CONFIGS = "accelerate"


class RecipeError(VitFinetuneError):
    """A recipe that cannot run; the message lists every problem found, one per line."""

    exit_code = EXIT_USAGE

    def __init__(self, problems: list[str], source: str = "recipe"):
        self.problems = problems
        source = source if len(source) <= 300 else excerpt(source)
        super().__init__(f"{source} has {len(problems)} problem(s):\n" + "\n".join(f"  - {p}" for p in problems))


class DuplicateKey(yaml.YAMLError):
    """A mapping that gives one key twice: YAML forbids it, and PyYAML would keep the last value without a word."""

    def __init__(self, key: Any, first_line: int, line: int):
        where = f"on line {line}" if line == first_line else f"on lines {first_line} and {line}"
        super().__init__(f"the key {excerpt(key)} is given twice, {where}; YAML would keep only the second, dropping "
                         "the first's values without a word. Fix: merge them into one")


class RecipeLoader(yaml.SafeLoader):
    """PyYAML's safe loader (a recipe can never construct Python objects) that refuses a key given twice in one
    mapping, at any level; a merge key (`<<: *defaults`) may still be overridden."""

    def construct_mapping(self, node, deep=False):
        lines: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key, line = self.construct_object(key_node), key_node.start_mark.line + 1
            try:
                if key in lines:
                    raise DuplicateKey(key, lines[key], line)
                lines[key] = line
            except TypeError:  # a list or mapping as a key: the constructor refuses it below
                continue
        return super().construct_mapping(node, deep)


def parse_yaml(text: str) -> Any:
    """A recipe's YAML (a file, or an override's value) with RecipeLoader."""
    return yaml.load(text, Loader=RecipeLoader)


def available_recipes() -> dict[str, Path]:
    """Recipe names (relative paths without .yaml, sub-folders included) mapped to their files."""
    found: dict[str, Path] = {}
    for directory in RECIPE_DIRS:
        if directory.is_dir():
            for path in recipe_files(directory):
                found.setdefault(path.relative_to(directory).with_suffix("").as_posix(), path)
    return found


def recipe_files(directory: Path) -> list[Path]:
    """The recipe files under `directory`, sub-folders included, Accelerate's config files left out."""
    return sorted(path for path in directory.rglob("*.yaml")
                  if path.relative_to(directory).parts[0] != ACCELERATE_CONFIGS)


def find_recipe(name_or_path: str) -> Path:
    """A recipe file from a shipped name (food101_384) or a path; unknown names list the shipped ones, a folder the
    recipes it holds."""
    path = Path(name_or_path)
    recipes = available_recipes()
    if _is_dir(path) and name_or_path not in recipes:
        raise RecipeError([folder_given(path)], "--recipe")
    if path.suffix in (".yaml", ".yml") or _is_file(path):
        if not _is_file(path):
            raise RecipeError([f"recipe file {name_or_path!r} does not exist"], "--recipe")
        return path
    if name_or_path not in recipes:
        close = difflib.get_close_matches(name_or_path, recipes, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise RecipeError(
            [f"no recipe named {name_or_path!r}.{hint} Available: {', '.join(recipes)}; or pass a path to a .yaml file"],
            "--recipe",
        )
    return recipes[name_or_path]


def folder_given(folder: Path, shown: int = 10) -> str:
    """Why a folder given as --recipe is refused: the recipe files directly in it (not below: a folder such as the
    home folder may hold a great many), or that it holds none."""
    try:
        inside = sorted(p.name for p in folder.iterdir() if p.suffix in (".yaml", ".yml") and _is_file(p))
    except OSError:
        inside = []
    named = repr(str(folder)) if len(str(folder)) <= 300 else excerpt(str(folder))
    if not inside:
        return (f"{named} is a folder, not a recipe file, and holds no .yaml recipe. Fix: give a "
                "recipe file (--recipe path/to/recipe.yaml) or a shipped name (--list-recipes lists them)")
    listed = ", ".join(inside[:shown]) + (f", ... ({len(inside)} in all)" if len(inside) > shown else "")
    return (f"{named} is a folder, not a recipe file; the recipes in it: {listed}. Fix: give one, "
            f"e.g. --recipe {(folder / inside[0]).as_posix()}")


def read_yaml(path: Path) -> dict[str, Any]:
    try:
        if path.stat().st_size > MAX_RECIPE_BYTES:
            raise RecipeError([f"{path} is {path.stat().st_size:,} bytes; a recipe is a few KB (limit "
                               f"{MAX_RECIPE_BYTES:,}). Is it the right file?"], str(path))
        data = parse_yaml(path.read_text())
    except DuplicateKey as error:
        raise RecipeError([f"{path}: {error}"], str(path)) from None
    except yaml.YAMLError as error:
        raise RecipeError([f"{path} is not valid YAML: {error}"], str(path)) from None
    except RecursionError:
        raise RecipeError([f"{path} is nested deeper than Python can read; a recipe is at most "
                           f"{MAX_RECIPE_DEPTH} levels deep"], str(path)) from None
    except UnicodeDecodeError as error:
        raise RecipeError([f"{path} is not UTF-8 text ({error.reason} at byte {error.start}); save it as UTF-8"],
                          str(path)) from None
    except OSError as error:
        raise RecipeError([f"{path} cannot be read: {error.strerror or error}"], str(path)) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise RecipeError([f"{path} must hold a mapping of sections (model:, data:, ...), got {type(data).__name__}"])
    return data


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `section.key=value` overrides; values are parsed as YAML scalars and typed by the schema later."""
    problems = []
    for override in overrides:
        key, sep, raw = override.partition("=")
        parts = key.strip().split(".")
        if not sep or not all(parts):
            problems.append(f"override {excerpt(override)} must look like section.key=value, e.g. train.lr=0.01")
            continue
        try:
            value = parse_yaml(raw) if raw.strip() else None
        except DuplicateKey as error:
            problems.append(f"override {excerpt(override)}: {error}")
            continue
        except yaml.YAMLError:
            value = raw  # let the schema decide whether a plain string is acceptable here
        except RecursionError:
            problems.append(f"override {key.strip()}=... is nested deeper than Python can read; a recipe value is at "
                            f"most {MAX_RECIPE_DEPTH} levels deep")
            continue
        node = data
        for part in parts[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[parts[-1]] = value
    if problems:
        raise RecipeError(problems, "command line")
    return data


# What other tools (transformers' TrainingArguments, timm, the examples users copy) call a setting -> its name here.
# Spelling alone would mislead: difflib finds 'train.early_stopping_patience' closest to 'train.learning_rate'.
SYNONYMS = {
    "learning_rate": "lr", "base_lr": "lr", "head_learning_rate": "head_lr",
    "lr_scheduler": "scheduler", "lr_scheduler_type": "scheduler", "schedule": "scheduler", "sched": "scheduler",
    "num_epochs": "epochs", "num_train_epochs": "epochs", "epoch": "epochs", "n_epochs": "epochs",
    "per_device_train_batch_size": "batch_size", "train_batch_size": "batch_size", "bs": "batch_size",
    "gradient_accumulation_steps": "grad_accum", "accumulation_steps": "grad_accum",
    "warmup": "warmup_steps", "num_warmup_steps": "warmup_steps", "warmup_epochs": "warmup_steps",
    "wd": "weight_decay", "optim": "optimizer", "opt": "optimizer",
    "fp16": "mixed_precision", "bf16": "mixed_precision", "precision": "mixed_precision", "amp": "mixed_precision",
    "clip_grad": "max_grad_norm", "clip_grad_norm": "max_grad_norm", "grad_clip": "max_grad_norm",
    "save_steps": "checkpoint_every_steps", "eval_steps": "eval_every_steps", "logging_steps": "log_every_steps",
    "resume_from_checkpoint": "resume", "patience": "early_stopping_patience",
    "early_stopping": "early_stopping_patience", "smoothing": "label_smoothing", "drop_path": "drop_path_rate",
    "model_name_or_path": "base", "model_name": "base", "pretrained_model": "base", "img_size": "image_size",
    "input_size": "image_size", "resolution": "image_size", "dataset_name": "dataset", "workers": "num_workers",
    "dataloader_num_workers": "num_workers", "push_to_hub": "push", "hub_model_id": "repo_id",
}


def closest_key(unknown: str) -> str | None:
    """The valid key an unknown one most likely means: its synonym's key (in the same section if there is one),
    else the closest spelling (difflib), else None."""
    valid = _valid_keys(Recipe)
    section, _, name = unknown.rpartition(".")
    meant = SYNONYMS.get(name.lower())
    if meant is not None:
        same_name = [key for key in valid if key.rpartition(".")[2] == meant]
        in_section = [key for key in same_name if key.rpartition(".")[0] == section]
        if in_section or same_name:
            return (in_section or same_name)[0]
    close = difflib.get_close_matches(unknown, valid, n=1, cutoff=0.6)
    return close[0] if close else None


def _valid_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    keys = []
    for name, field in model.model_fields.items():
        keys.append(prefix + name)
        for candidate in (field.annotation, *getattr(field.annotation, "__args__", ())):
            if isinstance(candidate, type) and issubclass(candidate, BaseModel):
                keys.extend(_valid_keys(candidate, f"{prefix}{name}."))
    return keys


def key_descriptions(model: type[BaseModel] = Recipe, prefix: str = "") -> dict[str, str]:
    """Every recipe key (dotted) mapped to its one-line meaning, from the schema's Field descriptions."""
    described: dict[str, str] = {}
    for name, field in model.model_fields.items():
        sections = [c for c in (field.annotation, *getattr(field.annotation, "__args__", ()))
                    if isinstance(c, type) and issubclass(c, BaseModel)]
        if field.description or not sections:  # a section that may be null (model.lora) is a key itself
            described[prefix + name] = field.description or ""
        for section in sections:
            described.update(key_descriptions(section, f"{prefix}{name}."))
    return described

def default_values(model: type[BaseModel] = Recipe, prefix: str = "") -> dict[str, Any]:
    """Every key's default (dotted, as JSON values), keys inside sections that default to null (train.distill)
    included: what a key that a recipe or a checkpoint does not name stands for."""
    values: dict[str, Any] = {}
    for name, field in model.model_fields.items():
        sections = [c for c in (field.annotation, *getattr(field.annotation, "__args__", ()))
                    if isinstance(c, type) and issubclass(c, BaseModel)]
        if not field.is_required():
            default = field.get_default(call_default_factory=True)
            if not isinstance(default, BaseModel):  # a section's keys come from its own fields, below
                values[prefix + name] = to_jsonable_python(default)
        for section in sections:
            values.update(default_values(section, f"{prefix}{name}."))
    return values


def format_keys(recipe: Recipe) -> str:
    """One line per key, `key = value  # meaning`, with the values this recipe resolves to (`-`: its section is null)."""
    values = flatten(recipe.model_dump(mode="json"))

    def shown_value(key: str) -> str:
        if key in values:
            return as_yaml_value(values[key])
        return "(set, below)" if any(k.startswith(f"{key}.") for k in values) else "-"

    shown = {key: shown_value(key) for key in key_descriptions()}
    width = max(len(f"{key} = {value}") for key, value in shown.items())
    return "".join(f"{f'{key} = {value}':<{width}}  # {meaning}\n"
                   for (key, value), meaning in zip(shown.items(), key_descriptions().values()))


def _location(error: dict[str, Any]) -> str:
    location = ".".join(str(part) for part in error["loc"] if not str(part).startswith("function-"))
    # Pydantic appends the union member it tried (e.g. "lora.LoraSettings"); keep only recipe keys.
    return re.sub(r"\.(LoraSettings|DistillSettings|list\[.*?\]|tuple\[.*?\])", "", location)


def _describe(error: dict[str, Any]) -> list[str]:
    """The problems one pydantic error stands for: one, or each problem a section's or the recipe's rules found."""
    location = _location(error)
    if error["type"] == "extra_forbidden":
        close = closest_key(location)
        hint = f"; did you mean {close!r}?" if close else "; run with --print to see every valid key"
        return [f"unknown key {location!r}{hint}"]
    if error["type"] == "missing":  # its input is the section around it, which says nothing useful
        return [f"{location} is required and has no default; set it, e.g. {location}=VALUE"]
    value = error.get("input")
    message = error["msg"].removeprefix("Value error, ")
    if location == "" or (error["type"] == "value_error" and isinstance(value, dict)):
        return message.split(PROBLEMS_APART)  # the rules between keys name the keys themselves
    return [f"{location}={excerpt(value)}: {message}"]


def validate(data: dict[str, Any], source: str = "recipe", overridden: tuple[str, ...] = ()) -> Recipe:
    """Type and check a recipe mapping; raise RecipeError listing every problem, those of a key set on the command
    line (`overridden`) marked as such: the recipe file does not hold them."""
    depth, key = deepest(data)
    if depth > MAX_RECIPE_DEPTH:
        raise RecipeError([f"{key or 'the recipe'} is nested more than {MAX_RECIPE_DEPTH} levels deep (lists or "
                           f"mappings inside each other, or a YAML alias that contains itself); a recipe is at most "
                           f"{MAX_RECIPE_DEPTH}. Write the value out flat"], source)
    if count_values(data) > MAX_RECIPE_VALUES:
        raise RecipeError([f"the recipe expands to more than {MAX_RECIPE_VALUES:,} values (YAML aliases repeated "
                           "inside each other, or a value that contains itself); a recipe has about 60. Write the "
                           "values out instead of nesting aliases"], source)
    try:
        return Recipe.model_validate(data)
    except ValidationError as error:
        def from_command_line(e: dict[str, Any]) -> bool:
            return any(f"{_location(e)}.".startswith(f"{key}.") for key in overridden)

        problems = list(dict.fromkeys(problem + (" (set on the command line)" if from_command_line(e) else "")
                                      for e in error.errors() for problem in _describe(e)))
        raise RecipeError(problems, source) from None


def load_recipe(name_or_path: str | None, overrides: list[str] = (), notes: list[str] | None = None) -> Recipe:
    """Find, read, override and validate a recipe; with no name, the schema's defaults. `notes` receives a line for
    each key the recipe spells the older way, saying how it was read (a run says them once)."""
    data: dict[str, Any] = {}
    source = "recipe"
    if name_or_path:
        path = find_recipe(name_or_path)
        data, source = read_yaml(path), str(path)
    overridden = tuple(override.partition("=")[0].strip() for override in overrides)
    if overridden:
        source = f"{source} with the command line's overrides"
    data = apply_overrides(data, list(overrides))
    recipe = validate(data, source, overridden)
    if notes is not None:
        notes.extend(older_spellings(data))
    return recipe


def to_yaml(recipe: Recipe) -> str:
    return yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False)


def write_recipe(recipe: Recipe, folder: Path) -> None:
    """The resolved recipe as `recipe.yaml` in an output folder, its staging folder or a checkpoint."""
    (Path(folder) / RECIPE_FILE).write_text(to_yaml(recipe))

