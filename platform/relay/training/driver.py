"""Driver side of a training run: build the TorchTrainer from a validated config, fit, record.

cfg = relay.config.load("jobs/configs/digits.yaml")
result = relay.train(cfg)          # connects to (or starts) Ray, trains, records the run
result.checkpoint                  # absolute path of the best checkpoint directory
"""

from __future__ import annotations

import contextlib
import secrets
import sys
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from relay.checkpoints import checkpoint, consolidate
from relay.config import ConfigError, RunConfig
from relay.observe import console, doctor, tracking
from relay.records import history, registry, run_admin
from relay.runtime import background, cluster, ray_private, worker_memory
from relay.training import efficiency

if TYPE_CHECKING:
    from relay.training.data.ingest import RunData, SharedData


@dataclass
class RunResult:
    run_id: str
    run_dir: str
    checkpoint: str | None  # the best checkpoint by the configured metric
    last_checkpoint: str | None
    metrics: dict[str, Any]  # the final epoch's
    best_metrics: dict[str, Any]  # the best checkpoint's
    history: list[dict[str, Any]] = field(default_factory=list)
    replicas_in_sync: bool | None = None
    model: str | None = None  # the model version this run was registered as, e.g. "digits:3"
    # From this fit() call's start to the start of the first epoch it trained (cluster, workers,
    # data); None when it trained none (e.g. resumed after its last epoch).
    startup_s: float | None = None
    efficiency: dict[str, Any] | None = None  # see relay.training.efficiency
    # Under scaling.memory_per_worker: {"mechanism": "cgroup" | "rlimit", "bytes": the limit}.
    memory: dict[str, Any] | None = None

    def to_json_dict(self) -> dict[str, Any]:
        return asdict(self)


def new_run_id(name: str) -> str:
    return f"{name}-{datetime.now(UTC):%Y%m%d-%H%M%S}-{secrets.token_hex(2)}"


def loop_config(
    cfg: RunConfig, run_id: str, data: RunData, init_checkpoint: str | None = None
) -> dict[str, Any]:
    """What the worker loop (worker_loop.run_loop) trains from, on every worker."""
    return {
        "run": cfg.model_dump(mode="json"),
        "run_dir": str(registry.runs_root(cfg.storage_path()) / run_id),
        "cpus_per_worker": cfg.scaling.cpus_per_worker,
        "train_rows": data.train_rows,
        # What each worker opens its batches from (relay.training.data.ingest).
        "data": data.loop_data(),
        # Where a run without checkpoints of its own starts (a PBT exploit: another trial's).
        "init_checkpoint": init_checkpoint,
    }


def checkpoint_config(cfg: RunConfig):
    """Which of a run's checkpoints are kept (Ray Train's CheckpointConfig)."""
    import ray.train

    # Mid-epoch checkpoints (a clock in steps or minutes) carry no validation metric: the
    # latest are kept.
    ranked = not cfg.checkpoint.step_clocked()
    return ray.train.CheckpointConfig(
        num_to_keep=cfg.checkpoint.keep,
        checkpoint_score_attribute=cfg.checkpoint.metric if ranked else None,
        checkpoint_score_order=cfg.checkpoint.mode,
    )


def build_trainer(
    cfg: RunConfig,
    run_id: str,
    data: RunData,
    callbacks: list | None = None,
    init_checkpoint: str | None = None,
    *,
    in_process: bool = False,
):
    """The run's TorchTrainer; with `in_process`, its one worker trained in this process
    instead (in_process.py: a sweep trial's actor), through the same `fit()`."""
    import ray.train

    from relay.training.worker_loop import train_loop_per_worker

    config = loop_config(cfg, run_id, data, init_checkpoint)
    if in_process:
        from relay.training.in_process import InProcessRun

        return InProcessRun(config, checkpoint_config(cfg), callbacks or [], cfg.scaling.use_gpu)
    scaling = ray.train.ScalingConfig(
        num_workers=cfg.scaling.num_workers,  # an int, or (min, max): elastic
        use_gpu=cfg.scaling.use_gpu,
        resources_per_worker=cfg.scaling.resources_per_worker,
    )
    run_config = ray.train.RunConfig(
        name=run_id,
        storage_path=str(registry.runs_root(cfg.storage_path())),
        failure_config=ray.train.FailureConfig(
            max_failures=cfg.failure.max_failures,
            # A start of the worker group that times out placing it is a controller failure.
            controller_failure_limit=cfg.failure.start_failures,
        ),
        checkpoint_config=checkpoint_config(cfg),
        callbacks=callbacks or [],
    )
    limited = cfg.scaling.memory_per_worker is not None
    return ray_private.torch_trainer(
        # Out of memory at the limit: the same wall on every restart, so the run ends at once.
        out_of_memory_ends=(run_id, cfg.scaling.max_workers) if limited else None,
        # Ray's cleaner watches the controller through the State API; where none answers it
        # never cleans, and this driver releases what a dead controller leaves (`_run`).
        placement_group_cleaner=cluster.state_api_served(),
        train_loop_per_worker=train_loop_per_worker,
        train_loop_config=config,
        scaling_config=scaling,
        run_config=run_config,
        datasets=data.datasets,  # Ray Data ingest only
    )


