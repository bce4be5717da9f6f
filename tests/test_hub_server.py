"""The loopback Hub (tests/hub_server/) against the real, unmodified clients.

No mocks: huggingface_hub, transformers and datasets talk HTTP to the server started by the
`hub_server` fixture (tests/conftest.py), through HF_ENDPOINT.
"""

from __future__ import annotations

import http.client
import json
import os
import pathlib
import socket
import struct
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hub_server import DEFAULT_TOKEN, git_blob_sha1, validate_card_metadata  # noqa: E402

TOKEN = DEFAULT_TOKEN

README = """---
license: apache-2.0
tags:
- image-classification
- vit
datasets:
- food101
---

# A test model
"""


def _api(token=TOKEN):
    from huggingface_hub import HfApi

    return HfApi(token=token)


def _write_safetensors(path: pathlib.Path) -> None:
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    save_file({"w": torch.randn(64, 32, generator=g), "b": torch.zeros(64)}, str(path))


def _http(hub, method: str, path: str, headers: dict | None = None, data: bytes | None = None):
    """A raw request (urllib, no client logic) -> (status, headers, body)."""
    req = urllib.request.Request(hub.url + path, method=method, headers=headers or {}, data=data)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


# --------------------------------------------------------------------------------------------------
# 1. create_repo(private) + upload_folder (LFS + README) + snapshot_download, idempotent re-upload
# --------------------------------------------------------------------------------------------------
def test_upload_folder_roundtrip_and_reupload(hub, hub_repo_id, tmp_path):
    from huggingface_hub import snapshot_download

    api = _api()
    url = api.create_repo(hub_repo_id, private=True)
    assert url.repo_id == hub_repo_id
    assert hub.is_private(hub_repo_id)
    # exist_ok: the client reads `url` from the 409 body
    assert api.create_repo(hub_repo_id, private=True, exist_ok=True).repo_id == hub_repo_id

    src = tmp_path / "src"
    (src / "nested").mkdir(parents=True)
    _write_safetensors(src / "model.safetensors")
    (src / "README.md").write_text(README)
    (src / "config.json").write_text(json.dumps({"a": 1}))
    (src / "nested" / "notes.txt").write_text("hello\n")
    uploaded = {p.relative_to(src).as_posix(): p.read_bytes() for p in src.rglob("*") if p.is_file()}

    info = api.upload_folder(folder_path=src, repo_id=hub_repo_id, commit_message="first upload")
    assert len(info.oid) == 40 and info.oid == hub.head(hub_repo_id)

    # the safetensors file went through LFS (preupload said so, batch + PUT happened), the rest inline
    assert hub.lfs_files(hub_repo_id) == {"model.safetensors"}
    assert hub.requests("POST", r"/info/lfs/objects/batch$", status=200)
    assert hub.requests("PUT", r"^/lfs-upload/", status=200)
    assert len(hub.requests("POST", rf"/api/models/{hub_repo_id}/commit/main$", status=200)) == 1
    # the client checks README metadata with the server before uploading (upload_folder does it twice)
    assert hub.requests("POST", r"^/api/validate-yaml$", status=200)

    stored = hub.repo_files(hub_repo_id)
    assert {k: v for k, v in stored.items() if k != ".gitattributes"} == uploaded
    assert ".gitattributes" in stored  # the Hub's initial commit

    local = pathlib.Path(snapshot_download(hub_repo_id, token=TOKEN, cache_dir=tmp_path / "cache"))
    for rel, content in uploaded.items():
        assert (local / rel).read_bytes() == content, rel

    # same folder again: the client sees identical oids and skips the commit
    n_commits = len(hub.commits(hub_repo_id))
    info2 = api.upload_folder(folder_path=src, repo_id=hub_repo_id, commit_message="second upload")
    commits = hub.commits(hub_repo_id)
    assert len(commits) == n_commits, "identical re-upload should not create a commit"
    assert info2.oid == info.oid
    assert hub.repo_files(hub_repo_id) == stored
    assert [c["title"] for c in commits] == ["first upload", "initial commit"]

    # a changed file gives a new commit; the old revision stays readable
    (src / "nested" / "notes.txt").write_text("changed\n")
    info3 = api.upload_folder(folder_path=src, repo_id=hub_repo_id, commit_message="third")
    assert info3.oid != info.oid
    assert hub.repo_files(hub_repo_id)["nested/notes.txt"] == b"changed\n"
    assert hub.repo_files(hub_repo_id, revision=info.oid)["nested/notes.txt"] == b"hello\n"
    assert api.model_info(hub_repo_id, revision=info.oid).sha == info.oid


