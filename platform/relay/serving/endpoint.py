"""Where a running `relay serve` is, so that `relay deploy` can reach it from another shell.

`relay serve` writes `<storage>/serving/<host>_<port>.json` once its endpoint answers and
removes it when it stops: the Ray cluster it serves from (a cluster relay started has a GCS
address nobody else knows), the Serve application's name, and the arguments it was started
with (the replicas must be rebuilt from the same ones, or Serve would restart them). A record
whose process is gone (killed with -9) is stale and ignored: alive means the recorded pid runs
*and* started when the recorded one did, so a pid the kernel handed to another process since
does not count.

The record is written under a temporary name of its own (O_EXCL, mode 0600: it names the
cluster and its runtime_env, nobody else's business) and renamed into place, so a reader sees
the old record or the new one, never half; two writers never share a temporary file. It only
says where to look: `relay deploy` checks it against the live cluster before using it
(relay/serving/command.py).
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from relay import config


@dataclass
class Endpoint:
    host: str
    port: int
    address: str  # the Ray cluster's GCS address
    app_name: str
    pid: int  # the relay serve process
    args: dict[str, Any]  # its AppArgs
    # Ray 2.60 turns token authentication on for a cluster `ray.init()` starts (RAY_AUTH_MODE
    # in that process's environment; the token in ~/.ray/auth_token) and a driver joining it
    # must be in the same mode, or its connection times out without a word about auth.
    auth_mode: str | None = None
    # The runtime_env the replicas run with. Serve gives a deployment that names none the
    # runtime_env of the driver calling serve.run, and restarts every replica when it changes;
    # `relay deploy` is another driver (another cwd, joining rather than starting the cluster),
    # so it passes this one on instead, and a swap stays an in-place reconfigure.
    runtime_env: dict[str, Any] | None = None
    # When the relay serve process started (process_start_time): with the pid, tells it from a
    # later process that got the same pid. None: a record of a relay that did not note it.
    pid_start: str | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"


def record_path(storage: str | None, host: str, port: int) -> Path:
    return config.resolve_storage(storage) / "serving" / f"{host}_{port}.json"


def write(storage: str | None, endpoint: Endpoint) -> Path:
    path = record_path(storage, endpoint.host, endpoint.port)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(asdict(endpoint), indent=2).encode()
    # A name nobody else uses (a fixed one would let two writers, or a planted link, share it)
    # created here and now (O_EXCL: never an existing file or link) and private from the start.
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(descriptor, "wb") as file:
            file.write(text)
        os.replace(temporary, path)  # a reader sees the old record or the new one, never half
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return path


def process_start_time(pid: int) -> str | None:
    """When process `pid` started, in clock ticks since boot (field 22 of /proc/PID/stat), as
    text; None if it does not exist or this system has no /proc."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces or ")": split after
    # its last ")". What follows starts at field 3 (state); field 22 is 19 further on.
    return stat.rpartition(")")[2].split()[19]


def _alive(pid: int, started: str | None) -> bool:
    """Whether the recorded process still runs: its pid exists and started when recorded."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: it exists; its start time tells
        pass
    if not Path("/proc").is_dir():  # nothing to compare on this system: the pid alone
        return True
    return started is not None and process_start_time(pid) == started


def read(storage: str | None, host: str, port: int) -> Endpoint | None:
    """The endpoint serving at host:port, or None (none recorded, or its process is gone)."""
    path = record_path(storage, host, port)
    try:
        endpoint = Endpoint(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None
    return endpoint if _alive(endpoint.pid, endpoint.pid_start) else None


def remove(storage: str | None, host: str, port: int, pid: int) -> None:
    """Remove the record if it is still this process's."""
    path = record_path(storage, host, port)
    try:
        if json.loads(path.read_text()).get("pid") == pid:
            path.unlink()
    except (OSError, ValueError):
        pass


@contextmanager
def changing(storage: str | None, host: str, port: int) -> Iterator[None]:
    """Held by a `relay deploy` from reading the endpoint's model table until the new table
    is in: two deploys at once would each start from the same table, and the later would undo
    the earlier's change. A lock file next to the record (the kernel releases it if the
    process dies); the waiting one says why it waits."""
    path = record_path(storage, host, port).with_suffix(".lock")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"relay: waiting for another relay deploy to {host}:{port}", file=sys.stderr)
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield
