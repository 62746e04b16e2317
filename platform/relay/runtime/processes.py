"""Ending exactly the processes one started: a `ray start` (or anything else) launched in a
session of its own (`start_new_session=True`) is ended session-wide, and nothing else is.
Ray's worker processes get process groups of their own but keep the session id."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

GENTLY = ((signal.SIGTERM, 15), (signal.SIGKILL, 10))


def session_members(sid: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if os.getsid(int(entry.name)) == sid:
                    pids.append(int(entry.name))
    return pids


def stop_session(leader: subprocess.Popen, signals=GENTLY) -> None:
    """End every process of the session `leader` leads: each signal in turn, waiting up to its
    grace seconds for them to go."""
    for sig, grace in signals:
        for pid in session_members(leader.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace
        while session_members(leader.pid) and time.monotonic() < deadline:
            leader.poll()  # reap the leader so it does not linger as a zombie
            time.sleep(0.2)
    leader.wait(timeout=30)
