"""The run's clocks between epoch ends: a report (`report.every_steps`), a bounded validation
(`validation.every_steps`, `validation.max_batches`) and a checkpoint (`checkpoint.every_steps`,
`checkpoint.every_minutes`). What runs after a step of the training pass; at an epoch's end the
epoch's own report, validation and checkpoint take over.

Every rank runs the same steps, so every rank reaches a clock's step together: the sums across
ranks, the validation and the checkpoint below are collectives. The wall clock is rank 0's (the
ranks' clocks would cross a minute at different steps), sent to every rank by a collective of
one number every MINUTES_CHECK_STEPS steps.

A run checkpointed mid-epoch restarts the random stream (dropout's) after every step from
(seed, step), so a run resumed at any step draws what the uninterrupted run drew after it.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from relay import parallel
from relay.config import RunConfig
from relay.records import history
from relay.tasks.base import Batch
from relay.training.epochs import Epochs

# (epoch in progress, run step, steps of the epoch, the step report's metrics or {})
Checkpoint = Callable[[int, int, int, dict[str, Any]], None]

# How often (in steps) the minutes clock is looked at mid-epoch: its collective then costs a
# tenth of one per step, and a clock of minutes strikes at most 10 steps late.
MINUTES_CHECK_STEPS = 10


def on(step: int, every: int | None) -> bool:
    """Whether a clock of period `every` (None: no clock) strikes at `step`."""
    return every is not None and step % every == 0


def any_clock(cfg: RunConfig) -> bool:
    every = (cfg.report.every_steps, cfg.validation.every_steps)
    return any(e is not None for e in every) or cfg.checkpoint.step_clocked()


def reseed(cfg: RunConfig, step: int) -> None:
    """The random stream (dropout's) from (seed, step): where training goes on after `step`."""
    torch.manual_seed(cfg.seed * 1_000_003 + step)


class StepClocks:
    """The after-step hook of each training pass (`Epochs.train`'s `after_step`)."""

    def __init__(
        self, cfg: RunConfig, run_dir: Path, epochs: Epochs, val_data, checkpoint: Checkpoint
    ) -> None:
        self.cfg, self.run_dir, self.epochs = cfg, run_dir, epochs
        self.val_data, self.checkpoint = val_data, checkpoint
        self.checkpointed_at = time.monotonic()  # rank 0's: see minutes_due

    def checkpointed(self) -> None:
        """A checkpoint was made (mid-epoch, or at an epoch's end): the minutes clock restarts."""
        self.checkpointed_at = time.monotonic()

    def minutes_due(self) -> bool:
        """Whether `checkpoint.every_minutes` have passed since the last checkpoint, by rank 0's
        clock; a collective (every rank calls it at the same step)."""
        every = self.cfg.checkpoint.every_minutes
        if every is None:
            return False
        passed = parallel.is_main() and time.monotonic() - self.checkpointed_at >= every * 60
        return parallel.sum_across_ranks({"due": torch.tensor(float(passed))})["due"] > 0

    def for_pass(self, epoch: int, first_step: int, done: int, epoch_steps: int, total_steps: int):
        """The hook for epoch `epoch`'s pass, which begins after the run's step `first_step`,
        `done` steps into the epoch (a resumed epoch's: the steps its checkpoint had trained);
        None without a clock between epoch ends."""
        if not any_clock(self.cfg):
            return None
        since: dict[str, Any] = {"sums": {}, "at": time.perf_counter()}
        cfg = self.cfg

        def after_step(steps: int, sums: Batch) -> None:
            step, into_epoch = first_step + steps, done + steps
            if into_epoch < epoch_steps and step < total_steps:  # else the epoch's own report
                validate = on(step, cfg.validation.every_steps)
                metrics: dict[str, Any] = {}
                if validate or on(step, cfg.report.every_steps):
                    metrics = self._report(epoch, step, sums, since, validate)
                if on(step, cfg.checkpoint.every_steps) or (
                    on(step, MINUTES_CHECK_STEPS) and self.minutes_due()
                ):
                    self.checkpoint(epoch, step, into_epoch, metrics)
                    self.checkpointed()
            if cfg.checkpoint.step_clocked():
                reseed(cfg, step)  # before the next step, whatever ran after this one

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
