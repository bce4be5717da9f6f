"""A loopback, Hub-compatible HTTP server for tests.

The real, unmodified clients (huggingface_hub, transformers, datasets, peft) talk to it through
``HF_ENDPOINT=http://127.0.0.1:PORT``. It speaks the subset of the Hub protocol those clients use:

* repo info        GET  /api/{models,datasets,spaces}/{id}[/revision/{rev}]
* tree listing     GET  /api/{type}s/{id}/tree/{rev}[/{path}]   (recursive, cursor pagination)
* paths info       POST /api/{type}s/{id}/paths-info/{rev}       (form-encoded or JSON)
* refs / commits   GET  /api/{type}s/{id}/refs, /api/{type}s/{id}/commits/{rev}
* branches / tags  POST /api/{type}s/{id}/branch/{branch}, POST /api/{type}s/{id}/tag/{rev}
* file download    HEAD/GET /[datasets/|spaces/]{id}/resolve/{rev}/{path}  (Range, ETag, X-Repo-Commit, ...)
* whoami           GET  /api/whoami-v2
* repo creation    POST /api/repos/create
* upload           POST /api/{type}s/{id}/preupload/{rev}
                   POST /[datasets/]{id}.git/info/lfs/objects/batch   ("basic" transfer)
                   PUT  /lfs-upload/{sha256}?sig=...                  (the href handed out by the batch call)
                   POST /api/{type}s/{id}/commit/{rev}                (NDJSON: header/file/lfsFile/deletedFile)
* card check       POST /api/validate-yaml

Xet is not implemented: clients must run with ``HF_HUB_DISABLE_XET=1`` when uploading (with hf_xet
installed, huggingface_hub 2.x sends every upload through Xet and has no fallback). Downloads work
either way because the server never sends Xet headers.

Standard library only, apart from PyYAML (a dependency of huggingface_hub) for README front matter.
Repos live in memory for the server's life; file contents are blobs on disk under its storage folder.

Repos are created the way the real Hub creates them: ``create_repo`` (and ``add_repo``) make an
"initial commit" holding a default ``.gitattributes``; every commit gets a fresh 40-hex sha; branches,
tags and all older revisions stay readable by sha.

The modules, lowest first:

* errors.py            HubError: an error answer, raised anywhere below a request
* storage.py           repos, commits, branches, tags and blobs; git and LFS ids; which files go through LFS
* cards.py             README.md front matter, and the Hub's metadata check of it
* faults.py            what a test steers and reads: injected faults (FaultRule) and the request log
* request.py           one request: who asks, faults and log, body, answers, permission checks
* admin_endpoints.py   whoami; creating repos, branches and tags
* read_endpoints.py    repo info, tree, paths-info, refs, commits, file download
* upload_endpoints.py  preupload, the LFS batch call and PUT, the commit, the card check
* routes.py            which endpoint answers a method and path
* server.py            HubServer: the thread serving it, and the test's direct access (seeding, reading back)
* __main__.py          the server on its own, for a user to try a push offline: PYTHONPATH=tests python -m hub_server
"""

from .cards import validate_card_metadata
from .faults import FaultRule, RequestRecord
from .server import DEFAULT_TOKEN, HubServer
from .storage import git_blob_sha1

__all__ = ["HubServer", "FaultRule", "RequestRecord", "DEFAULT_TOKEN", "git_blob_sha1", "validate_card_metadata"]
