"""Sweeps: Ray Tune + ASHA over the same train loop, each trial trained in its Tune trial actor
(one worker) or by a TorchTrainer of its own."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest
import yaml
from support import REPO, subprocess_env, sweep_driver, wait_until_cluster_idle

from relay.checkpoints import checkpoint
from relay.cli import main as relay_main
from relay.config import ConfigError, SweepConfig, load_sweep, sweep_from_dict
from relay.observe import doctor
from relay.records import history, registry, report
from relay.tuning import promotion, sweep

pytestmark = pytest.mark.timeout(480)


@pytest.fixture
def storage(tmp_path) -> Path:
    """A storage root per test, given through the config's `storage` field: a model another
    test registered in the shared RELAY_HOME (a better `digits:best`) must not change the
    outcome here, whatever order the tests run in."""
    return tmp_path / "storage"


def sweep_config(storage: Path, epochs: int = 4, **fields) -> SweepConfig:
    train = {
        "task": "digits",
        "size": "debug",
        "epochs": epochs,
        "batch_size": 32,
        "storage": str(storage),
    }
    return SweepConfig.model_validate(
        {
            "name": "sweep-test",
            "train": train,
            # Good learning rates first: ASHA compares later trials against recorded ones.
            "search": {"optim.lr": {"grid": [3e-3, 1e-2, 1e-5, 1e-6]}},
            "num_samples": 1,
            "workers_per_trial": 1,
            "max_concurrent_trials": 2,
            "asha": {"grace_period": 1, "reduction_factor": 2},
            **fields,
        }
    )


def relay_out(*argv: str) -> str:
    """What `relay ARGV` prints, run in this process (`relay sweeps` reads files only)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert relay_main(list(argv)) == 0
    return out.getvalue()


def relay_json(*argv: str):
    # Ray's log monitor may print to this process's stdout meanwhile: take the JSON line.
    lines = relay_out(*argv, "--json").splitlines()
    return json.loads([line for line in lines if line.startswith(("{", "["))][-1])


