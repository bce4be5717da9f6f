"""Serving: `export --onnx` on a short fine-tune of the shipped demo model (moved from 32 to 64 px), the parity check
that refuses a graph and leaves nothing half-written, int8 quantisation measured on the run's eval split, LoRA runs
exported merged, and `predict --runtime onnx` giving the torch path's labels."""

from __future__ import annotations

import csv
import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from runs import train
from test_output_dir import error_line, snapshot, tmpfs  # noqa: F401 (tmpfs: a fixture)
from vit_finetune.cli import main
from vit_finetune.data import synthetic

pytestmark = pytest.mark.slow  # a short demo run and three exports (~1-3 min on 2 shared cores)
pytest.importorskip("onnxruntime", reason="the [onnx] extra is not installed (pip install -e .[dev] installs it)")
pytest.importorskip("onnxscript", reason="the [onnx] extra is not installed (pip install -e .[dev] installs it)")

# The demo recipe, cut to a few steps: the model is the shipped tiny ViT resampled to 64 px.
SHORT_DEMO = ["--recipe", "demo", "--quiet", "train.epochs=1", "train.warmup_steps=0", "data.max_train_samples=96",
              "data.max_eval_samples=24", "data.num_workers=0"]


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory) -> Path:
    output = tmp_path_factory.mktemp("serving") / "demo"
    assert train([*SHORT_DEMO, f"output_dir={output}"]) == 0
    return output


@pytest.fixture(scope="module")
def exported(demo_run) -> Path:
    """The demo run exported through the command line's main, with int8 weights."""
    import contextlib
    import io

    printed, errors = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(errors):
        code = main(["export", str(demo_run), "--onnx", "--quantize", "int8"])
    assert code == 0, errors.getvalue()[-3000:]
    assert "parity: max abs logit difference" in printed.getvalue()
    return demo_run / "onnx"


def read_csv(path: Path) -> list[dict]:
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def test_the_export_is_at_the_trained_resolution_with_a_dynamic_batch_axis(exported, demo_run):
    import onnx

    graph = onnx.load(str(exported / "model.onnx")).graph
    (pixels,), (logits,) = graph.input, graph.output
    dims = [d.dim_param or d.dim_value for d in pixels.type.tensor_type.shape.dim]
    assert pixels.name == "pixel_values" and dims[1:] == [3, 64, 64] and isinstance(dims[0], str)
    classes = len(synthetic.TASKS["demo"]["classes"])
    assert logits.name == "logits" and logits.type.tensor_type.shape.dim[1].dim_value == classes
    report = json.loads((exported / "export.json").read_text())
    assert report["image_size"] == 64 and 0 <= report["parity"]["max_abs_logit_difference"] <= 1e-3
    for name in ("config.json", "preprocessor_config.json", "model_quantized.onnx"):
        assert (exported / name).is_file()
    assert exported.stat().st_mode & 0o055 == demo_run.stat().st_mode & 0o055  # as readable as the run's folder
    assert not [p.name for p in demo_run.iterdir() if ".partial-" in p.name or ".old-" in p.name]


def test_int8_figures_are_measured_on_the_runs_own_eval_split(exported, demo_run):
    quantized = json.loads((exported / "export.json").read_text())["quantized"]
    metrics = json.loads((demo_run / "metrics.json").read_text())
    assert quantized["images"] == metrics["eval_samples"] == 24
    # The float graph equals PyTorch (parity), so on the same split it scores the run's own accuracy.
    assert quantized["float_accuracy"] == pytest.approx(metrics["accuracy"])
    assert quantized["accuracy_change"] == pytest.approx(quantized["int8_accuracy"] - quantized["float_accuracy"])
    assert quantized["speedup"] > 0 and quantized["float_images_per_s"] > 0


