"""train.resolution_schedule: the recipe's refusals, the stages' boundaries, every family moved across sizes with its
tables resampled from the base's own, a scheduled run saved at model.image_size, an exact resume across a stage
boundary, auto said off, and the run without a schedule unchanged (CPU, tiny models, data made here).
"""

from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch
from PIL import Image
from pydantic import ValidationError
from safetensors.torch import load_file
from transformers import AutoModelForImageClassification, pipeline
import yaml

from runs import RECIPE, assert_bit_identical, completed, history, killed_after_a_checkpoint, train
from tiny import TINY_FAMILIES, make_tiny_family, write_colour_folder
from vit_finetune.artifacts.callbacks import Callback
from vit_finetune.core.errors import RunError
from vit_finetune.model import loading
from vit_finetune.model.families import FAMILIES
from vit_finetune.model.positions import resample_position_embeddings
from vit_finetune.recipe import ModelSettings, Recipe
from vit_finetune.training import resolution

# 12 steps (6 an epoch): 3 at 16 px, then 9 at 32 px, the second stage starting inside epoch 0.
SCHEDULE = "train.resolution_schedule=[[16, 0.25], [32, 0.75]]"
EVAL = "train.eval_every_steps=2"  # an evaluation in each stage
LABELS = ["cat", "dog", "fox"]


def refusal(**sections) -> str:
    with pytest.raises(ValidationError) as raised:
        Recipe.model_validate(sections)
    return str(raised.value)


def test_the_recipe_refuses_a_schedule_it_cannot_follow_naming_the_value_and_the_fix():
    assert "sum to 1 (they sum to 1.1)" in refusal(train={"resolution_schedule": [[16, 0.5], [32, 0.6]]})
    assert "strictly increasing" in refusal(train={"resolution_schedule": [[32, 0.5], [16, 0.5]]})
    assert "one size, which is the run without a schedule" in refusal(train={"resolution_schedule": [[32, 1]]})
    assert "list of [size, share] pairs, got 'fast'" in refusal(train={"resolution_schedule": "fast"})
    given = {"resolution_schedule": [[16, 0.5], [32, 0.5]]}
    assert "ends at 32 px, and the saved model is model.image_size=48: end the schedule at [48, share]" in refusal(
        model={"image_size": 48}, train=given)
    together = refusal(model={"image_size": 32}, data={"streaming": True},
                       train={**given, "keep_best": "eval_accuracy"})
    assert "a stream cannot (data.streaming=true)" in together and "train.keep_best=eval_accuracy would compare" in together
    assert "train.method=linear_probe takes none" in refusal(model={"image_size": 32},
                                                              train={**given, "method": "linear_probe"})
    assert Recipe.model_validate({"model": {"image_size": 32}, "train": given}).train.resolution_schedule == [
        (16, 0.5), (32, 0.5)]


def test_a_size_off_the_patch_grid_is_refused_before_training(args, tmp_path, capsys):
    assert train([*args, "train.resolution_schedule=[[18, 0.5], [32, 0.5]]", f"output_dir={tmp_path}"]) != 0
    assert "size 18 is not a multiple of the base's patch size 4; use 16 or 20" in capsys.readouterr().err
    assert not (tmp_path / "checkpoints").exists()


def test_the_stages_start_at_their_cumulative_share_of_the_steps():
    stages = resolution.stages_of([(224, 0.7), (384, 0.3)], 1000)
    assert [(s.size, s.first_step, s.steps) for s in stages] == [(224, 0, 700), (384, 700, 300)]
    stages = resolution.stages_of([(16, 0.25), (24, 0.25), (32, 0.5)], 10)  # 2.5 and 5 steps in: rounded half up
    assert [(s.first_step, s.steps) for s in stages] == [(0, 3), (3, 2), (5, 5)]
    assert [resolution.stage_of_step(stages, done) for done in (0, 2, 3, 4, 5, 9, 10)] == [0, 0, 1, 1, 2, 2, 2]
    assert resolution.stages_of(None, 10) == [] and resolution.stages_of([(16, 0.5), (32, 0.5)], 0) == []
    with pytest.raises(RunError, match=r"stage\(s\) at \[16\] px without an optimiser step of the run's 2"):
        resolution.stages_of([(16, 0.1), (32, 0.9)], 2)


