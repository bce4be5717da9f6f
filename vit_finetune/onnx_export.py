"""Serving: a trained classifier exported to ONNX at its trained resolution, checked against PyTorch on real
pixels, optionally with dynamic int8 weights; and the ONNX Runtime classifier `predict --runtime onnx` uses.

The graph comes from torch's maintained exporter, `torch.onnx.export(dynamo=True)` (it needs onnxscript): the
TorchScript exporter is deprecated since torch 2.9 and warns at every call. Measured on torch 2.13 with
transformers 5.23, the dynamo exporter exports every family with a dynamic batch axis once the model uses eager
attention; with SDPA attention it fails for BEiT, Data2Vec-vision and Swin (its decomposition views a
non-contiguous tensor), and the TorchScript exporter cannot export DINOv2-with-registers (antialiased bicubic).

The export is written into a staging folder beside its target and moved into place only once the parity check
has passed, so a refused or failed export (a full disk included) leaves no half-written file and an earlier export
intact. Like a run's folder, an export folder is claimed name by name: export.json lists the files the export wrote,
and a later export replaces those and nothing else. A folder holding anything else is the user's: refused unless it
is empty, and files a user adds to an earlier export (a Dockerfile, a server) are kept.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import shutil
import tempfile
import time
import warnings
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from types import SimpleNamespace

from .data import decode_image, decoding_settings, make_loader
from .errors import VitFinetuneError, shortened
from .families import FAMILIES
from .evaluate_saved import eval_split_of
from .saved_model import InputError, load_classifier, model_location, refuse_own_code
from .layout import (EXPORT_NAMES, EXPORT_REPORT_FILE, EXPORT_STAGING_MARK, MANIFEST, ONNX_DIR, ONNX_FILE,
                     QUANTIZED_ONNX_FILES, RECIPE_FILE, RUNTIME_FILES, describe_write_error, give_usual_modes, record,
                     rename_into_place, replace_atomically)
from .final_outputs import save_image_processor
from .data.synthetic import generate_arrays
from .tasks import Answers, of_config

DEFAULT_TOLERANCE = 1e-3  # max abs logit difference; fp32 exports measure ~1e-7 to 1e-5
PARITY_IMAGES = 8
EXTERNAL_DATA_BYTES = 1_800_000_000  # above this, weights go to model.onnx.data (protobuf caps a file at 2 GiB)
# --quantize KIND -> (file, onnxruntime QuantType name): weights stored as int8, activations quantised per batch.
QUANTIZATIONS = {"int8": (QUANTIZED_ONNX_FILES["int8"], "QInt8")}
VERSIONED_PACKAGES = ("torch", "transformers", "onnx", "onnxscript", "onnxruntime")


class ExportError(VitFinetuneError):
    """An export that cannot be written or failed its parity check; the message says why and what to do."""


def require_onnx_packages() -> None:
    """A clear error (not an ImportError deep in torch.onnx) when the optional extra is missing."""
    missing = [name for name in ("onnx", "onnxscript", "onnxruntime") if _absent(name)]
    if missing:
        raise ExportError(f"ONNX export and the onnx runtime need {', '.join(missing)}: "
                          "pip install 'vit_finetune[onnx]' (or pip install onnx onnxscript onnxruntime)")


def _absent(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is None


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


def export_graph(model, image_size: int, path: Path) -> None:
    """The model's logits as an ONNX graph: input pixel_values (batch, 3, size, size), output logits (batch, classes)."""
    import torch

    example = torch.zeros(2, 3, image_size, image_size)  # 2, not 1: a batch of 1 would be specialised as constant
    parameters = sum(p.numel() * p.element_size() for p in model.parameters())
    registration = logging.getLogger("torch.onnx._internal.exporter._registration")
    level = registration.level
    registration.setLevel(logging.ERROR)  # "torchvision is not installed. Skipping torchvision::nms" and kin
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # torch.export's own deprecations, not the user's
            torch.onnx.export(model, (), str(path), kwargs={"pixel_values": example}, input_names=["pixel_values"],
                              output_names=["logits"], dynamo=True, verbose=False,
                              dynamic_shapes={"pixel_values": {0: torch.export.Dim("batch", min=1, max=4096)}},
                              external_data=parameters > EXTERNAL_DATA_BYTES)
    finally:
        registration.setLevel(level)


def session(path: Path):
    """An onnxruntime session on the CPU with as many threads as torch has (OMP_NUM_THREADS, else one per core):
    predict's runtimes, and export's float and int8 timings, then run on the same threads."""
    import onnxruntime
    import torch

    options = onnxruntime.SessionOptions()
    options.log_severity_level = 3  # errors only: its graph-optimisation notices are not the user's concern
    options.intra_op_num_threads = torch.get_num_threads()
    return onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def run_session(runner, pixels: torch.Tensor) -> torch.Tensor:
    import torch

    return torch.from_numpy(runner.run(["logits"], {"pixel_values": pixels.float().numpy()})[0])


