"""Who this process is among the ranks, where its tensors live, and the collectives that
combine numbers and objects from all ranks.

Whoever launched the process has set up the process group (gloo on CPU, NCCL on GPU) — Ray
Train, with world rank = process-group rank, or torchrun — and names this process's device once
with `set_device`; rank and world come from `torch.distributed` (0 and 1 when there is no
process group), never from environment variables.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if _initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if _initialized() else 1


def is_main() -> bool:
    return rank() == 0


def distributed() -> bool:
    """More than one rank: there is something to synchronise or shard."""
    return _initialized() and dist.get_world_size() > 1


_device = torch.device("cpu")


def set_device(target: torch.device | str) -> None:
    """Name this process's device (the launcher knows it: Ray Train's `get_device()`, or
    cuda:LOCAL_RANK under torchrun); until then it is the CPU."""
    global _device
    _device = torch.device(target)
    if _device.type == "cuda":
        torch.cuda.set_device(_device)  # the current device for NCCL and for new tensors


def device() -> torch.device:
    return _device


def set_threads(threads: int | None, reserved_cpus: float) -> None:
    """One intra-op thread per reserved CPU unless told otherwise: torch's default (all cores)
    oversubscribes a machine that several workers share."""
    torch.set_num_threads(threads or max(1, int(reserved_cpus)))


def cpu_setup() -> dict[str, object]:
    """What this process computes with on a CPU: torch's intra- and inter-op threads, the
    OMP_NUM_THREADS it was started with, the cores it may run on and its niceness. Recorded
    per rank (and by the torchrun baseline the same way), so that two runs compared side by
    side can be seen to have run alike, or not."""
    try:
        affinity = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        affinity = None
    return {
        "threads": torch.get_num_threads(),
        "interop_threads": torch.get_num_interop_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "affinity": affinity,
        "nice": os.getpriority(os.PRIO_PROCESS, 0),
    }


def barrier() -> None:
    if distributed():
        dist.barrier()


def synchronize() -> None:
    """Wait for queued device work, so a host clock measures what the device did."""
    if torch.cuda.is_available() and device().type == "cuda":
        torch.cuda.synchronize(device())


def sum_across_ranks(values: dict[str, torch.Tensor]) -> dict[str, float]:
    """Sum each named scalar over all ranks (one collective for the whole dict)."""
    names = sorted(values)
    packed = torch.stack([values[n].detach().double().cpu() for n in names])
    if distributed():
        packed = packed.to(device())
        dist.all_reduce(packed, op=dist.ReduceOp.SUM)
    return dict(zip(names, packed.cpu().tolist(), strict=True))


def gather_objects(obj: object) -> list[object]:
    """Every rank's `obj`, in rank order (a collective: all ranks must call it)."""
    if not distributed():
        return [obj]
    out: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out
