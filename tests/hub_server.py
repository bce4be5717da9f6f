"""A loopback, Hub-compatible HTTP server for tests.

The real, unmodified clients (huggingface_hub, transformers, datasets, peft) talk to it through
``HF_ENDPOINT=http://127.0.0.1:PORT``. It speaks the subset of the Hub protocol those clients use:

* repo info        GET  /api/{models,datasets,spaces}/{id}[/revision/{rev}]
* tree listing     GET  /api/{type}s/{id}/tree/{rev}[/{path}]   (recursive, expand, cursor pagination)
* paths info       POST /api/{type}s/{id}/paths-info/{rev}       (form-encoded or JSON)
* refs / commits   GET  /api/{type}s/{id}/refs, /api/{type}s/{id}/commits/{rev}
* branches / tags  POST/DELETE /api/{type}s/{id}/branch/{branch}, POST /api/{type}s/{id}/tag/{rev}
* file download    HEAD/GET /[datasets/|spaces/]{id}/resolve/{rev}/{path}  (Range, ETag, X-Repo-Commit, ...)
* whoami           GET  /api/whoami-v2
* repo admin       POST /api/repos/create, DELETE /api/repos/delete, PUT /api/{type}s/{id}/settings
* upload           POST /api/{type}s/{id}/preupload/{rev}
                   POST /[datasets/]{id}.git/info/lfs/objects/batch   ("basic" transfer)
                   PUT  /lfs-upload/{sha256}?sig=...                  (the href handed out by the batch call)
                   POST /api/{type}s/{id}/commit/{rev}                (NDJSON: header/file/lfsFile/deleted*)
* card check       POST /api/validate-yaml
* misc             GET  /api/agent-harnesses (the client fetches it to build its user agent)

Xet is not implemented: clients must run with ``HF_HUB_DISABLE_XET=1`` when uploading (with hf_xet
installed, huggingface_hub 2.x sends every upload through Xet and has no fallback). Downloads work
either way because the server never sends Xet headers.

Standard library only, apart from PyYAML (a hard dependency of huggingface_hub) for README front matter;
a tiny fallback parser is used if it is missing.

Usage::

    with HubServer(tmp_path) as hub:
        os.environ["HF_ENDPOINT"] = hub.url     # before huggingface_hub is imported!
        ...

Repos are created the way the real Hub creates them: ``create_repo`` (and ``add_repo``) make an
"initial commit" holding a default ``.gitattributes``; every commit gets a fresh 40-hex sha; branches,
tags and all older revisions stay readable by sha.
"""

from __future__ import annotations

import base64
import copy
import datetime as _dt
import fnmatch
import hashlib
import hmac
import json
import os
import pathlib
import re
import secrets
import tempfile
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Iterable

__all__ = ["HubServer", "FaultRule", "RequestRecord", "DEFAULT_TOKEN", "DEFAULT_GITATTRIBUTES"]

DEFAULT_TOKEN = "hf_test_token"
LFS_SIZE_THRESHOLD = 10 * 1024 * 1024  # the Hub sends files above 10 MB through LFS whatever their name
TREE_PAGE_SIZE = 1000
TREE_PAGE_SIZE_EXPANDED = 50
COMMITS_PAGE_SIZE = 50

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
_URL_PREFIX = {"model": "", "dataset": "datasets/", "space": "spaces/"}
_REPO_ID_PART = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")

# architecture suffix -> pipeline tag (the Hub infers pipeline_tag from config.json this way)
_ARCH_SUFFIX_TO_TASK = [
    ("ForImageClassification", "image-classification"),
    ("ForSequenceClassification", "text-classification"),
    ("ForTokenClassification", "token-classification"),
    ("ForQuestionAnswering", "question-answering"),
    ("ForMaskedLM", "fill-mask"),
    ("ForCausalLM", "text-generation"),
    ("ForConditionalGeneration", "text2text-generation"),
    ("ForObjectDetection", "object-detection"),
    ("ForSemanticSegmentation", "image-segmentation"),
    ("ForAudioClassification", "audio-classification"),
    ("ForCTC", "automatic-speech-recognition"),
    ("ForDepthEstimation", "depth-estimation"),
    ("ForMaskedImageModeling", "image-feature-extraction"),
]


# --------------------------------------------------------------------------------------------------
# small helpers
# --------------------------------------------------------------------------------------------------
def _now_iso() -> str:
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


def _match_pattern(path: str, pattern: str) -> bool:
    """Approximate gitattributes/gitignore matching: a pattern without '/' matches the basename anywhere."""
    pattern = pattern.lstrip("/") if pattern.startswith("/") else pattern
    if pattern.endswith("/"):
        pattern = pattern + "**"
    if "/" not in pattern:
        return fnmatch.fnmatchcase(path.rsplit("/", 1)[-1], pattern)
    return fnmatch.fnmatchcase(path, pattern.replace("**/", "*").replace("/**", "/*"))


def _split_front_matter(content: str) -> tuple[str | None, str]:
    """Return (yaml_text or None, body) for a README with '---' front matter."""
    text = content.lstrip("\ufeff")
    if not text.startswith("---"):
        return None, content
    lines = text.splitlines(keepends=True)
    if lines[0].strip() != "---":
        return None, content
    for i in range(1, len(lines)):
        if lines[i].strip() == "---":
            return "".join(lines[1:i]), "".join(lines[i + 1 :])
    return None, content


def _yaml_load(text: str) -> Any:
    try:
        import yaml  # PyYAML is a hard dependency of huggingface_hub
    except ImportError:  # pragma: no cover - fallback for environments without PyYAML
        return _mini_yaml(text)
    return yaml.safe_load(text)


def _mini_yaml(text: str) -> dict:  # pragma: no cover - only used without PyYAML
    """Very small YAML subset: `key: value` and `key:` followed by `- item` lines."""
    out: dict[str, Any] = {}
    key = None
    for raw in text.splitlines():
        if not raw.strip() or raw.lstrip().startswith("#"):
            continue
        if raw.lstrip().startswith("- ") and key is not None:
            if not isinstance(out.get(key), list):
                out[key] = []
            out[key].append(raw.lstrip()[2:].strip().strip("'\""))
            continue
        if ":" not in raw or raw.startswith(" "):
            continue
        key, _, value = raw.partition(":")
        key = key.strip()
        value = value.strip()
        out[key] = value.strip("'\"") if value else None
    return out


def _looks_like_local_path(value: str) -> bool:
    v = value.strip()
    return (
        v.startswith(("/", "./", "../", "~", "\\", ".\\"))
        or v in (".", "..")
        or bool(re.match(r"^[A-Za-z]:[\\/]", v))
        or "\\" in v
    )


def _as_str_list(value: Any) -> list | None:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        return value
    return None


def validate_card_metadata(content: str, repo_type: str = "model") -> tuple[list[dict], list[dict]]:
    """A light version of the Hub's README metadata check. Returns (errors, warnings)."""
    errors: list[dict] = []
    warnings: list[dict] = []
    yaml_text, _ = _split_front_matter(content)
    if yaml_text is None or not yaml_text.strip():
        warnings.append({"message": "empty or missing yaml metadata in repo card"})
        return errors, warnings
    try:
        meta = _yaml_load(yaml_text)
    except Exception as e:  # yaml.YAMLError and friends
        errors.append({"message": f"Invalid YAML in README.md metadata: {e}"})
        return errors, warnings
    if meta is None:
        warnings.append({"message": "empty or missing yaml metadata in repo card"})
        return errors, warnings
    if not isinstance(meta, dict):
        errors.append({"message": "README.md metadata must be a YAML mapping"})
        return errors, warnings

    for key in ("datasets", "base_model"):
        if key not in meta:
            continue
        items = _as_str_list(meta[key])
        if items is None:
            errors.append({"message": f'"{key}" must be a string or an array of strings'})
            continue
        for item in items:
            if not isinstance(item, str):
                errors.append({"message": f'"{key}" must be a string or an array of strings'})
            elif _looks_like_local_path(item) or not item.strip():
                hint = ("dataset id from https://hf.co/datasets" if key == "datasets"
                        else "model id from https://hf.co/models")
                errors.append(
                    {"message": f'"{key}" with value "{item}" is not valid. It must be a Hub id: use a {hint}.'}
                )
    for key in ("tags", "language"):
        if key in meta:
            items = _as_str_list(meta[key])
            if items is None or not all(isinstance(i, str) for i in items):
                errors.append({"message": f'"{key}" must be a string or an array of strings'})
    for key in ("license", "pipeline_tag", "library_name"):
        if key in meta and meta[key] is not None and not isinstance(meta[key], str):
            errors.append({"message": f'"{key}" must be a string'})
    return errors, warnings


