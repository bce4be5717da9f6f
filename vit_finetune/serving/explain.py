"""Where the model looks: attention rollout and its class-specific, gradient-weighted form, drawn over each image.

rollout (Abnar & Zuidema, 2020): average each layer's attention over heads, add the identity for the residual
path, renormalise the rows, and multiply the layers together; the pooled token's row says how much each patch
reached the output. gradient (Chefer et al., 2021): each layer's attention weighted by the gradient of one
class's logit, negatives dropped, accumulated as R += A·R; so the map differs per class.

pytorch-grad-cam needs torchvision (not importable on these CPU machines) and captum has no rollout, so the
dozen lines are here. Attention weights need eager attention, loaded for explain only, never for training.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from vit_finetune import tasks
from vit_finetune.core.errors import VitFinetuneError, printable
from vit_finetune.core.layout import describe_write_error
from vit_finetune.data import BadImageError, decode_image, decoding_settings
from vit_finetune.model.families import FAMILIES
from vit_finetune.model.saved_model import load_classifier, path_kind
from vit_finetune.serving.prediction import label_scores, labels_given
from vit_finetune.tasks.pictures import pyplot, save_figure

METHODS = ("rollout", "gradient")
# Families whose attention does not span the whole image: a rollout over all patches is not defined there.
UNSUPPORTED = {
    "swin": "Swin attends within local windows (shifted between layers), so no token attends to the whole image",
    "swinv2": "Swin V2 attends within local windows (shifted between layers), so no token attends to the whole image",
}
MEAN_POOLED = {"siglip", "siglip_vision_model"}  # besides any config with use_mean_pooling (BEiT, Data2Vec-vision)


class ExplainError(VitFinetuneError):
    """A model or class that explain cannot draw, with the reason."""


@dataclass
class TokenLayout:
    """Which tokens are patches and which rows pool into the classifier."""
    prefix: int  # tokens before the patches (CLS, distillation, registers)
    grid: int  # patches per side
    mean_pooled: bool  # the head reads the mean of the patch tokens, not the first token


def check_supported(config) -> None:
    """A clear error for the families whose attention a rollout cannot follow."""
    vision = getattr(config, "vision_config", None) or config
    for model_type in (config.model_type, vision.model_type):
        if model_type in UNSUPPORTED:
            raise ExplainError(f"explain does not support {config.model_type!r} models: {UNSUPPORTED[model_type]}")


def token_layout(config, tokens: int) -> TokenLayout:
    """From the model's config and its sequence length (CLS, distillation or register tokens come first)."""
    check_supported(config)
    vision = getattr(config, "vision_config", None) or config
    family = FAMILIES[config.model_type]  # the model's size is asked of its family, as everywhere
    grid = family.image_size(config) // family.patch_size(config)
    prefix = tokens - grid * grid
    if prefix < 0:
        raise ExplainError(f"{tokens} tokens cannot hold a {grid}x{grid} patch grid; explain cannot map this model")
    mean_pooled = (bool(getattr(vision, "use_mean_pooling", False)) or config.model_type in MEAN_POOLED
                   or vision.model_type in MEAN_POOLED or prefix == 0)
    return TokenLayout(prefix, grid, mean_pooled)


def _to_grid(relevance: torch.Tensor, layout: TokenLayout) -> torch.Tensor:
    """The pooled rows' relevance of each patch, as a (grid, grid) map scaled to [0, 1] (all-equal maps: 0.5)."""
    rows = relevance[layout.prefix:] if layout.mean_pooled else relevance[:1]
    patches = rows.mean(0)[layout.prefix:].reshape(layout.grid, layout.grid)
    spread = patches.max() - patches.min()
    return (patches - patches.min()) / spread if spread > 1e-12 else torch.full_like(patches, 0.5)


