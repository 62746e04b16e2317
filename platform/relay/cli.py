"""`relay train|tune|plan|runs|sweeps|config` — thin: parse, validate, call the API, print.

Exit codes: 0 success, 1 the run failed, 2 bad usage or an invalid config (found before any
cluster work: Ray is not even imported until the config is valid).
"""

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
from relay.serving import command as serving

EXIT_FAILED, EXIT_USAGE = 1, 2


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="YAML run config, e.g. jobs/configs/digits.yaml")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a field, e.g. --set optim.lr=0.05 (repeatable; value read as YAML)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="relay", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train a config on Ray (DDP through TorchTrainer)")
    _add_config_args(train)
    train.add_argument("--json", action="store_true", help="end with one JSON line of results")
    train.add_argument("--verbose", action="store_true", help="show Ray's own logs")
    train.add_argument(
        "--model-name", help="register the best checkpoint under this model (default: task name)"
    )
    train.add_argument(
        "--resume",
        metavar="RUN_ID",
        help="continue this run from its latest checkpoint under CONFIG (which may change "
        "workers, strategy, precision, epochs; not the model)",
    )
    serving.add_allow_task(train)

    tune = sub.add_parser("tune", help="sweep hyperparameters with ASHA (each trial: DDP)")
    tune.add_argument(
        "config", nargs="?", help="YAML sweep config, e.g. jobs/configs/digits-sweep.yaml"
    )
    tune.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a sweep field, e.g. --set num_samples=4 --set train.epochs=3",
    )
    tune.add_argument("--resume", metavar="SWEEP_ID", help="continue an interrupted sweep")
    tune.add_argument("--storage", help="storage root for --resume (default: $RELAY_HOME, ~/relay)")
    tune.add_argument("--json", action="store_true", help="end with one JSON line of results")
    tune.add_argument(
        "--serve",
        action="store_true",
        help="then serve the sweep's best version at --host:--port: swapped into the relay "
        "serve running there (as relay deploy), else served here until Ctrl-C (as relay serve)",
    )
    tune.add_argument("--host", default="127.0.0.1", help="with --serve (default: 127.0.0.1)")
    tune.add_argument(
        "--port", type=serving.port_number, default=8000, help="with --serve (default: 8000)"
    )
    tune.add_argument("--verbose", action="store_true", help="show Ray's own logs")

    check = sub.add_parser("config", help="validate a config and print it fully resolved")
    _add_config_args(check)

    plan = sub.add_parser(
        "plan", help="memory per rank under ddp, zero1 and fsdp, measured from the real model"
    )
    _add_config_args(plan)
    plan.add_argument(
        "--workers", type=int, help="workers to plan for (default: the config's max workers)"
    )
    plan.add_argument(
        "--device-memory",
        help="memory of one device, e.g. 80GiB, 80GB, 512MiB or 1e9 (bytes); default: the "
        "GPU's, else this machine's RAM",
    )
    plan.add_argument("--json", action="store_true", help="print one JSON object")

    sub.add_parser("reference", help="print the config reference (Markdown)")

    report = sub.add_parser(
        "report",
        help="write a run's, sweep's or model's report: one self-contained HTML page of charts",
    )
    report.add_argument("ref", help="run id, sweep id (or unique prefix), or model reference")
    report.add_argument("-o", "--out", help="file to write (default: report.html in its dir)")
    report.add_argument("--storage", help="storage root (default: $RELAY_HOME, else ~/relay)")

    doctor = sub.add_parser(
        "doctor",
        help="a running run's every rank's stack (py-spy on its node), where each rank is and "
        "which stands out; kept under runs/<id>/doctor/",
    )
    doctor.add_argument("run_id", metavar="RUN", help="run id (or unique prefix)")
    doctor.add_argument("--storage", help="storage root (default: $RELAY_HOME, else ~/relay)")
    doctor.add_argument("--json", action="store_true", help="print JSON")

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

    sweeps = sub.add_parser(
        "sweeps",
        help="list sweeps (newest first), or show one: its trials, their configs, epochs, "
        "ASHA rungs, status and final metrics",
    )
    sweeps.add_argument("action", nargs="?", choices=["show"], help="show one sweep")
    sweeps.add_argument("sweep_id", nargs="?", help="sweep id (or a unique prefix) for `show`")
    sweeps.add_argument("--storage", help="storage root (default: $RELAY_HOME, else ~/relay)")
    sweeps.add_argument("--json", action="store_true", help="print JSON")

    tokens = sub.add_parser(
        "tokenizer",
        help="train a byte-level BPE tokenizer on text files, for the hf tasks' model.tokenizer",
    )
    tokens.add_argument("text", help="a text file, or a directory whose files are all read")
    tokens.add_argument("--out", required=True, help="directory to write the tokenizer to")
    tokens.add_argument("--vocab-size", type=int, default=4096, help="tokens (default: 4096)")
    tokens.add_argument(
        "--max-bytes", type=int, default=100_000_000, help="read at most this much text"
    )

    serving.add_parser(sub)
    return parser


