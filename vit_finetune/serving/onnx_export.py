"""Serving: a trained classifier exported to ONNX at its trained resolution, checked against PyTorch on real
pixels, optionally with dynamic int8 weights (the ONNX Runtime classifier `predict --runtime onnx` uses is
onnx_classifier.py; the export's folder, onnx_folder.py).

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

import json
import logging
import shutil
import time
import warnings
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from vit_finetune.artifacts.final_outputs import save_image_processor
from vit_finetune.core.errors import VitFinetuneError, shortened
from vit_finetune.core.layout import EXPORT_REPORT_FILE, ONNX_FILE, QUANTIZED_ONNX_FILES, RECIPE_FILE
from vit_finetune.data import decode_image, decoding_settings, make_loader
from vit_finetune.data.synthetic import generate_arrays
from vit_finetune.model.families import FAMILIES
from vit_finetune.model.saved_model import load_classifier, model_location
from vit_finetune.serving.evaluate_saved import eval_split_of
from vit_finetune.serving.onnx_classifier import ExportError, require_onnx_packages, run_session, session
from vit_finetune.serving.onnx_folder import (
    check_target, claim_in_run_folder, default_output, publish, remove_stale_staging, staging_folder, unwritable,
)
from vit_finetune.tasks import Answers, of_config

DEFAULT_TOLERANCE = 1e-3  # max abs logit difference; fp32 exports measure ~1e-7 to 1e-5
PARITY_IMAGES = 8
EXTERNAL_DATA_BYTES = 1_800_000_000  # above this, weights go to model.onnx.data (protobuf caps a file at 2 GiB)
# --quantize KIND -> (file, onnxruntime QuantType name): weights stored as int8, activations quantised per batch.
QUANTIZATIONS = {"int8": (QUANTIZED_ONNX_FILES["int8"], "QInt8")}
VERSIONED_PACKAGES = ("torch", "transformers", "onnx", "onnxscript", "onnxruntime")


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


def quantization_summary(figures: dict, answers: Answers) -> str:
    metric = answers.metric
    quality = (f"{answers.metric_name} {figures[f'float_{metric}']:.4g} -> {figures[f'int8_{metric}']:.4g} "
               f"({figures[f'{metric}_change']:+.4g})" if f"float_{metric}" in figures else "no labelled eval split")
    return (f"{figures['kind']}: {figures['speedup']:.2f}x the float graph's CPU speed "
            f"({figures['float_images_per_s']} -> {figures['int8_images_per_s']} images/s), {quality}, "
            f"{figures.get('agreement_of', 'top-1')} agreement {figures['top1_agreement']:.4f} over "
            f"{figures['images']} images")
