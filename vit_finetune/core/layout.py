"""The names of everything a run and an export write, and the one way to write a file or a folder atomically.

A run's folder (output_dir) holds the model as transformers saves it, the resolved recipe, the metrics (written
last: their presence marks a finished run), the history and pictures, the card, and the folders the run keeps
for itself (checkpoints, keep-best's copy, the trackers' files, the final save's staging). An export folder
(`export --onnx`, by default the run's onnx/) holds the graph and the files that load it. A run's manifest records,
path by path, what it wrote (output_guard.py decides what that allows). Every module that writes or reads one of these
names imports it from here; this module imports nothing of the package, so any module may.
"""

from __future__ import annotations

import re
import json
import os
import shutil
from pathlib import Path
from typing import Callable, Iterable

# What transformers' save_pretrained writes (transformers.utils CONFIG_NAME, SAFE_WEIGHTS_NAME,
# IMAGE_PROCESSOR_NAME; spelled out so that reading a name does not import transformers).
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
PROCESSOR_FILE = "preprocessor_config.json"

# A run's folder.
RECIPE_FILE = "recipe.yaml"  # the resolved recipe, beside a run's outputs and in each of its checkpoints
METRICS_FILE = "metrics.json"  # written last: a folder holding it is a finished run
HISTORY_FILE = "history.json"
RUN_INFO_FILE = "run_info.json"
CARD_FILE = "README.md"
ADAPTER_DIR = "adapter"  # a LoRA run's adapter alone, beside the merged model
CURVES_FILE = "training_curves.png"
POSITION_FILE = "position_embeddings.png"
CONFUSION_FILE = "confusion_matrix.png"
MISCLASSIFIED_FILE = "misclassified.png"
PRECISION_RECALL_FILE = "precision_recall.png"  # multi-label runs, instead of the two above
PREDICTED_VS_TRUE_FILE = "predicted_vs_true.png"  # regression runs, instead of the three above
PICTURE_FILES = (POSITION_FILE, CONFUSION_FILE, MISCLASSIFIED_FILE, PRECISION_RECALL_FILE, PREDICTED_VS_TRUE_FILE)
STAGING = ".staging-final"  # the final save, written here first and moved into output_dir file by file
TRACKER_DIR = "runs"  # where file-based trackers (tensorboard) write
MANIFEST = ".vit_finetune_manifest.json"  # the paths a run wrote, each recorded before it is written
PREVIOUS_RUN = ".vit_finetune_previous"  # overwrite=true: the run being replaced, set aside until the new one is done
LOCK = ".vit_finetune.lock"  # held for the run's life: a second run into the folder is refused
SHARED_CHECK = ".vit_finetune_shared"  # several processes: a token from the main process that all must read back

# Checkpoints: output_dir/checkpoints/step-00000100/, complete once COMPLETE is in it.
CHECKPOINTS = "checkpoints"
COMPLETE = "COMPLETE"
STATE_FILE = "trainer_state.json"
STREAM_POSITION_FILE = "stream_position_{rank}.json"  # a streamed run: one per process, in each checkpoint
CHECKPOINT_EMA = "ema.safetensors"  # train.ema: the averaged weights, in each checkpoint
CHECKPOINT_BEST = "best.safetensors"  # train.keep_best: the best weights so far, in each checkpoint
PARTIAL_PREFIX = ".partial-"  # a file or checkpoint being written under this name is renamed into place
# What the toolkit keeps in every output folder for itself: never a user's, never moved aside, never published.
OWN_FILES = frozenset({MANIFEST, f"{PARTIAL_PREFIX}{MANIFEST}", LOCK, SHARED_CHECK, PREVIOUS_RUN})
DAMAGED_PREFIX = "damaged-"  # a checkpoint that would not load, kept aside for inspection

# train.keep_best: output_dir/best/weights.safetensors, the best evaluation's weights while the run goes on.
BEST_DIR = "best"
BEST_FILE = "weights.safetensors"

