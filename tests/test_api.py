"""The Python API as a notebook drives it: several calls in one process, each as the CLI's command would run, with
the CLI's messages raised as VitFinetuneError (never SystemExit) and the files' contents returned as objects."""

from __future__ import annotations

import ast
import json
import sys

import pytest
import torch

import vit_finetune
from runs import RECIPE, assert_bit_identical
from tiny import REPO
from vit_finetune.artifacts.callbacks import Callback, REGISTERED
from vit_finetune.cli import main

ONE_EPOCH = "train.epochs=1"  # 6 steps: enough for a second run's weights to show any state the first one left


class CountSteps(Callback):
    steps = 0

    def on_step_end(self, run):
        self.steps += 1


THREADS = torch.get_num_threads()  # the notebook's, before any run


@pytest.fixture(scope="module")
def first_run(base, images, tmp_path_factory):
    """A notebook's first training, with a callback of its own, another seed, precision and thread count: what a
    second run must not inherit. Its recipe's sections given both ways: dotted keys and dicts."""
    counter = CountSteps()
    recipe = vit_finetune.load_recipe(None, *RECIPE, ONE_EPOCH, model={"base": base},
                                      train={"seed": 2, "mixed_precision": "bf16", "cpu_threads": 2},
                                      **{"data.dataset": images, "output_dir": tmp_path_factory.mktemp("api") / "first"})
    return vit_finetune.train(recipe, callbacks=[counter], quiet=True), counter


def test_a_second_training_in_the_same_process_gives_a_fresh_cli_runs_weights(first_run, base, images, warm_launcher,
                                                                              tmp_path):
    result, counter = first_run
    assert counter.steps == 6 and not REGISTERED  # the run's callback saw it, and was not left registered
    assert result.output_dir.is_dir()
    assert result.metrics == json.loads((result.output_dir / "metrics.json").read_text())
    assert torch.get_num_threads() == THREADS
    overrides = [f"model.base={base}", f"data.dataset={images}", *RECIPE, ONE_EPOCH]
    second = vit_finetune.train(vit_finetune.load_recipe(None, *overrides, output_dir=tmp_path / "api"), quiet=True)
    assert counter.steps == 6  # the first run's callback does not observe the second
    # The reference runs in a process of its own (forked from one that imported the libraries and never ran the
    # toolkit): nothing an earlier run in this one left can reach it.
    fresh = warm_launcher.cli(*overrides, f"output_dir={tmp_path / 'cli'}", "--quiet")
    assert fresh.returncode == 0, fresh.stderr[-2000:]
    assert_bit_identical(second.output_dir / "model.safetensors", tmp_path / "cli" / "model.safetensors")
    assert second.metrics == json.loads((tmp_path / "cli" / "metrics.json").read_text())


def api_and_cli_errors(folder):
    """(what the API is called with, the CLI's arguments for the same mistake)."""
    return [
        (lambda: vit_finetune.load_recipe("demo", **{"train.learning_rate": 0.01}),
         ["--recipe", "demo", "train.learning_rate=0.01", "--print"]),
        (lambda: vit_finetune.load_recipe("demo", train={"epochs": "many"}, data={"dataset": None}),
         ["--recipe", "demo", "train.epochs=many", "data.dataset=null", "--print"]),
        (lambda: vit_finetune.predict(folder / "missing", [folder]), ["predict", str(folder / "missing"), str(folder)]),
        (lambda: vit_finetune.evaluate(folder, split="test"), ["evaluate", str(folder), "--split", "test"]),
        (lambda: vit_finetune.push(folder, "user/x"), ["push", str(folder), "--repo-id", "user/x"]),
    ]


def test_a_mistake_raises_the_toolkits_error_with_the_message_the_cli_prints(tmp_path, capsys):
    for call, argv in api_and_cli_errors(tmp_path):
        assert main(argv) != 0, argv
        printed = capsys.readouterr().err
        with pytest.raises(vit_finetune.VitFinetuneError) as raised:  # a SystemExit would fail the test here
            call()
        assert f"error: {raised.value}\n" == printed, argv
    with pytest.raises(vit_finetune.VitFinetuneError, match="did you mean 'train.lr'"):
        vit_finetune.load_recipe("demo", **{"train.learning_rate": 0.01})
    with pytest.raises(vit_finetune.VitFinetuneError, match=r"top_k=0: 0 is below 1"):
        vit_finetune.predict(tmp_path, [tmp_path], top_k=0)  # argparse's check, without argparse's exit


