"""What a new user meets first: help with no arguments, instant listings, every key explained, readable logs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tiny import REPO, run_cli, write_colour_folder
from vit_finetune.recipe import Recipe, flatten, key_descriptions, load_recipe

SHIPPED = ("demo", "food101_384", "food101_384_lora", "cifar100_384", "oxford_pets_384")


def test_no_arguments_prints_help_and_recipes_and_runs_nothing(tmp_path):
    result = run_cli(cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: python -m vit_finetune") and "--recipe" in result.stdout
    listed = {line.split()[0] for line in result.stdout.split("\nshipped recipes")[1].splitlines()[1:] if line.strip()}
    assert set(SHIPPED) <= listed
    assert list(tmp_path.iterdir()) == []  # no outputs/ folder, no download


@pytest.mark.parametrize("args", [["--help"], ["--list-recipes"], [], ["--recipe", "demo", "--keys"],
                                  ["predict", "--help"], ["push", "--help"],
                                  ["predict", "someone/no-such-model", "docs/demo_position_embeddings.png"],
                                  ["push", "docs", "--repo-id", "user/x"]])
def test_help_and_listings_import_no_heavy_library(args):
    """The cause of a slow --help was torch/transformers/datasets imported up front; none may load for these, nor
    for a model that is neither a folder nor on the Hub (refused after one Hub question), nor for a push of a folder
    that holds no finished run."""
    code = ("import sys; from vit_finetune.cli import main\n"
            "try:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in ('torch', 'transformers', 'datasets', 'accelerate', 'peft') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "[]"


def test_help_answers_in_well_under_a_second():
    start = time.perf_counter()
    result = run_cli("--help")
    elapsed = time.perf_counter() - start
    assert result.returncode == 0 and "--keys" in result.stdout
    assert elapsed < 1.5, f"--help took {elapsed:.2f}s"  # 0.12 s measured here; a slack for a loaded CI machine


def test_every_recipe_key_has_a_one_line_meaning():
    described = key_descriptions()
    assert all(meaning and "\n" not in meaning for meaning in described.values()), \
        [key for key, meaning in described.items() if not meaning]
    every_leaf = set(flatten(Recipe(model={"lora": {}}).model_dump(mode="json")))
    assert every_leaf <= set(described), every_leaf - set(described)


def test_keys_lists_each_key_with_the_resolved_value(capsys):
    from vit_finetune.cli import main

    assert main(["--recipe", "food101_384_lora", "--keys", "train.lr=0.25"]) == 0
    lines = {line.split(" = ")[0]: line for line in capsys.readouterr().out.splitlines()}
    assert set(lines) == set(key_descriptions())
    assert lines["train.lr"].split("#")[0].split(" = ")[1].strip() == "0.25"
    assert lines["model.lora.r"].split("#")[0].split(" = ")[1].strip() == str(load_recipe("food101_384_lora").model.lora.r)
    assert "# peak learning rate" in lines["train.lr"]


def test_push_without_a_token_speaks_of_the_push_command(tmp_path, capsys):
    from vit_finetune.cli import main

    (tmp_path / "metrics.json").write_text("{}")
    assert main(["push", str(tmp_path), "--repo-id", "user/x"]) == 1
    error = capsys.readouterr().err
    assert "push needs a token" in error and "hf auth login" in error and "hub.push" not in error


@pytest.fixture(scope="module")
def no_validation_split(tmp_path_factory):
    """Class folders with no split folders: the eval split must be carved from train."""
    return write_colour_folder(tmp_path_factory.mktemp("flat"), classes=3, train=10, splits=False)


@pytest.mark.slow
def test_a_log_file_gets_plain_lines_and_a_carved_eval_split_is_said_everywhere(base, no_validation_split,
                                                                                warm_launcher, tmp_path):
    output = tmp_path / "run"
    result = warm_launcher.cli(f"model.base={base}", f"data.dataset={no_validation_split}", f"output_dir={output}",
                               "model.image_size=32", "train.batch_size=9", "train.epochs=2", "train.log_every_steps=2",
                               "data.num_workers=0", "data.eval_fraction=0.1")
    assert result.returncode == 0, result.stderr[-2000:]
    # Captured output is not a terminal: one line per logged step, no carriage-return redraws.
    assert "\r" not in result.stderr
    step_lines = [line for line in result.stderr.splitlines() if line.startswith("train step ")]
    assert [line.split()[2] for line in step_lines] == ["2/6", "4/6", "6/6"]
    assert all(" loss " in line and " img_s " in line for line in step_lines)
    metrics = json.loads((output / "metrics.json").read_text())
    assert metrics["eval_carved_from_train"] is True and metrics["eval_samples"] == 3  # 10 % of 30, stratified
    assert "10% of 'train' held out for evaluation (3 images" in result.stdout
    assert "3 eval images held out from `train` (10%" in (output / "README.md").read_text()


def test_a_quiet_run_called_in_process_gives_the_caller_its_logging_and_warnings_back(tmp_path, capsys):
    """--quiet silences the libraries for the run only: a notebook (or a test) calling main() keeps its warnings and
    log records afterwards, and its environment is as it was."""
    import logging
    import os
    import warnings

    from vit_finetune.cli import main

    switches = ("TRANSFORMERS_VERBOSITY", "PYTHONWARNINGS", "HF_DATASETS_DISABLE_PROGRESS_BARS")
    before = logging.root.manager.disable, list(warnings.filters), {k: os.environ.get(k) for k in switches}
    assert main(["--quiet", f"model.base={tmp_path / 'no-such-base'}", f"output_dir={tmp_path / 'out'}"]) != 0
    assert "no-such-base" in capsys.readouterr().err  # the run got as far as loading the base, quietly
    assert (logging.root.manager.disable, list(warnings.filters), {k: os.environ.get(k) for k in switches}) == before
    assert logging.getLogger("transformers").isEnabledFor(logging.WARNING)


@pytest.fixture(scope="module")
def quiet_run(base, images, tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """One `--quiet` run in a fresh interpreter (the libraries warn once per process, some as they are imported),
    shared by the tests below. A LoRA run: it meets warnings from the libraries (transformers' deprecations under
    peft) and writes everything a full run writes, the merged model included, and the adapter too."""
    output = tmp_path_factory.mktemp("quiet") / "q"
    result = run_cli("--quiet", f"model.base={base}", f"data.dataset={images}", f"output_dir={output}",
                     "model.image_size=32", "train.batch_size=8", "train.max_steps=2", "data.num_workers=0",
                     "model.lora={r: 4, alpha: 8}")
    assert result.returncode == 0, result.stderr[-2000:]
    return result, output


@pytest.mark.slow
def test_quiet_prints_only_the_result(quiet_run):
    result, output = quiet_run
    assert result.stdout.splitlines()[0].startswith("eval accuracy") and len(result.stdout.splitlines()) == 1
    assert result.stderr.strip() == ""
    assert json.loads((output / "metrics.json").read_text())["eval_carved_from_train"] is False


@pytest.mark.slow
def test_quiet_prints_no_library_warning(quiet_run):
    result, output = quiet_run
    assert result.stderr == ""
    assert len(result.stdout.splitlines()) == 1
    assert (output / "adapter").is_dir() and (output / "model.safetensors").is_file()


# Where `python -m vit_finetune` enters (vit_finetune/__main__.py), reporting at the process's exit whether the
# collector is on and how many objects it has frozen.
COMMAND_WITH_A_COLLECTOR_REPORT = (
    "import atexit, gc, runpy, sys\n"
    "atexit.register(lambda: print('collector', gc.isenabled(), gc.get_freeze_count()))\n"
    "sys.argv = ['vit_finetune', *sys.argv[1:]]\n"
    "runpy.run_module('vit_finetune', run_name='__main__', alter_sys=True)\n")


@pytest.mark.slow
def test_a_command_freezes_what_the_training_stack_made_and_a_caller_of_the_api_keeps_its_collector(args, tmp_path):
    import gc

    from runs import train

    # A command's own process: the libraries' objects leave the collector's reach, and it collects on.
    result = subprocess.run([sys.executable, "-c", COMMAND_WITH_A_COLLECTOR_REPORT, *args,
                             f"output_dir={tmp_path / 'command'}"], capture_output=True, text=True, cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    _, enabled, frozen = result.stdout.splitlines()[-1].split()
    assert enabled == "True" and int(frozen) > 100_000, result.stdout[-500:]
    assert (tmp_path / "command" / "model.safetensors").is_file()
    # The same training called in this process (a notebook's, a test's): nothing more is frozen (what was frozen
    # before may be freed by its reference count).
    before = gc.get_freeze_count()
    assert train([*args, f"output_dir={tmp_path / 'in-process'}"]) == 0
    assert gc.isenabled() and gc.get_freeze_count() <= before
