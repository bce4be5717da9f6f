"""Command line: train from a recipe (the default), predict with a trained folder, push a finished run.

    python -m vit_finetune                                   # help and the shipped recipes; nothing runs
    python -m vit_finetune --recipe food101_384 train.epochs=1
    python -m vit_finetune --list-recipes
    python -m vit_finetune --recipe food101_384 --print
    python -m vit_finetune --recipe food101_384 --keys       # every key, its value and its meaning
    python -m vit_finetune predict outputs/food101_384 img1.jpg img2.png
    python -m vit_finetune push outputs/food101_384 --repo-id you/vit-food101-384
    python -m vit_finetune export outputs/food101_384 --onnx --quantize int8
    python -m vit_finetune app outputs/food101_384 --port 7860
    python -m vit_finetune restore outputs/food101_384    # the run a stopped overwrite=true run was replacing

A user's mistake exits non-zero with a one-paragraph message, never a traceback. Nothing heavy (torch,
transformers, datasets) is imported until a command needs it, so the help and the listings answer at once.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Iterable

from vit_finetune.core import previous_run, progress
from vit_finetune.core.errors import EXIT_INTERRUPTED, PRINTING_RANK, VitFinetuneError, report
from vit_finetune.core.layout import METRICS_FILE, QUANTIZED_ONNX_FILES, RECIPE_FILE, RUNTIME_FILES
from vit_finetune.model import saved_model
from vit_finetune.serving.app import AppError, refuse_a_taken_port, require_gradio, serve
from vit_finetune.serving.onnx_classifier import load_onnx_classifier

if TYPE_CHECKING:
    from vit_finetune.artifacts.callbacks import Callback
    from vit_finetune.recipe import Recipe


TOP_K_HELP = ("labels listed per image: a single-label model's k best (default 5); a multi-label model's labels over "
              "their saved thresholds, at most k of them, highest first (default: all of them)")
# predict and evaluate read the same split of a --dataset unless told otherwise (prediction.chosen_split).
SPLIT_HELP = ("the split of --dataset (default, as for both predict and evaluate: its only split, else validation, "
              "else test)")


def _train_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m vit_finetune",
        description="Fine-tune a Vision Transformer from a recipe. Other commands (each with --help): "
                    "predict, evaluate, explain, export, app, push, restore.",
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


def at_least_one(text: str) -> int:
    """An argparse type for --batch-size and --top-k: 0 or below would silently give nothing ("0 images", exit 0)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number; give one of at least 1") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is below 1; give a whole number of at least 1")
    return value


def _model_command_parser(command: str, description: str, batches: bool = True) -> argparse.ArgumentParser:
    """The parser of a command that uses a trained model: its name, what it does, and the options all share."""
    parser = argparse.ArgumentParser(prog=f"python -m vit_finetune {command}", description=description)
    parser.add_argument("model", help="a trained output folder or a Hub model id")
    if batches:
        parser.add_argument("--batch-size", type=at_least_one, default=None, help="images per forward pass")
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ...; auto = cuda when available")
    return parser


def _predict_parser() -> argparse.ArgumentParser:
    parser = _model_command_parser("predict", "The labels a model gives each image, with their scores: a "
                                    "single-label model's top k, a multi-label model's labels over their thresholds. "
                                    "An unreadable image gets its error in its row and the rest go on.")
    parser.add_argument("images", nargs="*", help="image files, folders (searched recursively) or globs ('a/*.jpg')")
    parser.add_argument("--dataset", help="or: the images of a dataset split (Hub id, image folder, save_to_disk folder)")
    parser.add_argument("--split", help=SPLIT_HELP)
    parser.add_argument("--output", help="write results.csv or results.jsonl instead of printing them")
    parser.add_argument("--overwrite", action="store_true", help="replace --output if it exists")
    parser.add_argument("--top-k", type=at_least_one, default=None, help=TOP_K_HELP)
    parser.add_argument("--runtime", choices=RUNTIME_FILES, default="torch",
                        help="onnx / onnx-int8: the graph `export --onnx [--quantize int8]` wrote (MODEL may be the "
                             "export folder itself), run by onnxruntime on the CPU")
    return parser


