"""CPU that others use while a benchmark runs: the figures of a run that shared the machine
are unreliable, and load averages cannot tell a benchmark's own Ray cluster from someone else's
work. Shared by bench/strategies.py and bench/scaling.py."""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any

# Average CPU cores used by others during a run above this: the figures are unreliable.
BUSY_CORES = 0.25


class ForeignCPU:
    """CPU used by processes outside this benchmark's process tree (this process and its
    descendants: Ray's daemons and workers) while a run trains, in cores (CPU-seconds per
    second). Sampled from /proc every `interval` s; processes that live less than that are
    missed. `cores` is None where /proc is not available.

    With `training` (substrings of a command line, e.g. b"RayTrainWorker"), the bench's own
    tree is split too: the processes whose command line holds one of them train, the rest
    (Ray's daemons and actors, the driver, a launcher) support them. `between(t0, t1)` gives
    each share over the sampling intervals inside a window of wall-clock time, such as a run's
    epochs 2..N: what the support processes take from the cores while the workers train."""

    def __init__(self, interval: float = 1.0, training: tuple[bytes, ...] = ()) -> None:
        self._interval = interval
        self._training = training
        self._tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="foreign-cpu", daemon=True)
        self._ticks = 0
        self._started = 0.0
        # (interval start, interval end, {"foreign": ticks, "support": ..., "training": ...})
        self._intervals: list[tuple[float, float, dict[str, int]]] = []
        self.cores: float | None = None

    @staticmethod
    def _snapshot() -> dict[int, tuple[int, int]]:
        """pid → (parent pid, user + system clock ticks so far)."""
        out = {}
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/stat", "rb") as f:
                    raw = f.read()
            except OSError:
                continue
            fields = raw[raw.rindex(b")") + 2 :].split()  # after "pid (comm) "
            out[int(entry.name)] = (int(fields[1]), int(fields[11]) + int(fields[12]))
        return out

    @staticmethod
    def _ours(snapshot: dict[int, tuple[int, int]]) -> set[int]:
        children: dict[int, list[int]] = {}
        for pid, (ppid, _) in snapshot.items():
            children.setdefault(ppid, []).append(pid)
        ours, todo = set(), [os.getpid()]
        while todo:
            pid = todo.pop()
            ours.add(pid)
            todo.extend(children.get(pid, []))
        return ours

    def _trains(self, pid: int) -> bool:
        # Read each time: a Ray worker names itself after the actor it becomes.
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                command = f.read()
        except OSError:
            return False
        return any(marker in command for marker in self._training)

    def _poll(self) -> None:
        before, then = self._snapshot(), time.time()
        while True:
            stopping = self._stop.wait(self._interval)
            now, at = self._snapshot(), time.time()
            ours = self._ours(now)
            used = {"foreign": 0, "support": 0, "training": 0}
            for pid, (ppid, ticks) in now.items():
                if pid == 2 or ppid == 2:  # kernel threads
                    continue
                if pid not in ours:
                    share = "foreign"
                elif self._training:
                    share = "training" if self._trains(pid) else "support"
                else:
                    continue
                used[share] += ticks - before.get(pid, (ppid, 0))[1]
            self._ticks += used["foreign"]
            self._intervals.append((then, at, used))
            before, then = now, at
            if stopping:  # the last, partial interval is counted too
                return

    def between(self, t0: float, t1: float) -> dict[str, float] | None:
        """Cores used by each share ("foreign", "support", "training") over the sampling
        intervals that lie inside [t0, t1] (time.time()); None if none does."""
        inside = [(a, b, used) for a, b, used in self._intervals if a >= t0 and b <= t1]
        seconds = sum(b - a for a, b, _ in inside)
        if not inside or seconds <= 0:
            return None
        return {
            share: sum(used[share] for *_, used in inside) / self._tick / seconds
            for share in ("foreign", "support", "training")
        }

    def __enter__(self) -> ForeignCPU:
        if os.path.isdir("/proc"):
            self._started = time.perf_counter()
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._thread.is_alive():
            self._stop.set()
            self._thread.join()
            seconds = time.perf_counter() - self._started
            self.cores = self._ticks / self._tick / seconds if seconds > 0 else None


def busy_text(cores: float | None) -> str:
    return "n/a" if cores is None else f"{cores:.2f} cores"


def fit_watched(cfg_dict: dict[str, Any], show_progress: bool, training: tuple[bytes, ...] = ()):
    """`relay.training.driver.fit` of a config dict, watched: (result, wall seconds, the watcher:
    its
    `cores` are others', `between` splits the bench's own with `training`)."""
    import relay.config
    import relay.training.driver

    cfg = relay.config.from_dict(cfg_dict)
    called = time.perf_counter()
    with ForeignCPU(training=training) as others:
        result = relay.training.driver.fit(
            cfg, register=False, out=sys.stderr if show_progress else None
        )
    wall_s = time.perf_counter() - called
    if result.efficiency is None:
        raise RuntimeError(f"run {result.run_id} returned no efficiency report")
    return result, wall_s, others


def warn_if_busy(runs: list[dict[str, Any]]) -> int:
    """Print a warning for runs others' CPU disturbed; returns how many there were."""
    busy = [r for r in runs if (r["foreign_cpu_cores"] or 0.0) > BUSY_CORES]
    if busy:
        print(
            f"warning: other processes used more than {BUSY_CORES} cores on average during "
            f"{len(busy)} run(s) ({', '.join(busy_text(r['foreign_cpu_cores']) for r in busy)}): "
            "the figures are unreliable; rerun on a quiet machine"
        )
    return len(busy)
