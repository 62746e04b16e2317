"""`relay serve` as a user runs it: the command in a session of its own, relay installed from a
plain (non-editable) build and run from outside the repository, with its own embedded cluster,
behind HAProxy (the default) or Serve's Python proxy; then SIGTERM, and nothing may be left.
One HAProxy server serves the module's tests in order (the SIGTERM test last); test_serve.py's
bad-input catalogue runs through it too, with the same limits.

What is checked from outside, the way an operator would: the sockets the server's processes
listen on (`ss`), HAProxy's own config file, the files it keeps, the processes of the session.
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests
import torch
from support import REPO, free_port, session_members, stop_session, subprocess_env
from test_serve import (
    AMBIGUOUS_FRAMING,
    BAD_REQUESTS,
    HUGE_BODIES,
    MAX_BODY_BYTES,
    MAX_INSTANCES,
    SMUGGLED,
    VALID_BODY,
    Load,
    assert_matches,
    assert_still_serving,
    check_bad_request,
    exchange,
    framed,
    images,
    make_version,
    offline_predictions,
    post_raw,
    predict,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

READY_TIMEOUT_S = 150
STOP_WITHIN_S = 10  # the promise for Ctrl-C / SIGTERM


@pytest.fixture(scope="module")
def storage(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("serve-cli-storage")
    make_version(root, "digits", steps=40)
    return root


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """relay from a plain `pip install` of a copy of the project (no editable finder, no
    repository on the path): what `pip install .` on a user's machine gives."""
    tmp = tmp_path_factory.mktemp("installed")
    source = tmp / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    shutil.copytree(REPO / "platform", source / "platform", ignore=shutil.ignore_patterns("*.pyc"))
    site = tmp / "site"
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    pip += ["--no-deps", "--no-build-isolation", "--target", str(site), str(source)]
    subprocess.run(pip, check=True, timeout=240)
    return site


