"""The loopback Hub's account and repo administration: whoami, creating, deleting and moving repos, their settings,
branches and tags."""

from __future__ import annotations

import hashlib
import re

from .errors import HubError
from .request import Request
from .storage import REPO_TYPES, now_iso

_REPO_ID_PART = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")


class AdminEndpoints(Request):
    """Accounts, repos, settings, branches and tags (routes.Handler calls these)."""

    # account --------------------------------------------------------------------------------------
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
                     "accessToken": {"displayName": "loopback", "role": self._role, "createdAt": now_iso()}},
        })

    # repos ----------------------------------------------------------------------------------------
    def _parse_repo_payload(self, payload: dict) -> tuple[str, str]:
        name = payload.get("name")
        org = payload.get("organization")
        repo_type = payload.get("type") or "model"
        if repo_type not in REPO_TYPES:
            raise HubError(400, f"Invalid repo type {repo_type!r}")
        if not isinstance(name, str) or not _REPO_ID_PART.match(name) or "--" in name or ".." in name:
            raise HubError(400, f"Invalid repo name {name!r}")
        namespace = org or self._user
        if not isinstance(namespace, str) or not _REPO_ID_PART.match(namespace):
            raise HubError(400, f"Invalid namespace {namespace!r}")
        return repo_type, f"{namespace}/{name}"

    def _create_repo(self) -> None:
        payload = self._json_body()
        self._require_write()
        repo_type, repo_id = self._parse_repo_payload(payload if isinstance(payload, dict) else {})
        private = payload.get("private")
        if "visibility" in payload:
            private = payload["visibility"] != "public"
        with self.hub.lock:
            if self.hub.store.get(repo_type, repo_id) is not None:
                raise HubError(409, "You already created this repo", body={
                    "error": "You already created this repo", "url": self._repo_url(repo_type, repo_id)})
            repo = self.hub.store.create_repo(repo_type, repo_id, bool(private), owner=self._user)
            self.hub.store.save()
        self._send_json(200, {"url": self._repo_url(repo_type, repo_id), "name": repo_id, "id": repo["uid"]})

    def _delete_repo(self) -> None:
        payload = self._json_body()
        self._require_write()
        repo_type, repo_id = self._parse_repo_payload(payload if isinstance(payload, dict) else {})
        with self.hub.lock:
            self._repo_for_write(repo_type, repo_id)
            self.hub.store.repos.pop(self.hub.store.key(repo_type, repo_id))
            self.hub.store.save()
        self._send_json(200, {})

    def _move_repo(self) -> None:
        payload = self._json_body()
        self._require_write()
        repo_type = payload.get("type") or "model"
        src, dst = payload.get("fromRepo"), payload.get("toRepo")
        with self.hub.lock:
            repo = self._repo_for_write(repo_type, src)
            if self.hub.store.get(repo_type, dst) is not None:
                raise HubError(409, f"{dst} already exists")
            self.hub.store.repos.pop(self.hub.store.key(repo_type, src))
            repo["id"] = dst
            self.hub.store.repos[self.hub.store.key(repo_type, dst)] = repo
            self.hub.store.save()
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
            self.hub.store.save()
        self._send_json(200, {})

    # branches and tags ----------------------------------------------------------------------------
    def _branch(self, method: str, repo_type: str, repo_id: str, branch: str) -> None:
        payload = self._json_body() if method == "POST" else (self._drain_body() or {})
        with self.hub.lock:
            repo = self._repo_for_write(repo_type, repo_id)
            if method == "DELETE":
                if branch not in repo["branches"] or branch == "main":
                    raise HubError(404 if branch != "main" else 403, f"Cannot delete branch {branch}",
                                   "RevisionNotFound" if branch != "main" else None)
                del repo["branches"][branch]
            else:
                if branch in repo["branches"]:
                    raise HubError(409, f"Reference already exists: refs/heads/{branch}")
                start = payload.get("startingPoint") if isinstance(payload, dict) else None
                repo["branches"][branch] = self.hub.store.resolve_revision(repo, start or "main")
            self.hub.store.save()
        self._send_json(200, {})

    def _tag(self, method: str, repo_type: str, repo_id: str, arg: str) -> None:
        payload = self._json_body() if method == "POST" else (self._drain_body() or {})
        with self.hub.lock:
            repo = self._repo_for_write(repo_type, repo_id)
            if method == "DELETE":
                if arg not in repo["tags"]:
                    raise HubError(404, f"Tag {arg} not found", "RevisionNotFound")
                del repo["tags"][arg]
            else:
                tag = payload.get("tag") if isinstance(payload, dict) else None
                if not tag:
                    raise HubError(400, "Missing tag")
                if tag in repo["tags"]:
                    raise HubError(409, f"Tag {tag} already exists")
                repo["tags"][tag] = self.hub.store.resolve_revision(repo, arg)
            self.hub.store.save()
        self._send_json(200, {})

