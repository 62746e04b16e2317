"""Every rank's Python stack, read from outside the process by py-spy (installed with Ray),
on the node the rank runs on: a Ray task pinned to that node, or this process where no Ray
cluster can be reached and the rank runs on this host.

py-spy attaches with ptrace: it needs the same user as the workers and a kernel that allows
it (root, CAP_SYS_PTRACE in a container, or kernel.yama.ptrace_scope 0).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

DUMP_TIMEOUT_S = 30.0


def py_spy() -> str:
    """py-spy beside this interpreter (the venv Ray was installed into), else on PATH."""
    beside = Path(sys.executable).with_name("py-spy")
    return str(beside) if beside.exists() else (shutil.which("py-spy") or "py-spy")


def dump_pids(pids: list[int]) -> dict[int, dict[str, Any]]:
    """py-spy's JSON dump of each process (its threads, innermost frame first), or the error."""
    running = {
        pid: subprocess.Popen(
            [py_spy(), "dump", "--pid", str(pid), "--json"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for pid in pids
    }  # all at once: a stalled group is best seen at one moment
    dumps: dict[int, dict[str, Any]] = {}
    for pid, process in running.items():
        try:
            out, err = process.communicate(timeout=DUMP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate()
            dumps[pid] = {"error": f"py-spy gave no dump of pid {pid} in {DUMP_TIMEOUT_S:.0f} s"}
            continue
        if process.returncode != 0:
            dumps[pid] = {"error": (err or out).strip() or f"py-spy exited {process.returncode}"}
            continue
        try:
            dumps[pid] = {"threads": json.loads(out)}
        except ValueError:
            dumps[pid] = {"error": f"py-spy's output was not JSON: {out[:200]!r}"}
    return dumps


def collect(ranks: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Each rank's dump ({"threads": [...]} or {"error": ...}), by rank. `ranks` are progress
    records (heartbeat.py): they say on which node, and which pid, each rank is."""
    by_node: dict[str | None, list[dict[str, Any]]] = defaultdict(list)
    for record in ranks:
        by_node[record.get("node_id")].append(record)
    on_ray = _connected()
    pending, dumps = {}, {}
    for node_id, records in by_node.items():
        pids = [r["pid"] for r in records]
        if on_ray and node_id:
            pending[node_id] = _dump_on_node(node_id, pids)
        elif all(r["hostname"] == socket.gethostname() for r in records):
            dumps[node_id] = dump_pids(pids)
        else:
            dumps[node_id] = {pid: {"error": "no Ray cluster to reach its node"} for pid in pids}
    if pending:
        import ray

        for node_id, ref in pending.items():
            try:
                dumps[node_id] = ray.get(ref, timeout=DUMP_TIMEOUT_S * 2)
            except Exception as exc:  # the node is gone, or the task could not be placed
                pids = [r["pid"] for r in by_node[node_id]]
                dumps[node_id] = {
                    pid: {"error": f"could not run py-spy on its node: {exc}"} for pid in pids
                }
    return {r["rank"]: dumps[r.get("node_id")][r["pid"]] for r in ranks}


def _connected() -> bool:
    """Whether a Ray cluster is at hand: this process's, else the one RAY_ADDRESS or this
    host's latest `ray start`/`ray.init()` names."""
    import ray

    if ray.is_initialized():
        return True
    if os.environ.get("RAY_ADDRESS") == "local":  # a cluster of its own: never start one here
        return False
    try:  # RAY_ADDRESS, else the cluster this host's latest `ray start`/`ray.init()` began
        ray.init(address="auto", log_to_driver=False, logging_level="ERROR")
    except (ConnectionError, RuntimeError, ValueError):
        return False
    return True


def _dump_on_node(node_id: str, pids: list[int]):
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    # No CPU: the ranks hold the node's CPUs, and py-spy only waits on them.
    task = ray.remote(num_cpus=0, max_retries=0)(dump_pids)
    return task.options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        name="relay-doctor-py-spy",
    ).remote(pids)
