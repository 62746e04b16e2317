"""Runs and model versions, recorded on the storage path as plain files — no database — so
anyone who can read the storage path finds them, from any node:

    <storage>/runs/<run id>/run.json        a run (running, finished or failed)
    <storage>/models/<name>/<version>.json  a model version: a run's best checkpoint
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import secrets
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from relay.config import NAME_PATTERN

RECORD = "run.json"


class StorageError(OSError):
    """The storage path cannot hold runs (read-only, full, missing permissions)."""


def runs_root(storage: Path) -> Path:
    return storage / "runs"


def _write_temp(directory: Path, stem: str, record: dict[str, Any]) -> Path:
    """Write `record` whole to a hidden temp file of its own (unique per writer, so two
    writers never share one), ready to be published under its final name in one step."""
    tmp = directory / f".{stem}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    try:
        with open(tmp, "x") as f:
            json.dump(record, f, indent=2, default=str)
    except BaseException:
        tmp.unlink(missing_ok=True)  # e.g. the disk is full: leave no fragment behind
        raise
    return tmp


def write(run_dir: Path, record: dict[str, Any], *, final: bool = False) -> None:
    """Replace the run's record. `final` (the run finished or failed) first gives back the
    space `reserve` set aside, so the last record fits even when the disk filled up."""
    if final:
        (run_dir / RESERVE).unlink(missing_ok=True)
    tmp = _write_temp(run_dir, RECORD, record)
    os.replace(tmp, run_dir / RECORD)  # atomic: a reader never sees half a record


# Space a running run holds on the storage for its final record: a run that fails because the
# disk is full can still be recorded as failed. Random bytes, so no file system stores it
# sparse or compressed; removed by the final `write` (a killed driver leaves it behind).
RESERVE = ".run.json.reserve"
RESERVE_BYTES = 64 * 1024


def reserve(run_dir: Path) -> None:
    try:
        with open(run_dir / RESERVE, "wb") as f:
            f.write(os.urandom(RESERVE_BYTES))
    except OSError as exc:
        (run_dir / RESERVE).unlink(missing_ok=True)
        raise StorageError(f"storage {run_dir} has no room for a run: {exc.strerror}") from None


def check_writable(directory: Path) -> None:
    """Fail now, before any cluster work, if runs cannot be recorded under `directory`."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = _write_temp(directory, "probe", {})
        probe.unlink()
    except OSError as exc:
        raise StorageError(f"storage {directory} is not writable: {exc.strerror or exc}") from None


def read(run_dir: Path) -> dict[str, Any] | None:
    """A run's record, or None if it has none (yet)."""
    try:
        return json.loads((run_dir / RECORD).read_text())
    except FileNotFoundError:
        return None


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
        try:
            return json.loads(exact.read_text())
        except ValueError as exc:  # written atomically, so damaged by something else
            raise KeyError(f"{exact}: unreadable run record ({exc})") from None
    matches = [r for r in list_runs(storage) if r["run_id"].startswith(run_id)]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise KeyError(f"no run {run_id!r} under {runs_root(storage)}")
    ids = ", ".join(r["run_id"] for r in matches[:5])
    raise KeyError(f"run id {run_id!r} is ambiguous: {ids}")


# --- model versions ---------------------------------------------------------------------------
# `<storage>/models/<name>/<version>.json`, one file per version. A version is written whole to
# a temp file, then published by hard-linking it to `<version>.json`: the link fails if that
# name exists (another registration won the number: try the next), and a reader sees either
# no file or the whole record, never a half-written one. The aliases `latest` and `best` are
# derived on read.

MODEL_NAME = re.compile(NAME_PATTERN)


def models_root(storage: Path) -> Path:
    return storage / "models"


def default_model_name(task: str) -> str:
    """A built-in task's name, or a user task's class name ("pkg.mod:SineTask" → "sinetask")."""
    return task.rpartition(":")[2].lower()


def register_version(storage: Path, name: str, entry: dict[str, Any]) -> dict[str, Any]:
    """Record `entry` (checkpoint, run id, task, metric, mode, score, ...) as the next version."""
    if not MODEL_NAME.match(name):
        raise ValueError(f"invalid model name {name!r}: letters, digits, '_', '.', '-'")
    directory = models_root(storage) / name
    directory.mkdir(parents=True, exist_ok=True)
    version = max((int(p.stem) for p in directory.glob("*.json") if p.stem.isdigit()), default=0)
    while True:
        version += 1
        record = {
            **entry,
            "model": name,
            "version": version,
            "registered_at": datetime.now(UTC).isoformat(),
        }
        tmp = _write_temp(directory, "version", record)
        try:
            os.link(tmp, directory / f"{version}.json")
            return record
        except FileExistsError:
            continue
        finally:
            tmp.unlink()


def list_versions(storage: Path, name: str | None = None) -> list[dict[str, Any]]:
    """Versions of one model (or all), ordered by model name, then version."""
    pattern = f"{name}/*.json" if name else "*/*.json"
    records = []
    for path in models_root(storage).glob(pattern):
        if path.stem.isdigit():
            records.append(json.loads(path.read_text()))
    return sorted(records, key=lambda r: (r["model"], r["version"]))