def _fail(message: str, code: int) -> int:
    print(f"relay: {message}", file=sys.stderr)
    return code


def _cmd_train(args: argparse.Namespace) -> int:
    cfg = config_mod.load(args.config, args.overrides)
    from relay.checkpoints.checkpoint import CorruptCheckpoint
    from relay.records import registry
    from relay.records.run_admin import collected_reason
    from relay.tasks import UntrustedTask
    from relay.training.trainer import check_resumable, fit  # imports Ray: only with a good config

    run_id = None
    if args.resume:
        try:
            previous = registry.get_run(cfg.storage_path(), args.resume)
        except KeyError as exc:
            return _fail(f"--resume: {exc.args[0]}", EXIT_USAGE)
        check_resumable(previous["config"], cfg)  # a ConfigError: exit 2, naming the field
        run_id = previous["run_id"]
        if reason := collected_reason(previous):
            return _fail(f"--resume: {reason}", EXIT_USAGE)
    try:
        result = fit(
            cfg,
            verbose=args.verbose,
            model_name=args.model_name,
            run_id=run_id,
            allow_task=args.allow_task,
        )
    except (CorruptCheckpoint, UntrustedTask) as exc:  # found before any cluster work; the
        return _fail(f"--resume: {exc}", EXIT_USAGE)  # run is unchanged
    except Exception as exc:  # the run failed on the cluster; its record says so too
        return _fail(f"training failed: {_failure_summary(exc)}", EXIT_FAILED)
    _detach_from_ray()
    _write_report(cfg.storage_path(), result.run_id)
    if args.json:
        payload = result.to_json_dict()
        payload.pop("history")
        print(json.dumps(payload, default=str))
    return 0


def _failure_summary(exc: BaseException) -> str:
    """One line for a failed run: each worker's own error (Ray's message spans many lines; the
    whole of it is kept in the run's record, `relay runs show`)."""
    failures = getattr(exc, "worker_failures", None)  # ray.train.WorkerGroupError
    if failures:
        return "; ".join(f"rank {rank}: {_last_line(e)}" for rank, e in sorted(failures.items()))
    return _last_line(getattr(exc, "controller_failure", None) or exc)


