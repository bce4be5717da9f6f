"""Data from the Hub is the repo's own: an image cell that holds a path on this machine (no bytes) is never read
from the user's disk, so it can neither train the model nor reach misclassified.png, which a push publishes.
Datasets the Hub serves as image files (datasets keeps them in its cache) and local datasets keep working."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from runs import RECIPE, train

SHORT = ["train.max_steps=2"]


def png(rgb: tuple[int, int, int]) -> bytes:
    """A noisy colour square: one flat colour would be refused as an image that teaches nothing."""
    encoded = io.BytesIO()
    noisy = np.clip(np.array(rgb) + np.random.default_rng(sum(rgb)).normal(0, 30, (24, 24, 3)), 0, 255)
    Image.fromarray(noisy.astype(np.uint8)).save(encoded, format="PNG")
    return encoded.getvalue()


def parquet_split(cells: list[dict], labels: list[int], path: Path) -> Path:
    """A split as datasets writes it (an Image and a ClassLabel feature), the cells exactly as given."""
    import datasets

    features = datasets.Features({"image": datasets.Image(decode=False),
                                  "label": datasets.ClassLabel(names=["blue", "red"])})
    datasets.Dataset.from_dict({"image": cells, "label": labels}, features=features).to_parquet(str(path))
    return path


@pytest.fixture
def hub_dataset_with_a_local_path(hub, tmp_path) -> tuple[str, Path]:
    """A Hub dataset whose row 3 of each split names a file on this machine (the user's) instead of holding bytes."""
    secret = tmp_path / "private" / "passport.png"
    secret.parent.mkdir()
    secret.write_bytes(png((250, 250, 250)))
    files = {}
    for split in ("train", "validation"):
        cells = [{"bytes": png((40, 60, 210) if i % 2 else (210, 40, 40)), "path": f"{i}.png"} for i in range(6)]
        cells[3] = {"bytes": None, "path": str(secret)}
        files[f"data/{split}-00000-of-00001.parquet"] = parquet_split(cells, [i % 2 for i in range(6)],
                                                                      tmp_path / f"{split}.parquet")
    hub.add_repo("user/local-path-cells", files, repo_type="dataset", exist_ok=True)
    return "user/local-path-cells", secret


def test_a_hub_image_cell_naming_a_local_file_stops_the_run_naming_the_row(base, hub_dataset_with_a_local_path,
                                                                           tmp_path, capsys):
    repo, secret = hub_dataset_with_a_local_path
    out = tmp_path / "out"
    assert train([f"model.base={base}", f"data.dataset={repo}", *RECIPE, *SHORT, f"output_dir={out}"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert "row 3 of split 'train'" in err and "passport.png" in err and "holds no image bytes" in err, err[-2000:]
    assert "data.skip_bad_images=true" in err and "Loading weights" not in err  # refused before the model loads
    assert not (out / "metrics.json").exists() and not (out / "misclassified.png").exists()


def test_with_skip_bad_images_such_cells_are_skipped_and_counted(base, hub_dataset_with_a_local_path, tmp_path):
    repo, _secret = hub_dataset_with_a_local_path
    out = tmp_path / "out"
    # batch 4 over 6 train rows: the two steps draw all six, row 3 among them, once
    assert train([f"model.base={base}", f"data.dataset={repo}", *RECIPE, *SHORT, f"output_dir={out}",
                  "data.skip_bad_images=true"]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["skipped_images"] == 1
    assert metrics["eval_samples"] == 5  # the validation split's row 3 is left out of the metrics too


def test_a_hub_dataset_of_image_files_still_trains(base, images, hub, tmp_path):
    """The Hub serves these as files: datasets downloads them into its cache and gives their paths, which are read."""
    files = {str(path.relative_to(images)): path for path in images.rglob("*.png")}
    hub.add_repo("user/colour-files", files, repo_type="dataset", exist_ok=True)
    out = tmp_path / "out"
    assert train([f"model.base={base}", "data.dataset=user/colour-files", *RECIPE, *SHORT, f"output_dir={out}"]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["skipped_images"] == 0 and metrics["eval_samples"] == 9


def test_a_local_dataset_may_name_files_by_path(base, tmp_path):
    """A dataset the user saved on their own disk may point at their own files."""
    import datasets

    picture = tmp_path / "mine.png"
    picture.write_bytes(png((210, 40, 40)))
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=["blue", "red"])})
    rows = {"image": [str(picture) if i % 2 else {"bytes": png((40, 60, 210)), "path": None} for i in range(8)],
            "label": [i % 2 for i in range(8)]}
    saved = tmp_path / "saved"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(rows, features=features),
                          "validation": datasets.Dataset.from_dict(rows, features=features)}).save_to_disk(str(saved))
    out = tmp_path / "out"
    assert train([f"model.base={base}", f"data.dataset={saved}", *RECIPE, *SHORT, f"output_dir={out}"]) == 0
    assert json.loads((out / "metrics.json").read_text())["skipped_images"] == 0


