"""Multi-node training on a simulated cluster (`ray.cluster_utils.Cluster`): a 0-CPU head that
runs the driver and Train's controller, and two 1-CPU worker nodes, one worker each — so every
gradient crosses a node boundary, and removing a node really takes a worker with it.

- fsdp across the two nodes; one node is removed mid-run and a replacement joins: the run
  resumes from its last checkpoint on 2 workers again;
- elastic ddp (`num_workers: [1, 2]`); one node is removed and none replaces it: the run
  resumes from its last checkpoint on 1 worker — a resume with a different worker count.
"""

from __future__ import annotations

import json
import os
import threading
import time

import pytest

import relay
from relay.config import from_dict
from relay.records import history
from relay.tasks import build_task

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]


@pytest.fixture(scope="module")
def two_nodes(relay_home):
    """The simulated cluster, shared by this module's tests: a test that removes a worker node
    puts a replacement (if any) in its place in the list, so the next test finds the list's
    nodes alive (the elastic test, last, ends with one)."""
    import ray
    from ray.cluster_utils import Cluster

    from relay.runtime.cluster import REPORT_POLL_INTERVAL_S

    ray.shutdown()  # the shared single-node cluster; the next module that needs it restarts it
    # Nodes inherit this process's environment; the controller reads the poll interval from it.
    os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] = REPORT_POLL_INTERVAL_S
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    workers = [cluster.add_node(num_cpus=1) for _ in range(2)]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    yield cluster, workers
    ray.shutdown()
    cluster.shutdown()


def _config(name: str, **fields):
    return from_dict(
        {
            "name": name,
            "task": "charlm",
            "size": "debug",
            # Epochs of ~1 s, so that the node goes while the run is under way.
            "model": {"corpus_bytes": 400_000},
            "epochs": 5,
            "batch_size": 32,
            "optim": {"lr": 0.003},
            "failure": {"max_failures": 3},
            "scaling": {"resources_per_worker": {"CPU": 1}},
            **fields,
        }
    )


def _train_split(cfg) -> dict:
    task = build_task(cfg.task, cfg.size, cfg.model, cfg.data.path)
    return task.load_data(cfg.data.val_fraction, cfg.seed).train


def _train_in_thread(cfg, run_id: str) -> tuple[threading.Thread, dict]:
    """`relay.train` in a thread: nodes can only be added and removed from the main thread."""
    outcome: dict = {}

    def target():
        try:
            outcome["result"] = relay.train(cfg, out=None, register=False, run_id=run_id)
        except BaseException as exc:  # reported by the test, not lost in the thread
            outcome["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, outcome


def _wait_for_checkpoint(run_dir, epoch: int, thread: threading.Thread) -> None:
    snapshot = run_dir / "checkpoint_manager_snapshot.json"  # Ray Train's checkpoint record
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and thread.is_alive():
        try:
            latest = json.loads(snapshot.read_text())["latest_checkpoint_result"]["metrics"]
            if latest["epoch"] >= epoch:
                return
        except (OSError, ValueError, KeyError, TypeError):
            pass
        time.sleep(0.05)
    raise AssertionError(f"no checkpoint of epoch {epoch} registered in time")


def _finish(thread: threading.Thread, outcome: dict):
    thread.join(timeout=300)
    assert not thread.is_alive(), "the run did not finish after the node was removed"
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


def _lost_node_run(two_nodes, relay_home, cfg, run_id, *, replace: bool):
    """The run's result and when (this process's clock) the node was removed."""
    cluster, workers = two_nodes
    thread, outcome = _train_in_thread(cfg, run_id)
    _wait_for_checkpoint(relay_home / "runs" / run_id, 2, thread)
    removed_at = time.time()
    cluster.remove_node(workers.pop())
    if replace:
        workers.append(cluster.add_node(num_cpus=1))
    return _finish(thread, outcome), removed_at


def _check_resumed(run_dir, epochs: int) -> tuple[list[dict], list[dict]]:
    """(epochs the first worker group trained, epochs after the restart), from the raw history
    (every epoch as trained, repeats included): the run resumed, it did not start over."""
    raw = history.read_raw(run_dir)
    restart = next(
        i
        for i in range(1, len(raw))
        # An epoch trained again, or a pause far longer than a report: a new worker group.
        if raw[i]["epoch"] <= raw[i - 1]["epoch"]
        or raw[i]["time"] - raw[i]["epoch_s"] - raw[i - 1]["time"] > 2.0
    )
    before, after = raw[:restart], raw[restart:]
    assert before[0]["epoch"] == 1 and after[-1]["epoch"] == epochs
    assert after[0]["epoch"] >= 3, "resumed from the last checkpoint (epoch 2 or later)"
    return before, after


def _check_restart_startup(report: dict, after: list[dict], removed_at: float) -> None:
    """The report's start-up is the worker group that finished: it began after the node was
    removed (the test's clock), and it was up, with model and data, before the group's first
    epoch began (the history's clock). The training before the failure is not in it."""
    startup = report["startup"]
    assert startup["restarts"] >= 1 and startup["restarted_after_s"] > 0, startup
    began = after[0]["time"] - after[0]["epoch_s"]  # the finishing group's first epoch
    # 0.1 s: history stamps an epoch's start a few ms late; one machine, one clock.
    assert startup["worker_group_s"] + startup["model_and_data_s"] <= began - removed_at + 0.1


def test_fsdp_across_nodes_survives_a_lost_node_with_a_replacement(two_nodes, relay_home):
    cfg = _config("multinode-fsdp", parallel={"strategy": "fsdp"}, scaling={"num_workers": 2})
    result, removed_at = _lost_node_run(
        two_nodes, relay_home, cfg, "multinode-fsdp-1", replace=True
    )

    before, after = _check_resumed(result.run_dir, cfg.epochs)
    assert {h["workers"] for h in before} == {h["workers"] for h in after} == {2}
    assert after[-1]["val_loss"] < before[0]["val_loss"]
    report = result.efficiency
    assert report["workers"] == 2 and report["strategy"] == "fsdp"
    _check_restart_startup(report, after, removed_at)
    # The restarted group's counts: samples of the epochs it trained, from the data set.
    rows = len(next(iter(_train_split(cfg).values())))
    counted = after[1:] if len(after) > 1 else after
    assert report["throughput"]["samples"] == rows // 2 * 2 * len(counted)


def test_elastic_ddp_continues_on_fewer_workers_when_a_node_is_lost(two_nodes, relay_home):
    # The first restart still counts the removed node's CPU (Ray's view of the cluster lags):
    # that start waits `worker_wait_s` for a worker it cannot place (Ray's default: 60 s).
    cfg = _config(
        "multinode-elastic",
        scaling={"num_workers": [1, 2]},
        failure={"max_failures": 3, "worker_wait_s": 15},
    )
    result, removed_at = _lost_node_run(
        two_nodes, relay_home, cfg, "multinode-elastic-1", replace=False
    )

    before, after = _check_resumed(result.run_dir, cfg.epochs)
    assert {h["workers"] for h in before} == {2}
    assert {h["workers"] for h in after} == {1}
    assert after[-1]["val_loss"] < before[0]["val_loss"]
    assert result.efficiency["workers"] == 1
    _check_restart_startup(result.efficiency, after, removed_at)
