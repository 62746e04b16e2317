"""THE train loop: `train_loop_per_worker` runs on every Ray Train worker, for `relay train`,
for every Tune trial, and in the tests.

Distributed concerns (ranks, wrapping, reductions) live in parallel.py; the problem-specific
parts (model, data, loss, metrics) live in the task. What remains here is the epoch.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import signal
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import ray.train
import torch
from torch import nn

from relay import checkpoint, efficiency, history, parallel
from relay.config import FaultInjection, OptimConfig, RunConfig, ScheduleConfig
from relay.data import ShardBatches
from relay.tasks import Task, build_task
from relay.tasks.base import Batch

OPTIMIZERS = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam, "sgd": torch.optim.SGD}


def optimizer_spec(cfg: OptimConfig) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    """(optimizer class, its keyword arguments): a strategy may build it over a shard."""
    kwargs: dict[str, Any] = {"lr": cfg.lr, "weight_decay": cfg.weight_decay}
    if cfg.name == "sgd":
        kwargs["momentum"] = cfg.momentum
    return OPTIMIZERS[cfg.name], kwargs


def build_optimizer(cfg: OptimConfig, params) -> torch.optim.Optimizer:
    optimizer_class, kwargs = optimizer_spec(cfg)
    return optimizer_class(params, **kwargs)


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


def _fast_forward(scheduler: torch.optim.lr_scheduler.LambdaLR, steps: int) -> None:
    """Put a fresh schedule at optimizer step `steps`, as if it had stepped that often."""
    scheduler.last_epoch = steps - 1
    scheduler.step()


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


def _micro_batch_groups(batches: Iterable[Batch], size: int) -> Iterator[list[Batch]]:
    """Consecutive groups of `size` micro-batches: one optimizer step each (the last may be
    shorter)."""
    iterator = iter(batches)
    while group := list(itertools.islice(iterator, size)):
        yield group


class Epochs:
    """Runs training and evaluation epochs over one `parallel.Engine`, and keeps the counts
    the efficiency report needs (samples, seconds, optimizer steps) for this process."""

    def __init__(self, task: Task, engine: parallel.Engine, scheduler, cfg: RunConfig) -> None:
        self.task, self.engine, self.scheduler, self.cfg = task, engine, scheduler, cfg
        self.first_step_at: float | None = None
        # Per training pass of this process: samples, throughput units, seconds, steps.
        self.passes: list[dict[str, float]] = []

    def train(self, batches: Iterable[Batch]) -> dict[str, float]:
        """One training pass. Statistics stay on the device and are summed across ranks once
        at the end, so the hot path never waits on a host sync or a collective of its own."""
        engine = self.engine
        engine.model.train()
        sums: Batch = defaultdict(lambda: torch.zeros((), dtype=torch.float64))
        started = time.perf_counter()
        steps = 0
        for group in _micro_batch_groups(batches, self.cfg.parallel.grad_accum):
            engine.zero_grad()
            for i, batch in enumerate(group):
                # Gradients are synchronised once per optimizer step, on its last micro-batch.
                with engine.micro_step(sync=i == len(group) - 1):
                    loss, stats = self.task.loss_and_stats(engine.model, batch)
                    engine.backward(loss / len(group))
                _accumulate(sums, stats)
            engine.step(self.cfg.optim.grad_clip)
            self.scheduler.step()
            steps += 1
            if self.first_step_at is None:
                self.first_step_at = time.time()
        parallel.synchronize()
        elapsed = time.perf_counter() - started
        totals = parallel.sum_across_ranks(sums)
        self.passes.append(
            {
                "samples": totals["count"],
                "units": totals.get(self.task.throughput_stat, totals["count"]),
                "seconds": elapsed,
                "steps": steps,
            }
        )
        return {**totals, "train_s": elapsed}

    def steady(self) -> dict[str, float]:
        """Totals over this process's training passes, the first left out when there are more
        (it pays for warm-up: allocator, compilation, caches)."""
        passes = self.passes[1:] if len(self.passes) > 1 else self.passes
        total = {key: sum(p[key] for p in passes) for key in passes[0]}
        return {**total, "passes": len(passes), "warmup_excluded": len(passes) < len(self.passes)}

    @torch.no_grad()
    def evaluate(self, batches: Iterable[Batch]) -> dict[str, float]:
        self.engine.model.eval()
        sums: Batch = defaultdict(lambda: torch.zeros((), dtype=torch.float64))
        with self.engine.autocast():
            for batch in batches:
                _accumulate(sums, self.task.loss_and_stats(self.engine.model, batch)[1])
        return parallel.sum_across_ranks(sums)


def _accumulate(sums: Batch, stats: Batch) -> None:
    for name, value in stats.items():
        sums[name] = sums[name].to(value.device) + value.detach().double()


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


def train_loop_per_worker(loop_config: dict[str, Any]) -> dict[str, Any] | None:
    """Train `loop_config["run"]` (a RunConfig as a dict) on this worker; see trainer.py."""
    loop_started_at = time.time()
    memory_at_start = parallel.current_memory()  # the worker process before any training state
    cfg = RunConfig.model_validate(loop_config["run"])
    run_dir = Path(loop_config["run_dir"])
    parallel.set_threads(cfg.scaling.threads_per_worker, loop_config["cpus_per_worker"])

    # Same seed on every rank: identical initial weights (DDP also broadcasts rank 0's).
    torch.manual_seed(cfg.seed)
    task = build_task(cfg.task, cfg.size, cfg.model, cfg.data.path)
    model = task.build_model()
    start_epoch, train_state = _restore(model, ray.train.get_checkpoint())
    engine = parallel.Engine(model, cfg.parallel, *optimizer_spec(cfg.optim))

    # The world size is known only here: an elastic run may restart with fewer workers.
    # streaming_split(equal=True) gives each worker floor(rows / workers) rows.
    rows_per_worker = loop_config["train_rows"] // parallel.world_size()
    micro_batches = math.ceil(rows_per_worker / cfg.batch_size)
    steps_per_epoch = math.ceil(micro_batches / cfg.parallel.grad_accum)
    scheduler = build_scheduler(cfg.schedule, engine.optimizer, steps_per_epoch, cfg.epochs)
    if train_state is not None:
        engine.load_optimizer_state(train_state.optimizer)
        engine.load_scaler_state(train_state.scaler)
        # The schedule's position follows from the epoch, not from the saved step count: a run
        # resumed on another worker count (or grad_accum) has another number of steps per epoch.
        _fast_forward(scheduler, (start_epoch - 1) * steps_per_epoch)

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
    data_ready_at = time.time()

    epochs = Epochs(task, engine, scheduler, cfg)
    for epoch in range(start_epoch, cfg.epochs + 1):
        _maybe_inject_fault(cfg.fault_injection, epoch, run_dir)
        started = time.perf_counter()
        train = epochs.train(train_data.epoch(epoch))
        val = epochs.evaluate(val_data.epoch(epoch))
        metrics = {
            "epoch": epoch,
            **{f"train_{k}": v for k, v in task.summarize(train).items()},
            **{f"val_{k}": v for k, v in task.summarize(val).items()},
            "samples_per_s": train["count"] / train["train_s"],
            "epoch_s": time.perf_counter() - started,
            "lr": scheduler.get_last_lr()[0],
            "workers": parallel.world_size(),
        }
        _report(cfg, run_dir, epoch, metrics, engine, scheduler)

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


def _report(cfg: RunConfig, run_dir: Path, epoch: int, metrics, engine, scheduler):
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
    with tempfile.TemporaryDirectory(prefix="relay-ckpt-") as tmp:
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
