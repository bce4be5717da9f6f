"""Every ViT-family entry: moved to a new resolution once, saved, and run by plain transformers exactly as the base
checkpoint runs at that size with its own interpolation; LoRA by role; block depths; the family table's refusals.

All checkpoints are tiny random configurations of each family built here (tests/tiny.py): the Hub is unreachable.
"""

from __future__ import annotations

import inspect
import logging
import re
import shutil
from contextlib import contextmanager

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file
from transformers import AutoModelForImageClassification, pipeline

from tiny import TINY_FAMILIES, make_tiny_family, tiny_family_config
from vit_finetune.model import loading as vit, lora
from vit_finetune.model.families import FAMILIES, NO_WEIGHT_DECAY
from vit_finetune.recipe import LoraSettings, ModelSettings, Recipe
from vit_finetune.training.optim import build_optimizer

LABELS = ["cat", "dog", "fox", "owl", "yak", "emu"]
WEIGHT_WARNING = re.compile(r"LOAD REPORT|missing|unexpected|newly initiali|not used|not initiali|mismatch", re.I)
MEASURED: dict[str, float] = {}  # model_type -> invariant max abs difference, printed at the end (pytest -s)


@contextmanager
def transformers_log():
    """Every record transformers logs inside the block (its logger does not propagate, so caplog sees nothing)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = records.append
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)


def weight_warnings(records: list[logging.LogRecord]) -> list[str]:
    return [r.getMessage() for r in records if r.levelno >= logging.WARNING and WEIGHT_WARNING.search(r.getMessage())]


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """model_type -> folder of a tiny 32 px checkpoint saved like the family's Hub checkpoints."""
    return {t: make_tiny_family(t, tmp_path_factory.mktemp(t.replace("-", "_"))) for t in TINY_FAMILIES}


def test_the_tiny_zoo_covers_every_family():
    assert set(TINY_FAMILIES) == set(FAMILIES)


def test_the_log_capture_sees_a_newly_initialised_head(bases):
    # Positive control for the no-warning assertions below: a bare backbone loaded with a head is reported.
    with transformers_log() as records:
        AutoModelForImageClassification.from_pretrained(bases["dinov2"])
    assert weight_warnings(records)