def register_model(cfg: RunConfig, run_id: str, checkpoint: str, metrics: dict, name: str | None):
    """Record a checkpoint as the next version of model `name` (default: the task's name);
    with MLflow tracking, also in MLflow's Model Registry, from the run's MLflow run.

    A sharded checkpoint gets its whole weights file first (streamed from the shards), so every
    registered version is what Serve and Hugging Face tools load, with nothing to make later."""
    consolidate.consolidate(checkpoint)
    storage = cfg.storage_path()
    version = registry.register_version(
        storage,
        name or registry.default_model_name(cfg.task),
        {
            "checkpoint": checkpoint,
            "run_id": run_id,
            "task": cfg.task,
            "metric": cfg.checkpoint.metric,
            "mode": cfg.checkpoint.mode,
            "score": metrics.get(cfg.checkpoint.metric),
            "metrics": metrics,
        },
    )
    if cfg.tracking.mlflow is not None:
        best = registry.best_version(registry.list_versions(storage, version["model"]))
        is_best = best["version"] == version["version"]
        tracking.register_version(cfg, registry.get_run(storage, run_id), version, is_best)
    return version


def fit(
    cfg: RunConfig,
    *,
    verbose: bool = False,
    out: TextIO | None = sys.stdout,
    model_name: str | None = None,
    register: bool = True,
    run_id: str | None = None,
    callbacks: list | None = None,
    labels: dict[str, Any] | None = None,
    init_checkpoint: str | Path | None = None,
    data: SharedData | None = None,
    allow_task: Iterable[str] = (),
    in_process: bool = False,
) -> RunResult:
    """Train `cfg` on the current Ray cluster (starting a local one if none), record the run and
    (with `register`) make its best checkpoint the next version of model `model_name`.

    `run_id` of an existing run resumes it from its latest checkpoint, under this config: the
    worker count, strategy, precision, epochs and batch may differ from the run's, the model
    may not (see `check_resumable`). A Tune trial passes a stable `run_id` (so a resumed sweep
    resumes the same Train run), Tune's report `callbacks`, and `labels` for its record.

    `init_checkpoint` (a checkpoint directory, e.g. another PBT trial's) starts the run from
    those weights, optimizer state and epoch, under this config's hyperparameters; the run's
    own checkpoints, once it has any, take precedence (a restart resumes the run itself).

    `data`: what a sweep prepared once for all its trials (`ingest.put_for_trials`: a split
    in the object store, or its files' survey); used when it is what this config would
    prepare, else the run prepares its own.

    The checkpoint a run resumes or starts from must name `cfg`'s task in its meta.json, or
    one in `allow_task` (relay.tasks.UntrustedTask, before any cluster work).

    `in_process`: train the run's one worker in this process (a sweep trial's actor; see
    in_process.py), not in a worker group of its own; a config that needs one is refused.
    """
    from relay.training import in_process as in_process_runs
    from relay.training.data import ingest

    if in_process and (reason := in_process_runs.unfit_reason(cfg)):
        raise ValueError(f"{cfg.name}: cannot train in this process: {reason}")
    times = {"started": time.time()}
    previous, init_checkpoint = _check_start(cfg, run_id, init_checkpoint, allow_task)
    cluster.connect(verbose=verbose, num_cpus=ingest.cpus_to_start(cfg))
    times["connected"] = time.time()
    run_data = ingest.prepare(cfg, shared=data)
    train_rows = run_data.train_rows
    if train_rows < cfg.scaling.max_workers:
        raise ValueError(
            f"{train_rows} training samples cannot feed {cfg.scaling.max_workers} workers"
        )
    opened = _open_run(
        cfg, run_id, previous, init_checkpoint, labels, times["started"], out, in_process
    )
    # The failure clock stamps worker-group restarts: the efficiency report's start-up.
    callbacks = [*(callbacks or []), failure_clock(opened.run_dir), *opened.tracked.callbacks]
    trainer = build_trainer(
        cfg, opened.run_id, run_data, callbacks, init_checkpoint, in_process=in_process
    )
    result = _run(cfg, opened, trainer, out, times)
    return _finish(cfg, opened, result, times, register=register, model_name=model_name, out=out)


