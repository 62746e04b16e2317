"""PBT sweeps: weak trials continue from a strong trial's checkpoint (weights, optimizer,
epoch) under perturbed hyperparameters, each stretch a real TorchTrainer run."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
import torch
import yaml
from support import subprocess_env, sweep_driver

from relay.config import ConfigError, SweepConfig, sweep_from_dict
from relay.records import history, registry
from relay.tasks import build_task
from relay.training.epochs import build_scheduler, fast_forward, to_tensors
from relay.tuning import sweep

EPOCHS, INTERVAL = 4, 2


def pbt_spec(storage: Path, **fields) -> dict:
    return {
        "name": "pbt-test",
        "train": {
            "task": "digits",
            "size": "debug",
            "epochs": EPOCHS,
            "batch_size": 32,
            "storage": str(storage),
            # The population trains at once: one-worker trials in half the shared cluster,
            # whatever earlier tests still hold.
            "scaling": {"resources_per_worker": {"CPU": 0.5}},
        },
        # A spread from hopeless to good: the bottom trial has someone to copy from.
        "search": {"optim.lr": {"loguniform": [1e-5, 3e-2]}},
        "search_alg": "pbt",
        "pbt": {"interval": INTERVAL},
        "num_samples": 4,
        "seed": 3,
        "metric": "val_loss",
        "mode": "min",
        "workers_per_trial": 1,
        **fields,
    }


def untrained_val_loss(cfg: SweepConfig) -> float:
    """The loss of a model nobody trained, measured on the sweep's own validation split."""
    task = build_task("digits", "debug", {}, None)
    torch.manual_seed(cfg.train.seed)
    model = task.build_model().eval()
    split = task.load_data(cfg.train.data.val_fraction, cfg.train.seed)
    with torch.no_grad():
        batch = to_tensors(split.val, task.input_columns(), torch.device("cpu"))
        _, stats = task.loss_and_stats(model, batch)
    return task.summarize({k: float(v) for k, v in stats.items()})["loss"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_pbt_trials_continue_from_a_better_trial_with_a_perturbed_lr(ray_cluster, tmp_path):
    storage = tmp_path / "storage"
    # Three trials: seed 3 draws lr 2e-5, 7e-5, 6e-3 — PBT's bottom and top quantiles are a
    # trial each (ceil(3 x 0.25)), so the worst copies the one good trial.
    cfg = sweep_from_dict(pbt_spec(storage, num_samples=3))
    result = sweep.run(cfg, out=None)
    runs = registry.runs_root(storage)

    assert len(result.trials) == 3
    assert all(t["status"] == "completed" and t["epochs_run"] == EPOCHS for t in result.trials)
    exploited = [t for t in result.trials if len(t["segments"]) > 1]
    assert exploited, "no trial copied another's checkpoint"
    fresh = untrained_val_loss(cfg)

    for trial in exploited:
        assert trial["chosen_by"].startswith("pbt:exploit ")
        earlier, later = trial["segments"][-2], trial["segments"][-1]
        record = registry.get_run(storage, later["run_id"])
        donor_run, from_epoch = record["pbt"]["from_run"], record["pbt"]["from_epoch"]
        assert from_epoch == INTERVAL
        assert record["pbt"]["from_trial"] != trial["trial_id"]
        assert record["worker_group"] is False  # one worker: trained in the trial's actor
        # The exploited stretch is a Train run of its own that starts at the donor's epoch + 1.
        after = history.read(runs / later["run_id"])
        assert [e["epoch"] for e in after] == list(range(from_epoch + 1, EPOCHS + 1))
        donor = {e["epoch"]: e for e in history.read(runs / donor_run)}[from_epoch]
        # One epoch on from the donor's weights: near the donor's loss, far from a fresh model's.
        gap_to_donor = abs(after[0]["val_loss"] - donor["val_loss"])
        assert gap_to_donor < 0.5 * abs(fresh - donor["val_loss"]), (after[0], donor, fresh)
        # Under a perturbed lr, which the optimizer really used (constant schedule: lr = peak).
        donor_lr = registry.get_run(storage, donor_run)["config"]["optim"]["lr"]
        new_lr = record["config"]["optim"]["lr"]
        assert new_lr == trial["config"]["optim.lr"] != donor_lr
        assert all(math.isclose(e["lr"], new_lr) for e in after)
        assert math.isclose(donor["lr"], donor_lr)
        # The stretch it left ends there, recorded as PBT's doing, pointing at its successor.
        left = registry.get_run(storage, earlier["run_id"])
        assert left["status"] == "stopped" and left["continued_in"] == later["run_id"]

    # The final best beats the starting population: the best final val loss of any trial is
    # below the best val loss any trial had at the first interval (its first Train run).
    at_first_interval = [
        {e["epoch"]: e for e in history.read(runs / t["segments"][0]["run_id"])}[INTERVAL]
        for t in result.trials
    ]
    best_start = min(e["val_loss"] for e in at_first_interval)
    best_final = min(t["metrics"]["val_loss"] for t in result.trials)
    assert best_final < best_start, (best_final, best_start)
    assert result.best["best_score"] <= best_final
    assert result.best["checkpoint"].startswith(str(runs / result.best["run_id"]))
    assert result.model and result.model.startswith("digits:")


def test_pbt_config_errors_name_the_field(tmp_path):
    cases = {
        "search.model.hidden": {"search": {"model.hidden": {"choice": [[32], [64]]}}},
        "search.optim.name": {"search": {"optim.name": {"choice": ["adam", "sgd"]}}},
        "asha.enabled": {"asha": {"grace_period": 1}},
        "pbt.interval": {"pbt": {"interval": EPOCHS}},
        "num_samples": {"num_samples": 1},
        "max_concurrent_trials": {"max_concurrent_trials": 2},
    }
    for field, change in cases.items():
        with pytest.raises(ConfigError) as info:
            sweep_from_dict({**pbt_spec(tmp_path), **change})
        assert str(info.value).startswith(f"{field}:"), (field, str(info.value))
    spec = pbt_spec(tmp_path, train={**pbt_spec(tmp_path)["train"], "checkpoint": {"every": 3}})
    with pytest.raises(ConfigError, match=r"^pbt.interval: must be a multiple"):
        sweep_from_dict({**spec, "pbt": {"interval": 2}})
    assert sweep_from_dict({**pbt_spec(tmp_path), "asha": {"enabled": False}}).search_alg == "pbt"
    # What `relay tune --resume` reads back: the saved spec validates as it was saved.
    saved = sweep_from_dict(pbt_spec(tmp_path)).model_dump_json()
    assert sweep_from_dict(json.loads(saved)).model_dump_json() == saved


def test_a_copied_optimizer_trains_with_the_new_configs_hyperparameters():
    """torch's load_state_dict brings the saving run's lr and weight decay along; relay's loop
    puts the trial's own back before the schedule sets the lr."""
    from relay.config import RunConfig
    from relay.training.worker_loop import _config_hyperparameters_win

    model = torch.nn.Linear(3, 2)
    donor = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.0)
    model(torch.ones(1, 3)).sum().backward()
    donor.step()
    cfg = RunConfig.model_validate(
        {"task": "digits", "size": "debug", "optim": {"lr": 0.012, "weight_decay": 0.05}}
    )
    mine = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, weight_decay=0.05)
    scheduler = build_scheduler(cfg.schedule, mine, steps_per_epoch=5, epochs=4)
    mine.load_state_dict(donor.state_dict())
    assert mine.param_groups[0]["weight_decay"] == 0.0  # the donor's, without the fix
    _config_hyperparameters_win(mine, cfg)
    fast_forward(scheduler, 10)
    group = mine.param_groups[0]
    assert (group["lr"], group["weight_decay"]) == (0.012, 0.05)
    assert mine.state_dict()["state"][0]["step"] == 1  # the donor's moments stay


