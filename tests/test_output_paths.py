"""Paths a run reads and writes: overwrite=true never clears a folder the run reads (model.base, the distillation
teacher, a label file's images = output_dir), and `~` means one folder for the safety checks and the writes alike."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from runs import RECIPE, train
from test_output_dir import SHORT, error_line, snapshot


@pytest.fixture(scope="module")
def finished(tmp_path_factory, args) -> Path:
    """A finished run's output folder, which a later run may start from (model.base)."""
    out = tmp_path_factory.mktemp("finished") / "run"
    assert train([*args, *SHORT, f"output_dir={out}"]) == 0
    return out


@pytest.mark.parametrize("spelled", ["same", "symlink", "relative"])
def test_a_run_from_its_own_output_dir_is_refused_before_anything_is_cleared(finished, images, tmp_path, capsys,
                                                                            monkeypatch, spelled):
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    before = snapshot(out)
    monkeypatch.chdir(tmp_path)
    base = {"same": out, "symlink": tmp_path / "link", "relative": Path("run/../run/.")}[spelled]
    if spelled == "symlink":
        base.symlink_to(out)
    code = train([f"model.base={base}", f"data.dataset={images}", *RECIPE, *SHORT, f"output_dir={out}",
                  "overwrite=true"])
    error = error_line(capsys.readouterr().err)
    assert code == 1
    assert "model.base" in error and "another output_dir" in error, error
    assert snapshot(out) == before  # the finished run, its weights and metrics, all still there


def test_a_base_inside_a_folder_the_run_replaces_is_refused(finished, images, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    (out / "best").mkdir()  # a folder a run writes (train.keep_best): overwrite=true clears it
    for name in ("config.json", "model.safetensors", "preprocessor_config.json"):
        shutil.copy(out / name, out / "best" / name)
    before = snapshot(out)
    assert train([f"model.base={out / 'best'}", f"data.dataset={images}", *RECIPE, *SHORT, f"output_dir={out}",
                  "overwrite=true"]) == 1
    error = error_line(capsys.readouterr().err)
    assert "model.base" in error and "another output_dir" in error, error
    assert snapshot(out) == before


@pytest.mark.parametrize("spelled", ["same", "symlink", "relative", "inside"])
def test_a_distillation_teacher_in_the_output_dir_is_refused_before_anything_is_cleared(finished, images, tmp_path,
                                                                                        capsys, monkeypatch, spelled):
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    if spelled == "inside":  # a copy of the teacher in a folder the run writes (checkpoints/): cleared as well
        shutil.copytree(finished, out / "checkpoints" / "teacher")
    before = snapshot(out)
    monkeypatch.chdir(tmp_path)
    teacher = {"same": out, "symlink": tmp_path / "link", "relative": Path("run/../run/."),
               "inside": out / "checkpoints" / "teacher"}[spelled]
    if spelled == "symlink":
        teacher.symlink_to(out)
    code = train([f"model.base={finished}", f"data.dataset={images}", *RECIPE, *SHORT, f"output_dir={out}",
                  "overwrite=true", f"train.distill.teacher={teacher}"])
    error = error_line(capsys.readouterr().err)
    assert code == 1
    assert "train.distill.teacher" in error and "another output_dir" in error, error
    assert snapshot(out) == before  # the teacher's weights, config and metrics: all still there


@pytest.mark.parametrize("where", ["inside", "symlink", "equal"])
def test_an_output_dir_in_a_label_files_folder_is_refused_before_anything_is_written(base, tmp_path, capsys,
                                                                                     monkeypatch, where):
    from tiny import write_label_sets

    label_file = write_label_sets(tmp_path / "data", images=6)
    (tmp_path / "link").symlink_to(tmp_path / "data")
    before = snapshot(tmp_path / "data")
    monkeypatch.chdir(tmp_path)
    out = {"inside": "data/runs", "symlink": "link/runs", "equal": "data"}[where]
    code = train([f"model.base={base}", f"data.dataset={label_file}", *RECIPE, *SHORT, f"output_dir={out}"])
    error = error_line(capsys.readouterr().err)
    assert code == 1 and "overlaps the dataset's folder" in error, error
    assert snapshot(tmp_path / "data") == before and not (tmp_path / "data" / "runs").exists()


@pytest.mark.parametrize("where", ["the file", "under the file"])
def test_an_output_dir_that_is_a_file_is_named_as_one(args, tmp_path, capsys, where):
    notes = tmp_path / "notes.txt"
    notes.write_text("mine\n")
    out = notes if where == "the file" else notes / "run"
    assert train([*args, *SHORT, f"output_dir={out}"]) == 1
    error = error_line(capsys.readouterr().err)
    assert "which is a file" in error if where == "under the file" else "is a file, not a folder" in error, error
    assert "disk space" not in error and notes.read_text() == "mine\n"


def test_a_finished_run_is_a_base_for_a_run_into_another_folder(finished, images, tmp_path):
    out = tmp_path / "next"
    before = snapshot(finished)
    assert train([f"model.base={finished}", f"data.dataset={images}", *RECIPE, *SHORT, f"output_dir={out}"]) == 0
    assert json.loads((out / "metrics.json").read_text())["steps"] == 2
    assert snapshot(finished) == before


def test_a_tilde_means_the_home_folder_for_the_checks_and_the_writes(base, images, tmp_path, monkeypatch, capsys):
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    shutil.copytree(base, home / "base")
    shutil.copytree(images, home / "images")
    # A folder literally named `~` in the working directory, holding the user's files: never written into.
    users = work / "~" / "x"
    users.mkdir(parents=True)
    (users / "README.md").write_text("# my notes\n")
    (users / "config.json").write_text('{"mine": true}\n')
    before = snapshot(work)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    assert train(["model.base=~/base", "data.dataset=~/images", *RECIPE, *SHORT, "output_dir=~/x"]) == 0
    assert snapshot(work) == before
    assert json.loads((home / "x" / "metrics.json").read_text())["steps"] == 2
    written = (home / "x" / "recipe.yaml").read_text()
    assert f"output_dir: {home / 'x'}" in written and f"base: {home / 'base'}" in written

    # The checks look where the run writes: the user's files in ~/x are refused without overwrite=true.
    (home / "y").mkdir()
    (home / "y" / "notes.txt").write_text("mine\n")
    assert train(["model.base=~/base", "data.dataset=~/images", *RECIPE, *SHORT, "output_dir=~/y"]) == 1
    assert "holds files this toolkit did not write" in error_line(capsys.readouterr().err)
    assert sorted(p.name for p in (home / "y").iterdir()) == ["notes.txt"]
    assert snapshot(work) == before
