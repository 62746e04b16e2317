"""Issue 37, the serving side, where no server is needed: the `relay serve` record that steers
`relay deploy`, the JSON budget of a request body, the 500 a client sees, HAProxy's config as
relay rewrites it (checked by the real binary), ambiguous body framing. The same behaviours
against live servers: tests/test_serve.py (Serve's Python proxy) and tests/test_serve_cli.py
(HAProxy)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import stat
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest

from relay.serving import endpoint, haproxy_launch, json_limits
from relay.serving.web import ambiguous_framing

pytestmark = pytest.mark.timeout(60)


# --- the record of a running relay serve ------------------------------------------------------


def record(tmp_path: Path, **fields) -> endpoint.Endpoint:
    values = {
        "host": "127.0.0.1",
        "port": 8123,
        "address": "127.0.0.1:6379",
        "app_name": "relay",
        "pid": os.getpid(),
        "pid_start": endpoint.process_start_time(os.getpid()),
        "args": {"model": ["digits:1"], "storage": str(tmp_path)},
        "runtime_env": {"env_vars": {"PYTHONPATH": "/somewhere"}},
    }
    return endpoint.Endpoint(**{**values, **fields})


def test_the_record_is_private_from_its_first_byte(tmp_path):
    path = endpoint.write(str(tmp_path), record(tmp_path))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert endpoint.read(str(tmp_path), "127.0.0.1", 8123) == record(tmp_path)
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left


def test_a_planted_link_at_a_temporary_name_is_not_written_through(tmp_path):
    """The record's temporary file is a fresh, unguessable name created with O_EXCL: a link
    planted where a fixed temporary name would be (the old `<record>.tmp`) stays untouched,
    and so does what it points to."""
    victim = tmp_path / "victim"
    victim.write_text("precious")
    path = endpoint.record_path(str(tmp_path), "127.0.0.1", 8123)
    path.parent.mkdir(parents=True)
    (path.parent / f"{path.stem}.tmp").symlink_to(victim)
    endpoint.write(str(tmp_path), record(tmp_path))
    assert victim.read_text() == "precious"
    assert json.loads(path.read_text())["pid"] == os.getpid()


def test_a_pid_reused_by_another_process_is_not_the_server(tmp_path):
    """Alive means the recorded pid runs and started when recorded: this test's pid with
    another start time is a later process that got the pid, and the record is stale."""
    endpoint.write(str(tmp_path), record(tmp_path, pid_start="1"))
    assert endpoint.read(str(tmp_path), "127.0.0.1", 8123) is None
    endpoint.write(str(tmp_path), record(tmp_path, pid_start=None))  # no start time noted
    assert endpoint.read(str(tmp_path), "127.0.0.1", 8123) is None
    endpoint.write(str(tmp_path), record(tmp_path))
    assert endpoint.read(str(tmp_path), "127.0.0.1", 8123) is not None


def test_the_start_time_of_a_process_tells_it_from_a_later_one():
    first = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        started = endpoint.process_start_time(first.pid)
        assert started is not None and started.isdigit()
        assert endpoint.process_start_time(first.pid) == started  # stable while it runs
        assert started != endpoint.process_start_time(os.getpid())
    finally:
        first.kill()
        first.wait()
    assert endpoint.process_start_time(first.pid) is None


# --- the JSON budget of a request body ----------------------------------------------------------

MIB = 1 << 20


def test_a_mib_of_empty_objects_is_refused_before_it_is_parsed():
    """1 MiB of `{},` parses into ~24 MiB of dicts and list slots; refused by its count of
    objects, with a fraction of that in memory at its peak."""
    from relay.serving.answers import parse_json

    body = b'{"instances": [' + b"{}," * (MIB // 3) + b"{}]}"
    tracemalloc.start()
    try:
        payload, refusal = parse_json(body, max_instances=256)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert payload is None and refusal.status_code == 413
    answer = json.loads(refusal.body)
    assert answer["detail"][0]["type"] == "too_many_values", answer
    assert peak < 4 * MIB, f"{peak / MIB:.1f} MiB at the peak"


def test_the_json_budget_counts_structure_not_string_contents():
    # Brackets inside strings (escaped quotes too) are no structure.
    text = json.dumps({"instances": [{"prompt": '[{"x": "\\"[[[["}' * 1000}]})
    json_limits.check(text, max_containers=4)
    with pytest.raises(json_limits.TooMuchJSON) as caught:
        json_limits.check("[" * 40 + "]" * 40, max_containers=100)
    assert (caught.value.status, caught.value.kind) == (422, "too_deep")
    json_limits.check("[" * 32 + "]" * 32, max_containers=100)  # MAX_DEPTH itself is fine
    with pytest.raises(json_limits.TooMuchJSON) as caught:
        json_limits.check("[" + "[]," * 100 + "[]]", max_containers=100)
    assert (caught.value.status, caught.value.kind) == (413, "too_many_values")


def test_a_deep_body_is_a_422_naming_its_depth():
    from relay.serving.answers import parse_json

    body = b'{"instances": [' + b"[" * 100 + b"]" * 100 + b"]}"
    _, refusal = parse_json(body, max_instances=256)
    assert refusal.status_code == 422
    assert json.loads(refusal.body)["detail"][0] == {
        "loc": "body",
        "msg": "JSON nested deeper than 32 levels",
        "type": "too_deep",
    }


# --- the 500 a client sees ----------------------------------------------------------------------


def test_a_crash_answers_a_generic_500_and_logs_the_details(caplog):
    """What an exception says (a path, a piece of the model, of another request) stays in the
    replica's log, found there by the id the client got."""
    from relay.serving.metrics import ReplicaMetrics
    from relay.serving.model_table import LoadedModel, ModelInfo
    from relay.serving.routes import ModelResponses

    class Replica:
        info = ModelInfo(name="digits", reference="digits:3", version=3, task="digits",
                         checkpoint="/srv/models/digits/epoch_0003")  # fmt: skip
        table = {"digits": LoadedModel(info, task=None, model=None)}
        metrics = ReplicaMetrics()

    async def crashing_route(scope, receive, send) -> None:
        raise RuntimeError("cannot read /srv/models/digits/epoch_0003/model.safetensors")

    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/models/digits:predict",
             "root_path": "", "headers": []}  # fmt: skip
    with caplog.at_level(logging.ERROR, logger="relay.serving.routes"):
        asyncio.run(ModelResponses(crashing_route, Replica())(scope, receive, send))
    assert sent[0]["status"] == 500
    message = json.loads(sent[1]["body"])["error"]
    assert "/srv" not in message and "RuntimeError" not in message, message
    incident = message.split("id ")[1].split(";")[0]
    logged = [r for r in caplog.records if incident in r.getMessage()]
    assert logged and "epoch_0003/model.safetensors" in str(logged[0].exc_info[1])


