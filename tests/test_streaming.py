"""Streaming (data.streaming=true): parquet (or WebDataset) shards read while training, from the loopback Hub or a
local folder.

- Two processes (as torchrun starts them, gloo) stream from a loopback Hub dataset repo: in each epoch the ranks
  train on disjoint rows whose union is the whole train split; the eval split, of an odd size that the ranks share
  unevenly, is counted once, and its metrics equal a one-process evaluation of the saved model on the same images;
  a run resumed from one of its checkpoints ends with bit-identical weights.
- One process on a local folder: killed with SIGKILL and resumed with train.resume=auto (with DataLoader workers
  this time), it trains on the same batches and ends with bit-identical weights.
- WebDataset tar shards train with data.label_names and train.max_steps, and evaluate like the same rows as parquet.
- Under FSDP (tests/test_sharded.py's launch) the uneven eval shares are evaluated in lockstep.
- The clear errors: a source that is not shards, labels without a ClassLabel or names, no eval split, no row count.

Each row's pixels are identified by a fingerprint (tests/recorder.py). With data.crop_scale=[1, 1] and no flip, the
training transform is deterministic (the centre square, resized), so the test can compute every row's fingerprint.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
import torch

import recorder
from runs import FLOAT32, SimulatedKill, WarmLauncher, assert_bit_identical, completed, kill_at, train
from tiny import make_tiny_vit, write_colour_folder

CLASSES, TRAIN_PER_CLASS, EVAL_PER_CLASS = 3, 8, 3  # 24 train rows, 9 eval rows
TRAIN_SHARDS, EVAL_SHARDS = 4, 3  # 2 processes: whole shards for train; rows for eval (3 is not a multiple of 2)
BATCH = 4
RECIPE = ["model.image_size=32", f"train.batch_size={BATCH}", "train.epochs=2", "train.lr=0.005", "train.seed=1",
          "train.log_every_steps=1", "data.num_workers=0", "data.streaming=true", "data.shuffle_buffer=5",
          FLOAT32]
FIXED_CROP = ["data.crop_scale=[1.0,1.0]"]  # on square images: each row's training pixels are known


def colour_table(images: Path):
    """The colour folder as a datasets DatasetDict with the PNG bytes inside and a ClassLabel, as push_to_hub writes."""
    import datasets

    names = sorted(p.name for p in (images / "train").iterdir())
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=names)})
    splits = {}
    for split in ("train", "validation"):
        files = sorted((images / split).glob("*/*.png"))
        splits[split] = datasets.Dataset.from_dict(
            {"image": [{"bytes": square_png(f), "path": f"{f.parent.name}/{f.name}"} for f in files],
             "label": [names.index(f.parent.name) for f in files]}, features=features)
    return datasets.DatasetDict(splits)


def square_png(path: Path) -> bytes:
    """The image's top square as PNG bytes: on a square image, a crop of the whole area is the whole image, so the
    fixed crop (FIXED_CROP) is deterministic."""
    from PIL import Image

    with Image.open(path) as image:
        side = min(image.size)
        encoded = io.BytesIO()
        image.crop((0, 0, side, side)).save(encoded, format="PNG")
    return encoded.getvalue()


def write_shards(table, folder: Path, shards: dict[str, int]) -> Path:
    """Parquet shards named as datasets names splits: <split>-00000-of-0000N.parquet."""
    folder.mkdir(parents=True, exist_ok=True)
    for split, count in shards.items():
        for index in range(count):
            table[split].shard(count, index, contiguous=True).to_parquet(
                str(folder / f"{split}-{index:05d}-of-{count:05d}.parquet"))
    return folder


@pytest.fixture(scope="module")
def tables(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("streaming")
    images = write_colour_folder(root / "colours", classes=CLASSES, train=TRAIN_PER_CLASS, validation=EVAL_PER_CLASS)
    table = colour_table(images)
    shards = write_shards(table, root / "shards", {"train": TRAIN_SHARDS, "validation": EVAL_SHARDS})
    return {"root": root, "images": images, "table": table, "shards": shards, "base": make_tiny_vit(root / "tiny-vit")}


def train_fingerprints(table) -> dict[str, int]:
    """Each train row's fingerprint under the fixed crop -> its row number."""
    from vit_finetune import data
    from vit_finetune.recipe import DataSettings

    settings = DataSettings(crop_scale=(1.0, 1.0))
    found = {}
    for number, row in enumerate(table["train"].cast_column("image", __import__("datasets").Image(decode=False))):
        image = data.decode_image(row["image"], number, settings)
        pixels = data.train_transform(image, 32, data.sample_rng(0, 0, 0), settings)
        found[recorder.fingerprint(pixels)] = number
    assert len(found) == len(table["train"]), "two train images share their pixels: the test could not tell them apart"
    return found


