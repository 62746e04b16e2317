"""Serving over real HTTP: relay/serving/app.py on the session's Ray cluster, called with
`requests`.

Checkpoints are made in-process (a few optimizer steps on the real data, no Ray Train run) and
registered, so `digits:best` resolves as it would after `relay train`. One digits application
serves the whole module on a free loopback port; charlm, regression and the serve/config.yaml
application join it under route prefixes of their own. Serve is shut down at the end: later
tests train on the same cluster and need its CPUs.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import math
import re
import shutil
import socket
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import requests
import torch
import yaml
from support import REPO, cli_in_fresh_interpreter, free_port, render_page, subprocess_env

from relay import config
from relay.checkpoints import checkpoint
from relay.records import registry
from relay.tasks import Task, TaskSize, build_task

pytestmark = pytest.mark.timeout(180)

if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # serve.app, as `serve run` imports it from the repo root

MAX_BODY_BYTES = 16_384  # small, so a test body can exceed it cheaply
MAX_INSTANCES = 8
TIMEOUT = 30  # seconds per HTTP call: a wedged server fails the test instead of hanging it


def make_version(storage: Path, task_name: str, steps: int, model_name: str | None = None):
    """Train a debug model a few steps on its real data, save it as relay does, register it."""
    cfg = config.from_dict({"task": task_name, "size": "debug", "storage": str(storage)})
    task = build_task(cfg.task, cfg.size, cfg.model)
    torch.manual_seed(0)
    model = task.build_model()
    if steps:
        split = task.load_data(val_fraction=0.2, seed=0)
        dtypes = task.input_columns()
        batch = {
            name: torch.as_tensor(column[:256]).to(dtypes.get(name, torch.as_tensor(column).dtype))
            for name, column in split.train.items()
        }
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        for _ in range(steps):
            loss, _ = task.loss_and_stats(model, batch)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    run_id = f"{task_name.replace(':', '-').replace('.', '-')}-serve-test-{steps}"
    directory = storage / "runs" / run_id / "epoch_0000"
    meta = {"epoch": 1, "metrics": {}, "config": cfg.model_dump(mode="json")}
    checkpoint.save(directory, model.eval(), meta=meta)
    task.save_assets(directory)  # e.g. a Hugging Face task's config.json and tokenizer
    entry = {"checkpoint": str(directory), "run_id": run_id, "task": task_name, "score": None}
    name = model_name or registry.default_model_name(task_name)
    return registry.register_version(storage, name, entry)


def images(n: int, offset: int = 0) -> list[list[float]]:
    from sklearn.datasets import load_digits

    return load_digits().data[offset : offset + n].tolist()


def offline_predictions(storage: Path, ref: str, instances: list) -> list[dict]:
    task, model = checkpoint.load_model(registry.resolve_model(storage, ref).checkpoint)
    return [p.model_dump() for p in task.predict(model, task.validate_instances(instances))]


@pytest.fixture(scope="module")
def storage(tmp_path_factory) -> Path:
    # A storage root of this module's own: other tests register digits versions in RELAY_HOME,
    # and `digits:best` must mean the model made here.
    root = tmp_path_factory.mktemp("serve-storage")
    make_version(root, "digits", steps=40)
    make_version(root, "charlm", steps=5)
    make_version(root, "regression", steps=5)
    make_version(root, "hf-causal-lm", steps=5)
    # Another digits model, for the swap test (as `digits` it would become digits:best); its
    # version 2 has a version number of its own to tell in the answers.
    make_version(root, "digits", steps=5, model_name="digits-next")
    make_version(root, "digits", steps=6, model_name="digits-next")
    return root


@contextlib.contextmanager
def serving(app_name: str, **app_args):
    """Serve on a free loopback port with relay's app (AppArgs fields as keywords) at the route
    prefix "/"; its base URL. Serve is shut down after: later tests need the CPUs."""
    from ray import serve

    from relay.serving.app import AppArgs, app

    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(app(AppArgs(**app_args)), name=app_name, route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()


@pytest.fixture(scope="module")
def base_url(ray_cluster, storage):
    with serving(
        "test-digits",
        model="digits:best",
        storage=str(storage),
        num_cpus=0.5,
        # A generous wait, so requests sent together surely meet in one batch.
        batch_wait_timeout_s=0.05,
        max_instances=MAX_INSTANCES,
        max_body_bytes=MAX_BODY_BYTES,
    ) as url:
        yield url


def predict(base_url: str, body, name: str = "digits", **kwargs) -> requests.Response:
    url = f"{base_url}/v1/models/{name}:predict"
    if isinstance(body, dict | list):
        return requests.post(url, json=body, timeout=TIMEOUT, **kwargs)
    return requests.post(url, data=body, timeout=TIMEOUT, **kwargs)  # raw bytes, or chunks


def assert_matches(served: list[dict], expected: list[dict]) -> None:
    assert [p["label"] for p in served] == [p["label"] for p in expected]
    for got, want in zip(served, expected, strict=True):
        assert got["probabilities"] == pytest.approx(want["probabilities"], rel=1e-5, abs=1e-6)


def assert_still_serving(base_url: str, storage: Path) -> None:
    response = predict(base_url, {"instances": images(1, offset=7)})
    assert response.status_code == 200, response.text
    assert_matches(
        response.json()["predictions"], offline_predictions(storage, "digits:best", images(1, 7))
    )


class Load:
    """Closed-loop clients posting one image each until stopped; every answer recorded as
    (time sent, status or exception name, x-model-version)."""

    def __init__(self, base: str, clients: int = 4) -> None:
        self.base, self.answers, self.stop = base, [], threading.Event()
        self.errors: list[str] = []  # each exception's text, for a failure's message
        self.threads = [threading.Thread(target=self.client) for _ in range(clients)]

    def client(self) -> None:
        with requests.Session() as session:
            while not self.stop.is_set():
                sent = time.monotonic()
                try:
                    response = session.post(
                        f"{self.base}/v1/models/digits:predict",
                        json={"instances": images(1)},
                        timeout=TIMEOUT,  # a hang fails
                    )
                    version = response.headers.get("x-model-version")
                    self.answers.append((sent, response.status_code, version))
                except requests.RequestException as exc:
                    self.answers.append((sent, type(exc).__name__, None))
                    self.errors.append(f"{sent:.2f}: {exc!r}"[:300])

    def __enter__(self) -> Load:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join()

    def wait_for(self, count: int, after: float = 0.0, timeout_s: float = 120.0) -> None:
        """Until `count` answers to requests sent after `after` are in."""
        deadline = time.monotonic() + timeout_s
        while sum(sent > after for sent, _, _ in self.answers) < count:
            answered = len(self.answers)
            assert time.monotonic() < deadline, f"{answered} answers in all: {self.timeline()}"
            time.sleep(0.05)

    def timeline(self) -> dict[int, Counter]:
        """Per second since the first request: how many answers of each status (for a
        failure's message)."""
        start = min(sent for sent, _, _ in self.answers)
        seconds: dict[int, Counter] = {}
        for sent, status, _ in self.answers:
            seconds.setdefault(int(sent - start), Counter())[status] += 1
        return seconds


# --- the happy path ----------------------------------------------------------------------------


def test_the_python_api_serves_until_stopped(ray_cluster, storage):
    """`relay.serve` on the connected cluster: it returns once the model answers, the answers
    are the model's, and `stop()` removes the app (the cluster is this process's, so it stays).
    Before any test of this module starts Serve: this one starts it on a port of its own."""
    from ray import serve

    import relay

    try:
        with relay.serve(["digits:best"], port=free_port(), storage=str(storage)) as served:
            assert served.models == ["digits"] and served.own_cluster is False
            response = predict(served.url, {"instances": images(2)})
            assert response.status_code == 200, response.text
            assert_matches(
                response.json()["predictions"],
                offline_predictions(storage, "digits:best", images(2)),
            )
        assert "relay" not in serve.status().applications
        assert ray_cluster.is_initialized()
    finally:
        serve.shutdown()  # the module's own endpoint starts Serve on another port


def test_predictions_match_the_model_run_offline(base_url, storage):
    batch = images(5)
    as_rows = [[image[r * 8 : r * 8 + 8] for r in range(8)] for image in batch[:2]]
    body = {"instances": [*batch, {"pixels": batch[0]}, {"pixels": as_rows[1]}]}
    response = predict(base_url, body)
    assert response.status_code == 200, response.text
    assert response.headers["x-model-version"] == "1"
    served = response.json()["predictions"]
    assert len(served) == 7 and all(len(p["probabilities"]) == 10 for p in served)
    assert_matches(served, offline_predictions(storage, "digits:best", body["instances"]))
    assert [p["label"] for p in served[5:]] == [served[0]["label"], served[1]["label"]]


def batch_stats(base_url: str) -> dict:
    return requests.get(f"{base_url}/v1/models/digits/stats", timeout=TIMEOUT).json()


def test_concurrent_requests_share_batches(base_url, storage):
    """One image per request, 24 callers at once: some forward must have served several."""
    batch = images(24, offset=100)
    start = threading.Barrier(len(batch))
    results: list = [None] * len(batch)

    def client(i: int) -> None:
        start.wait()
        results[i] = predict(base_url, {"instances": [batch[i]]})

    before = batch_stats(base_url)
    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(batch))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(r is not None and r.status_code == 200 for r in results), results
    served = [r.json()["predictions"][0] for r in results]
    assert_matches(served, offline_predictions(storage, "digits:best", batch))
    after = batch_stats(base_url)
    assert after["instances"] - before["instances"] == len(batch)
    new_batches = {
        int(size): count - before["batch_size_histogram"].get(size, 0)
        for size, count in after["batch_size_histogram"].items()
    }
    assert max(size for size, count in new_batches.items() if count > 0) > 1, (before, after)