def _last_line(exc: BaseException) -> str:
    """An error's last line: for one that carries a traceback, the exception itself."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__


def _cmd_tune(args: argparse.Namespace) -> int:
    if args.resume:
        if args.config or args.overrides:
            return _fail("--resume takes the sweep's saved config; give no CONFIG or --set", 2)
        from relay.tuning import sweep

        storage = config_mod.resolve_storage(args.storage)
        try:
            cfg = sweep.load_spec(storage, args.resume)
        except KeyError as exc:
            return _fail(str(exc.args[0]), EXIT_USAGE)
    elif not args.config:
        return _fail("tune needs a CONFIG (or --resume SWEEP_ID)", EXIT_USAGE)
    else:
        cfg = config_mod.load_sweep(args.config, args.overrides)
        storage = cfg.train.storage_path()
    from relay.tuning import sweep  # imports Ray: only once the config is known to be good

    try:
        result = sweep.run(cfg, verbose=args.verbose, resume=args.resume, storage=storage)
    except config_mod.ConfigError:
        raise  # exit 2, naming the field (e.g. a PBT population the cluster cannot hold)
    except Exception as exc:
        return _fail(f"sweep failed: {exc}", EXIT_FAILED)
    _detach_from_ray()
    _write_report(storage, result.sweep)
    if args.json:
        print(json.dumps(result.to_json_dict(), default=str), flush=True)
    if not result.best:
        return EXIT_FAILED
    if args.serve:
        # With --json the JSON stays stdout's last line: what serving says goes to stderr.
        output = contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext()
        with output:
            return _serve_best(args, storage, result.model)
    return 0


def _serve_best(args: argparse.Namespace, storage: Path, model: str | None) -> int:
    """`relay tune --serve`: the sweep's registered best version onto an endpoint — swapped
    into the relay serve already at host:port, else served by this process."""
    from relay.serving import endpoint

    if model is None:
        return _fail("--serve: the sweep registered no model version to serve", EXIT_FAILED)
    # The version's task is the one the sweep trained, recorded in the storage root: the
    # checkpoint gate passes it with nothing more allowed.
    at = {"refs": [model], "host": args.host, "port": args.port, "verbose": args.verbose}
    at["allow_task"] = []
    if endpoint.read(str(storage), args.host, args.port) is not None:
        return serving.cmd_deploy(argparse.Namespace(**at, storage=str(storage)))
    flags = {field: None for field in serving.APP_FLAGS} | {"storage": str(storage)}
    return serving.cmd_serve(argparse.Namespace(**at, **flags, ingress=None, address=None))


def _detach_from_ray() -> None:
    """The work is done: leave Ray now, not at exit. Until then Ray's log monitor may print a
    raylet warning into stdout at any moment, after what `--json` promises is the last line."""
    import ray

    if ray.is_initialized():
        ray.shutdown()


def _write_report(storage: Path, ref: str) -> None:
    """The run's or sweep's report page, written at its end (a second or two); where it is."""
    from relay.records import report

    try:
        print(f"report: {report.write(storage, ref)}")
    except (OSError, ImportError) as exc:  # the run itself is done and recorded either way
        print(f"relay: no report page ({exc})", file=sys.stderr)


def _cmd_config(args: argparse.Namespace) -> int:
    cfg = config_mod.load(args.config, args.overrides)
    print(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False), end="")
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    if args.workers is not None and args.workers < 1:
        return _fail(f"--workers must be >= 1, got {args.workers}", EXIT_USAGE)
    cfg = config_mod.load(args.config, args.overrides)
    from relay.training import (
        plan,  # imports Ray's train module: only once the config is known to be good
    )

    if args.device_memory is None:
        memory, source = plan.default_device_memory()
    else:
        try:
            memory, source = plan.parse_bytes(args.device_memory), ""
        except ValueError as exc:
            return _fail(f"--device-memory: {exc}", EXIT_USAGE)
    report = plan.plan(cfg, args.workers or cfg.scaling.max_workers, memory, source)
    print(json.dumps(report) if args.json else plan.render(report))
    return 0


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


def _cmd_runs(args: argparse.Namespace) -> int:
    from relay.records import history, registry

    storage = config_mod.resolve_storage(args.storage)
    wanted = {None: 0, "show": 1, "logs": 1, "compare": 2, "gc": 0}.get(args.action)
    if wanted is not None and len(args.run_ids) != wanted:
        return _fail(
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
            return _fail(str(exc.args[0]), EXIT_USAGE)
        record = {**record, "history": history.read(record["run_dir"])}
        damaged = _damaged_checkpoint(record)
        if not damaged and (untrusted := _untrusted_checkpoint(record, args.allow_task)):
            return _fail(untrusted, EXIT_USAGE)
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
        return _fail(damaged, EXIT_FAILED) if damaged else 0
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
        return _fail("runs rm: name the runs to delete", EXIT_USAGE)
    try:
        records = run_admin.plan_removal(storage, args.run_ids, force=args.force)
    except (KeyError, run_admin.Refused) as exc:  # nothing was deleted
        return _fail(f"runs rm: {exc.args[0]}", EXIT_USAGE)
    run_admin.remove(storage, records)
    removed = [r["run_id"] for r in records]
    print(json.dumps({"removed": removed}) if args.json else f"removed {', '.join(removed)}")
    return 0


def _runs_gc(storage: Path, args: argparse.Namespace) -> int:
    from relay.observe import console
    from relay.records import run_admin

    if args.keep_best is None:
        return _fail(
            "runs gc: --keep-best N says how many of the best runs keep theirs", EXIT_USAGE
        )
    try:
        plan = run_admin.plan_collection(storage, args.keep_best)
        if not args.dry_run:
            run_admin.collect(storage, plan)  # Refused (a ValueError): nothing deleted
    except ValueError as exc:
        return _fail(f"runs gc: {exc}", EXIT_USAGE)
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
        return _fail(f"runs logs: {exc.args[0]}", EXIT_USAGE)
    run_dir = Path(record["run_dir"])
    present = worker_logs.ranks(run_dir)
    if args.rank is not None and args.rank not in present and not args.follow:
        return _fail(
            f"runs logs: run {record['run_id']} has no log of rank {args.rank}", EXIT_USAGE
        )

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
        return _fail(f"runs compare: {exc.args[0]}", EXIT_USAGE)
    comparison = run_admin.compare(first, second)
    print(
        json.dumps(comparison, default=str)
        if args.json
        else run_admin.format_comparison(comparison)
    )
    return 0


def _cmd_sweeps(args: argparse.Namespace) -> int:
    # Files only: listing a sweep never imports Ray, let alone starts it.
    from relay.records import sweep_records

    storage = config_mod.resolve_storage(args.storage)
    if args.action == "show":
        if not args.sweep_id:
            return _fail("sweeps show needs a SWEEP_ID", EXIT_USAGE)
        try:
            view = sweep_records.read_sweep(
                storage, sweep_records.find_sweep_id(storage, args.sweep_id)
            )
        except KeyError as exc:
            return _fail(str(exc.args[0]), EXIT_USAGE)
        except sweep_records.SweepRecordError as exc:
            return _fail(str(exc), EXIT_FAILED)
        print(json.dumps(view, default=str) if args.json else sweep_records.render_sweep(view))
        return 0
    views = sweep_records.list_sweeps(storage)
    if args.json:
        print(json.dumps(views, default=str))
    elif not views:
        print(f"no sweeps under {sweep_records.sweeps_root(storage)}")
    else:
        for view in views:
            print(sweep_records.sweep_line(view))
    # The others are listed all the same; a sweep whose files cannot be read is an error.
    for view in views:
        if "error" in view:
            _fail(view["error"], EXIT_FAILED)
    return EXIT_FAILED if any("error" in view for view in views) else 0


def _cmd_models(args: argparse.Namespace) -> int:
    from relay.records import registry

    storage = config_mod.resolve_storage(args.storage)
    verb, rest = (args.words[0], args.words[1:]) if args.words else (None, [])
    if verb == "alias":
        return _models_alias(storage, rest, args)
    if verb == "show":
        if len(rest) != 1:
            return _fail("models show: takes one REF (name, name:VERSION, name:ALIAS)", EXIT_USAGE)
        return _models_show(storage, rest[0], args)
    if args.rm:
        return _fail("--rm: only with `models alias`", EXIT_USAGE)
    if len(args.words) > 1:
        return _fail(f"models: unknown verb {verb!r} (show, alias)", EXIT_USAGE)
    try:
        versions = registry.list_versions(storage, verb)
        by_model: dict[str, list[dict[str, Any]]] = {}
        for version in versions:
            by_model.setdefault(version["model"], []).append(version)
        aliases = {name: registry.aliases_of(storage, name, e) for name, e in by_model.items()}
    except (KeyError, ValueError) as exc:  # a bad model name, or a damaged aliases.json
        return _fail(f"models: {exc.args[0]}", EXIT_USAGE)
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
        return _fail(usage, EXIT_USAGE)
    target, alias = words
    name, _, number = target.partition(":")
    if args.rm == bool(number) or (number and not number.isdigit()):
        return _fail(usage, EXIT_USAGE)
    try:
        before = registry.read_aliases(storage, name).get(alias)
        aliases = registry.set_alias(storage, name, None if args.rm else int(number), alias)
    except (KeyError, ValueError) as exc:
        return _fail(f"models alias: {exc.args[0]}", EXIT_USAGE)
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
        return _fail(f"models show: {exc.args[0]}", EXIT_USAGE)
    except checkpoint.CorruptCheckpoint as exc:
        return _fail(f"models show: {ref}: damaged checkpoint: {exc}", EXIT_FAILED)
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


def _cmd_export(args: argparse.Namespace) -> int:
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
        return _fail(f"export: {exc.args[0]}", EXIT_USAGE)
    except UntrustedTask as exc:
        return _fail(f"export: {exc}", EXIT_USAGE)
    except checkpoint.CorruptCheckpoint as exc:
        return _fail(f"export: {args.ref}: damaged checkpoint: {exc}", EXIT_FAILED)
    except OSError as exc:
        return _fail(f"export: cannot write {args.out or found.checkpoint}: {exc}", EXIT_USAGE)
    print(path)
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from relay.checkpoints import checkpoint
    from relay.records import report, sweep_records

    storage = config_mod.resolve_storage(args.storage)
    try:
        path = report.write(storage, args.ref, Path(args.out) if args.out else None)
    except (KeyError, sweep_records.SweepRecordError) as exc:
        return _fail(f"report: {exc.args[0]}", EXIT_USAGE)
    except checkpoint.CorruptCheckpoint as exc:
        return _fail(f"report: {args.ref}: damaged checkpoint: {exc}", EXIT_FAILED)
    except OSError as exc:
        return _fail(f"report: cannot write {args.out or 'the page'}: {exc.strerror}", EXIT_USAGE)
    print(path)
    return 0


def _cmd_doctor(args: argparse.Namespace) -> int:
    from relay.observe import doctor
    from relay.records import registry

    storage = config_mod.resolve_storage(args.storage)
    try:
        run = registry.get_run(storage, args.run_id)
    except KeyError as exc:
        return _fail(f"doctor: {exc.args[0]}", EXIT_USAGE)
    if run.get("status") != "running":
        return _fail(
            f"doctor: run {run['run_id']} is not running ({run.get('status')})", EXIT_USAGE
        )
    try:
        found = doctor.examine(Path(run["run_dir"]))
    except LookupError as exc:
        return _fail(f"doctor: {exc.args[0]}", EXIT_FAILED)
    if args.json:
        print(json.dumps(found, indent=2))
    else:
        print(found["summary"])
        print(f"  stacks: {found['dir']}")
    return 0


def _cmd_reference(args: argparse.Namespace) -> int:
    from relay.config.reference import config_reference

    print(config_reference(), end="")
    return 0


def _cmd_tokenizer(args: argparse.Namespace) -> int:
    try:
        from relay.tasks.charlm import read_corpus
        from relay.tasks.hf import tokenizer
    except ImportError as exc:
        return _fail(str(exc), EXIT_USAGE)
    if args.vocab_size < 256 + len(tokenizer.SPECIAL):
        return _fail("--vocab-size: at least 258 (the 256 bytes and 2 special tokens)", EXIT_USAGE)
    try:
        text = read_corpus(Path(args.text).expanduser(), args.max_bytes)
    except (OSError, ValueError) as exc:
        return _fail(f"{args.text}: {exc}", EXIT_USAGE)
    lines = text.decode("utf-8", errors="replace").splitlines()
    trained = tokenizer.train(lines, args.vocab_size)
    tokenizer.save(trained, Path(args.out))
    print(
        f"{trained.get_vocab_size()} tokens from {len(text):,} bytes → {args.out} "
        f"(use it with model.tokenizer: {args.out})"
    )
    return 0


COMMANDS = {
    "train": _cmd_train,
    "tune": _cmd_tune,
    "config": _cmd_config,
    "plan": _cmd_plan,
    "runs": _cmd_runs,
    "sweeps": _cmd_sweeps,
    "reference": _cmd_reference,
    "report": _cmd_report,
    "doctor": _cmd_doctor,
    "models": _cmd_models,
    "export": _cmd_export,
    "serve": serving.cmd_serve,
    "deploy": serving.cmd_deploy,
    "tokenizer": _cmd_tokenizer,
}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # `models alias --rm NAME ALIAS`, `runs logs -f RUN`: argparse ends a list of positionals
    # at the first flag; the words after it belong to the same list.
    positionals = {"models": "words", "runs": "run_ids"}.get(args.command)
    if extra and positionals and not any(e.startswith("-") for e in extra):
        setattr(args, positionals, getattr(args, positionals) + extra)
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return COMMANDS[args.command](args)
    except config_mod.ConfigError as exc:
        where = getattr(args, "config", None)
        return _fail(
            f"invalid config{f' {where}' if where else ''}:\n  " + str(exc).replace("\n", "\n  "),
            EXIT_USAGE,
        )


if __name__ == "__main__":
    sys.exit(main())
