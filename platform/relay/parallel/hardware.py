"""What this rank's device holds: memory now and at its peak."""

from __future__ import annotations

import resource
from typing import Any

import torch

from relay.parallel.ranks import device


def current_memory() -> int:
    """Memory this rank holds now: allocated on GPU, the process's resident set on CPU."""
    if device().type == "cuda":
        return torch.cuda.memory_allocated(device())
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


def peak_memory() -> dict[str, Any]:
    """Peak memory of this rank: the allocator's peak on GPU, the process's peak RSS on CPU."""
    if device().type == "cuda":
        return {"bytes": torch.cuda.max_memory_allocated(device()), "kind": "cuda_allocated"}
    # ru_maxrss is in KiB on Linux.
    return {
        "bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "kind": "process_peak_rss",
    }
