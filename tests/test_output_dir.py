"""The output folder: a run only ever removes or replaces what a run of this toolkit wrote; a folder that is the
user's, or the dataset's, is refused before anything is written; two runs never write into one folder at once."""

from __future__ import annotations

import gc
import hashlib
import shutil
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from runs import RECIPE, train
from tiny import write_colour_folder
from vit_finetune.core.layout import LOCK, MANIFEST

SHORT = ["train.max_steps=2"]


def snapshot(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.rglob("*") if p.is_file()}


def error_line(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr[-3000:]
    return next(line for line in reversed(stderr.splitlines()) if line.startswith("error: "))


def users_folder(folder: Path) -> Path:
    """A folder that never held a run: the user's own card, config and notes."""
    folder.mkdir(parents=True)
    (folder / "README.md").write_text("# my project notes\n")
    (folder / "config.json").write_text('{"mine": true}\n')
    (folder / "notes.txt").write_text("do not lose\n")
    return folder


def test_a_folder_the_toolkit_did_not_write_is_refused_and_untouched(args, tmp_path, capsys):
    out = users_folder(tmp_path / "mine")
    before = snapshot(out)
    assert train([*args, *SHORT, f"output_dir={out}"]) == 1
    error = error_line(capsys.readouterr().err)
    assert "holds files this toolkit did not write (['README.md', 'config.json', 'notes.txt'])" in error
    assert "overwrite=true" in error and "new or empty output_dir" in error
    assert snapshot(out) == before and sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "notes.txt"]


def test_overwrite_refuses_to_replace_a_users_files_or_delete_folders_it_did_not_write(args, tmp_path, capsys):
    out = users_folder(tmp_path / "mine")
    (out / "adapter").mkdir()
    (out / "adapter" / "weights.bin").write_bytes(b"the user's own adapter")
    (out / "checkpoints").mkdir()
    (out / "checkpoints" / "step-00000001").mkdir()
    before = snapshot(out)
    assert train([*args, *SHORT, f"output_dir={out}", "overwrite=true"]) == 1
    error = error_line(capsys.readouterr().err)
    assert "holds ['README.md', 'adapter', 'checkpoints', 'config.json'], which this toolkit did not write" in error
    assert snapshot(out) == before


def test_overwrite_only_ever_replaces_what_a_run_wrote(args, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "notes.txt").write_text("do not lose\n")
    (out / "my-plots").mkdir()
    (out / "my-plots" / "a.png").write_bytes(b"mine")
    assert train([*args, *SHORT, f"output_dir={out}", "overwrite=true"]) == 0  # beside the user's files
    assert json.loads((out / "metrics.json").read_text())["steps"] == 2
    written = set(json.loads((out / MANIFEST).read_text())["written"])
    assert {"model.safetensors", "metrics.json", "README.md", "recipe.yaml"} <= written
    assert not written & {"notes.txt", "my-plots", "checkpoints", "adapter", "runs"}  # what it wrote, not what it could
    first = (out / "model.safetensors").read_bytes()
    assert train([*args, "train.max_steps=3", f"output_dir={out}", "overwrite=true"]) == 0  # replaces its own
    assert json.loads((out / "metrics.json").read_text())["steps"] == 3 and (out / "model.safetensors").read_bytes() != first
    assert (out / "notes.txt").read_text() == "do not lose\n" and (out / "my-plots" / "a.png").read_bytes() == b"mine"


@pytest.mark.parametrize("where", ["equal", "inside", "containing"])
def test_an_output_dir_overlapping_the_dataset_is_refused_before_anything_is_written(base, tmp_path, capsys, where):
    images = write_colour_folder(tmp_path / "data" / "images", classes=2, train=3, validation=2)
    before = snapshot(tmp_path)
    out = {"equal": images, "inside": images / "train" / "runs", "containing": tmp_path / "data"}[where]
    assert train([f"model.base={base}", f"data.dataset={images}", *RECIPE, *SHORT, f"output_dir={out}",
                  "overwrite=true"]) == 1
    error = error_line(capsys.readouterr().err)
    assert "overlaps the dataset's folder" in error and "outside the dataset" in error
    assert snapshot(tmp_path) == before and not (images / "train" / "runs").exists()


def test_a_second_run_into_a_busy_folder_is_refused_and_a_killed_run_leaves_no_stuck_lock(args, warm_launcher,
                                                                                           tmp_path, capsys):
    out = tmp_path / "out"
    log = tmp_path / "first.log"
    [first] = warm_launcher.start([*args, f"output_dir={out}", "train.epochs=500"], {}, log, plain=True)
    ended = None
    try:
        deadline = time.monotonic() + 200
        while ended is None and time.monotonic() < deadline:  # until the first run holds the lock
            if (out / LOCK).is_file() and (out / LOCK).read_text() == str(first):
                break
            time.sleep(0.2)
            ended = warm_launcher.finished()
        assert ended is None and (out / LOCK).read_text() == str(first), log.with_suffix(".err").read_text()[-2000:]
        assert train([*args, *SHORT, f"output_dir={out}", "overwrite=true"]) == 1
        error = error_line(capsys.readouterr().err)
        assert f"another run (process {first}) is writing into output_dir" in error
        assert not (out / "metrics.json").exists()
    finally:
        if ended is None:
            os.kill(first, signal.SIGKILL)
            assert warm_launcher.wait() == -signal.SIGKILL
    assert train([*args, *SHORT, f"output_dir={out}", "overwrite=true"]) == 0  # the lock died with its process
    assert json.loads((out / "metrics.json").read_text())["steps"] == 2
    assert (out / LOCK).exists()


