"""THE train loop: `train_loop_per_worker` runs on every Ray Train worker, for `relay train`,
for every Tune trial, and in the tests.

Distributed concerns (ranks, wrapping, reductions) live in parallel.py; the problem-specific
parts (model, data, loss, metrics) live in the task. What remains here is the epoch.
"""

from __future__ import annotations

import json
import math
import os
import signal
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import ray.train
import torch
from torch import nn

from relay import checkpoint, history, parallel
from relay.config import FaultInjection, OptimConfig, RunConfig, ScheduleConfig
from relay.data import ShardBatches
from relay.tasks import Task, build_task
from relay.tasks.base import Batch


def build_optimizer(cfg: OptimConfig, params) -> torch.optim.Optimizer:
    if cfg.name == "sgd":
        return torch.optim.SGD(
            params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay
        )
    optimizer_cls = torch.optim.AdamW if cfg.name == "adamw" else torch.optim.Adam
    return optimizer_cls(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


def build_scheduler(
    cfg: ScheduleConfig, optimizer: torch.optim.Optimizer, steps_per_epoch: int, epochs: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """A per-step multiplier of the peak lr: linear warm-up, then constant/cosine/linear decay."""
    total = max(1, steps_per_epoch * epochs)
    warmup = round(cfg.warmup_epochs * steps_per_epoch)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if cfg.name == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        shape = 0.5 * (1 + math.cos(math.pi * progress)) if cfg.name == "cosine" else 1 - progress
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * shape

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def _maybe_inject_fault(cfg: FaultInjection, epoch: int, run_dir: Path) -> None:
    """Testing aid: SIGKILL this worker process once, to prove recovery from a real death.

    It first waits (a while, not forever) until Ray Train has registered the previous epoch's
    checkpoint: a checkpoint reported just before a crash may not be registered yet, and the
    aid is meant to show what a registered checkpoint saves, not to race the controller.
    """
    if cfg.kill_rank != parallel.rank() or cfg.kill_at_epoch != epoch:
        return
    marker = run_dir / f".fault-injected-rank{cfg.kill_rank}"
    if marker.exists():
        return
    snapshot = run_dir / "checkpoint_manager_snapshot.json"  # Ray Train's record of checkpoints
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            latest = json.loads(snapshot.read_text())["latest_checkpoint_result"]["metrics"]
            if latest["epoch"] >= epoch - 1:
                break
        except (OSError, ValueError, KeyError, TypeError):
            pass
        time.sleep(0.1)
    marker.write_text(f"killed at epoch {epoch}\n")
    os.kill(os.getpid(), signal.SIGKILL)


def _run_epoch(
    task: Task,
    model: nn.Module,
    batches,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler=None,
    grad_clip: float | None = None,
) -> dict[str, float]:
    """One pass over `batches`; trains when given an optimizer, else evaluates.

    Statistics stay on the device and are summed across ranks once at the end, so the hot path
    never waits on a host sync or a collective of its own.
    """
    training = optimizer is not None
    model.train(training)
    sums: Batch = defaultdict(lambda: torch.zeros((), dtype=torch.float64))
    with torch.set_grad_enabled(training):
        for batch in batches:
            loss, stats = task.loss_and_stats(model, batch)
            if training:
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                if grad_clip is not None:
                    nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
                optimizer.step()
                scheduler.step()
            for name, value in stats.items():
                sums[name] = sums[name].to(value.device) + value.detach().double()
    return parallel.sum_across_ranks(sums)


def _restore(model: nn.Module, ckpt: ray.train.Checkpoint | None) -> tuple[int, Any]:
    """Load the latest checkpoint into the plain model; returns (next epoch, train state)."""
    if ckpt is None:
        return 1, None
    with ckpt.as_directory() as directory:
        checkpoint.load_weights(directory, model)
        meta = checkpoint.read_meta(directory)
        state = checkpoint.load_train_state(directory)
    return meta["epoch"] + 1, state


def train_loop_per_worker(loop_config: dict[str, Any]) -> dict[str, Any] | None:
    """Train `loop_config["run"]` (a RunConfig as a dict) on this worker; see train.py."""
    cfg = RunConfig.model_validate(loop_config["run"])
    run_dir = Path(loop_config["run_dir"])
    parallel.set_threads(cfg.scaling.threads_per_worker, loop_config["cpus_per_worker"])

    # Same seed on every rank: identical initial weights (DDP also broadcasts rank 0's).
    torch.manual_seed(cfg.seed)
    task = build_task(cfg.task, cfg.size, cfg.model, cfg.data.path)
    model = task.build_model()
    start_epoch, train_state = _restore(model, ray.train.get_checkpoint())
    model = parallel.wrap_model(model)

    optimizer = build_optimizer(cfg.optim, model.parameters())
    steps_per_epoch = math.ceil(loop_config["train_rows_per_worker"] / cfg.batch_size)
    scheduler = build_scheduler(cfg.schedule, optimizer, steps_per_epoch, cfg.epochs)
    if train_state is not None:
        optimizer.load_state_dict(train_state.optimizer)
        scheduler.load_state_dict(train_state.scheduler)

    def batches(name: str, shuffle: bool) -> ShardBatches:
        return ShardBatches(
            name,
            batch_size=cfg.batch_size,
            dtypes=task.input_columns(),
            device=parallel.device(),
            cache=cfg.data.cache,
            shuffle=shuffle,
            seed=cfg.seed,
        )

    train_data, val_data = batches("train", cfg.data.shuffle), batches("val", False)
    train_data.load()
    val_data.load()

    for epoch in range(start_epoch, cfg.epochs + 1):
        _maybe_inject_fault(cfg.fault_injection, epoch, run_dir)
        started = time.perf_counter()
        train = _run_epoch(
            task,
            model,
            train_data.epoch(epoch),
            optimizer=optimizer,
            scheduler=scheduler,
            grad_clip=cfg.optim.grad_clip,
        )
        train_s = time.perf_counter() - started
        val = _run_epoch(task, model, val_data.epoch(epoch))
        metrics = {
            "epoch": epoch,
            **{f"train_{k}": v for k, v in task.summarize(train).items()},
            **{f"val_{k}": v for k, v in task.summarize(val).items()},
            "samples_per_s": train["count"] / train_s,
            "epoch_s": time.perf_counter() - started,
            "lr": scheduler.get_last_lr()[0],
        }
        _report(cfg, run_dir, epoch, metrics, model, optimizer, scheduler)

    digests = parallel.gather_objects(parallel.state_digest(model))
    if not parallel.is_main():
        return None
    return {"replica_digests": digests, "start_epoch": start_epoch}


def _report(cfg: RunConfig, run_dir: Path, epoch: int, metrics, model, optimizer, scheduler):
    """Report an epoch; every rank calls `ray.train.report` (a collective), rank 0 alone
    attaches the checkpoint and appends the epoch to the run's history."""
    if parallel.is_main():
        history.append(run_dir, metrics)
    due = epoch % cfg.checkpoint.every == 0 or epoch == cfg.epochs
    if not (due and parallel.is_main()):
        ray.train.report(metrics)
        return
    with tempfile.TemporaryDirectory(prefix="relay-ckpt-") as tmp:
        checkpoint.save(
            tmp,
            parallel.unwrap(model),
            optimizer=optimizer,
            scheduler=scheduler,
            meta={"epoch": epoch, "metrics": metrics, "config": cfg.model_dump(mode="json")},
        )
        ray.train.report(
            metrics,
            checkpoint=ray.train.Checkpoint.from_directory(tmp),
            checkpoint_dir_name=f"epoch_{epoch:04d}",
        )