class _HTTPError(Exception):
    def __init__(self, status: int, message: str, error_code: str | None = None, headers: dict | None = None,
                 body: Any = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.error_code = error_code
        self.headers = headers or {}
        self.body = body


# --------------------------------------------------------------------------------------------------
# public records
# --------------------------------------------------------------------------------------------------
@dataclass
class FaultRule:
    """Make the next `times` requests matching (method, path_regex) fail with `status`.

    `times=None` means "always". `delay` (seconds) is slept before answering (with the fault status, or
    with the normal answer when `status` is None: a pure slow-down, a stalled Hub when long). `reset=True`
    drops the connection instead of answering (a TCP reset after reading the request): the client sees a
    connection error, not an HTTP status.
    """

    status: int | None = 503
    times: int | None = 1
    path_regex: str | None = None
    method: str | None = None
    delay: float = 0.0
    message: str = "Injected fault"
    reset: bool = False
    hits: int = 0

    def matches(self, method: str, path: str) -> bool:
        if self.times is not None and self.hits >= self.times:
            return False
        if self.method is not None and self.method.upper() != method.upper():
            return False
        if self.path_regex is not None and re.search(self.path_regex, path) is None:
            return False
        return True

    @property
    def exhausted(self) -> bool:
        return self.times is not None and self.hits >= self.times


@dataclass
class RequestRecord:
    method: str
    path: str  # path and query string, as sent
    status: int
    user: str | None  # user of the bearer token (None if no/invalid token)
    user_agent: str
    client: tuple  # (host, port) of the client socket
    time: float = field(default_factory=time.time)
    faulted: bool = False
    client_pid: int | None = None  # the process that holds the client socket, when HubServer.identify_clients is on

    @property
    def route(self) -> str:
        """The path without the query string."""
        return self.path.split("?", 1)[0]


# --------------------------------------------------------------------------------------------------
# storage
# --------------------------------------------------------------------------------------------------
class _Store:
    """Repos, commits and blobs. All access goes through `lock` (held by the server)."""

    def __init__(self, root: pathlib.Path):
        self.root = root
        self.blob_dir = root / "blobs"
        self.tmp_dir = root / "tmp"
        self.blob_dir.mkdir(parents=True, exist_ok=True)
        self.tmp_dir.mkdir(parents=True, exist_ok=True)
        self.state_path = root / "state.json"
        self.repos: dict[str, dict] = {}  # key "type:id"
        self._counter = 0
        if self.state_path.exists():
            data = json.loads(self.state_path.read_text())
            self.repos = data.get("repos", {})
            self._counter = data.get("counter", 0)

    # persistence ------------------------------------------------------------------------------
    def save(self) -> None:
        tmp = self.state_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps({"repos": self.repos, "counter": self._counter}))
        os.replace(tmp, self.state_path)

    # blobs --------------------------------------------------------------------------------------
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

    # repos --------------------------------------------------------------------------------------
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
        now = _now_iso()
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
                raise _HTTPError(404, f"Invalid rev id: {branch}", "RevisionNotFound")
        sha = self.new_sha(repo["id"], branch, title, parent)
        repo["commits"][sha] = {
            "id": sha,
            "parents": [parent] if parent else [],
            "title": title,
            "message": description,
            "date": _now_iso(),
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
        raise _HTTPError(404, f"Invalid rev id: {revision}", "RevisionNotFound")

    def history(self, repo: dict, sha: str) -> list[dict]:
        out = []
        while sha:
            commit = repo["commits"][sha]
            out.append(commit)
            sha = commit["parents"][0] if commit["parents"] else None
        return out


# --------------------------------------------------------------------------------------------------
# the server
# --------------------------------------------------------------------------------------------------
class HubServer:
    """A Hub-compatible HTTP server on 127.0.0.1, serving from a daemon thread.

    Args:
        storage_dir: directory for blobs and the repo state (``state.json``); reused if it exists.
        tokens: ``{token: user}`` or ``{token: (user, "read" | "write")}``. Default ``{"hf_test_token": "user"}``.
        host, port: where to bind (port 0 = any free port).
        lfs_threshold: files at least this large go through LFS whatever their name (Hub: 10 MB).
    """

    def __init__(self, storage_dir: str | os.PathLike, tokens: dict | None = None, host: str = "127.0.0.1",
                 port: int = 0, lfs_threshold: int = LFS_SIZE_THRESHOLD):
        self.storage_dir = pathlib.Path(storage_dir)
        self.storage_dir.mkdir(parents=True, exist_ok=True)
        self.tokens: dict[str, tuple[str, str]] = {}
        for token, value in (tokens if tokens is not None else {DEFAULT_TOKEN: "user"}).items():
            self.tokens[token] = (value, "write") if isinstance(value, str) else (value[0], value[1])
        self.host = host
        self._requested_port = port
        self.lfs_threshold = lfs_threshold
        self.lock = threading.RLock()
        self._store = _Store(self.storage_dir)
        self._faults: list[FaultRule] = []
        self._log: list[RequestRecord] = []
        # Requests being answered: a client may read its answer before the handler's `finally` logs it, so the log
        # is read only once none is in flight (else a test asserting right after a request can see it missing).
        # A request begun before clear_log() (a stalled one from an earlier test) belongs to an older generation:
        # it is neither waited for nor logged.
        self._in_flight = 0
        self._generation = 0
        self._settled = threading.Condition(self.lock)
        # Which process sent each request (RequestRecord.client_pid): off by default, as it scans every process's
        # sockets once per connection.
        self.identify_clients = False
        self._secret = secrets.token_bytes(16)
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # lifecycle ----------------------------------------------------------------------------------
    def start(self) -> "HubServer":
        if self._httpd is not None:
            return self
        handler = type("_BoundHandler", (_Handler,), {"hub": self})
        httpd = ThreadingHTTPServer((self.host, self._requested_port), handler)
        httpd.daemon_threads = True
        self._httpd = httpd
        self._thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.1},
                                        name="loopback-hub", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._httpd is None:
            return
        self._httpd.shutdown()
        self._httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._httpd = None
        self._thread = None

    def __enter__(self) -> "HubServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def port(self) -> int:
        if self._httpd is None:
            raise RuntimeError("server not started")
        return self._httpd.server_address[1]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    # faults -------------------------------------------------------------------------------------
    def inject_faults(self, status: int | None = 503, times: int | None = 1, path_regex: str | None = None,
                      method: str | None = None, delay: float = 0.0, message: str = "Injected fault",
                      reset: bool = False) -> FaultRule:
        """Make the next `times` requests whose path (with query) matches `path_regex` (re.search) and whose
        method matches `method` fail with `status` (or, with `reset=True`, with a dropped connection). `times=None`
        = always. Returns the rule (see `.hits`)."""
        rule = FaultRule(status=status, times=times, path_regex=path_regex, method=method, delay=delay,
                         message=message, reset=reset)
        with self.lock:
            self._faults.append(rule)
        return rule

    def clear_faults(self) -> None:
        with self.lock:
            self._faults.clear()

    def _take_fault(self, method: str, path: str) -> FaultRule | None:
        with self.lock:
            for rule in self._faults:
                if rule.matches(method, path):
                    rule.hits += 1
                    return rule
        return None

    # request log --------------------------------------------------------------------------------
    @property
    def request_log(self) -> list[RequestRecord]:
        with self.lock:
            self._settled.wait_for(lambda: self._in_flight == 0, timeout=10)
            return list(self._log)

    def requests(self, method: str | None = None, path_regex: str | None = None,
                 status: int | None = None) -> list[RequestRecord]:
        """Logged requests, filtered by method, `re.search(path_regex, path)` and status."""
        log = self.request_log
        return [
            r for r in log
            if (method is None or r.method == method.upper())
            and (path_regex is None or re.search(path_regex, r.path))
            and (status is None or r.status == status)
        ]

    def clear_log(self) -> None:
        with self.lock:
            self._log.clear()
            self._generation += 1
            self._in_flight = 0

    def _begin_request(self) -> int:
        """Count a request in flight; returns the log generation it belongs to."""
        with self.lock:
            self._in_flight += 1
            return self._generation

    def _record(self, rec: RequestRecord, generation: int) -> None:
        """Log a request once it is answered, and mark it no longer in flight (if the log was not cleared since)."""
        with self.lock:
            if generation != self._generation:
                return
            self._log.append(rec)
            self._in_flight -= 1
            self._settled.notify_all()

    # auth ---------------------------------------------------------------------------------------
    def add_token(self, token: str, user: str, role: str = "write") -> None:
        with self.lock:
            self.tokens[token] = (user, role)

    # seeding / inspection helpers (used by tests; no HTTP involved) -------------------------------
    def add_repo(self, repo_id: str, files: dict[str, bytes | str | os.PathLike] | None = None,
                 repo_type: str = "model", private: bool = False, commit_message: str = "Add files",
                 exist_ok: bool = False) -> str:
        """Create a repo (with the Hub's initial `.gitattributes` commit) and commit `files` into it.
        Returns the sha of `main`. Values are bytes, str (text) or a pathlib.Path to read. With
        `exist_ok=True` an existing repo keeps its visibility and gets `files` as a new commit."""
        self._check_type(repo_type)
        with self.lock:
            repo = self._store.get(repo_type, repo_id)
            if repo is not None and not exist_ok:
                raise ValueError(f"{repo_type} repo {repo_id} exists")
            if repo is None:
                repo = self._store.create_repo(repo_type, repo_id, private, owner=repo_id.split("/")[0])
            sha = repo["branches"]["main"]
            if files:
                sha = self._commit_files_locked(repo, files, commit_message)
            self._store.save()
            return sha

    def commit_files(self, repo_id: str, files: dict[str, bytes | str | os.PathLike] | None = None,
                     deletions: Iterable[str] = (), repo_type: str = "model", branch: str = "main",
                     commit_message: str = "Update files") -> str:
        """Commit `files` (added/overwritten) and `deletions` to `branch` directly. Returns the commit sha."""
        with self.lock:
            repo = self._get_repo_or_raise(repo_type, repo_id)
            sha = self._commit_files_locked(repo, files or {}, commit_message, deletions, branch)
            self._store.save()
            return sha

    def _commit_files_locked(self, repo: dict, files: dict, message: str, deletions: Iterable[str] = (),
                             branch: str = "main") -> str:
        head = repo["branches"].get(branch)
        if head is None:
            raise ValueError(f"no branch {branch}")
        tree = dict(repo["commits"][head]["files"])
        for path in deletions:
            tree.pop(path, None)
        lfs_patterns = self._lfs_patterns(tree)
        for path, value in files.items():
            if isinstance(value, (str,)) and not isinstance(value, os.PathLike):
                data = value.encode()
            elif isinstance(value, os.PathLike):
                data = pathlib.Path(value).read_bytes()
            else:
                data = bytes(value)
            lfs = self._is_lfs(path, len(data), data[:512], lfs_patterns)
            tree[path.lstrip("/")] = self._store.file_entry(data, lfs)
        return self._store.make_commit(repo, branch, tree, message, "", author=repo.get("owner"))

    def repo_files(self, repo_id: str, repo_type: str = "model", revision: str = "main") -> dict[str, bytes]:
        """{path: content} of the repo at `revision` (includes the `.gitattributes` of the initial commit)."""
        with self.lock:
            repo = self._get_repo_or_raise(repo_type, repo_id)
            sha = self._resolve_rev(repo, revision)
            files = dict(repo["commits"][sha]["files"])
        return {path: self._store.read_blob(e["sha256"]) for path, e in sorted(files.items())}

    def commits(self, repo_id: str, repo_type: str = "model", revision: str = "main") -> list[dict]:
        """History of `revision`, newest first: dicts with id, title, message, parents, date, authors, files
        (the sorted list of paths in that commit's tree)."""
        with self.lock:
            repo = self._get_repo_or_raise(repo_type, repo_id)
            sha = self._resolve_rev(repo, revision)
            hist = self._store.history(repo, sha)
            return [
                {**{k: copy.deepcopy(v) for k, v in c.items() if k != "files"}, "files": sorted(c["files"])}
                for c in hist
            ]

    def head(self, repo_id: str, repo_type: str = "model", revision: str = "main") -> str:
        with self.lock:
            repo = self._get_repo_or_raise(repo_type, repo_id)
            return self._resolve_rev(repo, revision)

    def repo_exists(self, repo_id: str, repo_type: str = "model") -> bool:
        with self.lock:
            return self._store.get(repo_type, repo_id) is not None

    def is_private(self, repo_id: str, repo_type: str = "model") -> bool:
        with self.lock:
            return bool(self._get_repo_or_raise(repo_type, repo_id)["private"])

    def set_private(self, repo_id: str, private: bool, repo_type: str = "model") -> None:
        with self.lock:
            self._get_repo_or_raise(repo_type, repo_id)["private"] = bool(private)
            self._store.save()

    def lfs_files(self, repo_id: str, repo_type: str = "model", revision: str = "main") -> set[str]:
        """Paths stored as LFS at `revision`."""
        with self.lock:
            repo = self._get_repo_or_raise(repo_type, repo_id)
            sha = self._resolve_rev(repo, revision)
            return {p for p, e in repo["commits"][sha]["files"].items() if e["lfs"]}

    def list_repos(self, repo_type: str | None = None) -> list[str]:
        with self.lock:
            return sorted(r["id"] for r in self._store.repos.values() if repo_type in (None, r["type"]))

    def delete_repo(self, repo_id: str, repo_type: str = "model") -> None:
        with self.lock:
            self._store.repos.pop(self._store.key(repo_type, repo_id), None)
            self._store.save()

    # internals ----------------------------------------------------------------------------------
    @staticmethod
    def _check_type(repo_type: str) -> None:
        if repo_type not in REPO_TYPES:
            raise ValueError(f"repo_type must be one of {REPO_TYPES}, got {repo_type!r}")

    def _resolve_rev(self, repo: dict, revision: str) -> str:
        try:
            return self._store.resolve_revision(repo, revision)
        except _HTTPError as e:
            raise KeyError(f"{repo['type']} repo {repo['id']}: no revision {revision!r}") from e

    def _get_repo_or_raise(self, repo_type: str, repo_id: str) -> dict:
        self._check_type(repo_type)
        repo = self._store.get(repo_type, repo_id)
        if repo is None:
            raise KeyError(f"no {repo_type} repo {repo_id}")
        return repo

    def _lfs_patterns(self, tree: dict) -> list[str]:
        entry = tree.get(".gitattributes")
        if entry is None:
            return []
        try:
            return _parse_gitattributes_lfs(self._store.read_blob(entry["sha256"]).decode("utf-8", "replace"))
        except OSError:
            return []

    def _is_lfs(self, path: str, size: int, sample: bytes, patterns: list[str]) -> bool:
        if size == 0:
            return False
        if size >= self.lfs_threshold:
            return True
        if any(_match_pattern(path, p) for p in patterns):
            return True
        return _looks_binary(sample)

    def _sign(self, oid: str, size: int) -> str:
        return hmac.new(self._secret, f"{oid}:{size}".encode(), hashlib.sha256).hexdigest()[:32]