def rows_per_rank_and_epoch(samples: list[dict], fingerprints: dict[str, int]) -> dict[tuple[int, int], list[int]]:
    seen = defaultdict(list)
    for entry in samples:
        seen[entry["epoch"], entry["rank"]] += [fingerprints[f] for f in entry["samples"]]
    return dict(seen)


# ---------------------------------------------------------------- two processes, from the loopback Hub


def two_processes(warm: WarmLauncher, args: list[str], record: Path) -> subprocess.CompletedProcess:
    """2 processes as torchrun starts them, forked by the session's warm launcher (conftest.warm_launcher): these tests
    are of the stream's split between ranks, not of the launcher."""
    return warm.run(args, {recorder.ENV: str(record)}, record.with_suffix(".log"))


@pytest.fixture(scope="module")
def hub_dataset(tables, hub_server) -> str:
    from conftest import HUB_TOKEN

    repo_id = "user/streamed-colours"
    tables["table"].push_to_hub(repo_id, token=HUB_TOKEN, num_shards={"train": TRAIN_SHARDS, "validation": EVAL_SHARDS})
    return repo_id


@pytest.fixture(scope="module")
def two_process_run(tables, hub_dataset, warm_launcher) -> dict:
    root = tables["root"] / "ddp"
    out, record = root / "out", root / "record"
    args = [f"model.base={tables['base']}", f"data.dataset={hub_dataset}", *RECIPE, *FIXED_CROP,
            "train.checkpoint_every_steps=2", "train.keep_checkpoints=10"]
    result = two_processes(warm_launcher, [*args, f"output_dir={out}"], record)
    assert result.returncode == 0, result.stderr[-3000:]
    return {"root": root, "out": out, "record": record, "args": args}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_processes_stream_disjoint_rows_covering_the_split_each_epoch(tables, two_process_run):
    samples = recorder.read_samples(two_process_run["record"])
    seen = rows_per_rank_and_epoch(samples, train_fingerprints(tables["table"]))
    rows = set(range(CLASSES * TRAIN_PER_CLASS))
    assert sorted(seen) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for epoch in (0, 1):
        rank_0, rank_1 = seen[epoch, 0], seen[epoch, 1]
        assert len(rank_0) == len(rank_1) == len(rows) // 2  # the same number of steps on both ranks
        assert not set(rank_0) & set(rank_1), f"epoch {epoch}: a row was trained on by both ranks"
        assert set(rank_0) | set(rank_1) == rows, f"epoch {epoch}: rows missed"
    assert seen[0, 0] != seen[1, 0], "the second pass was not reshuffled"
    assert_bit_identical(two_process_run["record"] / "weights-0.safetensors",
                         two_process_run["record"] / "weights-1.safetensors")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_streamed_evaluation_counts_each_image_once_and_equals_one_process(tables, two_process_run):
    metrics = json.loads((two_process_run["out"] / "metrics.json").read_text())
    reference = evaluate_in_one_process(two_process_run["out"], tables["table"]["validation"])
    assert metrics["eval_samples"] == CLASSES * EVAL_PER_CLASS
    assert metrics["confusion_matrix"] == reference["confusion_matrix"]
    assert metrics["accuracy"] == reference["accuracy"]
    assert metrics["eval_loss"] == pytest.approx(reference["eval_loss"], rel=1e-6)


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.skipif(torch.cuda.device_count() == 1, reason="FSDP with 2 processes needs 2 GPUs (NCCL refuses two "
                    "ranks on one GPU); this machine has 1")