def logit_difference(model, runner, pixels: torch.Tensor) -> float:
    """Max abs difference of the logits, PyTorch vs ONNX Runtime, over the batch and over its first image alone
    (both ends of the dynamic batch axis)."""
    import torch

    with torch.no_grad():
        expected = model(pixel_values=pixels).logits.float()
    batch = (run_session(runner, pixels) - expected).abs().max()
    single = (run_session(runner, pixels[:1]) - expected[:1]).abs().max()
    return float(max(batch, single))


@dataclass
class ParityImages:
    pixels: torch.Tensor  # (N, 3, size, size), preprocessed by the saved processor
    source: str  # where they came from, in words


def parity_images(images: list | None, eval_set, processor, image_size: int, config=None) -> ParityImages:
    """Real pixels for the check: the user's images (decoded as the model `config` was trained on), else the first
    eval images of the run, else rendered shapes."""
    import torch

    if images:
        settings = decoding_settings(config)
        decoded = [decode_image(source.encoded, index, settings, source.folders) for index, source in enumerate(images)]
        source = f"{len(decoded)} image(s) given with --images"
    elif eval_set is not None and len(eval_set):
        count = min(PARITY_IMAGES, len(eval_set))
        pixels = torch.stack([eval_set[(index, 0)][0] for index in range(count)])
        return ParityImages(pixels, f"the first {count} images of the run's eval split")
    else:
        from PIL import Image

        arrays, _, _ = generate_arrays(2, split="validation", task="demo", image_size=image_size)
        decoded = [Image.fromarray(array) for array in arrays[:PARITY_IMAGES]]
        source = f"{len(decoded)} rendered demo shapes (no eval split known: pass --images for your own)"
    return ParityImages(processor(images=decoded[:PARITY_IMAGES], return_tensors="pt")["pixel_values"], source)


def quantize(staging: Path, kind: str) -> Path:
    """Dynamic quantisation: MatMul weights stored as int8, activations quantised per batch at run time; after
    onnxruntime's recommended pre-processing (shape inference, graph optimisation)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic
    from onnxruntime.quantization.shape_inference import quant_pre_process

    file, weight_type = QUANTIZATIONS[kind]
    prepared = staging / f"prepared-{ONNX_FILE}"
    quant_pre_process(str(staging / ONNX_FILE), str(prepared))
    quantize_dynamic(str(prepared), str(staging / file), weight_type=getattr(QuantType, weight_type))
    prepared.unlink()
    return staging / file


def answers_for(config) -> Answers:
    """How the model's task decides and scores its answers (tasks.Task.answers)."""
    return of_config(config).answers(config)


def compare_runtimes(float_runner, quantized_runner, answers: Answers, eval_set, batch_size: int, limit: int | None,
                     fallback: torch.Tensor) -> dict:
    """Quality (the task's metric: accuracy, a regression's MAE) and CPU speed of the float and the quantised graph,
    batch by batch on the same pixels (interleaved, so a busy machine slows both alike); only session.run is timed,
    not the image decoding. Without a labelled eval split, agreement of their answers on the parity pixels."""
    batches = ([{"pixel_values": fallback, "labels": None}] if eval_set is None else
               make_loader(eval_set, batch_size, False, 0, 0, False))
    seconds, scored, agree, counted, labelled = {"float": 0.0, "int8": 0.0}, {"float": 0.0, "int8": 0.0}, 0, 0, 0
    for batch in batches:
        pixels, labels = batch["pixel_values"], batch["labels"]
        if limit is not None and counted >= limit:
            break
        if limit is not None:
            pixels, labels = pixels[:limit - counted], None if labels is None else labels[:limit - counted]
        answer = {}
        for name, runner in (("float", float_runner), ("int8", quantized_runner)):
            if counted == 0:
                run_session(runner, pixels)  # a first run at a batch size allocates: not timed
            start = time.perf_counter()
            logits = run_session(runner, pixels)
            seconds[name] += time.perf_counter() - start
            answer[name] = answers.decide(logits)
        agree += int(answers.matches(answer["float"], answer["int8"]).sum())
        counted += len(pixels)
        if labels is not None:
            kept = answers.kept(labels)  # images skipped as unreadable are not counted, as in evaluate
            labelled += int(kept.sum())
            for name in answer:
                scored[name] += float(answers.scores(answer[name][kept], labels[kept]).double().sum())
    # top1_agreement keeps its name for a multi-label model, where it counts whole label sets (agreement_of says so)
    result = {"images": counted, "top1_agreement": agree / counted, "agreement_of": answers.kind,
              "float_images_per_s": round(counted / seconds["float"], 2),
              "int8_images_per_s": round(counted / seconds["int8"], 2),
              "speedup": round(seconds["float"] / seconds["int8"], 3)}
    if eval_set is not None and labelled:
        metric = answers.metric  # e.g. float_accuracy, int8_accuracy, accuracy_change; a regression's float_mae...
        result.update({"metric": metric, f"float_{metric}": scored["float"] / labelled,
                       f"int8_{metric}": scored["int8"] / labelled,
                       f"{metric}_change": (scored["int8"] - scored["float"]) / labelled})
    return result