def test_metadata_health_and_docs(base_url):
    response = requests.get(f"{base_url}/v1/models/digits", timeout=TIMEOUT)
    assert response.headers["x-model-version"] == "1"  # the version that answered
    meta = response.json()
    assert meta["ready"] is True and meta["name"] == "digits" and meta["task"] == "digits"
    assert meta["version"] == 1 and meta["reference"] == "digits:1"
    assert "checkpoint" not in meta  # where its files lie is the server's business
    assert requests.get(f"{base_url}/healthz", timeout=TIMEOUT).json() == {"status": "ok"}
    docs = requests.get(f"{base_url}/docs", timeout=TIMEOUT)
    assert docs.status_code == 200 and "swagger" in docs.text.lower()
    spec = requests.get(f"{base_url}/openapi.json", timeout=TIMEOUT).json()
    # Each served model's own predict path, with its task's schema.
    assert {"/v1/models/digits:predict", "/v2/models/digits/infer"} <= set(spec["paths"])
    assert spec["components"]["schemas"]["DigitsInstance"]["properties"]["pixels"]
    # v2 too: the infer request names the model's own tensors (GET /v2/models/digits's).
    infer = spec["paths"]["/v2/models/digits/infer"]["post"]["requestBody"]["content"]
    request = infer["application/json"]["schema"]["$ref"].rsplit("/", 1)[1]
    tensor = spec["components"]["schemas"][request]["properties"]["inputs"]["items"]["$ref"]
    pixels = spec["components"]["schemas"][tensor.rsplit("/", 1)[1]]["properties"]
    assert pixels["name"]["const"] == "pixels" and "FP32" in pixels["datatype"]["enum"]
    missing = requests.get(f"{base_url}/v1/models/nope", timeout=TIMEOUT)
    assert missing.status_code == 404 and "nope" in missing.json()["error"]


