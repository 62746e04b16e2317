"""Real training on the shared local Ray cluster: 2 DDP workers per run through TorchTrainer."""

from __future__ import annotations

import math
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import ray

import relay
from relay.checkpoints import checkpoint
from relay.config import from_dict
from relay.records import history, registry
from relay.runtime import cluster, ray_private
from relay.tasks import BUILTIN, build_task
from relay.training.driver import WorkersNotPlaced

pytestmark = pytest.mark.timeout(300)


def debug_config(task: str, **fields):
    return from_dict(
        {
            "name": f"test-{task.replace(':', '-').replace('.', '-')}",
            "task": task,
            "size": "debug",
            "epochs": 4,
            "batch_size": 32,
            "optim": {"lr": 0.01},
            "scaling": {"num_workers": 2, "resources_per_worker": {"CPU": 1}},
            **fields,
        }
    )


# The Hugging Face tasks train (ddp, then fsdp) in test_hf_runs.py.
@pytest.mark.parametrize("name", sorted(n for n in BUILTIN if not n.startswith("hf-")))
def test_builtin_task_trains_with_two_ddp_workers(ray_cluster, relay_home, name):
    cfg = debug_config(name)
    result = relay.train(cfg, out=None)

    losses = [epoch["train_loss"] for epoch in result.history]
    assert [e["epoch"] for e in result.history] == [1, 2, 3, 4]
    assert losses[-1] < losses[0], losses
    assert result.metrics["epoch"] == 4
    assert cfg.checkpoint.metric in result.metrics
    assert all(math.isfinite(e["samples_per_s"]) and e["samples_per_s"] > 0 for e in result.history)
    # DDP really synchronised: after all the steps, every rank holds identical parameters.
    assert result.replicas_in_sync is True

    # Absolute checkpoint under the storage root, loadable into a fresh model.
    best = Path(result.checkpoint)
    assert best.is_absolute() and best.is_relative_to(relay_home)
    meta = checkpoint.read_meta(best)
    assert meta["metrics"] == result.best_metrics
    task = build_task(name, "debug")
    model = checkpoint.load_weights(best, task.build_model()).eval()
    split = task.load_data(cfg.data.val_fraction, cfg.seed)
    loss, _ = task.loss_and_stats(model, task.first_rows(split.val, 64))
    assert math.isfinite(loss.item())

    record = registry.get_run(relay_home, result.run_id)
    assert record["status"] == "finished"
    assert record["checkpoint"] == result.checkpoint
    assert record["metrics"]["epoch"] == 4


def test_checkpoint_retention_keeps_the_best(ray_cluster, relay_home):
    cfg = debug_config("digits", epochs=4, checkpoint={"every": 1, "keep": 2})
    before = ray_private.alive_actor_ids("TrainController")
    cleaners = set(ray_private.actors_of_class("PlacementGroupCleaner"))  # bare TorchTrainers'
    result = relay.train(cfg, out=None)
    kept = sorted(p.name for p in Path(result.run_dir).glob("epoch_*"))
    assert len(kept) == 2, kept
    best_by_history = max(result.history, key=lambda e: e["val_accuracy"])
    assert result.best_metrics["val_accuracy"] == best_by_history["val_accuracy"]

    # relay's run switches (cluster.RUN_SWITCHES) reached the run's controller: the GCS lists
    # no PreemptionWatcher, which Ray Train starts for every worker group by default. Nor a
    # PlacementGroupCleaner, which Ray starts for every run and which cannot work on a
    # cluster without a dashboard, as this one is (ray_private.torch_trainer).
    assert ray_private.actors_of_class("TrainController")
    assert not ray_private.actors_of_class("PreemptionWatcher")
    assert not cluster.state_api_served()
    assert set(ray_private.actors_of_class("PlacementGroupCleaner")) == cleaners

    # The run's controller ended with it: Ray's Ctrl-C handler, which holds its handle, is gone.
    deadline = time.monotonic() + 30
    while ray_private.alive_actor_ids("TrainController") - before and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not ray_private.alive_actor_ids("TrainController") - before


def test_a_run_whose_controller_dies_leaves_no_placement_group_behind(ray_cluster, relay_home):
    """The run's controller is SIGKILLed mid-run (as the kernel's OOM killer would): fit()
    fails, and relay's driver releases the worker group's placement group, which Ray keeps
    while its creator's job lives — here the test's own. (Ray Train's PlacementGroupCleaner,
    meant for this, could not see the death on a cluster without a dashboard: with it and
    without relay's release, the group stayed.)"""
    cfg = debug_config("digits", name="controller-dies", epochs=500, scaling={"num_workers": 1})
    before = ray_private.alive_actor_ids("TrainController")
    groups_before = set(ray.util.placement_group_table())
    killed: list[int] = []

    def kill_the_controller_once_it_trains() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not killed:
            runs = [
                r
                for r in registry.list_runs(relay_home)
                if r["run_id"].startswith("controller-dies-")
            ]
            if runs and history.read_raw(runs[0]["run_dir"]):  # an epoch trained
                controllers = ray_private.actors_of_class("TrainController")
                (pid,) = [controllers[a]["pid"] for a in ray_private.alive_actor_ids(
                    "TrainController") - before]  # fmt: skip
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            time.sleep(0.2)

    killer = threading.Thread(target=kill_the_controller_once_it_trains, daemon=True)
    killer.start()
    with pytest.raises(Exception):  # noqa: B017 - Ray's own: the controller actor died
        relay.train(cfg, out=None)
    killer.join(timeout=10)
    assert killed, "the run ended before its controller could be killed"
    groups = ray.util.placement_group_table()
    left = [g for id_, g in groups.items() if id_ not in groups_before and g["state"] != "REMOVED"]
    assert left == [], left
    (run,) = [
        r for r in registry.list_runs(relay_home) if r["run_id"].startswith("controller-dies-")
    ]
    assert run["status"] == "failed"


def test_a_run_whose_workers_cannot_be_placed_fails_within_its_bound_then_resumes(
    ray_cluster, relay_home
):
    """Another holder keeps 3 of the cluster's 4 CPUs: a 2-worker run cannot be placed. It
    fails after its bounded starts (2 of up to 3 s each), naming the fields that bound it and
    what the cluster had free, recorded as failed; resumed once the CPUs are free, it trains."""
    from ray.util.placement_group import placement_group, remove_placement_group

    cfg = debug_config("digits", epochs=2, failure={"worker_wait_s": 3, "start_failures": 1})
    holder = placement_group([{"CPU": 3}])
    assert holder.wait(30)
    try:
        started = time.monotonic()
        with pytest.raises(WorkersNotPlaced) as failed:
            relay.train(cfg, out=None)
        waited = time.monotonic() - started
    finally:
        remove_placement_group(holder)
    message = str(failed.value)
    print(f"\nfailed after {waited:.1f} s: {message}")
    assert "failure.worker_wait_s" in message and "failure.start_failures = 1" in message
    assert "2 starts failed" in message and "'CPU': 1.0" in message  # free then: 4 - 3
    # Both starts waited their 3 s (a bound that fired early would not prove the wait), and
    # the run ended well before an unbounded wait's next minute.
    assert 6 <= waited < 45, waited
    (run,) = [r for r in registry.list_runs(relay_home) if r["run_id"] in message]
    assert run["status"] == "failed" and "WorkersNotPlaced" in run["error"]

    resumed = relay.train(cfg, out=None, run_id=run["run_id"])
    assert [e["epoch"] for e in resumed.history] == [1, 2]
    assert registry.get_run(relay_home, run["run_id"])["status"] == "finished"
