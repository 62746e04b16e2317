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
from relay.records import history, report

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


def _step(step: int, loss: float, **more) -> dict:
    return {"epoch": 1, "step": step, "train_loss": loss, "lr": 0.01, "samples_per_s": 900.0,
            **more}  # fmt: skip


def test_step_reports_go_to_tensorboard_and_mlflow_under_names_of_their_own(tmp_path):
    """What rank 0 appends to steps.jsonl reaches both trackers through the driver's
    `forward_steps`: under `step/`, the optimizer step as the step, each report once (a line
    not yet ended waits for the next call), the epoch reports' tags untouched. A resumed call
    (a new RunTracking) sends only what was appended after it opened."""
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    opened = _open(run_dir, uri, config={"epochs": 1})
    tracked = tracking.RunTracking(run_dir, mlflow=opened)
    tracked.callbacks = [
        TensorBoardTracker(run_dir),
        mlflow_runs.MlflowTracker(run_dir, uri, opened["run_id"]),
    ]
    tracked.callbacks[0].after_report(None, [{"epoch": 1, "train_loss": 1.9}], None)
    history.append_step(run_dir, _step(4, 2.0))
    history.append_step(run_dir, _step(8, 1.8, val_loss=1.7))
    with open(run_dir / history.STEPS, "a") as steps:
        steps.write('{"epoch": 1, "step": 12, "train_lo')  # rank 0 is writing it
    tracked.forward_steps()
    with open(run_dir / history.STEPS, "a") as steps:
        steps.write('ss": 1.6, "lr": 0.01, "time": 1.0}\n')
    tracked.forward_steps()
    tracked.forward_steps()  # nothing new: nothing sent twice
    resumed = tracking.RunTracking(run_dir, callbacks=tracked.callbacks, mlflow=opened)
    history.append_step(run_dir, _step(16, 1.5))
    resumed.forward_steps()

    scalars = tensorboard_scalars(run_dir / "tensorboard")
    assert scalars["train/loss"] == [(1, pytest.approx(1.9))]  # the epoch's, x: the epoch
    assert scalars["step/train_loss"] == [
        (4, 2.0), (8, pytest.approx(1.8)), (12, pytest.approx(1.6)), (16, 1.5)
    ]  # fmt: skip
    assert scalars["step/val_loss"] == [(8, pytest.approx(1.7))]
    assert [s for s, _ in scalars["step/lr"]] == [4, 8, 12, 16]
    assert "step/epoch" not in scalars and "step/time" not in scalars
    client = mlflow_client(uri)
    logged = client.get_metric_history(opened["run_id"], "step/train_loss")
    assert sorted((m.step, round(m.value, 6)) for m in logged) == [
        (4, 2.0), (8, 1.8), (12, 1.6), (16, 1.5)
    ]  # fmt: skip
    assert [m.step for m in client.get_metric_history(opened["run_id"], "step/val_loss")] == [8]
    stamped = {m.step: m.timestamp for m in logged}
    assert stamped[12] == 1000  # when rank 0 wrote it, not when it was sent
    assert client.get_metric_history(opened["run_id"], "train_loss") == []


def test_a_run_page_draws_its_step_reports(tmp_path):
    """A run with step clocks: its page draws the step reports against the optimizer step,
    the last report of a step trained again after a restart."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    epoch = {"epoch": 1, "step": 12, "train_loss": 1.6, "val_loss": 1.7, "lr": 0.01,
             "samples_per_s": 900.0, "epoch_s": 1.0}  # fmt: skip
    history.append(run_dir, epoch)
    history.append_step(run_dir, _step(4, 2.0))
    history.append_step(run_dir, _step(8, 9.9, val_loss=9.9))  # then a restart from step 4
    history.append_step(run_dir, _step(8, 1.8, val_loss=1.7))
    record = {"run_id": "run-1", "task": "digits", "size": "debug", "status": "finished",
              "run_dir": str(run_dir), "config": {"checkpoint": {"metric": "val_loss"}},
              }  # fmt: skip
    page = report.run_page(record)
    assert "2 step reports" in page
    for trace in ("step_train_loss", "step_val_loss", "step_lr", "step_samples_per_s"):
        assert page.count(f'id="trace-{trace}"') == 1, trace
    assert [r["train_loss"] for r in history.latest_steps(run_dir)] == [2.0, 1.8]
    without = tmp_path / "epochs-only"
    without.mkdir()
    assert "trace-step_" not in report.run_page({**record, "run_dir": str(without)})
