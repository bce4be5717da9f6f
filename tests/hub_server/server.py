"""The loopback Hub itself: HubServer, the object a test holds (started once a session by tests/conftest.py).

It serves the Hub's HTTP API from a thread (routes.Handler answers each request), and gives a test direct access
to what the clients cannot reach: seeding repos, reading back what was pushed, injected faults and the request
log. The helpers take the same lock as the endpoints, so a test reads a consistent state while clients talk to it.
"""

from __future__ import annotations

import copy
import hashlib
import hmac
import os
import pathlib
import re
import secrets
import sys
import threading
from http.server import ThreadingHTTPServer
from typing import Iterable

from .errors import HubError
from .faults import FaultRule, Faults, RequestLog, RequestRecord
from .routes import Handler
from .storage import REPO_TYPES, Store

DEFAULT_TOKEN = "hf_test_token"


class _HTTPServer(ThreadingHTTPServer):
    """One thread per connection; a client that hangs up (a connection pool dropping an idle connection) is no error,
    and is not printed. A printed traceback would also race with the tests' imports: Python 3.11 parses source to draw
    one, and two threads parsing at once fail with "AST constructor recursion depth mismatch"."""

    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        if not isinstance(sys.exc_info()[1], (ConnectionResetError, BrokenPipeError)):
            super().handle_error(request, client_address)


