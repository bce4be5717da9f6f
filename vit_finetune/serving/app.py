"""A page to try a trained model: drop an image, see its top-k labels and where the model looked (attention
rollout, explain.py), beside the position-embedding picture of a run moved to a new resolution (pictures.py).

    python -m vit_finetune app outputs/demo [--port 7860]

Gradio is the Hub's convention for such pages (a Space runs the same file). It serves on 127.0.0.1 only, with
its analytics off: nothing leaves the machine. Every string the model provides (its labels, its type) is shown as
text, never as Markdown or HTML, so no label can make the page fetch anything. An upload is decoded by the toolkit's
own decode_image, with the limits predict applies; the uploads, Gradio's copies and the pictures live in one
temporary folder, cleaned while the page runs and removed when it stops.
"""

from __future__ import annotations

import html
import os
import signal
import socket
import sys
import tempfile
from pathlib import Path

from vit_finetune.core.errors import VitFinetuneError, printable, shortened
from vit_finetune.core.layout import POSITION_FILE
from vit_finetune.model.saved_model import load_classifier, model_location

DEFAULT_PORT = 7860
MAX_UPLOAD = "100mb"  # larger uploads are refused before they reach the disk
# Every 5 minutes Gradio deletes what this page made (uploads, its copies, pictures) over 10 minutes old: a page left
# running for days does not fill the disk. Everything goes when the page stops.
CACHE_CLEANING_S = (300, 600)


class AppError(VitFinetuneError):
    """The page cannot be served as asked (gradio missing, the port taken); the message says how to fix it."""


def require_gradio():
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # read when gradio is imported
    try:
        import gradio
    except ImportError:
        raise AppError("the app needs gradio: pip install 'vit_finetune[app]' (or pip install gradio)") from None
    return gradio


