"""vit_finetune: fine-tune Vision Transformers from the Hugging Face Hub at a new resolution.

From Python (a notebook, a script): the CLI's commands as functions that return what the commands write, and raise
VitFinetuneError with the message the CLI prints where the CLI would exit.

    recipe = vit_finetune.load_recipe("demo", data={"dataset": "my_photos"}, **{"train.epochs": 3})
    result = vit_finetune.train(recipe)            # result.metrics: metrics.json; result.output_dir: the folder
    rows = vit_finetune.predict(result.output_dir, ["photo.png"], top_k=3)
    metrics = vit_finetune.evaluate(result.output_dir)

Each function runs the code its command runs (cli.py), so a recipe, an image or a model is checked the same way.
Callbacks to observe a run: vit_finetune.artifacts.callbacks.

`import vit_finetune` stays light (`python -m vit_finetune` imports this package before its --help answers): the
recipe's schema (pydantic), torch and the Hub's client load inside the functions that need them.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Mapping

import yaml

from vit_finetune import cli
from vit_finetune.core.errors import VitFinetuneError, excerpt
from vit_finetune.core.layout import METRICS_FILE, RUNTIME_FILES
from vit_finetune.core.progress import say
from vit_finetune.model.saved_model import InputError

if TYPE_CHECKING:
    from vit_finetune.artifacts.callbacks import Callback
    from vit_finetune.recipe import Recipe

__version__ = "0.1.0"
__all__ = ["Pushed", "TrainResult", "VitFinetuneError", "evaluate", "load_recipe", "predict", "push", "train"]

PathLike = str | os.PathLike


def override_text(value: Any, key: str) -> str:
    """`value` as the text of a `key=value` override, which the recipe's YAML reader reads back as the same value
    ('123' stays a string, None is null); a value no recipe can hold is refused, naming the key."""
    from vit_finetune.recipe import RecipeError

    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if isinstance(value, tuple):
        value = list(value)
    try:
        text = yaml.safe_dump(value, default_flow_style=True, width=float("inf"))
    except yaml.YAMLError:
        raise RecipeError([f"{key}={excerpt(value)}: a recipe value is a string, number, boolean, None, list or "
                           f"dict, not a value of type {type(value).__name__!r}"], "the overrides given") from None
    return text.removesuffix("\n").removesuffix("\n...")


def overrides_of(settings: Mapping[str, Any], prefix: str = "") -> list[str]:
    """`key.sub=value` overrides from keyword settings: dotted keys, and sections given as dicts
    (`data={"dataset": "x"}` is `data.dataset=x`); an empty dict is a value of its own."""
    overrides = []
    for key, value in settings.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            overrides.extend(overrides_of(value, f"{dotted}."))
        else:
            overrides.append(f"{dotted}={override_text(value, dotted)}")
    return overrides


def load_recipe(name_or_path: PathLike | None = None, *overrides: str, **settings: Any) -> Recipe:
    """A shipped recipe's name or a .yaml path (None: the defaults), with `section.key=value` strings as on the
    command line and/or settings (`**{"train.lr": 0.01}`, `train={"lr": 0.01}`); checked as `--recipe` checks it
    (RecipeError lists every problem)."""
    from vit_finetune.recipe import load_recipe as load_recipe_with_overrides

    notes: list[str] = []  # a key spelled the older way: said now, where the CLI says it when its run starts
    name = os.fspath(name_or_path) if name_or_path is not None else None
    recipe = load_recipe_with_overrides(name, [*overrides, *overrides_of(settings)], notes)
    for note in notes:
        say(note)
    return recipe


@dataclass(frozen=True)
class TrainResult:
    """A finished run: its final metrics (metrics.json) and the output folder that holds the model."""

    metrics: dict
    output_dir: Path


def train(recipe: Recipe, callbacks: Iterable[Callback] = (), quiet: bool = False) -> TrainResult:
    """Train as `python -m vit_finetune --recipe ...` does; `callbacks` observe this run only
    (vit_finetune.artifacts.callbacks).
    Each call starts afresh: the same recipe gives the same weights as the CLI, however many runs came before."""
    from vit_finetune.core.processes import reset_accelerate_state
    from vit_finetune.recipe import Recipe, RecipeError

    if not isinstance(recipe, Recipe):
        raise RecipeError([f"train() takes the Recipe that vit_finetune.load_recipe returns, not "
                           f"{excerpt(recipe)}; e.g. vit_finetune.train(vit_finetune.load_recipe('demo'))"],
                          "the recipe given")
    try:
        returned = cli.train_recipe(recipe, callbacks, quiet=quiet)
    finally:
        reset_accelerate_state()  # Accelerate's process-wide state would carry this run's settings into the next
    output_dir = Path(recipe.output_dir)
    written = output_dir / METRICS_FILE
    return TrainResult(json.loads(written.read_text()) if written.is_file() else returned, output_dir)


def at_least_one(name: str, value: int | None) -> int | None:
    """top_k and batch_size as the CLI's --top-k and --batch-size take them (None: the default)."""
    if value is None:
        return None
    try:
        return cli.at_least_one(str(value))
    except argparse.ArgumentTypeError as error:
        raise InputError(f"{name}={excerpt(value)}: {error}") from None