def placement_groups_left(wait_s: float = 30.0) -> list[dict]:
    """The cluster's placement groups not yet removed, once those being removed are gone:
    Ray removes a finished trial's group asynchronously (a group still pending when its
    trial ended was once seen a moment after a sweep returned), so give it `wait_s`."""
    import ray

    deadline = time.monotonic() + wait_s
    while True:
        left = [g for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED"]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


def test_asha_stops_weak_trials_and_registers_the_best(ray_cluster, storage):
    # overlap: one trial more than fits waits for workers while the others train (2 CPUs per
    # 1-worker trial: 2 fit on the test cluster's 4, the third waits).
    # Four trials: the first three start at once (two fit, one waits for workers) and race for
    # workers, so any of them may reach a rung first — and Ray's rule lets the first arrival go
    # on, whatever its score (a hopeless 1e-5 first ran all epochs, 1 run in 3). The fourth,
    # hopeless too, starts only when one of them ends, so it meets all three recorded at
    # epoch 1 — two of them good — and stops there.
    cfg = sweep_config(
        storage,
        overlap=1,
        max_concurrent_trials=None,
        search={"optim.lr": {"grid": [3e-3, 1e-2, 1e-5, 1e-6]}},
    )
    cfg.train.scaling.resources_per_worker = {"CPU": 2.0}
    cfg.train.scaling.threads_per_worker = 1  # as with the 1 CPU a worker has elsewhere
    wait_until_cluster_idle()  # "two fit" counts the whole cluster's CPUs
    assert sweep.max_concurrent_trials(cfg) == sweep.trials_that_fit(cfg) + 1
    result = sweep.run(cfg, out=None)
    assert Path(result.sweep_dir).parent == storage / "sweeps"
    # Stopped, finished or waiting, no trial leaves its workers' resources reserved.

    assert placement_groups_left() == []

    assert len(result.trials) == 4
    epochs = {t["config"]["optim.lr"]: t["epochs_run"] for t in result.trials}
    assert epochs[1e-6] == 1, epochs  # ASHA really stopped one, at its first rung
    assert max(epochs.values()) == cfg.asha.max_t
    stopped = [t for t in result.trials if t["status"] == "stopped"]
    assert stopped and all(t["epochs_run"] < cfg.asha.max_t for t in stopped)
    for trial in stopped:  # the registry says so too
        assert registry.get_run(storage, trial["run_id"])["status"] == "stopped"
    for trial in result.trials:  # one worker each: trained in its trial's actor
        assert registry.get_run(storage, trial["run_id"])["worker_group"] is False
    # Tune stops a trial at max_t too, by killing its actor: its fit() may not have written
    # its record's end (as seen on the namespace hosts); the sweep settles it from Ray Train's
    # own record. Here: as fit() would have written it, checked against what fit() did write.
    completed = [t for t in result.trials if t["status"] == "completed"]
    assert completed
    for trial in completed:
        record = registry.get_run(storage, trial["run_id"])
        assert record["status"] == "finished" and Path(record["checkpoint"]).is_dir(), record
        assert record["placement"], record
    by_fit = registry.get_run(storage, completed[0]["run_id"])
    run_dir = Path(by_fit["run_dir"])
    left_by_kill = {
        k: v
        for k, v in by_fit.items()
        if k not in ("checkpoint", "best_metrics", "placement", "metrics", "finished_at")
    }
    registry.write(run_dir, {**left_by_kill, "status": "failed", "error": "ActorDiedError(...)"})
    sweep._settle_records(cfg, storage, completed[:1])
    settled = registry.get_run(storage, completed[0]["run_id"])
    assert settled["status"] == "finished" and "error" not in settled
    for field in ("checkpoint", "best_metrics", "placement"):
        assert settled[field] == by_fit[field], field
    assert settled["metrics"][cfg.metric] == by_fit["metrics"][cfg.metric]

    best = result.best
    assert best["config"]["optim.lr"] in (3e-3, 1e-2)
    task, _ = checkpoint.load_model(best["checkpoint"])  # the best checkpoint loads
    assert task.metric == "val_accuracy"
    resolved = registry.resolve_model(storage, "digits:best")
    assert result.model == resolved.reference
    assert str(resolved.checkpoint) == best["checkpoint"]
    assert json.loads((Path(result.sweep_dir) / "result.json").read_text())["model"] == result.model

    # `relay sweeps` lists it; `relay sweeps show` gives every trial.
    (listed,) = relay_json("sweeps", "--storage", str(storage))
    assert (listed["sweep"], listed["status"], listed["model"]) == (
        result.sweep, "finished", result.model
    )  # fmt: skip
    shown = relay_json("sweeps", "show", result.sweep, "--storage", str(storage))
    # Ray's own ASHA places its rungs where the record says they are.
    from ray.tune.schedulers import ASHAScheduler

    asha = ASHAScheduler(
        time_attr="epoch", max_t=cfg.asha.max_t, grace_period=cfg.asha.grace_period,
        reduction_factor=cfg.asha.reduction_factor,
    )  # fmt: skip
    assert shown["asha_rungs"] == sorted(m for m, _ in asha._brackets[0]._rungs)
    trials = {t["trial_id"]: t for t in shown["trials"]}
    assert set(trials) == {t["trial_id"] for t in result.trials}
    for expected in result.trials:
        seen = trials[expected["trial_id"]]
        assert seen["config"] == expected["config"] and seen["status"] == expected["status"]
        epochs = history.read(storage / "runs" / expected["run_id"])  # what the run trained
        assert seen["epochs_trained"] == epochs[-1]["epoch"] >= seen["epochs_run"]
        if seen["status"] == "stopped":  # ASHA stops a trial only where it compares: at a rung
            assert seen["rungs_reached"][-1] == seen["epochs_run"]
        else:  # a completed trial's final metrics: its last epoch's, as the run recorded it
            assert seen["metrics"][cfg.metric] == epochs[-1][cfg.metric]
    table = relay_out("sweeps", "show", result.sweep[:12], "--storage", str(storage))
    for expected in result.trials:
        (row,) = [line for line in table.splitlines() if line.startswith(expected["trial_id"])]
        assert {"completed": "completed", "stopped": "stopped early"}[expected["status"]] in row
        lr = {3e-3: "0.003", 1e-2: "0.01", 1e-5: "1e-05", 1e-6: "1e-06"}
        assert f"optim.lr={lr[expected['config']['optim.lr']]}" in row
    assert f"model: {result.model}" in table

    # The sweep's report page marks where ASHA stopped a trial: every stopped one, no other.
    page = report.write(storage, result.sweep).read_text()
    assert set(re.findall(r'id="stopped-([^"]+)"', page)) == {t["trial_id"] for t in stopped}


@pytest.mark.slow
def test_promotion_asha_pauses_at_rungs_and_resumes_the_promoted(ray_cluster, storage, tmp_path):
    """asha.strategy promote, one trial at a time, rungs at epochs 1 and 2 of 4 (rf 2). The
    first trial (a good lr) has nothing to rank against at rung 1, so it pauses, where Ray's
    stopping rule would run it on. The driver is killed there (a crash) and the sweep resumed:
    the paused trial waits again, the hopeless second ranks below it, so the first is promoted
    and resumed from its rung-1 checkpoint; the last (the best lr) passes both rungs at once
    and alone trains to max_t; the sweep ends by stopping every trial still paused. The killed
    driver has a cluster of its own (a driver killed in the shared one could leave groups
    there that later tests would miss); the resumed one is this process, as `relay tune
    --resume` runs it, so that what it leaves behind can be seen.

    Its trials are TorchTrainer runs (`in_actor: false`, the path of multi-worker trials): the
    kill needs the time a trial's start takes, between the first pause and the second trial's
    arrival at rung 1. In-actor trials: test_promotion_in_trial_actors_..."""

    cfg = promotion_config(storage, in_actor=False)
    assert not sweep.trains_in_actor(cfg)
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(json.loads(cfg.model_dump_json())))
    # Tune saves its experiment state at most every 10 s ("auto"); 1 s here: less to wait for.
    env = subprocess_env(TUNE_GLOBAL_CHECKPOINT_S="1")

    def rungs(sweep_dir: Path) -> dict[int, dict]:
        state = sweep_dir / promotion.STATE
        return {r["epoch"]: r for r in json.loads(state.read_text())["rungs"]}

    with sweep_driver(path, env) as driver:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            assert driver.poll() is None, "the sweep ended before it could be interrupted"
            dirs = list((storage / "sweeps").glob("*"))
            if dirs and (dirs[0] / promotion.STATE).exists() and rungs(dirs[0])[1]["recorded"]:
                break
            time.sleep(0.2)
        else:
            pytest.fail("no trial reached rung 1")
        (sweep_dir,) = dirs
        paused_at = (sweep_dir / promotion.STATE).stat().st_mtime
        while time.monotonic() < deadline:  # Tune saves its state after the pause
            states = list(sweep_dir.glob("experiment_state-*.json"))
            if states and max(p.stat().st_mtime for p in states) > paused_at + 1:
                break
            time.sleep(0.2)
    killed_at = rungs(sweep_dir)
    assert len(killed_at[1]["recorded"]) == 1 and not killed_at[1]["promoted"], killed_at
    (first,) = killed_at[1]["recorded"]

    result = sweep.run(sweep.load_spec(storage, sweep_dir.name), resume=sweep_dir.name, out=None)
    assert placement_groups_left() == []
    trials = {t["config"]["optim.lr"]: t for t in result.trials}
    assert trials[3e-3]["trial_id"] == first  # the grid's order: the good lr came first
    assert_promotion_decisions(storage, result)


