"""From an image cell to pixels: decoding (a bad file is named by its path or index), RGB as `pipeline()` reads a
file, transparency and flat images, and training's crop, flip and resize, drawn per sample from a seeded generator.
"""

from __future__ import annotations

import io
import random
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from PIL import Image, ImageFile, ImageOps, UnidentifiedImageError

from vit_finetune.core.errors import BadImageError, excerpt
from vit_finetune.data.opening import not_the_datasets_file, path_allowed
from vit_finetune.data.splits import Splits
from vit_finetune.recipe import DataSettings


# ---------------------------------------------------------------- decoding


ImageFile.LOAD_TRUNCATED_IMAGES = False  # a truncated JPEG is an error, never silently grey pixels


def decode_image(encoded: dict, index: int, settings: DataSettings,
                 folders: tuple[Path, ...] | None = None, keep_alpha: bool = False) -> Image.Image:
    """An RGB PIL image from a datasets Image(decode=False) cell, or BadImageError naming the sample. A cell
    holding only a path is read only from `folders` (None: anywhere; see image_folders). `keep_alpha`: RGBA instead,
    its EXIF orientation applied and its transparency kept (what data.alpha_background=auto measures)."""
    where = sample_name(encoded, index)
    raw, path = encoded.get("bytes"), encoded.get("path")
    if raw is None and not path_allowed(path, folders):
        raise BadImageError(f"bad image sample #{index}: its cell " + not_the_datasets_file(path))
    try:
        source = io.BytesIO(raw) if raw is not None else path
        if raw is not None and len(raw) == 0:
            raise BadImageError("the file is empty (0 bytes)")
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(source)
            width, height = image.size
            if width * height > settings.max_image_pixels:
                raise BadImageError(f"{width}x{height} px is over data.max_image_pixels={settings.max_image_pixels}")
            if min(width, height) < settings.min_image_side:
                raise BadImageError(f"{width}x{height} px is under data.min_image_side={settings.min_image_side}")
            image.load()  # decode now, so a truncated file fails here and not inside a transform
        if keep_alpha:
            return rgba(image)
        return to_rgb(image, settings.alpha_background)
    except BadImageError as error:
        raise BadImageError(f"bad image {where}: {error}. Fix the file, or set data.skip_bad_images=true") from None
    except (OSError, UnidentifiedImageError, SyntaxError, ValueError, Image.DecompressionBombError, Warning) as error:
        raise BadImageError(
            f"bad image {where}: cannot be decoded ({type(error).__name__}: {error}). "
            "Fix the file, or set data.skip_bad_images=true to skip and count such images"
        ) from None


def sample_name(encoded: dict, index: int) -> str:
    """How messages name a sample: its file, or its index when it came as bytes."""
    return encoded.get("path") or f"sample #{index}"


# Grey deeper than 8 bits: convert("RGB") clips it at 255 (a white image) or truncates floats (a black one), so it
# is scaled to 8 bits instead, taking as white the top of the range its type conventionally spans:
#   16-bit ("I;16*"), and Pillow's "I" from a 16-bit PGM/PNM (Pillow stretches any maxval to 0..65535): 65535
#   32-bit integer TIFF ("I"): 2**31 - 1 if signed (Pillow writes these), 2**32 - 1 if unsigned
#   32-bit float ("F"): 1.0, as float images are kept in [0, 1] (skimage, OpenCV); values outside are clipped
# Data that uses only part of its type's range (12-bit counts in a 32-bit file) comes out dark: rescale it first.
SIXTEEN_BIT_MODES = ("I;16", "I;16L", "I;16B", "I;16N")
TIFF_BITS_PER_SAMPLE, TIFF_SAMPLE_FORMAT, TIFF_UNSIGNED = 258, 339, 1
WHITE_LEVELS = {**{mode: lambda image: 65535 for mode in SIXTEEN_BIT_MODES},
                "I": lambda image: _integer_white(image), "F": lambda image: 1.0}


def _integer_white(image: Image.Image) -> int:
    """White for Pillow's 32-bit signed mode "I": by the bits the file declares (only TIFF declares 32)."""
    tags = getattr(image, "tag_v2", {})
    if 32 not in tuple(tags.get(TIFF_BITS_PER_SAMPLE, ())):
        return 65535
    return 2**32 - 1 if tuple(tags.get(TIFF_SAMPLE_FORMAT, (TIFF_UNSIGNED,)))[0] == TIFF_UNSIGNED else 2**31 - 1


