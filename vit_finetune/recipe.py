"""Recipes: the typed schema of a run, YAML loading, dotted overrides and error reporting.

A recipe is the single source of truth for a run. Every error of a recipe is reported at once, each
naming the key, the value and the fix, before anything expensive starts.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .errors import EXIT_USAGE, VitFinetuneError

PACKAGE_DIR = Path(__file__).resolve().parent
RECIPE_FILE = "recipe.yaml"  # the resolved recipe, beside a run's outputs and in each of its checkpoints
# A checkout keeps recipes/ beside the package; an installed wheel carries a copy inside it.
RECIPE_DIRS = (PACKAGE_DIR.parent / "recipes", PACKAGE_DIR / "recipes")
# The Hub's own rule for repo ids: an optional namespace and a name, no spaces, at most 96 characters.
REPO_ID_PATTERN = re.compile(r"^(?:[A-Za-z0-9][\w.-]{0,95}/)?[A-Za-z0-9][\w.-]{0,95}$")
# The metrics train.keep_best can follow, and whether higher or lower is better.
KEEP_BEST_GOALS = {"eval_accuracy": "max", "eval_top5_accuracy": "max", "eval_macro_f1": "max", "eval_loss": "min"}


class RecipeError(VitFinetuneError):
    """A recipe that cannot run; the message lists every problem found, one per line."""

    exit_code = EXIT_USAGE

    def __init__(self, problems: list[str], source: str = "recipe"):
        self.problems = problems
        super().__init__(f"{source} has {len(problems)} problem(s):\n" + "\n".join(f"  - {p}" for p in problems))


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class LoraSettings(Strict):
    r: int = Field(16, gt=0, description="rank: higher = more capacity, more memory")
    alpha: float = Field(16, gt=0, description="scale of the update is alpha / r")
    dropout: float = Field(0.1, ge=0, lt=1)
    # Roles, not module names: they are mapped onto the loaded model's own names (transformers 4.x or 5.x).
    target_modules: list[Literal["query", "key", "value", "attention_output", "mlp_in", "mlp_out"]] = ["query", "value"]


class ModelSettings(Strict):
    base: str = "google/vit-base-patch16-224"
    image_size: int = Field(384, gt=0)
    lora: LoraSettings | None = None
    head_init: Literal["zero", "random"] = "zero"  # zero = big_vision's choice: start from uniform predictions
    pretrained: bool = True  # false = the same architecture from random weights, a baseline to compare against
    revision: str | None = None
    trust_remote_code: bool = False  # off unless a recipe turns it on: remote code runs on your machine
    compile: bool | None = None  # torch.compile; null = on for CUDA, off on CPU
    # Stochastic depth: null keeps the base config's; only families whose config has drop_path_rate (not ViT)
    drop_path_rate: float | None = Field(None, ge=0, lt=1)


class DataSettings(Strict):
    dataset: str = "ethz/food101"
    train_split: str = "train"
    eval_split: str | None = "validation"  # null or missing from the dataset: carve one from train
    eval_fraction: float = Field(0.1, gt=0, lt=1)
    image_column: str | None = None  # null = detect
    label_column: str | None = None  # null = detect
    max_train_samples: int | None = Field(None, gt=0)
    max_eval_samples: int | None = Field(None, gt=0)
    crop_scale: tuple[float, float] = (0.05, 1.0)  # random-resized-crop area range (original ViT recipe)
    horizontal_flip: bool = True
    skip_bad_images: bool = False
    min_image_side: int = Field(2, gt=0)  # smaller images are treated as corrupt
    max_image_pixels: int = Field(89_478_485, gt=0)  # PIL's decompression-bomb limit
    num_workers: int | None = Field(None, ge=0)  # null = chosen from the CPU count and the device
    # Skewed label counts: weights = loss weighted by inverse class frequency; sampler = draw classes equally often
    class_balance: Literal["weights", "sampler"] | None = None

    @field_validator("crop_scale")
    @classmethod
    def _crop_scale_ordered(cls, value: tuple[float, float]) -> tuple[float, float]:
        low, high = value
        if not 0 < low <= high <= 1:
            raise ValueError(f"must satisfy 0 < low <= high <= 1, got {list(value)}; e.g. [0.05, 1.0]")
        return value


class TrainSettings(Strict):
    epochs: int = Field(1, gt=0)
    max_steps: int | None = Field(None, gt=0)  # optimiser steps; stops early when set
    batch_size: int = Field(32, gt=0)  # per device
    grad_accum: int = Field(1, gt=0)
    optimizer: Literal["adamw", "sgd"] = "adamw"
    lr: float = Field(1e-4, gt=0, le=1e6, allow_inf_nan=False)  # beyond 1e6 it overflows inside the optimiser
    momentum: float = Field(0.9, ge=0, lt=1)  # sgd only
    weight_decay: float = Field(0.0, ge=0)
    warmup_steps: int = Field(0, ge=0)
    scheduler: Literal["cosine", "linear", "constant"] = "cosine"
    max_grad_norm: float | None = Field(1.0, gt=0)
    label_smoothing: float = Field(0.0, ge=0, lt=1)
    seed: int = 0
    mixed_precision: Literal["no", "bf16", "fp16"] = "no"
    log_every_steps: int = Field(10, gt=0)  # the loss is read back from the device only this often
    eval_every_steps: int | None = Field(None, gt=0)  # null = evaluate at the end of every epoch
    checkpoint_every_steps: int | None = Field(None, gt=0)
    keep_checkpoints: int = Field(2, gt=0)
    resume: str | None = None  # null | auto | path to a checkpoint folder
    resume_ignore_changes: list[str] = []  # recipe keys allowed to differ from the checkpoint's, e.g. [train.epochs]
    ema_decay: float | None = Field(None, gt=0, lt=1)  # EMA of the weights, e.g. 0.999; pick 1/(1-decay) << steps
    keep_best: Literal[tuple(KEEP_BEST_GOALS)] | None = None  # save the weights of the best evaluation, e.g. eval_accuracy
    early_stopping_patience: int | None = Field(None, gt=0)  # stop after this many evaluations without gain
    layer_decay: float | None = Field(None, gt=0, le=1)  # lr x decay^(layers + 1 - depth), e.g. 0.75; null = off

    @field_validator("mixed_precision", mode="before")
    @classmethod
    def _yaml_no_is_a_string(cls, value: Any) -> Any:
        return "no" if value is False else value  # YAML 1.1 reads a bare `no` as false


class HubSettings(Strict):
    push: bool = False
    repo_id: str | None = None
    private: bool = False

    @field_validator("repo_id")
    @classmethod
    def _repo_id_is_valid(cls, value: str | None) -> str | None:
        if value is not None and not REPO_ID_PATTERN.match(value):
            raise ValueError(
                f"{value!r} is not a valid Hub repo id; use 'name' or 'namespace/name' "
                "(letters, digits, '-', '_', '.', no spaces)"
            )
        return value


class Recipe(Strict):
    model: ModelSettings = ModelSettings()
    data: DataSettings = DataSettings()
    train: TrainSettings = TrainSettings()
    hub: HubSettings = HubSettings()
    output_dir: str = "outputs/run"
    overwrite: bool = False  # replace a finished run in output_dir

    @model_validator(mode="after")
    def _consistent(self) -> Recipe:
        problems = []
        if self.hub.push and not self.hub.repo_id:
            problems.append("hub.push=true needs hub.repo_id, e.g. hub.repo_id=your-name/vit-food101-384")
        if self.train.resume not in (None, "auto") and not _is_dir(self.train.resume):
            problems.append(f"train.resume={self.train.resume!r} is neither null, auto nor an existing checkpoint folder")
        unknown = sorted(set(self.train.resume_ignore_changes) - set(flatten(self.model_dump(mode="json"))))
        if unknown:
            problems.append(f"train.resume_ignore_changes names unknown keys {unknown}; use dotted keys such as train.epochs")
        if self.train.resume is not None and self.overwrite:
            problems.append("train.resume and overwrite=true contradict each other: choose one")
        if self.train.early_stopping_patience is not None and self.train.keep_best is None:
            problems.append("train.early_stopping_patience needs train.keep_best (the metric whose gain it waits "
                            "for), e.g. train.keep_best=eval_accuracy")
        if self.train.warmup_steps and self.train.max_steps and self.train.warmup_steps >= self.train.max_steps:
            problems.append(
                f"train.warmup_steps={self.train.warmup_steps} must be smaller than train.max_steps={self.train.max_steps}"
            )
        if problems:
            raise ValueError("; ".join(problems))
        return self


def _is_file(path: str | Path) -> bool:
    """Path.is_file, but False (not OSError) for a name the file system refuses, e.g. longer than 255 bytes."""
    try:
        return Path(path).is_file()
    except OSError:
        return False


def _is_dir(path: str | Path) -> bool:
    try:
        return Path(path).is_dir()
    except OSError:
        return False


def available_recipes() -> dict[str, Path]:
    """Recipe names (relative paths without .yaml, sub-folders included) mapped to their files."""
    found: dict[str, Path] = {}
    for directory in RECIPE_DIRS:
        if directory.is_dir():
            for path in sorted(directory.rglob("*.yaml")):
                found.setdefault(path.relative_to(directory).with_suffix("").as_posix(), path)
    return found


def find_recipe(name_or_path: str) -> Path:
    """A recipe file from a shipped name (food101_384) or a path; unknown names list the shipped ones."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or _is_file(path):
        if not _is_file(path):
            raise RecipeError([f"recipe file {name_or_path!r} does not exist"], "--recipe")
        return path
    recipes = available_recipes()
    if name_or_path not in recipes:
        close = difflib.get_close_matches(name_or_path, recipes, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise RecipeError(
            [f"no recipe named {name_or_path!r}.{hint} Available: {', '.join(recipes)}; or pass a path to a .yaml file"],
            "--recipe",
        )
    return recipes[name_or_path]


def read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text())  # safe loader: a recipe can never construct Python objects
    except yaml.YAMLError as error:
        raise RecipeError([f"{path} is not valid YAML: {error}"], str(path)) from None
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
            problems.append(f"override {override!r} must look like section.key=value, e.g. train.lr=0.01")
            continue
        try:
            value = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError:
            value = raw  # let the schema decide whether a plain string is acceptable here
        node = data
        for part in parts[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[parts[-1]] = value
    if problems:
        raise RecipeError(problems, "command line")
    return data


def _valid_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    keys = []
    for name, field in model.model_fields.items():
        keys.append(prefix + name)
        for candidate in (field.annotation, *getattr(field.annotation, "__args__", ())):
            if isinstance(candidate, type) and issubclass(candidate, BaseModel):
                keys.extend(_valid_keys(candidate, f"{prefix}{name}."))
    return keys


def _describe(error: dict[str, Any]) -> str:
    location = ".".join(str(part) for part in error["loc"] if not str(part).startswith("function-"))
    # Pydantic appends the union member it tried (e.g. "lora.LoraSettings"); keep only recipe keys.
    location = re.sub(r"\.(LoraSettings|list\[.*?\]|tuple\[.*?\])", "", location)
    if error["type"] == "extra_forbidden":
        close = difflib.get_close_matches(location, _valid_keys(Recipe), n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]!r}?" if close else "; run with --print to see every valid key"
        return f"unknown key {location!r}{hint}"
    value = error.get("input")
    message = error["msg"].removeprefix("Value error, ")
    if location == "":
        return message
    return f"{location}={value!r}: {message}"


def validate(data: dict[str, Any], source: str = "recipe") -> Recipe:
    """Type and check a recipe mapping; raise RecipeError listing every problem."""
    try:
        return Recipe.model_validate(data)
    except ValidationError as error:
        problems = list(dict.fromkeys(_describe(e) for e in error.errors()))
        raise RecipeError(problems, source) from None


def load_recipe(name_or_path: str | None, overrides: list[str] = ()) -> Recipe:
    """Find, read, override and validate a recipe; with no name, the schema's defaults."""
    data: dict[str, Any] = {}
    source = "recipe"
    if name_or_path:
        path = find_recipe(name_or_path)
        data, source = read_yaml(path), str(path)
    return validate(apply_overrides(data, list(overrides)), source)


def to_yaml(recipe: Recipe) -> str:
    return yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False)


def write_recipe(recipe: Recipe, folder: Path) -> None:
    """The resolved recipe as `recipe.yaml` in an output folder, its staging folder or a checkpoint."""
    (Path(folder) / RECIPE_FILE).write_text(to_yaml(recipe))


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{'train': {'lr': 1}} -> {'train.lr': 1}; used to compare recipes key by key."""
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