def _check_start(
    cfg: RunConfig, run_id: str | None, init_checkpoint: str | Path | None, allow_task
) -> tuple[dict | None, str | None]:
    """Before any cluster work: the record of the run `run_id` resumes (None for a new run),
    resumable under `cfg`, its latest checkpoint sound and of an allowed task; the checkpoint a
    run starts from, likewise; the storage root writable."""
    previous = registry.read(registry.runs_root(cfg.storage_path()) / run_id) if run_id else None
    if previous:
        if reason := run_admin.collected_reason(previous):
            raise ValueError(reason)
        check_resumable(previous["config"], cfg)
        # The checkpoint the workers will load, checked here: a damaged one fails now, naming
        # the file, not on every worker (and every retry) after a cluster start.
        if latest := checkpoint.latest_registered(registry.runs_root(cfg.storage_path()) / run_id):
            checkpoint.validate(latest[0])
            checkpoint.checked_task(latest[0], [cfg.task, *allow_task])
    if init_checkpoint is not None:
        init_checkpoint = str(checkpoint.validate(init_checkpoint))
        checkpoint.checked_task(init_checkpoint, [cfg.task, *allow_task])
        check_resumable(checkpoint.read_meta(init_checkpoint)["config"], cfg)
    registry.check_writable(registry.runs_root(cfg.storage_path()))
    return previous, init_checkpoint


@dataclass
class _OpenRun:
    """A run as recorded when it starts: its id and directory, its record, its trackers."""

    run_id: str
    run_dir: Path
    record: dict[str, Any]
    tracked: Any  # tracking.open_run's


def _open_run(
    cfg: RunConfig,
    run_id: str | None,
    previous: dict | None,
    init_checkpoint: str | None,
    labels: dict[str, Any] | None,
    started: float,
    out: TextIO | None,
    in_process: bool = False,
) -> _OpenRun:
    """The run's directory and its "running" record (a resumed run keeps its id), its
    trackers opened; the first console line."""
    resuming = run_id is not None
    run_id = run_id or new_run_id(cfg.name)
    run_dir = registry.runs_root(cfg.storage_path()) / run_id
    registry.make_dir(run_dir, exist_ok=resuming)  # 0700 (see registry: shared storage)
    record = {
        "run_id": run_id,
        "task": cfg.task,
        "size": cfg.size,
        "status": "running",
        "started_at": datetime.fromtimestamp(started, UTC).isoformat(),
        "run_dir": str(run_dir),
        "resumes": previous.get("resumes", -1) + 1 if previous else 0,
        # False: trained in the calling process (a sweep trial's actor; in_process.py).
        "worker_group": not in_process,
        **({"init_checkpoint": init_checkpoint} if init_checkpoint else {}),
        **(labels or {}),
        "config": cfg.model_dump(mode="json"),
    }
    registry.reserve(run_dir)
    tracked = tracking.open_run(
        cfg, run_dir, run_id, previous=previous, sweep_id=(labels or {}).get("sweep")
    )
    record.update(tracked.record())
    registry.write(run_dir, record)
    if out is not None:
        out.write(
            f"run {run_id}: {cfg.task} ({cfg.size}) on {cfg.scaling.describe()}, "
            f"{cfg.parallel.strategy}\n"
        )
    return _OpenRun(run_id, run_dir, record, tracked)