def _export_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m vit_finetune export",
        description="Export a trained model for serving: an ONNX graph at its trained resolution with a dynamic batch "
                    "axis, checked against PyTorch before it is written.")
    parser.add_argument("model", help="a trained output folder or a Hub model id")
    parser.add_argument("--onnx", action="store_true", help="export to ONNX (the one format for now; required)")
    parser.add_argument("--output", type=Path, help="the folder to write (default: MODEL/onnx, or ./NAME-onnx for a "
                                                    "Hub id); of an earlier export there, only the files it wrote "
                                                    "(export.json lists them) are replaced")
    parser.add_argument("--quantize", choices=QUANTIZED_ONNX_FILES,
                        help="also write model_quantized.onnx (dynamic int8) and measure its CPU speed-up and accuracy "
                             "change on the run's eval split")
    parser.add_argument("--tolerance", type=float, default=None,
                        help="the largest max abs logit difference from PyTorch accepted (default: 1e-3)")
    parser.add_argument("--images", nargs="+", help="images for the parity check (default: the run's eval split)")
    parser.add_argument("--eval-images", type=int, default=None,
                        help="--quantize: measure on at most this many eval images (default: the whole split)")
    return parser


def _app_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m vit_finetune app",
                                     description="Serve a page on 127.0.0.1 where one drops an image and sees the model's "
                                                 "top labels and where it looked (needs gradio).")
    parser.add_argument("model", help="a trained output folder or a Hub model id")
    parser.add_argument("--port", type=int, default=7860, help="the port on 127.0.0.1 (default: 7860)")
    parser.add_argument("--top-k", type=at_least_one, default=5,
                        help="labels shown per image (default: 5): a single-label model's best, a multi-label model's "
                             "over their thresholds")
    return parser


def _evaluate_parser() -> argparse.ArgumentParser:
    parser = _model_command_parser("evaluate", "Metrics of a saved model on a labelled split. With no --dataset: "
                                    "the run's own eval split, reproducing its metrics.json.")
    parser.add_argument("--dataset", help="a Hub dataset id, an image folder or a save_to_disk folder")
    parser.add_argument("--split", help=SPLIT_HELP)
    parser.add_argument("--target-columns", help="a regression model: the --dataset's columns holding its targets, "
                                                 "comma-separated in the model's order (default: the target names the "
                                                 "model was trained on, its config.json's id2label)")
    parser.add_argument("--output-dir", type=Path,
                        help="also write metrics.json, confusion_matrix.png and misclassified.png here")
    parser.add_argument("--overwrite", action="store_true", help="replace those files if --output-dir holds them")
    return parser


def _explain_parser() -> argparse.ArgumentParser:
    parser = _model_command_parser("explain", "Per image, a PNG with the image, where the model looked (a heat map "
                                    "over its patch grid) and its top predictions.", batches=False)
    parser.add_argument("images", nargs="+", help="image files, folders (searched recursively) or globs ('a/*.jpg')")
    parser.add_argument("--method", choices=("rollout", "gradient"), default="rollout",
                        help="rollout: attention rollout; gradient: gradient-weighted rollout for one class")
    parser.add_argument("--class", dest="label", help="gradient: the label to explain (default: the predicted one)")
    parser.add_argument("--output-dir", type=Path, default=Path("explain"),
                        help="where the PNGs go (default: explain/ in the current folder); the command prints it")
    parser.add_argument("--top-k", type=at_least_one, default=5,
                        help="scores drawn per image (default: 5); a multi-label model's labels over their thresholds "
                             "are marked, and all of them printed")
    parser.add_argument("--overwrite", action="store_true", help="replace pictures --output-dir already holds")
    return parser


