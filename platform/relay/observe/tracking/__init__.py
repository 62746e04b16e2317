"""Each run's and sweep's metrics sent to the tools people watch runs in (`tracking:` in the
config): TensorBoard event files (tensorboard.py) and MLflow runs (mlflow_runs.py).

Epochs are logged from Ray Train's controller, by `UserCallback`s (`after_report` gets every
rank's report), never from the workers: a worker group that restarts after a failure opens no
second writer or run, and every trial of a sweep logs its own run. What is logged once per run
(MLflow's run with its params, its end and artifacts, model versions) comes from the run's
driver. The step clocks' reports (`report.every_steps`, `validation.every_steps`), which rank 0
appends to steps.jsonl between epoch ends without a Ray Train report, are sent on by the
driver as they appear (`forward_steps`, every few seconds while the run trains). A tracker that
fails never costs the training: it warns once and stops, and history.jsonl, steps.jsonl and
run.json keep every epoch and step report.

    tracked = tracking.open_run(cfg, run_dir, run_id, previous=..., sweep_id=...)
    ... Ray Train with tracked.callbacks; run.json gets tracked.record() ...
    ... tracked.forward_steps() every few seconds while it trains ...
    tracked.close("FINISHED", efficiency=report)
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relay.config import redacted_uri
from relay.observe.tracking import failures, mlflow_runs, tensorboard
from relay.observe.tracking.metrics import numeric_metrics
from relay.observe.tracking.tensorboard import TensorBoardTracker, scalar_tags
from relay.records import history
from relay.records.sweep_records import sweeps_root

__all__ = [
    "RunTracking",
    "TensorBoardTracker",
    "close_sweep",
    "mirror_alias",
    "numeric_metrics",
    "open_run",
    "open_sweep",
    "register_version",
    "scalar_tags",
    "stopped",
    "sweep_where",
]

SWEEP_TRACKING = "tracking.json"  # in a sweep's directory: its MLflow parent run


def mlflow_uri(cfg) -> str:
    """The run config's MLflow tracking URI (its own, or the SQLite file under its storage)."""
    return cfg.tracking.mlflow.uri or mlflow_runs.default_uri(cfg.storage_path())


def _artifact_root(cfg) -> Path | None:
    """Where a new experiment keeps artifacts: under the storage root for a database URI
    (else MLflow's default is ./mlruns in whatever directory the run started from); an
    MLflow server decides its own."""
    if mlflow_uri(cfg).startswith(("http://", "https://")):
        return None
    return cfg.storage_path() / "mlflow" / "artifacts"


@dataclass
class RunTracking:
    """One run's trackers: the Ray Train callbacks, and its MLflow run (if any)."""

    run_dir: Path
    callbacks: list = field(default_factory=list)
    mlflow: dict[str, str] | None = None  # {"uri", "run_id", "experiment_id"}, in run.json

    def __post_init__(self) -> None:
        self.announce = failures.Announcer(self.run_dir)  # call it to print new failures
        # A resumed run's earlier step reports went to the trackers in its earlier calls.
        self._new_steps = history.Follower(self.run_dir, history.STEPS, from_end=True)

    def forward_steps(self) -> None:
        """Send the step reports rank 0 appended since the last call to each tracker."""
        records = self._new_steps.new()
        if records:
            for tracker in self.callbacks:
                tracker.write_steps(records)

    def record(self) -> dict[str, Any]:
        return {"tracking": {"mlflow": self.mlflow}} if self.mlflow else {}

    def where(self) -> str | None:
        """A line saying where the run can be watched beyond relay (None: nowhere else)."""
        return mlflow_runs.where(self.mlflow) if self.mlflow else None

    def close(
        self, status: str, *, efficiency: dict | None = None, checkpoint: str | None = None
    ) -> None:
        """The run ended with `status` (FINISHED, FAILED or KILLED): its efficiency report and
        its best `checkpoint`'s meta.json go with it."""
        from relay.checkpoints.checkpoint import META

        meta = Path(checkpoint) / META if checkpoint else None
        if self.mlflow:
            mlflow_runs.close_run(
                self.run_dir,
                self.mlflow["uri"],
                self.mlflow["run_id"],
                status,
                artifacts={"efficiency": efficiency},
                files=[meta] if meta and meta.exists() else [],
            )
        self.announce()


def open_run(
    cfg,
    run_dir: Path,
    run_id: str,
    *,
    previous: dict[str, Any] | None = None,
    sweep_id: str | None = None,
) -> RunTracking:
    """The trackers `cfg.tracking` turns on for the run `run_id`; a resumed run (`previous`
    is its record) continues its MLflow run, a sweep's trial is nested under the sweep's."""
    tracked = RunTracking(Path(run_dir))
    for tracker in (tensorboard.TRACKER, mlflow_runs.TRACKER):
        failures.clear(run_dir, tracker)  # a resumed run tries every tracker again
    if cfg.tracking.tensorboard:
        tracked.callbacks.append(TensorBoardTracker(run_dir))
    if cfg.tracking.mlflow is None:
        return tracked
    uri = mlflow_uri(cfg)
    before = ((previous or {}).get("tracking") or {}).get("mlflow") or {}
    tags = {
        "relay.run_id": run_id,
        "relay.task": cfg.task,
        "relay.size": cfg.size,
        "relay.strategy": cfg.parallel.strategy,
        "relay.workers": cfg.scaling.describe(),
    }
    parent = None
    if sweep_id:
        tags["relay.sweep_id"] = sweep_id
        parent = _sweep_parent(cfg.storage_path(), sweep_id, uri)
    tracked.mlflow = mlflow_runs.open_run(
        Path(run_dir),
        uri,
        cfg.tracking.mlflow.experiment,
        name=run_id,
        config=cfg.model_dump(mode="json"),
        tags=tags,
        artifact_root=_artifact_root(cfg),
        resume_id=before.get("run_id") if before.get("uri") == uri else None,
        parent_id=parent,
    )
    if tracked.mlflow:
        tracked.callbacks.append(mlflow_runs.MlflowTracker(run_dir, uri, tracked.mlflow["run_id"]))
    tracked.announce()
    return tracked


