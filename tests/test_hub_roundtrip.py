"""Download the base by its real id, load a Hub dataset, fine-tune, push, and reload, over the loopback Hub.

Everything here talks HTTP to tests/hub_server/ through the unmodified huggingface_hub, transformers,
datasets and peft clients (HF_ENDPOINT is set by conftest.py).
"""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import load_file

from runs import warm_launch_command
from tiny import COLOURS, colour_image, make_tiny_vit, run_cli
from vit_finetune.artifacts import publish
from vit_finetune.cli import main
from vit_finetune.model.loading import resample_position_embeddings

BASE_ID = "google/vit-base-patch16-224"
DATASET_ID = "user/colour-shapes"
CLASSES = ["red", "green", "blue"]
ARGS = ["model.image_size=64", "train.epochs=3", "train.batch_size=8", "train.lr=0.005", "train.seed=1"]


def parquet_split(count: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    labels = [i % len(CLASSES) for i in range(count)]
    table = datasets.Dataset.from_dict(
        {"image": [colour_image(COLOURS[CLASSES[label]], rng) for label in labels], "label": labels},
        features=datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=CLASSES)}),
    )
    buffer = io.BytesIO()
    table.to_parquet(buffer)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def seeded_hub(hub_server, tmp_path_factory):
    """The Hub holds a tiny ViT under the real base id (1000 labels, 4.x key names) and a parquet dataset."""
    base = make_tiny_vit(tmp_path_factory.mktemp("google-base"), num_labels=1000)
    if not hub_server.repo_exists(BASE_ID):
        hub_server.add_repo(BASE_ID, {p.name: p for p in base.iterdir()})
        hub_server.add_repo(DATASET_ID, {"data/train-00000-of-00001.parquet": parquet_split(48, 0),
                                         "data/validation-00000-of-00001.parquet": parquet_split(18, 1)},
                            repo_type="dataset")
    return hub_server


@pytest.fixture(autouse=True)
def _no_faults_left_behind(hub_server):
    yield
    hub_server.clear_faults()


