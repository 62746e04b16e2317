"""MLflow: one MLflow run per relay run, a parent run per sweep with a nested run per trial,
and relay's model versions in MLflow's Model Registry.

Who writes what:
- the driver of a run (`relay train`, or a sweep's trial actor) opens the MLflow run — or,
  for `--resume`, reopens the one its record names — with the flattened config as params and
  the run's identity as tags; when the run ends it adds the efficiency report and sets the
  run's status;
- Ray Train's controller logs each epoch's metrics (`MlflowTracker.after_report`, step =
  epoch), so a worker group that restarts never opens a second MLflow run; the driver logs
  the step clocks' reports as rank 0 appends them (`MlflowTracker.write_steps`, under `step/`,
  step = the optimizer step);
- registering a model version adds the checkpoint's `meta.json` and a pointer to the
  checkpoint as the run's `relay-checkpoint` artifact, registers that artifact as the next
  version of the model, and moves the alias `best` to it when it is relay's best (`latest` is
  MLflow's own, reserved: `models:/<name>/latest`).

MLflow is never where the training's records live: those stay in relay's own files. When a
call to MLflow fails (server down, bad URI), relay stops using MLflow for that run and the
driver warns once (failures.py); the run goes on.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import ray.train

from relay.config import flatten, redacted_uri
from relay.observe.tracking import failures
from relay.observe.tracking.metrics import numeric_metrics, step_metrics

# An unreachable server must cost a run seconds, not MLflow's default of 7 retries with
# backoff (minutes per call): at most 3 tries, 10 s each. A user's own setting wins.
CLIENT_ENV = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
    # MLflow prints "View run ... at" to stdout when a run ends, into relay's own output
    # (and `--json`'s); relay prints the run's address itself.
    "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true",
    # MLflow sends usage telemetry from every process that imports it (decided at import, in
    # mlflow/telemetry); relay's processes send nothing anywhere but the tracking URI. The
    # processes of a cluster relay starts have it already (cluster.TELEMETRY_OFF).
    "MLFLOW_DISABLE_TELEMETRY": "true",
}
TRACKER = "mlflow"  # its failure mark in a run's (or sweep's) directory: see failures.py
CHECKPOINT_ARTIFACT = "relay-checkpoint"
MAX_PARAM_LENGTH = 6000  # MLflow's limit on a param's value
MAX_BATCH_METRICS = 1000  # MLflow's limit on the metrics of one log_batch

T = TypeVar("T")


def default_uri(storage: Path) -> str:
    """The embedded default: a SQLite file under the storage root (nothing to start)."""
    return f"sqlite:///{storage / 'mlflow' / 'mlflow.db'}"


def _client(uri: str):
    for name, value in CLIENT_ENV.items():
        os.environ.setdefault(name, value)
    # A new SQLite file's schema set-up is logged at INFO: not news to a relay user.
    logging.getLogger("mlflow.store.db.utils").setLevel(logging.WARNING)
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def _call(directory: Path, uri: str, what: str, action: Callable[[], T]) -> T | None:
    """Run one exchange with MLflow for the run in `directory`. A failure marks MLflow off for
    the run (the driver announces it, once) and returns None."""
    if failures.failed(directory, TRACKER):
        return None
    try:
        return action()
    except Exception as error:  # MLflow's, requests', SQLAlchemy's: all mean "not tracked"
        shown = redacted_uri(uri)  # the mark is a file and a line on the console
        reason = " ".join(str(error).replace(uri, shown).split())[:300] or type(error).__name__
        failures.mark(
            directory,
            TRACKER,
            f"relay: MLflow at {shown} failed while {what} ({reason}); training goes on without "
            "MLflow for this run, its records stay in relay's own files",
        )
        return None


def where(run: dict[str, str]) -> str:
    """The line that says where a tracked run or sweep is: its page on an MLflow server, or
    the database URI (`mlflow ui` shows it)."""
    return f"mlflow: {run_url(run) or redacted_uri(run['uri'])} (run {run['run_id']})"


def run_url(run: dict[str, str]) -> str | None:
    """Where an MLflow server shows the run (None for a database URI: `mlflow ui` shows it)."""
    if not run["uri"].startswith(("http://", "https://")):
        return None
    base = redacted_uri(run["uri"]).rstrip("/")
    return f"{base}/#/experiments/{run['experiment_id']}/runs/{run['run_id']}"


def flat_params(config: dict[str, Any]) -> dict[str, str]:
    """A nested config as MLflow params: `parallel.strategy` → "ddp"; others as JSON."""
    return {
        name: (value if isinstance(value, str) else json.dumps(value))[:MAX_PARAM_LENGTH]
        for name, value in flatten(config).items()
    }


def version_tags() -> dict[str, str]:
    """relay's, Ray's and torch's versions, and the git commit of the working directory."""
    import ray
    import torch

    from relay.version import __version__

    tags = {"relay.version": __version__, "ray.version": ray.__version__}
    tags["torch.version"] = torch.__version__
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, check=True
        ).stdout.strip()
        tags["mlflow.source.git.commit"] = commit
    except (OSError, subprocess.SubprocessError):
        pass  # not a repository, or no git: no commit to name
    return tags