# --- ambiguous body framing ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "headers",
    [
        [(b"content-length", b"2"), (b"content-length", b"3")],
        [(b"content-length", b"2"), (b"Content-Length", b"2")],
        [(b"content-length", b"2"), (b"transfer-encoding", b"chunked")],
    ],
)
def test_ambiguous_framing_is_named(headers):
    assert "ambiguous" in ambiguous_framing(headers)


def test_plain_framing_passes():
    assert ambiguous_framing([(b"content-length", b"2"), (b"host", b"x")]) is None
    assert ambiguous_framing([(b"transfer-encoding", b"chunked")]) is None


# --- HAProxy's config as relay runs it ----------------------------------------------------------


def serve_config(host: str, directory: Path) -> str:
    """The config Serve's own HAProxy code writes for an HTTP frontend on `host` (no apps yet),
    with relay's settings (tests/test_serve_cli.py reads the one a live server runs)."""
    from ray.serve._private.haproxy import HAProxyApi, HAProxyConfig
    from ray.serve.config import HTTPOptions

    config = HAProxyConfig(
        http_options=HTTPOptions(host=host, port=18080),
        socket_path=str(directory / "admin.sock"),
        server_state_base=str(directory),
        server_state_file=str(directory / "server-state"),
        stats_port=18404,
        metrics_port=19101,
        metrics_enabled=False,  # RAY_SERVE_HAPROXY_METRICS_ENABLED=0 (ingress.py)
    )
    path = directory / "haproxy.cfg"
    HAProxyApi(config, config_file_path=str(path))._generate_config_file_internal()
    return path.read_text()


def section(text: str, header: str) -> list[str]:
    lines = text.splitlines()
    start = lines.index(header)
    rest = lines[start + 1 :]
    end = next((i for i, line in enumerate(rest) if not line[:1].isspace()), len(rest))
    return [line.strip() for line in rest[:end]]


@pytest.mark.parametrize("host", ["0.0.0.0", "::"])
def test_every_interface_for_the_api_keeps_stats_and_prometheus_on_loopback(tmp_path, host):
    """`relay serve --host 0.0.0.0` (or `::`): the API listens everywhere, HAProxy's stats page
    and Prometheus exporter stay on loopback, requests get `timeout http-request` covering the
    body — and the real HAProxy binary accepts the config."""
    errors = haproxy_launch.write_error_files(str(tmp_path))
    text = haproxy_launch.rewrite(serve_config(host, tmp_path), errors, "7")
    assert section(text, "frontend prometheus")[0] == "bind 127.0.0.1:19101"
    assert section(text, "listen stats")[0] == "bind 127.0.0.1:18404"
    frontend = section(text, "frontend http_frontend")
    assert "bind *:18080" in frontend
    assert {f"errorfile {code} {errors[code]}" for code in (400, 408)} <= set(frontend)
    defaults = section(text, "defaults")
    assert "timeout http-request 7s" in defaults and "option http-buffer-request" in defaults
    for code in (400, 408):
        head, _, body = Path(errors[code]).read_bytes().partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 %d " % code) and "error" in json.loads(body)
    path = tmp_path / "haproxy.cfg"
    path.write_text(text)
    check = subprocess.run(
        [haproxy_launch_binary(), "-c", "-f", str(path)], capture_output=True, text=True
    )
    assert check.returncode == 0, check.stdout + check.stderr


def haproxy_launch_binary() -> str:
    from relay.serving.ingress import haproxy_binary

    return haproxy_binary()


def test_an_operators_own_request_timeout_is_kept():
    text = "defaults\n    mode http\n    timeout http-request 3s\nfrontend f\n"
    assert haproxy_launch.request_timeout(text, "10") == text