def test_a_streamed_hub_image_cell_naming_a_local_file_is_never_read(base, hub_dataset_with_a_local_path, tmp_path,
                                                                      capsys):
    from test_streaming import RECIPE as STREAMED

    repo, secret = hub_dataset_with_a_local_path
    out = tmp_path / "out"
    assert train([f"model.base={base}", f"data.dataset={repo}", *STREAMED, "train.max_steps=2",
                  f"output_dir={out}"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and "holds no image bytes" in err and "passport.png" in err, err[-2000:]
    assert not (out / "metrics.json").exists()
    assert train([f"model.base={base}", f"data.dataset={repo}", *STREAMED, "train.max_steps=2", f"output_dir={out}",
                  "data.skip_bad_images=true", "overwrite=true"]) == 0
    assert json.loads((out / "metrics.json").read_text())["skipped_images"] >= 1


def test_predict_over_a_hub_dataset_never_reads_a_cell_naming_a_local_file(base, hub_dataset_with_a_local_path,
                                                                            tmp_path):
    """predict --dataset reads the same cells as training: the row naming a local file gets an error, not a label."""
    from vit_finetune.cli import main

    repo, _secret = hub_dataset_with_a_local_path
    out = tmp_path / "preds.jsonl"
    assert main(["predict", str(base), "--dataset", repo, "--split", "validation", "--output", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 6
    refused = [row for row in rows if "passport.png" in row["image"]]
    assert len(refused) == 1 and "holds no image bytes" in (refused[0]["error"] or ""), refused
    assert refused[0]["predictions"] == []
    assert all(row["error"] is None and row["predictions"] for row in rows if row is not refused[0])


def test_evaluate_over_a_hub_dataset_never_reads_a_cell_naming_a_local_file(hub_dataset_with_a_local_path, tmp_path,
                                                                             capsys):
    """evaluate --dataset reads the same cells as training: the row naming a local file is never decoded, so it
    reaches neither the metrics nor misclassified.png (which a push would publish)."""
    from tiny import make_tiny_vit
    from vit_finetune.cli import main

    repo, _secret = hub_dataset_with_a_local_path
    model = make_tiny_vit(tmp_path / "blue-red", num_labels=2)
    config = json.loads((model / "config.json").read_text())
    config.update(id2label={"0": "blue", "1": "red"}, label2id={"blue": 0, "red": 1})
    (model / "config.json").write_text(json.dumps(config))
    out = tmp_path / "eval"
    assert main(["evaluate", str(model), "--dataset", repo, "--split", "validation", "--output-dir", str(out)]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    error = next(line for line in reversed(err.splitlines()) if line.startswith("error: "))
    assert "#3" in error and "passport.png" in error and "holds no image bytes" in error, error
    assert not (out / "misclassified.png").exists() and not (out / "metrics.json").exists()
