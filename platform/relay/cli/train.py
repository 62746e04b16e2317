"""`relay train`, `config`, `plan`, `reference`, `doctor`, `tokenizer`: a run and what prepares or
examines it."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import yaml

from relay import config as config_mod
from relay.cli.common import (
    EXIT_FAILED,
    EXIT_USAGE,
    add_config_args,
    detach_from_ray,
    fail,
    last_line,
    write_report,
)
from relay.serving import command as serving


def add_train_parser(sub) -> None:
    train = sub.add_parser("train", help="train a config on Ray (DDP through TorchTrainer)")
    add_config_args(train)
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


def add_config_parser(sub) -> None:
    check = sub.add_parser("config", help="validate a config and print it fully resolved")
    add_config_args(check)


def add_plan_parser(sub) -> None:
    plan = sub.add_parser(
        "plan", help="memory per rank under ddp, zero1 and fsdp, measured from the real model"
    )
    add_config_args(plan)
    plan.add_argument(
        "--workers", type=int, help="workers to plan for (default: the config's max workers)"
    )
    plan.add_argument(
        "--device-memory",
        help="memory of one device, e.g. 80GiB, 80GB, 512MiB or 1e9 (bytes); default: the "
        "GPU's, else this machine's RAM",
    )
    plan.add_argument("--json", action="store_true", help="print one JSON object")


def add_reference_parser(sub) -> None:
    sub.add_parser("reference", help="print the config reference (Markdown)")


def add_doctor_parser(sub) -> None:
    doctor = sub.add_parser(
        "doctor",
        help="a running run's every rank's stack (py-spy on its node), where each rank is and "
        "which stands out; kept under runs/<id>/doctor/",
    )
    doctor.add_argument("run_id", metavar="RUN", help="run id (or unique prefix)")
    doctor.add_argument("--storage", help="storage root (default: $RELAY_HOME, else ~/relay)")
    doctor.add_argument("--json", action="store_true", help="print JSON")


def add_tokenizer_parser(sub) -> None:
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


def cmd_train(args: argparse.Namespace) -> int:
    cfg = config_mod.load(args.config, args.overrides)
    from relay.checkpoints.checkpoint import CorruptCheckpoint
    from relay.records import registry
    from relay.records.run_admin import collected_reason
    from relay.tasks import UntrustedTask
    from relay.training.driver import check_resumable, fit  # imports Ray: only with a good config

    run_id = None
    if args.resume:
        try:
            previous = registry.get_run(cfg.storage_path(), args.resume)
        except KeyError as exc:
            return fail(f"--resume: {exc.args[0]}", EXIT_USAGE)
        check_resumable(previous["config"], cfg)  # a ConfigError: exit 2, naming the field
        run_id = previous["run_id"]
        if reason := collected_reason(previous):
            return fail(f"--resume: {reason}", EXIT_USAGE)
    try:
        result = fit(
            cfg,
            verbose=args.verbose,
            model_name=args.model_name,
            run_id=run_id,
            allow_task=args.allow_task,
        )
    except (CorruptCheckpoint, UntrustedTask) as exc:  # found before any cluster work; the
        return fail(f"--resume: {exc}", EXIT_USAGE)  # run is unchanged
    except Exception as exc:  # the run failed on the cluster; its record says so too
        return fail(f"training failed: {_failure_summary(exc)}", EXIT_FAILED)
    detach_from_ray()
    write_report(cfg.storage_path(), result.run_id)
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
        return "; ".join(f"rank {rank}: {last_line(e)}" for rank, e in sorted(failures.items()))
    return last_line(getattr(exc, "controller_failure", None) or exc)


def cmd_config(args: argparse.Namespace) -> int:
    cfg = config_mod.load(args.config, args.overrides)
    print(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False), end="")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    if args.workers is not None and args.workers < 1:
        return fail(f"--workers must be >= 1, got {args.workers}", EXIT_USAGE)
    cfg = config_mod.load(args.config, args.overrides)
    # Imports Ray's train module: only once the config is known to be good.
    from relay.training import plan

    if args.device_memory is None:
        memory, source = plan.default_device_memory()
    else:
        try:
            memory, source = plan.parse_bytes(args.device_memory), ""
        except ValueError as exc:
            return fail(f"--device-memory: {exc}", EXIT_USAGE)
    report = plan.plan(cfg, args.workers or cfg.scaling.max_workers, memory, source)
    print(json.dumps(report) if args.json else plan.render(report))
    return 0


def cmd_reference(args: argparse.Namespace) -> int:
    from relay.config.reference import config_reference

    print(config_reference(), end="")
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    from relay.observe import doctor
    from relay.records import registry

    storage = config_mod.resolve_storage(args.storage)
    try:
        run = registry.get_run(storage, args.run_id)
    except KeyError as exc:
        return fail(f"doctor: {exc.args[0]}", EXIT_USAGE)
    if run.get("status") != "running":
        return fail(f"doctor: run {run['run_id']} is not running ({run.get('status')})", EXIT_USAGE)
    try:
        found = doctor.examine(Path(run["run_dir"]))
    except LookupError as exc:
        return fail(f"doctor: {exc.args[0]}", EXIT_FAILED)
    if args.json:
        print(json.dumps(found, indent=2))
    else:
        print(found["summary"])
        print(f"  stacks: {found['dir']}")
    return 0


def cmd_tokenizer(args: argparse.Namespace) -> int:
    try:
        from relay.tasks.charlm import read_corpus
        from relay.tasks.hf import tokenizer
    except ImportError as exc:
        return fail(str(exc), EXIT_USAGE)
    if args.vocab_size < 256 + len(tokenizer.SPECIAL):
        return fail("--vocab-size: at least 258 (the 256 bytes and 2 special tokens)", EXIT_USAGE)
    try:
        text = read_corpus(Path(args.text).expanduser(), args.max_bytes)
    except (OSError, ValueError) as exc:
        return fail(f"{args.text}: {exc}", EXIT_USAGE)
    lines = text.decode("utf-8", errors="replace").splitlines()
    trained = tokenizer.train(lines, args.vocab_size)
    tokenizer.save(trained, Path(args.out))
    print(
        f"{trained.get_vocab_size()} tokens from {len(text):,} bytes → {args.out} "
        f"(use it with model.tokenizer: {args.out})"
    )
    return 0
