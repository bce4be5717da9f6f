"""Publishing a finished run: create the repo and upload what the run wrote in one commit, then, if asked, the
Space-ready app in a commit of its own.

huggingface_hub retries its upload calls but sends the commit once and waits forever for an answer, so the whole
push is retried here with back-off, under a timeout per request. A push publishes only what the run's manifest
lists, and only reads the output folder: a failure never touches the local files. Talking to the Hub at all (the
token, the timeout, offline switches) is hub.py's.
"""

from __future__ import annotations

import json
import re
import shlex
import tempfile
import time
from pathlib import Path

from huggingface_hub import CommitOperationAdd, HfApi
from huggingface_hub.errors import HfHubHTTPError, HFValidationError
from huggingface_hub.utils import validate_repo_id

from vit_finetune.artifacts.card import card_loading_from
from vit_finetune.core.errors import shortened
from vit_finetune.core.hub import (
    PushError, TIMEOUT_VARIABLE, http_library, request_timeout, requests_time_out, require_token,
)
from vit_finetune.core.layout import (
    CARD_FILE, KEPT_FOR_THE_RUN, MANIFEST, METRICS_FILE, POSITION_FILE, SPACE_DIR, written,
)

RETRY_DELAYS = (1.0, 2.0, 4.0, 8.0)  # seconds between attempts: five attempts in all


# hf_xet (huggingface_hub's Xet uploads, used whenever it is installed) turns an HTTP error answer into a Python
# ConnectionError whose text holds the status: "... HTTP status client error (400 Bad Request), domain: URL". Read as
# a connection error it was retried five times; it is an answer, and a 4xx will not pass on a retry.
XET_ANSWER = re.compile(r"HTTP status (?:client|server) error \((\d{3})([^)]*)\), domain: (\S+)")
XET_FIX = ("The server speaks no Xet, the upload protocol huggingface_hub uses when hf_xet is installed (a test or "
           "private Hub, such as the test suite's loopback Hub): set HF_HUB_DISABLE_XET=1 to upload by the LFS "
           "transfer instead. ")


def answered_status(error: Exception) -> int | None:
    """The HTTP status the Hub answered with, if it answered (from huggingface_hub's error or hf_xet's message)."""
    status = getattr(getattr(error, "response", None), "status_code", None)
    if status is None and (match := XET_ANSWER.search(str(error))):
        status = int(match.group(1))
    return status


def is_retryable(error: Exception) -> bool:
    """Connection errors, timeouts, 408, 429 and 5xx may pass; a 4xx (bad token, bad card, no Xet) will not."""
    status = answered_status(error)
    return status is None or status in (408, 429) or status >= 500


def failure_reason(error: Exception, timeout: float) -> str:
    """One line on what went wrong with a request."""
    http = http_library()
    if isinstance(error, http.TimeoutException):
        return f"the Hub did not answer within {timeout:g} s ({TIMEOUT_VARIABLE}): timed out"
    if isinstance(error, http.TransportError):
        return f"connection error: {type(error).__name__}: {error}"
    xet = XET_ANSWER.search(str(error))
    if xet:
        return f"the Hub answered {xet.group(1)}{xet.group(2)} to hf_xet's request {xet.group(3)}"
    return f"{type(error).__name__}: {error}"


def refuses_xet(error: Exception | None) -> bool:
    """Whether the Hub answered hf_xet's request for an upload token with a 4xx: it has no Xet."""
    xet = XET_ANSWER.search(str(error)) if error is not None else None
    return bool(xet) and int(xet.group(1)) < 500 and "/xet-" in xet.group(3)


def published_files(output_dir: Path) -> list[str]:
    """The paths the run's manifest lists, less what a run keeps for itself: what a push publishes. A file a user
    left beside the run or in a folder it writes in (notes, a log in runs/) is not in the manifest, so it is never
    uploaded."""
    names = sorted(path for path in written(output_dir)
                   if not path.startswith(".") and path.split("/")[0] not in KEPT_FOR_THE_RUN
                   and (output_dir / path).exists())
    if not names:
        raise PushError(f"{output_dir} holds no {MANIFEST} listing what a run wrote there, so what to publish is unknown; "
                        "push a folder written by `python -m vit_finetune` (or upload your own files with `hf upload`)")
    return names