# --------------------------------------------------------------------------------------------------
# 2. a tiny ViT: from_pretrained and pipeline() load it from the server, same logits
# --------------------------------------------------------------------------------------------------
def test_vit_from_pretrained_and_pipeline(hub, hub_repo_id, tmp_path):
    import numpy as np
    import torch
    from PIL import Image
    from transformers import ViTConfig, ViTForImageClassification, ViTImageProcessor, pipeline

    labels = ["apple", "banana", "cherry"]
    config = ViTConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        image_size=32, patch_size=4, num_labels=3,
        id2label=dict(enumerate(labels)), label2id={l: i for i, l in enumerate(labels)},
    )
    torch.manual_seed(0)
    model = ViTForImageClassification(config).eval()
    processor = ViTImageProcessor(size={"height": 32, "width": 32})
    local = tmp_path / "vit"
    model.save_pretrained(local)
    processor.save_pretrained(local)
    assert (local / "model.safetensors").exists()

    api = _api()
    api.create_repo(hub_repo_id)
    api.upload_folder(folder_path=local, repo_id=hub_repo_id)
    assert "model.safetensors" in hub.lfs_files(hub_repo_id)

    info = api.model_info(hub_repo_id)
    assert info.pipeline_tag == "image-classification"  # inferred from config.json architectures
    assert info.library_name == "transformers"

    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 256, (48, 40, 3), dtype=np.uint8))
    pixel_values = processor(images=image, return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        expected = model(pixel_values=pixel_values).logits[0]

    remote = ViTForImageClassification.from_pretrained(hub_repo_id).eval()
    with torch.no_grad():
        got = remote(pixel_values=pixel_values).logits[0]
    torch.testing.assert_close(got, expected)
    assert remote.config.id2label == config.id2label

    # task inferred from the Hub's pipeline_tag (GET /api/models/{id}); raw logits via function_to_apply
    clf = pipeline(model=hub_repo_id, device="cpu")
    assert clf.task == "image-classification"
    out = clf(image, top_k=3, function_to_apply="none")
    by_label = {o["label"]: o["score"] for o in out}
    np.testing.assert_allclose([by_label[l] for l in labels], expected.numpy(), rtol=1e-4, atol=1e-5)
    assert hub.requests("GET", rf"^/api/models/{hub_repo_id}$", status=200)

    clf2 = pipeline("image-classification", model=hub_repo_id, device="cpu")
    out2 = clf2(image, top_k=3)
    probs = torch.softmax(expected, -1).numpy()
    np.testing.assert_allclose([{o["label"]: o["score"] for o in out2}[l] for l in labels], probs,
                               rtol=1e-4, atol=1e-6)


# --------------------------------------------------------------------------------------------------
# 3. a parquet dataset repo loads with datasets.load_dataset
# --------------------------------------------------------------------------------------------------
def test_dataset_parquet_load_dataset(hub, hub_repo_id, tmp_path):
    import datasets
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(1)

    def make(n):
        imgs = [Image.fromarray(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)) for _ in range(n)]
        return datasets.Dataset.from_dict({"image": imgs, "label": [i % 3 for i in range(n)]}).cast_column(
            "image", datasets.Image())

    src = tmp_path / "ds"
    (src / "data").mkdir(parents=True)
    make(12).to_parquet(str(src / "data" / "train-00000-of-00001.parquet"))
    make(5).to_parquet(str(src / "data" / "validation-00000-of-00001.parquet"))

    api = _api()
    api.create_repo(hub_repo_id, repo_type="dataset")
    api.upload_folder(folder_path=src, repo_id=hub_repo_id, repo_type="dataset")
    assert hub.lfs_files(hub_repo_id, repo_type="dataset") == {
        "data/train-00000-of-00001.parquet", "data/validation-00000-of-00001.parquet"}

    ds = datasets.load_dataset(hub_repo_id, cache_dir=str(tmp_path / "ds_cache"))
    assert set(ds) == {"train", "validation"}
    assert ds["train"].num_rows == 12 and ds["validation"].num_rows == 5
    row = ds["train"][4]
    assert row["label"] == 1
    assert row["image"].size == (16, 16)
    # it went through the dataset API + tree listing + resolve
    assert hub.requests("GET", rf"^/api/datasets/{hub_repo_id}", status=200)
    assert hub.requests("GET", rf"^/api/datasets/{hub_repo_id}/tree/", status=200)
    assert hub.requests("GET", rf"^/datasets/{hub_repo_id}/resolve/.*\.parquet$")


