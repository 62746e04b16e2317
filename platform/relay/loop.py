"""THE train loop: `train_loop_per_worker` runs on every Ray Train worker, for `relay train`,
for every Tune trial, and in the tests.

Only Ray's part of a worker lives here: the checkpoint to resume from, this rank's data (opened
through the run's ingest, relay/ingest.py), reporting each epoch and writing checkpoints. The
epoch itself (optimizer, schedule, passes, statistics) is epochs.py, which the plain-torchrun
baseline runs too; distributed concerns (ranks, wrapping, reductions) live in relay/parallel/; the
problem-specific parts (model, data, loss, metrics) in the task.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import ray.train
import ray.train.torch
import torch
from torch import nn

from relay import checkpoint, efficiency, history, ingest, parallel, worker_logs
from relay.config import RunConfig
from relay.epochs import Epochs, build_scheduler, fast_forward, optimizer_spec, steps_per_epoch
from relay.tasks import build_task


def _restore(model: nn.Module, ckpt: ray.train.Checkpoint | None) -> tuple[int, Any]:
    """Load the latest checkpoint's full weights into the plain model (before any strategy
    wraps or shards it); returns (next epoch, train state)."""
    if ckpt is None:
        return 1, None
    with ckpt.as_directory() as directory:
        checkpoint.load_weights(directory, model)
        meta = checkpoint.read_meta(directory)
        state = checkpoint.load_train_state(directory)
    return meta["epoch"] + 1, state


def _start_checkpoint(loop_config: dict[str, Any]) -> ray.train.Checkpoint | None:
    """The run's own latest checkpoint; else the one it was started from (a PBT exploit)."""
    own = ray.train.get_checkpoint()
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
    """Train `loop_config["run"]` (a RunConfig as a dict) on this worker; see trainer.py.
    What the worker prints is also kept in the run's logs/ (`relay runs logs`)."""
    run_dir = Path(loop_config["run_dir"])
    with worker_logs.captured(run_dir, parallel.rank(), parallel.world_size()):
        return _train(loop_config)


def _train(loop_config: dict[str, Any]) -> dict[str, Any] | None:
    loop_started_at = time.time()
    parallel.set_device(ray.train.torch.get_device())
    memory_at_start = parallel.current_memory()  # the worker process before any training state
    cfg = RunConfig.model_validate(loop_config["run"])
    run_dir = Path(loop_config["run_dir"])
    parallel.set_threads(cfg.scaling.threads_per_worker, loop_config["cpus_per_worker"])

    # Same seed on every rank: identical initial weights (DDP also broadcasts rank 0's).
    torch.manual_seed(cfg.seed)
    task = build_task(cfg.task, cfg.size, cfg.model, cfg.data.path)
    model = task.build_model()
    start_epoch, train_state = _restore(model, _start_checkpoint(loop_config))
    # Before any rank can checkpoint again (the engine's set-up is a collective).
    _remove_orphaned_staging(run_dir)
    engine = parallel.Engine(model, cfg.parallel, *optimizer_spec(cfg.optim))

    # The world size is known only here: an elastic run may restart with fewer workers.
    steps = steps_per_epoch(
        loop_config["train_rows"], parallel.world_size(), cfg.batch_size, cfg.parallel.grad_accum
    )
    scheduler = build_scheduler(cfg.schedule, engine.optimizer, steps, cfg.epochs)
    if train_state is not None:
        engine.load_optimizer_state(train_state.optimizer)
        engine.load_scaler_state(train_state.scaler)
        _config_hyperparameters_win(engine.optimizer, cfg)
        # The schedule's position follows from the epoch, not from the saved step count: a run
        # resumed on another worker count (or grad_accum) has another number of steps per epoch.
        fast_forward(scheduler, (start_epoch - 1) * steps)

    def batches(name: str, shuffle: bool):
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

    train_data, val_data = batches("train", cfg.data.shuffle), batches("val", False)
    train_data.load()
    val_data.load()
    data_ready_at = time.time()

    epochs = Epochs(task, engine, scheduler, cfg)
    for epoch in range(start_epoch, cfg.epochs + 1):
        following = epoch + 1 if epoch < cfg.epochs else None
        train = train_data.epoch(epoch, next_epoch=following)
        metrics = epochs.epoch(epoch, train, val_data.epoch(epoch))
        _report(cfg, run_dir, epoch, metrics, engine, scheduler, task)

    report = None
    if epochs.passes:
        probe = next(iter(train_data.epoch(0)))
        report = efficiency.measure(task, engine, epochs, probe, cfg, memory_at_start)
    digests = parallel.gather_objects(engine.replica_digest())
    if not parallel.is_main():
        return None
    return {
        "replica_digests": digests,
        "start_epoch": start_epoch,
        "efficiency": report,
        "loop_started_at": loop_started_at,
        "data_ready_at": data_ready_at,
        "first_step_at": epochs.first_step_at,
    }


def _staging_prefix(run_dir: Path) -> str:
    """Rank 0 writes each checkpoint to a local temp dir that Ray Train copies to storage."""
    return f"relay-ckpt-{run_dir.name}-"


def _remove_orphaned_staging(run_dir: Path) -> None:
    """A rank 0 killed mid-write (SIGKILL runs no cleanup) leaves its temp checkpoint dir
    behind; the worker group that replaces it removes this run's leftovers on its nodes."""
    for path in Path(tempfile.gettempdir()).glob(_staging_prefix(run_dir) + "*"):
        shutil.rmtree(path, ignore_errors=True)


def _report(cfg: RunConfig, run_dir: Path, epoch: int, metrics, engine, scheduler, task):
    """Report an epoch; every rank calls `ray.train.report` (a collective), rank 0 alone
    attaches the checkpoint and appends the epoch to the run's history."""
    if parallel.is_main():
        history.append(run_dir, metrics)
    if not (epoch % cfg.checkpoint.every == 0 or epoch == cfg.epochs):
        ray.train.report(metrics)
        return
    weights, optimizer_state = engine.full_state()  # a collective: shards gather on rank 0
    if not parallel.is_main():
        ray.train.report(metrics)
        return
    with tempfile.TemporaryDirectory(prefix=_staging_prefix(run_dir)) as tmp:
        task.save_assets(Path(tmp))  # before meta.json, which save_state writes last
        checkpoint.save_state(
            tmp,
            weights=weights,
            optimizer=optimizer_state,
            scheduler=scheduler.state_dict(),
            scaler=engine.scaler_state(),
            meta={
                "epoch": epoch,
                "metrics": metrics,
                "config": cfg.model_dump(mode="json"),
                "strategy": cfg.parallel.strategy,
                "workers": parallel.world_size(),
            },
        )
        ray.train.report(
            metrics,
            checkpoint=ray.train.Checkpoint.from_directory(tmp),
            checkpoint_dir_name=f"epoch_{epoch:04d}",
        )
