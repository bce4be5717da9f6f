"""A Hub id that cannot be fetched fails at once, saying the Hub is unreachable and what to do offline, instead of
a minute of the clients' retries ending in a fix that names the very id given."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tiny import REPO, python_path
from vit_finetune.cli import main

OFFLINE_FIX = "set HF_HUB_OFFLINE=1"


UNREACHABLE = {"model.base": ("someone/vit-base", "give a local folder holding config.json"),
               "data.dataset": ("someone/photos", "give a local image folder")}
# The CLI's main on each case in turn, in one fresh interpreter; a line on stderr marks where each case's output ends.
CASES_IN_ONE_INTERPRETER = """
import json, sys
from vit_finetune.cli import main

for args in json.loads(sys.argv[1]):
    print(main(args), flush=True)
    print("--- end of case", file=sys.stderr, flush=True)
"""


@pytest.fixture(scope="module")
def refused(tmp_path_factory) -> dict:
    """key -> (exit code, stderr, output folder, endpoint) of a demo run given that key's Hub id with the Hub down."""
    with socket.socket() as probe:  # a loopback port with nothing listening: connections are refused at once
        probe.bind(("127.0.0.1", 0))
        dead_endpoint = f"http://127.0.0.1:{probe.getsockname()[1]}"
    root = tmp_path_factory.mktemp("unreachable")
    cases = [["--recipe", "demo", f"{key}={value}", f"output_dir={root / key}"]
             for key, (value, _fix) in UNREACHABLE.items()]
    # A fresh interpreter: huggingface_hub reads HF_ENDPOINT once, when it is imported (one for both cases: the import
    # is most of its cost).
    result = subprocess.run([sys.executable, "-c", CASES_IN_ONE_INTERPRETER, json.dumps(cases)], capture_output=True,
                            text=True, timeout=300, cwd=REPO,
                            env={**os.environ, "PYTHONPATH": python_path(), "TOKENIZERS_PARALLELISM": "false",
                                 "HF_ENDPOINT": dead_endpoint})
    assert result.returncode == 0, result.stderr[-3000:]
    codes, errors = result.stdout.split(), result.stderr.split("--- end of case\n")
    return {key: (int(code), error, root / key, dead_endpoint) for key, code, error in zip(UNREACHABLE, codes, errors)}


@pytest.mark.slow
@pytest.mark.parametrize("key", UNREACHABLE)
def test_a_hub_that_refuses_connections_is_named_with_the_offline_fix(refused, key):
    value, local_fix = UNREACHABLE[key]
    code, stderr, output, dead_endpoint = refused[key]
    assert code == 1 and "Traceback" not in stderr
    error = stderr.strip().splitlines()[-1]
    assert error.startswith(f"error: {key}={value!r}: the Hub ({dead_endpoint}) is unreachable"), error
    assert OFFLINE_FIX in error and local_fix in error
    assert "Retrying" not in stderr  # huggingface_hub's back-off (1+2+4+8+8 s) was never entered
    assert not output.exists()


def test_a_hub_answering_503_is_asked_once(hub, tmp_path, capsys):
    """The loopback Hub refuses every request: one request, no retries, the same message."""
    hub.inject_faults(status=503, times=None)
    assert main(["--recipe", "demo", "model.base=user/vit-base", f"output_dir={tmp_path / 'run'}"]) == 1
    error = capsys.readouterr().err
    assert "Traceback" not in error
    assert "the Hub (" in error and "is unreachable (HfHubHTTPError" in error
    assert OFFLINE_FIX in error
    assert len(hub.requests()) == 1, [(r.method, r.path) for r in hub.requests()]


def test_a_missing_repo_is_not_called_unreachable(hub, tmp_path, capsys):
    assert main(["--recipe", "demo", "model.base=user/no-such-model", f"output_dir={tmp_path / 'run'}"]) == 1
    error = capsys.readouterr().err
    assert "Traceback" not in error
    assert "error: model.base='user/no-such-model': the Hub has no model 'user/no-such-model'" in error
    assert "unreachable" not in error


def test_a_missing_local_folder_is_named_as_missing_with_the_path_looked_at(hub, tmp_path, monkeypatch, capsys):
    """Run from the wrong folder, a path is reported missing where it was looked for, not blamed on the Hub (down
    here, as offline); a bare name, which could be a folder or a Hub id, gets both."""
    monkeypatch.chdir(tmp_path)
    hub.inject_faults(status=503, times=None)
    for key, value in (("data.dataset", "./my_photos"), ("model.base", "./typo"), ("model.base", "~/no/such/run")):
        assert main(["--recipe", "demo", f"{key}={value}", f"output_dir={tmp_path / 'run'}"]) == 1
        error = capsys.readouterr().err
        looked_at = Path(value).expanduser().absolute()  # the recipe expands ~ itself
        assert f"error: {key}={value.replace('~', str(Path.home()))!r}: there is no folder or file {str(looked_at)!r}" in error, error
        assert "give its full path" in error and "Hub" not in error and "Traceback" not in error
    assert hub.requests() == []  # a path is not asked of the Hub
    assert main(["--recipe", "demo", "data.dataset=my_photos", f"output_dir={tmp_path / 'run'}"]) == 1
    error = capsys.readouterr().err
    assert f"there is no folder or file {str(tmp_path / 'my_photos')!r}" in error
    assert "is unreachable" in error and OFFLINE_FIX in error
    assert not (tmp_path / "run").exists()


def test_a_path_into_an_existing_folder_is_named_as_missing_before_the_hub(hub, tmp_path, monkeypatch, capsys):
    """`data/missing_sub` beside an existing `data/` reads as a path of the user's: said missing first, with the
    folder that does exist, then what the Hub (down here) says of it as an id."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    hub.inject_faults(status=503, times=None)
    assert main(["--recipe", "demo", "data.dataset=data/missing_sub", f"output_dir={tmp_path / 'run'}"]) == 1
    error = capsys.readouterr().err
    assert error.startswith(f"error: data.dataset='data/missing_sub': there is no folder or file "
                            f"{str(tmp_path / 'data' / 'missing_sub')!r}, though the folder {str(tmp_path / 'data')!r} "
                            "exists: check the name"), error
    assert "is unreachable" in error and "Traceback" not in error
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("key, value, local", [("data.dataset", "someone/photos", "image folder, label file"),
                                               ("data.dataset", "photos", "image folder, label file"),
                                               ("model.base", "someone/vit-base", "folder holding config.json")])
def test_under_hf_hub_offline_a_name_in_no_cache_and_no_folder_is_said_to_be_nowhere(hub, tmp_path, monkeypatch,
                                                                                     capsys, key, value, local):
    """HF_HUB_OFFLINE=1, as the user sets it: huggingface_hub and datasets read it once, when imported, so their
    flags are set here as that import would have set them. The Hub is never asked."""
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    assert main(["--recipe", "demo", f"{key}={value}", f"output_dir={tmp_path / 'run'}"]) == 1
    error = capsys.readouterr().err
    assert error.startswith(f"error: {key}={value!r}: HF_HUB_OFFLINE=1 turns the Hub off"), error
    assert f"{value!r} is not there; nor is it a local folder: there is no folder or file {str(tmp_path / value)!r}" in error
    assert local in error and "unset HF_HUB_OFFLINE" in error
    assert "Traceback" not in error and "unreachable" not in error
    assert hub.requests() == []
    assert not (tmp_path / "run").exists()
