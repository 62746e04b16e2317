"""The epoch itself, in plain torch: optimizer and schedule, the passes over batches, the
statistics they sum, and the cached shard they iterate.

Ray's worker loop (worker_loop.py) and the plain-torchrun baseline (bench/torchrun_ddp.py) both run
this module over the same `parallel.Engine`, so what relay is compared against cannot drift
from what relay does. It imports no Ray (a test checks): Ray's part — the checkpoint to resume
from, the dataset shard, reporting and checkpoint writing — stays in worker_loop.py and data/.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import numpy as np
import torch

from relay import parallel
from relay.config import OptimConfig, RunConfig, ScheduleConfig
from relay.observe.doctor.heartbeat import Heartbeat, NoHeartbeat
from relay.tasks import Task
from relay.tasks.base import Batch

# --- optimizer and schedule --------------------------------------------------------------------

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


def steps_per_epoch(train_rows: int, world: int, batch_size: int, grad_accum: int) -> int:
    """Optimizer steps each rank takes per epoch. Every rank trains floor(rows / world) rows
    (Ray Data's streaming_split(equal=True) under relay; the same slice size under torchrun)."""
    micro_batches = math.ceil(train_rows // world / batch_size)
    return math.ceil(micro_batches / grad_accum)


def run_steps(cfg: RunConfig, steps_per_epoch: int) -> int:
    """Optimizer steps the whole run takes: `max_steps`, else its epochs' steps."""
    return cfg.max_steps or steps_per_epoch * cfg.epochs


def run_epochs(cfg: RunConfig, steps_per_epoch: int) -> int:
    """Epochs the run trains in (with `max_steps`, the last may end mid-epoch)."""
    return math.ceil(cfg.max_steps / max(1, steps_per_epoch)) if cfg.max_steps else cfg.epochs


def build_scheduler(
    cfg: ScheduleConfig,
    optimizer: torch.optim.Optimizer,
    steps_per_epoch: int,
    epochs: int,
    total_steps: int | None = None,
) -> torch.optim.lr_scheduler.LambdaLR:
    """A per-step multiplier of the peak lr: linear warm-up, then constant/cosine/linear decay
    over `total_steps` (default: `epochs` of `steps_per_epoch`)."""
    total = max(1, total_steps or steps_per_epoch * epochs)
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


def fast_forward(scheduler: torch.optim.lr_scheduler.LambdaLR, steps: int) -> None:
    """Put a fresh schedule at optimizer step `steps`, as if it had stepped that often."""
    scheduler.last_epoch = steps - 1
    scheduler.step()


# --- the cached shard --------------------------------------------------------------------------


def to_tensors(
    columns: Mapping[str, np.ndarray], dtypes: dict[str, torch.dtype], device: torch.device
) -> Batch:
    """Columns of rows as tensors of the task's dtypes (`Task.input_columns`) on `device`."""
    out = {}
    for name, array in columns.items():
        tensor = torch.as_tensor(np.ascontiguousarray(array))
        out[name] = tensor.to(device, dtype=dtypes.get(name, tensor.dtype))
    return out


class CachedBatches:
    """A shard held as tensors on the device; each epoch yields its rows in batches, in a
    seeded per-epoch permutation (or in order without `shuffle`). The hot path only indexes."""

    def __init__(self, tensors: Batch, *, batch_size: int, shuffle: bool, seed: int) -> None:
        self._tensors = tensors
        self._batch_size = batch_size
        self._shuffle = shuffle
        self._seed = seed
        self._device = next(iter(tensors.values())).device

    def __len__(self) -> int:
        return len(next(iter(self._tensors.values())))

    def epoch(self, epoch: int) -> Iterator[Batch]:
        n = len(self)
        if self._shuffle:
            # The permutation is drawn on the CPU: the same on every device for a seed.
            generator = torch.Generator().manual_seed(self._seed * 100_003 + epoch)
            order = torch.randperm(n, generator=generator).to(self._device)
        else:
            order = torch.arange(n, device=self._device)
        for start in range(0, n, self._batch_size):
            index = order[start : start + self._batch_size]
            yield {name: tensor[index] for name, tensor in self._tensors.items()}


# --- the passes --------------------------------------------------------------------------------


def _micro_batch_groups(batches: Iterable[Batch], size: int) -> Iterator[list[Batch]]:
    """Consecutive groups of `size` micro-batches: one optimizer step each (the last may be
    shorter)."""
    iterator = iter(batches)
    while group := list(itertools.islice(iterator, size)):
        yield group


class Epochs:
    """Runs training and evaluation epochs over one `parallel.Engine`, and keeps the counts
    the efficiency report needs (samples, seconds, optimizer steps) for this process."""

    def __init__(
        self,
        task: Task,
        engine: parallel.Engine,
        scheduler,
        cfg: RunConfig,
        heartbeat: Heartbeat | NoHeartbeat | None = None,
    ) -> None:
        self.task, self.engine, self.scheduler, self.cfg = task, engine, scheduler, cfg
        # This rank's progress, for the hang doctor: a phase per pass, a beat per step.
        self.heartbeat = heartbeat or NoHeartbeat()
        self.first_step_at: float | None = None
        # Per training pass of this process: samples, throughput units, seconds, steps.
        self.passes: list[dict[str, float]] = []

    def epoch(
        self, number: int, train: Iterable[Batch], val: Iterable[Batch], **pass_options
    ) -> dict[str, Any]:
        """A training pass (`pass_options`: `train`'s) and a validation pass: the epoch's
        metrics as relay reports them. `samples_per_s` is global training samples over this
        rank's training-pass seconds."""
        started = time.perf_counter()
        self.heartbeat.phase("train", number)
        trained = self.train(train, **pass_options)
        self.heartbeat.phase("val", number)
        validated = self.evaluate(val)
        summarize = self.task.summarize
        return {
            "epoch": number,
            **{f"train_{k}": v for k, v in summarize(trained).items()},
            **{f"val_{k}": v for k, v in summarize(validated).items()},
            "samples_per_s": trained["count"] / trained["train_s"],
            # Share of the training pass the ranks spent waiting for their next batch: near 0
            # when the input keeps up, near 1 when it starves the trainers.
            "input_wait_share": trained["input_wait_s"]
            / (trained["train_s"] * parallel.world_size()),
            "epoch_s": time.perf_counter() - started,
            "lr": self.scheduler.get_last_lr()[0],
            "workers": parallel.world_size(),
        }

    def train(
        self,
        batches: Iterable[Batch],
        *,
        max_steps: int | None = None,
        after_step: Callable[[int, Batch], None] | None = None,
    ) -> dict[str, float]:
        """One training pass: all of `batches`, or its first `max_steps` optimizer steps.
        `after_step(steps, sums)` runs after each step with this rank's statistics so far
        (every rank, at the same steps: a mid-epoch report or checkpoint may be a collective);
        its time is not the pass's.

        Statistics stay on the device and are summed across ranks once at the end, so the hot
        path never waits on a host sync or a collective of its own. The pass's clock stops
        before that sum: it times the steps, not the statistics."""
        engine = self.engine
        engine.model.train()
        sums: Batch = defaultdict(lambda: torch.zeros((), dtype=torch.float64))
        started = time.perf_counter()
        steps = 0
        outside = 0.0  # seconds spent in after_step
        waiting = _InputClock(batches)
        groups = _micro_batch_groups(waiting, self.cfg.parallel.grad_accum)
        for group in itertools.islice(groups, max_steps):
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
            self.heartbeat.step()
            if self.first_step_at is None:
                self.first_step_at = time.time()
            if after_step is not None:
                paused = time.perf_counter()
                after_step(steps, sums)
                outside += time.perf_counter() - paused
        parallel.synchronize()
        elapsed = time.perf_counter() - started - outside
        sums["input_wait_s"] = torch.tensor(waiting.seconds, dtype=torch.float64)
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
                self.heartbeat.tick()
        return parallel.sum_across_ranks(sums)


class _InputClock:
    """Iterates `batches`, adding up the seconds spent waiting for each next one."""

    def __init__(self, batches: Iterable[Batch]) -> None:
        self._batches = iter(batches)
        self.seconds = 0.0

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        started = time.perf_counter()
        try:
            return next(self._batches)
        finally:
            self.seconds += time.perf_counter() - started


def _accumulate(sums: Batch, stats: Batch) -> None:
    for name, value in stats.items():
        sums[name] = sums[name].to(value.device) + value.detach().double()