def to_rgb(image: Image.Image, alpha_background: str | None = None) -> Image.Image:
    """RGB pixels as `pipeline()` reads a file (transformers' load_image): EXIF orientation applied, then
    convert("RGB"), which drops alpha and maps grey, palette and CMYK. Two exceptions: grey deeper than 8 bits is
    scaled to 8 bits (WHITE_LEVELS; load_image clips it); and with `alpha_background` (data.alpha_background) an
    image with transparency is laid on that colour first, so a drawing kept in the alpha channel survives.
    `predict`, `explain` and the page decode with this function, so their pixels match evaluation."""
    ImageOps.exif_transpose(image, in_place=True)
    white_level = WHITE_LEVELS.get(image.mode)
    if white_level is not None:
        white = white_level(image)
        values = np.asarray(image)
        if white == 2**32 - 1:  # unsigned 32-bit samples, held by Pillow in a signed int32
            values = values.astype(np.int32).view(np.uint32)
        scaled = np.clip(values.astype(np.float64) / white, 0.0, 1.0) * 255.0
        image = Image.fromarray(np.round(np.nan_to_num(scaled)).astype(np.uint8))  # mode L; NaN as black
    elif alpha_background not in (None, "auto") and has_alpha(image):  # auto: a run resolves it before decoding
        return laid_on(image, alpha_background)
    if isinstance(image.info.get("transparency"), bytes):
        # A palette's alpha per entry, which convert("RGB") drops (as pipeline() does) with a warning per image:
        # dropped here first, the same pixels, quietly (alpha_background says what to do with transparency).
        del image.info["transparency"]
    return image if image.mode == "RGB" else image.convert("RGB")


def laid_on(image: Image.Image, colour: str) -> Image.Image:
    """An image with transparency laid on `colour` (data.alpha_background's spelling), as RGB."""
    layer = image.convert("RGBA")
    return Image.alpha_composite(Image.new("RGBA", layer.size, (*background_rgb(colour), 255)), layer).convert("RGB")


def rgba(image: Image.Image) -> Image.Image:
    """An image as RGBA, its EXIF orientation applied: opaque where it has no transparency."""
    ImageOps.exif_transpose(image, in_place=True)
    if image.mode in WHITE_LEVELS:  # deeper than 8 bits: scaled as to_rgb does, then opaque
        return to_rgb(image).convert("RGBA")
    return image.convert("RGBA")


# ---------------------------------------------------------------- transparency and flat images

# data.alpha_background: the colour transparent pixels are laid on before the alpha channel goes (a name here, or
# #rrggbb). Saved in the model's config.json under ALPHA_BACKGROUND_KEY, where predict, evaluate --dataset, explain,
# export and the page read it back; the card tells pipeline() users to do the same.
ALPHA_BACKGROUNDS = {"white": (255, 255, 255), "black": (0, 0, 0)}
ALPHA_BACKGROUND_KEY = "alpha_background"
ALPHA_MODES = ("RGBA", "RGBa", "LA", "La", "PA")


def has_alpha(image: Image.Image) -> bool:
    """Whether an image has transparency: an alpha channel, or a palette or grey value marked transparent."""
    return image.mode in ALPHA_MODES or "transparency" in image.info


def background_rgb(name: str) -> tuple[int, int, int]:
    """data.alpha_background as an (r, g, b) colour: white, black or #rrggbb (the recipe checks the spelling)."""
    if name in ALPHA_BACKGROUNDS:
        return ALPHA_BACKGROUNDS[name]
    return tuple(int(name[start:start + 2], 16) for start in (1, 3, 5))


def decoding_settings(config, **settings) -> DataSettings:
    """The data settings an image is read with for a saved model: its data.alpha_background (config.json), so
    that predict, evaluate, explain, export and the page see the pixels the model was trained and evaluated on."""
    return DataSettings(alpha_background=getattr(config, ALPHA_BACKGROUND_KEY, None), **settings)


def alpha_card_text(settings: DataSettings) -> str:
    """The card's word on transparency: what training did with it, and what a pipeline() user must do the same."""
    if settings.alpha_background in (None, "auto"):  # auto is resolved before training; unresolved, nothing was done
        return ""
    return (f"Images with transparency were laid on {settings.alpha_background} before their alpha channel was "
            f"dropped (`data.alpha_background: {settings.alpha_background}`, saved as `{ALPHA_BACKGROUND_KEY}` in "
            "`config.json`); vit_finetune's `predict`, `explain` and page do the same. `pipeline()` drops alpha "
            "without it: give it such images composited first, e.g. `Image.alpha_composite(Image.new(\"RGBA\", "
            f"image.size, {background_rgb(settings.alpha_background)}), image.convert(\"RGBA\")).convert(\"RGB\")`.\n")


