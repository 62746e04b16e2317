"""A swap's new weights, loaded by every replica before the swap.

`relay deploy` changes the deployment's user_config, and Serve calls each replica's
`reconfigure` with it. While that runs, Serve counts the replica as UPDATING and routes no new
requests to it (relay/serving/model_table.py): with one replica, every request waits as long as
`reconfigure` takes. Loading the new weights there would make that wait as long as the load (a
large model: seconds). So `relay deploy` stages the new table first, through one small actor
per application (the board): every replica watches it, loads what the staged table needs beside
the table it serves, and reports back; once all have, the deploy changes the user_config, and
`reconfigure` finds the weights already loaded and only swaps the table. A replica that cannot
load the new table reports why, and the deploy stops before anything changes.

Replicas that start later (a restart, autoscaling) load their table in `reconfigure`, as at
any start. A replica that does not report within the deploy's wait (one of an older relay that
has no watcher) still gets the new table, loaded in `reconfigure`: staging makes a swap shorter,
never different.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from typing import Any

import ray

WATCH_TIMEOUT_S = 30.0  # a watcher's long poll; it asks again after
# A replica that has not taken a staged table up by then has no watcher (it would have in
# milliseconds): the deploy stops waiting for it.
TAKE_UP_S = 10.0


@ray.remote(num_cpus=0)
class StagingBoard:
    """The staged table (set by relay deploy) and what each replica reported about it."""

    def __init__(self) -> None:
        self.key: str | None = None
        self.config: dict[str, Any] | None = None
        self.loading: set[str] = set()  # replicas that took the staged table up
        self.reports: dict[str, str | None] = {}  # replica → None (loaded) or the problem
        self.changed = asyncio.Event()

    async def stage(self, key: str, config: dict[str, Any]) -> None:
        self.key, self.config, self.loading, self.reports = key, config, set(), {}
        self.changed.set()
        self.changed = asyncio.Event()

    async def watch(self, seen: str | None) -> tuple[str | None, dict[str, Any] | None]:
        """The staged table once its key differs from `seen` (or what there is, after
        WATCH_TIMEOUT_S)."""
        if self.key == seen:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait(), WATCH_TIMEOUT_S)
        return self.key, self.config

    async def took_up(self, replica: str, key: str) -> None:
        if key == self.key:
            self.loading.add(replica)

    async def report(self, replica: str, key: str, problem: str | None) -> None:
        if key == self.key:
            self.reports[replica] = problem

    async def progress(self, key: str) -> tuple[set[str], dict[str, str | None]]:
        """The replicas loading the table staged as `key`, and those done with it."""
        return (set(self.loading), dict(self.reports)) if key == self.key else (set(), {})


def board(app_name: str):
    """The application's board: in Serve's namespace and detached, like the replicas."""
    return StagingBoard.options(
        name=f"relay-staging-{app_name}",
        namespace="serve",
        lifetime="detached",
        get_if_exists=True,
    ).remote()


def stage(app_name: str, config: dict[str, Any] | None, replicas: int, timeout_s: float) -> bool:
    """Stage `config` (a user_config; None calls a staging off) and wait until `replicas`
    replicas have loaded it. True when all did; False when some did not take it up within
    TAKE_UP_S or did not finish within `timeout_s` (the swap then loads the rest in
    reconfigure). Raises RuntimeError naming a replica that could not load it."""
    handle, key = board(app_name), uuid.uuid4().hex
    ray.get(handle.stage.remote(key, config))
    started = time.monotonic()
    while True:
        loading, reports = ray.get(handle.progress.remote(key))
        if problems := {replica: p for replica, p in reports.items() if p is not None}:
            replica, problem = next(iter(problems.items()))
            raise RuntimeError(f"replica {replica} cannot load the new models: {problem}")
        if len(reports) >= replicas:
            return True
        waited = time.monotonic() - started
        if waited > timeout_s or (waited > TAKE_UP_S and len(loading) < replicas):
            return False
        time.sleep(0.1)


async def watch_forever(app_name: str, replica: str, load) -> None:
    """A replica's background task: each newly staged table to `load` (an async callable of
    the user_config that keeps what it loaded for the next reconfigure), then the report."""
    handle, seen = board(app_name), None
    while True:
        try:
            key, config = await handle.watch.remote(seen)
        except ray.exceptions.RayActorError:  # the board died (its node): watch a new one
            handle = board(app_name)
            continue
        if key is None or key == seen:
            continue
        seen = key
        await handle.took_up.remote(replica, key)
        try:
            await load(config)
            problem = None
        except Exception as exc:  # a checkpoint that cannot be read, out of memory, ...
            problem = f"{type(exc).__name__}: {exc}"
        await handle.report.remote(replica, key, problem)
