"""Resuming never trains on the wrong thing and never hangs: damaged checkpoints are set aside, changed data or
labels are refused with the reason, and a frozen process ends a multi-process run with a message naming it."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

import recorder
from runs import RECIPE, SimulatedKill, completed, kill_at, train
from tiny import write_colour_folder

pytestmark = pytest.mark.slow


def error_line(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr[-3000:]
    return next(line for line in reversed(stderr.splitlines()) if line.startswith("error: "))


def killed_run(base: Path, tmp_path: Path) -> tuple[list[str], Path]:
    """A run on its own image folder, 'killed' as step 3 starts, with complete checkpoints at steps 1 and 2."""
    images = write_colour_folder(tmp_path / "images", classes=3, train=8, validation=3)
    out = tmp_path / "out"
    args = [f"model.base={base}", f"data.dataset={images}", *RECIPE, f"output_dir={out}",
            "train.checkpoint_every_steps=1"]
    with pytest.raises(SimulatedKill):
        train(args, callbacks=[kill_at(3)])
    assert completed(out, 1).exists() and completed(out, 2).exists()
    return args, out


def test_a_damaged_newest_checkpoint_is_set_aside_and_the_one_before_resumed(base, tmp_path, capsys):
    args, out = killed_run(base, tmp_path)
    (out / "checkpoints" / "step-00000002" / "optimizer.bin").write_bytes(b"half written")
    assert train([*args, "train.resume=auto"], record=tmp_path / "record") == 0
    assert recorder.read_samples(tmp_path / "record")[0]["step"] == 2  # from step 1's checkpoint
    aside = out / "checkpoints" / "damaged-step-00000002"
    assert (aside / "optimizer.bin").read_bytes() == b"half written"  # kept, as it was, for inspection
    said = capsys.readouterr().out
    assert f"checkpoint {out / 'checkpoints' / 'step-00000002'} is damaged" in said and str(aside) in said
    assert json.loads((out / "metrics.json").read_text())["steps"] == 12


def test_an_intact_checkpoint_that_an_accepted_change_no_longer_fits_is_refused_and_never_set_aside(base, tmp_path,
                                                                                                     capsys):
    """train.layer_decay splits the optimiser into other parameter groups: accepting that change (as the refusal
    suggests) makes Accelerate's load fail on files that read back perfectly well."""
    args, out = killed_run(base, tmp_path)
    before = {path.relative_to(out): path.read_bytes() for path in (out / "checkpoints").rglob("*") if path.is_file()}
    assert train([*args, "train.layer_decay=0.75", "train.resume=auto"]) == 1
    assert "train.resume_ignore_changes=[train.layer_decay]" in error_line(capsys.readouterr().err)
    assert train([*args, "train.layer_decay=0.75", "train.resume=auto",
                  "train.resume_ignore_changes=[train.layer_decay]"]) == 1
    error = error_line(capsys.readouterr().err)
    assert "step-00000002: it is intact, but what it saved does not fit this run" in error, error
    assert "restore those keys' values" in error and "overwrite=true" in error
    after = {path.relative_to(out): path.read_bytes() for path in (out / "checkpoints").rglob("*") if path.is_file()}
    assert after == before  # nothing renamed damaged-*, nothing changed
    assert train([*args, "train.resume=auto"]) == 0  # and the run resumes as it was
    assert json.loads((out / "metrics.json").read_text())["steps"] == 12


def test_a_checkpoint_recipe_that_is_not_yaml_is_a_clean_error_and_auto_skips_it(base, tmp_path, capsys):
    args, out = killed_run(base, tmp_path)
    newest = out / "checkpoints" / "step-00000002"
    (newest / "recipe.yaml").write_text("train: {lr: [unclosed\n")
    assert train([*args, f"train.resume={newest}"]) == 1
    error = error_line(capsys.readouterr().err)
    assert f"cannot resume from {newest}: its recipe.yaml cannot be read" in error and "train.resume=auto" in error
    assert train([*args, "train.resume=auto"], record=tmp_path / "record") == 0
    assert recorder.read_samples(tmp_path / "record")[0]["step"] == 2
    assert (out / "checkpoints" / "damaged-step-00000002" / "recipe.yaml").is_file()


