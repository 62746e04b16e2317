"""What happened in a run, as it happened, in JSON lines under its run dir:

- `history.jsonl`: per-epoch metrics, appended by rank 0. The driver follows the file to print
  progress; `relay runs show` and the tests read it back. After a restart an epoch may be
  trained again; the last record of an epoch wins.
- `steps.jsonl`: the step clocks' reports between epoch ends (`report.every_steps`,
  `validation.every_steps`), appended by rank 0: the training metrics of the steps since the
  previous report, mid-epoch validation's, the step and the epoch in progress.
- `worker_failures.jsonl`: when the controller found failed workers (the moment a restarted
  worker group's start-up begins; the efficiency report's start-up is measured off it).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

FILE = "history.jsonl"
STEPS = "steps.jsonl"
FAILURES = "worker_failures.jsonl"


def _append(path: Path, record: dict[str, Any]) -> None:
    """Append a record stamped with the wall-clock time it was written."""
    with open(path, "a") as f:
        f.write(json.dumps({**record, "time": time.time()}) + "\n")


def _read(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a line cut short by a killed writer
    return records


def append(run_dir: str | Path, metrics: dict[str, Any]) -> None:
    """Append an epoch, stamped with the wall-clock time it ended (start-up is measured off it)."""
    _append(Path(run_dir) / FILE, metrics)


def read_raw(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every epoch record in order written, restarts included."""
    return _read(Path(run_dir) / FILE)


def append_step(run_dir: str | Path, metrics: dict[str, Any]) -> None:
    """Append a step report (see the module's docstring), stamped with the time it was made."""
    _append(Path(run_dir) / STEPS, metrics)


def read_steps(run_dir: str | Path) -> list[dict[str, Any]]:
    """Every step report in order written, restarts included."""
    return _read(Path(run_dir) / STEPS)


def latest_steps(run_dir: str | Path) -> list[dict[str, Any]]:
    """One step report per step, in step order (the latest of a step reported again after a
    restart)."""
    by_step = {record["step"]: record for record in read_steps(run_dir)}
    return [by_step[s] for s in sorted(by_step)]


class Follower:
    """The records appended to one of a run's files since the last call, read from where the
    last call stopped (a run of days appends steps.jsonl a line every few seconds: rereading
    it whole each time would grow without bound). A line not yet ended is left for the next
    call; a line that does not parse (cut short by a killed writer) is skipped."""

    def __init__(self, run_dir: str | Path, name: str = STEPS, *, from_end: bool = False):
        self.path = Path(run_dir) / name
        self.offset = self.path.stat().st_size if from_end and self.path.exists() else 0

    def new(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        ended = data.rfind(b"\n") + 1
        self.offset += ended
        records = []
        for line in data[:ended].splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return records


def append_failure(run_dir: str | Path, ranks: list[int]) -> None:
    _append(Path(run_dir) / FAILURES, {"ranks": ranks})


def failure_times(run_dir: str | Path) -> list[float]:
    """When each worker failure was found, in order."""
    return [record["time"] for record in _read(Path(run_dir) / FAILURES)]


def read(run_dir: str | Path) -> list[dict[str, Any]]:
    """One record per epoch, in epoch order (the latest attempt of a repeated epoch)."""
    by_epoch = {record["epoch"]: record for record in read_raw(run_dir)}
    return [by_epoch[e] for e in sorted(by_epoch)]
