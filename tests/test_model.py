"""Position-embedding resampling, the new head, save/reload, label maps and LoRA targets (merging: test_families)."""

from __future__ import annotations

import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import ViTConfig, ViTForImageClassification, ViTModel

from tiny import make_tiny_vit
from vit_finetune.model import loading as vit, lora
from vit_finetune.model.families import FAMILIES
from vit_finetune.recipe import ModelSettings

LABELS = ["cat", "dog", "fox", "owl", "yak", "emu"]
VIT = FAMILIES["vit"]


@pytest.fixture(scope="module")
def tiny_base(tmp_path_factory):
    return make_tiny_vit(tmp_path_factory.mktemp("base"))


def test_resampling_to_the_same_grid_is_an_exact_identity():
    embeddings = torch.randn(1, 1 + 14 * 14, 16)
    assert torch.equal(vit.resample_position_embeddings(embeddings, (14, 14)), embeddings)


@pytest.mark.parametrize("old, new", [(8, 16), (14, 24), (7, 10)])
def test_resampling_matches_transformers_interpolate_pos_encoding(old, new):
    config = ViTConfig(hidden_size=24, num_attention_heads=2, image_size=old * 4, patch_size=4)
    embeddings = ViTModel(config).embeddings
    with torch.no_grad():
        embeddings.position_embeddings.normal_()
    expected = embeddings.interpolate_pos_encoding(torch.zeros(1, 1 + new * new, 24), new * 4, new * 4)
    resampled = vit.resample_position_embeddings(embeddings.position_embeddings, (new, new))
    assert resampled.shape == (1, 1 + new * new, 24)
    assert torch.allclose(resampled, expected, atol=1e-6, rtol=0)


def test_cls_embedding_is_kept_aside_and_untouched():
    embeddings = torch.randn(1, 1 + 8 * 8, 12)
    embeddings[0, 0] = 1000.0  # a huge CLS value would bleed into neighbours if it were part of the grid
    resampled = vit.resample_position_embeddings(embeddings, (12, 12))
    assert torch.equal(resampled[0, 0], embeddings[0, 0])
    assert resampled[0, 1:].abs().max() < 100


def test_shrinking_antialiases():
    embeddings = torch.randn(1, 1 + 16 * 16, 4)
    grid = embeddings[:, 1:].reshape(1, 16, 16, 4).permute(0, 3, 1, 2)
    antialiased = torch.nn.functional.interpolate(grid, size=(8, 8), mode="bicubic", antialias=True)
    expected = antialiased.permute(0, 2, 3, 1).reshape(1, 64, 4)
    assert torch.allclose(vit.resample_position_embeddings(embeddings, (8, 8))[:, 1:], expected, atol=1e-6)


def test_vit_b16_config_at_384_gets_577_by_768_positions():
    # google/vit-base-patch16-224's embeddings (patch 16, width 768); one encoder layer of its twelve, which hold
    # no position embedding and would only add CPU time
    base = ViTModel(ViTConfig(num_hidden_layers=1), add_pooling_layer=False)
    assert base.embeddings.position_embeddings.shape == (1, 197, 768)
    resampled = vit.resample_position_embeddings(base.embeddings.position_embeddings, (24, 24))
    assert resampled.shape == (1, 577, 768)
    target = ViTModel(ViTConfig(image_size=384, num_hidden_layers=1), add_pooling_layer=False)
    target.embeddings.position_embeddings.data.copy_(resampled)
    assert target(torch.randn(1, 3, 384, 384)).last_hidden_state.shape == (1, 577, 768)


def test_build_model_keeps_every_pretrained_tensor_and_resamples_positions(tiny_base):
    settings = ModelSettings(base=str(tiny_base), image_size=64)
    pretrained = ViTForImageClassification.from_pretrained(tiny_base)
    built = vit.build_model(settings, LABELS)
    assert built.config.image_size == 64
    assert built.config.id2label == dict(enumerate(LABELS))
    for name, tensor in pretrained.state_dict().items():
        if name.startswith("classifier"):
            continue
        if name.endswith("position_embeddings"):
            expected = vit.resample_position_embeddings(tensor, (16, 16))
            assert torch.equal(built.state_dict()[name], expected)
        else:
            assert torch.equal(built.state_dict()[name], tensor), name
    assert built.classifier.weight.shape == (len(LABELS), 32)
    assert built.classifier.weight.abs().sum() == 0  # zero-initialised head
    # It runs at the new size with no interpolation flag.
    assert built(torch.randn(2, 3, 64, 64)).logits.shape == (2, len(LABELS))


