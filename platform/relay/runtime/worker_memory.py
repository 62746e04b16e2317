"""A hard memory limit per worker process, enforced by the OS (`scaling.memory_per_worker`).

Where the cgroup v1 memory controller can be written (Linux, as root), each rank gets a cgroup of
its own, `relay-<run id>-rank<K>`, nested in the group the process is in (so any limit a
container already sets still holds), with `memory.limit_in_bytes` and swap capped alike; the
worker moves itself in before it builds anything. cgroup v1 leaves what a process was charged
before the move with its old group, so the limit covers what training allocates — the model,
its gradients and optimizer state, activations, checkpoint buffers — and not the ~0.4 GB of
interpreter, torch and Ray the worker held already. Past the limit the kernel's OOM killer ends
the process; the group's counters tell the driver afterwards which rank it was
(`ranks_killed`). Elsewhere: RLIMIT_DATA, set at the process's data size now plus the limit, so
allocations past it fail inside torch (a RuntimeError) instead.
"""

from __future__ import annotations

import os
import re
import resource
import time
from dataclasses import dataclass
from pathlib import Path

CGROUP_MEMORY = Path("/sys/fs/cgroup/memory")
PREFIX = "relay-"


@dataclass(frozen=True)
class Confinement:
    mechanism: str  # "cgroup" or "rlimit"
    limit_bytes: int
    where: str  # the cgroup's path, or the rlimit it set


class OutOfMemory(RuntimeError):
    """A run's workers did not fit their memory limit."""


# What a rank's OutOfMemory says when RLIMIT_DATA refuses it an allocation; the driver and
# the failure policy read the rank back from this text in the worker failure.
_REFUSED = "out of memory at its limit of"


def refused(rank: int, limit_text: str) -> OutOfMemory:
    """The error a rank raises when an allocation past its RLIMIT_DATA limit fails."""
    return OutOfMemory(f"rank {rank}: {_REFUSED} {limit_text}")


def _group(run_id: str, rank: int) -> Path:
    """The rank's group, a child of the calling process's memory group: the driver and the
    workers it starts on this machine begin in the same one."""
    own = ""
    with open("/proc/self/cgroup") as groups:
        for line in groups:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            if "memory" in controllers.split(","):
                own = path.lstrip("/")
    if Path(own).name.startswith(PREFIX):  # already confined: a sibling, not a child
        own = str(Path(own).parent)
    return CGROUP_MEMORY / own / f"{PREFIX}{run_id}-rank{rank}"


# Modules every run under a limit imports sooner or later: loaded before the limit applies, so
# that it measures the model's memory rather than Python code (~50 MB).
PRELOADED = (
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.distributed.checkpoint",
    "torch.distributed.checkpoint.state_dict",
)
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
MMAP_THRESHOLD_BYTES = 1 << 20


def return_freed_memory(threshold_bytes: int = MMAP_THRESHOLD_BYTES) -> None:
    """Make glibc give freed tensors back to the OS. Its mmap threshold rises as large blocks
    are freed (up to 32 MiB), after which a freed tensor stays in the heap, counted against
    the process: measured on 4 fsdp ranks of a 34M-parameter MLP, a rank's RSS grew 0.8 GB in
    two steps where its training state is 0.13 GB (0.24 GB with this). A fixed threshold
    keeps every block over `threshold_bytes` mmapped, and so released on free. Blocks already
    freed into the heap would still be reused before any mmap: `malloc_trim` hands their pages
    back now (without it, efficiency.activation_bytes saw 9.6 of an MLP's 16 MiB)."""
    import ctypes

    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(M_MMAP_THRESHOLD, threshold_bytes)
        libc.malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: its allocator has its own rules
        pass


def confine(limit_bytes: int, run_id: str, rank: int) -> Confinement:
    """Put this process under `limit_bytes` more memory than it holds now."""
    import importlib

    for module in PRELOADED:
        importlib.import_module(module)
    return_freed_memory()
    group = _group(run_id, rank)
    try:
        group.mkdir(exist_ok=True)  # a restarted worker group reuses its rank's group
        (group / "memory.limit_in_bytes").write_text(str(limit_bytes))
        swap = group / "memory.memsw.limit_in_bytes"  # present where swap is accounted
        if swap.exists():
            swap.write_text(str(limit_bytes))
        (group / "cgroup.procs").write_text(str(os.getpid()))
        return Confinement("cgroup", limit_bytes, str(group))
    except OSError:
        data = _data_size()
        resource.setrlimit(resource.RLIMIT_DATA, (data + limit_bytes, data + limit_bytes))
        return Confinement("rlimit", limit_bytes, f"RLIMIT_DATA={data + limit_bytes}")


def wall_advice(cfg) -> str:
    """What the configured model needs per rank, and the way past the limit (for the error a
    run that hit it raises)."""
    import torch

    from relay.tasks import build_task

    with torch.device("meta"):  # sizes only: nothing allocated
        model = build_task(cfg.task, cfg.size, cfg.model, cfg.data.path).build_model()
    parameters = sum(p.numel() for p in model.parameters())
    state = 16 * parameters  # fp32 weights + gradients + Adam's two moments
    held = {
        "ddp": "every rank holds the whole model",
        "zero1": "every rank holds the whole model and its gradients",
        "fsdp": f"fsdp holds 1/{cfg.scaling.max_workers} of the model per rank",
    }[cfg.parallel.strategy]
    return (
        f"{held} ({parameters / 1e6:.1f}M parameters: ~{state / 2**20:,.0f} MiB of fp32 weights, "
        "gradients and Adam state in all) — the memory wall. parallel.strategy: fsdp with more "
        "workers shards all three; `relay plan CONFIG --workers N` predicts the bytes per rank"
    )


def _data_size() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024
    raise OSError("no VmData in /proc/self/status")


def ranks_out_of_memory(run_id: str, ranks: int, error: BaseException) -> list[int]:
    """The ranks that hit their limit in the failure `error` of run `run_id`: ended by the OOM
    killer (cgroup), or refused an allocation and said so (RLIMIT_DATA: the loop's
    OutOfMemory, whose text the worker failure carries)."""
    said = {int(rank) for rank in re.findall(rf"rank (\d+): {_REFUSED}", str(error))}
    return ranks_killed(run_id, ranks) or sorted(said)


def ranks_killed(run_id: str, ranks: int) -> list[int]:
    """The ranks whose group saw the OOM killer end a process (cgroup only)."""
    killed = []
    for rank in range(ranks):
        try:
            control = (_group(run_id, rank) / "memory.oom_control").read_text()
        except OSError:
            continue
        counters = dict(line.split() for line in control.splitlines() if len(line.split()) == 2)
        if int(counters.get("oom_kill", 0)) > 0:
            killed.append(rank)
    return killed


def release(run_id: str, ranks: int, wait_s: float = 10.0) -> None:
    """Remove this run's groups once their processes are gone (Ray ends a worker group's
    processes shortly after `fit()` returns); a group still in use after `wait_s` stays."""
    groups = [_group(run_id, rank) for rank in range(ranks)]
    deadline = time.monotonic() + wait_s
    while groups:
        for group in list(groups):
            try:
                group.rmdir()
            except FileNotFoundError:
                pass
            except OSError:  # busy: a process is still in it
                continue
            groups.remove(group)
        if not groups or time.monotonic() > deadline:
            return
        time.sleep(0.2)
