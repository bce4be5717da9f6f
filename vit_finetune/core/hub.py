"""Talking to the Hub: the token, a timeout for every request, the offline switches, and one quick question
before a download (is this id there at all?), so that a dead connection or a wrong id fails at once, with the fix.

Data, model and streaming download through it; publishing a run (publish.py) pushes through it. It loads no part
of the training stack: predict's check of a model that is not a folder answers without torch.
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

from huggingface_hub import get_session, get_token

from vit_finetune.core.errors import VitFinetuneError, shortened
from vit_finetune.core.layout import CARD_FILE, CONFIG_FILE


class PushError(VitFinetuneError):
    """The Hub refused or failed the push; the local outputs are intact."""


# What a missing token means depends on who needed it: a training run asked to push can still be run without
# the push, the push command cannot.
MISSING_TOKEN_FIX = {
    "hub.push=true": "run `hf auth login`, or set HF_TOKEN, or run without hub.push and publish later with "
                     "`python -m vit_finetune push OUTPUT_DIR`",
    "push": "run `hf auth login`, or set HF_TOKEN, then run the same push command again",
}


def require_token(asked_by: str = "hub.push=true") -> str:
    """The saved or HF_TOKEN token; checked before any download or training when hub.push=true."""
    token = get_token()
    if not token:
        raise PushError(f"{asked_by} needs a token, but no Hugging Face token was found. Fix: {MISSING_TOKEN_FIX[asked_by]}.")
    return token


@contextmanager
def offline_unless(talks_to_hub: bool):
    """Inside, a process that must not talk to the Hub reads only what the main process already cached.

    huggingface_hub, transformers and datasets all consult these flags at call time.
    """
    if talks_to_hub:
        yield
        return
    with hub_offline(True):
        yield


@contextmanager
def hub_offline(offline: bool):
    """Inside, huggingface_hub and datasets are offline (True) or may talk to the Hub (False); restored after."""
    import datasets.config
    import huggingface_hub.constants

    saved = huggingface_hub.constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE
    huggingface_hub.constants.HF_HUB_OFFLINE = datasets.config.HF_HUB_OFFLINE = offline
    try:
        yield
    finally:
        huggingface_hub.constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE = saved


def offline_by_user() -> bool:
    """Whether the user set HF_HUB_OFFLINE (or HF_DATASETS_OFFLINE), read from the environment, not from the flags
    offline_unless may have set for this process."""
    import huggingface_hub.constants

    return any(os.environ.get(name, "").upper() in huggingface_hub.constants.ENV_VARS_TRUE_VALUES
               for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


TIMEOUT_VARIABLE = "VIT_FINETUNE_HUB_TIMEOUT"
DEFAULT_TIMEOUT_S = 120.0  # per request (connect, each read, each write): a stalled Hub is given up, then retried


def request_timeout() -> float:
    """Seconds a Hub request may wait on the network: VIT_FINETUNE_HUB_TIMEOUT, else DEFAULT_TIMEOUT_S."""
    value = os.environ.get(TIMEOUT_VARIABLE, "").strip()
    if not value:
        return DEFAULT_TIMEOUT_S
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds < float("inf"):
        raise PushError(f"{TIMEOUT_VARIABLE}={value!r} is not a number of seconds above 0; set it to e.g. 120, or unset it")
    return seconds


def http_library() -> ModuleType:
    """The HTTP library of huggingface_hub's own client (httpx under huggingface_hub 1.x, httpx2 under 2.x): its
    timeout and error types are taken from there, so both major versions work and neither library is imported
    by name (only huggingface_hub, which brings the right one, is a dependency)."""
    return sys.modules[type(get_session()).__module__.partition(".")[0]]


@contextmanager
def requests_time_out(seconds: float):
    """Inside, every request huggingface_hub sends (its one shared client) gives up after `seconds` of silence:
    its default is to wait forever, so a stalled commit would block a push with no end."""
    session = get_session()
    saved = session.timeout
    session.timeout = http_library().Timeout(seconds)
    try:
        yield
    finally:
        session.timeout = saved


# What to do when a Hub id cannot be fetched, per kind of repo: never "give a Hub id", which the user just did.
UNREACHABLE_FIX = {
    "model": "check the network (or HF_ENDPOINT) and run again; offline, give a local folder holding config.json "
             "(what save_pretrained writes), or set HF_HUB_OFFLINE=1 to use a copy already in the Hugging Face cache",
    "dataset": "check the network (or HF_ENDPOINT) and run again; offline, give a local image folder or a folder "
               "written by save_to_disk, or set HF_HUB_OFFLINE=1 to use a copy already in the Hugging Face cache",
}
PROBE_TIMEOUT_S = 10


def in_cache(repo_id: str, repo_type: str, revision: str | None = None) -> bool:
    """Whether the Hugging Face cache holds the repo's config.json (a model's) or card (a dataset's)."""
    from huggingface_hub import try_to_load_from_cache

    cached_file = CONFIG_FILE if repo_type == "model" else CARD_FILE  # a dataset repo's card
    return isinstance(try_to_load_from_cache(repo_id, cached_file, revision=revision, repo_type=repo_type), str)


def unreachable_problem(repo_id: str, repo_type: str = "model", revision: str | None = None) -> str | None:
    """Why `repo_id` cannot be fetched from the Hub, asked once with no retries; None if it can, if it is cached,
    or if the Hub is off (HF_HUB_OFFLINE, or a process that reads the main process's cache).

    Left to them, transformers and datasets retry a dead connection for over a minute, then blame the id.
    """
    import huggingface_hub.constants
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    if huggingface_hub.constants.HF_HUB_OFFLINE:
        return None
    if in_cache(repo_id, repo_type, revision):
        return None
    ask = HfApi().model_info if repo_type == "model" else HfApi().dataset_info
    try:
        ask(repo_id, revision=revision, timeout=PROBE_TIMEOUT_S)
    except GatedRepoError:
        return f"the Hub's {repo_type} {repo_id!r} is gated: accept its terms on its page, then `hf auth login`"
    except RevisionNotFoundError:
        return f"the Hub's {repo_type} {repo_id!r} has no revision {revision!r}"
    except RepositoryNotFoundError:
        return f"the Hub has no {repo_type} {repo_id!r} (or it is private: log in with `hf auth login`)"
    except Exception as error:  # connection errors, timeouts, a Hub answering 5xx: all mean "not reachable"
        return (f"the Hub ({huggingface_hub.constants.ENDPOINT}) is unreachable ({type(error).__name__}: "
                f"{shortened(error, 160)}) and {repo_id!r} is not in the local cache. "
                f"Fix: {UNREACHABLE_FIX[repo_type]}")
    return None



LOCAL_PATH_FIX = "run the command from the folder that holds it, or give its full path"


def not_here(value: str) -> str:
    """A local path that does not exist, in words: the absolute path looked at (a relative one is read from the
    folder the command runs in, the usual culprit)."""
    return f"there is no folder or file {str(Path(value).expanduser().absolute())!r}"


def offline_setting() -> str | None:
    """`HF_HUB_OFFLINE=<value>` when the user turned the Hub off by that variable (not when this toolkit turns it
    off for a process that reads the main process's cache), else None."""
    from huggingface_hub.constants import ENV_VARS_TRUE_VALUES

    value = os.environ.get("HF_HUB_OFFLINE", "")
    return f"HF_HUB_OFFLINE={value}" if value.upper() in ENV_VARS_TRUE_VALUES else None


def offline_problem(value: str, repo_type: str) -> str | None:
    """Why `value`, not fetched, is nowhere, when the user's HF_HUB_OFFLINE turned the Hub off; None otherwise."""
    setting = offline_setting()
    if setting is None:
        return None
    return (f"{setting} turns the Hub off, so a Hub {repo_type} is read from the Hugging Face cache alone, and "
            f"{value!r} is not there; nor is it a local folder: {not_here(value)}. Fix: give a local "
            f"{LOCAL_FOLDER[repo_type]} ({LOCAL_PATH_FIX}), or unset HF_HUB_OFFLINE to download {value!r}")


# What a local copy is, per kind of repo, as an offline fix names it.
LOCAL_FOLDER = {"model": "folder holding config.json, as save_pretrained writes it",
                "dataset": "image folder, label file (.csv or .jsonl) or folder written by save_to_disk"}


def looks_local(value: str) -> Path | None:
    """The folder `value` would lie in, if that exists here (`data/missing_sub` beside an existing `data/`): a
    name that reads as a path into the user's own folders, whatever the Hub holds."""
    parent = Path(value).expanduser().parent
    return parent.absolute() if "/" in value and parent.is_dir() else None


def missing_source_problem(value: str, repo_type: str, could_be_hub_id: bool, revision: str | None = None) -> str | None:
    """Why `value` (data.dataset, model.base), which names nothing on this disk, cannot be read; None if the Hub has
    it. A path is named as missing, with the absolute path looked at. A bare name (`my_photos`), or a path whose
    folder exists here (`data/missing_sub`), could be a folder as well as a Hub id: both are said; any other
    `namespace/name` is taken for a Hub id. With the Hub off by HF_HUB_OFFLINE, a model not in the cache is said to
    be nowhere (a dataset's cache is datasets' own: its load says, opening.py)."""
    if not could_be_hub_id:
        return f"{not_here(value)}. Fix: {LOCAL_PATH_FIX}"
    if repo_type == "model" and not in_cache(value, repo_type, revision):
        offline = offline_problem(value, repo_type)
        if offline:
            return offline
    problem = unreachable_problem(value, repo_type, revision)
    folder = looks_local(value)
    if problem is None or ("/" in value and folder is None):
        return problem
    exists = f", though the folder {str(folder)!r} exists: check the name" if folder else ""
    return f"{not_here(value)}{exists} (if it is a folder of yours: {LOCAL_PATH_FIX}), and as a Hub id: {problem}"