def test_a_streamed_run_under_fsdp_evaluates_uneven_shares_in_lockstep(tables, warm_launcher, tmp_path):
    """A sharded model's forward is a collective: the ranks' eval shares (5 and 4 rows, batch 4: 2 and 1 batches)
    must still be evaluated without a hang, each image once (on CPU, as tests/test_sharded.py explains)."""
    from test_sharded import FSDP_CONFIG, FSDP_ON_CPU, succeeded

    out = tmp_path / "out"
    succeeded(warm_launcher.run([f"model.base={tables['base']}", f"data.dataset={tables['shards']}",
                                 f"output_dir={out}", *RECIPE, "train.epochs=1"], FSDP_ON_CPU, tmp_path / "fsdp.log",
                                FSDP_CONFIG))
    metrics = json.loads((out / "metrics.json").read_text())
    reference = evaluate_in_one_process(out, tables["table"]["validation"])
    assert metrics["eval_samples"] == CLASSES * EVAL_PER_CLASS
    assert metrics["confusion_matrix"] == reference["confusion_matrix"]
    assert metrics["eval_loss"] == pytest.approx(reference["eval_loss"], rel=1e-5)


def evaluate_in_one_process(output: Path, split) -> dict:
    """The saved model and image processor over every eval image, in this process, with evaluation's own metrics."""
    from PIL import Image
    from transformers import AutoImageProcessor, AutoModelForImageClassification

    from vit_finetune.tasks import evaluation

    model = AutoModelForImageClassification.from_pretrained(output).eval()
    processor = AutoImageProcessor.from_pretrained(output)
    rows = split.cast_column("image", __import__("datasets").Image(decode=False))
    pixels = torch.stack([processor(images=Image.open(io.BytesIO(row["image"]["bytes"])).convert("RGB"),
                                    return_tensors="pt")["pixel_values"][0] for row in rows])
    labels = torch.tensor(rows["label"])
    with torch.no_grad():
        logits = model(pixel_values=pixels).logits.float()
    metrics = evaluation.compute_metrics(logits.topk(CLASSES, dim=-1).indices.numpy(), labels.numpy(), CLASSES)
    metrics["eval_loss"] = float(torch.nn.functional.cross_entropy(logits, labels, reduction="none").double().mean())
    return metrics


def two_processes_killed_when(warm: WarmLauncher, args: list[str], record: Path, marker: Path) -> list[int]:
    """two_processes(), both ranks SIGKILLed once `marker` exists; returns the ranks' pids."""
    code, ranks = warm.run_and_kill(args, {recorder.ENV: str(record)}, record.with_suffix(".log"), marker.exists)
    assert code != 0
    return ranks


def by_step_and_rank(*segments: list[dict]) -> dict[tuple[int, int], dict]:
    """(step, rank) -> record for a run made of segments; a later segment redoes a step."""
    return {(entry["step"], entry["rank"]): entry for segment in segments for entry in segment}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_processes_killed_and_resumed_end_with_identical_weights(tables, two_process_run, warm_launcher):
    """SIGKILL to both ranks once checkpoint step 4 exists (inside the second epoch: each rank is mid-way through
    its second pass), then resume=auto: the same batches follow and the same weights come out."""
    root = two_process_run["root"]
    out = root / "killed"
    run = [*two_process_run["args"], f"output_dir={out}"]
    killed = two_processes_killed_when(warm_launcher, run, root / "r1", completed(out, 4))
    assert sorted(int(path.stem.split("-")[1]) for path in (root / "r1").glob("samples-*.jsonl")) == sorted(killed)
    assert not (out / "model.safetensors").exists()
    position = json.loads((completed(out, 4).parent / "stream_position_1.json").read_text())
    assert (position["pass"], position["offset"]) == (1, BATCH)  # 3 steps an epoch: 1 step into pass 1
    result = two_processes(warm_launcher, [*run, "train.resume=auto"], root / "r2")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resuming from" in result.stdout and "at step 4" in result.stdout

    assert_bit_identical(out / "model.safetensors", two_process_run["out"] / "model.safetensors")
    original = by_step_and_rank(recorder.read_samples(two_process_run["record"]))
    resumed = by_step_and_rank(recorder.read_samples(root / "r1"), recorder.read_samples(root / "r2"))
    assert resumed == original


