"""Data: any `datasets` source to train/eval splits, labels, decoding, augmentation and loaders, or a stream.

Images are decoded here (not by `datasets`) so a bad file is reported by its path or index. Training
batches leave the workers as uint8 and are normalised on the device; evaluation uses exactly the image
processor that is saved with the model, so reported accuracy is what a `pipeline()` user gets.

The package's modules follow the data's journey, lowest first (its errors, DataError and BadImageError, are in
core/errors.py): synthetic.py
(the demo's generated images), labels.py (label files: CSV or JSON Lines naming each image and its labels or
targets), opening.py (a dataset found and opened), targets.py (a regression's target columns read and checked),
splits.py (the train and eval splits, their columns, labels or targets, and what a checkpoint records of them),
pixels.py (decoding an image, transparency and flat images, the training crop and
resize), loaders.py (the datasets, the sampler, batches and loaders, and the normalisation on the device),
balance.py (skewed label counts: class weights or a balanced sampler), shards.py (a streamed dataset's shards
checked and named), streaming.py (a dataset read as a stream of shards while training) and augment.py (the batch augmentations, on the device).
"""

from __future__ import annotations

from vit_finetune.core.errors import BadImageError, DataError
from vit_finetune.data.labels import LABEL_COLUMN_NAMES
from vit_finetune.data.loaders import (
    EpochSampler, ImageClassificationDataset, PixelNormalizer, SKIPPED_LABEL, TARGET_ENCODINGS, blank_pixels, collate,
    cpu_cores, default_num_workers, eval_dataset, eval_pixels_from_processor, make_loader, train_dataset,
    train_dataset_as_evaluated,
)
from vit_finetune.data.opening import (
    BUILTIN_SHAPES, cache_dir, image_folders, is_hub_dataset_copy, is_local, open_dataset, preflight,
    refuse_unreachable,
)
from vit_finetune.data.pixels import (
    ALPHA_BACKGROUND_KEY, AUTO_CROP_MEASURED_UP_TO, CROP_MEASURED_UNDER_SHIFT_UP_TO, CROP_UNDER_SHIFT,
    CROP_UNDER_SHIFT_GAINED_UP_TO, FLAT_SPREAD, alpha_card_text, auto_crop_scale, auto_crop_scale_under_shift,
    crop_in_words, decode_image, decoding_settings, drawing_in_alpha, flat_images, is_flat, random_resized_crop_box,
    resample_of, sample_rng, train_transform,
)
from vit_finetune.data.splits import (
    CONTENT_HASH_LIMIT_BYTES, IMAGE_COLUMN_NAMES, Splits, detect_column, files_digest, identity, is_label_set,
    load_splits, relabel_by_name, target_encoding, training_facts, training_facts_notes,
)

__all__ = ["ALPHA_BACKGROUND_KEY", "AUTO_CROP_MEASURED_UP_TO", "BUILTIN_SHAPES", "CONTENT_HASH_LIMIT_BYTES",
           "CROP_MEASURED_UNDER_SHIFT_UP_TO", "CROP_UNDER_SHIFT", "CROP_UNDER_SHIFT_GAINED_UP_TO",
           "IMAGE_COLUMN_NAMES", "LABEL_COLUMN_NAMES", "SKIPPED_LABEL", "TARGET_ENCODINGS", "BadImageError",
           "DataError", "EpochSampler", "ImageClassificationDataset", "PixelNormalizer", "Splits", "alpha_card_text",
           "auto_crop_scale", "auto_crop_scale_under_shift",
           "blank_pixels", "cache_dir", "collate", "cpu_cores", "crop_in_words", "decode_image",
           "decoding_settings", "default_num_workers", "detect_column", "drawing_in_alpha", "eval_dataset",
           "eval_pixels_from_processor",
           "files_digest", "FLAT_SPREAD", "flat_images", "identity", "image_folders", "is_flat", "is_hub_dataset_copy",
           "preflight",
           "is_label_set", "is_local", "load_splits", "make_loader", "open_dataset",
           "random_resized_crop_box", "refuse_unreachable", "relabel_by_name", "resample_of", "sample_rng",
           "target_encoding", "train_dataset", "train_dataset_as_evaluated", "train_transform", "training_facts",
           "training_facts_notes"]
