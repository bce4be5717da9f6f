# --- loopback Hub ---
# A Hub-compatible server on 127.0.0.1 (tests/hub_server/) that the real huggingface_hub /
# transformers / datasets / peft clients talk to. huggingface_hub reads HF_ENDPOINT when it is
# imported, so the environment is set here, at conftest import, before any test module imports it.
#
# Environment set for the whole test session (and inherited by subprocesses):
#   HF_ENDPOINT=http://127.0.0.1:<port>   HF_HUB_DISABLE_XET=1   HF_HUB_DISABLE_TELEMETRY=1
#   HF_HOME=<session temp dir>  (hub + datasets caches and the token file live there; removed at exit)
#   VIT_FINETUNE_CACHE=<session temp dir>/vit_finetune_cache  (the demo's images, compiled graphs)
#   NO_PROXY/no_proxy extended with 127.0.0.1,localhost
#   HF_TOKEN / HUGGING_FACE_HUB_TOKEN / *_OFFLINE removed (no real token ever reaches the test Hub)
# HF_TOKEN is deliberately NOT set: in-process tests pass `token=HUB_TOKEN` explicitly. A subprocess that
# must write to the Hub gets `env=hub_env` (fixture) = os.environ + HF_TOKEN=HUB_TOKEN, e.g.
#   subprocess.run([sys.executable, "-m", "vit_finetune", ...], env=hub_env, check=True)
#
# Fixtures: `hub_server` (session: the running HubServer), `hub` (function: same server, faults and
# request log cleared), `hub_token`, `hub_env`, `hub_repo_id` (a fresh "user/<test-name>-<hex>" id).
import atexit as _hub_atexit
import os as _hub_os
import shutil as _hub_shutil
import socket as _hub_socket
import sys as _hub_sys
import tempfile as _hub_tempfile
import uuid as _hub_uuid
import warnings as _hub_warnings

import pytest as _hub_pytest

# --- the garbage collector ---
# The libraries the tests import hold about a million objects, which every full collection walks, and the tiny runs
# allocate fast enough to start thousands of collections. Measured on test_methods.py, test_families.py and
# test_regression.py (157 tests, one process): 5.2 of 64 CPU-s went to the collector with Python's default thresholds
# (700, 10, 10), 1.8 of 56 with these thresholds and what the collection imported frozen (pytest_collection_finish).
# Cyclic garbage waits longer to be freed; a test that needs it gone calls gc.collect() itself.
import gc as _gc  # noqa: E402

_gc.set_threshold(20_000, 20, 20)


def pytest_collection_finish(session):
    """The test modules and the libraries they imported live as long as this process: out of the collector's reach."""
    _gc.collect()
    _gc.freeze()


# --- one torch thread per test process ---
# The workers (one per core) already keep every core busy, and the runs are tiny: torch's default of one thread per
# core puts two threads on each core, and its thread pool then spends most of a tiny op waiting for a core (measured
# on 2 cores with one other busy process: tests/test_keep_best.py took 119 CPU-s with the default, 20 with one
# thread). Set before torch is imported, here and in every subprocess the tests start; a value already set is kept.
_hub_os.environ.setdefault("OMP_NUM_THREADS", "1")
if "torch" in _hub_sys.modules:
    _hub_sys.modules["torch"].set_num_threads(int(_hub_os.environ["OMP_NUM_THREADS"]))

_hub_tests_dir = _hub_os.path.dirname(_hub_os.path.abspath(__file__))
if _hub_tests_dir not in _hub_sys.path:  # so `import hub_server` works under any --import-mode
    _hub_sys.path.insert(0, _hub_tests_dir)

from hub_server import DEFAULT_TOKEN as _HUB_DEFAULT_TOKEN  # noqa: E402
from hub_server import HubServer as _HubServer  # noqa: E402

HUB_TOKEN = _HUB_DEFAULT_TOKEN  # "hf_test_token"
HUB_USER = "user"


def _hub_free_port() -> int:
    with _hub_socket.socket(_hub_socket.AF_INET, _hub_socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_HUB_TMP = _hub_tempfile.mkdtemp(prefix="loopback-hub-")
_hub_atexit.register(_hub_shutil.rmtree, _HUB_TMP, True)
HUB_PORT = _hub_free_port()
HUB_URL = f"http://127.0.0.1:{HUB_PORT}"

_hub_os.environ["HF_ENDPOINT"] = HUB_URL
_hub_os.environ["HF_HUB_DISABLE_XET"] = "1"
_hub_os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
_hub_os.environ["HF_HOME"] = _hub_os.path.join(_HUB_TMP, "hf_home")
# The toolkit's own cache (the demo's generated images, inductor's compiled code) lives in the session's folder too:
# a test run then reads nothing an earlier run left in ~/.cache, and takes what it takes on a fresh machine.
_hub_os.environ["VIT_FINETUNE_CACHE"] = _hub_os.path.join(_HUB_TMP, "vit_finetune_cache")
for _hub_var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE",
                 "HF_DATASETS_OFFLINE", "HUGGINGFACE_CO_STAGING", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE",
                 "HF_DATASETS_CACHE", "HF_TOKEN_PATH", "HF_XET_CACHE", "HF_ASSETS_CACHE"):
    _hub_os.environ.pop(_hub_var, None)
for _hub_var in ("NO_PROXY", "no_proxy"):
    _hub_prev = _hub_os.environ.get(_hub_var, "")
    _hub_os.environ[_hub_var] = ",".join(x for x in (_hub_prev, "127.0.0.1", "localhost") if x)

