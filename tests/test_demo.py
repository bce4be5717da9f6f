"""The embedded default: the shipped tiny ViT, the generated demo dataset and the demo recipe agree."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import pytest
from tiny import REPO

from vit_finetune.core.layout import ASSETS_DIR
from vit_finetune.data import synthetic
from vit_finetune.model.loading import base_location, load_base_config
from vit_finetune.recipe import load_recipe


def digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_the_shipped_model_is_a_small_vit_and_the_demo_doubles_its_resolution():
    recipe = load_recipe("demo")
    folder = Path(base_location(recipe.model))
    assert folder.parent == ASSETS_DIR
    assert sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) < 5 * 2**20
    config = load_base_config(recipe.model)
    assert recipe.model.image_size == 2 * config.image_size
    pretrain_classes = set(json.loads((folder / "config.json").read_text())["label2id"])
    assert pretrain_classes == set(synthetic.TASKS["pretrain"]["classes"])
    # The demo fine-tunes a new head on classes the model was never trained on.
    assert not pretrain_classes & set(synthetic.TASKS["demo"]["classes"])


def test_the_demo_dataset_is_generated_deterministically_and_once(tmp_path):
    first = synthetic.ensure_demo_dataset(tmp_path / "a")
    second = synthetic.ensure_demo_dataset(tmp_path / "b")
    assert digest(first) == digest(second)
    classes = sorted(p.name for p in (first / "train").iterdir())
    assert classes == sorted(synthetic.TASKS["demo"]["classes"])
    stamp = {p: p.stat().st_mtime_ns for p in first.rglob("*.png")}
    assert synthetic.ensure_demo_dataset(tmp_path / "a") == first  # reused, not rewritten
    assert {p: p.stat().st_mtime_ns for p in first.rglob("*.png")} == stamp


def loaded(settings) -> dict:
    """What a run takes from loading its data: rows, order, labels, and the global RNGs it then seeds models from."""
    import random

    import numpy as np
    import torch
    from accelerate.utils import set_seed

    from vit_finetune import data

    set_seed(0)  # as training.run() does, before it loads the data
    splits = data.load_splits(settings, seed=0)

    def rows(table) -> list[tuple[str, int]]:
        return [("/".join(Path(row["image"]["path"]).parts[-3:]), row["label"]) for row in table]

    return {"train": rows(splits.train), "eval": rows(splits.eval), "labels": splits.labels,
            "torch": torch.get_rng_state().numpy().tobytes(), "numpy": repr(np.random.get_state()),
            "python": random.getstate()}


def test_the_run_that_generates_the_demo_dataset_loads_it_as_later_runs_do(tmp_path, monkeypatch):
    # The first demo run writes the images and has `datasets` build its cache; later runs read both back. Their
    # training must be bit-identical, so loading must give the same rows in the same order and leave the global
    # RNGs (model init, dropout) where a cached load leaves them.
    monkeypatch.setenv("VIT_FINETUNE_CACHE", str(tmp_path / "cache"))
    settings = load_recipe("demo").data
    first = loaded(settings)
    assert len(first["train"]) == sum(1 for _ in (tmp_path / "cache").rglob("train/*/*.png"))  # it generated them
    assert loaded(settings) == first


def test_make_demo_runs_on_the_avx2_kernels_of_every_x86_cpu():
    """`make demo` prints one figure on every x86-64 CPU only if torch, MKL and oneDNN take the same code paths: the
    Makefile names them before Python starts (they are read once, at the first operation), and torch obeys."""

    # Run from `make test`, a sub-make inherits MAKELEVEL and prints "Entering/Leaving directory" lines: start afresh.
    fresh = {name: value for name, value in os.environ.items() if name not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS")}
    printed = subprocess.run(["make", "-n", "-o", ".cache/installed", "demo"], cwd=REPO, env=fresh, capture_output=True,
                             text=True, check=True).stdout
    command = next(line for line in printed.splitlines() if "-m vit_finetune" in line)
    variables = dict(word.split("=", 1) for word in command.split() if re.fullmatch(r"[A-Z_]+=\S+", word))
    assert variables == {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    assert "-m vit_finetune --recipe demo" in command
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the AVX2 code paths exist on x86-64 only")
    probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"],
                           env={**os.environ, **variables}, capture_output=True, text=True, check=True)
    assert probe.stdout.strip() == "AVX2"


def test_make_demo_needs_nothing_past_pip_and_make_test_installs_the_pages_browser():
    """`make demo` on a fresh machine (-B: every stamp out of date) installs with pip alone, never apt-get; `make test`
    also installs the browser the page's test drives; CI's order (test, test-floors, demo) builds both stamps."""
    fresh = {name: value for name, value in os.environ.items() if name not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS")}

    def planned(*targets: str) -> str:
        return subprocess.run(["make", "-n", "-B", *targets], cwd=REPO, env=fresh, capture_output=True, text=True,
                              check=True).stdout

    for target in ("demo", "install", "test-floors", "list"):
        printed = planned(target)
        assert "pip install" in printed, (target, printed)
        assert "apt-get" not in printed and "chromium" not in printed, (target, printed)
    test = planned("test")
    assert "apt-get install -y -qq chromium chromium-driver" in test and "touch .cache/browser-installed" in test
    assert test.index("pip install") < test.index("-m pytest") and test.index("apt-get") < test.index("-m pytest")
    ci = [line.split("#")[0].split() for line in (REPO / ".ci" / "run").read_text().splitlines()]
    assert [words[1] for words in ci if words[:1] == ["make"]] == ["test", "test-floors", "demo"]
