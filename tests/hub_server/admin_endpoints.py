"""The loopback Hub's account and repo administration: whoami, creating repos, branches and tags."""

from __future__ import annotations

import hashlib
import re

from .errors import HubError
from .request import Request
from .storage import REPO_TYPES, now_iso

_REPO_ID_PART = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")


class AdminEndpoints(Request):
    """Whoami, and creating repos, branches and tags (routes.Handler calls these)."""

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
                     "accessToken": {"displayName": "loopback", "role": "write", "createdAt": now_iso()}},
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
        self._require_token()
        repo_type, repo_id = self._parse_repo_payload(payload if isinstance(payload, dict) else {})
        private = payload.get("private")
        if "visibility" in payload:
            private = payload["visibility"] != "public"
        with self.hub.lock:
            if self.hub.store.get(repo_type, repo_id) is not None:
                raise HubError(409, "You already created this repo", body={
                    "error": "You already created this repo", "url": self._repo_url(repo_type, repo_id)})
            repo = self.hub.store.create_repo(repo_type, repo_id, bool(private), owner=self._user)
        self._send_json(200, {"url": self._repo_url(repo_type, repo_id), "name": repo_id, "id": repo["uid"]})

    # branches and tags ----------------------------------------------------------------------------
    def _create_branch(self, repo_type: str, repo_id: str, branch: str) -> None:
        payload = self._json_body()
        with self.hub.lock:
            repo = self._repo_for_write(repo_type, repo_id)
            if branch in repo["branches"]:
                raise HubError(409, f"Reference already exists: refs/heads/{branch}")
            start = payload.get("startingPoint") if isinstance(payload, dict) else None
            repo["branches"][branch] = self.hub.store.resolve_revision(repo, start or "main")
        self._send_json(200, {})

    def _create_tag(self, repo_type: str, repo_id: str, revision: str) -> None:
        payload = self._json_body()
        with self.hub.lock:
            repo = self._repo_for_write(repo_type, repo_id)
            tag = payload.get("tag") if isinstance(payload, dict) else None
            if not tag:
                raise HubError(400, "Missing tag")
            if tag in repo["tags"]:
                raise HubError(409, f"Tag {tag} already exists")
            repo["tags"][tag] = self.hub.store.resolve_revision(repo, revision)
        self._send_json(200, {})