def snapshot(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def pushed(seeded_hub, tmp_path_factory):
    """One full run with the unmodified base id and a Hub dataset id, pushed privately."""
    from conftest import HUB_TOKEN

    output = tmp_path_factory.mktemp("pushed") / "out"
    repo_id = "user/vit-colours-64"
    seeded_hub.clear_log()
    cold_cache = tmp_path_factory.mktemp("hf-home")  # so the request log is that of a first run
    result = run_cli(f"model.base={BASE_ID}", f"data.dataset={DATASET_ID}", f"output_dir={output}", *ARGS,
                     "hub.push=true", f"hub.repo_id={repo_id}", "hub.private=true",
                     env={"HF_TOKEN": HUB_TOKEN, "HF_HOME": str(cold_cache)})
    assert result.returncode == 0, result.stderr[-3000:]
    return {"output": output, "repo_id": repo_id, "log": list(seeded_hub.request_log), "stdout": result.stdout}


def hub_traffic(log, repo_id: str) -> list[tuple[str, str]]:
    """(method, path) of every request in a stable order, with what legitimately differs between two runs
    (the pushed repo's name, content hashes of the trained weights, signed query strings) replaced."""
    import re

    def normalise(path: str) -> str:
        path = path.replace(repo_id, "<pushed>").split("?")[0]
        return re.sub(r"[0-9a-f]{40,64}", "<hash>", path)

    # LFS uploads are left out: the server keeps blobs by content, so a file identical to one pushed before (the
    # deterministic position-embedding picture of the same base) is not uploaded again.
    return sorted((r.method, normalise(r.path)) for r in log if not r.path.startswith("/lfs-upload/"))


@pytest.mark.slow
def test_only_the_main_process_talks_to_the_hub_in_a_two_process_run(pushed, seeded_hub, tmp_path):
    import os
    import subprocess
    import sys

    from conftest import HUB_TOKEN
    from tiny import REPO

    repo_id = "user/vit-colours-64-ddp"
    seeded_hub.clear_log()
    seeded_hub.identify_clients = True  # each request's sender, by its socket
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_TOKEN": HUB_TOKEN, "HF_HOME": str(tmp_path / "hf-home")}
    # The ranks forked warm (tests/warm_launch.py): what they share from before the fork (transformers' session id)
    # cannot tell them apart, their sockets can.
    result = subprocess.run(
        [*warm_launch_command(), "-m", "vit_finetune",
         f"model.base={BASE_ID}", f"data.dataset={DATASET_ID}", f"output_dir={tmp_path / 'out'}", *ARGS,
         "hub.push=true", f"hub.repo_id={repo_id}", "hub.private=true"],
        capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    seeded_hub.identify_clients = False
    two_process = list(seeded_hub.request_log)
    senders = {r.client_pid for r in two_process}
    assert len(senders) == 1 and None not in senders and os.getpid() not in senders  # one process of the run
    # And the whole conversation (datasets' requests included) is exactly that of a one-process run.
    assert hub_traffic(two_process, repo_id) == hub_traffic(pushed["log"], pushed["repo_id"])
    assert len(seeded_hub.commits(repo_id)) == 2


def test_the_base_is_downloaded_by_its_real_id_and_resampled(pushed, seeded_hub):
    paths = [r.path for r in pushed["log"]]
    assert any(f"/{BASE_ID}/resolve/" in p and p.endswith("model.safetensors") for p in paths)
    assert any(f"/datasets/{DATASET_ID}/resolve/" in p and p.endswith(".parquet") for p in paths)
    base_weights = load_safetensors_bytes(seeded_hub.repo_files(BASE_ID)["model.safetensors"])
    assert "vit.encoder.layer.0.attention.attention.query.weight" in base_weights  # the Hub's 4.x key names
    trained = load_file(pushed["output"] / "model.safetensors")
    assert trained["vit.embeddings.position_embeddings"].shape == (1, 1 + 16 * 16, 32)
    # Full fine-tuning moved them, but they started from the resampled grid, not a re-initialisation.
    start = resample_position_embeddings(base_weights["vit.embeddings.position_embeddings"], (16, 16))
    correlation = torch.corrcoef(torch.stack([start.flatten(), trained["vit.embeddings.position_embeddings"].flatten()]))
    assert correlation[0, 1] > 0.9


def load_safetensors_bytes(data: bytes) -> dict:
    from safetensors.torch import load

    return load(data)


def test_push_is_one_private_commit_with_everything(pushed, seeded_hub):
    repo_id = pushed["repo_id"]
    assert seeded_hub.is_private(repo_id)
    commits = seeded_hub.commits(repo_id)
    assert len(commits) == 2  # the repo's initial .gitattributes commit, then exactly one upload
    files = seeded_hub.repo_files(repo_id)
    assert {"model.safetensors", "config.json", "preprocessor_config.json", "README.md", "training_curves.png",
            "recipe.yaml", "metrics.json"} <= set(files)
    assert not any(name.startswith(("checkpoints/", ".")) and name != ".gitattributes" for name in files)
    config = json.loads(files["config.json"])
    assert config["image_size"] == 64 and config["id2label"] == {"0": "red", "1": "green", "2": "blue"}
    assert json.loads(files["preprocessor_config.json"])["size"] == {"height": 64, "width": 64}
    for name in ("model.safetensors", "metrics.json", "README.md"):
        assert files[name] == (pushed["output"] / name).read_bytes()


def test_model_card_metadata_passes_hub_validation(pushed, seeded_hub):
    from huggingface_hub import ModelCard

    text = seeded_hub.repo_files(pushed["repo_id"])["README.md"].decode()
    card = ModelCard(text)
    card.validate()  # POST /api/validate-yaml on the loopback Hub, as push does
    metadata = yaml.safe_load(text.split("---")[1])
    assert metadata["base_model"] == BASE_ID and metadata["datasets"] == [DATASET_ID]
    results = metadata["model-index"][0]["results"]
    reported = json.loads((pushed["output"] / "metrics.json").read_text())
    values = {m["type"]: m["value"] for r in results for m in r["metrics"]}
    assert values["accuracy"] == pytest.approx(reported["accuracy"], abs=1e-6)
    assert "training_curves.png" in text


def test_pipeline_from_the_hub_reproduces_the_reported_accuracy(pushed, seeded_hub):
    from conftest import HUB_TOKEN
    from transformers import pipeline

    classify = pipeline("image-classification", model=pushed["repo_id"], token=HUB_TOKEN, device=-1)
    validation = datasets.load_dataset(DATASET_ID, split="validation")
    names = validation.features["label"].names
    predictions = [classify(row["image"], top_k=1)[0]["label"] for row in validation]
    accuracy = np.mean([p == names[row["label"]] for p, row in zip(predictions, validation)])
    reported = json.loads((pushed["output"] / "metrics.json").read_text())["accuracy"]
    assert accuracy == reported  # exactly: same processor, same resolution, no interpolation flag
    assert reported >= 0.9


def test_a_local_dataset_or_base_never_reaches_the_card_metadata(tmp_path):
    from vit_finetune.artifacts.card import model_card
    from vit_finetune.recipe import load_recipe

    recipe = load_recipe(None, [f"data.dataset={tmp_path}", "model.base=./my-vit"])
    card = model_card(recipe, {"accuracy": 0.5, "eval_samples": 2}, ["a", "b"], "x", lora=False)
    assert card.data.base_model is None and card.data.datasets is None
    assert str(tmp_path) not in str(card.data.to_dict())


def test_push_later_and_lora_layout(seeded_hub, tmp_path, monkeypatch, capsys):
    """A LoRA run without push, then `python -m vit_finetune push`: merged model at the root, adapter in adapter/."""
    from conftest import HUB_TOKEN
    from peft import PeftModel
    from transformers import ViTForImageClassification

    from vit_finetune.model.loading import build_model
    from vit_finetune.recipe import ModelSettings

    output = tmp_path / "lora"
    assert main([f"model.base={BASE_ID}", f"data.dataset={DATASET_ID}", f"output_dir={output}", *ARGS,
                 "train.epochs=1", "model.lora={r: 4, alpha: 8, dropout: 0.0}"]) == 0, capsys.readouterr().err[-3000:]
    repo_id = "user/vit-colours-lora"
    local_card = (output / "README.md").read_text()
    assert f'model="{output}")' in local_card  # trained without hub.push: the card loads the folder
    monkeypatch.setenv("HF_TOKEN", HUB_TOKEN)
    assert main(["push", str(output), "--repo-id", repo_id]) == 0, capsys.readouterr().err[-3000:]
    files = seeded_hub.repo_files(repo_id)
    # the pushed card's usage snippet loads the repo it was pushed to; the local card is left as it was
    assert files["README.md"].decode() == local_card.replace(f'model="{output}")', f'model="{repo_id}")')
    assert (output / "README.md").read_text() == local_card
    assert {"model.safetensors", "adapter/adapter_model.safetensors", "adapter/adapter_config.json"} <= set(files)
    merged = ViTForImageClassification.from_pretrained(repo_id, token=HUB_TOKEN).eval()
    base = build_model(ModelSettings(base=BASE_ID, image_size=64), CLASSES)
    adapter = PeftModel.from_pretrained(base, repo_id, subfolder="adapter", token=HUB_TOKEN).eval()
    pixels = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        assert (merged(pixels).logits - adapter(pixel_values=pixels).logits).abs().max() <= 1e-5


def test_no_token_is_reported_before_anything_is_downloaded(seeded_hub, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    seeded_hub.clear_log()
    code = main([f"model.base={BASE_ID}", f"data.dataset={DATASET_ID}", f"output_dir={tmp_path / 'o'}", *ARGS,
                 "hub.push=true", "hub.repo_id=user/never"])
    error = capsys.readouterr().err
    assert code == 1
    assert "no Hugging Face token" in error and "HF_TOKEN" in error
    assert "Traceback" not in error
    assert not seeded_hub.requests() and not (tmp_path / "o").exists()


def test_push_survives_two_503s_on_the_commit(pushed, seeded_hub, monkeypatch, capsys):
    from conftest import HUB_TOKEN

    monkeypatch.setenv("HF_TOKEN", HUB_TOKEN)
    monkeypatch.setattr(publish, "RETRY_DELAYS", (0.01,) * 4)  # the real back-off sleeps 3 s before the third try
    seeded_hub.clear_log()
    seeded_hub.inject_faults(status=503, times=2, path_regex=r"/commit/")
    assert main(["push", str(pushed["output"]), "--repo-id", "user/after-503"]) == 0, capsys.readouterr().err[-3000:]
    assert "push attempt 2 of 5 failed" in capsys.readouterr().out
    statuses = [r.status for r in seeded_hub.requests(method="POST", path_regex=r"/commit/")]
    assert statuses == [503, 503, 200]
    assert seeded_hub.repo_files("user/after-503")["model.safetensors"] == (pushed["output"] / "model.safetensors").read_bytes()


def test_a_hub_that_always_fails_leaves_the_folder_untouched_and_says_how_to_push_later(
        pushed, seeded_hub, monkeypatch, capsys):
    from conftest import HUB_TOKEN

    monkeypatch.setenv("HF_TOKEN", HUB_TOKEN)
    monkeypatch.setattr(publish, "RETRY_DELAYS", (0.01,) * 4)  # the real back-off sleeps 15 s in all
    before = snapshot(pushed["output"])
    seeded_hub.clear_log()
    seeded_hub.inject_faults(status=500, times=None, path_regex=r"/commit/")
    assert main(["push", str(pushed["output"]), "--repo-id", "user/always-500"]) == 1
    error = capsys.readouterr().err
    assert f"The model is safe in {pushed['output']}" in error
    assert f"python -m vit_finetune push {pushed['output']} --repo-id user/always-500" in error
    assert snapshot(pushed["output"]) == before
    assert len(seeded_hub.requests(method="POST", path_regex=r"/commit/")) == 5


def test_a_failed_push_after_training_keeps_the_trained_model(seeded_hub, monkeypatch, capsys, tmp_path):
    from conftest import HUB_TOKEN

    monkeypatch.setenv("HF_TOKEN", HUB_TOKEN)
    monkeypatch.setattr(publish, "RETRY_DELAYS", (0.01,))
    seeded_hub.clear_faults()
    seeded_hub.inject_faults(status=500, times=None, path_regex=r"/commit/")
    output = tmp_path / "kept"
    code = main([f"model.base={BASE_ID}", f"data.dataset={DATASET_ID}", f"output_dir={output}", *ARGS,
                 "train.epochs=1", "hub.push=true", "hub.repo_id=user/train-then-500"])
    assert code == 1
    assert f"The model is safe in {output}" in capsys.readouterr().err
    assert json.loads((output / "metrics.json").read_text())["accuracy"] >= 0  # the finished run is all there
    assert (output / "model.safetensors").is_file()


def test_pushing_the_same_folder_twice_gives_a_clean_repo(pushed, seeded_hub, monkeypatch, capsys):
    from conftest import HUB_TOKEN

    monkeypatch.setenv("HF_TOKEN", HUB_TOKEN)
    seeded_hub.clear_faults()
    from transformers import ViTForImageClassification

    for _ in range(2):
        assert main(["push", str(pushed["output"]), "--repo-id", "user/twice"]) == 0, capsys.readouterr().err[-2000:]
    files = seeded_hub.repo_files("user/twice")
    local = {name: (pushed["output"] / name).read_bytes() for name in files if name not in (".gitattributes", "README.md")}
    assert all(files[name] == data for name, data in local.items())
    assert 'pipeline("image-classification", model="user/twice")' in files["README.md"].decode()
    assert len(seeded_hub.commits("user/twice")) in (2, 3)  # initial + first push (+ an identical second)
    ViTForImageClassification.from_pretrained("user/twice", token=HUB_TOKEN)