def test_saved_model_reloads_with_no_mismatch_and_identical_predictions(tiny_base, tmp_path):
    built = vit.build_model(ModelSettings(base=str(tiny_base), image_size=48, head_init="random"), LABELS).eval()
    built.save_pretrained(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        reloaded, info = ViTForImageClassification.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert reloaded.config.id2label == {i: label for i, label in enumerate(LABELS)}
    assert reloaded.config.label2id == {label: i for i, label in enumerate(LABELS)}
    pixels = torch.randn(3, 3, 48, 48)
    with torch.no_grad():
        assert torch.equal(reloaded.eval()(pixels).logits, built(pixels).logits)


def test_a_checkpoint_missing_a_backbone_tensor_fails_loudly(tiny_base, tmp_path):
    broken = tmp_path / "broken"
    make_tiny_vit(broken)
    weights = load_file(broken / "model.safetensors")
    victim = next(k for k in weights if "layernorm_before.weight" in k)
    del weights[victim]
    save_file(weights, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(vit.ModelError, match="re-initialised"):
        vit.build_model(ModelSettings(base=str(broken), image_size=32), LABELS)


def test_a_base_folder_without_weights_is_a_model_error_naming_the_folder_and_the_fix(tmp_path):
    weightless = tmp_path / "weightless"
    make_tiny_vit(weightless)
    (weightless / "model.safetensors").unlink()  # config.json alone, as a half-copied folder leaves it
    with pytest.raises(vit.ModelError, match=r"(?s)model.base='.*weightless': its weights could not be loaded.*"
                                             r"Fix: a folder needs model.safetensors"):
        vit.build_model(ModelSettings(base=str(weightless), image_size=32), LABELS)


def test_image_size_must_be_a_multiple_of_the_patch_size(tiny_base):
    with pytest.raises(vit.ModelError, match=r"model.image_size=30 is not a multiple of the patch size 4; use 28 or 32"):
        vit.load_base_config(ModelSettings(base=str(tiny_base), image_size=30))


def test_lora_targets_by_role_on_transformers_5_names(tiny_base):
    built = vit.build_model(ModelSettings(base=str(tiny_base), image_size=32), LABELS)
    assert lora.lora_target_modules(built, ["query", "value"], VIT) == [
        "vit.layers.0.attention.q_proj", "vit.layers.0.attention.v_proj",
        "vit.layers.1.attention.q_proj", "vit.layers.1.attention.v_proj",
    ]
    assert lora.lora_target_modules(built, ["mlp_out"], VIT) == ["vit.layers.0.mlp.fc2", "vit.layers.1.mlp.fc2"]


class _Old4xLayer(nn.Module):
    """transformers 4.x ViTLayer naming. 4.x cannot be installed beside 5.x, so its module tree is rebuilt here."""

    def __init__(self):
        super().__init__()
        self.attention = nn.Module()
        self.attention.attention = nn.Module()
        for name in ("query", "key", "value"):
            setattr(self.attention.attention, name, nn.Linear(4, 4))
        self.attention.output = nn.Module()
        self.attention.output.dense = nn.Linear(4, 4)
        self.intermediate = nn.Module()
        self.intermediate.dense = nn.Linear(4, 8)
        self.output = nn.Module()
        self.output.dense = nn.Linear(8, 4)


def test_lora_targets_by_role_on_transformers_4_names():
    old = nn.Module()
    old.vit = nn.Module()
    old.vit.encoder = nn.Module()
    old.vit.encoder.layer = nn.ModuleList([_Old4xLayer(), _Old4xLayer()])
    old.classifier = nn.Linear(4, 3)
    assert lora.lora_target_modules(old, ["query", "value"], VIT) == [
        "vit.encoder.layer.0.attention.attention.query", "vit.encoder.layer.0.attention.attention.value",
        "vit.encoder.layer.1.attention.attention.query", "vit.encoder.layer.1.attention.attention.value",
    ]
    # mlp_out must not catch the attention output projection, which also ends in output.dense
    assert lora.lora_target_modules(old, ["mlp_out"], VIT) == ["vit.encoder.layer.0.output.dense",
                                                        "vit.encoder.layer.1.output.dense"]
    assert lora.lora_target_modules(old, ["attention_output"], VIT) == [
        "vit.encoder.layer.0.attention.output.dense", "vit.encoder.layer.1.attention.output.dense"]


def test_pretrained_false_gives_the_same_architecture_from_random_weights(tiny_base):
    pretrained = vit.build_model(ModelSettings(base=str(tiny_base), image_size=64), LABELS)
    scratch = vit.build_model(ModelSettings(base=str(tiny_base), image_size=64, pretrained=False), LABELS)
    assert scratch.config.to_dict() == pretrained.config.to_dict()
    name = "vit.layers.0.attention.q_proj.weight"
    assert not torch.equal(scratch.state_dict()[name], pretrained.state_dict()[name])


def test_the_image_processor_is_chosen_by_name_quietly_and_saved_under_that_name(tiny_base, tmp_path):
    """Without torchvision, transformers 5 falls back to the PIL processors with a warning (once per process: its
    once-only cache is emptied first, so this process warns as a fresh one would); both a base with a
    preprocessor_config.json and one without get the PIL class."""
    import json
    import logging
    import shutil

    from transformers.utils import logging as transformers_logging

    from vit_finetune.artifacts.final_outputs import save_image_processor

    class Kept(logging.Handler):
        records: list[str] = []

        def emit(self, record):
            self.records.append(record.getMessage())

    bare = tmp_path / "bare"  # config and weights only: the family's default processor
    bare.mkdir()
    shutil.copy(tiny_base / "config.json", bare / "config.json")
    library = logging.getLogger("transformers")
    kept, level = Kept(), library.level
    library.addHandler(kept)
    library.setLevel(logging.WARNING)  # what a fresh process has: another test's run may have quietened it
    transformers_logging.warning_once.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            names = []
            for base, out in ((tiny_base, tmp_path / "a"), (bare, tmp_path / "b")):
                processor = vit.load_image_processor(ModelSettings(base=str(base), image_size=48), 48)
                save_image_processor(processor, out)
                names.append(type(processor).__name__)
    finally:
        library.removeHandler(kept)
        library.setLevel(level)
    assert names == ["ViTImageProcessorPil", "ViTImageProcessorPil"]
    said = [*kept.records, *(str(w.message) for w in warned)]
    assert not [line for line in said if "torchvision" in line or "falling back" in line.lower()], said
    for out in ("a", "b"):
        saved = json.loads((tmp_path / out / "preprocessor_config.json").read_text())
        assert saved["image_processor_type"] == "ViTImageProcessorPil" and saved["size"] == {"height": 48, "width": 48}
    assert json.loads((tmp_path / "b" / "preprocessor_config.json").read_text())["image_mean"] == [0.5] * 3