@pytest.mark.slow
def test_promotion_in_trial_actors_pauses_and_resumes_the_promoted(ray_cluster, storage):
    """The same promotion sweep, its one-worker trials trained in their Tune trial actors, not
    interrupted: the same decisions at every rung, the promoted trial's run resumed in place
    from its rung-1 checkpoint."""
    cfg = promotion_config(storage)
    assert sweep.trains_in_actor(cfg)
    result = sweep.run(cfg, out=None)
    assert placement_groups_left() == []
    assert_promotion_decisions(storage, result)
    # A run in its trial's actor waits at the rung inside its report: nothing ran ahead.
    (promoted,) = [t for t in result.trials if t["config"]["optim.lr"] == 3e-3]
    run_dir = registry.get_run(storage, promoted["run_id"])["run_dir"]
    assert [e["epoch"] for e in history.read_raw(run_dir) if "train_loss" in e] == [1, 2]


def promotion_config(storage: Path, **fields) -> SweepConfig:
    """asha.strategy promote, one trial at a time, rungs at epochs 1 and 2 of 4 (rf 2)."""
    cfg = sweep_config(
        storage,
        search={"optim.lr": {"grid": [3e-3, 1e-6, 1e-5, 1e-2]}},
        max_concurrent_trials=1,
        asha={"grace_period": 1, "reduction_factor": 2, "strategy": "promote"},
        **fields,
    )
    assert sweep.promotion_rungs(cfg) == [1, 2]
    return cfg