def test_docs_page_shows_the_api_without_internet_access(base_url, tmp_path):
    """/docs in a real headless Chromium that cannot resolve any host name: the page and its
    scripts come from the server itself, and Swagger UI renders the operations."""
    page = requests.get(f"{base_url}/docs", timeout=TIMEOUT).text
    assert not re.search(r"(src|href)=[\"']https?://", page), page  # nothing from elsewhere
    _, dom, console = render_page(f"{base_url}/docs", tmp_path, offline=True)
    operations = re.findall(r'class="opblock-summary-path"[^>]*data-path="([^"]+)"', dom)
    assert "/v1/models/digits:predict" in operations, (operations, console, dom[:2000])
    assert {"/v1/models/{name}", "/v2/models/digits/infer"} <= set(operations)


# --- bad input: a 4xx JSON naming the problem, and the next request is served ------------------

VALID = [float(i % 17) for i in range(64)]
RAW_NAN = ("[" + ",".join(["NaN"] + ["1"] * 63) + "]").encode()
RAW_INF = ("[" + ",".join(["1"] * 10 + ["Infinity"] + ["1"] * 53) + "]").encode()

BAD_REQUESTS = {
    # name: (body, status, loc of the first detail or None, words the error must contain)
    "pixels of the wrong type": ({"instances": [{"pixels": "abc"}]}, 422, "instances.0.pixels", ""),
    "a string pixel": (
        {"instances": [[*VALID[:3], "7", *VALID[4:]]]},
        422,
        "instances.0.pixels.3",
        "",
    ),
    "a boolean pixel": ({"instances": [[True, *VALID[1:]]]}, 422, "instances.0.pixels.0", ""),
    "63 pixels": ({"instances": [VALID[:63]]}, 422, "instances.0.pixels", ""),
    "8 rows of 7": ({"instances": [[[0.0] * 7] * 8]}, 422, "instances.0.pixels", ""),
    "missing pixels": ({"instances": [{}]}, 422, "instances.0.pixels", ""),
    "an unknown field": ({"instances": [{"pixels": VALID, "x": 1}]}, 422, "instances.0.x", ""),
    "the bad one of two": ({"instances": [VALID, VALID[:10]]}, 422, "instances.1.pixels", ""),
    "NaN": (b'{"instances": [' + RAW_NAN + b"]}", 422, "instances.0.pixels.0", ""),
    "Infinity": (b'{"instances": [' + RAW_INF + b"]}", 422, "instances.0.pixels.10", ""),
    "a pixel above 16": (
        {"instances": [[*VALID[:5], 17, *VALID[6:]]]},
        422,
        "instances.0.pixels.5",
        "",
    ),
    "a negative pixel": ({"instances": [[-1, *VALID[1:]]]}, 422, "instances.0.pixels.0", ""),
    "no instances key": ({"inputs": [VALID]}, 422, "instances", ""),
    "instances not a list": ({"instances": VALID[0]}, 422, "instances", ""),
    "an empty list": ({"instances": []}, 422, "instances", ""),
    "an extra body field": ({"instances": [VALID], "extra": 1}, 422, "extra", ""),
    "too many instances": (
        {"instances": [VALID] * (MAX_INSTANCES + 1)},
        413,
        "instances",
        "at most",
    ),
    "malformed JSON": (b'{"instances": [[1, 2', 400, None, "malformed JSON"),
    "not JSON at all": (b"\xff\xfe garbage", 400, None, "malformed JSON"),
    # Bounded before parsing (relay/serving/json_limits.py): deeper than Python recurses was a
    # 400 from a RecursionError; deeper than 32 is refused by its depth.
    "nesting deeper than Python recurses": (b"[" * 10_000, 422, "body", "nested deeper"),
    "nesting 100 deep": (
        b'{"instances": [' + b"[" * 100 + b"]" * 100 + b"]}",
        422,
        "body",
        "nested deeper",
    ),
    # ~20x its bytes once parsed: refused by its count of objects, before parsing (this used
    # to be parsed whole, then refused for its count of instances).
    "a body of empty objects": (
        b'{"instances": [' + b"{}," * 5000 + b"{}]}",
        413,
        "body",
        "JSON objects and arrays",
    ),
    "a 5000-digit number": (b'{"instances": [[' + b"1" * 5000 + b"]]}", 400, None, "malformed"),
    "a body over the limit": (b"[" + b"0," * MAX_BODY_BYTES + b"0]", 413, None, "exceeds"),
}


