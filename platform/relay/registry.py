"""Finished (and failed) runs, recorded on the storage path: `<storage>/runs/<run id>/run.json`.

A plain directory per run — no database — so a run is found by anyone who can read the storage
path, from any node, and two runs never write the same file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

RECORD = "run.json"


def runs_root(storage: Path) -> Path:
    return storage / "runs"


def write(run_dir: Path, record: dict[str, Any]) -> None:
    tmp = run_dir / f".{RECORD}.tmp"
    tmp.write_text(json.dumps(record, indent=2, default=str))
    os.replace(tmp, run_dir / RECORD)  # atomic: a reader never sees half a record


def list_runs(storage: Path) -> list[dict[str, Any]]:
    """Every recorded run, newest first."""
    records = []
    for path in runs_root(storage).glob(f"*/{RECORD}"):
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError):
            continue
    return sorted(records, key=lambda r: r.get("started_at", ""), reverse=True)


def get_run(storage: Path, run_id: str) -> dict[str, Any]:
    """A run by id or unique id prefix."""
    exact = runs_root(storage) / run_id / RECORD
    if exact.exists():
        return json.loads(exact.read_text())
    matches = [r for r in list_runs(storage) if r["run_id"].startswith(run_id)]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise KeyError(f"no run {run_id!r} under {runs_root(storage)}")
    ids = ", ".join(r["run_id"] for r in matches[:5])
    raise KeyError(f"run id {run_id!r} is ambiguous: {ids}")