def upload_operations(output_dir: Path, names: list[str], repo_id: str) -> list:
    """One commit's files: every file under the published `names`, the model card's usage snippet naming `repo_id`
    (the local card is not changed)."""
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
    reason, failure = "", None
    connection_error = http_library().TransportError  # timeouts included
    with requests_time_out(timeout):
        for attempt, delay in enumerate((0.0, *RETRY_DELAYS), start=1):  # read at each call: tests shorten it
            time.sleep(delay)
            try:
                api.create_repo(repo_id, private=private, exist_ok=True)
                commit = api.create_commit(repo_id, upload_operations(output_dir, names, repo_id),
                                           commit_message=f"Upload {output_dir.name} with vit_finetune")
                return commit.commit_url
            except (HfHubHTTPError, connection_error, OSError) as error:
                reason, failure = " ".join(failure_reason(error, timeout).split())[:300], error
                if not is_retryable(error):
                    break
                if attempt < attempts:
                    print(f"push attempt {attempt} of {attempts} failed ({reason}); retrying in {RETRY_DELAYS[attempt - 1]:g} s",
                          flush=True)
    again = (f"python -m vit_finetune push {shlex.quote(str(output_dir))} --repo-id {repo_id}"
             f"{' --private' if private else ''}{' --space-app' if space_app else ''}")
    raise PushError(f"could not push {output_dir} to {repo_id} after {attempt} attempt(s) ({reason}). "
                    f"{XET_FIX if refuses_xet(failure) else ''}"
                    f"The model is safe in {output_dir}: the local folder is intact. Push it again with: {again}")


# push --space-app: a Gradio app that runs on a Space from the model repo alone (transformers' pipeline, no
# vit_finetune needed there): the top labels and the run's position-embedding picture when the repo has one.
SPACE_APP = '''"""Try {repo_id}: drop an image, see its top labels. A Space runs this file; locally: python app.py"""
import os

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
import gradio as gr
from huggingface_hub import hf_hub_download
from transformers import pipeline

MODEL = "{repo_id}"
classifier = pipeline("image-classification", model=MODEL)


def classify(image):
    if image is None:
        return None
    return {{guess["label"]: guess["score"] for guess in classifier(image.convert("RGB"), top_k={top_k})}}


def position_picture():
    try:
        return hf_hub_download(MODEL, "{position_file}")
    except Exception:  # a model not moved to a new resolution has none
        return None


with gr.Blocks(title=MODEL) as demo:
    gr.Markdown("## " + MODEL)
    with gr.Row():
        image = gr.Image(type="pil", label="image")
        labels = gr.Label(num_top_classes={top_k}, label="top labels")
    picture = position_picture()
    if picture:
        gr.Image(picture, label="position embeddings, before and after the move to the new resolution",
                 interactive=False)
    image.change(classify, inputs=image, outputs=labels)

if __name__ == "__main__":
    demo.launch()
'''
SPACE_FILES = {
    "app.py": lambda repo_id, top_k: SPACE_APP.format(repo_id=repo_id, top_k=top_k, position_file=POSITION_FILE),
    "requirements.txt": lambda repo_id, top_k: "transformers>=5,<6\ntorch\npillow\ngradio>=5,<7\n",
    # The YAML values quoted (a JSON string is a YAML one): a repo named null, true or 1e3 keeps its name as text.
    CARD_FILE: lambda repo_id, top_k: (f"---\ntitle: {json.dumps(repo_id.split('/')[-1])}\nsdk: gradio\n"
                                         f"app_file: app.py\nmodels:\n- {json.dumps(repo_id)}\n---\nTry "
                                         f"[{repo_id}](https://huggingface.co/{repo_id}): copy this folder into a new "
                                         "Space, or run `python app.py`.\n"),
}


def write_space_app(folder: Path, repo_id: str, top_k: int = 5) -> Path:
    """app.py, requirements.txt and the Space's README in `folder`; returns it."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, content in SPACE_FILES.items():
        (folder / name).write_text(content(repo_id, top_k))
    return folder


def push_space_app(repo_id: str, top_k: int = 5) -> str:
    """Add the Space-ready app under space/ of the model repo, in a commit of its own after the model's."""
    with tempfile.TemporaryDirectory() as staging:
        folder = write_space_app(Path(staging) / SPACE_DIR, repo_id, top_k)
        try:
            commit = HfApi(token=require_token("push")).upload_folder(
                repo_id=repo_id, folder_path=folder, path_in_repo=SPACE_DIR,
                commit_message="Add a Space-ready Gradio app (vit_finetune push --space-app)")
        except (HfHubHTTPError, OSError) as error:
            raise PushError(f"the model is pushed to {repo_id}, but its app could not be added: {shortened(error)}. "
                            f"Run the same push command again to retry") from None
    return commit.commit_url
