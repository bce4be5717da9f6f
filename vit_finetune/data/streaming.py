"""Streaming (data.streaming=true): train and evaluate from parquet shards read while training, from a Hub dataset
or a local folder, for datasets larger than the disk.

The shards are checked and named by shards.py. Each process reads its own share of a split (datasets.distributed.split_dataset_by_node: whole shards when the shard
count is a multiple of the process count, every n-th row otherwise) as an endless series of passes, each shuffled
with a seeded buffer (IterableDataset.shuffle, set_epoch(pass)). The main process reads the stream and only hands
the encoded rows out; DataLoader workers decode and augment them as data/loaders.py does for a map-style dataset.
So the order of the rows never depends on the number of workers, and a row's augmentation is a function of (seed,
pass, its place in the stream) alone.

Exact resume. IterableDataset.state_dict() is not enough: datasets documents that a shuffle buffer's content is not
in it (a resumed stream refills its buffer from later rows), and a DataLoader reads ahead of training, so the
dataset's state when a checkpoint is written is not the position of the rows trained on. A checkpoint therefore
stores each process's position as (pass, rows of that pass trained on: loop.StreamPositions); a resume reads that pass again from its
start and fast-forwards over those rows without decoding them: the same buffer, the same next batch. The cost: up to
one pass over the process's shards read again (bytes only).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from PIL import Image
from torch.utils.data import Sampler

from vit_finetune.core.errors import DataError, excerpt
from vit_finetune.data import loaders
from vit_finetune.data.labels import LABEL_COLUMN_NAMES, label_sets_chosen
from vit_finetune.data.opening import is_local
from vit_finetune.data.shards import SHARD_SUFFIXES, check_shards, online_unless_the_user_is_offline, shard_identity
from vit_finetune.data.splits import IMAGE_COLUMN_NAMES, detect_column, is_label_set, target_encoding
from vit_finetune.recipe import DataSettings, Recipe


@dataclass
class StreamedSplits:
    """What data.Splits holds, for streams: this process's share of each split, images left encoded."""

    train: Any  # datasets.IterableDataset: this process's share, not shuffled yet
    eval: Any
    image_column: str
    label_column: str
    labels: list[str]
    eval_split: str
    train_rows: int | None  # the whole split's, over all processes, from the dataset's metadata
    eval_rows: int | None
    identity: dict  # the labels and the shards read, as each checkpoint records them
    image_folders: tuple[Path, ...] | None  # None: a local stream's path-only cells are read; a Hub stream's never
    task: str = "single_label"  # multi_label: each row's label is a list of class ids (a set, possibly empty)
    notes: list[str] = field(default_factory=list)  # what the run should say of the data before it trains (none yet)


@dataclass
class Position:
    """Where a process stands in its stream: the pass (0, 1, ...) and how many rows of that pass were used."""

    pass_: int = 0
    offset: int = 0


# ---------------------------------------------------------------- opening


def unsupported(settings: DataSettings, why: str) -> DataError:
    return DataError(
        f"data.dataset={excerpt(settings.dataset)} {why}. data.streaming=true reads parquet or WebDataset shards: give "
        "a Hub dataset of parquet files (e.g. written by Dataset.push_to_hub) or of .tar shards, or a local folder of "
        ".parquet or .tar files, or set data.streaming=false to load the dataset whole")


