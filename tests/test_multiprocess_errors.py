"""A user's mistake in a run of several processes is said once, by one process, with no traceback from the
others (torchrun's own failure summary, printed by the launcher for any failed process, stays)."""

from __future__ import annotations

import os
import subprocess

import pytest

from runs import torchrun_command
from tiny import REPO


def torchrun(*args: str, cwd) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([*torchrun_command(), "-m", "vit_finetune", "--recipe", "demo", *args],
                          capture_output=True, text=True, timeout=300, env=env, cwd=cwd)


@pytest.mark.slow
@pytest.mark.parametrize("mistake, message", [
    # refused by the schema, before the processes meet
    ("train.lr=abc", "error: "),
    # refused by the first process once they have met (from the base's config): the others waited for it
    ("model.image_size=63", "error: model.image_size=63 is not a multiple of the patch size 4; use 60 or 64"),
])
def test_a_bad_value_is_said_once_with_no_traceback_from_the_processes(tmp_path, mistake, message):
    output = tmp_path / "run"
    result = torchrun(mistake, f"output_dir={output}", cwd=tmp_path)
    assert result.returncode != 0
    said = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(said) == 1 and said[0].startswith(message), result.stderr[-3000:]
    assert mistake.split("=")[0] in result.stderr
    assert not [line for line in result.stderr.splitlines() if line.startswith("[rank")], result.stderr[-3000:]
    assert not output.exists()
