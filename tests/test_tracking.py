"""The trackers without a cluster: which metrics become which TensorBoard tags, MLflow's run
of a relay run (params, epochs, a resume, a model version) in a real SQLite-backed MLflow, the
`tracking.mlflow` config, and a tracker that cannot write stops quietly instead of failing the
run. Runs and sweeps tracked through a real MLflow server and TensorBoard files are tested in
test_cli.py and test_strategy_runs.py."""

from __future__ import annotations

import math

import pytest
from support import mlflow_client, tensorboard_scalars

from relay import config
from relay.observe import tracking
from relay.observe.tracking import TensorBoardTracker, failures, mlflow_runs, scalar_tags

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


def test_mlflow_config_switches_on_with_defaults_and_names_a_bad_uri(tmp_path):
    assert config.load(None, ["task=digits"]).tracking.mlflow is None
    cfg = config.load(None, ["task=digits", "tracking.mlflow=true", f"storage={tmp_path}"])
    assert cfg.tracking.mlflow.experiment == "relay" and cfg.tracking.mlflow.uri is None
    assert tracking.mlflow_uri(cfg) == f"sqlite:///{tmp_path}/mlflow/mlflow.db"
    cfg = config.load(None, ["task=digits", "tracking.mlflow.uri=http://127.0.0.1:5000"])
    assert cfg.tracking.mlflow.uri == "http://127.0.0.1:5000"
    for bad in ("127.0.0.1:5000", "ftp://host/x", "mlruns"):
        with pytest.raises(config.ConfigError, match=r"tracking\.mlflow\.uri"):
            config.load(None, ["task=digits", f"tracking.mlflow.uri={bad}"])


def test_a_nested_config_becomes_dotted_params():
    params = mlflow_runs.flat_params(
        {"epochs": 3, "parallel": {"strategy": "ddp", "grad_accum": 2}, "storage": None,
         "search": {}, "labels": ["a", "b"]}
    )  # fmt: skip
    assert params == {
        "epochs": "3",
        "parallel.strategy": "ddp",
        "parallel.grad_accum": "2",
        "storage": "null",
        "search": "{}",
        "labels": '["a", "b"]',
    }


def _open(run_dir, uri, *, config, resume_id=None):
    return mlflow_runs.open_run(
        run_dir, uri, "unit", name="run-1", config=config, tags={"relay.run_id": "run-1"},
        artifact_root=run_dir.parent / "artifacts", resume_id=resume_id,
    )  # fmt: skip


def test_an_mlflow_run_gets_every_epoch_continues_on_resume_and_registers(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    opened = _open(run_dir, uri, config={"epochs": 2, "scaling": {"num_workers": 2}})
    tracker = mlflow_runs.MlflowTracker(run_dir, uri, opened["run_id"])
    for epoch, loss in ((1, 2.0), (2, 1.5)):  # rank 0's report first, as Ray Train passes them
        tracker.after_report(None, [{"epoch": epoch, "val_loss": loss}, {"epoch": epoch}], None)
    mlflow_runs.close_run(run_dir, uri, opened["run_id"], "FINISHED")

    # A resume under another worker count reopens the same run and logs on into it.
    reopened = _open(
        run_dir, uri, config={"epochs": 3, "scaling": {"num_workers": 1}},
        resume_id=opened["run_id"],
    )  # fmt: skip
    assert reopened == opened
    tracker = mlflow_runs.MlflowTracker(run_dir, uri, opened["run_id"])
    tracker.after_report(None, [{"epoch": 3, "val_loss": 1.2, "note": "text"}], None)
    (tmp_path / "meta.json").write_text('{"epoch": 3}')
    version = {"model": "unit", "version": 1, "checkpoint": str(tmp_path), "metric": "val_loss",
               "score": 1.2, "task": "digits"}  # fmt: skip
    assert mlflow_runs.register_version(
        run_dir, uri, opened["run_id"], version, best=True, meta=tmp_path / "meta.json"
    ) in (1, "1")
    mlflow_runs.close_run(
        run_dir, uri, opened["run_id"], "FINISHED", artifacts={"efficiency": {"workers": 2}},
        files=[tmp_path / "meta.json"],
    )  # fmt: skip

    client = mlflow_client(uri)
    run = client.get_run(opened["run_id"])
    assert run.info.status == "FINISHED"
    history = client.get_metric_history(opened["run_id"], "val_loss")
    assert [(m.step, m.value) for m in history] == [(1, 2.0), (2, 1.5), (3, 1.2)]
    assert run.data.params == {"epochs": "2", "scaling.num_workers": "2"}
    assert run.data.tags["relay.resumed.epochs"] == "3"
    assert run.data.tags["relay.resumed.scaling.num_workers"] == "1"
    registered = client.get_model_version_by_alias("unit", "best")
    assert registered.run_id == opened["run_id"]
    assert registered.tags == {"relay.version": "1", "relay.checkpoints.checkpoint": str(tmp_path)}
    artifacts = {a.path for a in client.list_artifacts(opened["run_id"], "relay-checkpoint")}
    assert artifacts == {"relay-checkpoint/checkpoint.json", "relay-checkpoint/meta.json"}
    ended = {a.path for a in client.list_artifacts(opened["run_id"], "relay")}
    assert ended == {"relay/efficiency.json", "relay/meta.json"}
    assert not failures.failed(run_dir, mlflow_runs.TRACKER)


def test_mlflow_that_fails_is_told_once_by_the_driver_and_not_called_again(tmp_path, capsys):
    """The controller (each epoch) and the driver (the run's end) both talk to MLflow for a
    run, in two processes: after the first failure (here: a database in a directory that
    cannot exist) neither tries again, and the driver tells it once."""
    (tmp_path / "not-a-dir").write_text("a file")
    uri = f"sqlite:///{tmp_path}/not-a-dir/mlflow.db"
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    controller = mlflow_runs.MlflowTracker(run_dir, uri, "no-such-run")
    controller.after_report(None, [{"epoch": 1, "val_loss": 1.0}], None)
    controller.after_report(None, [{"epoch": 2, "val_loss": 0.9}], None)
    mlflow_runs.close_run(run_dir, uri, "no-such-run", "FINISHED")  # the driver, at the end
    assert capsys.readouterr().err == ""  # the controller's output may go nowhere
    announce = failures.Announcer(run_dir)  # the driver's, as it follows the run
    announce()
    announce()
    warnings = capsys.readouterr().err.splitlines()
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith(f"relay: MLflow at {uri} failed while logging epoch 1")
    assert "training goes on" in warnings[0]
    assert failures.failed(run_dir, mlflow_runs.TRACKER)
