"""Runs measured in optimizer steps (`max_steps`) with a checkpoint clock in steps
(`checkpoint.every_steps`): a worker lost mid-epoch costs at most `every_steps` steps, and the
resumed run goes on from the step after its last checkpoint, with exactly the samples its
epoch had not trained, to the same result as a run never interrupted."""

from __future__ import annotations

from pathlib import Path

import pytest
from support import mlflow_client, tensorboard_scalars

import relay
from relay.checkpoints import checkpoint
from relay.config import from_dict
from relay.records import history
from relay.tasks import build_task
from relay.training.step_clocks import MINUTES_CHECK_STEPS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

EVERY = 5  # checkpoint and validation clocks
REPORT = 4  # the report clock
VAL_BATCHES = 2
BATCH = 64


def step_config(
    name: str, max_steps: int, tracking: dict | None = None, checkpoint: dict | None = None, **model
):
    return from_dict(
        {
            **({"tracking": tracking} if tracking else {}),
            "name": name,
            "task": "tests.crash_task:CrashTask",
            "size": "debug",
            "model": {"dropout": 0.1, **model},  # a random stream the resume must restore
            "max_steps": max_steps,
            "batch_size": BATCH,
            "optim": {"lr": 0.01},
            "schedule": {"name": "cosine"},
            "scaling": {"num_workers": 1, "resources_per_worker": {"CPU": 1}},
            "checkpoint": checkpoint or {"every_steps": EVERY, "keep": None},
            "validation": {"every_steps": EVERY, "max_batches": VAL_BATCHES},
            "report": {"every_steps": REPORT},
        }
    )


