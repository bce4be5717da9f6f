"""Streamed shards: a checkpoint names its Hub shards by what they hold (size and content hash from the Hub's
metadata), not by the repo's commit, so an unrelated commit leaves it resumable while a changed shard is still
refused; and a damaged shard stops the run before training, naming the shard and what is wrong with it."""

from __future__ import annotations

import io
import json
import shutil
import tarfile
from pathlib import Path

import pytest

from runs import SimulatedKill, kill_at, train
from test_streaming import CLASSES, EVAL_PER_CLASS, RECIPE, TRAIN_PER_CLASS, colour_table, write_shards, write_webdataset
from tiny import make_tiny_vit, write_colour_folder


@pytest.fixture(scope="module")
def tables(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("shards")
    images = write_colour_folder(root / "colours", classes=CLASSES, train=TRAIN_PER_CLASS, validation=EVAL_PER_CLASS)
    table = colour_table(images)
    shards = write_shards(table, root / "shards", {"train": 2, "validation": 1})
    return {"root": root, "images": images, "table": table, "shards": shards, "base": make_tiny_vit(root / "tiny-vit")}


def killed_at_step_3(args: list[str]) -> None:
    with pytest.raises(SimulatedKill):
        train([*args, "train.checkpoint_every_steps=2"], callbacks=[kill_at(3)])


def test_an_unrelated_commit_to_the_dataset_repo_keeps_checkpoints_resumable(tables, hub, tmp_path, capsys):
    repo = "user/shards-with-later-commits"
    hub.add_repo(repo, {f"data/{p.name}": p for p in tables["shards"].glob("*.parquet")}, repo_type="dataset")
    out = tmp_path / "out"
    args = [f"model.base={tables['base']}", f"data.dataset={repo}", *RECIPE, f"output_dir={out}"]
    killed_at_step_3(args)
    hub.commit_files(repo, {"LICENSE.txt": b"CC-BY-4.0\n"}, repo_type="dataset", commit_message="Add a licence")
    assert train([*args, "train.checkpoint_every_steps=2", "train.resume=auto"]) == 0, capsys.readouterr().err[-2000:]
    assert json.loads((out / "metrics.json").read_text())["steps"] == 12


def test_a_changed_hub_shard_still_refuses_the_resume(tables, hub, tmp_path, capsys):
    repo = "user/shards-rewritten"
    hub.add_repo(repo, {f"data/{p.name}": p for p in tables["shards"].glob("*.parquet")}, repo_type="dataset")
    out = tmp_path / "out"
    args = [f"model.base={tables['base']}", f"data.dataset={repo}", *RECIPE, f"output_dir={out}"]
    killed_at_step_3(args)
    first, second = sorted(tables["shards"].glob("train-*.parquet"))
    hub.commit_files(repo, {f"data/{first.name}": second}, repo_type="dataset", commit_message="Replace a shard")
    assert train([*args, "train.checkpoint_every_steps=2", "train.resume=auto"]) == 1
    assert "the data of the train split(s) changed since it was written" in capsys.readouterr().err
    assert not (out / "metrics.json").exists()


def damage(kind: str, tables: dict, folder: Path) -> str:
    """Damage the second train shard of a copy of the shards in `folder`; returns the damaged shard's name."""
    shard = folder / "train-00001-of-00002.parquet"
    second_half = tables["table"]["train"].shard(2, 1, contiguous=True)
    if kind == "no rows":
        second_half.select([]).to_parquet(str(shard))
    elif kind == "renamed column":
        second_half.rename_column("image", "picture").to_parquet(str(shard))
    elif kind == "truncated":
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    elif kind == "empty file":
        shard.write_bytes(b"")
    return shard.name


@pytest.mark.parametrize("kind, problem", [("no rows", "holds no rows"),
                                           ("renamed column", "has no column 'image'"),
                                           ("truncated", "is not a readable parquet file"),
                                           ("empty file", "is not a readable parquet file")])
def test_a_damaged_parquet_shard_stops_the_run_before_training_naming_it(tables, tmp_path, capsys, kind, problem):
    shards = Path(shutil.copytree(tables["shards"], tmp_path / "shards"))
    name = damage(kind, tables, shards)
    out = tmp_path / "out"
    assert train([f"model.base={tables['base']}", f"data.dataset={shards}", *RECIPE, f"output_dir={out}"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and "train.max_steps" not in err, err[-3000:]
    error = next(line for line in reversed(err.splitlines()) if line.startswith("error: "))
    assert name in error and problem in error, error
    assert "train step" not in err and "Loading weights" not in err  # before the model loads, let alone trains
    assert not (out / "checkpoints").exists()


def test_a_truncated_tar_shard_stops_the_run_instead_of_dropping_its_last_rows(tables, tmp_path, capsys):
    shards = write_webdataset(tables["images"], tmp_path / "wds", {"train": 2, "validation": 1})
    cut = shards / "train-00001.tar"
    members = tarfile.open(cut).getmembers()
    cut.write_bytes(cut.read_bytes()[: members[-3].offset_data + 10])  # inside the third-last member's data
    out = tmp_path / "out"
    assert train([f"model.base={tables['base']}", f"data.dataset={shards}", *RECIPE, f"output_dir={out}",
                  "train.max_steps=3", "data.label_names=[blue,green,red]"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err, err[-3000:]
    error = next(line for line in reversed(err.splitlines()) if line.startswith("error: "))
    assert "train-00001.tar" in error and "truncated" in error, error
    assert "train step" not in err and not (out / "metrics.json").exists()


@pytest.mark.parametrize("cut", ["inside a member", "at a block boundary"])
def test_a_truncated_tar_shard_on_the_hub_stops_the_run_before_training(tables, hub, tmp_path, capsys, cut):
    shards = write_webdataset(tables["images"], tmp_path / "wds", {"train": 2, "validation": 1})
    whole = f"user/wds-whole-{cut.replace(' ', '-')}"
    hub.add_repo(whole, {f"data/{p.name}": p for p in shards.glob("*.tar")}, repo_type="dataset")
    damaged = shards / "train-00001.tar"
    members = tarfile.open(damaged).getmembers()
    end = members[-3].offset_data + (10 if cut == "inside a member" else 512)
    damaged.write_bytes(damaged.read_bytes()[:end])
    repo = f"user/wds-cut-{cut.replace(' ', '-')}"
    hub.add_repo(repo, {f"data/{p.name}": p for p in shards.glob("*.tar")}, repo_type="dataset")
    args = [f"model.base={tables['base']}", *RECIPE, "train.max_steps=3", "data.label_names=[blue,green,red]"]
    assert train([*args, f"data.dataset={repo}", f"output_dir={tmp_path / 'out'}"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err, err[-3000:]
    error = next(line for line in reversed(err.splitlines()) if line.startswith("error: "))
    assert "train-00001.tar" in error and "truncated" in error, error
    assert "train step" not in err and not (tmp_path / "out" / "metrics.json").exists()
    # the same shards whole still train
    assert train([*args, f"data.dataset={whole}", f"output_dir={tmp_path / 'whole'}"]) == 0
    assert json.loads((tmp_path / "whole" / "metrics.json").read_text())["steps"] == 3
