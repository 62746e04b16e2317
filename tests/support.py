"""Helpers the tests share (conftest.py holds the fixtures)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from relay.records import history
from relay.runtime.processes import session_members, stop_session  # noqa: F401 - for the tests

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def subprocess_env(**extra: str) -> dict[str, str]:
    """Environment for child processes: our venv first, a cluster of their own."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env["RAY_ADDRESS"] = "local"
    env.update(extra)
    return env


def files_holding(text: str, *roots: Path) -> list[str]:
    """Every file under `roots` whose bytes contain `text`."""
    return [
        str(path)
        for root in roots
        for path in root.rglob("*")
        if path.is_file() and text.encode() in path.read_bytes()
    ]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def free_ports(count: int) -> list[int]:
    """`count` distinct free loopback ports (all held open until all are chosen)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


# --- faults from outside: SIGKILL a Ray Train worker process ------------------------------------


def train_worker_pids() -> list[int]:
    """PIDs of the live Ray Train worker processes of the cluster this process is connected to,
    never another's on the same machine (`make test` runs the multi-host tier's beside it)."""
    from relay.runtime import ray_private

    actors = ray_private.actors_of_class("RayTrainWorker").values()
    return sorted(a["pid"] for a in actors if a["state"] == "ALIVE" and a["pid"])


def process_gone(pid: int, timeout_s: float = 10.0) -> bool:
    """Whether `pid` ended (or is a zombie waiting to be reaped) within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.05)
    return False


# Runs `relay.cli.main` on each argv in one fresh interpreter and reports, besides each exit code
# and stderr, whether Ray was imported or a Ray cluster started before the refusals came.
_CLI_PROBE = textwrap.dedent(
    """
    import contextlib, io, json, sys
    from relay.cli import main
    results = {}
    for name, argv in json.loads(sys.argv[1]).items():
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            code = main(argv)
        results[name] = {"code": code, "stderr": err.getvalue()}
    ray = sys.modules.get("ray")
    results["ray_imported"] = ray is not None
    results["ray_initialized"] = ray is not None and ray.is_initialized()
    print(json.dumps(results))
    """
)


def cli_in_fresh_interpreter(
    cases: dict[str, list[str]], *, cwd: Path | None = None, env: dict[str, str] | None = None
) -> dict:
    """{case name: {"code", "stderr"}, "ray_imported", "ray_initialized"} for `relay ARGV...`."""
    out = subprocess.run(
        [sys.executable, "-c", _CLI_PROBE, json.dumps(cases)],
        cwd=cwd,
        env=env or subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def tensorboard_scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in the TensorBoard event files of `logdir`, read by TensorBoard's own
    reader: tag → [(step, value), ...] in step order."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    events.Reload()
    return {
        tag: sorted((e.step, e.value) for e in events.Scalars(tag))
        for tag in events.Tags()["scalars"]
    }


@contextlib.contextmanager
def mlflow_server(directory: Path, *args: str, **env: str):
    """A real `mlflow server` on a free loopback port (its runs in SQLite, its artifacts in
    `directory`; more options in `args`, more environment in `env`), in a session of its own,
    its telemetry off; yields (URI, the server's Popen). Ends every process of that session,
    also when a test stopped it already. MLflow's job runner is off: huey consumers for
    MLflow's own server-side jobs, which relay never submits (7 processes, on 2 cores more CPU
    than the tracking server itself: 23.6 against 9.2 CPU-s a server)."""
    env = {
        **os.environ,
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
        **env,
    }
    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    log = open(directory / "mlflow-server.log", "w")  # noqa: SIM115 (closed below)
    server = subprocess.Popen(
        [
            str(BIN / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port),
            "--workers", "1",
            "--backend-store-uri", f"sqlite:///{directory / 'mlflow.db'}",
            "--artifacts-destination", str(directory / "artifacts"), *args,
        ],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=directory, env=env,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while True:
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(f"{uri}/health", timeout=2) as answer,
            ):
                if answer.status == 200:
                    break
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"mlflow server did not start: {(directory / 'mlflow-server.log').read_text()}"
                )
            time.sleep(0.5)
        yield uri, server
    finally:
        stop_session(server)
        log.close()


def mlflow_client(uri: str):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=uri, registry_uri=uri)


CHROMIUM_FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--enable-logging=stderr", "--v=0",
)  # fmt: skip


