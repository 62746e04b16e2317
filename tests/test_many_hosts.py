"""Real multi-host training on one machine: two "hosts", each a network namespace with its own
address, host name, `ray start` (raylet, object store, temp dir) and a veth link to a bridge
(relay/netns_cluster.py). `ray job submit` from host 0 runs jobs/train.py with one worker per
host, so gloo's collectives cross the veth link — the namespaces have no other way to each
other — and the test proves where each rank ran.

Needs root (`ip netns add`); skipped, saying so, where namespaces cannot be made.
"""

from __future__ import annotations

import json
import secrets
import time
from pathlib import Path

import pytest
from support import BIN, REPO

from relay import history, registry
from relay.netns_cluster import NetnsCluster, netns_unavailable

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

# Each host offers one `worker_slot`, each worker asks for one: the two workers of a run can
# only be placed one per host (relay's `scaling` has no placement strategy field; Ray Train's
# default, PACK, would put both on one host if it could).
ONE_PER_HOST = ["--set", "scaling.num_workers=2",
                "--set", "scaling.resources_per_worker={CPU: 1, worker_slot: 1}"]  # fmt: skip


@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory):
    if reason := netns_unavailable():
        pytest.skip(f"NO NETWORK NAMESPACES: {reason}")
    storage = tmp_path_factory.mktemp("netns-home")
    cluster = NetnsCluster(2, storage=storage, host_resources={"worker_slot": 1})
    try:
        cluster.start()
        print(f"\n{cluster.describe()}\nup in {cluster.up_in_s:.1f} s")
        yield cluster
    finally:
        cluster.stop()
        assert not cluster.leftovers(), cluster.leftovers()


def submit_train(cluster: NetnsCluster, name: str, *overrides: str) -> tuple[dict, str]:
    """`ray job submit` of jobs/train.py (digits, debug size, 2 epochs) from host 0 to the
    head's job server on its namespace address: (the run's --json result, the job's id)."""
    submission_id = f"{name}-{secrets.token_hex(3)}"
    began = time.monotonic()
    bytes_before = cluster.link_bytes(1)
    submit = cluster.run(
        0,
        [
            BIN / "ray", "job", "submit", f"--address={cluster.dashboard_address}",
            f"--submission-id={submission_id}", "--working-dir", ".",
            "--", "python", "jobs/train.py", "jobs/configs/digits.yaml",
            "--set", "size=debug", "--set", "epochs=2", "--set", f"name={name}",
            "--set", f"storage={cluster.storage}", *ONE_PER_HOST, *overrides, "--json",
        ],
        cwd=REPO,
        timeout=300,
    )  # fmt: skip
    assert submit.returncode == 0, submit.stdout[-4000:] + submit.stderr[-4000:]
    assert "succeeded" in submit.stdout
    result = json.loads(
        next(line for line in reversed(submit.stdout.splitlines()) if line.startswith('{"run_id"'))
    )
    print(
        f"\n{name}: job {submission_id} took {time.monotonic() - began:.1f} s; host 1's eth0 "
        f"carried {(cluster.link_bytes(1) - bytes_before) / 1e6:.1f} MB"
    )
    (job,) = cluster.ray_json("jobs", f"--filter=submission_id={submission_id}")
    return result, job["job_id"]


def rank_hosts(cluster: NetnsCluster, run_id: str, job_id: str) -> list[str]:
    """The node IP of each of the run's ranks, from two sources that must agree: Ray's State
    API (the job's RayTrainWorker actors and their nodes) and the run's record of where its
    ranks ran (`placement`, from each rank's progress file; also: each rank's host name is its
    host's)."""
    nodes = cluster.node_ips()
    actors = cluster.ray_json(
        "actors", "--detail", "--limit=1000",
        "--filter=class_name=RayTrainWorker", f"--filter=job_id={job_id}",
    )  # fmt: skip
    by_ray = sorted(nodes[a["node_id"]] for a in actors)
    print(f"{run_id}: State API: RayTrainWorker actors on {by_ray}")
    ranks = registry.get_run(cluster.storage, run_id)["placement"]  # from each rank's record
    print(f"{run_id}: per-rank records {ranks}")
    host_of = {h.ip: h.hostname for h in cluster.hosts}
    for rank in ranks:
        assert nodes[rank["node_id"]] == rank["node_ip"], rank
        assert rank["hostname"] == host_of[rank["node_ip"]], rank
    by_record = sorted(r["node_ip"] for r in ranks)
    assert by_record == by_ray, (by_record, by_ray)
    return by_record