def steps_per_epoch() -> int:
    cfg = step_config("probe", 1)
    split = build_task(cfg.task, cfg.size, cfg.model).load_data(cfg.data.val_fraction, cfg.seed)
    return -(-len(split.train["y"]) // BATCH)  # one worker: every row, the last batch short


@pytest.fixture(scope="module")
def whole(ray_cluster, tmp_path_factory):
    """A run of a step budget into epoch 2 (12 steps of it), never interrupted, its clocks in
    steps; tracked: its step reports go to TensorBoard and MLflow from the driver as they
    appear. (the result, the MLflow URI)"""
    uri = f"sqlite:///{tmp_path_factory.mktemp('mlflow')}/mlflow.db"
    tracking = {"tensorboard": True, "mlflow": {"uri": uri}}
    cfg = step_config("steps-whole", steps_per_epoch() + 12, tracking)
    return relay.train(cfg, out=None, register=False), uri


def test_a_step_budget_ends_mid_epoch_and_a_killed_worker_resumes_exactly(
    whole, relay_home, tmp_path
):
    whole, uri = whole
    epoch_steps = steps_per_epoch()
    # Into epoch 2 and 12 steps of it; the worker dies starting step epoch_steps + 8, after
    # the step clock's checkpoint in (epoch_steps, epoch_steps + 5]: mid-epoch 2.
    budget, crash_at = epoch_steps + 12, epoch_steps + 8
    resumed_from = (crash_at - 1) // EVERY * EVERY  # the step clock's last checkpoint before
    cfg = step_config(
        "steps-killed",
        budget,
        crash_dir=str(tmp_path),
        crash_at_step=crash_at,
        crash_run_glob=str(relay_home / "runs" / "steps-killed-*"),
        crash_after=f"step_{resumed_from:08d}",
    )
    killed = relay.train(cfg, out=None, register=False)

    assert (tmp_path / "crashed").exists()
    run_dir = Path(killed.run_dir)
    assert len(history.failure_times(run_dir)) == 1
    # Each epoch reported once, the last where the budget ended, in both runs.
    for result in (whole, killed):
        lines = history.read_raw(result.run_dir)
        assert [(e["epoch"], e["step"]) for e in lines] == [(1, epoch_steps), (2, budget)]
    # The LR schedule spans the budget: the cosine is at its end.
    assert killed.history[-1]["lr"] == pytest.approx(0.0, abs=1e-9)

    # The resumed worker took up at the mid-epoch checkpoint: the epoch's pass after the
    # resume trained only the steps after it (full batches here), not the whole epoch again.
    assert epoch_steps < resumed_from < crash_at
    mid = checkpoint.read_meta(run_dir / f"step_{resumed_from:08d}")
    assert (mid["epoch"], mid["step"], mid["epoch_steps"]) == (
        1,
        resumed_from,
        resumed_from - epoch_steps,
    )
    assert killed.history[-1]["train_count"] == (budget - resumed_from) * BATCH
    assert whole.history[-1]["train_count"] == (budget - epoch_steps) * BATCH
    # Lost: the steps between that checkpoint and the crash, fewer than the clock's period.
    assert crash_at - 1 - resumed_from < EVERY

    # The resumed worker group's step reports: the run's own steps (not counted from the
    # epoch's start again), each over the same steps as the uninterrupted run's, to the same
    # losses. (The first worker group's last reports before the crash are in the file too.)
    after = [
        r for r in history.read_steps(run_dir) if r["time"] > history.failure_times(run_dir)[0]
    ]
    same = {r["step"]: r for r in history.read_steps(whole.run_dir) if r["step"] > resumed_from}
    assert [r["step"] for r in after] == sorted(same), (after, same)
    for report in after:
        for key in ("train_loss", "train_count"):
            assert report[key] == pytest.approx(same[report["step"]][key], rel=1e-5), report

    # Same samples in the same order, the same dropout draws: the same model in the end.
    for key in ("val_loss", "val_accuracy"):
        assert killed.metrics[key] == pytest.approx(whole.metrics[key], rel=1e-5), key
    assert killed.metrics["step"] == whole.metrics["step"] == budget
    final = checkpoint.read_meta(killed.last_checkpoint)
    assert (final["epoch"], final["step"]) == (2, budget)

    _check_step_reports(whole, epoch_steps, budget)
    _check_step_tracking(whole, uri)


def test_a_wall_clock_checkpoints_mid_epoch_without_changing_what_is_trained(whole):
    """`checkpoint.every_minutes` so short that it has always passed when rank 0's clock is
    looked at (every MINUTES_CHECK_STEPS steps, and at each epoch's end): a checkpoint there
    and at no other step. The random stream restarts from (seed, step) after every step
    whatever clock made the checkpoints, so the run ends with the model of the run whose
    checkpoints were every EVERY steps."""
    by_steps, _ = whole
    epoch_steps = steps_per_epoch()
    budget = epoch_steps + 12
    minutes = {"every_minutes": 1e-6, "keep": None}
    cfg = step_config("clock-minutes", budget, checkpoint=minutes)
    by_minutes = relay.train(cfg, out=None, register=False)

    made = sorted(p.name for p in Path(by_minutes.run_dir).glob("step_*"))
    checks = range(MINUTES_CHECK_STEPS, budget, MINUTES_CHECK_STEPS)
    assert made == [f"step_{s:08d}" for s in checks if s != epoch_steps], made
    assert sorted(p.name for p in Path(by_minutes.run_dir).glob("epoch_*")) == [
        "epoch_0001", "epoch_0002"
    ]  # fmt: skip
    for key in ("val_loss", "val_accuracy"):
        assert by_minutes.metrics[key] == pytest.approx(by_steps.metrics[key], rel=1e-5), key


def _check_step_reports(result, epoch_steps: int, budget: int) -> None:
    """The uninterrupted run's steps.jsonl: a report at each strike of the report or the
    validation clock between epoch ends, over the steps since the previous report."""
    reports = history.read_steps(result.run_dir)
    due = [s for s in range(1, budget) if s % REPORT == 0 or s % EVERY == 0]
    assert [r["step"] for r in reports] == [s for s in due if s != epoch_steps]
    previous = 0
    for report in reports:
        step = report["step"]
        assert report["epoch"] == (1 if step < epoch_steps else 2), report
        since = max(previous, epoch_steps if step > epoch_steps else 0)
        assert report["train_count"] == (step - since) * BATCH, report  # full batches here
        previous = step
        validated = "val_loss" in report
        assert validated == (step % EVERY == 0), report
        if validated:  # bounded: VAL_BATCHES batches, not the epoch end's whole split
            assert report["val_count"] == VAL_BATCHES * BATCH, report
    assert result.history[0]["val_count"] > VAL_BATCHES * BATCH
    lrs = [r["lr"] for r in reports]
    assert lrs == sorted(lrs, reverse=True) and lrs[0] > lrs[-1]  # the cosine over the budget
    # A mid-epoch checkpoint made where the validation clock struck carries its metrics.
    meta = checkpoint.read_meta(Path(result.run_dir) / f"step_{EVERY:08d}")
    (at_five,) = [r for r in reports if r["step"] == EVERY]
    assert meta["metrics"]["val_loss"] == pytest.approx(at_five["val_loss"])


def _check_step_tracking(result, uri: str) -> None:
    """Every step report in TensorBoard and in the run's MLflow run, under `step/` with the
    optimizer step as the step; the epoch reports as before, the epoch as the step."""
    reports = history.read_steps(result.run_dir)
    steps = [r["step"] for r in reports]
    scalars = tensorboard_scalars(Path(result.run_dir) / "tensorboard")
    assert [s for s, _ in scalars["step/train_loss"]] == steps
    assert [v for _, v in scalars["step/train_loss"]] == pytest.approx(
        [r["train_loss"] for r in reports]
    )
    assert [s for s, _ in scalars["step/val_loss"]] == [s for s in steps if s % EVERY == 0]
    assert [s for s, _ in scalars["train/loss"]] == [1, 2]
    client = mlflow_client(uri)
    (run,) = client.search_runs(
        [client.get_experiment_by_name("relay").experiment_id],
        filter_string=f"tags.`relay.run_id` = '{Path(result.run_dir).name}'",
    )
    logged = client.get_metric_history(run.info.run_id, "step/train_loss")
    assert sorted(m.step for m in logged) == steps
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "val_loss")) == [1, 2]
