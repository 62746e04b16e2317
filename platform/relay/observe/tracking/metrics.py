"""What of a report every tracker records: its finite numbers, the epoch being the step."""

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