def check_bad_request(base_url: str, storage: Path, case: str) -> None:
    """BAD_REQUESTS[case] gets its 4xx JSON, and the next valid request is served."""
    body, status, loc, words = BAD_REQUESTS[case]
    response = predict(base_url, body)
    assert response.status_code == status, response.text
    assert response.headers["x-model-version"] == "1"  # errors say who answered too
    payload = response.json()
    assert isinstance(payload["error"], str) and words in payload["error"]
    if loc is not None:
        assert payload["detail"][0]["loc"] == loc, payload
    assert_still_serving(base_url, storage)


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_bad_request_gets_a_4xx_json_and_the_server_carries_on(base_url, storage, case):
    check_bad_request(base_url, storage, case)


def test_chunked_body_over_the_limit_is_refused_while_it_streams(base_url, storage):
    def chunks():  # no Content-Length: requests sends Transfer-Encoding: chunked
        for _ in range(4 * MAX_BODY_BYTES // 1024):
            yield b" " * 1024

    response = predict(base_url, chunks())
    assert response.status_code == 413 and "exceeds" in response.json()["error"]
    assert_still_serving(base_url, storage)


HUGE_BODIES = {  # name: (bytes, chunked)
    "25 MB with Content-Length": (25_000_000, False),
    "200 MB with Content-Length": (200_000_000, False),
    "25 MB chunked": (25_000_000, True),
}


def post_raw(base_url: str, size: int, chunked: bool) -> bytes:
    """POST `size` bytes to predict as a plain blocking client does — the whole body first,
    then the answer — and return the status line and headers it gets ("" on a reset)."""
    host, port = base_url.removeprefix("http://").split("/")[0].split(":")
    framing = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {size}"
    head = (
        f"POST /v1/models/digits:predict HTTP/1.1\r\nHost: {host}\r\n"
        f"Content-Type: application/json\r\n{framing}\r\n\r\n"
    )
    block = b"0" * (1 << 20)
    with socket.create_connection((host, int(port)), timeout=120) as sock:
        try:
            sock.sendall(head.encode())
            for offset in range(0, size, len(block)):
                piece = block[: min(len(block), size - offset)]
                sock.sendall(b"%x\r\n%b\r\n" % (len(piece), piece) if chunked else piece)
            if chunked:
                sock.sendall(b"0\r\n\r\n")
            answer = b""
            while b"\r\n\r\n" not in answer and (data := sock.recv(65536)):
                answer += data
        except (ConnectionResetError, BrokenPipeError):
            return b""
    return answer


@pytest.mark.parametrize("case", sorted(HUGE_BODIES))
def test_a_huge_body_gets_its_413_not_a_reset(base_url, storage, case):
    size, chunked = HUGE_BODIES[case]
    answer = post_raw(base_url, size, chunked)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:300]
    assert_still_serving(base_url, storage)


def exchange(base_url: str, raw: bytes) -> bytes:
    """Send `raw` bytes as they are (a client no library would be) and return everything the
    server answers until it closes the connection or goes quiet for 5 s."""
    host, port = base_url.removeprefix("http://").split("/")[0].split(":")
    answer = b""
    with socket.create_connection((host, int(port)), timeout=TIMEOUT) as sock:
        sock.sendall(raw)
        sock.settimeout(5)
        with contextlib.suppress(TimeoutError, ConnectionResetError):
            while data := sock.recv(65536):
                answer += data
    return answer


def framed(headers: str, body: bytes, then: bytes = b"") -> bytes:
    return (
        b"POST /v1/models/digits:predict HTTP/1.1\r\nHost: relay\r\n"
        + b"Content-Type: application/json\r\n" + headers.encode() + b"\r\n" + body + then
    )  # fmt: skip


VALID_BODY = json.dumps({"instances": [VALID]}).encode()
# A second request hidden after the first one's body, as one of two parsers would see it.
SMUGGLED = b"GET /v1/models/smuggled HTTP/1.1\r\nHost: relay\r\n\r\n"
AMBIGUOUS_FRAMING = {  # name: (headers, body)
    "two different Content-Lengths": (
        f"Content-Length: {len(VALID_BODY)}\r\nContent-Length: 2\r\n",
        VALID_BODY,
    ),
    "Content-Length beside chunked": (
        "Content-Length: 4\r\nTransfer-Encoding: chunked\r\n",
        b"%x\r\n%b\r\n0\r\n\r\n" % (len(VALID_BODY), VALID_BODY),
    ),
}