def rollout(attentions: list[torch.Tensor], layout: TokenLayout) -> torch.Tensor:
    """attentions: per layer (heads, T, T) of one image -> (grid, grid) map."""
    tokens = attentions[0].shape[-1]
    identity = torch.eye(tokens)
    joint = identity
    for layer in attentions:
        mixed = 0.5 * layer.float().mean(0) + 0.5 * identity  # half of each token's output is its residual
        joint = (mixed / mixed.sum(-1, keepdim=True)) @ joint
    return _to_grid(joint, layout)


def gradient_rollout(attentions: list[torch.Tensor], gradients: list[torch.Tensor], layout: TokenLayout) -> torch.Tensor:
    """attentions and d(class logit)/d(attention), per layer (heads, T, T) -> (grid, grid) map for that class."""
    tokens = attentions[0].shape[-1]
    relevance = torch.eye(tokens)
    for layer, gradient in zip(attentions, gradients):
        weighted = (gradient.float() * layer.float()).clamp(min=0).mean(0)
        relevance = relevance + weighted @ relevance
    return _to_grid(relevance, layout)


@dataclass
class Explanation:
    heat_map: torch.Tensor  # (grid, grid) in [0, 1]
    explained_label: str
    # what the picture shows beside the map (the task's `shown`): a classifier's top labels and their probabilities
    # (a multi-label model's own sigmoid scores), best first; a regression's values, in the targets' order
    top: list[tuple[str, float]]
    given: list[tuple[str, float]]  # what predict lists for the image (predict.labels_given), best first
    task: tasks.Task  # the model's: it draws and words its outputs

    def given_text(self) -> str:
        """What the model gives the image, in one line: `label score` (a regression: `target value`) pairs."""
        return ", ".join(f"{label} {score:{self.task.score_format}}" for label, score in self.given) or "no label"


def explain_pixels(model, pixels: torch.Tensor, method: str = "rollout", label: str | None = None,
                   top_k: int = 5) -> Explanation:
    """One image's (1, 3, H, W) pixels through an eager-attention classifier -> its map and top predictions."""
    with torch.set_grad_enabled(method == "gradient"):
        outputs = model(pixel_values=pixels, output_attentions=True)
    if not outputs.attentions:
        raise ExplainError("the model returned no attention weights; load it with attn_implementation='eager'")
    attentions = outputs.attentions
    logits = outputs.logits[0].detach().float()
    # A multi-label model scores each label on its own (a sigmoid), as pipeline() and predict do; a regression model
    # gives its values in the targets' units.
    scores = label_scores(model.config, logits)
    task = tasks.of_config(model.config)
    top = task.shown(scores, [model.config.id2label[i] for i in range(model.config.num_labels)], top_k)
    given = labels_given(model.config, scores.tolist(), top_k if task.ranks else None)  # what predict lists
    target = model.config.label2id[label if label is not None else top[0][0]]
    layout = token_layout(model.config, attentions[0].shape[-1])
    if method == "rollout":
        heat_map = rollout([a[0].detach() for a in attentions], layout)
    else:
        gradients = torch.autograd.grad(outputs.logits[0, target], attentions)
        heat_map = gradient_rollout([a[0].detach() for a in attentions], [g[0] for g in gradients], layout)
    return Explanation(heat_map, model.config.id2label[target], top, given, task)


def draw_explanation(image, explanation: Explanation, size: int, method: str, path: Path) -> None:
    """The image as the model sees it (its resolution), the same with the heat map per patch, and what the model gives
    it as its task shows that (top labels, label scores and thresholds, or values)."""
    plt = pyplot()
    shown = image.convert("RGB").resize((size, size))
    figure, (plain, heat, bars) = plt.subplots(1, 3, figsize=(11, 3.8), gridspec_kw={"width_ratios": [1, 1, 1.1]})
    plain.imshow(shown)
    plain.set_title(f"input at {size}x{size} px")
    heat.imshow(shown)
    grid = explanation.heat_map.shape[0]
    heat.imshow(explanation.heat_map.numpy(), cmap="inferno", alpha=0.6, extent=(0, size, size, 0),
                interpolation="nearest", vmin=0, vmax=1)
    what = "attention rollout" if method == "rollout" else f"gradient rollout for '{explanation.explained_label}'"
    heat.set_title(f"{what}\n({grid}x{grid} patches)", fontsize=10)
    for axis in (plain, heat):
        axis.set_axis_off()
    explanation.task.draw_shown(bars, explanation.top, explanation.given)  # probabilities, label scores or values
    figure.tight_layout()
    save_figure(figure, path, dpi=80)