class HubServer:
    """A Hub-compatible HTTP server on 127.0.0.1, serving from a daemon thread.

    Args:
        storage_dir: directory for the blobs (the repos themselves are kept in memory).
        tokens: ``{token: user}``, each token with write access. Default ``{"hf_test_token": "user"}``.
        host, port: where to bind (port 0 = any free port).
    """

    def __init__(self, storage_dir: str | os.PathLike, tokens: dict | None = None, host: str = "127.0.0.1",
                 port: int = 0):
        self.storage_dir = pathlib.Path(storage_dir)
        self.storage_dir.mkdir(parents=True, exist_ok=True)
        self.tokens: dict[str, str] = dict(tokens if tokens is not None else {DEFAULT_TOKEN: "user"})
        self.host = host
        self._requested_port = port
        self.lock = threading.RLock()
        self.store = Store(self.storage_dir)
        self.faults = Faults(self.lock)
        self.log = RequestLog(self.lock)
        # Which process sent each request (RequestRecord.client_pid): off by default, as it scans every process's
        # sockets once per connection.
        self.identify_clients = False
        self._secret = secrets.token_bytes(16)
        self._httpd: _HTTPServer | None = None
        self._thread: threading.Thread | None = None

    # lifecycle ------------------------------------------------------------------------------------
    def start(self) -> "HubServer":
        if self._httpd is not None:
            return self
        handler = type("_BoundHandler", (Handler,), {"hub": self})
        httpd = _HTTPServer((self.host, self._requested_port), handler)
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

    @property
    def port(self) -> int:
        if self._httpd is None:
            raise RuntimeError("server not started")
        return self._httpd.server_address[1]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    # faults ---------------------------------------------------------------------------------------
    def inject_faults(self, status: int | None = 503, times: int | None = 1, path_regex: str | None = None,
                      method: str | None = None, delay: float = 0.0, message: str = "Injected fault",
                      reset: bool = False) -> FaultRule:
        """Make the next `times` requests whose path (with query) matches `path_regex` (re.search) and whose
        method matches `method` fail with `status` (or, with `reset=True`, with a dropped connection). `times=None`
        = always. Returns the rule (see `.hits`)."""
        rule = FaultRule(status=status, times=times, path_regex=path_regex, method=method, delay=delay,
                         message=message, reset=reset)
        return self.faults.add(rule)

    def clear_faults(self) -> None:
        self.faults.clear()

    # request log ----------------------------------------------------------------------------------
    @property
    def request_log(self) -> list[RequestRecord]:
        return self.log.records()

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
        self.log.clear()

    def _record(self, record: RequestRecord, generation: int) -> None:
        """Log an answered request: the handler's one way into the log (test_hub_server.py slows it down here)."""
        self.log.add(record, generation)

    # auth -----------------------------------------------------------------------------------------
    def add_token(self, token: str, user: str) -> None:
        with self.lock:
            self.tokens[token] = user

    # seeding / inspection helpers (used by tests; no HTTP involved) -------------------------------
    def add_repo(self, repo_id: str, files: dict[str, bytes | str | os.PathLike] | None = None,
                 repo_type: str = "model", private: bool = False, commit_message: str = "Add files",
                 exist_ok: bool = False) -> str:
        """Create a repo (with the Hub's initial `.gitattributes` commit) and commit `files` into it.
        Returns the sha of `main`. Values are bytes, str (text) or a pathlib.Path to read. With
        `exist_ok=True` an existing repo keeps its visibility and gets `files` as a new commit."""
        self._check_type(repo_type)
        with self.lock:
            repo = self.store.get(repo_type, repo_id)
            if repo is not None and not exist_ok:
                raise ValueError(f"{repo_type} repo {repo_id} exists")
            if repo is None:
                repo = self.store.create_repo(repo_type, repo_id, private, owner=repo_id.split("/")[0])
            sha = repo["branches"]["main"]
            if files:
                sha = self._commit_files_locked(repo, files, commit_message)
            return sha

    def commit_files(self, repo_id: str, files: dict[str, bytes | str | os.PathLike] | None = None,
                     deletions: Iterable[str] = (), repo_type: str = "model", branch: str = "main",
                     commit_message: str = "Update files") -> str:
        """Commit `files` (added/overwritten) and `deletions` to `branch` directly. Returns the commit sha."""
        with self.lock:
            repo = self._get_repo_or_raise(repo_type, repo_id)
            return self._commit_files_locked(repo, files or {}, commit_message, deletions, branch)

    def _commit_files_locked(self, repo: dict, files: dict, message: str, deletions: Iterable[str] = (),
                             branch: str = "main") -> str:
        head = repo["branches"].get(branch)
        if head is None:
            raise ValueError(f"no branch {branch}")
        tree = dict(repo["commits"][head]["files"])
        for path in deletions:
            tree.pop(path, None)
        lfs_patterns = self.store.lfs_patterns(tree)
        for path, value in files.items():
            if isinstance(value, (str,)) and not isinstance(value, os.PathLike):
                data = value.encode()
            elif isinstance(value, os.PathLike):
                data = pathlib.Path(value).read_bytes()
            else:
                data = bytes(value)
            lfs = self.store.is_lfs(path, len(data), data[:512], lfs_patterns)
            tree[path.lstrip("/")] = self.store.file_entry(data, lfs)
        return self.store.make_commit(repo, branch, tree, message, "", author=repo.get("owner"))

    def repo_files(self, repo_id: str, repo_type: str = "model", revision: str = "main") -> dict[str, bytes]:
        """{path: content} of the repo at `revision` (includes the `.gitattributes` of the initial commit)."""
        with self.lock:
            repo = self._get_repo_or_raise(repo_type, repo_id)
            sha = self._resolve_rev(repo, revision)
            files = dict(repo["commits"][sha]["files"])
        return {path: self.store.read_blob(e["sha256"]) for path, e in sorted(files.items())}

    def commits(self, repo_id: str, repo_type: str = "model", revision: str = "main") -> list[dict]:
        """History of `revision`, newest first: dicts with id, title, message, parents, date, authors, files
        (the sorted list of paths in that commit's tree)."""
        with self.lock:
            repo = self._get_repo_or_raise(repo_type, repo_id)
            sha = self._resolve_rev(repo, revision)
            hist = self.store.history(repo, sha)
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
            return self.store.get(repo_type, repo_id) is not None

    def is_private(self, repo_id: str, repo_type: str = "model") -> bool:
        with self.lock:
            return bool(self._get_repo_or_raise(repo_type, repo_id)["private"])

    def set_private(self, repo_id: str, private: bool, repo_type: str = "model") -> None:
        with self.lock:
            self._get_repo_or_raise(repo_type, repo_id)["private"] = bool(private)

    def lfs_files(self, repo_id: str, repo_type: str = "model", revision: str = "main") -> set[str]:
        """Paths stored as LFS at `revision`."""
        with self.lock:
            repo = self._get_repo_or_raise(repo_type, repo_id)
            sha = self._resolve_rev(repo, revision)
            return {p for p, e in repo["commits"][sha]["files"].items() if e["lfs"]}

    # internals ------------------------------------------------------------------------------------
    @staticmethod
    def _check_type(repo_type: str) -> None:
        if repo_type not in REPO_TYPES:
            raise ValueError(f"repo_type must be one of {REPO_TYPES}, got {repo_type!r}")

    def _resolve_rev(self, repo: dict, revision: str) -> str:
        try:
            return self.store.resolve_revision(repo, revision)
        except HubError as e:
            raise KeyError(f"{repo['type']} repo {repo['id']}: no revision {revision!r}") from e

    def _get_repo_or_raise(self, repo_type: str, repo_id: str) -> dict:
        self._check_type(repo_type)
        repo = self.store.get(repo_type, repo_id)
        if repo is None:
            raise KeyError(f"no {repo_type} repo {repo_id}")
        return repo

    def sign_upload(self, oid: str, size: int) -> str:
        """The signature of an LFS upload's href: the PUT of an object the batch call did not hand out is refused."""
        return hmac.new(self._secret, f"{oid}:{size}".encode(), hashlib.sha256).hexdigest()[:32]
