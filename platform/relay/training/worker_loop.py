"""THE worker loop: `train_loop_per_worker` runs on every Ray Train worker, for `relay train`,
for multi-worker Tune trials, and in the tests (the driver, relay/training/driver.py, starts
them); `run_loop` runs the same loop in a one-worker trial's own actor (training/in_process.py).

Only the run's part of a worker lives here: the checkpoint to resume from, this rank's data
(opened through the run's ingest, relay/training/data/ingest.py), reporting each epoch and
writing checkpoints — each through the host it runs under (training/hosts.py). The epoch
itself (optimizer, schedule, passes, statistics) is epochs.py, which the plain-torchrun
baseline runs too; distributed concerns (ranks, wrapping, reductions) live in relay/parallel/;
the problem-specific parts (model, data, loss, metrics) in the task.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ray.train
import torch
from torch import nn

from relay import models, parallel
from relay.checkpoints import checkpoint
from relay.config import RunConfig
from relay.observe import doctor, worker_logs
from relay.records import history
from relay.runtime import worker_memory
from relay.tasks import build_task
from relay.training import efficiency, hosts, step_clocks
from relay.training.data import ingest
from relay.training.epochs import (
    Epochs,
    build_scheduler,
    fast_forward,
    optimizer_spec,
    run_epochs,
    run_steps,
    steps_per_epoch,
)
from relay.training.step_clocks import StepClocks


@contextlib.contextmanager
def _opened(ckpt: ray.train.Checkpoint | None) -> Iterator[Path | None]:
    if ckpt is None:
        yield None
        return
    with ckpt.as_directory() as directory:
        yield Path(directory)


def _build_model(task, cfg: RunConfig, directory: Path | None) -> nn.Module:
    """The plain model: on the `meta` device (no storage) when fsdp will materialise only this
    rank's shards of it (`parallel.meta_init`), else whole. Meta needs a task whose model
    builds without loading weights (`Task.builds_on_meta`), the model's per-module init
    (models.init_seeded), no buffers (they would be left empty), and no whole-weights
    checkpoint to start from (those load before sharding)."""
    whole_checkpoint = directory is not None and not checkpoint.is_sharded(directory)
    shards_it = cfg.parallel.strategy == "fsdp" and parallel.distributed()
    if cfg.parallel.meta_init and task.builds_on_meta and shards_it and not whole_checkpoint:
        with torch.device("meta"):
            model = task.build_model()
        if models.seeded(model) and not any(True for _ in model.buffers()):
            return model
    return task.build_model()


def _build_engine(
    model: nn.Module, cfg: RunConfig, directory: Path | None
) -> tuple[parallel.Engine, int, Any]:
    """The model wrapped for the configured strategy, with the state of the checkpoint at
    `directory` (if any) loaded; returns (engine, the checkpoint's meta or None, train state).

    Whole weights load into the plain model before the strategy wraps or shards it; shards
    load after, each rank reading only what it now holds (resharded from whatever worker count
    and strategy wrote them)."""
    sharded = directory is not None and checkpoint.is_sharded(directory)
    if directory is not None and not sharded:
        checkpoint.load_weights(directory, model)
    engine = parallel.Engine(model, cfg.parallel, *optimizer_spec(cfg.optim))
    if directory is None:
        return engine, None, None
    if sharded:
        engine.load_sharded(directory / checkpoint.SHARDS)  # a collective
    return engine, checkpoint.read_meta(directory), checkpoint.load_train_state(directory)


def _start_checkpoint(
    loop_config: dict[str, Any], host: hosts.LoopHost
) -> ray.train.Checkpoint | None:
    """The run's own latest checkpoint; else the one it was started from (a PBT exploit)."""
    own = host.own_checkpoint()
    if own is not None or not loop_config.get("init_checkpoint"):
        return own
    return ray.train.Checkpoint.from_directory(loop_config["init_checkpoint"])


def _config_hyperparameters_win(optimizer: torch.optim.Optimizer, cfg: RunConfig) -> None:
    """Loaded optimizer state brings the param groups of the run that saved it: its lr, weight
    decay, momentum. A run started from another's checkpoint under other hyperparameters (a PBT
    exploit, a resume with a changed config) trains with its own; the schedule, built over
    `cfg.optim.lr` and fast-forwarded after this, then sets each group's current lr."""
    _, hyperparameters = optimizer_spec(cfg.optim)
    for group in optimizer.param_groups:
        group.update(hyperparameters)
        group["initial_lr"] = cfg.optim.lr


def train_loop_per_worker(loop_config: dict[str, Any]) -> dict[str, Any] | None:
    """Ray Train's entry: the loop on this rank of the run's worker group."""
    return run_loop(loop_config, hosts.TrainWorker())


def run_loop(loop_config: dict[str, Any], host: hosts.LoopHost) -> dict[str, Any] | None:
    """Train `loop_config["run"]` (a RunConfig as a dict) on this worker (driver.build_trainer
    writes the loop config). What the worker prints is also kept in the run's logs/
    (`relay runs logs`)."""
    run_dir = Path(loop_config["run_dir"])
    with worker_logs.captured(run_dir, parallel.rank(), parallel.world_size()):
        try:
            return _train(loop_config, host)
        except (MemoryError, RuntimeError) as exc:
            # Under RLIMIT_DATA (worker_memory) an allocation past the limit fails in torch.
            limit = RunConfig.model_validate(loop_config["run"]).scaling.memory_per_worker
            if limit and ("allocate" in str(exc) or isinstance(exc, MemoryError)):
                raise worker_memory.refused(parallel.rank(), limit.human_readable()) from exc
            raise


def _train(loop_config: dict[str, Any], host: hosts.LoopHost) -> dict[str, Any] | None:
    loop_started_at = time.time()
    parallel.set_device(host.device())
    cfg = RunConfig.model_validate(loop_config["run"])
    run_dir = Path(loop_config["run_dir"])
    confined, beat = _prepare_worker(cfg, run_dir, loop_config["cpus_per_worker"], host)
    try:
        return _train_from_start(loop_config, host, cfg, beat, confined, loop_started_at)
    finally:
        beat.stop()  # its writer thread: the process may train other runs (hosts.TrialProcess)


def _train_from_start(loop_config, host, cfg: RunConfig, beat, confined, loop_started_at):
    """The run's model, data and epochs on this worker, ready (`_prepare_worker`)."""
    run_dir = Path(loop_config["run_dir"])
    memory_at_start = parallel.current_memory()  # the worker process before any training state
    parallel.reset_peak()  # the start-up peak: building the model and loading its state

    # Same seed on every rank: identical initial weights (DDP also broadcasts rank 0's).
    torch.manual_seed(cfg.seed)
    task = build_task(cfg.task, cfg.size, cfg.model, cfg.data.path)
    # Before any rank can checkpoint again (the engine's set-up is a collective).
    _remove_orphaned_staging(run_dir)
    beat.phase("model")
    start = _restore(task, cfg, loop_config, host)
    engine, scheduler, start_epoch = start.engine, start.scheduler, start.epoch
    startup_peak = parallel.peak_since_reset()  # model built, its state loaded; nothing trained

    beat.phase("data")
    train_data = _open_batches(loop_config, task, cfg, "train", cfg.data.shuffle)
    val_data = _open_batches(loop_config, task, cfg, "val", False)
    train_data.load()
    val_data.load()
    data_ready_at = time.time()

    epochs = Epochs(task, engine, scheduler, cfg, beat)
    mid_epoch_checkpoint = _mid_epoch_checkpoint(cfg, run_dir, engine, scheduler, task, host)
    clocks = StepClocks(cfg, run_dir, epochs, val_data, mid_epoch_checkpoint)
    last_epoch, total_steps = run_epochs(cfg, start.epoch_steps), run_steps(cfg, start.epoch_steps)
    step = (start_epoch - 1) * start.epoch_steps + start.steps_done  # the run's optimizer steps
    for epoch in range(start_epoch, last_epoch + 1):
        following = epoch + 1 if epoch < last_epoch else None
        done = start.steps_done if epoch == start_epoch else 0  # resumed mid-epoch: skipped
        train = train_data.epoch(epoch, next_epoch=following)
        # The epoch's batches come in the same seeded order as before the resume.
        train = itertools.islice(train, done * cfg.parallel.grad_accum, None)
        after_step = clocks.for_pass(epoch, step, done, start.epoch_steps, total_steps)
        budget = min(start.epoch_steps - done, total_steps - step)
        metrics = epochs.epoch(
            epoch, train, val_data.epoch(epoch), max_steps=budget, after_step=after_step
        )
        step += epochs.passes[-1]["steps"]
        metrics["step"] = step
        beat.phase("report", epoch)
        due = (
            epoch % cfg.checkpoint.every == 0
            or epoch == last_epoch
            or step_clocks.on(step, cfg.checkpoint.every_steps)
            or clocks.minutes_due()  # a collective: every rank's terms above are the same
        )
        _report(
            cfg, run_dir, epoch, metrics, engine, scheduler, task, host, due, epoch == last_epoch
        )
        if due:
            clocks.checkpointed()

    report = None
    beat.phase("efficiency")
    if epochs.passes:
        probe = next(iter(train_data.epoch(0)))
        report = efficiency.measure(task, engine, epochs, probe, cfg, memory_at_start, startup_peak)
    digests = parallel.gather_objects(engine.replica_digest())
    beat.phase("done")
    if not parallel.is_main():
        return None
    return {
        "replica_digests": digests,
        "start_epoch": start_epoch,
        "efficiency": report,
        "loop_started_at": loop_started_at,
        "data_ready_at": data_ready_at,
        "first_step_at": epochs.first_step_at,
        "memory_limit": confined
        and {"mechanism": confined.mechanism, "bytes": confined.limit_bytes},
    }


def _prepare_worker(cfg: RunConfig, run_dir: Path, cpus: float, host: hosts.LoopHost):
    """This worker process made ready for the run, before anything of it is built: its memory
    limit (if any), its threads, and the heartbeat the hang doctor reads. Returns (the memory
    confinement or None, the heartbeat)."""
    confined = None
    if cfg.scaling.memory_per_worker:
        confined = worker_memory.confine(
            int(cfg.scaling.memory_per_worker), run_dir.name, parallel.rank()
        )
        print(f"rank {parallel.rank()}: memory limited by {confined.mechanism} ({confined.where})")
    parallel.set_threads(cfg.scaling.threads_per_worker, cpus)
    node_id, node_ip = host.node()
    beat = doctor.Heartbeat(  # where this rank is, and how far it got: for the hang doctor
        run_dir,
        parallel.rank(),
        parallel.world_size(),
        node_id=node_id,
        node_ip=node_ip,
        cpu=parallel.cpu_setup(),
    )
    return confined, beat


@dataclasses.dataclass
class _Start:
    """Where this worker group takes up the run."""

    engine: parallel.Engine
    scheduler: Any
    epoch: int  # the first epoch to train (in part, when resumed mid-epoch)
    steps_done: int  # optimizer steps of that epoch its checkpoint had trained
    epoch_steps: int  # optimizer steps per epoch, at this worker group's size


def _restore(task, cfg: RunConfig, loop_config: dict[str, Any], host: hosts.LoopHost) -> _Start:
    """The model, wrapped for the strategy, with its optimizer and LR schedule, from the
    checkpoint the run starts from (if any), and where in the run it stands."""
    with _opened(_start_checkpoint(loop_config, host)) as directory:
        model = _build_model(task, cfg, directory)
        torch.manual_seed(cfg.seed)  # dropout's stream, however the model was built
        engine, meta, train_state = _build_engine(model, cfg, directory)

    # The world size is known only here: an elastic run may restart with fewer workers.
    steps = steps_per_epoch(
        loop_config["train_rows"], parallel.world_size(), cfg.batch_size, cfg.parallel.grad_accum
    )
    scheduler = build_scheduler(
        cfg.schedule, engine.optimizer, steps, cfg.epochs, run_steps(cfg, steps)
    )
    if meta is None:
        return _Start(engine, scheduler, 1, 0, steps)
    start_epoch, done = meta["epoch"] + 1, _steps_to_skip(meta, cfg, steps)
    if train_state.optimizer is not None:  # a full checkpoint's (a sharded one's is loaded)
        engine.load_optimizer_state(train_state.optimizer)
    engine.load_scaler_state(train_state.scaler)
    _config_hyperparameters_win(engine.optimizer, cfg)
    # The schedule's position follows from the epoch, not from the saved step count: a run
    # resumed on another worker count (or grad_accum) has another number of steps per epoch.
    fast_forward(scheduler, (start_epoch - 1) * steps + done)
    if cfg.checkpoint.step_clocked():  # as the run did after the step training takes up at
        step_clocks.reseed(cfg, (start_epoch - 1) * steps + done)
    return _Start(engine, scheduler, start_epoch, done, steps)


def _steps_to_skip(meta: dict[str, Any], cfg: RunConfig, epoch_steps: int) -> int:
    """The steps of its epoch in progress that a mid-epoch checkpoint had trained, if this
    worker group can skip exactly those samples: the same ranks, batches and steps per epoch
    cut the epoch's seeded order the same way. Else 0: the epoch trains again from its start
    (said on rank 0's output)."""
    done = meta.get("epoch_steps") or 0
    if not done:
        return 0
    saved = meta.get("config") or {}
    same_cut = (
        meta.get("workers") == parallel.world_size()
        and saved.get("batch_size") == cfg.batch_size
        and (saved.get("parallel") or {}).get("grad_accum") == cfg.parallel.grad_accum
        and done < epoch_steps
    )
    if not same_cut and parallel.is_main():
        print(
            f"relay: the checkpoint was taken {done} steps into epoch {meta['epoch'] + 1} by "
            f"{meta.get('workers')} workers; this worker group cuts the epoch differently, so "
            "the epoch trains again from its start"
        )
    return done if same_cut else 0


def _mid_epoch_checkpoint(cfg, run_dir, engine, scheduler, task, host) -> step_clocks.Checkpoint:
    """A checkpoint on a clock in steps or minutes where it strikes mid-epoch (at an epoch's
    end, the epoch's report carries it), with the step report's metrics if one was made at that
    step."""

    def write(epoch: int, step: int, epoch_steps: int, reported: dict[str, Any]) -> None:
        # No "epoch" key: trackers log epochs; this is a resume point.
        validated = {k: v for k, v in reported.items() if k.startswith("val_")}
        metrics = {"step": step, "epoch_in_progress": epoch, "epoch_steps": epoch_steps}
        meta = {"epoch": epoch - 1, "step": step, "epoch_steps": epoch_steps}
        _checkpoint_and_report(
            cfg,
            run_dir,
            {**metrics, **validated},
            meta,
            engine,
            scheduler,
            task,
            host,
            f"step_{step:08d}",
            False,
        )

    return write


def _open_batches(loop_config: dict[str, Any], task, cfg: RunConfig, name: str, shuffle: bool):
    """This rank's batches of split `name`, through the run's ingest (training/data/ingest.py)."""
    return ingest.open_batches(
        loop_config["data"],
        name,
        batch_size=cfg.batch_size,
        dtypes=task.input_columns(),
        device=parallel.device(),
        cache=cfg.data.caches,
        shuffle=shuffle,
        seed=cfg.seed,
        shuffle_buffer=cfg.data.shuffle_buffer,
    )


def _staging_prefix(run_dir: Path) -> str:
    """Each rank writes its part of a checkpoint to a local temp dir that Ray Train copies to
    storage (merging the ranks' parts into one directory)."""
    return f"relay-ckpt-{run_dir.name}-"


def _remove_orphaned_staging(run_dir: Path) -> None:
    """A rank 0 killed mid-write (SIGKILL runs no cleanup) leaves its temp checkpoint dir
    behind; the worker group that replaces it removes this run's leftovers on its nodes."""
    for path in Path(tempfile.gettempdir()).glob(_staging_prefix(run_dir) + "*"):
        shutil.rmtree(path, ignore_errors=True)


def _report(
    cfg: RunConfig, run_dir: Path, epoch, metrics, engine, scheduler, task, host, due, last
):
    """Report an epoch, with a checkpoint if one is `due`; every rank reports (under Ray
    Train, a collective). Rank 0 appends the epoch to the run's history."""
    if parallel.is_main():
        history.append(run_dir, metrics)
    if not due:
        host.report(metrics)
        return
    meta = {"epoch": epoch, "step": metrics["step"]}
    overlapped = cfg.checkpoint.upload == "async" and not last
    _checkpoint_and_report(
        cfg, run_dir, metrics, meta, engine, scheduler, task, host, f"epoch_{epoch:04d}", overlapped
    )


def _checkpoint_and_report(
    cfg: RunConfig,
    run_dir: Path,
    metrics,
    meta,
    engine,
    scheduler,
    task,
    host,
    dir_name,
    overlapped,
) -> None:
    """Report `metrics` with a checkpoint named `dir_name` (its meta.json: `meta` and the run's
    config). Rank 0 writes the meta; the weights and optimizer state come gathered from rank 0
    (full) or from every rank in parallel (sharded).

    Each rank writes its part to a local staging directory that the host copies to storage
    and then deletes: before training goes on (`checkpoint.upload: sync`) or, under Ray Train,
    while it does (`overlapped`, for async uploads). The last epoch's copy is always waited
    for: nothing is left to overlap it with."""
    sharded = cfg.checkpoint.sharded(cfg.parallel.strategy)
    weights, optimizer_state = None, None
    if not sharded:
        weights, optimizer_state = engine.full_state()  # a collective: shards gather on rank 0
        if not parallel.is_main():
            host.report(metrics)
            return
    staging = Path(tempfile.mkdtemp(prefix=_staging_prefix(run_dir)))
    handed_over = False
    try:
        if sharded:
            engine.save_sharded(staging / checkpoint.SHARDS)  # a collective
        if parallel.is_main():
            task.save_assets(staging)  # before meta.json, which save_state writes last
            checkpoint.save_state(
                staging,
                weights=weights,
                optimizer=optimizer_state,
                scheduler=scheduler.state_dict(),
                scaler=engine.scaler_state(),
                meta={
                    **meta,
                    "metrics": metrics,
                    "config": cfg.model_dump(mode="json"),
                    "strategy": cfg.parallel.strategy,
                    "workers": parallel.world_size(),
                },
            )
        handed_over = host.report(metrics, staging, dir_name=dir_name, overlapped=overlapped)
    finally:
        if not handed_over:  # else Ray's copying thread deletes it once the copy is done
            shutil.rmtree(staging, ignore_errors=True)
