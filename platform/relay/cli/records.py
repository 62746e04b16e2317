"""`relay runs`, `models`, `export`, `report`: what the storage root holds, shown, compared,
aliased, exported, cleaned up."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import yaml

from relay import config as config_mod
from relay.cli.common import (
    EXIT_FAILED,
    EXIT_USAGE,
    fail,
)
from relay.serving import command as serving


def add_report_parser(sub) -> None:
    report = sub.add_parser(
        "report",
        help="write a run's, sweep's or model's report: one self-contained HTML page of charts",
    )
    report.add_argument("ref", help="run id, sweep id (or unique prefix), or model reference")
    report.add_argument("-o", "--out", help="file to write (default: report.html in its dir)")
    report.add_argument("--storage", help="storage root (default: $RELAY_HOME, else ~/relay)")


def add_models_parser(sub) -> None:
    models = sub.add_parser(
        "models",
        help="list model versions and their aliases; `show REF`; `alias NAME:VERSION ALIAS`",
        description="relay models [NAME] | relay models show REF | relay models alias "
        "NAME:VERSION ALIAS | relay models alias --rm NAME ALIAS",
    )
    models.add_argument(
        "words", nargs="*", metavar="NAME | show REF | alias ...", help="see the usage above"
    )
    models.add_argument("--rm", action="store_true", help="alias: remove ALIAS from NAME")
    models.add_argument("--storage", help="storage root (default: $RELAY_HOME, else ~/relay)")
    models.add_argument("--json", action="store_true", help="print JSON")


def add_export_parser(sub) -> None:
    export = sub.add_parser(
        "export",
        help="a model's whole weights (model.safetensors, streamed from a sharded checkpoint's "
        "shards tensor by tensor) with its meta.json and task assets",
    )
    export.add_argument(
        "ref",
        help="model reference (name, name:VERSION, name:ALIAS), run id or checkpoint directory",
    )
    export.add_argument(
        "-o", "--out", help="new or empty directory to write (default: beside the shards)"
    )
    export.add_argument("--storage", help="storage root (default: $RELAY_HOME, else ~/relay)")
    serving.add_allow_task(export)


def add_runs_parser(sub) -> None:
    runs = sub.add_parser(
        "runs",
        help="list recorded runs (newest first); `show RUN`; `logs RUN [-f]`; `compare A B`; "
        "`rm RUN...`; `gc --keep-best N`",
    )
    runs.add_argument(
        "action",
        nargs="?",
        choices=["show", "logs", "compare", "rm", "gc"],
        help="what to do with RUN",
    )
    runs.add_argument("run_ids", nargs="*", metavar="RUN", help="run ids (or unique prefixes)")
    runs.add_argument(
        "--force",
        action="store_true",
        help="rm: also runs a model version points at, or recorded as running",
    )
    runs.add_argument(
        "-f", "--follow", action="store_true", help="logs: keep printing while the run runs"
    )
    runs.add_argument("--rank", type=int, help="logs: only this rank's")
    runs.add_argument(
        "--keep-best",
        type=int,
        metavar="N",
        help="gc: of the runs that ended, the N best of each task and metric keep their "
        "checkpoints (and every run a model version points at); the rest lose them",
    )
    runs.add_argument("--dry-run", action="store_true", help="gc: only say what it would delete")
    serving.add_allow_task(runs)
    runs.add_argument("--storage", help="storage root (default: $RELAY_HOME, else ~/relay)")
    runs.add_argument("--json", action="store_true", help="print JSON")


def _run_summary(record: dict[str, Any]) -> str:
    metrics = record.get("best_metrics") or record.get("metrics") or {}
    metric = record.get("config", {}).get("checkpoint", {}).get("metric")
    score = f"{metric}={metrics[metric]:.4g}" if metric in metrics else ""
    epochs = f"epochs={metrics.get('epoch', '-')}"
    status = record.get("status", "?")
    config = record.get("config", {})
    workers = (record.get("efficiency") or {}).get("workers") or config.get("scaling", {}).get(
        "num_workers", "?"
    )
    if isinstance(workers, list):  # elastic, and no report yet
        workers = "-".join(map(str, workers))
    layout = f"{config.get('parallel', {}).get('strategy', 'ddp')}:{workers}w"
    return (
        f"{record['run_id']:<40} {status:<9} {record['task']:<12} {layout:<9} {epochs:<10} {score}"
    )


def _damaged_checkpoint(record: dict[str, Any]) -> str | None:
    """Why one of the run's checkpoints (best, last, or the one a resume would load) cannot
    be loaded; None if all can."""
    from pathlib import Path

    from relay.checkpoints import checkpoint

    for path in _checkpoints_of(record):
        try:
            checkpoint.validate(Path(path))
        except checkpoint.CorruptCheckpoint as exc:
            return f"run {record['run_id']}: damaged checkpoint: {exc}"
    return None


def _checkpoints_of(record: dict[str, Any]) -> list[str]:
    """The run's checkpoints: best, last, and the one a resume would load; none once `relay
    runs gc` deleted them on purpose (the record says so)."""
    from relay.checkpoints import checkpoint

    if record.get("collected"):
        return []
    latest = checkpoint.latest_registered(record["run_dir"])
    paths = [record.get("checkpoint"), record.get("last_checkpoint"), latest and latest[0]]
    return list(dict.fromkeys(str(p) for p in paths if p))


def _untrusted_checkpoint(record: dict[str, Any], allow: list[str]) -> str | None:
    """Why one of the run's checkpoints names a task relay may not import (relay.tasks.
    check_allowed): neither built in, nor the run's own (its record, in the trusted storage
    root), nor allowed with --allow-task. None if all are fine."""
    from relay.checkpoints import checkpoint
    from relay.tasks import UntrustedTask

    own = [t for t in (record.get("task"), (record.get("config") or {}).get("task")) if t]
    for path in _checkpoints_of(record):
        try:
            checkpoint.checked_task(path, [*allow, *(t for t in own if isinstance(t, str))])
        except UntrustedTask as exc:
            return f"run {record['run_id']}: {exc}"
    return None


def cmd_runs(args: argparse.Namespace) -> int:
    from relay.records import history, registry

    storage = config_mod.resolve_storage(args.storage)
    wanted = {None: 0, "show": 1, "logs": 1, "compare": 2, "gc": 0}.get(args.action)
    if wanted is not None and len(args.run_ids) != wanted:
        return fail(
            f"runs {args.action or ''}: takes {wanted} run id{'s' * (wanted != 1)}, "
            f"got {len(args.run_ids)}",
            EXIT_USAGE,
        )
    if args.action == "rm":
        return _runs_rm(storage, args)
    if args.action == "logs":
        return _runs_logs(storage, args)
    if args.action == "gc":
        return _runs_gc(storage, args)
    if args.action == "compare":
        return _runs_compare(storage, args)
    if args.action == "show":
        try:
            record = registry.get_run(storage, args.run_ids[0])
        except KeyError as exc:
            return fail(str(exc.args[0]), EXIT_USAGE)
        record = {**record, "history": history.read(record["run_dir"])}
        damaged = _damaged_checkpoint(record)
        if not damaged and (untrusted := _untrusted_checkpoint(record, args.allow_task)):
            return fail(untrusted, EXIT_USAGE)
        if args.json:
            print(json.dumps(record, default=str))
        else:
            report = record.pop("efficiency", None)
            print(yaml.safe_dump(record, sort_keys=False, default_flow_style=None), end="")
            if report:
                from relay.training.efficiency import format_report

                print(format_report(report))
        # The record is shown either way (it says what happened); a checkpoint the run relies
        # on that cannot be loaded is an error all the same.
        return fail(damaged, EXIT_FAILED) if damaged else 0
    records = registry.list_runs(storage)
    if args.json:
        print(json.dumps(records, default=str))
    elif not records:
        print(f"no runs under {registry.runs_root(storage)}")
    else:
        for record in records:
            print(_run_summary(record))
    return 0


def _runs_rm(storage: Path, args: argparse.Namespace) -> int:
    from relay.records import run_admin

    if not args.run_ids:
        return fail("runs rm: name the runs to delete", EXIT_USAGE)
    try:
        records = run_admin.plan_removal(storage, args.run_ids, force=args.force)
    except (KeyError, run_admin.Refused) as exc:  # nothing was deleted
        return fail(f"runs rm: {exc.args[0]}", EXIT_USAGE)
    run_admin.remove(storage, records)
    removed = [r["run_id"] for r in records]
    print(json.dumps({"removed": removed}) if args.json else f"removed {', '.join(removed)}")
    return 0


def _runs_gc(storage: Path, args: argparse.Namespace) -> int:
    from relay.observe import console
    from relay.records import run_admin

    if args.keep_best is None:
        return fail("runs gc: --keep-best N says how many of the best runs keep theirs", EXIT_USAGE)
    try:
        plan = run_admin.plan_collection(storage, args.keep_best)
        if not args.dry_run:
            run_admin.collect(storage, plan)  # Refused (a ValueError): nothing deleted
    except ValueError as exc:
        return fail(f"runs gc: {exc}", EXIT_USAGE)
    freed = sum(entry["bytes"] for entry in plan)
    if args.json:
        print(json.dumps({"dry_run": args.dry_run, "runs": plan, "bytes": freed}))
        return 0
    verb = "would delete" if args.dry_run else "deleted"
    for entry in plan:
        print(f"{verb} {len(entry['checkpoints'])} checkpoints of {entry['run_id']}")
    print(f"{verb} {console.human_bytes(freed)} in {len(plan)} runs")
    return 0


def _runs_logs(storage: Path, args: argparse.Namespace) -> int:
    from relay.observe import worker_logs
    from relay.records import registry

    try:
        record = registry.get_run(storage, args.run_ids[0])
    except KeyError as exc:
        return fail(f"runs logs: {exc.args[0]}", EXIT_USAGE)
    run_dir = Path(record["run_dir"])
    present = worker_logs.ranks(run_dir)
    if args.rank is not None and args.rank not in present and not args.follow:
        return fail(f"runs logs: run {record['run_id']} has no log of rank {args.rank}", EXIT_USAGE)

    def running() -> bool:
        return (registry.read(run_dir) or {}).get("status") == "running"

    with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C ends a follow; the run goes on
        worker_logs.show(
            run_dir, sys.stdout, rank=args.rank, follow=running if args.follow else None
        )
    return 0


def _runs_compare(storage: Path, args: argparse.Namespace) -> int:
    from relay.records import registry, run_admin

    try:
        first, second = (registry.get_run(storage, ref) for ref in args.run_ids)
    except KeyError as exc:
        return fail(f"runs compare: {exc.args[0]}", EXIT_USAGE)
    comparison = run_admin.compare(first, second)
    print(
        json.dumps(comparison, default=str)
        if args.json
        else run_admin.format_comparison(comparison)
    )
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from relay.records import registry

    storage = config_mod.resolve_storage(args.storage)
    verb, rest = (args.words[0], args.words[1:]) if args.words else (None, [])
    if verb == "alias":
        return _models_alias(storage, rest, args)
    if verb == "show":
        if len(rest) != 1:
            return fail("models show: takes one REF (name, name:VERSION, name:ALIAS)", EXIT_USAGE)
        return _models_show(storage, rest[0], args)
    if args.rm:
        return fail("--rm: only with `models alias`", EXIT_USAGE)
    if len(args.words) > 1:
        return fail(f"models: unknown verb {verb!r} (show, alias)", EXIT_USAGE)
    try:
        versions = registry.list_versions(storage, verb)
        by_model: dict[str, list[dict[str, Any]]] = {}
        for version in versions:
            by_model.setdefault(version["model"], []).append(version)
        aliases = {name: registry.aliases_of(storage, name, e) for name, e in by_model.items()}
    except (KeyError, ValueError) as exc:  # a bad model name, or a damaged aliases.json
        return fail(f"models: {exc.args[0]}", EXIT_USAGE)
    if args.json:
        print(
            json.dumps(
                {
                    name: {
                        "versions": entries,
                        "best": aliases[name]["best"],
                        "latest": aliases[name]["latest"],
                        "aliases": aliases[name],  # best, latest and the user's
                    }
                    for name, entries in by_model.items()
                },
                default=str,
            )
        )
        return 0
    if not versions:
        print(f"no models under {registry.models_root(storage)}")
    for name, entries in by_model.items():
        for v in entries:
            tags = [a for a, n in aliases[name].items() if n == v["version"]]
            score = f"{v['metric']}={v['score']:.4g}" if v.get("score") is not None else ""
            tag = f"({', '.join(tags)})" if tags else ""
            print(f"{name}:{v['version']:<4} {tag:<24} {score:<24} {v['run_id']}")
    return 0


def _models_alias(storage: Path, words: list[str], args: argparse.Namespace) -> int:
    """`alias NAME:VERSION ALIAS` points a user alias at a version; `alias --rm NAME ALIAS`
    removes it."""
    from relay.records import registry

    usage = "models alias: NAME:VERSION ALIAS, or --rm NAME ALIAS"
    if len(words) != 2:
        return fail(usage, EXIT_USAGE)
    target, alias = words
    name, _, number = target.partition(":")
    if args.rm == bool(number) or (number and not number.isdigit()):
        return fail(usage, EXIT_USAGE)
    try:
        before = registry.read_aliases(storage, name).get(alias)
        aliases = registry.set_alias(storage, name, None if args.rm else int(number), alias)
    except (KeyError, ValueError) as exc:
        return fail(f"models alias: {exc.args[0]}", EXIT_USAGE)
    # Where the version's run was tracked in MLflow, its registry gets the alias too.
    target = before if args.rm else int(number)
    version = next(v for v in registry.list_versions(storage, name) if v["version"] == target)
    if mirrored := _mirror_alias(storage, version, alias, args.rm):
        print(mirrored, file=sys.stderr)
    if args.json:
        print(json.dumps({"model": name, "aliases": aliases}))
    else:
        print(f"{name}:{alias} removed" if args.rm else f"{name}:{alias} -> {name}:{number}")
    return 0


def _mirror_alias(storage: Path, version: dict[str, Any], alias: str, remove: bool) -> str:
    if importlib.util.find_spec("mlflow") is None:
        return ""
    from relay.observe.tracking import mirror_alias  # imports Ray (the trackers are its callbacks)

    return mirror_alias(storage, version, alias, remove=remove)


def _models_show(storage: Path, ref: str, args: argparse.Namespace) -> int:
    """A model version (or a run's or a directory's checkpoint): its record, aliases, and the
    checkpoint's own account of itself (epoch, metrics)."""
    from relay.checkpoints import checkpoint
    from relay.records import registry

    try:
        found = registry.resolve_model(storage, ref)
    except KeyError as exc:
        return fail(f"models show: {exc.args[0]}", EXIT_USAGE)
    except checkpoint.CorruptCheckpoint as exc:
        return fail(f"models show: {ref}: damaged checkpoint: {exc}", EXIT_FAILED)
    meta = checkpoint.read_meta(found.checkpoint)
    shown: dict[str, Any] = {"reference": found.reference, "checkpoint": str(found.checkpoint)}
    if found.version:
        name = found.version["model"]
        every = registry.aliases_of(storage, name, registry.list_versions(storage, name))
        shown["aliases"] = [a for a, n in every.items() if n == found.version["version"]]
        shown["version"] = found.version
    shown["checkpoint_epoch"] = meta.get("epoch")
    shown["checkpoint_metrics"] = meta.get("metrics")
    shown["task"] = meta.get("config", {}).get("task")
    if args.json:
        print(json.dumps(shown, default=str))
    else:
        print(yaml.safe_dump(shown, sort_keys=False, default_flow_style=None), end="")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from relay.checkpoints import checkpoint, consolidate
    from relay.records import registry
    from relay.tasks import UntrustedTask

    storage = config_mod.resolve_storage(args.storage)
    try:
        found = registry.resolve_model(storage, args.ref)
        # What it exports says which task to load it with: one relay may import.
        allowed = [*args.allow_task, *registry.recorded_task(storage, found)]
        checkpoint.checked_task(found.checkpoint, allowed)
        path = consolidate.export(found.checkpoint, args.out)
    except KeyError as exc:
        return fail(f"export: {exc.args[0]}", EXIT_USAGE)
    except UntrustedTask as exc:
        return fail(f"export: {exc}", EXIT_USAGE)
    except checkpoint.CorruptCheckpoint as exc:
        return fail(f"export: {args.ref}: damaged checkpoint: {exc}", EXIT_FAILED)
    except OSError as exc:
        return fail(f"export: cannot write {args.out or found.checkpoint}: {exc}", EXIT_USAGE)
    print(path)
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from relay.checkpoints import checkpoint
    from relay.records import report, sweep_records

    storage = config_mod.resolve_storage(args.storage)
    try:
        path = report.write(storage, args.ref, Path(args.out) if args.out else None)
    except (KeyError, sweep_records.SweepRecordError) as exc:
        return fail(f"report: {exc.args[0]}", EXIT_USAGE)
    except checkpoint.CorruptCheckpoint as exc:
        return fail(f"report: {args.ref}: damaged checkpoint: {exc}", EXIT_FAILED)
    except OSError as exc:
        return fail(f"report: cannot write {args.out or 'the page'}: {exc.strerror}", EXIT_USAGE)
    print(path)
    return 0
