"""Publishing: create the repo and upload a finished output folder to the Hub in one commit.

huggingface_hub retries its upload calls but sends the commit once, so the whole push is retried here
with back-off. A push only reads the output folder: a failure never touches the local files.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from pathlib import Path

from huggingface_hub import HfApi, get_token
from huggingface_hub.errors import HfHubHTTPError

from .errors import VitFinetuneError
from .checkpoint import CHECKPOINTS
from .export import CARD_FILE, METRICS_FILE, STAGING, card_loading_from

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
    cached_file = "config.json" if repo_type == "model" else "README.md"
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
                f"{str(error)[:160]}) and {repo_id!r} is not in the local cache. Fix: {UNREACHABLE_FIX[repo_type]}")
    return None


def is_retryable(error: Exception) -> bool:
    status = getattr(getattr(error, "response", None), "status_code", None)
    return status is None or status in (408, 429) or status >= 500


def upload_operations(output_dir: Path, repo_id: str) -> list:
    """One commit's files: the folder as upload_folder would send it (checkpoints, staging and hidden files left
    out), except the model card, whose usage snippet names `repo_id`. The local card is not changed."""
    from huggingface_hub import CommitOperationAdd
    from huggingface_hub.hf_api import DEFAULT_IGNORE_PATTERNS
    from huggingface_hub.utils import filter_repo_objects

    files = {path.relative_to(output_dir).as_posix(): path for path in sorted(output_dir.rglob("*")) if path.is_file()}
    ignored = [f"{CHECKPOINTS}/**", f"{STAGING}/**", ".*", *DEFAULT_IGNORE_PATTERNS]
    return [CommitOperationAdd(path_in_repo=name, path_or_fileobj=(
                card_loading_from(files[name].read_text(), repo_id).encode() if name == CARD_FILE else files[name]))
            for name in filter_repo_objects(list(files), ignore_patterns=ignored)]


def push_folder(output_dir: Path, repo_id: str, private: bool = False) -> str:
    """Upload a finished run (checkpoints left out) and return the commit URL."""
    output_dir = Path(output_dir)
    if not (output_dir / METRICS_FILE).is_file():
        raise PushError(f"{output_dir} holds no finished run ({METRICS_FILE} is missing); train first, then push")
    api = HfApi(token=require_token())
    last_error: Exception | None = None
    for attempt, delay in enumerate((0.0, *RETRY_DELAYS)):  # read at each call: tests shorten it
        time.sleep(delay)
        try:
            api.create_repo(repo_id, private=private, exist_ok=True)
            commit = api.create_commit(repo_id, upload_operations(output_dir, repo_id),
                                       commit_message=f"Upload {output_dir.name} with vit_finetune")
            return commit.commit_url
        except (HfHubHTTPError, OSError) as error:
            last_error = error
            if not is_retryable(error):
                break
            print(f"push attempt {attempt + 1} failed ({error.__class__.__name__}: {str(error)[:200]}); retrying")
    raise PushError(
        f"could not push {output_dir} to {repo_id}: {str(last_error)[:500]}\n"
        f"The model is safe in {output_dir}. Push it later with:\n"
        f"  python -m vit_finetune push {output_dir} --repo-id {repo_id}{' --private' if private else ''}"
    )