# --------------------------------------------------------------------------------------------------
# 4. fault injection, auth
# --------------------------------------------------------------------------------------------------
def test_faults_on_commit_endpoint(hub, hub_repo_id, tmp_path):
    from huggingface_hub import CommitOperationAdd
    from huggingface_hub.errors import HfHubHTTPError

    api = _api()
    api.create_repo(hub_repo_id)
    rule = hub.inject_faults(status=503, times=2, path_regex=r"/commit/main$", method="POST")

    def commit():
        return api.create_commit(
            hub_repo_id, [CommitOperationAdd("a.txt", b"payload")], commit_message="add a")

    statuses = []
    for _ in range(2):
        with pytest.raises(HfHubHTTPError) as exc:
            commit()
        statuses.append(exc.value.response.status_code)
    info = commit()
    assert statuses == [503, 503]
    assert rule.hits == 2 and rule.exhausted
    # the client sends the commit POST once per call: no hidden retry
    assert [r.status for r in hub.requests("POST", r"/commit/main$")] == [503, 503, 200]
    assert hub.repo_files(hub_repo_id)["a.txt"] == b"payload"
    assert info.oid == hub.head(hub_repo_id)

    # always failing -> upload_folder raises HfHubHTTPError, nothing committed
    head = hub.head(hub_repo_id)
    hub.inject_faults(status=500, times=None, path_regex=r"/commit/")
    (tmp_path / "f").mkdir()
    (tmp_path / "f" / "b.txt").write_text("b")
    with pytest.raises(HfHubHTTPError) as exc:
        api.upload_folder(folder_path=tmp_path / "f", repo_id=hub_repo_id)
    assert exc.value.response.status_code == 500
    assert hub.head(hub_repo_id) == head
    hub.clear_faults()
    api.upload_folder(folder_path=tmp_path / "f", repo_id=hub_repo_id)
    assert hub.repo_files(hub_repo_id)["b.txt"] == b"b"


def test_a_reset_fault_drops_the_connection_and_commits_nothing(hub, hub_repo_id):
    from huggingface_hub import CommitOperationAdd

    from vit_finetune.core.hub import http_library

    api = _api()
    api.create_repo(hub_repo_id)
    head = hub.head(hub_repo_id)
    rule = hub.inject_faults(status=None, reset=True, times=1, path_regex=r"/commit/main$", method="POST")
    with pytest.raises(http_library().TransportError):  # no HTTP status at all: the connection is gone
        api.create_commit(hub_repo_id, [CommitOperationAdd("a.txt", b"payload")], commit_message="add a")
    assert rule.exhausted and hub.head(hub_repo_id) == head
    api.create_commit(hub_repo_id, [CommitOperationAdd("a.txt", b"payload")], commit_message="add a")
    assert hub.repo_files(hub_repo_id)["a.txt"] == b"payload"


