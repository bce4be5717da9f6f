"""Test-only observation of a training run, from outside the package: what each process trained on,
the weights each process ended with, and every file each process wrote.

It observes through the package's documented hook (vit_finetune.artifacts.callbacks), never by patching the
loop's functions by name: `Recorder` is a Callback, passed to one in-process run, or registered for
every run of a subprocess or an `accelerate launch`, where the folder `tests/observed_site/` goes on
PYTHONPATH and its sitecustomize.py calls `install_in_subprocess()` when VIT_FINETUNE_RECORD names a
folder, so the command line stays exactly the user's.

Written into the record folder, one file set per process id (a SIGKILL loses nothing already written):
- samples-<pid>.jsonl: one line per optimiser step: step, epoch, rank, the batch's places, and the labels
  and a fingerprint of the pixels of each sample that is not a bad image's blank place (the pixels are a pure
  function of seed, epoch and sample, so equal fingerprints mean the same sample with the same augmentation).
- weights-<rank>.safetensors: the process's own trained model state (on_train_end: after the final evaluation).
- writes-<pid>.jsonl (subprocesses only): path and kind of every file or folder written, renamed or
  removed, seen through Python's audit hooks plus the two native writers that bypass them
  (safetensors' serializer and torch.save's zip writer).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

ENV = "VIT_FINETUNE_RECORD"
OBSERVED_SITE = Path(__file__).resolve().parent / "observed_site"


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


class _Lines:
    """An append-only JSON-lines file kept open, flushed after every line."""

    def __init__(self, path: Path):
        self.handle = open(path, "a", buffering=1)

    def write(self, entry: dict) -> None:
        self.handle.write(json.dumps(entry) + "\n")
        self.handle.flush()


def fingerprint(pixels) -> str:
    return hashlib.sha1(pixels.contiguous().cpu().numpy().tobytes()).hexdigest()[:16]


def recorder(record_dir: Path):
    """A vit_finetune Callback that writes the record files of this process into `record_dir`."""
    from safetensors.torch import save_file

    from vit_finetune.artifacts.callbacks import Callback
    from vit_finetune.data import SKIPPED_LABEL

    record_dir = Path(record_dir)
    record_dir.mkdir(parents=True, exist_ok=True)

    class Recorder(Callback):
        def __init__(self):
            self.samples = _Lines(record_dir / f"samples-{os.getpid()}.jsonl")

        def on_batch(self, run, batch):
            labels = batch["labels"].tolist()
            real = [(label, pixels) for label, pixels in zip(labels, batch["pixel_values"]) if label != SKIPPED_LABEL]
            # "places": the batch's size, skipped bad images' blank places included; the rest: real images only.
            self.samples.write({"step": run.state.step + 1, "epoch": run.state.epoch,
                                "rank": run.accelerator.process_index, "places": len(labels),
                                "labels": [label for label, _ in real], "samples": [fingerprint(p) for _, p in real]})

        def on_train_end(self, run, model):
            tensors = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
            save_file(tensors, str(record_dir / f"weights-{run.accelerator.process_index}.safetensors"))

    return Recorder()


def read_samples(record_dir: Path) -> list[dict]:
    """Every recorded step of every process, in the order the processes ran and wrote them."""
    files = sorted(Path(record_dir).glob("samples-*.jsonl"), key=lambda p: p.stat().st_mtime_ns)
    return [json.loads(line) for path in files for line in path.read_text().splitlines()]


def steps_as_trained(*segments: list[dict]) -> dict[int, dict]:
    """step -> record for a run made of segments (killed, resumed, ...): a later segment redoes a step."""
    merged: dict[int, dict] = {}
    for segment in segments:
        for entry in segment:
            merged[entry["step"]] = entry
    return dict(sorted(merged.items()))


# ---------------------------------------------------------------- subprocesses: sitecustomize entry


_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def install_in_subprocess(record_dir: str) -> None:
    """Record writes from the interpreter's start; register the recorder when vit_finetune.artifacts.callbacks loads."""
    import importlib.abc
    import importlib.util

    record_dir = Path(record_dir)
    record_dir.mkdir(parents=True, exist_ok=True)
    writes = _Lines(record_dir / f"writes-{os.getpid()}.jsonl")
    busy = []

    def record(kind: str, path) -> None:
        if busy or path is None or isinstance(path, int):
            return
        busy.append(1)
        try:
            writes.write({"pid": os.getpid(), "rank": os.environ.get("RANK"), "kind": kind,
                          "path": os.path.abspath(os.fsdecode(path))})
        finally:
            busy.pop()

    def audit(event: str, args: tuple) -> None:
        if event == "open":
            path, mode, flags = args
            writing = any(c in (mode or "") for c in "wax+") if mode else bool((flags or 0) & _WRITE_FLAGS)
            if writing:
                record("open", path)
        elif event in ("os.rename", "os.replace"):
            record(event, args[0])
            record(event, args[1])
        elif event in ("os.mkdir", "os.remove", "os.rmdir", "os.truncate", "shutil.rmtree", "shutil.copyfile"):
            record(event, args[-1] if event == "shutil.copyfile" else args[0])

    sys.addaudithook(audit)

    def patch_native_writers() -> None:
        import safetensors.torch
        import torch.serialization

        serialize_file, zip_writer = safetensors.torch.serialize_file, torch.serialization._open_zipfile_writer

        def recorded_serialize_file(tensors, filename, *args, **kwargs):
            record("safetensors", filename)
            return serialize_file(tensors, filename, *args, **kwargs)

        def recorded_zip_writer(name_or_buffer, *args, **kwargs):
            if isinstance(name_or_buffer, (str, os.PathLike)):
                record("torch.save", name_or_buffer)
            return zip_writer(name_or_buffer, *args, **kwargs)

        safetensors.torch.serialize_file = recorded_serialize_file
        torch.serialization._open_zipfile_writer = recorded_zip_writer

    class RegisterOnImport(importlib.abc.MetaPathFinder):
        """Lets vit_finetune.artifacts.callbacks load normally, then registers the recorder: nothing heavy is imported
        before the user's code."""

        def find_spec(self, name, path, target=None):
            if name != "vit_finetune.artifacts.callbacks":
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            load = spec.loader.exec_module

            def exec_module(module):
                load(module)
                patch_native_writers()
                module.register(recorder(record_dir))

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, RegisterOnImport())


def subprocess_env(record_dir: Path | None, **extra: str) -> dict:
    """Environment for a `python -m vit_finetune` / `accelerate launch` that is observed by this module (or, with no
    record_dir, could be)."""
    from tiny import REPO

    tests = Path(__file__).resolve().parent
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(OBSERVED_SITE), str(tests), str(REPO)]),
            **({ENV: str(record_dir)} if record_dir else {}), "TOKENIZERS_PARALLELISM": "false",
            "PYTHONUNBUFFERED": "1", **extra}


def writers_by_path(record_dir: Path, folder: Path) -> dict[str, set[str]]:
    """path under `folder` (relative, posix) -> the ranks (as strings) that wrote that file, from the writes logs.

    Folders are left out: Accelerate makes the checkpoint folder on every rank (exist_ok), no file.
    """
    from collections import defaultdict

    writers: dict[str, set[str]] = defaultdict(set)
    for log in Path(record_dir).glob("writes-*.jsonl"):
        for entry in map(json.loads, log.read_text().splitlines()):
            if entry["rank"] is not None and entry["path"].startswith(str(folder)) and entry["kind"] != "os.mkdir":
                writers[Path(entry["path"]).relative_to(folder).as_posix()].add(entry["rank"])
    return dict(writers)
