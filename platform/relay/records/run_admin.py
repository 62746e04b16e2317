"""What `relay runs rm`, `runs gc` and `runs compare` do with recorded runs, without Ray.

Removal is all or nothing: every run named is looked up and checked before the first one is
deleted, so a bad argument deletes nothing. A run whose checkpoint a model version points at
is refused (serving that version would fail), and so is one recorded as running (its driver
may still be writing to it); `force` deletes them anyway.

Collection (`gc`) frees the space checkpoints take and keeps every record: of the runs that
ended, per task and metric, the `keep_best` best keep their checkpoints, and so does every run
a model version points at; the others lose their checkpoint directories, and their run.json
says when (`collected`). Such a run can be shown and compared, not resumed.

Deletion only ever touches `<storage>/runs/<run id>` (and checkpoint directories in it),
computed from a checked run id — never a path a record names, so a copied storage root never
deletes the original's runs — and only once the resolved path is inside the resolved runs/
and no link: a link out of runs/ is refused, not followed.
"""

from __future__ import annotations

import shutil
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from relay.config import flatten
from relay.records import registry


class Refused(ValueError):
    """A removal that would lose something; the message says what and how to force it."""


def deletable_run_dir(storage: Path, run_id: str) -> Path:
    """`<storage>/runs/<run_id>`, checked safe to delete: `run_id` one name (KeyError if
    not), and the directory itself inside the resolved runs/ and no link (Refused if not)."""
    root = registry.runs_root(storage).resolve()
    path = root / registry.check_run_id(run_id)
    if path.is_symlink() or not path.resolve().is_relative_to(root):
        raise Refused(f"run {run_id}: {path} is a link or lies outside {root}; refused")
    return path


def _deletable_checkpoint(run_dir: Path, name: str) -> Path:
    """A checkpoint directory `name` of the run at `run_dir` (as `deletable_run_dir` gave)."""
    path = run_dir / name
    if (
        Path(name).name != name
        or name in ("", ".", "..")
        or path.is_symlink()
        or path.resolve().parent != run_dir.resolve()
    ):
        raise Refused(f"{path} is not a checkpoint directory of {run_dir}; refused")
    return path


def versions_using(
    storage: Path, run_id: str, versions: list[dict[str, Any]] | None = None
) -> list[str]:
    """The model versions ("digits:3") made from run `run_id`: by the run id they record, or a
    checkpoint in the run's directory (so a version of a copied storage's is found either way).
    `versions`: every version, where the caller has them already."""
    run_dir = registry.run_dir(storage, run_id).resolve()
    return [
        f"{v['model']}:{v['version']}"
        for v in (registry.list_versions(storage) if versions is None else versions)
        if v.get("run_id") == run_id
        or (isinstance(v.get("checkpoint"), str) and _in_dir(Path(v["checkpoint"]), run_dir))
    ]


def _in_dir(path: Path, directory: Path) -> bool:
    return directory in path.resolve().parents


def plan_removal(storage: Path, refs: list[str], *, force: bool = False) -> list[dict[str, Any]]:
    """The records of the runs `refs` names (ids or unique prefixes), each checked removable;
    raises KeyError (no such run, not a run id) or Refused before anything is deleted."""
    records: dict[str, dict[str, Any]] = {}
    for ref in refs:
        record = registry.get_run(storage, ref)  # only a record of its own directory's
        deletable_run_dir(storage, record["run_id"])
        records[record["run_id"]] = record
    if force:
        return list(records.values())
    for record in records.values():
        used = versions_using(storage, record["run_id"])
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


def remove(storage: Path, records: list[dict[str, Any]]) -> None:
    """Delete the runs `plan_removal` gave: each `<storage>/runs/<run id>`, checked again."""
    for path in [deletable_run_dir(storage, record["run_id"]) for record in records]:
        shutil.rmtree(path)


ENDED = ("finished", "failed", "stopped")


def _checkpoint_dirs(run_dir: Path) -> list[Path]:
    from relay.checkpoints.checkpoint import META

    return sorted(
        p
        for p in Path(run_dir).iterdir()
        if p.is_dir() and not p.is_symlink() and (p / META).exists()
    )


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def plan_collection(storage: Path, keep_best: int) -> list[dict[str, Any]]:
    """The runs whose checkpoints `collect` would delete: [{run_id, run_dir, checkpoints,
    bytes}], best-scored last. Never a running run, one of the `keep_best` best of its task
    and metric, or one a model version points at."""
    if keep_best < 0:
        raise ValueError(f"--keep-best: {keep_best} is not a count of runs to keep")
    versions = registry.list_versions(storage)
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
            try:
                run_dir = deletable_run_dir(storage, record["run_id"])
            except Refused:  # a link out of runs/: not relay's to collect
                continue
            if versions_using(storage, record["run_id"], versions) or not run_dir.is_dir():
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
    """Delete the planned checkpoints; each run's record then says they are gone. Every
    entry is checked (its run's directory and record, its checkpoints' names) before the
    first deletion: Refused deletes nothing."""
    checked = [(entry, _collectable(storage, entry)) for entry in plan]
    for entry, (run_dir, record, checkpoints) in checked:
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
        for path in checkpoints:
            shutil.rmtree(path, ignore_errors=True)


def _collectable(storage: Path, entry: dict[str, Any]) -> tuple[Path, dict[str, Any], list[Path]]:
    """A planned entry's run directory (from its run id, never its `run_dir`), record and
    checkpoint directories, each checked to be that run's."""
    run_dir = deletable_run_dir(storage, entry["run_id"])
    record = registry.read(run_dir) or {}
    if record.get("run_id") != entry["run_id"]:
        raise Refused(f"{run_dir}: its record is not run {entry['run_id']}'s; refused")
    return run_dir, record, [_deletable_checkpoint(run_dir, n) for n in entry["checkpoints"]]


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
