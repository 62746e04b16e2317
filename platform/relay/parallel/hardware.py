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


def reset_peak() -> None:
    """Count this rank's peak afresh from here (`peak_since_reset`): the CUDA allocator's peak
    on GPU; on CPU the kernel's high-water mark of the resident set (VmHWM), reset through
    /proc/self/clear_refs (Linux 4.0 on). Where that cannot be written the mark stays the
    process's own: an upper bound."""
    if device().type == "cuda":
        torch.cuda.reset_peak_memory_stats(device())
        return
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")  # 5: reset the peak resident set size
    except OSError:
        pass


def peak_since_reset() -> int:
    """The most memory this rank held since `reset_peak` (see there)."""
    if device().type == "cuda":
        return torch.cuda.max_memory_allocated(device())
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # kB
    return peak_memory()["bytes"]
