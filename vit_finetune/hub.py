"""Publishing: create the repo and upload a finished output folder to the Hub in one commit.

huggingface_hub retries its upload calls but sends the commit once and waits forever for an answer, so the whole
push is retried here with back-off, under a timeout per request. A push publishes only what the run's manifest
lists, and only reads the output folder: a failure never touches the local files.
"""

from __future__ import annotations

import os
import shlex
import time
from contextlib import contextmanager
from pathlib import Path

from huggingface_hub import HfApi, get_token
from huggingface_hub.errors import HfHubHTTPError

from .errors import VitFinetuneError, shortened
from .layout import CARD_FILE, CONFIG_FILE, KEPT_FOR_THE_RUN, MANIFEST, METRICS_FILE

# The model card's module (.export) loads torch: it is imported where a push needs it, so that asking the Hub about an
# id (predict's check of a model that is not a folder) answers without it.

RETRY_DELAYS = (1.0, 2.0, 4.0, 8.0)  # seconds between attempts: five attempts in all


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


@contextmanager
def requests_time_out(seconds: float):
    """Inside, every request huggingface_hub sends (its one shared client) gives up after `seconds` of silence:
    its default is to wait forever, so a stalled commit would block a push with no end."""
    import httpx2
    from huggingface_hub import get_session

    session = get_session()
    saved = session.timeout
    session.timeout = httpx2.Timeout(seconds)
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


def unreachable_problem(repo_id: str, repo_type: str = "model", revision: str | None = None) -> str | None:
    """Why `repo_id` cannot be fetched from the Hub, asked once with no retries; None if it can, if it is cached,
    or if the Hub is off (HF_HUB_OFFLINE, or a process that reads the main process's cache).

    Left to them, transformers and datasets retry a dead connection for over a minute, then blame the id.
    """
    import huggingface_hub.constants
    from huggingface_hub import HfApi, try_to_load_from_cache
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    if huggingface_hub.constants.HF_HUB_OFFLINE:
        return None
    cached_file = CONFIG_FILE if repo_type == "model" else CARD_FILE  # a dataset repo's card
    if isinstance(try_to_load_from_cache(repo_id, cached_file, revision=revision, repo_type=repo_type), str):
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


def is_retryable(error: Exception) -> bool:
    """Connection errors, timeouts, 408, 429 and 5xx may pass; a 4xx (bad token, bad card) will not."""
    status = getattr(getattr(error, "response", None), "status_code", None)
    return status is None or status in (408, 429) or status >= 500


def failure_reason(error: Exception, timeout: float) -> str:
    """One line on what went wrong with a request."""
    import httpx2

    if isinstance(error, httpx2.TimeoutException):
        return f"the Hub did not answer within {timeout:g} s ({TIMEOUT_VARIABLE}): timed out"
    if isinstance(error, httpx2.TransportError):
        return f"connection error: {type(error).__name__}: {error}"
    return f"{type(error).__name__}: {error}"


def published_files(output_dir: Path) -> list[str]:
    """The names the run's manifest lists, less what a run keeps for itself: what a push publishes. A file a user
    left beside the run (notes, a folder of their own) is not in the manifest, so it is never uploaded."""
    from .outputs import claimed

    names = sorted(name for name in claimed(output_dir)
                   if not name.startswith(".") and name not in KEPT_FOR_THE_RUN and (output_dir / name).exists())
    if not names:
        raise PushError(f"{output_dir} holds no {MANIFEST} listing what a run wrote there, so what to publish is unknown; "
                        "push a folder written by `python -m vit_finetune` (or upload your own files with `hf upload`)")
    return names


def upload_operations(output_dir: Path, names: list[str], repo_id: str) -> list:
    """One commit's files: every file under the published `names`, the model card's usage snippet naming `repo_id`
    (the local card is not changed)."""
    from huggingface_hub import CommitOperationAdd

    from .run_outputs import card_loading_from

    files = sorted(path for name in names for path in ([output_dir / name] if (output_dir / name).is_file()
                                                          else (output_dir / name).rglob("*"))
                   if path.is_file() and not any(part.startswith(".") for part in path.relative_to(output_dir).parts))
    return [CommitOperationAdd(path_in_repo=path.relative_to(output_dir).as_posix(), path_or_fileobj=(
                card_loading_from(path.read_text(), repo_id).encode() if path.name == CARD_FILE and path.parent == output_dir
                else path))
            for path in files]


def push_folder(output_dir: Path, repo_id: str, private: bool = False, space_app: bool = False) -> str:
    """Upload what the run wrote (its manifest, checkpoints left out) in one commit and return the commit URL.
    `space_app`: the push command was asked for the Space app too, so the command to push again asks for it.

    The whole push (create, upload, commit) is retried with back-off on connection errors, timeouts and 5xx;
    every request times out. The output folder is only read: a failure never touches it.
    """
    import httpx2
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    output_dir = Path(output_dir)
    try:
        validate_repo_id(repo_id)
    except HFValidationError as error:
        raise PushError(f"repo id {repo_id!r} is not a valid Hub id ({error}); use namespace/name with letters, "
                        "digits, '-', '_' or '.' (no '--' or '..')") from None
    if not (output_dir / METRICS_FILE).is_file():
        raise PushError(f"{output_dir} holds no finished run ({METRICS_FILE} is missing); train first, then push")
    names = published_files(output_dir)
    timeout = request_timeout()
    api = HfApi(token=require_token())
    attempts = 1 + len(RETRY_DELAYS)
    reason = ""
    with requests_time_out(timeout):
        for attempt, delay in enumerate((0.0, *RETRY_DELAYS), start=1):  # read at each call: tests shorten it
            time.sleep(delay)
            try:
                api.create_repo(repo_id, private=private, exist_ok=True)
                commit = api.create_commit(repo_id, upload_operations(output_dir, names, repo_id),
                                           commit_message=f"Upload {output_dir.name} with vit_finetune")
                return commit.commit_url
            except (HfHubHTTPError, httpx2.TransportError, OSError) as error:
                reason = " ".join(failure_reason(error, timeout).split())[:300]
                if not is_retryable(error):
                    break
                if attempt < attempts:
                    print(f"push attempt {attempt} of {attempts} failed ({reason}); retrying in {RETRY_DELAYS[attempt - 1]:g} s",
                          flush=True)
    again = (f"python -m vit_finetune push {shlex.quote(str(output_dir))} --repo-id {repo_id}"
             f"{' --private' if private else ''}{' --space-app' if space_app else ''}")
    raise PushError(f"could not push {output_dir} to {repo_id} after {attempt} attempt(s) ({reason}). "
                    f"The model is safe in {output_dir}: the local folder is intact. Push it again with: {again}")
