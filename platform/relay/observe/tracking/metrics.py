"""What of a report every tracker records: its finite numbers, the epoch being the step; a step
report's (`report.every_steps`, history's steps.jsonl) under `step/`, the optimizer step being
the step."""

from __future__ import annotations

import math
from numbers import Real
from typing import Any


def numeric_metrics(report: dict[str, Any]) -> dict[str, float]:
    """The report's finite numeric metrics (not the epoch, not flags or text)."""
    return {
        name: float(value)
        for name, value in report.items()
        if name != "epoch"
        and not isinstance(value, bool)
        and isinstance(value, Real)
        and math.isfinite(value)
    }


# A step report's fields that place it (x-axes and the time it was written), not metrics.
_PLACE = {"epoch", "step", "time"}


def step_metrics(record: dict[str, Any]) -> dict[str, float]:
    """A step report's metrics under `step/` (`step/train_loss`, `step/val_loss`, `step/lr`):
    names of their own, so that the epoch reports' curves (x: epoch) and the step reports'
    (x: optimizer step) are never one series."""
    return {
        f"step/{name}": value
        for name, value in numeric_metrics(record).items()
        if name not in _PLACE
    }
