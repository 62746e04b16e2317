"""What the commands share: exit codes, failing with one line, the CONFIG and --set arguments,
leaving Ray before the last line of output, a run's or sweep's report page."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

EXIT_FAILED, EXIT_USAGE = 1, 2


def fail(message: str, code: int) -> int:
    print(f"relay: {message}", file=sys.stderr)
    return code


def add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="YAML run config, e.g. jobs/configs/digits.yaml")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a field, e.g. --set optim.lr=0.05 (repeatable; value read as YAML)",
    )


def last_line(exc: BaseException) -> str:
    """An error's last line: for one that carries a traceback, the exception itself."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__


def detach_from_ray() -> None:
    """The work is done: leave Ray now, not at exit. Until then Ray's log monitor may print a
    raylet warning into stdout at any moment, after what `--json` promises is the last line."""
    import ray

    if ray.is_initialized():
        ray.shutdown()


def write_report(storage: Path, ref: str) -> None:
    """The run's or sweep's report page, written at its end (a second or two); where it is."""
    from relay.records import report

    try:
        print(f"report: {report.write(storage, ref)}")
    except (OSError, ImportError) as exc:  # the run itself is done and recorded either way
        print(f"relay: no report page ({exc})", file=sys.stderr)