def refuse_a_taken_port(port: int) -> None:
    """Before the model loads: a port another program listens on, named with the fix."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError as error:
            other = port + 1 if port < 65535 else DEFAULT_PORT
            raise AppError(f"port {port} on 127.0.0.1 cannot be used ({error.strerror or error}): another program "
                           f"listens there. Pass another --port, e.g. --port {other}") from None


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


def read_upload(path: str, settings):
    """An uploaded file as predict reads an image (decode_image with the model's decoding settings: its size limit,
    EXIF orientation, the alpha background it trained with, RGB); a file it cannot read is a gradio.Error naming the
    user's file, never the server's folder."""
    import gradio

    from vit_finetune.data import BadImageError, decode_image

    name = Path(path).name  # Gradio keeps the upload's own name: cache/<hash>/<name>
    try:
        return decode_image({"path": path, "bytes": None}, 0, settings)
    except BadImageError as error:
        # Named as the user named it, without the server's folder; the message's advice is for training.
        reason = str(error).replace(path, name).split(". Fix the file")[0].removeprefix("bad image ")
        raise gradio.Error(f"{shortened(reason)}. Drop a PNG, JPEG or WebP image", print_exception=False) from None


def classifier(name: str, top_k: int, scratch: Path):
    """classify(uploaded file) -> ({label: score} of the labels the model gives the image, as predict lists them,
    or None where its scores are not confidences (a regression's values); the rollout picture; the task's line under
    them (which labels pass their thresholds; a regression's values as numbers)). The pictures are drawn in `scratch`
    and read back, so none is kept."""
    from PIL import Image

    from vit_finetune.data import decoding_settings
    from vit_finetune.serving.explain import check_supported, draw_explanation, explain_pixels
    from vit_finetune.model.families import FAMILIES

    model, processor = load_classifier(name, "cpu", eager_attention=True)  # eager: rollout needs the weights
    check_supported(model.config)
    size = FAMILIES[model.config.model_type].image_size(model.config)
    settings = decoding_settings(model.config)

    def classify(upload: str | None):
        if upload is None:
            return None, None, ""
        image = read_upload(upload, settings)
        pixels = processor(images=image, return_tensors="pt")["pixel_values"]
        explanation = explain_pixels(model, pixels, "rollout", None, top_k)
        handle, path = tempfile.mkstemp(suffix=".rollout.png", dir=scratch)
        os.close(handle)
        try:
            draw_explanation(image, explanation, size, "rollout", Path(path))
            with Image.open(path) as drawn:
                picture = drawn.copy()
        finally:
            os.unlink(path)
        task = explanation.task
        confidences = ({printable(label): score for label, score in explanation.given[:top_k]} if task.confidences
                       else None)
        return confidences, picture, task.page_note(explanation.top, explanation.given, top_k)

    return classify, model.config, size


def header_html(name: str, config, size: int) -> str:
    """The page's heading: the model's name, type, task and labels (or targets) as escaped text (a label is any
    string its maker chose, `![t](http://host/x.png)`, `<img src=...>` or a right-to-left override included)."""
    from vit_finetune.tasks import of_config

    task = of_config(config)
    labels = [config.id2label[i] for i in range(config.num_labels)]
    shown = ", ".join(html.escape(printable(label)) for label in labels[:10]) + (", ..." if len(labels) > 10 else "")
    return (f"<h2>{html.escape(printable(name))}</h2><p>A {html.escape(str(config.model_type))} {task.model_noun} at "
            f"{size}x{size} px with {len(labels)} {task.output_noun} ({shown}). Drop an image to try it.</p>")


def build_app(name: str, top_k: int = 5, scratch: Path | None = None):
    """The page as a gradio Blocks (not yet served); its pictures are drawn in `scratch` (a new temporary folder
    if None). Each picture's title is a heading above it: gradio's label badge would cover the title drawn at the top
    of the picture."""
    gradio = require_gradio()
    location = model_location(name)
    scratch = Path(scratch or tempfile.mkdtemp(prefix="vit-finetune-app-"))
    classify, config, size = classifier(name, top_k, scratch)
    from vit_finetune.tasks import of_config

    task = of_config(config)
    picture = position_picture(name, location)
    with gradio.Blocks(title=f"{Path(name).name} - vit_finetune", delete_cache=CACHE_CLEANING_S) as page:
        gradio.HTML(header_html(name, config, size), elem_id="header")
        with gradio.Row():
            image = gradio.File(label="image", file_types=["image"], type="filepath", elem_id="image")
            with gradio.Column():
                # a regression's values are not confidences: they are written as numbers in the line below
                top = gradio.Label(num_top_classes=top_k, label="labels the model gives", elem_id="labels",
                                   visible=task.confidences)
                passing = gradio.HTML(elem_id="verdict")
        gradio.HTML("<h3>Attention rollout: where the model looked</h3>")
        rollout = gradio.Image(show_label=False, elem_id="rollout", interactive=False)
        if picture:
            gradio.HTML("<h3>Position embeddings, before and after the move to the new resolution</h3>")
            gradio.Image(picture, show_label=False, elem_id="positions", interactive=False)
        image.change(classify, inputs=image, outputs=[top, rollout, passing])
    return page


def serve(name: str, port: int = DEFAULT_PORT, top_k: int = 5) -> None:
    """Serve the page on 127.0.0.1:port until interrupted (Ctrl-C or SIGTERM); what it stored goes with it."""
    refuse_a_taken_port(port)
    with tempfile.TemporaryDirectory(prefix="vit-finetune-app-") as scratch:
        os.environ["GRADIO_TEMP_DIR"] = scratch  # uploads and Gradio's copies, read when the page is built
        page = build_app(name, top_k, Path(scratch))
        try:
            page.launch(server_name="127.0.0.1", server_port=port, share=False, inbrowser=False, show_error=True,
                        quiet=True, prevent_thread_lock=True, max_file_size=MAX_UPLOAD)
        except OSError as error:  # taken between the check and the launch
            raise AppError(f"cannot serve on port {port}: {shortened(error)}. Pass another --port") from None
        print(f"serving {name} on http://127.0.0.1:{port} (Ctrl-C stops it)", flush=True)
        previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # a service stop cleans up like Ctrl-C
        try:
            page.block_thread()  # returns on Ctrl-C, Gradio having closed the server
        except KeyboardInterrupt:  # a second Ctrl-C while Gradio closes it
            pass
        finally:
            signal.signal(signal.SIGTERM, previous)
            page.close()