def as_list(paths: PathLike | Iterable[PathLike] | None) -> list[str]:
    if paths is None:
        return []
    if isinstance(paths, (str, os.PathLike)):
        return [os.fspath(paths)]
    return [os.fspath(path) for path in paths]


def predict(model_dir: PathLike, images: PathLike | Iterable[PathLike] | None = None, top_k: int | None = None,
            dataset: PathLike | None = None, split: str | None = None, batch_size: int | None = None,
            device: str = "auto", runtime: str = "torch") -> list[dict]:
    """The rows `predict --output results.jsonl` writes, one per image in order: {"image", "error" (None, or why it
    could not be read), "predictions": [{"label", "score"}, ...] best first}. `images`: files, folders, globs; or
    `dataset` (and `split`)."""
    from vit_finetune.serving.prediction import predict_rows

    top_k, batch_size = at_least_one("top_k", top_k), at_least_one("batch_size", batch_size)
    if runtime not in RUNTIME_FILES:
        raise InputError(f"runtime={excerpt(runtime)}: choose one of {', '.join(RUNTIME_FILES)}")
    model = os.fspath(model_dir)
    sources = cli.images_to_predict(model, as_list(images), os.fspath(dataset) if dataset else None, split)
    loaded, processor = cli.load_predictor(model, runtime, device)
    return list(predict_rows(loaded, processor, sources, top_k, batch_size or 32))


def evaluate(model_dir: PathLike, dataset: PathLike | None = None, split: str | None = None,
             target_columns: list[str] | None = None, batch_size: int | None = None, device: str = "auto",
             output_dir: PathLike | None = None, overwrite: bool = False) -> dict:
    """The metrics `evaluate` computes (and, with `output_dir`, writes there as metrics.json with its pictures): on
    the run's own eval split unless a `dataset` is given."""
    from vit_finetune.core.processes import reset_accelerate_state

    batch_size = at_least_one("batch_size", batch_size)
    try:
        return cli.evaluate_model(os.fspath(model_dir), os.fspath(dataset) if dataset else None, split,
                                  target_columns, batch_size, device,
                                  Path(output_dir) if output_dir is not None else None, overwrite)
    finally:
        reset_accelerate_state()  # its Accelerator's settings must not reach a later train()


@dataclass(frozen=True)
class Pushed:
    """Where push() put a run: the model's URL, and the Space app's when asked for (else None)."""

    url: str
    app: str | None = None


def push(model_dir: PathLike, repo_id: str | None = None, private: bool | None = None,
         space_app: bool = False) -> Pushed:
    """Push a finished run folder as `push` does: to `repo_id` (default: its recipe's hub.repo_id); `private`
    defaults to its recipe's hub.private; `space_app` adds the Gradio app of `push --space-app`."""
    from vit_finetune.artifacts.publish import push_space_app

    url, repo_id = cli.push_run(os.fspath(model_dir), repo_id, private, space_app)
    return Pushed(url, push_space_app(repo_id) if space_app else None)