def check_one_rank_per_host(cluster: NetnsCluster, result: dict, job_id: str) -> None:
    record = registry.get_run(cluster.storage, result["run_id"])
    assert record["status"] == "finished"
    assert record["metrics"]["epoch"] == 2
    assert Path(record["checkpoint"]).is_dir()
    # Two workers (a restart would show more), one on each host's namespace address.
    placed = rank_hosts(cluster, result["run_id"], job_id)
    assert placed == sorted(h.ip for h in cluster.hosts), placed


def test_ddp_job_runs_one_rank_per_host(two_hosts):
    result, job_id = submit_train(two_hosts, "hosts-ddp")
    check_one_rank_per_host(two_hosts, result, job_id)


def test_fsdp_job_runs_one_rank_per_host(two_hosts):
    result, job_id = submit_train(two_hosts, "hosts-fsdp", "--set", "parallel.strategy=fsdp")
    check_one_rank_per_host(two_hosts, result, job_id)


# --- a rank stuck on the other host ----------------------------------------------------------


def test_doctor_names_the_stuck_rank_on_the_other_host(two_hosts, tmp_path):
    """Rank 1 (on host 1) sleeps inside a step (tests/stall_task.py). The job's own driver (on
    the head) notices and reads both ranks' stacks, and `relay doctor` run on host 0 does the
    same on demand: py-spy runs on each rank's node through a Ray task pinned there."""
    cluster, name = two_hosts, "hosts-doctor"
    marker = cluster.storage / f"{name}-stalled-at"
    config = tmp_path / "stall.yaml"  # the same filesystem every host sees
    config.write_text(
        json.dumps(
            {
                "name": name,
                "task": "tests.stall_task:StallingTask",
                "size": "debug",
                "model": {"stall_rank": 1, "stall_at": 30, "stall_s": 45, "marker": str(marker)},
                "epochs": 3,
                "batch_size": 32,
                "storage": str(cluster.storage),
                "doctor": {"stall_s": 10},
            }
        )
    )
    submission_id = f"{name}-{secrets.token_hex(3)}"
    submit = cluster.run(
        0,
        [
            BIN / "ray", "job", "submit", f"--address={cluster.dashboard_address}",
            f"--submission-id={submission_id}", "--working-dir", ".", "--no-wait",
            "--", "python", "jobs/train.py", str(config), *ONE_PER_HOST,
        ],
        cwd=REPO,
        timeout=120,
    )  # fmt: skip
    assert submit.returncode == 0, submit.stdout[-4000:] + submit.stderr[-4000:]
    deadline = time.monotonic() + 240
    while not marker.exists():
        assert time.monotonic() < deadline, "rank 1 never stalled"
        time.sleep(0.5)
    (run_dir,) = (cluster.storage / "runs").glob(f"{name}-*")
    deadline = time.monotonic() + 40
    while not list((run_dir / "doctor").glob("*/doctor.json")):
        assert time.monotonic() < deadline, "the job's driver never examined the stalled run"
        time.sleep(0.5)

    asked = cluster.run(
        0,
        [BIN / "relay", "doctor", run_dir.name, "--json"],
        env={**cluster.env, "RAY_ADDRESS": cluster.gcs_address},
        timeout=120,
    )
    assert asked.returncode == 0, asked.stderr[-4000:]
    assert _job_outcome(cluster, submission_id) == "SUCCEEDED"

    reports = [json.loads(p.read_text()) for p in (run_dir / "doctor").glob("*/doctor.json")]
    (watched,) = [r for r in reports if r["reason"]]  # the driver's; `relay doctor` gives none
    for report in (watched, json.loads(asked.stdout)):
        assert report["odd_ones_out"] == [1]
        stalled, waiting = report["ranks"][1], report["ranks"][0]
        assert (stalled["node_ip"], waiting["node_ip"]) == (cluster.hosts[1].ip, cluster.head.ip)
        assert stalled["function"] == "StallingTask.stall_in_the_step", stalled
        assert waiting["waiting_in"], waiting


