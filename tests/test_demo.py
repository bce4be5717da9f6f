"""The embedded default: the shipped tiny ViT, the generated demo dataset and the demo recipe agree."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from vit_finetune import synthetic
from vit_finetune.model import ASSETS_DIR, base_location, load_base_config
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