# ---------------------------------------------------------------- one process, a local folder, killed


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_killed_and_resumed_stream_equals_the_uninterrupted_run(tables, tmp_path):
    """Killed as step 5 starts, once checkpoint step 4 (of 6 an epoch) exists, resume=auto: the same batches,
    bit-identical weights. The resumed run decodes in 2 DataLoader workers: the order of a stream does not depend on
    them. In this process: the two-process test above sends real SIGKILLs to a stream."""
    args = [f"model.base={tables['base']}", f"data.dataset={tables['shards']}", *RECIPE,
            "train.checkpoint_every_steps=2", "train.keep_checkpoints=10"]
    assert train([*args, f"output_dir={tmp_path / 'reference'}"], record=tmp_path / "reference-record") == 0

    out = tmp_path / "out"
    with pytest.raises(SimulatedKill):
        train([*args, f"output_dir={out}"], record=tmp_path / "r1", callbacks=[kill_at(5)])
    assert completed(out, 4).exists() and not (out / "model.safetensors").exists()
    assert train([*args, f"output_dir={out}", "train.resume=auto", "data.num_workers=2"], record=tmp_path / "r2") == 0

    assert_bit_identical(out / "model.safetensors", tmp_path / "reference" / "model.safetensors")
    reference = recorder.steps_as_trained(recorder.read_samples(tmp_path / "reference-record"))
    resumed = recorder.steps_as_trained(recorder.read_samples(tmp_path / "r1"), recorder.read_samples(tmp_path / "r2"))
    assert resumed == reference
    assert recorder.read_samples(tmp_path / "r2")[0]["step"] == 5  # from checkpoint 4, inside epoch 0 (steps 1-6)
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["eval_samples"] == CLASSES * EVAL_PER_CLASS


def test_gradient_accumulation_makes_whole_steps_of_each_epoch(tables, tmp_path):
    """train.grad_accum=2: an epoch of 6 batches is 3 optimiser steps of 2 batches, each row once per epoch (the
    streamed loader is not Accelerate's, so the step boundaries come from the batch count alone)."""
    record = tmp_path / "record"
    assert train([f"model.base={tables['base']}", f"data.dataset={tables['shards']}", *RECIPE, *FIXED_CROP,
                  "train.grad_accum=2", f"output_dir={tmp_path / 'out'}"], record=record) == 0
    samples = recorder.read_samples(record)
    assert [entry["step"] for entry in samples] == [1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6]
    seen = rows_per_rank_and_epoch(samples, train_fingerprints(tables["table"]))
    assert all(sorted(rows) == list(range(CLASSES * TRAIN_PER_CLASS)) for rows in seen.values()) and len(seen) == 2
    assert json.loads((tmp_path / "out" / "metrics.json").read_text())["steps"] == 6


# ---------------------------------------------------------------- splitting and errors, in this process


def test_ranks_split_rows_when_the_shards_do_not_divide(tables, tmp_path):
    """3 shards, 2 processes: datasets gives each rank every other row; together they read each row once."""
    from vit_finetune.data import streaming
    from vit_finetune.recipe import DataSettings

    shards = write_shards(tables["table"], tmp_path / "three", {"train": 3, "validation": 1})
    settings = DataSettings(dataset=str(shards), streaming=True)
    reads = []
    for rank in (0, 1):
        splits = streaming.open_streams(settings, rank, 2)
        reader = streaming.StreamReader(splits.train, (1, 5))
        reader.count = 12
        reads.append([row["image"]["path"] for row, _pass, _offset in reader])
    assert len(set(reads[0])) == len(set(reads[1])) == 12
    assert not set(reads[0]) & set(reads[1])
    assert len(set(reads[0]) | set(reads[1])) == CLASSES * TRAIN_PER_CLASS


