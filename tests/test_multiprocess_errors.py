"""A user's mistake in a run of several processes is said once, by one process, with no traceback from the
others (torchrun's own failure summary, printed by the launcher for any failed process, stays).

A mistake the schema refuses stops each process before the libraries load: it goes through the real torchrun. One
refused once the processes have met is said by the ranks themselves: their launch is forked warm
(tests/warm_launch.py), which spares the two ranks and the launcher each their own import of the libraries."""

from __future__ import annotations

import os
import subprocess

import pytest

from runs import torchrun_command, warm_launch_command
from tiny import REPO


def launch(launcher: list[str], *args: str, cwd) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([*launcher, "-m", "vit_finetune", "--recipe", "demo", *args],
                          capture_output=True, text=True, timeout=300, env=env, cwd=cwd)


@pytest.mark.slow
@pytest.mark.parametrize("mistake, message, launcher", [
    # refused by the schema, before the processes meet
    ("train.lr=abc", "error: ", torchrun_command),
    # refused by the first process once they have met (from the base's config): the others waited for it
    ("model.image_size=63", "error: model.image_size=63 is not a multiple of the patch size 4; use 60 or 64",
     warm_launch_command),
], ids=["schema", "after-meeting"])
def test_a_bad_value_is_said_once_with_no_traceback_from_the_processes(tmp_path, mistake, message, launcher):
    output = tmp_path / "run"
    result = launch(launcher(), mistake, f"output_dir={output}", cwd=tmp_path)
    assert result.returncode != 0
    said = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(said) == 1 and said[0].startswith(message), result.stderr[-3000:]
    assert mistake.split("=")[0] in result.stderr
    assert not [line for line in result.stderr.splitlines() if line.startswith("[rank")], result.stderr[-3000:]
    assert not output.exists()