def test_auth_required_for_writes(hub, hub_repo_id):
    from huggingface_hub.errors import HfHubHTTPError

    with pytest.raises(HfHubHTTPError) as exc:
        _api(token=False).create_repo(hub_repo_id)
    assert exc.value.response.status_code == 401
    with pytest.raises(HfHubHTTPError) as exc:
        _api(token="hf_not_a_token").create_repo(hub_repo_id)
    assert exc.value.response.status_code == 401
    assert not hub.repo_exists(hub_repo_id)

    assert _api().whoami()["name"] == "user"
    with pytest.raises(HfHubHTTPError):
        _api(token="hf_not_a_token").whoami()

    # writing into an existing repo without a token fails too
    hub.add_repo(hub_repo_id, {"x.txt": b"x"})
    status, _, _ = _http(hub, "POST", f"/api/models/{hub_repo_id}/commit/main",
                         headers={"Content-Type": "application/x-ndjson"},
                         data=b'{"key": "header", "value": {"summary": "s"}}\n')
    assert status == 401


# --------------------------------------------------------------------------------------------------
# 5. private repos need a token to read
# --------------------------------------------------------------------------------------------------
def test_private_repo_download(hub, hub_repo_id, tmp_path):
    from huggingface_hub import hf_hub_download, snapshot_download
    from huggingface_hub.errors import RepositoryNotFoundError

    hub.add_repo(hub_repo_id, {"weights.bin": b"\x00\x01secret", "config.json": b"{}"}, private=True)

    with pytest.raises(RepositoryNotFoundError) as exc:
        hf_hub_download(hub_repo_id, "config.json", token=False, cache_dir=tmp_path / "c1")
    assert exc.value.response.status_code == 401
    with pytest.raises(RepositoryNotFoundError):
        snapshot_download(hub_repo_id, token=False, cache_dir=tmp_path / "c1")
    with pytest.raises(RepositoryNotFoundError):
        _api(token=False).model_info(hub_repo_id)

    path = hf_hub_download(hub_repo_id, "weights.bin", token=TOKEN, cache_dir=tmp_path / "c2")
    assert pathlib.Path(path).read_bytes() == b"\x00\x01secret"
    assert _api().model_info(hub_repo_id).private is True

    hub.set_private(hub_repo_id, False)
    path = hf_hub_download(hub_repo_id, "config.json", token=False, cache_dir=tmp_path / "c3")
    assert pathlib.Path(path).read_bytes() == b"{}"


# --------------------------------------------------------------------------------------------------
# 6. README metadata check
# --------------------------------------------------------------------------------------------------
def test_validate_yaml_rejects_local_dataset_path(hub, hub_repo_id):
    api = _api()
    api.create_repo(hub_repo_id)
    head = hub.head(hub_repo_id)
    bad = "---\nlicense: mit\ndatasets:\n- /home/me/data/food101\n---\n# card\n"
    with pytest.raises(ValueError, match="Invalid metadata in README.md"):
        api.upload_file(path_or_fileobj=bad.encode(), path_in_repo="README.md", repo_id=hub_repo_id)
    assert hub.requests("POST", r"^/api/validate-yaml$", status=400)
    assert hub.head(hub_repo_id) == head  # nothing committed

    for value in ("./data", "~/data", "C:\\data", "../x"):
        errors, _ = validate_card_metadata(f"---\ndatasets: {json.dumps(value)}\n---\n")
        assert errors, value
    errors, _ = validate_card_metadata("---\ndatasets: [food101, user/my-ds]\nbase_model: google/vit\n---\n")
    assert errors == []
    errors, _ = validate_card_metadata("---\ndatasets: [unclosed\n---\n")
    assert errors  # not YAML
    _, warnings = validate_card_metadata("# no metadata\n")
    assert warnings

    good = "---\nlicense: mit\ndatasets:\n- food101\n---\n# card\n"
    api.upload_file(path_or_fileobj=good.encode(), path_in_repo="README.md", repo_id=hub_repo_id)
    assert hub.repo_files(hub_repo_id)["README.md"] == good.encode()