@pytest.mark.parametrize("runtime", ["onnx", "onnx-int8"])
def test_predict_with_the_onnx_runtime_gives_the_torch_labels(exported, demo_run, runtime, tmp_path):
    every = sorted(str(p) for p in _demo_validation_folder().rglob("*.png"))
    images = every[::len(every) // 24][:24]  # spread over the classes, which come folder by folder
    assert main(["predict", str(demo_run), *images, "--output", str(tmp_path / "torch.csv")]) == 0
    assert main(["predict", str(demo_run), *images, "--runtime", runtime, "--output", str(tmp_path / "onnx.csv")]) == 0
    torch_rows, onnx_rows = read_csv(tmp_path / "torch.csv"), read_csv(tmp_path / "onnx.csv")
    assert len(onnx_rows) == 24 and [r["image"] for r in onnx_rows] == [r["image"] for r in torch_rows]
    agree = sum(o["label_1"] == t["label_1"] for o, t in zip(onnx_rows, torch_rows))
    if runtime == "onnx":
        assert agree == 24
        assert all(float(o["score_1"]) == pytest.approx(float(t["score_1"]), abs=1e-5)
                   for o, t in zip(onnx_rows, torch_rows))
    else:  # int8 rounds every weight, so close calls flip (which ones depends on onnxruntime and the CPU's kernels):
        # predict must give the int8 graph's own labels, run here directly on the processor's pixels.
        assert [r["label_1"] for r in onnx_rows] == int8_graph_labels(exported, images)
        assert agree >= 12, agree  # and still mostly the model's
    # The export folder itself is a model one can name.
    assert main(["predict", str(exported), images[0], "--runtime", runtime, "--output", str(tmp_path / "e.csv")]) == 0
    assert read_csv(tmp_path / "e.csv")[0]["label_1"] == onnx_rows[0]["label_1"]


def int8_graph_labels(exported: Path, images: list[str]) -> list[str]:
    """The top label of each image from onnxruntime on model_quantized.onnx, fed the export's image processor."""
    import onnxruntime
    from PIL import Image
    from transformers import AutoImageProcessor

    processor = AutoImageProcessor.from_pretrained(exported)
    names = json.loads((exported / "config.json").read_text())["id2label"]
    session = onnxruntime.InferenceSession(str(exported / "model_quantized.onnx"), providers=["CPUExecutionProvider"])
    pixels = processor(images=[Image.open(path).convert("RGB") for path in images], return_tensors="np")["pixel_values"]
    logits = session.run(None, {"pixel_values": pixels.astype("float32")})[0]
    return [names[str(index)] for index in logits.argmax(-1)]


def _demo_validation_folder() -> Path:
    from vit_finetune.data import cache_dir

    return synthetic.ensure_demo_dataset(cache_dir() / "shapes") / "validation"  # where builtin:shapes lives


def test_a_graph_outside_the_tolerance_is_refused_and_the_earlier_export_kept(exported, demo_run, capsys):
    before = {p.name: p.read_bytes() for p in exported.iterdir()}
    # fp32 export and PyTorch differ by rounding (~1e-7 here, see export.json), never by less than 1e-15.
    assert main(["export", str(demo_run), "--onnx", "--tolerance", "1e-15"]) == 1
    error = capsys.readouterr().err
    assert "differ from PyTorch's by" in error and "more than the tolerance 1e-15" in error
    assert {p.name: p.read_bytes() for p in exported.iterdir()} == before  # quantised file and all: untouched
    assert not [p.name for p in demo_run.iterdir() if ".partial-" in p.name or ".old-" in p.name]


def test_a_folder_of_the_users_is_never_an_export_target(demo_run, tmp_path, capsys):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    assert main(["export", str(demo_run), "--onnx", "--output", str(mine)]) == 1
    assert "not an ONNX export of this toolkit" in capsys.readouterr().err
    assert [p.name for p in mine.iterdir()] == ["notes.txt"] and (mine / "notes.txt").read_text() == "keep me"


def test_a_folder_that_only_holds_a_file_named_export_json_is_not_taken_for_an_export(demo_run, tmp_path, capsys):
    mine = tmp_path / "mine"
    (mine / "sub").mkdir(parents=True)
    (mine / "precious.txt").write_text("keep me")
    (mine / "sub" / "deep.txt").write_text("me too")
    (mine / "export.json").write_text("{}")
    before = snapshot(mine)
    assert main(["export", str(demo_run), "--onnx", "--output", str(mine)]) == 1
    assert "not an ONNX export of this toolkit" in error_line(capsys.readouterr().err)
    assert snapshot(mine) == before


def test_a_re_export_replaces_only_what_the_export_wrote(exported, demo_run, tmp_path, capsys):
    """Through a link to an earlier export (int8 included) where the user added files; beside it, the staging folder
    of an export that was killed."""
    earlier = tmp_path / "served"
    shutil.copytree(exported, earlier)
    (earlier / "Dockerfile").write_text("FROM python:3.11\n")
    (earlier / "app").mkdir()
    (earlier / "app" / "server.py").write_text("print('mine')\n")
    link = tmp_path / "current"
    link.symlink_to(earlier)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    killed = tmp_path / f".served.partial-{int(dead.stdout)}-x1y2"  # an export killed mid-way leaves this
    killed.mkdir()
    assert main(["export", str(demo_run), "--onnx", "--output", str(link)]) == 0, capsys.readouterr().err[-2000:]
    assert link.is_symlink() and link.resolve() == earlier  # written through the link, which stays
    assert (earlier / "Dockerfile").read_text() == "FROM python:3.11\n"
    assert (earlier / "app" / "server.py").read_text() == "print('mine')\n"
    report = json.loads((earlier / "export.json").read_text())
    assert report["files"] == ["config.json", "export.json", "model.onnx", "preprocessor_config.json"]
    assert not (earlier / "model_quantized.onnx").exists()  # the earlier int8 graph: stale beside the new float one
    assert not killed.exists() and not [p.name for p in tmp_path.iterdir() if ".partial-" in p.name]


def test_an_export_on_a_full_disk_is_an_error_and_keeps_the_earlier_export(exported, demo_run, tmpfs, capsys):
    disk = tmpfs(sum(p.stat().st_size for p in exported.iterdir()) // 1024 + 256)
    earlier = disk / "onnx"
    shutil.copytree(exported, earlier)
    before = snapshot(earlier)
    left = shutil.disk_usage(disk).free
    (disk / "filler").write_bytes(b"\0" * (left - 8192))  # a few KB left: the graph cannot be written
    assert main(["export", str(demo_run), "--onnx", "--output", str(earlier)]) == 1
    error = error_line(capsys.readouterr().err)
    assert "cannot be written" in error and "No space left" in error and "earlier export is as it was" in error
    assert snapshot(earlier) == before
    assert sorted(p.name for p in disk.iterdir()) == ["filler", "onnx"]  # no staging folder left behind


def test_bad_export_requests_fail_before_work(demo_run, tmp_path, capsys):
    assert main(["export", str(demo_run)]) == 1
    assert "pass --onnx" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "no-such-run"), "--onnx"]) == 1
    assert "folder not found" in capsys.readouterr().err


