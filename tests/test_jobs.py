"""`ray start --head` (started here, on free ports, in a session of its own) + `ray job submit`
of jobs/train.py with a user's task from the job's working dir: the run succeeds and is findable
afterwards in the registry. One job for the whole module (each job is a Train run of its own on
the head; the tests only read what it left)."""

from __future__ import annotations

import json
import secrets
import subprocess
import tempfile
from pathlib import Path

import pytest
from support import BIN, REPO, free_ports, stop_session, subprocess_env, wait_for_job_server

from relay.records import registry

pytestmark = [pytest.mark.timeout(420), pytest.mark.slow]


@pytest.fixture(scope="module")
def head_node():
    gcs, dashboard, client, node_manager, object_manager, agent, agent_grpc, metrics, runtime = (
        free_ports(9)
    )
    temp_dir = tempfile.mkdtemp(prefix="rh-", dir="/tmp")  # Ray's socket paths must stay short
    # Token auth as Ray 2.60 intends it, with a token of this cluster's own: the head, the job
    # CLI and the job's driver (which inherits the raylet's environment) all present it.
    env = subprocess_env(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32))
    env.pop("RAY_ADDRESS")
    # On SIGTERM `ray start --block` drains its node first (up to 30 s by default), for Serve
    # traffic on a node leaving a cluster that stays; this whole cluster is going.
    env["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"] = "0"
    cmd = [
        str(BIN / "ray"), "start", "--head", "--block", "--disable-usage-stats",
        "--num-cpus=3", f"--temp-dir={temp_dir}",
        "--node-ip-address=127.0.0.1", f"--port={gcs}",
        "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}",
        f"--ray-client-server-port={client}", f"--node-manager-port={node_manager}",
        f"--object-manager-port={object_manager}", f"--dashboard-agent-listen-port={agent}",
        f"--dashboard-agent-grpc-port={agent_grpc}", f"--metrics-export-port={metrics}",
        f"--runtime-env-agent-port={runtime}",
    ]  # fmt: skip
    log = open(Path(temp_dir) / "ray-start.log", "w")  # noqa: SIM115 - closed at teardown
    leader = subprocess.Popen(
        cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    address = f"http://127.0.0.1:{dashboard}"
    try:
        wait_for_job_server(address, env, leader, Path(temp_dir) / "ray-start.log", 120)
        yield address, env
    finally:
        stop_session(leader)
        log.close()


# Answers of a head's job server that submitted nothing, or that lost the answer to a submit
# (seen in CI on a loaded machine): the head answers `ray job list` before its job agent is up,
# and a submit then waits 10 s for it and fails with "No available agent ..."; and a POST of
# the job once got the connection closed without an answer.
TRANSIENT = ("No available agent to submit job", "RemoteDisconnected", "Connection refused")


def submit_train(head_node, config: str, storage: Path, *extra: str) -> subprocess.CompletedProcess:
    """`ray job submit --working-dir . -- python jobs/train.py CONFIG` (debug size, 2 epochs),
    under a submission id of its own. After a transient answer (TRANSIENT) the job is asked for
    by that id: if the lost submit made it, it is followed to its end (`ray job logs
    --follow`), else submitted again — never twice."""
    address, env = head_node
    submission_id = f"relay-test-{secrets.token_hex(4)}"

    def ray_job(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(BIN / "ray"), "job", *args], cwd=REPO, env=env, capture_output=True, text=True,
            timeout=300,
        )  # fmt: skip

    for _ in range(6):
        submit = ray_job(
            "submit", f"--address={address}", f"--submission-id={submission_id}",
            "--working-dir", ".", "--", "python", "jobs/train.py", config,
            "--set", "size=debug", "--set", "epochs=2", "--set", f"storage={storage}", *extra,
        )  # fmt: skip
        if submit.returncode == 0 or not any(t in submit.stderr for t in TRANSIENT):
            break
        if ray_job("status", f"--address={address}", submission_id).returncode == 0:
            logs = ray_job("logs", "--follow", f"--address={address}", submission_id)
            status = ray_job("status", f"--address={address}", submission_id)
            submit = subprocess.CompletedProcess(
                submit.args, logs.returncode or status.returncode,
                logs.stdout + status.stdout, logs.stderr + status.stderr,
            )  # fmt: skip
            break
    assert submit.returncode == 0, submit.stdout[-4000:] + submit.stderr[-4000:]
    return submit


@pytest.fixture(scope="module")
def sine_job(head_node, tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """examples/sine.yaml, a task that is not part of relay: the job's workers import it from
    the working dir the submit uploaded. (storage root, the finished submit)"""
    storage = tmp_path_factory.mktemp("jobs") / "storage"
    return storage, submit_train(head_node, "examples/sine.yaml", storage, "--json")


def test_job_submit_trains_and_registers(head_node, sine_job):
    _, env = head_node
    storage, submit = sine_job
    assert "succeeded" in submit.stdout.lower()  # the submit's line, or `ray job status`'s
    result_line = next(
        line for line in reversed(submit.stdout.splitlines()) if line.startswith('{"run_id"')
    )
    result = json.loads(result_line)

    # Findable afterwards: on the absolute storage path, not in the job's temp working dir.
    record = registry.get_run(storage, result["run_id"])
    assert record["status"] == "finished"
    assert Path(record["checkpoint"]).is_dir()
    assert record["metrics"]["epoch"] == 2
    listed = subprocess.run(
        [str(BIN / "relay"), "runs", "--storage", str(storage)],
        env=env, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert result["run_id"] in listed.stdout


def test_job_submit_runs_a_user_task_from_the_working_dir(sine_job):
    storage, _ = sine_job
    (record,) = registry.list_runs(storage)
    assert record["task"] == "examples.sine:SineTask"
    assert record["status"] == "finished"