# --------------------------------------------------------------------------------------------------
# protocol details the clients rely on
# --------------------------------------------------------------------------------------------------
def test_resolve_headers_ranges_and_errors(hub, hub_repo_id):
    content = bytes(range(256)) * 8
    sha = hub.add_repo(hub_repo_id, {"blob.bin": content, "a/b.txt": b"text file\n"})

    status, headers, body = _http(hub, "HEAD", f"/{hub_repo_id}/resolve/main/a/b.txt")
    assert status == 200 and body == b""
    assert headers["X-Repo-Commit"] == sha
    assert headers["ETag"].strip('"') == git_blob_sha1(b"text file\n")
    assert headers["Content-Length"] == "10"

    status, headers, _ = _http(hub, "HEAD", f"/{hub_repo_id}/resolve/{sha}/blob.bin")
    assert status == 200 and headers["X-Linked-Size"] == str(len(content))
    import hashlib

    assert headers["X-Linked-Etag"].strip('"') == hashlib.sha256(content).hexdigest()

    status, headers, body = _http(hub, "GET", f"/{hub_repo_id}/resolve/main/blob.bin",
                                  headers={"Range": "bytes=10-19"})
    assert status == 206 and body == content[10:20]
    assert headers["Content-Range"] == f"bytes 10-19/{len(content)}"
    assert _http(hub, "GET", f"/{hub_repo_id}/resolve/main/blob.bin", headers={"Range": "bytes=-5"})[2] == content[-5:]
    assert _http(hub, "GET", f"/{hub_repo_id}/resolve/main/blob.bin",
                 headers={"Range": f"bytes={len(content)}-"})[0] == 416

    status, headers, _ = _http(hub, "HEAD", f"/{hub_repo_id}/resolve/main/missing.txt")
    assert status == 404 and headers["X-Error-Code"] == "EntryNotFound" and headers["X-Repo-Commit"] == sha
    status, headers, _ = _http(hub, "GET", f"/{hub_repo_id}/resolve/nope/a/b.txt")
    assert status == 404 and headers["X-Error-Code"] == "RevisionNotFound"
    status, headers, _ = _http(hub, "GET", "/user/does-not-exist/resolve/main/x")
    assert status in (401, 404) and headers["X-Error-Code"] == "RepoNotFound"

    # HfFileSystem: paths-info, tree listing and Range reads
    from huggingface_hub import HfFileSystem

    fs = HfFileSystem(token=TOKEN, skip_instance_cache=True)
    with fs.open(f"{hub_repo_id}/blob.bin", "rb", block_size=64) as f:
        f.seek(300)
        assert f.read(7) == content[300:307]
    assert fs.info(f"{hub_repo_id}/a")["type"] == "directory"
    assert fs.info(f"{hub_repo_id}/a/b.txt", refresh=True)["size"] == 10  # POST paths-info
    assert hub.requests("GET", rf"/{hub_repo_id}/resolve/main/blob.bin$", status=206)
    assert sorted(fs.ls(hub_repo_id, detail=False)) == sorted(
        f"{hub_repo_id}/{p}" for p in (".gitattributes", "a", "blob.bin"))
    assert hub.requests("POST", rf"/api/models/{hub_repo_id}/paths-info/")