# --- a host lost mid-run ------------------------------------------------------------------------


def _wait_for_checkpoint(storage: Path, name: str, epoch: int) -> Path:
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


def _job_outcome(cluster: NetnsCluster, submission_id: str, timeout_s: float = 300) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        (job,) = cluster.ray_json("jobs", f"--filter=submission_id={submission_id}")
        if job["status"] in ("SUCCEEDED", "FAILED", "STOPPED"):
            return job["status"]
        time.sleep(2)
    raise AssertionError(f"job {submission_id} still running after {timeout_s:.0f} s")


def test_elastic_run_continues_on_the_head_host_when_the_other_host_is_lost(two_hosts):
    """Last in this module: it kills host 1 (every process of its `ray start`, SIGKILL, as a
    machine that loses power), then starts host 1 again for whatever runs next."""
    cluster, name = two_hosts, "hosts-elastic"
    submission_id = f"{name}-{secrets.token_hex(3)}"
    submit = cluster.run(
        0,
        [
            BIN / "ray", "job", "submit", f"--address={cluster.dashboard_address}",
            f"--submission-id={submission_id}", "--working-dir", ".", "--no-wait",
            "--", "python", "jobs/train.py", "jobs/configs/charlm.yaml",
            "--set", "size=debug", "--set", "epochs=6", "--set", f"name={name}",
            "--set", "model.corpus_bytes=400000", "--set", "failure.max_failures=3",
            "--set", f"storage={cluster.storage}", *ONE_PER_HOST,
            "--set", "scaling.num_workers=[1, 2]",
        ],
        cwd=REPO,
        timeout=120,
    )  # fmt: skip
    assert submit.returncode == 0, submit.stdout[-4000:] + submit.stderr[-4000:]
    try:
        run_dir = _wait_for_checkpoint(cluster.storage, name, 2)
        lost_at = time.monotonic()
        cluster.kill_host(1)
        outcome = _job_outcome(cluster, submission_id)
        print(f"\n{name}: {outcome} {time.monotonic() - lost_at:.1f} s after host 1 was lost")
    finally:
        cluster.restart_host(1)
    logs = cluster.run(
        0, [BIN / "ray", "job", "logs", f"--address={cluster.dashboard_address}", submission_id]
    )
    assert outcome == "SUCCEEDED", logs.stdout[-4000:]

    raw = history.read_raw(run_dir)  # every epoch as trained, repeats included
    print(f"{name}: epochs (epoch, workers) {[(h['epoch'], h['workers']) for h in raw]}")
    restart = next(i for i in range(1, len(raw)) if raw[i]["workers"] != raw[i - 1]["workers"])
    before, after = raw[:restart], raw[restart:]
    assert {h["workers"] for h in before} == {2} and {h["workers"] for h in after} == {1}
    assert before[0]["epoch"] == 1 and after[-1]["epoch"] == 6
    assert after[0]["epoch"] >= 3, "resumed from the last checkpoint (epoch 2 or later)"
    assert registry.get_run(cluster.storage, run_dir.name)["status"] == "finished"
    # The workers after the loss: one, on the head's host.
    placement = registry.get_run(cluster.storage, run_dir.name)["placement"]
    assert [(r["rank"], r["node_ip"]) for r in placement] == [(0, cluster.head.ip)], placement
