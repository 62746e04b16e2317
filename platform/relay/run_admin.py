"""What `relay runs rm` and `relay runs compare` do with recorded runs, without Ray.

Removal is all or nothing: every run named is looked up and checked before the first one is
deleted, so a bad argument deletes nothing. A run whose checkpoint a model version points at
is refused (serving that version would fail), and so is one recorded as running (its driver
may still be writing to it); `force` deletes them anyway.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from relay import registry
from relay.config import flatten


class Refused(ValueError):
    """A removal that would lose something; the message says what and how to force it."""


def versions_using(storage: Path, run_dir: Path) -> list[str]:
    """The model versions ("digits:3") whose checkpoint lies in `run_dir`."""
    run_dir = Path(run_dir).resolve()
    return [
        f"{v['model']}:{v['version']}"
        for v in registry.list_versions(storage)
        if run_dir in Path(v["checkpoint"]).resolve().parents
    ]


def plan_removal(storage: Path, refs: list[str], *, force: bool = False) -> list[dict[str, Any]]:
    """The records of the runs `refs` names (ids or unique prefixes), each checked removable;
    raises KeyError (no such run) or Refused before anything is deleted."""
    records: dict[str, dict[str, Any]] = {}
    for ref in refs:
        record = registry.get_run(storage, ref)
        records[record["run_id"]] = record
    if force:
        return list(records.values())
    for record in records.values():
        used = versions_using(storage, Path(record["run_dir"]))
        if used:
            raise Refused(
                f"run {record['run_id']} holds the checkpoint of model version "
                f"{', '.join(used)}; --force deletes it anyway (those versions then fail to load)"
            )
        if record.get("status") == "running":
            raise Refused(
                f"run {record['run_id']} is recorded as running (its driver may still write to "
                "it); --force deletes it anyway"
            )
    return list(records.values())


def remove(records: list[dict[str, Any]]) -> None:
    for record in records:
        shutil.rmtree(record["run_dir"])


def compare(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Two run records side by side: the config fields that differ, and each metric of their
    final and best epochs ([a, b]; None where a run has no such value)."""
    config_a, config_b = flatten(a["config"]), flatten(b["config"])
    differing = {
        field: [config_a.get(field), config_b.get(field)]
        for field in sorted(config_a.keys() | config_b.keys())
        if config_a.get(field) != config_b.get(field) and field != "name"
    }

    def side_by_side(key: str) -> dict[str, list[Any]]:
        first, second = a.get(key) or {}, b.get(key) or {}
        names = [*first, *(n for n in second if n not in first)]
        return {n: [first.get(n), second.get(n)] for n in names}

    return {
        "runs": [a["run_id"], b["run_id"]],
        "status": [a.get("status"), b.get("status")],
        "config": differing,
        "metrics": side_by_side("metrics"),
        "best_metrics": side_by_side("best_metrics"),
    }


def format_comparison(comparison: dict[str, Any]) -> str:
    """The comparison as aligned text: one column per run."""
    rows: list[tuple[str, list[Any]]] = [("run", comparison["runs"])]
    rows.append(("status", comparison["status"]))
    sections = (
        ("config (fields that differ)", comparison["config"]),
        ("final epoch", comparison["metrics"]),
        ("best checkpoint", comparison["best_metrics"]),
    )
    for title, values in sections:
        rows.append((f"-- {title}", ["", ""]))
        if not values:
            rows.append(("  (none)", ["", ""]))
        rows += [(f"  {name}", pair) for name, pair in values.items()]
    cells = [(name, [_cell(v) for v in pair]) for name, pair in rows]
    width = max(len(name) for name, _ in cells)
    first = max(len(pair[0]) for _, pair in cells)
    return "\n".join(
        f"{name:<{width}}  {pair[0]:<{first}}  {pair[1]}".rstrip() for name, pair in cells
    )


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)