# Before training, this many training images (seeded, spread over the split) are decoded as training will decode
# them, to find those that come out as one flat colour: what a drawing kept only in the alpha channel becomes once
# alpha is dropped. A flat field keeps a spread below FLAT_SPREAD (8-bit values, the largest channel's standard
# deviation) even after JPEG compression; any drawing or photo is far above it.
FLAT_CHECKED = 256
FLAT_SPREAD = 2.0


def is_flat(image: Image.Image) -> bool:
    """Whether an image is one colour, or nearly (measured on a thumbnail: the same for a flat field, and fast)."""
    thumbnail = image.copy()
    thumbnail.thumbnail((128, 128))
    values = np.asarray(thumbnail, dtype=np.float64)
    return float(values.reshape(-1, values.shape[-1] if values.ndim == 3 else 1).std(axis=0).max()) < FLAT_SPREAD


def drawing_in_alpha(image: Image.Image) -> bool:
    """Whether an image (flat with its alpha dropped) shows a drawing when laid on white or black: the drawing lives in
    its alpha channel alone."""
    return not all(is_flat(laid_on(image, colour)) for colour in ALPHA_BACKGROUNDS)


@dataclass
class FlatImages:
    """What the check found: how many training images it decoded, which came out flat, and which of those hold
    a drawing in their alpha channel (not flat when laid on white or black)."""
    checked: int
    flat: list[str]
    drawn_in_alpha: list[str]

    def problem(self, settings: DataSettings) -> str | None:
        """The console's word on the flat images (None if there is none)."""
        if not self.flat:
            return None
        alpha = (f"; {len(self.drawn_in_alpha)} of them keep their drawing in the alpha channel (transparency), which "
                 "decoding drops as pipeline() does" if self.drawn_in_alpha else "")
        fix = ("Fix: data.alpha_background=white (or black, or #rrggbb) lays transparent pixels on that colour in "
               "training, evaluation, predict, explain, export and the page, and the model card asks pipeline() "
               "users to do the same" if self.drawn_in_alpha and settings.alpha_background is None
               else "Fix: check those files")
        return (f"{len(self.flat)} of the {self.checked} training images checked decode to one flat colour, which "
                f"teaches nothing (e.g. {', '.join(excerpt(name) for name in self.flat[:3])}){alpha}. {fix}")

    def refuses(self, settings: DataSettings) -> bool:
        """Most training images flat: the run would train on nothing, unless data.allow_flat_images says so."""
        return len(self.flat) * 2 > self.checked and not settings.allow_flat_images


def flat_images(splits: Splits, settings: DataSettings, seed: int,
                suspect: Callable[[Any], bool] = lambda label: True) -> FlatImages:
    """Decode up to FLAT_CHECKED training images (a seeded sample) as training does; find the flat ones that are
    suspect: those holding a drawing in their alpha channel, and those whose label `suspect` says a flat image should
    not have (the task decides: a blank multi-label negative or a regression's blank image is data, not a fault)."""
    table, count = splits.train, len(splits.train)
    chosen = range(count) if count <= FLAT_CHECKED else sorted(random.Random(seed).sample(range(count), FLAT_CHECKED))
    checked, flat, drawn = 0, [], []
    # data.alpha_background=auto lays an image that keeps its drawing in the alpha channel on a colour (probe_checks):
    # such an image is decoded with alpha dropped here, and is no fault.
    auto = settings.alpha_background == "auto"
    if auto:
        settings = settings.model_copy(update={"alpha_background": None})
    for index in chosen:
        row = table[index]
        cell = row[splits.image_column]
        try:
            image = decode_image(cell, index, settings, splits.image_folders)
        except BadImageError:  # reported, or skipped and counted, where training decodes it
            continue
        checked += 1
        if not is_flat(image):
            continue
        in_alpha = settings.alpha_background is None and drawing_in_alpha(
            decode_image(cell, index, settings, splits.image_folders, keep_alpha=True))
        if (in_alpha and auto) or not (in_alpha or suspect(row[splits.label_column])):
            continue
        flat.append(sample_name(cell, index))
        if in_alpha:
            drawn.append(sample_name(cell, index))
    return FlatImages(checked, flat, drawn)