@pytest.mark.timeout(60)
def test_a_seeded_sweeps_explore_draws_the_same_at_the_same_point(tmp_path):
    """PBT draws from the global generators; relay's seeded scheduler makes each decision under
    generators seeded by (sweep seed, trial, PBT time). Tune's own explore step, run under them:
    the same point draws the same config, another point or seed draws its own, and draws
    elsewhere in the process go on as if nothing had been drawn."""
    import random

    import numpy as np
    from ray.tune.schedulers.pbt import _explore

    from relay.runtime import ray_private
    from relay.tuning import pbt

    spec = pbt_spec(tmp_path, search={
        "optim.lr": {"loguniform": [1e-5, 3e-2]},
        "optim.weight_decay": {"uniform": [0.0, 0.1]},
        "batch_size": {"choice": [16, 32, 64]},
    })  # fmt: skip
    mutations = pbt.mutations(sweep_from_dict(spec))
    start = {"params": {"optim.lr": 1e-3, "optim.weight_decay": 0.05, "batch_size": 32}}

    def explore(*key: int) -> dict:
        with ray_private.drawing_from(*key):
            # Resampling half the time: draws through both generators (a domain's sample(None)).
            new, _ = _explore(json.loads(json.dumps(start)), mutations, 0.5, (1.2, 0.8), None)
        return new["params"]

    random.seed(11)
    np.random.seed(11)
    expected_next = random.random(), np.random.random()
    random.seed(11)
    np.random.seed(11)
    draws = {key: explore(*key) for key in [(3, t, e) for t in range(4) for e in (2, 4)]}
    assert (random.random(), np.random.random()) == expected_next
    assert all(explore(*key) == params for key, params in draws.items())
    distinct = {json.dumps(params, sort_keys=True) for params in draws.values()}
    assert len(distinct) >= 6, draws  # 8 points: each its own draw, not one repeated
    assert any(explore(4, *key[1:]) != params for key, params in draws.items())


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_killed_pbt_sweep_resumes_from_its_trials_checkpoints(ray_cluster, tmp_path):
    """Kill the sweep's driver once every trial has handed PBT its checkpoint at the first
    interval; the resume (in this process, as `relay tune --resume` runs it; the killed
    driver has a cluster of its own) finishes the population from those checkpoints: every
    epoch trained after the resume comes after the interval (nothing restarts from scratch),
    every trial ends at the last epoch, and the sweep is finished.

    Its trials are TorchTrainer runs (`in_actor: false`, the path of multi-worker trials, whose
    reports reach Tune through pbt's mailbox): in-actor trials of this size end the whole sweep
    within the second or two the kill needs."""
    storage = tmp_path / "storage"
    spec = pbt_spec(storage, num_samples=2, in_actor=False)
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(spec))
    env = subprocess_env(TUNE_GLOBAL_CHECKPOINT_S="1")  # Tune saves its state every second
    runs = registry.runs_root(storage)

    def sweep_runs() -> list[dict]:
        return [r for r in registry.list_runs(storage) if r.get("sweep")]

    def at_interval(run: dict) -> bool:
        return any(e["epoch"] >= INTERVAL for e in history.read_raw(runs / run["run_id"]))

    with sweep_driver(path, env) as driver:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            assert driver.poll() is None, "the sweep ended before it could be interrupted"
            started = sweep_runs()
            if len(started) == 2 and all(at_interval(r) for r in started):
                break
            time.sleep(0.5)
        else:
            pytest.fail("the population never reached the first interval")
        time.sleep(3)  # Tune takes the interval's checkpoints and saves its state
    assert not any(r["status"] == "finished" for r in sweep_runs()), "nothing left to resume"
    (sweep_dir,) = (storage / "sweeps").iterdir()

    resumed_at = time.time()
    result = sweep.run(sweep.load_spec(storage, sweep_dir.name), resume=sweep_dir.name, out=None)
    assert len(result.trials) == 2
    assert all(t["status"] == "completed" and t["epochs_run"] == EPOCHS for t in result.trials)
    after = [
        e
        for r in sweep_runs()
        for e in history.read_raw(runs / r["run_id"])
        if e["time"] >= resumed_at
    ]
    assert after, "nothing trained after the resume"
    assert min(e["epoch"] for e in after) > INTERVAL, sorted(e["epoch"] for e in after)
    assert max(e["epoch"] for e in after) == EPOCHS
    # PBT acted once at the interval, not again after the resume (Tune's restore resets PBT's
    # clock): no trial was started twice from the same donor's checkpoint.
    exploits = [
        (r["trial_id"], r["pbt"]["from_run"], r["pbt"]["from_epoch"])
        for r in sweep_runs()
        if r.get("pbt")
    ]
    assert len(exploits) == len(set(exploits)), exploits
    assert result.model.startswith("digits:")
