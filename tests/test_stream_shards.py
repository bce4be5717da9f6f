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
