"""Each worker's own output kept with its run, for `relay runs logs`:

    <run_dir>/logs/rank_<r>.log    what rank r's Python code printed or warned (stdout and
                                   stderr), every attempt appended after a header line

Ray keeps every process's output in its session directory on the node that ran it (gone when
the cluster is); these files sit on the storage path with the run, from every node. What goes
through Python's sys.stdout / sys.stderr is kept: print, warnings, tracebacks; output of
handlers bound to a stream before the loop starts (Ray's own loggers) and of C code is not.
A log that cannot be written never costs the run: that rank's copy stops.
"""

from __future__ import annotations

import io
import os
import socket
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from datetime import UTC, datetime
from pathlib import Path
from typing import TextIO

LOGS = "logs"


class _Tee(io.TextIOBase):
    """A text stream that writes to the worker's own stream and a copy to the run's log."""

    def __init__(self, stream: TextIO, copy: TextIO) -> None:
        self.stream, self.copy = stream, copy

    def write(self, text: str) -> int:
        if self.copy is not None:
            try:
                self.copy.write(text)
            except (OSError, ValueError):  # full or closed: the run goes on without a copy
                self.copy = None
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()

    def fileno(self) -> int:
        return self.stream.fileno()

    def isatty(self) -> bool:
        return self.stream.isatty()

    @property
    def encoding(self) -> str:
        return getattr(self.stream, "encoding", "utf-8")


def log_path(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / LOGS / f"rank_{rank}.log"


@contextmanager
def captured(run_dir: Path, rank: int, world_size: int) -> Iterator[None]:
    """Copy this worker's stdout and stderr to its rank's log for the block; an exception
    that ends the block is written there too."""
    path = log_path(run_dir, rank)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        copy = open(path, "a", buffering=1)  # noqa: SIM115 (closed below; line-buffered)
        copy.write(
            f"--- relay: rank {rank} of {world_size} on {socket.gethostname()}, pid "
            f"{os.getpid()}, {datetime.now(UTC):%Y-%m-%d %H:%M:%S} UTC ---\n"
        )
    except OSError:
        yield
        return
    streams = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _Tee(streams[0], copy), _Tee(streams[1], copy)
    try:
        yield
    except BaseException:
        with suppress(OSError, ValueError):
            traceback.print_exc(file=copy)
        raise
    finally:
        sys.stdout, sys.stderr = streams
        copy.close()


def ranks(run_dir: Path) -> list[int]:
    """The ranks that have a log, in order."""
    found = (p.stem.removeprefix("rank_") for p in (Path(run_dir) / LOGS).glob("rank_*.log"))
    return sorted(int(r) for r in found if r.isdigit())


def show(
    run_dir: Path,
    out: TextIO,
    *,
    rank: int | None = None,
    follow: Callable[[], bool] | None = None,
    poll_s: float = 0.5,
) -> None:
    """Print the run's worker logs (one rank's, or every rank's with a `[rank r]` prefix).
    With `follow` (called between polls: True while the run may still write), keep printing
    what is appended until it returns False, then print the rest and stop."""
    offsets: dict[int, int] = {}
    pending: dict[int, str] = {}

    def drain() -> None:
        for r in [rank] if rank is not None else ranks(run_dir):
            path = log_path(run_dir, r)
            try:
                with open(path, encoding="utf-8", errors="replace") as f:
                    f.seek(offsets.get(r, 0))
                    text = f.read()
                    offsets[r] = f.tell()
            except FileNotFoundError:
                continue
            text = pending.pop(r, "") + text
            complete, _, partial = text.rpartition("\n")
            if partial:
                pending[r] = partial  # a line still being written: printed once it ends
            prefix = "" if rank is not None else f"[rank {r}] "
            for line in complete.splitlines():
                out.write(f"{prefix}{line}\n")
        out.flush()

    drain()
    while follow is not None and follow():
        time.sleep(poll_s)
        drain()
    if follow is not None:
        drain()  # what was written between the last poll and the end
    for r, partial in pending.items():  # a last line without a newline
        out.write(f"{'' if rank is not None else f'[rank {r}] '}{partial}\n")