def test_predict_returns_the_rows_predict_output_writes(first_run, images, tmp_path, capsys):
    result, _ = first_run
    validation = images / "validation"
    assert main(["predict", str(result.output_dir), str(validation), "--top-k", "2",
                 "--output", str(tmp_path / "rows.jsonl")]) == 0, capsys.readouterr().err[-2000:]
    written = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    rows = vit_finetune.predict(result.output_dir, validation, top_k=2)
    assert rows == written
    assert len(rows) == 9 and all(len(row["predictions"]) == 2 and row["error"] is None for row in rows)


def test_evaluate_returns_the_metrics_evaluate_writes(first_run, tmp_path, capsys):
    result, _ = first_run
    assert main(["evaluate", str(result.output_dir), "--output-dir", str(tmp_path / "cli")]) == 0, \
        capsys.readouterr().err[-2000:]
    metrics = vit_finetune.evaluate(result.output_dir)
    assert json.loads(json.dumps(metrics)) == json.loads((tmp_path / "cli" / "metrics.json").read_text())
    assert metrics["accuracy"] == result.metrics["accuracy"]  # the run's own eval split, reproduced


def test_push_sends_the_run_and_returns_its_url(first_run, hub, hub_token, hub_repo_id, monkeypatch):
    result, _ = first_run
    monkeypatch.setenv("HF_TOKEN", hub_token)
    pushed = vit_finetune.push(result.output_dir, hub_repo_id)
    assert hub_repo_id in pushed.url and pushed.app is None
    files = hub.repo_files(hub_repo_id)
    assert files["model.safetensors"] == (result.output_dir / "model.safetensors").read_bytes()


def notebook_block() -> str:
    """The Python block of README's "In a notebook"."""
    section = (REPO / "README.md").read_text().split("## In a notebook", 1)[1].split("\n## ", 1)[0]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


def test_the_readmes_notebook_block_calls_the_api_as_it_is():
    """Every vit_finetune name the block uses is the package's, and its recipe loads as written (the training, on the
    reader's own photos, is what the tests above run on theirs)."""
    tree = ast.parse(notebook_block())
    used = {node.attr for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "vit_finetune"}
    assert used == {"load_recipe", "train", "predict", "evaluate"} and used <= set(vit_finetune.__all__)
    loading = next(node.value for node in ast.walk(tree) if isinstance(node, ast.Assign)
                   and isinstance(node.value, ast.Call) and ast.unparse(node.value.func) == "vit_finetune.load_recipe")
    recipe = eval(compile(ast.Expression(loading), "README.md", "eval"), {"vit_finetune": vit_finetune})
    assert (recipe.data.dataset, recipe.data.horizontal_flip, recipe.output_dir) == ("my_photos", False,
                                                                                     "outputs/my_photos_tiny")


class KernelShell:
    """What tqdm and the toolkit read of a Jupyter kernel's shell (IPython.get_ipython()): its config names the kernel
    app. A kernel cannot run here (no ipykernel), so its shell is stood in for; IPython itself is real where present."""

    config = {"IPKernelApp": {"connection_file": "kernel.json"}}


def test_progress_in_a_notebook_cell_is_a_bar_and_plain_lines_elsewhere(monkeypatch, capsys):
    from tqdm.std import tqdm

    from vit_finetune.core import progress

    plain = progress.progress(10, desc="train")  # pytest's stderr is no terminal: one line per logged step
    assert isinstance(plain, progress.LogLines) and not progress.interactive()
    fake_ipython = type(sys)("IPython")
    fake_ipython.get_ipython = KernelShell
    monkeypatch.setitem(sys.modules, "IPython", fake_ipython)
    assert progress.in_notebook() and progress.interactive()
    bar = progress.progress(10, desc="train")
    try:
        assert isinstance(bar, tqdm)  # tqdm.auto's: the notebook bar with ipywidgets, else its redrawn text bar
        bar.update(3)
    finally:
        bar.close()
    fake_ipython.get_ipython = lambda: None  # IPython imported in a plain interpreter: no kernel
    assert not progress.in_notebook()