def open_builder(settings: DataSettings):
    """datasets' builder for the source (metadata and the list of shards only: nothing is downloaded yet)."""
    import datasets

    name = settings.dataset
    local = Path(name).expanduser()
    if name.startswith((".", "/", "~", "builtin:")) or local.exists():
        if not local.is_dir() or not any(path.suffix in SHARD_SUFFIXES for path in local.rglob("*")):
            raise unsupported(settings, "is not a folder holding .parquet or .tar shards")
        name = str(local)
    try:
        with online_unless_the_user_is_offline():
            builder = datasets.load_dataset_builder(name)
    except Exception as error:  # datasets raises many types; the user needs the id and the reason
        raise DataError(f"data.dataset={excerpt(name)} could not be opened for streaming: "
                        f"{type(error).__name__}: {error}") from None
    files = [file for split in (builder.config.data_files or {}).values() for file in split]
    kinds = {suffix for file in files for suffix in SHARD_SUFFIXES if file.endswith(suffix)}
    others = [file for file in files if not file.endswith(SHARD_SUFFIXES)]
    if not files or others or len(kinds) > 1:
        example = others[:1] or sorted(kinds)
        raise unsupported(settings, f"holds files other than shards of one format (e.g. {excerpt(example or None)})")
    return builder


def open_streams(settings: DataSettings, rank: int, processes: int) -> StreamedSplits:
    """This process's share of the train and eval splits, with detected columns and the ClassLabel's names."""
    import datasets
    from datasets.distributed import split_dataset_by_node

    builder = open_builder(settings)
    files = builder.config.data_files
    names = [str(split) for split in files]
    if settings.train_split not in files:
        raise DataError(f"data.train_split={settings.train_split!r} not in the dataset; its splits are {names}")
    eval_split = settings.eval_split if settings.eval_split in files else "test" if "test" in files else None
    if eval_split is None:
        raise DataError(f"data.eval_split={settings.eval_split!r} not in the dataset, whose splits are {names}; "
                        "a stream cannot hold out part of train for evaluation. Set data.eval_split=<one of them>")
    with online_unless_the_user_is_offline():
        train = builder.as_streaming_dataset(split=settings.train_split)
        evaluation_stream = builder.as_streaming_dataset(split=eval_split)
    features = train.features
    image_column = detect_column(features, settings.image_column, "image", IMAGE_COLUMN_NAMES, datasets.Image)
    label_column = detect_column(features, settings.label_column, "label", LABEL_COLUMN_NAMES,
                                      datasets.ClassLabel)
    labels = class_names(features[label_column], label_column, settings)
    chosen = label_sets_chosen(settings)
    multi_label = is_label_set(features[label_column]) if chosen is None else chosen
    if is_label_set(features[label_column]) and not multi_label:
        raise DataError(f"data.task=single_label, but the label column {label_column!r} holds a list of labels per "
                        "row; set data.task=multi_label (or auto)")
    # Every shard is looked at before training: a damaged one would otherwise end in a library's traceback, or in
    # rows silently missing, partway through a run.
    counted = {split: check_shards(files[split], split, (image_column, label_column), settings)
               for split in dict.fromkeys([settings.train_split, eval_split])}

    def share(stream):
        stream = stream.cast_column(image_column, datasets.Image(decode=False))
        return split_dataset_by_node(stream.select_columns([image_column, label_column]), rank, processes)

    identity = {"labels": labels, "train": shard_identity(files[settings.train_split]),
                "eval": shard_identity(files[eval_split])}
    # A streamed Hub dataset downloads no image files: a cell holding only a path names one on this machine.
    folders = None if is_local(settings) else ()
    return StreamedSplits(share(train), share(evaluation_stream), image_column, label_column, labels, eval_split,
                          split_rows(builder, settings.train_split, counted[settings.train_split]),
                          split_rows(builder, eval_split, counted[eval_split]), identity, folders,
                          "multi_label" if multi_label else "single_label")


