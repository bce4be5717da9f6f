"""A dataset found and opened: a Hub id, a saved dataset, a label file, an image folder or the demo's shapes; where
a path-only image cell may be read from, and the folder layouts datasets would misread refused.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from vit_finetune.core import hub
from vit_finetune.core.errors import DataError, VitFinetuneError, excerpt, problems_of
from vit_finetune.core.layout import CARD_FILE, REPO_ID_PATTERN
from vit_finetune.data import labels
from vit_finetune.data.synthetic import ensure_demo_dataset
from vit_finetune.recipe import DataSettings


BUILTIN_SHAPES = "builtin:shapes"  # the demo's dataset, generated deterministically on first use


def cache_dir() -> Path:
    return Path(os.environ.get("VIT_FINETUNE_CACHE", Path.home() / ".cache" / "vit_finetune"))


def preflight(settings: DataSettings) -> list[VitFinetuneError]:
    """The data's problems before any download: a dataset that is neither on this disk nor fetchable."""
    return problems_of(lambda: refuse_unreachable(settings))


def refuse_unreachable(settings: DataSettings) -> None:
    """A dataset that is neither on this disk nor fetchable from the Hub stops here, the Hub asked once (or, under the
    user's HF_HUB_OFFLINE, datasets' cache), with the absolute path looked at and the offline fix (an existing folder
    or file is not asked)."""
    name = settings.dataset
    if name.startswith(BUILTIN_SHAPES) or Path(name).expanduser().exists():
        return
    could_be_hub_id = not name.startswith((".", "/", "~")) and bool(REPO_ID_PATTERN.match(name))
    problem = hub.missing_source_problem(name, "dataset", could_be_hub_id)
    if problem:
        raise DataError(f"data.dataset={name!r}: {problem}")
    if could_be_hub_id and hub.offline_setting():
        refuse_uncached_offline(name)


def refuse_uncached_offline(name: str) -> None:
    """With the Hub off by the user's HF_HUB_OFFLINE, a Hub dataset datasets holds no copy of is refused, saying that
    no local folder of that name exists either. Asked as load_dataset asks (its builder, no data read): datasets
    keeps its own cache, which a look at the Hub cache would miss."""
    import datasets

    try:
        datasets.load_dataset_builder(name)
    except ConnectionError:  # what datasets raises offline for a dataset it has no copy of
        raise DataError(f"data.dataset={name!r}: {hub.offline_problem(name, 'dataset')}") from None
    except Exception:  # any other trouble with a cached copy: the load says it, as before
        return


def open_dataset(settings: DataSettings, notes: list[str] | None = None):
    """A DatasetDict from a Hub id, a saved dataset (save_to_disk), a local copy of a Hub dataset repo, a label file
    or an image folder; what the run should say of it (a label file found multi-label) is added to `notes`."""
    import datasets

    source = Path(settings.dataset).expanduser()
    if settings.dataset == BUILTIN_SHAPES:
        source = ensure_demo_dataset(cache_dir() / "shapes")
    try:
        label_file = labels.label_file_of(source)
        if label_file is not None and settings.task == "regression":
            loaded = labels.load_target_file(label_file, settings)
        elif label_file is not None:
            loaded = labels.load_label_file(label_file, settings, notes)
        elif source.is_dir() and ((source / "dataset_dict.json").exists() or (source / "state.json").exists()):
            loaded = datasets.load_from_disk(str(source))
        elif source.is_dir() and is_hub_dataset_copy(source):  # read as load_dataset reads the Hub repo itself
            loaded = datasets.load_dataset(str(source))
        elif source.is_dir():
            check_image_folder_layout(source, settings.dataset)
            loaded = datasets.load_dataset("imagefolder", data_dir=str(source))
        elif source.exists() or settings.dataset.startswith((".", "/", "~")):
            raise DataError(f"data.dataset={settings.dataset!r} is not a folder; give an image folder, a label file "
                        "(.csv or .jsonl) or a Hub id")
        else:
            refuse_unreachable(settings)
            loaded = datasets.load_dataset(settings.dataset)
    except DataError:
        raise
    except labels.LabelFileError as error:
        raise DataError(f"data.dataset={excerpt(settings.dataset)}: {error}") from None
    except Exception as error:  # datasets raises many types; the user needs the id and the reason
        raise DataError(
            f"data.dataset={settings.dataset!r} could not be loaded: {type(error).__name__}: {error}\n"
            "Fix: give a Hub dataset id, a folder of class sub-folders, or a folder written by save_to_disk."
        ) from None
    if isinstance(loaded, datasets.Dataset):
        loaded = datasets.DatasetDict({settings.train_split: loaded})
    return loaded


# The data files a Hub dataset repo holds, which datasets reads by itself (an image folder holds images).
HUB_DATA_FILES = ("*.parquet", "*.arrow")


def is_hub_dataset_copy(folder: Path) -> bool:
    """Whether a folder is laid out as a Hub dataset repo (a `hf download --repo-type dataset` copy, say): a
    README.md whose card declares its configs or features, or parquet/arrow files at most two folders down
    (data/train-00000-of-00008.parquet, default/train/0000.parquet)."""
    card = folder / CARD_FILE
    text = card.read_text(errors="replace") if card.is_file() else ""
    header = text.split("\n---", 1)[0] if text.startswith("---") else ""  # the card's YAML front matter
    if re.search(r"^(configs|dataset_info):", header, re.MULTILINE):
        return True
    return any(next(folder.glob(f"{depth}{pattern}"), None) for depth in ("", "*/", "*/*/") for pattern in HUB_DATA_FILES)


