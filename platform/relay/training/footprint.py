"""The bytes a rank's training state really occupies: parameters, gradients, optimizer state.

Measured, not computed from shapes: every live tensor is followed to the storage that holds it,
and each storage is counted once, whole. So what a strategy really allocates shows:

  * FSDP2: a parameter is a DTensor whose local shard is a view into a flat buffer padded to a
    multiple of the world size; a unit's gradients are views into one reduce-scatter output.
    The padded buffers are counted, not the shards' shapes.
  * DDP with `gradient_as_bucket_view`: gradients are views into the communication buckets;
    the buckets are counted (once each), not one tensor per gradient.
  * ZeroRedundancyOptimizer: the state of the inner optimizer over this rank's partition.
  * tied weights and any storage met twice count once, in the first category that meets it
    (parameters, then gradients, then optimizer state).

Not counted: activations, temporaries, FSDP's all-gather buffers while parameters are gathered,
the model's buffers (e.g. running statistics), and the process itself. Torch only: no Ray.

    footprint.state_bytes(engine.model, engine.optimizer)
    # {"param_bytes": ..., "grad_bytes": ..., "optimizer_bytes": ..., "state_bytes": ...}
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of `tensor`: a DTensor's local shard, any other tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def inner_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer that holds the state: ZeroRedundancyOptimizer's `.optim` over this rank's
    partition, any other optimizer itself. torch.distributed.optim is not imported for this
    (0.7-1.7 s, which zero1 alone pays: relay/parallel/zero1.py): where nothing imported it,
    no optimizer can be a ZeroRedundancyOptimizer."""
    zero = sys.modules.get("torch.distributed.optim")
    if zero is not None and isinstance(optimizer, zero.ZeroRedundancyOptimizer):
        return optimizer.optim
    return optimizer


def _tensors(tree: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a nested dict/list/tuple (optimizer state may nest)."""
    if torch.is_tensor(tree):
        yield tree
    elif isinstance(tree, dict):
        for value in tree.values():
            yield from _tensors(value)
    elif isinstance(tree, list | tuple):
        for value in tree:
            yield from _tensors(value)


class _Storages:
    """Counts storages once each, by (device, address)."""

    def __init__(self) -> None:
        self._seen: set[tuple[str, int]] = set()

    def bytes(self, tensors: Iterable[torch.Tensor]) -> int:
        total = 0
        for tensor in tensors:
            storage = local(tensor).untyped_storage()
            size = storage.nbytes()
            if size == 0:  # freed (FSDP resizes unsharded storage to 0) or empty
                continue
            key = (str(storage.device), storage.data_ptr())
            if key in self._seen:
                continue
            self._seen.add(key)
            total += size
        return total


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of the storages this rank's parameters, gradients and optimizer state occupy
    (gradients as the last backward left them: measure before `zero_grad`)."""
    params = list(model.parameters())
    storages = _Storages()
    param_bytes = storages.bytes(params)
    grad_bytes = storages.bytes(p.grad for p in params if p.grad is not None)
    optimizer_bytes = storages.bytes(_tensors(list(inner_optimizer(optimizer).state.values())))
    return {
        "param_bytes": param_bytes,
        "grad_bytes": grad_bytes,
        "optimizer_bytes": optimizer_bytes,
        "state_bytes": param_bytes + grad_bytes + optimizer_bytes,
    }