def test_every_family_moved_across_sizes_holds_the_tensors_of_the_base_loaded_at_that_size(tmp_path):
    for model_type in TINY_FAMILIES:
        base = make_tiny_family(model_type, tmp_path / model_type)
        kept = []
        model = loading.build_model(ModelSettings(base=str(base), image_size=32), LABELS, keep_base=kept.append)
        head = FAMILIES[model_type].head
        for size in (16, 48, 32):  # down, up past the base's own size, and back: never from a resampled table
            loading.at_image_size(model, kept[0], size)
            direct = loading.build_model(ModelSettings(base=str(base), image_size=size), LABELS)
            ours, theirs = model.state_dict(), direct.state_dict()
            assert ours.keys() == theirs.keys()
            different = [k for k in theirs if not k.startswith(f"{head}.") and not torch.equal(ours[k], theirs[k])]
            assert not different, f"{model_type} at {size} px: {different[:3]}"
            assert FAMILIES[model_type].image_size(model.config) == size
            pixels = torch.randn(1, 3, size, size, generator=torch.Generator().manual_seed(size))
            direct.load_state_dict(ours)
            with torch.no_grad():  # the same modules' sizes too: the moved model runs as the one built there
                assert torch.equal(model.eval()(pixel_values=pixels).logits, direct.eval()(pixel_values=pixels).logits)


class Sizes(Callback):
    """The pixels' size of each training batch and of the eval split at each evaluation, by step."""

    def __init__(self):
        self.trained, self.evaluated = [], []

    def on_batch(self, run, batch):
        self.trained.append((run.state.step + 1, batch["pixel_values"].shape[-1]))

    def on_evaluate(self, run, metrics):
        self.evaluated.append((run.state.step, run.parts.eval_loader.dataset[(0, 0)][0].shape[-1]))


