"""The loopback Hub's URL map: which endpoint answers a method and path (the Hub's own layout, as the clients
call it). Handler is the request handler HubServer serves with: the endpoints of the three modules, and this map."""

from __future__ import annotations

from .admin_endpoints import AdminEndpoints
from .errors import HubError
from .read_endpoints import ReadEndpoints
from .upload_endpoints import UploadEndpoints

_API_KEYWORDS = {"revision", "tree", "paths-info", "preupload", "commit", "commits", "refs", "branch", "tag",
                 "settings", "xet-write-token", "xet-read-token", "discussions", "parquet", "treesize",
                 "resolve", "lfs-files", "super-squash"}


def _take_revision(segs: list[str]) -> tuple[str, str]:
    """Split `rev/path...` into (rev, path). Clients quote revisions ('refs%2Fpr%2F1'), except that
    HfFileSystem leaves special refs ('refs/pr/1', 'refs/convert/parquet') unquoted in URLs."""
    if len(segs) >= 3 and segs[0] == "refs" and segs[1] in ("pr", "convert", "heads", "tags"):
        return "/".join(segs[:3]), "/".join(segs[3:])
    return segs[0], "/".join(segs[1:])


class Handler(AdminEndpoints, ReadEndpoints, UploadEndpoints):
    """Answers one request: Request's plumbing, the endpoints, and the routing below."""

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
            raise HubError(404, "Not found")
        with self.hub.lock:
            for repo_id, rest in candidates:
                if self.hub.store.get(repo_type, repo_id) is not None:
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
                raise HubError(405, "Method not allowed")
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
        raise HubError(404, f"Not found: {method} {self.path}")

    def _route_api(self, method: str, s: list[str]) -> None:
        if not s:
            raise HubError(404, "Not found")
        if s == ["whoami-v2"] and method in ("GET", "HEAD"):
            return self._whoami()
        if s == ["validate-yaml"] and method == "POST":
            return self._validate_yaml()
        if s == ["repos", "create"] and method == "POST":
            return self._create_repo()
        if s[0] in ("models", "datasets", "spaces") and len(s) > 1:
            repo_type = s[0][:-1]
            repo_id, rest = self._split_repo(s[1:], repo_type)
            return self._route_repo(method, repo_type, repo_id, rest)
        raise HubError(404, f"Not found: {method} {self.path}")

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
        if kw == "branch" and len(rest) >= 2 and method == "POST":
            return self._create_branch(repo_type, repo_id, "/".join(rest[1:]))
        if kw == "tag" and len(rest) >= 2 and method == "POST":
            return self._create_tag(repo_type, repo_id, "/".join(rest[1:]))
        if kw in ("xet-write-token", "xet-read-token"):
            self._drain_body()
            raise HubError(400, "Xet storage is not supported by the loopback Hub: set HF_HUB_DISABLE_XET=1")
        raise HubError(404, f"Not found: {method} {self.path}")