def test_a_class_added_since_the_checkpoint_is_named_as_a_label_change(base, tmp_path, capsys):
    args, out = killed_run(base, tmp_path)
    write_colour_folder(tmp_path / "more", classes=4, train=8, validation=3)  # yellow is the fourth colour
    for split in ("train", "validation"):
        os.rename(tmp_path / "more" / split / "yellow", tmp_path / "images" / split / "yellow")
    assert train([*args, "train.resume=auto"], record=tmp_path / "record") == 1
    error = error_line(capsys.readouterr().err)
    assert "labels changed since it was written (added ['yellow'])" in error and "damaged" not in error
    assert recorder.read_samples(tmp_path / "record") == []
    assert not list((out / "checkpoints").glob("damaged-*"))  # an intact checkpoint is not set aside


def test_images_added_to_a_class_since_the_checkpoint_are_refused(base, tmp_path, capsys):
    args, out = killed_run(base, tmp_path)
    red = tmp_path / "images" / "train" / "red"
    (red / "extra.png").write_bytes((red / "0.png").read_bytes())
    assert train([*args, "train.resume=auto"], record=tmp_path / "record") == 1
    error = error_line(capsys.readouterr().err)
    assert "the data of the train" in error and "changed since it was written" in error and "overwrite=true" in error
    assert recorder.read_samples(tmp_path / "record") == []
    (red / "extra.png").unlink()  # put back as it was: the same command resumes
    assert train([*args, "train.resume=auto"], record=tmp_path / "record2") == 0
    assert recorder.read_samples(tmp_path / "record2")[0]["step"] == 3


@pytest.mark.timeout(400)
def test_a_frozen_process_ends_a_two_process_run_with_a_message_naming_it(base, images, warm_launcher, tmp_path):
    out, log = tmp_path / "out", tmp_path / "stdout.txt"
    err = log.with_suffix(".err")
    # The ranks forked warm (tests/warm_launch.py): the subject is what the ranks do when one stops answering, which
    # the toolkit's own collective timeout decides; as torchrun does, the launcher stops the other ranks once one fails.
    _, frozen = warm_launcher.start([f"model.base={base}", f"data.dataset={images}", f"output_dir={out}",
                                     "model.image_size=32", "train.batch_size=2", "train.epochs=100",
                                     "data.num_workers=0", "train.collective_timeout_s=10"], {}, log)
    code = None
    try:
        deadline = time.monotonic() + 200
        # Training starts right after the main process says how many processes run it.
        while "on 2 process(es)" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(2)  # into the loop's collectives
        os.kill(frozen, signal.SIGSTOP)
        stopped = time.monotonic()
        # Without a timeout, rank 0 waits forever. Once it has said so, end the frozen rank here: the launcher would
        # otherwise wait 30 s for it to obey a SIGTERM it cannot see while stopped.
        while code is None and "error: " not in err.read_text() and time.monotonic() < stopped + 150:
            time.sleep(0.2)
            code = warm_launcher.finished()
        waited = time.monotonic() - stopped
    finally:
        try:
            os.kill(frozen, signal.SIGKILL)
        except ProcessLookupError:  # the launcher ended it first
            pass
        if code is None:
            code = warm_launcher.wait(timeout=60)
    assert code != 0 and waited >= 10
    message = next(line for line in err.read_text().splitlines() if line.startswith("error: "))
    assert message.startswith("error: process 0 waited train.collective_timeout_s=10 s") and "(rank) 1" in message


def test_an_image_changed_in_place_with_its_size_and_time_kept_is_refused(base, tmp_path, capsys):
    import numpy as np
    from PIL import Image

    images = write_colour_folder(tmp_path / "images", classes=3, train=8, validation=3)
    changed = images / "train" / "red" / "uncompressed.bmp"  # a BMP's size depends on its dimensions only
    Image.fromarray(np.full((32, 32, 3), (200, 30, 30), np.uint8)).save(changed)
    out = tmp_path / "out"
    args = [f"model.base={base}", f"data.dataset={images}", *RECIPE, f"output_dir={out}", "train.checkpoint_every_steps=1"]
    with pytest.raises(SimulatedKill):
        train(args, callbacks=[kill_at(3)])
    assert completed(out, 2).exists()
    before = changed.stat()
    Image.fromarray(np.full((32, 32, 3), (30, 30, 200), np.uint8)).save(changed)  # now blue, labelled red
    os.utime(changed, ns=(before.st_atime_ns, before.st_mtime_ns))  # as a copy tool that keeps times leaves it
    assert (changed.stat().st_size, changed.stat().st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    assert train([*args, "train.resume=auto"], record=tmp_path / "record") == 1
    error = error_line(capsys.readouterr().err)
    assert "the data of the train" in error and "changed since it was written" in error and "bytes" in error
    assert recorder.read_samples(tmp_path / "record") == []
    assert not list((out / "checkpoints").glob("damaged-*"))  # the checkpoint is intact and kept
