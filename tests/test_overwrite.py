"""overwrite=true: the finished run in output_dir is touched only once the new run has passed every check made before
training; it is set aside (not deleted) until the new run's outputs are written, comes back if the new run fails or
is killed, and only what it wrote is ever moved: a user's file inside a folder a run writes in stays."""

from __future__ import annotations

import hashlib
import json
import shutil
import signal
from pathlib import Path

import pytest

from runs import before_batch, completed, exists, launch_and_kill, train
from vit_finetune.artifacts.publish import published_files
from vit_finetune.core.layout import LOCK, MANIFEST, PREVIOUS_RUN

SHORT = ["train.max_steps=2"]
USERS_LOG = Path("runs") / "my_experiment_log.txt"


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under `folder` and its hash; the lock is left out (each run writes its process id there)."""
    return {str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in folder.rglob("*") if path.is_file() and path.name != LOCK}


@pytest.fixture(scope="module")
def finished(args, tmp_path_factory) -> Path:
    """A finished run with a checkpoint and the pictures, and a log the user put in its runs/ folder afterwards."""
    out = tmp_path_factory.mktemp("finished") / "run"
    assert train([*args, "train.max_steps=3", "train.checkpoint_every_steps=2", "pictures=true",
                  f"output_dir={out}"]) == 0
    (out / USERS_LOG).parent.mkdir(exist_ok=True)
    (out / USERS_LOG).write_text("my notes on this run\n")
    return out


@pytest.fixture
def previous(finished, tmp_path) -> Path:
    """A copy of the finished run of this module for one test to run into."""
    return Path(shutil.copytree(finished, tmp_path / "run"))


def test_a_users_file_in_a_folder_a_run_writes_in_survives_overwrite(args, previous):
    pytest.importorskip("tensorboard", reason="tensorboard is a dev dependency (pip install -e '.[dev]')")
    assert train([*args, *SHORT, f"output_dir={previous}", "overwrite=true", "train.report_to=[tensorboard]"]) == 0
    assert (previous / USERS_LOG).read_text() == "my notes on this run\n"
    assert not (previous / "checkpoints").exists()  # the previous run's checkpoint went with it
    assert not (previous / PREVIOUS_RUN).exists()
    events = list((previous / "runs" / previous.name).glob("events.out.tfevents.*"))
    assert len(events) == 1  # the tracker's log of this run, recorded as written
    assert f"runs/{previous.name}" in json.loads((previous / MANIFEST).read_text())["written"]
    assert f"runs/{previous.name}" in published_files(previous) and str(USERS_LOG) not in published_files(previous)
    # A second overwrite replaces that log and still keeps the user's.
    assert train([*args, *SHORT, f"output_dir={previous}", "overwrite=true", "train.report_to=[tensorboard]"]) == 0
    assert list((previous / "runs" / previous.name).glob("events.out.tfevents.*")) != events
    assert (previous / USERS_LOG).read_text() == "my notes on this run\n"


REFUSED = {
    "no such dataset": (lambda tmp: [f"data.dataset={tmp / 'no_such_photos'}"], "no_such_photos"),
    "keep_best a single-label run does not measure": (lambda tmp: ["train.keep_best=eval_map"], "train.keep_best=eval_map"),
    "wise_ft_alpha with no probe": (lambda tmp: ["train.method=auto", "train.wise_ft_alpha=0.5"],
                                    "train.wise_ft_alpha=0.5"),
    "regression with no target column": (lambda tmp: ["data.task=regression"], "no target column"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_refused_overwrite_leaves_the_finished_run_byte_identical(args, previous, tmp_path, capsys, case):
    overrides, said = REFUSED[case]
    before = snapshot(previous)
    assert train([*args, *SHORT, f"output_dir={previous}", "overwrite=true", *overrides(tmp_path)]) == 1
    assert said in capsys.readouterr().err
    assert snapshot(previous) == before
    assert not (previous / PREVIOUS_RUN).exists()


def test_an_overwrite_that_fails_before_a_checkpoint_puts_the_finished_run_back(args, previous, capsys):
    before = snapshot(previous)

    def fail(batch: int) -> None:
        if batch == 2:
            raise RuntimeError("a failure during training")

    with pytest.raises(RuntimeError, match="a failure during training"):
        train([*args, *SHORT, f"output_dir={previous}", "overwrite=true"], callbacks=[before_batch(fail)])
    assert "the run it was replacing is back" in capsys.readouterr().out
    assert snapshot(previous) == before
    assert not (previous / PREVIOUS_RUN).exists()


def test_a_killed_overwrite_leaves_the_finished_run_aside_and_the_next_run_puts_it_back_or_resumes(
        args, previous, warm_launcher, tmp_path, capsys):
    from transformers import AutoModelForImageClassification

    before = snapshot(previous)
    run = [*args, f"output_dir={previous}", "train.checkpoint_every_steps=2", "train.max_steps=6"]
    killed = launch_and_kill(warm_launcher, [*run, "overwrite=true"], tmp_path / "record",
                             exists(completed(previous, 4)), tmp_path / "killed.log")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    # Killed after its checkpoint at step 4: the finished run is whole, set aside; the user's log never moved.
    aside = previous / PREVIOUS_RUN
    assert {name: digest for name, digest in snapshot(aside).items()} == {
        name: digest for name, digest in before.items() if name != str(USERS_LOG)}
    assert (previous / USERS_LOG).read_text() == "my notes on this run\n"
    assert not (previous / "metrics.json").exists() and completed(previous, 4).exists()

    # Any run that does not resume puts it back first, with one line, and then meets the finished run.
    copy = Path(shutil.copytree(previous, tmp_path / "copy"))
    assert train([*args, *SHORT, f"output_dir={copy}"]) == 1
    captured = capsys.readouterr()
    assert "was stopped before it finished; the run it was replacing is back as it was" in captured.out
    assert "holds files this toolkit did not write (['runs'])" in captured.err  # the user's log: the first refusal
    assert snapshot(copy) == before
    AutoModelForImageClassification.from_pretrained(copy)  # loads

    # train.resume=auto continues the killed run, which replaces the finished one only once it is done.
    assert train([*run, "train.resume=auto"]) == 0
    captured = capsys.readouterr()
    assert "stays set aside" in captured.out and "resuming from" in captured.out
    assert not aside.exists()
    assert json.loads((previous / "metrics.json").read_text())["steps"] == 6
    assert (previous / USERS_LOG).read_text() == "my notes on this run\n"
    assert completed(previous, 6).exists()  # its own checkpoints


def test_a_second_ctrl_c_stops_in_one_line_saying_where_the_previous_run_is_and_restore_puts_it_back(
        args, previous, tmp_path, capsys):
    """Ctrl-C twice in one step of an overwrite: no traceback, one line naming the folder the finished run is kept in
    and the command that puts it back; predict, evaluate and export on the folder point there too; `restore` does
    it, and says there is nothing left to restore after."""
    import os

    from vit_finetune.cli import main
    from vit_finetune.core.previous_run import after_a_stop_at_once

    before = snapshot(previous)
    # Stopped before it set the finished run aside, an overwrite says that run is untouched (not: resume its checkpoint).
    assert after_a_stop_at_once(previous) == f"the finished run in {previous} is as it was"

    def ctrl_c_twice(batch: int) -> None:
        if batch == 2:
            os.kill(os.getpid(), signal.SIGINT)  # heard: a checkpoint at the step's end, then a stop
            os.kill(os.getpid(), signal.SIGINT)  # impatient: stop now

    assert train([*args, *SHORT, f"output_dir={previous}", "overwrite=true"], callbacks=[before_batch(ctrl_c_twice)]) == 130
    error = capsys.readouterr().err
    aside = previous / PREVIOUS_RUN
    assert "Traceback" not in error and "KeyboardInterrupt" not in error
    line = error.strip().splitlines()[-1]  # the run's own lines before it, and this one
    assert [said for said in error.splitlines() if said.startswith("error:")] == [line]
    assert line.startswith("error: stopped at once by Ctrl-C; this overwrite=true run was not finished; the run it "
                           f"was replacing is kept, whole, in {aside}: put it back with "
                           f"`python -m vit_finetune restore {previous}`"), line
    assert aside.is_dir() and not (previous / "config.json").exists()

    for command in (["predict", str(previous), str(tmp_path)], ["evaluate", str(previous)],
                    ["export", str(previous), "--onnx"]):
        assert main(command) == 1, command
        said = capsys.readouterr().err
        assert f"an overwrite=true run into it stopped before it finished; the run it was replacing is kept, whole, " \
               f"in {aside}: put it back with `python -m vit_finetune restore {previous}`" in said, (command, said)

    assert main(["restore", str(previous)]) == 0
    assert "the run it was replacing is back as it was" in capsys.readouterr().out
    assert snapshot(previous) == before and not aside.exists()
    assert main(["restore", str(previous)]) == 1
    assert "holds no run set aside" in capsys.readouterr().err
    assert snapshot(previous) == before


def test_a_users_file_in_the_staging_folder_is_refused_by_name_not_deleted(args, previous, capsys):
    """The final save's staging folder is cleared by every run: only of what the final save writes there. A file of
    the user's in it stops the run before anything moves, naming it and the fix."""
    from vit_finetune.core.layout import STAGING

    staging = previous / STAGING
    staging.mkdir()
    (staging / "config.json").write_text("{}")  # what a final save cut short leaves: the toolkit's to clear
    (staging / "my_notes.txt").write_text("mine\n")
    before = snapshot(previous)
    assert train([*args, *SHORT, f"output_dir={previous}", "overwrite=true"]) == 1
    error = capsys.readouterr().err
    assert f"{staging} holds ['my_notes.txt'], which this toolkit did not write" in error, error
    assert f"Fix: move '{staging / 'my_notes.txt'}' out of {STAGING}, then run again" in error
    assert snapshot(previous) == before and not (previous / PREVIOUS_RUN).exists()

    (staging / "my_notes.txt").rename(previous.parent / "my_notes.txt")
    assert train([*args, *SHORT, f"output_dir={previous}", "overwrite=true"]) == 0
    assert not staging.exists() and (previous.parent / "my_notes.txt").read_text() == "mine\n"