if "huggingface_hub.constants" in _hub_sys.modules:  # imported before us (a plugin?): the endpoint is stale
    _hub_constants = _hub_sys.modules["huggingface_hub.constants"]
    if _hub_constants.ENDPOINT != HUB_URL:
        _hub_warnings.warn(
            "huggingface_hub was imported before tests/conftest.py set HF_ENDPOINT; patching its constants "
            "(modules that copied the endpoint may still point elsewhere).",
            stacklevel=1,
        )
        _hub_constants.ENDPOINT = HUB_URL
        _hub_constants.HUGGINGFACE_CO_URL_TEMPLATE = HUB_URL + "/{repo_id}/resolve/{revision}/{filename}"
        _hub_constants.HF_HUB_DISABLE_XET = True


@_hub_pytest.fixture(scope="session")
def hub_server():
    """The loopback Hub for the whole session, listening on HF_ENDPOINT."""
    try:
        server = _HubServer(_hub_os.path.join(_HUB_TMP, "storage"), tokens={HUB_TOKEN: HUB_USER}, port=HUB_PORT)
        server.start()
    except OSError as e:  # the port picked at import got taken in between (very unlikely)
        raise RuntimeError(f"loopback Hub could not bind 127.0.0.1:{HUB_PORT}: {e}") from e
    yield server
    server.stop()


@_hub_pytest.fixture
def hub(hub_server):
    """The session Hub with no faults injected and an empty request log."""
    hub_server.clear_faults()
    hub_server.clear_log()
    yield hub_server
    hub_server.clear_faults()


@_hub_pytest.fixture
def hub_token() -> str:
    return HUB_TOKEN


@_hub_pytest.fixture
def hub_env(hub_server) -> dict:
    """Environment for subprocesses that talk to the Hub (HF_ENDPOINT etc. plus HF_TOKEN)."""
    return {**_hub_os.environ, "HF_TOKEN": HUB_TOKEN, "HF_ENDPOINT": hub_server.url}


@_hub_pytest.fixture
def hub_repo_id(request) -> str:
    """A repo id nobody used yet in this session: 'user/<test-name>-<8 hex>'."""
    name = "".join(c if c.isalnum() or c in "-_" else "-" for c in request.node.name)[:40].strip("-_")
    return f"{HUB_USER}/{name or 'repo'}-{_hub_uuid.uuid4().hex[:8]}"
# --- end loopback Hub ---


# --- shared test plumbing ---
@_hub_pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    """Accelerate keeps process-wide singletons; in-process CLI runs each start from a clean state."""
    yield
    from vit_finetune.core.processes import reset_accelerate_state

    reset_accelerate_state()


# Module-scoped, so each test module trains on its own copies: a tiny ViT saved like a Hub checkpoint,
# 3 colour classes x (8 train, 3 validation) images, and the shared small-run arguments from runs.py.
@_hub_pytest.fixture(scope="module")
def base(tmp_path_factory):
    from tiny import make_tiny_vit

    return make_tiny_vit(tmp_path_factory.mktemp("tiny-vit"))


@_hub_pytest.fixture(scope="module")
def images(tmp_path_factory):
    from tiny import write_colour_folder

    return write_colour_folder(tmp_path_factory.mktemp("colours"), classes=3, train=8, validation=3)


@_hub_pytest.fixture(scope="session")
def warm_launcher():
    """One warm launcher (tests/warm_launch.py --serve) for every two-process launch of this pytest process whose
    subject is what the ranks do, not the launcher: the libraries are imported once for all of them. Started with
    the environment of `recorder.subprocess_env` (the site hooks importable, none on), at the first test that asks."""
    import recorder
    from runs import WarmLauncher
    from tiny import REPO

    launcher = WarmLauncher(recorder.subprocess_env(None), REPO)
    yield launcher
    launcher.close()


@_hub_pytest.fixture(scope="module")
def args(base, images) -> list[str]:
    from runs import RECIPE

    return [f"model.base={base}", f"data.dataset={images}", *RECIPE]


# `make test` gives each worker a whole file at a time (--dist loadfile) in collection order
# (--no-loadscope-reorder), so the longest files go first: the two workers then end within a short file of each
# other, instead of one still running a multi-process file that was handed out last. Longest first as measured
# (each file's test durations summed, as `pytest --durations=0` gives them, in a two-worker run); the files not
# named keep their alphabetical order after these.
LONGEST_FILES_FIRST = ("test_serving.py", "test_launch.py", "test_streaming.py", "test_stopping.py", "test_resume.py",
                       "test_safety_io.py", "test_hub_roundtrip.py", "test_resume_safety.py", "test_sharded.py",
                       "test_deepspeed.py", "test_first_minutes.py", "test_device_switches.py", "test_methods.py",
                       "test_bench.py", "test_readme_commands.py", "test_multilabel.py", "test_multiprocess.py",
                       "test_families.py", "test_warm_launch.py", "test_overwrite.py", "test_distill.py",
                       "test_test_split.py", "test_hostile_configs.py", "test_unreachable_hub.py", "test_model.py", "test_security.py")


def pytest_collection_modifyitems(items):
    def rank(item) -> int:
        name = item.path.name
        return LONGEST_FILES_FIRST.index(name) if name in LONGEST_FILES_FIRST else len(LONGEST_FILES_FIRST)

    items.sort(key=rank)  # stable: each file's tests stay together and in their order