# An export: output_dir/onnx/ (as Hub repos hold their ONNX files), or a folder of the user's choosing.
ONNX_DIR = "onnx"
ONNX_FILE = "model.onnx"
ONNX_DATA_FILE = f"{ONNX_FILE}.data"  # the weights beside a graph over protobuf's 2 GiB cap
QUANTIZED_ONNX_FILES = {"int8": "model_quantized.onnx"}  # --quantize KIND -> its graph
EXPORT_REPORT_FILE = "export.json"  # the parity check, and the files the export claims: written last
# Every name an export may write in its folder: the most export.json can claim, whatever it lists.
EXPORT_NAMES = frozenset({ONNX_FILE, ONNX_DATA_FILE, *QUANTIZED_ONNX_FILES.values(), CONFIG_FILE, PROCESSOR_FILE,
                          EXPORT_REPORT_FILE})
EXPORT_STAGING_MARK = ".partial-"  # .TARGET.partial-PID-XXXX: an export being written beside TARGET by process PID
# predict --runtime NAME -> the file of an export it runs (None: the PyTorch model itself).
RUNTIME_FILES = {"torch": None, "onnx": ONNX_FILE, **{f"onnx-{kind}": file for kind, file in QUANTIZED_ONNX_FILES.items()}}

SPACE_DIR = "space"  # push --space-app: the page as a Space-ready folder inside the model repo

# Every name a run writes directly in output_dir (files and folders), claimed in its manifest first. ONNX_DIR:
# `export --onnx` of these weights, stale once they are replaced.
RUN_NAMES = (METRICS_FILE, CARD_FILE, RECIPE_FILE, HISTORY_FILE, CURVES_FILE, RUN_INFO_FILE, *PICTURE_FILES,
             CONFIG_FILE, WEIGHTS_FILE, PROCESSOR_FILE, ADAPTER_DIR, CHECKPOINTS, BEST_DIR, TRACKER_DIR, STAGING,
             ONNX_DIR)
# What the final save writes in STAGING (save_pretrained shards large weights): a run clears only these there, and
# refuses a folder where STAGING holds anything else, which is the user's.
STAGED_NAMES = (METRICS_FILE, CARD_FILE, RECIPE_FILE, HISTORY_FILE, CURVES_FILE, RUN_INFO_FILE, *PICTURE_FILES,
                CONFIG_FILE, WEIGHTS_FILE, PROCESSOR_FILE, ADAPTER_DIR, "model-*-of-*.safetensors",
                f"{WEIGHTS_FILE}.index.json", f"{PARTIAL_PREFIX}*")
# Folders a run or an export writes in beside a user's own files, never replacing the folder: the trackers' logs
# (each run its own sub-folder), an export's files (export.json names them).
SHARED_FOLDERS = frozenset({TRACKER_DIR, ONNX_DIR})
# What a run keeps for itself, never published: resumable state, the final save's staging, keep-best's copy.
KEPT_FOR_THE_RUN = frozenset({CHECKPOINTS, STAGING, BEST_DIR})


def written(output_dir: Path) -> list[str]:
    """The paths (relative, `/`-separated) a run recorded in `output_dir`'s manifest (MANIFEST): what it wrote, or
    was about to; none if no run wrote there. A manifest of a version that listed names only gives those names."""
    try:
        paths = json.loads((Path(output_dir) / MANIFEST).read_text())["written"]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    return sorted({path for path in paths if _inside(path)}) if isinstance(paths, list) else []


def _inside(path: object) -> bool:
    """A manifest entry that names something inside the folder: relative, no `..`, none of the toolkit's own."""
    if not isinstance(path, str) or path.startswith("/") or "\\" in path:
        return False
    parts = path.split("/")
    return all(part not in ("", ".", "..") for part in parts) and parts[0] not in OWN_FILES


def record(output_dir: Path, paths: Iterable[str]) -> None:
    """Add `paths` (relative to output_dir: a file, or a folder the run makes for itself) to the manifest, atomically,
    before any of them is written: a run killed midway leaves nothing a later run would take for the user's. Entries
    whose files are gone (a checkpoint train.keep_checkpoints removed) are dropped."""
    output_dir = Path(output_dir)
    kept = {path for path in written(output_dir) if os.path.lexists(output_dir / path)}
    content = json.dumps({"written": sorted(kept | {path for path in paths if _inside(path)})}, indent=1)
    output_dir.mkdir(parents=True, exist_ok=True)
    replace_atomically(output_dir / MANIFEST, lambda partial: partial.write_text(content))


