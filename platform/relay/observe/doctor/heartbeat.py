"""Each rank's progress, as a small file in the run's directory that the driver watches.

A rank writes `progress/rank-<K>.json` when its phase changes (model built, data loaded, an
epoch's training or validation pass, a checkpoint) and, inside a pass, at most once a second:
what it is doing, its last completed step, when, how fast steps have been going, and where it
runs (node, pid, thread), which is what the doctor needs to find it. The run's storage is seen
by every node (multi-node runs need that for checkpoints already), so the driver reads these
wherever the ranks are. Imports no Ray: the loop passes the node in.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

PROGRESS = "progress"


def progress_path(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / PROGRESS / f"rank-{rank}.json"


def read_all(run_dir: Path) -> list[dict[str, Any]]:
    """The newest progress of each rank of the current worker group, by rank.

    A worker group restarted on fewer workers leaves the files of the ranks it no longer has:
    only ranks below the world size of the newest file count."""
    records = []
    for path in sorted((Path(run_dir) / PROGRESS).glob("rank-*.json")):
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, ValueError):  # replaced while read: the next look gets it
            continue
    if not records:
        return []
    world = max(records, key=lambda r: r["time"])["world_size"]
    return sorted((r for r in records if r["rank"] < world), key=lambda r: r["rank"])


def placement(run_dir: Path) -> list[dict[str, Any]]:
    """Where the current worker group's ranks ran: rank, host name, node IP and node id, and
    what each computed with (`cpu`: threads, allowed cores, niceness; parallel.cpu_setup)."""
    keys = ("rank", "hostname", "node_ip", "node_id", "cpu")
    return [{key: record.get(key) for key in keys} for record in read_all(run_dir)]


class Heartbeat:
    """This rank's progress file. `step()` and `tick()` cost the training thread a clock read:
    a daemon thread writes the file, at most once per `interval_s` and only when something
    moved, so a stalled rank's file still shows its last completed step. Phase changes (rare)
    are written at once."""

    def __init__(
        self,
        run_dir: Path,
        rank: int,
        world_size: int,
        *,
        node_id: str | None = None,
        node_ip: str | None = None,
        cpu: dict[str, Any] | None = None,
        interval_s: float = 1.0,
    ) -> None:
        self._path = progress_path(run_dir, rank)
        with contextlib.suppress(OSError):  # unwritable: _write skips, the run goes on
            self._path.parent.mkdir(parents=True, exist_ok=True)
        now = time.time()
        self._record: dict[str, Any] = {
            "rank": rank,
            "world_size": world_size,
            "hostname": socket.gethostname(),
            "node_ip": node_ip,
            "node_id": node_id,
            "cpu": cpu,
            "pid": os.getpid(),
            # The thread that trains (Ray Train runs the loop in a thread of its own): the
            # doctor reads this thread's stack out of the process's.
            "thread_id": threading.get_native_id(),
            "started": now,
            "phase": "start",
            "epoch": None,
            "step": 0,  # optimizer steps completed in this epoch's training pass
            "steps": 0,  # optimizer steps completed by this worker group
            "step_s": None,  # seconds per step, over the last written interval of training
            "time": now,  # of the last progress
        }
        self._lock = threading.Lock()  # one writer at a time: the daemon or a phase change
        self._written: tuple[float, int] | None = None  # (time, steps) last written
        self._write()
        self._stop = threading.Event()
        self._interval_s = interval_s
        threading.Thread(target=self._keep_writing, name="relay-heartbeat", daemon=True).start()

    def phase(self, name: str, epoch: int | None = None) -> None:
        """This rank starts `name` ("model", "data", "train", "val", "report", "done"...)."""
        record = self._record
        record.update(phase=name, time=time.time())
        if epoch is not None:
            record["epoch"] = epoch
        if name == "train":
            record["step"] = 0
        self._write()
        if name == "done":
            self._stop.set()

    def stop(self) -> None:
        """No more writes (a loop that ended without "done": stopped, failed)."""
        self._stop.set()

    def step(self) -> None:
        """One optimizer step completed."""
        record = self._record
        record["step"] += 1
        record["steps"] += 1
        record["time"] = time.time()

    def tick(self) -> None:
        """Progress that is not a training step (a validation batch)."""
        self._record["time"] = time.time()

    def _keep_writing(self) -> None:
        while not self._stop.wait(self._interval_s):
            if self._written is None or self._record["time"] > self._written[0]:
                self._write()

    def _write(self) -> None:
        with self._lock:
            record = dict(self._record)  # the training thread goes on changing its own
            if record["phase"] == "train" and self._written and record["steps"] > self._written[1]:
                then, steps = self._written
                record["step_s"] = self._record["step_s"] = (record["time"] - then) / (
                    record["steps"] - steps
                )
            partial = self._path.with_name(self._path.name + ".tmp")
            try:
                partial.write_text(json.dumps(record))
                os.replace(partial, self._path)  # readers never see half a file
            except OSError:  # e.g. the storage is full: the doctor's loss, never the run's
                return
            self._written = (record["time"], record["steps"])


class NoHeartbeat:
    """Stands in where nothing watches (the plain-torchrun baseline)."""

    epoch = None

    def phase(self, name: str, epoch: int | None = None) -> None:
        pass

    def step(self) -> None:
        pass

    def tick(self) -> None:
        pass

    def stop(self) -> None:
        pass
