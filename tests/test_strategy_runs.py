"""Strategies end to end, through the user's paths: a sweep over `parallel.strategy` (bf16,
2 micro-batches per step), each trial a real 2-worker Train run; the fsdp-trained model served
over HTTP; every run's efficiency report checked against counts made without it (rows of the
data set, the model's parameters, the transformer FLOP count, history.jsonl and the test's own
clock); and the 1-worker reference that turns a report's throughput into speedup, and the
start-up of a fresh run. (A resumed run's start-up: test_sharded_checkpoints.py, whose resume
test pays for that run anyway.)
"""

from __future__ import annotations

import math
import re
import time
from pathlib import Path

import pytest
import requests
from support import (
    first_epoch_start,
    free_port,
    mlflow_client,
    pixels_of,
    render_page,
    tensorboard_scalars,
)

import relay
from relay.checkpoints import checkpoint
from relay.config import SweepConfig, from_dict
from relay.records import history, registry
from relay.records import report as report_page
from relay.tasks import build_task
from relay.tuning import sweep

pytestmark = [pytest.mark.slow, pytest.mark.timeout(480)]


EPOCHS = 3


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
                "tracking": {"tensorboard": True, "mlflow": True},  # MLflow in SQLite
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
        # Each trial writes TensorBoard files of its own, every epoch in them.
        scalars = tensorboard_scalars(Path(run["run_dir"]) / "tensorboard")
        assert [step for step, _ in scalars["val/loss"]] == list(range(1, EPOCHS + 1))


def test_a_sweep_is_an_mlflow_run_with_a_nested_run_per_trial(strategy_sweep, relay_home):
    """In the embedded default (SQLite under the storage root, written by the sweep's driver,
    three trial drivers and their controllers at once), read back by MLflow's own client."""
    result, runs = strategy_sweep
    client = mlflow_client(f"sqlite:///{relay_home}/mlflow/mlflow.db")
    experiment = client.get_experiment_by_name("relay")
    tracked = client.search_runs(
        [experiment.experiment_id], f"tags.`relay.sweep_id` = '{result.sweep}'"
    )
    (parent,) = [r for r in tracked if r.info.run_name == result.sweep]
    trials = {r.info.run_name: r for r in tracked if r is not parent}
    assert parent.info.status == "FINISHED" and parent.data.params["search_alg"] == "random"
    assert parent.data.params["search.parallel.strategy.grid"] == '["ddp", "zero1", "fsdp"]'
    assert sorted(trials) == sorted(run["run_id"] for run in runs.values())
    for strategy, run in runs.items():
        trial = trials[run["run_id"]]
        assert trial.data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert trial.info.status == "FINISHED"
        assert trial.data.params["parallel.strategy"] == strategy
        # Every trial's run has its best checkpoint's meta.json, registered or not.
        artifacts = {a.path for a in client.list_artifacts(trial.info.run_id, "relay")}
        assert artifacts == {"relay/efficiency.json", "relay/meta.json"}
        logged = client.get_metric_history(trial.info.run_id, "val_loss")
        assert [(m.step, m.value) for m in logged] == [
            (e["epoch"], pytest.approx(e["val_loss"], rel=1e-6))
            for e in history.read(run["run_dir"])
        ]
    # The sweep's model version is registered from the winning trial's MLflow run.
    best = client.get_model_version_by_alias("charlm-strategies", "best")
    winner = trials[result.best["run_id"]]
    assert best.run_id == winner.info.run_id and best.tags["relay.version"] == "1"
    assert parent.data.metrics["best_score"] == pytest.approx(result.best["best_score"])


def test_the_sweeps_report_page_draws_every_trial(strategy_sweep, relay_home, tmp_path):
    """`relay report <sweep>` in a real browser: every trial's curve and config line, the
    best one drawn in its own colour, and the table with the best row marked."""
    result, _ = strategy_sweep
    page = tmp_path / "sweep.html"
    report_page.write(relay_home, result.sweep, page)
    screenshot, dom, console = render_page(page, tmp_path)
    assert console == []
    trials = {t["trial_id"] for t in result.trials}
    traces = set(re.findall(r'id="trace-([^"]+)"', dom))
    assert traces == trials | {f"config-{t}" for t in trials}
    assert pixels_of(screenshot, (214, 39, 40)) > 300  # the best trial's colour
    best_row = re.search(r"<tr class=\"best\">(.*?)</tr>", dom).group(1)
    assert f"<td>{result.best['trial_id']}</td>" in best_row
    assert dom.count("<tr") == 1 + len(trials)  # the header and one row per trial


def _train_rows(run: dict) -> int:
    """Training rows of the run's config, counted from its data set (not from the run)."""
    cfg = from_dict(run["config"])
    task = build_task(cfg.task, cfg.size, cfg.model, cfg.data.path)
    return len(next(iter(task.load_data(cfg.data.val_fraction, cfg.seed).train.values())))