def start_server(
    site: Path, cwd: Path, *args: str, **env: str
) -> tuple[subprocess.Popen, list[str]]:
    """`relay serve ...` in a new session (`env`: variables for it besides relay's); returns it
    and its stdout lines up to the example curl line (the last of the start-up block)."""
    server = subprocess.Popen(
        [sys.executable, "-m", "relay.cli", "serve", *args],
        cwd=cwd,
        env=subprocess_env(PYTHONPATH=str(site), **env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    lines: list[str] = []
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        line = server.stdout.readline()
        if not line:
            break  # it exited
        lines.append(line.rstrip("\n"))
        if line.startswith("curl "):
            return server, lines
    stop_session(server)
    pytest.fail(f"relay serve did not come up: {lines}\n{server.stderr.read()[-3000:]}")


def listening(sid: int) -> list[tuple[str, str, int]]:
    """(process name, address, port) of every TCP socket a process of session `sid` listens on,
    as iproute2's `ss` reports them."""
    members = set(session_members(sid))
    table = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    found = []
    for line in table.splitlines():
        fields = line.split()
        address, _, port = fields[3].rpartition(":")
        for name, pid in re.findall(r'\("([^"]+)",pid=(\d+),', line):
            if int(pid) in members:
                found.append((name, address.strip("[]"), int(port)))
    return found


def command_line(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    except OSError:  # gone meanwhile
        return []


def haproxy_files(sid: int) -> tuple[Path, Path, Path]:
    """The config file of session `sid`'s HAProxy, its admin socket, and the nearest directory
    above the socket that only its owner may enter."""
    for pid in session_members(sid):
        cmdline = command_line(pid)
        if cmdline and Path(cmdline[0]).name == "haproxy" and "-f" in cmdline:
            config = Path(cmdline[cmdline.index("-f") + 1])
            admin_socket = Path(re.search(r"stats socket (\S+)", config.read_text()).group(1))
            private = next(d for d in admin_socket.parents if d.stat().st_mode & 0o077 == 0)
            return config, admin_socket, private
    raise AssertionError("no HAProxy process in the server's session")


def stop_and_count(server: subprocess.Popen) -> tuple[float, list[int]]:
    """SIGTERM to relay serve alone (as `kill PID` would); seconds until its session is empty
    (or the processes still there after STOP_WITHIN_S)."""
    started = time.monotonic()
    server.send_signal(signal.SIGTERM)
    while time.monotonic() - started < STOP_WITHIN_S:
        server.poll()
        if not session_members(server.pid):
            return time.monotonic() - started, []
        time.sleep(0.2)
    return time.monotonic() - started, session_members(server.pid)


def check_predictions(base: str, storage: Path, ref: str = "digits:best") -> None:
    response = requests.post(
        f"{base}/v1/models/digits:predict", json={"instances": images(3)}, timeout=30
    )
    assert response.status_code == 200, response.text
    expected = offline_predictions(storage, ref, images(3))
    assert_matches(response.json()["predictions"], expected)


REQUEST_TIMEOUT_S = 3
LIMITS = ("--max-body-bytes", str(MAX_BODY_BYTES), "--max-instances", str(MAX_INSTANCES))


class SyslogCollector:
    """HAProxy's access log, as it sends it (syslog over UDP to Serve's log target): every line,
    for a failure's message (the termination state says which side ended a request, and how)."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.settimeout(0.5)
        self.port = self.sock.getsockname()[1]
        self.lines: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._collect, daemon=True)
        self.thread.start()

    def _collect(self) -> None:
        while not self.stop.is_set():
            with contextlib.suppress(TimeoutError):
                self.lines.append(self.sock.recv(65536).decode(errors="replace").strip())

    def unusual(self) -> list[str]:
        """The lines of requests not answered 200 (health checks and reloads included)."""
        return [line for line in self.lines if " 200 " not in line][-80:]

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.sock.close()


@pytest.fixture(scope="module")
def haproxy_log():
    collector = SyslogCollector()
    yield collector
    collector.close()


@pytest.fixture(scope="module")
def haproxy_server(installed, storage, tmp_path_factory, haproxy_log):
    """`relay serve digits:best` with its default ingress and 2 replicas, from a directory
    outside the repo; HAProxy's access log goes to `haproxy_log`."""
    port = free_port()
    cwd = tmp_path_factory.mktemp("elsewhere")
    at = ("--storage", str(storage), "--port", str(port), "--replicas", "2")
    env = {
        # A short `timeout http-request` (relay's default: 10 s): the slow client's test is quick.
        "RELAY_HAPROXY_REQUEST_TIMEOUT_S": str(REQUEST_TIMEOUT_S),
        "RAY_SERVE_HAPROXY_LOG_TARGET": f"127.0.0.1:{haproxy_log.port}",
    }
    server, lines = start_server(installed, cwd, "digits:best", *at, *LIMITS, **env)
    try:
        yield server, f"http://127.0.0.1:{port}", lines
    finally:
        if server.poll() is None:
            stop_and_count(server)  # as a user would: relay serve cleans up after itself
        stop_session(server)


def test_relay_is_the_installed_copy(installed, tmp_path):
    probe = subprocess.run(
        [sys.executable, "-c", "import relay; print(relay.__file__)"],
        cwd=tmp_path,
        env=subprocess_env(PYTHONPATH=str(installed)),
        capture_output=True,
        text=True,
        check=True,
    )
    assert probe.stdout.startswith(str(installed)), probe.stdout  # not the checkout's relay


def test_haproxy_serves_by_default_and_says_so(haproxy_server, storage):
    _, base, lines = haproxy_server
    assert lines[0].startswith(f"serving digits:1 (task digits) at {base}/v1/models/digits")
    assert lines[1].startswith("ingress: haproxy"), lines
    check_predictions(base, storage)


def test_haproxy_listens_on_loopback_and_keeps_its_files_private(haproxy_server):
    server, base, _ = haproxy_server
    port = int(base.rsplit(":", 1)[1])
    sockets = listening(server.pid)
    haproxy = [(ip, p) for name, ip, p in sockets if name == "haproxy"]
    # The frontend on the asked port, stats and Prometheus on free ports: all on loopback,
    # none on Serve's fixed defaults (8404, 9101, the fallback proxy's 8500), which two
    # clusters on one machine would fight over.
    assert ("127.0.0.1", port) in haproxy and len(haproxy) >= 3, sockets
    assert all(ip == "127.0.0.1" for ip, _ in haproxy), haproxy
    assert not {8404, 9101, 8500} & {p for _, _, p in sockets}, sockets
    # The replica's own HTTP server (direct ingress, 30000-31000) that HAProxy forwards to.
    replica = [(ip, p) for name, ip, p in sockets if name.startswith("ray::ServeRepli")]
    direct = [(ip, p) for ip, p in replica if 30000 <= p <= 31000]
    assert direct and all(ip == "127.0.0.1" for ip, _ in direct), replica
    # HAProxy's files, the admin socket (mode 666, level admin) among them, lie under a
    # directory only this user may enter (Serve makes subdirectories of its own in it).
    config, admin_socket, private = haproxy_files(server.pid)
    assert admin_socket.is_socket() and config.is_relative_to(private)
    assert private != Path("/") and private.stat().st_uid == os.getuid()


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_bad_request_through_haproxy(haproxy_server, storage, case):
    _, base, _ = haproxy_server
    check_bad_request(base, storage, case)


@pytest.mark.parametrize("case", sorted(HUGE_BODIES))
def test_a_huge_body_through_haproxy_gets_its_413(haproxy_server, storage, case):
    _, base, _ = haproxy_server
    size, chunked = HUGE_BODIES[case]
    answer = post_raw(base, size, chunked)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:300]
    assert b"\r\nx-model-version: 1\r\n" in answer.lower(), answer[:300]
    assert_still_serving(base, storage)


def test_two_content_lengths_get_haproxys_400(haproxy_server, storage):
    _, base, _ = haproxy_server
    headers, body = AMBIGUOUS_FRAMING["two different Content-Lengths"]
    answer = exchange(base, framed(headers, body, then=SMUGGLED))
    # HAProxy's parser refuses it, with its own HTML page (2.8 applies no errorfile there).
    assert answer.startswith(b"HTTP/1.1 400 "), answer[:300]
    assert answer.count(b"HTTP/1.1 ") == 1 and b"smuggled" not in answer, answer
    assert_still_serving(base, storage)


def test_content_length_beside_chunked_smuggles_nothing_through_haproxy(haproxy_server, storage):
    """HAProxy settles this one itself (RFC 9112 6.3): it drops the Content-Length, reads
    the body as chunked, answers it and closes the connection, so what follows the body is
    never read as a request."""
    _, base, _ = haproxy_server
    headers, body = AMBIGUOUS_FRAMING["Content-Length beside chunked"]
    answer = exchange(base, framed(headers, body, then=SMUGGLED))
    assert answer.startswith((b"HTTP/1.1 200 ", b"HTTP/1.1 400 ")), answer[:300]
    assert answer.count(b"HTTP/1.1 ") == 1 and b"smuggled" not in answer, answer
    assert_still_serving(base, storage)


@pytest.mark.parametrize("sent", ["headers only", "half the body"])
def test_a_client_too_slow_to_send_its_request_gets_a_408(haproxy_server, storage, sent):
    """HAProxy's `timeout http-request` (relay adds it; Serve's template has none) covers the
    body as well as the headers: a client that stops sending is answered 408 and let go,
    rather than holding its connection and a replica's in-flight slot for an hour."""
    _, base, _ = haproxy_server
    raw = framed(f"Content-Length: {len(VALID_BODY)}\r\n", VALID_BODY)
    partial = raw.partition(b"\r\n\r\n")[0] if sent == "headers only" else raw[:-20]
    answer = exchange_silent(base, partial, wait_s=REQUEST_TIMEOUT_S + 60)
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:300]
    if sent == "half the body":  # incomplete headers get HAProxy 2.8's built-in page
        assert "error" in json.loads(answer.partition(b"\r\n\r\n")[2]), answer
    assert_still_serving(base, storage)


def exchange_silent(base: str, raw: bytes, wait_s: float) -> bytes:
    """Send `raw` and then nothing; what the server answers before it closes (b"" if it never
    does within `wait_s`, far beyond the timeout under test)."""
    host, port = base.removeprefix("http://").split(":")
    answer = b""
    with socket.create_connection((host, int(port)), timeout=wait_s) as sock:
        sock.sendall(raw)
        with contextlib.suppress(TimeoutError, ConnectionResetError):
            while data := sock.recv(65536):
                answer += data
    return answer


def replica_pids(server: subprocess.Popen) -> list[int]:
    return [
        pid
        for pid in session_members(server.pid)
        if " ".join(command_line(pid)).startswith("ray::ServeReplica:relay:")
    ]


def listening_ports(pid: int) -> set[int]:
    """The TCP ports process `pid` listens on (iproute2's `ss`)."""
    table = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    return {
        int(line.split()[3].rpartition(":")[2])
        for line in table.splitlines()
        if f",pid={pid}," in line
    }


def haproxy_servers_up(admin_socket: Path) -> set[int]:
    """The ports of the servers HAProxy sends requests to now: the non-backup servers its
    admin socket's `show stat` marks UP (Serve's fallback proxy, a backup, is not one)."""
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(5)
        sock.connect(str(admin_socket))
        sock.sendall(b"show stat\n")
        raw = b"".join(iter(lambda: sock.recv(65536), b""))
    rows = csv.DictReader(raw.decode().removeprefix("# ").splitlines())
    return {
        int(row["addr"].rpartition(":")[2])
        for row in rows
        if row["svname"] not in ("FRONTEND", "BACKEND")
        and row["status"].startswith("UP")
        and row["bck"] == "0"
        and row.get("addr")
    }


def two_replicas_in_rotation(server: subprocess.Popen, admin_socket: Path) -> list[int]:
    """Until the server has two replica processes and HAProxy sends to both of them (each
    replica's direct-ingress port is an UP server); their pids."""
    deadline = time.monotonic() + 90
    while True:
        replicas = replica_pids(server)
        ports = {pid: listening_ports(pid) for pid in replicas}
        up = haproxy_servers_up(admin_socket)
        if len(replicas) == 2 and all(ports[pid] & up for pid in replicas):
            return replicas
        assert time.monotonic() < deadline, f"replicas {ports}, HAProxy sends to {up}"
        time.sleep(0.25)


KILLS = 3


def test_killed_replicas_of_two_fail_no_request(haproxy_server, haproxy_log, storage):
    """SIGKILL one of the two replicas under continuous load, three times, each time once the
    previous kill's replacement is in HAProxy's rotation: no request fails and nothing hangs.
    The requests a killed replica was working on are sent again to the other one (relay's
    `retry-on empty-response`, serving/ingress.py); without it they fail."""
    server, base, _ = haproxy_server
    _, admin_socket, _ = haproxy_files(server.pid)
    kills = []
    with Load(base) as load:
        load.wait_for(100)
        for _ in range(KILLS):
            victim = two_replicas_in_rotation(server, admin_socket)[0]
            os.kill(victim, signal.SIGKILL)
            kills.append(time.monotonic())
            load.wait_for(50, after=kills[-1] + 2)  # answers while Serve replaces it
        two_replicas_in_rotation(server, admin_socket)
        load.wait_for(50, after=time.monotonic())
    answers = load.answers
    failed = [(round(sent - kills[0], 2), status) for sent, status, _ in answers if status != 200]
    around = [round(k - kills[0], 2) for k in kills]
    if failed:  # pytest.fail: a message it does not shorten
        pytest.fail(
            f"failed {failed} of {len(answers)}; kills at {around} s; {load.errors}; "
            f"per second {load.timeline()}; HAProxy's log, but for requests answered 200:\n"
            + "\n".join(haproxy_log.unusual())
        )
    assert_still_serving(base, storage)


def test_relay_deploy_swaps_the_version_under_load_with_no_failed_request(
    haproxy_server, installed, storage, tmp_path
):
    """`relay deploy digits:2` from another process, in another directory, while clients keep
    posting: no request fails, both versions answer during the swap, requests sent after the
    command returns are all answered by version 2, with its predictions — and by the same
    replica processes (an in-place reconfigure; a restarted single replica leaves HAProxy
    nothing to send to for seconds)."""
    server, base, _ = haproxy_server
    make_version(storage, "digits", steps=5)  # digits:2
    replicas = sorted(replica_pids(server))
    port, storage_at = base.rsplit(":", 1)[1], ("--storage", str(storage))
    with Load(base) as load:
        load.wait_for(200)
        deploy = subprocess.run(
            [sys.executable, "-m", "relay.cli", "deploy", "digits:2", "--port", port, *storage_at],
            cwd=tmp_path,
            env=subprocess_env(PYTHONPATH=str(installed)),
            capture_output=True,
            text=True,
            timeout=180,
        )
        done = time.monotonic()
        load.wait_for(200, after=done)
    assert deploy.returncode == 0, deploy.stderr[-3000:]
    assert f"deployed digits:2 at {base}/v1/models/digits (version 1 → 2)" in deploy.stdout
    failed = [answer for answer in load.answers if answer[1] != 200]
    assert not failed, failed[:10]
    assert {version for sent, _, version in load.answers if sent > done} == {"2"}
    assert "1" in {version for _, _, version in load.answers}
    assert sorted(replica_pids(server)) == replicas
    response = predict(base, {"instances": images(3)})
    expected = offline_predictions(storage, "digits:2", images(3))
    assert_matches(response.json()["predictions"], expected)
    # Each replica loaded version 2 while it served version 1, before the swap (the time
    # Serve routes nothing to a replica: relay/serving/staging.py).
    loaded_ahead = replica_stats(base, "digits", len(replicas))
    assert loaded_ahead == {replica: (2, True) for replica in loaded_ahead}, loaded_ahead


def replica_stats(base: str, name: str, replicas: int) -> dict[str, tuple]:
    """Each replica's (version, loaded_before_swap) for `name`, asked until every one of
    `replicas` has answered (HAProxy picks the replica)."""
    seen: dict[str, tuple] = {}
    for _ in range(200):
        stats = requests.get(f"{base}/v1/models/{name}/stats", timeout=30).json()
        seen[stats["replica"]] = (stats["version"], stats["loaded_before_swap"])
        if len(seen) == replicas:
            break
    return seen


def test_relay_tune_serve_swaps_the_sweeps_best_into_the_running_endpoint(
    haproxy_server, storage, tmp_path
):
    """`relay tune SWEEP --serve --port P` with relay serve running at P: the sweep (two
    one-epoch trials) registers its best as digits:3 and swaps it in, as relay deploy does."""
    _, base, _ = haproxy_server
    sweep = {
        "name": "serve-after-tune",
        "train": {"task": "digits", "size": "debug", "epochs": 1, "storage": str(storage)},
        "search": {"optim.lr": {"grid": [3e-3, 1e-2]}},
        "num_samples": 1,
        "workers_per_trial": 1,
        "max_concurrent_trials": 2,
        "asha": {"enabled": False},
    }
    path = tmp_path / "sweep.yaml"
    path.write_text(json.dumps(sweep))  # JSON is YAML
    port = ("--port", base.rsplit(":", 1)[1])
    tuned = subprocess.run(
        [sys.executable, "-m", "relay.cli", "tune", str(path), "--json", "--serve", *port],
        cwd=tmp_path,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert tuned.returncode == 0, tuned.stdout[-3000:] + tuned.stderr[-3000:]
    result = json.loads(tuned.stdout.splitlines()[-1])  # --json: the last line, serving or not
    assert result["model"] == "digits:3" and len(result["trials"]) == 2
    assert f"deployed digits:3 at {base}/v1/models/digits (version 2 → 3)" in tuned.stderr
    meta = requests.get(f"{base}/v1/models/digits", timeout=30)
    assert meta.json()["version"] == 3 and meta.headers["x-model-version"] == "3"
    check_predictions(base, storage, "digits:3")


def test_two_relay_deploys_at_once_both_land(haproxy_server, installed, storage, tmp_path):
    """Two `relay deploy` started together, each adding a model: the second waits for the
    first (and says so) rather than starting from the same table and undoing its change."""
    _, base, _ = haproxy_server
    names = ("digits-a", "digits-b")
    for name in names:
        make_version(storage, "digits", steps=2, model_name=name)
    port, storage_at = base.rsplit(":", 1)[1], ("--storage", str(storage))
    deploys = [
        subprocess.Popen(
            [sys.executable, "-m", "relay.cli", "deploy", name, "--port", port, *storage_at],
            cwd=tmp_path,
            env=subprocess_env(PYTHONPATH=str(installed)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name in names
    ]
    outputs = [deploy.communicate(timeout=240) for deploy in deploys]
    assert [deploy.returncode for deploy in deploys] == [0, 0], outputs
    for name, (stdout, _) in zip(names, outputs, strict=True):
        assert f"deployed {name}:1 at {base}/v1/models/{name} (added)" in stdout
    assert sum(f"waiting for another relay deploy to 127.0.0.1:{port}" in err for _, err in outputs)
    served = requests.get(f"{base}/v1/models", timeout=30).json()["models"]
    assert {"digits", *names} <= {model["name"] for model in served}, served
    for name in names:
        response = predict(base, {"instances": images(3)}, name=name)
        expected = offline_predictions(storage, f"{name}:1", images(3))
        assert_matches(response.json()["predictions"], expected)


def test_a_version_no_replica_can_load_is_refused_before_the_swap(
    haproxy_server, installed, storage, tmp_path
):
    """`relay deploy` of a version whose weights do not fit its model (a readable weights
    file, so the reference resolves, holding one tensor of the wrong name and shape): every
    replica tries to load it ahead, fails, and the deploy stops there — exit 1 naming the
    problem, the endpoint still on its version, its replicas the same processes."""
    from safetensors.torch import save_file

    server, base, _ = haproxy_server
    entry = make_version(storage, "digits", steps=9)
    save_file({"not.a.layer": torch.zeros(3)}, Path(entry["checkpoint"], "model.safetensors"))
    serving = requests.get(f"{base}/v1/models/digits", timeout=30).json()["version"]
    replicas = sorted(replica_pids(server))
    port, storage_at = base.rsplit(":", 1)[1], ("--storage", str(storage))
    deploy = subprocess.run(
        [sys.executable, "-m", "relay.cli", "deploy", f"digits:{entry['version']}", "--port",
         port, *storage_at],
        cwd=tmp_path,
        env=subprocess_env(PYTHONPATH=str(installed)),
        capture_output=True,
        text=True,
        timeout=180,
    )  # fmt: skip
    assert deploy.returncode == 1, deploy.stdout + deploy.stderr[-3000:]
    assert "cannot load the new models" in deploy.stderr, deploy.stderr[-3000:]
    assert sorted(replica_pids(server)) == replicas
    versions = replica_stats(base, "digits", len(replicas))
    assert {version for version, _ in versions.values()} == {serving}, versions
    check_predictions(base, storage, f"digits:{serving}")


def test_the_record_is_private_and_deploy_checks_it_against_the_cluster(
    haproxy_server, installed, storage, tmp_path
):
    """`relay serve`'s record (mode 0600, its pid with its start time) steers `relay deploy`
    only as far as the live cluster confirms it: a record whose runtime_env the replicas do
    not run with (edited, or left by another server) is refused, and nothing changes."""
    server, base, _ = haproxy_server
    port = base.rsplit(":", 1)[1]
    path = storage / "serving" / f"127.0.0.1_{port}.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    original = path.read_text()
    recorded = json.loads(original)
    assert recorded["pid"] == server.pid and recorded["pid_start"].isdigit(), recorded
    tampered = {**recorded, "runtime_env": {"env_vars": {"PYTHONPATH": str(tmp_path)}}}
    path.write_text(json.dumps(tampered))
    serving = requests.get(f"{base}/v1/models/digits", timeout=30).json()["version"]
    try:
        deploy = subprocess.run(
            [sys.executable, "-m", "relay.cli", "deploy", "digits:best", "--port", port,
             "--storage", str(storage)],
            cwd=tmp_path,
            env=subprocess_env(PYTHONPATH=str(installed)),
            capture_output=True,
            text=True,
            timeout=180,
        )  # fmt: skip
    finally:
        path.write_text(original)
    assert deploy.returncode == 2, deploy.stdout + deploy.stderr[-3000:]
    assert "runtime_env the running replicas do not have" in deploy.stderr, deploy.stderr
    assert requests.get(f"{base}/v1/models/digits", timeout=30).json()["version"] == serving


def test_sigterm_leaves_nothing_running(haproxy_server):
    """Last of the HAProxy tests: it stops the module's server."""
    server, _, _ = haproxy_server
    _, _, private = haproxy_files(server.pid)
    took, left = stop_and_count(server)
    assert not left, f"still running {took:.1f} s after SIGTERM: {left}"
    assert not private.exists()
    assert server.wait(timeout=10) == 0


def test_python_proxy_on_request(installed, storage, tmp_path):
    port = free_port()
    at = ("--storage", str(storage), "--port", str(port), "--ingress", "proxy")
    server, lines = start_server(installed, tmp_path, "digits:best", *at)
    try:
        assert lines[1].startswith("ingress: proxy (Serve's Python proxy)"), lines
        check_predictions(f"http://127.0.0.1:{port}", storage)
        sockets = listening(server.pid)
        assert not [s for s in sockets if s[0] == "haproxy"], sockets
        assert ("127.0.0.1", port) in [(ip, p) for name, ip, p in sockets], sockets
        took, left = stop_and_count(server)
        assert not left, f"still running {took:.1f} s after SIGTERM: {left}"
    finally:
        stop_session(server)


def test_two_models_on_one_replica_and_a_kill_costs_json_errors_never_a_hang(
    installed, storage, tmp_path
):
    """`relay serve digits:1 charlm:1`: both on one port, one replica. SIGKILL it: requests
    meanwhile get a prediction (HAProxy's backup, Serve's fallback proxy, holds them until
    the new replica is up) or a JSON 5xx (relay's error files), never a text page, a
    connection closed unanswered or a hang;
    then predictions come back, and SIGTERM leaves nothing running."""
    make_version(storage, "charlm", steps=5)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    at = ("--storage", str(storage), "--port", str(port))
    server, lines = start_server(installed, tmp_path, "digits:1", "charlm:1", *at)
    try:
        assert lines[0].startswith(f"serving digits:1 (task digits) at {base}/v1/models/digits")
        assert lines[1].startswith(f"serving charlm:1 (task charlm) at {base}/v1/models/charlm")
        prompt = {"prompt": "def ", "max_new_tokens": 4, "temperature": 0}
        response = predict(base, {"instances": [prompt]}, name="charlm")
        assert response.json()["predictions"] == offline_predictions(storage, "charlm:1", [prompt])
        (replica,) = replica_pids(server)
        os.kill(replica, signal.SIGKILL)
        statuses, healthy_in_a_row = [], 0
        deadline = time.monotonic() + 120
        while healthy_in_a_row < 5 and time.monotonic() < deadline:
            try:
                response = predict(base, {"instances": images(1)})  # times out on a hang
            except requests.ConnectionError:
                # What Serve's `http-reuse always` gave the request right after the kill (a
                # connection closed unanswered); relay's `http-reuse safe` turns it into an
                # error answer (relay/serving/haproxy_launch.py).
                statuses.append("dropped")
                continue
            statuses.append(response.status_code)
            if response.status_code == 200:
                healthy_in_a_row += 1
                continue
            healthy_in_a_row = 0
            assert response.status_code in (502, 503, 504), (response.status_code, response.text)
            assert response.headers["content-type"] == "application/json", response.text
            assert "error" in response.json()
            time.sleep(0.1)
        assert healthy_in_a_row == 5, f"no recovery: {statuses[-20:]}"
        assert "dropped" not in statuses, statuses
        check_predictions(base, storage, "digits:1")
        took, left = stop_and_count(server)
        assert not left, f"still running {took:.1f} s after SIGTERM: {left}"
    finally:
        stop_session(server)
