"""Everything distributed, in one place: who am I, where do tensors live, how is the model
wrapped, and how do numbers from all ranks combine.

The loop calls these and never branches on ranks or backends itself. Ray Train has already
set up the process group (gloo on CPU, NCCL on GPU) by the time the loop runs; rank and world
come from `ray.train.get_context()`, never from environment variables.
"""

from __future__ import annotations

import hashlib

import ray.train
import ray.train.torch
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def rank() -> int:
    return ray.train.get_context().get_world_rank()


def world_size() -> int:
    return ray.train.get_context().get_world_size()


def is_main() -> bool:
    return rank() == 0


def device() -> torch.device:
    return ray.train.torch.get_device()


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def set_threads(threads: int | None, reserved_cpus: float) -> None:
    """One intra-op thread per reserved CPU unless told otherwise: torch's default (all cores)
    oversubscribes a machine that several workers share."""
    torch.set_num_threads(threads or max(1, int(reserved_cpus)))


def wrap_model(model: nn.Module) -> nn.Module:
    """Move to this worker's device and wrap for data parallelism (DDP when world > 1).

    DDP broadcasts rank 0's parameters on construction, so every replica starts identical.
    """
    return ray.train.torch.prepare_model(model)


def unwrap(model: nn.Module) -> nn.Module:
    """The plain module inside whatever wrapper parallel.py put around it."""
    return model.module if isinstance(model, DistributedDataParallel) else model


def sum_across_ranks(values: dict[str, torch.Tensor]) -> dict[str, float]:
    """Sum each named scalar over all ranks (one collective for the whole dict)."""
    names = sorted(values)
    packed = torch.stack([values[n].detach().double().cpu() for n in names])
    if _distributed():
        packed = packed.to(device())
        dist.all_reduce(packed, op=dist.ReduceOp.SUM)
    return dict(zip(names, packed.cpu().tolist(), strict=True))


def gather_objects(obj: object) -> list[object]:
    """Every rank's `obj`, in rank order (a collective: all ranks must call it)."""
    if not _distributed():
        return [obj]
    out: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def state_digest(model: nn.Module) -> str:
    """A hash of the model's parameters and buffers: equal on every rank iff replicas agree."""
    h = hashlib.sha256()
    for name, tensor in sorted(unwrap(model).state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]
