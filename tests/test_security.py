"""Security: the Hub token never leaks into anything written, checkpoints never unpickle code, recipes
never construct objects (tests/test_fuzz_recipes.py), and no model code from a repo runs unless asked.

There are no tracker integrations (wandb, TensorBoard...) to leak a token through: the run writes only
the output folder, stdout and stderr, and all three are searched.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch

from runs import RECIPE, killed_after_a_checkpoint, train

SECRET = "hf_SECRETtoken123456"



@pytest.mark.slow
def test_the_hub_token_appears_in_nothing_the_run_writes_or_prints(args, hub, hub_repo_id, tmp_path, monkeypatch,
                                                                    capfd, caplog):
    """In this process, the token in the environment as a user's shell gives it (huggingface_hub reads HF_TOKEN at
    each call); what is printed is read at the file descriptors, and every log record is kept."""
    hub.add_token(SECRET, "user")
    monkeypatch.setenv("HF_TOKEN", SECRET)
    out = tmp_path / "out"
    caplog.set_level("DEBUG")
    code = train([*args, f"output_dir={out}", "train.checkpoint_every_steps=4", "hub.push=true",
                  f"hub.repo_id={hub_repo_id}"])
    printed = capfd.readouterr()
    assert code == 0, printed.err[-3000:]
    assert hub.repo_files(hub_repo_id)  # the token was used: the push went through with it
    written = [p for p in out.rglob("*") if p.is_file()]
    assert {"recipe.yaml", "README.md", "model.safetensors"} <= {p.name for p in written}
    assert any(p.name == "optimizer.bin" for p in written)  # checkpoints are searched too
    needles = [SECRET.encode(), SECRET.encode("utf-16-le"), SECRET[3:].encode()]
    for path in written:
        content = path.read_bytes()
        assert not any(needle in content for needle in needles), path
    for name, content in hub.repo_files(hub_repo_id).items():
        assert SECRET.encode() not in content, name
    assert printed.out and SECRET not in printed.out and SECRET not in printed.err
    assert SECRET[3:] not in caplog.text


# ---------------------------------------------------------------- checkpoints load without running code


@pytest.fixture(scope="module")
def checkpointed(args, tmp_path_factory) -> Path:
    """A run killed at step 3 whose last checkpoint is step 2."""
    return killed_after_a_checkpoint(args, tmp_path_factory.mktemp("checkpointed") / "out")


@pytest.mark.slow
def test_resume_reads_weights_from_safetensors_and_every_other_file_with_weights_only(args, checkpointed, tmp_path):
    import shutil

    import safetensors.torch

    out = tmp_path / "out"
    shutil.copytree(checkpointed, out)
    files = sorted(p.name for p in (out / "checkpoints" / "step-00000002").iterdir())
    assert files == ["COMPLETE", "model.safetensors", "optimizer.bin", "random_states_0.pkl", "recipe.yaml",
                     "scheduler.bin", "trainer_state.json"]  # no custom_checkpoint_*.pkl: Accelerate unpickles those fully
    torch_loads, safetensors_loads = [], []
    original_load, original_load_file = torch.load, safetensors.torch.load_file

    def recording_load(f, *rest, **kwargs):
        torch_loads.append((Path(f).name, kwargs.get("weights_only")))
        return original_load(f, *rest, **kwargs)

    def recording_load_file(filename, *rest, **kwargs):
        safetensors_loads.append(Path(filename).name)
        return original_load_file(filename, *rest, **kwargs)

    assert train([*args, f"output_dir={out}", "train.checkpoint_every_steps=2", "train.resume=auto"],
                 patches=[(torch, "load", recording_load), (safetensors.torch, "load_file", recording_load_file)]) == 0
    assert {name for name, _ in torch_loads} == {"optimizer.bin", "scheduler.bin", "random_states_0.pkl"}
    assert all(weights_only is True for _, weights_only in torch_loads), torch_loads
    assert "model.safetensors" in safetensors_loads


class _Payload:
    """Unpickling this creates a file: the stand-in for an attacker's code in a planted checkpoint file."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return Path.touch, (self.marker,)


@pytest.mark.slow
@pytest.mark.parametrize("planted", ["random_states_0.pkl", "optimizer.bin", "scheduler.bin"])
def test_a_planted_pickle_in_a_checkpoint_is_refused_and_never_runs(args, checkpointed, tmp_path, capsys, planted):
    import shutil

    out, marker = tmp_path / "out", tmp_path / "payload-ran"
    shutil.copytree(checkpointed, out)
    evil = pickle.dumps({"state": _Payload(marker)}, protocol=2)
    pickle.loads(evil)  # the control: unpickled without weights_only, the payload runs
    assert marker.exists()
    marker.unlink()

    (out / "checkpoints" / "step-00000002" / planted).write_bytes(evil)
    assert train([*args, f"output_dir={out}", "train.resume=auto"]) == 1
    error = capsys.readouterr().err
    assert "Traceback" not in error and "cannot resume from" in error and "damaged or was not written" in error
    assert not marker.exists()


# ---------------------------------------------------------------- trust_remote_code


def remote_code_base(tiny: Path, folder: Path, marker: Path, model_type: str) -> Path:
    """A copy of the tiny ViT whose config.json maps AutoConfig to code in the folder that creates `marker`."""
    import shutil

    shutil.copytree(tiny, folder)
    (folder / "evil.py").write_text(
        f"from pathlib import Path\nPath({str(marker)!r}).touch()\n"
        "from transformers import ViTConfig\n\n\n"
        f"class EvilConfig(ViTConfig):\n    model_type = {model_type!r}\n"
    )
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type=model_type, auto_map={"AutoConfig": "evil.EvilConfig"})
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_code_shipped_with_a_base_model_never_runs_unless_the_recipe_trusts_it(base, images, tmp_path, capsys):
    from transformers import AutoConfig

    marker = tmp_path / "remote-code-ran"
    evil = remote_code_base(base, tmp_path / "evil-base", marker, "evil-vit")
    code = train([f"model.base={evil}", f"data.dataset={images}", *RECIPE, f"output_dir={tmp_path / 'out'}"])
    assert code == 1
    error = capsys.readouterr().err
    assert "Traceback" not in error and "trust_remote_code" in error
    assert not marker.exists()
    AutoConfig.from_pretrained(evil, trust_remote_code=True)  # the control: trusted, the folder's code runs
    assert marker.exists()


def test_every_loader_is_called_with_trust_remote_code_off_by_default(base, monkeypatch):
    import transformers

    from vit_finetune.model import loading as vit
    from vit_finetune.recipe import ModelSettings

    seen = []
    for cls in (transformers.AutoConfig, transformers.AutoImageProcessor, transformers.ViTForImageClassification):
        original = cls.from_pretrained.__func__

        def recording(owner, *rest, _original=original, _name=cls.__name__, **kwargs):
            seen.append((_name, kwargs.get("trust_remote_code", "missing")))
            return _original(owner, *rest, **kwargs)

        monkeypatch.setattr(cls, "from_pretrained", classmethod(recording))
    settings = ModelSettings(base=str(base), image_size=32)
    vit.load_base_config(settings)
    vit.build_model(settings, ["a", "b"])
    vit.load_image_processor(settings, 32)
    assert {name for name, _ in seen} == {"AutoConfig", "AutoImageProcessor", "ViTForImageClassification"}
    assert all(trust is False for _, trust in seen), seen
