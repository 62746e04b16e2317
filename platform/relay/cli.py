"""`relay train|tune|plan|runs|sweeps|config` — thin: parse, validate, call the API, print.

Exit codes: 0 success, 1 the run failed, 2 bad usage or an invalid config (found before any
cluster work: Ray is not even imported until the config is valid).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml

from relay import config as config_mod
from relay import serving

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

    models = sub.add_parser("models", help="list model versions and their aliases")
    models.add_argument("name", nargs="?", help="only this model")
    models.add_argument("--storage", help="storage root (default: $RELAY_HOME, else ~/relay)")
    models.add_argument("--json", action="store_true", help="print JSON")

    runs = sub.add_parser("runs", help="list recorded runs (newest first), or show one")
    runs.add_argument("action", nargs="?", choices=["show"], help="show one run")
    runs.add_argument("run_id", nargs="?", help="run id (or a unique prefix) for `show`")
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
    from relay import registry
    from relay.checkpoint import CorruptCheckpoint
    from relay.trainer import check_resumable, fit  # imports Ray: only with a good config

    run_id = None
    if args.resume:
        try:
            previous = registry.get_run(cfg.storage_path(), args.resume)
        except KeyError as exc:
            return _fail(f"--resume: {exc.args[0]}", EXIT_USAGE)
        check_resumable(previous["config"], cfg)  # a ConfigError: exit 2, naming the field
        run_id = previous["run_id"]
    try:
        result = fit(cfg, verbose=args.verbose, model_name=args.model_name, run_id=run_id)
    except CorruptCheckpoint as exc:  # found before any cluster work; the run is unchanged
        return _fail(f"--resume: {exc}", EXIT_USAGE)
    except Exception as exc:  # the run failed on the cluster; its record says so too
        return _fail(f"training failed: {_failure_summary(exc)}", EXIT_FAILED)
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
        from relay import sweep

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
    from relay import sweep  # imports Ray: only once the config is known to be good

    try:
        result = sweep.run(cfg, verbose=args.verbose, resume=args.resume, storage=storage)
    except config_mod.ConfigError:
        raise  # exit 2, naming the field (e.g. a PBT population the cluster cannot hold)
    except Exception as exc:
        return _fail(f"sweep failed: {exc}", EXIT_FAILED)
    if args.json:
        print(json.dumps(result.to_json_dict(), default=str))
    return 0 if result.best else EXIT_FAILED


def _cmd_config(args: argparse.Namespace) -> int:
    cfg = config_mod.load(args.config, args.overrides)
    print(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False), end="")
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    if args.workers is not None and args.workers < 1:
        return _fail(f"--workers must be >= 1, got {args.workers}", EXIT_USAGE)
    cfg = config_mod.load(args.config, args.overrides)
    from relay import plan  # imports Ray's train module: only once the config is known to be good

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

    from relay import checkpoint

    latest = checkpoint.latest_registered(record["run_dir"])
    paths = [record.get("checkpoint"), record.get("last_checkpoint"), latest and latest[0]]
    for path in dict.fromkeys(str(p) for p in paths if p):
        try:
            checkpoint.validate(Path(path))
        except checkpoint.CorruptCheckpoint as exc:
            return f"run {record['run_id']}: damaged checkpoint: {exc}"
    return None


def _cmd_runs(args: argparse.Namespace) -> int:
    from relay import history, registry

    storage = config_mod.resolve_storage(args.storage)
    if args.action == "show":
        if not args.run_id:
            return _fail("runs show needs a RUN_ID", EXIT_USAGE)
        try:
            record = registry.get_run(storage, args.run_id)
        except KeyError as exc:
            return _fail(str(exc.args[0]), EXIT_USAGE)
        record = {**record, "history": history.read(record["run_dir"])}
        damaged = _damaged_checkpoint(record)
        if args.json:
            print(json.dumps(record, default=str))
        else:
            report = record.pop("efficiency", None)
            print(yaml.safe_dump(record, sort_keys=False, default_flow_style=None), end="")
            if report:
                from relay.efficiency import format_report

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


def _cmd_sweeps(args: argparse.Namespace) -> int:
    # Files only: listing a sweep never imports Ray, let alone starts it.
    from relay import sweep_records

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
    from relay import registry

    storage = config_mod.resolve_storage(args.storage)
    versions = registry.list_versions(storage, args.name)
    by_model: dict[str, list[dict[str, Any]]] = {}
    for version in versions:
        by_model.setdefault(version["model"], []).append(version)
    if args.json:
        print(
            json.dumps(
                {
                    name: {
                        "versions": entries,
                        "latest": entries[-1]["version"],
                        "best": registry.best_version(entries)["version"],
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
        best, latest = registry.best_version(entries)["version"], entries[-1]["version"]
        for v in entries:
            aliases = [a for a, n in (("best", best), ("latest", latest)) if n == v["version"]]
            score = f"{v['metric']}={v['score']:.4g}" if v.get("score") is not None else ""
            tag = f"({', '.join(aliases)})" if aliases else ""
            print(f"{name}:{v['version']:<4} {tag:<16} {score:<24} {v['run_id']}")
    return 0


def _cmd_reference(args: argparse.Namespace) -> int:
    from relay.reference import config_reference

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
    "models": _cmd_models,
    "serve": serving.cmd_serve,
    "tokenizer": _cmd_tokenizer,
}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
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