def test_a_hub_repo_without_a_card_is_counted_from_its_parquet_footers(tables, hub):
    """Shards uploaded as plain files (no dataset card with split sizes): the parquet footers give the row counts."""
    from vit_finetune.data import streaming
    from vit_finetune.recipe import DataSettings

    hub.add_repo("user/bare-shards", {f"data/{path.name}": path for path in tables["shards"].glob("*.parquet")},
                 repo_type="dataset")
    hub.clear_log()
    splits = streaming.open_streams(DataSettings(dataset="user/bare-shards", streaming=True), 0, 1)
    assert (splits.train_rows, splits.eval_rows) == (CLASSES * TRAIN_PER_CLASS, CLASSES * EVAL_PER_CLASS)
    assert splits.labels == ["blue", "green", "red"]
    # Each shard named by what it holds (path in the repo, size, content hash), not by the commit it was read at.
    sizes = {f"datasets/user/bare-shards/data/{p.name}": p.stat().st_size for p in tables["shards"].glob("train-*")}
    assert {shard.split()[0]: int(shard.split()[1]) for shard in splits.identity["train"]} == sizes
    assert all("@" not in shard and len(shard.split()[2]) == 64 for shard in splits.identity["train"])


def run_expecting_error(args: list[str], capsys) -> str:
    assert train(args) != 0
    return capsys.readouterr().err


def test_a_source_that_is_not_parquet_shards_is_refused(tables, tmp_path, capsys):
    error = run_expecting_error([f"model.base={tables['base']}", f"data.dataset={tables['images']}", *RECIPE,
                                 f"output_dir={tmp_path / 'out'}"], capsys)
    from vit_finetune.core.errors import excerpt

    # The message quotes the path as excerpt() shortens it (a worker's temporary folder can be long enough to be cut).
    assert f"data.dataset={excerpt(str(tables['images']))}" in error
    assert "is not a folder holding .parquet or .tar shards" in error
    assert "data.streaming=false" in error
    assert not (tmp_path / "out" / "checkpoints").exists()


def test_a_hub_repo_of_image_files_is_refused_before_any_image_is_read(tables, hub, tmp_path, capsys):
    files = {f"train/{path.parent.name}/{path.name}": path for path in sorted((tables["images"] / "train").rglob("*.png"))}
    hub.add_repo("user/colour-pictures", files, repo_type="dataset")
    hub.clear_log()
    error = run_expecting_error([f"model.base={tables['base']}", "data.dataset=user/colour-pictures", *RECIPE,
                                 f"output_dir={tmp_path / 'out'}"], capsys)
    assert "data.dataset='user/colour-pictures' holds files other than shards of one format" in error
    assert "train/blue/0.png" in error or ".png" in error
    assert hub.requests(path_regex=r"/resolve/.*\.png") == []  # listed, never downloaded


def test_a_resume_refuses_changed_shards(tables, tmp_path, capsys):
    """A shard changed after the checkpoint, its size and modification time kept: the resume is refused before any
    weight loads."""
    import pyarrow.parquet as pq
    from runs import SimulatedKill, kill_at

    shards = Path(shutil.copytree(tables["shards"], tmp_path / "shards"))
    first = next(shards.glob("train-*.parquet"))
    pq.write_table(pq.read_table(first), first, compression="none", use_dictionary=False)  # see rows_swapped_in_place
    args = [f"model.base={tables['base']}", f"data.dataset={shards}", *RECIPE, f"output_dir={tmp_path / 'out'}",
            "train.checkpoint_every_steps=2"]
    with pytest.raises(SimulatedKill):
        train(args, callbacks=[kill_at(3)])
    rows_swapped_in_place(first)
    error = run_expecting_error([*args, "train.resume=auto"], capsys)
    assert "the data of the train split(s) changed since it was written" in error