# ---------------------------------------------------------------- the training crop and resize

# data.crop_scale=auto: the crop area from the training images a run will see (plan.images_read: what its steps read).
# Measured where the eval images come from the training source (docs/studies/small-data.md, "The crop rule"): against
# no crop, every random-resized-crop range tried lost or tied up to AUTO_CROP_MEASURED_UP_TO images seen, on three
# real sets and on held-out digits. Measured where they come from another source (docs/studies/shift.md, "The crop, on
# two sets and three schedules"), up to CROP_MEASURED_UNDER_SHIFT_UP_TO images seen: crops raised the other source's
# accuracy on both sets, and on one of them cost 0.05-0.07 on images like the training ones, more than the seeds'
# spread; nothing measured before training told the two sets apart. So auto never crops; past both ranges it stays at
# no crop, the choice measured, rather than extrapolate toward the ViT paper's 5-100 % over 250k+ images.
AUTO_CROP_MEASURED_UP_TO = 7_040  # training images seen: the longest same-source run where crops were compared
CROP_MEASURED_UNDER_SHIFT_UP_TO = 16_000  # the longest run of the shift study's crop arms


def auto_crop_scale(images_seen: int) -> tuple[tuple[float, float], str]:
    """The random-resized-crop area range data.crop_scale=auto stands for, and why, for a run that sees
    `images_seen` training images."""
    under_shift = ("where the eval images came from another source, crops gained there and cost up to 0.07 on images "
                   "like the training ones (docs/studies/shift.md)")
    if images_seen <= AUTO_CROP_MEASURED_UP_TO:
        return (1.0, 1.0), (f"every crop range measured up to {AUTO_CROP_MEASURED_UP_TO:,} training images seen lost to "
                            f"no crop or tied (docs/training.md: Small data), and {under_shift}")
    if images_seen <= CROP_MEASURED_UNDER_SHIFT_UP_TO:
        return (1.0, 1.0), (f"crops were measured up to {CROP_MEASURED_UNDER_SHIFT_UP_TO:,} training images seen, and "
                            f"only {under_shift}, so auto stays at no crop")
    return (1.0, 1.0), (f"crops are not measured beyond {CROP_MEASURED_UNDER_SHIFT_UP_TO:,} training images seen, so "
                        "auto stays at no crop")


# Where the run's own eval images likely come from another source (training.probe_checks.shift_test), the run is
# judged on that source. There the shift study measured random-resized crops of CROP_UNDER_SHIFT of the area against
# no crop, the run's eval split taken from the other source (docs/studies/shift.md, "When the run's eval images come
# from another source"): where a mirror image is the same thing to the base (the mirror test: ELPV's cells, icons)
# crops gained on the other source in every run of up to CROP_UNDER_SHIFT_GAINED_UP_TO images seen, and at 16,000
# they lost a little on both; on the digits, which a mirror turns into another symbol, they lost in three of four
# cells. So auto crops only where both tests say so, and only that far.
CROP_UNDER_SHIFT = (0.08, 1.0)  # the ViT recipe's range, the transformers example's too
CROP_UNDER_SHIFT_GAINED_UP_TO = 4_800  # training images seen: the longest run where the crop gained on both sets


def auto_crop_scale_under_shift(images_seen: int, mirror_keeps_labels: bool | None) -> tuple[tuple[float, float], str]:
    """data.crop_scale=auto for a run whose eval images likely come from another source, and why; `mirror_keeps_labels`:
    the mirror test's answer (None where it could not run)."""
    if images_seen > CROP_UNDER_SHIFT_GAINED_UP_TO:
        return (1.0, 1.0), (f"with eval images from another source crops gained up to "
                            f"{CROP_UNDER_SHIFT_GAINED_UP_TO:,} training images seen and lost a little on both sets "
                            "measured at 16,000, so auto stays at no crop")
    if not mirror_keeps_labels:
        return (1.0, 1.0), ("to the base a mirror image may be another thing (the mirror test: a digit, a letter), and "
                            "on digits crops lost on the other source in three of four cells (docs/studies/shift.md)")
    return CROP_UNDER_SHIFT, ("the eval images likely come from another source and to the base a mirror image is the "
                              "same thing; there, with the eval split from another source, crops raised its accuracy "
                              f"in every run of up to {CROP_UNDER_SHIFT_GAINED_UP_TO:,} training images seen, by "
                              "0.01-0.06 (docs/studies/shift.md)")