def render_page(
    page: Path | str, directory: Path, offline: bool = False
) -> tuple[Path, str, list[str]]:
    """Open `page` (a file, or a URL) in a real headless Chromium (.ci/run installs Debian's):
    a screenshot, the DOM after load, and the lines Chromium logged from the page's console.

    `offline`: no host name resolves, so nothing outside this machine can be fetched (a page
    that needs a CDN stays blank), and the page's scripts get time to run before the DOM dump.
    A URL must then name its host by address (127.0.0.1).
    """
    import shutil

    import pytest

    chromium = shutil.which("chromium")
    if chromium is None:
        message = "NO BROWSER: Debian's chromium is not installed (.ci/run installs it)"
        if os.environ.get("CI") == "true":  # CI installs it: a missing browser is a failure
            pytest.fail(message)
        pytest.skip(message)
    profile = directory / "chromium-profile"
    url = page.as_uri() if isinstance(page, Path) else page
    name = page.stem if isinstance(page, Path) else "page"
    screenshot = directory / f"{name}.png"
    common = [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}"]
    if offline:
        # Every host name fails to resolve; the loopback address the test's server is on
        # stays reachable.
        rules = "MAP * ~NOTFOUND, EXCLUDE 127.0.0.1"
        common += [f"--host-resolver-rules={rules}", "--virtual-time-budget=15000"]
    shot = subprocess.run(
        [*common, f"--screenshot={screenshot}", "--window-size=1100,2400", url],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert screenshot.exists(), shot.stderr
    dom = subprocess.run([*common, "--dump-dom", url], capture_output=True, text=True, timeout=120)
    console = [line for line in shot.stderr.splitlines() if "CONSOLE" in line]
    return screenshot, dom.stdout, console


def pixels_of(screenshot: Path, rgb: tuple[int, int, int], tolerance: int = 30) -> int:
    """How many pixels of the screenshot are within `tolerance` of the colour `rgb`."""
    from PIL import Image

    with Image.open(screenshot) as image:
        return sum(
            1
            for pixel in image.convert("RGB").getdata()
            if all(abs(c - r) <= tolerance for c, r in zip(pixel, rgb, strict=True))
        )


@contextlib.contextmanager
def sweep_driver(path: Path, env: dict[str, str]) -> Iterator[subprocess.Popen]:
    """`relay tune PATH` in a session of its own, killed with its whole session (SIGKILL) when
    the block ends: a sweep interrupted as a crash would interrupt it."""
    driver = subprocess.Popen(
        [str(BIN / "relay"), "tune", str(path)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        yield driver
    finally:
        stop_session(driver, signals=((signal.SIGKILL, 15),))


def wait_for_checkpoint(storage: Path, name: str, epoch: int) -> Path:
    """The run dir of the (one) run named `name`, once Ray Train has registered its checkpoint
    of `epoch`."""
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        for run_dir in (storage / "runs").glob(f"{name}-*"):
            snapshot = run_dir / "checkpoint_manager_snapshot.json"  # Ray Train's record
            try:
                latest = json.loads(snapshot.read_text())["latest_checkpoint_result"]["metrics"]
                if latest["epoch"] >= epoch:
                    return run_dir
            except (OSError, ValueError, KeyError, TypeError):
                pass
        time.sleep(0.1)
    raise AssertionError(f"no checkpoint of epoch {epoch} of {name} in time")


def wait_for_job_server(
    address: str, env: dict[str, str], leader, log: Path, wait_s: float
) -> None:
    """Until `ray job list` answers at `address` (the dashboard of a `ray start --head` run by
    `leader`); fails with the start log's tail if the head exits, or `wait_s` passes."""
    import pytest

    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        assert leader.poll() is None, log.read_text()[-4000:]
        probe = subprocess.run(
            [str(BIN / "ray"), "job", "list", f"--address={address}"],
            env=env, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        if probe.returncode == 0:
            return
        time.sleep(2)
    pytest.fail(f"the head at {address} never served its jobs: {probe.stderr[-3000:]}")


def first_epoch_start(run_dir, since: float) -> float:
    """When the first epoch trained after `since` began, from history.jsonl (rank 0's clock)."""
    first = next(e for e in history.read_raw(run_dir) if e["time"] >= since)
    return first["time"] - first["epoch_s"]


def wait_until_cluster_idle(timeout_s: float = 120.0) -> None:
    """Until the connected cluster has every CPU free again: a test whose premise is what fits
    on the cluster must not count another test's actors still going away (seen in CI: the
    first sweep test of a module, after test_strategy_runs, found CPUs freed between two reads)."""
    import ray

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ray.available_resources().get("CPU", 0.0) >= ray.cluster_resources().get("CPU", 0.0):
            return
        time.sleep(0.2)
    raise AssertionError(f"CPUs still held after {timeout_s} s: {ray.available_resources()}")