def ended_from_outside(run_record: dict[str, Any], status: str) -> None:
    """A run Tune ended from outside (ASHA stopped its trial: `KILLED`; or killed it as it
    finished its last epoch: `FINISHED`): its MLflow run, left open, ends with `status`."""
    mlflow = (run_record.get("tracking") or {}).get("mlflow")
    if mlflow:
        mlflow_runs.close_run(Path(run_record["run_dir"]), mlflow["uri"], mlflow["run_id"], status)


def register_version(cfg, run_record: dict[str, Any], version: dict[str, Any], best: bool):
    """Mirror relay's new model `version` in MLflow's registry, from the MLflow run of the run
    that made it (nothing when that run was not tracked in MLflow)."""
    mlflow = (run_record.get("tracking") or {}).get("mlflow")
    if cfg.tracking.mlflow is None or not mlflow:
        return None
    from relay.checkpoints.checkpoint import META

    checkpoint = Path(version["checkpoint"])
    return mlflow_runs.register_version(
        Path(run_record["run_dir"]),
        mlflow["uri"],
        mlflow["run_id"],
        version,
        best=best,
        meta=checkpoint / META,
    )


def mirror_alias(storage: Path, version: dict[str, Any], alias: str, *, remove: bool) -> str:
    """Mirror a user alias of relay's model `version` in MLflow's registry, when the run that
    made it was tracked there; a line saying what happened ("" when MLflow was not used)."""
    from relay.records import registry

    try:
        record = registry.get_run(storage, version["run_id"])
    except KeyError:
        return ""
    mlflow = (record.get("tracking") or {}).get("mlflow")
    if not mlflow:
        return ""
    name = version["model"]
    try:
        mlflow_runs.set_alias(mlflow["uri"], name, version["version"], alias, remove=remove)
    except Exception as error:  # the alias stands in relay either way
        shown = redacted_uri(mlflow["uri"])
        reason = str(error).replace(mlflow["uri"], shown)
        return f"relay: MLflow at {shown} did not take the alias ({reason})"
    return f"mlflow: {name}@{alias} {'removed' if remove else 'set'}"


def open_sweep(cfg, sweep_dir: Path, sweep_id: str, *, resume: bool) -> None:
    """The sweep's MLflow parent run (reopened on resume), named in the sweep's directory for
    its trials (which run in other processes) to nest under."""
    train = cfg.train
    if train.tracking.mlflow is None:
        return
    uri = mlflow_uri(train)
    path = Path(sweep_dir) / SWEEP_TRACKING
    before = json.loads(path.read_text()) if resume and path.exists() else {}
    failures.clear(sweep_dir, mlflow_runs.TRACKER)
    parent = mlflow_runs.open_run(
        Path(sweep_dir),
        uri,
        train.tracking.mlflow.experiment,
        name=sweep_id,
        config=cfg.model_dump(mode="json"),
        tags={"relay.sweep_id": sweep_id, "relay.search_alg": cfg.search_alg},
        artifact_root=_artifact_root(train),
        resume_id=before.get("run_id") if before.get("uri") == uri else None,
    )
    if parent:
        path.write_text(json.dumps(parent))
    failures.Announcer(sweep_dir)()


def sweep_where(sweep_dir: Path) -> str | None:
    """A line saying where the sweep's parent run is (None: not in MLflow)."""
    path = Path(sweep_dir) / SWEEP_TRACKING
    if not path.exists():
        return None
    return mlflow_runs.where(json.loads(path.read_text()))


def close_sweep(sweep_dir: Path, status: str, result: dict[str, Any] | None) -> None:
    """End the sweep's parent run; its result (trials, best) as an artifact, the best trial's
    score as the metric `best_score`."""
    path = Path(sweep_dir) / SWEEP_TRACKING
    if not path.exists():
        return
    parent = json.loads(path.read_text())
    best = (result or {}).get("best") or {}
    mlflow_runs.close_run(
        Path(sweep_dir),
        parent["uri"],
        parent["run_id"],
        status,
        artifacts={"sweep_result": result},
        metrics={"best_score": best.get("best_score")},
    )
    failures.Announcer(sweep_dir)()


def _sweep_parent(storage: Path, sweep_id: str, uri: str) -> str | None:
    path = sweeps_root(storage) / sweep_id / SWEEP_TRACKING
    if not path.exists():
        return None
    parent = json.loads(path.read_text())
    return parent["run_id"] if parent.get("uri") == uri else None
