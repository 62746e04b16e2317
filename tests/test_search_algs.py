"""Search algorithms (`search_alg`): random, grid and TPE choose trial configs; a killed TPE
sweep resumes with its searcher's state, without rerunning finished trials (the one
killed-sweep test: `relay tune --resume` and `relay sweeps show` of a killed sweep).

The searchers are driven here the way Tune drives them, through relay's own `_searcher(cfg)`
and `param_space(cfg)`, so reproducibility and enumeration are checked without training."""

from __future__ import annotations

import io
import itertools
import json
import math
import statistics
import time
from pathlib import Path

import pytest
import yaml
from support import subprocess_env, sweep_driver
from test_sweep import _finished_trials, relay_json, sweep_config

from relay.config import SweepConfig, trial_config
from relay.records import registry
from relay.tuning import sweep

pytestmark = pytest.mark.timeout(480)


def _score(params: dict) -> float:
    """A made-up val_accuracy, best at lr = 1e-2: what a trial would report, without training."""
    return 1.0 - abs(math.log10(params["optim.lr"]) + 2.0) / 3.0


def first_configs(cfg: SweepConfig, n: int) -> list[dict]:
    """The first `n` trial configs `search_alg` chooses (all of them, if fewer), each trial
    finishing (with `_score`) before the next is asked for — as one trial at a time runs."""
    from ray.tune.experiment import Experiment

    searcher = sweep._searcher(cfg)
    configs = []
    if isinstance(searcher, sweep.BasicVariantGenerator):
        space = sweep.param_space(cfg)
        experiment = Experiment("e", lambda _: None, config=space, num_samples=cfg.num_samples)
        searcher.add_configurations([experiment])
        while len(configs) < n and (trial := searcher.next_trial()) is not None:
            configs.append(trial.config["params"])
            searcher.on_trial_complete(trial.trial_id)  # frees its max_concurrent slot
        return configs
    assert searcher.set_search_properties(cfg.metric, cfg.mode, sweep.param_space(cfg))
    for i in range(n):
        params = searcher.suggest(f"t{i}")["params"]
        configs.append(params)
        searcher.on_trial_complete(f"t{i}", {cfg.metric: _score(params), "training_iteration": 1})
    return configs


def search_config(storage: Path, search_alg: str, seed: int | None, n: int = 12) -> SweepConfig:
    return sweep_config(
        storage,
        search_alg=search_alg,
        seed=seed,
        num_samples=n,
        search={
            "optim.lr": {"loguniform": [1e-4, 1.0]},
            "model.hidden": {"choice": [[16], [32, 16]]},
            "batch_size": {"randint": [16, 64]},
        },
    )


@pytest.mark.parametrize("search_alg", ["random", "tpe"])
def test_same_seed_chooses_the_same_configs(tmp_path, search_alg):
    runs = [first_configs(search_config(tmp_path, search_alg, seed), 12) for seed in (7, 7, 8)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]  # the seed really drives the draws
    base = search_config(tmp_path, search_alg, 7).train.model_dump(mode="json")
    for params in runs[0]:
        assert 1e-4 <= params["optim.lr"] <= 1.0
        assert isinstance(params["batch_size"], int) and 16 <= params["batch_size"] < 64
        assert params["model.hidden"] in ([16], [32, 16])
        trial = trial_config(base, params)  # every chosen config is a valid train config
        assert trial.optim.lr == params["optim.lr"] and trial.batch_size == params["batch_size"]


def test_tpe_learns_from_finished_trials(tmp_path):
    """After its random start-up trials, TPE samples where the scores it was told are good:
    its later configs score better than a seeded random search's on the same objective
    (seen for seeds 0-5; one is checked)."""
    tpe = first_configs(search_config(tmp_path, "tpe", 0, n=32), 32)  # 8 start-up trials
    rand = first_configs(search_config(tmp_path, "random", 0, n=32), 32)
    later, baseline = [_score(p) for p in tpe[16:]], [_score(p) for p in rand[16:]]
    assert statistics.median(later) > statistics.median(baseline), (later, baseline)


def test_grid_enumerates_every_combination(tmp_path):
    grid = {"optim.lr": [1e-3, 1e-2, 1e-1], "model.hidden": [[16], [32, 16]], "batch_size": [32]}
    search = {
        "optim.lr": {"grid": grid["optim.lr"]},
        "model.hidden": {"choice": grid["model.hidden"]},  # a choice is enumerated too
        "batch_size": {"grid": grid["batch_size"]},
    }
    spec = sweep_config(tmp_path, search_alg="grid", search=search).model_dump(mode="json")
    del spec["num_samples"]  # unset, a grid sweep runs each combination once
    cfg = SweepConfig.model_validate(spec)
    assert cfg.num_samples == 1
    configs = first_configs(cfg, 100)
    as_tuples = sorted((c["optim.lr"], tuple(c["model.hidden"]), c["batch_size"]) for c in configs)
    expected = sorted(
        (lr, tuple(hidden), bs) for lr, hidden, bs in itertools.product(*grid.values())
    )
    assert as_tuples == expected  # each combination exactly once


