"""A student cut from a fine-tuned teacher's own blocks (model.keep_blocks), through the real CLI, on a tiny DINOv2.

The teacher is a toolkit run on the colour images from a 4-block DINOv2 whose blocks all hold different random
weights; the student keeps 2 of them at another size (48 px against the teacher's 32): the first two by default,
[0, 3] when a list asks for them. Its one optimiser step runs at
an lr of 1e-9, so every weight it saved is, to 1e-6, the weight it was built with: which block went where, whether
the position table was resampled and whether the head came along can be read off the saved folder.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from runs import RECIPE, train
from tiny import make_tiny_family, make_tiny_vit
from vit_finetune.model import student
from vit_finetune.model.families import FAMILIES
from vit_finetune.model.loading import build_model
from vit_finetune.model.positions import resample_position_embeddings
from vit_finetune.recipe import ModelSettings

BLOCK = re.compile(r"(?:^|\.)layers?\.(\d+)\.")
STILL = ["train.max_steps=1", "train.lr=1e-9", "train.head_lr=1e-9"]  # one step that moves no weight by 1e-6


def saved(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


def block_weights(state: dict[str, torch.Tensor], block: int) -> dict[str, torch.Tensor]:
    """Block `block`'s tensors, by their name inside the block."""
    found = {}
    for key, tensor in state.items():
        match = BLOCK.search(key)
        if match and int(match.group(1)) == block:
            found[key[match.end():]] = tensor
    return found


def blocks_of(model: torch.nn.Module) -> set[int]:
    """The indices of the blocks a loaded model holds."""
    return {int(match.group(1)) for key in model.state_dict() if (match := BLOCK.search(key))}


def metrics(folder: Path) -> dict:
    return json.loads((folder / "metrics.json").read_text())


@pytest.fixture(scope="module")
def deep_base(tmp_path_factory) -> Path:
    """A tiny DINOv2 backbone of 4 blocks, saved as its Hub checkpoints are, its position table non-trivial."""
    from transformers import Dinov2Config, Dinov2Model

    torch.manual_seed(0)
    model = Dinov2Model(Dinov2Config(hidden_size=32, num_hidden_layers=4, num_attention_heads=2, mlp_ratio=2,
                                     image_size=32, patch_size=4))
    with torch.no_grad():
        model.embeddings.position_embeddings.normal_(std=0.5)
    return make_tiny_family("dinov2", tmp_path_factory.mktemp("dinov2-4"), model=model)