def assert_promotion_decisions(storage: Path, result: sweep.SweepResult) -> None:
    """What `promotion_config`'s sweep decides (the docstring of test_promotion_asha_...)."""
    sweep_dir = Path(result.sweep_dir)
    trials = {t["config"]["optim.lr"]: t for t in result.trials}
    # Tune's view: the epochs each trial was let train before its last decision
    assert {lr: t["epochs_run"] for lr, t in trials.items()} == {
        3e-3: 2,  # paused at rung 1, promoted, paused at rung 2 behind 1e-2, stopped at the end
        1e-6: 1,
        1e-5: 1,
        1e-2: 4,
    }
    assert [t["status"] for t in trials.values()].count("completed") == 1
    assert result.best["config"]["optim.lr"] == 1e-2
    assert all(t["chosen_by"] == "random" for t in result.trials)  # the search chose
    # Every rung's decisions, across the kill: all four ranked at rung 1, where 3e-3 was kept
    # on the second's arrival and 1e-2 on its own; 1e-2 alone passed rung 2.
    ids = {lr: t["trial_id"] for lr, t in trials.items()}
    final = {r["epoch"]: r for r in json.loads((sweep_dir / promotion.STATE).read_text())["rungs"]}
    assert set(final[1]["recorded"]) == set(ids.values())
    assert set(final[1]["promoted"]) == {ids[3e-3], ids[1e-2]}
    assert set(final[2]["recorded"]) == {ids[3e-3], ids[1e-2]}
    assert final[2]["promoted"] == [ids[1e-2]]

    # The promoted trial's Train run was stopped and resumed: one run, resumed once (after the
    # kill, not at it: it waited at the rung), its second stretch starting right after the
    # rung-1 checkpoint (history.jsonl keeps every attempt; the first stretch may have run
    # ahead of the pause before it was stopped).
    record = registry.get_run(storage, trials[3e-3]["run_id"])
    assert record["resumes"] == 1, record
    attempts = [e["epoch"] for e in history.read_raw(record["run_dir"]) if "train_loss" in e]
    # (a stretch that did not run ahead continues at the next index)
    restart = next((i for i in range(1, len(attempts)) if attempts[i] <= attempts[i - 1]), 1)
    assert attempts[0] == 1 and attempts[restart] == 2, attempts
    # Trials started after the resume, one at a time: 1e-5 paused for good, never resumed;
    # 1e-2 started only once 1e-5 had paused (else it would have met rung 2 first and waited
    # there), so it ran straight through.
    for lr in (1e-5, 1e-2):
        assert registry.get_run(storage, trials[lr]["run_id"]).get("resumes") == 0, lr