def test_the_head_swap_loads_without_transformers_load_report_and_a_missing_backbone_weight_is_refused(bases, tmp_path):
    # The new head is swapped on purpose: transformers' table naming it MISSING reads like an error, so it is not shown.
    with transformers_log() as records:
        vit.build_model(ModelSettings(base=str(bases["dinov2"]), image_size=64), LABELS)
    assert weight_warnings(records) == []
    # What the report would have warned of is still refused: a backbone weight the checkpoint lacks.
    damaged = tmp_path / "damaged"
    shutil.copytree(bases["dinov2"], damaged)
    weights = load_file(damaged / "model.safetensors")
    dropped = next(key for key in weights if "norm" in key)
    del weights[dropped]
    save_file(weights, damaged / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(vit.ModelError, match="would be re-initialised instead of loaded"):
        vit.build_model(ModelSettings(base=str(damaged), image_size=64), LABELS)


def last_hidden_state(model, family, pixels, interpolate: bool) -> torch.Tensor:
    backbone = getattr(model, family.backbone)
    flag = {"interpolate_pos_encoding": True} if interpolate and "interpolate_pos_encoding" in inspect.signature(
        backbone.forward).parameters else {}  # DINOv2 has no flag: it always interpolates
    with torch.no_grad():
        return backbone(pixel_values=pixels, **flag).last_hidden_state


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_saved_model_at_twice_the_size_equals_the_base_interpolating_and_pipeline_runs_it(model_type, bases, tmp_path):
    family = FAMILIES[model_type]
    settings = ModelSettings(base=str(bases[model_type]), image_size=64, head_init="random")
    vit.build_model(settings, LABELS).save_pretrained(tmp_path)
    vit.load_image_processor(settings, 64).save_pretrained(tmp_path)
    with transformers_log() as records:
        reloaded = AutoModelForImageClassification.from_pretrained(tmp_path).eval()
    assert weight_warnings(records) == []
    assert type(reloaded).__name__ == family.classification_class  # a distilled DeiT comes back as DeiTForImage...
    assert family.image_size(reloaded.config) == 64
    assert reloaded.config.id2label == dict(enumerate(LABELS))

    base = family.model_class().from_pretrained(bases[model_type]).eval()
    pixels = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    expected = last_hidden_state(base, family, pixels, interpolate=True)
    ours = last_hidden_state(reloaded, family, pixels, interpolate=False)  # no flag: the saved model is 64 px
    difference = (ours - expected).abs().max().item()
    MEASURED[model_type] = difference
    assert difference <= 1e-5, f"{model_type}: max abs difference {difference:.3g}"

    # pipeline() with the saved processor (each family's own size convention) feeds the model its new size.
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (50, 70, 3), dtype=np.uint8))
    with transformers_log() as records:
        classify = pipeline("image-classification", model=str(tmp_path))
        predictions = classify(image, top_k=len(LABELS))
    assert weight_warnings(records) == []
    assert classify.image_processor(image, return_tensors="pt")["pixel_values"].shape == (1, 3, 64, 64)
    assert sorted(p["label"] for p in predictions) == sorted(LABELS)


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_every_lora_role_finds_one_linear_per_block_and_merging_keeps_the_logits(model_type, bases):
    family = FAMILIES[model_type]
    built = vit.build_model(ModelSettings(base=str(bases[model_type]), image_size=64, head_init="random"), LABELS)
    blocks = family.num_blocks(built.config)
    for role in family.roles:
        names = lora.lora_target_modules(built, [role], family)
        assert len(names) == blocks, (role, names)
    roles = list(family.roles)
    adapted = lora.apply_lora(built, LoraSettings(r=4, alpha=8, dropout=0.0, target_modules=roles))
    trainable = {n for n, p in adapted.named_parameters() if p.requires_grad}
    assert any("lora_A" in n for n in trainable) and any(family.head in n for n in trainable)
    assert not any("base_layer" in n for n in trainable)
    torch.manual_seed(1)
    with torch.no_grad():  # as if trained: non-zero B matrices and a changed head
        for name, parameter in adapted.named_parameters():
            if "lora_B" in name or "modules_to_save" in name:
                parameter.normal_(std=0.5)
    adapted.eval()
    merged = lora.merged_copy(adapted).eval()
    assert not lora.is_lora(merged) and type(merged).__name__ == family.classification_class
    pixels = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        difference = (merged(pixel_values=pixels).logits - adapted(pixel_values=pixels).logits).abs().max().item()
    assert difference <= 1e-5
    assert lora.is_lora(adapted)  # merging a copy leaves the adapter model usable


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_block_index_numbers_every_block_and_nothing_outside(model_type):
    family = FAMILIES[model_type]
    config = tiny_family_config(model_type)
    model = family.model_class()(config)
    indices = {name: family.block_index(name, config) for name, _ in model.named_parameters()}
    assert {i for i in indices.values() if i is not None} == set(range(family.num_blocks(config)))
    assert all(indices[n] is None for n in indices if n.startswith(family.head) or ".embeddings." in n)


def test_swin_with_a_new_window_resizes_every_bias_table_bicubically(bases, tmp_path):
    settings = ModelSettings(base=str(bases["swin"]), image_size=64, window_size=8)
    built = vit.build_model(settings, LABELS)
    assert built.config.window_size == 8
    base = FAMILIES["swin"].model_class().from_pretrained(bases["swin"])
    tables = {n: t for n, t in base.state_dict().items() if n.endswith("relative_position_bias_table")}
    assert tables and all(t.shape == (7 * 7, 2) for t in tables.values())
    for name, table in tables.items():
        grid = table.T.reshape(1, 2, 7, 7)
        expected = torch.nn.functional.interpolate(grid, size=(15, 15), mode="bicubic", align_corners=False)
        assert torch.allclose(built.state_dict()[name], expected.reshape(2, 225).T, atol=1e-6)
    built.save_pretrained(tmp_path)
    with transformers_log() as records:
        reloaded = AutoModelForImageClassification.from_pretrained(tmp_path)
    assert weight_warnings(records) == []
    assert torch.isfinite(reloaded(pixel_values=torch.randn(1, 3, 64, 64)).logits).all()


