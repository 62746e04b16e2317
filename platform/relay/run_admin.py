"""What `relay runs rm`, `runs gc` and `runs compare` do with recorded runs, without Ray.

Removal is all or nothing: every run named is looked up and checked before the first one is
deleted, so a bad argument deletes nothing. A run whose checkpoint a model version points at
is refused (serving that version would fail), and so is one recorded as running (its driver
may still be writing to it); `force` deletes them anyway.

Collection (`gc`) frees the space checkpoints take and keeps every record: of the runs that
ended, per task and metric, the `keep_best` best keep their checkpoints, and so does every run
a model version points at; the others lose their checkpoint directories, and their run.json
says when (`collected`). Such a run can be shown and compared, not resumed.
"""

from __future__ import annotations

import shutil
from datetime import UTC, datetime
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


ENDED = ("finished", "failed", "stopped")


def _checkpoint_dirs(run_dir: Path) -> list[Path]:
    from relay.checkpoint import META

    return sorted(p for p in Path(run_dir).iterdir() if p.is_dir() and (p / META).exists())


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def plan_collection(storage: Path, keep_best: int) -> list[dict[str, Any]]:
    """The runs whose checkpoints `collect` would delete: [{run_id, run_dir, checkpoints,
    bytes}], best-scored last. Never a running run, one of the `keep_best` best of its task
    and metric, or one a model version points at."""
    if keep_best < 0:
        raise ValueError(f"--keep-best: {keep_best} is not a count of runs to keep")
    served = {Path(v["checkpoint"]).resolve().parent for v in registry.list_versions(storage)}
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for record in registry.list_runs(storage):
        if record.get("status") in ENDED and not record.get("collected"):
            spec = record["config"]["checkpoint"]
            groups.setdefault((record["task"], spec["metric"], spec["mode"]), []).append(record)
    plan = []
    for (_, metric, mode), records in groups.items():
        sign = 1 if mode == "max" else -1

        def score(record: dict[str, Any], metric=metric, sign=sign) -> float:
            value = (record.get("best_metrics") or {}).get(metric)
            return sign * value if isinstance(value, int | float) else float("-inf")

        ranked = sorted(records, key=score, reverse=True)  # best first
        for record in reversed(ranked[keep_best:]):
            run_dir = Path(record["run_dir"])
            if run_dir.resolve() in served or not run_dir.is_dir():
                continue
            checkpoints = _checkpoint_dirs(run_dir)
            if checkpoints:
                plan.append(
                    {
                        "run_id": record["run_id"],
                        "run_dir": str(run_dir),
                        "checkpoints": [p.name for p in checkpoints],
                        "bytes": sum(_size(p) for p in checkpoints),
                    }
                )
    return plan


def collect(storage: Path, plan: list[dict[str, Any]]) -> None:
    """Delete the planned checkpoints; each run's record then says they are gone."""
    for entry in plan:
        run_dir = Path(entry["run_dir"])
        record = registry.read(run_dir) or {}
        registry.write(
            run_dir,
            {
                **record,
                "collected": {
                    "at": datetime.now(UTC).isoformat(),
                    "checkpoints": entry["checkpoints"],
                },
            },
        )
        for name in entry["checkpoints"]:
            shutil.rmtree(run_dir / name, ignore_errors=True)


def collected_reason(record: dict[str, Any]) -> str | None:
    """Why a run cannot be resumed from its checkpoints (None: it can)."""
    if not record.get("collected"):
        return None
    return (
        f"run {record['run_id']}'s checkpoints were deleted by `relay runs gc` "
        f"({record['collected']['at']}); it cannot resume"
    )


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
