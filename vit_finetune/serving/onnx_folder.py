"""An export's folder: what an export may replace there (the names its export.json claims), the staging folder beside
it, and the move into place that touches nothing of the user's."""

from __future__ import annotations

import glob
import json
import os
import shutil
import tempfile
from pathlib import Path

from vit_finetune.core.layout import (
    EXPORT_NAMES, EXPORT_REPORT_FILE, EXPORT_STAGING_MARK, MANIFEST, ONNX_DIR, describe_write_error, give_usual_modes,
    record, rename_into_place, replace_atomically,
)
from vit_finetune.serving.onnx_classifier import ExportError


def default_output(name: str, location: str) -> Path:
    """A run's folder: its onnx/ subfolder (pushed with it, where the Hub's ONNX files live); a Hub id: ./NAME-onnx."""
    folder = Path(location)
    return folder / ONNX_DIR if folder.is_dir() else Path(f"{name.split('/')[-1]}-{ONNX_DIR}")


def claimed_names(folder: Path) -> set[str] | None:
    """The names an earlier export of this toolkit wrote in `folder`, as its export.json lists them (only names an
    export writes count); None when there is no export.json of ours."""
    try:
        report = json.loads((folder / EXPORT_REPORT_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(report, dict):
        return None
    if isinstance(report.get("files"), list):
        return {name for name in report["files"] if name in EXPORT_NAMES} | {EXPORT_REPORT_FILE}
    # An export written before export.json listed its files: it wrote the fixed set of names.
    return set(EXPORT_NAMES) if {"exporter", "parity", "source"} <= report.keys() else None


def check_target(target: Path) -> set[str]:
    """What an export may replace in `target`: the names an earlier export there claimed. Anything else is the
    user's: a folder that holds anything and is no export of ours is refused, and so is a file of the user's under a
    name an export writes."""
    if target.is_symlink() and not target.exists():
        raise ExportError(f"--output {target} is a link to a folder that does not exist; give a folder")
    if target.exists() and not target.is_dir():
        raise ExportError(f"--output {target} is a file; give a folder (it is created)")
    entries = {entry.name for entry in target.iterdir()} if target.is_dir() else set()
    if not entries:
        return set()
    claimed = claimed_names(target)
    if claimed is None:
        raise ExportError(f"--output {target} holds files that are not an ONNX export of this toolkit "
                          f"({_listed(entries)}); choose another --output, or a new or empty folder")
    colliding = (entries - claimed) & EXPORT_NAMES
    if colliding:
        raise ExportError(f"--output {target} holds {_listed(colliding)}, which no export of this toolkit wrote there "
                          "and an export would replace; move them out, or choose another --output")
    return claimed & entries


def _listed(names: set[str], most: int = 5) -> str:
    shown = sorted(names)
    return ", ".join(shown[:most]) + (f", ... ({len(shown)} in all)" if len(shown) > most else "")


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def staging_folder(target: Path) -> Path:
    """A new folder beside `target` (on its disk, so files move into it by rename) named after this process."""
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}{EXPORT_STAGING_MARK}{os.getpid()}-", dir=target.parent))
    staging.chmod(0o777 & ~current_umask())  # mkdtemp's 0700 would make the export unreadable to a serving user
    return staging


def remove_stale_staging(target: Path) -> None:
    """Staging folders beside `target` left by an export that was killed (its process is gone): a kill cannot be
    cleaned up after, so the next export does it."""
    for folder in target.parent.glob(f".{glob.escape(target.name)}{EXPORT_STAGING_MARK}*"):
        pid = folder.name.removeprefix(f".{target.name}{EXPORT_STAGING_MARK}").split("-")[0]
        if folder.is_dir() and not folder.is_symlink() and pid.isdigit() and not process_alive(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def publish(staging: Path, target: Path, earlier: set[str]) -> None:
    """Move the staged export into `target`, file by file, export.json last; remove the names the earlier export
    there claimed (`earlier`) that this one did not write. Nothing else in `target` is touched."""
    written = {entry.name for entry in staging.iterdir()}
    give_usual_modes(staging)
    if not target.exists():
        rename_into_place(staging, target)
        return
    # Claimed before any file moves (the new report, listing the earlier names too): a kill midway leaves nothing
    # the next export would take for the user's.
    claim = {**json.loads((staging / EXPORT_REPORT_FILE).read_text()), "files": sorted(earlier | written)}
    replace_atomically(target / EXPORT_REPORT_FILE, lambda partial: partial.write_text(json.dumps(claim, indent=1)))
    for name in sorted(written - {EXPORT_REPORT_FILE}):
        os.replace(staging / name, target / name)
    for name in sorted(earlier - written):  # an earlier --quantize's graph, stale beside the new weights
        (target / name).unlink(missing_ok=True)
    os.replace(staging / EXPORT_REPORT_FILE, target / EXPORT_REPORT_FILE)
    staging.rmdir()


def claim_in_run_folder(location: str, target: Path, files: list[str]) -> None:
    """An export's `files` in a run's own onnx/ are recorded in the run's manifest before they are moved there, so a
    later run with overwrite=true removes them with the weights they were made from instead of leaving a stale graph
    beside new weights (a user's file in onnx/ stays)."""
    folder = Path(location)
    if target.resolve() == (folder / ONNX_DIR).resolve() and (folder / MANIFEST).is_file():
        record(folder, [f"{ONNX_DIR}/{name}" for name in files])


def unwritable(target: Path, error: OSError) -> ExportError:
    """The export could not be written (a full or read-only disk): the reason, and that nothing was replaced."""

    existing = next(folder for folder in [target, *target.parents] if folder.exists())
    reason = describe_write_error(error, existing)
    return ExportError(f"--output {target} cannot be written ({reason}); nothing there was replaced: an earlier "
                       "export is as it was. Free disk space, or choose another --output")