@pytest.mark.slow
def test_a_killed_trial_actor_resumes_its_run_from_the_last_checkpoint(ray_cluster, storage):
    """A one-worker trial trains in its Tune trial actor. SIGKILL that actor mid-run: Tune
    starts the trial again (from train.failure.max_failures), its run resumes from the last
    checkpoint it recorded, and the kill cost at most the epochs since that checkpoint."""
    cfg = sweep_config(
        storage, epochs=30, search={"optim.lr": {"grid": [3e-3]}}, asha={"enabled": False}
    )
    cfg.train.checkpoint.every = 2
    assert sweep.trains_in_actor(cfg)
    results: list = []
    thread = threading.Thread(target=lambda: results.append(sweep.run(cfg, out=None)))
    thread.start()
    runs = storage / "runs"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        run_dirs = list(runs.glob("*")) if runs.is_dir() else []
        latest = run_dirs and checkpoint.latest_registered(run_dirs[0])
        if latest and latest[1] >= 3:
            break
        time.sleep(0.05)
    else:
        pytest.fail("the trial never checkpointed its third epoch")
    (run_dir,) = run_dirs
    (beat,) = doctor.heartbeat.read_all(run_dir)
    killed_at = time.time()
    os.kill(beat["pid"], signal.SIGKILL)  # the trial's actor: it trains in that process
    thread.join(timeout=300)
    assert not thread.is_alive(), "the sweep did not end"

    ((trial,),) = [r.trials for r in results]
    assert (trial["status"], trial["epochs_run"]) == ("completed", 30), trial
    record = registry.get_run(storage, trial["run_id"])
    assert record["status"] == "finished" and record["resumes"] == 1, record
    assert record["worker_group"] is False  # it trained in the trial's actor
    trained = [e for e in history.read_raw(run_dir) if "train_loss" in e]
    before = [e["epoch"] for e in trained if e["time"] < killed_at]
    after = [e["epoch"] for e in trained if e["time"] >= killed_at]
    resumed_from = after[0] - 1  # the epoch of the checkpoint it continued from
    assert resumed_from % cfg.train.checkpoint.every == 0 and resumed_from >= 2, (before, after)
    assert before[-1] - resumed_from <= cfg.train.checkpoint.every, (before, after)
    assert after == list(range(resumed_from + 1, 31)), after


def test_placement_groups_of_dead_actors_are_released(ray_cluster):
    """What a sweep does for trials Tune killed mid-run: their worker groups' CPUs come back.
    Only this test's groups are asked about (the cluster is shared), and they are removed
    whatever the outcome: a group left here would hold CPUs that later tests need."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    from relay.runtime import ray_private

    @ray.remote(num_cpus=0)
    class Creator:
        def reserve(self) -> str:
            group = placement_group([{"CPU": 1}])
            ray.get(group.ready())
            return group.id.hex()

    mine = placement_group([{"CPU": 1}])  # the driver's own group must survive
    creator = Creator.remote()
    try:
        ray.get(mine.ready())
        made = ray.get(creator.reserve.remote())
        released = ray_private.release_orphaned_placement_groups()
        assert made not in released and mine.id.hex() not in released  # its creator lives
        ray.kill(creator)
        deadline = time.monotonic() + 30
        while made not in released and time.monotonic() < deadline:
            released = ray_private.release_orphaned_placement_groups()
            time.sleep(0.2)
        assert made in released and mine.id.hex() not in released
        assert ray.util.placement_group_table()[made]["state"] == "REMOVED"
        assert ray.util.placement_group_table()[mine.id.hex()]["state"] == "CREATED"
    finally:
        ray.kill(creator)
        remove_placement_group(mine)


def test_train_controllers_a_sweep_leaves_alive_are_ended_and_their_groups_released(ray_cluster):
    """A Train controller that outlives its sweep (one whose trial actor died while Ray was
    creating it) is killed once the sweep has returned, and its worker group released; one alive
    before the sweep began is another run's and is left alone. Stand-ins with Train's actor class
    name, so that the test can make one outlive its block at will."""
    import ray

    from relay.runtime import ray_private

    class TrainController:
        def reserve(self) -> str:
            from ray.util.placement_group import placement_group

            self.group = placement_group([{"CPU": 1}])
            ray.get(self.group.ready())
            return self.group.id.hex()

        def release(self) -> None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.group)

    # Ray names an actor class by its qualified name: this one's must be Train's.
    TrainController.__qualname__ = "TrainController"
    controller = ray.remote(num_cpus=0)(TrainController)
    before = controller.remote()
    kept = ray.get(before.reserve.remote())
    try:
        with ray_private.reclaiming_orphans(interval_s=0.5, settle_s=30, grace_s=1):
            stray = controller.remote()
            made = ray.get(stray.reserve.remote())
        groups = ray.util.placement_group_table()
        assert groups[made]["state"] == "REMOVED" and groups[kept]["state"] == "CREATED"
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(stray.reserve.remote(), timeout=30)
        ray.get(before.release.remote(), timeout=30)  # alive still
    finally:
        ray.kill(before)


def test_a_train_controller_that_appears_just_after_the_sweep_settles_is_ended_too(ray_cluster):
    """A stopped trial's controller can reach the GCS a moment after the sweep looked settled:
    the sweep waits until it has looked settled for `quiet_s`, so one that appears within that
    time is killed and its group released as any stray controller's. Stand-in as above."""
    import threading

    import ray

    from relay.runtime import ray_private

    class TrainController:
        def reserve(self) -> str:
            from ray.util.placement_group import placement_group

            group = placement_group([{"CPU": 1}])
            ray.get(group.ready())
            return group.id.hex()

    TrainController.__qualname__ = "TrainController"
    controller = ray.remote(num_cpus=0)(TrainController)
    late: dict = {}

    def arrive_late():
        time.sleep(0.5)  # the block's body has returned and everything looked settled
        late["actor"] = controller.remote()
        try:
            late["group"] = ray.get(late["actor"].reserve.remote())
        except ray.exceptions.RayActorError:
            late["group"] = None  # killed before its group was ready: as good

    def live_groups() -> set[str]:
        table = ray.util.placement_group_table()
        return {id_ for id_, group in table.items() if group["state"] != "REMOVED"}

    before = live_groups()
    arriving = threading.Thread(target=arrive_late, daemon=True)
    with ray_private.reclaiming_orphans(interval_s=0.5, settle_s=30, grace_s=1, quiet_s=3):
        arriving.start()
    arriving.join(timeout=30)
    assert "actor" in late and "group" in late, late
    # Dead, and it holds no group (made and released, or never made).
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(late["actor"].reserve.remote(), timeout=30)
    deadline = time.monotonic() + 10
    while live_groups() - before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert live_groups() - before == set()