def _device(name: str) -> str:
    import torch

    return ("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name


def _push_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m vit_finetune push", description="Push a finished output folder.")
    parser.add_argument("output_dir")
    parser.add_argument("--repo-id", help="namespace/name; default: hub.repo_id from the folder's recipe.yaml")
    parser.add_argument("--private", action="store_true", default=None)
    parser.add_argument("--space-app", action="store_true",
                        help="also add space/ (app.py, requirements.txt, README.md): a Gradio app to try the model, "
                             "ready to copy into a Space; the model files are pushed as without it")
    return parser


def _restore_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m vit_finetune restore",
        description="Put back the run that an overwrite=true run into OUTPUT_DIR was replacing, when that run stopped "
                    "before it finished (killed, or Ctrl-C twice): it is kept in OUTPUT_DIR/.vit_finetune_previous. "
                    "The stopped run's files (its checkpoints too) are removed; the user's own files stay.")
    parser.add_argument("output_dir")
    return parser


def list_recipes() -> int:
    from vit_finetune.recipe import available_recipes

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
    from vit_finetune.recipe import load_recipe, to_yaml

    notes: list[str] = []  # how the recipe was read, where it spells a key the older way
    recipe = load_recipe(args.recipe, args.overrides, notes)
    if args.print:
        print(to_yaml(recipe), end="")
        return 0
    if args.keys:
        from vit_finetune.recipe import format_keys

        print(format_keys(recipe), end="")
        return 0
    train_recipe(recipe, notes=notes, quiet=args.quiet)
    return 0


# Set by main_exit, where `python -m vit_finetune` and the console script enter: this process runs one command and
# ends. A notebook or a test calling main() or the API leaves it unset.
_A_COMMANDS_OWN_PROCESS = False


