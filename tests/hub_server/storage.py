"""The loopback Hub's storage: repos, their commits and branches, and the blobs their files point to.

A repo is a dict kept in memory: branches and tags (name -> commit sha), and commits (sha -> title, parents and
files). A commit's files map each path to an entry naming its blob by sha256, with the git object id the Hub
reports for it: the blob's own for a regular file, its LFS pointer's for an LFS file. Blobs live on disk under
`blobs/`, each written once, atomically. Which files go through LFS follows the repo's `.gitattributes` and the
file's size, as on the Hub.
"""

from __future__ import annotations

import datetime as _dt
import fnmatch
import hashlib
import json
import os
import pathlib
import re
import secrets
import tempfile
import time
from typing import Any

from .errors import HubError

LFS_SIZE_THRESHOLD = 10 * 1024 * 1024  # the Hub sends files above 10 MB through LFS whatever their name

_LFS_PATTERNS = [
    "*.7z", "*.arrow", "*.bin", "*.bz2", "*.ckpt", "*.ftz", "*.gz", "*.h5", "*.joblib", "*.lfs.*",
    "*.mlmodel", "*.model", "*.msgpack", "*.npy", "*.npz", "*.onnx", "*.ot", "*.parquet", "*.pb",
    "*.pickle", "*.pkl", "*.pt", "*.pth", "*.rar", "*.safetensors", "saved_model/**/*", "*.tar.*",
    "*.tar", "*.tflite", "*.tgz", "*.wasm", "*.xz", "*.zip", "*.zst", "*tfevents*",
]
_LFS_PATTERNS_DATASET_EXTRA = [
    "*.lz4", "*.mds", "*.mp3", "*.ogg", "*.wav", "*.flac", "*.jpg", "*.jpeg", "*.png", "*.webp",
]
DEFAULT_GITATTRIBUTES = "".join(f"{p} filter=lfs diff=lfs merge=lfs -text\n" for p in _LFS_PATTERNS)
DEFAULT_GITATTRIBUTES_DATASET = DEFAULT_GITATTRIBUTES + "".join(
    f"{p} filter=lfs diff=lfs merge=lfs -text\n" for p in _LFS_PATTERNS_DATASET_EXTRA
)

