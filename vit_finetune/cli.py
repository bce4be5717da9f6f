"""Command line: train from a recipe (the default), predict with a trained folder, push a finished run.

    python -m vit_finetune                                   # help and the shipped recipes; nothing runs
    python -m vit_finetune --recipe food101_384 train.epochs=1
    python -m vit_finetune --list-recipes
    python -m vit_finetune --recipe food101_384 --print
    python -m vit_finetune --recipe food101_384 --keys       # every key, its value and its meaning
    python -m vit_finetune predict outputs/food101_384 img1.jpg img2.png
    python -m vit_finetune push outputs/food101_384 --repo-id you/vit-food101-384

A user's mistake exits non-zero with a one-paragraph message, never a traceback. Nothing heavy (torch,
transformers, datasets) is imported until a command needs it, so the help and the listings answer at once.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

EXIT_USAGE = 2


def _train_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m vit_finetune",
        description="Fine-tune a Vision Transformer from a recipe. Subcommands: predict, push.",
        epilog="Overrides: section.key=value, e.g. train.lr=0.01 model.lora=null data.max_train_samples=2000",
    )
    parser.add_argument("--recipe", help="a shipped recipe name (see --list-recipes) or a path to a .yaml file")
    parser.add_argument("--list-recipes", action="store_true", help="list the shipped recipes and exit")
    parser.add_argument("--print", action="store_true", help="print the resolved recipe and exit without running")
    parser.add_argument("--keys", action="store_true",
                        help="list every recipe key with its resolved value and meaning, and exit")
    parser.add_argument("--quiet", action="store_true", help="print only the result and errors, no progress")
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


def first_help() -> int:
    """`python -m vit_finetune` alone: what to type next, not a download of Food-101."""
    _train_parser().print_help()
    print("\nshipped recipes (run one with --recipe NAME; make demo runs offline):")
    return list_recipes()


def train_command(argv: list[str]) -> int:
    if not argv:
        return first_help()
    args = _train_parser().parse_args(argv)
    if args.list_recipes:
        return list_recipes()
    from .recipe import load_recipe, to_yaml

    recipe = load_recipe(args.recipe, args.overrides)
    if args.print:
        print(to_yaml(recipe), end="")
        return 0
    if args.keys:
        from .recipe import format_keys

        print(format_keys(recipe), end="")
        return 0
    from . import progress

    progress.configure(quiet=args.quiet)
    from .train import run

    run(recipe)
    return 0


def predict_command(argv: list[str]) -> int:
    args = _predict_parser().parse_args(argv)
    missing = [image for image in args.images if not Path(image).is_file()]
    if missing:
        raise FileNotFoundError(f"image file(s) not found: {missing}")
    from transformers import pipeline

    from .data import decode_image
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
    from .hub import push_folder
    from .recipe import read_yaml

    output_dir = Path(args.output_dir)
    saved = read_yaml(output_dir / "recipe.yaml").get("hub", {}) if (output_dir / "recipe.yaml").is_file() else {}
    repo_id = args.repo_id or saved.get("repo_id")
    if not repo_id:
        raise ValueError("no repo id: pass --repo-id namespace/name")
    from .recipe import HubSettings

    HubSettings(repo_id=repo_id)  # same validation as in recipes
    private = args.private if args.private is not None else bool(saved.get("private", False))
    from .export import METRICS_FILE
    from .hub import require_token

    if not (output_dir / METRICS_FILE).is_file():
        raise FileNotFoundError(f"{output_dir} holds no finished run ({METRICS_FILE} is missing); train first, then push")
    print(f"pushed to {push_folder(output_dir, repo_id, private, token=require_token('push'))}")
    return 0


# The errors a user can cause, by (module, class), with their exit codes (None: the error carries its own).
# They are looked up only in modules already imported: an unloaded module raised nothing, and importing the
# training modules here would cost seconds on every `--help`.
USER_ERRORS = {
    ("vit_finetune.recipe", "RecipeError"): EXIT_USAGE,
    ("pydantic", "ValidationError"): EXIT_USAGE,
    ("vit_finetune.train", "NonFiniteLoss"): None,
    ("vit_finetune.train", "Interrupted"): None,
    ("vit_finetune.train", "RunError"): 1,
    ("vit_finetune.model", "ModelError"): 1,
    ("vit_finetune.data", "DataError"): 1,
    ("vit_finetune.checkpoint", "CheckpointError"): 1,
    ("vit_finetune.hub", "PushError"): 1,
    ("builtins", "FileNotFoundError"): 1,
    ("builtins", "ValueError"): 1,
}


def exit_code_for(error: BaseException) -> int | None:
    """The exit code of a user's mistake, or None for a bug (which keeps its traceback)."""
    for (module_name, class_name), code in USER_ERRORS.items():
        error_type = getattr(sys.modules.get(module_name), class_name, None)
        if error_type is not None and isinstance(error, error_type):
            return error.exit_code if code is None else code
    return None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"predict": predict_command, "push": push_command}
    command = commands.get(argv[0], train_command) if argv else train_command
    if command is not train_command:
        argv = argv[1:]
    try:
        return command(argv)
    except Exception as error:
        code = exit_code_for(error)
        if code is None:
            raise
        print(f"error: {error}", file=sys.stderr)
        return code


def main_exit() -> None:
    """Entry point of the `vit-finetune` console script."""
    sys.exit(main())
