"""ONNX Runtime: a session on the CPU's threads, and an exported graph loaded as the classifier
`predict --runtime onnx` runs (from a run's folder, its onnx/ subfolder or a Hub repo's)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

from vit_finetune.core.errors import VitFinetuneError, shortened
from vit_finetune.core.layout import ONNX_DIR, ONNX_FILE, QUANTIZED_ONNX_FILES, RUNTIME_FILES
from vit_finetune.model.saved_model import InputError, model_location, refuse_own_code


class ExportError(VitFinetuneError):
    """An export that cannot be written or failed its parity check; the message says why and what to do."""


def require_onnx_packages() -> None:
    """A clear error (not an ImportError deep in torch.onnx) when the optional extra is missing."""
    missing = [name for name in ("onnx", "onnxscript", "onnxruntime") if _absent(name)]
    if missing:
        raise ExportError(f"ONNX export and the onnx runtime need {', '.join(missing)}: "
                          "pip install 'vit_finetune[onnx]' (or pip install onnx onnxscript onnxruntime)")


def _absent(module: str) -> bool:
    return importlib.util.find_spec(module) is None


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

        quantize = "".join(f" --quantize {kind}" for kind, name in QUANTIZED_ONNX_FILES.items() if name == file)
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