def best_version(versions: list[dict[str, Any]]) -> dict[str, Any]:
    """The version with the best score by its own metric's mode; ties go to the newer."""
    scored = [v for v in versions if v.get("score") is not None]
    if not scored:
        return versions[-1]
    sign = -1 if scored[-1]["mode"] == "min" else 1
    return max(scored, key=lambda v: (sign * v["score"], v["version"]))


# --- user aliases ------------------------------------------------------------------------------
# `<storage>/models/<name>/aliases.json`: {"champion": 3, ...}, beside the derived `best` and
# `latest`. Replaced whole (temp file, then rename) under a lock, so two edits never lose one.

ALIASES = "aliases.json"
DERIVED_ALIASES = ("best", "latest")


def read_aliases(storage: Path, name: str) -> dict[str, int]:
    """A model's user aliases: alias → version."""
    try:
        return json.loads((models_root(storage) / name / ALIASES).read_text())
    except FileNotFoundError:
        return {}


def check_alias(alias: str) -> None:
    if alias in DERIVED_ALIASES or alias.isdigit() or not MODEL_NAME.match(alias):
        raise ValueError(
            f"invalid alias {alias!r}: letters, digits, '_', '.', '-', not only digits, and "
            f"not {' or '.join(DERIVED_ALIASES)} (relay derives those)"
        )


def set_alias(storage: Path, name: str, version: int | None, alias: str) -> dict[str, int]:
    """Point `alias` of model `name` at `version` (None: remove it); the aliases after."""
    check_alias(alias)
    directory = models_root(storage) / name
    versions = {v["version"] for v in list_versions(storage, name)}
    if not versions:
        raise KeyError(f"no model {name!r} under {models_root(storage)}")
    if version is not None and version not in versions:
        numbers = ", ".join(str(v) for v in sorted(versions))
        raise KeyError(f"model {name!r} has no version {version} (versions: {numbers})")
    with open(directory / f".{ALIASES}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        aliases = read_aliases(storage, name)
        if version is None:
            if alias not in aliases:
                raise KeyError(f"model {name!r} has no alias {alias!r}")
            del aliases[alias]
        else:
            aliases[alias] = version
        tmp = _write_temp(directory, ALIASES, aliases)
        os.replace(tmp, directory / ALIASES)
    return aliases


def aliases_of(storage: Path, name: str, versions: list[dict[str, Any]]) -> dict[str, int]:
    """Every alias of a model, derived and user's: alias → version."""
    if not versions:
        return {}
    derived = {"best": best_version(versions)["version"], "latest": versions[-1]["version"]}
    return {**derived, **read_aliases(storage, name)}


@dataclass(frozen=True)
class ResolvedModel:
    checkpoint: Path
    reference: str  # what it resolved as, e.g. "digits:3"
    version: dict[str, Any] | None = None


def resolve_model(storage: Path, ref: str) -> ResolvedModel:
    """`name:best`, `name:latest`, `name:N`, `name:<alias>` (`relay models alias`), `name`
    (= best), a run id, or a checkpoint dir;
    its checkpoint's files checked whole (`checkpoint.CorruptCheckpoint` names a bad one)."""
    found = _resolve_model(storage, ref)
    from relay import checkpoint

    checkpoint.validate(found.checkpoint)
    return found


def _resolve_model(storage: Path, ref: str) -> ResolvedModel:
    from relay.checkpoint import META

    as_path = Path(ref).expanduser()
    if (as_path / META).exists():
        return ResolvedModel(as_path.resolve(), str(as_path.resolve()))
    name, _, selector = ref.partition(":")
    versions = list_versions(storage, name) if MODEL_NAME.match(name) else []
    if versions:
        selector = selector or "best"
        if selector == "best":
            chosen = best_version(versions)
        elif selector == "latest":
            chosen = versions[-1]
        elif selector.isdigit() and any(v["version"] == int(selector) for v in versions):
            chosen = next(v for v in versions if v["version"] == int(selector))
        elif (number := read_aliases(storage, name).get(selector)) is not None:
            chosen = next(v for v in versions if v["version"] == number)
        else:
            numbers = ", ".join(str(v["version"]) for v in versions)
            aliases = ", ".join(["best", "latest", *read_aliases(storage, name)])
            raise KeyError(
                f"model {name!r} has no version or alias {selector!r} (versions: {numbers}; "
                f"aliases: {aliases})"
            )
        return ResolvedModel(Path(chosen["checkpoint"]), f"{name}:{chosen['version']}", chosen)
    try:
        run = get_run(storage, ref)
    except KeyError:
        raise KeyError(
            f"no model, run or checkpoint {ref!r} under {storage} (try `relay models`)"
        ) from None
    if not run.get("checkpoint"):
        raise KeyError(f"run {run['run_id']} has no checkpoint (status {run.get('status')})")
    return ResolvedModel(Path(run["checkpoint"]), run["run_id"])