def _checked_throughput(report: dict, run: dict, rows: int) -> None:
    """The report's throughput against counts made without it: samples from the data set's
    rows, optimizer steps from the batch arithmetic of the data loader, seconds from the
    per-epoch rates rank 0 wrote to history.jsonl and from the history's wall-clock stamps."""
    t, s = report["throughput"], report["step"]
    workers = report["workers"]
    cfg = from_dict(run["config"])
    batch, accum = cfg.batch_size, cfg.parallel.grad_accum
    epochs = history.read(run["run_dir"])
    counted = epochs[1:]  # the first epoch is warm-up: left out when there are more
    assert t["warmup_excluded"] and t["epochs_counted"] == len(counted)
    # Every rank trains floor(rows / workers) rows an epoch (streaming_split(equal=True)).
    per_epoch = rows // workers * workers
    assert t["samples"] == per_epoch * len(counted)
    steps = math.ceil(math.ceil(rows // workers / batch) / accum)
    assert s["optimizer_steps"] == steps * len(counted)
    # The training passes' seconds, as each epoch's record has them (samples / its rate).
    pass_seconds = sum(per_epoch / e["samples_per_s"] for e in counted)
    assert t["train_s"] == pytest.approx(pass_seconds, rel=1e-6)
    # ... and on the wall clock: inside the counted epochs, and a good part of them (the rest
    # is validation and the statistics' all-reduces, a few ms even for the tiniest model).
    wall = counted[-1]["time"] - epochs[0]["time"]
    assert 0.3 * sum(e["epoch_s"] for e in counted) <= t["train_s"] <= wall


def test_efficiency_reports_match_independent_counts(strategy_sweep):
    _, runs = strategy_sweep
    reports = {strategy: run["efficiency"] for strategy, run in runs.items()}
    run = runs["ddp"]
    rows = _train_rows(run)
    cfg = from_dict(run["config"])
    task = build_task(cfg.task, cfg.size, cfg.model, cfg.data.path)
    model = task.build_model()
    hp = task.hp
    for strategy, report in reports.items():
        t, f = report["throughput"], report["flops"]
        assert report["workers"] == 2 and report["mixed_precision"] == "bf16"
        # Steps of milliseconds: the step split is timed over the full 3 steps a pass.
        assert report["step"]["probe_steps_per_pass"] == 3
        _checked_throughput(report, runs[strategy], rows)
        # Tokens: every sample predicts block_size characters.
        assert t["units_per_s"] == pytest.approx(t["samples_per_s"] * hp.block_size)
        # Model FLOPs against the transformer count (as PaLM's, appendix B): 6 per weight
        # per token for the matmul weights (12 d^2 per block, the d x V head), and the T x T
        # attention products: 4 T^2 d per block forward, twice that backward, plus the 2 T^2 d
        # of scores that the fused attention kernel's backward recomputes (torch counts it).
        T, d, L = hp.block_size, hp.d_model, hp.n_layer
        V = model.head.weight.shape[0]
        expected = 6 * T * (12 * L * d * d + d * V) + 14 * L * T * T * d
        assert f["model_flops_per_sample"] == pytest.approx(expected, rel=1e-3)
        # Over the matmul rate measured in the compute dtype, on both workers. No upper bound
        # here: on a CPU without bf16 instructions a small model's bf16 matmuls can beat every
        # square size the probe tries (see the fp32 runs below for one).
        assert f["fraction_of_measured_matmul_peak"] > 0
        assert f["matmul_peak"]["dtype"] == f["peak_dtype"] == "bfloat16"
        assert len(f["matmul_peak"]["per_worker_flops_per_s"]) == 2

    # State bytes (live storages, relay.training.footprint) against the model's own parameter count.
    # AdamW keeps two fp32 moments per value and one fp32 `step` per parameter tensor; every
    # first dimension of this model is even, so fsdp's row split pads nothing.
    params = list(model.parameters())
    numel, tensors = sum(p.numel() for p in params), len(params)
    adamw = 8 * numel + 4 * tensors

    def per_rank(strategy: str, key: str) -> list[int]:
        return [r[key] for r in reports[strategy]["memory"]["per_rank"]]

    assert per_rank("ddp", "param_bytes") == per_rank("ddp", "grad_bytes") == [4 * numel] * 2
    assert per_rank("ddp", "optimizer_bytes") == [adamw] * 2
    assert per_rank("zero1", "param_bytes") == per_rank("zero1", "grad_bytes") == [4 * numel] * 2
    assert sum(per_rank("zero1", "optimizer_bytes")) == adamw  # each tensor's state on one rank
    assert per_rank("fsdp", "param_bytes") == per_rank("fsdp", "grad_bytes") == [2 * numel] * 2
    assert per_rank("fsdp", "optimizer_bytes") == [4 * numel + 4 * tensors] * 2
    for report in reports.values():
        for rank in report["memory"]["per_rank"]:
            # The process grew by at least the state it allocated after the loop started.
            assert rank["peak_growth_bytes"] >= rank["state_bytes"], rank


def test_fsdp_trained_model_serves_like_the_offline_model(strategy_sweep, relay_home):
    from ray import serve

    from relay.serving.app import AppArgs, app

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
    called = time.time()
    double = relay.train(config(2), out=None, register=False)
    ref = double.efficiency["reference"]
    assert ref["run_id"] == single.run_id
    assert ref["samples_per_s"] == single.efficiency["throughput"]["samples_per_s"]
    rows = _train_rows(registry.get_run(relay_home, double.run_id))
    for run in (single, double):
        _checked_throughput(run.efficiency, registry.get_run(relay_home, run.run_id), rows)
        # fp32: a CPU's large square matmuls are its fastest; a tiny MLP's FLOP/s stay far
        # below them. Above 1, the FLOP count, the throughput or the probe would be wrong.
        assert 0 < run.efficiency["flops"]["fraction_of_measured_matmul_peak"] < 1

    # Start-up against the test's own clock and the history: the run's figure ends when its
    # first epoch began (fit() starts within a second of the call); the report's when its
    # first step ended, a step later. (History stamps an epoch's start a few ms late, and
    # startup_s is rounded: hence the small slack.)
    epoch_started = first_epoch_start(double.run_dir, called)
    assert epoch_started - called - 1.0 <= double.startup_s <= epoch_started - called + 0.01
    assert -0.05 <= double.efficiency["startup"]["total_s"] - double.startup_s < 2.0
    assert double.efficiency["startup"]["restarts"] == 0
    assert double.efficiency["startup"]["restarted_after_s"] is None