@contextlib.contextmanager
def _collector_paused_while_loading():
    """Import the training stack in here: the cyclic garbage collector is paused while it loads and, in a command's
    own process, what it made is then frozen out of the collector's reach. The import makes about a million objects
    and every collection walks them all: `python -m vit_finetune` on the tests' tiny recipe (32 px, 12 steps) spent
    1.2 of 5.8 CPU-s in the collector, most of it while importing, and takes 3.8-4.1 CPU-s with the pause and the
    freeze against 6.0-6.5 without (three runs each, 2 cores). A notebook's process keeps its collector as it was: a
    freeze there would keep its garbage of that moment for good."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if _A_COMMANDS_OWN_PROCESS:
            gc.freeze()
        if enabled:
            gc.enable()


def train_recipe(recipe: Recipe, callbacks: Iterable[Callback] = (), notes: Iterable[str] = (),
                 quiet: bool = False) -> dict:
    """The train command once its recipe is read (the API's train too): `notes` say how the recipe was read; returns
    the final metrics."""
    with _collector_paused_while_loading():
        from vit_finetune.core.processes import refuse_a_lone_process

    # Before the training stack loads (transformers, datasets): a launch refused here answers in about 2 s, not 8.
    refuse_a_lone_process()
    with progress.configured(quiet=quiet):
        with _collector_paused_while_loading():
            from vit_finetune.training.run import run

        if os.environ.get("RANK", PRINTING_RANK) == PRINTING_RANK:  # once in a launch of several processes
            for note in notes:
                progress.say(note)
        return run(recipe, callbacks)


def images_to_predict(model: str, images: list[str], dataset: str | None, split: str | None,
                      output: str | None = None) -> list:
    """predict's images (files, folders, globs), or a dataset split's, refused with the reason before the model loads:
    both or neither given, an image that is the --output, a model that is neither a folder nor on the Hub."""
    from vit_finetune.serving import prediction

    if bool(images) == bool(dataset):
        raise saved_model.InputError("give image files/folders/globs, or --dataset D --split S (one of the two)")
    sources = None if dataset else prediction.collect_images(images)
    prediction.refuse_output_among_inputs(output, sources or [], dataset)
    saved_model.model_location(model)
    return sources or prediction.dataset_images(dataset, split)


def load_predictor(model: str, runtime: str = "torch", device: str = "auto"):
    """The (model, processor) predict runs: the PyTorch model on `device`, or an export's ONNX graph on the CPU."""
    if runtime == "torch":
        return saved_model.load_classifier(model, _device(device))
    return load_onnx_classifier(model, runtime)


def predict_command(argv: list[str]) -> int:
    args = _predict_parser().parse_args(argv)
    from vit_finetune.serving import prediction

    write = prediction.writer_for(args.output, args.overwrite)  # a wrong output, image or model fails before loading
    sources = images_to_predict(args.model, args.images, args.dataset, args.split, args.output)
    output = Path(args.output).expanduser() if args.output else None
    shown = 0  # rows listed on the terminal as well, when the listing goes to a file of predict's choosing
    if write is None and sys.stdout.isatty() and len(sources) > prediction.TERMINAL_ROWS:
        output = prediction.listing_file(Path.cwd())  # None where the folder cannot be written: all on the terminal
        write, shown = (prediction.write_csv, prediction.TERMINAL_ROWS) if output else (None, 0)
    model, processor = load_predictor(args.model, args.runtime, args.device)
    write = prediction.writer_for_model(write, model.config)
    unreadable: list[str] = []

    def noting_errors(rows):
        for row in rows:
            if row["error"]:
                unreadable.append(row["image"])
            yield row

    rows = noting_errors(prediction.predict_rows(model, processor, sources, args.top_k, args.batch_size or 32))
    if write is None:
        prediction.write_text(rows)
        return 0
    columns = min(args.top_k or prediction.DEFAULT_TOP_K, model.config.num_labels)  # a single-label CSV's label columns
    count = prediction.write_output(write, prediction.listing_first(rows, shown), output, columns)
    where = (f" (the first {shown} listed above; --output FILE.csv or FILE.jsonl names the file)" if shown else "")
    print(f"{count} images -> {output}{where}" + (f"; {len(unreadable)} unreadable, skipped (their rows say why): "
                                                  f"{unreadable[:5]}" if unreadable else ""))
    return 0


def evaluate_command(argv: list[str]) -> int:
    args = _evaluate_parser().parse_args(argv)
    target_columns = [name.strip() for name in args.target_columns.split(",")] if args.target_columns else None
    metrics = evaluate_model(args.model, args.dataset, args.split, target_columns, args.batch_size, args.device,
                             args.output_dir, args.overwrite)
    shown = {key: value for key, value in metrics.items() if isinstance(value, (int, float, str))}
    print(json.dumps(shown, indent=1))
    return 0


def evaluate_model(model: str, dataset: str | None = None, split: str | None = None,
                   target_columns: list[str] | None = None, batch_size: int | None = None, device: str = "auto",
                   output_dir: Path | None = None, overwrite: bool = False) -> dict:
    """The evaluate command's work: a saved model's metrics on `dataset` (default: its run's own eval split), also
    written into `output_dir` when given; what cannot work is refused before the model loads."""
    from vit_finetune.serving import evaluate_saved

    if output_dir is not None:
        evaluate_saved.check_evaluation_folder(output_dir, overwrite)  # before seconds of loading
    if dataset is None and (split or target_columns):
        raise saved_model.InputError("--split and --target-columns read a --dataset; give --dataset D, or leave them "
                                     "out to evaluate on the run's own eval split")
    return evaluate_saved.evaluate_saved(model, dataset, split, batch_size, _device(device), output_dir,
                                         target_columns)


def explain_command(argv: list[str]) -> int:
    args = _explain_parser().parse_args(argv)
    from vit_finetune.serving import prediction

    sources = prediction.collect_images(args.images)
    saved_model.model_location(args.model)
    from vit_finetune.serving.explain import check_output_dir, explain_images, output_names

    check_output_dir(args.output_dir, output_names([source.name for source in sources], args.method), args.overwrite)

    written = explain_images(args.model, sources, args.output_dir, args.method, args.label, _device(args.device),
                             args.top_k)
    print(f"{len(written)} picture(s) in {args.output_dir.resolve()}")
    return 0


def export_command(argv: list[str]) -> int:
    args = _export_parser().parse_args(argv)
    from vit_finetune.serving.onnx_export import DEFAULT_TOLERANCE, ExportError, export_onnx

    if not args.onnx:
        raise ExportError("export needs a format: pass --onnx (the one format for now)")
    if args.eval_images is not None and args.eval_images < 1:
        raise ExportError(f"--eval-images {args.eval_images}: give a positive count, or leave it out for the whole split")
    from vit_finetune.serving import prediction

    images = prediction.collect_images(args.images) if args.images else None
    written = export_onnx(args.model, args.output, args.quantize,
                          DEFAULT_TOLERANCE if args.tolerance is None else args.tolerance, images, args.eval_images)
    print(f"exported to {written}")
    return 0


def app_command(argv: list[str]) -> int:
    args = _app_parser().parse_args(argv)

    if not 0 < args.port < 65536:
        raise AppError(f"--port {args.port}: give a port between 1 and 65535, e.g. 7860")
    saved_model.model_location(args.model)  # a wrong path or a taken port fails before gradio's imports
    refuse_a_taken_port(args.port)
    require_gradio()
    serve(args.model, args.port, args.top_k)
    return 0


def push_command(argv: list[str]) -> int:
    args = _push_parser().parse_args(argv)
    url, repo_id = push_run(args.output_dir, args.repo_id, args.private, args.space_app)
    print(f"pushed to {url}")
    if args.space_app:
        from vit_finetune.artifacts.publish import push_space_app

        print(f"app added: {push_space_app(repo_id)}")
    return 0


def push_run(folder: str, repo_id: str | None = None, private: bool | None = None,
             space_app: bool = False) -> tuple[str, str]:
    """The push command's work up to its Space app (publish.push_space_app): a finished run folder to `repo_id`
    (default: its recipe's hub.repo_id), space/ included when asked; returns the model's URL and the repo id."""
    from vit_finetune.core.hub import PushError, require_token
    from vit_finetune.recipe import read_yaml, validate

    output_dir = Path(folder)
    saved_model.path_kind(output_dir, folder, "the run folder")  # a name too long to look up: one line
    saved = read_yaml(output_dir / RECIPE_FILE).get("hub", {}) if (output_dir / RECIPE_FILE).is_file() else {}
    repo_id = repo_id or saved.get("repo_id")
    if not repo_id:
        raise PushError("no repo id: pass --repo-id namespace/name")
    validate({"hub": {"repo_id": repo_id}}, "--repo-id")  # the recipe's own check, as a RecipeError
    private = private if private is not None else bool(saved.get("private", False))
    if not (output_dir / METRICS_FILE).is_file():
        raise PushError(f"{output_dir} holds no finished run ({METRICS_FILE} is missing); train first, then push")
    require_token("push")  # the message speaks of this command, not of hub.push=true
    from vit_finetune.artifacts.publish import push_folder  # loads the training stack: after the refusals above

    return push_folder(output_dir, repo_id, private, space_app), repo_id


def restore_command(argv: list[str]) -> int:
    args = _restore_parser().parse_args(argv)
    print(previous_run.restore(Path(args.output_dir).expanduser()))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run one command; a VitFinetuneError becomes its message on stderr and its exit code, anything else a traceback."""
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"predict": predict_command, "evaluate": evaluate_command, "explain": explain_command,
                "export": export_command, "app": app_command, "push": push_command, "restore": restore_command}
    command = commands.get(argv[0], train_command) if argv else train_command
    if command is not train_command:
        argv = argv[1:]
    with progress.configured():  # before the heavy libraries load: their bars follow the terminal / log-file choice
        try:
            return command(argv)
        except VitFinetuneError as error:
            report(error)
            return error.exit_code
        except KeyboardInterrupt:  # Ctrl-C where no handler of a run hears it (loading, predict): one line, no traceback
            print("stopped by Ctrl-C", file=sys.stderr)
            return EXIT_INTERRUPTED


def main_exit() -> None:
    """Entry point of the `vit-finetune` console script and of `python -m vit_finetune`: a process of its own."""
    global _A_COMMANDS_OWN_PROCESS
    _A_COMMANDS_OWN_PROCESS = True
    sys.exit(main())
