"""What a streamed resume's fast-forward costs next to training's own reading: rows/s read from local parquet shards
without decoding (the fast-forward, vit_finetune.data.streaming.StreamReader) against rows/s read, decoded and cropped to
the training size (what DataLoader workers do per row), on one core.

    python scripts/stream_resume_cost.py [--rows 2000] [--side 500] [--size 384] [--folder /tmp/stream-cost]

The shards hold synthetic JPEG photos (smooth colour fields with noise, quality 90) of side x side px.
"""

from __future__ import annotations

import argparse
import io
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's vit_finetune


def write_shards(folder: Path, rows: int, side: int, shards: int = 8) -> None:
    import datasets

    rng = np.random.default_rng(0)
    grid = np.linspace(0, 1, side)[None, :, None]
    images = []
    for _ in range(rows):
        base = rng.uniform(0, 255, 3) * grid + rng.uniform(0, 255, 3) * grid.transpose(1, 0, 2)
        pixels = np.clip(base / 2 + rng.normal(0, 20, (side, side, 3)), 0, 255).astype(np.uint8)
        encoded = io.BytesIO()
        Image.fromarray(pixels).save(encoded, format="JPEG", quality=90)
        images.append({"bytes": encoded.getvalue(), "path": None})
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=["a", "b"])})
    table = datasets.Dataset.from_dict({"image": images, "label": [i % 2 for i in range(rows)]}, features=features)
    folder.mkdir(parents=True, exist_ok=True)
    for split, count in (("train", shards), ("validation", 1)):
        for index in range(count):
            table.shard(count, index, contiguous=True).to_parquet(str(folder / f"{split}-{index:05d}-of-{count:05d}.parquet"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2000)
    parser.add_argument("--side", type=int, default=500)
    parser.add_argument("--size", type=int, default=384)
    parser.add_argument("--folder", type=Path, default=Path("/tmp/stream-cost"))
    options = parser.parse_args()
    import torch

    from vit_finetune import data
    from vit_finetune.data import streaming
    from vit_finetune.recipe import DataSettings

    torch.set_num_threads(1)
    if not any(options.folder.glob("train-*.parquet")):
        write_shards(options.folder, options.rows, options.side)
    settings = DataSettings(dataset=str(options.folder), streaming=True, crop_scale=(0.05, 1.0))
    splits = streaming.open_streams(settings, rank=0, processes=1)
    reader = streaming.StreamReader(splits.train, (0, 1000))
    reader.count = splits.train_rows

    started = time.perf_counter()
    rows = [row for row, _pass, _offset in reader]
    read = time.perf_counter() - started
    started = time.perf_counter()
    for index, row in enumerate(rows):
        image = data.decode_image(row["image"], index, settings)
        data.train_transform(image, options.size, data.sample_rng(0, 0, index), settings)
    decoded = time.perf_counter() - started
    megabytes = sum(len(row["image"]["bytes"]) for row in rows) / 1e6
    print(f"{len(rows)} rows, {megabytes:.0f} MB of JPEG ({options.side}x{options.side} px)")
    print(f"fast-forward (read, shuffle buffer, no decode): {len(rows) / read:,.0f} rows/s")
    print(f"decode + crop to {options.size} px (one core):      {len(rows) / decoded:,.0f} rows/s "
          f"(read time added: {len(rows) / (read + decoded):,.0f} rows/s)")


if __name__ == "__main__":
    main()