def is_local(settings: DataSettings) -> bool:
    """Whether data.dataset is on the user's own disk (a folder, a label file, or the built-in shapes), not a Hub id."""
    return settings.dataset == BUILTIN_SHAPES or Path(settings.dataset).exists()


def image_folders(settings: DataSettings) -> tuple[Path, ...] | None:
    """Where an image cell that holds only a path (no bytes) may be read from. A local dataset is the user's: any
    path (None). A Hub dataset's cells come from whoever wrote the repo: only the files datasets downloaded for it
    (the repo's folder in the Hub cache, datasets' download folder), never a file the repo names on this disk."""
    if is_local(settings):
        return None
    import datasets
    from huggingface_hub.constants import HF_HUB_CACHE

    downloaded = (Path(HF_HUB_CACHE) / ("datasets--" + settings.dataset.replace("/", "--")),
                  Path(datasets.config.DOWNLOADED_DATASETS_PATH))
    # As written (the cells spell them so) and resolved (decode_image resolves a cell's path before comparing).
    return tuple(dict.fromkeys([*(Path(os.path.abspath(f)) for f in downloaded), *(f.resolve() for f in downloaded)]))


def refuse_foreign_paths(split, split_name: str, image_column: str, folders: tuple[Path, ...] | None,
                         settings: DataSettings) -> None:
    """Before training: the first image cell of a Hub dataset's split that holds only a path outside `folders` (a
    file on this machine) stops the run, naming its row. Only the path column is read (Arrow, no image bytes), and
    paths are compared as written; decode_image checks each image again with links resolved."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if folders is None or settings.skip_bad_images:  # a local dataset; or such cells are skipped as they come
        return
    start = 0
    for chunk in split.data.column(image_column).chunks:
        if pa.types.is_struct(chunk.type):
            paths, pathless = chunk.field("path"), pc.is_null(chunk.field("bytes"))
        else:  # a column of plain strings: each one a path
            paths, pathless = chunk, pa.array([True] * len(chunk))
        for row, path in zip(pc.indices_nonzero(pathless).to_pylist(), pc.filter(paths, pathless).to_pylist()):
            if not path_allowed(path, folders, follow_links=False):
                raise DataError(f"data.dataset={excerpt(settings.dataset)}: row {start + row} of split {split_name!r} "
                                + not_the_datasets_file(path))
        start += len(chunk)


def not_the_datasets_file(path: str | None) -> str:
    """Why a Hub dataset's image cell that holds only a path is refused, and the fix."""
    return (f"holds no image bytes, only the path {excerpt(path)}, which is not a file of the Hub dataset: a Hub "
            "dataset's images are read from the dataset, never from this machine's disk. Fix the dataset (embed the "
            "images, as push_to_hub does), or set data.skip_bad_images=true to skip and count such images")


def path_allowed(path: str | None, folders: tuple[Path, ...] | None, follow_links: bool = True) -> bool:
    """Whether a path-only image cell may be opened: anywhere when `folders` is None, else only inside one of them.
    `..` never leads out; with `follow_links`, nor does a symlink (the path is resolved first: a syscall per part)."""
    if folders is None:
        return True
    if not path:
        return False
    where = Path(path).resolve() if follow_links else Path(os.path.abspath(path))
    return any(where.is_relative_to(folder) for folder in folders)


def names_a_split(folder_name: str) -> bool:
    """Whether datasets' imagefolder reads a top-level folder of this name as a split (train, test, val, ...)."""
    from datasets.data_files import SPLIT_KEYWORDS

    first_word = re.split(r"[-._ ]", folder_name)[0]
    return any(first_word == word for words in SPLIT_KEYWORDS.values() for word in words)


def check_image_folder_layout(root: Path, name: str) -> None:
    """Refuse, saying what is wrong, the class-folder layouts that imagefolder would misread without a word."""
    from datasets.packaged_modules.imagefolder.imagefolder import ImageFolder

    if any(root.rglob("metadata.*")):  # labels may then come from the metadata file, at any depth
        return
    folders = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith((".", "__")))
    splits = [f for f in folders if names_a_split(f)]
    classes = [f for f in folders if not names_a_split(f)]
    if splits and classes:
        raise DataError(
            f"data.dataset={excerpt(name)}: the folder holds class folders {excerpt(classes)} beside {splits}, which "
            f"datasets reads as a split, not a class. Fix: rename the class folder {splits[0]!r} (e.g. "
            f"'{splits[0]}_class'), or put all classes under train/ (and validation/ or test/)"
        )
    extensions = set(ImageFolder.EXTENSIONS)
    for split_root in [root / f for f in splits] or [root]:
        examples: dict[int, Path] = {}  # images' depth below the split -> one of them
        for path in split_root.rglob("*"):
            relative = path.relative_to(split_root)
            if path.suffix.lower() in extensions and not any(part.startswith((".", "__")) for part in relative.parts):
                examples.setdefault(len(relative.parts), relative)
        if len(examples) > 1:
            found = ", ".join(f"'{example.as_posix()}'" for _, example in sorted(examples.items()))
            raise DataError(
                f"data.dataset={excerpt(name)}: images sit at different depths below {str(split_root)!r} (e.g. {found}); "
                "each image's label is the folder that holds it only when all images are one folder deep, so "
                "datasets would drop the labels. Fix: one folder per class holding its images directly, "
                "e.g. red/1.png, green/2.png (move nested folders up, or make each its own class folder)"
            )