@pytest.mark.parametrize("case", sorted(AMBIGUOUS_FRAMING))
def test_an_ambiguous_body_length_is_refused_and_nothing_is_smuggled(base_url, storage, case):
    """Two Content-Lengths, or one beside chunked: a 400 (no front end and replica may each
    pick another end of the body), and whatever follows is never answered as a request."""
    headers, body = AMBIGUOUS_FRAMING[case]
    answer = exchange(base_url, framed(headers, body, then=SMUGGLED))
    assert answer.startswith(b"HTTP/1.1 400 "), answer[:300]
    assert answer.count(b"HTTP/1.1 ") == 1 and b"smuggled" not in answer, answer
    assert_still_serving(base_url, storage)


def test_unknown_model_name_is_404(base_url, storage):
    response = predict(base_url, {"instances": [VALID]}, name="digitz")
    assert response.status_code == 404 and "digitz" in response.json()["error"]
    assert_still_serving(base_url, storage)


# --- KServe v2 (Open Inference Protocol) beside v1 ---------------------------------------------


def infer(base_url: str, body, name: str = "digits") -> requests.Response:
    return requests.post(f"{base_url}/v2/models/{name}/infer", json=body, timeout=TIMEOUT)


def pixels_tensor(batch: list[list[float]], datatype: str = "FP64") -> dict:
    flat = [value for image in batch for value in image]
    return {"name": "pixels", "shape": [len(batch), 64], "datatype": datatype, "data": flat}


def test_v2_health_metadata_and_infer_match_v1(base_url, storage):
    assert requests.get(f"{base_url}/v2/health/live", timeout=TIMEOUT).json() == {"live": True}
    assert requests.get(f"{base_url}/v2/health/ready", timeout=TIMEOUT).json() == {"ready": True}
    ready = requests.get(f"{base_url}/v2/models/digits/ready", timeout=TIMEOUT)
    assert ready.json() == {"name": "digits", "ready": True}
    meta = requests.get(f"{base_url}/v2/models/digits", timeout=TIMEOUT)
    assert meta.headers["x-model-version"] == "1"
    assert meta.json()["versions"] == ["1"]
    assert meta.json()["inputs"] == [{"name": "pixels", "datatype": "FP64", "shape": [-1, 64]}]
    assert {o["name"] for o in meta.json()["outputs"]} == {"label", "probabilities"}

    batch = images(3, offset=20)
    response = infer(base_url, {"id": "r-7", "inputs": [pixels_tensor(batch, "FP32")]})
    assert response.status_code == 200, response.text
    body = response.json()
    assert (body["model_name"], body["model_version"], body["id"]) == ("digits", "1", "r-7")
    outputs = {tensor["name"]: tensor for tensor in body["outputs"]}
    expected = offline_predictions(storage, "digits:best", batch)
    assert outputs["label"]["shape"] == [3]
    assert outputs["label"]["data"] == [p["label"] for p in expected]
    assert outputs["probabilities"]["shape"] == [3, 10]
    flat = [value for p in expected for value in p["probabilities"]]
    assert outputs["probabilities"]["data"] == pytest.approx(flat, rel=1e-5, abs=1e-6)
    only_label = {"inputs": [pixels_tensor(batch[:1])], "outputs": [{"name": "label"}]}
    assert [t["name"] for t in infer(base_url, only_label).json()["outputs"]] == ["label"]


V2_BAD = {
    # name: (body, status, the first detail's loc)
    "unknown input": ({"inputs": [{**pixels_tensor(images(1)), "name": "px"}]}, 422, "inputs.px"),
    "shape against data": (
        {"inputs": [{**pixels_tensor(images(1)), "shape": [2, 64]}]},
        422,
        "inputs.pixels.data",
    ),
    "out of the schema's range": (
        {"inputs": [{**pixels_tensor([[0.0] * 63 + [99.0]])}]},
        422,
        "inputs.pixels.0.63",
    ),
    "NaN-free but a string": (
        {"inputs": [{**pixels_tensor(images(1)), "data": ["x"] * 64}]},
        422,
        "inputs.pixels.0.0",
    ),
    "too many instances": ({"inputs": [pixels_tensor(images(MAX_INSTANCES + 1))]}, 413, None),
    "unknown output": (
        {"inputs": [pixels_tensor(images(1))], "outputs": [{"name": "logits"}]},
        422,
        "outputs.logits",
    ),
}


@pytest.mark.parametrize("case", sorted(V2_BAD))
def test_v2_bad_tensors_get_a_4xx_json_and_the_server_carries_on(base_url, storage, case):
    body, status, loc = V2_BAD[case]
    response = infer(base_url, body)
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    assert "error" in response.json()
    if loc is not None:
        assert response.json()["detail"][0]["loc"] == loc, response.json()
    assert infer(base_url, {"inputs": [pixels_tensor(images(1))]}, name="digitz").status_code == 404
    assert_still_serving(base_url, storage)