@pytest.fixture(scope="module")
def teacher(deep_base, images, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("teacher") / "out"
    assert train([f"model.base={deep_base}", f"data.dataset={images}", *RECIPE, "train.epochs=1",
                  f"output_dir={out}"]) == 0
    return out


@pytest.fixture(scope="module")
def cut_student(teacher, images, tmp_path_factory) -> Path:
    """2 of the teacher's 4 blocks (the first and the last) at 48 px, taught by the teacher itself."""
    out = tmp_path_factory.mktemp("student") / "out"
    assert train([f"model.base={teacher}", "model.keep_blocks=[0,3]", f"data.dataset={images}", *RECIPE,
                  "model.image_size=48", *STILL, f"train.distill.teacher={teacher}", f"output_dir={out}"]) == 0
    return out


def test_the_student_holds_the_first_and_the_last_of_the_teachers_blocks_in_order(teacher, cut_student):
    theirs, ours = saved(teacher), saved(cut_student)
    assert {int(match.group(1)) for key in ours if (match := BLOCK.search(key))} == {0, 1}
    for position, block in enumerate([0, 3]):
        mine = block_weights(ours, position)
        assert mine.keys() == block_weights(theirs, block).keys()
        for name, tensor in mine.items():
            torch.testing.assert_close(tensor, block_weights(theirs, block)[name], atol=1e-6, rtol=0)
    # The teacher's blocks differ from each other, so a block taken from elsewhere could not pass the checks above.
    middle = block_weights(theirs, 1)
    assert any((block_weights(ours, 1)[name] - middle[name]).abs().max() > 1e-3 for name in middle)


def test_the_student_keeps_the_teachers_embeddings_final_norm_and_head(teacher, cut_student):
    theirs, ours = saved(teacher), saved(cut_student)
    outside = [key for key in ours if not BLOCK.search(key) and not key.endswith("position_embeddings")]
    assert any(key.startswith("classifier.") for key in outside) and any("layernorm" in key for key in outside)
    assert sorted(outside) == sorted(key for key in theirs if not BLOCK.search(key)
                                     and not key.endswith("position_embeddings"))
    for key in outside:
        torch.testing.assert_close(ours[key], theirs[key], atol=1e-6, rtol=0)
    assert theirs["classifier.weight"].abs().max() > 1e-2  # a trained head, not the zeros a new one starts from


def test_the_students_position_table_is_the_teachers_resampled_to_its_size(teacher, cut_student):
    key = next(key for key in saved(cut_student) if key.endswith("position_embeddings"))
    table = saved(cut_student)[key]
    assert table.shape[1] == 1 + 12 * 12  # 48 px at patch 4
    # DINOv2's own resampling: bicubic, no antialias, CLS row kept (families.py)
    expected = resample_position_embeddings(saved(teacher)[key], (12, 12), prefix_rows=1, antialias="never")
    torch.testing.assert_close(table, expected, atol=1e-6, rtol=0)


def test_the_saved_student_loads_in_a_plain_pipeline_and_its_config_says_its_depth(cut_student, images):
    from transformers import pipeline

    config = json.loads((cut_student / "config.json").read_text())
    assert config["num_hidden_layers"] == 2
    assert config[student.STUDENT_KEY] == {"blocks": [0, 3], "of": 4, "head": True}
    classify = pipeline("image-classification", model=str(cut_student))
    assert blocks_of(classify.model) == {0, 1}
    image = next((images / "validation" / "red").iterdir())
    answer = classify(str(image), top_k=3)
    assert {row["label"] for row in answer} == {"red", "green", "blue"}
    assert answer[0]["label"] == "red"  # the teacher's head on the cut blocks still tells the colours apart


def test_a_distilled_run_says_the_students_depth_and_that_it_was_cut_from_the_teacher(teacher, cut_student):
    facts = metrics(cut_student)["distillation"]
    assert facts["student"] == {"blocks": 2, "from": str(teacher), "kept_blocks": [0, 3], "of": 4,
                                "head_kept": True, "from_teacher": True}
    said = "the student: 2 blocks cut from the teacher itself (blocks 0, 3 of its 4; its head kept)"
    assert said in (cut_student / "README.md").read_text()


def test_a_count_keeps_the_first_blocks_and_a_backbone_cut_gets_a_new_zero_head(deep_base, images, tmp_path):
    """The backbone has no head for these labels: the student gets a new one (zero, model.head_init)."""
    out = tmp_path / "out"
    assert train([f"model.base={deep_base}", "model.keep_blocks=3", f"data.dataset={images}", *RECIPE, *STILL,
                  f"output_dir={out}"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 3
    assert config[student.STUDENT_KEY] == {"blocks": [0, 1, 2], "of": 4, "head": False}
    assert saved(out)["classifier.weight"].abs().max() < 1e-6
    for position, block in enumerate([0, 1, 2]):
        base_block = block_weights(saved(deep_base), block)
        for name, tensor in block_weights(saved(out), position).items():
            torch.testing.assert_close(tensor, base_block[name], atol=1e-6, rtol=0)


@pytest.mark.parametrize("keep, said", [
    ("5", "has 4 blocks (0 to 3), so it cannot give 5 blocks"),
    ("[0,4]", "has 4 blocks (0 to 3), so it cannot give blocks [4]"),
])
def test_more_blocks_than_the_base_has_are_refused_before_anything_is_written(deep_base, images, tmp_path, capsys,
                                                                             keep, said):
    out = tmp_path / "out"
    assert train([f"model.base={deep_base}", f"model.keep_blocks={keep}", f"data.dataset={images}", *RECIPE,
                  f"output_dir={out}"]) == 2
    assert said in capsys.readouterr().err and not out.exists()


def test_a_family_whose_blocks_cannot_be_cut_is_refused_by_name(images, tmp_path, capsys):
    base = make_tiny_family("swin", tmp_path / "swin")
    out = tmp_path / "out"
    assert train([f"model.base={base}", "model.keep_blocks=2", f"data.dataset={images}", *RECIPE,
                  f"output_dir={out}"]) == 2
    error = capsys.readouterr().err
    assert "is a Swin model, whose blocks sit in stages" in error and "model.keep_blocks=null" in error
    assert "DINOv2" in error and not out.exists()


@pytest.mark.parametrize("keep, said", [
    ("0", "must keep at least 1 block"),
    ("[3,1]", "distinct 0-based indices in increasing order"),
    ("[1,1]", "distinct 0-based indices in increasing order"),
    ("six", "must be a number of blocks or a list of block indices"),
])
def test_a_wrong_count_or_list_of_blocks_is_a_recipe_error(base, images, tmp_path, capsys, keep, said):
    assert train([f"model.base={base}", f"model.keep_blocks={keep}", f"data.dataset={images}", *RECIPE,
                  f"output_dir={tmp_path / 'out'}"]) == 2
    error = capsys.readouterr().err
    assert "model.keep_blocks" in error and said in error


def test_a_student_from_random_weights_has_the_cut_depth(tmp_path):
    base = make_tiny_vit(tmp_path / "vit", layers=4)
    model = build_model(ModelSettings(base=str(base), image_size=32, pretrained=False, keep_blocks=[0, 2, 3]),
                        ["a", "b"])
    assert model.config.num_hidden_layers == 3 and blocks_of(model) == {0, 1, 2}


@pytest.mark.parametrize("model_type", [t for t, family in FAMILIES.items() if family.one_block_stack])
def test_every_family_of_one_block_stack_can_be_cut_and_saved_and_loaded_back(model_type, tmp_path):
    """Each family's tiny checkpoint (2 blocks) cut to its last one: it runs, and its saved config builds it again."""
    from transformers import AutoConfig

    base = make_tiny_family(model_type, tmp_path / "base")
    model = build_model(ModelSettings(base=str(base), image_size=32, keep_blocks=[1]), ["a", "b"])
    family = FAMILIES[model_type]
    assert family.num_blocks(model.config) == 1 and blocks_of(model) == {0}
    original = family.model_class().from_pretrained(base)
    for name, tensor in block_weights(model.state_dict(), 0).items():
        torch.testing.assert_close(tensor, block_weights(original.state_dict(), 1)[name])
    model.save_pretrained(tmp_path / "cut")
    again = family.model_class().from_pretrained(tmp_path / "cut")
    assert family.num_blocks(AutoConfig.from_pretrained(tmp_path / "cut")) == 1 and blocks_of(again) == {0}
    with torch.no_grad():
        assert again(pixel_values=torch.rand(1, 3, 32, 32)).logits.shape == (1, 2)


def test_training_on_from_a_cut_student_without_a_cut_replaces_its_head_and_forgets_the_cut(cut_student, images,
                                                                                           tmp_path):
    out = tmp_path / "out"
    assert train([f"model.base={cut_student}", f"data.dataset={images}", *RECIPE, *STILL, f"output_dir={out}"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 2 and student.STUDENT_KEY not in config
    assert saved(out)["classifier.weight"].abs().max() < 1e-6  # a new head, as for any base


def test_auto_says_a_student_keeps_the_teachers_head_instead_of_calling_it_new(teacher, images, tmp_path, capsys):
    """The log said '(... its head kept)' and then 'train.head_lr=auto -> 0.002: the new head starts from zero'."""
    out = tmp_path / "student"
    assert train([f"model.base={teacher}", "model.keep_blocks=2", f"data.dataset={images}", *RECIPE,
                  # the lr of a real-sized base (auto's for this tiny one, 2e-3, would leave the head at train.lr)
                  "train.max_steps=1", "train.lr=2e-5", "train.head_lr=auto", "train.warmup_steps=auto",
                  f"output_dir={out}"]) == 0
    printed = capsys.readouterr().out
    assert "its head kept" in printed and "new head" not in printed
    assert "train.head_lr=auto -> 0.002: the student keeps the teacher's trained head" in printed
    assert "train.warmup_steps=auto -> 0: none, as every student of the student study" in printed
    assert json.loads((out / "config.json").read_text())["student_of"]["head"] is True