def crop_in_words(scale: tuple[float, float]) -> str:
    """A crop area range as the console names it."""
    low, high = scale
    return "no random crop" if (low, high) == (1.0, 1.0) else f"random crops of {low:.0%} to {high:.0%} of the area"


# The image processor's resampling filter (PIL's number) -> torch's uint8 kernel for it, which gives PIL's antialiased
# resize to within one grey level, about 3x faster on one core for ~512 px photos to 384 px. Training must resize
# as evaluation (the saved processor, which pipeline() runs) does: on 8 px digits upscaled to 56 px a head fitted on
# bicubic pixels lost accuracy on bilinear ones (docs/data.md). Filters not listed resize with PIL itself.
TORCH_RESIZE = {Image.Resampling.BILINEAR: "bilinear", Image.Resampling.BICUBIC: "bicubic"}


def resample_of(processor) -> int:
    """The PIL filter an image processor resizes with (bilinear when it names none)."""
    return int(getattr(processor, "resample", None) or Image.Resampling.BILINEAR)


def random_resized_crop_box(width: int, height: int, rng: random.Random, scale: tuple[float, float]) -> tuple[int, int, int, int]:
    """A crop box covering `scale` of the area with aspect ratio in [3/4, 4/3], as in the original ViT recipe."""
    if tuple(scale) == (1.0, 1.0) and width != height:
        # No crop asked, and a draw of the whole area at another aspect than the image's own never fits. (A square
        # image takes the draws below, which give it whole too: its random stream stays as measured.)
        return whole_image_box(width, height)
    area = width * height
    for _ in range(10):
        target_area = area * rng.uniform(*scale)
        aspect = np.exp(rng.uniform(np.log(3 / 4), np.log(4 / 3)))
        crop_w = int(round(np.sqrt(target_area * aspect)))
        crop_h = int(round(np.sqrt(target_area / aspect)))
        if 0 < crop_w <= width and 0 < crop_h <= height:
            left = rng.randint(0, width - crop_w)
            top = rng.randint(0, height - crop_h)
            return left, top, left + crop_w, top + crop_h
    return whole_image_box(width, height)


def whole_image_box(width: int, height: int) -> tuple[int, int, int, int]:
    """torchvision's fallback when no draw fits: the whole image, centre-cropped only to bring its aspect ratio
    into [3/4, 4/3]. Evaluation resizes the whole image, so within that range training without a crop sees what
    evaluation sees."""
    crop_w = min(width, round(height * 4 / 3))
    crop_h = min(height, round(width * 4 / 3))
    left, top = (width - crop_w) // 2, (height - crop_h) // 2
    return left, top, left + crop_w, top + crop_h


def train_transform(image: Image.Image, size: int, rng: random.Random, settings: DataSettings,
                    resample: int = Image.Resampling.BILINEAR) -> torch.Tensor:
    """Random resized crop + horizontal flip to a uint8 CHW tensor; the crop is resized with `resample` (PIL's
    filter number: the image processor's, resample_of)."""
    if settings.crop_scale == "auto":
        raise ValueError("train_transform needs data.crop_scale resolved (auto_crop_scale) before it runs")
    left, top, right, bottom = random_resized_crop_box(*image.size, rng, settings.crop_scale)
    mode = TORCH_RESIZE.get(resample)
    if mode is None:
        resized = image.crop((left, top, right, bottom)).resize((size, size), resample)
        pixels = torch.from_numpy(np.array(resized, dtype=np.uint8)).permute(2, 0, 1)
    else:
        crop = torch.from_numpy(np.array(image, dtype=np.uint8))[top:bottom, left:right].permute(2, 0, 1)
        pixels = torch.nn.functional.interpolate(crop[None], size=(size, size), mode=mode, antialias=True,
                                                 align_corners=False)[0]
    if settings.horizontal_flip is True and rng.random() < 0.5:  # auto is resolved before training
        pixels = pixels.flip(-1)
    return pixels.contiguous()


def sample_rng(seed: int, epoch: int, index: int) -> random.Random:
    """Augmentation randomness fixed by (seed, epoch, sample): resumes and worker counts cannot change it."""
    return random.Random(f"{seed}-{epoch}-{index}")
