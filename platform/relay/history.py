"""A run's per-epoch metrics, appended by rank 0 to `<run dir>/history.jsonl` as they happen.

The driver follows the file to print progress; `relay runs show` and the tests read it back.
After a restart an epoch may be trained again; the last record of an epoch wins.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

FILE = "history.jsonl"


def append(run_dir: str | Path, metrics: dict[str, Any]) -> None:
    """Append an epoch, stamped with the wall-clock time it ended (start-up is measured off it)."""
    with open(Path(run_dir) / FILE, "a") as f:
        f.write(json.dumps({**metrics, "time": time.time()}) + "\n")


def read_raw(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every record in order written, restarts included."""
    path = Path(run_dir) / FILE
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a line cut short by a killed writer
    return records


def read(run_dir: str | Path) -> list[dict[str, Any]]:
    """One record per epoch, in epoch order (the latest attempt of a repeated epoch)."""
    by_epoch = {record["epoch"]: record for record in read_raw(run_dir)}
    return [by_epoch[e] for e in sorted(by_epoch)]
