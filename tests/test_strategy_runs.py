"""Strategies end to end, through the user's paths: a sweep over `parallel.strategy` (bf16,
2 micro-batches per step), each trial a real 2-worker Train run; the fsdp-trained model served
over HTTP; every run's efficiency report checked for consistency; and the 1-worker reference
that turns a report's throughput into speedup and scaling efficiency.
"""

from __future__ import annotations

import sys

import pytest
import requests
from support import REPO, free_port

import relay
from relay import checkpoint, history, registry, sweep
from relay.config import SweepConfig, from_dict

pytestmark = pytest.mark.timeout(480)

if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # serve.app, as `serve run` imports it from the repo root

EPOCHS = 4


@pytest.fixture(scope="module")
def strategy_sweep(ray_cluster, relay_home):
    cfg = SweepConfig.model_validate(
        {
            "name": "strategies",
            "train": {
                "task": "charlm",
                "size": "debug",
                "epochs": EPOCHS,
                "batch_size": 16,
                "optim": {"lr": 0.01},
                "parallel": {"mixed_precision": "bf16", "grad_accum": 2},
                "scaling": {"resources_per_worker": {"CPU": 0.5}},
            },
            "search": {"parallel.strategy": {"grid": ["ddp", "zero1", "fsdp"]}},
            "num_samples": 1,
            "workers_per_trial": 2,
            "max_concurrent_trials": 3,
            "asha": {"enabled": False},
            "model_name": "charlm-strategies",
        }
    )
    result = sweep.run(cfg, out=None)
    runs = {
        t["config"]["parallel.strategy"]: registry.get_run(relay_home, t["run_id"])
        for t in result.trials
    }
    return result, runs


def test_every_strategy_trains_through_a_sweep(strategy_sweep):
    result, runs = strategy_sweep
    assert sorted(runs) == ["ddp", "fsdp", "zero1"]
    assert all(t["status"] == "completed" for t in result.trials), result.trials
    for strategy, run in runs.items():
        assert run["status"] == "finished", strategy
        epochs = history.read(run["run_dir"])
        assert [e["epoch"] for e in epochs] == list(range(1, EPOCHS + 1))
        assert epochs[-1]["val_loss"] < epochs[0]["val_loss"] - 0.2, (strategy, epochs)
        assert run["efficiency"]["strategy"] == strategy


def test_efficiency_reports_are_consistent(strategy_sweep):
    _, runs = strategy_sweep
    reports = {strategy: run["efficiency"] for strategy, run in runs.items()}
    for report in reports.values():
        t, s, f = report["throughput"], report["step"], report["flops"]
        assert report["workers"] == 2 and report["mixed_precision"] == "bf16"
        # Throughput is samples over seconds of the epochs it counts (the first left out).
        assert t["warmup_excluded"] and t["epochs_counted"] == EPOCHS - 1
        assert t["samples_per_s"] * t["train_s"] == pytest.approx(t["samples"])
        per_epoch = t["samples"] / t["epochs_counted"]
        assert per_epoch == pytest.approx(2 * (per_epoch // 2))  # equal shards on 2 workers
        assert t["unit"] == "tokens" and t["units_per_s"] > t["samples_per_s"]
        assert s["step_s"] > 0 and s["compute_s"] > 0 and s["comm_s"] >= 0
        assert s["other_s"] >= 0 and 0 <= s["comm_fraction"] < 1
        assert 0 < f["mfu"] < 1 and f["peak_dtype"] == "bfloat16"
        assert f["achieved_flops_per_s"] == pytest.approx(
            f["model_flops_per_sample"] * t["samples_per_s"]
        )
        startup = report["startup"]
        parts = ("connect_s", "prepare_s", "worker_group_s", "model_and_data_s", "first_step_s")
        assert all(startup[p] >= 0 for p in parts)
        assert sum(startup[p] for p in parts) == pytest.approx(startup["total_s"])

    def rank_bytes(strategy: str, key: str) -> list[int]:
        return [r[key] for r in reports[strategy]["memory"]["per_rank"]]

    ddp_params = rank_bytes("ddp", "param_bytes")
    assert ddp_params[0] == ddp_params[1]  # full replicas
    for key in ("param_bytes", "grad_bytes", "optimizer_bytes"):
        pairs = zip(rank_bytes("fsdp", key), rank_bytes("ddp", key), strict=True)
        assert all(fsdp == pytest.approx(ddp / 2, rel=0.05) for fsdp, ddp in pairs), key
    assert rank_bytes("zero1", "param_bytes") == ddp_params
    assert sum(rank_bytes("zero1", "optimizer_bytes")) == pytest.approx(
        rank_bytes("ddp", "optimizer_bytes")[0], rel=0.01
    )  # each rank holds its part of one copy


def test_fsdp_trained_model_serves_like_the_offline_model(strategy_sweep, relay_home):
    from ray import serve

    from serve.app import AppArgs, app

    _, runs = strategy_sweep
    directory = runs["fsdp"]["checkpoint"]
    meta = checkpoint.read_meta(directory)
    assert meta["strategy"] == "fsdp" and meta["workers"] == 2
    task, model = checkpoint.load_model(directory)  # full weights, no process group needed
    instances = [{"prompt": "def main(", "max_new_tokens": 16, "temperature": 0}]
    offline = [p.model_dump() for p in task.predict(model, task.validate_instances(instances))]

    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(app(AppArgs(model=directory, num_cpus=0.5)), name="fsdp", route_prefix="/")
        response = requests.post(
            f"http://127.0.0.1:{port}/v1/models/charlm:predict",
            json={"instances": instances},
            timeout=60,
        )
    finally:
        serve.shutdown()
    assert response.status_code == 200, response.text
    assert response.json()["predictions"] == offline


def test_one_worker_run_is_the_reference_for_speedup(ray_cluster, relay_home):
    def config(workers: int):
        return from_dict(
            {
                "name": "reference",
                "task": "digits",
                "size": "debug",
                "epochs": 3,
                "scaling": {"num_workers": workers, "resources_per_worker": {"CPU": 1}},
            }
        )

    single = relay.train(config(1), out=None, register=False)
    assert single.efficiency["reference"] is None  # nothing to compare with yet
    double = relay.train(config(2), out=None, register=False)
    ref = double.efficiency["reference"]
    assert ref["run_id"] == single.run_id
    rate = double.efficiency["throughput"]["samples_per_s"]
    assert ref["speedup"] == pytest.approx(rate / ref["samples_per_s"])
    assert ref["scaling_efficiency"] == pytest.approx(ref["speedup"] / 2)
    assert single.efficiency["step"]["comm_s"] == 0  # one worker: nothing to communicate