def own_eval_split(name: str, model, processor):
    """The run's own eval split (the one `evaluate` uses), or None for a model with no recipe.yaml or whose
    dataset is not here (a pushed run trained on a local folder), said in a line."""
    if not (Path(model_location(name)) / RECIPE_FILE).is_file():
        return None
    try:
        return eval_split_of(name, model, processor)
    except VitFinetuneError as error:
        print(f"the run's eval split cannot be loaded here ({shortened(error)}); checking on other images")
        return None


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


def export_onnx(name: str, output: Path | None = None, quantize_kind: str | None = None,
                tolerance: float = DEFAULT_TOLERANCE, images: list | None = None,
                eval_limit: int | None = None) -> Path:
    """Export `name` (a run's folder or a Hub id) to `output`; returns the folder written. See the module doc."""
    require_onnx_packages()
    if not tolerance > 0:
        raise ExportError(f"--tolerance {tolerance}: give a positive max abs logit difference, e.g. {DEFAULT_TOLERANCE}")
    location = model_location(name)
    given = Path(output) if output is not None else default_output(name, location)
    earlier = check_target(given)
    target = given.resolve()  # a linked --output: written through the link, which stays
    model, processor = load_classifier(name, "cpu", eager_attention=True)
    image_size = FAMILIES[model.config.model_type].image_size(model.config)
    chosen = own_eval_split(name, model, processor)
    eval_set = chosen.dataset if chosen is not None else None
    parity = parity_images(images, eval_set, processor, image_size, model.config)

    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_staging(target)
        staging = staging_folder(target)
    except OSError as error:
        raise unwritable(given, error) from None
    try:
        print(f"exporting {name} at {image_size}x{image_size} px (torch.onnx dynamo exporter) ...")
        export_graph(model, image_size, staging / ONNX_FILE)
        float_runner = session(staging / ONNX_FILE)
        difference = logit_difference(model, float_runner, parity.pixels)
        answers = answers_for(model.config)
        print(f"parity: max abs logit difference PyTorch vs ONNX Runtime = {difference:.3g}"
              f"{answers.in_own_terms(difference)} on {parity.source} (tolerance {tolerance:g})")
        if difference > tolerance:
            raise ExportError(f"the ONNX graph's logits differ from PyTorch's by {difference:.3g}, more than the "
                              f"tolerance {tolerance:g}; nothing was written to {target}. Report the model type "
                              f"({model.config.model_type}), or pass a larger --tolerance if the difference is acceptable")
        model.config.save_pretrained(staging)
        save_image_processor(processor, staging)
        report = {"source": name, "image_size": image_size, "model_type": model.config.model_type,
                  "exporter": "torch.onnx.export(dynamo=True)", "input": "pixel_values (batch, 3, H, W)",
                  "parity": {"max_abs_logit_difference": difference, "tolerance": tolerance, "images": parity.source},
                  "versions": {package: metadata.version(package) for package in VERSIONED_PACKAGES}}
        if quantize_kind is not None:
            quantized = quantize(staging, quantize_kind)
            figures = compare_runtimes(float_runner, session(quantized), answers, eval_set,
                                       chosen.batch_size if chosen else PARITY_IMAGES, eval_limit, parity.pixels)
            report["quantized"] = {"kind": quantize_kind, "file": quantized.name, **figures,
                                   "measured_on": "the run's eval split" if eval_set is not None else parity.source}
            print(quantization_summary(report["quantized"], answers))
        report["files"] = sorted({entry.name for entry in staging.iterdir()} | {EXPORT_REPORT_FILE})
        (staging / EXPORT_REPORT_FILE).write_text(json.dumps(report, indent=1))
        claim_in_run_folder(location, target, report["files"])
        publish(staging, target, earlier)
    except OSError as error:  # a full disk while staging: the earlier export was not touched
        shutil.rmtree(staging, ignore_errors=True)
        raise unwritable(given, error) from None
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return given


