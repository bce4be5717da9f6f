"""How clients push to the loopback Hub: preupload (which files go through LFS), the LFS batch call and the PUT of
each LFS object ("basic" transfer), the commit itself (NDJSON), and the model card's metadata check."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import re
import tempfile

from .cards import validate_card_metadata
from .errors import HubError
from .request import Request
from .storage import match_pattern


class UploadEndpoints(Request):
    """Preupload, LFS, commits and the card check (routes.Handler calls these)."""

    # upload ---------------------------------------------------------------------------------------
    def _branch_for_write(self, repo: dict, revision: str) -> str:
        if revision in repo["branches"]:
            return revision
        if revision.startswith("refs/heads/") and revision[11:] in repo["branches"]:
            return revision[11:]
        raise HubError(404, f"Invalid rev id: {revision} (not a branch)", "RevisionNotFound")

    def _preupload(self, repo_type: str, repo_id: str, revision: str) -> None:
        payload = self._json_body()
        with self.hub.lock:
            repo = self._repo_for_write(repo_type, repo_id)
            sha = self.hub.store.resolve_revision(repo, revision)
            files = repo["commits"][sha]["files"]
            patterns = self.hub.store.lfs_patterns(files)
            ignore = payload.get("gitIgnore")
            if ignore is None and ".gitignore" in files:
                ignore = self.hub.store.read_blob(files[".gitignore"]["sha256"]).decode("utf-8", "replace")
            ignore_patterns = [ln.strip() for ln in (ignore or "").splitlines()
                               if ln.strip() and not ln.strip().startswith("#")]
            out = []
            for f in payload.get("files", []):
                path = f["path"]
                try:
                    sample = base64.b64decode(f.get("sample", ""))
                except Exception:
                    sample = b""
                lfs = self.hub.store.is_lfs(path, int(f.get("size", 0)), sample, patterns)
                existing = files.get(path)
                oid = None
                if existing is not None:
                    oid = existing["sha256"] if existing["lfs"] else existing["oid"]
                out.append({
                    "path": path,
                    "uploadMode": "lfs" if lfs else "regular",
                    "shouldIgnore": any(match_pattern(path, p) for p in ignore_patterns),
                    "oid": oid,
                })
        self._send_json(200, {"files": out, "commitOid": sha})

    def _lfs_batch(self, repo_type: str, repo_id: str) -> None:
        payload = self._json_body()
        with self.hub.lock:
            self._repo_for_write(repo_type, repo_id)
        if payload.get("operation") != "upload":
            raise HubError(400, "Only the 'upload' operation is supported by the loopback Hub")
        transfers = payload.get("transfers") or ["basic"]
        if "basic" not in transfers:
            raise HubError(400, f"No supported transfer among {transfers}; the loopback Hub speaks 'basic'")
        objects = []
        for obj in payload.get("objects", []):
            oid, size = obj.get("oid"), obj.get("size")
            if not isinstance(oid, str) or not re.fullmatch(r"[0-9a-f]{64}", oid) or not isinstance(size, int):
                objects.append({"oid": str(oid), "size": int(size or 0),
                                "error": {"code": 422, "message": "Invalid oid or size"}})
                continue
            if self.hub.store.has_blob(oid):
                objects.append({"oid": oid, "size": size})
                continue
            href = f"{self._base_url()}/lfs-upload/{oid}?size={size}&sig={self.hub.sign_upload(oid, size)}"
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
            raise HubError(400, "Missing size")
        if not hmac.compare_digest(sig, self.hub.sign_upload(oid, size)):
            raise HubError(403, "Invalid upload signature")
        fd, tmp = tempfile.mkstemp(dir=self.hub.store.tmp_dir)
        digest = hashlib.sha256()
        n = 0
        try:
            with os.fdopen(fd, "wb") as f:
                for chunk in self._iter_body():
                    digest.update(chunk)
                    n += len(chunk)
                    f.write(chunk)
            if digest.hexdigest() != oid or n != size:
                raise HubError(400, f"Uploaded content does not match oid/size ({n} bytes, expected {size})")
            with self.hub.lock:
                self.hub.store.adopt_blob_file(tmp, oid)
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
                    raise HubError(400, "Invalid NDJSON line in commit payload")
        if not lines or lines[0].get("key") != "header":
            raise HubError(400, "The commit payload must start with a header line")
        header = lines[0].get("value") or {}
        summary = header.get("summary")
        if not isinstance(summary, str) or not summary.strip():
            raise HubError(400, "Commit summary is required")
        with self.hub.lock:
            repo = self._repo_for_write(repo_type, repo_id)
            store = self.hub.store
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
                except HubError:
                    raise HubError(412, f"Parent commit {parent} is not the head of {revision}")
                if create_pr:
                    base_sha = parent_sha
                elif parent_sha != base_sha:
                    raise HubError(412, f"A commit has happened since. Parent commit {parent} is not the head of "
                                       f"{revision} ({base_sha})")
            tree = dict(repo["commits"][base_sha]["files"])
            for line in lines[1:]:
                key, value = line.get("key"), line.get("value") or {}
                path = str(value.get("path", "")).lstrip("/")
                if key in ("file", "lfsFile", "deletedFile") and not path:
                    raise HubError(400, f"Missing path in {key} operation")
                if ".." in path.split("/") or path.startswith(".git/") or path == ".git":
                    raise HubError(400, f"Invalid path {path!r}")
                if key == "file":
                    if value.get("encoding", "base64") != "base64":
                        data = str(value.get("content", "")).encode()
                    else:
                        try:
                            data = base64.b64decode(value.get("content", ""), validate=False)
                        except Exception:
                            raise HubError(400, f"Invalid base64 content for {path}")
                    tree[path] = store.file_entry(data, lfs=False)
                elif key == "lfsFile":
                    oid = value.get("oid")
                    if value.get("algo", "sha256") != "sha256" or not isinstance(oid, str):
                        raise HubError(400, f"Invalid lfsFile operation for {path}")
                    if not store.has_blob(oid):
                        raise HubError(422, f"LFS object {oid} for {path} was not uploaded (missing from storage)")
                    size = store.blob_path(oid).stat().st_size
                    if value.get("size") is not None and int(value["size"]) != size:
                        raise HubError(422, f"LFS object {oid} for {path} has size {size}, not {value['size']}")
                    tree[path] = store.entry_for_blob(oid, size, lfs=True)
                elif key == "deletedFile":
                    if path not in tree:
                        raise HubError(404, f"A file with this name doesn't exist: {path}", "EntryNotFound")
                    del tree[path]
                else:
                    raise HubError(400, f"Unknown commit operation {key!r}")
            pr_url = None
            if create_pr:
                repo["pr_count"] = repo.get("pr_count", 0) + 1
                num = repo["pr_count"]
                branch = f"refs/pr/{num}"
                pr_url = f"{self._repo_url(repo_type, repo_id)}/discussions/{num}"
            sha = store.make_commit(repo, branch, tree, summary, header.get("description") or "",
                                    author=self._user, create_branch=True, parent=base_sha)
        self._send_json(200, {
            "success": True,
            "commitOid": sha,
            "commitUrl": f"{self._repo_url(repo_type, repo_id)}/commit/{sha}",
            "hookOutput": "",
            "pullRequestUrl": pr_url,
        })

    # validate-yaml --------------------------------------------------------------------------------
    def _validate_yaml(self) -> None:
        payload = self._json_body()
        content = payload.get("content") if isinstance(payload, dict) else None
        if not isinstance(content, str):
            raise HubError(400, "Missing 'content'", body={"errors": [{"message": "Missing 'content'"}]})
        errors, warnings = validate_card_metadata(content, payload.get("repoType") or "model")
        if errors:
            raise HubError(400, "Invalid metadata in README.md", body={"errors": errors, "warnings": warnings})
        self._send_json(200, {"errors": [], "warnings": warnings})