def rows_swapped_in_place(shard: Path) -> None:
    """Swap the shard's first two rows, keeping its size (it is plain, uncompressed parquet without dictionaries,
    so the same values in another order take the same bytes) and its modification time: only the bytes tell the
    change apart."""
    import os

    import pyarrow.parquet as pq

    stat = shard.stat()
    table = pq.read_table(shard)
    pq.write_table(table.take([1, 0, *range(2, len(table))]), shard, compression="none", use_dictionary=False)
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert shard.stat().st_size == stat.st_size and shard.stat().st_mtime_ns == stat.st_mtime_ns


def test_labels_without_a_class_label_are_refused(tables, tmp_path, capsys):
    import datasets

    table = tables["table"].cast_column("label", datasets.Value("int64"))
    shards = write_shards(table, tmp_path / "plain", {"train": 2, "validation": 1})
    error = run_expecting_error([f"model.base={tables['base']}", f"data.dataset={shards}", *RECIPE,
                                 f"output_dir={tmp_path / 'out'}"], capsys)
    assert "the label column 'label' is Value('int64'), not a ClassLabel" in error and "cast_column" in error
    assert "data.label_names=[cat,dog,...]" in error


def write_webdataset(images: Path, folder: Path, shards: dict[str, int]) -> Path:
    """The colour folder as WebDataset tar shards: per sample key a .png and a .cls holding the class index."""
    import tarfile

    names = sorted(p.name for p in (images / "train").iterdir())
    folder.mkdir(parents=True)
    for split, count in shards.items():
        files = sorted((images / split).glob("*/*.png"))
        for index in range(count):
            with tarfile.open(folder / f"{split}-{index:05d}.tar", "w") as tar:
                for number, path in enumerate(files[index::count]):
                    for extension, content in (("png", square_png(path)), ("cls", str(names.index(path.parent.name)).encode())):
                        member = tarfile.TarInfo(f"{split}-{index}-{number:04d}.{extension}")
                        member.size = len(content)
                        tar.addfile(member, io.BytesIO(content))
    return folder


def test_webdataset_tar_shards_train_with_their_classes_named_by_label_names(tables, tmp_path, capsys):
    from transformers import AutoConfig

    shards = write_webdataset(tables["images"], tmp_path / "wds", {"train": 2, "validation": 1})
    args = [f"model.base={tables['base']}", f"data.dataset={shards}", *RECIPE, f"output_dir={tmp_path / 'out'}"]
    names = "data.label_names=[blue,green,red]"
    # A tar shard has no row count: an epoch needs train.max_steps; and integer labels need their names.
    assert "set train.max_steps=<optimiser steps>" in run_expecting_error([*args, names], capsys)
    assert "data.label_names=[cat,dog,...]" in run_expecting_error([*args, "train.max_steps=3"], capsys)
    error = run_expecting_error([*args, "train.max_steps=3", "data.label_names=[blue,green]"], capsys)
    assert "has label 2, outside the 2 classes of data.label_names (0 to 1)" in error
    assert train([*args, "train.max_steps=3", names]) == 0
    out = tmp_path / "out"
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["steps"] == 3 and metrics["eval_samples"] == CLASSES * EVAL_PER_CLASS
    assert AutoConfig.from_pretrained(out).id2label == {0: "blue", 1: "green", 2: "red"}
    reference = evaluate_in_one_process(out, tables["table"]["validation"])  # the same images, as parquet rows
    assert metrics["confusion_matrix"] == reference["confusion_matrix"]


def test_a_stream_without_an_eval_split_is_refused(tables, tmp_path, capsys):
    shards = write_shards(tables["table"], tmp_path / "train-only", {"train": 2})
    error = run_expecting_error([f"model.base={tables['base']}", f"data.dataset={shards}", *RECIPE,
                                 f"output_dir={tmp_path / 'out'}"], capsys)
    assert "data.eval_split='validation' not in the dataset" in error and "['train']" in error