# ---------------------------------------------------------------- a disk that cannot be written


@pytest.fixture
def tmpfs(tmp_path):
    """mount(size_kib, read_only) -> a fresh tmpfs folder. A real read-only or full filesystem: chmod does not stop
    root, and a full disk cannot be faked without mocking the writes."""
    mounted = []

    def mount(size_kib: int, read_only: bool = False) -> Path:
        folder = tmp_path / f"mount{len(mounted)}"
        folder.mkdir()
        made = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(folder)],
                              capture_output=True, text=True)
        if made.returncode:
            pytest.skip(f"cannot mount a tmpfs here ({made.stderr.strip()}): mounting needs root with CAP_SYS_ADMIN, "
                        "and nothing else makes a read-only or full filesystem honestly")
        mounted.append(folder)
        if read_only:
            subprocess.run(["mount", "-o", "remount,ro", str(folder)], check=True)
        return folder

    yield mount
    gc.collect()  # what the run left in reference cycles may still map a file there (tests/conftest.py: the collector)
    for folder in mounted:
        subprocess.run(["umount", str(folder)], check=False)


def test_an_output_dir_on_a_read_only_filesystem_is_refused_with_the_reason(args, tmpfs, capsys):
    read_only = tmpfs(64, read_only=True)
    for output in (read_only, read_only / "new"):  # the folder itself, or one to be made there
        assert train([*args, *SHORT, f"output_dir={output}"]) == 1
        error = error_line(capsys.readouterr().err)
        assert f"output_dir={output} cannot be written (Read-only file system" in error
        assert "choose another output_dir" in error
    assert not any(read_only.iterdir())


def test_an_output_dir_on_a_full_disk_is_refused_with_the_reason(args, tmpfs, capsys):
    full = tmpfs(64)
    with open(full / "filler", "wb", buffering=0) as filler:  # the user's file, filling the disk
        try:
            while True:
                filler.write(b"\0" * 4096)
        except OSError:
            pass
    filler_size = (full / "filler").stat().st_size
    output = full / "out"
    assert train([*args, *SHORT, f"output_dir={output}"]) == 1
    error = error_line(capsys.readouterr().err)
    assert f"output_dir={output} cannot be written (No space left on device; 0.0 MiB free on that disk)" in error
    assert "free disk space" in error
    assert (full / "filler").stat().st_size == filler_size  # the user's file untouched


def test_a_tensorboard_folder_that_cannot_be_written_is_refused_on_resume_before_training(args, tmp_path, capsys):
    pytest.importorskip("tensorboard", reason="tensorboard is a dev dependency (pip install -e '.[dev]')")
    from runs import SimulatedKill, completed, kill_at

    output = tmp_path / "run"
    run = [*args, f"output_dir={output}", "train.report_to=[tensorboard]", "train.checkpoint_every_steps=2"]
    with pytest.raises(SimulatedKill):
        train(run, callbacks=[kill_at(3)])
    assert completed(output, 2).exists()
    shutil.rmtree(output / "runs")
    (output / "runs").write_text("a file where TensorBoard's folder should be\n")
    batches = []
    from runs import before_batch

    assert train([*run, "train.resume=auto"], callbacks=[before_batch(batches.append)]) == 1
    error = error_line(capsys.readouterr().err)
    assert f"train.report_to=['tensorboard'] writes into {output / 'runs'}, which cannot be written" in error
    assert batches == []  # refused before training
    assert (output / "runs").read_text() == "a file where TensorBoard's folder should be\n"


# ---------------------------------------------------------------- file modes


def test_every_file_a_run_writes_gets_the_usual_mode(args, tmp_path):
    """safetensors writes its files 0600; beside the 0644 of the rest, a served or shared folder could not read the
    model. Every file, checkpoints and the LoRA adapter included, gets 0666 less the umask (0002 here: 0664)."""
    out = tmp_path / "run"
    previous = os.umask(0o002)
    try:
        assert train([*args, *SHORT, f"output_dir={out}", "train.checkpoint_every_steps=1", "train.keep_checkpoints=2",
                      "model.lora={r: 4, alpha: 8, dropout: 0.0}"]) == 0
    finally:
        os.umask(previous)
    modes = {str(path.relative_to(out)): oct(path.stat().st_mode & 0o777) for path in out.rglob("*") if path.is_file()}
    assert {"model.safetensors", "adapter/adapter_model.safetensors",
            "checkpoints/step-00000002/model.safetensors"} <= modes.keys()
    assert {name: mode for name, mode in modes.items() if mode != "0o664"} == {}