def _experiment_id(client, name: str, artifact_root: Path | None) -> str:
    found = client.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    try:
        location = artifact_root.as_uri() if artifact_root else None
        return client.create_experiment(name, artifact_location=location)
    except Exception:  # another trial created it first
        found = client.get_experiment_by_name(name)
        if found is None:
            raise
        return found.experiment_id


def _log_params(client, run_id: str, params: dict[str, str]) -> None:
    """Log the params the run does not have yet. A resumed run keeps its first values (MLflow
    params are immutable); a value the resume changed is kept as a `relay.resumed.<key>` tag."""
    from mlflow.entities import Param, RunTag

    have = client.get_run(run_id).data.params
    new = [Param(k, v) for k, v in params.items() if k not in have]
    changed = [RunTag(f"relay.resumed.{k}", v) for k, v in params.items() if have.get(k, v) != v]
    for start in range(0, max(len(new), len(changed)), 100):  # MLflow's batch limit
        client.log_batch(run_id, params=new[start : start + 100], tags=changed[start : start + 100])


def open_run(
    directory: Path,
    uri: str,
    experiment: str,
    *,
    name: str,
    config: dict[str, Any],
    tags: dict[str, str],
    artifact_root: Path | None,
    resume_id: str | None = None,
    parent_id: str | None = None,
) -> dict[str, str] | None:
    """Start (or with `resume_id`, reopen) the MLflow run of the relay run or sweep in
    `directory`: {"uri", "run_id", "experiment_id"}, or None when MLflow cannot be used."""

    def start() -> dict[str, str]:
        from mlflow.entities import RunStatus

        client = _client(uri)
        info = None
        if resume_id:
            try:
                info = client.get_run(resume_id).info
                client.update_run(info.run_id, status=RunStatus.to_string(RunStatus.RUNNING))
            except Exception:
                info = None  # e.g. a new tracking URI: the resumed run starts a new one
        if info is None:
            all_tags = {**version_tags(), **tags, "mlflow.runName": name}
            if parent_id:
                all_tags["mlflow.parentRunId"] = parent_id
            exp = _experiment_id(client, experiment, artifact_root)
            info = client.create_run(exp, run_name=name, tags=all_tags).info
        _log_params(client, info.run_id, flat_params(config))
        return {"uri": uri, "run_id": info.run_id, "experiment_id": info.experiment_id}

    return _call(directory, uri, "opening its run", start)


def close_run(
    directory: Path,
    uri: str,
    run_id: str,
    status: str,
    *,
    artifacts: dict[str, Any] | None = None,
    files: list[Path] = (),
    metrics: dict[str, Any] | None = None,
) -> None:
    """End the MLflow run with `status` (FINISHED, FAILED, KILLED); `artifacts` maps names to
    JSON-able records (written as `relay/<name>.json`), `files` are copied into `relay/`;
    `metrics` are logged without a step."""

    def close() -> None:
        from mlflow.entities import Metric

        client = _client(uri)
        for artifact, record in (artifacts or {}).items():
            if record is not None:
                client.log_dict(run_id, record, f"relay/{artifact}.json")
        for path in files:
            client.log_artifact(run_id, str(path), "relay")
        if metrics:
            now = int(time.time() * 1000)
            values = [Metric(k, v, now, 0) for k, v in numeric_metrics(metrics).items()]
            client.log_batch(run_id, metrics=values)
        client.set_terminated(run_id, status=status)

    _call(directory, uri, "closing its run", close)


