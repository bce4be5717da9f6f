"""What clients read from the loopback Hub: repo info (with the tags and pipeline_tag the Hub infers), tree and
paths-info listings, refs and commit history, and the files themselves (`resolve`, with Range reads)."""

from __future__ import annotations

import base64
import hashlib
import json
import re
import urllib.parse
from typing import Any

from .cards import as_str_list, load_yaml, split_front_matter
from .errors import HubError
from .request import Request

TREE_PAGE_SIZE = 1000
COMMITS_PAGE_SIZE = 50

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


class ReadEndpoints(Request):
    """Repo info, trees, refs, history and downloads (routes.Handler calls these)."""

    # repo info ------------------------------------------------------------------------------------
    def _card_metadata(self, files: dict) -> dict:
        entry = files.get("README.md")
        if entry is None:
            return {}
        try:
            yaml_text, _ = split_front_matter(self.hub.store.read_blob(entry["sha256"]).decode("utf-8", "replace"))
            meta = load_yaml(yaml_text) if yaml_text else None
        except Exception:
            return {}
        return meta if isinstance(meta, dict) else {}

    def _json_file(self, files: dict, name: str) -> dict:
        entry = files.get(name)
        if entry is None or entry["size"] > 5 * 1024 * 1024:
            return {}
        try:
            data = json.loads(self.hub.store.read_blob(entry["sha256"]))
        except Exception:
            return {}
        return data if isinstance(data, dict) else {}

    def _info_payload(self, repo: dict, sha: str) -> dict:
        commit = repo["commits"][sha]
        files = commit["files"]
        repo_type = repo["type"]
        card = self._card_metadata(files)
        tags = [t for t in (as_str_list(card.get("tags")) or []) if isinstance(t, str)]
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
            for ds in as_str_list(card.get("datasets")) or []:
                if isinstance(ds, str):
                    tags.append(f"dataset:{ds}")
            for bm in as_str_list(card.get("base_model")) or []:
                if isinstance(bm, str):
                    tags.append(f"base_model:{bm}")
        elif repo_type == "dataset":
            if isinstance(card.get("license"), str):
                tags.append(f"license:{card['license']}")
            if any(p.endswith(".parquet") for p in files):
                tags.append("format:parquet")
        out["tags"] = list(dict.fromkeys(tags))
        if card:
            out["cardData"] = card
        out["siblings"] = [{"rfilename": path} for path in sorted(files)]
        out["spaces"] = []
        out["usedStorage"] = sum(e["size"] for e in files.values())
        return out

    def _repo_info(self, repo_type: str, repo_id: str, revision: str) -> None:
        with self.hub.lock:
            repo = self._repo_for_read(repo_type, repo_id)
            sha = self.hub.store.resolve_revision(repo, revision)
            payload = self._info_payload(repo, sha)
        self._send_json(200, payload, headers={"X-Repo-Commit": sha})

    # tree / paths-info ----------------------------------------------------------------------------
    @staticmethod
    def _entry_json(path: str, entry: dict | None, files: dict) -> dict:
        if entry is None:  # directory
            prefix = path + "/"
            digest = hashlib.sha1()
            for p in sorted(files):
                if p.startswith(prefix):
                    digest.update(f"{p}\0{files[p]['oid']}\n".encode())
            return {"type": "directory", "oid": digest.hexdigest(), "size": 0, "path": path}
        out: dict[str, Any] = {"type": "file", "oid": entry["oid"], "size": entry["size"], "path": path}
        if entry["lfs"]:
            out["lfs"] = {"oid": entry["sha256"], "size": entry["size"], "pointerSize": entry["pointer_size"]}
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
        try:
            limit = max(1, min(int((q.get("limit") or [TREE_PAGE_SIZE])[0]), TREE_PAGE_SIZE))
        except ValueError:
            raise HubError(400, "Invalid limit")
        cursor = (q.get("cursor") or [""])[0]
        path = path.strip("/")
        with self.hub.lock:
            repo = self._repo_for_read(repo_type, repo_id)
            sha = self.hub.store.resolve_revision(repo, revision)
            files = repo["commits"][sha]["files"]
            dirs = self._dirs_of(files)
            if path and path not in dirs:
                raise HubError(404, f"Entry not found: {path}", "EntryNotFound", headers={"X-Repo-Commit": sha})
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
                    raise HubError(400, "Invalid cursor")
            page = names[start:start + limit]
            entries = [self._entry_json(p, None if p in dirs else files[p], files) for p in page]
        headers = {"X-Repo-Commit": sha}
        if start + limit < len(names):
            next_cursor = base64.urlsafe_b64encode(str(start + limit).encode()).decode()
            params = {"recursive": str(recursive), "limit": str(limit), "cursor": next_cursor}
            url = f"{self._base_url()}{self.path.split('?', 1)[0]}?{urllib.parse.urlencode(params)}"
            headers["Link"] = f'<{url}>; rel="next"'
        self._send_json(200, entries, headers=headers)

    def _paths_info(self, repo_type: str, repo_id: str, revision: str) -> None:
        body = self._json_body()
        paths = body.get("paths", []) if isinstance(body, dict) else []
        if isinstance(paths, str):
            paths = [paths]
        with self.hub.lock:
            repo = self._repo_for_read(repo_type, repo_id)
            sha = self.hub.store.resolve_revision(repo, revision)
            files = repo["commits"][sha]["files"]
            dirs = self._dirs_of(files)
            out = []
            for p in paths:
                p = p.strip("/")
                if p in files:
                    out.append(self._entry_json(p, files[p], files))
                elif p in dirs:
                    out.append(self._entry_json(p, None, files))
        self._send_json(200, out, headers={"X-Repo-Commit": sha})

    # refs / commits -------------------------------------------------------------------------------
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
            sha = self.hub.store.resolve_revision(repo, revision)
            hist = self.hub.store.history(repo, sha)
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

    # download -------------------------------------------------------------------------------------
    def _resolve(self, repo_type: str, repo_id: str, revision: str, path: str, head_only: bool) -> None:
        with self.hub.lock:
            repo = self._repo_for_read(repo_type, repo_id)
            sha = self.hub.store.resolve_revision(repo, revision)
            entry = repo["commits"][sha]["files"].get(path)
            if entry is None:
                raise HubError(404, f"Entry not found: {path}", "EntryNotFound", headers={"X-Repo-Commit": sha})
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
                raise HubError(416, "Invalid range", headers={"Content-Range": f"bytes */{size}"})
            if m.group(1) == "":
                n = int(m.group(2))
                start, end = max(size - n, 0), size - 1
            else:
                start = int(m.group(1))
                end = min(int(m.group(2)), size - 1) if m.group(2) else size - 1
            if start >= size or start > end:
                raise HubError(416, "Range not satisfiable", headers={"Content-Range": f"bytes */{size}"})
            status = 206
            headers["Content-Range"] = f"bytes {start}-{end}/{size}"
        length = max(end - start + 1, 0)
        if head_only:
            self._send(status, b"", headers=headers, content_type=ctype, head_only=True, content_length=length)
            return
        blob = self.hub.store.blob_path(entry["sha256"])
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