def _replay_tpe(cfg: SweepConfig, trials: list[dict]) -> list[dict]:
    """The configs a seeded TPE chooses when fed these trials' final metrics in order."""
    searcher = sweep._searcher(cfg)
    assert searcher.set_search_properties(cfg.metric, cfg.mode, sweep.param_space(cfg))
    chosen = []
    for i, trial in enumerate(trials):
        chosen.append(searcher.suggest(f"t{i}")["params"])
        final = {cfg.metric: trial["metrics"][cfg.metric], "training_iteration": 1}
        searcher.on_trial_complete(f"t{i}", final)
    return chosen


@pytest.mark.slow
def test_killed_tpe_sweep_resumes_with_its_searcher_state(ray_cluster, tmp_path):
    """Kill the sweep driver after its first trial, resume (in this process, as `relay tune
    --resume` runs it; the killed driver had a cluster of its own): no finished trial reruns,
    the sweep still has num_samples trials, and the trials TPE chose (not start-up sampling)
    after the resume are the ones a seeded TPE chooses from the earlier trials' results: the
    restored searcher kept Optuna's study and its random state."""
    samples = 6  # → 2 random start-up trials, then TPE
    # One-worker trials train in their reused actors: a trial of a few epochs would take well
    # under a second, and the next ones would finish between Tune's save and the kill (their
    # runs then left out of the saved sweep, which chooses others after the resume). Trials
    # of several seconds leave that window empty.
    epochs = 40
    storage = tmp_path / "storage"
    spec = sweep_config(
        storage,
        epochs=epochs,
        search_alg="tpe",
        seed=3,
        num_samples=samples,
        max_concurrent_trials=1,
        asha={"enabled": False},
        search={"optim.lr": {"loguniform": [1e-3, 1e-1]}},
    )
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(json.loads(spec.model_dump_json())))
    # Tune saves its experiment state at most every 10 s ("auto"); 1 s here: less to wait for.
    env = subprocess_env(TUNE_GLOBAL_CHECKPOINT_S="1")

    with sweep_driver(path, env) as driver:
        deadline = time.monotonic() + 300
        while not _finished_trials(storage) and time.monotonic() < deadline:
            assert driver.poll() is None, "the sweep ended before it could be interrupted"
            time.sleep(0.5)
        assert _finished_trials(storage), "no trial finished in time"
        # Let Tune save its experiment (and searcher) state after that trial ended.
        (sweep_dir,) = (storage / "sweeps").iterdir()
        done_at = time.time()
        while time.monotonic() < deadline:
            states = list(sweep_dir.glob("experiment_state-*.json"))
            if states and max(p.stat().st_mtime for p in states) > done_at + 1:
                break
            time.sleep(0.5)
    before = _finished_trials(storage)
    assert len(before) < samples, "the sweep finished before it was interrupted"
    assert list(sweep_dir.glob("searcher-state-*.pkl")), "Tune saved no searcher state"

    # Killed, the sweep has no result: `relay sweeps show` builds it from its trials' runs.
    shown = relay_json("sweeps", "show", sweep_dir.name, "--storage", str(storage))
    assert shown["status"] == "incomplete"
    assert shown["resume"] == f"relay tune --resume {sweep_dir.name} --storage {storage}"
    listed = {t["run_id"]: t for t in shown["trials"]}
    recorded = {r["run_id"] for r in registry.list_runs(storage) if r.get("sweep")}
    assert {r for r, t in listed.items() if t["status"] != "pending"} == recorded
    for run_id in before:
        assert (listed[run_id]["status"], listed[run_id]["epochs_run"]) == ("completed", epochs)

    out = io.StringIO()
    resumed = sweep.run(sweep.load_spec(storage, sweep_dir.name), resume=sweep_dir.name, out=out)
    assert "search tpe" in out.getvalue()  # the summary names the algorithm
    # In the order TPE chose them (trials ran one at a time; ids are random, not ordered).
    trials = sorted(
        resumed.trials, key=lambda t: registry.get_run(storage, t["run_id"])["started_at"]
    )
    assert len(trials) == samples
    assert all(t["status"] == "completed" and t["chosen_by"] == "tpe" for t in trials), [
        (t["status"], t["epochs_run"], t["chosen_by"]) for t in trials
    ]
    after = _finished_trials(storage)
    for run_id, finished_at in before.items():
        assert after[run_id] == finished_at, f"{run_id} was trained again"
    assert len(after) == samples
    assert [t["config"] for t in trials] == _replay_tpe(spec, trials)
    assert resumed.model.startswith("digits:")
    shown = relay_json("sweeps", "show", sweep_dir.name, "--storage", str(storage))
    assert shown["status"] == "finished" and shown["counts"] == {"completed": samples}
    assert sorted(t["run_id"] for t in shown["trials"]) == sorted(t["run_id"] for t in trials)