def _run(cfg: RunConfig, opened: _OpenRun, trainer: Any, out: TextIO | None, times: dict):
    """`trainer.fit()`, followed on the console and watched by the doctor; a failure recorded
    (and explained, where relay knows why: the memory wall, workers never placed) and raised."""
    run_id, run_dir = opened.run_id, opened.run_dir
    try:
        with (
            # First: `wait_s` is bound whatever fails after it.
            cluster.worker_wait(cfg.failure.worker_wait_s) as wait_s,
            cluster.run_ends_with_fit(),
            console.follow(run_dir, cfg.epochs, out, opened.tracked.announce, cfg.max_steps),
            _steps_tracked(cfg, opened.tracked),
            doctor.watching(cfg.doctor, run_dir, out),
        ):
            times["fit_called"] = time.time()
            return trainer.fit()
    except BaseException as exc:
        # A controller that died (not one that ended the run) leaves its worker group's
        # placement group behind while this job lives: no cleaner watches it here
        # (ray_private.torch_trainer). The run's own failure is what to report, even when the
        # cluster cannot be asked (a lost head).
        with contextlib.suppress(Exception):
            ray_private.release_orphaned_placement_groups()
        explained = _memory_wall(cfg, run_id, exc) or _not_placed(cfg, run_id, exc, wait_s)
        _record_failure(run_dir, opened.record, explained or exc)
        opened.tracked.close("FAILED" if isinstance(exc, Exception) else "KILLED")
        if explained:
            raise explained from exc
        raise
    finally:
        if cfg.scaling.memory_per_worker:  # once Ray has ended the worker processes in them
            worker_memory.release(run_id, cfg.scaling.max_workers)


# How often the driver sends the step reports rank 0 appended to the trackers.
STEP_TRACKING_S = 2.0


def _steps_tracked(cfg: RunConfig, tracked: tracking.RunTracking):
    """While the run trains, its step reports (steps.jsonl) go to its trackers, if any."""
    reports = cfg.report.every_steps or cfg.validation.every_steps
    if not (reports and tracked.callbacks):
        return contextlib.nullcontext()
    return background.every(STEP_TRACKING_S, tracked.forward_steps, "relay-step-tracking")


def _finish(
    cfg: RunConfig,
    opened: _OpenRun,
    result: Any,
    times: dict,
    *,
    register: bool,
    model_name: str | None,
    out: TextIO | None,
) -> RunResult:
    """The run's result from Ray Train's, its efficiency report, its best checkpoint registered
    as a model version (with `register`), the "finished" record, the last console lines."""
    run_id, run_dir, record, tracked = opened.run_id, opened.run_dir, opened.record, opened.tracked
    started = times["started"]
    run = _run_result(cfg, run_id, run_dir, result)
    run.memory = (result.return_value or {}).get("memory_limit")
    trained = [e for e in history.read_raw(run_dir) if e["time"] >= started]  # by this call
    run.efficiency = _efficiency(cfg, run_dir, times, result.return_value or {}, trained)
    if trained:  # a resumed run's history starts with epochs an earlier call trained
        first = trained[0]
        run.startup_s = round(first["time"] - first["epoch_s"] - started, 3)
    if register and run.checkpoint:
        try:
            version = register_model(cfg, run_id, run.checkpoint, run.best_metrics, model_name)
        except BaseException as exc:  # e.g. the storage filled up at the very end
            _record_failure(run_dir, record, exc)
            tracked.close("FAILED")
            raise
        run.model = f"{version['model']}:{version['version']}"
    registry.write(
        run_dir,
        {
            **record,
            "status": "finished",
            "finished_at": datetime.now(UTC).isoformat(),
            "wall_s": round(time.time() - started, 2),
            "checkpoint": run.checkpoint,
            "last_checkpoint": run.last_checkpoint,
            "metrics": run.metrics,
            "best_metrics": run.best_metrics,
            "replicas_in_sync": run.replicas_in_sync,
            "startup_s": run.startup_s,
            "placement": doctor.heartbeat.placement(run_dir),  # the last worker group's
            "model": run.model,
            "memory_limit": run.memory,
            "efficiency": run.efficiency,
        },
        final=True,
    )
    tracked.close("FINISHED", efficiency=run.efficiency, checkpoint=run.checkpoint)
    if out is not None:
        if run.efficiency:
            out.write(efficiency.format_report(run.efficiency) + "\n")
        out.write(f"model: {run.model} at {run.checkpoint}\n")
        if where := tracked.where():
            out.write(where + "\n")
    return run


def _memory_wall(cfg: RunConfig, run_id: str, exc: BaseException) -> Exception | None:
    """The out-of-memory a failed run under `scaling.memory_per_worker` ran into, as an error
    that names the ranks, the limit and the way past it; None if the failure was another."""
    limit = cfg.scaling.memory_per_worker
    if not limit or not isinstance(exc, Exception):
        return None
    ranks = worker_memory.ranks_out_of_memory(run_id, cfg.scaling.max_workers, exc)
    if not ranks:
        return None
    return worker_memory.OutOfMemory(
        f"out of memory on rank {', '.join(map(str, ranks))}: each worker may use "
        f"{limit.human_readable()} (scaling.memory_per_worker) and "
        f"{worker_memory.wall_advice(cfg)}"
    )