# --- /metrics ------------------------------------------------------------------------------------


def scrape(base_url: str) -> dict[tuple, float]:
    """Every sample of /metrics, parsed by prometheus-client's own parser: (name, labels) →
    value."""
    from prometheus_client.parser import text_string_to_metric_families

    response = requests.get(f"{base_url}/metrics", timeout=TIMEOUT)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


def test_metrics_count_requests_latency_and_batches(base_url):
    """The counters move by exactly what this test sends: 3 good requests of 2 instances, one
    422 (one replica serves the module, so its scrape is live)."""
    labels = (("model", "digits"), ("version", "1"))
    before = scrape(base_url)
    for offset in (0, 2, 4):
        assert predict(base_url, {"instances": images(2, offset)}).status_code == 200
    assert predict(base_url, {"instances": [[1.5] * 3]}).status_code == 422
    after = scrape(base_url)

    def moved(name: str, extra: tuple = ()) -> float:
        key = (name, tuple(sorted((*labels, *extra))))
        return after.get(key, 0) - before.get(key, 0)

    assert moved("relay_requests_total", (("code", "200"),)) == 3
    assert moved("relay_requests_total", (("code", "422"),)) == 1
    assert moved("relay_request_duration_seconds_count") == 4
    assert moved("relay_request_duration_seconds_sum") > 0
    # Each good request is one forward of 2 (alone in the replica: nothing else is sent).
    assert moved("relay_batch_size_count") == 3
    assert moved("relay_batch_size_sum") == 6
    assert moved("relay_batch_size_bucket", (("le", "2.0"),)) == 3
    assert moved("relay_batch_size_bucket", (("le", "1.0"),)) == 0


# --- other tasks, the deploy config, refusals before any Ray work -----------------------------


def deploy(ray_cluster, storage: Path, prefix: str, **app_args) -> None:
    from ray import serve

    from relay.serving.app import AppArgs, app

    args = AppArgs(**{"num_cpus": 0.5, **app_args, "storage": str(storage)})
    serve.run(app(args), name=prefix.strip("/"), route_prefix=prefix)


def test_several_models_share_one_endpoint(ray_cluster, base_url, storage):
    from ray import serve

    deploy(ray_cluster, storage, "/multi", model="digits:best,charlm:best")
    multi = f"{base_url}/multi"
    listed = requests.get(f"{multi}/v1/models", timeout=TIMEOUT).json()["models"]
    assert [m["name"] for m in listed] == ["charlm", "digits"]
    response = predict(multi, {"instances": images(2)})
    assert response.status_code == 200 and response.headers["x-model-version"] == "1"
    assert_matches(
        response.json()["predictions"], offline_predictions(storage, "digits:best", images(2))
    )
    prompt = {"prompt": "def ", "max_new_tokens": 4, "temperature": 0}
    response = predict(multi, {"instances": [prompt]}, name="charlm")
    assert response.json()["predictions"] == offline_predictions(storage, "charlm:best", [prompt])
    missing = predict(multi, {"instances": [prompt]}, name="nope")
    assert missing.status_code == 404
    assert "'charlm', 'digits'" in missing.json()["error"]
    assert "x-model-version" not in missing.headers  # two models: no version speaks for it
    paths = requests.get(f"{multi}/openapi.json", timeout=TIMEOUT).json()["paths"]
    assert {"/v1/models/digits:predict", "/v1/models/charlm:predict"} <= set(paths)
    serve.delete("multi")  # the module's cluster has CPUs for only so many replicas


def test_a_version_swap_under_load_fails_no_request(ray_cluster, base_url, storage):
    """Redeploying with another version of `digits` (what `relay deploy` does): the replica
    reconfigures in place (same replica, not a restart), every request under continuous load
    succeeds, and afterwards only the new version answers."""
    from ray import serve

    from relay.serving import model_table
    from relay.serving.app import AppArgs, build

    args = AppArgs(model="digits:best", storage=str(storage), num_cpus=0.5)
    first = model_table.resolve("digits:best", str(storage))
    second = model_table.resolve("digits-next:2", str(storage), name="digits")
    serve.run(build([first], args), name="swap", route_prefix="/swap")
    swap = f"{base_url}/swap"
    replica = requests.get(f"{swap}/v1/models/digits/stats", timeout=TIMEOUT).json()["replica"]
    with Load(swap) as load:
        load.wait_for(50)
        serve.run(build([second], args), name="swap", route_prefix="/swap")
        swapped = time.monotonic()
        load.wait_for(50, after=swapped)
    answers = load.answers
    failed = [answer for answer in answers if answer[1] != 200]
    assert not failed and len(answers) >= 100, failed[:5]
    assert "1" in {version for sent, _, version in answers if sent < swapped}
    # Sent after serve.run returned: the new version only.
    assert {version for sent, _, version in answers if sent > swapped} == {"2"}
    stats = requests.get(f"{swap}/v1/models/digits/stats", timeout=TIMEOUT).json()
    assert stats["replica"] == replica  # swapped inside the same replica
    response = predict(swap, {"instances": images(2)})
    assert_matches(
        response.json()["predictions"], offline_predictions(storage, "digits-next:2", images(2))
    )
    serve.delete("swap")