# --------------------------------------------------------------------------------------------------
# request handler
# --------------------------------------------------------------------------------------------------
_API_KEYWORDS = {"revision", "tree", "paths-info", "preupload", "commit", "commits", "refs", "branch", "tag",
                 "settings", "xet-write-token", "xet-read-token", "discussions", "parquet", "treesize",
                 "resolve", "lfs-files", "super-squash"}


def _take_revision(segs: list[str]) -> tuple[str, str]:
    """Split `rev/path...` into (rev, path). Clients quote revisions ('refs%2Fpr%2F1'), except that
    HfFileSystem leaves special refs ('refs/pr/1', 'refs/convert/parquet') unquoted in URLs."""
    if len(segs) >= 3 and segs[0] == "refs" and segs[1] in ("pr", "convert", "heads", "tags"):
        return "/".join(segs[:3]), "/".join(segs[3:])
    return segs[0], "/".join(segs[1:])


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "LoopbackHub/1.0"
    hub: HubServer  # set on the subclass bound to a server

    # quiet
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        pass

    # entry points -------------------------------------------------------------------------------
    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_HEAD(self) -> None:
        self._dispatch("HEAD")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    def do_PATCH(self) -> None:
        self._dispatch("PATCH")

    # plumbing -----------------------------------------------------------------------------------
    def _dispatch(self, method: str) -> None:
        self._status = 0
        self._body_consumed = False
        self._user, self._role, self._bad_token = self._authenticate()
        raw_path, _, query = self.path.partition("?")
        self._query = urllib.parse.parse_qs(query, keep_blank_values=True)
        self._segments = [urllib.parse.unquote(s) for s in raw_path.split("/")[1:]]
        faulted = False
        generation = self.hub._begin_request()  # before any answer can reach the client (see HubServer._in_flight)
        try:
            rule = self.hub._take_fault(method, self.path)
            if rule is not None:
                if rule.delay:
                    time.sleep(rule.delay)
                if rule.reset:
                    faulted = True
                    self._drain_body()
                    self._reset_connection()
                    return
                if rule.status is not None:
                    faulted = True
                    self._drain_body()
                    raise _HTTPError(rule.status, rule.message)
            self._route(method)
        except _HTTPError as e:
            self._drain_body()
            self._send_error(e)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception as e:  # a server bug: answer 500 so the client does not hang
            import traceback

            traceback.print_exc()
            try:
                self._drain_body()
                self._send_error(_HTTPError(500, f"Internal error in loopback Hub: {e!r}"))
            except Exception:
                self.close_connection = True
        finally:
            self.hub._record(RequestRecord(
                method=method, path=self.path, status=self._status, user=self._user,
                user_agent=self.headers.get("User-Agent", ""), client=tuple(self.client_address),
                faulted=faulted, client_pid=self._client_pid() if self.hub.identify_clients else None,
            ), generation)

    def _client_pid(self) -> int | None:
        """The pid of the process whose socket is this connection's other end (the same machine: loopback); found
        once per connection, while it is open."""
        if not hasattr(self, "_client_pid_found"):
            import psutil

            client = tuple(self.client_address)
            self._client_pid_found = next((c.pid for c in psutil.net_connections("tcp")
                                           if c.laddr and tuple(c.laddr) == client), None)
        return self._client_pid_found

    def _reset_connection(self) -> None:
        """Close the socket with SO_LINGER 0, so the kernel sends a TCP reset and no answer reaches the client."""
        import socket
        import struct

        self.close_connection = True
        try:
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.connection.close()
        except OSError:
            pass

    def _authenticate(self) -> tuple[str | None, str | None, bool]:
        auth = self.headers.get("Authorization")
        if not auth:
            return None, None, False
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None, None, True
        with self.hub.lock:
            found = self.hub.tokens.get(token.strip())
        if found is None:
            return None, None, True
        return found[0], found[1], False

    def _base_url(self) -> str:
        host = self.headers.get("Host") or f"{self.hub.host}:{self.hub.port}"
        return f"http://{host}"

    # body reading -------------------------------------------------------------------------------
    def _iter_body(self, chunk_size: int = 1 << 20):
        if self._body_consumed:
            return
        self._body_consumed = True
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            while True:
                line = self.rfile.readline()
                size = int(line.split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return
                remaining = size
                while remaining:
                    data = self.rfile.read(min(remaining, chunk_size))
                    if not data:
                        raise ConnectionResetError("client closed mid-chunk")
                    remaining -= len(data)
                    yield data
                self.rfile.readline()  # CRLF after each chunk
        else:
            remaining = int(self.headers.get("Content-Length") or 0)
            while remaining > 0:
                data = self.rfile.read(min(remaining, chunk_size))
                if not data:
                    raise ConnectionResetError("client closed mid-body")
                remaining -= len(data)
                yield data

    def _read_body(self) -> bytes:
        return b"".join(self._iter_body())

    def _drain_body(self) -> None:
        try:
            for _ in self._iter_body():
                pass
        except Exception:
            self.close_connection = True

    def _json_body(self) -> Any:
        body = self._read_body()
        ctype = self.headers.get("Content-Type", "")
        if "application/x-www-form-urlencoded" in ctype:
            return urllib.parse.parse_qs(body.decode(), keep_blank_values=True)
        if not body:
            return {}
        try:
            return json.loads(body)
        except ValueError:
            raise _HTTPError(400, "Invalid JSON body")

    # responses ----------------------------------------------------------------------------------
    def _send(self, status: int, body: bytes = b"", headers: dict | None = None,
              content_type: str = "application/json; charset=utf-8", head_only: bool = False,
              content_length: int | None = None) -> None:
        self._status = status
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body) if content_length is None else content_length))
        self.send_header("Access-Control-Expose-Headers", "X-Repo-Commit, X-Error-Code, X-Error-Message, ETag")
        for k, v in (headers or {}).items():
            if v is not None:
                self.send_header(k, str(v))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if body and not head_only:
            self.wfile.write(body)

    def _send_json(self, status: int, obj: Any, headers: dict | None = None) -> None:
        self._send(status, json.dumps(obj).encode(), headers=headers, head_only=self.command == "HEAD")

    def _send_error(self, e: _HTTPError) -> None:
        headers = dict(e.headers)
        if e.error_code:
            headers["X-Error-Code"] = e.error_code
        headers["X-Error-Message"] = e.message.replace("\n", " ")[:500]
        body = e.body if e.body is not None else {"error": e.message}
        self._send_json(e.status, body, headers=headers)

    # permission checks --------------------------------------------------------------------------
    def _require_token(self) -> None:
        if self._bad_token:
            raise _HTTPError(401, "Invalid credentials in Authorization header")
        if self._user is None:
            raise _HTTPError(401, "You must be authenticated to access this endpoint (missing bearer token)")

    def _require_write(self) -> None:
        self._require_token()
        if self._role != "write":
            raise _HTTPError(403, "This token does not have write access")

    def _repo_for_read(self, repo_type: str, repo_id: str) -> dict:
        """The repo, or the same 401/404 + RepoNotFound answers the Hub gives."""
        if self._bad_token:
            raise _HTTPError(401, "Invalid credentials in Authorization header")
        repo = self.hub._store.get(repo_type, repo_id)
        if repo is None or (repo["private"] and self._user is None):
            status = 401 if self._user is None else 404
            raise _HTTPError(status, "Repository not found", "RepoNotFound")
        return repo

    def _repo_for_write(self, repo_type: str, repo_id: str) -> dict:
        self._require_token()
        repo = self._repo_for_read(repo_type, repo_id)
        if self._role != "write":
            raise _HTTPError(403, "This token does not have write access to this repo")
        return repo

    # routing ------------------------------------------------------------------------------------
    def _split_repo(self, segs: list[str], repo_type: str) -> tuple[str, list[str]]:
        """Split `ns/name/rest...` or `name/rest...` into (repo_id, rest) (rest starts with a keyword)."""
        candidates = []
        for n in (2, 1):
            if len(segs) < n:
                continue
            rest = segs[n:]
            if not rest or rest[0] in _API_KEYWORDS:
                candidates.append(("/".join(segs[:n]), rest))
        if not candidates:
            raise _HTTPError(404, "Not found")
        with self.hub.lock:
            for repo_id, rest in candidates:
                if self.hub._store.get(repo_type, repo_id) is not None:
                    return repo_id, rest
        return candidates[0]

    def _route(self, method: str) -> None:
        s = self._segments
        if not s or s == [""]:
            return self._send_json(200, {"name": "loopback-hub"})
        if s[0] == "api":
            return self._route_api(method, s[1:])
        if s[0] == "lfs-upload" and len(s) == 2 and method == "PUT":
            return self._lfs_upload(s[1])
        # /[datasets/|spaces/]{id}.git/info/lfs/objects/batch
        if len(s) >= 5 and s[-4:] == ["info", "lfs", "objects", "batch"] and s[-5].endswith(".git"):
            head = s[:-4]
            head[-1] = head[-1][: -len(".git")]
            repo_type = "model"
            if head[0] in ("datasets", "spaces") and len(head) > 1:
                repo_type = head[0][:-1]
                head = head[1:]
            if method != "POST":
                raise _HTTPError(405, "Method not allowed")
            return self._lfs_batch(repo_type, "/".join(head))
        # /[datasets/|spaces/]{id}/resolve/{rev}/{path}
        repo_type = "model"
        segs = s
        if s[0] in ("datasets", "spaces") and len(s) > 1 and "resolve" in s[1:]:
            repo_type = s[0][:-1]
            segs = s[1:]
        if "resolve" in segs:
            repo_id, rest = self._split_repo(segs, repo_type)
            if rest and rest[0] == "resolve" and len(rest) >= 3 and method in ("GET", "HEAD"):
                revision, path = _take_revision(rest[1:])
                return self._resolve(repo_type, repo_id, revision, path, head_only=method == "HEAD")
        raise _HTTPError(404, f"Not found: {method} {self.path}")

    def _route_api(self, method: str, s: list[str]) -> None:
        if not s:
            raise _HTTPError(404, "Not found")
        if s == ["whoami-v2"] and method in ("GET", "HEAD"):
            return self._whoami()
        if s == ["agent-harnesses"]:
            return self._send_json(200, {"standardEnvVars": [], "harnesses": {}})
        if s == ["validate-yaml"] and method == "POST":
            return self._validate_yaml()
        if s[0] == "repos" and len(s) == 2:
            if s[1] == "create" and method == "POST":
                return self._create_repo()
            if s[1] == "delete" and method == "DELETE":
                return self._delete_repo()
            if s[1] == "move" and method == "POST":
                return self._move_repo()
        if s[0] in ("models", "datasets", "spaces"):
            repo_type = s[0][:-1]
            if len(s) == 1 and method in ("GET", "HEAD"):
                return self._list_repos(repo_type)
            repo_id, rest = self._split_repo(s[1:], repo_type)
            return self._route_repo(method, repo_type, repo_id, rest)
        raise _HTTPError(404, f"Not found: {method} {self.path}")

    def _route_repo(self, method: str, repo_type: str, repo_id: str, rest: list[str]) -> None:
        get = method in ("GET", "HEAD")
        if not rest and get:
            return self._repo_info(repo_type, repo_id, "main")
        kw = rest[0] if rest else ""
        if kw == "revision" and len(rest) >= 2 and get:
            return self._repo_info(repo_type, repo_id, "/".join(rest[1:]))
        if kw == "tree" and len(rest) >= 2 and get:
            return self._tree(repo_type, repo_id, *_take_revision(rest[1:]))
        if kw == "paths-info" and len(rest) >= 2 and method == "POST":
            return self._paths_info(repo_type, repo_id, "/".join(rest[1:]))
        if kw == "preupload" and len(rest) >= 2 and method == "POST":
            return self._preupload(repo_type, repo_id, "/".join(rest[1:]))
        if kw == "commit" and len(rest) >= 2 and method == "POST":
            return self._commit(repo_type, repo_id, "/".join(rest[1:]))
        if kw == "commits" and len(rest) >= 2 and get:
            return self._list_commits(repo_type, repo_id, "/".join(rest[1:]))
        if kw == "refs" and len(rest) == 1 and get:
            return self._refs(repo_type, repo_id)
        if kw == "branch" and len(rest) >= 2 and method in ("POST", "DELETE"):
            return self._branch(method, repo_type, repo_id, "/".join(rest[1:]))
        if kw == "tag" and len(rest) >= 2 and method in ("POST", "DELETE"):
            return self._tag(method, repo_type, repo_id, "/".join(rest[1:]))
        if kw == "settings" and method == "PUT":
            return self._settings(repo_type, repo_id)
        if kw in ("xet-write-token", "xet-read-token"):
            self._drain_body()
            raise _HTTPError(400, "Xet storage is not supported by the loopback Hub: set HF_HUB_DISABLE_XET=1")
        raise _HTTPError(404, f"Not found: {method} {self.path}")

    # endpoints: account ---------------------------------------------------------------------------
    def _whoami(self) -> None:
        self._require_token()
        user = self._user
        self._send_json(200, {
            "type": "user",
            "id": hashlib.sha1(user.encode()).hexdigest()[:24],
            "name": user,
            "fullname": user,
            "email": f"{user}@example.com",
            "emailVerified": True,
            "canPay": False,
            "isPro": False,
            "periodEnd": None,
            "avatarUrl": "",
            "orgs": [],
            "auth": {"type": "access_token",
                     "accessToken": {"displayName": "loopback", "role": self._role, "createdAt": _now_iso()}},
        })

    # endpoints: repo admin ------------------------------------------------------------------------
    def _parse_repo_payload(self, payload: dict) -> tuple[str, str]:
        name = payload.get("name")
        org = payload.get("organization")
        repo_type = payload.get("type") or "model"
        if repo_type not in REPO_TYPES:
            raise _HTTPError(400, f"Invalid repo type {repo_type!r}")
        if not isinstance(name, str) or not _REPO_ID_PART.match(name) or "--" in name or ".." in name:
            raise _HTTPError(400, f"Invalid repo name {name!r}")
        namespace = org or self._user
        if not isinstance(namespace, str) or not _REPO_ID_PART.match(namespace):
            raise _HTTPError(400, f"Invalid namespace {namespace!r}")
        return repo_type, f"{namespace}/{name}"

    def _repo_url(self, repo_type: str, repo_id: str) -> str:
        return f"{self._base_url()}/{_URL_PREFIX[repo_type]}{repo_id}"

    def _create_repo(self) -> None:
        payload = self._json_body()
        self._require_write()
        repo_type, repo_id = self._parse_repo_payload(payload if isinstance(payload, dict) else {})
        private = payload.get("private")
        if "visibility" in payload:
            private = payload["visibility"] != "public"
        with self.hub.lock:
            if self.hub._store.get(repo_type, repo_id) is not None:
                raise _HTTPError(409, "You already created this repo", body={
                    "error": "You already created this repo", "url": self._repo_url(repo_type, repo_id)})
            repo = self.hub._store.create_repo(repo_type, repo_id, bool(private), owner=self._user)
            self.hub._store.save()
        self._send_json(200, {"url": self._repo_url(repo_type, repo_id), "name": repo_id, "id": repo["uid"]})

    def _delete_repo(self) -> None:
        payload = self._json_body()
        self._require_write()
        repo_type, repo_id = self._parse_repo_payload(payload if isinstance(payload, dict) else {})
        with self.hub.lock:
            self._repo_for_write(repo_type, repo_id)
            self.hub._store.repos.pop(self.hub._store.key(repo_type, repo_id))
            self.hub._store.save()
        self._send_json(200, {})

    def _move_repo(self) -> None:
        payload = self._json_body()
        self._require_write()
        repo_type = payload.get("type") or "model"
        src, dst = payload.get("fromRepo"), payload.get("toRepo")
        with self.hub.lock:
            repo = self._repo_for_write(repo_type, src)
            if self.hub._store.get(repo_type, dst) is not None:
                raise _HTTPError(409, f"{dst} already exists")
            self.hub._store.repos.pop(self.hub._store.key(repo_type, src))
            repo["id"] = dst
            self.hub._store.repos[self.hub._store.key(repo_type, dst)] = repo
            self.hub._store.save()
        self._send_json(200, {})

    def _settings(self, repo_type: str, repo_id: str) -> None:
        payload = self._json_body()
        with self.hub.lock:
            repo = self._repo_for_write(repo_type, repo_id)
            if "private" in payload:
                repo["private"] = bool(payload["private"])
            if "visibility" in payload:
                repo["private"] = payload["visibility"] != "public"
            if "gated" in payload:
                repo["gated"] = payload["gated"]
            self.hub._store.save()
        self._send_json(200, {})

    def _list_repos(self, repo_type: str) -> None:
        search = (self._query.get("search") or [""])[0]
        author = (self._query.get("author") or [None])[0]
        out = []
        with self.hub.lock:
            for repo in self.hub._store.repos.values():
                if repo["type"] != repo_type or (repo["private"] and self._user is None):
                    continue
                if search and search not in repo["id"]:
                    continue
                if author and repo["id"].split("/")[0] != author:
                    continue
                out.append(self._info_payload(repo, repo["branches"]["main"], blobs=False, listing=True))
        self._send_json(200, out)

    # endpoints: repo info ---------------------------------------------------------------------------
    def _card_metadata(self, files: dict) -> dict:
        entry = files.get("README.md")
        if entry is None:
            return {}
        try:
            yaml_text, _ = _split_front_matter(self.hub._store.read_blob(entry["sha256"]).decode("utf-8", "replace"))
            meta = _yaml_load(yaml_text) if yaml_text else None
        except Exception:
            return {}
        return meta if isinstance(meta, dict) else {}

    def _json_file(self, files: dict, name: str) -> dict:
        entry = files.get(name)
        if entry is None or entry["size"] > 5 * 1024 * 1024:
            return {}
        try:
            data = json.loads(self.hub._store.read_blob(entry["sha256"]))
        except Exception:
            return {}
        return data if isinstance(data, dict) else {}

    def _info_payload(self, repo: dict, sha: str, blobs: bool, listing: bool = False) -> dict:
        commit = repo["commits"][sha]
        files = commit["files"]
        repo_type = repo["type"]
        card = self._card_metadata(files)
        tags = [t for t in (_as_str_list(card.get("tags")) or []) if isinstance(t, str)]
        out: dict[str, Any] = {
            "_id": repo["uid"],
            "id": repo["id"],
            "author": repo["id"].split("/")[0] if "/" in repo["id"] else None,
            "sha": sha,
            "lastModified": commit["date"],
            "createdAt": repo["created_at"],
            "private": repo["private"],
            "gated": repo.get("gated", False) or False,
            "disabled": False,
            "downloads": 0,
            "likes": 0,
        }
        if repo_type == "model":
            out["modelId"] = repo["id"]
            config = self._json_file(files, "config.json")
            has_adapter = "adapter_config.json" in files
            library = card.get("library_name")
            if not isinstance(library, str):
                library = "transformers" if config else ("peft" if has_adapter else None)
            pipeline_tag = card.get("pipeline_tag") if isinstance(card.get("pipeline_tag"), str) else None
            archs = config.get("architectures") or []
            if pipeline_tag is None and isinstance(archs, list):
                for arch in archs:
                    for suffix, task in _ARCH_SUFFIX_TO_TASK:
                        if isinstance(arch, str) and arch.endswith(suffix):
                            pipeline_tag = task
                            break
                    if pipeline_tag:
                        break
            if library:
                out["library_name"] = library
                tags = [library] + tags
            if pipeline_tag:
                out["pipeline_tag"] = pipeline_tag
                tags.append(pipeline_tag)
            if any(p.endswith(".safetensors") for p in files):
                tags.append("safetensors")
            if config:
                out["config"] = {k: config[k] for k in ("architectures", "model_type") if k in config}
                if isinstance(config.get("model_type"), str):
                    tags.append(config["model_type"])
            if isinstance(card.get("license"), str):
                tags.append(f"license:{card['license']}")
            for ds in _as_str_list(card.get("datasets")) or []:
                if isinstance(ds, str):
                    tags.append(f"dataset:{ds}")
            for bm in _as_str_list(card.get("base_model")) or []:
                if isinstance(bm, str):
                    tags.append(f"base_model:{bm}")
        elif repo_type == "dataset":
            if isinstance(card.get("license"), str):
                tags.append(f"license:{card['license']}")
            if any(p.endswith(".parquet") for p in files):
                tags.append("format:parquet")
        out["tags"] = list(dict.fromkeys(tags))
        if listing:
            return out
        if card:
            out["cardData"] = card
        siblings = []
        for path in sorted(files):
            entry = files[path]
            sib: dict[str, Any] = {"rfilename": path}
            if blobs:
                sib["size"] = entry["size"]
                sib["blobId"] = entry["oid"]
                if entry["lfs"]:
                    sib["lfs"] = {"size": entry["size"], "sha256": entry["sha256"],
                                  "pointerSize": entry["pointer_size"]}
            siblings.append(sib)
        out["siblings"] = siblings
        out["spaces"] = []
        out["usedStorage"] = sum(e["size"] for e in files.values())
        return out

    def _repo_info(self, repo_type: str, repo_id: str, revision: str) -> None:
        blobs = (self._query.get("blobs") or ["false"])[0].lower() in ("1", "true")
        with self.hub.lock:
            repo = self._repo_for_read(repo_type, repo_id)
            sha = self.hub._store.resolve_revision(repo, revision)
            payload = self._info_payload(repo, sha, blobs=blobs)
        self._send_json(200, payload, headers={"X-Repo-Commit": sha})

    # endpoints: tree / paths-info -------------------------------------------------------------------
    def _last_commit_for(self, repo: dict, sha: str, path: str, is_dir: bool) -> dict:
        hist = self.hub._store.history(repo, sha)

        def view(commit: dict):
            files = commit["files"]
            if is_dir:
                prefix = path + "/" if path else ""
                return {p: e["sha256"] for p, e in files.items() if p.startswith(prefix)}
            e = files.get(path)
            return (e["sha256"], e["lfs"]) if e else None

        target = hist[0]
        current = view(hist[0])
        for older in hist[1:]:
            if view(older) != current:
                break
            target = older
        return {"id": target["id"], "title": target["title"], "date": target["date"]}

    def _entry_json(self, repo: dict, sha: str, path: str, entry: dict | None, expand: bool,
                    files: dict) -> dict:
        if entry is None:  # directory
            prefix = path + "/"
            digest = hashlib.sha1()
            for p in sorted(files):
                if p.startswith(prefix):
                    digest.update(f"{p}\0{files[p]['oid']}\n".encode())
            out: dict[str, Any] = {"type": "directory", "oid": digest.hexdigest(), "size": 0, "path": path}
            if expand:
                out["lastCommit"] = self._last_commit_for(repo, sha, path, is_dir=True)
            return out
        out = {"type": "file", "oid": entry["oid"], "size": entry["size"], "path": path}
        if entry["lfs"]:
            out["lfs"] = {"oid": entry["sha256"], "size": entry["size"], "pointerSize": entry["pointer_size"]}
        if expand:
            out["lastCommit"] = self._last_commit_for(repo, sha, path, is_dir=False)
            out["securityFileStatus"] = {"status": "safe", "avScan": {"virusFound": False, "virusNames": None},
                                         "pickleImportScan": None}
        return out

    @staticmethod
    def _dirs_of(files: dict) -> set[str]:
        dirs = set()
        for p in files:
            parts = p.split("/")[:-1]
            for i in range(1, len(parts) + 1):
                dirs.add("/".join(parts[:i]))
        return dirs

    def _tree(self, repo_type: str, repo_id: str, revision: str, path: str) -> None:
        q = self._query
        recursive = (q.get("recursive") or ["false"])[0].lower() in ("1", "true")
        expand = (q.get("expand") or ["false"])[0].lower() in ("1", "true")
        default_limit = TREE_PAGE_SIZE_EXPANDED if expand else TREE_PAGE_SIZE
        try:
            limit = max(1, min(int((q.get("limit") or [default_limit])[0]), default_limit))
        except ValueError:
            raise _HTTPError(400, "Invalid limit")
        cursor = (q.get("cursor") or [""])[0]
        path = path.strip("/")
        with self.hub.lock:
            repo = self._repo_for_read(repo_type, repo_id)
            sha = self.hub._store.resolve_revision(repo, revision)
            files = repo["commits"][sha]["files"]
            dirs = self._dirs_of(files)
            if path and path not in dirs:
                raise _HTTPError(404, f"Entry not found: {path}", "EntryNotFound", headers={"X-Repo-Commit": sha})
            prefix = path + "/" if path else ""
            names = [p for p in list(files) + list(dirs) if p.startswith(prefix) and p != path]
            if not recursive:
                names = [p for p in names if "/" not in p[len(prefix):]]
            # directories first, then files, each sorted (like the Hub)
            names.sort(key=lambda p: (p not in dirs, p))
            start = 0
            if cursor:
                try:
                    start = int(base64.urlsafe_b64decode(cursor.encode()).decode())
                except Exception:
                    raise _HTTPError(400, "Invalid cursor")
            page = names[start:start + limit]
            entries = [self._entry_json(repo, sha, p, None if p in dirs else files[p], expand, files) for p in page]
        headers = {"X-Repo-Commit": sha}
        if start + limit < len(names):
            next_cursor = base64.urlsafe_b64encode(str(start + limit).encode()).decode()
            params = {"recursive": str(recursive), "expand": str(expand), "limit": str(limit), "cursor": next_cursor}
            url = f"{self._base_url()}{self.path.split('?', 1)[0]}?{urllib.parse.urlencode(params)}"
            headers["Link"] = f'<{url}>; rel="next"'
        self._send_json(200, entries, headers=headers)

    def _paths_info(self, repo_type: str, repo_id: str, revision: str) -> None:
        body = self._json_body()
        paths = body.get("paths", []) if isinstance(body, dict) else []
        if isinstance(paths, str):
            paths = [paths]
        expand_v = body.get("expand", False) if isinstance(body, dict) else False
        if isinstance(expand_v, list):
            expand_v = expand_v[0] if expand_v else False
        expand = str(expand_v).lower() in ("1", "true")
        with self.hub.lock:
            repo = self._repo_for_read(repo_type, repo_id)
            sha = self.hub._store.resolve_revision(repo, revision)
            files = repo["commits"][sha]["files"]
            dirs = self._dirs_of(files)
            out = []
            for p in paths:
                p = p.strip("/")
                if p in files:
                    out.append(self._entry_json(repo, sha, p, files[p], expand, files))
                elif p in dirs:
                    out.append(self._entry_json(repo, sha, p, None, expand, files))
        self._send_json(200, out, headers={"X-Repo-Commit": sha})

    # endpoints: refs / commits / branches -----------------------------------------------------------
    def _refs(self, repo_type: str, repo_id: str) -> None:
        with self.hub.lock:
            repo = self._repo_for_read(repo_type, repo_id)
            branches = [{"name": b, "ref": f"refs/heads/{b}", "targetCommit": s}
                        for b, s in repo["branches"].items() if not b.startswith("refs/pr/")]
            prs = [{"name": b, "ref": b, "targetCommit": s}
                   for b, s in repo["branches"].items() if b.startswith("refs/pr/")]
            tags = [{"name": t, "ref": f"refs/tags/{t}", "targetCommit": s} for t, s in repo["tags"].items()]
        self._send_json(200, {"branches": branches, "converts": [], "tags": tags, "pullRequests": prs})

    def _list_commits(self, repo_type: str, repo_id: str, revision: str) -> None:
        try:
            page = int((self._query.get("p") or ["0"])[0])
        except ValueError:
            page = 0
        with self.hub.lock:
            repo = self._repo_for_read(repo_type, repo_id)
            sha = self.hub._store.resolve_revision(repo, revision)
            hist = self.hub._store.history(repo, sha)
        chunk = hist[page * COMMITS_PAGE_SIZE:(page + 1) * COMMITS_PAGE_SIZE]
        items = [{
            "id": c["id"],
            "title": c["title"],
            "message": c["message"],
            "date": c["date"],
            "authors": [{"user": a} for a in c["authors"]],
            "parents": c["parents"],
            "formatted": {"title": c["title"], "message": c["message"]},
        } for c in chunk]
        headers = {}
        if (page + 1) * COMMITS_PAGE_SIZE < len(hist):
            url = f"{self._base_url()}{self.path.split('?', 1)[0]}?p={page + 1}"
            headers["Link"] = f'<{url}>; rel="next"'
        self._send_json(200, items, headers=headers)

    def _branch(self, method: str, repo_type: str, repo_id: str, branch: str) -> None:
        payload = self._json_body() if method == "POST" else (self._drain_body() or {})
        with self.hub.lock:
            repo = self._repo_for_write(repo_type, repo_id)
            if method == "DELETE":
                if branch not in repo["branches"] or branch == "main":
                    raise _HTTPError(404 if branch != "main" else 403, f"Cannot delete branch {branch}",
                                     "RevisionNotFound" if branch != "main" else None)
                del repo["branches"][branch]
            else:
                if branch in repo["branches"]:
                    raise _HTTPError(409, f"Reference already exists: refs/heads/{branch}")
                start = payload.get("startingPoint") if isinstance(payload, dict) else None
                repo["branches"][branch] = self.hub._store.resolve_revision(repo, start or "main")
            self.hub._store.save()
        self._send_json(200, {})

    def _tag(self, method: str, repo_type: str, repo_id: str, arg: str) -> None:
        payload = self._json_body() if method == "POST" else (self._drain_body() or {})
        with self.hub.lock:
            repo = self._repo_for_write(repo_type, repo_id)
            if method == "DELETE":
                if arg not in repo["tags"]:
                    raise _HTTPError(404, f"Tag {arg} not found", "RevisionNotFound")
                del repo["tags"][arg]
            else:
                tag = payload.get("tag") if isinstance(payload, dict) else None
                if not tag:
                    raise _HTTPError(400, "Missing tag")
                if tag in repo["tags"]:
                    raise _HTTPError(409, f"Tag {tag} already exists")
                repo["tags"][tag] = self.hub._store.resolve_revision(repo, arg)
            self.hub._store.save()
        self._send_json(200, {})

    # endpoints: download ------------------------------------------------------------------------------
    def _resolve(self, repo_type: str, repo_id: str, revision: str, path: str, head_only: bool) -> None:
        with self.hub.lock:
            repo = self._repo_for_read(repo_type, repo_id)
            sha = self.hub._store.resolve_revision(repo, revision)
            entry = repo["commits"][sha]["files"].get(path)
            if entry is None:
                raise _HTTPError(404, f"Entry not found: {path}", "EntryNotFound", headers={"X-Repo-Commit": sha})
            entry = dict(entry)
        size = entry["size"]
        headers = {
            "X-Repo-Commit": sha,
            "ETag": f'"{entry["sha256"] if entry["lfs"] else entry["oid"]}"',
            "Accept-Ranges": "bytes",
            "Content-Disposition": f"inline; filename*=UTF-8''{urllib.parse.quote(path.rsplit('/', 1)[-1])}",
            "Cache-Control": "no-cache",
        }
        if entry["lfs"]:
            headers["X-Linked-Etag"] = f'"{entry["sha256"]}"'
            headers["X-Linked-Size"] = str(size)
        ctype = "application/octet-stream"
        if path.endswith((".json", ".md", ".txt", ".yaml", ".yml", ".py", ".gitattributes")) and not entry["lfs"]:
            ctype = "text/plain; charset=utf-8"
        start, end, status = 0, size - 1, 200
        rng = self.headers.get("Range")
        if rng:
            m = re.fullmatch(r"\s*bytes=(\d*)-(\d*)\s*", rng)
            if m is None or (m.group(1) == "" and m.group(2) == ""):
                raise _HTTPError(416, "Invalid range", headers={"Content-Range": f"bytes */{size}"})
            if m.group(1) == "":
                n = int(m.group(2))
                start, end = max(size - n, 0), size - 1
            else:
                start = int(m.group(1))
                end = min(int(m.group(2)), size - 1) if m.group(2) else size - 1
            if start >= size or start > end:
                raise _HTTPError(416, "Range not satisfiable", headers={"Content-Range": f"bytes */{size}"})
            status = 206
            headers["Content-Range"] = f"bytes {start}-{end}/{size}"
        length = max(end - start + 1, 0)
        if head_only:
            self._send(status, b"", headers=headers, content_type=ctype, head_only=True, content_length=length)
            return
        blob = self.hub._store.blob_path(entry["sha256"])
        self._send(status, b"", headers=headers, content_type=ctype, content_length=length)
        with open(blob, "rb") as f:
            f.seek(start)
            remaining = length
            while remaining > 0:
                data = f.read(min(remaining, 1 << 20))
                if not data:
                    break
                self.wfile.write(data)
                remaining -= len(data)

    # endpoints: upload --------------------------------------------------------------------------------
    def _branch_for_write(self, repo: dict, revision: str) -> str:
        if revision in repo["branches"]:
            return revision
        if revision.startswith("refs/heads/") and revision[11:] in repo["branches"]:
            return revision[11:]
        raise _HTTPError(404, f"Invalid rev id: {revision} (not a branch)", "RevisionNotFound")

    def _preupload(self, repo_type: str, repo_id: str, revision: str) -> None:
        payload = self._json_body()
        with self.hub.lock:
            repo = self._repo_for_write(repo_type, repo_id)
            sha = self.hub._store.resolve_revision(repo, revision)
            files = repo["commits"][sha]["files"]
            patterns = self.hub._lfs_patterns(files)
            ignore = payload.get("gitIgnore")
            if ignore is None and ".gitignore" in files:
                ignore = self.hub._store.read_blob(files[".gitignore"]["sha256"]).decode("utf-8", "replace")
            ignore_patterns = [ln.strip() for ln in (ignore or "").splitlines()
                               if ln.strip() and not ln.strip().startswith("#")]
            out = []
            for f in payload.get("files", []):
                path = f["path"]
                try:
                    sample = base64.b64decode(f.get("sample", ""))
                except Exception:
                    sample = b""
                lfs = self.hub._is_lfs(path, int(f.get("size", 0)), sample, patterns)
                existing = files.get(path)
                oid = None
                if existing is not None:
                    oid = existing["sha256"] if existing["lfs"] else existing["oid"]
                out.append({
                    "path": path,
                    "uploadMode": "lfs" if lfs else "regular",
                    "shouldIgnore": any(_match_pattern(path, p) for p in ignore_patterns),
                    "oid": oid,
                })
        self._send_json(200, {"files": out, "commitOid": sha})

    def _lfs_batch(self, repo_type: str, repo_id: str) -> None:
        payload = self._json_body()
        with self.hub.lock:
            self._repo_for_write(repo_type, repo_id)
        if payload.get("operation") != "upload":
            raise _HTTPError(400, "Only the 'upload' operation is supported by the loopback Hub")
        transfers = payload.get("transfers") or ["basic"]
        if "basic" not in transfers:
            raise _HTTPError(400, f"No supported transfer among {transfers}; the loopback Hub speaks 'basic'")
        objects = []
        for obj in payload.get("objects", []):
            oid, size = obj.get("oid"), obj.get("size")
            if not isinstance(oid, str) or not re.fullmatch(r"[0-9a-f]{64}", oid) or not isinstance(size, int):
                objects.append({"oid": str(oid), "size": int(size or 0),
                                "error": {"code": 422, "message": "Invalid oid or size"}})
                continue
            if self.hub._store.has_blob(oid):
                objects.append({"oid": oid, "size": size})
                continue
            href = f"{self._base_url()}/lfs-upload/{oid}?size={size}&sig={self.hub._sign(oid, size)}"
            objects.append({"oid": oid, "size": size, "authenticated": True,
                            "actions": {"upload": {"href": href, "expires_in": 3600}}})
        self._send(200, json.dumps({"transfer": "basic", "objects": objects, "hash_algo": "sha256"}).encode(),
                   content_type="application/vnd.git-lfs+json")

    def _lfs_upload(self, oid: str) -> None:
        size_q = (self._query.get("size") or [""])[0]
        sig = (self._query.get("sig") or [""])[0]
        try:
            size = int(size_q)
        except ValueError:
            raise _HTTPError(400, "Missing size")
        if not hmac.compare_digest(sig, self.hub._sign(oid, size)):
            raise _HTTPError(403, "Invalid upload signature")
        fd, tmp = tempfile.mkstemp(dir=self.hub._store.tmp_dir)
        digest = hashlib.sha256()
        n = 0
        try:
            with os.fdopen(fd, "wb") as f:
                for chunk in self._iter_body():
                    digest.update(chunk)
                    n += len(chunk)
                    f.write(chunk)
            if digest.hexdigest() != oid or n != size:
                raise _HTTPError(400, f"Uploaded content does not match oid/size ({n} bytes, expected {size})")
            with self.hub.lock:
                self.hub._store.adopt_blob_file(tmp, oid)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        self._send(200, b"", content_type="text/plain")

    def _commit(self, repo_type: str, repo_id: str, revision: str) -> None:
        body = self._read_body()
        create_pr = (self._query.get("create_pr") or ["0"])[0] in ("1", "true", "True")
        lines = []
        for raw in body.splitlines():
            if raw.strip():
                try:
                    lines.append(json.loads(raw))
                except ValueError:
                    raise _HTTPError(400, "Invalid NDJSON line in commit payload")
        if "application/json" in self.headers.get("Content-Type", "") and len(lines) == 1 and "summary" in lines[0]:
            # the legacy JSON format: {"summary", "description", "files", "lfsFiles", "deletedFiles"}
            j = lines[0]
            lines = [{"key": "header", "value": {"summary": j.get("summary"), "description": j.get("description", ""),
                                                 "parentCommit": j.get("parentCommit")}}]
            lines += [{"key": "file", "value": v} for v in j.get("files", [])]
            lines += [{"key": "lfsFile", "value": v} for v in j.get("lfsFiles", [])]
            lines += [{"key": "deletedFile", "value": v} for v in j.get("deletedFiles", [])]
        if not lines or lines[0].get("key") != "header":
            raise _HTTPError(400, "The commit payload must start with a header line")
        header = lines[0].get("value") or {}
        summary = header.get("summary")
        if not isinstance(summary, str) or not summary.strip():
            raise _HTTPError(400, "Commit summary is required")
        with self.hub.lock:
            repo = self._repo_for_write(repo_type, repo_id)
            store = self.hub._store
            if create_pr:
                base_sha = store.resolve_revision(repo, revision)
                branch = None
            else:
                branch = self._branch_for_write(repo, revision)
                base_sha = repo["branches"][branch]
            parent = header.get("parentCommit")
            if parent:
                try:
                    parent_sha = store.resolve_revision(repo, parent)
                except _HTTPError:
                    raise _HTTPError(412, f"Parent commit {parent} is not the head of {revision}")
                if create_pr:
                    base_sha = parent_sha
                elif parent_sha != base_sha:
                    raise _HTTPError(412, f"A commit has happened since. Parent commit {parent} is not the head of "
                                          f"{revision} ({base_sha})")
            tree = dict(repo["commits"][base_sha]["files"])
            for line in lines[1:]:
                key, value = line.get("key"), line.get("value") or {}
                path = str(value.get("path", "")).lstrip("/")
                if key in ("file", "lfsFile", "deletedFile", "deletedFolder") and not path:
                    raise _HTTPError(400, f"Missing path in {key} operation")
                if ".." in path.split("/") or path.startswith(".git/") or path == ".git":
                    raise _HTTPError(400, f"Invalid path {path!r}")
                if key == "file":
                    if value.get("encoding", "base64") != "base64":
                        data = str(value.get("content", "")).encode()
                    else:
                        try:
                            data = base64.b64decode(value.get("content", ""), validate=False)
                        except Exception:
                            raise _HTTPError(400, f"Invalid base64 content for {path}")
                    tree[path] = store.file_entry(data, lfs=False)
                elif key == "lfsFile":
                    oid = value.get("oid")
                    if value.get("algo", "sha256") != "sha256" or not isinstance(oid, str):
                        raise _HTTPError(400, f"Invalid lfsFile operation for {path}")
                    if not store.has_blob(oid):
                        raise _HTTPError(422, f"LFS object {oid} for {path} was not uploaded (missing from storage)")
                    size = store.blob_path(oid).stat().st_size
                    if value.get("size") is not None and int(value["size"]) != size:
                        raise _HTTPError(422, f"LFS object {oid} for {path} has size {size}, not {value['size']}")
                    tree[path] = store.entry_for_blob(oid, size, lfs=True)
                elif key == "deletedFile":
                    if path not in tree:
                        raise _HTTPError(404, f"A file with this name doesn't exist: {path}", "EntryNotFound")
                    del tree[path]
                elif key == "deletedFolder":
                    prefix = path.rstrip("/") + "/"
                    doomed = [p for p in tree if p.startswith(prefix)]
                    if not doomed:
                        raise _HTTPError(404, f"A folder with this name doesn't exist: {path}", "EntryNotFound")
                    for p in doomed:
                        del tree[p]
                else:
                    raise _HTTPError(400, f"Unknown commit operation {key!r}")
            pr_url = None
            if create_pr:
                repo["pr_count"] = repo.get("pr_count", 0) + 1
                num = repo["pr_count"]
                branch = f"refs/pr/{num}"
                pr_url = f"{self._repo_url(repo_type, repo_id)}/discussions/{num}"
            sha = store.make_commit(repo, branch, tree, summary, header.get("description") or "",
                                    author=self._user, create_branch=True, parent=base_sha)
            store.save()
        self._send_json(200, {
            "success": True,
            "commitOid": sha,
            "commitUrl": f"{self._repo_url(repo_type, repo_id)}/commit/{sha}",
            "hookOutput": "",
            "pullRequestUrl": pr_url,
        })

    # endpoints: validate-yaml -------------------------------------------------------------------------
    def _validate_yaml(self) -> None:
        payload = self._json_body()
        content = payload.get("content") if isinstance(payload, dict) else None
        if not isinstance(content, str):
            raise _HTTPError(400, "Missing 'content'", body={"errors": [{"message": "Missing 'content'"}]})
        errors, warnings = validate_card_metadata(content, payload.get("repoType") or "model")
        if errors:
            raise _HTTPError(400, "Invalid metadata in README.md", body={"errors": errors, "warnings": warnings})
        self._send_json(200, {"errors": [], "warnings": warnings})


def main(argv: list[str] | None = None) -> None:  # pragma: no cover - manual use
    import argparse

    parser = argparse.ArgumentParser(description="Run the loopback Hub")
    parser.add_argument("--dir", default=None, help="storage directory (default: a temp dir)")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--token", action="append", default=None, help="TOKEN=USER (repeatable)")
    args = parser.parse_args(argv)
    tokens = None
    if args.token:
        tokens = dict(t.split("=", 1) for t in args.token)
    storage = args.dir or tempfile.mkdtemp(prefix="loopback-hub-")
    with HubServer(storage, tokens=tokens, port=args.port) as hub:
        print(f"HF_ENDPOINT={hub.url}  (storage: {storage})", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":  # pragma: no cover
    main()
