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
    """classify(PIL image) -> ({label: probability} of the top k, path of the rollout picture)."""
    from .explain import check_supported, draw_explanation, explain_pixels
    from .families import FAMILIES
    from .inference import load_classifier

    model, processor = load_classifier(name, "cpu", eager_attention=True)  # eager: rollout needs the weights
    check_supported(model.config)
    size = FAMILIES[model.config.model_type].image_size(model.config)
    pictures = Path(tempfile.mkdtemp(prefix="vit-finetune-app-"))

    def classify(image):
        if image is None:
            return None, None
        image = image.convert("RGB")
        pixels = processor(images=image, return_tensors="pt")["pixel_values"]
        explanation = explain_pixels(model, pixels, "rollout", None, top_k)
        path = Path(tempfile.mkstemp(suffix=".rollout.png", dir=pictures)[1])
        draw_explanation(image, explanation, size, "rollout", path)
        return dict(explanation.top), str(path)

    return classify, model.config, size


def build_app(name: str, top_k: int = 5):
    """The page as a gradio Blocks (not yet served)."""
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
            image = gradio.Image(type="pil", label="image", elem_id="image")
            top = gradio.Label(num_top_classes=top_k, label="top labels", elem_id="labels")
        rollout = gradio.Image(label="attention rollout: where the model looked", elem_id="rollout",
                               interactive=False)
        if picture:
            gradio.Image(picture, label="position embeddings, before and after the move to the new resolution",
                         elem_id="positions", interactive=False)
        image.change(classify, inputs=image, outputs=[top, rollout])
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