REPO_TYPES = ("model", "dataset", "space")


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def git_blob_sha1(data: bytes) -> str:
    """The git object id of a blob (what the Hub reports as a regular file's oid / ETag)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(sha256: str, size: int) -> bytes:
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()


def _looks_binary(sample: bytes) -> bool:
    return b"\x00" in sample


def _parse_gitattributes_lfs(content: str) -> list[str]:
    patterns = []
    for line in content.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        if any(attr == "filter=lfs" for attr in parts[1:]):
            patterns.append(parts[0])
    return patterns


def match_pattern(path: str, pattern: str) -> bool:
    """Approximate gitattributes/gitignore matching: a pattern without '/' matches the basename anywhere."""
    pattern = pattern.lstrip("/") if pattern.startswith("/") else pattern
    if pattern.endswith("/"):
        pattern = pattern + "**"
    if "/" not in pattern:
        return fnmatch.fnmatchcase(path.rsplit("/", 1)[-1], pattern)
    return fnmatch.fnmatchcase(path, pattern.replace("**/", "*").replace("/**", "/*"))


class Store:
    """Repos, commits and blobs. All access goes through `lock` (held by the server)."""

    def __init__(self, root: pathlib.Path):
        self.root = root
        self.blob_dir = root / "blobs"
        self.tmp_dir = root / "tmp"
        self.blob_dir.mkdir(parents=True, exist_ok=True)
        self.tmp_dir.mkdir(parents=True, exist_ok=True)
        self.repos: dict[str, dict] = {}  # key "type:id"
        self._counter = 0

    # blobs ----------------------------------------------------------------------------------------
    def blob_path(self, sha256: str) -> pathlib.Path:
        return self.blob_dir / sha256[:2] / sha256

    def has_blob(self, sha256: str) -> bool:
        return self.blob_path(sha256).is_file()

    def put_blob(self, data: bytes) -> str:
        sha = hashlib.sha256(data).hexdigest()
        path = self.blob_path(sha)
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.tmp_dir)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        return sha

    def adopt_blob_file(self, tmp_path: str, sha256: str) -> None:
        path = self.blob_path(sha256)
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists():
            os.unlink(tmp_path)
        else:
            os.replace(tmp_path, path)

    def read_blob(self, sha256: str) -> bytes:
        return self.blob_path(sha256).read_bytes()

    def file_entry(self, data: bytes, lfs: bool) -> dict:
        sha = self.put_blob(data)
        return self.entry_for_blob(sha, len(data), lfs, data=data)

    def entry_for_blob(self, sha256: str, size: int, lfs: bool, data: bytes | None = None) -> dict:
        if lfs:
            pointer = lfs_pointer(sha256, size)
            return {"sha256": sha256, "size": size, "lfs": True, "oid": git_blob_sha1(pointer),
                    "pointer_size": len(pointer)}
        if data is None:
            data = self.read_blob(sha256)
        return {"sha256": sha256, "size": size, "lfs": False, "oid": git_blob_sha1(data)}

    # repos ----------------------------------------------------------------------------------------
    @staticmethod
    def key(repo_type: str, repo_id: str) -> str:
        return f"{repo_type}:{repo_id}"

    def get(self, repo_type: str, repo_id: str) -> dict | None:
        return self.repos.get(self.key(repo_type, repo_id))

    def new_sha(self, *parts: Any) -> str:
        self._counter += 1
        h = hashlib.sha1()
        h.update(json.dumps([self._counter, time.time(), secrets.token_hex(8), *map(str, parts)]).encode())
        return h.hexdigest()

    def create_repo(self, repo_type: str, repo_id: str, private: bool, owner: str | None) -> dict:
        now = now_iso()
        repo = {
            "id": repo_id,
            "type": repo_type,
            "private": bool(private),
            "owner": owner,
            "created_at": now,
            "uid": secrets.token_hex(12),
            "branches": {},
            "tags": {},
            "commits": {},  # sha -> commit
            "pr_count": 0,
        }
        self.repos[self.key(repo_type, repo_id)] = repo
        gitattributes = DEFAULT_GITATTRIBUTES_DATASET if repo_type == "dataset" else DEFAULT_GITATTRIBUTES
        files = {".gitattributes": self.file_entry(gitattributes.encode(), lfs=False)}
        self.make_commit(repo, "main", files, "initial commit", "", author=owner, create_branch=True)
        return repo

    def make_commit(self, repo: dict, branch: str, files: dict, title: str, description: str,
                    author: str | None, create_branch: bool = False, parent: str | None = "__branch__") -> str:
        if parent == "__branch__":
            parent = repo["branches"].get(branch)
            if parent is None and not create_branch:
                raise HubError(404, f"Invalid rev id: {branch}", "RevisionNotFound")
        sha = self.new_sha(repo["id"], branch, title, parent)
        repo["commits"][sha] = {
            "id": sha,
            "parents": [parent] if parent else [],
            "title": title,
            "message": description,
            "date": now_iso(),
            "authors": [author] if author else [],
            "files": files,
        }
        repo["branches"][branch] = sha
        return sha

    def resolve_revision(self, repo: dict, revision: str) -> str:
        if revision in repo["branches"]:
            return repo["branches"][revision]
        if revision.startswith("refs/heads/") and revision[11:] in repo["branches"]:
            return repo["branches"][revision[11:]]
        if revision in repo["tags"]:
            return repo["tags"][revision]
        if revision.startswith("refs/tags/") and revision[10:] in repo["tags"]:
            return repo["tags"][revision[10:]]
        if revision in repo["commits"]:
            return revision
        if re.fullmatch(r"[0-9a-f]{7,39}", revision):
            found = [sha for sha in repo["commits"] if sha.startswith(revision)]
            if len(found) == 1:
                return found[0]
        raise HubError(404, f"Invalid rev id: {revision}", "RevisionNotFound")

    def history(self, repo: dict, sha: str) -> list[dict]:
        out = []
        while sha:
            commit = repo["commits"][sha]
            out.append(commit)
            sha = commit["parents"][0] if commit["parents"] else None
        return out

    # LFS ------------------------------------------------------------------------------------------
    def lfs_patterns(self, tree: dict) -> list[str]:
        entry = tree.get(".gitattributes")
        if entry is None:
            return []
        try:
            return _parse_gitattributes_lfs(self.read_blob(entry["sha256"]).decode("utf-8", "replace"))
        except OSError:
            return []

    def is_lfs(self, path: str, size: int, sample: bytes, patterns: list[str]) -> bool:
        if size == 0:
            return False
        if size >= LFS_SIZE_THRESHOLD:
            return True
        if any(match_pattern(path, p) for p in patterns):
            return True
        return _looks_binary(sample)