def class_names(feature, label_column: str, settings: DataSettings) -> list[str]:
    """The classes, known without reading the stream: the label column's ClassLabel names (of each row's list of
    labels, for a multi-label column), or data.label_names for plain integer labels (WebDataset's .cls files hold
    the class index)."""
    import datasets

    feature = getattr(feature, "feature", feature) if is_label_set(feature) else feature
    if isinstance(feature, datasets.ClassLabel):
        if settings.label_names is not None and list(settings.label_names) != feature.names:
            raise DataError(f"data.label_names={excerpt(settings.label_names)} differs from the label column's own "
                            f"class names {excerpt(feature.names)}; remove data.label_names")
        return list(feature.names)
    if settings.label_names is not None and str(getattr(feature, "dtype", "")).startswith(("int", "uint")):
        return list(settings.label_names)
    raise DataError(
        f"data.streaming=true needs the classes before reading the stream: the label column {label_column!r} is "
        f"{feature}, not a ClassLabel. Fix: for integer labels (WebDataset's .cls) name the classes in index order, "
        "data.label_names=[cat,dog,...]; or write the shards with datasets after cast_column(label, "
        "ClassLabel(names=[...])) (push_to_hub and to_parquet keep it); or set data.streaming=false")


def check_label(label: int | list[int], classes: int, where: str) -> None:
    """A plain integer label (each of a row's labels, for a multi-label row) must name one of the classes (a
    ClassLabel column cannot hold another)."""
    for value in label if isinstance(label, list) else [label]:
        if not 0 <= value < classes:
            raise DataError(f"{where} has label {value}, outside the {classes} classes of data.label_names (0 to "
                            f"{classes - 1}). Fix: data.label_names must name every class index the shards use")


def split_rows(builder, split: str, counted: int | None) -> int | None:
    """The split's row count: from the dataset's card (datasets' split info), else `counted` from the parquet
    footers (check_shards); None if neither knows."""
    known = (builder.info.splits or {}).get(split)
    if known is not None and known.num_examples:
        return known.num_examples
    return counted


def epoch_rows(splits: StreamedSplits, recipe: Recipe, processes: int) -> int:
    """Rows in one epoch: the train split's, or, when its metadata has no count, those of train.max_steps steps."""
    if splits.train_rows:
        return splits.train_rows
    t = recipe.train
    if t.max_steps is None:
        raise DataError(
            f"data.dataset={excerpt(recipe.data.dataset)}: the row count of split {recipe.data.train_split!r} is not in "
            "the dataset's metadata, so an epoch has no length. Fix: set train.max_steps=<optimiser steps>")
    return t.max_steps * t.batch_size * t.grad_accum * processes


# ---------------------------------------------------------------- reading and decoding


class StreamReader(Sampler):
    """Runs in the main process: this process's rows, still encoded, `count` of them from `start`, as
    (row, pass, offset) items that DataLoader batches and hands to its workers. Training reads pass after pass
    (endless); evaluation reads one pass, in order."""

    def __init__(self, stream, shuffle_with: tuple[int, int] | None,
                 check: Callable[[dict, str], None] = lambda row, where: None):
        if shuffle_with is not None:
            # The buffer is fed from one shard at a time: datasets' default (10 at once) reads them in threads whose
            # shutdown sleeps 5 s (an Arrow workaround) at every pass's end, and whenever a pass is left unfinished.
            seed, buffer_size = shuffle_with
            stream = stream.shuffle(seed=seed, buffer_size=buffer_size, max_buffer_input_shards=1)
        self.stream, self.check = stream, check
        self.endless = shuffle_with is not None
        self.start, self.count = Position(), None

    def __iter__(self) -> Iterator[tuple[dict, int, int]]:
        return itertools.islice(self._rows_from(self.start), self.count)

    def _rows_from(self, start: Position) -> Iterator[tuple[dict, int, int]]:
        for pass_ in itertools.count(start.pass_):
            self.stream.set_epoch(pass_)  # reshuffles the shards and seeds the buffer, per pass
            skip = start.offset if pass_ == start.pass_ else 0
            found = False
            # The fast-forward of a resume: rows before `skip` are read, never decoded.
            for offset, row in enumerate(itertools.islice(iter(self.stream), skip, None), skip):
                found = True
                self.check(row, f"row {offset} of pass {pass_} of this process's share of the stream")
                yield row, pass_, offset
            if not self.endless:
                return
            if not found and skip == 0:
                raise DataError("this process's share of the stream is empty: the split has fewer rows than there "
                                "are processes. Use fewer processes, or more data")