def test_charlm_continues_a_prompt(ray_cluster, base_url, storage):
    deploy(ray_cluster, storage, "/charlm", model="charlm:best")
    instance = {"prompt": "def main(", "max_new_tokens": 12, "temperature": 0}
    response = predict(f"{base_url}/charlm", {"instances": [instance]}, name="charlm")
    assert response.status_code == 200, response.text
    (served,) = response.json()["predictions"]
    assert isinstance(served["text"], str) and 0 < len(served["text"]) <= 12
    assert [served] == offline_predictions(storage, "charlm:best", [instance])
    too_long = {"prompt": "x", "max_new_tokens": 513}
    response = predict(f"{base_url}/charlm", {"instances": [too_long]}, name="charlm")
    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"] == "instances.0.max_new_tokens"


def test_hugging_face_causal_lm_generates_as_offline(ray_cluster, base_url, storage):
    """Served from its checkpoint alone (config and tokenizer saved in it), seeded sampling
    included; the context bounds max_new_tokens."""
    deploy(ray_cluster, storage, "/hf", model="hf-causal-lm:best")
    instances = [
        {"prompt": "import ", "max_new_tokens": 12, "seed": 1},
        {"prompt": "def main(", "max_new_tokens": 8, "temperature": 0},
    ]
    response = predict(f"{base_url}/hf", {"instances": instances}, name="hf-causal-lm")
    assert response.status_code == 200, response.text
    assert response.json()["predictions"] == offline_predictions(
        storage, "hf-causal-lm:best", instances
    )
    too_long = {"prompt": "x", "max_new_tokens": 128}  # the debug context is 128 tokens
    response = predict(f"{base_url}/hf", {"instances": [too_long]}, name="hf-causal-lm")
    assert response.status_code == 422 and "context" in response.text


def test_regression_checks_the_feature_count(ray_cluster, base_url, storage):
    deploy(ray_cluster, storage, "/regression", model="regression:best")
    features = [0.1 * i for i in range(8)]  # the debug size has 8 features
    response = predict(f"{base_url}/regression", {"instances": [features]}, name="regression")
    assert response.status_code == 200, response.text
    (served,) = response.json()["predictions"]
    (expected,) = offline_predictions(storage, "regression:best", [features])
    assert math.isclose(served["value"], expected["value"], rel_tol=1e-5, abs_tol=1e-6)
    response = predict(f"{base_url}/regression", {"instances": [features[:7]]}, name="regression")
    assert response.status_code == 422 and "expected 8 features" in response.text


@pytest.fixture(scope="module")
def by_directory(ray_cluster, base_url, storage):
    """digits served by its checkpoint directory (an absolute path) at /bydir, one request in
    flight and one waiting at most."""
    from ray import serve

    directory = registry.resolve_model(storage, "digits:best").checkpoint
    deploy(
        ray_cluster, storage, "/bydir", model=str(directory), name="digits",
        max_ongoing_requests=1, max_queued_requests=1,
    )  # fmt: skip
    try:
        yield f"{base_url}/bydir", directory
    finally:
        serve.delete("bydir")


def test_no_answer_shows_where_the_checkpoint_lies(by_directory):
    """A model served from its directory: /v1/models and the version header name it by its
    run and checkpoint, never by the server's absolute path."""
    url, directory = by_directory
    listed = requests.get(f"{url}/v1/models", timeout=TIMEOUT)
    answer = predict(url, {"instances": [VALID]})
    v2 = requests.get(f"{url}/v2/models/digits", timeout=TIMEOUT)
    assert listed.status_code == answer.status_code == v2.status_code == 200, listed.text
    shown = "/".join(Path(directory).parts[-2:])
    (meta,) = listed.json()["models"]
    assert meta["reference"] == meta["version"] == shown and "checkpoint" not in meta, meta
    assert answer.headers["x-model-version"] == shown and v2.json()["versions"] == [shown]
    for text in (listed.text, str(answer.headers), v2.text):
        assert str(Path(directory).parent) not in text, text


def test_requests_beyond_those_in_flight_and_waiting_get_503(by_directory, storage):
    """Two requests whose bodies are still arriving hold the replica's one slot and the one
    place in its queue; the next is refused at once (Serve's backpressure, 503) rather than
    waiting without bound; the two are answered once their bodies are in."""
    url, _ = by_directory
    host, port = url.removeprefix("http://").split("/")[0].split(":")
    head = (
        f"POST /bydir/v1/models/digits:predict HTTP/1.1\r\nHost: relay\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(VALID_BODY)}\r\n\r\n"
    ).encode()
    slow = [socket.create_connection((host, int(port)), timeout=TIMEOUT) for _ in range(2)]
    try:
        for sock in slow:
            sock.sendall(head + VALID_BODY[:10])
            time.sleep(1)  # in order: the first takes the slot, the second the queue
        refused = predict(url, {"instances": [VALID]})
        assert refused.status_code == 503, refused.text
        for sock in slow:
            sock.sendall(VALID_BODY[10:])
        for sock in slow:
            assert sock.recv(65536).startswith(b"HTTP/1.1 200 "), "a held request failed"
    finally:
        for sock in slow:
            sock.close()
    assert predict(url, {"instances": [VALID]}).status_code == 200