def test_predict_onnx_without_an_export_names_the_command_that_makes_it(args, tmp_path, images, capsys):
    output = tmp_path / "plain"
    assert train([*args, f"output_dir={output}", "train.epochs=1"]) == 0
    image = next((images / "validation").rglob("*.png"))
    assert main(["predict", str(output), str(image), "--runtime", "onnx"]) == 1
    assert f"python -m vit_finetune export {output} --onnx" in capsys.readouterr().err


def test_a_lora_run_exports_its_merged_model_which_a_new_run_in_the_folder_removes(args, tmp_path, images):
    import onnx

    output = tmp_path / "lora"
    lora = ["train.epochs=1", "model.lora={r: 4, alpha: 8, dropout: 0.0}"]
    assert train([*args, f"output_dir={output}", *lora]) == 0
    assert (output / "adapter" / "adapter_config.json").is_file()
    assert main(["export", str(output), "--onnx"]) == 0
    initializers = [i.name for i in onnx.load(str(output / "onnx" / "model.onnx")).graph.initializer]
    assert initializers and not [name for name in initializers if "lora" in name.lower()]
    picked = sorted(str(p) for p in (images / "validation").rglob("*.png"))
    assert main(["predict", str(output), *picked, "--output", str(tmp_path / "t.csv")]) == 0
    assert main(["predict", str(output), *picked, "--runtime", "onnx", "--output", str(tmp_path / "o.csv")]) == 0
    assert [r["label_1"] for r in read_csv(tmp_path / "o.csv")] == [r["label_1"] for r in read_csv(tmp_path / "t.csv")]
    # New weights in the folder: the graph of the old ones must not stay beside them.
    assert train([*args, f"output_dir={output}", *lora, "overwrite=true", "train.seed=2"]) == 0
    assert (output / "metrics.json").is_file() and not (output / "onnx").exists()