def test_without_a_row_count_an_epoch_needs_max_steps(tables):
    """A split whose metadata has no row count (train_rows None): refused without train.max_steps, which then
    makes the epoch."""
    from vit_finetune.data import streaming
    from vit_finetune.data import DataError
    from vit_finetune.recipe import DataSettings, Recipe

    splits = streaming.open_streams(DataSettings(dataset=str(tables["shards"]), streaming=True), 0, 1)
    assert splits.train_rows == CLASSES * TRAIN_PER_CLASS  # counted from the parquet footers of a local folder
    splits.train_rows = None
    recipe = Recipe(data={"dataset": str(tables["shards"]), "streaming": True}, train={"batch_size": 4})
    with pytest.raises(DataError, match=r"train\.max_steps=<optimiser steps>"):
        streaming.epoch_rows(splits, recipe, 2)
    recipe = Recipe(data={"dataset": str(tables["shards"]), "streaming": True}, train={"batch_size": 4, "max_steps": 5})
    assert streaming.epoch_rows(splits, recipe, 2) == 5 * 4 * 2


def test_streaming_refuses_keys_that_need_the_whole_dataset():
    from vit_finetune.recipe import Recipe

    with pytest.raises(ValueError, match=r"data\.streaming=true cannot be combined with data\.max_train_samples=5"):
        Recipe(data={"streaming": True, "max_train_samples": 5})


def test_label_names_apply_to_streams_only_and_must_be_distinct():
    from vit_finetune.recipe import Recipe

    with pytest.raises(ValueError, match=r"data\.label_names names the classes of a stream's integer labels"):
        Recipe(data={"label_names": ["cat", "dog"]})
    with pytest.raises(ValueError, match=r"must hold at least two distinct names"):
        Recipe(data={"streaming": True, "label_names": ["cat", "cat"]})
    assert Recipe(data={"streaming": True, "label_names": ["cat", "dog"]}).data.label_names == ["cat", "dog"]


def test_multi_label_shards_from_a_label_file_stream_and_score_as_evaluate_scores_them(tables, tmp_path):
    """A multi-label label file (some images with no label) written as parquet shards, as push_to_hub writes its
    dataset: a list of ClassLabel per row, the image bytes inside."""
    import datasets

    from tiny import write_label_sets
    from vit_finetune import data
    from vit_finetune.cli import main
    from vit_finetune.recipe import DataSettings

    path = write_label_sets(tmp_path / "labels", images=24, split_column=True, seed=2)
    lines = path.read_text().splitlines()
    assert lines[7].startswith("images/6.png,") and lines[7].endswith(",validation")
    lines[7] = "images/6.png,,validation"  # no label: a negative for every one
    path.write_text("\n".join(lines) + "\n")
    loaded = data.open_dataset(DataSettings(dataset=str(path)))
    assert loaded["validation"][2]["labels"] == []
    embedded = datasets.DatasetDict({split: datasets.Dataset.from_dict(
        {"file_name": [{"bytes": Path(cell["path"]).read_bytes(), "path": None}
                       for cell in table.cast_column("file_name", datasets.Image(decode=False))["file_name"]],
         "labels": table["labels"]}, features=table.features) for split, table in loaded.items()})
    shards = write_shards(embedded, tmp_path / "shards", {"train": 2, "validation": 1})
    out = tmp_path / "out"
    assert train([f"model.base={tables['base']}", f"data.dataset={shards}", *RECIPE, f"output_dir={out}"]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["multi_label"] is True and metrics["eval_samples"] == 8 and metrics["eval_images_without_labels"] == 1
    # The label file's own validation rows, read whole, at the thresholds the streamed run chose and saved
    assert main(["evaluate", str(out), "--dataset", str(path), "--split", "validation",
                 "--output-dir", str(tmp_path / "again")]) == 0
    again = json.loads((tmp_path / "again" / "metrics.json").read_text())
    assert again["thresholds"] == metrics["thresholds"]
    for key in ("map", "micro_f1", "macro_f1", "accuracy", "eval_images_given_no_label"):
        assert again[key] == pytest.approx(metrics[key]), key
