"""`relay train|tune|plan|runs|sweeps|config` — thin: parse, validate, call the API, print.

Exit codes: 0 success, 1 the run failed, 2 bad usage or an invalid config (found before any
cluster work: Ray is not even imported until the config is valid).
"""

from __future__ import annotations

import argparse
import sys

from relay import config as config_mod
from relay.cli import records, train, tune
from relay.cli.common import EXIT_USAGE, fail
from relay.serving import command as serving


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="relay", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    # In the order `relay --help` lists them.
    train.add_train_parser(sub)
    tune.add_tune_parser(sub)
    train.add_config_parser(sub)
    train.add_plan_parser(sub)
    train.add_reference_parser(sub)
    records.add_report_parser(sub)
    train.add_doctor_parser(sub)
    records.add_models_parser(sub)
    records.add_export_parser(sub)
    records.add_runs_parser(sub)
    tune.add_sweeps_parser(sub)
    train.add_tokenizer_parser(sub)
    serving.add_parser(sub)
    return parser


COMMANDS = {
    "train": train.cmd_train,
    "tune": tune.cmd_tune,
    "config": train.cmd_config,
    "plan": train.cmd_plan,
    "runs": records.cmd_runs,
    "sweeps": tune.cmd_sweeps,
    "reference": train.cmd_reference,
    "report": records.cmd_report,
    "doctor": train.cmd_doctor,
    "models": records.cmd_models,
    "export": records.cmd_export,
    "serve": serving.cmd_serve,
    "deploy": serving.cmd_deploy,
    "tokenizer": train.cmd_tokenizer,
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
        return fail(
            f"invalid config{f' {where}' if where else ''}:\n  " + str(exc).replace("\n", "\n  "),
            EXIT_USAGE,
        )


if __name__ == "__main__":
    sys.exit(main())
