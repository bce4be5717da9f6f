"""A page to try a trained model: drop an image, see its top-k labels and where the model looked (attention
rollout, explain.py), beside the position-embedding picture of a run moved to a new resolution (pictures.py).

    python -m vit_finetune app outputs/demo [--port 7860]

Gradio is the Hub's convention for such pages (a Space runs the same file). It serves on 127.0.0.1 only, with
its analytics off: nothing leaves the machine.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from .errors import VitFinetuneError
from .export import markdown_text
from .pictures import POSITION_FILE

DEFAULT_PORT = 7860
SPACE_DIR = "space"  # push --space: the page as a Space-ready folder inside the model repo


class AppError(VitFinetuneError):
    """The page cannot be served as asked (gradio missing, the port taken); the message says how to fix it."""


def require_gradio():
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # read when gradio is imported
    try:
        import gradio
    except ImportError:
        raise AppError("the app needs gradio: pip install 'vit_finetune[app]' (or pip install gradio)") from None
    return gradio


def position_picture(name: str, location: str) -> str | None:
    """The run's position_embeddings.png (written when the run moved the model to a new resolution), if any."""
    folder = Path(location)
    if folder.is_dir():
        return str(folder / POSITION_FILE) if (folder / POSITION_FILE).is_file() else None
    from huggingface_hub import hf_hub_download

    try:
        return hf_hub_download(location, POSITION_FILE)
    except Exception:  # not in the repo (a model this toolkit did not make), or the Hub is unreachable
        return None


def classifier(name: str, top_k: int):
    """classify(image file) -> ({label: score} of the labels the model gives the image, as predict lists them; the
    rollout picture's path; a line saying which labels pass, for a multi-label model against its thresholds). The
    file is decoded as predict decodes it (the model's data.alpha_background included)."""
    from .data import BadImageError, decode_image, decoding_settings
    from .explain import check_supported, draw_explanation, explain_pixels
    from .families import FAMILIES
    from .inference import load_classifier

    model, processor = load_classifier(name, "cpu", eager_attention=True)  # eager: rollout needs the weights
    check_supported(model.config)
    size = FAMILIES[model.config.model_type].image_size(model.config)
    settings = decoding_settings(model.config)
    pictures = Path(tempfile.mkdtemp(prefix="vit-finetune-app-"))

    def classify(path):
        if path is None:
            return None, None, ""
        try:
            image = decode_image({"path": str(path), "bytes": None}, 0, settings)
        except BadImageError as error:
            return None, None, str(error)
        pixels = processor(images=image, return_tensors="pt")["pixel_values"]
        explanation = explain_pixels(model, pixels, "rollout", None, top_k)
        picture = Path(tempfile.mkstemp(suffix=".rollout.png", dir=pictures)[1])
        draw_explanation(image, explanation, size, "rollout", picture)
        shown = explanation.given[:top_k]
        return dict(shown), str(picture), verdict(explanation, top_k)

    return classify, model.config, size


def verdict(explanation, top_k: int) -> str:
    """The page's line under the labels: for a multi-label model, which labels pass their thresholds and the best
    of those that do not; nothing for a single-label one (its labels are its top k)."""
    if explanation.thresholds is None:
        return ""
    given = {label for label, _ in explanation.given}
    passing = ", ".join(f"**{markdown_text(label)}** {score:.2f} (threshold {explanation.thresholds[label]:.2f})"
                        for label, score in explanation.given[:top_k])
    below = ", ".join(f"{markdown_text(label)} {score:.2f} (threshold {explanation.thresholds[label]:.2f})"
                      for label, score in explanation.top if label not in given)
    return (f"Labels given (score at or over the label's threshold): {passing or 'none'}."
            + (f" Below their thresholds: {below}." if below else ""))


def build_app(name: str, top_k: int = 5):
    """The page as a gradio Blocks (not yet served). Each picture's title is a heading above it: gradio's label
    badge would cover the title drawn at the top of the picture."""
    from .inference import model_location

    gradio = require_gradio()
    location = model_location(name)
    classify, config, size = classifier(name, top_k)
    picture = position_picture(name, location)
    labels = [config.id2label[i] for i in range(config.num_labels)]
    with gradio.Blocks(title=f"{Path(name).name} - vit_finetune") as page:
        gradio.Markdown(f"## {name}\nA {config.model_type} classifier at {size}x{size} px with {len(labels)} labels "
                        f"({', '.join(labels[:10])}{', ...' if len(labels) > 10 else ''}). Drop an image to classify it.")
        with gradio.Row():
            image = gradio.Image(type="filepath", label="image", elem_id="image")
            with gradio.Column():
                top = gradio.Label(num_top_classes=top_k, label="labels the model gives", elem_id="labels")
                passing = gradio.Markdown(elem_id="verdict")
        gradio.Markdown("### Attention rollout: where the model looked")
        rollout = gradio.Image(show_label=False, elem_id="rollout", interactive=False)
        if picture:
            gradio.Markdown("### Position embeddings, before and after the move to the new resolution")
            gradio.Image(picture, show_label=False, elem_id="positions", interactive=False)
        image.change(classify, inputs=image, outputs=[top, rollout, passing])
    return page


def serve(name: str, port: int = DEFAULT_PORT, top_k: int = 5) -> None:
    """Serve the page on 127.0.0.1:port until interrupted."""
    page = build_app(name, top_k)
    print(f"serving {name} on http://127.0.0.1:{port} (Ctrl-C stops it)", flush=True)
    try:
        page.launch(server_name="127.0.0.1", server_port=port, share=False, inbrowser=False, show_error=True,
                    quiet=True)
    except OSError as error:
        raise AppError(f"cannot serve on port {port}: {error}. Pass another --port") from None


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
    "README.md": lambda repo_id, top_k: (f"---\ntitle: {repo_id.split('/')[-1]}\nsdk: gradio\napp_file: app.py\n"
                                         f"models:\n- {repo_id}\n---\nTry [{repo_id}](https://huggingface.co/{repo_id}): "
                                         "copy this folder into a new Space, or run `python app.py`.\n"),
}


def write_space_app(folder: Path, repo_id: str, top_k: int = 5) -> Path:
    """app.py, requirements.txt and the Space's README in `folder`; returns it."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, content in SPACE_FILES.items():
        (folder / name).write_text(content(repo_id, top_k))
    return folder


def push_space_app(repo_id: str, top_k: int = 5) -> str:
    """Add the Space-ready app under space/ of the model repo, in a commit of its own after the model's."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    from .hub import PushError, require_token

    with tempfile.TemporaryDirectory() as staging:
        folder = write_space_app(Path(staging) / SPACE_DIR, repo_id, top_k)
        try:
            commit = HfApi(token=require_token("push")).upload_folder(
                repo_id=repo_id, folder_path=folder, path_in_repo=SPACE_DIR,
                commit_message="Add a Space-ready Gradio app (vit_finetune push --space-app)")
        except (HfHubHTTPError, OSError) as error:
            raise PushError(f"the model is pushed to {repo_id}, but its app could not be added: {str(error)[:300]}. "
                            f"Run the same push command again to retry") from None
    return commit.commit_url
