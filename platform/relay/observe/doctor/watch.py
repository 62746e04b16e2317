"""The hang doctor: notices a run whose ranks stopped making progress, and examines it.

While `relay train` (or a sweep's trial) waits in `fit()`, `watching` reads the ranks'
progress files (heartbeat.py) every few seconds. When no rank has made progress for the stall
threshold, it examines the run once (until progress resumes): every rank's stack, read by
py-spy on the rank's node, with its last completed step, into `runs/<id>/doctor/<time>/`, and a
one-screen summary on the console naming the rank that stands out. `relay doctor RUN` examines
a running run on demand.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TextIO

from relay.config import DoctorConfig
from relay.observe.doctor import diagnosis, heartbeat, stacks
from relay.runtime import background

DOCTOR = "doctor"
# Until the run has timed its steps (its first training pass), the threshold is generous:
# start-up, the first epoch's compilation and data loading make no steps for a while.
UNTIMED_STALL_S = 300.0
TIMED_FLOOR_S, STEPS_OF_SILENCE = 120.0, 30


def stall_threshold(cfg: DoctorConfig, ranks: list[dict[str, Any]]) -> float:
    """`doctor.stall_s` if set; else a few minutes, longer for runs whose steps are slow."""
    if cfg.stall_s is not None:
        return cfg.stall_s
    step_s = [r["step_s"] for r in ranks if r.get("step_s")]
    if not step_s:
        return UNTIMED_STALL_S
    return max(TIMED_FLOOR_S, STEPS_OF_SILENCE * max(step_s))


def examine(
    run_dir: Path, reason: str | None = None, ranks: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """Read every rank's stack now; write them and the summary under the run's doctor/ dir.
    `ranks`: the progress records to examine (default: every rank's, read now).
    Returns {"dir", "ranks": [where each rank is], "odd_ones_out", "summary"}."""
    run_dir = Path(run_dir)
    if ranks is None:
        ranks = heartbeat.read_all(run_dir)
    if not ranks:
        raise LookupError(f"run {run_dir.name} has no rank that reported progress")
    now = time.time()
    dumps = stacks.collect(ranks)
    places = [diagnosis.locate(r, dumps[r["rank"]]) for r in ranks]
    odd = diagnosis.odd_ones_out(places)
    newest = max(r["time"] for r in ranks)
    headline = reason or (
        f"doctor: run {run_dir.name}: the newest progress of any rank was {now - newest:.0f} s ago"
    )
    out_dir = run_dir / DOCTOR / datetime.fromtimestamp(now, UTC).strftime("%Y%m%dT%H%M%S.%fZ")
    text = diagnosis.summary(places, odd, headline)
    report = {
        "time": now,
        "run_id": run_dir.name,
        "reason": reason,
        "odd_ones_out": odd,
        "ranks": places,
    }
    out_dir.mkdir(parents=True)
    (out_dir / "summary.txt").write_text(text + f"\nstacks: {out_dir}\n")
    (out_dir / "doctor.json").write_text(json.dumps(report, indent=1))
    for rank, dump in dumps.items():
        (out_dir / f"rank-{rank}.json").write_text(json.dumps(dump, indent=1))
    return {**report, "dir": str(out_dir), "summary": text}


def examinations(run_dir: Path) -> list[Path]:
    """The run's doctor reports, oldest first."""
    return sorted(p for p in (Path(run_dir) / DOCTOR).glob("*") if (p / "doctor.json").exists())


class _StallWatch:
    def __init__(self, cfg: DoctorConfig, run_dir: Path, out: TextIO | None) -> None:
        self.cfg, self.run_dir, self.out = cfg, run_dir, out
        self.closed = False
        self.since = time.time()  # progress files older than this are an earlier call's
        self._examined_at_progress: float | None = None  # one examination per stall
        self._lock = threading.Lock()

    def check(self) -> None:
        if self.closed or not self._lock.acquire(blocking=False):
            return
        try:
            self._check()
        except Exception as exc:  # the doctor must never cost the run
            if self.out is not None:
                self.out.write(f"doctor: could not examine run {self.run_dir.name}: {exc}\n")
        finally:
            self._lock.release()

    def _check(self) -> None:
        ranks = [r for r in heartbeat.read_all(self.run_dir) if r["started"] >= self.since]
        live = [r for r in ranks if r["phase"] != "done"]
        if not live:
            return
        newest = max(r["time"] for r in ranks)
        silent_s = time.time() - newest
        threshold = stall_threshold(self.cfg, ranks)
        if silent_s < threshold or self._examined_at_progress == newest:
            return
        self._examined_at_progress = newest
        laggard = min(ranks, key=lambda r: (r["steps"], r["time"]))
        reason = (
            f"doctor: run {self.run_dir.name} has made no progress for {silent_s:.0f} s "
            f"(doctor.stall_s {threshold:.0f} s); last completed: epoch {laggard['epoch']} "
            f"step {laggard['step']} ({laggard['phase']})"
        )
        found = examine(self.run_dir, reason, ranks)  # this worker group's ranks
        if self.out is not None and not self.closed:
            self.out.write(found["summary"] + f"\n  stacks: {found['dir']}\n")


@contextmanager
def watching(cfg: DoctorConfig, run_dir: Path, out: TextIO | None) -> Iterator[None]:
    """Watch the run at `run_dir` for stalls while the block runs (`doctor.watch`)."""
    if not cfg.watch:
        yield
        return
    watch = _StallWatch(cfg, Path(run_dir), out)
    interval = min(5.0, max(0.5, (cfg.stall_s or UNTIMED_STALL_S) / 4))
    with background.every(interval, watch.check, "relay-doctor"):
        try:
            yield
        finally:
            watch.closed = True  # the run is over: its ranks are gone or going