def test_what_training_changed_in_a_table_moves_with_it_once_resampled(base):
    kept = []
    model = loading.build_model(ModelSettings(base=str(base), image_size=32), LABELS, keep_base=kept.append)
    table = model.vit.embeddings.position_embeddings
    learned = 0.01 * torch.randn(table.shape, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        table += learned  # as steps at 32 px would have changed it
    movers = loading.at_image_size(model, kept[0], 16)
    direct = loading.build_model(ModelSettings(base=str(base), image_size=16), LABELS).vit.embeddings
    expected = direct.position_embeddings + resample_position_embeddings(learned, (4, 4))
    assert model.vit.embeddings.position_embeddings is table  # the same parameter: an optimiser keeps it
    # (table + learned) - table is learned up to float32's rounding
    torch.testing.assert_close(table.detach(), expected.detach(), rtol=0, atol=1e-7)
    assert not torch.allclose(table.detach(), direct.position_embeddings.detach(), atol=1e-4)
    assert list(movers) == [table] and movers[table](learned).shape == (1, 17, 32)  # so do its optimiser moments


@pytest.fixture(scope="module")
def scheduled(args, tmp_path_factory):
    """The uninterrupted 2-stage run, every checkpoint kept, the lines it printed and the sizes it trained and
    evaluated at."""
    out = tmp_path_factory.mktemp("scheduled") / "out"
    printed, sizes = io.StringIO(), Sizes()
    with contextlib.redirect_stdout(printed):
        assert train([*args, SCHEDULE, EVAL, f"output_dir={out}", "train.checkpoint_every_steps=2",
                      "train.keep_checkpoints=10"], callbacks=[sizes]) == 0
    return out, printed.getvalue().splitlines(), sizes


def test_a_scheduled_run_says_its_stages_and_saves_a_plain_model_at_the_final_size(scheduled, tmp_path):
    out, lines, sizes = scheduled
    assert "resolution stage 1 of 2: 16 px, steps 1-3 (3 steps)" in lines
    assert "resolution stage 2 of 2: 32 px, steps 4-12 (9 steps)" in lines
    assert any(line.startswith("resolution stage 1 of 2 (16 px): 3 steps in ") and "images/s" in line for line in lines)
    stages = json.loads((out / "run_info.json").read_text())["resolution_stages"]
    assert [(s["image_size"], s["first_step"], s["steps"]) for s in stages] == [(16, 0, 3), (32, 3, 9)]
    assert all(s["seconds"] > 0 and s["images_per_s"] > 0 for s in stages)
    assert "Resolution schedule (`train.resolution_schedule`): 16 px for 3 steps" in (out / "README.md").read_text()
    # Crops and evaluations at the stage's size, the final evaluation at model.image_size; a plain 32 px model saved.
    assert sizes.trained == [(step, 16 if step <= 3 else 32) for step in range(1, 13)]
    assert sizes.evaluated == [(2, 16), (4, 32), (6, 32), (8, 32), (10, 32), (12, 32)]
    assert [e["step"] for e in history(out) if "eval_accuracy" in e] == [2, 4, 6, 8, 10, 12]
    model = AutoModelForImageClassification.from_pretrained(out)
    assert model.config.image_size == 32 and model.vit.embeddings.position_embeddings.shape == (1, 65, 32)
    classify = pipeline("image-classification", model=str(out))
    predictions = classify(Image.new("RGB", (40, 48), (210, 40, 40)), top_k=3)
    assert sorted(p["label"] for p in predictions) == ["blue", "green", "red"]


def test_each_checkpoint_records_its_stage_and_holds_the_weights_at_its_size(scheduled):
    out = scheduled[0]
    for step, stage, size in ((2, 0, 16), (4, 1, 32)):
        folder = completed(out, step).parent
        state = json.loads((folder / "trainer_state.json").read_text())
        assert (state["resolution"]["stage"], state["resolution"]["image_size"]) == (stage, size)
        tables = [t for k, t in load_file(str(folder / "model.safetensors")).items() if k.endswith("position_embeddings")]
        assert tables[0].shape == (1, (size // 4) ** 2 + 1, 32)


def test_killed_in_the_first_stage_and_resumed_across_its_end_equals_the_uninterrupted_run(args, scheduled, tmp_path):
    out = killed_after_a_checkpoint([*args, SCHEDULE, EVAL, "train.keep_checkpoints=10"], tmp_path / "out")  # at 2
    assert train([*args, SCHEDULE, EVAL, f"output_dir={out}", "train.checkpoint_every_steps=2",
                  "train.keep_checkpoints=10", "train.resume=auto"]) == 0
    assert history(out) == history(scheduled[0])
    assert_bit_identical(out / "model.safetensors", scheduled[0] / "model.safetensors")


class Observed(Callback):
    """What the run trains with, seen at its start and end: the schedule, the model's table, the loaders."""

    def on_train_start(self, run):
        self.start = (run.parts.resolution, run.parts.train_loader, run.parts.eval_loader,
                      run.parts.model.vit.embeddings.position_embeddings)

    def on_train_end(self, run, model):
        self.end = (run.parts.train_loader, run.parts.eval_loader, model.vit.embeddings.position_embeddings.shape)


def test_without_a_schedule_the_run_is_todays_and_auto_says_off(args, tmp_path, capsys):
    unset, null, auto = Observed(), Observed(), Observed()
    assert train([*args, f"output_dir={tmp_path / 'unset'}"], callbacks=[unset]) == 0
    assert train([*args, "train.resolution_schedule=null", f"output_dir={tmp_path / 'null'}"], callbacks=[null]) == 0
    assert_bit_identical(tmp_path / "unset" / "model.safetensors", tmp_path / "null" / "model.safetensors")
    assert unset.start[0] is None  # no schedule: nothing kept, moved or rebuilt
    assert unset.end[:2] == unset.start[1:3] and unset.end[2] == (1, 65, 32)
    assert "resolution stage" not in capsys.readouterr().out
    assert train([*args, "train.resolution_schedule=auto", "train.max_steps=2", f"output_dir={tmp_path / 'auto'}"],
                 callbacks=[auto]) == 0
    said = capsys.readouterr()
    assert ("train.resolution_schedule=auto -> off: every schedule measured lost accuracy to the whole run at the final "
            "size (docs/studies/resolution.md); set train.resolution_schedule to choose") in said.out + said.err
    assert auto.start[0] is None and "resolution_stages" not in json.loads((tmp_path / "auto" / "run_info.json").read_text())


def test_a_probe_that_auto_chose_says_the_schedule_is_unused_and_runs_at_the_final_size(base, tmp_path, capsys):
    # 12 images per class seen 10 times (360 seen): train.method=auto takes the probe alone, which reads each image once
    # at model.image_size and takes no step, so no stage would begin.
    images = write_colour_folder(tmp_path / "colours", classes=3, train=12, validation=3)
    out = tmp_path / "probe"
    assert train([f"model.base={base}", f"data.dataset={images}", *RECIPE, "train.method=auto", "train.epochs=10",
                  SCHEDULE, f"output_dir={out}"]) == 0
    said = capsys.readouterr().out
    method = said.split("train.method=auto -> ")[1]
    assert method.startswith("linear_probe")
    assert ("train.resolution_schedule=[[16, 0.25], [32, 0.75]]" in method.split("not used")[0]
            and "not used: the probe alone reads each image once" in method)
    assert "resolution stage" not in said
    assert "resolution_stages" not in json.loads((out / "run_info.json").read_text())
    assert yaml.safe_load((out / "recipe.yaml").read_text())["train"]["resolution_schedule"] is None
    assert AutoModelForImageClassification.from_pretrained(out).config.image_size == 32