def register_version(
    directory: Path,
    uri: str,
    run_id: str,
    version: dict[str, Any],
    *,
    best: bool,
    meta: Path | None,
) -> str | None:
    """Register relay's model `version` (a registry record) in MLflow's Model Registry, from
    the run `run_id`: a pointer to relay's checkpoint (and its meta.json) as the run's
    `relay-checkpoint` artifact, registered as the model's next version, and when `best`,
    with the alias `best` (MLflow's own `models:/<name>/latest` is the newest). The MLflow
    version number, or None."""

    def register() -> str:
        client = _client(uri)
        pointer = {k: version[k] for k in ("model", "version", "checkpoint", "metric", "score")}
        client.log_dict(run_id, pointer, f"{CHECKPOINT_ARTIFACT}/checkpoint.json")
        if meta is not None and meta.exists():
            client.log_artifact(run_id, str(meta), CHECKPOINT_ARTIFACT)
        name = version["model"]
        try:
            client.get_registered_model(name)
        except Exception:
            client.create_registered_model(name, tags={"relay.task": version["task"]})
        created = client.create_model_version(
            name,
            source=f"runs:/{run_id}/{CHECKPOINT_ARTIFACT}",
            run_id=run_id,
            tags={
                "relay.version": str(version["version"]),
                "relay.checkpoints.checkpoint": pointer["checkpoint"],
            },
            description=f"relay model {name}:{version['version']}",
            await_creation_for=0,  # ready at once (nothing to copy): no wait, no log line
        )
        if best:  # `latest` is MLflow's own (reserved): models:/<name>/latest
            client.set_registered_model_alias(name, "best", created.version)
        return created.version

    return _call(directory, uri, "registering a model version", register)


def set_alias(uri: str, name: str, relay_version: int, alias: str, *, remove: bool) -> None:
    """Point (or with `remove`, drop) MLflow's alias `alias` of model `name` at the MLflow
    version registered for relay's `relay_version`. Raises when MLflow cannot do it."""
    client = _client(uri)
    if remove:
        client.delete_registered_model_alias(name, alias)
        return
    matches = [
        v
        for v in client.search_model_versions(f"name='{name}'")
        if v.tags.get("relay.version") == str(relay_version)
    ]
    if not matches:
        raise LookupError(f"{name}:{relay_version} is not in MLflow's registry")
    client.set_registered_model_alias(name, alias, max(int(v.version) for v in matches))


class MlflowTracker(ray.train.UserCallback):
    """Rank 0's report of each epoch as MLflow metrics, step = epoch (runs on the controller)."""

    def __init__(self, run_dir: Path, uri: str, run_id: str) -> None:
        self.run_dir, self.uri, self.run_id = Path(run_dir), uri, run_id
        self._client = None

    def after_report(self, run_context, metrics: list[dict[str, Any]], checkpoint) -> None:
        if not metrics or "epoch" not in metrics[0]:
            return
        report, epoch = metrics[0], int(metrics[0]["epoch"])

        def log() -> None:
            from mlflow.entities import Metric

            if self._client is None:
                self._client = _client(self.uri)
            now = int(time.time() * 1000)
            values = [Metric(k, v, now, epoch) for k, v in numeric_metrics(report).items()]
            self._client.log_batch(self.run_id, metrics=values)

        _call(self.run_dir, self.uri, f"logging epoch {epoch}", log)

    def write_steps(self, records: list[dict[str, Any]]) -> None:
        """Step reports (steps.jsonl's records), logged by the driver as rank 0 appends them,
        each at the time rank 0 wrote it."""
        if not records:
            return

        def log() -> None:
            from mlflow.entities import Metric

            if self._client is None:
                self._client = _client(self.uri)
            values = [
                Metric(name, value, int(r["time"] * 1000), int(r["step"]))
                for r in records
                for name, value in step_metrics(r).items()
            ]
            for start in range(0, len(values), MAX_BATCH_METRICS):
                batch = values[start : start + MAX_BATCH_METRICS]
                self._client.log_batch(self.run_id, metrics=batch)

        _call(self.run_dir, self.uri, f"logging steps up to {records[-1]['step']}", log)
