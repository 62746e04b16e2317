"""Reading the ranks' stacks: where each rank is, whether it waits in a collective, and which
rank is the odd one out ("rank 1 in SlowTask.loss_and_stats, rank 0 waiting in backward").

A stalled data-parallel step is usually one rank that never reaches a collective and every
other rank waiting in it; the one not waiting is where to look.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

_LIBRARY_MARKERS = ("/site-packages/", "/dist-packages/", "/lib/python3")

# Library code whose frames mean "waiting for the other ranks", and what to call the wait.
# DDP's and FSDP's gradient collectives run from autograd hooks, below the Python frames.
_WAITS = (
    ("torch/distributed/distributed_c10d.py", None),  # the collective's own name
    ("torch/distributed/", None),
    ("torch/autograd/", "backward (the gradients' collectives)"),
    ("ray/train/", "ray.train.report (a collective)"),
)


def _own(frame: dict[str, Any]) -> bool:
    """Code of relay or of the user (their task, their model), not of a library."""
    filename = frame.get("filename") or ""
    if "/site-packages/relay/" in filename:
        return True
    return not filename.startswith("<") and not any(m in filename for m in _LIBRARY_MARKERS)


def _training_thread(threads: list[dict[str, Any]], thread_id: int | None) -> dict[str, Any]:
    for thread in threads:
        if thread_id is not None and thread.get("os_thread_id") == thread_id:
            return thread
    for thread in threads:  # the heartbeat's thread may be gone: the loop's is the one
        if any(f["name"].endswith("train_loop_per_worker") for f in thread["frames"]):
            return thread
    return threads[0]


def locate(record: dict[str, Any], dump: dict[str, Any]) -> dict[str, Any]:
    """Where one rank is: its innermost own frame (`where`), and the wait it is in, if any."""
    place: dict[str, Any] = {
        "rank": record["rank"],
        "hostname": record.get("hostname"),
        "node_ip": record.get("node_ip"),
        "pid": record["pid"],
        "epoch": record.get("epoch"),
        "phase": record.get("phase"),
        "step": record.get("step"),
        "steps": record.get("steps"),
        "last_progress": record.get("time"),
    }
    if "error" in dump:
        return {**place, "where": None, "waiting_in": None, "error": dump["error"]}
    frames = _training_thread(dump["threads"], record.get("thread_id"))["frames"]
    own = next((f for f in frames if _own(f)), None)
    place["where"] = own and f"{own['name']} ({own['short_filename']}:{own['line']})"
    place["function"] = own and own["name"]
    place["waiting_in"] = _wait(frames)
    place["frames"] = [f"{f['name']} ({f['short_filename']}:{f['line']})" for f in frames]
    return place


def _wait(frames: list[dict[str, Any]]) -> str | None:
    """The collective (or other cross-rank wait) the innermost frames are in, if visible."""
    for frame in frames:
        if _own(frame):
            return None  # the rank is in its own code, below any wait
        filename = frame.get("filename") or ""
        for marker, name in _WAITS:
            if marker in filename:
                return name or frame["name"]
    return None


def odd_ones_out(places: list[dict[str, Any]]) -> list[int]:
    """The ranks to look at: those not waiting while others wait for them; else, when all
    wait, the ranks in a wait fewer ranks share. Empty when nothing stands out."""
    seen = [p for p in places if "error" not in p]
    waiting = [p for p in seen if p["waiting_in"]]
    if waiting and len(waiting) < len(seen):
        return [p["rank"] for p in seen if not p["waiting_in"]]
    groups: dict[str, list[int]] = defaultdict(list)
    for p in seen:
        groups[p["waiting_in"] or p["where"] or "?"].append(p["rank"])
    if len(groups) < 2:
        return []
    sizes = sorted(len(ranks) for ranks in groups.values())
    if sizes[0] == sizes[1]:
        return []
    return min(groups.values(), key=len)


def summary(places: list[dict[str, Any]], odd: list[int], headline: str) -> str:
    """One screen: a line per rank, the odd ones first and marked."""
    lines = [headline]
    ordered = sorted(places, key=lambda p: (p["rank"] not in odd, p["rank"]))
    for p in ordered:
        at = f"epoch {p['epoch']}, {p['phase']}, {p['step']} steps done"
        host = f"{p['hostname']}/{p['node_ip']}" if p.get("node_ip") else p["hostname"]
        if "error" in p:
            where = f"no stack: {p['error']}"
        elif p["waiting_in"]:
            where = f"waiting in {p['waiting_in']}, from {p['where']}"
        else:
            where = f"in {p['where']}"
        mark = "   <- the odd one out" if p["rank"] in odd else ""
        lines.append(f"  rank {p['rank']} ({host}, pid {p['pid']}) {at}: {where}{mark}")
    return "\n".join(lines)
