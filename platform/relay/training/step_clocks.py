"""The run's clocks in optimizer steps, between epoch ends: a report (`report.every_steps`), a
bounded validation (`validation.every_steps`, `validation.max_batches`) and a checkpoint
(`checkpoint.every_steps`). What runs after a step of the training pass; at an epoch's end the
epoch's own report, validation and checkpoint take over.

Every rank runs the same steps, so every rank reaches a clock's step together: the sums across
ranks, the validation and the checkpoint below are collectives.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from relay import parallel
from relay.config import RunConfig
from relay.records import history
from relay.tasks.base import Batch
from relay.training.epochs import Epochs

# (epoch in progress, run step, steps of the epoch, the step report's metrics or {})
Checkpoint = Callable[[int, int, int, dict[str, Any]], None]


def on(step: int, every: int | None) -> bool:
    """Whether a clock of period `every` (None: no clock) strikes at `step`."""
    return every is not None and step % every == 0


def any_clock(cfg: RunConfig) -> bool:
    every = (cfg.report.every_steps, cfg.validation.every_steps, cfg.checkpoint.every_steps)
    return any(e is not None for e in every)


class StepClocks:
    """The after-step hook of each training pass (`Epochs.train`'s `after_step`)."""

    def __init__(
        self, cfg: RunConfig, run_dir: Path, epochs: Epochs, val_data, checkpoint: Checkpoint
    ) -> None:
        self.cfg, self.run_dir, self.epochs = cfg, run_dir, epochs
        self.val_data, self.checkpoint = val_data, checkpoint

    def for_pass(self, epoch: int, steps_before: int, epoch_steps: int, total_steps: int):
        """The hook for epoch `epoch`'s pass (the run had trained `steps_before` steps when
        the epoch began); None without a step clock."""
        if not any_clock(self.cfg):
            return None
        since: dict[str, Any] = {"sums": {}, "at": time.perf_counter()}

        def after_step(steps: int, sums: Batch) -> None:
            step = steps_before + steps
            if steps >= epoch_steps or step >= total_steps:
                return  # the epoch's (or the run's) end: its own report follows
            cfg = self.cfg
            validate = on(step, cfg.validation.every_steps)
            metrics: dict[str, Any] = {}
            if validate or on(step, cfg.report.every_steps):
                metrics = self._report(epoch, step, sums, since, validate)
            if on(step, cfg.checkpoint.every_steps):
                self.checkpoint(epoch, step, steps, metrics)

        return after_step

    def _report(self, epoch: int, step: int, sums: Batch, since: dict, validate: bool) -> dict:
        """The step report: training metrics of the steps since the previous one (summed
        across ranks), and a bounded validation's if `validate`. Rank 0 appends it."""
        task, engine = self.epochs.task, self.epochs.engine
        previous = since["sums"]
        interval = {k: v - previous.get(k, 0.0) for k, v in sums.items()}
        since["sums"] = {k: v.clone() for k, v in sums.items()}
        totals = parallel.sum_across_ranks(interval)
        now = time.perf_counter()
        metrics: dict[str, Any] = {
            "epoch": epoch,
            "step": step,
            **{f"train_{k}": v for k, v in task.summarize(totals).items()},
            "samples_per_s": totals["count"] / max(now - since["at"], 1e-9),
            "lr": self.epochs.scheduler.get_last_lr()[0],
        }
        since["at"] = now
        if validate:
            self.epochs.heartbeat.phase("val", epoch)
            batches = itertools.islice(self.val_data.epoch(epoch), self.cfg.validation.max_batches)
            validated = self.epochs.evaluate(batches)
            metrics.update({f"val_{k}": v for k, v in task.summarize(validated).items()})
            engine.model.train()
            self.epochs.heartbeat.phase("train", epoch)
        if parallel.is_main():
            history.append_step(self.run_dir, metrics)
        return metrics