def test_deploy_config_is_valid_and_its_application_serves(ray_cluster, base_url, storage):
    """serve/config.yaml passes Serve's own schema, binds loopback, and its application (built
    by the same builder `serve deploy` calls, with the file's args) serves. A `ray start --head`
    cluster for a real `serve deploy` would double this file's run time."""
    from ray.serve.schema import ServeDeploySchema

    from relay.serving.app import AppArgs
    from relay.serving.app import app as relay_app

    schema = ServeDeploySchema.model_validate(
        yaml.safe_load((REPO / "serve/config.yaml").read_text())
    )
    assert (schema.http_options.host, schema.http_options.port) == ("127.0.0.1", 8000)
    (application,) = schema.applications
    assert application.import_path == "serve.app:app"
    # The thin entry Serve imports from the repository root is relay's own builder.
    module, _, attribute = application.import_path.partition(":")
    assert getattr(importlib.import_module(module), attribute) is relay_app
    args = AppArgs.model_validate(application.args)
    assert args.model == ["digits:best"]
    # Only where the model is looked up, and the CPUs, differ from the file.
    deploy(ray_cluster, storage, "/from-config", **args.model_dump(exclude={"storage", "num_cpus"}))
    response = predict(f"{base_url}/from-config", {"instances": [VALID]})
    assert response.status_code == 200 and len(response.json()["predictions"]) == 1


class NoSchemaSize(TaskSize):
    hidden: int


class NoSchemaTask(Task):
    """A task that trains but declares no serving schemas."""

    metric = "val_loss"
    mode = "min"
    Size = NoSchemaSize
    sizes = {"debug": {"hidden": 4}}

    def build_model(self):
        return torch.nn.Linear(1, 1)

    def load_data(self, val_fraction, seed):
        raise NotImplementedError

    def loss_and_stats(self, model, batch):
        raise NotImplementedError


def test_a_task_without_schemas_cannot_be_served(tmp_path):
    from relay.serving.app import AppArgs, resolve_models

    make_version(tmp_path, "test_serve:NoSchemaTask", steps=0, model_name="plain")
    with pytest.raises(TypeError, match="cannot be served"):
        resolve_models(AppArgs(model="plain:best", storage=str(tmp_path)))
    task = build_task("test_serve:NoSchemaTask", "debug")
    with pytest.raises(NotImplementedError, match="cannot be served"):
        task.predict(task.build_model(), [])


def test_refusals_come_before_any_ray_work(tmp_path):
    storage = tmp_path / "storage"
    make_version(storage, "test_serve:NoSchemaTask", steps=0, model_name="plain")
    make_version(storage, "digits", steps=0)
    # Ray puts every session it starts under $RAY_TMPDIR/ray (short: Ray's socket paths are
    # limited to ~107 bytes); an empty one afterwards means no cluster was ever started.
    ray_tmp = Path(tempfile.mkdtemp(prefix="relay-serve-", dir="/tmp"))
    busy = socket.socket()
    try:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        at = ["--storage", str(storage)]
        cases = {
            "unknown_model": ["serve", "nope:best", *at],
            "no_schemas": ["serve", "plain", *at],
            "bad_flag": ["serve", "digits:best", *at, "--max-batch-size", "0"],
            "ray_resource": ["serve", "digits:best", *at, "--replica-resources", "{CPU: 1}"],
            "not_yaml": ["serve", "digits:best", *at, "--replica-resources", "{host1: [1"],
            "port_taken": ["serve", "digits:best", *at, "--port", str(busy.getsockname()[1])],
        }
        # relay/serving/app.py imports Ray Serve, so Ray may be imported, but no cluster may have
        # been started when a refusal comes.
        results = cli_in_fresh_interpreter(
            cases,
            cwd=REPO / "tests",  # where `test_serve:NoSchemaTask` imports from
            env=subprocess_env(RAY_TMPDIR=str(ray_tmp)),
        )
        sessions = sorted(p.name for p in ray_tmp.rglob("session_*"))
    finally:
        busy.close()
        shutil.rmtree(ray_tmp, ignore_errors=True)
    expect_in_message = {
        "unknown_model": "no model, run or checkpoint 'nope:best'",
        "no_schemas": "needs Instance and Prediction schemas",
        "bad_flag": "--max-batch-size:",
        "ray_resource": "--replica-resources: CPU is one of Ray's own resources",
        "not_yaml": "--replica-resources: not YAML",
        "port_taken": "cannot listen on 127.0.0.1:",
    }
    for name, fragment in expect_in_message.items():
        assert results[name]["code"] == 2, (name, results[name])
        assert fragment in results[name]["stderr"], (name, results[name]["stderr"])
        assert "Traceback" not in results[name]["stderr"], name
    assert results["ray_initialized"] is False
    assert sessions == [], f"a Ray session was started before the refusal: {sessions}"