def test_sweep_config_errors_name_the_field():
    base = yaml.safe_load((REPO / "jobs/configs/digits-sweep.yaml").read_text())
    base["train"] = yaml.safe_load((REPO / "jobs/configs/digits.yaml").read_text())
    cases = {
        "search.optim.lrr": {"search": {"optim.lrr": {"choice": [1]}}},
        "search.optim.lr": {"search": {"optim.lr": {"uniform": [1, 0.1]}}},
        "search.batch_size": {"search": {"batch_size": {"randint": [0, 4]}}},
        "search.x": {"search": {"x": {"choice": [1], "grid": [2]}}},
        "asha.grace_period": {"asha": {"grace_period": 50}},
        "asha.strategy": {"asha": {"strategy": "pause"}},
        "train.optim.lr": {"train": {**base["train"], "optim": {"lr": -1}}},
        "num_samples": {"num_samples": 0},
    }
    for field, change in cases.items():
        with pytest.raises(ConfigError) as info:
            sweep_from_dict({**base, **change})
        assert str(info.value).startswith(f"{field}:"), (field, str(info.value))
    with pytest.raises(ConfigError, match="num_samples"):
        load_sweep(REPO / "jobs/configs/digits-sweep.yaml", ["num_samples=-1"])


def test_example_sweep_loads_its_train_config():
    cfg = load_sweep(REPO / "jobs/configs/digits-sweep.yaml")
    train = yaml.safe_load((REPO / "jobs/configs/digits.yaml").read_text())
    assert cfg.train.task == "digits" and cfg.train.epochs == train["epochs"]
    assert (cfg.metric, cfg.mode) == ("val_accuracy", "max")


def _finished_trials(storage: Path) -> dict[str, str]:
    return {
        r["run_id"]: r["finished_at"]
        for r in registry.list_runs(storage)
        if r.get("sweep") and r.get("status") == "finished"
    }