class StreamedImages(loaders.ImageClassificationDataset):
    """Decodes, in DataLoader workers, the (row, pass, offset) items StreamReader hands out; yields what the
    map-style dataset yields, plus the position after the row."""

    def __init__(self, rows: int | None, rank: int, processes: int, **parts):
        super().__init__(None, **parts)
        self.rows, self.rank, self.processes = rows, rank, processes

    def __len__(self) -> int:
        return self.rows or 0  # the whole split's rows, over all processes

    def __getitem__(self, item: tuple[dict, int, int]) -> tuple:
        row, pass_, offset = item
        # Unique within a pass over all processes: the row's place in this process's stream, interleaved by rank.
        index = offset * self.processes + self.rank
        return (*self.sample(row, index, pass_), Position(pass_, offset + 1))


def collate(samples: list) -> dict:
    batch = loaders.collate([sample[:3] for sample in samples])
    batch["stream_next"] = samples[-1][3]
    return batch


class StreamLoader:
    """This process's batches of a stream, moved to the device. Accelerate does not prepare it: it would deal the
    batches out to the processes a second time. `position` is where training stands; checkpoints save it."""

    def __init__(self, reader: StreamReader, dataset: StreamedImages, batch_size: int, workers: int, pin: bool,
                 seed: int, device: torch.device):
        self.reader, self.dataset, self.batch_size, self.device = reader, dataset, batch_size, device
        self.position = Position()
        self.loader = loaders.make_loader(dataset, batch_size, False, seed, workers, pin, sampler=reader, collate_fn=collate)

    def batches(self, count: int | None) -> Iterator[dict]:
        """`count` batches from `position` on (None: to the end of the pass), each on the device."""
        from accelerate.utils import send_to_device

        self.reader.start = self.position
        self.reader.count = None if count is None else count * self.batch_size
        for batch in self.loader:
            self.position = batch.pop("stream_next")
            yield send_to_device(batch, self.device, non_blocking=self.device.type == "cuda")

    def whole_split(self) -> Iterator[dict]:
        """One pass over this process's share, in order (evaluation)."""
        self.position = Position()
        return self.batches(None)


def make_loaders(splits: StreamedSplits, settings: DataSettings, seed: int, batch_size: int, workers: int,
                 accelerator, train_pixels: Callable[[Image.Image, int, int], torch.Tensor],
                 processor, image_size: int) -> tuple[StreamLoader, StreamLoader]:
    """The train loader (shuffled, endless, augmented by `train_pixels`) and the eval loader (in order, one pass,
    preprocessed by the saved image processor)."""
    rank, processes, device = accelerator.process_index, accelerator.num_processes, accelerator.device
    common = dict(image_column=splits.image_column, label_column=splits.label_column, settings=settings,
                  image_folders=splits.image_folders, encoding=target_encoding(splits),
                  outputs=len(splits.labels))
    train_set = StreamedImages(splits.train_rows, rank, processes, make_pixels=train_pixels,
                               placeholder=loaders.blank_pixels(image_size, training=True), **common)
    eval_set = StreamedImages(splits.eval_rows, rank, processes, make_pixels=loaders.eval_pixels_from_processor(processor),
                              placeholder=loaders.blank_pixels(image_size, training=False), **common)
    pin = device.type == "cuda"

    def check(row: dict, where: str) -> None:
        check_label(row[splits.label_column], len(splits.labels), where)

    train = StreamLoader(StreamReader(splits.train, (seed, settings.shuffle_buffer), check), train_set, batch_size,
                         workers, pin, seed, device)
    evaluation_loader = StreamLoader(StreamReader(splits.eval, None, check), eval_set, batch_size, workers, pin, seed,
                                     device)
    return train, evaluation_loader