def test_swinv2_with_a_new_window_keeps_its_coordinate_scale(bases):
    built = vit.build_model(ModelSettings(base=str(bases["swinv2"]), image_size=64, window_size=8), LABELS)
    assert built.config.window_size == 8 and set(built.config.pretrained_window_sizes) == {4}  # the old window


def test_a_window_for_a_family_without_one_is_refused_from_the_config(bases):
    with pytest.raises(vit.ModelError, match=r"model.window_size=8 applies to Swin and Swinv2 only; DeiT"):
        vit.load_base_config(ModelSettings(base=str(bases["deit"]), image_size=64, window_size=8))


@pytest.mark.parametrize("config_class, key", [("Dinov2Config", None), ("CLIPConfig", "vision_config")])
def test_patch_14_families_need_multiples_of_14(config_class, key, tmp_path):
    import transformers

    kwargs = {"vision_config": {"patch_size": 14}} if key else {"patch_size": 14}
    getattr(transformers, config_class)(**kwargs).save_pretrained(tmp_path)  # config only: nothing else to fetch
    assert vit.load_base_config(ModelSettings(base=str(tmp_path), image_size=448))
    with pytest.raises(vit.ModelError, match=r"model.image_size=450 is not a multiple of the patch size 14; use 448 or 462"):
        vit.load_base_config(ModelSettings(base=str(tmp_path), image_size=450))


def test_an_unsupported_model_type_is_refused_naming_the_families(tmp_path):
    from transformers import ResNetConfig

    ResNetConfig().save_pretrained(tmp_path)  # config only: a refusal must come before any weights are wanted
    with pytest.raises(vit.ModelError, match=r"'resnet' model.*supported families.*DeiT \(deit\).*SigLIP"):
        vit.load_base_config(ModelSettings(base=str(tmp_path)))


@pytest.mark.parametrize("model_type", ["beit", "dinov2_with_registers", "clip", "swinv2"])
def test_position_and_token_parameters_get_no_weight_decay(model_type, bases):
    built = vit.build_model(ModelSettings(base=str(bases[model_type]), image_size=64), LABELS)
    recipe = Recipe(train={"weight_decay": 0.05, "lr": 2e-5, "head_lr": 2e-3})
    groups = build_optimizer(built, recipe, "cpu").param_groups  # the head's pair (its own lr), then the rest
    decayed_ids = {id(p) for group in groups if group["weight_decay"] > 0 for p in group["params"]}
    names = [n for n, p in built.named_parameters() if NO_WEIGHT_DECAY.search(n)]
    assert names  # every one of these families has some
    assert not [n for n, p in built.named_parameters() if NO_WEIGHT_DECAY.search(n) and id(p) in decayed_ids]
    assert decayed_ids  # the weight matrices still decay


@pytest.mark.slow
@pytest.mark.parametrize("model_type, lora", [("deit", True), ("clip", True), ("data2vec-vision", True),
                                              ("swinv2", True), ("dinov2_with_registers", False), ("swin", False)])
def test_the_cli_fine_tunes_each_kind_of_family_end_to_end(model_type, lora, bases, tmp_path):
    from runs import train
    from tiny import write_colour_folder

    images = write_colour_folder(tmp_path / "images", classes=3, train=4, validation=2)
    output = tmp_path / "out"
    lora_args = ["model.lora={r: 4, target_modules: [query, key, value, attention_output, mlp_in, mlp_out]}"] * lora
    assert train([f"model.base={bases[model_type]}", f"data.dataset={images}", f"output_dir={output}",
                  "model.image_size=64", "train.max_steps=2", "train.batch_size=4", "data.num_workers=0",
                  *lora_args]) == 0
    family = FAMILIES[model_type]
    with transformers_log() as records:
        reloaded = AutoModelForImageClassification.from_pretrained(output)
    assert weight_warnings(records) == [] and family.image_size(reloaded.config) == 64
    assert (output / "adapter" / "adapter_config.json").is_file() == lora
    card = (output / "README.md").read_text()
    assert f"- {model_type}\n" in card and family.name in card


