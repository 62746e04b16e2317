"""The trackers' own logic, without a cluster: which metrics become which TensorBoard tags,
and a tracker that cannot write stops quietly instead of failing the run. Runs and sweeps that
write TensorBoard files are tested in test_cli.py and test_strategy_runs.py."""

from __future__ import annotations

import math

import pytest
from support import tensorboard_scalars

from relay.tracking import TensorBoardTracker, scalar_tags

pytestmark = pytest.mark.timeout(60)


def test_numeric_metrics_become_grouped_tags_and_the_epoch_is_the_step():
    tags = scalar_tags(
        {
            "epoch": 3,
            "train_loss": 0.5,
            "val_accuracy": 0.9,
            "samples_per_s": 1200,
            "lr": 1e-3,
            "workers": 2,
            "nan_metric": math.nan,
            "flag": True,
            "note": "text",
        }
    )
    assert tags == {
        "train/loss": 0.5,
        "val/accuracy": 0.9,
        "run/samples_per_s": 1200.0,
        "run/lr": 1e-3,
        "run/workers": 2.0,
    }


def test_epochs_are_written_and_read_back(tmp_path):
    tracker = TensorBoardTracker(tmp_path)
    for epoch, loss in ((1, 2.0), (2, 1.5)):
        tracker.after_report(None, [{"epoch": epoch, "val_loss": loss}, {"epoch": epoch}], None)
    assert tensorboard_scalars(tmp_path / "tensorboard") == {"val/loss": [(1, 2.0), (2, 1.5)]}


def test_a_tracker_that_cannot_write_warns_once_and_stops(tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.write_text("a file where the run's directory should be")
    tracker = TensorBoardTracker(run_dir)
    for epoch in (1, 2):
        tracker.after_report(None, [{"epoch": epoch, "val_loss": 1.0}], None)
    warnings = capsys.readouterr().err.splitlines()
    assert len(warnings) == 1 and "training goes on" in warnings[0]
