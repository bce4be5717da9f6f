"""A streamed dataset's shards (parquet, WebDataset tar), looked at before training: each one whole and holding the
columns, and what a checkpoint records of them (what each holds, not where it was read).
"""

from __future__ import annotations

import os

from vit_finetune.core import hub
from vit_finetune.core.errors import DataError, excerpt
from vit_finetune.data.splits import CONTENT_HASH_LIMIT_BYTES, files_digest
from vit_finetune.recipe import DataSettings


# The shard formats datasets streams: parquet (push_to_hub), and WebDataset tar files (an image file and a .cls
# label per sample key; their labels are plain integers, named by data.label_names).
SHARD_SUFFIXES = (".parquet", ".tar")


def online_unless_the_user_is_offline():
    """Every process reads its own shards, so every process may talk to the Hub while opening and reading them, even
    one the run kept offline (hub.offline_unless); only the user's HF_HUB_OFFLINE keeps them all offline."""
    return hub.hub_offline(hub.offline_by_user())


def check_shards(files: list[str], split: str, columns: tuple[str, str], settings: DataSettings) -> int | None:
    """Stop before training at the first damaged shard of `split`, naming it and what is wrong: a parquet shard's
    footer must open (a small ranged read on the Hub) and list rows and the image and label columns; a local tar
    shard must hold each of its members whole. Returns the parquet shards' total rows (None for tar shards, which
    have no count short of reading them)."""
    total = 0
    for file in files:
        name = file.rsplit("/", 1)[-1]
        where = f"data.dataset={excerpt(settings.dataset)}: the shard {name!r} of split {split!r}"
        fix = "Fix: replace the shard with a whole copy, or remove it from the dataset"
        if file.endswith(".parquet"):
            rows, problem = parquet_rows(file, columns)
            total += rows
        else:
            problem = tar_problem(file)
        if problem:
            raise DataError(f"{where} {problem}. {fix}")
    return total if all(file.endswith(".parquet") for file in files) else None


def parquet_rows(file: str, columns: tuple[str, str]) -> tuple[int, str | None]:
    """(rows, None) for a usable parquet shard, else (0, what is wrong with it); only its footer is read."""
    import fsspec
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        with online_unless_the_user_is_offline(), fsspec.open(file, "rb") as handle:
            footer = pq.ParquetFile(handle)
            rows, names = footer.metadata.num_rows, footer.schema_arrow.names
    except pa.ArrowException as error:  # no footer: cut short, empty, or not parquet at all
        return 0, f"is not a readable parquet file (truncated, empty or damaged: {error})"
    except (OSError, ValueError) as error:
        return 0, f"cannot be read ({type(error).__name__}: {error})"
    missing = [column for column in columns if column not in names]
    if missing:
        return 0, f"has no column {missing[0]!r}: its columns are {excerpt(names)}, the other shards' {list(columns)}"
    if rows == 0:
        return 0, "holds no rows"
    return rows, None


def tar_problem(file: str) -> str | None:
    """What is wrong with a tar shard (None if nothing). A local one: its headers are read and each member's data is
    checked to end inside the file (a truncated tar otherwise ends early without a word). A Hub one, which reading
    whole would download: its last two blocks are read (one small ranged request) and must be the empty blocks
    that close every tar file, so one cut short is refused unless the cut happens to fall after a run of zeros."""
    import tarfile

    if "://" in file:
        return hub_tar_problem(file)
    try:
        size = os.path.getsize(file)
        with tarfile.open(file) as archive:  # headers only: each member's data is seeked over, not read
            for member in archive:
                if member.offset_data + member.size > size:
                    return (f"is truncated: its member {member.name!r} needs {member.offset_data + member.size:,} "
                            f"bytes, the file has {size:,}")
    except (tarfile.TarError, OSError) as error:
        return f"is not a readable tar file (truncated or damaged: {error})"
    return None


TAR_BLOCK = 512  # a tar file is whole 512-byte blocks, closed by two empty ones


def hub_tar_problem(file: str) -> str | None:
    """tar_problem for a shard on the Hub, from its size and its last two blocks."""
    import fsspec

    try:
        with online_unless_the_user_is_offline(), fsspec.open(file, "rb") as handle:
            size = handle.size
            if size < 2 * TAR_BLOCK or size % TAR_BLOCK:
                return f"is truncated: its {size:,} bytes are not a whole number of {TAR_BLOCK}-byte tar blocks"
            handle.seek(size - 2 * TAR_BLOCK)
            closing = handle.read(2 * TAR_BLOCK)
    except (OSError, ValueError) as error:
        return f"cannot be read ({type(error).__name__}: {error})"
    if closing.strip(b"\0"):
        return f"is truncated: its {size:,} bytes do not end with the two empty blocks that close a tar file"
    return None


def shard_identity(files: list[str]) -> list[str]:
    """What a checkpoint records of a split's shards: what each one holds, not where it was read. A Hub shard is
    named by its path in the repo, its size and its content hash from the Hub's metadata (the commit it was
    resolved at is left out: a commit that changes other files leaves it as it was); a local one by its size and a
    hash of its bytes while the local shards total at most data.CONTENT_HASH_LIMIT_BYTES (so a shard changed in
    place with its size and modification time kept is noticed), beyond that by its size and modification time
    (datasets' own rule for local files)."""
    import fsspec

    hashed = sum(os.path.getsize(file) for file in files if "://" not in file) <= CONTENT_HASH_LIMIT_BYTES
    named = []
    for file in files:
        if "://" not in file:
            stat = os.stat(file)
            named.append(f"{file} {stat.st_size} {files_digest([file]) if hashed else stat.st_mtime_ns}")
            continue
        filesystem, path = fsspec.core.url_to_fs(file)
        try:
            with online_unless_the_user_is_offline():
                info = filesystem.info(path)
        except (OSError, ValueError) as error:
            raise DataError(f"the shard {excerpt(file)} cannot be described by the Hub ({type(error).__name__}: "
                            f"{error}); check the connection, then run again") from None
        content = (info.get("lfs") or {}).get("sha256") or info.get("blob_id")  # the git blob's hash if not in LFS
        where = filesystem.resolve_path(path)  # HfFileSystem: the repo and the path in it, the commit apart
        named.append(f"{where.repo_type}s/{where.repo_id}/{where.path_in_repo} {info.get('size')} {content}")
    return named