class WorkersNotPlaced(RuntimeError):
    """The cluster never had room for the run's worker group within the run's bound."""


def _not_placed(cfg: RunConfig, run_id: str, exc: BaseException, wait_s: float) -> Exception | None:
    """The error of a run that gave up waiting for its workers, naming what it waited for,
    for how long, what the cluster had free and the fields that set the bound; None if the
    failure was another."""
    if not ray_private.gave_up_placing_workers(exc):
        return None
    import ray

    per_worker = cfg.scaling.worker_resources
    try:  # what a lost host, or other runs and trials, left of the resources a worker needs
        available = ray.available_resources()
        free = {name: round(available.get(name, 0.0), 2) for name in per_worker}
    except Exception:  # the cluster itself is gone: the message does without
        free = "unknown"
    starts = cfg.failure.start_failures + 1
    return WorkersNotPlaced(
        f"run {run_id}: the cluster could not place {cfg.scaling.describe()} "
        f"({per_worker} each): {starts} starts failed, each waiting up to {wait_s:g} s "
        f"(failure.worker_wait_s; failure.start_failures = {cfg.failure.start_failures}); "
        f"free on the cluster now: {free}. A lost node or what other runs hold keeps them "
        f"out: free resources or add nodes, then `relay train --resume {run_id}`."
    )


def failure_clock(run_dir: Path):
    """A Ray Train callback, run on the controller: records when it finds failed workers."""
    import ray.train

    class FailureClock(ray.train.UserCallback):
        def after_exception(self, run_context, worker_exceptions) -> None:
            history.append_failure(run_dir, sorted(worker_exceptions))

    return FailureClock()


def _record_failure(run_dir: Path, record: dict[str, Any], exc: BaseException) -> None:
    """Record the run as failed. If even that cannot be written (storage gone read-only; a
    full disk is covered by the record's reserve), say so on stderr: the record then still
    reads "running", and the error raised to the caller is the run's own."""
    failed = {
        **record,
        "status": "failed",
        "finished_at": datetime.now(UTC).isoformat(),
        "error": repr(exc)[:2000],
    }
    try:
        registry.write(run_dir, failed, final=True)
    except OSError as write_error:
        print(
            f"relay: run {record['run_id']} failed and {run_dir / registry.RECORD} could not "
            f"record it: {write_error.strerror or write_error}",
            file=sys.stderr,
        )


# What a resumed run may not change: the checkpoint's weights must fit the model.
MODEL_FIELDS = ("task", "size", "model")


def check_resumable(previous: dict[str, Any], cfg: RunConfig) -> None:
    """A run resumes under a new config — other workers, strategy, precision, epochs, batch —
    as long as the model it builds is the one its checkpoints hold."""
    current = cfg.model_dump(mode="json")
    for field_name in MODEL_FIELDS:
        if previous.get(field_name) != current[field_name]:
            raise ConfigError(
                f"{field_name}: a resumed run keeps its model; the run has "
                f"{previous.get(field_name)!r}, the config {current[field_name]!r}"
            )


def _efficiency(
    cfg: RunConfig, run_dir: Path, times: dict, returned: dict, trained: list[dict]
) -> dict | None:
    report = returned.get("efficiency")
    if report is None:  # e.g. resumed after its last epoch: nothing trained in this run
        return None
    failed_at = history.failure_times(run_dir)
    ended_at = [e["time"] for e in trained]
    report["startup"] = efficiency.startup(times, returned, failed_at, ended_at)
    run_id = run_dir.name
    efficiency.add_reference(report, efficiency.find_reference(cfg.storage_path(), cfg, run_id))
    return report


def _run_result(cfg: RunConfig, run_id: str, run_dir: Path, result) -> RunResult:
    best = result.get_best_checkpoint(cfg.checkpoint.metric, cfg.checkpoint.mode)
    best_metrics = next(
        (m for c, m in result.best_checkpoints or [] if best and c.path == best.path), {}
    )
    # fsdp ranks hold shards, not replicas: nothing to compare (None).
    digests = [d for d in (result.return_value or {}).get("replica_digests") or [] if d]
    return RunResult(
        run_id=run_id,
        run_dir=str(run_dir),
        checkpoint=best.path if best else None,
        last_checkpoint=result.checkpoint.path if result.checkpoint else None,
        metrics=result.metrics or {},
        best_metrics=best_metrics,
        history=history.read(run_dir),
        replicas_in_sync=len(set(digests)) == 1 if digests else None,
    )