def is_finished(output_dir: Path) -> bool:
    """Whether `output_dir` holds a finished run: its metrics are written last."""
    return (Path(output_dir) / METRICS_FILE).is_file()


def checkpoint_name(step: int) -> str:
    """The checkpoint folder of optimiser step `step`: sorting the names sorts the steps."""
    return f"step-{step:08d}"


def describe_write_error(error: Exception, folder: Path) -> str:
    """The reason a write failed, with the free space left where it was writing (the usual culprit)."""
    reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return reason
    return f"{reason}; {free / 2**20:.1f} MiB free on that disk"


def replace_atomically(target: Path, write: Callable[[Path], None]) -> None:
    """`write(path)` under a temporary name beside `target`, fsynced, then renamed over it: never half a file. If
    the write fails, its partial file goes and `target` stays as it was."""
    partial = target.with_name(f"{PARTIAL_PREFIX}{target.name}")
    try:
        write(partial)
        give_usual_modes(partial)
        with open(partial, "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(partial, target)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    fsync_folder(target.parent)


def rename_into_place(partial: Path, final: Path) -> None:
    """A folder written in full under `partial` becomes `final` in one rename, made durable first (its files) and
    after (the rename): a reader sees the whole folder or none of it. An earlier `final` is replaced."""
    give_usual_modes(partial)
    fsync_tree(partial)
    if final.exists():
        shutil.rmtree(final)
    os.rename(partial, final)
    fsync_folder(final.parent)


def move_into(staging: Path, target: Path, last: str) -> None:
    """Each entry of `staging` renamed into `target` (an entry there of the same name replaced), `last` after all
    the others, then `staging` removed: when `last` appears, everything written with it is in place."""
    give_usual_modes(staging)
    for entry in sorted(staging.iterdir(), key=lambda path: path.name == last):
        if (target / entry.name).is_dir():
            shutil.rmtree(target / entry.name)
        os.replace(entry, target / entry.name)
    staging.rmdir()


def usual_file_mode() -> int:
    """The mode a new file gets from open(): 0666 less the umask (read off /proc where it can be: setting the umask
    to read it is process-wide, and another thread could create a file in between)."""
    try:
        status = Path("/proc/self/status").read_text()
        return 0o666 & ~int(next(line for line in status.splitlines() if line.startswith("Umask:")).split()[1], 8)
    except (OSError, StopIteration, ValueError, IndexError):
        mask = os.umask(0)
        os.umask(mask)
        return 0o666 & ~mask


def give_usual_modes(path: Path) -> None:
    """`path`, or every file under it, given the usual mode (usual_file_mode): safetensors writes its files 0600,
    which a shared folder, a web server or another user's job could not read beside the 0644 of the rest."""
    mode = usual_file_mode()
    path = Path(path)
    files = [path] if not path.is_dir() else [entry for entry in path.rglob("*") if entry.is_file()]
    for file in files:
        if not file.is_symlink() and file.stat().st_mode & 0o7777 != mode:
            file.chmod(mode)


def fsync_tree(folder: Path) -> None:
    """Every file under `folder`, then `folder` itself, on disk: what must hold before a folder is renamed into
    place (a rename can reach the disk before the files it names)."""
    for path in folder.rglob("*"):
        if path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
    fsync_folder(folder)


def fsync_folder(folder: Path) -> None:
    """`folder`'s entries on disk: makes a rename into it durable."""
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


# Where a model or a dataset comes from: a folder on this machine, a model shipped inside the package (`builtin:NAME`,
# under assets/), or a Hub id, which the Hub's own pattern tells from a path.
PACKAGE_DIR = Path(__file__).resolve().parent.parent  # vit_finetune/
BUILTIN_PREFIX = "builtin:"  # models shipped inside the package, e.g. builtin:tiny-vit-32 for the offline demo
ASSETS_DIR = PACKAGE_DIR / "model" / "assets"
# The Hub's own rule for repo ids: an optional namespace and a name, no spaces, at most 96 characters.
REPO_ID_PATTERN = re.compile(r"^(?:[A-Za-z0-9][\w.-]{0,95}/)?[A-Za-z0-9][\w.-]{0,95}$")
