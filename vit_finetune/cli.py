"""Command line: train from a recipe (the default), predict with a trained folder, push a finished run.

    python -m vit_finetune --recipe food101_384 train.epochs=1
    python -m vit_finetune --list-recipes
    python -m vit_finetune --recipe food101_384 --print
    python -m vit_finetune predict outputs/food101_384 img1.jpg img2.png
    python -m vit_finetune push outputs/food101_384 --repo-id you/vit-food101-384

A user's mistake exits non-zero with a one-paragraph message, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _train_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m vit_finetune",
        description="Fine-tune a Vision Transformer from a recipe. Subcommands: predict, push.",
        epilog="Overrides: section.key=value, e.g. train.lr=0.01 model.lora=null data.max_train_samples=2000",
    )
    parser.add_argument("--recipe", help="a shipped recipe name (see --list-recipes) or a path to a .yaml file")
    parser.add_argument("--list-recipes", action="store_true", help="list the shipped recipes and exit")
    parser.add_argument("--print", action="store_true", help="print the resolved recipe and exit without running")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides")
    return parser


def _predict_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m vit_finetune predict",
                                     description="Top-5 labels and scores for each image.")
    parser.add_argument("model", help="a trained output folder or a Hub model id")
    parser.add_argument("images", nargs="+", help="image files")
    parser.add_argument("--top-k", type=int, default=5)
    return parser


def _push_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m vit_finetune push", description="Push a finished output folder.")
    parser.add_argument("output_dir")
    parser.add_argument("--repo-id", help="namespace/name; default: hub.repo_id from the folder's recipe.yaml")
    parser.add_argument("--private", action="store_true", default=None)
    return parser


def list_recipes() -> int:
    from .recipe import available_recipes

    for name, path in available_recipes().items():
        first = next((line[1:].strip() for line in path.read_text().splitlines() if line.startswith("#")), "")
        print(f"{name:24s} {first}")
    return 0


def train_command(argv: list[str]) -> int:
    args = _train_parser().parse_args(argv)
    if args.list_recipes:
        return list_recipes()
    from .recipe import load_recipe, to_yaml

    recipe = load_recipe(args.recipe, args.overrides)
    if args.print:
        print(to_yaml(recipe), end="")
        return 0
    from .train import run

    run(recipe)
    return 0


def predict_command(argv: list[str]) -> int:
    args = _predict_parser().parse_args(argv)
    from .data import DataError, decode_image

    missing = [image for image in args.images if not Path(image).is_file()]
    if missing:
        raise DataError(f"image file(s) not found: {missing}")
    from transformers import pipeline

    from .recipe import DataSettings

    classify = pipeline("image-classification", model=args.model, device=-1)
    for image_path in args.images:
        image = decode_image({"path": image_path, "bytes": None}, 0, DataSettings())
        print(image_path)
        for guess in classify(image, top_k=args.top_k):
            print(f"  {guess['score']:.4f}  {guess['label']}")
    return 0


def push_command(argv: list[str]) -> int:
    args = _push_parser().parse_args(argv)
    from .hub import PushError, push_folder
    from .recipe import RECIPE_FILE, read_yaml, validate

    output_dir = Path(args.output_dir)
    saved = read_yaml(output_dir / RECIPE_FILE).get("hub", {}) if (output_dir / RECIPE_FILE).is_file() else {}
    repo_id = args.repo_id or saved.get("repo_id")
    if not repo_id:
        raise PushError("no repo id: pass --repo-id namespace/name")
    validate({"hub": {"repo_id": repo_id}}, "--repo-id")  # the recipe's own check, as a RecipeError
    private = args.private if args.private is not None else bool(saved.get("private", False))
    print(f"pushed to {push_folder(output_dir, repo_id, private)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run one command; a VitFinetuneError becomes its message on stderr and its exit code, anything else a traceback."""
    from .errors import VitFinetuneError

    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"predict": predict_command, "push": push_command}
    command = commands.get(argv[0], train_command) if argv else train_command
    if command is not train_command:
        argv = argv[1:]
    try:
        return command(argv)
    except VitFinetuneError as error:
        print(f"error: {error}", file=sys.stderr)
        return error.exit_code


def main_exit() -> None:
    """Entry point of the `vit-finetune` console script."""
    sys.exit(main())
