"""A user's mistake in a run of several processes is said once, by one process, with no traceback from the
others (torchrun's own failure summary, printed by the launcher for any failed process, stays).

A mistake the schema refuses stops each process before the libraries load: it goes through the real torchrun. One
refused once the processes have met is said by the ranks themselves: their launch is forked warm
(tests/warm_launch.py; the session's launcher, conftest.warm_launcher), which spares the ranks their own import of the
libraries."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from runs import torchrun_command
from tiny import REPO


def real_torchrun(args: list[str], cwd: Path, request) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([*torchrun_command(), "-m", "vit_finetune", *args], capture_output=True, text=True,
                          timeout=300, env=env, cwd=cwd)


def warm_ranks(args: list[str], cwd: Path, request) -> subprocess.CompletedProcess:
    """The session's warm launcher (conftest.warm_launcher); its log sits beside the run's folder."""
    launcher = request.getfixturevalue("warm_launcher")
    return launcher.run(args, {}, cwd / "launch.log", cwd=cwd)


@pytest.mark.slow
@pytest.mark.parametrize("mistake, message, launch", [
    # refused by the schema, before the processes meet
    ("train.lr=abc", "error: ", real_torchrun),
    # refused by the first process once they have met (from the base's config): the others waited for it
    ("model.image_size=63", "error: model.image_size=63 is not a multiple of the patch size 4; use 60 or 64",
     warm_ranks),
], ids=["schema", "after-meeting"])
def test_a_bad_value_is_said_once_with_no_traceback_from_the_processes(tmp_path, request, mistake, message, launch):
    output = tmp_path / "run"
    result = launch(["--recipe", "demo", mistake, f"output_dir={output}"], tmp_path, request)
    assert result.returncode != 0
    said = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(said) == 1 and said[0].startswith(message), result.stderr[-3000:]
    assert mistake.split("=")[0] in result.stderr
    assert not [line for line in result.stderr.splitlines() if line.startswith("[rank")], result.stderr[-3000:]
    assert not output.exists()
