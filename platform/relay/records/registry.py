"""Runs and model versions, recorded on the storage path as plain files — no database — so
anyone who can read the storage path finds them, from any node:

    <storage>/runs/<run id>/run.json        a run (running, finished or failed)
    <storage>/models/<name>/<version>.json  a model version: a run's best checkpoint

Names from outside (a command line, a record) become paths only when they are one whole name
(`is_name`); a path a record names is followed only when it lies inside the storage root. A
record says where things were when it was written; a storage root copied or moved elsewhere
keeps working, and never reaches back into the one it was copied from.

What relay creates under the storage root is the user's alone — directories 0700, records
0600 — unless it is made in a setgid directory (a team's shared storage): there the user's
umask decides (e.g. umask 007: the group reads and writes, others nothing).
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import secrets
import stat
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from relay.config import NAME_PATTERN

RECORD = "run.json"


class StorageError(OSError):
    """The storage path cannot hold runs (read-only, full, missing permissions)."""


# --- names and places -------------------------------------------------------------------------

NAME = re.compile(NAME_PATTERN)  # run ids, model names and aliases alike


def is_name(text: object) -> bool:
    """Whether `text` is one whole name: one directory name that stays where it is joined
    (no '/', not '.' or '..', nothing after it — `fullmatch`: `$` alone lets a trailing
    newline through)."""
    return isinstance(text, str) and NAME.fullmatch(text) is not None


def check_run_id(run_id: object) -> str:
    """`run_id`, if it is a run id; a KeyError naming it if not (before it names a path)."""
    if not is_name(run_id):
        raise KeyError(
            f"invalid run id {run_id!r}: letters, digits, '_', '.', '-' (one directory under runs/)"
        )
    return run_id


def check_model_name(name: object) -> str:
    if not is_name(name):
        raise ValueError(f"invalid model name {name!r}: letters, digits, '_', '.', '-'")
    return name


def runs_root(storage: Path) -> Path:
    return storage / "runs"


def run_dir(storage: Path, run_id: str) -> Path:
    """Where run `run_id` lies: `<storage>/runs/<run_id>`, from a checked id — never from
    what a record says."""
    return runs_root(storage) / check_run_id(run_id)


def inside(path: Path, root: Path) -> bool:
    """Whether `path` lies under `root` once both are resolved (links followed: a link out of
    `root` is outside it)."""
    return Path(path).resolve().is_relative_to(Path(root).resolve())


# --- modes -------------------------------------------------------------------------------------
# Private unless the storage is a group's: a setgid directory (`chgrp team /shared/relay && chmod
# 2770 /shared/relay`, the usual way to share one, which Linux passes on to every directory made
# in it). Decided by the directory a thing is made in, not by an environment variable, so a
# trial's process on another node decides as the driver does.


def _shared(directory: Path) -> bool:
    try:
        return bool(directory.stat().st_mode & stat.S_ISGID)
    except OSError:
        return False


def dir_mode(parent: Path) -> int:
    """The mode a directory made in `parent` asks for (the umask applies on top)."""
    return 0o777 if _shared(parent) else 0o700


def file_mode(parent: Path) -> int:
    return 0o666 if _shared(parent) else 0o600


def make_dir(path: Path, *, exist_ok: bool = True) -> None:
    """`mkdir -p` where every directory made gets `dir_mode` (Path.mkdir gives the parents it
    makes the umask's default instead). Directories that exist keep their modes."""
    path = Path(path)
    if not path.parent.exists():
        make_dir(path.parent)
    try:
        path.mkdir(mode=dir_mode(path.parent))
    except FileExistsError:
        if not exist_ok or not path.is_dir():
            raise


def open_new(path: Path, mode: str = "x") -> Any:
    """`open(path, mode)` for a file relay writes under the storage: made with `file_mode`
    (the mode of a file that exists is left as it is)."""
    flags = os.O_WRONLY | os.O_CREAT
    flags |= {"x": os.O_EXCL, "w": os.O_TRUNC, "a": os.O_APPEND}[mode.replace("b", "")]
    return os.fdopen(os.open(path, flags, file_mode(Path(path).parent)), mode.replace("x", "w"))


# --- run records -------------------------------------------------------------------------------


def _write_temp(directory: Path, stem: str, record: dict[str, Any]) -> Path:
    """Write `record` whole to a hidden temp file of its own (unique per writer, so two
    writers never share one), ready to be published under its final name in one step."""
    tmp = directory / f".{stem}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    try:
        with open_new(tmp) as f:
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
        with open_new(run_dir / RESERVE, "wb") as f:
            f.write(os.urandom(RESERVE_BYTES))
    except OSError as exc:
        (run_dir / RESERVE).unlink(missing_ok=True)
        raise StorageError(f"storage {run_dir} has no room for a run: {exc.strerror}") from None


def check_writable(directory: Path) -> None:
    """Fail now, before any cluster work, if runs cannot be recorded under `directory`."""
    try:
        make_dir(directory)
        probe = _write_temp(directory, "probe", {})
        probe.unlink()
    except OSError as exc:
        raise StorageError(f"storage {directory} is not writable: {exc.strerror or exc}") from None


def read(run_dir: Path) -> dict[str, Any] | None:
    """A run's record as written, or None if it has none (yet)."""
    try:
        return json.loads((run_dir / RECORD).read_text())
    except FileNotFoundError:
        return None


def _located(record: dict[str, Any], directory: Path) -> dict[str, Any]:
    """A run's record with `run_dir` where it lies now, and its checkpoint there too: a
    record in a copied or moved storage root still names the original's places."""
    written = record.get("run_dir")
    if not isinstance(written, str) or Path(written).resolve() == directory.resolve():
        return record
    located = {**record, "run_dir": str(directory)}
    checkpoint = record.get("checkpoint")
    if isinstance(checkpoint, str) and Path(checkpoint).is_relative_to(written):
        located["checkpoint"] = str(directory / Path(checkpoint).relative_to(written))
    return located


def _own_record(path: Path) -> dict[str, Any]:
    """The record at `path` (`runs/<id>/run.json`): KeyError if it cannot be read or if it
    names a run other than its directory's (it is not that run's, nor this one's)."""
    try:
        record = json.loads(path.read_text())
    except ValueError as exc:  # written atomically, so damaged by something else
        raise KeyError(f"{path}: unreadable run record ({exc})") from None
    named = record.get("run_id") if isinstance(record, dict) else None
    if named != path.parent.name:
        raise KeyError(
            f"{path}: the record names run {named!r}, not {path.parent.name!r} (moved or "
            "edited by hand?): refused"
        )
    return _located(record, path.parent)


def list_runs(storage: Path) -> list[dict[str, Any]]:
    """Every recorded run, newest first (a record that cannot be read, or that names another
    run than its directory's, is left out)."""
    records = []
    for path in runs_root(storage).glob(f"*/{RECORD}"):
        if not is_name(path.parent.name):
            continue
        try:
            records.append(_own_record(path))
        except (OSError, KeyError):
            continue
    return sorted(records, key=lambda r: r.get("started_at", ""), reverse=True)


def get_run(storage: Path, run_id: str) -> dict[str, Any]:
    """A run by id or unique id prefix; KeyError for anything that is not a run id."""
    exact = run_dir(storage, run_id) / RECORD
    if exact.exists():
        return _own_record(exact)
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
#
# A version's checkpoint is stored relative to the storage root ("runs/<id>/epoch_0003"), so a
# copied or moved storage root serves its own checkpoints; records read name it absolute (what
# `relay models` shows). Records written before, with absolute paths, are read while their
# checkpoint lies inside the storage root; one outside it (or with '..') is refused.


def models_root(storage: Path) -> Path:
    return storage / "models"


def default_model_name(task: str) -> str:
    """A built-in task's name, or a user task's class name ("pkg.mod:SineTask" → "sinetask")."""
    return task.rpartition(":")[2].lower()


def checkpoint_in_storage(storage: Path, recorded: object, what: str) -> Path:
    """The checkpoint a record names (relative to the storage root, or absolute), as an
    absolute path; KeyError naming `what` (e.g. "model version digits:3") when the record names
    none, or one outside the storage root — a record is never a way out of its storage."""
    if not isinstance(recorded, str) or not recorded:
        raise KeyError(f"{what} names no checkpoint")
    path = storage / recorded  # an absolute `recorded` stays as it is
    # Inside the storage root, or inside its runs/ where that is a link to another disk.
    if ".." in Path(recorded).parts or not (
        inside(path, storage) or inside(path, runs_root(storage))
    ):
        raise KeyError(
            f"{what}: its checkpoint {recorded} lies outside the storage root {storage} "
            "(refused: a checkpoint is a run's, under runs/; was this storage copied from "
            "elsewhere?)"
        )
    return path


def _relative_checkpoint(storage: Path, checkpoint: str, what: str) -> str:
    """How a new version records `checkpoint`: relative to the storage root."""
    path = Path(checkpoint).absolute()
    for root in (storage.absolute(), storage.resolve()):  # as written, then links followed
        if path.is_relative_to(root) and ".." not in path.parts:
            relative = str(path.relative_to(root))
            checkpoint_in_storage(storage, relative, what)
            return relative
    raise ValueError(
        f"{what}: checkpoint {checkpoint} lies outside the storage root {storage} (a model "
        "version's checkpoint is a run's, under runs/)"
    )


def _as_read(storage: Path, record: dict[str, Any]) -> dict[str, Any]:
    """A version record as callers see it: its checkpoint (if any) an absolute path."""
    if isinstance(record.get("checkpoint"), str) and record["checkpoint"]:
        return {**record, "checkpoint": str(storage / record["checkpoint"])}
    return record


def register_version(storage: Path, name: str, entry: dict[str, Any]) -> dict[str, Any]:
    """Record `entry` (checkpoint, run id, task, metric, mode, score, ...) as the next version;
    its checkpoint must lie inside the storage root."""
    check_model_name(name)
    if "checkpoint" in entry:
        what = f"model {name!r}"
        entry = {**entry, "checkpoint": _relative_checkpoint(storage, entry["checkpoint"], what)}
    directory = models_root(storage) / name
    make_dir(directory)
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
            return _as_read(storage, record)
        except FileExistsError:
            continue
        finally:
            tmp.unlink()


def list_versions(storage: Path, name: str | None = None) -> list[dict[str, Any]]:
    """Versions of one model (or all), ordered by model name, then version. A record that
    is not its own file's (its model or version differs from its path) is left out."""
    pattern = f"{check_model_name(name)}/*.json" if name else "*/*.json"
    records = []
    for path in models_root(storage).glob(pattern):
        if not (path.stem.isdigit() and is_name(path.parent.name)):
            continue
        record = json.loads(path.read_text())
        if not isinstance(record, dict) or type(record.get("version")) is not int:
            continue
        if record.get("model") == path.parent.name and record["version"] == int(path.stem):
            records.append(_as_read(storage, record))
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
    """A model's user aliases: alias → version; KeyError if aliases.json holds anything else."""
    path = models_root(storage) / check_model_name(name) / ALIASES
    try:
        aliases = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except ValueError as exc:  # replaced whole under a lock, so damaged by something else
        raise KeyError(f"{path}: unreadable aliases ({exc})") from None
    if not isinstance(aliases, dict):
        raise KeyError(f"{path}: not a map of aliases to versions: refused")
    bad = {a: n for a, n in aliases.items() if not _is_alias(a) or type(n) is not int}
    if bad:
        raise KeyError(f"{path}: an alias names a version by its number; refused {bad}")
    return aliases


def _is_alias(alias: str) -> bool:
    return alias not in DERIVED_ALIASES and not alias.isdigit() and is_name(alias)


def check_alias(alias: str) -> None:
    if not _is_alias(alias):
        raise ValueError(
            f"invalid alias {alias!r}: letters, digits, '_', '.', '-', not only digits, and "
            f"not {' or '.join(DERIVED_ALIASES)} (relay derives those)"
        )


def set_alias(storage: Path, name: str, version: int | None, alias: str) -> dict[str, int]:
    """Point `alias` of model `name` at `version` (None: remove it); the aliases after."""
    check_model_name(name)
    check_alias(alias)
    directory = models_root(storage) / name
    versions = {v["version"] for v in list_versions(storage, name)}
    if not versions:
        raise KeyError(f"no model {name!r} under {models_root(storage)}")
    if version is not None and version not in versions:
        numbers = ", ".join(str(v) for v in sorted(versions))
        raise KeyError(f"model {name!r} has no version {version} (versions: {numbers})")
    with open_new(directory / f".{ALIASES}.lock", "a") as lock:
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
    from relay.checkpoints import checkpoint

    checkpoint.validate(found.checkpoint)
    return found


def _resolve_model(storage: Path, ref: str) -> ResolvedModel:
    from relay.checkpoints.checkpoint import META

    as_path = Path(ref).expanduser()
    if (as_path / META).exists():
        return ResolvedModel(as_path.resolve(), str(as_path.resolve()))
    name, _, selector = ref.partition(":")
    versions = list_versions(storage, name) if is_name(name) else []
    if versions:
        selector = selector or "best"
        if selector == "best":
            chosen = best_version(versions)
        elif selector == "latest":
            chosen = versions[-1]
        elif selector.isdigit() and any(v["version"] == int(selector) for v in versions):
            chosen = next(v for v in versions if v["version"] == int(selector))
        elif (number := read_aliases(storage, name).get(selector)) is not None:
            chosen = next((v for v in versions if v["version"] == number), None)
            if chosen is None:
                numbers = ", ".join(str(v["version"]) for v in versions)
                raise KeyError(
                    f"alias {name}:{selector} names version {number}, which model {name!r} "
                    f"does not have (versions: {numbers})"
                )
        else:
            numbers = ", ".join(str(v["version"]) for v in versions)
            aliases = ", ".join(["best", "latest", *read_aliases(storage, name)])
            raise KeyError(
                f"model {name!r} has no version or alias {selector!r} (versions: {numbers}; "
                f"aliases: {aliases})"
            )
        reference = f"{name}:{chosen['version']}"
        found = checkpoint_in_storage(
            storage, chosen.get("checkpoint"), f"model version {reference}"
        )
        return ResolvedModel(found, reference, chosen)
    try:
        run = get_run(storage, ref)
    except KeyError:
        raise KeyError(
            f"no model, run or checkpoint {ref!r} under {storage} (try `relay models`)"
        ) from None
    if not run.get("checkpoint"):
        raise KeyError(f"run {run['run_id']} has no checkpoint (status {run.get('status')})")
    found = checkpoint_in_storage(storage, run["checkpoint"], f"run {run['run_id']}")
    return ResolvedModel(found, run["run_id"])


def recorded_task(storage: Path, found: Any) -> list[str]:
    """The task the storage root records for a resolved reference (`ResolvedModel`):
    its model version's, or its run's. The storage root is trusted and its records copy the
    user's own run config, so that task needs no --allow-task. None for a checkpoint
    directory given by path: only its own meta.json speaks for it."""
    if found.version:
        return [found.version["task"]] if found.version.get("task") else []
    if Path(found.reference).is_absolute():  # a directory (run ids are never paths)
        return []
    try:
        task = get_run(storage, found.reference).get("task")
    except KeyError:
        return []
    return [task] if isinstance(task, str) else []