def output_names(names: list[str], method: str) -> list[str]:
    """`photo.rollout.png` per image, under its path relative to the folder all images share (`a/x.rollout.png`,
    `b/x.rollout.png`), so same-named images of two folders never write one picture; two images that differ only
    by suffix in one folder keep it (`x.png.rollout.png`, `x.jpg.rollout.png`)."""
    paths = [Path(os.path.abspath(name)) for name in names]
    common = Path(os.path.commonpath([path.parent for path in paths])) if paths else Path(".")
    relative = [path.relative_to(common) for path in paths]
    short = [str(path.with_suffix("")) for path in relative]
    chosen = [stem if short.count(stem) == 1 else str(path) for stem, path in zip(short, relative)]
    if len(set(chosen)) < len(chosen):  # a stem that is another image's full name: full names, distinct paths
        chosen = [str(path) for path in relative]
    return [f"{name}.{method}.png" for name in chosen]


def check_output_dir(output_dir: Path, names: list[str], overwrite: bool = False) -> None:
    """--output-dir must be a folder, or a name for a new one: never a file (it is the user's). Pictures it already
    holds under `names` are replaced only with --overwrite, as predict's and evaluate's outputs are."""
    if path_kind(output_dir, str(output_dir), "--output-dir") == "file":
        raise ExplainError(f"--output-dir {str(output_dir)!r} is a file, not a folder; choose another --output-dir")
    existing = [name for name in names if (output_dir / name).exists()]
    if existing and not overwrite:
        raise ExplainError(f"--output-dir {str(output_dir)!r} already holds {len(existing)} of the pictures this would "
                           f"write ({', '.join(repr(name) for name in existing[:3])}{', ...' if len(existing) > 3 else ''}); "
                           "pass --overwrite to replace them, or choose another --output-dir")


def explain_images(model_name: str, sources: list, output_dir: Path, method: str = "rollout",
                   label: str | None = None, device: str = "cpu", top_k: int = 5) -> list[Path]:
    """One PNG per readable image in output_dir, and a line naming it with the labels the model gives the image
    (what predict lists); unreadable ones are reported and skipped. Returns the files."""
    model, processor = load_classifier(model_name, device, eager_attention=True)
    check_supported(model.config)  # before any image is read
    if label is not None and label not in model.config.label2id:
        raise ExplainError(f"--class {label!r} is not a label of the model; its labels: {list(model.config.label2id)[:20]}")
    settings = decoding_settings(model.config)  # as training decoded (data.alpha_background)
    written = []
    for source, name in zip(sources, output_names([s.name for s in sources], method)):
        try:
            image = decode_image(source.encoded, 0, settings, source.folders)
        except BadImageError as error:
            print(f"skipped: {error}")
            continue
        pixels = processor(images=image, return_tensors="pt")["pixel_values"].to(device)
        explanation = explain_pixels(model, pixels, method, label, top_k)
        try:
            (output_dir / name).parent.mkdir(parents=True, exist_ok=True)
            draw_explanation(image, explanation, FAMILIES[model.config.model_type].image_size(model.config), method,
                             output_dir / name)
        except OSError as error:

            reason = describe_write_error(error, output_dir)
            raise ExplainError(f"--output-dir {str(output_dir)!r} cannot be written ({reason}) at {name!r}; the "
                               f"{len(written)} picture(s) written before it are whole, no picture is half-written. "
                               "Free disk space or choose another --output-dir") from None
        written.append(output_dir / name)
        print(printable(f"{source.name}: {explanation.given_text()} -> {output_dir / name}"))
    return written

