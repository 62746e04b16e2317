"""`relay tune` (and `--serve` of its best) and `relay sweeps`."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

from relay import config as config_mod
from relay.cli.common import (
    EXIT_FAILED,
    EXIT_USAGE,
    detach_from_ray,
    fail,
    write_report,
)
from relay.serving import command as serving


def add_tune_parser(sub) -> None:
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


def add_sweeps_parser(sub) -> None:
    sweeps = sub.add_parser(
        "sweeps",
        help="list sweeps (newest first), or show one: its trials, their configs, epochs, "
        "ASHA rungs, status and final metrics",
    )
    sweeps.add_argument("action", nargs="?", choices=["show"], help="show one sweep")
    sweeps.add_argument("sweep_id", nargs="?", help="sweep id (or a unique prefix) for `show`")
    sweeps.add_argument("--storage", help="storage root (default: $RELAY_HOME, else ~/relay)")
    sweeps.add_argument("--json", action="store_true", help="print JSON")


def cmd_tune(args: argparse.Namespace) -> int:
    if args.resume:
        if args.config or args.overrides:
            return fail("--resume takes the sweep's saved config; give no CONFIG or --set", 2)
        from relay.tuning import sweep

        storage = config_mod.resolve_storage(args.storage)
        try:
            cfg = sweep.load_spec(storage, args.resume)
        except KeyError as exc:
            return fail(str(exc.args[0]), EXIT_USAGE)
    elif not args.config:
        return fail("tune needs a CONFIG (or --resume SWEEP_ID)", EXIT_USAGE)
    else:
        cfg = config_mod.load_sweep(args.config, args.overrides)
        storage = cfg.train.storage_path()
    from relay.tuning import sweep  # imports Ray: only once the config is known to be good

    try:
        result = sweep.run(cfg, verbose=args.verbose, resume=args.resume, storage=storage)
    except config_mod.ConfigError:
        raise  # exit 2, naming the field (e.g. a PBT population the cluster cannot hold)
    except Exception as exc:
        return fail(f"sweep failed: {exc}", EXIT_FAILED)
    detach_from_ray()
    write_report(storage, result.sweep)
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
        return fail("--serve: the sweep registered no model version to serve", EXIT_FAILED)
    # The version's task is the one the sweep trained, recorded in the storage root: the
    # checkpoint gate passes it with nothing more allowed.
    at = {"refs": [model], "host": args.host, "port": args.port, "verbose": args.verbose}
    at["allow_task"] = []
    if endpoint.read(str(storage), args.host, args.port) is not None:
        return serving.cmd_deploy(argparse.Namespace(**at, storage=str(storage)))
    flags = {field: None for field in serving.APP_FLAGS} | {"storage": str(storage)}
    return serving.cmd_serve(argparse.Namespace(**at, **flags, ingress=None, address=None))


def cmd_sweeps(args: argparse.Namespace) -> int:
    # Files only: listing a sweep never imports Ray, let alone starts it.
    from relay.records import sweep_records

    storage = config_mod.resolve_storage(args.storage)
    if args.action == "show":
        if not args.sweep_id:
            return fail("sweeps show needs a SWEEP_ID", EXIT_USAGE)
        try:
            view = sweep_records.read_sweep(
                storage, sweep_records.find_sweep_id(storage, args.sweep_id)
            )
        except KeyError as exc:
            return fail(str(exc.args[0]), EXIT_USAGE)
        except sweep_records.SweepRecordError as exc:
            return fail(str(exc), EXIT_FAILED)
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
            fail(view["error"], EXIT_FAILED)
    return EXIT_FAILED if any("error" in view for view in views) else 0