# --- the page a person tries, driven in a real headless browser ---

@pytest.fixture
def browser() -> tuple[str, str]:
    """(chromium, chromedriver). Skipped only where they cannot be installed; where apt-get and root are there,
    `make test` (or `make browser`) installs them, so their absence is a failure."""
    import os
    import shutil

    found = shutil.which("chromium"), shutil.which("chromedriver")
    if all(found):
        return found
    if shutil.which("apt-get") and os.geteuid() == 0:
        pytest.fail("chromium and chromium-driver are missing but installable here: run `make browser`")
    pytest.skip("chromium and chromium-driver are not installed and cannot be here (no apt-get, or not root)")


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Tracker:
    """A loopback HTTP server standing for any outside address: it records every request that reaches it."""

    def __init__(self):
        import http.server
        import threading

        requests = self.requests = []

        class Record(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                requests.append(self.path)
                self.send_response(204)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Record)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


class Page:
    """`python -m vit_finetune app MODEL --port P` as a user starts it, its temporary files under `temp` (TMPDIR):
    started on first use, again after a test stopped it."""

    def __init__(self, model: Path, temp: Path, log: Path):
        self.model, self.temp, self.log, self.process, self.url = model, temp, log, None, None

    def start(self) -> str:
        import os
        import subprocess
        import sys
        import time
        import urllib.request

        from tiny import REPO

        if self.process is not None and self.process.poll() is None:
            return self.url
        port = free_port()
        self.url = f"http://127.0.0.1:{port}/"
        with open(self.log, "a") as out:
            # Ctrl-C as a terminal delivers it: SIGINT at its default in the page's process, whatever this test
            # process inherited or was left with (an ignored SIGINT survives exec, and the page would not hear it).
            self.process = subprocess.Popen([sys.executable, "-m", "vit_finetune", "app", str(self.model), "--port",
                                             str(port)], stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                                            env={**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(self.temp)},
                                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        deadline = time.monotonic() + 400  # gradio's import alone takes 30 s on a loaded 2-core machine
        while True:
            assert self.process.poll() is None, f"the app exited: {self.log.read_text()[-3000:]}"
            try:
                urllib.request.urlopen(self.url, timeout=5)
                return self.url
            except OSError:
                assert time.monotonic() < deadline, f"the app did not answer: {self.log.read_text()[-3000:]}"
                time.sleep(1)

    def stop(self, how: int = signal.SIGTERM) -> int:
        """SIGTERM, as a service manager stops it, or SIGINT, as Ctrl-C does; its exit code."""
        if self.process is None or self.process.poll() is not None:
            return 0 if self.process is None else self.process.returncode
        self.process.send_signal(how)
        return self.process.wait(timeout=60)


@pytest.fixture(scope="module")
def tracker() -> Tracker:
    tracker = Tracker()
    yield tracker
    tracker.server.shutdown()


@pytest.fixture(scope="module")
def hostile_model(demo_run, tracker, tmp_path_factory) -> Path:
    """The demo run handed over by someone who named its labels as Markdown and HTML that fetch from the tracker."""
    model = tmp_path_factory.mktemp("hostile") / "demo"
    shutil.copytree(demo_run, model, ignore=shutil.ignore_patterns("onnx"))
    config = json.loads((model / "config.json").read_text())
    labels = [config["id2label"][str(i)] for i in range(len(config["id2label"]))]
    labels[:4] = [f"![t]({tracker.url}/markdown.png)", f"<img src={tracker.url}/html.png>",
                  f"[link]({tracker.url}/link)", f"<script>fetch('{tracker.url}/script')</script>"]
    config.update(id2label={str(i): label for i, label in enumerate(labels)},
                  label2id={label: i for i, label in enumerate(labels)})
    (model / "config.json").write_text(json.dumps(config))
    return model


@pytest.fixture(scope="module")
def page(hostile_model, tmp_path_factory) -> Page:
    folder = tmp_path_factory.mktemp("page")
    (folder / "tmp").mkdir()
    page = Page(hostile_model, folder / "tmp", folder / "app.log")
    yield page
    page.stop()


def test_the_app_page_shows_predicts_labels_the_rollout_and_the_position_picture(browser, page, hostile_model, tracker,
                                                                                tmp_path):
    """With labels that are Markdown and HTML fetching an outside address: shown as text, and nothing is fetched."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    chromium, chromedriver = browser
    served = page.start()
    image = sorted(_demo_validation_folder().rglob("*.png"))[0]
    assert main(["predict", str(hostile_model), str(image), "--top-k", "5", "--output", str(tmp_path / "p.jsonl")]) == 0
    expected = json.loads((tmp_path / "p.jsonl").read_text())["predictions"]
    labels = json.loads((hostile_model / "config.json").read_text())["id2label"]

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,1300"):
        options.add_argument(argument)
    browser = webdriver.Chrome(options=options, service=Service(chromedriver))  # no driver download
    try:
        browser.get(served)
        wait = WebDriverWait(browser, 180)
        upload = wait.until(lambda b: b.find_elements(By.CSS_SELECTOR, "#image input[type=file]"))[0]
        upload.send_keys(str(image))
        names = wait.until(lambda b: b.find_elements(By.CSS_SELECTOR, "#labels dt") or None)
        shown = [(n.text, n.find_element(By.XPATH, "following-sibling::dd").text) for n in names]
        wait.until(lambda b: b.find_elements(By.CSS_SELECTOR, "#rollout img"))
        positions = [img.get_attribute("src") for img in browser.find_elements(By.CSS_SELECTOR, "#positions img")]
        text = browser.find_element(By.TAG_NAME, "body").text
        pointing = browser.find_elements(By.CSS_SELECTOR, f"[src^='{tracker.url}'], [href^='{tracker.url}']")
        fetched = [entry["name"] for entry in browser.execute_script("return performance.getEntriesByType('resource')")]
        screenshot = tmp_path / "app.png"
        browser.save_screenshot(str(screenshot))
    finally:
        browser.quit()
    assert not tracker.requests and not [url for url in fetched if url.startswith(tracker.url)]  # nothing fetched
    assert not pointing  # no image, link or script made of a label
    assert all(label in text for label in list(labels.values())[:4])  # the labels as typed, as text
    assert shown == [(guess["label"], f"{round(guess['score'] * 100)}%") for guess in expected]
    assert positions and positions[0]  # the demo moved the model from 32 to 64 px: its picture is shown
    assert screenshot.read_bytes()[:4] == b"\x89PNG"


def test_the_page_refuses_what_predict_refuses_by_name_and_stopping_it_removes_every_upload(page, tmp_path):
    from gradio_client import Client, handle_file
    from PIL import Image

    client = Client(page.start(), verbose=False)
    (tmp_path / "notes.png").write_text("my notes, not an image\n")
    Image.new("1", (13000, 13000)).save(tmp_path / "huge.png")  # 169 megapixels in a 20 KB file
    for name, reason in (("notes.png", "cannot identify image file 'notes.png'"), ("huge.png", "89478485")):
        with pytest.raises(Exception) as refused:
            client.predict(handle_file(str(tmp_path / name)), api_name="/classify")
        message = str(refused.value)
        assert name in message and reason in message, message
        assert str(page.temp) not in message and "/tmp" not in message  # nothing of the server's folders
    top, picture, _verdict = client.predict(handle_file(str(sorted(_demo_validation_folder().rglob("*.png"))[0])),
                                            api_name="/classify")
    assert len(top["confidences"]) == 5 and Path(picture).is_file()
    assert [p for p in page.temp.rglob("*") if p.is_file()]  # the uploads are on disk while the page runs
    assert page.stop(signal.SIGINT) == 0  # Ctrl-C
    log = page.log.read_text()
    assert "Traceback" not in log and "serving" in log
    assert not [p for p in page.temp.rglob("*") if p.is_file()], "uploads or pictures left after the page stopped"


def test_a_taken_port_is_refused_before_the_model_loads(demo_run, capsys):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["app", str(demo_run), "--port", str(port)]) == 1
    said = capsys.readouterr()
    assert f"port {port}" in error_line(said.err) and "another --port" in said.err
    assert "serving" not in said.out


@pytest.mark.parametrize("name", ["null", "true", "1e3"])
def test_the_space_readme_keeps_a_repo_name_yaml_would_read_as_another_type(name, demo_run, hub, hub_token,
                                                                             monkeypatch, capsys):
    import yaml
    from huggingface_hub import hf_hub_download

    monkeypatch.setenv("HF_TOKEN", hub_token)
    repo_id = f"user/{name}"
    assert main(["push", str(demo_run), "--repo-id", repo_id, "--space-app"]) == 0, capsys.readouterr().err[-2000:]
    front = Path(hf_hub_download(repo_id, "space/README.md")).read_text().split("---")[1]
    assert yaml.safe_load(front)["title"] == name and yaml.safe_load(front)["models"] == [repo_id]


def test_push_space_app_adds_a_space_ready_app_that_gives_predicts_labels(demo_run, hub, hub_token, hub_repo_id,
                                                                           tmp_path, monkeypatch, capsys):
    import runpy

    from huggingface_hub import HfApi, hf_hub_download
    from PIL import Image

    monkeypatch.setenv("HF_TOKEN", hub_token)
    assert main(["push", str(demo_run), "--repo-id", hub_repo_id, "--space-app"]) == 0, capsys.readouterr().err[-3000:]
    files = set(HfApi().list_repo_files(hub_repo_id))
    assert {"space/app.py", "space/requirements.txt", "space/README.md", "model.safetensors"} <= files
    readme = Path(hf_hub_download(hub_repo_id, "space/README.md")).read_text()
    assert "sdk: gradio" in readme and "app_file: app.py" in readme
    requirements = Path(hf_hub_download(hub_repo_id, "space/requirements.txt")).read_text().split()
    assert {line.split(">")[0] for line in requirements} >= {"gradio", "transformers", "torch"}
    # The app as a Space runs it (built, not launched: launching is under __main__), against the pushed model.
    app = runpy.run_path(hf_hub_download(hub_repo_id, "space/app.py"), run_name="space_app")
    image = sorted(_demo_validation_folder().rglob("*.png"))[-1]
    assert main(["predict", str(demo_run), str(image), "--top-k", "5", "--output", str(tmp_path / "p.jsonl")]) == 0
    expected = json.loads((tmp_path / "p.jsonl").read_text())["predictions"]
    shown = app["classify"](Image.open(image))
    assert list(shown) == [guess["label"] for guess in expected]
    assert list(shown.values()) == pytest.approx([guess["score"] for guess in expected], abs=1e-5)
    assert Path(app["position_picture"]()).read_bytes() == (demo_run / "position_embeddings.png").read_bytes()


def test_onnxruntime_runs_on_as_many_threads_as_torch(tmp_path):
    """predict's runtimes, and export's float and int8 timings, on the same threads: a session takes torch's count
    (OMP_NUM_THREADS or torch.set_num_threads), not onnxruntime's own default of one per core."""
    import onnx
    import torch
    from onnx import TensorProto, helper

    from vit_finetune.serving.onnx_classifier import session

    tensor = [helper.make_tensor_value_info(name, TensorProto.FLOAT, [1]) for name in ("pixel_values", "logits")]
    graph = helper.make_graph([helper.make_node("Identity", ["pixel_values"], ["logits"])], "identity", tensor[:1],
                              tensor[1:])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), tmp_path / "m.onnx")
    before = torch.get_num_threads()
    try:
        for threads in (1, 3):
            torch.set_num_threads(threads)
            assert session(tmp_path / "m.onnx").get_session_options().intra_op_num_threads == threads
    finally:
        torch.set_num_threads(before)