def test_tree_pagination_and_helpers(hub, hub_repo_id):
    files = {f"d{i % 3}/f{i:03d}.txt": f"{i}".encode() for i in range(25)}
    hub.add_repo(hub_repo_id, files, repo_type="dataset")

    # cursor pagination with the Link header, as huggingface_hub follows it
    status, headers, body = _http(hub, "GET", f"/api/datasets/{hub_repo_id}/tree/main?recursive=true&limit=10")
    assert status == 200 and len(json.loads(body)) == 10 and 'rel="next"' in headers["Link"]
    from huggingface_hub import HfApi

    entries = list(HfApi(token=TOKEN).list_repo_tree(hub_repo_id, repo_type="dataset", recursive=True))
    assert {e.path for e in entries if hasattr(e, "size")} == set(files) | {".gitattributes"}
    assert {e.path for e in entries if not hasattr(e, "size")} == {"d0", "d1", "d2"}
    top = list(HfApi().list_repo_tree(hub_repo_id, repo_type="dataset"))
    assert sorted(e.path for e in top) == [".gitattributes", "d0", "d1", "d2"]
    sub = list(HfApi().list_repo_tree(hub_repo_id, "d1", repo_type="dataset"))
    assert all(e.path.startswith("d1/") for e in sub) and len(sub) == 8

    # seeding helpers
    sha2 = hub.commit_files(hub_repo_id, {"new.txt": b"n"}, deletions=["d0/f000.txt"], repo_type="dataset")
    now = hub.repo_files(hub_repo_id, repo_type="dataset")
    assert "new.txt" in now and "d0/f000.txt" not in now
    assert [c["id"] for c in hub.commits(hub_repo_id, repo_type="dataset")][0] == sha2
    assert HfApi().dataset_info(hub_repo_id).sha == sha2
    assert HfApi().file_exists(hub_repo_id, "new.txt", repo_type="dataset")
    assert not HfApi().file_exists(hub_repo_id, "d0/f000.txt", repo_type="dataset")


def test_branches_tags_and_refs(hub, hub_repo_id):
    from huggingface_hub import CommitOperationAdd, hf_hub_download

    api = _api()
    api.create_repo(hub_repo_id)
    api.create_branch(hub_repo_id, branch="dev")
    api.create_branch(hub_repo_id, branch="dev", exist_ok=True)
    api.create_commit(hub_repo_id, [CommitOperationAdd("x.txt", b"dev")], commit_message="on dev", revision="dev")
    api.create_tag(hub_repo_id, tag="v1", revision="dev")
    refs = api.list_repo_refs(hub_repo_id)
    assert {b.name for b in refs.branches} == {"main", "dev"} and [t.name for t in refs.tags] == ["v1"]
    assert "x.txt" not in hub.repo_files(hub_repo_id)
    assert pathlib.Path(hf_hub_download(hub_repo_id, "x.txt", revision="v1")).read_bytes() == b"dev"
    assert [c.title for c in api.list_repo_commits(hub_repo_id, revision="dev")] == ["on dev", "initial commit"]

    # a pull request lives on refs/pr/N, readable by hf_hub_download and HfFileSystem (unquoted special ref)
    from huggingface_hub import HfFileSystem

    pr = api.create_commit(hub_repo_id, [CommitOperationAdd("pr.txt", b"from a PR")], commit_message="PR",
                           create_pr=True)
    assert pr.pr_revision == "refs/pr/1" and pr.pr_num == 1
    assert "pr.txt" not in hub.repo_files(hub_repo_id)
    assert hub.repo_files(hub_repo_id, revision="refs/pr/1")["pr.txt"] == b"from a PR"
    assert pathlib.Path(hf_hub_download(hub_repo_id, "pr.txt", revision="refs/pr/1")).read_bytes() == b"from a PR"
    fs = HfFileSystem(skip_instance_cache=True)
    assert fs.read_bytes(f"{hub_repo_id}@refs/pr/1/pr.txt") == b"from a PR"