def unwritable(target: Path, error: OSError) -> ExportError:
    """The export could not be written (a full or read-only disk): the reason, and that nothing was replaced."""

    existing = next(folder for folder in [target, *target.parents] if folder.exists())
    reason = describe_write_error(error, existing)
    return ExportError(f"--output {target} cannot be written ({reason}); nothing there was replaced: an earlier "
                       "export is as it was. Free disk space, or choose another --output")


def quantization_summary(figures: dict, answers: Answers) -> str:
    metric = answers.metric
    quality = (f"{answers.metric_name} {figures[f'float_{metric}']:.4g} -> {figures[f'int8_{metric}']:.4g} "
               f"({figures[f'{metric}_change']:+.4g})" if f"float_{metric}" in figures else "no labelled eval split")
    return (f"{figures['kind']}: {figures['speedup']:.2f}x the float graph's CPU speed "
            f"({figures['float_images_per_s']} -> {figures['int8_images_per_s']} images/s), {quality}, "
            f"{figures.get('agreement_of', 'top-1')} agreement {figures['top1_agreement']:.4f} over "
            f"{figures['images']} images")


def load_errors() -> tuple[type[Exception], ...]:
    """What onnxruntime raises for a file that is not a graph it can run (its types derive from Exception alone)."""
    from onnxruntime.capi import onnxruntime_pybind11_state as state

    return (state.Fail, state.InvalidArgument, state.InvalidProtobuf, state.InvalidGraph, state.NoSuchFile,
            state.NoModel, state.NotImplemented, state.RuntimeException)


class OnnxClassifier:
    """An exported graph behind what predict.predict_rows uses of a model: .config, .device, and a call that
    returns an object with .logits. A damaged file, or a graph that does not take pixel_values and give logits as
    `export --onnx` writes them, is an InputError naming the file and the fix."""

    def __init__(self, folder: Path, file: str):
        from transformers import AutoConfig
        import torch

        quantize = "".join(f" --quantize {kind}" for kind, (name, _) in QUANTIZATIONS.items() if name == file)
        again = f"Export it again: python -m vit_finetune export MODEL --onnx{quantize} --output {folder}"
        refuse_own_code(str(folder), str(folder))
        try:
            self.config = AutoConfig.from_pretrained(folder, trust_remote_code=False)
            self.runner = session(folder / file)
        except (OSError, ValueError, *load_errors()) as error:
            raise InputError(f"{folder / file} cannot be loaded as an ONNX classifier ({shortened(error)}). "
                             f"{again}") from None
        inputs = [given.name for given in self.runner.get_inputs()]
        outputs = [given.name for given in self.runner.get_outputs()]
        if inputs != ["pixel_values"] or "logits" not in outputs:
            raise InputError(f"{folder / file} takes {inputs} and gives {outputs}; predict feeds it pixel_values "
                             f"alone and reads logits, as an export of this toolkit does. {again}")
        self.device = torch.device("cpu")  # onnxruntime's CPU provider: the installed onnxruntime is CPU-only

    def __call__(self, pixel_values: torch.Tensor) -> SimpleNamespace:
        return SimpleNamespace(logits=run_session(self.runner, pixel_values.cpu()))


def export_folder(name: str) -> Path:
    """Where a model's export is: the folder itself if it is one, its onnx/ subfolder, or a Hub repo's onnx/."""
    location = model_location(name)
    folder = Path(location)
    if not folder.is_dir():
        from huggingface_hub import snapshot_download

        folder = Path(snapshot_download(location, allow_patterns=[f"{ONNX_DIR}/*"]))
    for candidate in (folder, folder / ONNX_DIR):
        if (candidate / ONNX_FILE).is_file():
            return candidate
    raise InputError(f"{name} holds no ONNX export ({ONNX_FILE} or {ONNX_DIR}/{ONNX_FILE}); make one with "
                     f"`python -m vit_finetune export {name} --onnx`")


def load_onnx_classifier(name: str, runtime: str):
    """(OnnxClassifier, its image processor) for predict --runtime onnx / onnx-int8."""
    from transformers import AutoImageProcessor

    require_onnx_packages()
    folder = export_folder(name)
    if not (folder / RUNTIME_FILES[runtime]).is_file():
        kind = runtime.removeprefix("onnx-")
        raise InputError(f"{folder} holds no {RUNTIME_FILES[runtime]}; make it with "
                         f"`python -m vit_finetune export {name} --onnx --quantize {kind}`")
    return OnnxClassifier(folder, RUNTIME_FILES[runtime]), AutoImageProcessor.from_pretrained(folder)