@pytest.mark.parametrize("model_type, expected", [
    ("deit", "DeiT 32d x 2 blocks, patch 4, 64px (16x16 grid)"),
    ("siglip", "SigLIP vision tower 32d x 2 blocks, patch 4, 64px (16x16 grid)"),
    ("swin", "Swin 32d x 4 blocks, patch 2, 64px (32x32 grid)"),
])
def test_describe_reads_each_familys_own_config_keys(model_type, expected):
    config = tiny_family_config(model_type)
    FAMILIES[model_type].set_image_size(config, 64)
    assert vit.describe(config) == expected


def test_the_resample_hook_sees_the_familys_absolute_table_and_skips_families_without_one(bases):
    seen = []
    vit.build_model(ModelSettings(base=str(bases["clip"]), image_size=64), LABELS,
                    on_resample=lambda before, after: seen.append((before.shape, after.shape)))
    assert seen == [((1, 1 + 8 * 8, 32), (1, 1 + 16 * 16, 32))]  # the nn.Embedding weight, as (1, rows, D)
    vit.build_model(ModelSettings(base=str(bases["swin"]), image_size=64), LABELS,
                    on_resample=lambda before, after: seen.append("swin"))
    assert "swin" not in seen
    # At the base's own size (a student cut at it, say) nothing moves: no "before and after" picture to draw.
    vit.build_model(ModelSettings(base=str(bases["clip"]), image_size=32), LABELS,
                    on_resample=lambda before, after: seen.append("unmoved"))
    vit.build_model(ModelSettings(base=str(bases["clip"]), image_size=32, keep_blocks=1), LABELS,
                    on_resample=lambda before, after: seen.append("unmoved student"))
    assert len(seen) == 1


def test_report_measured_differences():
    """Prints the invariant's measured differences (run with -s); runs last in this file."""
    for model_type, difference in MEASURED.items():
        print(f"invariant max abs diff {model_type}: {difference:.3g}")
    assert all(d <= 1e-5 for d in MEASURED.values())


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_layer_decay_gives_every_depth_its_lr_from_the_embeddings_to_the_head(model_type, bases):
    family = FAMILIES[model_type]
    built = vit.build_model(ModelSettings(base=str(bases[model_type]), image_size=64), LABELS)
    blocks = family.num_blocks(built.config)
    optimizer = build_optimizer(built, Recipe(train={"lr": 0.1, "head_lr": 0.1, "weight_decay": 0, "layer_decay": 0.5}),
                                "cpu")
    lr_of = {id(p): group["lr"] for group in optimizer.param_groups for p in group["params"]}
    lrs = {name: lr_of[id(p)] for name, p in built.named_parameters()}
    assert {lrs[n] for n in lrs if n.startswith(f"{family.head}.")} == {0.1}  # the head trains at the full lr
    embedding_lrs = [lrs[n] for n in lrs if ".embeddings." in n]
    assert embedding_lrs and embedding_lrs == pytest.approx([0.1 * 0.5 ** (blocks + 1)] * len(embedding_lrs))
    assert len({round(lr, 15) for lr in lrs.values()}) == blocks + 2  # embeddings, each block, what follows them


def test_drop_path_rate_reaches_the_built_model_of_a_family_that_has_one(bases):
    settings = ModelSettings(base=str(bases["dinov2"]), image_size=64, drop_path_rate=0.5, head_init="random")
    built = vit.build_model(settings, LABELS)
    assert built.config.drop_path_rate == 0.5
    pixels = torch.randn(2, 3, 64, 64)
    assert not torch.equal(built.train()(pixel_values=pixels).logits, built(pixel_values=pixels).logits)
    assert torch.equal(built.eval()(pixel_values=pixels).logits, built(pixel_values=pixels).logits)
