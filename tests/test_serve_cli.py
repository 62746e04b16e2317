"""`relay serve` as a user runs it: the command in a session of its own, relay installed from a
plain (non-editable) build and run from outside the repository, with its own embedded cluster,
behind HAProxy (the default) or Serve's Python proxy; then SIGTERM, and nothing may be left.

What is checked from outside, the way an operator would: the sockets the server's processes
listen on (`ss`), HAProxy's own config file, the files it keeps, the processes of the session.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
from support import REPO, free_port, session_members, stop_session, subprocess_env
from test_serve import assert_matches, images, make_version, offline_predictions

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


def start_server(site: Path, cwd: Path, *args: str) -> tuple[subprocess.Popen, list[str]]:
    """`relay serve ...` in a new session; returns it and its stdout lines up to the example
    curl line (the last of the start-up block)."""
    server = subprocess.Popen(
        [sys.executable, "-m", "relay.cli", "serve", *args],
        cwd=cwd,
        env=subprocess_env(PYTHONPATH=str(site)),
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


def haproxy_config(sid: int) -> Path:
    for pid in session_members(sid):
        cmdline = command_line(pid)
        if cmdline and Path(cmdline[0]).name == "haproxy" and "-f" in cmdline:
            return Path(cmdline[cmdline.index("-f") + 1])
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


def check_predictions(base: str, storage: Path) -> None:
    response = requests.post(
        f"{base}/v1/models/digits:predict", json={"instances": images(3)}, timeout=30
    )
    assert response.status_code == 200, response.text
    expected = offline_predictions(storage, "digits:best", images(3))
    assert_matches(response.json()["predictions"], expected)


def test_haproxy_ingress_on_loopback_from_an_installed_relay(installed, storage, tmp_path):
    probe = subprocess.run(
        [sys.executable, "-c", "import relay; print(relay.__file__)"],
        cwd=tmp_path,
        env=subprocess_env(PYTHONPATH=str(installed)),
        capture_output=True,
        text=True,
        check=True,
    )
    assert probe.stdout.startswith(str(installed)), probe.stdout  # not the checkout's relay

    port = free_port()
    server, lines = start_server(installed, tmp_path, "digits:best", "--storage", str(storage),
                                 "--port", str(port))  # fmt: skip
    try:
        assert lines[0].startswith(f"serving digits:1 (task digits) at http://127.0.0.1:{port}")
        assert lines[1].startswith("ingress: haproxy"), lines
        check_predictions(f"http://127.0.0.1:{port}", storage)

        sockets = listening(server.pid)
        haproxy = [(ip, p) for name, ip, p in sockets if name == "haproxy"]
        # The frontend on the asked port, stats and Prometheus on free ports: all on loopback,
        # none on Serve's fixed defaults (8404, 9101), which two clusters would fight over.
        assert ("127.0.0.1", port) in haproxy and len(haproxy) >= 3, sockets
        assert all(ip == "127.0.0.1" for ip, _ in haproxy), haproxy
        assert not {8404, 9101, 8500} & {p for _, _, p in sockets}, sockets
        # The replica's own HTTP server (direct ingress, 30000-31000) that HAProxy forwards to.
        replica = [(ip, p) for name, ip, p in sockets if name.startswith("ray::ServeRepli")]
        direct = [(ip, p) for ip, p in replica if 30000 <= p <= 31000]
        assert direct and all(ip == "127.0.0.1" for ip, _ in direct), replica

        # HAProxy's files, the admin socket (mode 666, level admin) among them, lie under a
        # directory only this user may enter (Serve makes subdirectories of its own in it).
        config = haproxy_config(server.pid)
        text = config.read_text()
        socket_path = Path(re.search(r"stats socket (\S+)", text).group(1))
        assert socket_path.is_socket()
        private = next(d for d in socket_path.parents if d.stat().st_mode & 0o077 == 0)
        assert private != Path("/") and config.is_relative_to(private)
        assert private.stat().st_uid == os.getuid()
        assert re.search(r"(?m)^\s*bind 127\.0\.0\.1:\d+$", text), text

        took, left = stop_and_count(server)
        assert not left, f"still running {took:.1f} s after SIGTERM: {left}"
        assert not private.exists()
        assert server.wait(timeout=10) == 0
    finally:
        stop_session(server)


def test_python_proxy_on_request(installed, storage, tmp_path):
    port = free_port()
    server, lines = start_server(installed, tmp_path, "digits:best", "--storage", str(storage),
                                 "--port", str(port), "--ingress", "proxy")  # fmt: skip
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