def test_raw_lfs_protocol_chunked_put_and_parent_commit(hub, hub_repo_id):
    """The upload protocol without the client: batch -> chunked PUT -> NDJSON commit."""
    import base64
    import hashlib
    import http.client

    hub.add_repo(hub_repo_id, {"old.txt": b"old"}, repo_type="dataset")
    auth = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    data = b"\x00binary" * 1000
    oid = hashlib.sha256(data).hexdigest()
    batch = {"operation": "upload", "transfers": ["basic"], "hash_algo": "sha256",
             "objects": [{"oid": oid, "size": len(data)}]}
    status, _, body = _http(hub, "POST", f"/datasets/{hub_repo_id}.git/info/lfs/objects/batch",
                            headers=auth, data=json.dumps(batch).encode())
    assert status == 200
    href = json.loads(body)["objects"][0]["actions"]["upload"]["href"]

    # no signature -> refused; chunked transfer-encoding is accepted
    assert _http(hub, "PUT", "/lfs-upload/" + oid + f"?size={len(data)}", data=data)[0] == 403
    conn = http.client.HTTPConnection("127.0.0.1", hub.port, timeout=10)
    conn.putrequest("PUT", href[len(hub.url):])
    conn.putheader("Transfer-Encoding", "chunked")
    conn.endheaders()
    for i in range(0, len(data), 1500):
        piece = data[i:i + 1500]
        conn.send(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
    conn.send(b"0\r\n\r\n")
    assert conn.getresponse().status == 200
    conn.close()

    head = hub.head(hub_repo_id, repo_type="dataset")
    lines = [
        {"key": "header", "value": {"summary": "raw commit", "description": "d", "parentCommit": head}},
        {"key": "lfsFile", "value": {"path": "blob.bin", "algo": "sha256", "oid": oid, "size": len(data)}},
        {"key": "file", "value": {"path": "t.txt", "content": base64.b64encode(b"t").decode(), "encoding": "base64"}},
        {"key": "deletedFile", "value": {"path": "old.txt"}},
    ]
    ndjson = b"".join(json.dumps(x).encode() + b"\n" for x in lines)
    commit_url = f"/api/datasets/{hub_repo_id}/commit/main"
    headers = {**auth, "Content-Type": "application/x-ndjson"}
    status, _, body = _http(hub, "POST", commit_url, headers=headers, data=ndjson)
    assert status == 200, body
    new = json.loads(body)["commitOid"]
    files = hub.repo_files(hub_repo_id, repo_type="dataset")
    assert files["blob.bin"] == data and files["t.txt"] == b"t" and "old.txt" not in files
    assert hub.lfs_files(hub_repo_id, repo_type="dataset") == {"blob.bin"}
    assert hub.commits(hub_repo_id, repo_type="dataset")[0]["id"] == new

    # the same parentCommit again is stale now -> 412 (datasets' push_to_hub retries on it)
    assert _http(hub, "POST", commit_url, headers=headers, data=ndjson)[0] == 412
    # an lfsFile whose object was never uploaded -> refused
    lines[0]["value"].pop("parentCommit")
    lines[1]["value"]["oid"] = "0" * 64
    missing = b"".join(json.dumps(x).encode() + b"\n" for x in lines[:2])
    assert _http(hub, "POST", commit_url, headers=headers, data=missing)[0] == 422


def test_a_request_is_in_the_log_as_soon_as_its_answer_has_arrived(hub, monkeypatch):
    """The handler logs a request after answering it; a test reading the log right after its request must still see
    it. The logging is slowed down here (a stand-in for a loaded machine) to make that race certain."""
    import time

    logged = hub._record

    def slow_record(*args):
        time.sleep(0.5)
        logged(*args)

    monkeypatch.setattr(hub, "_record", slow_record)
    status, _, _ = _http(hub, "GET", "/api/models/user/none-such")
    assert status in (401, 404)  # a missing repo answers like a private one to a caller without a token
    assert [(r.method, r.path, r.status) for r in hub.requests()] == [("GET", "/api/models/user/none-such", status)]


def test_a_client_hanging_up_its_kept_alive_connection_is_not_an_error(hub, capfd):
    """Connection pools close idle connections; a reset while the server waits for the next request is no error, so
    the server prints nothing. It used to print a traceback from its thread, and Python 3.11 parses source to draw a
    traceback, which raced with the main thread's imports: pytest crashed with "AST constructor recursion depth
    mismatch" at the end of tests/test_stream_shards.py run alone."""
    threads_before = threading.active_count()
    connection = http.client.HTTPConnection("127.0.0.1", hub.port, timeout=10)
    connection.request("GET", "/api/whoami-v2")
    assert connection.getresponse().read() and connection.sock is not None  # answered, and kept alive
    connection.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    connection.close()  # SO_LINGER 0: the kernel sends a reset, as a pool dropping a connection can
    deadline = time.monotonic() + 10
    while threading.active_count() > threads_before and time.monotonic() < deadline:  # its handler thread ends
        time.sleep(0.01)
    assert threading.active_count() <= threads_before
    assert "Traceback" not in capfd.readouterr().err
