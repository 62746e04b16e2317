"""The hang doctor on real runs (shared local cluster, 2 DDP workers): one rank sleeps inside a
training step (tests/stall_task.py) while the other waits for it in the gradient all-reduce.

- the watcher examines the run within `doctor.stall_s` + a few seconds of the stall's start,
  names the sleeping rank as the odd one out, in the task's frame, and the other as waiting;
  each rank's last completed step is the one before the stall (counted by the task itself);
- `relay doctor RUN` does the same on demand while the rank still sleeps;
- a healthy run under the same threshold is never examined.
"""

from __future__ import annotations

import io
import json
import os
import threading
import time
from pathlib import Path

import pytest

import relay
from relay import cli
from relay.config import from_dict
from relay.observe import doctor
from relay.records import registry
from relay.runtime import cluster

pytestmark = pytest.mark.timeout(300)

STALL_S = 10.0  # doctor.stall_s: no rank progressing this long is a stall
SLEEP_S = 40.0  # the longest the stalling rank sleeps: past the watcher's and the CLI's looks
STALL_AT = 30  # the training step it sleeps in: epoch 2 (26 steps an epoch per rank)


def _config(name: str, tmp_path: Path, stall_rank: int, threads: int | None = None):
    return from_dict(
        {
            "name": name,
            "task": "tests.stall_task:StallingTask",
            "size": "debug",
            "model": {
                "stall_rank": stall_rank,
                "stall_at": STALL_AT,
                "stall_s": SLEEP_S,
                "marker": str(tmp_path / "stalled-at"),
                "release": str(tmp_path / "release"),  # the test wakes it once it has looked
            },
            "epochs": 3,
            "batch_size": 32,
            "scaling": {
                "num_workers": 2,
                "resources_per_worker": {"CPU": 1},
                "threads_per_worker": threads,
            },
            "doctor": {"stall_s": STALL_S},
        }
    )


def _running_run(storage: Path, name: str, timeout_s: float = 120) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        runs = [r for r in registry.list_runs(storage) if r["run_id"].startswith(name)]
        if runs and runs[0]["status"] == "running":
            return runs[0]
        time.sleep(0.5)
    pytest.fail(f"no running run {name}")


def _wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.25)
    pytest.fail(f"timed out waiting for {what}")


def test_the_doctor_names_the_stalled_rank_and_its_frame(ray_cluster, relay_home, tmp_path, capsys):
    cfg = _config("doctor-stall", tmp_path, stall_rank=1)
    console = io.StringIO()
    outcome: dict = {}

    def train() -> None:
        try:
            outcome["result"] = relay.train(cfg, out=console, register=False)
        except BaseException as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=train)
    thread.start()
    run = _running_run(relay_home, "doctor-stall")
    run_dir = Path(run["run_dir"])
    marker = tmp_path / "stalled-at"
    _wait_for(marker.exists, 180, "rank 1 to stall")
    stalled_at = float(_wait_for(lambda: marker.read_text().strip(), 5, "the marker's time"))

    # The watcher's look, then one on demand while the rank still sleeps.
    _wait_for(lambda: doctor.examinations(run_dir), STALL_S + 20, "the watcher's examination")
    capsys.readouterr()
    assert cli.main(["doctor", run["run_id"], "--json"]) == 0
    on_demand = json.loads(capsys.readouterr().out)
    assert time.time() < stalled_at + SLEEP_S, "the rank woke before `relay doctor` looked"
    (tmp_path / "release").touch()

    thread.join(timeout=240)
    assert "error" not in outcome, outcome.get("error")
    assert outcome["result"].metrics["epoch"] == 3  # the run finished once the rank woke

    watched, asked = (
        json.loads((p / "doctor.json").read_text()) for p in doctor.examinations(run_dir)
    )
    assert watched["reason"] and asked["reason"] is None
    assert watched["time"] - stalled_at <= STALL_S + 8, watched["time"] - stalled_at
    for report in (watched, asked, on_demand):
        assert report["odd_ones_out"] == [1]
        stalled, waiting = report["ranks"][1], report["ranks"][0]
        assert stalled["function"] == "StallingTask.stall_in_the_step"
        assert stalled["where"].startswith("StallingTask.stall_in_the_step (")
        assert stalled["waiting_in"] is None
        assert waiting["waiting_in"], waiting["frames"]  # rank 0 waits for rank 1's gradients
        # The last completed step, as the task counts it: the one before the stall, epoch 2.
        for place in (stalled, waiting):
            assert (place["steps"], place["epoch"], place["phase"]) == (STALL_AT - 1, 2, "train")
    # Every rank's stack is kept, and the summary went to the console.
    assert {p.name for p in Path(on_demand["dir"]).iterdir()} >= {
        "summary.txt",
        "doctor.json",
        "rank-0.json",
        "rank-1.json",
    }
    printed = console.getvalue()
    assert "has made no progress" in printed, printed
    odd_line = next(line for line in printed.splitlines() if "the odd one out" in line)
    assert odd_line.lstrip().startswith("rank 1 ") and "stall_in_the_step" in odd_line


def test_a_healthy_run_is_never_examined(ray_cluster, relay_home, tmp_path):
    # Two torch threads on one reserved CPU: not the default, so the record below is this run's.
    cfg = _config("doctor-healthy", tmp_path, stall_rank=-1, threads=2)
    result = relay.train(cfg, out=None, register=False)

    record = registry.get_run(relay_home, result.run_id)
    run_dir = Path(record["run_dir"])
    assert doctor.examinations(run_dir) == []
    # The run records where its ranks ran: this single-node cluster's node, for both.
    node = ray_cluster.get_runtime_context().get_node_id()
    assert [(p["rank"], p["node_id"]) for p in record["placement"]] == [(0, node), (1, node)]
    # ... and what each computed with, as the benches compare it with torchrun's ranks.
    for rank in record["placement"]:
        cpu = rank["cpu"]
        assert cpu["threads"] == 2 and cpu["interop_threads"] >= 1, cpu
        assert cpu["omp_num_threads"] == "1", cpu  # Ray's, from the reserved CPU
        assert cpu["affinity"] and set(cpu["affinity"]) <= os.sched_getaffinity(0), cpu
        assert cpu["nice"] == int(cluster.WORKER_NICENESS), cpu
    ranks = doctor.heartbeat.read_all(run_dir)
    assert [r["rank"] for r in ranks] == [0, 1]
    assert all(r["phase"] == "done" and r["epoch"] == 3 for r in ranks)
    assert ranks[0]["steps"] == ranks[1]["steps"] > 0


def test_doctor_refuses_a_run_that_is_not_running(relay_home, capsys):
    record_dir = registry.runs_root(relay_home) / "doctor-ended-1"
    record_dir.mkdir(parents=True)
    registry.write(
        record_dir, {"run_id": "doctor-ended-1", "status": "finished", "run_dir": str(record_dir)}
    )
    assert cli.main(["doctor", "doctor-ended-1"]) == 2
    assert "is not running (finished)" in capsys.readouterr().err
