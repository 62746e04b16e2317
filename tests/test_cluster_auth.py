"""A head started the documented way (`ray start --head` in docs/clusters.md, "Train on a Ray
cluster with `ray job submit`") refuses a client without its token, and accepts the page's own
`ray job` commands.

Ray 2.60 turns token authentication on by itself only for a cluster `ray.init()` starts; a
`ray start --head` enables it only with `RAY_AUTH_MODE=token` or a token already on the
machine, and otherwise serves its job API (arbitrary code) to anyone who reaches it. The test
runs the page's shell lines as written, in a home directory of its own (so it neither reads
nor writes the user's ~/.ray), adding only the ports, temp dir and `--block` a test needs.
The namespace-cluster demo (netns_cluster) prints a client line that names a 0600 token
file, never the token.
"""

from __future__ import annotations

import shlex
import shutil
import stat
import subprocess
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from netns_cluster import NetnsCluster, client_auth_env
from support import BIN, REPO, free_ports, stop_session, subprocess_env, wait_for_job_server

pytestmark = pytest.mark.timeout(240)

PAGE = REPO / "docs" / "clusters.md"
SECTION = "## Train on a Ray cluster with `ray job submit`"


def documented_recipe() -> tuple[list[str], str]:
    """The shell lines of the section's first bash block before `ray start --head`, and that
    line itself."""
    text = PAGE.read_text()
    section = text[text.index(SECTION) :]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    lines = [line for line in block.splitlines() if line.strip()]
    (start,) = [i for i, line in enumerate(lines) if "ray start --head" in line]
    return lines[:start], lines[start]


def shell_env_after(lines: list[str], env: dict[str, str]) -> dict[str, str]:
    """The environment a shell has after running `lines` (exports included)."""
    script = "set -e\n" + "\n".join(lines) + "\nenv -0\n"
    result = subprocess.run(
        ["bash", "-c", script], env=env, capture_output=True, timeout=120, check=True
    )
    pairs = [item.split(b"=", 1) for item in result.stdout.split(b"\0") if b"=" in item]
    return {key.decode(): value.decode() for key, value in pairs}


def head_command(line: str, temp_dir: str, dashboard: int) -> tuple[dict[str, str], list[str]]:
    """The page's `ray start --head` line as (its VAR=value prefixes, argv), with the test's
    ports, temp dir and --block appended."""
    words = shlex.split(line, comments=True)
    assignments = {}
    while "=" in words[0] and not words[0].startswith("-"):
        key, _, value = words.pop(0).partition("=")
        assignments[key] = value
    assert words[:3] == ["ray", "start", "--head"], line
    gcs, client, node_manager, object_manager, agent, agent_grpc, metrics, runtime = free_ports(8)
    extra = [
        "--block", "--num-cpus=1", f"--temp-dir={temp_dir}",
        "--node-ip-address=127.0.0.1", f"--port={gcs}",
        "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}",
        f"--ray-client-server-port={client}", f"--node-manager-port={node_manager}",
        f"--object-manager-port={object_manager}", f"--dashboard-agent-listen-port={agent}",
        f"--dashboard-agent-grpc-port={agent_grpc}", f"--metrics-export-port={metrics}",
        f"--runtime-env-agent-port={runtime}",
    ]  # fmt: skip
    return assignments, [str(BIN / "ray"), *words[1:], *extra]


def get_jobs(address: str, token: str | None) -> int:
    """The HTTP status of the job API's list, with a bearer token or none."""
    request = urllib.request.Request(f"{address}/api/jobs/")
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code


@pytest.fixture(scope="module")
def documented_head():
    """A head started by the page's lines; yields (dashboard address, the page shell's
    environment, its home directory, the head's log). The home (the token) goes at the end."""
    temp_dir = tempfile.mkdtemp(prefix="ra-", dir="/tmp")  # Ray's socket paths must stay short
    home = Path(temp_dir) / "home"
    home.mkdir()
    base = subprocess_env(HOME=str(home), RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0")
    base.pop("RAY_ADDRESS")
    setup, start_line = documented_recipe()
    shell_env = shell_env_after(setup, base)
    dashboard = free_ports(1)[0]
    assignments, argv = head_command(start_line, temp_dir, dashboard)
    log_path = Path(temp_dir) / "ray-start.log"
    log = open(log_path, "w")  # noqa: SIM115 - closed at teardown
    leader = subprocess.Popen(
        argv,
        env={**shell_env, **assignments},
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    address = f"http://127.0.0.1:{dashboard}"
    try:
        wait_for_job_server(address, shell_env, leader, log_path, 150)
        yield address, shell_env, home, log_path
    finally:
        stop_session(leader)
        log.close()
        shutil.rmtree(home, ignore_errors=True)


@pytest.mark.slow  # a `ray start --head` of its own
def test_documented_head_refuses_a_client_without_the_token(documented_head):
    address, _, home, _ = documented_head
    assert get_jobs(address, token=None) == 401  # no token: unauthenticated
    assert get_jobs(address, token="not-the-token") == 403  # a wrong one: forbidden
    token = (home / ".ray" / "auth_token").read_text().strip()
    assert get_jobs(address, token=token) == 200


@pytest.mark.slow  # a `ray start --head` of its own
def test_documented_token_is_private_to_its_user(documented_head):
    _, _, home, _ = documented_head
    mode = stat.S_IMODE((home / ".ray" / "auth_token").stat().st_mode)
    assert mode & 0o077 == 0, f"~/.ray/auth_token is {oct(mode)}: others may read the token"


@pytest.mark.slow  # a `ray start --head` of its own
def test_documented_job_cli_presents_the_token(documented_head):
    """`ray job submit` / `ray job list` in the page's shell reach the head (the fixture's
    probe), and the job CLI from a shell without the token is refused, naming authentication."""
    address, shell_env, home, _ = documented_head
    stranger_home = home.parent / "stranger"
    stranger_home.mkdir(exist_ok=True)
    stranger = {**shell_env, "HOME": str(stranger_home), "RAY_AUTH_MODE": "token"}
    refused = subprocess.run(
        [str(BIN / "ray"), "job", "list", f"--address={address}"],
        env=stranger, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert refused.returncode != 0
    assert "auth" in (refused.stdout + refused.stderr).lower(), refused.stderr[-2000:]


@pytest.mark.slow  # a `ray start --head` of its own
def test_documented_head_sends_no_usage_stats(documented_head):
    *_, log_path = documented_head
    assert "Usage stats collection is disabled" in log_path.read_text()


def test_netns_demo_prints_no_token(tmp_path):
    """The demo's printed `ray job submit` / `ray list nodes` lines carry the token's path, not
    the token (they land in scrollback and logs); the file is the owner's alone."""
    cluster = NetnsCluster(1, storage=tmp_path)  # nothing started: no namespace, no Ray
    try:
        words = client_auth_env(cluster)
        token = cluster.env["RAY_AUTH_TOKEN"]
        assert token not in words
        env = dict(word.split("=", 1) for word in shlex.split(words))
        assert env["RAY_AUTH_MODE"] == "token"
        path = Path(env["RAY_AUTH_TOKEN_PATH"])
        assert path.read_text() == token
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
        assert path.parent == cluster.temp_root  # removed with the cluster by stop()
    finally:
        shutil.rmtree(cluster.temp_root, ignore_errors=True)
