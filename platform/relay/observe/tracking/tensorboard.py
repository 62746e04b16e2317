"""TensorBoard: event files (tensorboardX, which Ray already installs) in `<run_dir>/tensorboard`,
one scalar per numeric metric with the epoch as its step, grouped as TensorBoard shows them:
`train/loss`, `val/accuracy`, `run/samples_per_s`; the step clocks' reports under `step/`
(`step/train_loss`, `step/val_loss`, `step/lr`) with the optimizer step as theirs. A resumed
run writes to the same directory; TensorBoard reads its files as one run.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import ray.train

from relay.observe.tracking import failures
from relay.observe.tracking.metrics import numeric_metrics, step_metrics

TENSORBOARD_DIR = "tensorboard"
TRACKER = "tensorboard"  # its failure mark in a run's directory: see failures.py


def scalar_tags(metrics: dict[str, Any]) -> dict[str, float]:
    """A report's numeric metrics under TensorBoard tags (`train_loss` → `train/loss`); the
    epoch is the step, not a scalar."""
    tags = {}
    for name, value in numeric_metrics(metrics).items():
        group, _, rest = name.partition("_")
        tag = f"{group}/{rest}" if group in ("train", "val") and rest else f"run/{name}"
        tags[tag] = value
    return tags


class TensorBoardTracker(ray.train.UserCallback):
    """Rank 0's report of each epoch as TensorBoard scalars (runs on the controller).

    Each report is written by a writer of its own, closed before the callback returns:
    tensorboardX writes from a background thread that `flush()` does not wait for, and only
    `close()` drains it, so an epoch is on disk when the next step of training begins (and
    survives the controller's exit). One small event file per epoch; TensorBoard reads a
    directory's files as one run."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = Path(run_dir)
        self.logdir = self.run_dir / TENSORBOARD_DIR
        self._broken = False  # also where no mark can be written (see failures.mark)

    def after_report(self, run_context, metrics: list[dict[str, Any]], checkpoint) -> None:
        if self._broken or not metrics or "epoch" not in metrics[0]:
            return
        if failures.failed(self.run_dir, TRACKER):
            return
        report, epoch = metrics[0], int(metrics[0]["epoch"])
        self._write([(scalar_tags(report), epoch)], f"{epoch}", "history.jsonl has every epoch")

    def write_steps(self, records: list[dict[str, Any]]) -> None:
        """Step reports (steps.jsonl's records), written by the driver as rank 0 appends them."""
        if self._broken or not records or failures.failed(self.run_dir, TRACKER):
            return
        scalars = [(step_metrics(r), int(r["step"])) for r in records]
        self._write(scalars, f"step{scalars[0][1]}", "steps.jsonl has every step report")

    def _write(self, scalars: list[tuple[dict[str, float], int]], suffix: str, kept: str) -> None:
        """`(tags and values, step)` pairs in an event file of their own, on disk when this
        returns."""
        try:
            from tensorboardX import SummaryWriter

            # The suffix keeps two writes within one second in files of their own.
            writer = SummaryWriter(
                logdir=str(self.logdir), filename_suffix=f".{os.getpid()}.{suffix}"
            )
            try:
                for tags, step in scalars:
                    for tag, value in tags.items():
                        writer.add_scalar(tag, value, global_step=step)
            finally:
                writer.close()
        except OSError as error:
            self._broken = True
            failures.mark(
                self.run_dir,
                TRACKER,
                f"relay: TensorBoard files in {self.logdir} could not be written "
                f"({error.strerror or error}); training goes on, {kept}",
            )
